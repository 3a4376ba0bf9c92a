"""Routing of microbatches to the peers of one stage: interleaved weighted round-robin and random wiring.

SWARM (Ryabinin et al. 2023, §3.2 and Appendix C, Algorithm 1) routes each microbatch to the peer
of the next stage with the smallest *priority*, the total expected processing time of the requests
already given to it; choosing a peer adds that peer's exponential moving average (EMA) of its
measured time per microbatch to its priority, so a peer that takes twice as long is chosen half
as often (interleaved weighted round-robin, IWRR). A peer that fails or times out is banned
(priority infinity) for a cool-down; the microbatch goes to another peer of the stage.

Here (one ``Router`` per sender and stage):

* ``IWRRRouter.choose()``: the live peer with the smallest priority (ties: the peer added first);
  its priority grows by its EMA at once, so the microbatches the sender keeps in flight spread
  over the peers before any of them completes (the paper's Algorithm 1 adds at choose time too).
* ``done(peer, seconds)``: EMA update ``ema = gamma*seconds + (1-gamma)*ema`` (the paper's
  gamma = 0.1); the first measurement of a peer replaces its initial guess.
* a new or unbanned peer starts at the current minimum priority among the live peers, and a new
  peer's EMA guess is the mean EMA of the measured peers: it does not flood (a fresh priority of
  0 or a tiny EMA would send it every microbatch until its first completion).
* ``RandomRouter``: uniform over the live peers (the DiLoCo-SWARM paper's code), for comparison.

Bans use an injectable clock (``time.monotonic`` by default), so the tests run in simulated time.
When no peer of the stage is live, ``choose`` raises ``NoLivePeer`` naming the stage.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Protocol

DEFAULT_GAMMA = 0.1  # SWARM §4.3: "moving average with alpha = 0.1"
DEFAULT_BAN_S = 30.0  # cool-down after a failure before a peer is tried again
DEFAULT_INITIAL_EMA_S = 1.0  # time guess for a peer when no peer of the stage was measured yet


class NoLivePeer(RuntimeError):
    """Every peer of the stage is banned or gone: the stage cannot serve (the job must stop)."""


class Router(Protocol):
    """What the SWARM runtime needs from a router of one stage."""

    def choose(self) -> Hashable: ...

    def done(self, peer: Hashable, seconds: float) -> None: ...

    def failed(self, peer: Hashable) -> None: ...

    def ban(self, peer: Hashable, seconds: float) -> None: ...

    def unban(self, peer: Hashable) -> None: ...

    def live(self) -> list: ...

    def banned(self) -> list: ...

    def add(self, peer: Hashable) -> None: ...

    def remove(self, peer: Hashable) -> None: ...


def _check_positive(name: str, value: float) -> float:
    value = float(value)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name}={value!r} must be a finite number > 0")
    return value


class _BanList:
    """Peers in insertion order, each with a ban deadline (clock time; -inf = not banned)."""

    def __init__(self, peers: Iterable[Hashable], name: str, ban_s: float, clock: Callable[[], float]):
        self.name = name
        self.ban_s = _check_positive("ban_s", ban_s)
        self.clock = clock
        self.until: dict[Hashable, float] = {}
        self.gone: set = set()  # peers removed (they left the stage): late done/failed/ban reports are ignored
        for p in peers:
            self._add(p)

    def _add(self, peer: Hashable) -> bool:
        """Register ``peer``; False if it was already known."""
        if peer in self.until:
            return False
        self.until[peer] = -math.inf
        return True

    def _check_known(self, peer: Hashable) -> None:
        if peer not in self.until:
            raise KeyError(f"{self.name}: unknown peer {peer!r}; known: {list(self.until)}")

    def _expire(self) -> list:
        """Peers whose ban ran out just now (they are live again)."""
        now = self.clock()
        back = [p for p, t in self.until.items() if math.isfinite(t) and t <= now]
        for p in back:
            self.until[p] = -math.inf
        return back

    def live(self) -> list:
        self._expire_hook()
        return [p for p, t in self.until.items() if t == -math.inf]

    def banned(self) -> list:
        self._expire_hook()
        return [p for p, t in self.until.items() if t != -math.inf]

    def _expire_hook(self) -> None:  # subclasses re-admit expired peers at the minimum priority
        self._expire()

    def ban(self, peer: Hashable, seconds: float | None = None) -> None:
        """Exclude ``peer`` for ``seconds`` (default: ``ban_s``; ``math.inf``: until ``unban``)."""
        if peer in self.gone:
            return
        self._check_known(peer)
        seconds = self.ban_s if seconds is None else float(seconds)
        if not seconds > 0:
            raise ValueError(f"{self.name}: ban of {peer!r} for {seconds} s; the ban must last > 0 s")
        self.until[peer] = self.clock() + seconds

    def failed(self, peer: Hashable) -> None:
        """The peer timed out or failed: ban it for the cool-down."""
        self.ban(peer)

    def _no_live(self) -> NoLivePeer:
        banned = {p: max(0.0, t - self.clock()) for p, t in self.until.items()}
        detail = ", ".join(f"{p!r} banned for {s:.3g} s more" for p, s in banned.items()) or "no peers registered"
        return NoLivePeer(f"{self.name} has no live peer ({detail}); training cannot continue without this stage")


class IWRRRouter(_BanList):
    """Interleaved weighted round-robin over the live peers of one stage (see the module docstring)."""

    def __init__(
        self,
        peers: Iterable[Hashable] = (),
        *,
        name: str = "stage",
        gamma: float = DEFAULT_GAMMA,
        ban_s: float = DEFAULT_BAN_S,
        initial_ema_s: float = DEFAULT_INITIAL_EMA_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.gamma = float(gamma)
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"gamma={gamma!r} must be in (0, 1] (the EMA weight of a new measurement)")
        self.initial_ema_s = _check_positive("initial_ema_s", initial_ema_s)
        self.priority: dict[Hashable, float] = {}
        self.ema: dict[Hashable, float] = {}
        self.measured: dict[Hashable, int] = {}
        super().__init__(peers, name, ban_s, clock)

    def _min_live_priority(self, exclude: Hashable = None) -> float:
        vals = [self.priority[p] for p, t in self.until.items() if t == -math.inf and p != exclude]
        return min(vals) if vals else 0.0

    def _add(self, peer: Hashable) -> bool:
        if not super()._add(peer):
            return False
        known = [self.ema[p] for p in self.ema if self.measured.get(p)]
        self.ema[peer] = sum(known) / len(known) if known else self.initial_ema_s
        self.measured[peer] = 0
        self.priority[peer] = self._min_live_priority(exclude=peer)
        return True

    def add(self, peer: Hashable) -> None:
        """A peer (newly announced) joins: it starts at the current minimum priority."""
        self.gone.discard(peer)
        self._add(peer)

    def remove(self, peer: Hashable) -> None:
        """Forget ``peer`` (it left the stage); reports about it that were in flight are ignored from now on."""
        self._check_known(peer)
        for d in (self.until, self.priority, self.ema, self.measured):
            d.pop(peer, None)
        self.gone.add(peer)

    def _expire_hook(self) -> None:
        back = self._expire()
        if back:  # all at the minimum of the peers live before (not each at another's stale one: they would flood)
            others = [self.priority[p] for p, t in self.until.items() if t == -math.inf and p not in back]
            base = min(others) if others else 0.0
            for p in back:
                self.priority[p] = base

    def unban(self, peer: Hashable) -> None:
        """Readmit ``peer`` now, at the current minimum priority (its EMA is kept)."""
        self._check_known(peer)
        if self.until[peer] != -math.inf:
            self.until[peer] = -math.inf
            self.priority[peer] = self._min_live_priority(exclude=peer)

    def choose(self) -> Hashable:
        """The live peer with the smallest priority; its priority grows by its EMA."""
        live = self.live()
        if not live:
            raise self._no_live()
        best = min(live, key=lambda p: self.priority[p])  # min keeps the first of equal priorities
        self.priority[best] += self.ema[best]
        return best

    def done(self, peer: Hashable, seconds: float) -> None:
        """A microbatch finished on ``peer`` after ``seconds``: update its EMA."""
        if peer in self.gone:
            return
        self._check_known(peer)
        seconds = float(seconds)
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"{self.name}: time {seconds!r} s measured on {peer!r} must be finite and >= 0")
        if self.measured[peer]:
            self.ema[peer] = self.gamma * seconds + (1.0 - self.gamma) * self.ema[peer]
        else:
            self.ema[peer] = seconds
        self.measured[peer] += 1

    def throughput(self, peer: Hashable) -> float:
        """Microbatches per second the EMA predicts for ``peer``."""
        self._check_known(peer)
        return 1.0 / self.ema[peer] if self.ema[peer] > 0 else math.inf


class RandomRouter(_BanList):
    """Uniform random choice over the live peers (DiLoCo-SWARM's wiring); seeded, so reproducible."""

    def __init__(
        self,
        peers: Iterable[Hashable] = (),
        *,
        name: str = "stage",
        seed: int = 0,
        ban_s: float = DEFAULT_BAN_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.rng = random.Random(seed)
        super().__init__(peers, name, ban_s, clock)

    def add(self, peer: Hashable) -> None:
        self.gone.discard(peer)
        self._add(peer)

    def remove(self, peer: Hashable) -> None:
        self._check_known(peer)
        del self.until[peer]
        self.gone.add(peer)

    def unban(self, peer: Hashable) -> None:
        self._check_known(peer)
        self.until[peer] = -math.inf

    def choose(self) -> Hashable:
        live = self.live()
        if not live:
            raise self._no_live()
        return live[self.rng.randrange(len(live))]

    def done(self, peer: Hashable, seconds: float) -> None:
        if peer in self.gone:
            return
        self._check_known(peer)  # random wiring ignores the timing


ROUTERS = ("iwrr", "random")


def build_router(kind: str, peers: Iterable[Hashable] = (), **kw) -> IWRRRouter | RandomRouter:
    """``kind``: ``iwrr`` or ``random``; keyword arguments go to the router (``seed`` only to random,
    ``gamma``/``initial_ema_s`` only to IWRR)."""
    if kind == "iwrr":
        kw.pop("seed", None)
        return IWRRRouter(peers, **kw)
    if kind == "random":
        kw.pop("gamma", None)
        kw.pop("initial_ema_s", None)
        return RandomRouter(peers, **kw)
    raise ValueError(f"router kind {kind!r} is not one of {list(ROUTERS)} (swarm routing)")
