"""Signals and bounded waits: a Ctrl-C or SIGTERM stops the whole run cleanly, nothing waits forever.

Three pieces (see docs/RELIABILITY.md for what each fault does and how long it takes):

- :func:`supervise` (the ``dilocox train --nproc N`` parent): torchrun runs in its own session;
  SIGINT/SIGTERM/SIGHUP received by the parent are forwarded to torchrun, which forwards them to
  its workers (and SIGKILLs them 30 s later). The parent returns only after its children
  exited; after ``stop_timeout_s`` (``train.stop_timeout_s``, default 60) or at a second signal
  it SIGKILLs every process of the run, found by a tag in their environment
  (``DILOCOX_RUN_TAG``), so even workers orphaned by a dead torchrun are found.
- :class:`StopFlag` (every worker): the handler only sets a flag. At each step boundary every
  rank of a replica learns whether any rank *of its replica* got a signal by a one-integer
  all-reduce MAX on a dedicated group of the replica's ranks (as Megatron's
  DistributedSignalHandler does each iteration, but never across the slow links); the replicas
  exchange their agreed signal only at the boundaries where an outer sync crosses the slow links
  anyway (a second one-integer all-reduce, over the ranks of one coordinate in every replica).
  Each all-reduce is started at one boundary and read at the next, so it overlaps one step's
  compute and costs no round trip on the critical path; every rank decides on the same step.
  The trainer then saves a checkpoint (unless one exists for this step) and exits with
  128 + signal number (130 for SIGINT, 143 for SIGTERM).
- :func:`bounded_wait`: polls a completion test, logs "waiting N s for <op> with <peers> ..."
  every ``warn_after_s`` while it lasts, and raises :class:`CommTimeoutError` (naming the
  operation, the peers and the timeout key) after ``timeout_s``. :func:`exit_watchdog` logs such
  an error and, if the clean-up that follows is itself stuck (a thread inside a collective,
  ``destroy_process_group`` with a dead peer), ends the process with ``os._exit`` after 15 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from typing import Callable

import torch
import torch.distributed as dist

from dilocox.distributed.procs import RUN_TAG_ENV, kill_tagged, spawn, tagged_pids  # noqa: F401 (re-exported)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class CommTimeoutError(RuntimeError):
    """A wait on another rank or replica passed its configured timeout (or its collective failed)."""


class ReportedCommError(CommTimeoutError):
    """A failed collective whose one line this rank already logged (:func:`exit_watchdog`): ``dilocox`` exits 1 on it
    without a second line or a traceback."""


class Interrupted(Exception):
    """Raised by the trainer after it stopped (and saved) at a step boundary because of a signal."""

    def __init__(self, signum: int, step: int, checkpoint: str | None) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint"
        super().__init__(f"interrupted by {name} at step {step}; {where}; run the same command again to resume")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _log(msg: str) -> None:
    sys.stderr.write(msg + "\n")  # one write: lines of several ranks sharing a terminal do not interleave
    sys.stderr.flush()


def _rank() -> str:
    """This process's global rank for its log lines: torchrun's RANK, else SLURM's (plain ``srun``), else 0."""
    return os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0"


def _rank_log(msg: str) -> None:
    _log(f"[rank {_rank()}] {msg}")


# ---------------------------------------------------------------------------------------------- bounded waits
def bounded_wait(
    done: Callable[[], bool] | threading.Event,
    what: str,
    timeout_s: float | None,
    warn_after_s: float | None,
    log: Callable[[str], None] = _log,
    poll_s: float = 0.5,
) -> float:
    """Wait until ``done`` (an Event, or a callable polled) is true; return the seconds waited.

    While the wait lasts longer than ``warn_after_s``, logs ``waiting N s for <what> ...`` every
    ``warn_after_s``; after ``timeout_s`` raises CommTimeoutError. None disables either bound.

    An Event wakes the waiter the moment it is set (``Event.wait`` in slices of at most ``poll_s``,
    for the warnings and the bound); a callable is polled with a back-off from 1 ms to at most
    ``POLL_CAP_S``. (A back-off up to 0.5 s, as before, rounded every blocking wait up to the next
    0.51 s / 1.01 s mark: it doubled the blocked time of a per-step all-reduce on a 100 Mbit/s link.)
    """
    ev = done if isinstance(done, threading.Event) else None
    check = ev.is_set if ev is not None else done
    t0 = time.monotonic()
    if check():
        return 0.0
    next_warn = warn_after_s if warn_after_s else None
    sleep = 0.001
    while not check():
        elapsed = time.monotonic() - t0
        if timeout_s is not None and elapsed >= timeout_s:
            raise CommTimeoutError(f"timed out after {elapsed:.0f} s waiting for {what}")
        if next_warn is not None and elapsed >= next_warn:
            log(f"waiting {elapsed:.0f} s for {what} ...")
            next_warn += warn_after_s
        if ev is not None:
            bounds = [poll_s] + [b - elapsed for b in (timeout_s, next_warn) if b is not None]
            ev.wait(max(0.0, min(bounds)))
        else:
            time.sleep(sleep)
            sleep = min(POLL_CAP_S, poll_s, sleep * 2)
    return time.monotonic() - t0


