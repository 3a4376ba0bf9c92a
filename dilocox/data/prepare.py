"""Prepare: corpus -> tokens -> ``train.bin`` / ``val.bin`` memmap files + ``meta.json``.

The prepared directory (default ``<cache_dir>/prepared/<source>-<tokenizer>-<key>``) holds

- ``train.bin``, ``val.bin``  raw token ids, uint16 when the vocabulary fits, else uint32;
                              every document is followed by the tokenizer's ``eot_id``
- ``tokenizer.json``          the BPE (bpe only), so the directory is self-contained
- ``meta.json``               tokenizer kind, vocab size, dtype, token and document counts,
                              source description, a content hash and the cache ``key``

``key`` hashes everything the tokens depend on (source, path, split/field, tokenizer, vocab,
val_fraction, max_bytes, and the names/sizes/mtimes of the source files), so a second call
with the same config is a cache hit that reads nothing but ``meta.json``.

Concurrency: ``prepare`` is race-free without any coordination from the caller. Concurrent
callers on one host serialize on an ``fcntl`` lock next to the output directory (the first
builds, the others then find a cache hit); the directory is built under a temporary name and
published with one atomic ``rename``, so a reader never sees a half-written directory, even on
a shared filesystem where the lock does not reach across hosts.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from dilocox.config import DataConfig
from dilocox.data.outdir import check_replaces
from dilocox.data.sampler import val_batches as _val_batches
from dilocox.data.sources import (
    DataError,
    DocStream,
    cap_note,
    cut_document,
    fingerprint,
    skipped_note,
    split_plan,
)
from dilocox.data.tokenizer import (
    PRETRAINED,
    BPETokenizer,
    ByteTokenizer,
    load_or_train_bpe,
    load_tokenizer,
    pretrained_path,
    tokenizer_sha256,
)

FORMAT = 6  # bump when the on-disk layout, tokenization or meta.json changes: invalidates every cache (2: "cut";
# 3: data.source=text reads a file over 1 MB as one document per MB, sources.TEXT_PIECE_BYTES; 4: data.max_bytes
# cutting inside a character made an empty document; 5: a text file's leading UTF-8 byte order mark is skipped;
# 6: a special token's text in a document is text, not that token; a file's NUL or invalid UTF-8 past its first 64 KiB
# leaves it out; an hf row over 1 MB is cut as text's files; byte: a NUL in a document dropped; tokenizer_sha256)


@dataclass
class PreparedData:
    """A prepared directory: token memmaps, tokenizer and meta."""

    dir: str
    meta: dict
    cache_hit: bool = False
    seconds: float = 0.0  # wall time of this prepare() call

    @property
    def train_path(self) -> str:
        return os.path.join(self.dir, "train.bin")

    @property
    def val_path(self) -> str:
        return os.path.join(self.dir, "val.bin")

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    def _map(self, path: str, n: int) -> np.ndarray:
        if n == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(path, dtype=self.dtype, mode="r", shape=(n,))

    def train_tokens(self) -> np.ndarray:
        return self._map(self.train_path, int(self.meta["train_tokens"]))

    def val_tokens(self) -> np.ndarray:
        return self._map(self.val_path, int(self.meta["val_tokens"]))

    def sampler_args(self) -> dict:
        """What ``TokenSampler`` checks: what the tokens depend on beyond their count (on a resume), the text's
        content hash and the tokenizer's (the SHA-256 of its file, or of ``byte``; computed here for a directory
        prepared before meta.json held it), and the vocabulary every id must be below (a damaged file)."""
        tok = self.meta.get("tokenizer_sha256")
        if tok is None:
            path = self.meta.get("tokenizer_file")
            tok = tokenizer_sha256(os.path.join(self.dir, path) if path else None, self.meta.get("tokenizer"))
        return {"content": self.meta.get("content_sha256"), "tokenizer": tok, "vocab_size": self.vocab_size}

    def tokenizer(self):
        path = self.meta.get("tokenizer_file")
        return load_tokenizer(self.meta["tokenizer"], os.path.join(self.dir, path) if path else None)

    def val_batches(self, n_batches: int, batch_size: int, seq_len: int, dp_rank: int = 0, dp_size: int = 1):
        """Fixed validation windows (same for every replica and call); see sampler.val_batches."""
        return _val_batches(self.val_tokens(), n_batches, batch_size, seq_len, dp_rank, dp_size, self.vocab_size)


# --------------------------------------------------------------------------- keys and paths


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _identity(cfg: DataConfig) -> dict:
    """What the raw corpus and its split depend on (shared by the tokenizer and data keys)."""
    path = cfg.path
    if path and cfg.source in ("text", "hf") and os.path.exists(os.path.expanduser(path)):
        path = os.path.abspath(os.path.expanduser(path))
    ident = {
        "format": FORMAT,
        "source": cfg.source,
        "path": path,
        "max_bytes": cfg.max_bytes,
        "val_fraction": cfg.val_fraction,
        "files": fingerprint(cfg),
    }
    if cfg.source == "hf":
        ident.update(hf_config=cfg.hf_config, hf_split=cfg.hf_split, hf_text_field=cfg.hf_text_field)
    return ident


def tokenizer_key(cfg: DataConfig) -> str:
    return _hash({**_identity(cfg), "bpe_vocab_size": cfg.bpe_vocab_size, "bpe_train_bytes": cfg.bpe_train_bytes})


def data_key(cfg: DataConfig) -> str:
    ident = {**_identity(cfg), "tokenizer": cfg.tokenizer}
    if cfg.tokenizer == "bpe":
        ident["bpe_vocab_size"] = cfg.bpe_vocab_size
        ident["bpe_train_bytes"] = cfg.bpe_train_bytes
    elif cfg.tokenizer.startswith(PRETRAINED):  # the tokens depend on the file's content, not its name
        with open(pretrained_path(cfg.tokenizer), "rb") as f:
            ident["tokenizer_sha256"] = hashlib.sha256(f.read()).hexdigest()
    return _hash(ident)


def default_out_dir(cfg: DataConfig, key: str | None = None) -> str:
    key = key or data_key(cfg)
    tok = {"bpe": f"bpe{cfg.bpe_vocab_size}", "byte": "byte"}.get(cfg.tokenizer, "pretrained")
    return os.path.join(
        os.path.abspath(os.path.expanduser(cfg.cache_dir)), "prepared", f"{cfg.source}-{tok}-{key[:16]}"
    )


# --------------------------------------------------------------------------- loading


def load_prepared(path: str, field: str = "data.path") -> PreparedData:
    """Open a prepared directory (the ``memmap`` source), checking the files match meta.json."""
    meta_path = os.path.join(path, "meta.json")
    if os.path.isfile(path) and os.path.exists(os.path.join(os.path.dirname(path) or ".", "meta.json")):
        raise FileNotFoundError(
            f"{field}={path!r} is a file of a prepared data directory; give the directory: "
            f"{field}={os.path.dirname(path) or '.'}"
        )
    if not os.path.isdir(path):
        what = "is not a directory" if os.path.exists(path) else "does not exist"
        raise FileNotFoundError(
            f"{field}={path!r} {what} (resolved to {os.path.abspath(path)!r}); "
            "data.source='memmap' needs a directory written by `dilocox data prepare`"
        )
    if not os.path.exists(meta_path):
        raise FileNotFoundError(
            f"{field}={path!r} has no meta.json; it is not a directory written by `dilocox data prepare`"
        )
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        p = PreparedData(os.path.abspath(path), meta)
        sizes = {s: int(meta[f"{s}_tokens"]) * p.dtype.itemsize for s in ("train", "val")}
        p.vocab_size, meta["tokenizer"]  # noqa: B018 - what check_data and train read next
    except (ValueError, KeyError, TypeError) as e:  # (json.JSONDecodeError is a ValueError)
        why = f"lacks {e.args[0]!r}" if isinstance(e, KeyError) else f"is not valid ({e})"
        raise ValueError(
            f"{field}={path!r}: its meta.json {why}; it is not a directory written by `dilocox data prepare`: "
            "re-run `dilocox data prepare`"
        ) from None
    for split in ("train", "val"):
        fpath = os.path.join(path, f"{split}.bin")
        want = sizes[split]
        if not os.path.exists(fpath):
            raise ValueError(f"{fpath} is missing (meta.json says {want} bytes); re-run `dilocox data prepare`")
        if (have := os.path.getsize(fpath)) != want:
            raise ValueError(
                f"{fpath} has {have} bytes but meta.json says {want} "
                f"({meta[f'{split}_tokens']} x {p.dtype}); re-run `dilocox data prepare`"
            )
    return p


def _try_cached(out_dir: str, key: str) -> PreparedData | None:
    try:
        p = load_prepared(out_dir, "out_dir")
    except (FileNotFoundError, ValueError, KeyError, json.JSONDecodeError):
        return None
    return p if p.meta.get("key") == key else None


@contextlib.contextmanager
def _file_lock(path: str):
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- building


PROGRESS_EVERY_S = 10.0  # a pass over the corpus that takes longer prints a progress line this often
# documents are tokenized and written in batches of about this many bytes: a BPE holds ~70 bytes per input byte
# while it encodes (tokenizers' Encoding objects), so 1 MB keeps that near 70 MB (8 MB: 560 MB measured)
ENCODE_BATCH_BYTES = 1_000_000


def _split_stream(stream: DocStream, i: int, head_bytes: int | None, sizes):
    """One pass over ``stream``: ("train" | "val", document), with the split of ``split_plan`` (the one document it
    cuts is split at a line end); a document whose size changed since the first pass is an error."""
    changed = "the corpus changed while it was being prepared ({}); prepare it again"
    n = 0
    for idx, doc in enumerate(stream):
        n = idx + 1
        if idx >= len(sizes) or len(doc.encode("utf-8")) != sizes[idx]:
            raise DataError(changed.format(f"document {idx}" + (" is new" if idx >= len(sizes) else "")))
        if idx < i:
            yield "train", doc
        elif idx == i and head_bytes is not None:
            head, tail = cut_document(doc, head_bytes)
            if head:
                yield "train", head
            yield "val", tail
        else:
            yield "val", doc
    if n != len(sizes):
        raise DataError(changed.format(f"{len(sizes)} documents on the first pass, {n} on this one"))


class _Progress:
    """``data prepare: tokenizing 412.0 / 1,024.0 MB (40 %), 35.2 MB/s, 17 s left`` (``total`` None: ``reading
    412.0 MB, 35.2 MB/s``) every PROGRESS_EVERY_S: a corpus that is read in less prints nothing."""

    def __init__(self, total: int | None, what: str):
        self.total, self.what, self.done = total, what, 0
        self.t0 = self.last = time.perf_counter()

    def add(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        rate = self.done / max(now - self.t0, 1e-9)
        if self.total is None:
            where = f"{self.done / 1e6:,.1f} MB"
        else:
            left, pct = (self.total - self.done) / max(rate, 1e-9), 100 * self.done / max(self.total, 1)
            where = f"{self.done / 1e6:,.1f} / {self.total / 1e6:,.1f} MB ({pct:.0f} %), {left:.0f} s left"
        print(f"data prepare: {self.what} {where}, {rate / 1e6:.1f} MB/s", flush=True)


def _tokenizer(cfg: DataConfig, stream, i: int, head_bytes, sizes, tmp: str):
    """The byte tokenizer, or the BPE of the training documents (cached by data settings; a third pass over them
    when it is trained), copied into ``tmp``."""
    if cfg.tokenizer.startswith(PRETRAINED):  # a model's own tokenizer.json, kept as it is
        path = pretrained_path(cfg.tokenizer)
        tok = BPETokenizer.from_file(path)
        shutil.copyfile(path, os.path.join(tmp, "tokenizer.json"))
        return tok
    if cfg.tokenizer != "bpe":
        return ByteTokenizer()
    cache = os.path.join(
        os.path.abspath(os.path.expanduser(cfg.cache_dir)),
        "tokenizers",
        f"bpe{cfg.bpe_vocab_size}-{tokenizer_key(cfg)[:16]}.json",
    )
    n_train = i + (head_bytes is not None)  # (a hint for the trainer's progress; the cut head may be empty)
    stride = bpe_stride(sum(sizes[:i]) + (head_bytes or 0), cfg.bpe_train_bytes)
    train_docs = (
        d
        for k, (split, d) in enumerate(_split_stream(stream, i, head_bytes, sizes))
        if split == "train" and k % stride == 0
    )
    tok = load_or_train_bpe(train_docs, cfg.bpe_vocab_size, cache, length=-(-n_train // stride))
    tok.sample_stride = stride
    shutil.copyfile(cache, os.path.join(tmp, "tokenizer.json"))
    return tok


def bpe_stride(train_bytes: int, limit: int | None) -> int:
    """Every how many training documents the BPE trains on, to stay near ``limit`` bytes (1: all of them)."""
    return 1 if limit is None or train_bytes <= limit else -(-train_bytes // max(limit, 1))


def _build(cfg: DataConfig, key: str, tmp: str) -> dict:
    """Stream, split, tokenize and write into ``tmp``; return the meta dict (not yet written).

    Bounded memory: the corpus is read as a stream of documents twice (sizes and content hash, then tokens; the BPE,
    when trained, reads the training documents once more), never whole; what is held is one batch of documents
    (ENCODE_BATCH_BYTES, or one document when larger) and one 8-byte size per document."""
    from array import array

    t0 = time.perf_counter()
    stream = DocStream(cfg)
    sizes, content = array("q"), hashlib.sha256()
    progress = _Progress(None, "reading")
    for doc in stream:  # pass 1: document sizes (for the split) and the content hash
        raw = doc.encode("utf-8")
        sizes.append(len(raw))
        content.update(raw + b"\0")
        progress.add(len(raw))
    i, head_bytes = split_plan(sizes, cfg.val_fraction)
    t_read = time.perf_counter()
    tok = _tokenizer(cfg, stream, i, head_bytes, sizes, tmp)
    t_tok = time.perf_counter()
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32)
    counts = {"train": [0, 0], "val": [0, 0]}  # tokens, documents
    progress = _Progress(stream.nbytes, "tokenizing")
    files = {s: open(os.path.join(tmp, f"{s}.bin"), "wb") for s in ("train", "val")}  # noqa: SIM115
    try:
        batch, batch_split, batch_bytes = [], None, 0

        def flush() -> None:
            if batch:
                arr = tok.encode_docs(batch).astype(dtype, copy=False)
                arr.tofile(files[batch_split])
                counts[batch_split][0] += len(arr)
                counts[batch_split][1] += len(batch)
                progress.add(batch_bytes)

        for split, doc in _split_stream(stream, i, head_bytes, sizes):  # pass 2: tokens, appended per batch
            if split != batch_split or batch_bytes >= ENCODE_BATCH_BYTES:
                flush()
                batch, batch_split, batch_bytes = [], split, 0
            batch.append(doc)
            batch_bytes += len(doc.encode("utf-8"))
        flush()
        for f in files.values():
            f.flush()
            os.fsync(f.fileno())
    finally:
        for f in files.values():
            f.close()
    if not counts["train"][1]:
        raise DataError("the corpus is too small for a train/validation split; raise data.max_bytes")
    n_tokens = counts["train"][0] + counts["val"][0]
    seconds = time.perf_counter() - t0
    tok_file = "tokenizer.json" if tok.kind == "bpe" else None
    return {
        "format": FORMAT,
        "key": key,
        "tokenizer": tok.kind,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "dtype": dtype.name,
        "train_tokens": counts["train"][0],
        "val_tokens": counts["val"][0],
        "train_docs": counts["train"][1],
        "val_docs": counts["val"][1],
        "bytes": stream.nbytes,
        "source": stream.description,
        "cut": stream.cut,  # data.max_bytes cut the source (sizes), else None
        "skipped": [list(x) for x in stream.skipped[:5]],  # text files left out as not UTF-8 (the first 5)
        "skipped_count": len(stream.skipped),
        "content_sha256": content.hexdigest(),
        "tokenizer_file": tok_file,
        "tokenizer_sha256": tokenizer_sha256(tok_file and os.path.join(tmp, tok_file), tok.kind),
        "bpe_sample_stride": getattr(tok, "sample_stride", None),  # trained on every k-th training document
        "seconds": {"read": t_read - t0, "tokenizer": t_tok - t_read, "total": seconds},
        "tokens_per_sec": n_tokens / max(seconds, 1e-9),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _publish(tmp: str, out_dir: str, key: str) -> None:
    """Atomically move ``tmp`` to ``out_dir`` (replacing a stale prepared dir, never other data)."""
    if _try_cached(out_dir, key) is not None:  # another host published the same data meanwhile
        return
    if os.path.exists(out_dir):
        if os.listdir(out_dir) and not os.path.exists(os.path.join(out_dir, "meta.json")):
            raise FileExistsError(
                f"out_dir {out_dir!r} exists and is not a prepared data directory; refusing to replace it"
            )
        old = tempfile.mkdtemp(prefix=".old-", dir=os.path.dirname(out_dir))
        os.rename(out_dir, os.path.join(old, "d"))
        shutil.rmtree(old, ignore_errors=True)
    try:
        os.rename(tmp, out_dir)
    except OSError:
        if not os.path.exists(os.path.join(out_dir, "meta.json")):  # another host won the race: keep theirs
            raise


def _check_out_dir(out_dir: str) -> None:
    """Refuse, before any work, an ``out_dir`` that holds something else: a file, or a directory with files but no
    meta.json (``_publish`` would refuse it only after the build, with a traceback)."""
    if os.path.exists(out_dir) and (
        not os.path.isdir(out_dir) or os.listdir(out_dir) and not os.path.exists(os.path.join(out_dir, "meta.json"))
    ):
        kind = "a directory that is not a prepared data directory" if os.path.isdir(out_dir) else "not a directory"
        raise DataError(
            f"out_dir {out_dir!r} exists and is {kind}; refusing to replace it: give --out a new or empty directory "
            "(or one written by `dilocox data prepare`)"
        )


def _tmp_prefix() -> str:
    return f".tmp-{socket.gethostname().replace('/', '_')}-"


def _sweep_dead_builds(parent: str) -> None:
    """Remove the half-built directories (``.tmp-<this host>-<pid>-*``) of builds on this host whose process is gone
    (killed: SIGKILL, the OOM killer), which their own ``finally`` never removed. Other hosts' are left alone."""
    prefix = _tmp_prefix()
    for name in os.listdir(parent):
        pid = name[len(prefix) :].split("-", 1)[0] if name.startswith(prefix) else ""
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


