"""Adaptive rebalancing between SWARM stages (SWARM §3.2 and Appendix D, Algorithm 2): pure decision logic.

Every T seconds each peer reports (its stage, its request queue length, its measured throughput in
microbatches per second). The load of stage s is the time its peers need to drain their queues,
``L_s = sum(queue) / sum(throughput)`` (the issue's "queue length / throughput"; the paper sums queue
sizes, which is the same ordering when the stages' peers are alike). The peer with the shortest
queue in the least-loaded stage moves to the most-loaded stage (Algorithm 2, lines 19-24), downloads
that stage's state and serves it. Here the move is only proposed when

* the two stages differ and the source stage keeps at least one peer (never empty a stage), and
* it helps: the predicted maximum load falls by at least ``min_gain`` (relative). After the move the
  queues stay where they are (the moving peer's queued requests are re-sent within its old stage);
  the source stage loses the peer's throughput and the target gains its estimate there: the peer's
  speed relative to its stage's mean times the target stage's mean throughput (stages differ in
  cost per microbatch, e.g. the last holds the LM head), or its own throughput if the target has no
  peer. A stage with no peer has infinite load: any other stage with two or more peers gives one.

``plan_move`` decides once; ``Rebalancer`` calls it at most every ``period_s`` (simulated clocks
work). The runtime carries the move out and logs ``Move.describe()`` with the measured throughput.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

DEFAULT_PERIOD_S = 300.0  # SWARM §4.3: "SWARM nodes run rebalancing every T=300 seconds"
DEFAULT_MIN_GAIN = 0.1


@dataclass(frozen=True)
class PeerLoad:
    """One peer's report: its stage, request queue length and throughput (microbatches/s)."""

    peer: Hashable
    stage: int
    queue: float
    throughput: float


@dataclass(frozen=True)
class Move:
    peer: Hashable
    from_stage: int
    to_stage: int
    load_before: tuple[float, ...]  # seconds to drain each stage's queue
    load_after: tuple[float, ...]  # predicted
    throughput_before: float  # pipeline bound: min over stages of summed throughput (microbatches/s)
    throughput_after: float  # predicted
    gain: float  # relative drop of the maximum load

    def describe(self) -> str:
        fmt = ", ".join
        return (
            f"rebalance: peer {self.peer!r} moves stage {self.from_stage} -> {self.to_stage}; stage loads "
            f"[{fmt(f'{x:.3g}' for x in self.load_before)}] s -> [{fmt(f'{x:.3g}' for x in self.load_after)}] s; "
            f"predicted throughput {self.throughput_before:.3g} -> {self.throughput_after:.3g} microbatches/s"
        )


def _check(peers: list[PeerLoad], n_stages: int) -> None:
    if n_stages < 1:
        raise ValueError(f"n_stages={n_stages} must be >= 1")
    seen = set()
    for p in peers:
        if not (isinstance(p.stage, int) and 0 <= p.stage < n_stages):
            raise ValueError(f"peer {p.peer!r}: stage={p.stage!r} is not in [0, {n_stages})")
        if not (p.queue >= 0 and math.isfinite(p.queue)):
            raise ValueError(f"peer {p.peer!r}: queue={p.queue!r} must be a finite number >= 0")
        if not (p.throughput > 0 and math.isfinite(p.throughput)):
            raise ValueError(f"peer {p.peer!r}: throughput={p.throughput!r} must be a finite number > 0")
        if p.peer in seen:
            raise ValueError(f"peer {p.peer!r} reported twice; one report per peer")
        seen.add(p.peer)


def stage_loads(queues: list[float], throughputs: list[float]) -> list[float]:
    """``L_s = Q_s / T_s``; a stage without throughput (no peer) has infinite load."""
    return [q / t if t > 0 else math.inf for q, t in zip(queues, throughputs)]


def plan_move(peers: Iterable[PeerLoad], n_stages: int, min_gain: float = DEFAULT_MIN_GAIN) -> Move | None:
    """The one move Algorithm 2 makes now, or None (balanced, no gain, or it would empty a stage)."""
    peers = list(peers)
    _check(peers, n_stages)
    if not 0.0 <= min_gain < 1.0:
        raise ValueError(f"min_gain={min_gain!r} must be in [0, 1)")
    by_stage: list[list[PeerLoad]] = [[] for _ in range(n_stages)]
    for p in peers:
        by_stage[p.stage].append(p)
    Q = [sum(p.queue for p in s) for s in by_stage]
    T = [sum(p.throughput for p in s) for s in by_stage]
    L = stage_loads(Q, T)
    served = [s for s in range(n_stages) if by_stage[s]]
    if len(served) < 1 or n_stages < 2:
        return None
    s_max = max(range(n_stages), key=lambda s: L[s])  # first of equals
    s_min = min(served, key=lambda s: L[s])
    if s_min == s_max or L[s_min] >= L[s_max] or len(by_stage[s_min]) < 2:
        return None
    mover = min(by_stage[s_min], key=lambda p: p.queue)  # Algorithm 2: the peer with the lowest queue
    if by_stage[s_max]:
        est = mover.throughput / (T[s_min] / len(by_stage[s_min])) * (T[s_max] / len(by_stage[s_max]))
    else:
        est = mover.throughput
    T2 = list(T)
    T2[s_min] -= mover.throughput
    T2[s_max] += est
    L2 = stage_loads(Q, T2)
    before, after = max(L), max(L2)
    if math.isinf(before):
        gain = 1.0 if math.isfinite(after) else 0.0
    else:
        gain = (before - after) / before if before > 0 else 0.0
    if gain < min_gain or gain <= 0:
        return None
    return Move(mover.peer, s_min, s_max, tuple(L), tuple(L2), min(T), min(T2), gain)


class Rebalancer:
    """Calls ``plan_move`` at most once every ``period_s`` seconds of ``clock``."""

    def __init__(
        self,
        n_stages: int,
        period_s: float = DEFAULT_PERIOD_S,
        min_gain: float = DEFAULT_MIN_GAIN,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not (period_s > 0 and math.isfinite(period_s)):
            raise ValueError(f"period_s={period_s!r} must be a finite number > 0 (swarm rebalancing period)")
        self.n_stages, self.period_s, self.min_gain, self.clock = n_stages, float(period_s), min_gain, clock
        self.last = clock()

    def due(self) -> bool:
        return self.clock() - self.last >= self.period_s

    def maybe_move(self, peers: Iterable[PeerLoad]) -> Move | None:
        """None until the period has passed; then one decision (and the period restarts)."""
        if not self.due():
            return None
        self.last = self.clock()
        return plan_move(peers, self.n_stages, self.min_gain)
