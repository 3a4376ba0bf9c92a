"""SWARM checkpoints and resume (issue 22 item 4; docs/SWARM.md "Checkpoints and resume").

SWARM peers keep their state on their own, so a stage that loses its last peer used to lose the run. With
``checkpoint.every`` = E > 0 every stage is saved after the sync of each step S-1 with S a multiple of E, and at
the end of the run (S = the last step), into ``CKPT/step_{S:08d}/`` (CKPT = ``checkpoint.dir``, else
``OUT/checkpoints``; on several hosts it must be a shared directory):

- ``s{j}p{i}/``: the writer's state as one ``torch.distributed.checkpoint`` (DCP) directory, through
  ``dilocox.checkpoint.names`` as a trainer's replica saves it (one peer = one replica of its stage's layers, named
  as in the whole model): ``replica0/model/<name>`` its stage parameters, ``replica0/optim/<name>/<k>`` its inner
  optimizer's state, ``replica0/outer/<kind>/<name>`` its DiLoCo outer state (``swarm.sync=diloco``: in-flight work
  waited for and kept pending, as a ``dilocox train`` checkpoint holds it), ``rank0/rest`` the step, RNG state and
  the rest as JSON. Written into a temporary directory and moved into place; nothing pickled, and DCP's index is
  read by ``dilocox.checkpoint.reader``'s restricted unpickler;
- ``s{j}p{i}.json``: each of its files' size and SHA-256, the step, the stage layout and the config; written after
  the directory is in place, so a ``.json`` means a whole checkpoint.

Checkpoints of the earlier format (one ``s{j}p{i}.pt`` file, ``torch.save``, read with ``weights_only=True``) still
resume and export.

Who writes: ``swarm.sync=swarm`` leaves every live peer of a stage with the same bytes after each sync, so ONE peer
writes, the lowest index among that sync's contributors (every peer computes the same answer from the same agreed
list, no message); ``swarm.sync=diloco`` peers differ between outer steps (own AdamW state, own θ with overlap),
so each live peer writes its own file. A step is complete when every stage has at least one file there; the
newest complete step is the one a resume starts from. Older step directories are pruned to ``checkpoint.keep``
complete ones once a newer one is complete (never the newest ones).

Resume (``dilocox swarm --resume``, a peer's ``--resume``; not with ``--join``): before it publishes its address
(no peer trains, so none saves, until every peer has done this) every peer lists the complete steps whose file for
it verifies (its own file of the step, else the lowest index of its stage: a new peer of a DiLoCo stage then starts
from that peer's inner state, as a joiner does); through the address store the peers take the newest step on every
list (a damaged file in one stage moves every stage back together), the job's first peer moves newer step
directories aside (``step_X.stale-T``: partial ones would mix with this run's saves), and each peer loads its file.
The config must not change what a step computes (a changed stage-0 peer count is allowed with a warning: it changes
the batch). Another stage count is allowed from DCP checkpoints: each peer then lists the steps where every saved
stage has a file that verifies, and takes its layers' parameters, inner optimizer and outer state from them by name.
Records of the steps after it move to ``s{j}p{i}.discarded.jsonl``. A peer that stops with an error names the newest
complete checkpoint and the resume command.

Saving is on the peer's main thread, between its sync and its next step: the stage's other peers wait for it at
their next sync (keep a save well under ``swarm.sync_timeout_s``). Not saved: the routers' throughput estimates,
rebalancing history, and gradients of a step in progress (checkpoints are taken between steps only).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time

import torch

from dilocox.checkpoint import names
from dilocox.checkpoint.full import load_keys
from dilocox.checkpoint.layout import (
    HASH,
    CheckpointError,
    CorruptCheckpointError,
    _atomic_write_text,
    file_hash,
    record,
    step_dir_name,
    verify_files,
)
from dilocox.checkpoint.state import nonfinite_tensors, rng_state, set_rng_state
from dilocox.fsutil import replace_durably
from dilocox.rundir import config_changes, move_records_after
from dilocox.swarm.common import SwarmError

log = logging.getLogger("dilocox.swarm.peer")

_STEP_RE = re.compile(r"^step_(\d{8})$")
_FILE_RE = re.compile(r"^s(\d+)p(\d+)\.json$")
VERSION = 2  # 2: a DCP directory per peer (1: one torch.save file)
# config keys a resume may change without a warning beyond the log line: where and how many peers serve a stage,
# how microbatches are routed and timed (the stage state is the same whoever serves it)
LAYOUT_KEYS = frozenset(
    "swarm.peers_per_stage swarm.host swarm.routing swarm.max_inflight swarm.ban_s swarm.rebalance_period_s "
    "swarm.rebalance_min_gain".split()
)


def checkpoint_dir(cfg, out_dir: str) -> str:
    return os.path.abspath(cfg.checkpoint.dir or os.path.join(out_dir, "checkpoints"))


def due(cfg, step: int) -> bool:
    """Is the state entering ``step`` (``step`` steps done) saved? (``checkpoint.every`` > 0 multiples.)"""
    e = cfg.checkpoint.every
    return e > 0 and step > 0 and step % e == 0


def file_stem(stage: int, index: int) -> str:
    return f"s{stage}p{index}"


def _steps(ckpt_dir: str) -> list[tuple[int, str]]:
    if not os.path.isdir(ckpt_dir):
        return []
    out = []
    for name in os.listdir(ckpt_dir):
        m = _STEP_RE.match(name)
        if m:
            out.append((int(m.group(1)), os.path.join(ckpt_dir, name)))
    return sorted(out)


def stage_files(step_dir: str) -> dict[int, dict[int, dict]]:
    """{stage: {index: its .json record}} of the whole checkpoints in ``step_dir`` (a .json whose directory or .pt
    is gone: skipped)."""
    out: dict[int, dict[int, dict]] = {}
    try:
        listed = os.listdir(step_dir)
    except OSError:
        return out
    for name in listed:
        m = _FILE_RE.match(name)
        if not m:
            continue
        try:
            with open(os.path.join(step_dir, name)) as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and _target(step_dir, rec, name[:-5]) is not None:
            out.setdefault(int(m.group(1)), {})[int(m.group(2))] = rec
    return out


def _target(step_dir: str, rec: dict, stem: str) -> str | None:
    """The checkpoint a record names (its DCP directory, or an earlier format's .pt) if it exists, else None."""
    d, f = rec.get("dir"), rec.get("file")
    if d == stem and isinstance(rec.get("files"), dict) and os.path.isdir(os.path.join(step_dir, d)):
        return os.path.join(step_dir, d)
    if f == stem + ".pt" and os.path.exists(os.path.join(step_dir, f)):
        return os.path.join(step_dir, f)
    return None


def record_path(path: str) -> str:
    """The .json record of a checkpoint (its DCP directory or .pt file)."""
    return (path[:-3] if path.endswith(".pt") else path.rstrip(os.sep)) + ".json"


def saved_stages(files: dict[int, dict[int, dict]]) -> int | None:
    """The stage count the records of one step (``stage_files``) name, None when none does."""
    counts = [r["n_stages"] for per in files.values() for r in per.values() if isinstance(r.get("n_stages"), int)]
    return max(counts) if counts else None


def complete_steps(ckpt_dir: str, n_stages: int | None) -> list[tuple[int, str]]:
    """(step, step dir) of the steps where every one of the ``n_stages`` stages has a file (and the records name no
    other stage count), oldest first; ``n_stages`` None: every stage of the count its records name (a resume onto
    another stage count)."""
    out = []
    for s, d in _steps(ckpt_dir):
        files = stage_files(d)
        saved = saved_stages(files)
        n = n_stages if n_stages is not None else saved
        if n and (saved is None or saved == n) and all(j in files for j in range(n)):
            out.append((s, d))
    return out


def newest_complete(ckpt_dir: str, n_stages: int) -> tuple[int, str] | None:
    steps = complete_steps(ckpt_dir, n_stages)
    return steps[-1] if steps else None


def describe_newest(cfg, out_dir: str, n_stages: int, config: str = "CONFIG") -> str:
    """One clause for an error line: the newest complete checkpoint and how to resume from it (or that none);
    ``config``: the config path the resume command names."""
    if cfg.checkpoint.every <= 0:
        return "no SWARM checkpoints are written (checkpoint.every=0): the run cannot be resumed"
    ckpt = checkpoint_dir(cfg, out_dir)
    newest = newest_complete(ckpt, n_stages)
    if newest is None:
        return f"no complete SWARM checkpoint in {ckpt} yet (checkpoint.every={cfg.checkpoint.every})"
    return (
        f"the newest complete checkpoint is {newest[1]} (step {newest[0]}, every stage); resume from it with "
        f"`dilocox swarm {config} --out {out_dir} --resume` (SLURM: DILOCOX_SWARM_RESUME=1)"
    )


def refuse_stale(cfg, out_dir: str) -> None:
    """A fresh (not --resume) run whose checkpoint dir holds step directories of an earlier run is refused: its
    saves would mix with them, and a resume could not tell them apart; with checkpoint.every=0 a later --resume
    would go back to them past this run's records)."""
    ckpt = checkpoint_dir(cfg, out_dir)
    steps = _steps(ckpt)
    if steps:
        raise SwarmError(
            f"{ckpt} already holds SWARM checkpoints of an earlier run (steps {steps[0][0]}..{steps[-1][0]}): resume "
            f"it with --resume, or give this run another --out (or --checkpoint.dir), or remove them"
        )


# ---------------------------------------------------------------------------------------------- saving


def writes(peer) -> bool:
    """Does this peer write its stage's file? sync=diloco: every live peer; sync=swarm: the lowest index among the
    last sync's contributors (itself on a one-peer stage; module docstring)."""
    if peer.s.sync == "diloco" or peer.group is None:
        return True
    live = list(peer.group.contributors) or [peer.index]
    return peer.index == min(live)


def peer_state(peer, step: int) -> dict:
    """The peer's state as DCP entries by global names (``names.flatten``; module docstring)."""
    sd = {
        "version": VERSION,
        "step": step,
        "stage": peer.stage,
        "index": peer.index,
        "sync": peer.s.sync,
        "model": {n: p.detach() for n, p in peer.model.named_parameters()},
        "optimizer": peer.opt.state_dict(),
        "outer": peer.outer.state_dict() if peer.outer is not None else None,
        "rng": rng_state(),
    }
    return names.flatten(
        sd, 0, 0, names.opt_param_names(peer.model, peer.cfg.optim.name), names.outer_layout(peer.outer)
    )


def _write_dcp(where: str, state: dict) -> list[str]:
    """``state`` as a DCP checkpoint in the new directory ``where`` (written beside it, fsynced, moved into place;
    a leftover of an interrupted save is replaced); returns its files."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from dilocox.checkpoint.save import dcp_failures

    tmp = f"{where}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=1)
        with warnings.catch_warnings():  # (one process, no process group: DCP says so)
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=writer, no_dist=True)
        shutil.rmtree(where, ignore_errors=True)  # (no .json names it: an interrupted save's leftover)
        replace_durably(tmp, where)  # (a directory: the rename made durable, as fsutil's files are)
    except CheckpointException as e:  # (a BaseException wrapping the writer's error: its OSError, else one made)
        shutil.rmtree(tmp, ignore_errors=True)
        first = next(iter(dcp_failures(e).values()))
        raise first if isinstance(first, OSError) else OSError(f"{type(first).__name__}: {first}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(os.path.join(where, n) for n in os.listdir(where))


def save(peer, step: int) -> str | None:
    """Write this peer's checkpoint of ``step`` if it is a writer (``writes``); returns its directory or None.
    A state holding NaN/Inf is not written (SwarmError naming the newest good checkpoint)."""
    if not writes(peer):
        return None
    ckpt = checkpoint_dir(peer.cfg, peer.out_dir)
    step_dir = os.path.join(ckpt, step_dir_name(step))
    stem = file_stem(peer.stage, peer.index)
    where, meta_path = os.path.join(step_dir, stem), os.path.join(step_dir, stem + ".json")
    if os.path.exists(meta_path):  # (a resumed run's last step, saved again at its end: never rewritten)
        return where
    t0 = time.monotonic()
    state = peer_state(peer, step)
    bad = nonfinite_tensors(state)
    if bad:
        raise SwarmError(
            f"{peer.name}: not saving the checkpoint of step {step}: the state holds NaN/Inf in {', '.join(bad)}; "
            + describe_newest(peer.cfg, peer.out_dir, peer.n)
        )
    try:
        os.makedirs(step_dir, exist_ok=True)
        files = record(_write_dcp(where, state), step_dir)
    except FileNotFoundError:  # a faster writer completed a newer step and pruned this one meanwhile (sync=diloco)
        log.warning(
            "%s: checkpoint of step %d skipped: %s was pruned (a newer one is complete)", peer.name, step, where
        )
        return None
    except OSError as e:
        raise SwarmError(
            f"{peer.name}: writing the checkpoint of step {step} to {where} failed ({e}); "
            + describe_newest(peer.cfg, peer.out_dir, peer.n)
        ) from e
    size = sum(f["bytes"] for f in files.values())
    rec = {
        "version": VERSION,
        "step": step,
        "stage": peer.stage,
        "index": peer.index,
        "n_stages": peer.n,
        "sync": peer.s.sync,
        "dir": stem,
        "files": files,
        "bytes": size,
        "hash": HASH,
        "config": peer.cfg.to_dict(),
        "time": time.time(),
    }
    _atomic_write_text(meta_path, json.dumps(rec, indent=1, sort_keys=True) + "\n")
    took = time.monotonic() - t0
    log.info("%s: checkpoint of step %d: %s (%.1f MB, %.2f s)", peer.name, step, where, size / 1e6, took)
    prune(ckpt, peer.n, peer.cfg.checkpoint.keep)
    return where


def prune(ckpt_dir: str, n_stages: int, keep: int) -> None:
    """Remove step directories older than the ``keep``-th newest complete step (any writer may run it: it never
    touches a complete step among the newest ``keep``, nor anything newer)."""
    complete = complete_steps(ckpt_dir, n_stages)
    if keep <= 0 or len(complete) <= keep:
        return
    oldest_kept = complete[-keep][0]
    for s, d in _steps(ckpt_dir):
        if s < oldest_kept:
            shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- resuming


def _verify(step_dir: str, rec: dict) -> str | None:
    """None when the checkpoint matches its record (every file's size and SHA-256), else why not."""
    if "dir" in rec:
        d, files = rec["dir"], rec.get("files")
        if not isinstance(files, dict) or f"{d}/.metadata" not in files:
            return f"{os.path.join(step_dir, d)}.json lists no DCP index ({d}/.metadata)"
        if any(not k.startswith(d + "/") or ".." in k.split("/") for k in files):
            return f"{os.path.join(step_dir, d)}.json lists files outside {d}/"
        try:
            verify_files(step_dir, rec)
        except CorruptCheckpointError as e:
            return str(e).replace("COMPLETE.json", d + ".json")
        except (KeyError, TypeError, ValueError, OSError) as e:
            return f"{os.path.join(step_dir, d)}.json is malformed or unreadable ({type(e).__name__}: {e})"
        return None
    path = os.path.join(step_dir, rec["file"])  # the earlier format: one file
    try:
        size = os.path.getsize(path)
    except OSError as e:
        return f"{path}: {e.strerror}"
    if size != rec.get("bytes"):
        return f"{path} is corrupt or truncated: {size} bytes, {rec['file'][:-3]}.json records {rec.get('bytes')}"
    algo = rec.get("hash", HASH)
    if file_hash(path, algo) != rec.get(algo):
        return f"{path} is corrupt: its {algo} does not match {rec['file'][:-3]}.json (flipped bits on disk?)"
    return None


def _verified(step_dir: str, files: dict[int, dict], stage: int, index: int) -> str | None:
    """The checkpoint of ``stage`` in ``step_dir`` that verifies: ``index``'s own, else the lowest index's."""
    for i in ([index] if index in files else []) + sorted(i for i in files if i != index):
        why = _verify(step_dir, files[i])
        if why is None:
            return _target(step_dir, files[i], file_stem(stage, i))
        log.warning("--resume: %s; skipped", why)
    return None


def candidates_in(
    ckpt_dir: str, n_stages: int, stage: int, index: int, resplit: bool = False
) -> list[tuple[int, str | tuple[str, ...]]]:
    """(step, this peer's file) of every complete step where this stage has a file that verifies (its own, else the
    lowest index of its stage), newest first. Damaged files are logged and skipped. ``resplit``: a step saved by a
    job of another stage count counts too, with a file of EVERY saved stage (a tuple, by stage): the peer's layers
    are taken from them by name (``load``)."""
    complete = complete_steps(ckpt_dir, None if resplit else n_stages)
    if not complete:
        found = [s for s, _ in _steps(ckpt_dir)]
        raise SwarmError(
            f"--resume: no complete SWARM checkpoint in {ckpt_dir} (a step where every one of the {n_stages} stages "
            f"saved; step directories found: {found or 'none'}); start a fresh run without --resume in another --out "
            "(or move those directories away)"
        )
    out: list[tuple[int, str | tuple[str, ...]]] = []
    for step, step_dir in reversed(complete):
        files = stage_files(step_dir)
        saved = saved_stages(files) or n_stages
        if saved == n_stages:
            one = _verified(step_dir, files[stage], stage, index)
            if one is not None:
                out.append((step, one))
            continue
        every = [_verified(step_dir, files[j], j, index) for j in range(saved)]
        if None not in every:
            out.append((step, tuple(every)))
    return out


def pick(ckpt_dir: str, n_stages: int, stage: int, index: int, resplit: bool = False) -> tuple[int, str]:
    """The newest ``candidates_in`` (one peer on its own; ``resume`` agrees on a step with the others)."""
    got = candidates_in(ckpt_dir, n_stages, stage, index, resplit)
    if not got:
        raise SwarmError(f"--resume: every checkpoint of stage {stage} in {ckpt_dir} is damaged (see the warnings)")
    return got[0]


def candidates(peer) -> list[tuple[int, str]]:
    """``candidates_in`` for this peer (before it publishes its address), with the config checked against the
    newest one's."""
    ckpt = checkpoint_dir(peer.cfg, peer.out_dir)
    got = candidates_in(ckpt, peer.n, peer.stage, peer.index, resplit=True)
    if got:
        check_config(peer, got[0][1])
    return got


def resume(peer, cands: list[tuple[int, str]]) -> None:
    """Agree through the address store on the newest step that every peer of the job can load (each publishes the
    steps whose files verify for it: a damaged file in one stage moves all to an older step together), move step
    directories newer than it aside (one peer: the first of the job; they would mix with this run's saves), then
    load this peer's file of that step and move its records of later steps aside."""
    from datetime import timedelta

    from dilocox.net.rpc import run_secret
    from dilocox.net.secure import open_value, sign_value

    key = lambda name: f"swarm/resume/{name}"  # noqa: E731
    names = [file_stem(j, i) for j, idx in enumerate(peer.members) for i in idx]
    mine = json.dumps(sorted(s for s, _ in cands))
    with peer.store_lock:
        peer.store.set(key(peer.name), sign_value(run_secret(), key(peer.name), mine))
    try:
        peer.store.wait([key(n) for n in names], timedelta(seconds=peer.s.startup_timeout_s))
    except Exception as e:  # noqa: BLE001 - the store raises a plain RuntimeError on timeout
        raise SwarmError(
            f"{peer.name}: --resume: not every peer said which steps it can resume from within "
            f"swarm.startup_timeout_s={peer.s.startup_timeout_s}s: start every peer with --resume"
        ) from e
    with peer.store_lock:
        can = {n: set(json.loads(open_value(run_secret(), key(n), peer.store.get(key(n)).decode()))) for n in names}
    common = set.intersection(*can.values())
    if not common:
        raise SwarmError(
            f"{peer.name}: --resume: no checkpoint step that every peer can load (steps per peer: "
            f"{ {n: sorted(v) for n, v in can.items()} }): a checkpoint dir that is not shared between hosts, or "
            "damaged files (see the warnings); give every host the same checkpoint.dir"
        )
    step = max(common)
    path = dict(cands)[step]
    ckpt = checkpoint_dir(peer.cfg, peer.out_dir)
    if peer.name == names[0]:  # newer (partial, or unloadable) step directories: kept, out of the way
        for s, d in _steps(ckpt):
            if s > step:
                aside = f"{d}.stale-{int(time.time())}"
                os.replace(d, aside)
                log.warning("%s: --resume from step %d: moved %s aside to %s", peer.name, step, d, aside)
    got = load(peer, path)
    if isinstance(path, tuple):
        log.warning(
            "%s: --resume from a checkpoint of %d stages onto %d: its layers are taken by name from %s",
            peer.name, len(path), peer.n, ", ".join(os.path.basename(p) for p in path),
        )  # fmt: skip
    elif os.path.basename(path).split(".")[0] != file_stem(peer.stage, peer.index):
        log.warning("%s: --resume: no file of its own at step %d: starts from %s", peer.name, step, path)
    peer.enter_step(got)
    dropped = discard_records(peer.out_dir, peer.name, got)
    peer.metrics.resume_at(got)  # TensorBoard drops its events past the step too (a trainer's resume does the same)
    log.info(
        "%s: resumed from %s at step %d%s", peer.name, path, got,
        f" ({dropped} record(s) of later steps moved to {peer.name}.discarded.jsonl)" if dropped else "",
    )  # fmt: skip
    if got >= peer.steps:
        log.info("%s: step %d is at or past the run's %d steps: nothing to train", peer.name, got, peer.steps)


def check_config(peer, path: str | tuple[str, ...]) -> None:
    """Refuse a resume whose config changes what a step computes (the keys named), log the allowed changes. Another
    stage count is allowed from DCP checkpoints (``path`` a tuple: every saved stage's), not from ``.pt`` files."""
    resplit = isinstance(path, tuple)
    if resplit and any(p.endswith(".pt") for p in path):
        raise SwarmError(
            f"--resume: {path[0]} is of the earlier .pt format, which resumes only with its stage count "
            f"({len(path)} stages, this job has {peer.n}); set swarm.peers_per_stage back to {len(path)} stages"
        )
    with open(record_path(path[0] if resplit else path)) as f:
        rec = json.load(f)
    if int(rec.get("n_stages", peer.n)) != peer.n and not resplit:
        raise SwarmError(
            f"--resume: {path} was written by a job of {rec.get('n_stages')} stages, this one has {peer.n} "
            f"(swarm.peers_per_stage={list(peer.pps)}): a resume keeps the stages (their layers); set it back, or "
            "start a fresh run in another --out"
        )
    saved = rec.get("config")
    if not isinstance(saved, dict):
        return
    if resplit:  # (swarm.peers_per_stage changes with the stage count: a layout key)
        log.warning(
            "%s: --resume onto %d stages from a checkpoint of %d: parameters, inner optimizer and outer state move by "
            "name (an adaptive compressor's controller restarts, as after a reshard)",
            peer.name, peer.n, len(path),
        )  # fmt: skip
    before = (saved.get("swarm") or {}).get("peers_per_stage") or [peer.pps[0]]
    if int(before[0]) != peer.pps[0]:
        log.warning(
            "%s: --resume with %d stage-0 peers instead of %d: each step's batch (stage-0 peers x train.batch_size) "
            "and every stage-0 peer's data shard change from here on",
            peer.name, peer.pps[0], int(before[0]),
        )  # fmt: skip
    math_, sched = config_changes(saved, peer.cfg.to_dict())
    layout = [c for c in math_ if c[0] in LAYOUT_KEYS]
    math_ = [c for c in math_ if c[0] not in LAYOUT_KEYS]
    if math_:
        listed = ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in math_)
        raise SwarmError(
            f"--resume: the config differs from the one {path} was trained with in keys that change the "
            f"computation: {listed}. A resume must keep them; set them back, or start a fresh run in another --out"
        )
    if sched or layout:
        listed = ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in sched + layout)
        log.info("%s: resuming with changed settings (schedule/layout, allowed): %s", peer.name, listed)


