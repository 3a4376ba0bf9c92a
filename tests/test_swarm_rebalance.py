"""SWARM adaptive rebalancing (dilocox/swarm/rebalance.py, SWARM Appendix D): which peer moves where."""

import json
import logging
import math
import os
import signal
import subprocess

import pytest
import torch

from dilocox.config import ConfigError, load_config
from dilocox.swarm.membership import LoadMeter, peer_loads, window
from dilocox.swarm.rebalance import PeerLoad, Rebalancer, plan_move
from dilocox.swarm.routing import IWRRRouter, RandomRouter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def P(peer, stage, queue, thr=1.0):
    return PeerLoad(peer, stage, queue, thr)


def test_peer_of_least_loaded_stage_moves_to_the_most_loaded():
    peers = [P("a", 0, 2), P("b", 0, 0), P("c", 0, 1), P("d", 1, 10)]
    mv = plan_move(peers, 2)
    assert (mv.peer, mv.from_stage, mv.to_stage) == ("b", 0, 1)  # b has the shortest queue in stage 0
    assert mv.load_before == (1.0, 10.0)
    assert mv.load_after == pytest.approx((3 / 2, 5.0))
    assert mv.gain == pytest.approx(0.5)
    assert (mv.throughput_before, mv.throughput_after) == (1.0, 2.0)
    assert "peer 'b' moves stage 0 -> 1" in mv.describe() and "1 -> 2 microbatches/s" in mv.describe()


def test_three_stages_pick_min_and_max():
    peers = [P("a", 0, 4), P("b", 0, 4), P("c", 1, 0), P("d", 1, 1), P("e", 2, 30), P("f", 2, 30)]
    mv = plan_move(peers, 3)
    assert (mv.peer, mv.from_stage, mv.to_stage) == ("c", 1, 2)


def test_no_move_that_would_empty_a_stage():
    assert plan_move([P("a", 0, 0), P("b", 1, 50), P("c", 1, 50)], 2) is None


def test_no_move_when_balanced_or_idle():
    assert plan_move([P("a", 0, 3), P("b", 0, 3), P("c", 1, 6, 2.0)], 2) is None  # both drain in 3 s
    assert plan_move([P("a", 0, 0), P("b", 0, 0), P("c", 1, 0)], 2) is None


def test_no_move_below_the_gain_threshold():
    # stage 1: ten peers, load 10/10 = 1 s; one more peer only brings it to 10/11 (a 9 % gain)
    peers = [P("a", 0, 0), P("b", 0, 0)] + [P(f"s{i}", 1, 1) for i in range(10)]
    assert plan_move(peers, 2, min_gain=0.1) is None
    mv = plan_move(peers, 2, min_gain=0.05)
    assert mv is not None and mv.gain == pytest.approx(1 - 10 / 11)


def test_no_move_when_it_would_make_things_worse():
    # stage 0 is barely less loaded; losing a peer makes it the new bottleneck, worse than before
    peers = [P("a", 0, 9), P("b", 0, 9), P("c", 1, 10), P("d", 1, 10)]
    assert plan_move(peers, 2, min_gain=0.0) is None


def test_throughput_estimate_scales_with_the_stages_cost():
    # stage 1 is 4x as expensive per microbatch: a stage-0 peer moving there adds 1/4 of its stage-0 speed
    peers = [P("a", 0, 0, 8.0), P("b", 0, 0, 8.0), P("c", 1, 20, 2.0)]
    mv = plan_move(peers, 2)
    assert mv.to_stage == 1 and mv.load_after[1] == pytest.approx(20 / (2.0 + 2.0))


def test_an_empty_stage_gets_a_peer():
    mv = plan_move([P("a", 0, 5), P("b", 0, 1), P("c", 1, 9)], 3)
    assert (mv.peer, mv.from_stage, mv.to_stage) == ("b", 0, 2)
    assert math.isinf(mv.load_before[2]) and mv.load_after[2] == 0.0 and mv.gain == 1.0
    assert mv.throughput_before == 0.0 and mv.throughput_after == 1.0


