"""Run a function on N local gloo ranks (test-only helper: the multi-rank tests use it).

``run_ranks(world, fn, *args)`` runs ``fn(rank, world, *args)`` on ``world`` processes joined by a gloo
process group and returns the list of return values (index = rank). An
exception in any rank is re-raised in the parent with that rank's traceback, so a failing multi-rank
test reads like a single-process one.

The ranks come from a warm pool (one per world size, per test process): starting an interpreter and
importing torch costs more than most multi-rank tests themselves, so the processes are kept between
calls. Each task starts from the state a new process has (environment, torch's default seed and dtype,
signal handlers); a worker that comes back changed (a thread or a signal handler left behind), a failed
rank or a timeout retires the whole pool, and the next call starts new processes. ``fresh=True`` (a
test that kills or crashes its ranks on purpose) or ``DILOCOX_TEST_FRESH_RANKS=1`` (the whole run)
starts new processes for the call, as before the pool existed.
"""

from __future__ import annotations

import atexit
import io
import os
import queue as pyqueue
import shutil
import socket
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

_FRESH_SEED = 67280421310721  # torch.initial_seed() of a new CPU process


_PORT_SPAN = 400  # ports per xdist worker, below the kernel's ephemeral range
_port_next = 0


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A localhost port free now, that no other test process will be handed.

    A port the kernel hands out (bind to 0) is from the ephemeral range, which every socket of every xdist
    worker draws from: released here, it can be another worker's before our server listens (EADDRINUSE in
    CI). So each worker takes ports from its own slice below that range (gw0: 20000.., gw1: 20400.., ...),
    in turn, skipping any not free; the kernel's pick only where the slice does not fit."""
    global _port_next
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    base = 20000 + _PORT_SPAN * (int(worker) if worker.isdigit() else 0)
    if base + _PORT_SPAN <= _ephemeral_low():
        for _ in range(_PORT_SPAN):
            port = base + _port_next % _PORT_SPAN
            _port_next += 1
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_task(rank: int, world: int, rdzv: tuple[int, str], fn: Callable, args: tuple) -> tuple[str, Any]:
    """One task in this process: the rank's environment, gloo init, ``fn``, tear-down.

    The ranks meet through a file store (``rdzv[1]``, a path new for this call), not a TCP port: a port
    picked free and released can be taken by another xdist worker before rank 0 listens on it
    (EADDRINUSE in CI). ``MASTER_PORT`` is still set (``rdzv[0]``) for code that reads it."""
    import torch

    port, store = rdzv

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        out = fn(rank, world, *args)
        # Serialise to bytes: torch's queue would share tensors through file descriptors that
        # vanish when this process exits (ConnectionResetError in the parent for many tensors).
        buf = io.BytesIO()
        torch.save(out, buf)
        return "ok", buf.getvalue()
    except BaseException:  # noqa: BLE001 - forwarded to the parent
        return "err", traceback.format_exc()
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def _fresh_worker(rank: int, world: int, rdzv: tuple[int, str], fn: Callable, args: tuple, results: Any) -> None:
    """A new process for one task."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    status, payload = _run_task(rank, world, rdzv, fn, args)
    results.put((rank, status, payload, False))


_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")


def _pool_worker(rank: int, world: int, tasks: Any, results: Any) -> None:
    """A warm rank: torch imported once, then one task per message until ``None`` or the parent is gone.

    Before each task the state a test could depend on is set as a process spawned now would have it (the
    parent's environment and directory, torch's default seed and dtype); after it the worker reports
    whether it is still clean (no thread it did not start with, the same signal handlers).
    """
    import signal
    import threading

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    sigs = [getattr(signal, s) for s in _SIGNALS]
    handlers0 = {s: signal.getsignal(s) for s in sigs}
    threads0 = {t.ident for t in threading.enumerate()}
    dtype0 = torch.get_default_dtype()
    parent = os.getppid()
    while True:
        try:
            msg = tasks.get(timeout=1.0)
        except pyqueue.Empty:
            if os.getppid() != parent:  # the test process is gone (killed, or exited without atexit)
                return
            continue
        if msg is None:
            return
        rdzv, fn, args, env, cwd = msg
        # the parent's environment and directory of this call, as a process spawned now would have them
        os.environ.clear()
        os.environ.update(env)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.chdir(cwd)
        torch.manual_seed(_FRESH_SEED)
        torch.set_default_dtype(dtype0)
        status, payload = _run_task(rank, world, rdzv, fn, args)
        _release_run_dir_locks()
        left = [t for t in threading.enumerate() if t.ident not in threads0 and t.is_alive()]
        clean = not left and all(signal.getsignal(s) == handlers0[s] for s in sigs)
        results.put((rank, status, payload, clean))


def _release_run_dir_locks() -> None:
    """Drop the run-dir locks (``dilocox.rundir``) a task's Trainers still hold, as the exit of a fresh process
    would: the next task, or another world size's pool, may open the same run dir (a resume)."""
    import sys

    rd = sys.modules.get("dilocox.rundir")
    for fd, _ in list(getattr(rd, "_HELD", {}).values()):
        try:
            os.close(fd)
        except OSError:
            pass
    if rd is not None:
        rd._HELD.clear()


