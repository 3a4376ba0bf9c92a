"""Sharded, atomic, verified checkpoints of the whole training state.

Layout (one directory per saved step, one file per rank)::

    <dir>/step_00000100/rank_00003.pt     this rank's shard: model, inner + outer optimizer,
                                          data position, RNG, ... (plain tensors/containers)
    <dir>/step_00000100/COMPLETE.json     written by rank 0 after every rank has saved; holds
                                          each shard's size and SHA-256
    <dir>/latest                          text: the name of the newest COMPLETE step dir

Every file is written to a temporary name and moved into place with ``os.replace`` (atomic
on POSIX), ``latest`` only after ``COMPLETE.json``. A crash at any point therefore leaves
the previous checkpoint and the previous ``latest`` untouched; a step directory without
``COMPLETE.json`` is ignored on resume. Loading uses ``torch.load(weights_only=True)``.

What is refused, so that a bad checkpoint never replaces a good one:

* a state with a NaN/Inf tensor anywhere (params, optimizer moments, outer state) is not
  saved (:class:`NonFiniteStateError`, naming the last good checkpoint); pruning runs only
  after a new checkpoint is complete, so the good ones stay;
* a shard whose size or SHA-256 does not match COMPLETE.json (flipped bits, truncation)
  raises :class:`CorruptCheckpointError` naming the file; :func:`load_latest` then falls back
  to the previous complete checkpoint (all ranks agree on which) and sets the bad one aside
  as ``step_XXXXXXXX.corrupt``;
* a full disk gives "no space left on device while writing <file> (needs ~N MB, free M MB)"
  and removes the partial step directory; :func:`preflight` checks writability and room for
  ``keep + 1`` checkpoints at start-up.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

_STEP_RE = re.compile(r"^step_(\d{8})$")
HASH = "sha256"  # hashlib name; ~1.2 GB/s with SHA-NI here vs ~0.5 GB/s for blake2b
_MB = 1024 * 1024


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not match the run layout."""


class CorruptCheckpointError(CheckpointError):
    """A shard's bytes do not match its size/hash in COMPLETE.json, or it cannot be unpickled."""


class NonFiniteStateError(CheckpointError):
    """The state to be saved holds NaN/Inf values; it was not saved."""


class _HashingWriter:
    """File wrapper for ``torch.save``: hashes and counts the bytes while they are written, and
    keeps the OSError of a failed write (torch re-raises it as an opaque RuntimeError)."""

    def __init__(self, f: Any):
        self.f, self.h, self.nbytes, self.error = f, hashlib.new(HASH), 0, None

    def write(self, b: Any) -> int:
        try:
            n = self.f.write(b)
        except OSError as e:
            self.error = e
            raise
        self.h.update(b)
        self.nbytes += len(b)
        return n

    def flush(self) -> None:
        self.f.flush()


def _atomic_write_bytes(path: str, write: Callable[[Any], None]) -> tuple[int, str]:
    """Write through ``write(f)`` to a temp file, fsync, move into place; returns (bytes, hex hash).

    On failure the temp file is removed and the error re-raised; an ENOSPC hidden inside
    torch's RuntimeError is re-raised as that OSError."""
    tmp = f"{path}.tmp.{os.getpid()}"
    w = None
    try:
        with open(tmp, "wb") as f:
            w = _HashingWriter(f)
            write(w)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return w.nbytes, w.h.hexdigest()
    except BaseException as e:
        try:
            os.remove(tmp)  # no half-written temp file left behind
        except OSError:
            pass
        if w is not None and w.error is not None and not isinstance(e, OSError):
            raise w.error from None
        raise


def _atomic_write_text(path: str, text: str) -> None:
    _atomic_write_bytes(path, lambda f: f.write(text.encode()))


def file_hash(path: str, algo: str = HASH, chunk: int = 8 * _MB) -> str:
    h = hashlib.new(algo)
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


# --------------------------------------------------------------------------- state inspection


def iter_tensors(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted path, tensor) for every tensor in nested dicts/lists/tuples, whatever their class."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_tensors(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{path}.{i}" if path else str(i))


def nonfinite_tensors(state: Any, limit: int = 4) -> list[str]:
    """Paths of the (first ``limit``) floating tensors in ``state`` holding a NaN or Inf.

    Fast path: a tensor's sum is finite only if every element is (a reduction, ~20x faster on a
    CPU than ``isfinite(t).all()``, which allocates a mask); only a tensor whose sum is not finite
    (a NaN/Inf, or finite values whose sum overflows) gets the exact elementwise check. One
    device synchronisation per device for the fast path, not one per tensor."""
    by_dev: dict[torch.device, tuple[list[str], list[torch.Tensor], list[torch.Tensor]]] = {}
    for p, t in iter_tensors(state):
        if (t.is_floating_point() or t.is_complex()) and t.numel():
            names, tensors, sums = by_dev.setdefault(t.device, ([], [], []))
            names.append(p)
            tensors.append(t)
            acc = t.sum() if t.is_complex() or t.dtype == torch.float64 else t.sum(dtype=torch.float32)
            sums.append(torch.isfinite(acc).all())
    bad: list[str] = []
    for names, tensors, sums in by_dev.values():
        ok = torch.stack(sums).cpu().tolist()
        bad += [n for n, t, f in zip(names, tensors, ok) if not f and not bool(torch.isfinite(t).all())]
    return bad[:limit] + ([f"... {len(bad) - limit} more"] if len(bad) > limit else [])


