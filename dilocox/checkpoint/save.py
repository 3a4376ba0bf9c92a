"""Saving a checkpoint on every rank, and the start-up check that one can be saved at all.

``save_checkpoint`` refuses a non-finite state and a disk without room before writing anything,
saves the ranks' state with ``torch.distributed.checkpoint`` (each rank its own files), lets rank 0 fold the
files' sizes and hashes into COMPLETE.json, move ``latest`` and prune old checkpoints, and removes the partial
step directory when any rank failed. Every decision that could differ between ranks goes through ``agree`` so all
ranks raise the same error. ``preflight`` checks at start-up that ``checkpoint.dir`` is writable
on every rank and has room for one checkpoint (warning below ``keep + 1``).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import time
import warnings
from collections.abc import Callable

from dilocox.checkpoint.layout import (
    _MB,
    HASH,
    CheckpointError,
    NonFiniteStateError,
    _atomic_write_text,
    _sum_path,
    complete_steps,
    find_latest,
    rank_files,
    record,
    step_dir_name,
)
from dilocox.checkpoint.state import estimate_bytes, nonfinite_tensors
from dilocox.fsutil import sync_dir


def disk_free(path: str) -> int:
    """Free bytes for an unprivileged writer on the filesystem of ``path`` (or its nearest parent)."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return shutil.disk_usage(p).free


def checkpoint_bytes(share: int, world_size: int) -> int:
    """One checkpoint's bytes in ``checkpoint.dir`` (one directory shared by all ranks), from this rank's share of it
    (:func:`estimate_bytes`: with data parallelism 1/D of what the D DP ranks hold alike, which DCP writes once):
    ``world_size`` such shares. Every rank checks with its own and the ranks agree, so the largest share decides
    (``preflight`` at start-up and ``save_checkpoint`` before each save alike)."""
    return share * world_size


def _no_space(path: str, need: int, where: str, what: str = "") -> str:
    return (
        f"no space left on device while writing {path} (needs ~{need / _MB:.1f} MB{what}, free "
        f"{disk_free(where) / _MB:.1f} MB)"
    )


