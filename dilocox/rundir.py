"""The run directory's bookkeeping: one run at a time, resume policy, config history, metrics.

A run dir (``log.run_dir``) holds ``config.yaml``, ``metrics.jsonl``, ``rank_*.json``, ``tokenizer.json``
(BPE and hf:PATH runs) and, by default, ``checkpoints/``. What this module guarantees:

- **One run per dir.** Rank 0 holds an exclusive ``flock`` on ``<run_dir>/run.lock`` for the
  whole run (the kernel drops it when the process dies, so a crash never leaves a stale lock).
  The lock file names the holder's PID, host and start time; a second run on the dir stops with
  that in its message. The other ranks learn rank 0's outcome by an all-reduce, so every rank
  exits, none waits.
- **A resume continues the same computation.** The config saved with the checkpoint (in its
  ``COMPLETE.json``; older checkpoints: ``config.yaml`` of the run dir) is compared with the new
  one. A change to a key that changes the math (model, replicas, method, outer, compression,
  seed, data, batch, ...) is refused with the keys listed; schedule keys (steps, learning-rate
  schedule, logging, evaluation, checkpoint cadence, timeouts) and layout keys that a resume
  reshards exactly (parallel.data/pipeline/tensor, microbatches) may change, with a warning.
- **A finished run is not silently re-run**: resuming a checkpoint already at or past
  ``train.steps`` stops with a message (``checkpoint.resume_finished=skip``: exit 0, nothing
  written).
- **History is kept**: every start writes the config it trains with to ``config.<step>.yaml``
  (step = the step it starts from) besides ``config.yaml`` (the latest), and a resume drops the
  ``metrics.jsonl`` records past the resumed step (moved to ``metrics.discarded.jsonl``) and
  marks the resume, so each step appears once.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shlex
import shutil
import socket
import time
from collections.abc import Callable
from typing import Any

import yaml

from dilocox.checkpoint.layout import step_dir_name
from dilocox.config import Config, ConfigError
from dilocox.fsutil import atomic_path, atomic_write_text, replace_durably, sync_dir

LOCK_NAME = "run.lock"
METRICS_NAME = "metrics.jsonl"
DISCARDED_NAME = "metrics.discarded.jsonl"
SET_ASIDE_PREFIX = ".metrics.set-aside."  # + token + ".jsonl": the records of a set-aside in progress

# Keys a resume may change (with a warning): they set how long / how fast / what is logged,
# not what a given step computes, or a layout that the resume reshards exactly (dilocox.reshard).
SCHEDULE_KEYS = frozenset(
    {
        "train.steps",
        "train.max_tokens",
        "train.eval_every",
        "train.eval_batches",
        "train.device",
        "optim.lr",
        "optim.min_lr_ratio",
        "optim.warmup_steps",
        "optim.schedule",
        "optim.decay_fraction",  # (the schedule's shape, as optim.warmup_steps)
        "parallel.data",
        "parallel.pipeline",
        "parallel.tensor",
        "parallel.microbatches",
        "parallel.schedule",
        "outer.state_device",
        "data.cache_dir",
        "model.init_from",  # only the start of a fresh run; a resume loads the checkpoint instead
        "model.init_std",  # (likewise)
        "train.compile",  # how a step's kernels run, not what it computes (as train.device)
        "train.recompute",  # (likewise: the same results, bit for bit, for less activation memory)
        "model.attn_backend",  # (likewise: SDPA, flash-attn or TE attention of the same function)
        "model.fused_qkv",  # (likewise: one GEMM for q, k and v over the same parameters)
        "model.loss_backend",  # (likewise: the same cross-entropy, another kernel)
        # elastic membership settings: where the lighthouse is and how long to wait, not what a step computes
        # (replica_rank and max_replicas pick the data shard: they are not here)
        "outer.elastic.lighthouse",
        "outer.elastic.min_replicas",
        "outer.elastic.initial_replicas",
        "outer.elastic.max_attempts",
        "outer.elastic.heartbeat_ms",
        # who may join and how the same bytes travel (authenticated or not), not what they are
        "outer.elastic.lighthouse_auth",
        "outer.elastic.collectives",
    }
)
SCHEDULE_PREFIXES = ("log.", "checkpoint.", "security.")  # (security: who may connect, not what is computed)
UNREPORTED_KEYS = frozenset({"checkpoint.resume", "checkpoint.resume_finished"})  # how to resume, not what


class RunDirError(ConfigError):
    """The run dir cannot be used as asked (locked by another run, incompatible resume, finished run)."""


# --------------------------------------------------------------------------- lock

_HELD: dict[str, list] = {}  # realpath of the lock file -> [fd, count]: re-entrant within one process


def _holder(path: str) -> str:
    try:
        with open(path) as f:
            info = json.loads(f.read() or "{}")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info.get("time", 0))))
        return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, since {since}"
    except (OSError, ValueError):
        return "a process that has not written its pid yet"


class RunDirLock:
    """Exclusive, non-blocking ``flock`` on ``<run_dir>/run.lock``; released by ``release()`` or by death."""

    def __init__(self, run_dir: str):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.realpath(os.path.join(run_dir, LOCK_NAME))
        self.held = False
        if self.path in _HELD:  # a second Trainer of the same process (tests, notebooks)
            _HELD[self.path][1] += 1
            self.held = True
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirError(
                f"log.run_dir={run_dir} is in use by another run ({_holder(self.path)}); two runs on one dir would "
                f"interleave metrics and checkpoints. Wait for it to end or stop it, or set --log.run_dir to another "
                f"directory"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}).encode())
        os.fsync(fd)
        _HELD[self.path] = [fd, 1]
        self.held = True

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        ent = _HELD.get(self.path)
        if ent is None:
            return
        ent[1] -= 1
        if ent[1] == 0:
            del _HELD[self.path]
            os.close(ent[0])  # drops the flock; the file stays (its content names the last holder)


def lock_run_dir(run_dir: str, is_holder: bool, agree: Callable[[bool], bool]) -> RunDirLock | None:
    """Rank ``is_holder`` takes the lock; every rank learns the outcome (``agree``: an all-reduce) and raises alike."""
    lock, err = None, None
    if is_holder:
        try:
            lock = RunDirLock(run_dir)
        except (RunDirError, OSError) as e:
            err = e if isinstance(e, RunDirError) else RunDirError(f"cannot lock log.run_dir={run_dir}: {e}")
            if not run_dir.strip():
                err = RunDirError("log.run_dir is empty; give the run's directory, e.g. --log.run_dir=runs/mine")
            elif os.path.exists(run_dir) and not os.path.isdir(run_dir):
                err = RunDirError(
                    f"log.run_dir={run_dir} is a file, not a directory; give a directory (new or a run's)"
                )
    if not agree(err is None):
        if lock is not None:
            lock.release()
        raise err or RunDirError(f"log.run_dir={run_dir} could not be locked by rank 0 (its message says why)")
    return lock


# --------------------------------------------------------------------------- resume policy


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def is_schedule_key(key: str) -> bool:
    last = key.rsplit(".", 1)[-1]
    return key in SCHEDULE_KEYS or key.startswith(SCHEDULE_PREFIXES) or "timeout" in last or last.startswith("warn")


def config_changes(saved: dict, new: dict) -> tuple[list[tuple[str, Any, Any]], list[tuple[str, Any, Any]]]:
    """(math changes, schedule changes) from ``saved`` to ``new`` (nested config dicts), as (key, old, new).

    A key missing from ``saved`` (written by an older version) counts as its default."""
    defaults = flatten(Config().to_dict())
    old, cur = flatten(saved), flatten(new)
    math_, sched = [], []
    # a run without elastic replicas never reads outer.elastic.*: a changed default there is no reason to refuse
    elastic = any(d.get("outer.elastic.enabled", defaults.get("outer.elastic.enabled")) for d in (old, cur))
    for key in sorted(set(old) | set(cur)):
        a, b = old.get(key, defaults.get(key)), cur.get(key, defaults.get(key))
        if not elastic and key.startswith("outer.elastic."):
            continue
        if a != b and key not in UNREPORTED_KEYS:
            (sched if is_schedule_key(key) else math_).append((key, a, b))
    return math_, sched


def saved_config(step_dir: str, meta: dict, run_dir: str) -> tuple[dict | None, str]:
    """The config the checkpoint was trained with: from its COMPLETE.json, else the run dir's config.yaml."""
    if isinstance(meta.get("config"), dict):
        return meta["config"], os.path.join(step_dir, "COMPLETE.json")
    path = os.path.join(run_dir, "config.yaml")
    if os.path.exists(path):
        try:
            with open(path) as f:
                d = yaml.safe_load(f)
            return (d, path) if isinstance(d, dict) else (None, path)
        except (OSError, yaml.YAMLError):
            return None, path
    return None, ""


