"""Corpus sources: where the raw text comes from, as an ordered list of documents.

Six sources (``data.source``):

- ``stdlib``  the embedded default corpus: the ``.py`` files of the running Python's standard
              library (``sysconfig.get_paths()["stdlib"]``), sorted walk, ``site-packages`` and
              test directories skipped, one file = one document. Always present, no download.
- ``prose``   English prose that also ships with every interpreter: the help texts of CPython's
              ``pydoc_data.topics`` (about 465k characters, one topic = one document, sorted by name);
              the second corpus of ``dilocox bench frontier`` (no download).
- ``docs``    more English prose from the interpreter, for long runs (prose repeats 13 times in 3,000 steps of
              the frontier's layout): ``prose``'s topics, then per stdlib module (in the ``stdlib`` order) its
              docstrings (``ast.get_docstring``), one module = one document; about 2.1 MB (4.6x prose).
- ``text``    ``data.path`` is a text file, a directory (sorted recursive walk, hidden files skipped,
              binary and non-UTF-8 ones left out and named: ``skipped_note``) or a glob; one file = one
              document (a file over 1 MB: one per MB, cut at a line end, ``TEXT_PIECE_BYTES``). Binary or not
              UTF-8 (``binary_reason``, the whole file read first): a NUL, or over 1% of its bytes invalid UTF-8.
- ``hf``      HF ``datasets``: local text/json/jsonl/parquet/csv files (by extension), a
              ``save_to_disk`` directory or a local copy of a hub dataset (both offline), or a
              hub dataset name (needs a network); ``data.hf_config`` names the dataset's config
              (wikitext-103-raw-v1). ``datasets`` is imported only here. Local text files: one row each,
              checked as ``text``'s. A row over 1 MB: pieces of at most 1 MB, as ``text``'s files.
- ``memmap``  an already-prepared directory; handled by ``prepare.load_prepared``.

No source is capped unless ``data.max_bytes`` is set (opt-in): then it keeps the first
``data.max_bytes`` UTF-8 bytes (the last document is truncated at the cap) and the corpus says
so (``Corpus.cut``: the source's size and the kept size, printed by ``prepare`` and ``train``).
Every source is deterministic. ``split_documents`` makes the held-out validation split: the
last documents, about ``val_fraction`` of the bytes, never a document cut in two.
"""

from __future__ import annotations

import ast
import functools
import glob
import hashlib
import io
import itertools
import os
import sys
import sysconfig
from dataclasses import dataclass

import numpy as np

from dilocox.config import DataConfig

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
TEST_DIRS = {"test", "tests", "idle_test"}
HF_BUILDERS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".json": "json",
    ".jsonl": "json",
    ".ndjson": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst")


@dataclass
class Corpus:
    docs: list[str]  # in corpus order; empty documents dropped
    description: str  # human-readable: where the text came from
    cut: dict | None = None  # data.max_bytes cut it: {"max_bytes", "source_bytes" (None: unknown), "kept_bytes"}


def cap_note(cut: dict | None) -> str | None:
    """The one line that says data.max_bytes cut the corpus (original and kept size), or None."""
    if not cut:
        return None
    src = cut.get("source_bytes")
    of = f"of {src / 1e6:.2f} MB" if src else "of a larger source (its size is not known before reading it all)"
    return (
        f"note: data.max_bytes={cut['max_bytes']} cut the corpus: kept {cut['kept_bytes'] / 1e6:.2f} MB {of}; "
        f"remove the cap (--data.max_bytes=null) to train on all of it"
    )


# --------------------------------------------------------------------------- file listing


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str | None = None, include_tests: bool = False) -> list[str]:
    """The standard library's ``.py`` files in a deterministic (sorted, top-down) order."""
    root = root or stdlib_root()
    skip = SKIP_DIRS | (set() if include_tests else TEST_DIRS)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        out += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    if not out:
        raise FileNotFoundError(
            f"data.source='stdlib' found no .py files under {root!r} (this Python ships its "
            "standard library compiled or zipped); use data.source=text with data.path=DIR"
        )
    return out


class DataError(ValueError):
    """A corpus that cannot be used (empty, binary, too short): the message names the file and the fix."""


SNIFF_BYTES, SCAN_BYTES = 65536, 1 << 18  # the quick first check's bytes; the whole-file check's pieces (memory ~10x)
MAX_INVALID_UTF8 = 0.01  # a larger share of bytes that are not valid UTF-8 marks a file as binary