def state_nbytes(state: Any) -> int:
    """Bytes of tensor data ``torch.save`` writes for ``state`` (shared storages counted once)."""
    seen, total = set(), 0
    for _, t in iter_tensors(state):
        st = t.untyped_storage()
        key = (t.device, st.data_ptr(), st.nbytes())
        if key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


def estimate_bytes(state: Any, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Size of this rank's shard: ``state``'s tensors (+1% and 64 KiB for the container), plus the
    moments an optimizer that has not stepped yet will hold (Adam-style: 2, SGD momentum: 1)."""
    n = state_nbytes(state)
    if optimizer is not None and not optimizer.state:
        for g in optimizer.param_groups:
            per = 2 if "betas" in g else (1 if g.get("momentum", 0) else 0)
            n += per * sum(p.numel() * p.element_size() for p in g["params"])
    return int(n * 1.01) + 64 * 1024


def disk_free(path: str) -> int:
    """Free bytes for an unprivileged writer on the filesystem of ``path`` (or its nearest parent)."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return shutil.disk_usage(p).free


def _no_space(path: str, need: int, where: str) -> str:
    return (
        f"no space left on device while writing {path} (needs ~{need / _MB:.1f} MB, free "
        f"{disk_free(where) / _MB:.1f} MB)"
    )


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


def _sum_path(step_dir: str, rank: int) -> str:
    """Per-rank sidecar with the shard's size and hash; rank 0 folds them into COMPLETE.json."""
    return os.path.join(step_dir, f"rank_{rank:05d}.sum.json")


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

    Refused on every rank, with nothing written: a state holding NaN/Inf
    (:class:`NonFiniteStateError`) and a disk without room for this rank's shard. A write that
    fails (e.g. the disk fills up meanwhile) removes the partial step directory. Older
    checkpoints are pruned to ``keep`` only after the new one is complete. Returns the step directory.
    """
    agree = agree or (lambda flag: flag)
    step_dir = os.path.join(ckpt_dir, step_dir_name(step))
    # Already saved at this step (e.g. a run resumed at its last step saves again): never
    # rewrite shards inside a directory that is marked complete.
    if not agree(not os.path.exists(os.path.join(step_dir, "COMPLETE.json"))):
        return step_dir
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
    err, path, need = "", shard_path(step_dir, rank), estimate_bytes(state)
    try:
        os.makedirs(ckpt_dir, exist_ok=True)
        if disk_free(ckpt_dir) < need:  # fail before creating anything
            err = f"rank {rank}: " + _no_space(path, need, ckpt_dir)
    except OSError as e:
        err = f"rank {rank} cannot use checkpoint.dir {ckpt_dir}: {type(e).__name__}: {e}"
    if not agree(not err):
        raise CheckpointError(_save_failed(err, step, ckpt_dir, rank))
    try:
        os.makedirs(step_dir, exist_ok=True)
        nbytes, digest = _atomic_write_bytes(path, lambda f: torch.save(state, f))
        _atomic_write_text(_sum_path(step_dir, rank), json.dumps({"bytes": nbytes, HASH: digest}))
    except Exception as e:  # noqa: BLE001 - a full disk surfaces from torch.save as RuntimeError
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            err = f"rank {rank}: " + _no_space(path, need, ckpt_dir)
        else:
            err = f"rank {rank} could not write its shard in {step_dir}: {type(e).__name__}: {e}"
    if not agree(not err):
        _remove_partial(step_dir, rank, agree)
        raise CheckpointError(
            _save_failed(
                err or f"another rank could not write its shard in {step_dir} (see its log)", step, ckpt_dir, rank
            )
        )
    if rank == 0:
        try:
            err = _mark_complete(ckpt_dir, step_dir, step, world_size, meta, keep)
        except Exception as e:  # noqa: BLE001 - every rank must reach the agreement below
            err = f"rank 0 could not mark {step_dir} complete: {type(e).__name__}: {e}"
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                err = (
                    f"rank 0: no space left on device while marking {step_dir} complete "
                    f"(free {disk_free(ckpt_dir) / _MB:.1f} MB)"
                )
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
    missing = [
        r
        for r in range(world_size)
        if not (os.path.exists(shard_path(step_dir, r)) and os.path.exists(_sum_path(step_dir, r)))
    ]
    if missing:
        return (
            f"rank 0 cannot see the shards of ranks {missing} in {step_dir}; checkpoint not marked complete. "
            "checkpoint.dir must be one directory shared by all ranks (a network filesystem on multi-node runs)"
        )
    shards = {}
    for r in range(world_size):  # O(world_size) small records: ~100 bytes each
        with open(_sum_path(step_dir, r)) as f:
            shards[os.path.basename(shard_path(step_dir, r))] = json.load(f)
    info = {"step": step, "world_size": world_size, "time": time.time(), **(meta or {}), "hash": HASH, "shards": shards}
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
            shutil.rmtree(old, ignore_errors=True)
    return ""


def _remove_partial(step_dir: str, rank: int, agree: Callable[[bool], bool]) -> None:
    """After a failed save (agreed by all ranks): remove this rank's files, then rank 0 the directory."""
    if os.path.exists(os.path.join(step_dir, "COMPLETE.json")):
        agree(True)
        return  # marked complete (only ``latest`` failed): a valid checkpoint, keep it
    for p in (shard_path(step_dir, rank), _sum_path(step_dir, rank)):
        try:
            os.remove(p)
        except OSError:
            pass
    agree(True)  # every rank is done with the directory
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
) -> str:
    """Start-up check of ``checkpoint.dir``: writable on every rank, and room for a checkpoint.

    ``shard_bytes`` is this rank's shard estimate (:func:`estimate_bytes`); a checkpoint is taken
    as ``world_size`` such shards. Raises :class:`CheckpointError` on every rank when the dir is
    not writable or has no room for even one checkpoint; returns a warning (else '') when it has
    room for fewer than ``keep + 1`` (a save writes the new checkpoint before pruning the oldest)."""
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
    one, free = shard_bytes * world_size, disk_free(ckpt_dir)
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
    return ""


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
        raise CheckpointError(
            f"{step_dir} is not a complete checkpoint (no COMPLETE.json): it was interrupted while "
            "saving; resume from an earlier step directory"
        )
    try:
        with open(path) as f:
            meta = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(
            f"{path} is corrupt ({type(e).__name__}: {e}); resume from an earlier step directory"
        ) from None
    if not isinstance(meta, dict):
        raise CorruptCheckpointError(
            f"{path} is corrupt (a JSON {type(meta).__name__}, not an object); resume from an earlier step directory"
        )
    return meta


