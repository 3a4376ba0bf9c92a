"""Starting and stopping the processes of a run: the one launch library (issue 25 item 4).

Every launcher (``dilocox train --nproc``'s supervisor, ``dilocox launch [--elastic]``, ``dilocox swarm``, the
namespace emulation, the benches and tools) starts its children with ``spawn`` (a new session, so one
``kill_group`` reaches a child and everything it started), stops them with ``kill_group`` /
``kill_and_reap`` (bounded: nothing waits forever on a process that will not die), finds what a SIGKILLed
torchrun left behind with ``tagged_pids`` / ``kill_tagged`` (every process of a run carries
``DILOCOX_RUN_TAG`` in its environment), and reads a child's ready line with ``read_ready_line`` (bounded).
Nothing here imports torch or another dilocox module.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

log = logging.getLogger("dilocox.procs")

RUN_TAG_ENV = "DILOCOX_RUN_TAG"  # every process of one run carries it (a /proc scan finds them all)


def child_env() -> dict[str, str]:
    """This process's environment for a child of the run: one OpenMP thread unless set, and this checkout first on
    ``PYTHONPATH`` (the children import dilocox from where this process did, installed or not)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    return env


def spawn(argv: list[str], die_with_parent: bool = False, **popen_kw) -> subprocess.Popen:
    """``subprocess.Popen(argv, **popen_kw)`` in a new session (process group = the child's pid).

    ``die_with_parent`` (Linux): the child gets SIGTERM when this thread's process dies, even by SIGKILL (which no
    handler sees: the launcher's own children, in their own session, ran on orphaned, e.g. torchrun and its ranks
    after a ``kill -9`` of ``dilocox train --nproc``). SIGTERM, not SIGKILL: a torchrun forwards it and its ranks
    save and stop. The caller's thread must outlive the child (the kernel's signal follows the forking thread)."""
    if die_with_parent and _PRCTL is not None:
        popen_kw["preexec_fn"] = _parent_death_signal(os.getpid())
    return subprocess.Popen(argv, start_new_session=True, **popen_kw)


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()  # (looked up here: nothing is loaded or imported between fork and exec)
_PR_SET_PDEATHSIG = 1


def _parent_death_signal(parent: int) -> Callable[[], None]:
    def preexec() -> None:  # in the child, between fork and exec
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl: nobody would signal this child
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def kill_group(pid: int | subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """``sig`` to the process group of ``pid`` (a ``spawn``ed child: it and everything it started); a group that
    is gone already is not an error."""
    if isinstance(pid, subprocess.Popen):
        pid = pid.pid
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_and_reap(proc: subprocess.Popen, timeout_s: float = 10.0, what: str = "process") -> int | None:
    """SIGKILL a ``spawn``ed child's group, then wait for the child at most ``timeout_s``; returns its exit code
    (None, logged, if it did not exit in time). The group is killed whenever the child was not reaped yet, even if
    it exited (a zombie): what it started may still run (it was skipped then, leaving them orphaned); its pid, the
    group's id, cannot have been reused before the reap. A child reaped earlier is left alone (its id may be reused)."""
    if proc.returncode is None:
        kill_group(proc.pid, signal.SIGKILL)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log.error("%s pid %d did not exit within %.0f s of SIGKILL", what, proc.pid, timeout_s)
        return None


def read_ready_line(
    proc: subprocess.Popen,
    pattern: str | re.Pattern,
    timeout_s: float,
    abort: Callable[[], bool] = lambda: False,
) -> re.Match | None:
    """The first line of ``proc.stdout`` (text mode) that matches ``pattern``, within ``timeout_s``.

    A daemon thread reads stdout to its end (later lines are dropped, so the child never blocks on a full pipe).
    Returns None when the time is up or ``abort()`` turns true (checked every 0.5 s); raises ``EOFError`` when the
    child closed its stdout (exited) without printing it."""
    rx = re.compile(pattern) if isinstance(pattern, str) else pattern
    lines: queue.Queue = queue.Queue()

    def pump(f) -> None:
        for line in f:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, args=(proc.stdout,), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or abort():
            return None
        try:
            line = lines.get(timeout=min(left, 0.5))
        except queue.Empty:
            continue
        if line is None:
            raise EOFError("the process closed its output before printing the line")
        m = rx.search(line)
        if m:
            return m


def tagged_pids(tag: str) -> list[int]:
    """PIDs of live processes whose environment holds ``DILOCOX_RUN_TAG=<tag>`` (a /proc scan)."""
    needle = f"{RUN_TAG_ENV}={tag}".encode()
    out, skip = [], _ancestors()  # never this process or the ones that started it (they may carry the tag)
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) in skip:
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{d}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env and state != b"Z":
            out.append(int(d))
    return out


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                pid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def kill_tagged(tag: str, sig: int = signal.SIGKILL) -> list[int]:
    """``sig`` to every process of the run ``tag`` (other sessions too: what a SIGKILLed torchrun left)."""
    pids = tagged_pids(tag)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    return pids