def prepare(cfg: DataConfig, out_dir: str | None = None) -> PreparedData:
    """Tokenize the configured corpus into memmap files (cached; safe to call from every rank).

    ``data.source='memmap'`` opens ``data.path`` as an already-prepared directory instead.
    Returns a :class:`PreparedData`; ``.cache_hit`` says whether it was built by this call.
    """
    t0 = time.perf_counter()
    if cfg.source == "memmap":
        p = load_prepared(os.path.expanduser(cfg.path or ""))
        p.cache_hit, p.seconds = True, time.perf_counter() - t0
        return p
    key, given = data_key(cfg), out_dir is not None
    out_dir = os.path.abspath(out_dir or default_out_dir(cfg, key))
    parent = os.path.dirname(out_dir)
    if (p := _try_cached(out_dir, key)) is None:
        _check_out_dir(out_dir)
        os.makedirs(parent, exist_ok=True)
        with _file_lock(out_dir + ".lock"):
            if (p := _try_cached(out_dir, key)) is None:
                _sweep_dead_builds(parent)
                tmp = tempfile.mkdtemp(prefix=f"{_tmp_prefix()}{os.getpid()}-", dir=parent)
                try:
                    meta = _build(cfg, key, tmp)
                    if given:  # (--out: what is there may be another run's data; the same data is replaced)
                        try:
                            old = load_prepared(out_dir, "--out")
                        except (FileNotFoundError, ValueError, KeyError):
                            old = None  # (nothing there, or damaged: built again)
                        check_replaces(out_dir, old, meta)
                    with open(os.path.join(tmp, "meta.json"), "w") as f:
                        json.dump(meta, f, indent=2)
                    _publish(tmp, out_dir, key)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
                p = load_prepared(out_dir, "out_dir")
                p.seconds = time.perf_counter() - t0
                return p
    p.cache_hit, p.seconds = True, time.perf_counter() - t0
    return p


