"""Loading a checkpoint: one step with its checks, and the newest good checkpoint with fallback.

``load_step`` (collective) checks that a step is complete, in this format and written with the same settings
(``expect``), that its files match their sizes and hashes (each rank hashes a stripe of them), then asks the
``Reader`` for this rank's targets and fills them with ``torch.distributed.checkpoint.load`` (which reads the
saved chunks overlapping each target: another layout reshards by itself). ``load_latest`` makes every rank load
the same step, falls back past a damaged one (set aside as ``<step dir>.corrupt``) and points ``latest`` at the
one loaded.
``all_ranks_agree``/``all_ranks_min`` are the agreements over the default process group that both
saving and loading use (identity without one).
"""

from __future__ import annotations

import errno
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Protocol

import torch

from dilocox.checkpoint.layout import (
    _STEP_RE,
    CheckpointError,
    CorruptCheckpointError,
    _atomic_write_text,
    _step_of,
    complete_steps,
    dcp_dirs,
    find_latest,
    read_meta,
    step_dir_name,
    verify_files,
)


def all_ranks_agree(flag: bool) -> bool:
    """True iff ``flag`` is true on every rank of the default group (a MIN all-reduce; also a barrier)."""
    import torch.distributed as dist

    from dilocox.distributed.topology import default_group_device

    if not (dist.is_available() and dist.is_initialized()):
        return bool(flag)
    dev = default_group_device()
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def all_ranks_min(value: int) -> int:
    """The minimum of ``value`` over all ranks of the default group (identity without a group)."""
    import torch.distributed as dist

    from dilocox.distributed.topology import default_group_device

    if not (dist.is_available() and dist.is_initialized()):
        return int(value)
    dev = default_group_device()
    t = torch.tensor([value], dtype=torch.int64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


class Reader(Protocol):
    """What a loader needs from the state it restores (``Trainer``'s ``_Reader``). ``part``: ``(subdir, group,
    group size)`` of the DCP checkpoint it reads, as ``save_checkpoint`` took it; None: ``step_dir`` itself, read
    by every rank of the default group."""

    part: tuple[str, object, int] | None

    def prepare(self, step_dir: str, meta: dict) -> dict:
        """This rank's empty DCP targets for ``step_dir`` (raise :class:`CheckpointError` when it cannot fit)."""

    def finish(self, step_dir: str, meta: dict, targets: dict) -> dict:
        """Restore the state from the filled targets (raise to refuse it: every rank then raises); returns it."""


class WholeReader:
    """A ``Reader`` of every saved key of one DCP checkpoint (``step_dir/subdir``) as a full tensor: tools, tests.
    ``size``: the ranks reading it together (1: this process alone)."""

    def __init__(self, subdir: str = "", size: int | None = None):
        self.part = None if size is None else (subdir, None, size)
        self.subdir = subdir

    def prepare(self, step_dir: str, meta: dict) -> dict:
        from dilocox.checkpoint.reader import reader

        md = reader(os.path.join(step_dir, self.subdir)).read_metadata().state_dict_metadata
        return {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.items() if hasattr(m, "size")}

    def finish(self, step_dir: str, meta: dict, targets: dict) -> dict:
        return targets


def load_checkpoint(step_dir: str, expect: dict | None = None, verify: bool = True) -> dict:
    """Every key of ``step_dir`` (all its DCP checkpoints: one per replica) as a full tensor, in this process alone
    (checks as :func:`load_step`)."""
    out: dict = {}
    for d in dcp_dirs(step_dir):
        reader = WholeReader(os.path.relpath(d, step_dir), 1)
        out.update(load_step(step_dir, 0, 1, reader, expect, verify, agree=lambda flag: flag))
    return out


def check_meta(step_dir: str, meta: dict, expect: dict | None) -> None:
    """Refuse a checkpoint of another format or with another value of an ``expect`` key."""
    if "shards" in meta and "files" not in meta:
        raise CheckpointError(
            f"{step_dir} is a checkpoint of dilocox's earlier format (one torch.save file per rank); convert it to "
            f"the torch.distributed.checkpoint format once with: dilocox checkpoint convert {os.path.dirname(step_dir)}"
        )
    for k, v in (expect or {}).items():
        if k in meta and meta[k] != v:
            raise CheckpointError(
                f"checkpoint {step_dir} has {k}={meta[k]!r} but this run has {k}={v!r}; resume with "
                "the same setting or start a fresh run_dir"
            )


def _prepare(step_dir: str, rank: int, world_size: int, reader: Reader, expect: dict | None, verify: bool):
    """This rank's part before the collective read: ``(targets or None, error or '', damaged)``."""
    try:
        meta = read_meta(step_dir)
        check_meta(step_dir, meta, expect)
        if verify:  # the files are checked in stripes: each rank hashes 1/world of them
            verify_files(step_dir, meta, rank, world_size)
        return reader.prepare(step_dir, meta), "", False
    except CorruptCheckpointError as e:
        return None, str(e), True
    except CheckpointError as e:
        return None, str(e), False
    except Exception as e:  # noqa: BLE001 - an unreadable file (OSError, DCP's index): every rank must agree below
        again = _transient(e)
        return None, f"checkpoint {step_dir} cannot be read: {type(e).__name__}: {e}{_AGAIN * again}", not again


_AGAIN = " (a failure of the moment, not of its files: it is left as it is; run again)"
_TRANSIENT = {errno.ESTALE, errno.ETIMEDOUT, errno.EAGAIN, errno.EINTR, errno.ENOMEM}


def _transient(e: BaseException) -> bool:
    """A read that failed for a reason of the moment (a stale NFS handle, a time-out, no memory), not because a file
    is damaged: no fallback, and the checkpoint is not set aside as ``.corrupt``."""
    return isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno in _TRANSIENT)


