"""Run a function on N local gloo ranks (test-only helper: the multi-rank tests use it).

``run_ranks(world, fn, *args)`` spawns ``world`` processes, initialises a gloo process group
on a free localhost port, calls ``fn(rank, world, *args)`` in each and returns the list of
return values (index = rank). An exception in any rank is re-raised in the parent with that
rank's traceback, so a failing multi-rank test reads like a single-process one.
"""

from __future__ import annotations

import io
import os
import queue as pyqueue
import socket
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        out = fn(rank, world, *args)
        # Serialise to bytes: torch's queue would share tensors through file descriptors that
        # vanish when this process exits (ConnectionResetError in the parent for many tensors).
        buf = io.BytesIO()
        torch.save(out, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - forwarded to the parent
        queue.put((rank, "err", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_ranks(world: int, fn: Callable, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return results ordered by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue), daemon=False) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except pyqueue.Empty:
                # A rank killed by a signal (segfault, OOM, abort) never reports: name it now
                # instead of waiting for the timeout. One more read first, in case its result
                # arrived just before it exited.
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
                if dead:
                    try:
                        rank, status, payload = queue.get(timeout=2.0)
                    except pyqueue.Empty:
                        errors.append(
                            f"--- rank {dead[0]} ---\n"
                            f"exited with code {procs[dead[0]].exitcode} without reporting a result"
                        )
                        break
                elif time.monotonic() > deadline:
                    raise TimeoutError(
                        f"run_ranks: ranks {sorted(set(range(world)) - set(results))} did not finish within {timeout} s"
                    ) from None
                else:
                    continue
            if status == "ok":
                import torch

                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("a rank failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world)]


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