def read_resplit(paths: tuple[str, ...], stage: int, model_keys: list[str], opt_names: list[str], outer, groups):
    """``read_state`` of a peer of another stage layout: its parameters' entries (model, inner optimizer, outer
    state, by global name) from whichever saved stage holds them, the rest (step, RNG, the outer loop's counters)
    from the saved stage of the same number (else the last); its optimizer keeps this run's ``groups``."""
    mine = set(model_keys)
    src = min(stage, len(paths) - 1)
    got: dict = {}
    for j, path in enumerate(paths):
        got.update(load_keys(path, lambda k: names.param_of(k) in mine or (j == src and k.startswith("rank0/rest"))))
    missing = [n for n in model_keys if names.key("replica0", "model", n) not in got]
    if missing:
        raise SwarmError(
            f"--resume: no saved stage of {paths[0]}'s step holds parameters {missing[:4]}: the model changed"
        )
    return names.unflatten(got, 0, 0, model_keys, opt_names, outer, False, groups, paths[src])


def read_state(path: str, model_keys: list[str] | None = None, opt_names=None, outer=None) -> dict:
    """A peer checkpoint (its DCP directory, or an earlier format's .pt) as ``{"model": params, "optimizer",
    "outer", "step", "stage", "sync", "rng", ...}``; ``model_keys``/``opt_names``/``outer``: the loading peer's
    (None: the parameters alone, as saved). Files are verified by the caller (``candidates_in``)."""
    if path.endswith(".pt"):
        sd = torch.load(path, map_location="cpu", weights_only=True)
        return {**sd, "model": sd["params"], "optimizer": sd.get("opt")}
    if model_keys is None:  # (the parameters alone: export)
        got = load_keys(path, lambda k: k.startswith("replica0/model/"))
        return {"model": {k.split("/", 2)[2]: v for k, v in got.items()}}
    got = load_keys(path)
    saved = [k.split("/", 2)[2] for k in got if k.startswith("replica0/model/")]
    if set(saved) != set(model_keys):
        raise SwarmError(
            f"--resume: {path} holds parameters {sorted(set(saved) ^ set(model_keys))[:4]} that the peer's stage "
            "does not (or the other way round): the model or swarm.peers_per_stage's stage count changed"
        )
    return names.unflatten(got, 0, 0, model_keys, opt_names, outer, True, None, path)


