"""The one way dilocox replaces a file: write a temporary file beside it, flush it to disk, rename it over the old.

A reader (another rank, a resumed run, ``dilocox report``) sees the old file or the new one, never half of one; a
crash or an error while writing leaves the old file as it was and no temporary file behind. Every writer of a file
that something later trusts goes through ``atomic_path`` (checkpoint shards and markers, the run dir's configs and
metrics, prepared tokenizers, HF exports, the SWARM peers' results, the delay switch's binary).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def atomic_path(path: str, sync: bool = True) -> Iterator[str]:
    """Yield a temporary name in ``path``'s directory for the caller to write; on a clean exit fsync it (``sync``:
    False when the caller fsynced its own handle) and rename it onto ``path``; on an error remove it and re-raise."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp.{os.getpid()}")
    try:
        yield tmp
        if sync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def atomic_write_text(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8), atomically and durably."""
    with atomic_path(path, sync=False) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
