"""Data: corpus sources, tokenizers, memmap token files and resumable samplers.

sources.py    stdlib (embedded default) | text | hf corpora -> documents; train/val split
tokenizer.py  ByteTokenizer, byte-level BPE trained on the corpus (cached JSON)
prepare.py    documents -> train.bin / val.bin / meta.json (cached, atomic, race-free)
sampler.py    TokenSampler (pure function of seed, replica, step), val_batches, entropy
check.py      check_data(cfg): prepare and check the corpus fits the run (one-line DataError)
"""

from dilocox.data.check import check_data
from dilocox.data.prepare import (
    PreparedData,
    data_key,
    default_out_dir,
    load_prepared,
    prepare,
    prepare_main,
)
from dilocox.data.sampler import TokenSampler, unigram_entropy, val_batches
from dilocox.data.sources import (
    Corpus,
    DataError,
    read_corpus,
    split_documents,
    stdlib_files,
)
from dilocox.data.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    load_or_train_bpe,
    load_tokenizer,
    train_bpe,
)

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "Corpus",
    "DataError",
    "PreparedData",
    "TokenSampler",
    "check_data",
    "data_key",
    "default_out_dir",
    "load_or_train_bpe",
    "load_prepared",
    "load_tokenizer",
    "prepare",
    "prepare_main",
    "read_corpus",
    "split_documents",
    "stdlib_files",
    "train_bpe",
    "unigram_entropy",
    "val_batches",
]
