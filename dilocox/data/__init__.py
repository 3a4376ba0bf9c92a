"""Data: corpus sources, tokenizers, memmap token files and resumable samplers.

    sources.py    stdlib (embedded default) | text | hf corpora -> documents; train/val split
    tokenizer.py  ByteTokenizer, byte-level BPE trained on the corpus (cached JSON)
    prepare.py    documents -> train.bin / val.bin / meta.json (cached, atomic, race-free)
    sampler.py    TokenSampler (pure function of seed, replica, step), val_batches, entropy
    build.py      build_data(cfg, replica, dp_rank) for the training loop
"""

from dilocox.data.build import DataBundle, build_data
from dilocox.data.prepare import PreparedData, data_key, default_out_dir, load_prepared, prepare, prepare_main
from dilocox.data.sampler import TokenSampler, mix_seed, unigram_entropy, val_batches
from dilocox.data.sources import Corpus, read_corpus, split_documents, stdlib_files
from dilocox.data.tokenizer import BPETokenizer, ByteTokenizer, load_or_train_bpe, load_tokenizer, train_bpe

__all__ = [
    "BPETokenizer", "ByteTokenizer", "Corpus", "DataBundle", "PreparedData", "TokenSampler", "build_data",
    "data_key", "default_out_dir", "load_or_train_bpe", "load_prepared", "load_tokenizer", "mix_seed",
    "prepare", "prepare_main", "read_corpus", "split_documents", "stdlib_files", "train_bpe",
    "unigram_entropy", "val_batches",
]
