"""Edges of SWARM mode found in the fourth review: DiLoCo-SWARM's streamed stage sync (rebalancing threw a moving
peer's local steps of every fragment but one away; the planner assumed one fragment), the per-step state a peer kept
for the whole run, and a live peer healed in a later round of its stage's sync (it took the round for its own step,
and waited for stage-norm keys the others had deleted)."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from datetime import timedelta

import pytest
import torch

from dilocox.config import ConfigError, load_config
from dilocox.net.rpc import run_secret
from dilocox.net.secure import sign_value
from dilocox.optim import lr_at
from dilocox.swarm import cli, peer_sync, step_end
from dilocox.swarm import plan as swarm_plan_mod
from dilocox.swarm.common import SwarmError, validate_layout
from dilocox.swarm.peer import SwarmPeer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
BASE = {"security": {"authenticate": False}, "checkpoint": {"every": 0}}


def _cfg(**sections):
    ov = json.loads(json.dumps(BASE))
    for k, v in sections.items():
        ov.setdefault(k, {}).update(v)
    return load_config(TINY, ov)


# ------------------------------------------------------------------ 1. streaming and rebalancing, the planner
@pytest.mark.parametrize("streaming", [{"fragments": 2}, {"tau": 1}])
def test_diloco_rebalancing_with_a_streamed_stage_sync_is_one_config_line_before_anything_starts(streaming, tmp_path):
    """Bug: with swarm.sync=diloco, rebalancing and outer.streaming (fragments > 1 or tau > 0) a moving peer left
    after fragment 0's outer step, where the other fragments had synced last H/K... steps before (tau: the last tau
    steps reach no all-reduce): those local steps were thrown away, against docs/SWARM.md. No step boundary has them
    all synced, so the combination is refused, naming the fields and the fix, by the launcher (nothing started) and
    by a hand-started peer (``validate_layout``)."""
    cfg = _cfg(
        swarm={"peers_per_stage": [2, 1], "sync": "diloco", "rebalance_period_s": 5},
        outer={"method": "diloco", "sync_every": 4, "streaming": streaming},
    )
    with pytest.raises(ConfigError, match=r"swarm.rebalance_period_s=5 .*outer.streaming.fragments=1 and outer"):
        validate_layout(cfg)
    out = tmp_path / "out"
    over = [f"--outer.streaming.{k}={v}" for k, v in streaming.items()]
    with pytest.raises(ConfigError, match=r"thrown away; set outer.streaming.fragments=1"):
        cli.main([TINY, "--peers", "2,1", "--steps", "4", "--out", str(out), "--rebalance-s", "5",
                  "--swarm.sync=diloco", "--outer.method=diloco", "--outer.sync_every=4", *over])  # fmt: skip
    assert not out.exists()
    # each alone is fine: streaming without rebalancing, rebalancing with one fragment and tau 0
    validate_layout(dataclasses.replace(cfg, swarm=dataclasses.replace(cfg.swarm, rebalance_period_s=0.0)))
    flat = dataclasses.replace(cfg.outer.streaming, fragments=1, tau=0)
    validate_layout(dataclasses.replace(cfg, outer=dataclasses.replace(cfg.outer, streaming=flat)))


def test_the_plan_streams_the_stage_sync_as_the_runtime_does(monkeypatch):
    """Bug: ``plan_config`` forced one fragment ("the runtime's stage sync does not stream"), but ``_build_outer``
    passes outer.streaming to ``build_outer``: the peers stream. The plan now uses the config's fragments, and a
    fragment count the stages' layers cannot hold (4 fragments, 2 layers per stage: the config load checks
    parallel.pipeline's stages, not SWARM's) is refused by the plan and by ``validate_layout`` (a peer died with an
    ``assign_fragments`` traceback), where the plan used to give numbers."""
    from dilocox.model import build_stage_model
    from dilocox.outer import build_outer

    cfg = _cfg(
        swarm={"peers_per_stage": [2, 2], "sync": "diloco"},
        outer={"method": "diloco", "sync_every": 4, "streaming": {"fragments": 2}},
    )
    seen = []
    real = swarm_plan_mod.stage_sync_wire
    monkeypatch.setattr(swarm_plan_mod, "stage_sync_wire", lambda *a, **k: seen.append(k) or real(*a, **k))
    row = swarm_plan_mod.plan_config(cfg)
    planned = {k.get("fragments", 1) for k in seen if not k.get("extra")}  # (extra: SWARM's per-step message)
    model = build_stage_model(cfg.model, stage=1, n_stages=2, seed=cfg.train.seed)
    outer = build_outer(
        list(model.named_parameters()),
        None,
        dataclasses.replace(cfg.outer, method="diloco"),
        cfg.compress,
        seed=0,
        layer_of=model.param_layer_id,
        n_layers_total=cfg.model.n_layers,
        group=None,
    )  # fmt: skip (as SwarmPeer._build_outer of a one-peer stage)
    try:
        assert planned == {outer.K} == {2}
        assert row["diloco_sync_bytes_per_stage"][1] == 2 * sum(c.wire_bytes(2) for c in outer.compressors)
    finally:
        outer.finish()
    too_many = _cfg(
        swarm={"peers_per_stage": [2, 2], "sync": "diloco"},
        outer={"method": "diloco", "sync_every": 4, "streaming": {"fragments": 4}},
    )
    with pytest.raises(ConfigError, match="outer.streaming.fragments=4 exceeds the 2 layers"):
        swarm_plan_mod.plan_config(too_many)
    with pytest.raises(ConfigError, match=r"outer.streaming.fragments=4 exceeds the 2 layers of a stage"):
        validate_layout(too_many)


# ------------------------------------------------------------------ 2. bounded per-step state
def _peer(tmp_path, cfg, stage: int, index: int = 0, store=None, steps: int = 10) -> SwarmPeer:
    """A real ``SwarmPeer`` (model, optimizer, RPC server) that is not started: its steps are driven by the test."""
    p = SwarmPeer(cfg, stage, index, store, None, str(tmp_path), steps=steps)
    p.metrics.prepare()
    return p


def test_a_long_run_keeps_only_recent_per_step_state_in_memory(tmp_path):
    """Bug: a peer kept, for the whole run, every microbatch visit, stage-0 route, ban, replay and record, and every
    end-of-step marker that arrived after its step's wait (a re-send after a replay, a late sender's): 600 steps left
    600 records, 2400 visits, 600 routes, 600 bans and 600 stale markers in memory (and in the final .pt). Now the
    trail of the last TRACE_STEPS steps, the newest RECORDS_KEPT records (every record is in the .jsonl) and no
    marker of a finished step; the trail a test reads of a short run is whole."""
    n = 600
    cfg = _cfg(swarm={"peers_per_stage": [1, 1]})
    p = _peer(tmp_path, cfg, stage=1, steps=n)
    peak = {}

    def end_of_step(k):
        p._handle("end_step", {"step": k, "sender": "s0p0", "n": 2}, {})  # on time
        type(p)._end_of_step(p, k)  # (the real wait: it finds the marker)
        for i in range(2):
            p.visits += [(k, f"s0p0:{k}:{i}", "fwd"), (k, f"s0p0:{k}:{i}", "bwd")]
        p.routes[f"s0p0:{k}:0"] = ["s0p0", "s1p0"]
        p.bans.append({"step": k, "mb": None, "peer": "s0p1", "reason": "test", "t": 0.0})
        p._handle("end_step", {"step": k, "sender": "s0p0", "n": 3}, {})  # late: a re-send after its wait

    def sync(k):
        with p.cv:
            p.step = k + 1
        peak["visits"] = max(peak.get("visits", 0), len(p.visits))
        return {}

    p._end_of_step, p._sync = end_of_step, sync
    try:
        p.run()
    finally:
        p.close()
    sizes = [len(p.records), len(p.visits), len(p.routes), len(p.bans), len(p.markers)]
    assert all(a < b for a, b in zip(sizes, [n, 4 * n, n, n, 1])), sizes  # (it was [600, 2400, 600, 600, 600])
    TRACE_STEPS, RECORDS_KEPT = step_end.TRACE_STEPS, step_end.RECORDS_KEPT
    assert len(p.records) == RECORDS_KEPT and p.records[-1]["step"] == n - 1
    assert p.markers == {}, sorted(p.markers)[:5]
    assert (
        len(p.visits) == 4 * TRACE_STEPS
        and p.visits[0][0] == n - TRACE_STEPS
        and peak["visits"] <= 4 * (TRACE_STEPS + 1)
    )
    assert len(p.routes) == len(p.bans) == TRACE_STEPS and next(iter(p.routes)) == f"s0p0:{n - TRACE_STEPS}:0"
    with open(tmp_path / "s1p0.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f if line.strip()]
    assert steps == list(range(n))  # every record is in the metrics file
    p.save()
    saved = torch.load(tmp_path / "s1p0.pt", weights_only=True)
    assert [r["step"] for r in saved["records"]] == list(range(n - RECORDS_KEPT, n))  # (final.py: the newest step)


# ------------------------------------------------------------------ 3. a live peer healed in a later round
class _HealingGroup:
    """A stage's torchft group in which this peer missed the quorum of its step and was healed in the round of step
    ``h``: ``load_from_peer`` with the live peer's state as it enters step h, the round's mean back."""

    def __init__(self, peer, h: int, mean: torch.Tensor) -> None:
        self.peer, self.h, self.mean = peer, h, mean
        self.healed, self.contributors = False, []

    def allreduce_mean(self, tensors, step):
        p = self.peer
        state = {"params": [t.detach().clone() + 0.5 for t in p.params], "opt": p.opt.state_dict(), "step": self.h}
        peer_sync.load_from_peer(p, state)
        self.healed, self.contributors = True, [0]
        return [self.mean.clone()]

    def close(self) -> None:
        pass


def test_a_live_peer_healed_in_a_later_round_takes_that_rounds_step_and_its_norm_keys(tmp_path):
    """Bug: a live peer left out of its stage's quorum of step k (late past the lighthouse's join timeout) met the
    stage's next round, was healed there with a live peer's state as it enters step k+1, and took that round's mean
    as its own step k: the lr and clip norm of step k, stage-norm keys of step k, which the other stages delete once
    they read step k+1's (the faster peers had), so it waited swarm.sync_timeout_s and died ("stage(s) [0] sent none
    for step 4"), or mixed the norms of two steps; and it went on one step behind. Now it takes the round's step,
    with its norm keys (still there: NORM_KEYS_KEPT), and goes on after it."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    cfg = _cfg(
        swarm={"peers_per_stage": [2, 2], "sync_timeout_s": 3},
        optim={"grad_clip": 1.0, "warmup_steps": 20},
    )
    p = _peer(tmp_path, cfg, stage=1, index=1, store=store)
    k, h = 4, 5
    key = peer_sync.norm_key(h, 0)  # the other stage's norm of step h; its key of step k is gone (deleted)
    store.set(key, sign_value(run_secret(), key, (4.0).hex()))
    n = sum(t.numel() for t in p.params)
    g = torch.full((n,), 1e-3)
    p.group = _HealingGroup(p, h, torch.cat([g, torch.ones(1)]))
    p.step = k
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(rec=_try(lambda: p._sync(k))), daemon=True)
    t.start()
    t.join(timeout=60)
    try:
        assert not t.is_alive(), "the sync hung"
        rec = out["rec"]
        assert not isinstance(rec, Exception), rec
        assert rec["healed_to"] == h and p.step == h + 1  # it goes on from the step after the round's
        want = (g.double().pow(2).sum() + 4.0).sqrt().item()  # the round's stage norm with the other stage's of step h
        assert rec["grad_norm"] == pytest.approx(want, rel=1e-6)
        assert rec["lr"] == lr_at(h, cfg) != lr_at(k, cfg)  # the round's step's lr (warm-up: they differ)
        assert store.check([peer_sync.norm_key(h, 1)])  # it wrote its stage's key of step h
    finally:
        p.close()