POLL_CAP_S = 0.01  # longest sleep between two polls of a callable in bounded_wait (what a late wake-up can add)


def exit_watchdog(err: BaseException, after_s: float = 15.0, code: int = 1) -> threading.Thread:
    """Log ``err`` now; if this process is still alive ``after_s`` seconds later (the clean-up is stuck,
    e.g. in a collective or ``destroy_process_group`` with a dead peer), end it with ``os._exit``.

    The caller re-raises ``err`` and cleans up normally; the daemon thread only bounds that."""
    rank = _rank()
    _log(f"[rank {rank}] error: {err}")

    def _fire() -> None:
        time.sleep(after_s)
        _log(f"[rank {rank}] still alive {after_s:.0f} s after a communication failure: exiting now")
        os._exit(code)

    t = threading.Thread(target=_fire, name="dilocox-exit-watchdog", daemon=True)
    t.start()
    return t


_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIST = os.path.join("torch", "distributed") + os.sep


def _where(frames) -> str | None:
    """'all_ranks_agree (dilocox/checkpoint.py:414)' for the innermost dilocox frame of ``frames`` (outer first)."""
    for name, filename, lineno in reversed(frames):
        if filename.startswith(_PKG) and not filename.endswith("signals.py"):
            return f"{name} ({os.path.relpath(filename, os.path.dirname(_PKG))}:{lineno})"
    return None


class StallMonitor:
    """A daemon thread that logs, every ``warn_after_s``, while the main thread is blocked inside a
    torch.distributed call (a collective on any group: checkpoint agreements, pipeline sends, TP/DP
    all-reduces), naming the innermost dilocox frame. The bound itself is the group's timeout."""

    def __init__(
        self, warn_after_s: float, peers: str, log: Callable[[str], None] | None = None, poll_s: float = 1.0
    ) -> None:
        self.warn_after_s, self.peers, self.poll_s = warn_after_s, peers, poll_s
        self._log = log or _rank_log
        self._stop = threading.Event()
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._run, name="dilocox-stall-monitor", daemon=True)

    def start(self) -> "StallMonitor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _blocked_in(self) -> str | None:
        frame = sys._current_frames().get(self._main)
        stack, in_dist = [], False
        while frame is not None:
            fn = frame.f_code.co_filename
            in_dist = in_dist or _TORCH_DIST in fn
            stack.append((frame.f_code.co_name, fn, frame.f_lineno))
            frame = frame.f_back
        return _where(stack[::-1]) if in_dist else None

    def _run(self) -> None:
        key, since, next_warn = None, 0.0, 0.0
        while not self._stop.wait(self.poll_s):
            where, now = self._blocked_in(), time.monotonic()
            if where != key:
                key, since, next_warn = where, now, self.warn_after_s
                continue
            if key is not None and now - since >= next_warn:
                whom = self.peers if "of this replica" in self.peers else f"{self.peers} or ranks of this replica"
                self._log(f"waiting {now - since:.0f} s for the collective in {key} (with {whom}) ...")
                next_warn += self.warn_after_s


_COMM_MARKERS = ("gloo", "nccl", "Connection closed by peer", "Timed out waiting", "Connection reset")


def comm_failure_message(err: BaseException, peers: str, timeout_key: str, timeout_s: float) -> str | None:
    """A one-line description of a failed collective (``None`` if ``err`` is not one).

    For errors raised inside a collective called from code without its own wrapper (e.g. a
    checkpoint agreement on the default group) it names the innermost dilocox frame."""
    if isinstance(err, CommTimeoutError):
        return str(err)
    text = str(err)
    if not (isinstance(err, dist.DistBackendError) or any(m in text for m in _COMM_MARKERS)):
        return None
    inner = _where([(fr.name, fr.filename, fr.lineno) for fr in traceback.extract_tb(err.__traceback__)])
    where = f"the collective in {inner}" if inner else "a collective"
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return (
        f"{where} with {peers} failed: {first} ({timeout_key}={timeout_s:g}); the last complete checkpoint "
        f"is still valid"
    )


def replica_peers(topo) -> str:
    """'replica(s) 1, 2' — the other replicas of the outer group (for wait messages)."""
    if topo is None or topo.R <= 1:
        return "the other ranks of this replica"
    others = [r for r in range(topo.R) if r != topo.replica]
    return f"replica(s) {', '.join(map(str, others))}"


