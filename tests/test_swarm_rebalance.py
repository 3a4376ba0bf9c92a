"""SWARM adaptive rebalancing (dilocox/swarm/rebalance.py, SWARM Appendix D): which peer moves where."""

import math

import pytest

from dilocox.swarm.rebalance import PeerLoad, Rebalancer, plan_move


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