def _read(step_dir: str, targets: dict, part: tuple) -> tuple[str, bool]:
    """The collective ``dcp.load`` into ``targets`` over the part's group; returns (an error or '', damaged) (every
    rank of the part sees the same outcome; the caller's agreement spans the parts)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # (lazy: DCP costs ~1 s at import)

    from dilocox.checkpoint.reader import reader
    from dilocox.checkpoint.save import _dcp_rank

    subdir, group, size = part
    try:
        with warnings.catch_warnings():  # (one process: DCP warns that it loads without a process group)
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(
                targets,
                storage_reader=reader(os.path.join(step_dir, subdir)),
                process_group=group,
                no_dist=_dcp_rank(group, size)[1],
            )
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP gathers every rank's failure into one
        from dilocox.checkpoint.save import dcp_failures

        failures = dcp_failures(e)
        why = "; ".join(f"rank {r}: {type(x).__name__}: {str(x)[:300]}" for r, x in failures.items())
        again = all(_transient(x) for x in failures.values())
        return f"checkpoint {step_dir} could not be read ({why}){_AGAIN * again}", not again
    return "", False


def load_step(
    step_dir: str,
    rank: int,
    world_size: int,
    reader: Reader,
    expect: dict | None = None,
    verify: bool = True,
    agree: Callable[[bool], bool] | None = None,
) -> dict:
    """Collective: check ``step_dir`` (format, ``expect`` keys, files against COMPLETE.json), read it into the
    reader's targets with DCP and return the reader's state. Every rank raises the same error."""
    agree = agree or all_ranks_agree
    targets, err, corrupt = _prepare(step_dir, rank, world_size, reader, expect, verify)
    if not agree(corrupt or not err):  # a setting or a missing directory somewhere: no fallback helps
        raise CheckpointError(err or f"another rank cannot load {step_dir} (see its log)")
    if not agree(not err):  # a damaged file somewhere: every rank raises the same kind (load_latest falls back)
        raise CorruptCheckpointError(err or f"another rank found a damaged file in {step_dir} (see its log)")
    err, corrupt = _read(step_dir, targets, getattr(reader, "part", None) or ("", None, world_size))
    if not agree(corrupt or not err):  # (a failure of the moment somewhere: no fallback, nothing set aside)
        raise CheckpointError(err or f"another rank could not read {step_dir} for now (see its log)")
    if not agree(not err):
        raise CorruptCheckpointError(err or f"another rank could not read {step_dir} (see its log)")
    from dilocox.config import ConfigError

    sd, err, kind = None, "", CheckpointError
    try:  # (what a rank refuses here, e.g. a tensor moved to another fragment, may differ between ranks)
        sd = reader.finish(step_dir, read_meta(step_dir), targets)
    except ConfigError as e:  # this run's input differs (e.g. the data since the save): a config error as at
        err, kind = str(e), ConfigError  # start-up (exit 2), not a fault of the checkpoint
    except Exception as e:  # noqa: BLE001 - every rank must reach the agreement
        err = str(e) if isinstance(e, CheckpointError) else f"restoring {step_dir}: {type(e).__name__}: {e}"
    if not agree(not err):
        raise kind(err or f"another rank could not restore {step_dir} (see its log)")
    return sd


def _warn(msg: str) -> None:
    print(f"WARNING: {msg}", file=sys.stderr, flush=True)


def load_latest(
    ckpt_dir: str,
    rank: int,
    world_size: int,
    reader: Reader,
    expect: dict | None = None,
    fallback: bool = True,
    agree: Callable[[bool], bool] | None = None,
    reduce_min: Callable[[int], int] | None = None,
    warn: Callable[[str], None] = _warn,
) -> tuple[str, dict] | None:
    """Load the newest good checkpoint in ``ckpt_dir``: (step dir, the reader's state), or None if none.

    Starts at :func:`find_latest`. If any rank finds a file damaged (size/hash mismatch, unreadable), then with
    ``fallback`` every rank warns and moves on to the previous complete checkpoint; else every rank raises
    :class:`CorruptCheckpointError`. All ranks load the same step: the candidate is the minimum over ranks
    (``reduce_min``) and success is agreed (``agree``). Damaged checkpoints passed over are renamed
    ``<step dir>.corrupt`` by rank 0 (so that neither a resume nor a later save at that step mistakes them for
    good ones) and ``latest`` names the loaded one. ``agree``/``reduce_min`` default to the default process group
    (identity without one)."""
    agree = agree or all_ranks_agree
    reduce_min = reduce_min or all_ranks_min
    newest = find_latest(ckpt_dir)
    mine = [_step_of(p) for p in complete_steps(ckpt_dir)]
    mine = [s for s in mine if newest is not None and s <= _step_of(newest)]
    none = 1 << 62
    skipped: list[str] = []
    while True:
        step = reduce_min(mine[-1] if mine else none)
        if step == none:
            if skipped:
                raise CorruptCheckpointError(
                    f"no loadable checkpoint in {ckpt_dir}: {', '.join(skipped)} are damaged; "
                    "move the directory away to start fresh"
                )
            return None
        step_dir = os.path.join(ckpt_dir, step_dir_name(step))
        try:
            if not agree(step in mine):
                raise CheckpointError(
                    f"rank {rank} does not see {step_dir} as complete; checkpoint.dir must be one directory shared "
                    "by all ranks"
                    if step not in mine
                    else f"another rank does not see {step_dir} as complete (see its log)"
                )
            sd = load_step(step_dir, rank, world_size, reader, expect, agree=agree)
            break
        except CorruptCheckpointError as e:
            _fall_back_past(step_dir, str(e), rank, fallback, warn)
        skipped.append(step_dir)
        mine = [s for s in mine if s < step]
    if skipped:
        if rank == 0:
            _set_aside_damaged(ckpt_dir, skipped, step_dir, warn)
        agree(True)  # no rank goes on (and may save at a skipped step) before the damaged ones are set aside
    return step_dir, sd


def _fall_back_past(step_dir: str, err: str, rank: int, fallback: bool, warn: Callable[[str], None]) -> None:
    """A damaged ``step_dir`` (on some rank): raise without ``fallback``, else warn that it is passed over."""
    if not fallback:
        raise CorruptCheckpointError(
            (err or f"a file of {step_dir} is damaged (see another rank's log)")
            + "; checkpoint.fallback=false: stopping (checkpoint.fallback=true resumes from the previous complete "
            "checkpoint)"
        )
    if err:
        warn(err)
    if rank == 0:
        warn(
            f"checkpoint {step_dir} is damaged on at least one rank; falling back to the previous complete "
            f"checkpoint (checkpoint.fallback=true): the steps after it are trained again"
        )


CONTINUE_DIR = "continue"  # <checkpoint dir>/continue/step_N: a finished run's state before outer.finish (train_state)


def set_aside_later(ckpt_dir: str, step_dir: str, warn: Callable[[str], None] = _warn) -> list[str]:
    """Rank 0, after a resume from ``step_dir`` (an explicit ``checkpoint.resume``, e.g. a rewind with a lower
    learning rate): rename every complete checkpoint of ``ckpt_dir`` after its step to ``<step dir>.superseded``.
    A save at a step whose directory is complete is skipped, so they would stand in for this run's own saves and
    ``latest``. ``latest`` names ``step_dir`` when it is in ``ckpt_dir``. A final checkpoint's continuation
    (``continue/step_N``) is renamed with it, first (a later save removes only bare ``step_N`` continuations), so
    renaming both back undoes the rewind. Returns the new names."""
    step = read_meta(step_dir).get("step")
    if not isinstance(step, int):  # (a COMPLETE.json edited by hand: the step its directory is named after)
        step = _step_of(step_dir.rstrip("/")) if _STEP_RE.match(os.path.basename(step_dir.rstrip("/"))) else 1 << 62
    later = [d for d in complete_steps(ckpt_dir) if _step_of(d) > step]
    here = os.path.abspath(step_dir)  # (a path given with a trailing "/": latest names the directory, not "")
    if later and os.path.dirname(here) == os.path.abspath(ckpt_dir):  # first: a crash between leaves it right
        _atomic_write_text(os.path.join(ckpt_dir, "latest"), os.path.basename(here) + "\n")
    moved = []
    for d in later:
        cont = os.path.join(ckpt_dir, CONTINUE_DIR, os.path.basename(d))
        dest, n = d + ".superseded", 0
        while os.path.exists(dest) or os.path.exists(os.path.join(ckpt_dir, CONTINUE_DIR, os.path.basename(dest))):
            n += 1  # (free beside its checkpoint and under continue/: a set-aside one deleted from one place only)
            dest = f"{d}.superseded.{int(time.time())}" + (f".{n}" if n > 1 else "")
        if os.path.isdir(cont):
            os.replace(cont, os.path.join(ckpt_dir, CONTINUE_DIR, os.path.basename(dest)))
        os.replace(d, dest)
        moved.append(dest)
    if moved:
        warn(
            f"resumed from {step_dir}: the {len(moved)} later checkpoint(s) of {ckpt_dir} are trained again and were "
            f"set aside as {', '.join(os.path.basename(m) for m in moved)} (delete them when no longer needed)"
        )
    return moved


def _set_aside_damaged(ckpt_dir: str, skipped: list[str], step_dir: str, warn: Callable[[str], None]) -> None:
    """Rank 0: rename the damaged checkpoints passed over to ``<step dir>.corrupt`` and point ``latest`` at
    the loaded ``step_dir``."""
    for d in skipped:
        dest = d + ".corrupt"
        if os.path.exists(dest):
            dest = f"{d}.corrupt.{int(time.time())}"
        try:
            os.replace(d, dest)
            warn(f"set the damaged checkpoint aside as {dest} (inspect or delete it)")
        except OSError as e:
            warn(f"could not rename damaged checkpoint {d}: {e}")
    try:
        _atomic_write_text(os.path.join(ckpt_dir, "latest"), os.path.basename(step_dir) + "\n")
    except OSError as e:
        warn(f"could not update {ckpt_dir}/latest: {e}")
    warn(f"resuming from {step_dir} instead of {skipped[0]}")