def _try(fn):
    try:
        return fn()
    except (SwarmError, RuntimeError) as e:
        return e


def test_the_run_goes_on_after_the_step_a_healed_sync_took(tmp_path):
    """Bug: ``run`` counted its steps on its own (``for k in range``): after a sync that took a later round's step h
    it served step k + 1 again (its requests all refused downstream, its sync one round behind for good). It goes on
    from h + 1."""
    cfg = _cfg(swarm={"peers_per_stage": [1, 1]})
    p = _peer(tmp_path, cfg, stage=1, steps=8)

    def end_of_step(k):
        p._handle("end_step", {"step": k, "sender": "s0p0", "n": 1}, {})
        type(p)._end_of_step(p, k)

    def sync(k):
        with p.cv:
            p.step = k + 3 if k == 2 else k + 1  # step 2's sync was healed into the round of step 4
        return {"healed_to": 4} if k == 2 else {}

    p._end_of_step, p._sync = end_of_step, sync
    try:
        p.run()
    finally:
        p.close()
    with open(tmp_path / "s1p0.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f if line.strip()]
    assert steps == [0, 1, 2, 5, 6, 7]


def test_a_live_peers_parameters_of_another_shape_are_refused_before_anything_is_copied(tmp_path):
    """``load_from_peer`` copied each received tensor into a parameter: ``copy_`` broadcasts a scalar over it."""
    p = _peer(tmp_path, _cfg(swarm={"peers_per_stage": [2, 2]}), stage=1, index=1, store=None)
    before = [t.detach().clone() for t in p.params]
    sent = [t.detach().clone() + 1 for t in p.params]
    for bad in (torch.zeros(()), before[-1].double(), "x"):
        with pytest.raises(RuntimeError, match="a live peer sent parameter"):
            peer_sync.load_from_peer(p, {"params": sent[:-1] + [bad], "opt": p.opt.state_dict(), "step": 3})
        assert all(torch.equal(a, b) for a, b in zip(p.params, before))
    peer_sync.load_from_peer(p, {"params": sent, "opt": p.opt.state_dict(), "step": 3})
    assert all(torch.equal(a, b + 1) for a, b in zip(p.params, before))


def test_what_an_authenticated_caller_sends_is_bounded_before_a_peer_acts_on_it(tmp_path):
    """Found by a review of what crosses the network (every caller here holds the run secret): ``leave``'s move_to
    became the peer's next command line as sent (``--out``, ``--config`` of the caller's choosing); a forward's
    ``budget_s`` was waited on as sent (JSON's Infinity overflowed the wait, 1e12 pinned a server thread); end-of-step
    markers were kept for any future step. Now: the move_to a mover sends, checked; the budget within the job's
    longest hop timeout; markers for at most MARKER_STEPS steps at once, the nearest ones."""
    from dilocox.swarm.membership import checked_move_to, moved_argv
    from dilocox.swarm.step_end import MARKER_STEPS

    mover = {"stage": 1, "index": 2, "lighthouse": "http://127.0.0.1:29510", "args": ["--pace-s", "0.08"]}
    assert checked_move_to(mover, 2) == mover and checked_move_to(None, 2) is None
    assert checked_move_to({**mover, "lighthouse": "http://node0:29531/"}, 2)["lighthouse"] == "http://node0:29531"
    argv = moved_argv(["--stage", "0", "--index", "1", "--out", "o"], checked_move_to(mover, 2))
    assert argv == ["--out", "o", "--stage", "1", "--index", "2", "--join", "--lighthouse", mover["lighthouse"],
                    "--pace-s", "0.08"]  # fmt: skip
    bads = [{"stage": 2}, {"index": True}, {"args": ["--out", "/tmp/x"]}, {"args": ["--pace-s", "nan"]},
            {"lighthouse": "-x:1"}, {"more": 1}]  # fmt: skip
    for bad in [{**mover, **b} for b in bads] + [[]]:
        with pytest.raises(ValueError, match="move_to"):
            checked_move_to(bad, 2)
    p = _peer(tmp_path, _cfg(swarm={"peers_per_stage": [2, 2], "rpc_timeout_s": 5}), stage=1, index=1, store=None)
    top = 5 * 2**p.n
    assert [p.caller_budget({"budget_s": b}) for b in (3.0, 1e12, float("inf"), float("nan"), -1.0)] == [
        3.0, top, 0.0, 0.0, 0.0
    ]  # fmt: skip
    assert p.caller_budget({}) == 0.0
    for k in range(MARKER_STEPS + 10):
        p._on_marker({"sender": "s0p0", "step": 10**6 + k, "n": 1})
    assert len(p.markers) == MARKER_STEPS and max(p.markers) == 10**6 + MARKER_STEPS - 1
    p._on_marker({"sender": "s0p1", "step": 10**6, "n": 2})  # (a step already kept takes its other senders)
    assert p.markers[10**6] == {"s0p0": 1, "s0p1": 2}
    p._on_marker({"sender": "s0p0", "step": p.step, "n": 3})  # a real step's marker is not crowded out: the farthest
    assert p.markers[p.step] == {"s0p0": 3} and len(p.markers) == MARKER_STEPS  # step goes for it
    assert max(p.markers) == 10**6 + MARKER_STEPS - 2
