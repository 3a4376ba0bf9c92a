"""The async outer transport (distributed/comm.py) and the point of overlap: hidden comm time."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from dilocox.config import CompressConfig, OuterConfig, ParallelConfig
from dilocox.distributed.comm import AsyncComm
from dilocox.distributed.topology import build_topology
from tests.reference_diloco import forward_backward, layer_of, make_inner_opt, make_model
from tests.spawn import run_ranks

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
    # Timing asserts are ratios between the caller's and the comm thread's clocks (a loaded machine
    # stretches both), never absolute limits; only the sleeps' lower bounds are absolute.
    delay, compute = 0.3, 0.2
    comm = AsyncComm(delay_s=delay)
    t0 = time.perf_counter()
    h = comm.submit(lambda: "x")
    submit_s = time.perf_counter() - t0
    time.sleep(compute)  # "compute" overlapping the transfer
    assert h.wait() == "x"
    assert h.comm_s >= delay
    assert submit_s < h.comm_s / 3  # submit does not block
    # only the part not hidden by compute: ~(delay - compute) / delay = 1/3 of the transfer, not all of it
    assert h.blocked_s < h.comm_s * (1 - 0.5 * compute / delay), (h.blocked_s, h.comm_s)
    assert h.blocked_s > 0.0
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
    rate = sent[0] / elapsed
    assert rate <= 1_000_000 * 1.01  # the cap holds (a loaded machine only slows the sender further)
    assert rate > 1_000_000 * 0.4  # and throttles to the cap, not far below it (ideal: 400 kB in 0.4 s)
    comm.shutdown()
    with pytest.raises(ValueError, match="sent_bytes"):
        AsyncComm(bandwidth=10)


# ---------------------------------------------------------------------------- overlap on 2 ranks

DELAY_S, STEP_S, H, PHASES = 0.3, 0.05, 10, 2


def _timed(rank: int, world: int) -> dict:
    from dilocox.outer import build_outer as OuterLoop  # noqa: N813 (the outer object for ocfg.method)

    topo = build_topology(ParallelConfig(replicas=world))
    out = {}
    for overlap in ("none", "delayed", "eager"):
        model = make_model(0)
        opt = make_inner_opt(model)
        ocfg = OuterConfig(method="diloco", sync_every=H, overlap=overlap)
        loop = OuterLoop(
            list(model.named_parameters()),
            topo,
            ocfg,
            CompressConfig(),
            seed=0,
            layer_of=layer_of,
            comm_delay_s=DELAY_S,
        )
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
        out[overlap] = {"phase_s": [b - a for a, b in itertools.pairwise(marks)], "blocked": stats["blocked_total_s"]}
    return out


def test_overlap_hides_communication():
    """Overlapped modes hide the transfer that ``none`` waits for.

    Asserted as ratios between the modes of one run, not absolute times (a 1.0 s limit failed at
    1.019 s on a loaded 2-core machine): load stretches every mode's compute alike, while the hidden
    transfer (DELAY_S per sync) stays the difference. Ideal phase: none H*STEP_S + DELAY_S = 0.8 s,
    delayed/eager H*STEP_S = 0.5 s (ratio 0.62); without overlap the ratio would be ~1.
    """
    res = run_ranks(2, _timed)
    for r in res:
        none, delayed, eager = r["none"], r["delayed"], r["eager"]
        # lower bounds from the emulated link's sleep: load can only lengthen them
        assert none["blocked"] > PHASES * DELAY_S * 0.8, none
        assert min(none["phase_s"]) > H * STEP_S + DELAY_S * 0.8, none
        for mode in (delayed, eager):
            # ideal ~0 (a loaded host: the ranks' skew and the GIL; 0.35 still tells a hidden wait from none's)
            assert mode["blocked"] < 0.35 * none["blocked"], (mode, none)
            assert sum(mode["phase_s"]) < 0.9 * sum(none["phase_s"]), (mode, none)  # ideal 0.62
