"""``dilocox data prepare --out DIR`` over a directory prepared before: replaced only when it holds the same data."""

from __future__ import annotations

from dilocox.data.sources import DataError


def check_replaces(out_dir: str, old, new: dict) -> None:
    """``dilocox data prepare --out DIR``: refuse to replace a prepared ``DIR`` whose data differs from what was just
    built (``new``: its meta), since a run trained on it could no longer resume; the same text, tokenizer and token
    counts are replaced (a file's mtime, the cache format or the Python version changed the key, nothing else), and
    a damaged one (``old`` None: it does not load) is built again. Other data is refused, named."""
    if old is None:
        return
    differ = [k for k in ("content_sha256", "train_tokens", "val_tokens", "dtype") if old.meta.get(k) != new.get(k)]
    if old.sampler_args()["tokenizer"] != new.get("tokenizer_sha256"):
        differ.append("tokenizer")
    if differ:
        raise DataError(
            f"--out {out_dir!r} holds other data than this build ({old.meta.get('source', '?')}; its "
            f"{', '.join(differ)} differ): a run trained on it could not resume on the new one; give --out a new "
            "directory (or delete this one first)"
        )
