"""Edge cases of the training step's distributed parts: engine, process groups, signals, inner step."""

from __future__ import annotations

import os
import queue as pyqueue
import tempfile
import traceback

import torch.multiprocessing as mp


def _stop_flag_rank(rank: int, world: int, store: str, backend: str, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist

    from dilocox.distributed.signals import StopFlag

    try:
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
        flag = StopFlag()
        flag.attach(rank, [list(range(world))], None, 20.0, 20.0, None, "the other ranks of this replica")
        answers = [flag.should_stop(), flag.should_stop(), flag.should_stop()]
        flag.close()
        results.put((rank, "ok", answers))
    except BaseException:  # noqa: BLE001 - forwarded to the test
        results.put((rank, "err", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_stop_agreement_runs_when_the_default_backend_has_no_cpu_device():
    """Bug: StopFlag's agreement groups took the default backend. On a GPU run ``init_distributed`` picks "nccl" (a
    backend for CUDA tensors only), and the agreement's CPU int64 all-reduce failed at the first step boundary of
    every multi-rank GPU run ("No backend type associated with device type cpu"). Emulated on CPU with the device
    map "cuda:gloo" (a backend for cuda only, as "nccl" is): the agreement must run on its own gloo group."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(prefix="dilocox-stopflag-"), "store")
    procs = [ctx.Process(target=_stop_flag_rank, args=(r, 2, store, "cuda:gloo", results)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(2):
            rank, status, payload = results.get(timeout=120)
            assert status == "ok", f"rank {rank}:\n{payload}"
            got[rank] = payload
    except pyqueue.Empty:
        raise AssertionError("the stop agreement did not finish within 120 s") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert got == {0: [False, False, False], 1: [False, False, False]}
