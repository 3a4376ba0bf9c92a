"""data.tokenizer = hf:PATH (issue 44): a model's own tokenizer.json, used as it is from prepare to export."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from dilocox.config import ConfigError, load_config
from dilocox.data import prepare

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [
    "def f(x):\n    return x + 1\n",
    "The quick brown fox jumps over the lazy dog. " * 20,
    "import os\nprint(os.getcwd())\n",
] * 30


def _gpt2_style_tokenizer(path: str, eos: str = "<|endoftext|>", vocab: int = 300) -> None:
    """A byte-level BPE in GPT-2's format (its pre-tokenizer, decoder and special token), made here with the
    ``tokenizers`` library, not with dilocox: a stand-in for a downloaded model's tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=[eos], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["some other text, not the corpus " * 50, "x = [i * 2 for i in range(9)]"], trainer)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tok.save(path)


def _corpus(tmp_path) -> str:
    d = tmp_path / "corpus"
    d.mkdir()
    for i, doc in enumerate(DOCS):
        (d / f"{i:03d}.txt").write_text(doc)
    return str(d)


def _cfg(tmp_path, tok: str, *extra: str):
    return load_config(
        os.path.join(ROOT, "configs", "tiny.yaml"),
        [
            "--data.source=text",
            f"--data.path={_corpus(tmp_path) if not (tmp_path / 'corpus').exists() else tmp_path / 'corpus'}",
            f"--data.tokenizer={tok}",
            f"--data.cache_dir={tmp_path / 'cache'}",
            "--model.vocab_size=320",
            *extra,
        ],
    )


def test_prepare_keeps_the_pretrained_tokenizer(tmp_path):
    from tokenizers import Tokenizer

    src = tmp_path / "gpt2" / "tokenizer.json"
    _gpt2_style_tokenizer(str(src))
    p = prepare(_cfg(tmp_path, f"hf:{src.parent}").data)  # a model directory holding tokenizer.json
    ref = Tokenizer.from_file(str(src))
    assert p.vocab_size == ref.get_vocab_size() and p.meta["tokenizer"] == "bpe"
    with open(os.path.join(p.dir, "tokenizer.json")) as f, open(src) as g:
        assert json.load(f) == json.load(g)  # the file itself, not a retrained one
    eot = ref.token_to_id("<|endoftext|>")
    tokens = np.concatenate([np.asarray(p.train_tokens()), np.asarray(p.val_tokens())])
    first = ref.encode(DOCS[0], add_special_tokens=False).ids
    assert eot in tokens.tolist() and len(tokens) > len(first)
    docs = [d for d in np.split(tokens, np.where(tokens == eot)[0] + 1) if len(d)]
    assert any(list(d[:-1]) == first for d in docs)  # documents encoded by that tokenizer, each ended by its EOT
    # another file behind the same path is other data: a new key, prepared again
    _gpt2_style_tokenizer(str(src), vocab=280)
    q = prepare(_cfg(tmp_path, f"hf:{src}").data)
    assert q.dir != p.dir and q.vocab_size == Tokenizer.from_file(str(src)).get_vocab_size() != p.vocab_size


def test_a_tokenizer_without_eot_or_file_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.tokenizer='hf:"):
        prepare(_cfg(tmp_path, f"hf:{tmp_path / 'nowhere'}").data)
    src = tmp_path / "llama" / "tokenizer.json"
    _gpt2_style_tokenizer(str(src), eos="</s>")  # another end-of-document token is found
    from tokenizers import Tokenizer

    p = prepare(_cfg(tmp_path, f"hf:{src}").data)
    assert p.vocab_size == Tokenizer.from_file(str(src)).get_vocab_size()
    assert p.tokenizer().eot_id == Tokenizer.from_file(str(src)).token_to_id("</s>")
    with pytest.raises(ConfigError, match="data.tokenizer"):
        _cfg(tmp_path, "gpt2")


def test_train_export_and_transformers_reads_it_back(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    from dilocox.export import export_run
    from dilocox.train import train

    src = tmp_path / "gpt2" / "tokenizer.json"
    _gpt2_style_tokenizer(str(src))
    run = tmp_path / "run"
    cfg = _cfg(
        tmp_path,
        f"hf:{src}",
        f"--log.run_dir={run}",
        "--train.steps=2",
        "--train.batch_size=2",
        "--train.seq_len=32",
        "--train.eval_every=0",
        "--train.eval_batches=1",
        "--log.tensorboard=false",
        "--log.progress=false",
        "--model.n_layers=2",
        "--model.d_model=64",
    )
    train(cfg)
    out = tmp_path / "hf"
    export_run(str(run), str(out))
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    from tokenizers import Tokenizer

    text = "def f(x): return the quick fox"
    assert tok(text)["input_ids"] == Tokenizer.from_file(str(src)).encode(text, add_special_tokens=False).ids
    assert tok.eos_token == "<|endoftext|>"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    ids = torch.tensor([tok(text)["input_ids"]])
    gen = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.eos_token_id)
    assert gen.shape[1] == ids.shape[1] + 4 and isinstance(tok.decode(gen[0]), str)