class _Pool:
    """``world`` warm ranks, each with its own task queue and one shared result queue."""

    def __init__(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.procs = [
            ctx.Process(target=_pool_worker, args=(r, world, self.tasks[r], self.results), daemon=False)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def submit(self, rdzv: tuple[int, str], fn: Callable, args: tuple) -> None:
        env, cwd = dict(os.environ), os.getcwd()
        for q in self.tasks:
            q.put((rdzv, fn, args, env, cwd))

    def close(self, graceful: bool) -> None:
        if graceful:
            for q in self.tasks:
                try:
                    q.put(None)
                except Exception:  # noqa: BLE001 - a broken queue: the kill below ends it
                    pass
        for p in self.procs:
            p.join(timeout=5 if graceful else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


_POOLS: dict[int, _Pool] = {}


@atexit.register
def _close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close(graceful=True)


def _collect(world: int, results: Any, procs: list, timeout: float) -> tuple[dict[int, Any], list[str], bool]:
    """Read ``world`` results; name a rank that died without reporting instead of waiting for the timeout."""
    got: dict[int, Any] = {}
    errors: list[str] = []
    clean = True
    deadline = time.monotonic() + timeout
    while len(got) < world:
        try:
            rank, status, payload, ok = results.get(timeout=1.0)
        except pyqueue.Empty:
            # A rank killed by a signal (segfault, OOM, abort) never reports. One more read first, in
            # case its result arrived just before it exited.
            dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
            if dead:
                try:
                    rank, status, payload, ok = results.get(timeout=2.0)
                except pyqueue.Empty:
                    errors.append(
                        f"--- rank {dead[0]} ---\nexited with code {procs[dead[0]].exitcode} without reporting a result"
                    )
                    break
            elif time.monotonic() > deadline:
                raise TimeoutError(
                    f"run_ranks: ranks {sorted(set(range(world)) - set(got))} did not finish within {timeout} s"
                ) from None
            else:
                continue
        clean = clean and ok
        if status != "ok":
            errors.append(f"--- rank {rank} ---\n{payload}")
            break
        import torch

        got[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    return got, errors, clean


def run_ranks(world: int, fn: Callable, *args: Any, timeout: float = 300.0, fresh: bool = False) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return results ordered by rank."""
    store_dir = tempfile.mkdtemp(prefix="dilocox-rdzv-")
    rdzv = (free_port(), os.path.join(store_dir, "store"))
    fresh = fresh or os.environ.get("DILOCOX_TEST_FRESH_RANKS") == "1"
    pool = None
    if fresh:
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [
            ctx.Process(target=_fresh_worker, args=(r, world, rdzv, fn, args, results), daemon=False)
            for r in range(world)
        ]
        for p in procs:
            p.start()
    else:
        pool = _POOLS.get(world)
        if pool is None or not pool.alive():
            if pool is not None:
                pool.close(graceful=False)
            pool = _POOLS[world] = _Pool(world)
        pool.submit(rdzv, fn, args)
        results, procs = pool.results, pool.procs
    ok = False
    try:
        got, errors, clean = _collect(world, results, procs, timeout)
        ok = not errors and clean
    finally:
        if pool is not None:
            if not ok:  # a failed, timed-out or changed rank: nothing of this pool is reused
                _POOLS.pop(world, None)
                pool.close(graceful=False)
        else:
            for p in procs:
                p.join(timeout=5 if not ok else 60)
                if p.is_alive():
                    p.kill()
        shutil.rmtree(store_dir, ignore_errors=True)
    if errors:
        raise RuntimeError("a rank failed:\n" + "\n".join(errors))
    return [got[r] for r in range(world)]


def processes_naming(text: str, kind: str) -> list[str]:
    """Live processes whose command line contains both ``text`` (e.g. a job's out dir) and ``kind`` (e.g.
    ``dilocox.swarm.peer``): what a job left behind. Each as "pid: command line"."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd and kind in cmd:
            found.append(f"{pid}: {cmd}")
    return found


def read_records(path) -> list[dict]:
    """The complete JSON lines of a file another process is appending to: a last line without its newline is still
    being written and is left out (reading it mid-write raised JSONDecodeError on a loaded CI host); [] when the file
    does not exist yet."""
    import json

    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return []
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]