def prepare_or_error(cfg: DataConfig, out_dir: str | None = None) -> PreparedData:
    """``prepare``, with the data layer's own failures (a missing file, a directory without meta.json, a tokenizer
    that does not load) as one-line ``DataError``s: what ``dilocox train`` and ``dilocox data prepare`` print."""
    try:
        return prepare(cfg, out_dir)
    except DataError:
        raise
    except (FileNotFoundError, ValueError, KeyError, ImportError, RuntimeError, OverflowError) as e:
        msg = e.args[0] if e.args and isinstance(e.args[0], str) else str(e)
        raise DataError(msg) from e
    except OSError as e:  # a cache_dir or --out that is a file, not writable, a full disk: one line, not a traceback
        raise DataError(
            f"{e.strerror or e}: {e.filename!r}; data.path must be readable, data.cache_dir (and --out) directories "
            "this user can write"
        ) from e


# --------------------------------------------------------------------------- CLI


def prepare_main(argv: list[str] | None = None) -> int:
    """``dilocox data prepare [CONFIG] [--out DIR] [--a.b=v ...]``: prepare and print a summary.

    Only the ``data`` section matters here: a BPE vocabulary larger than the config's
    ``model.vocab_size`` is prepared anyway, and the summary says which ``--model.vocab_size``
    a training run on it needs.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(PREPARE_HELP)
        return 0
    out = None
    for i, a in enumerate(args):
        if a == "--out" or a.startswith("--out="):
            out = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
            if not out or out.startswith("--"):
                raise DataError("--out needs a directory: dilocox data prepare [CONFIG] --out DIR")
            del args[i : i + (1 if "=" in a else 2)]
            break
    config = args.pop(0) if args and not args[0].startswith("--") else None
    cfg = _data_only_config(config, args)
    p = prepare_or_error(cfg.data, out_dir=out)
    m = p.meta
    n = m["train_tokens"] + m["val_tokens"]
    built = m["seconds"]["total"]
    print(f"prepared   {p.dir}  ({'cache hit' if p.cache_hit else 'built'} in {p.seconds:.2f}s)")
    print(f"source     {m['source']}")
    if note := cap_note(m.get("cut")):
        print(f"cap        {note}")
    if note := skipped_note(m.get("skipped"), m.get("skipped_count")):
        print(f"skipped    {note.removeprefix('note: ')}")
    k = m.get("bpe_sample_stride") or 1
    sample = f"  (trained on every {k}th training document: data.bpe_train_bytes)" if k > 1 else ""
    print(f"tokenizer  {m['tokenizer']}  vocab {m['vocab_size']}  dtype {m['dtype']}{sample}")
    print(f"train      {p.train_path}  {m['train_tokens']:,} tokens  ({m['train_docs']} documents)")
    print(f"val        {p.val_path}  {m['val_tokens']:,} tokens  ({m['val_docs']} documents)")
    print(
        f"speed      {n:,} tokens in {built:.2f}s = {n / max(built, 1e-9):,.0f} tokens/s "
        f"(read {m['seconds']['read']:.2f}s, tokenizer {m['seconds']['tokenizer']:.2f}s)"
    )
    if p.vocab_size > cfg.model.vocab_size:
        t = cfg.parallel.tensor
        print(
            f"note       train on it with --model.vocab_size={-(-p.vocab_size // t) * t} (the tokenizer's vocabulary; "
            f"the config has model.vocab_size={cfg.model.vocab_size})"
        )
    return 0


PREPARE_HELP = """usage: dilocox data prepare [CONFIG] [--out DIR] [--section.key=value ...]

