"""Text files are judged whole, and long rows are cut (from the data review): data.source=text left a file out as
binary / not UTF-8 only on its first 64 KiB (a NUL past it became the byte tokenizer's end-of-document id, invalid
bytes past it U+FFFD); data.source=hf gave a whole local text file (or any long row) as one document."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import dilocox.data.sources as srcmod
from dilocox.config import DataConfig
from dilocox.data import DataError, prepare
from dilocox.data.sources import MAX_INVALID_UTF8, SNIFF_BYTES, TEXT_PIECE_BYTES, DocStream, binary_reason

ASCII = b"plain ascii line of text\n"  # 25 bytes


def _cfg(tmp_path, **kw) -> DataConfig:
    return DataConfig(cache_dir=str(tmp_path / "cache"), **kw)


def _ascii(n: int) -> bytes:
    """About ``n`` bytes (whole lines) of clean ASCII text: past the 64 KiB sniff window for n > 65536."""
    return ASCII * (n // len(ASCII) + 1)


def _stream(cfg: DataConfig) -> tuple[DocStream, list[str]]:
    s = DocStream(cfg)
    docs = list(s)
    assert s.n_docs == len(docs) and s.nbytes == sum(len(d.encode()) for d in docs)
    return s, docs


def _big_utf8(n: int) -> bytes:
    """About ``n`` bytes of UTF-8 text of 1-4 byte characters in lines of varied length, with one long line of no
    newline at all (the piece cut there falls between characters), so that cuts land inside characters' bytes."""
    lines, size, i = [], 0, 0
    while size < n:
        if i == 300:
            line = "日本語😀é" * 85000 + "\n"  # ~1.3 MB without a newline: a piece is cut between characters
        else:
            line = f"ligne {i}: café 日本語 😀 {'ü€' * (i % 37)}\n"
        lines.append(line)
        size += len(line.encode())
        i += 1
    return "".join(lines).encode()


