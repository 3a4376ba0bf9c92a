"""The stage-sync extras of a SWARM peer (dilocox/swarm/peer_sync.py): optim.grad_clip's global norm through the
store and the inner step it clips (dilocox/inner_step.py), the stage-local rule of DiLoCo-SWARM, and the bounded
wait of a DiLoCo-SWARM joiner. In-process, no peers: the process-level checks are in test_swarm_runtime.py (1 x 1
with grad_clip vs the single process; the restart test, parametrized for diloco)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
from torch.distributed import TCPStore

from dilocox.config import Config
from dilocox.inner_step import InnerStep
from dilocox.net.rpc import RpcServer
from dilocox.optim import lr_at
from dilocox.swarm import peer_sync


def _peer(store, stage: int, n: int, clip: float = 1.0, sync_timeout_s: float = 10.0, **kw):
    return SimpleNamespace(
        cfg=SimpleNamespace(optim=SimpleNamespace(grad_clip=clip), outer=SimpleNamespace(sync_every=2)),
        s=SimpleNamespace(sync_timeout_s=sync_timeout_s, rpc_timeout_s=kw.pop("rpc_timeout_s", 5.0)),
        store=store,
        store_lock=threading.Lock(),
        n=n,
        stage=stage,
        name=f"s{stage}p0",
        **kw,
    )


@pytest.fixture
def store():
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield master


def _client(master):
    return TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10))


def _inner(clip: float, *grads: torch.Tensor) -> tuple[InnerStep, list[torch.nn.Parameter]]:
    """A peer's InnerStep (the default schedule, SGD) over parameters holding ``grads``."""
    cfg = Config()
    cfg.optim.grad_clip = clip
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return InnerStep(torch.optim.SGD(params, lr=0.0), cfg), params


def test_global_norm_is_the_global_norm_on_every_stage(store):
    torch.manual_seed(0)
    grads = [torch.randn(50), torch.randn(30) * 3]
    ref = [g.clone().requires_grad_(False) for g in grads]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in ref]
    for p, g in zip(params, ref):
        p.grad = g.clone()
    want_norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
    for step in range(peer_sync.NORM_KEYS_KEPT + 1):
        peers = [_peer(_client(store), j, 2) for j in range(2)]
        norms = [None, None]

        def run(j, step=step, peers=peers, norms=norms):
            norms[j] = peer_sync.global_norm(peers[j], step, grads[j].clone())

        threads = [threading.Thread(target=run, args=(j,)) for j in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        assert norms[0] == norms[1] == pytest.approx(want_norm, rel=1e-6)  # the same norm on both stages
        for j in range(2):  # and clipped by it, each stage's grads are the single process's clipped grads
            inner, (p,) = _inner(1.0, grads[j])
            rec = inner.clip(norms[j])
            assert rec["grad_norm"] == norms[0] and rec["clip_coef"] == min(1.0, 1.0 / (norms[0] + 1e-6)) < 0.2
            torch.testing.assert_close(p.grad, params[j].grad, rtol=1e-6, atol=1e-7)
    # step NORM_KEYS_KEPT read: the keys of step 0 are gone, the later ones stay (a peer behind still finds them)
    assert not store.check([peer_sync.norm_key(0, 0)]) and not store.check([peer_sync.norm_key(0, 1)])
    assert store.check([peer_sync.norm_key(1, 0), peer_sync.norm_key(1, 1)])


def test_swarm_step_clipping_off_and_stage_without_microbatches(store):
    inner, (p,) = _inner(0.0, torch.ones(4))
    peer = _peer(store, 0, 1, clip=0.0, inner=inner, _set_grads=lambda g: setattr(p, "grad", g.clone()))
    mean = torch.tensor([2.0, 2.0, 2.0, 2.0, 2.0])  # [grad sum | count]: the mean gradient is 1
    assert peer_sync.swarm_step(peer, 0, mean) == {"lr": lr_at(0, inner.cfg)}  # clipping off: no norm exchanged
    assert not store.check([peer_sync.norm_key(0, 0)])
    # a stage that served nothing this step still sends its (zero) norm, so the other stages do not wait for it
    inner.cfg.optim.grad_clip = 1.0
    rec = peer_sync.swarm_step(peer, 1, torch.zeros(5))
    assert rec == {"lr": lr_at(1, inner.cfg), "grad_norm": 0.0, "clip_coef": 1.0}
    assert store.check([peer_sync.norm_key(1, 0)]) and p.grad is None


def test_global_norm_missing_stage_is_bounded_and_named(store):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"stage\(s\) \[1\] sent none for step 3 within swarm.sync_timeout_s=0.3s"):
        peer_sync.global_norm(_peer(store, 0, 2, sync_timeout_s=0.3), 3, torch.ones(4))
    assert time.monotonic() - t0 < 3


def test_local_step_uses_the_peers_own_norm():
    for clip, coef in ((1.0, 1 / (5 + 1e-6)), (10.0, 1.0)):  # above the norm: untouched
        inner, (p,) = _inner(clip, torch.zeros(2))
        seen = []
        peer = _peer(None, 1, 2, clip=clip, inner=inner, _set_grads=lambda g, p=p: setattr(p, "grad", g.clone()))
        inner.optimizer.step = lambda seen=seen, p=p: seen.append(p.grad.clone())
        rec = peer_sync.local_step(peer, 0, torch.tensor([6.0, 8.0]), 2)  # mean gradient [3, 4]
        assert rec["grad_norm"] == pytest.approx(5.0) and rec["clip_coef"] == pytest.approx(coef)
        assert torch.equal(seen[0], torch.tensor([3.0, 4.0]) * coef) and p.grad is None
    seen.clear()
    assert peer_sync.local_step(peer, 1, torch.zeros(2), 0) == {"lr": lr_at(1, inner.cfg)}  # no microbatch: no step
    assert seen == []


def _stage_peer(addrs: dict, **kw):
    p = _peer(None, 1, 2, m=2, index=1, addrs=addrs, members=None, **kw)
    p._refresh_addr = lambda name: False
    return p


def test_joiner_waits_for_the_end_of_an_outer_phase():
    pings = []

    def handler(method, meta, tensors):
        pings.append(method)
        last = len(pings) >= 3  # the live peer reaches the last inner step of its phase at the third ping
        return {"name": "s1p0", "step": 7 if last else 6, "outer_next": last, "syncing": False}, {}

    srv = RpcServer(handler)
    try:
        assert peer_sync._await_phase_end(_stage_peer({"s1p0": srv.addr})) == "s1p0"
        assert len(pings) == 3
    finally:
        srv.close()


def test_joiner_wait_fails_fast_when_its_stage_is_gone():
    srv = RpcServer(lambda *a: ({}, {}))
    addr = srv.addr
    srv.close()  # a dead stage peer: connection refused
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="cannot join: no peer of stage 1 answered for swarm.rpc_timeout_s=0.5s"):
        peer_sync._await_phase_end(_stage_peer({"s1p0": addr}, rpc_timeout_s=0.5))
    assert time.monotonic() - t0 < 5