def binary_reason(path: str) -> str | None:
    """Why ``path`` is not UTF-8 text, else None: a NUL byte, or over 1% of its bytes invalid UTF-8 (of its first 64
    KiB, or of the whole file, read in ``SCAN_BYTES`` pieces once while its size and mtime stay)."""
    return _verdict(os.path.abspath(path), (st := os.stat(path)).st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=1 << 16)  # (path, size, mtime): one scan per file, not one per pass over the corpus
def _verdict(path: str, size: int, mtime_ns: int) -> str | None:
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
        more = bool(f.read(1))
        if b"\0" in head:
            return f"has NUL bytes (first at byte {head.index(0)})"
        if more:  # do not count a multi-byte character cut by the sniff window as invalid
            head = head[: max(len(head) - 3, 0)]
        bad = _invalid_utf8(head)[0]
        if head and bad / len(head) > MAX_INVALID_UTF8:
            return f"is not UTF-8 text ({bad / len(head):.0%} of its first {len(head)} bytes are invalid UTF-8)"
        return _scan_reason(f) if more else None


def _invalid_utf8(buf: bytes) -> tuple[int, int]:
    """(how many bytes of ``buf`` are not valid UTF-8, the offset of the first of them: -1 when none)."""
    try:
        buf.decode("utf-8")
    except UnicodeDecodeError as e:
        return len(buf) - len(buf.decode("utf-8", errors="ignore").encode("utf-8")), e.start
    return 0, -1


def _scan_reason(f) -> str | None:
    """``binary_reason``'s rule over the whole of the open file ``f`` (from its start, ``SCAN_BYTES`` at a time; a
    character that a piece's end cuts is checked with the next piece)."""
    f.seek(0)
    done, bad, first, rest = 0, 0, -1, b""  # done: bytes checked; rest: the cut character carried over
    while True:
        chunk = f.read(SCAN_BYTES)
        if (k := chunk.find(0)) >= 0:
            return f"has NUL bytes (first at byte {done + len(rest) + k})"
        buf = rest + chunk
        cut = _char_end(buf) if chunk else len(buf)
        n, at = _invalid_utf8(buf[:cut])
        if n and first < 0:
            first = done + at
        bad, done, rest = bad + n, done + cut, buf[cut:]
        if not chunk:
            break
    if done and bad / done > MAX_INVALID_UTF8:
        return f"is not UTF-8 text ({bad / done:.1%} of its {done} bytes are invalid UTF-8, the first at byte {first})"
    return None


