"""Sharded, atomic checkpoints of the whole training state.

Layout (one directory per saved step, one file per rank)::

    <dir>/step_00000100/rank_00003.pt     this rank's shard: model, inner + outer optimizer,
                                          data position, RNG, ... (plain tensors/containers)
    <dir>/step_00000100/COMPLETE.json     written by rank 0 after every rank has saved
    <dir>/latest                          text: the name of the newest COMPLETE step dir

Every file is written to a temporary name and moved into place with ``os.replace`` (atomic
on POSIX), ``latest`` only after ``COMPLETE.json``. A crash at any point therefore leaves
the previous checkpoint and the previous ``latest`` untouched; a step directory without
``COMPLETE.json`` is ignored on resume. Loading uses ``torch.load(weights_only=True)``; a
truncated or corrupt shard raises :class:`CheckpointError` naming the file and what to do.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from typing import Any, Callable

import torch

_STEP_RE = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not match the run layout."""


def _atomic_write_bytes(path: str, write: Callable[[Any], None]) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)  # no half-written temp file left behind
        except OSError:
            pass
        raise


def _atomic_write_text(path: str, text: str) -> None:
    _atomic_write_bytes(path, lambda f: f.write(text.encode()))


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def shard_path(step_dir: str, rank: int) -> str:
    return os.path.join(step_dir, f"rank_{rank:05d}.pt")


def complete_steps(ckpt_dir: str) -> list[str]:
    """Step directories that were fully written (have COMPLETE.json), oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    out = []
    for name in sorted(os.listdir(ckpt_dir)):
        if _STEP_RE.match(name) and os.path.exists(os.path.join(ckpt_dir, name, "COMPLETE.json")):
            out.append(os.path.join(ckpt_dir, name))
    return out


def find_latest(ckpt_dir: str) -> str | None:
    """The step directory named by ``latest`` if it is complete, else the newest complete one."""
    latest = os.path.join(ckpt_dir, "latest")
    if os.path.exists(latest):
        with open(latest) as f:
            name = f.read().strip()
        cand = os.path.join(ckpt_dir, name)
        if os.path.exists(os.path.join(cand, "COMPLETE.json")):
            return cand
    steps = complete_steps(ckpt_dir)
    return steps[-1] if steps else None


def save_checkpoint(
    ckpt_dir: str,
    step: int,
    rank: int,
    world_size: int,
    state: dict,
    meta: dict | None = None,
    agree: Callable[[bool], bool] | None = None,
    keep: int = 2,
) -> str:
    """Write this rank's shard; rank 0 marks the step complete and moves ``latest``.

    ``agree(flag)`` must be a collective over all ranks that returns whether ``flag`` is true
    on every rank (``all_ranks_agree``); it also synchronises them. Every decision that could
    differ between ranks goes through it, so all ranks take the same branch and raise the
    same error instead of one rank raising while the others wait in a barrier forever (e.g.
    ``checkpoint.dir`` on node-local disks, where rank 0 cannot see the other nodes' shards).
    Returns the step directory.
    """
    agree = agree or (lambda flag: flag)
    step_dir = os.path.join(ckpt_dir, step_dir_name(step))
    # Already saved at this step (e.g. a run resumed at its last step saves again): never
    # rewrite shards inside a directory that is marked complete.
    if not agree(not os.path.exists(os.path.join(step_dir, "COMPLETE.json"))):
        return step_dir
    err = ""
    try:
        os.makedirs(step_dir, exist_ok=True)
        _atomic_write_bytes(shard_path(step_dir, rank), lambda f: torch.save(state, f))
    except Exception as e:  # noqa: BLE001 - a full disk surfaces from torch.save as RuntimeError
        err = f"rank {rank} could not write its shard in {step_dir}: {type(e).__name__}: {e}"
    if not agree(not err):
        raise CheckpointError(err or f"another rank could not write its shard in {step_dir} (see its log); checkpoint not marked complete")
    if rank == 0:
        try:
            missing = [r for r in range(world_size) if not os.path.exists(shard_path(step_dir, r))]
            if missing:
                err = (f"rank 0 cannot see the shards of ranks {missing} in {step_dir}; checkpoint not marked complete. "
                       "checkpoint.dir must be one directory shared by all ranks (a network filesystem on multi-node runs)")
            else:
                info = {"step": step, "world_size": world_size, "time": time.time(), **(meta or {})}
                _atomic_write_text(os.path.join(step_dir, "COMPLETE.json"), json.dumps(info, indent=1))
                _atomic_write_text(os.path.join(ckpt_dir, "latest"), step_dir_name(step) + "\n")
                for old in complete_steps(ckpt_dir)[:-keep] if keep > 0 else []:
                    if os.path.abspath(old) != os.path.abspath(step_dir):
                        shutil.rmtree(old, ignore_errors=True)
        except Exception as e:  # noqa: BLE001 - every rank must reach the agreement below
            err = f"rank 0 could not mark {step_dir} complete: {type(e).__name__}: {e}"
    if not agree(not err):
        raise CheckpointError(err or f"rank 0 could not mark {step_dir} complete (see rank 0's error; if it cannot see the "
                              "other ranks' shards, checkpoint.dir must be one directory shared by all ranks)")
    return step_dir


def all_ranks_agree(flag: bool) -> bool:
    """True iff ``flag`` is true on every rank of the default group (a MIN all-reduce; also a barrier)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return bool(flag)
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def read_meta(step_dir: str) -> dict:
    path = os.path.join(step_dir, "COMPLETE.json")
    if not os.path.exists(path):
        raise CheckpointError(f"{step_dir} is not a complete checkpoint (no COMPLETE.json): it was interrupted while saving; resume from an earlier step directory")
    with open(path) as f:
        return json.load(f)


def load_checkpoint(step_dir: str, rank: int, world_size: int | None = None, expect: dict | None = None) -> dict:
    """Load this rank's shard. Checks completeness, world size and any ``expect`` meta keys."""
    meta = read_meta(step_dir)
    if world_size is not None and meta.get("world_size") != world_size:
        raise CheckpointError(
            f"checkpoint {step_dir} was written by {meta.get('world_size')} ranks but this run has {world_size}; "
            "resume with the same parallel layout (parallel.replicas/data/pipeline/tensor)"
        )
    for k, v in (expect or {}).items():
        if k in meta and meta[k] != v:
            raise CheckpointError(f"checkpoint {step_dir} has {k}={meta[k]!r} but this run has {k}={v!r}; resume with the same setting or start a fresh run_dir")
    path = shard_path(step_dir, rank)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint shard {path} is missing; the checkpoint is incomplete — resume from an earlier step directory")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types for a damaged zip
        raise CheckpointError(
            f"checkpoint shard {path} is corrupt or truncated ({type(e).__name__}: {e}); "
            f"delete {os.path.dirname(path)} to resume from the previous checkpoint, or start fresh in a new log.run_dir"
        ) from None


# --------------------------------------------------------------------------- RNG state


def rng_state() -> dict:
    import random

    st = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def set_rng_state(st: dict) -> None:
    import random

    torch.set_rng_state(st["torch"])
    random.setstate((3, tuple(st["python"]), None))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])