def test_rebalancer_period():
    t = [0.0]
    rb = Rebalancer(2, period_s=300, clock=lambda: t[0])
    peers = [P("a", 0, 0), P("b", 0, 0), P("c", 1, 10)]
    assert rb.maybe_move(peers) is None
    t[0] = 299.0
    assert rb.maybe_move(peers) is None
    t[0] = 300.0
    assert rb.maybe_move(peers).peer == "a"
    assert rb.maybe_move(peers) is None  # the period restarted
    t[0] = 600.0
    assert rb.maybe_move(peers) is not None


def test_bad_reports():
    with pytest.raises(ValueError, match="stage=2 is not in"):
        plan_move([P("a", 2, 0)], 2)
    with pytest.raises(ValueError, match="throughput=0"):
        plan_move([P("a", 0, 0, 0)], 2)
    with pytest.raises(ValueError, match="queue=-1"):
        plan_move([P("a", 0, -1)], 2)
    with pytest.raises(ValueError, match="reported twice"):
        plan_move([P("a", 0, 0), P("a", 1, 0)], 2)
    with pytest.raises(ValueError, match="min_gain"):
        plan_move([P("a", 0, 0)], 2, min_gain=1.0)
    with pytest.raises(ValueError, match="period_s"):
        Rebalancer(2, period_s=0)


# ---------------------------------------------------------------------------------------------- carrying moves out


@pytest.mark.parametrize("kind", ["iwrr", "random"])
def test_router_remove_and_add(kind):
    """A peer that left (bye) is never chosen again and late reports about it are ignored; one that joined (hello)
    is chosen; IWRR starts it at the current minimum priority (it does not flood)."""
    r = IWRRRouter(["a", "b"]) if kind == "iwrr" else RandomRouter(["a", "b"], seed=1)
    r.remove("b")
    assert r.live() == ["a"] and {r.choose() for _ in range(20)} == {"a"}
    r.done("b", 0.5)  # a reply that was in flight when it left
    r.failed("b")
    assert r.live() == ["a"]
    with pytest.raises(KeyError):
        r.remove("b")  # unknown now
    if kind == "iwrr":
        for _ in range(5):
            r.done(r.choose(), 1.0)
    r.add("c")
    picks = [r.choose() for _ in range(40)]
    assert "c" in picks
    if kind == "iwrr":
        assert abs(picks.count("c") - picks.count("a")) <= 1  # equal EMAs: alternate, no flood of the new peer
    r.add("b")  # back again (a new peer at the same name)
    assert "b" in r.live()


def test_load_meter_window():
    """Queue = time-average of the microbatches waiting for or in the compute; throughput = done / busy seconds."""
    t = [0.0]
    m = LoadMeter(clock=lambda: t[0])
    a = m.snapshot()
    m.enter()  # one microbatch for 1 s
    t[0] = 1.0
    m.enter()  # a second one queues behind it
    t[0] = 2.0
    m.exit(done=True)
    t[0] = 3.0
    m.exit(done=True)
    t[0] = 5.0  # idle for 2 s
    b = m.snapshot()
    q, thr = window(a, b)
    assert q == pytest.approx((1 + 2 + 1) / 5)
    assert thr == pytest.approx(2 / 3)  # 2 microbatches in 3 busy seconds (idle time is not counted)
    assert window(b, m.snapshot()) is None  # nothing done: no throughput to measure


def _snap(t, area, busy, done, stage, step=5, **kw):
    return {"t": t, "area": area, "busy": busy, "done": done, "stage": stage, "step": step, "serving": True, **kw}