def _walk(root: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out += [os.path.join(dirpath, f) for f in sorted(filenames) if not f.startswith(".")]
    return out


def local_files(
    path: str | None, source: str, skip_binary: bool = True, skipped: list[tuple[str, str]] | None = None
) -> list[str]:
    """Resolve ``data.path`` (file, directory or glob) to a sorted list of files, or raise. ``skipped`` collects
    (path, why) of each binary or non-UTF-8 file a directory or glob held (they are left out, and said so)."""
    if not path:
        raise FileNotFoundError(f"data.path is not set; data.source={source!r} needs a file, a directory or a glob")
    expanded = os.path.expanduser(path)

    def check(f: str) -> str | None:  # (hf reads a compressed file decompressed: its bytes say nothing)
        return binary_reason(f) if skip_binary and not (source == "hf" and f.endswith(_COMPRESSED)) else None

    if os.path.isfile(expanded):
        if why := check(expanded):
            raise DataError(
                f"data.path={path!r} {why}; data.source={source!r} reads UTF-8 text: give a text file "
                "(convert with iconv -t utf-8) or a directory written by `dilocox data prepare` "
                "with data.source=memmap"
            )
        return [os.path.abspath(expanded)]
    if os.path.isdir(expanded):
        files = _walk(expanded)
        if not files:
            raise DataError(
                f"data.path={path!r} is an empty directory; put text files in it or point data.path "
                "at a text file, a directory of text files or a glob"
            )
    else:
        files = sorted(f for f in glob.glob(expanded, recursive=True) if os.path.isfile(f))
        if not files:
            raise FileNotFoundError(
                f"data.path={path!r} does not exist (resolved to {os.path.abspath(expanded)!r}, "
                f"no file, directory or glob match); data.source={source!r} needs a file, a directory or a glob"
            )
    found, files, first_why = files, [], ""
    for f in found:
        why = check(f)
        if why is None:
            files.append(os.path.abspath(f))
            continue
        first_why = first_why or why
        if skipped is not None:
            skipped.append((os.path.abspath(f), why))
    if not files:
        raise DataError(
            f"data.path={path!r} matched no text files ({len(found)} binary file(s) skipped, e.g. "
            f"{found[0]!r}, which {first_why}); data.source={source!r} reads UTF-8 text"
        )
    return files


def skipped_note(skipped: list | None, n: int | None = None) -> str | None:
    """The one line that says which files of a text directory or glob were left out as binary or not UTF-8, or
    None. ``skipped``: [path, why] pairs (the first few), ``n``: how many in all."""
    if not skipped:
        return None
    n = n or len(skipped)
    path, why = skipped[0]
    more = f" and {n - 1} more" if n > 1 else ""
    return (
        f"note: data.path: {n} file(s) left out as binary or not UTF-8: {path} {why}{more}; to train on a text "
        "file, convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
    )


def _stat_digest(files: list[str]) -> str:
    h = hashlib.sha256()
    for f in files:
        st = os.stat(f)
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _hf_local(path: str | None) -> list[str] | None:
    """Local files for an hf source, or None when ``path`` names a hub dataset."""
    if not path:
        raise FileNotFoundError("data.path is not set; data.source='hf' needs a hub dataset name or local data files")
    expanded = os.path.expanduser(path)
    if os.path.exists(expanded) or glob.glob(expanded, recursive=True):
        return local_files(path, "hf", skip_binary=False)
    return None


def fingerprint(cfg: DataConfig) -> str:
    """A cheap identity of the raw source (file names, sizes, mtimes; no reading).

    Keys the tokenizer and prepared-data caches, so an edited file invalidates them. A hub
    dataset cannot be fingerprinted offline: its name, split and field stand for it.
    """
    if cfg.source == "stdlib":
        return _stat_digest(stdlib_files()) + f"|python {sys.version}"
    if cfg.source in ("prose", "docs"):
        import pydoc_data.topics as t

        extra = stdlib_files() if cfg.source == "docs" else []
        return _stat_digest([t.__file__, *extra]) + f"|python {sys.version}"
    if cfg.source == "text":  # every file, the binary ones left out too: converting or removing one re-prepares
        return _stat_digest(local_files(cfg.path, "text", skip_binary=False))
    if cfg.source == "hf":
        files = _hf_local(cfg.path)
        where = _stat_digest(files) if files else f"hub:{cfg.path}"
        return f"{where}|{cfg.hf_config}|{cfg.hf_split}|{cfg.hf_text_field}"
    raise ValueError(f"data.source={cfg.source!r} has no raw corpus to fingerprint")


# --------------------------------------------------------------------------- reading


class _Capped:
    """Passes documents through until ``max_bytes`` UTF-8 bytes; truncates the last one (streaming: one at a time)."""

    def __init__(self, max_bytes: int | None):
        self.max_bytes, self.total, self.cut = max_bytes, 0, False

    @property
    def full(self) -> bool:
        return self.cut or self.max_bytes is not None and self.total >= self.max_bytes

    def take(self, raw: bytes) -> str | None:
        """The document ``raw`` as kept (decoded; cut at the cap, before a character the cap would split), or None
        when nothing of it is kept."""
        if self.max_bytes is not None and self.total + len(raw) > self.max_bytes:
            raw = _whole_chars(raw[: self.max_bytes - self.total])
            self.cut = True
        if not raw:
            return None
        self.total += len(raw)
        return raw.decode("utf-8", errors="replace")

    def report(self, source_bytes: int | None) -> dict | None:
        """``Corpus.cut`` / ``DocStream.cut``: what the cap cut, else None."""
        if not self.cut:
            return None
        return {"max_bytes": self.max_bytes, "source_bytes": source_bytes, "kept_bytes": self.total}


def _whole_chars(raw: bytes) -> bytes:
    """``raw`` less a UTF-8 character its end cuts (b"" when that is all it holds)."""
    for k in range(1, min(4, len(raw)) + 1):
        b = raw[-k]
        if b & 0xC0 != 0x80:  # the last lead (or ASCII) byte: does its character end within raw?
            return raw[:-k] if (4 if b >= 0xF0 else 3 if b >= 0xE0 else 2 if b >= 0xC0 else 1) > k else raw
    return raw


def _docstring_raws(files: list[str]):
    """Per file, its module, class and function docstrings (breadth first: module, then classes and functions),
    blank-line separated, as UTF-8; a file without any, or that does not parse, gives nothing."""
    for f in files:
        try:
            with open(f, "rb") as fh:
                tree = ast.parse(fh.read(), f)
        except (SyntaxError, ValueError):
            continue
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        parts = [d for n in ast.walk(tree) if isinstance(n, kinds) and (d := ast.get_docstring(n))]
        if parts:
            yield "\n\n".join(parts).encode("utf-8")


# data.source=text reads a file larger than this as several documents, each cut at a line end: a 1 GB file of one
# document would otherwise be held, encoded and (for a BPE) trained on at once (~150x its size in memory). Each
# piece ends with the end-of-document token, one per MB; the stdlib corpora are not cut; an hf row over it is.
TEXT_PIECE_BYTES = 1 << 20


def _pieces(fh, limit: int):
    """The bytes of the open file ``fh`` in pieces of at most ``limit`` bytes, each cut after its last newline (or,
    in a piece without one, before a UTF-8 character that the cut would split)."""
    rest = b""
    while chunk := fh.read(limit - len(rest)):
        buf = rest + chunk
        if len(buf) < limit:
            rest = buf
            break
        cut = buf.rfind(b"\n") + 1 or _char_end(buf)
        yield buf[:cut]
        rest = buf[cut:]
    if rest:
        yield rest


def _char_end(buf: bytes) -> int:
    """The length of ``buf`` less a UTF-8 character its end cuts (the whole length when none is cut)."""
    i = len(buf) - 1
    while i > 0 and len(buf) - i < 4 and buf[i] & 0xC0 == 0x80:  # back over continuation bytes to the lead byte
        i -= 1
    lead = buf[i]
    need = 4 if lead >= 0xF0 else 3 if lead >= 0xE0 else 2 if lead >= 0xC0 else 1
    return i if i > 0 and i + need > len(buf) else len(buf)


UTF8_BOM = b"\xef\xbb\xbf"


def _file_raws(files: list[str], piece: int | None = None):
    """Each file's bytes as one document, or (``piece``) a larger file as documents of at most ``piece`` bytes. A
    leading UTF-8 byte order mark (Windows editors write one) is not text: it is skipped, not trained on."""
    for f in files:
        with open(f, "rb") as fh:
            if fh.read(len(UTF8_BOM)) != UTF8_BOM:
                fh.seek(0)
            if piece is None or os.fstat(fh.fileno()).st_size <= piece:
                yield fh.read()
            else:
                yield from _pieces(fh, piece)


def _is_saved_dataset(path: str | None) -> bool:
    """A directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (``datasets.load_from_disk``)."""
    p = os.path.expanduser(path or "")
    return os.path.isdir(p) and any(os.path.exists(os.path.join(p, n)) for n in ("state.json", "dataset_dict.json"))


def _hf_rows(cfg: DataConfig, skipped: list[tuple[str, str]] | None = None):
    """(an iterable of rows, a description) for data.source=hf; every failure is a one-line DataError. Local text
    files are checked as data.source=text's (``binary_reason``): a binary or non-UTF-8 one is left out (``skipped``),
    or refused when it is data.path itself; the few invalid bytes of one kept are decoded as U+FFFD (as text's)."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            "data.source='hf' needs the datasets package, which is not installed: pip install datasets"
        ) from None
    name = f"[{cfg.hf_config}]" if cfg.hf_config else ""
    if _is_saved_dataset(cfg.path):  # offline: a save_to_disk directory (memory-mapped Arrow files)
        ds = datasets.load_from_disk(os.path.expanduser(cfg.path))
        if isinstance(ds, datasets.DatasetDict):
            if cfg.hf_split not in ds:
                raise DataError(
                    f"data.hf_split={cfg.hf_split!r} is not a split of the dataset directory {cfg.path}; "
                    f"its splits: {sorted(ds)}"
                )
            ds = ds[cfg.hf_split]
        return ds, f"dataset directory {cfg.path}[{cfg.hf_split}]"
    files = _hf_local(cfg.path)
    if files is not None:
        exts = set()
        for f in files:
            base = f[: -len(c)] if (c := next((c for c in _COMPRESSED if f.endswith(c)), "")) else f
            exts.add(os.path.splitext(base)[1].lower())
        builders = {HF_BUILDERS.get(e) for e in exts}
        if None not in builders and len(builders) == 1:
            builder = builders.pop()
            extra = {}
            if builder == "text":  # datasets reads a NUL as text and stops at the first invalid byte
                files = local_files(cfg.path, "hf", skipped=skipped)
                extra = {"sample_by": "document", "encoding_errors": "replace"}
            ds = datasets.load_dataset(
                builder, data_files={cfg.hf_split: files}, split=cfg.hf_split, streaming=True, **extra
            )
            return ds, f"{builder} files {cfg.path}"
        if not os.path.isdir(os.path.expanduser(cfg.path)):
            raise DataError(
                f"data.path={cfg.path!r} has files of types {sorted(exts)}; data.source='hf' reads one "
                f"kind at a time out of {sorted(HF_BUILDERS)}"
            )
        # a local copy of a hub dataset (README.md + data files, configs in its README): datasets reads it offline
    where = "local dataset" if files is not None else "hub dataset"
    try:
        ds = datasets.load_dataset(os.path.expanduser(cfg.path), cfg.hf_config, split=cfg.hf_split, streaming=True)
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; the message is what matters
        raise DataError(
            f"data.path={cfg.path!r}: loading it as a {where} (config data.hf_config={cfg.hf_config!r}, split "
            f"data.hf_split={cfg.hf_split!r}) failed: {' '.join(str(e).split())[:500]}"
        ) from None
    return ds, f"{where} {cfg.path}{name}[{cfg.hf_split}]"


class DocStream:
    """The configured corpus as a stream of documents, read one at a time (memory: one document), in the order and
    with the content ``read_corpus`` returns; iterate it again for another pass. After a complete pass:
    ``n_docs``, ``nbytes`` (UTF-8), ``cut`` (what data.max_bytes cut, else None) and ``description``."""

    def __init__(self, cfg: DataConfig):
        if cfg.source not in ("stdlib", "prose", "docs", "text", "hf"):
            raise ValueError(f"data.source={cfg.source!r} is not a raw corpus (use prepare() for memmap)")
        self.cfg = cfg
        self.n_docs, self.nbytes, self.cut, self.description = 0, 0, None, ""
        self.skipped: list[tuple[str, str]] = []  # text, hf text files: left out as binary / not UTF-8 (local_files)

    def _raws(self):
        """(raw documents as bytes, a function giving the source's size once the cap cut it, a description)."""
        cfg = self.cfg
        if cfg.source == "stdlib":
            root = stdlib_root()
            files = stdlib_files(root)
            size = lambda: sum(os.path.getsize(f) for f in files)  # noqa: E731
            return _file_raws(files), size, f"stdlib {root} (Python {sys.version.split()[0]})"
        if cfg.source in ("prose", "docs"):
            import pydoc_data.topics as t

            raws = (t.topics[name].encode("utf-8") for name in sorted(t.topics))
            size = lambda: sum(len(v.encode("utf-8")) for v in t.topics.values())  # noqa: E731
            if cfg.source == "prose":
                return raws, size, f"prose: pydoc_data.topics (Python {sys.version.split()[0]})"
            files = stdlib_files(stdlib_root())
            raws = itertools.chain(raws, _docstring_raws(files))

            def size() -> int:
                return sum(len(r) for r in _docstring_raws(files)) + sum(len(v.encode()) for v in t.topics.values())

            return raws, size, f"docs: pydoc_data.topics + stdlib docstrings (Python {sys.version.split()[0]})"
        if cfg.source == "text":
            self.skipped = []
            files = local_files(cfg.path, "text", skipped=self.skipped)
            size = lambda: sum(os.path.getsize(f) for f in files)  # noqa: E731
            return _file_raws(files, TEXT_PIECE_BYTES), size, f"text {cfg.path}"
        self.skipped = []
        ds, where = _hf_rows(cfg, self.skipped)
        files_of_text = where.startswith("text files")  # one row per local file (sample_by=document)

        def rows():
            for n, row in enumerate(ds):
                if cfg.hf_text_field not in row:
                    raise DataError(
                        f"data.hf_text_field={cfg.hf_text_field!r} is not a column of {where}; columns: {sorted(row)}"
                    )
                text = row[cfg.hf_text_field]
                if text is None:  # a null cell: no document (not the text "None")
                    continue
                if not isinstance(text, str):
                    raise DataError(
                        f"data.hf_text_field={cfg.hf_text_field!r} of {where} holds a {type(text).__name__}, not "
                        f"text (row {n}: {str(text)[:80]!r}); name the column that holds the documents' text"
                    )
                if files_of_text and text.startswith("\ufeff"):  # a file's UTF-8 byte order mark: not text
                    text = text[1:]
                raw = text.encode("utf-8")
                if len(raw) <= TEXT_PIECE_BYTES:
                    yield raw
                else:  # a long row (a whole local text file): pieces cut at a line end, as data.source=text's
                    yield from _pieces(io.BytesIO(raw), TEXT_PIECE_BYTES)

        return rows(), lambda: None, f"hf {where}, field {cfg.hf_text_field!r}"

    def __iter__(self):
        acc = _Capped(self.cfg.max_bytes)
        raws, size, desc = self._raws()
        n, nbytes = 0, 0
        for raw in raws:
            if acc.full:
                acc.cut = True
                break
            doc = acc.take(raw)
            if doc is not None:
                n += 1
                nbytes += len(doc.encode("utf-8"))
                yield doc
        self.n_docs, self.nbytes, self.cut = n, nbytes, acc.report(size() if acc.cut else None)
        self.description = f"{desc}: {n} documents, {nbytes / 1e6:.2f} MB"
        if not n:
            raise DataError(
                f"data.source={self.cfg.source!r} data.path={self.cfg.path!r} is empty (0 bytes of text); give a "
                "non-empty corpus"
            )


def read_corpus(cfg: DataConfig) -> Corpus:
    """Read the configured source into documents (deterministic; capped only at an opt-in data.max_bytes). The whole
    corpus in memory: ``prepare`` streams it (``DocStream``) instead."""
    stream = DocStream(cfg)
    docs = list(stream)
    return Corpus(docs, stream.description, stream.cut)


# --------------------------------------------------------------------------- train/val split


def _cut_at_line(doc: str, head_bytes: int) -> tuple[str, str]:
    """Cut ``doc`` at the first line end after ``head_bytes`` UTF-8 bytes (or exactly there)."""
    k = len(doc.encode("utf-8")[:head_bytes].decode("utf-8", errors="ignore"))
    nl = doc.find("\n", max(k - 1, 0))
    cut = nl + 1 if 0 <= nl < len(doc) - 1 else k
    return doc[:cut], doc[cut:]


def split_plan(sizes, val_fraction: float) -> tuple[int, int | None]:
    """Where ``split_documents`` splits documents of UTF-8 ``sizes``: (i, None) = train docs[:i], val docs[i:]; or
    (i, head_bytes) = document i is cut by ``cut_document(docs[i], head_bytes)``: its head ends train, its tail starts
    validation."""
    sizes = np.asarray(sizes, dtype=np.int64)
    total = int(sizes.sum())
    if total < 2:
        raise DataError("the corpus is too small for a train/validation split; raise data.max_bytes")
    want = val_fraction * total
    suffix = np.concatenate([np.cumsum(sizes[::-1])[::-1], [0]])  # suffix[c] = bytes of docs[c:]
    n = len(sizes)
    if n > 1:
        dist = np.abs(suffix[1:n] - want)
        best = int(np.flatnonzero(dist == dist.min())[-1]) + 1  # the closest boundary; the last on a tie
        if want / 2 <= suffix[best] <= 2 * want:
            return best, None
    i = int(np.flatnonzero(suffix[:n] >= want)[-1])  # the document holding the target
    return i, max(1, int(sizes[i]) - int(want - suffix[i + 1]))


def cut_document(doc: str, head_bytes: int) -> tuple[str, str]:
    """The (head, tail) of the one document that a split cuts (``split_plan``): both non-empty."""
    head, tail = _cut_at_line(doc, head_bytes)
    if not tail:
        head, tail = doc[:-1], doc[-1:]
    return head, tail


def split_documents(docs: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """Held-out split: validation = the last documents, ~val_fraction of the bytes.

    The split is document-level at the boundary that brings the validation share closest to
    ``val_fraction``. Only when no boundary is within a factor 2 of it (a document bigger than
    the whole validation target straddles it, or the corpus is one file) is that one document
    cut at a line end: its head stays in train and its tail starts validation. Either way no
    text is in both splits, and both are non-empty.
    """
    i, head_bytes = split_plan([len(d.encode("utf-8")) for d in docs], val_fraction)
    if head_bytes is None:
        return docs[:i], docs[i:]
    head, tail = cut_document(docs[i], head_bytes)
    train, val = docs[:i] + ([head] if head else []), [tail] + docs[i + 1 :]
    if not train:
        raise DataError("the corpus is too small for a train/validation split; raise data.max_bytes")
    return train, val