@torch.no_grad()
def load(peer, path: str | tuple[str, ...]) -> int:
    """Load ``path`` into ``peer`` (params, inner optimizer, outer state, RNG); returns its step."""
    named = dict(peer.model.named_parameters())
    opt_names = names.opt_param_names(peer.model, peer.cfg.optim.name)
    resplit = isinstance(path, tuple)
    try:
        if resplit:
            groups = peer.opt.state_dict()["param_groups"]
            sd = read_resplit(path, peer.stage, list(named), opt_names, peer.outer, groups)
        else:
            sd = read_state(path, list(named), opt_names, peer.outer)
    except CheckpointError as e:
        raise SwarmError(f"--resume: {path} cannot be loaded into {peer.name}: {e}") from e
    if (sd.get("stage") != peer.stage and not resplit) or sd.get("sync") != peer.s.sync:
        raise SwarmError(
            f"--resume: {path} holds stage {sd.get('stage')} with swarm.sync={sd.get('sync')}; {peer.name} serves "
            f"stage {peer.stage} with swarm.sync={peer.s.sync}"
        )
    if set(named) != set(sd["model"]):
        raise SwarmError(
            f"--resume: {path} holds parameters {sorted(set(sd['model']) ^ set(named))[:4]} that {peer.name}'s "
            "stage does not (or the other way round): the model or swarm.peers_per_stage's stage count changed"
        )
    for n, p in named.items():
        p.copy_(sd["model"][n])
    try:
        peer.opt.load_state_dict(sd["optimizer"])
        if peer.outer is not None:
            peer.outer.load_state_dict(sd["outer"])
    except (ValueError, KeyError, RuntimeError) as e:
        raise SwarmError(f"--resume: {path} does not fit {peer.name}'s optimizer or outer state: {e}") from e
    set_rng_state(sd["rng"])
    return int(sd["step"])


def discard_records(out_dir: str, name: str, step: int) -> int:
    """Move ``name``'s records of steps >= ``step`` (a run past the checkpoint) to ``name.discarded.jsonl``."""
    path = os.path.join(out_dir, f"{name}.jsonl")
    return move_records_after(path, os.path.join(out_dir, f"{name}.discarded.jsonl"), step - 1, mark=False)