def test_an_idle_peer_is_spare_capacity_of_its_stage_and_moves():
    """The CI failure of test_peer_moves_into_stage0: stage 1's router starved s1p1 (its first microbatch was slow on
    a loaded host), so s1p1 did no work in any window; leaving it out left stage 1 with one measured peer and no move
    was ever made. An idle serving peer counts with queue 0 at its stage's mean speed, and it is the one that moves."""
    prev = {"s0p0": _snap(0, 0, 0, 0, 0), "s1p0": _snap(0, 0, 0, 0, 1), "s1p1": _snap(0, 0, 0, 1, 1)}
    cur = {
        "s0p0": _snap(2, 5.0, 1.9, 20, 0),  # always busy, 2.5 queued: the bottleneck
        "s1p0": _snap(2, 0.1, 0.1, 20, 1),  # 200 mb/s when busy
        "s1p1": _snap(2, 0.0, 0.0, 1, 1),  # idle the whole window
    }
    loads, warm = peer_loads(prev, cur)
    assert warm
    by = {p.peer: p for p in loads}
    assert by["s1p1"].queue == 0.0 and by["s1p1"].throughput == pytest.approx(by["s1p0"].throughput)
    mv = plan_move(loads, 2)
    assert mv is not None and (mv.peer, mv.from_stage, mv.to_stage) == ("s1p1", 1, 0)
    # left out: a peer that held work without finishing any (speed unknown), one not serving, one leaving
    cur["s1p1"] = _snap(2, 1.0, 1.0, 1, 1)
    assert "s1p1" not in {p.peer for p in peer_loads(prev, cur)[0]}
    for extra in ({"serving": False}, {"leaving": True}):
        cur["s1p1"] = _snap(2, 0.0, 0.0, 1, 1, **extra)
        assert "s1p1" not in {p.peer for p in peer_loads(prev, cur)[0]}
    # an idle stage with no measured peer gives no speed to borrow: left out
    cur["s1p0"] = _snap(2, 0.0, 0.0, 0, 1)
    cur["s1p1"] = _snap(2, 0.0, 0.0, 1, 1)
    assert {p.stage for p in peer_loads(prev, cur)[0]} == {0}
    # not warm while a peer had not finished 2 steps at the window's start
    prev["s1p0"] = _snap(0, 0, 0, 0, 1, step=1)
    assert not peer_loads(prev, cur)[1]


def _moves(out: str, caplog) -> list[dict]:
    """The records of OUT/rebalance.jsonl; when there is none, the mover's decisions in the failure message."""
    path = os.path.join(out, "rebalance.jsonl")
    if not os.path.exists(path):
        said = "\n".join(r.getMessage() for r in caplog.records if r.name == "dilocox.swarm.mover")
        pytest.fail(f"no move was made or refused (no {path}); the mover said:\n{said or '(nothing)'}")
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_rebalance_config_checked():
    base = [os.path.join(ROOT, "configs", "tiny.yaml")]
    with pytest.raises(ConfigError, match="swarm.rebalance_period_s=-1.0"):
        load_config(*base, ["--swarm.rebalance_period_s=-1"])
    with pytest.raises(ConfigError, match="swarm.rebalance_min_gain"):
        load_config(*base, ["--swarm.rebalance_min_gain=1.5"])
    with pytest.raises(ConfigError, match="needs outer.overlap=none"):
        load_config(*base, ["--swarm.rebalance_period_s=5", "--swarm.sync=diloco", "--outer.overlap=delayed"])
    assert load_config(*base, ["--swarm.rebalance_period_s=5", "--swarm.sync=diloco"]).swarm.sync == "diloco"
    assert load_config(*base, ["--swarm.rebalance_period_s=300"]).swarm.rebalance_period_s == 300


def _left_over(out_dir: str) -> list[str]:
    """Processes still running whose command line names this test's output directory."""
    ps = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True, timeout=10).stdout
    return [line for line in ps.splitlines() if out_dir in line and "ps -eo" not in line]