def verify_shard(step_dir: str, rank: int, meta: dict | None = None) -> None:
    """Check this rank's shard against the size and hash in COMPLETE.json (no-op for checkpoints
    written before hashes were recorded). Raises :class:`CorruptCheckpointError` naming the file."""
    meta = read_meta(step_dir) if meta is None else meta
    path = shard_path(step_dir, rank)
    rec = (meta.get("shards") or {}).get(os.path.basename(path))
    if rec is None:
        return
    algo = meta.get("hash", HASH)
    size = os.path.getsize(path)
    if size != rec["bytes"]:
        raise CorruptCheckpointError(
            f"checkpoint shard {path} is corrupt or truncated: {size} bytes, COMPLETE.json records {rec['bytes']}"
        )
    if file_hash(path, algo) != rec[algo]:
        raise CorruptCheckpointError(
            f"checkpoint shard {path} is corrupt or truncated: its {algo} does not match "
            "COMPLETE.json (flipped bits on disk or in transfer)"
        )


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


def all_ranks_min(value: int) -> int:
    """The minimum of ``value`` over all ranks of the default group (identity without a group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return int(value)
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.int64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _warn(msg: str) -> None:
    print(f"WARNING: {msg}", file=sys.stderr, flush=True)


def _step_of(step_dir: str) -> int:
    return int(_STEP_RE.match(os.path.basename(step_dir)).group(1))


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
        if not agree(corrupt or not err):  # a layout mismatch or a missing directory: no fallback helps
            raise CheckpointError(err or f"another rank cannot load {step_dir} (see its log)")
        if agree(not err):
            break
        sd = None
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
        skipped.append(step_dir)
        mine = [s for s in mine if s < step]
    if skipped:
        if rank == 0:
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
        agree(True)  # no rank goes on (and may save at a skipped step) before the damaged ones are set aside
    return step_dir, sd


# --------------------------------------------------------------------------- RNG state


def rng_state() -> dict:
    """torch (CPU, and CUDA when in use) and Python ``random`` state, as weights_only-loadable values.

    Python's state is (version, 625 ints, gauss_next); gauss_next is the cached second value of
    ``random.gauss`` and must be kept too, or the next gauss() after a resume differs."""
    version, internal, gauss_next = random.getstate()
    st = {
        "torch": torch.get_rng_state(),
        "python": list(internal),
        "python_version": version,
        "python_gauss_next": gauss_next,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate((st.get("python_version", 3), tuple(st["python"]), st.get("python_gauss_next")))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])
