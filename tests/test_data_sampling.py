"""``data.sampler`` (random | epoch) as the trainer uses it, what a resume checks of the sampler, and a special
token's text inside a document (from a review of the data pipeline, 2026-12-03)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from dilocox.config import ConfigError, load_config
from dilocox.config.checks import _CHOICES
from dilocox.data import TokenSampler, prepare
from dilocox.data.sampler import MODES
from tests.spawn import run_ranks
from tests.test_train import ROOT, _assert_resume_exact, _train_and_resume, tiny_cfg


def test_the_config_choices_are_the_samplers_modes_and_a_bad_one_is_named():
    assert tuple(_CHOICES["data.sampler"]) == MODES
    with pytest.raises(ConfigError, match="data.sampler"):
        load_config(os.path.join(ROOT, "configs", "tiny.yaml"), ["--data.sampler=shuffle"])


def _windows_of_each_replica(rank, world, tmp, mode):
    from dilocox.train import Trainer

    tr = Trainer(tiny_cfg(tmp, "--parallel.replicas=2", "--outer.method=diloco", f"--data.sampler={mode}", steps=4))
    s = tr.sampler
    steps = s.steps_per_epoch if mode == "epoch" else 40
    return s.mode, tr.topo.replica, np.concatenate([s.starts(k) for k in range(steps)]).tolist()


@pytest.mark.parametrize("mode", ["epoch", "random"])
def test_with_data_sampler_epoch_two_replicas_of_a_run_read_no_window_twice_in_an_epoch(tmp_path, mode):
    """The trainer built every sampler in random mode whatever the docs said of shards: the replicas' windows
    overlapped by chance (38 % of one replica's tokens in the review's case). Now ``data.sampler=epoch`` reaches
    the trainer, and random mode (the control) is what it says: independent draws that do overlap."""
    out = sorted(run_ranks(2, _windows_of_each_replica, str(tmp_path), mode), key=lambda r: r[1])
    assert [m for m, _, _ in out] == [mode, mode] and [r for _, r, _ in out] == [0, 1]
    a, b = np.array(out[0][2]), np.array(out[1][2])
    # pairs of windows (64 inputs each, train.seq_len) that share a token: one of a and one of b, or two of a
    across = int((np.abs(a[:, None] - b[None, :]) < 64).sum())
    within = int((np.abs(a[:, None] - a[None, :]) < 64).sum()) - len(a)
    if mode == "epoch":
        assert across == 0 and within == 0
        assert len(a) + len(b) >= 0.9 * (400_000 * 0.98 // 64)  # (nearly every window of the split, once)
    else:
        assert across > 0  # i.i.d. draws over the same split: windows of the two replicas overlap


def test_an_epoch_mode_run_resumes_exactly(tmp_path):
    _assert_resume_exact(run_ranks(1, _train_and_resume, str(tmp_path), ["--data.sampler=epoch"], 8, 5))


def test_an_epoch_mode_resume_refuses_another_mapping_of_steps_to_windows():
    toks = np.arange(5000, dtype=np.uint16)
    state = TokenSampler(toks, 10, 4, seed=1, replica=0, n_replicas=3, mode="epoch").state_dict()
    for kw, key in (({"n_replicas": 2}, "n_replicas"), ({"batch_size": 8}, "batch_size")):
        args = {"seq_len": 10, "batch_size": 4, "n_replicas": 3, **kw}
        s = TokenSampler(toks, args["seq_len"], args["batch_size"], seed=1, n_replicas=args["n_replicas"], mode="epoch")
        with pytest.raises(ConfigError, match=f"data.sampler=epoch.*{key}=") as e:
            s.load_state_dict(state)
        assert "fresh --log.run_dir" in str(e.value)
    seq = TokenSampler(toks, 20, 4, seed=1, n_replicas=3, mode="epoch")
    with pytest.raises(ConfigError, match="seq_len"):
        seq.load_state_dict({**state, "n_tokens": 5000})
    same = TokenSampler(toks, 10, 4, seed=1, replica=2, n_replicas=3, mode="epoch")
    same.load_state_dict({**state, "step": 7})  # the control: the same mapping resumes
    assert same.step == 7
    # random mode: a batch does not depend on n_replicas, so it is not refused here (parallel.replicas is, upstream)
    rnd = TokenSampler(toks, 10, 4, seed=1, n_replicas=3).state_dict()
    TokenSampler(toks, 10, 4, seed=1, n_replicas=2).load_state_dict(rnd)


def test_a_resume_refuses_the_same_text_under_another_tokenizer():
    """The sampler checked the text's hash and the token count: a tokenizer file changed at the same path (two ids
    swapped) gave other tokens under every check."""
    toks = np.arange(5000, dtype=np.uint16)
    state = TokenSampler(toks, 10, 4, seed=1, content="c" * 64, tokenizer="a" * 64).state_dict()
    with pytest.raises(ConfigError, match="tokenizer_sha256"):
        TokenSampler(toks, 10, 4, seed=1, content="c" * 64, tokenizer="b" * 64).load_state_dict(state)
    TokenSampler(toks, 10, 4, seed=1, content="c" * 64, tokenizer="a" * 64).load_state_dict(state)
    old = {k: v for k, v in state.items() if k != "tokenizer_sha256"}  # a checkpoint saved before the check
    TokenSampler(toks, 10, 4, seed=1, content="c" * 64, tokenizer="b" * 64).load_state_dict(old)


def _bpe_corpus(tmp_path, text: str) -> str:
    d = tmp_path / "corpus"
    d.mkdir(exist_ok=True)
    for i in range(30):
        (d / f"f{i:02d}.txt").write_text(f"doc {i}: {text}\n" + "the quick brown fox jumps over it\n" * 20)
    return str(d)


def _data_cfg(tmp_path, path: str, tokenizer: str = "bpe"):
    cfg = load_config(
        os.path.join(ROOT, "configs", "tiny.yaml"),
        ["--data.source=text", f"--data.path={path}", f"--data.tokenizer={tokenizer}", "--data.bpe_vocab_size=300",
         "--model.vocab_size=300", f"--data.cache_dir={tmp_path}/cache", "--data.val_fraction=0.1"],
    )  # fmt: skip
    return cfg.data


def test_a_special_tokens_text_inside_a_document_is_text_not_the_end_of_the_document(tmp_path):
    """``tokenizers`` matched "<|endoftext|>" inside a document as the end-of-document token: each such document was
    cut in two and the model never saw the string."""
    p = prepare(_data_cfg(tmp_path, _bpe_corpus(tmp_path, "print('<|endoftext|>')")))
    tok = p.tokenizer()
    ids = np.concatenate([p.train_tokens(), p.val_tokens()])
    assert int((ids == tok.eot_id).sum()) == p.meta["train_docs"] + p.meta["val_docs"] == 30  # one per document
    first = ids[: int(np.flatnonzero(ids == tok.eot_id)[0])]
    assert tok.decode(first.tolist()).startswith("doc 0: print('<|endoftext|>')")
    assert tok.tok.encode_special_tokens is False  # (the tokenizer's setting is given back)
    assert tok.encode("<|endoftext|>") == [tok.eot_id]  # (a prompt's text still names the token, as before)


def test_the_prepared_datas_identity_names_its_tokenizer(tmp_path):
    """The tokenizer's hash is in meta.json and in what the trainer hands the sampler; a directory prepared before
    it was recorded gets it from its tokenizer file."""
    corpus = _bpe_corpus(tmp_path, "x")
    p = prepare(_data_cfg(tmp_path, corpus))
    ident = p.sampler_args()
    assert ident["content"] == p.meta["content_sha256"] and len(ident["tokenizer"]) == 64
    assert ident["vocab_size"] == p.vocab_size == 300
    assert ident["tokenizer"] == p.meta["tokenizer_sha256"]
    meta_path = os.path.join(p.dir, "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    del meta["tokenizer_sha256"]
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    assert prepare(_data_cfg(tmp_path, corpus)).sampler_args() == ident  # (computed from tokenizer.json)
    byte = prepare(_data_cfg(tmp_path, corpus, tokenizer="byte")).sampler_args()
    assert byte["tokenizer"] != ident["tokenizer"] and byte["content"] == ident["content"]


def test_swarm_refuses_data_sampler_epoch():
    from dilocox.swarm.cli import SwarmUsageError, refuse_unsupported

    with pytest.raises(SwarmUsageError, match="data.sampler"):
        refuse_unsupported(load_config(os.path.join(ROOT, "configs", "tiny.yaml"), ["--data.sampler=epoch"]))
    refuse_unsupported(load_config(os.path.join(ROOT, "configs", "tiny.yaml"), []))


def test_the_byte_tokenizer_drops_a_nul_inside_a_document_which_would_read_as_its_end():
    """A JSON row's "\\u0000" (data.source=hf) reached the byte tokenizer, whose end-of-document id is 0: the row was
    cut in two. (A text file with a NUL is left out whole: tests/test_data_sources_whole.py.)"""
    from dilocox.data import ByteTokenizer

    ids = ByteTokenizer().encode_docs(["ab\x00c", "d"])
    assert ids.tolist() == [97, 98, 99, 0, 100, 0]


def test_eval_of_an_export_tokenizes_a_document_as_training_did(tmp_path):
    """(From a review of this change: ``dilocox eval HF_DIR --text`` encoded through the export's tokenizer.json,
    which still matched "<|endoftext|>" as the token: the same model and text scored otherwise than ``eval RUN``.)"""
    from dilocox.evaluate import encode_docs
    from dilocox.generate import _HFTokenizer

    p = prepare(_data_cfg(tmp_path, _bpe_corpus(tmp_path, "x")))
    docs = ["s = '<|endoftext|>'\n", "second"]
    run = encode_docs(p.tokenizer(), docs)
    hf = encode_docs(_HFTokenizer(os.path.join(p.dir, "tokenizer.json")), docs)
    assert run.tolist() == hf.tolist() and int((run == p.tokenizer().eot_id).sum()) == 2