def check_resume_config(saved: dict | None, source: str, cfg: Config) -> list[str]:
    """Refuse a resume whose config changes the math (RunDirError listing the keys); warnings for the rest."""
    if saved is None:
        return [
            (
                f"warning: no saved config to compare with ({source or 'the checkpoint has none'}); "
                "resuming without checking that the config matches the checkpoint"
            )
        ]
    math_, sched = config_changes(saved, cfg.to_dict())
    if math_:
        listed = ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in math_)
        raise RunDirError(
            f"the config differs from the one the checkpoint was trained with ({source}) in keys that change the "
            f"computation: {listed}. A resume must keep them; set them back, or start a fresh run in a new "
            f"--log.run_dir"
        )
    if sched:
        listed = ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in sched)
        return [
            (
                f"warning: resuming with changed settings (allowed: they change the schedule, logging or layout, "
                f"not the computation): {listed}"
            )
        ]
    return []


def finished_message(step: int, tokens_seen: int, cfg: Config, source: str, skip: bool = False) -> str | None:
    """The message for a resumed run that has nothing left to train, or None.

    ``skip`` (``checkpoint.resume_finished=skip``, the default): the one line a rerun of a finished run prints
    before it exits 0 ("already finished: see RUN_DIR; `dilocox report RUN_DIR`")."""
    max_tok = cfg.train.max_tokens
    if step < cfg.train.steps and not (max_tok and tokens_seen >= max_tok):
        return None
    by_steps = step >= cfg.train.steps
    by_tokens = bool(max_tok and tokens_seen >= max_tok)
    what = (
        f"step {step}, at or past train.steps={cfg.train.steps}"
        if by_steps
        else f"{tokens_seen} tokens, at or past train.max_tokens={max_tok}"
    )
    raise_ = " and ".join(  # every limit the run is at: raising only one of them trains nothing
        ([f"--train.steps (now {cfg.train.steps})"] if by_steps else [])
        + ([f"--train.max_tokens (now {max_tok}; 0 = no limit)"] if by_tokens else [])
    )
    if skip:
        rd = cfg.log.run_dir
        return (
            f"already finished: see {rd} (its checkpoint {source} is already at {what}; nothing was trained); "
            f"plots: `dilocox report {shlex.quote(rd)}`. To train further raise {raise_}; "
            f"to start over use a new --log.run_dir"
        )
    return (
        f"the checkpoint resumed from ({source}) is already at {what}: this run is finished and nothing was "
        f"trained. To train further raise {raise_}; to start over use a new "
        f"--log.run_dir; --checkpoint.resume_finished=skip makes this case exit 0"
    )