def test_latin1_past_the_sniff_window_is_left_out_and_named(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    good = _ascii(1000)
    (d / "a_good.txt").write_bytes(good)
    head = _ascii(70_000)
    (d / "b_latin1.txt").write_bytes(head + "café crème déjà\n".encode("latin-1") * 2000)  # ~9% invalid past 64 KiB
    assert binary_reason(str(d / "b_latin1.txt")) is not None
    s, docs = _stream(_cfg(tmp_path, source="text", path=str(d)))
    assert docs == [good.decode()] and not any("\ufffd" in x for x in docs)
    [(path, why)] = s.skipped
    assert path == str(d / "b_latin1.txt")
    assert why.startswith("is not UTF-8 text (") and f"of its {len(head) + 16 * 2000} bytes are invalid UTF-8" in why
    assert why.endswith(f"the first at byte {len(head) + 3})")  # the é of the first "café"
    with pytest.raises(DataError, match=r"b_latin1.txt' is not UTF-8 text \(\d+\.\d% of its \d+ bytes"):
        list(DocStream(_cfg(tmp_path, source="text", path=str(d / "b_latin1.txt"))))
    (d / "a_good.txt").unlink()  # nothing left: the error says why the file is left out
    with pytest.raises(DataError, match=r"matched no text files .*b_latin1.txt', which is not UTF-8 text \(\d"):
        list(DocStream(_cfg(tmp_path, source="text", path=str(d))))


def test_a_nul_past_the_sniff_window_is_left_out_and_named(tmp_path):
    """A NUL anywhere (in the first scan piece past 64 KiB, or one 1.5 MB in): the file is left out whole; the
    byte tokenizer's end-of-document id (0) then appears only at documents' ends."""
    d = tmp_path / "corpus"
    d.mkdir()
    good = _ascii(100_000)
    (d / "a_good.txt").write_bytes(good)
    (d / "b_nul.txt").write_bytes(b"a" * 70_000 + b"\0" + b"b" * 100 + b"\n")
    far = _ascii(1_500_000)
    (d / "c_nul_far.txt").write_bytes(far + b"x\0y\n")
    s, docs = _stream(_cfg(tmp_path, source="text", path=str(d)))
    assert docs == [good.decode()]
    assert s.skipped == [
        (str(d / "b_nul.txt"), "has NUL bytes (first at byte 70000)"),
        (str(d / "c_nul_far.txt"), f"has NUL bytes (first at byte {len(far) + 1})"),
    ]
    p = prepare(_cfg(tmp_path, source="text", path=str(d), val_fraction=0.1))
    tokens = np.concatenate([p.train_tokens(), p.val_tokens()])
    assert int((tokens == 0).sum()) == p.meta["train_docs"] + p.meta["val_docs"] == 2  # a.txt cut by the split
    assert p.meta["skipped_count"] == 2


def test_a_clean_big_file_is_kept_and_its_pieces_join_to_it(tmp_path, monkeypatch):
    """A clean file over 1 MB with multi-byte characters across every boundary (the check's scan pieces, the read's
    pieces) is kept, as pieces of at most TEXT_PIECE_BYTES that join to its bytes exactly; a big file with a NUL
    near its end, next to it, is left out."""
    d = tmp_path / "corpus"
    d.mkdir()
    big = _big_utf8(2_600_000)
    (d / "a_big.txt").write_bytes(big)
    (d / "b_big_nul.txt").write_bytes(big[:-10] + b"\0" + big[-9:])
    s, docs = _stream(_cfg(tmp_path, source="text", path=str(d)))
    pieces = [x.encode() for x in docs]
    assert len(pieces) >= 3 and all(0 < len(x) <= TEXT_PIECE_BYTES for x in pieces)
    assert b"".join(pieces) == big and not any("\ufffd" in x for x in docs)
    assert s.skipped == [(str(d / "b_big_nul.txt"), f"has NUL bytes (first at byte {len(big) - 10})")]
    small = tmp_path / "chars.txt"
    small.write_bytes("😀é日".encode() * 8000)  # 72 kB: past the sniff window
    monkeypatch.setattr(srcmod, "SCAN_BYTES", 7)  # the scan cuts characters everywhere: none is counted invalid
    assert binary_reason(str(small)) is None
    small.write_bytes("😀é日".encode() * 7800 + b"\xe9x" * 500)  # 500 of 71,200 bytes (0.7%): still text
    assert binary_reason(str(small)) is None
    small.write_bytes("😀é日".encode() * 7800 + b"\xe9x" * 800)  # 800 of 71,800 bytes (1.1%): not text
    why = "is not UTF-8 text (1.1% of its 71800 bytes are invalid UTF-8, the first at byte 70200)"
    assert binary_reason(str(small)) == why


def test_the_one_percent_rule_is_over_the_whole_file(tmp_path):
    """Past the sniff window: a few invalid bytes (under 1% of the file) are kept as before (U+FFFD); over 1% of the
    whole file, the file is left out."""
    d = tmp_path / "corpus"
    d.mkdir()
    head = _ascii(70_000)
    n = len(head) + 30_000
    k_few = int(n * MAX_INVALID_UTF8 / 2)
    few = head + b"\xe9" * k_few + _ascii(30_000 - k_few)[: 30_000 - k_few]
    (d / "a_few.txt").write_bytes(few)
    many = head + (b"\xe9" + b"x" * 19) * 1500  # 5% of the last 30 kB, 1.5% of the file
    (d / "b_many.txt").write_bytes(many)
    assert len(head) > SNIFF_BYTES and len(few) == len(many) == n
    s, docs = _stream(_cfg(tmp_path, source="text", path=str(d)))
    assert docs == [few.decode("utf-8", errors="replace")] and docs[0].count("\ufffd") == k_few
    [(path, why)] = s.skipped
    assert path == str(d / "b_many.txt") and why == (
        f"is not UTF-8 text (1.5% of its {n} bytes are invalid UTF-8, the first at byte {len(head)})"
    )


# --------------------------------------------------------------------------- hf


def _hf_offline(monkeypatch):
    pytest.importorskip("datasets", reason="the datasets package is not installed")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def test_hf_a_big_local_text_file_is_read_as_pieces(tmp_path, monkeypatch):
    _hf_offline(monkeypatch)
    big = _big_utf8(2_500_000)
    f = tmp_path / "big.txt"
    f.write_bytes(big)
    _, docs = _stream(_cfg(tmp_path, source="hf", path=str(f)))
    pieces = [x.encode() for x in docs]
    assert len(pieces) >= 3 and all(0 < len(x) <= TEXT_PIECE_BYTES for x in pieces)
    assert b"".join(pieces) == big
    assert all(x.endswith(b"\n") for x in pieces[:-1] if b"\n" in x)  # cut at a line end where the piece has one


def test_hf_a_long_jsonl_row_is_read_as_pieces(tmp_path, monkeypatch):
    _hf_offline(monkeypatch)
    long = _big_utf8(2_500_000).decode()
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("short row", long, "last row")))
    _, docs = _stream(_cfg(tmp_path, source="hf", path=str(f)))
    assert docs[0] == "short row" and docs[-1] == "last row"
    middle = [x.encode() for x in docs[1:-1]]
    assert len(middle) >= 3 and all(0 < len(x) <= TEXT_PIECE_BYTES for x in middle)
    assert b"".join(middle) == long.encode()