@pytest.mark.slow
def test_peer_moves_to_the_slow_stage(tmp_path, monkeypatch, caplog):
    """[2, 1] with stage 1 the bottleneck (every stage-1 peer, the moved one too, takes 80 ms per
    microbatch): the launcher moves a stage-0 peer to stage 1; it downloads stage 1's state, serves, and the job's
    measured tokens/s goes up; every step's microbatches are trained once by each stage, before and after."""
    from dilocox.swarm.peer import DIGEST_ENV
    from dilocox.swarm.runtime import launch

    monkeypatch.setenv(DIGEST_ENV, "1")  # every sync record carries a hash of the peer's params + AdamW state

    over = [
        "--model.n_layers=2", "--model.d_model=64", "--data.max_bytes=200000", "--train.batch_size=8",
        "--train.seq_len=32", "--optim.warmup_steps=0", "--optim.schedule=constant", "--swarm.microbatch_size=2",
        "--swarm.max_inflight=4", "--swarm.step_timeout_s=60", "--swarm.sync_timeout_s=60",
        "--swarm.rpc_timeout_s=20", "--swarm.ban_s=0.5", "--swarm.rebalance_period_s=2",
    ]  # fmt: skip
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), over)
    steps = 50
    out = str(tmp_path)
    caplog.set_level(logging.INFO, logger="dilocox.swarm.mover")
    try:
        res = launch(cfg, out, peers_per_stage=[2, 1], steps=steps, timeout_s=240, stage_paces={1: 0.08})
    finally:
        for line in _left_over(out):
            os.kill(int(line.split()[0]), signal.SIGKILL)
    assert not _left_over(out)
    for name, rc in res.returncodes.items():
        assert rc == 0, f"{name} exited {rc}:\n{res.log_tail(name)}"
    moves = _moves(out, caplog)
    done = [m for m in moves if "line" in m]
    assert len(done) == 1, moves
    mv = done[0]
    assert mv["from"] == 0 and mv["to"] == 1 and mv["peer"] in ("s0p0", "s0p1") and mv["joiner"] == "s1p1"
    assert set(res.returncodes) == {"s0p0", "s0p1", "s1p0"}  # the moved peer is the same process, no new one
    assert "measured" in mv["line"] and "tokens/s" in mv["line"]
    assert mv["tokens_s_after"] > mv["tokens_s_before"], mv["line"]  # (capacity doubles; per-step overheads stay)
    leaver, stayer = mv["peer"], ({"s0p0", "s0p1"} - {mv["peer"]}).pop()
    left = [r for r in res.records[leaver] if r.get("left")]
    assert len(left) == 1 and res.records[leaver][-1] is left[0] and left[0]["moved_to"] == "s1p1"
    k_left = left[0]["step"]
    joined = [r for r in res.records["s1p1"] if r.get("joined")]
    assert len(joined) == 1 and joined[0]["contributors"] == [0], joined
    k_join = joined[0]["step"]
    assert k_left < k_join < steps - 2
    served = [r for r in res.records["s1p1"] if r["step"] > k_join]
    assert [r["step"] for r in served] == list(range(k_join + 1, steps))
    assert sum(r["microbatches"] for r in served) > 0, "the joiner never served"
    # every step: each microbatch of the stage-0 peers trained once by stage 1 (before, between and after the move)
    per_step = {}
    for name in ("s0p0", "s0p1", "s1p0", "s1p1"):
        for r in res.records[name]:
            if "microbatches" in r:
                per_step.setdefault(r["step"], [0, 0])[int(name[1])] += r["microbatches"]
    assert sorted(per_step) == list(range(steps))
    for k, (n0, n1) in per_step.items():
        assert n0 == (8 if k <= k_left else 4) and n1 == n0, (k, n0, n1)
    bwd1 = [mb for n in ("s1p0", "s1p1") for _, mb, kind in res.peers[n]["visits"] if kind == "bwd"]
    routes = {**res.peers["s0p0"]["routes"], **res.peers["s0p1"]["routes"]}
    assert sorted(bwd1) == sorted(routes), "a microbatch was lost or trained twice in stage 1"
    assert not any(r[1] == "s1p1" for mb, r in routes.items() if int(mb.split(":")[1]) <= k_join)  # before it served
    assert any(r[1] == "s1p1" for mb, r in routes.items() if mb.startswith(stayer + ":"))
    digests = {r["step"]: r["digest"] for r in res.records["s1p0"] if "digest" in r}
    assert joined[0]["digest"] == digests[k_join], "the moved peer left its first sync unlike its new stage"
    assert all(r["digest"] == digests[r["step"]] for r in served), "params or AdamW state diverged after the join"
    a, b = res.peers["s1p0"]["params"], res.peers["s1p1"]["params"]
    assert all(torch.equal(a[n], b[n]) for n in a), "the moved peer differs from its new stage"