def save_checkpoint(
    ckpt_dir: str,
    step: int,
    rank: int,
    world_size: int,
    state: dict,
    meta: dict | None = None,
    agree: Callable[[bool], bool] | None = None,
    keep: int = 2,
    part: tuple[str, object, int] | None = None,
    share: int | None = None,
) -> str:
    """Collective: save ``state`` (this rank's part of one DCP state dict, ``dilocox.checkpoint.names``) with
    ``torch.distributed.checkpoint``; rank 0 marks the step complete and moves ``latest``.

    ``part = (subdir, group, group size)``: the DCP checkpoint this rank belongs to, in ``step_dir/subdir``, saved
    by the ranks of ``group`` alone (the Trainer: one per replica, so DCP's plan exchange never crosses the slow
    link); default: one checkpoint in ``step_dir`` by every rank of the default group.

    ``agree(flag)`` must be a collective over all ranks that returns whether ``flag`` is true
    on every rank (``all_ranks_agree``); it also synchronises them. Every decision that could
    differ between ranks goes through it, so all ranks take the same branch and raise the
    same error instead of one rank raising while the others wait in a barrier forever (e.g.
    ``checkpoint.dir`` on node-local disks, where rank 0 cannot see the other nodes' shards).

    Refused on every rank, with nothing written: a state holding NaN/Inf
    (:class:`NonFiniteStateError`) and a disk without room for the whole checkpoint, all ranks' files
    (:func:`checkpoint_bytes`: ``world_size`` shares of ``share``, this rank's share as :func:`estimate_bytes` gives
    it, the Trainer's ``_checkpoint_share``; default: ``state`` whole, no key shared with another rank). A write that
    fails (e.g. the disk fills up meanwhile) removes the partial step directory. Older
    checkpoints are pruned to ``keep`` only after the new one is complete. Returns the step directory.
    """
    agree = agree or (lambda flag: flag)
    _only_tensors(state)
    step_dir = os.path.join(ckpt_dir, step_dir_name(step))
    # Already saved at this step (e.g. a run resumed at its last step saves again): never
    # rewrite shards inside a directory that is marked complete.
    if not agree(not os.path.exists(os.path.join(step_dir, "COMPLETE.json"))):
        return step_dir
    _refuse_nonfinite(ckpt_dir, step, rank, state, agree)
    share = estimate_bytes(state) if share is None else share
    need = checkpoint_bytes(share, world_size)  # (the older ones are pruned only after: room for a whole new one)
    what = f" for the checkpoint: {world_size} ranks' shares of ~{share / _MB:.1f} MB" if world_size > 1 else ""
    _refuse_no_room(ckpt_dir, step, rank, step_dir, need, agree, what)
    if rank == 0 and os.path.isdir(step_dir):  # an interrupted save's files: never mixed into this one
        shutil.rmtree(step_dir, ignore_errors=True)
    agree(True)
    part = part or ("", None, world_size)
    try:
        os.makedirs(os.path.join(step_dir, part[0]), exist_ok=True)
        err = ""
    except OSError as e:
        err = f"rank {rank} cannot create {step_dir}: {e}"
    if not agree(not err):  # (before DCP's collectives: every rank enters them, or none)
        raise CheckpointError(_save_failed(err or f"another rank cannot create {step_dir}", step, ckpt_dir, rank))
    err = _write_dcp(ckpt_dir, step_dir, rank, part, state, (share, need))
    if not agree(not err):
        _remove_partial(step_dir, rank, agree)
        raise CheckpointError(
            _save_failed(
                err or f"another rank could not write its shard in {step_dir} (see its log)", step, ckpt_dir, rank
            )
        )
    err = _try_mark_complete(ckpt_dir, step_dir, step, world_size, meta, keep) if rank == 0 else ""
    if not agree(not err):
        _remove_partial(step_dir, rank, agree)
        raise CheckpointError(
            _save_failed(
                err
                or f"rank 0 could not mark {step_dir} complete (see rank 0's error; if it cannot see the "
                "other ranks' shards, checkpoint.dir must be one directory shared by all ranks)",
                step,
                ckpt_dir,
                rank,
            )
        )
    return step_dir


