"""The async outer transport (distributed/comm.py) and the point of overlap: hidden comm time."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dilocox.config import CompressConfig, OuterConfig, ParallelConfig
from dilocox.distributed.comm import AsyncComm
from dilocox.distributed.spawn import run_ranks
from dilocox.distributed.topology import build_topology
from tests.reference_diloco import forward_backward, layer_of, make_inner_opt, make_model

# ---------------------------------------------------------------------------- AsyncComm alone


def test_results_fifo_and_errors():
    comm = AsyncComm()
    order: list[int] = []
    handles = [comm.submit(lambda i=i: (order.append(i), threading.current_thread().name)[1]) for i in range(5)]
    names = [h.wait() for h in handles]
    assert order == [0, 1, 2, 3, 4] and set(names) == {"outer-comm"}

    def boom():
        raise ValueError("link down")

    h = comm.submit(boom)
    with pytest.raises(RuntimeError, match="failed on the comm thread") as ei:
        h.wait()
    assert isinstance(ei.value.__cause__, ValueError)
    assert comm.submit(lambda: 41 + 1).wait() == 42  # the thread survives a failed task
    comm.shutdown()
    assert comm._thread is None
    assert comm.submit(lambda: "restarted").wait() == "restarted"
    comm.shutdown()


def test_delay_blocks_only_the_waiter():
    comm = AsyncComm(delay_s=0.3)
    t0 = time.perf_counter()
    h = comm.submit(lambda: "x")
    assert time.perf_counter() - t0 < 0.1  # submit does not block
    time.sleep(0.2)  # "compute" overlapping the transfer
    assert h.wait() == "x"
    assert 0.05 < h.blocked_s < 0.2  # only the part not hidden by compute
    assert h.comm_s >= 0.3
    comm.shutdown()


def test_token_bucket_cap():
    sent = [0]

    def send(n):
        sent[0] += n

    comm = AsyncComm(bandwidth=1_000_000, sent_bytes=lambda: sent[0])  # 1 MB/s
    t0 = time.perf_counter()
    hs = [comm.submit(send, 100_000) for _ in range(4)]
    for h in hs:
        h.wait()
    elapsed = time.perf_counter() - t0
    assert sent[0] / elapsed <= 1_000_000 * 1.01
    assert elapsed < 0.8
    comm.shutdown()
    with pytest.raises(ValueError, match="sent_bytes"):
        AsyncComm(bandwidth=10)


# ---------------------------------------------------------------------------- overlap on 2 ranks

DELAY_S, STEP_S, H, PHASES = 0.5, 0.08, 10, 2


def _timed(rank: int, world: int) -> dict:
    from dilocox.outer import OuterLoop
    topo = build_topology(ParallelConfig(replicas=world))
    out = {}
    for overlap in ("none", "delayed", "eager"):
        model = make_model(0)
        opt = make_inner_opt(model)
        ocfg = OuterConfig(method="diloco", sync_every=H, overlap=overlap)
        loop = OuterLoop(list(model.named_parameters()), topo, ocfg, CompressConfig(), seed=0, layer_of=layer_of, comm_delay_s=DELAY_S)
        marks = [time.perf_counter()]
        for step in range(H * PHASES):
            time.sleep(STEP_S)  # the known inner step time
            forward_backward(model, 0, topo.replica, step)
            opt.step()
            opt.zero_grad()
            loop.after_inner_step(step)
            if (step + 1) % H == 0:
                marks.append(time.perf_counter())
        stats = dict(loop.stats)
        loop.finish()
        out[overlap] = {"phase_s": [b - a for a, b in zip(marks, marks[1:])], "blocked": stats["blocked_total_s"]}
    return out


def test_overlap_hides_communication():
    res = run_ranks(2, _timed)
    for r in res:
        none, delayed, eager = r["none"], r["delayed"], r["eager"]
        assert none["blocked"] > PHASES * DELAY_S * 0.8, none
        assert min(none["phase_s"]) > H * STEP_S + DELAY_S * 0.8, none
        for mode in (delayed, eager):
            assert mode["blocked"] < 0.15, mode
            assert max(mode["phase_s"]) < H * STEP_S + 0.2, mode
