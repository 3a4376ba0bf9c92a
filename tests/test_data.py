"""Data layer: sources, tokenizers, prepared memmaps, samplers (fast: small corpora)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch

import dilocox.data.tokenizer as tokmod
from dilocox.config import ConfigError, DataConfig, load_config
from dilocox.data import (
    ByteTokenizer,
    DataError,
    TokenSampler,
    check_data,
    load_or_train_bpe,
    prepare,
    prepare_main,
    read_corpus,
    split_documents,
    stdlib_files,
    unigram_entropy,
    val_batches,
)
from tests.spawn import run_ranks

SMALL = 300_000
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(tmp_path, **kw) -> DataConfig:
    return DataConfig(cache_dir=str(tmp_path / "cache"), max_bytes=kw.pop("max_bytes", SMALL), **kw)


def _expected_stdlib_docs(max_bytes: int) -> list[bytes]:
    """Independent re-reading of the stdlib corpus: sorted walk, capped, empty files dropped."""
    out, total = [], 0
    for f in stdlib_files():
        with open(f, "rb") as fh:
            raw = fh.read()[: max_bytes - total]
        total += len(raw)
        if raw:
            out.append(raw)
        if total >= max_bytes:
            break
    return out


# --------------------------------------------------------------------------- sources


def test_stdlib_corpus_found_and_deterministic(tmp_path):
    files = stdlib_files()
    assert files and all(f.endswith(".py") for f in files)
    assert not any(f"{os.sep}site-packages{os.sep}" in f or f"{os.sep}test{os.sep}" in f for f in files)
    assert files == stdlib_files()
    a, b = read_corpus(_cfg(tmp_path)), read_corpus(_cfg(tmp_path))
    assert a.docs == b.docs
    assert sum(len(d.encode()) for d in a.docs) == SMALL  # capped exactly at max_bytes
    want = _expected_stdlib_docs(SMALL)
    assert len(a.docs) == len(want)
    assert [d.encode() for d in a.docs[:-1]] == want[:-1]  # last one may be cut mid-character


def test_prose_corpus_is_pydoc_topics_in_name_order(tmp_path):
    """data.source=prose: the second corpus of the frontier benchmark, shipped with the interpreter."""
    import pydoc_data.topics as t

    cfg = _cfg(tmp_path, source="prose", max_bytes=None)
    c = read_corpus(cfg)
    assert c.docs == [t.topics[k] for k in sorted(t.topics)] and sum(map(len, c.docs)) > 400_000
    p = prepare(cfg)
    text = p.train_tokens().astype(np.uint8).tobytes() + p.val_tokens().astype(np.uint8).tobytes()
    assert text.replace(b"\0", b"") == "".join(c.docs).encode("utf-8")
    assert prepare(cfg).cache_hit


def test_docs_corpus_is_the_topics_then_each_modules_docstrings(tmp_path):
    """data.source=docs: prose's topics, then per stdlib module its docstrings (re-read here for the first module
    that has any); a cap keeps a prefix of the same documents and says so (read as a stream: the cap stops it)."""
    import ast
    import pydoc_data.topics as t

    from dilocox.data.sources import _docstring_raws

    c = read_corpus(_cfg(tmp_path, source="docs", max_bytes=600_000))
    topics = [t.topics[k] for k in sorted(t.topics)]
    assert c.docs[: len(topics)] == topics and "docstrings" in c.description
    assert c.cut["kept_bytes"] == 600_000 and len(c.docs) > len(topics)
    first = next(f for f in stdlib_files() if next(_docstring_raws([f]), None))
    mod_doc = ast.get_docstring(ast.parse(open(first, encoding="utf-8").read()))
    assert c.docs[len(topics)].startswith(mod_doc or "")


def test_docs_corpus_is_several_times_prose(tmp_path):
    import pydoc_data.topics as t

    c = read_corpus(_cfg(tmp_path, source="docs", max_bytes=None))
    assert sum(map(len, c.docs)) > 3 * sum(map(len, t.topics.values()))


def test_split_is_document_level_suffix():
    docs = [f"doc{i} " * (i + 1) for i in range(50)]
    train, val = split_documents(docs, 0.1)
    assert train + val == docs and train and val
    nbytes = [len(d) for d in docs]
    val_share = sum(nbytes[len(train) :]) / sum(nbytes)
    assert 0.1 <= val_share <= 0.1 + max(nbytes) / sum(nbytes)
    one_train, one_val = split_documents(["line\n" * 1000], 0.05)  # one file: cut at a line end
    assert one_train == ["line\n" * 950] and one_val == ["line\n" * 50]
    big = ["a\n" * 100, "b\n" * 100, "c\n" * 2000]  # the last document alone is 83% of the bytes
    train, val = split_documents(big, 0.1)
    assert train == big[:2] + ["c\n" * 1780] and val == ["c\n" * 220]  # 10% of 4400 bytes


# --------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_roundtrip():
    tok, text = ByteTokenizer(), "def f(x):\n    return 'héllo ✓ 日本'\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < tok.vocab_size == 256
    assert tok.decode(ids) == text
    assert tok.encode_docs(["ab", "c"]).tolist() == [97, 98, 0, 99, 0]


def test_bpe_trains_roundtrips_and_is_cached(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, tokenizer="bpe", bpe_vocab_size=512)
    p = prepare(cfg)
    tok = p.tokenizer()
    assert tok.vocab_size == 512 == p.vocab_size
    for text in (read_corpus(cfg).docs[-1], "x = 'héllo ✓ 日本'\n\tpass  # trailing  "):
        ids = tok.encode(text)
        assert tok.decode(ids) == text and max(ids) < 512
    doc = read_corpus(cfg).docs[0]
    assert len(tok.encode(doc)) < 0.6 * len(doc.encode())  # it learned merges
    # tokens on disk are exactly the tokenizer's encoding of the documents
    train = p.train_tokens()
    first = tok.encode(doc)
    assert train[: len(first)].tolist() == first and train[len(first)] == tok.eot_id

    cache_files = os.listdir(tmp_path / "cache" / "tokenizers")
    assert len(cache_files) == 1
    cache = str(tmp_path / "cache" / "tokenizers" / cache_files[0])
    mtime = os.stat(cache).st_mtime_ns

    def boom(*a, **k):
        raise AssertionError("BPE retrained although a cached tokenizer exists")

    monkeypatch.setattr(tokmod, "train_bpe", boom)

    shutil.rmtree(p.dir)  # force a rebuild of the token files: the tokenizer must come from cache
    p2 = prepare(cfg)
    assert not p2.cache_hit and os.stat(cache).st_mtime_ns == mtime
    assert np.array_equal(p2.train_tokens(), train)
    assert load_or_train_bpe([], 512, cache).vocab_size == 512


# --------------------------------------------------------------------------- prepare


def test_prepare_byte_memmap_split_and_cache(tmp_path):
    cfg = _cfg(tmp_path, val_fraction=0.05)
    p = prepare(cfg)
    assert not p.cache_hit
    with open(os.path.join(p.dir, "meta.json")) as f:
        meta = json.load(f)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 256 and meta["tokenizer"] == "byte"
    train, val = p.train_tokens(), p.val_tokens()
    assert train.dtype == np.uint16 and len(train) == meta["train_tokens"] and len(val) == meta["val_tokens"]
    assert os.path.getsize(p.train_path) == 2 * len(train) and os.path.getsize(p.val_path) == 2 * len(val)
    # the token stream is the documents, each followed by EOT=0; validation is a suffix of it
    docs = _expected_stdlib_docs(SMALL)
    expected = b"\0".join(docs) + b"\0"
    tb, vb = train.astype(np.uint8).tobytes(), val.astype(np.uint8).tobytes()
    assert tb.endswith(b"\0") and expected.endswith(vb)
    at_boundary = tb + vb == expected  # document-level split
    assert at_boundary or tb[:-1] + vb == expected  # else one big document cut at a line end
    assert meta["train_docs"] + meta["val_docs"] == len(docs) + (0 if at_boundary else 1)
    assert tb.count(b"\0") == meta["train_docs"] and vb.count(b"\0") == meta["val_docs"] >= 1
    assert 0.025 <= len(vb) / len(expected) <= 0.1
    # second call: cache hit, nothing rewritten; a different split is a different directory
    mtime = os.stat(p.train_path).st_mtime_ns
    p2 = prepare(cfg)
    assert p2.cache_hit and p2.dir == p.dir and p2.meta == p.meta and os.stat(p.train_path).st_mtime_ns == mtime
    p3 = prepare(_cfg(tmp_path, val_fraction=0.1))
    assert p3.dir != p.dir and p3.meta["val_tokens"] > len(val)


def test_missing_paths_name_data_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data\.path='.*nope\.txt'"):
        prepare(_cfg(tmp_path, source="text", path=str(tmp_path / "nope.txt")))
    with pytest.raises(FileNotFoundError, match=r"data\.path='.*no_dir'"):
        prepare(_cfg(tmp_path, source="memmap", path=str(tmp_path / "no_dir")))


def test_text_source_and_memmap_reuse(tmp_path):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    texts = {"b.txt": "bravo " * 300, "a.txt": "alpha " * 300, "sub/c.md": "charlie " * 50}
    for name, t in texts.items():
        (d / name).write_text(t)
    (d / "blob.bin").write_bytes(b"\0\1\2binary")
    p = prepare(_cfg(tmp_path, source="text", path=str(d), val_fraction=0.1))
    stream = np.concatenate([p.train_tokens(), p.val_tokens()]).astype(np.uint8).tobytes()
    want = [texts["a.txt"], texts["b.txt"], texts["sub/c.md"]]  # sorted walk, binary skipped
    assert stream == b"\0".join(t.encode() for t in want) + b"\0"
    assert p.meta["val_docs"] == 1 and p.meta["val_tokens"] == len(texts["sub/c.md"]) + 1
    m = prepare(_cfg(tmp_path, source="memmap", path=p.dir))
    assert m.dir == p.dir and np.array_equal(m.train_tokens(), p.train_tokens())
    one = tmp_path / "one.txt"  # a single file is cut at a line end into train head / val tail
    one.write_text("".join(f"line {i}\n" for i in range(2000)))
    q = prepare(_cfg(tmp_path, source="text", path=str(one)))
    head, tail = ByteTokenizer().decode(q.train_tokens()), ByteTokenizer().decode(q.val_tokens())
    assert head.endswith("\n\0") and tail.startswith("line ") and head[:-1] + tail[:-1] == one.read_text()
    assert q.meta["train_docs"] == q.meta["val_docs"] == 1


def _prepare_rank(rank, world, cache_dir):
    p = prepare(DataConfig(cache_dir=cache_dir, max_bytes=100_000))
    return p.dir, p.cache_hit, p.meta["content_sha256"], p.train_tokens()[:64].tolist()


def test_concurrent_prepare_builds_once(tmp_path):
    res = run_ranks(2, _prepare_rank, str(tmp_path / "cache"))
    assert len({r[0] for r in res}) == 1 and len({r[2] for r in res}) == 1 and res[0][3] == res[1][3]
    assert sorted(r[1] for r in res) == [False, True]  # exactly one rank built it
    assert not [f for f in os.listdir(os.path.dirname(res[0][0])) if f.startswith(".tmp-")]


def test_prepare_main_prints_summary(tmp_path, capsys):
    assert prepare_main([f"--data.cache_dir={tmp_path}", "--data.max_bytes=50000"]) == 0
    out = capsys.readouterr().out
    assert "train.bin" in out and "val.bin" in out and "tokens/s" in out and "built" in out


# --------------------------------------------------------------------------- hf


def test_hf_missing_datasets_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # simulate the GPU image: not installed
    f = tmp_path / "x.jsonl"
    f.write_text('{"text": "hi"}\n')
    with pytest.raises(DataError, match=r"data.source='hf' needs the datasets package.*: pip install datasets$"):
        prepare(_cfg(tmp_path, source="hf", path=str(f)))


def test_hf_local_jsonl(tmp_path):
    pytest.importorskip("datasets", reason="the datasets package is not installed")
    rows = [f"document {i}: " + "word " * (10 + i) for i in range(20)]
    f = tmp_path / "tiny.jsonl"
    f.write_text("".join(json.dumps({"content": r, "id": i}) + "\n" for i, r in enumerate(rows)))
    p = prepare(_cfg(tmp_path, source="hf", path=str(f), hf_text_field="content", val_fraction=0.1))
    stream = np.concatenate([p.train_tokens(), p.val_tokens()]).astype(np.uint8).tobytes()
    assert stream == b"\0".join(r.encode() for r in rows) + b"\0"
    with pytest.raises(DataError, match="hf_text_field='text'"):
        prepare(_cfg(tmp_path, source="hf", path=str(f)))


# --------------------------------------------------------------------------- samplers


def _arange_tokens(n=5000):
    return np.arange(n, dtype=np.uint16)


def test_sampler_deterministic_shifted_and_replica_distinct():
    toks = _arange_tokens()
    a = TokenSampler(toks, seq_len=16, batch_size=4, seed=7, replica=0, n_replicas=2)
    b = TokenSampler(toks, seq_len=16, batch_size=4, seed=7, replica=0, n_replicas=2)
    x, y = a.batch_at(5)
    assert x.dtype == torch.long and x.shape == (4, 16) == y.shape
    assert torch.equal(x, b.batch_at(5)[0]) and torch.equal(y, b.batch_at(5)[1])
    assert torch.equal(y, x + 1)  # y is x shifted by one (tokens are 0..n-1)
    assert torch.equal(x[:, 1:], y[:, :-1])
    r1 = TokenSampler(toks, 16, 4, seed=7, replica=1, n_replicas=2)
    assert not torch.equal(x, r1.batch_at(5)[0])
    assert not torch.equal(x, a.batch_at(6)[0])
    assert not torch.equal(x, TokenSampler(toks, 16, 4, seed=8).batch_at(5)[0])
    starts = np.concatenate([a.starts(s) for s in range(500)])
    assert starts.min() >= 0 and starts.max() <= len(toks) - 16 - 1 and starts.max() > len(toks) - 200


def test_sampler_resume_is_exact():
    toks = _arange_tokens()
    ref = TokenSampler(toks, 8, 4, seed=3, replica=1, n_replicas=3)
    batches = [ref.next_batch() for _ in range(7)]
    s = TokenSampler(toks, 8, 4, seed=3, replica=1, n_replicas=3)
    for _ in range(3):
        s.next_batch()
    state = s.state_dict()
    assert state["step"] == 3
    resumed = TokenSampler(toks, 8, 4, seed=3, replica=1, n_replicas=3)
    resumed.load_state_dict(state)
    for want in batches[3:]:
        got = resumed.next_batch()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="seed"):
        TokenSampler(toks, 8, 4, seed=4).load_state_dict(state)


def test_sampler_dp_ranks_split_the_replica_batch():
    toks = _arange_tokens()
    full = TokenSampler(toks, 8, 4, seed=1).batch_at(2)[0]
    parts = [TokenSampler(toks, 8, 4, seed=1, dp_rank=r, dp_size=2).batch_at(2)[0] for r in range(2)]
    assert torch.equal(torch.cat(parts), full)


def test_epoch_mode_windows_do_not_overlap():
    toks = _arange_tokens(1000)
    samplers = [TokenSampler(toks, 10, 3, seed=0, replica=r, n_replicas=2, mode="epoch") for r in range(2)]
    spe = samplers[0].steps_per_epoch
    assert spe == (999 // 10) // 6
    starts = np.concatenate([s.starts(k) for s in samplers for k in range(spe)])
    assert len(set(starts.tolist())) == len(starts) and (starts % 10 == 0).all()
    assert not np.array_equal(samplers[0].starts(0), samplers[0].starts(spe))  # reshuffled next epoch


def test_val_batches_fixed_and_spread():
    toks = _arange_tokens(1000)
    a, b = val_batches(toks, 3, 4, 16), val_batches(toks, 3, 4, 16)
    assert len(a) == 3 and all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))
    first = torch.stack([x[:, 0] for x, _ in a]).flatten().tolist()
    assert first[0] == 0 and first[-1] == 1000 - 16 - 1 and first == sorted(first)
    halves = [val_batches(toks, 3, 4, 16, dp_rank=r, dp_size=2)[1][0] for r in range(2)]
    assert torch.equal(torch.cat(halves), a[1][0])
    with pytest.raises(ValueError, match="val_fraction"):
        val_batches(toks[:10], 1, 1, 16)


def test_unigram_entropy_matches_counter():
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 300, 5000).astype(np.uint16)
    c = Counter(toks.tolist())
    want = -sum(n / 5000 * math.log(n / 5000) for n in c.values())
    assert unigram_entropy(toks) == pytest.approx(want, rel=1e-12)
    assert unigram_entropy(toks, chunk=777) == pytest.approx(want, rel=1e-12)
    assert unigram_entropy(np.array([0, 1, 2, 3] * 10, dtype=np.uint16)) == pytest.approx(math.log(4))


def test_check_data(tmp_path):
    cfg = load_config(
        None,
        {
            "data": {"cache_dir": str(tmp_path), "max_bytes": 100_000},
            "train": {"batch_size": 4, "seq_len": 32, "eval_batches": 2},
            "parallel": {"data": 2, "microbatches": 1},
            "model": {"max_seq_len": 32},
        },
    )
    p = check_data(cfg)
    assert p.vocab_size == 256 and p.meta["train_tokens"] > 34
    assert check_data(cfg).cache_hit  # the ranks' second call reads only meta.json
    bpe_dir = prepare(DataConfig(cache_dir=str(tmp_path), max_bytes=100_000, tokenizer="bpe", bpe_vocab_size=300)).dir
    small = load_config(None, {"data": {"source": "memmap", "path": bpe_dir}, "model": {"vocab_size": 256}})
    with pytest.raises(ConfigError, match=r"model.vocab_size=256 .*--model.vocab_size=300"):
        check_data(small)


# --------------------------------------------------------------------------- bad corpora: one-line DataError


def _text_cfg(tmp_path, path, **train):
    return load_config(
        None,
        {
            "data": {"source": "text", "path": str(path), "cache_dir": str(tmp_path / "cache")},
            "train": {"seq_len": 64, **train},
            "model": {"max_seq_len": 64},
        },
    )


def test_bad_corpora_name_the_file_and_the_fix(tmp_path):
    empty_dir = tmp_path / "empty_dir"
    empty_dir.mkdir()
    with pytest.raises(DataError, match=r"data.path='.*empty_dir' is an empty directory"):
        check_data(_text_cfg(tmp_path, empty_dir))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match=r"data.path='.*empty.txt' is empty"):
        check_data(_text_cfg(tmp_path, empty))
    short = tmp_path / "short.txt"
    short.write_text("hello world\n" * 5)  # 60 bytes: fewer tokens than one 64-token sequence
    with pytest.raises(
        DataError,
        match=r"short.txt' gives \d+ training tokens, fewer than one sequence "
        r"\(train.seq_len=64 needs 66\)",
    ):
        check_data(_text_cfg(tmp_path, short))
    val_short = tmp_path / "val_short.txt"  # train split is long enough, validation is not
    val_short.write_text("".join(f"line {i}\n" for i in range(300)))
    with pytest.raises(DataError, match="validation tokens.*train.eval_batches=0"):
        check_data(_text_cfg(tmp_path, val_short, eval_batches=2))
    assert check_data(_text_cfg(tmp_path, val_short, eval_batches=0)).meta["train_tokens"] > 66
    assert issubclass(DataError, ValueError)  # callers that caught ValueError from the data layer still do


def test_binary_file_as_text_corpus_is_refused(tmp_path):
    nul = tmp_path / "model.bin"
    nul.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 40)
    with pytest.raises(DataError, match=r"data.path='.*model.bin' has NUL bytes .* reads UTF-8 text"):
        check_data(_text_cfg(tmp_path, nul))
    latin = tmp_path / "latin1.txt"  # no NUL, but 10% of the bytes are not valid UTF-8
    latin.write_bytes(("caf\xe9 na\xefve " * 2000).encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt' is not UTF-8 text \(\d+% of its first"):
        prepare(_text_cfg(tmp_path, latin).data)
    ok = tmp_path / "utf8.txt"  # valid UTF-8 with many multi-byte characters passes
    ok.write_text("café naïve 日本語 ✓\n" * 3000, encoding="utf-8")
    assert prepare(_text_cfg(tmp_path, ok).data).meta["train_tokens"] > 0
    d = tmp_path / "only_binary"  # a directory keeps skipping binary files, but not silently to nothing
    d.mkdir()
    shutil.copy(nul, d / "a.bin")
    with pytest.raises(DataError, match=r"matched no text files \(1 binary file\(s\) skipped"):
        prepare(_text_cfg(tmp_path, d).data)


def test_readme_bpe_prepare_command_works(tmp_path):
    """README: `dilocox data prepare configs/tiny.yaml --data.tokenizer=bpe` (bpe 4096 > tiny's 256)."""
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    cmd = "dilocox data prepare configs/tiny.yaml --data.tokenizer=bpe"
    assert cmd in readme
    from dilocox.data.prepare import _data_only_config

    cfg = _data_only_config(os.path.join(REPO, "configs/tiny.yaml"), ["--data.tokenizer=bpe"])
    assert cfg.data.tokenizer == "bpe" and cfg.data.bpe_vocab_size == 4096 and cfg.model.vocab_size == 256
    with pytest.raises(ConfigError, match="bpe_vocab_size"):  # training with the tiny model's vocab still refuses
        load_config(os.path.join(REPO, "configs/tiny.yaml"), ["--data.tokenizer=bpe"])
    load_config(os.path.join(REPO, "configs/tiny.yaml"), ["--data.tokenizer=bpe", "--model.vocab_size=4096"])
    assert "--data.tokenizer=bpe --model.vocab_size=4096" in readme  # the README's follow-up train command


@pytest.mark.slow
def test_readme_bpe_prepare_command_runs(tmp_path):
    """The exact README command end to end (BPE of 4096 on the 4 MB stdlib corpus: ~30 s on 2 cores)."""
    import subprocess

    cmd = ["dilocox", "data", "prepare", "configs/tiny.yaml", "--data.tokenizer=bpe"]
    shutil.copytree(os.path.join(REPO, "configs"), tmp_path / "configs")  # cwd=tmp: the cache lands in tmp
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    r = subprocess.run(
        [sys.executable, "-m", "dilocox.cli", *cmd[1:]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert "tokenizer  bpe  vocab 4096" in r.stdout and "--model.vocab_size=4096" in r.stdout
    assert (tmp_path / ".cache" / "dilocox" / "prepared").is_dir()


# --------------------------------------------------------------------------- data.max_bytes: opt-in, said (issue 44)


def _three_files(tmp_path, size=100_000):
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(3):
        (d / f"part{i}.txt").write_text(f"part {i} ..\n" * (size // 10))  # 10-byte lines: exactly size bytes
    return d


def test_max_bytes_is_opt_in_and_a_cut_is_said_with_both_sizes(tmp_path, capsys):
    from dilocox import cli
    from dilocox.data import prepare_main

    assert DataConfig().max_bytes is None and load_config(None, []).data.max_bytes is None  # no silent cap
    d = _three_files(tmp_path)
    total = sum(f.stat().st_size for f in d.iterdir())
    full = prepare(DataConfig(source="text", path=str(d), cache_dir=str(tmp_path / "c")))
    assert full.meta["bytes"] == total and full.meta["cut"] is None  # all of it
    capped = prepare(DataConfig(source="text", path=str(d), cache_dir=str(tmp_path / "c"), max_bytes=100_000))
    assert capped.meta["cut"] == {"max_bytes": 100_000, "source_bytes": total, "kept_bytes": 100_000}
    args = ["--data.source=text", f"--data.path={d}", f"--data.cache_dir={tmp_path / 'c'}", "--data.max_bytes=100000"]
    assert prepare_main(args) == 0
    out = capsys.readouterr().out
    assert "cap        note: data.max_bytes=100000 cut the corpus: kept 0.10 MB of 0.30 MB" in out, out
    cfg = load_config(os.path.join(REPO, "configs", "tiny.yaml"), args)
    cli._check_data(cfg)  # what `dilocox train` prints before training (once, rank 0)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "kept 0.10 MB of 0.30 MB" in lines[0] and "--data.max_bytes=null" in lines[0], lines
    cli._check_data(load_config(os.path.join(REPO, "configs", "tiny.yaml"), args[:-1] + ["--data.max_bytes=null"]))
    assert capsys.readouterr().out == ""  # no cap, nothing to say
    for source, cap in (("prose", 50_000), ("stdlib", 50_000)):
        c = read_corpus(DataConfig(source=source, max_bytes=cap)).cut
        assert c["kept_bytes"] == cap and c["source_bytes"] > cap, (source, c)


def test_hf_saved_dataset_dir_and_local_copy_with_a_config_name_offline(tmp_path, monkeypatch):
    """data.source=hf on a save_to_disk directory (a DatasetDict: the split picked by data.hf_split) and on a local
    copy of a hub dataset whose README names two configs (data.hf_config picks one); no network."""
    datasets = pytest.importorskip("datasets", reason="the datasets package is not installed")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rows = {s: [f"{s} document {i}: " + "word " * (5 + i) for i in range(12)] for s in ("train", "validation")}
    saved = tmp_path / "saved"
    datasets.DatasetDict({s: datasets.Dataset.from_dict({"text": r}) for s, r in rows.items()}).save_to_disk(saved)
    for split in ("train", "validation"):
        p = prepare(_cfg(tmp_path, source="hf", path=str(saved), hf_split=split, val_fraction=0.1))
        stream = np.concatenate([p.train_tokens(), p.val_tokens()]).astype(np.uint8).tobytes()
        assert stream == b"\0".join(r.encode() for r in rows[split]) + b"\0", split
    with pytest.raises(DataError, match=r"hf_split='test' is not a split .* its splits: \['train', 'validation'\]"):
        prepare(_cfg(tmp_path, source="hf", path=str(saved), hf_split="test"))
    repo = tmp_path / "hub_copy"
    for name in ("small", "big"):
        (repo / name).mkdir(parents=True)
        with open(repo / name / "train.jsonl", "w") as f:
            for i in range(4 if name == "small" else 8):
                f.write(json.dumps({"text": f"{name} row {i} " + "z" * 40}) + "\n")
    (repo / "README.md").write_text(
        "---\nconfigs:\n- config_name: small\n  data_files:\n  - split: train\n    path: small/*.jsonl\n"
        "- config_name: big\n  data_files:\n  - split: train\n    path: big/*.jsonl\n---\n# a dataset\n"
    )
    for name, n in (("small", 4), ("big", 8)):
        c = read_corpus(_cfg(tmp_path, source="hf", path=str(repo), hf_config=name))
        assert [d.split(" ")[:3] for d in c.docs] == [[name, "row", str(i)] for i in range(n)], c.docs
        assert f"[{name}][train]" in c.description
    with pytest.raises(DataError, match=r"hf_config='nope'"):
        read_corpus(_cfg(tmp_path, source="hf", path=str(repo), hf_config="nope"))


# --------------------------------------------------------------------------- streaming prepare (issue 44 item 1)


def _reference_tokens(cfg):
    """The in-memory way (the whole corpus read, split, encoded at once): what the streamed build must equal."""
    from dilocox.data.tokenizer import train_bpe

    docs = read_corpus(cfg).docs
    train, val = split_documents(docs, cfg.val_fraction)
    tok = train_bpe(train, cfg.bpe_vocab_size) if cfg.tokenizer == "bpe" else ByteTokenizer()
    return tok.encode_docs(train), tok.encode_docs(val), len(train), len(val)


@pytest.mark.parametrize(
    "layout", ["many", "one_file", "tie"], ids=["many-docs", "one-doc-cut-at-a-line", "equal-docs"]
)
@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_streamed_prepare_equals_the_in_memory_split_and_tokens(tmp_path, monkeypatch, layout, tokenizer):
    """Small encode batches (many flushes, documents of each split in several batches): the token files, document
    counts and content hash equal the whole-corpus computation, for a document-level split, for one document cut at
    a line end, and for equal documents (ties)."""
    prep = sys.modules["dilocox.data.prepare"]  # (dilocox.data.prepare, the attribute, is the function)
    monkeypatch.setattr(prep, "ENCODE_BATCH_BYTES", 700)
    d = tmp_path / "c"
    d.mkdir()
    if layout == "many":
        for i in range(40):
            (d / f"{i:03d}.txt").write_text(f"doc {i} é ✓ " + "word%d " % i * (i % 7 + 3) + "\n")
    elif layout == "one_file":
        (d / "one.txt").write_text("".join(f"line {i} of the only document\n" for i in range(300)))
    else:
        for i in range(10):
            (d / f"{i}.txt").write_text("same size\n" * 20)
    cfg = DataConfig(
        source="text", path=str(d), cache_dir=str(tmp_path / "cache"), tokenizer=tokenizer, bpe_vocab_size=300,
        val_fraction=0.1,
    )  # fmt: skip
    p = prepare(cfg)
    train, val, n_train, n_val = _reference_tokens(cfg)
    assert np.array_equal(p.train_tokens(), train) and np.array_equal(p.val_tokens(), val)
    assert (p.meta["train_docs"], p.meta["val_docs"]) == (n_train, n_val)
    want = hashlib.sha256(b"".join(x.encode() + b"\0" for x in read_corpus(cfg).docs)).hexdigest()
    assert p.meta["content_sha256"] == want


@pytest.mark.slow  # writes and prepares a 120 MB / 30 MB corpus in a subprocess
@pytest.mark.parametrize("files, lines", [(1200, 1000), (1, 300_000)])
def test_prepare_streams_with_memory_below_the_corpus_size(tmp_path, files, lines):
    """Peak RSS added by preparing a 120 MB corpus (1,200 files of 100 kB) or one 30 MB file: below 100 MB. The
    whole-corpus way held the text, its bytes and its tokens at once (over 4x the corpus); one file read whole was one
    document, held, encoded and joined at once (5.9x the file). Bounded by the batch and the piece, not the corpus."""
    d = tmp_path / "big"
    d.mkdir()
    line = "".join(chr(97 + (i * 7) % 26) for i in range(99)) + "\n"
    for i in range(files):
        (d / f"{i:05d}.txt").write_text(line * lines)
    code = (
        "import resource, sys\n"
        "from dilocox.config import DataConfig\n"
        "from dilocox.data import prepare\n"
        "cfg = DataConfig(source='text', path=sys.argv[1], cache_dir=sys.argv[2])\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "p = prepare(cfg)\n"
        "peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "m = p.meta\n"
        "print(base, peak, m['bytes'], m['train_tokens'] + m['val_tokens'], m['train_docs'] + m['val_docs'])\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(d), str(tmp_path / "cache")],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": REPO},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    base, peak, nbytes, ntok, ndocs = map(int, r.stdout.split()[-5:])
    assert nbytes == files * lines * 100 and ntok == nbytes + ndocs  # every byte, one end-of-document token per doc
    assert ndocs == files if files > 1 else ndocs >= nbytes // (1 << 20)  # (one file: a document per MB piece)
    assert (peak - base) * 1024 < 100e6, f"prepare added {(peak - base) / 1024:.0f} MB of peak RSS for {nbytes} B"


def test_bpe_trains_on_a_strided_sample_of_a_large_corpus(tmp_path):
    """data.bpe_train_bytes: past it the BPE trains on every k-th training document (k = ceil(train bytes / limit)),
    equal to training on exactly those documents; the whole corpus is still tokenized, and the sample is keyed."""
    from dilocox.data.prepare import bpe_stride
    from dilocox.data.tokenizer import train_bpe

    d = tmp_path / "c"
    d.mkdir()
    for i in range(40):
        (d / f"{i:03d}.txt").write_text(f"doc {i} " + ("alpha beta " if i % 2 else "gamma delta ") * (20 + i) + "\n")
    base = dict(source="text", path=str(d), cache_dir=str(tmp_path / "cache"), tokenizer="bpe", bpe_vocab_size=300)
    docs = read_corpus(DataConfig(**base, val_fraction=0.1)).docs
    train, val = split_documents(docs, 0.1)
    limit = sum(len(x.encode()) for x in train) // 3
    k = bpe_stride(sum(len(x.encode()) for x in train), limit)
    assert k == 4  # (3 and a remainder)
    p = prepare(DataConfig(**base, val_fraction=0.1, bpe_train_bytes=limit))
    assert p.meta["bpe_sample_stride"] == k and p.meta["train_docs"] == len(train)
    want = train_bpe(train[::k], 300)
    assert np.array_equal(p.train_tokens(), want.encode_docs(train).astype(p.train_tokens().dtype))
    whole = prepare(DataConfig(**base, val_fraction=0.1, bpe_train_bytes=None))
    assert whole.meta["bpe_sample_stride"] == 1 and whole.dir != p.dir