def extended_note(step: int, method: str) -> str:
    """What a finished DiLoCo-family run resumed with more steps trains from (``Trainer._begin_run``)."""
    return (
        f"note: continuing a finished run from step {step}: its end set every parameter to the outer params θ "
        f"(outer.method={method}: the in-flight averages applied, the local progress no all-reduce carried dropped), "
        f"so training goes on from θ, not from where one uninterrupted run of train.steps would be (its end saved no "
        f"continuation: checkpoint.continuation was off, or the checkpoint is older); for that, resume from a mid-run "
        f"checkpoint before step {step} (--checkpoint.resume=PATH)"
    )


# --------------------------------------------------------------------------- a fresh start on an earlier run's records


def earlier_records(run_dir: str) -> dict | None:
    """What ``metrics.jsonl`` says about an earlier run in ``run_dir``: None when it holds no step record and no
    summary, else {"last_step", "checkpoint" (the path of the last mid-run save it recorded, or None), "finished",
    "resumed"}."""
    path = os.path.join(run_dir, METRICS_NAME)
    if not os.path.exists(path):
        return None
    last, ck, finished, resumed, ended_at = None, None, False, False, None
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:  # a line cut by a kill
                continue
            if not isinstance(rec, dict):
                continue
            if isinstance(rec.get("step"), int):
                last = rec["step"] if last is None else max(last, rec["step"])
                if "summary" not in rec:
                    ended_at = None  # (steps logged after a finish: the run went on)
            if "summary" in rec:
                finished, ended_at = True, last or 0
            resumed |= rec.get("event") == "resume"
            if rec.get("event") == "checkpoint":
                ck = rec.get("path") or "?"
    if last is None and not finished:
        return None
    # ended_at: the step the last record's run finished at (None: steps were logged after its summary)
    return {"last_step": last or 0, "checkpoint": ck, "finished": finished, "resumed": resumed, "ended_at": ended_at}