def _only_tensors(state: dict) -> None:
    """DCP would pickle anything else (and load it with ``weights_only=False``): refused before any collective
    (a programming error, alike on every rank). ``names.encode`` turns other values into a tensor."""
    import torch

    bad = [k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(
            f"checkpoint state {bad[:3]}: only tensors under str keys are saved (nothing is pickled); encode other "
            "values with dilocox.checkpoint.names.encode"
        )


def _refuse_nonfinite(ckpt_dir: str, step: int, rank: int, state: dict, agree: Callable[[bool], bool]) -> None:
    """Raise :class:`NonFiniteStateError` on every rank when any rank's state holds NaN/Inf."""
    bad = nonfinite_tensors(state)
    if not agree(not bad):
        last = find_latest(ckpt_dir)
        what = (
            f"rank {rank}'s state holds NaN/Inf in {', '.join(bad)}"
            if bad
            else "another rank's state holds NaN/Inf (see its log)"
        )
        raise NonFiniteStateError(
            f"not saving the checkpoint of step {step}: {what}. The run diverged (lower optim.lr or set "
            "optim.grad_clip); "
            + (
                f"the last good checkpoint is {last}, resume from it"
                if last
                else f"there is no earlier checkpoint in {ckpt_dir}"
            )
        )


def _refuse_no_room(
    ckpt_dir: str, step: int, rank: int, path: str, need: int, agree: Callable[[bool], bool], what: str = ""
) -> None:
    """Raise :class:`CheckpointError` on every rank, before anything is created, when any rank cannot use
    ``checkpoint.dir`` or finds less room there than ``need``, the whole checkpoint (:func:`checkpoint_bytes`)."""
    err = ""
    try:
        os.makedirs(ckpt_dir, exist_ok=True)
        if disk_free(ckpt_dir) < need:  # fail before creating anything
            err = f"rank {rank}: " + _no_space(path, need, ckpt_dir, what)
    except OSError as e:
        err = f"rank {rank} cannot use checkpoint.dir {ckpt_dir}: {type(e).__name__}: {e}"
    if not agree(not err):
        raise CheckpointError(_save_failed(err, step, ckpt_dir, rank))


def _dcp_rank(group, size: int) -> tuple[int, bool]:
    """``(this rank's rank in group, whether DCP runs without a process group)`` for a part of ``size`` ranks."""
    import torch.distributed as dist

    on = dist.is_available() and dist.is_initialized()
    if size == 1 or not on:
        return 0, True
    return dist.get_rank(group), False


def _write_dcp(ckpt_dir: str, step_dir: str, rank: int, part: tuple, state: dict, room: tuple[int, int]) -> str:
    """Collective over the part's group: ``dcp.save`` of ``state`` into ``step_dir/subdir``, then this rank's files'
    sizes and hashes (and the group coordinator's ``.metadata``) into its sidecar. Returns an error or '' (DCP
    gathers every rank's failure, so all ranks of the part fail alike; the caller's agreement spans all parts).
    ``room``: (this rank's share, the whole checkpoint) in bytes, to tell a full disk from another failure."""
    import torch.distributed.checkpoint as dcp

    subdir, group, size = part
    where = os.path.join(step_dir, subdir)
    from torch.distributed.checkpoint.api import CheckpointException  # (lazy: DCP costs ~1 s at import)

    grank, no_dist = _dcp_rank(group, size)
    try:
        # one writer thread: with thread_count=2 GPT-2 small + AdamW saves in 3.0 s instead of 4.9 s here, but in
        # torch 2.13 an extra writer thread's exception is lost (filesystem._write_data only joins it), so a full
        # disk there would pass unnoticed
        writer = dcp.FileSystemWriter(where, single_file_per_rank=True, sync_files=True, thread_count=1)
        with warnings.catch_warnings():  # (one process: DCP warns that it saves without a process group)
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=writer, process_group=group, no_dist=no_dist)
        sync_dir(where)  # (DCP syncs its files, not the directory's entries: COMPLETE.json must not outlive them)
        mine = rank_files(where, grank) + ([os.path.join(where, ".metadata")] if grank == 0 else [])
        _atomic_write_text(_sum_path(step_dir, rank), json.dumps(record(mine, step_dir)))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP gathers every rank's failure into one
        first = dcp_failures(e)
        # (torch.save inside DCP's writer turns ENOSPC into RuntimeError "unexpected pos": the disk decides,
        # measured while the partial files still hold their space: full when not even this rank's share fits)
        share, need = room
        if any(isinstance(x, OSError) and x.errno == errno.ENOSPC for x in first.values()) or disk_free(ckpt_dir) < max(
            share, _MB
        ):
            return f"rank {rank}: " + _no_space(step_dir, need, ckpt_dir)
        return f"could not write {step_dir}: " + "; ".join(
            f"rank {r}: {type(x).__name__}: {x}" for r, x in first.items()
        )
    return ""


