"""SWARM routing (dilocox/swarm/routing.py): IWRR shares under a slow peer, bans, EMA, joins.

Deterministic: a discrete-event simulation in simulated time (no processes, no sleeps)."""

import heapq
import math

import pytest

from dilocox.swarm.routing import IWRRRouter, NoLivePeer, RandomRouter, build_router


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def simulate(router, service: dict, in_flight: int, n: int, clock: Clock | None = None):
    """One sender keeps ``in_flight`` microbatches outstanding; each peer serves its FIFO queue one
    microbatch at a time, ``service[p]`` seconds each; the sender reports the round-trip time
    (queueing included, what a real sender measures). Returns (microbatches per peer, makespan)."""
    clock = clock or Clock()
    free = {p: 0.0 for p in service}
    count = {p: 0 for p in service}
    events: list = []
    sent = 0

    def send():
        nonlocal sent
        p = router.choose()
        finish = max(clock.t, free[p]) + service[p]
        free[p] = finish
        heapq.heappush(events, (finish, sent, p, clock.t))
        sent += 1
        count[p] += 1

    for _ in range(in_flight):
        send()
    while events:
        clock.t, _, p, t0 = heapq.heappop(events)
        router.done(p, clock.t - t0)
        if sent < n:
            send()
    return count, clock.t


@pytest.mark.parametrize("in_flight", [1, 2, 4, 8])
def test_iwrr_gives_a_3x_slower_peer_a_quarter(in_flight):
    # throughputs 1 and 1/3 microbatch per second: the slow peer's fair share is (1/3)/(4/3) = 1/4
    n = 400
    count, makespan = simulate(IWRRRouter(["fast", "slow"]), {"fast": 1.0, "slow": 3.0}, in_flight, n)
    assert count["slow"] / n == pytest.approx(0.25, rel=0.10)
    if in_flight >= 2:  # both peers busy: near the capacity bound n / (4/3) = 300 s
        assert makespan <= 1.1 * 300


@pytest.mark.parametrize("in_flight", [2, 8])
def test_random_wiring_gives_the_slow_peer_half_and_is_slower(in_flight):
    n = 400
    count, makespan = simulate(RandomRouter(["fast", "slow"], seed=3), {"fast": 1.0, "slow": 3.0}, in_flight, n)
    assert count["slow"] / n == pytest.approx(0.5, abs=0.06)
    iwrr, iwrr_makespan = simulate(IWRRRouter(["fast", "slow"]), {"fast": 1.0, "slow": 3.0}, in_flight, n)
    assert makespan > 1.5 * iwrr_makespan  # the slow peer's half takes ~600 s vs ~300 s