def check_fresh_start(run_dir: str, ckpt_dir: str, cfg: Config) -> str | None:
    """Rank 0, when a run finds no checkpoint to resume: may it start at step 0 in ``run_dir``?

    Returns None (no earlier records), or the note to print when the caller sets them aside (``set_aside_metrics``:
    ``checkpoint.resume=none``;
    or an earlier run of the same config that stopped before its first checkpoint: starting over loses nothing).
    Raises RunDirError (one line naming ``--checkpoint.resume=none`` and a new ``--log.run_dir``) when the earlier
    run had checkpoints that are not in ``ckpt_dir`` (moved, deleted), finished, or trained another config: a silent
    start at step 0 would append the same steps again to its ``metrics.jsonl``."""
    finish_set_aside(run_dir)  # (records whose set-aside a crash cut short: they were judged already)
    finish_moves(os.path.join(run_dir, METRICS_NAME), os.path.join(run_dir, DISCARDED_NAME))  # (a cut-short truncate)
    info = earlier_records(run_dir)
    if info is None:
        return None
    n = info["last_step"]
    if cfg.checkpoint.resume != "none":
        why = None
        if info["checkpoint"] or info["resumed"] or info["finished"]:
            last = f" (its last recorded checkpoint: {info['checkpoint']})" if info["checkpoint"] else ""
            if info["finished"]:  # (the final save logs no record after the summary: it is the last step's)
                last = f" (its final checkpoint: {os.path.join(ckpt_dir, step_dir_name(n))})"
            why = f"{'a finished' if info['finished'] else 'an earlier'} run up to step {n}{last}"
        else:
            saved, _ = saved_config("", {}, run_dir)
            if saved is None or config_changes(saved, cfg.to_dict())[0]:
                why = f"an earlier run up to step {n} with another config ({os.path.join(run_dir, 'config.yaml')})"
        if why:
            raise RunDirError(
                f"log.run_dir={run_dir} holds the metrics of {why}, but checkpoint.dir={ckpt_dir} has no checkpoint "
                f"to resume from; starting at step 0 would log the same steps twice. Point --checkpoint.dir at that "
                f"run's checkpoints to continue it, pass --checkpoint.resume=none to start over (its records move to "
                f"{DISCARDED_NAME}), or use a new --log.run_dir"
            )
    if cfg.checkpoint.resume == "none":
        return (
            f"checkpoint.resume=none: starting over; the earlier run's records (to step {n}) move to {DISCARDED_NAME}"
        )
    return (
        f"the earlier run in {run_dir} stopped at step {n} before its first checkpoint: starting over at step 0 "
        f"(same config; its records move to {DISCARDED_NAME})"
    )


def set_aside_metrics(run_dir: str) -> int:
    """Move every record of ``metrics.jsonl`` to ``metrics.discarded.jsonl`` (a fresh start); return how many.

    No record is lost or ends in both files, wherever the process dies: ``metrics.jsonl`` is first renamed to
    ``.metrics.set-aside.<token>.jsonl`` (atomic: its records are then in that file only), the discarded file is then
    replaced whole (``fsutil.atomic_path``) by itself + a marker line naming the token + those records, and only then
    is the set-aside file removed (and an empty ``metrics.jsonl`` written). A set-aside that a crash cut short is
    finished by the next call, ``check_fresh_start`` or ``truncate_metrics`` (``finish_set_aside``): the marker says
    whether its records are in the discarded file already."""
    n = finish_set_aside(run_dir)
    path = os.path.join(run_dir, METRICS_NAME)
    if not os.path.exists(path):
        return n
    token = secrets.token_hex(8)
    staged = os.path.join(run_dir, f"{SET_ASIDE_PREFIX}{token}.jsonl")
    replace_durably(path, staged)
    n += _discard_staged(run_dir, staged, token)
    atomic_write_text(path, "")
    return n


