"""Loading a checkpoint: one shard with its checks, and the newest good checkpoint with fallback.

``load_checkpoint`` checks that a step is complete, written by the same layout and settings, and
(``verify``) that this rank's shard matches its size and hash, then loads it with
``torch.load(weights_only=True)``. ``load_latest`` makes every rank load the same step, falls back
past a damaged one (set aside as ``<step dir>.corrupt``) and points ``latest`` at the one loaded.
``all_ranks_agree``/``all_ranks_min`` are the agreements over the default process group that both
saving and loading use (identity without one).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import torch

from dilocox.checkpoint.layout import (
    CheckpointError,
    CorruptCheckpointError,
    _atomic_write_text,
    _step_of,
    complete_steps,
    find_latest,
    read_meta,
    shard_path,
    step_dir_name,
    verify_shard,
)


def all_ranks_agree(flag: bool) -> bool:
    """True iff ``flag`` is true on every rank of the default group (a MIN all-reduce; also a barrier)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return bool(flag)
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def all_ranks_min(value: int) -> int:
    """The minimum of ``value`` over all ranks of the default group (identity without a group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return int(value)
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.int64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def load_checkpoint(
    step_dir: str, rank: int, world_size: int | None = None, expect: dict | None = None, verify: bool = True
) -> dict:
    """Load this rank's shard. Checks completeness, world size, any ``expect`` meta keys and (``verify``)
    the shard's size and hash; a damaged shard raises :class:`CorruptCheckpointError`."""
    meta = read_meta(step_dir)
    if world_size is not None and meta.get("world_size") != world_size:
        raise CheckpointError(
            f"checkpoint {step_dir} was written by {meta.get('world_size')} ranks but this run has {world_size}; "
            "resume with the same parallel layout (parallel.replicas/data/pipeline/tensor)"
        )
    for k, v in (expect or {}).items():
        if k in meta and meta[k] != v:
            raise CheckpointError(
                f"checkpoint {step_dir} has {k}={meta[k]!r} but this run has {k}={v!r}; resume with "
                "the same setting or start a fresh run_dir"
            )
    path = shard_path(step_dir, rank)
    if not os.path.exists(path):
        raise CheckpointError(
            f"checkpoint shard {path} is missing; the checkpoint is incomplete — resume from an earlier step directory"
        )
    hint = (
        f"; delete or move {os.path.dirname(path)} to resume from the previous checkpoint, or start fresh in a new "
        "log.run_dir"
    )
    try:
        if verify:
            verify_shard(step_dir, rank, meta)
        return torch.load(path, map_location="cpu", weights_only=True)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{e}{hint}") from None
    except Exception as e:  # noqa: BLE001 - torch raises many types for a damaged zip
        raise CorruptCheckpointError(
            f"checkpoint shard {path} is corrupt or truncated ({type(e).__name__}: {e}){hint}"
        ) from None


def _warn(msg: str) -> None:
    print(f"WARNING: {msg}", file=sys.stderr, flush=True)


def load_latest(
    ckpt_dir: str,
    rank: int,
    world_size: int | None = None,
    expect: dict | None = None,
    fallback: bool = True,
    agree: Callable[[bool], bool] | None = None,
    reduce_min: Callable[[int], int] | None = None,
    warn: Callable[[str], None] = _warn,
) -> tuple[str, dict] | None:
    """Load the newest good checkpoint in ``ckpt_dir``: (step dir, this rank's state), or None if none.

    Starts at :func:`find_latest`. If any rank's shard is damaged (size/hash mismatch, unreadable),
    then with ``fallback`` every rank warns and moves on to the previous complete checkpoint; else
    every rank raises :class:`CorruptCheckpointError`. All ranks load the same step: the candidate
    is the minimum over ranks (``reduce_min``) and success is agreed (``agree``). Damaged
    checkpoints passed over are renamed ``<step dir>.corrupt`` by rank 0 (so that neither a resume
    nor a later save at that step mistakes them for good ones) and ``latest`` names the loaded one.
    ``agree``/``reduce_min`` default to the default process group (identity without one)."""
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
        sd, err, corrupt = _try_load_step(step_dir, step, mine, rank, world_size, expect)
        if not agree(corrupt or not err):  # a layout mismatch or a missing directory: no fallback helps
            raise CheckpointError(err or f"another rank cannot load {step_dir} (see its log)")
        if agree(not err):
            break
        sd = None
        _fall_back_past(step_dir, err, rank, fallback, warn)
        skipped.append(step_dir)
        mine = [s for s in mine if s < step]
    if skipped:
        if rank == 0:
            _set_aside_damaged(ckpt_dir, skipped, step_dir, warn)
        agree(True)  # no rank goes on (and may save at a skipped step) before the damaged ones are set aside
    return step_dir, sd


def _try_load_step(
    step_dir: str, step: int, mine: list[int], rank: int, world_size: int | None, expect: dict | None
) -> tuple[dict | None, str, bool]:
    """Load this rank's shard of the agreed candidate ``step``: ``(state or None, error or '', damaged)``."""
    sd, err, corrupt = None, "", False
    try:
        if step not in mine:
            raise CheckpointError(
                f"rank {rank} does not see {step_dir} as complete; checkpoint.dir must be one "
                "directory shared by all ranks"
            )
        sd = load_checkpoint(step_dir, rank, world_size, expect)
    except CorruptCheckpointError as e:
        err, corrupt = str(e), True
    except CheckpointError as e:
        err = str(e)
    return sd, err, corrupt


def _fall_back_past(step_dir: str, err: str, rank: int, fallback: bool, warn: Callable[[str], None]) -> None:
    """A damaged ``step_dir`` (on some rank): raise without ``fallback``, else warn that it is passed over."""
    if not fallback:
        raise CorruptCheckpointError(
            (err or f"another rank's shard of {step_dir} is damaged (see its log)")
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