def dcp_failures(e: BaseException) -> dict:
    """``{rank: exception}`` of a DCP ``CheckpointException`` (every rank's failure, gathered by DCP), or
    ``{"this rank": e}`` for any other exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    failures = getattr(e, "failures", None)
    if isinstance(e, CheckpointException) and failures:
        return {r: f[0] if isinstance(f, tuple) else f for r, f in sorted(failures.items())}
    return {"this rank": e}


def _try_mark_complete(ckpt_dir: str, step_dir: str, step: int, world_size: int, meta: dict | None, keep: int) -> str:
    """Rank 0: :func:`_mark_complete`, with any exception turned into an error string (every rank must reach
    the agreement after it). Returns an error or ''."""
    try:
        return _mark_complete(ckpt_dir, step_dir, step, world_size, meta, keep)
    except Exception as e:  # noqa: BLE001 - every rank must reach the agreement below
        err = f"rank 0 could not mark {step_dir} complete: {type(e).__name__}: {e}"
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            err = (
                f"rank 0: no space left on device while marking {step_dir} complete "
                f"(free {disk_free(ckpt_dir) / _MB:.1f} MB)"
            )
        return err


def _save_failed(err: str, step: int, ckpt_dir: str, rank: int) -> str:
    last = find_latest(ckpt_dir)
    return (
        f"{err}; checkpoint of step {step} not saved (no partial directory left), older checkpoints are intact"
        + (f" (latest: {last})" if last else "")
        + (
            "; free space in checkpoint.dir, lower checkpoint.keep, or point checkpoint.dir at a larger disk"
            if "no space left" in err
            else ""
        )
    )


def _mark_complete(ckpt_dir: str, step_dir: str, step: int, world_size: int, meta: dict | None, keep: int) -> str:
    """Rank 0: fold the shards' sums into COMPLETE.json, move ``latest``, prune. Returns an error or ''."""
    missing = [r for r in range(world_size) if not os.path.exists(_sum_path(step_dir, r))]
    if missing:
        return (
            f"rank 0 cannot see the files of ranks {missing or 'all'} in {step_dir}; checkpoint not marked complete. "
            "checkpoint.dir must be one directory shared by all ranks (a network filesystem on multi-node runs)"
        )
    files = {}
    for r in range(world_size):  # O(world_size) small records: ~100 bytes per file
        with open(_sum_path(step_dir, r)) as f:
            files.update(json.load(f))
    info = {
        "step": step,
        "world_size": world_size,
        "time": time.time(),
        **(meta or {}),
        "format": "dcp",
        "hash": HASH,
        "files": files,
    }
    _atomic_write_text(os.path.join(step_dir, "COMPLETE.json"), json.dumps(info, indent=1))
    for r in range(world_size):
        try:
            os.remove(_sum_path(step_dir, r))
        except OSError:
            pass
    _atomic_write_text(os.path.join(ckpt_dir, "latest"), step_dir_name(step) + "\n")
    # Only now, with the new one complete: every remaining step dir is complete and finite
    # (non-finite states are never written), so keeping the newest `keep` keeps `keep` good ones.
    for old in complete_steps(ckpt_dir)[:-keep] if keep > 0 else []:
        if os.path.abspath(old) != os.path.abspath(step_dir):
            remove_step_dir(old)
    for old in _partial_steps(ckpt_dir, step):  # (a save killed mid-write, a prune killed mid-rmtree: no resume
        shutil.rmtree(old, ignore_errors=True)  # takes them, and the room check counts keep + 1 whole ones only)
    return ""


def remove_step_dir(path: str) -> None:
    """Remove a step directory, its COMPLETE.json first: a kill inside the rmtree leaves a directory no resume takes
    for complete (and a later save's prune removes it)."""
    try:
        os.remove(os.path.join(path, "COMPLETE.json"))
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def _partial_steps(ckpt_dir: str, below: int) -> list[str]:
    """The step directories of ``ckpt_dir`` before step ``below`` without COMPLETE.json (a save is collective: none
    of them is being written)."""
    out = []
    for name in os.listdir(ckpt_dir):
        m = re.fullmatch(r"step_(\d{8})", name)
        path = os.path.join(ckpt_dir, name)
        if m and int(m.group(1)) < below and not os.path.exists(os.path.join(path, "COMPLETE.json")):
            out.append(path)
    return out


def _remove_partial(step_dir: str, rank: int, agree: Callable[[bool], bool]) -> None:
    """After a failed save (agreed by all ranks): remove this rank's files, then rank 0 the directory."""
    # (rank 0's view decides, on every rank alike: another's file system may not show its COMPLETE.json yet)
    if not agree(rank != 0 or not os.path.exists(os.path.join(step_dir, "COMPLETE.json"))):
        return  # marked complete (only ``latest`` failed): a valid checkpoint, keep it
    try:
        os.remove(_sum_path(step_dir, rank))
    except OSError:
        pass
    agree(True)  # every rank is done with the directory (rank 0 removes it with every rank's files)
    if rank == 0 and not os.path.exists(os.path.join(step_dir, "COMPLETE.json")):
        shutil.rmtree(step_dir, ignore_errors=True)
    agree(True)  # and no rank reports the failure before it is gone