Tokenize the config's corpus once into train.bin / val.bin / meta.json (cached; a run with the
same data keys reuses it). Only the data section is used:
  --data.source=stdlib|prose|docs|text|hf|memmap  --data.path=FILE|DIR|GLOB  --data.tokenizer=byte|bpe
  --data.bpe_vocab_size=N  --data.max_bytes=N (opt-in cap; default: all)  --data.val_fraction=F
  --data.hf_config=NAME  --data.hf_split=SPLIT  --data.hf_text_field=FIELD  --data.cache_dir=DIR
  --out DIR   write here instead of <data.cache_dir>/prepared/<source>-<tokenizer>-<key> (other data: refused)
Every key and its default: docs/CONFIG.md."""


def _data_only_config(path: str | None, overrides: list[str]):
    """The config for preparing data: validated, except that model.vocab_size may be below the BPE's."""
    from dilocox.config import _deep_merge, _read_yaml, from_dict, parse_overrides

    data = _read_yaml(path) if path else {}
    if overrides:
        data = _deep_merge(data, parse_overrides(overrides))
    if not all(isinstance(data.get(k) or {}, dict) for k in ("data", "model", "parallel")):
        return from_dict(data)  # a ConfigError naming the section that is not a mapping
    d, m = data.get("data") or {}, data.get("model") or {}
    bpe = d.get("bpe_vocab_size", DataConfig.bpe_vocab_size)
    mv = m.get("vocab_size", 0)
    if d.get("tokenizer") == "bpe" and isinstance(bpe, int) and isinstance(mv, int) and bpe > mv:
        t = (data.get("parallel") or {}).get("tensor", 1)
        t = t if isinstance(t, int) and t > 0 else 1
        cfg = from_dict(_deep_merge(data, {"model": {"vocab_size": -(-bpe // t) * t}}))
        cfg.model.vocab_size = m.get("vocab_size", cfg.model.vocab_size)  # as configured: for the note
        return cfg
    return from_dict(data)