@pytest.mark.slow
def test_diloco_peer_moves_at_an_outer_step(tmp_path, monkeypatch, caplog):
    """swarm.sync=diloco, [2, 1] with stage 1 the bottleneck: the chosen stage-0 peer leaves only after an outer
    step (its H local steps count), joins stage 1 at that stage's next outer step with θ, outer momentum and a
    live peer's AdamW state (bit-identical there), serves, and the stage's peers end with the same params."""
    from dilocox.swarm.peer import DIGEST_ENV
    from dilocox.swarm.runtime import launch

    monkeypatch.setenv(DIGEST_ENV, "1")
    H = 4
    over = [
        "--model.n_layers=2", "--model.d_model=64", "--data.max_bytes=200000", "--train.batch_size=8",
        "--train.seq_len=32", "--optim.warmup_steps=0", "--optim.schedule=constant", "--swarm.microbatch_size=2",
        "--swarm.max_inflight=4", "--swarm.step_timeout_s=60", "--swarm.sync_timeout_s=60",
        "--swarm.rpc_timeout_s=20", "--swarm.ban_s=0.5", "--swarm.rebalance_period_s=2", "--swarm.sync=diloco",
        f"--outer.sync_every={H}",
    ]  # fmt: skip
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), over)
    steps = 48
    out = str(tmp_path)
    caplog.set_level(logging.INFO, logger="dilocox.swarm.mover")
    try:
        res = launch(cfg, out, peers_per_stage=[2, 1], steps=steps, timeout_s=300, stage_paces={1: 0.08})
    finally:
        for line in _left_over(out):
            os.kill(int(line.split()[0]), signal.SIGKILL)
    assert not _left_over(out)
    for name, rc in res.returncodes.items():
        assert rc == 0, f"{name} exited {rc}:\n{res.log_tail(name)}"
    moves = _moves(out, caplog)
    done = [m for m in moves if "line" in m]
    assert len(done) == 1, moves
    mv = done[0]
    assert mv["from"] == 0 and mv["to"] == 1 and mv["joiner"] == "s1p1" and "measured" in mv["line"]
    assert set(res.returncodes) == {"s0p0", "s0p1", "s1p0"}  # the same process moved
    left = [r for r in res.records[mv["peer"]] if r.get("left")]
    assert len(left) == 1 and left[0]["moved_to"] == "s1p1"
    k_left = left[0]["step"]
    assert (k_left + 1) % H == 0, f"left at step {k_left}, not at the end of an outer phase (H={H})"
    joined = [r for r in res.records["s1p1"] if r.get("joined")]
    assert len(joined) == 1 and joined[0]["outer"] and joined[0]["contributors"] == [0], joined
    k_join = joined[0]["step"]
    assert (k_join + 1) % H == 0 and k_left < k_join < steps - H, (k_left, k_join)
    digests = {r["step"]: r["digest"] for r in res.records["s1p0"] if "digest" in r}
    assert joined[0]["digest"] == digests[k_join], "params, θ or AdamW state differ from the stage's at the join"
    served = [r for r in res.records["s1p1"] if r["step"] > k_join]
    assert [r["step"] for r in served] == list(range(k_join + 1, steps))
    assert sum(r["microbatches"] for r in served) > 0, "the joiner never served"
    outer_steps = {r["step"] for r in res.records["s1p0"] if r.get("outer")}
    assert outer_steps == set(range(H - 1, steps, H))  # the stage kept its outer schedule through the move
    assert all(sorted(r.get("outer_contributors", [])) == [0, 1] for r in res.records["s1p0"] if r.get("outer")
               and r["step"] > k_join), "the moved peer did not contribute to stage 1's later outer steps"  # fmt: skip
    per_step = {}
    for name in ("s0p0", "s0p1", "s1p0", "s1p1"):
        for r in res.records[name]:
            if "microbatches" in r:
                per_step.setdefault(r["step"], [0, 0])[int(name[1])] += r["microbatches"]
    assert sorted(per_step) == list(range(steps))
    for k, (n0, n1) in per_step.items():
        assert n0 == (8 if k <= k_left else 4) and n1 == n0, (k, n0, n1)
    a, b = res.peers["s1p0"]["params"], res.peers["s1p1"]["params"]
    assert all(torch.equal(a[n], b[n]) for n in a), "stage 1's peers differ after the last outer step"