# ---------------------------------------------------------------------------------------------- workers
class StopFlag:
    """Per-rank signal flag plus the agreements at step boundaries (see module docstring).

    ``install()`` (main thread) sets the handlers; ``should_stop(crossed)`` is called by every rank at
    every step boundary and returns the same answer on all of them. Two agreements, so that nothing
    crosses the slow links between outer syncs (issue 20):

    - inside the replica, at every boundary: an all-reduce MAX of the signal over the replica's ranks
      (a fast link), started at boundary k and read at k+1;
    - across replicas, only at the boundaries where an outer sync uses the slow links anyway
      (``crossed=True``: an outer all-reduce was launched or applied there; every step for the per-step
      methods): an all-reduce MAX of the replica's agreed signal over the ranks of the same
      (data, stage, tp) coordinate in every replica, started there and read at the next boundary.

    A replica that agreed to stop therefore trains on to its next outer sync and every replica stops at
    the boundary after it, each saving a checkpoint. ``close()`` finishes what is in flight (all ranks
    started it, so it completes) and restores the handlers."""

    def __init__(self, log: Callable[[str], None] = _rank_log) -> None:
        self.signum: int | None = None
        self.agreed_signum: int | None = None
        self._log = log
        self._prev: dict[int, object] = {}
        self._local = _Agreement("the stop-signal agreement (all-reduce MAX over this replica's ranks)")
        self._cross = _Agreement("the stop-signal exchange of the outer sync")
        self._cross_on = False
        self._replica_agreed = 0  # the replica's agreed signal (sticky): what it sends at its next outer sync
        self._told = False

    def install(self) -> "StopFlag":
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in STOP_SIGNALS:
            self._prev[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:  # second signal: the user does not want to wait for the save
            _log(f"[rank {_rank()}] second signal ({name}): exiting now without a checkpoint")
            os._exit(128 + signum)
        self.signum = signum
        _log(
            f"[rank {_rank()}] received {name}: stopping at the next step boundary agreed with "
            f"every rank (the next outer sync's when there are several replicas) and saving a checkpoint (a second "
            f"signal exits at once)"
        )

    def attach(
        self,
        rank: int,
        replica_groups: list[list[int]],
        cross_groups: list[list[int]] | None,
        timeout_s: float,
        cross_timeout_s: float,
        warn_after_s: float | None,
        peers: str,
        timeout_key: str = "parallel.timeout_s",
        cross_timeout_key: str = "outer.timeout_s",
    ) -> None:
        """Create the dedicated agreement groups (collective: every rank calls it at the same point, with every
        group's rank list in the same order). ``replica_groups``: the ranks of each replica; ``cross_groups``:
        the ranks of each (data, stage, tp) coordinate across the replicas (None: one replica)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
            return
        self._local.bind(rank, replica_groups, timeout_s, warn_after_s, timeout_key)
        if cross_groups and max(len(g) for g in cross_groups) > 1:
            self._cross.what = f"the stop-signal exchange of the outer sync (all-reduce MAX with {peers})"
            self._cross.bind(rank, cross_groups, cross_timeout_s, warn_after_s, cross_timeout_key)
            self._cross_on = self._cross.group is not None

    def should_stop(self, crossed: bool = True) -> bool:
        """The same answer on every rank at the same boundary. ``crossed``: an outer sync used the slow links
        at this boundary (the only boundaries at which the replicas exchange their signal)."""
        if self.agreed_signum is not None:
            return True
        if not self._replica_agreed:  # inside the replica: every step
            if self._local.group is None:
                self._replica_agreed = self.signum or 0
            else:
                self._replica_agreed = self._local.collect()
                if not self._replica_agreed:
                    self._local.start(self.signum or 0)
        if not self._cross_on:
            agreed = self._replica_agreed
        else:  # across replicas: only at an outer sync
            agreed = self._cross.collect() if crossed else 0  # read where it rides the next outer sync
            if not agreed and crossed:
                self._cross.start(self._replica_agreed)
            elif not agreed and self._replica_agreed and not self._told:
                self._told = True
                self._log(  # (self._log prefixes the rank)
                    "this replica agreed to stop: training on to the next outer sync, where every replica learns it "
                    "and all stop together"
                )
        if agreed:
            self.agreed_signum = agreed
        return bool(agreed)

    def close(self, drain: bool = True) -> None:
        """Restore the handlers; ``drain``: first finish the agreements in flight (the normal end of a run)."""
        try:
            if drain:
                self._local.collect()
                self._cross.collect()
        finally:
            for sig, prev in self._prev.items():
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, prev)  # type: ignore[arg-type]
            self._prev.clear()


class _Agreement:
    """One asynchronous all-reduce MAX of an int64 on a dedicated gloo group: ``start`` at one boundary,
    ``collect`` (bounded, naming the operation and its timeout key) at a later one."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.group = None
        self._timeout_s: float | None = None
        self._warn_after_s: float | None = None
        self._timeout_key = ""
        self._work = None
        self._buf: torch.Tensor | None = None

    def bind(self, rank: int, groups: list[list[int]], timeout_s: float, warn: float | None, key: str) -> None:
        import datetime

        self._timeout_s, self._warn_after_s, self._timeout_key = timeout_s, warn, key
        for ranks in groups:  # new_group is collective over the world: every rank creates every group
            # gloo whatever the default backend: the agreement all-reduces a CPU int64 (NCCL has no CPU backend)
            g = dist.new_group(ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
            if rank in ranks and len(ranks) > 1:
                self.group = g

    def start(self, value: int) -> None:
        self._buf = torch.tensor([value], dtype=torch.int64)
        self._work = dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def collect(self) -> int:
        """The result of the one in flight (0 when none is)."""
        if self._work is None:
            return 0
        work, buf, self._work = self._work, self._buf, None
        t0 = time.monotonic()
        try:
            bounded_wait(work.is_completed, self.what, self._timeout_s, self._warn_after_s, _rank_log)
            work.wait()  # re-raises a gloo error (e.g. its own timeout)
        except (RuntimeError, CommTimeoutError) as e:  # DistBackendError is a RuntimeError
            raise CommTimeoutError(
                f"{self.what} failed after {time.monotonic() - t0:.0f} s ({self._timeout_key}={self._timeout_s:g}): "
                f"{e}; the last complete checkpoint is still valid"
            ) from None
        return int(buf.item())


# ---------------------------------------------------------------------------------------------- the parent
def supervise(cmd: list[str], env: dict, stop_timeout_s: float = 60.0, log: Callable[[str], None] = _log) -> int:
    """Run ``cmd`` (torchrun) in its own session; forward stop signals to it; return its exit code.

    After the first signal the children get ``stop_timeout_s`` to save and exit, then every
    process of the run is SIGKILLed; a second signal does that at once. Returns 128 + signal
    number if a signal was received (the children's own codes are logged), else the child's code."""
    tag = env.get(RUN_TAG_ENV) or uuid.uuid4().hex
    env = dict(env, **{RUN_TAG_ENV: tag})
    got: list[int] = []
    main = threading.current_thread() is threading.main_thread()
    prev = {}

    first_at: list[float] = []
    child: list[subprocess.Popen] = []

    def on_signal(signum: int, frame: object) -> None:
        got.append(signum)
        first_at.append(time.monotonic())
        name = signal.Signals(signum).name
        if len(got) == 1:
            log(
                f"dilocox: {name} received: asking every rank to save a checkpoint and stop (up to "
                f"{stop_timeout_s:.0f} s; a second signal kills the run at once)"
            )
            if child:
                _forward(child[0], signum)
        else:
            log(f"dilocox: second signal ({name}): killing every process of the run now")
            kill_tagged(tag)

    # handlers first, then the child: a signal in between is forwarded as soon as the child exists.
    # (Not a blocked signal mask around Popen: the child would inherit it and ignore SIGTERM.)
    if main:
        for sig in STOP_SIGNALS:
            prev[sig] = signal.signal(sig, on_signal)
    try:
        proc = spawn(cmd, die_with_parent=True, env=env)  # (a SIGKILLed parent: torchrun stops, its ranks save)
        child.append(proc)
        if got:
            _forward(proc, got[0])
        while True:
            try:
                code = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            if first_at and time.monotonic() - first_at[0] > stop_timeout_s:
                log(f"dilocox: the run did not stop within {stop_timeout_s:.0f} s (train.stop_timeout_s): killing it")
                kill_tagged(tag)
                first_at[0] = float("inf")  # once
        # torchrun gone: its workers must be too (a SIGKILLed torchrun leaves them running)
        left = kill_tagged(tag)
        if left:
            log(f"dilocox: killed {len(left)} process(es) of the run left behind by torchrun: {left}")
    finally:
        for sig, h in prev.items():
            signal.signal(sig, h)  # type: ignore[arg-type]
    if got:
        log(f"dilocox: stopped by {signal.Signals(got[0]).name} (torchrun exit code {code})")
        return 128 + got[0]
    if code < 0:  # torchrun itself killed by a signal (Popen's -N): the shell's 128+N, not sys.exit(-9)'s 247
        log(f"dilocox: torchrun was killed by {_signame(-code)}")
        return 128 - code
    return code


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _forward(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.kill(proc.pid, signum)  # torchrun forwards it to each worker
    except OSError:
        pass