def finish_set_aside(run_dir: str) -> int:
    """Finish every ``set_aside_metrics`` that a crash cut short (oldest first); return how many records it moved."""
    try:
        names = [n for n in os.listdir(run_dir) if n.startswith(SET_ASIDE_PREFIX) and n.endswith(".jsonl")]
    except OSError:  # (no run dir yet)
        return 0
    paths = sorted((os.path.join(run_dir, n) for n in names), key=lambda p: os.stat(p).st_mtime_ns)
    return sum(_discard_staged(run_dir, p, os.path.basename(p)[len(SET_ASIDE_PREFIX) : -len(".jsonl")]) for p in paths)


def _discard_staged(run_dir: str, staged: str, token: str) -> int:
    """The records of the set-aside file ``staged`` appended to the discarded file after a marker naming ``token``
    (unless a marker names it already: a crash after that step), then ``staged`` removed."""
    with open(staged, "rb") as f:
        lines = [ln if ln.endswith(b"\n") else ln + b"\n" for ln in f if ln.strip()]
    discarded = os.path.join(run_dir, DISCARDED_NAME)
    mark = json.dumps({"discarded_after_step": 0, "time": time.time(), "set_aside": token}).encode() + b"\n"
    if lines and not _marked(discarded, token):
        append_atomically(discarded, [mark, *lines])
    os.remove(staged)
    sync_dir(run_dir)
    return len(lines)


def append_atomically(path: str, lines: list[bytes]) -> None:
    """``path`` replaced whole (``fsutil.atomic_path``, fsynced) by its old bytes + ``lines``: a crash leaves the old
    file or the new one, never a half-appended line. After an old last line cut by a crash the new ones start on a
    line of their own."""
    with atomic_path(path, sync=False) as tmp:
        with open(tmp, "wb") as out:
            last = b"\n"
            try:
                with open(path, "rb") as old:
                    while chunk := old.read(1 << 20):
                        out.write(chunk)
                        last = chunk[-1:]
            except FileNotFoundError:
                pass
            out.write(b"" if last == b"\n" else b"\n")
            out.writelines(lines)
            out.flush()
            os.fsync(out.fileno())