@pytest.mark.slow
def test_peer_moves_into_stage0(tmp_path, monkeypatch, caplog):
    """[1, 2] with stage 0 the bottleneck (paced 80 ms per microbatch): a stage-1 peer moves into stage 0, gets
    stage 0's params and AdamW state, and from then on drives its own batch each step (a stream of its own: the
    job's microbatches per step double), bit-identical to s0p0 at every sync."""
    from dilocox.swarm.peer import DIGEST_ENV
    from dilocox.swarm.runtime import launch

    monkeypatch.setenv(DIGEST_ENV, "1")
    over = [
        "--model.n_layers=2", "--model.d_model=64", "--data.max_bytes=200000", "--train.batch_size=8",
        "--train.seq_len=32", "--optim.warmup_steps=0", "--optim.schedule=constant", "--swarm.microbatch_size=2",
        "--swarm.max_inflight=4", "--swarm.step_timeout_s=60", "--swarm.sync_timeout_s=60",
        "--swarm.rpc_timeout_s=20", "--swarm.ban_s=0.5", "--swarm.rebalance_period_s=2",
    ]  # fmt: skip
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), over)
    steps = 40
    out = str(tmp_path)
    caplog.set_level(logging.INFO, logger="dilocox.swarm.mover")
    try:
        res = launch(cfg, out, peers_per_stage=[1, 2], steps=steps, timeout_s=240, stage_paces={0: 0.08})
    finally:
        for line in _left_over(out):
            os.kill(int(line.split()[0]), signal.SIGKILL)
    assert not _left_over(out)
    for name, rc in res.returncodes.items():
        assert rc == 0, f"{name} exited {rc}:\n{res.log_tail(name)}"
    moves = _moves(out, caplog)
    done = [m for m in moves if "line" in m]
    assert len(done) == 1 and not any("refused" in m or "error" in m for m in moves), moves
    mv = done[0]
    assert mv["from"] == 1 and mv["to"] == 0 and mv["joiner"] == "s0p1", mv
    k_left = next(r["step"] for r in res.records[mv["peer"]] if r.get("left"))
    joined = [r for r in res.records["s0p1"] if r.get("joined")]
    assert len(joined) == 1 and joined[0]["contributors"] == [0], joined
    k_join = joined[0]["step"]
    assert k_left < k_join < steps - 2
    per_step = {}
    for name in ("s0p0", "s0p1", "s1p0", "s1p1"):
        for r in res.records[name]:
            if "microbatches" in r and not r.get("joined"):
                per_step.setdefault(r["step"], [0, 0])[int(name[1])] += r["microbatches"]
    assert sorted(per_step) == list(range(steps))
    for k, (n0, n1) in per_step.items():
        assert n0 == (4 if k <= k_join else 8) and n1 == n0, (k, n0, n1)
    routes = {**res.peers["s0p0"]["routes"], **res.peers["s0p1"]["routes"]}
    assert sum(mb.startswith("s0p1:") for mb in routes) == 4 * (steps - 1 - k_join)  # its own batches, every step
    digests = {r["step"]: r["digest"] for r in res.records["s0p0"] if "digest" in r}
    mine = [r for r in res.records["s0p1"] if "digest" in r]
    assert mine and all(r["digest"] == digests[r["step"]] for r in mine), "the stage-0 peers diverged"
    assert mv["tokens_s_after"] > mv["tokens_s_before"], mv["line"]


def test_moved_argv_keeps_overrides_after_the_separator():
    """A moved peer's command: its old place flags out, the new ones in, BEFORE ``--`` (a ``--netns`` peer ends with
    ``-- --swarm.host=198.18.0.2``: a flag after it would be read as a config override)."""
    from dilocox.swarm.membership import moved_argv

    argv = [
        "--config",
        "c.yaml",
        "--stage",
        "0",
        "--index",
        "1",
        "--store",
        "h:1",
        "--lighthouse",
        "http://a:",
        "--out",
        "o",
        "--resume",
        "--pace-s",
        "0.1",
        "--delay-serial",
        "--",
        "--swarm.host=1.2.3.4",
        "--stage=9",
    ]  # fmt: skip (--resume: a peer of a resumed job, moved later, joins: it does not resume)
    move = {"stage": 1, "index": 3, "lighthouse": "http://b:4", "args": ["--pace-s", "0.08"]}
    got = moved_argv(argv, move)
    assert got == ["--config", "c.yaml", "--store", "h:1", "--out", "o", "--stage", "1", "--index", "3", "--join",
                   "--lighthouse", "http://b:4", "--pace-s", "0.08", "--", "--swarm.host=1.2.3.4",
                   "--stage=9"]  # fmt: skip
    assert moved_argv(argv[:-3], move)[-3:] == ["http://b:4", "--pace-s", "0.08"]  # no separator: appended
    assert "--resume" not in moved_argv(argv, move)


