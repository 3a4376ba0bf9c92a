"""The one way dilocox replaces a file: write a temporary file beside it, flush it to disk, rename it over the old.

A reader (another rank, a resumed run, ``dilocox report``) sees the old file or the new one, never half of one; a
crash or an error while writing leaves the old file as it was and no temporary file behind. Every writer of a file
that something later trusts goes through ``atomic_path`` (checkpoint shards and markers, the run dir's configs and
metrics, prepared tokenizers, HF exports, the SWARM peers' results, the delay switch's binary).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def atomic_path(path: str, sync: bool = True) -> Iterator[str]:
    """Yield a temporary name in ``path``'s directory for the caller to write; on a clean exit fsync it (``sync``:
    False when the caller fsynced its own handle) and rename it onto ``path``; on an error remove it and re-raise."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    # a unique name, created exclusively: writers on other hosts of a shared file system or in other threads never
    # collide; mode 0666 less the umask, as open() would give the file itself (mkstemp's 0600 would not)
    while True:
        tmp = os.path.join(d, f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
        try:
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            break
        except FileExistsError:
            continue
    try:
        yield tmp
        if sync:
            _fsync(tmp, os.O_RDONLY)
        replace_durably(tmp, path)  # (the rename itself, durable)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def sync_dir(path: str) -> None:
    """fsync the directory ``path``: the renames, creations and removals of its entries survive a power loss."""
    _fsync(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def replace_durably(src: str, dst: str) -> None:
    """``os.replace(src, dst)`` (atomic: ``dst`` is the old file or ``src``'s, never neither), made durable."""
    os.replace(src, dst)
    sync_dir(os.path.dirname(os.path.abspath(dst)))


def _fsync(path: str, flags: int) -> None:
    try:
        fd = os.open(path, flags)
    except OSError:  # (a directory that cannot be opened for reading: the rename is still atomic)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8), atomically and durably."""
    with atomic_path(path, sync=False) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