def _ends_with(path: str, tail: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if size < len(tail):
                return False
            f.seek(size - len(tail))
            return f.read() == tail
    except FileNotFoundError:
        return False


def _marked(discarded: str, token: str) -> bool:
    needle = json.dumps({"set_aside": token})[1:-1].encode()
    try:
        with open(discarded, "rb") as f:
            return any(needle in line for line in f)
    except FileNotFoundError:
        return False


# --------------------------------------------------------------------------- history


def write_config_history(run_dir: str, text: str, step: int) -> str:
    """Write ``config.<step>.yaml`` and ``config.yaml``; a different old one stays (``config.<step>.<n>.yaml``)."""
    os.makedirs(run_dir, exist_ok=True)
    path, n = os.path.join(run_dir, f"config.{step}.yaml"), 0
    while os.path.exists(path):
        with open(path) as f:
            if f.read() == text:
                break
        n += 1
        path = os.path.join(run_dir, f"config.{step}.{n}.yaml")
    else:
        atomic_write_text(path, text)
    atomic_write_text(os.path.join(run_dir, "config.yaml"), text)
    return path


def truncate_metrics(run_dir: str, step: int) -> int:
    """Drop the ``metrics.jsonl`` records logged after ``step`` (moved to metrics.discarded.jsonl); return how many.

    Records without a step (summaries, resume marks) are kept when they precede the first dropped record. A
    set-aside that a crash cut short is finished first (``finish_set_aside``)."""
    finish_set_aside(run_dir)
    return move_records_after(os.path.join(run_dir, METRICS_NAME), os.path.join(run_dir, DISCARDED_NAME), step)


MOVING_INFIX = ".moving."  # <path>.moving.<step>.<token>: a move_records_after that a crash may have cut short


def move_records_after(path: str, discarded_path: str, step: int, mark: bool = True) -> int:
    """Move the JSON-lines records of ``path`` whose ``step`` is above ``step`` (with the step-less ones after the
    first of them, and lines cut by a crash) to the end of ``discarded_path`` (``mark``: after a
    ``discarded_after_step`` line); return how many moved.

    No record is lost or ends in both files, wherever the process dies (as ``set_aside_metrics``): ``path`` is
    renamed to ``<path>.moving.<step>.<token>`` first (its records are then there only), the discarded file is
    replaced whole by itself + the moved lines, ``path`` is written with the kept ones, and only then is the moving
    file removed. The next call on ``path`` finishes a move a crash cut short: the moved lines are appended only
    when the discarded file does not end with them already."""
    n = finish_moves(path, discarded_path, mark)
    if not os.path.exists(path) or not _split_after(_read_lines(path), step)[1]:
        return n
    staged = f"{path}{MOVING_INFIX}{step}.{secrets.token_hex(8)}"
    replace_durably(path, staged)
    return n + _finish_move(path, discarded_path, staged, step, mark)


def finish_moves(path: str, discarded_path: str, mark: bool = True) -> int:
    """Finish every ``move_records_after`` on ``path`` that a crash cut short; return how many records it moved."""
    folder, base = os.path.split(path)
    prefix = base + MOVING_INFIX
    try:
        names = sorted(n for n in os.listdir(folder or ".") if n.startswith(prefix))
    except OSError:
        return 0
    moved = 0
    for name in names:
        step_text = name[len(prefix) :].split(".", 1)[0]
        if step_text.lstrip("-").isdigit():
            moved += _finish_move(path, discarded_path, os.path.join(folder, name), int(step_text), mark)
    return moved


def _read_lines(path: str) -> list[str]:
    with open(path) as f:
        return [ln if ln.endswith("\n") else ln + "\n" for ln in f if ln.strip()]


def _split_after(lines: list[str], step: int) -> tuple[list[str], list[str]]:
    keep, drop = [], []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:  # a line cut by a crash mid-write
            drop.append(line)
            continue
        s = rec.get("step") if isinstance(rec, dict) else None
        (drop if (isinstance(s, int) and s > step) or (s is None and drop) else keep).append(line)
    return keep, drop


def _finish_move(path: str, discarded_path: str, staged: str, step: int, mark: bool) -> int:
    keep, drop = _split_after(_read_lines(staged), step)
    tail = "".join(drop).encode()
    if drop and not _ends_with(discarded_path, tail):
        head = [json.dumps({"discarded_after_step": step, "time": time.time()}).encode() + b"\n"] if mark else []
        append_atomically(discarded_path, [*head, tail])
    kept = "".join(keep)
    try:
        with open(path) as f:
            now = f.read()
    except FileNotFoundError:
        now = ""
    if not now.startswith(kept):  # (written already, or a later writer made ``path`` anew: the kept lines first)
        atomic_write_text(path, kept + now)
    os.remove(staged)
    sync_dir(os.path.dirname(path) or ".")
    return len(drop)


def write_rank_summary(run_dir: str, rank: int, coord: str, summary: dict) -> None:
    text = json.dumps({"rank": rank, "coord": coord, **summary})
    atomic_write_text(os.path.join(run_dir, f"rank_{rank:05d}.json"), text)


TOKENIZER = "tokenizer.json"  # RUN_DIR/tokenizer.json: the run's BPE (bpe and hf:PATH runs), as it trained


def keep_tokenizer(run_dir: str, prepared) -> None:
    """Copy the prepared data's ``tokenizer.json`` (a BPE run's, or hf:PATH's) into the run dir, atomically, so that
    `dilocox export`/`generate` read what the model learned, not a BPE rebuilt from a corpus that may have changed."""
    name = prepared.meta.get("tokenizer_file")
    if not name:  # (bytes: nothing to keep)
        return
    with atomic_path(os.path.join(run_dir, TOKENIZER)) as tmp:
        shutil.copyfile(os.path.join(prepared.dir, name), tmp)