@pytest.mark.slow
def test_rebalance_command_moves_a_peer_of_a_job_it_did_not_start(tmp_path):
    """``dilocox swarm rebalance`` (what launcher/slurm/swarm.sbatch starts with DILOCOX_SWARM_REBALANCE_S): a process
    that owns no peer reaches the job through its store and moves a peer; the job runs without its own mover."""
    import sys

    from dilocox.swarm.runtime import launch

    over = [
        "--model.n_layers=2", "--model.d_model=64", "--data.max_bytes=200000", "--train.batch_size=8",
        "--train.seq_len=32", "--optim.warmup_steps=0", "--optim.schedule=constant", "--swarm.microbatch_size=2",
        "--swarm.max_inflight=4", "--swarm.step_timeout_s=60", "--swarm.sync_timeout_s=60",
        "--swarm.rpc_timeout_s=20", "--swarm.ban_s=0.5", "--swarm.rebalance_period_s=2",
    ]  # fmt: skip
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), over)
    out = str(tmp_path / "job")
    procs = []

    def start_rebalancer(la):
        cmd = [sys.executable, "-m", "dilocox.cli", "swarm", "rebalance", "--config", la.config_path, "--store",
               la.store_addr(), "--out", out, "--max-s", "200"]  # fmt: skip
        for j in range(2):
            cmd += ["--lighthouse", f"{j}={la.lighthouse(j)}"]
        log = open(os.path.join(str(tmp_path), "rebalance.log"), "wb")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    try:
        res = launch(cfg, out, peers_per_stage=[2, 1], steps=60, timeout_s=240, stage_paces={1: 0.08},
                     on_started=start_rebalancer, rebalancer=False)  # fmt: skip
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=40)
            except subprocess.TimeoutExpired:
                p.kill()
    log = open(os.path.join(str(tmp_path), "rebalance.log")).read()
    assert procs and procs[0].returncode == 0, log[-3000:]
    assert "swarm rebalance: stopping (1 move(s) made)" in log, log[-3000:]
    for name, rc in res.returncodes.items():
        assert rc == 0, f"{name} exited {rc}:\n{res.log_tail(name)}"
    with open(os.path.join(out, "rebalance.jsonl")) as f:
        done = [m for m in map(json.loads, f) if "line" in m]
    assert len(done) == 1 and done[0]["from"] == 0 and done[0]["to"] == 1 and done[0]["joiner"] == "s1p1", done
    served = [r for r in res.records["s1p1"] if not r.get("joined")]
    assert served and sum(r["microbatches"] for r in served) > 0, "the moved peer never served"
    a, b = res.peers["s1p0"]["params"], res.peers["s1p1"]["params"]
    assert all(torch.equal(a[n], b[n]) for n in a), "the moved peer differs from its new stage"
    assert not _left_over(out)


def test_rebalance_command_bad_input_is_one_line_exit_2(capsys):
    from dilocox.cli import main as cli_main

    tiny = os.path.join(ROOT, "configs", "tiny.yaml")
    base = ["swarm", "rebalance", "--config", tiny, "--store", "127.0.0.1:1", "--out", "/nonexistent"]
    cases = [
        ([], "swarm.rebalance_period_s is 0"),
        (["--lighthouse", "0=http://a:1", "--", "--swarm.rebalance_period_s=5"], "no address for stage(s) [1]"),
        (["--lighthouse", "zero=http://a:1", "--", "--swarm.rebalance_period_s=5"], "must be STAGE=URL"),
    ]
    for extra, needle in cases:
        assert cli_main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err