def test_iwrr_equal_peers_alternate():
    r = IWRRRouter(["a", "b", "c"])
    assert [r.choose() for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_iwrr_choose_adds_the_ema_and_done_updates_it():
    r = IWRRRouter(["a", "b"], gamma=0.1, initial_ema_s=1.0)
    assert r.choose() == "a" and r.priority["a"] == 1.0
    r.done("a", 4.0)  # first measurement replaces the guess
    assert r.ema["a"] == 4.0
    r.done("a", 2.0)
    assert r.ema["a"] == pytest.approx(0.1 * 2.0 + 0.9 * 4.0)
    assert r.throughput("a") == pytest.approx(1 / 3.8)
    assert r.choose() == "b"  # b still at 0
    assert r.priority["b"] == 1.0
    r.done("b", 1.0)
    # a at 1.0 + 3.8 after its next pick, b at 1 + 1 per pick: b is picked until it passes a
    picks = [r.choose() for _ in range(5)]
    assert picks == ["a", "b", "b", "b", "b"]
    with pytest.raises(ValueError, match="must be finite"):
        r.done("a", float("nan"))
    with pytest.raises(KeyError, match="unknown peer"):
        r.done("zz", 1.0)


def test_ban_excludes_until_the_cool_down_ends_and_the_peer_rejoins_at_min_priority():
    clock = Clock()
    r = IWRRRouter(["a", "b"], ban_s=10.0, clock=clock)
    for _ in range(10):
        r.done(r.choose(), 1.0)
    r.failed("a")
    assert r.live() == ["b"] and r.banned() == ["a"]
    assert all(r.choose() == "b" for _ in range(50))  # b's priority climbs far above a's stale one
    clock.t = 9.9
    assert r.live() == ["b"]
    clock.t = 10.0
    assert r.live() == ["a", "b"]
    assert r.priority["a"] == r.priority["b"]  # readmitted at the minimum, not at its stale low priority
    picks = [r.choose() for _ in range(10)]
    assert picks.count("a") == 5  # no flood: it alternates with b
    r.ban("b", math.inf)
    clock.t = 1e9
    assert r.live() == ["a"]
    r.unban("b")
    assert r.live() == ["a", "b"] and r.priority["b"] == r.priority["a"]


def test_new_peer_does_not_flood():
    r = IWRRRouter(["a", "b"])
    for _ in range(100):
        r.done(r.choose(), 2.0)
    r.add("c")
    assert r.ema["c"] == 2.0  # the mean of the measured peers, not the tiny/zero initial guess
    picks = [r.choose() for _ in range(30)]  # nothing completes meanwhile (q in flight)
    assert 8 <= picks.count("c") <= 12  # about a third, not all 30


def test_no_live_peer_names_the_stage():
    clock = Clock()
    for r in (IWRRRouter(["x"], name="stage 1", clock=clock), RandomRouter(["x"], name="stage 1", clock=clock)):
        r.failed("x")
        with pytest.raises(NoLivePeer, match="stage 1 has no live peer"):
            r.choose()
        r.unban("x")
        assert r.choose() == "x"
        r.remove("x")
        with pytest.raises(NoLivePeer, match="stage 1"):
            r.choose()


def test_random_router_skips_banned_and_is_seeded():
    clock = Clock()
    r = RandomRouter(["a", "b", "c"], seed=7, clock=clock)
    r.ban("b", 5.0)
    assert set(r.choose() for _ in range(100)) == {"a", "c"}
    clock.t = 5.0
    assert "b" in {r.choose() for _ in range(100)}
    a = RandomRouter(["a", "b", "c"], seed=7)
    b = RandomRouter(["a", "b", "c"], seed=7)
    assert [a.choose() for _ in range(20)] == [b.choose() for _ in range(20)]


def test_bad_arguments():
    with pytest.raises(ValueError, match="gamma"):
        IWRRRouter(["a"], gamma=0)
    with pytest.raises(ValueError, match="ban_s"):
        IWRRRouter(["a"], ban_s=-1)
    with pytest.raises(ValueError, match="must last > 0"):
        IWRRRouter(["a"]).ban("a", 0)
    with pytest.raises(ValueError, match="not one of"):
        build_router("roundrobin")
    assert isinstance(build_router("random", ["a"], seed=1, gamma=0.2), RandomRouter)
    assert isinstance(build_router("iwrr", ["a"], seed=1, gamma=0.2), IWRRRouter)


def simulate_senders(routers: list, service: dict, in_flight: int, n_each: int):
    """Several senders (stage-0 peers), each with its own router, share the peers of the next stage."""
    clock = Clock()
    free = {p: 0.0 for p in service}
    count = {p: 0 for p in service}
    sent = [0] * len(routers)
    events: list = []
    seq = 0

    def send(i):
        nonlocal seq
        p = routers[i].choose()
        finish = max(clock.t, free[p]) + service[p]
        free[p] = finish
        heapq.heappush(events, (finish, seq, i, p, clock.t))
        seq += 1
        sent[i] += 1
        count[p] += 1

    for i in range(len(routers)):
        for _ in range(in_flight):
            send(i)
    while events:
        clock.t, _, i, p, t0 = heapq.heappop(events)
        routers[i].done(p, clock.t - t0)
        if sent[i] < n_each:
            send(i)
    return count, clock.t


def test_iwrr_share_holds_with_several_senders_sharing_the_peers():
    # 3 stage-0 peers route independently into the same two stage-1 peers (one 3x slower)
    n_each = 300
    routers = [IWRRRouter(["fast", "slow"]) for _ in range(3)]
    count, makespan = simulate_senders(routers, {"fast": 1.0, "slow": 3.0}, 2, n_each)
    assert count["slow"] / (3 * n_each) == pytest.approx(0.25, rel=0.10)
    assert makespan <= 1.1 * 3 * n_each / (4 / 3)
    rnd = [RandomRouter(["fast", "slow"], seed=s) for s in range(3)]
    count, rnd_makespan = simulate_senders(rnd, {"fast": 1.0, "slow": 3.0}, 2, n_each)
    assert count["slow"] / (3 * n_each) == pytest.approx(0.5, abs=0.05)
    assert rnd_makespan > 1.5 * makespan