def preflight(
    ckpt_dir: str,
    shard_bytes: int,
    world_size: int,
    keep: int,
    rank: int = 0,
    agree: Callable[[bool], bool] | None = None,
    check_space: bool = True,
    continuation: bool = False,
) -> str:
    """Start-up check of ``checkpoint.dir``: writable on every rank, and room for a checkpoint.

    ``shard_bytes`` is this rank's share of a checkpoint (:func:`estimate_bytes`: with data parallelism, 1/D of
    what the D DP ranks hold alike, which DCP writes once); a checkpoint is taken as ``world_size`` such shares
    (:func:`checkpoint_bytes`, as ``save_checkpoint`` takes it before each save). Raises :class:`CheckpointError` on
    every rank when the dir is not writable or has no room for even one checkpoint; returns a warning (else '') when
    it has room for fewer than ``keep + 1`` (a save writes the new checkpoint before pruning the oldest), or, with
    ``continuation`` (a DiLoCo-family run saves one at its end beside the final checkpoint, best effort:
    ``checkpoint.continuation``), for fewer than ``keep + 2``."""
    agree = agree or (lambda flag: flag)
    err = ""
    probe = os.path.join(ckpt_dir, f".write_test.{socket.gethostname()}.{os.getpid()}")
    try:
        os.makedirs(ckpt_dir, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"ok")
        os.remove(probe)
    except OSError as e:
        err = (
            f"rank {rank}: checkpoint.dir {ckpt_dir} is not writable ({type(e).__name__}: {e}); set checkpoint.dir "
            "(or log.run_dir) to a writable directory shared by all ranks"
        )
    if not agree(not err):
        raise CheckpointError(err or f"checkpoint.dir {ckpt_dir} is not writable on another rank (see its log)")
    if not check_space:
        return ""
    one, free = checkpoint_bytes(shard_bytes, world_size), disk_free(ckpt_dir)
    if free < one:
        err = (
            f"checkpoint.dir {ckpt_dir} has {free / _MB:.1f} MB free but one checkpoint needs ~{one / _MB:.1f} MB "
            f"({world_size} shard(s) of ~{shard_bytes / _MB:.1f} MB): the first save would fail. Free space, or "
            "point checkpoint.dir at a larger disk (checkpoint.check_space=false skips this check)"
        )
    if not agree(not err):
        raise CheckpointError(
            err or f"checkpoint.dir {ckpt_dir} has no room for one checkpoint (see another rank's log)"
        )
    if keep <= 0:  # keep=0 keeps every checkpoint: no steady state to account for
        return ""
    have = min(len(complete_steps(ckpt_dir)), keep)  # already on disk, not in `free`
    extra = keep + 1 - have
    if free < extra * one:
        return (
            f"warning: checkpoint.dir {ckpt_dir} has {free / _MB:.1f} MB free; with checkpoint.keep={keep} a "
            f"save needs room for {keep + 1} checkpoints of ~{one / _MB:.1f} MB ({have} present + {extra} to "
            "write; the oldest is pruned only after the newest is complete), so a later save will fail with "
            f"'no space left'. Free ~{(extra * one - free) / _MB:.1f} MB or lower checkpoint.keep"
        )
    if continuation and free < (extra + 1) * one:
        return (
            f"warning: checkpoint.dir {ckpt_dir} has {free / _MB:.1f} MB free: room for checkpoint.keep={keep} "
            f"checkpoints of ~{one / _MB:.1f} MB, but not for the continuation saved beside the final one at the "
            "run's end (checkpoint.continuation): the run will skip it with a warning, and a resume with more "
            f"train.steps will go on from θ. Free ~{((extra + 1) * one - free) / _MB:.1f} MB, or set "
            "checkpoint.continuation=false"
        )
    return ""