def test_hf_local_text_files_are_judged_as_the_text_source(tmp_path, monkeypatch):
    """hf over local text files: a NUL (datasets read it as text) or over 1% invalid UTF-8 (datasets stopped with a
    UnicodeDecodeError) leaves the file out and names it, as data.source=text; a few invalid bytes are U+FFFD."""
    _hf_offline(monkeypatch)
    d = tmp_path / "corpus"
    d.mkdir()
    good = _ascii(1000)
    (d / "a_good.txt").write_bytes(good)
    few = _ascii(10_000) + b"caf\xe9\n" + _ascii(10_000)
    (d / "b_few.txt").write_bytes(few)
    (d / "c_nul.txt").write_bytes(b"a" * 70_000 + b"\0b\n")
    (d / "d_latin1.txt").write_bytes(_ascii(70_000) + "café crème\n".encode("latin-1") * 2000)
    s, docs = _stream(_cfg(tmp_path, source="hf", path=str(d)))
    assert docs == [good.decode(), few.decode("utf-8", errors="replace")]
    assert [(os.path.basename(p), why.split(" (")[0]) for p, why in s.skipped] == [
        ("c_nul.txt", "has NUL bytes"),
        ("d_latin1.txt", "is not UTF-8 text"),
    ]
    with pytest.raises(DataError, match=r"c_nul.txt' has NUL bytes \(first at byte 70000\); data.source='hf'"):
        list(DocStream(_cfg(tmp_path, source="hf", path=str(d / "c_nul.txt"))))


def test_each_file_is_scanned_once_over_the_passes_of_a_prepare(tmp_path):
    """(From a review of this change: the whole-file scan ran again on every pass over the corpus, two with the byte
    tokenizer, three with a BPE: a corpus larger than the page cache was read twice as often as before.)"""
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(4):
        (d / f"{i}.txt").write_bytes(_ascii(SNIFF_BYTES + 1000))
    srcmod._verdict.cache_clear()
    prepare(_cfg(tmp_path, source="text", path=str(d)))
    assert srcmod._verdict.cache_info().misses == 4
    os.utime(d / "0.txt", ns=(1, 1))  # a changed file is judged again
    assert binary_reason(str(d / "0.txt")) is None and srcmod._verdict.cache_info().misses == 5


def test_hf_compressed_text_files_are_read_not_judged_by_their_compressed_bytes(tmp_path, monkeypatch):
    """(From a review of this change: the binary check read a .txt.gz's compressed bytes, so every compressed text
    file of data.source=hf was refused as binary.)"""
    import gzip

    _hf_offline(monkeypatch)
    d = tmp_path / "gz"
    d.mkdir()
    for i in range(3):
        with gzip.open(d / f"part{i}.txt.gz", "wt") as f:
            f.write(f"document {i}\nhello world\n")
    for path in (str(d), str(d / "part0.txt.gz")):
        s, docs = _stream(_cfg(tmp_path, source="hf", path=path))
        assert docs[0].startswith("document 0\nhello world") and not s.skipped
