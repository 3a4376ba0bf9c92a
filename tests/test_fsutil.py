"""dilocox.fsutil: the one atomic replace of a file (issue 43: it was written five times)."""

from __future__ import annotations

import os

import pytest

from dilocox.fsutil import atomic_path, atomic_write_text


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "sub" / "f.txt"
    atomic_write_text(str(path), "old")
    with pytest.raises(RuntimeError, match="disk"):
        with atomic_path(str(path)) as tmp:
            assert os.path.dirname(tmp) == str(path.parent)  # beside it: the rename stays on one file system
            with open(tmp, "w") as f:
                f.write("half of the new")
            raise RuntimeError("disk full")
    assert path.read_text() == "old" and os.listdir(path.parent) == ["f.txt"]


def test_a_clean_write_replaces_and_creates_the_directory(tmp_path):
    path = tmp_path / "new" / "deeper" / "g.bin"
    with atomic_path(str(path)) as tmp:
        with open(tmp, "wb") as f:
            f.write(b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01" and os.listdir(path.parent) == ["g.bin"]
    atomic_write_text(str(path), "text")
    assert path.read_text() == "text"


def test_every_writer_uses_it():
    """No module of dilocox renames a temp file onto its target by itself any more (data/prepare.py's publish of a
    whole prepared directory and checkpoint/legacy.py's swap of a converted step directory, renames of directories,
    are the other atomic moves)."""
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dilocox")
    offenders = []
    for d, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py") and name != "fsutil.py":
                with open(os.path.join(d, name)) as f:
                    for i, line in enumerate(f, 1):
                        if "os.replace(tmp" in line:
                            offenders.append(f"{os.path.relpath(os.path.join(d, name), root)}:{i}")
    assert not offenders, offenders
