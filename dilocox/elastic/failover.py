"""Lighthouse failover for the elastic outer group (issue 10 §6b): survive a lighthouse restart.

Measured on torchft 0.2.0 (docs/ELASTIC.md): when the lighthouse dies, the replica's ``ManagerServer``
fails its lighthouse request at once ("tcp connect error") but never answers the waiting
``Manager.start_quorum``, which therefore blocks for its whole timeout, and the failed quorum stays in
``Manager._quorum_future`` so every later ``start_quorum`` re-raises it. A restarted lighthouse on the same
address is reached again by the ManagerServer's heartbeats (it reconnects by itself) and forms a new quorum
from the replicas' fresh requests; it keeps no state, so its quorum ids start again at 1.

Three pieces make the survivors continue without restarting a replica:

1. ``start_quorum_with_failover`` asks for the quorum in short attempts (``attempt_s`` each), all within the
   caller's deadline, and clears the failed quorum future between attempts. While a TCP connect to the
   lighthouse is refused it does not send a request at all (the request would only be dropped) but polls the
   address every ``probe_every_s``, so the first request goes out as soon as the new lighthouse listens.
2. ``install_quorum_guard`` wraps the manager's RPC client so that a quorum from a new lighthouse never
   reuses a gloo rendezvous: the quorum's store prefix gets a suffix derived from what every member of that
   quorum receives identically (its max step and its members), because a restarted lighthouse hands out
   quorum ids (and hence torchft's store prefixes ``torchft/<quorum_id>/<rank>``) that the old one already
   used on the same TCPStore, whose stale keys would mislead the new rendezvous.
3. The same guard forces the process group to be reconfigured when the new lighthouse's quorum id equals
   the last one this replica saw but the members differ (torchft reconfigures only when the id changes, so
   it would run the all-reduce on the old group).

When the lighthouse stays down the attempts continue until the caller's deadline and
``LighthouseUnreachable`` (with how long it was unreachable) is raised; ``ElasticOuterGroup`` turns that
into its ``ElasticMinReplicasError``. ``LighthouseFailover`` adds keeping the last quorum while the
lighthouse is down (its docstring).

A restart is only as quick as the new lighthouse's start: ``python3 dilocox/elastic/failover.py lighthouse``
(this file run as a script: it imports neither torch nor the dilocox package, only its sibling ``torchft.py`` by
path) loads torchft's native extension alone and listens within ~0.1 s, where importing ``torchft`` (which imports
torch) took 3-15 s on the loaded 2-core machine here.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import os
import signal
import socket
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("dilocox.elastic")

DEFAULT_ATTEMPT_S = 2.0  # seconds per quorum request: bounds the wait on a request the dead lighthouse dropped
MIN_ATTEMPT_S = 0.1  # quorum requests are at least this far apart
MAX_ATTEMPT_FACTOR = 8  # LighthouseFailover: requests on a live lighthouse grow up to this x attempt_s


class QuorumTimeout(RuntimeError):
    """No quorum within the deadline; ``lighthouse_down_s`` says how long the lighthouse refused connections."""

    def __init__(self, msg: str, lighthouse_down_s: float, attempts: int) -> None:
        super().__init__(msg)
        self.lighthouse_down_s = lighthouse_down_s
        self.attempts = attempts


class LighthouseUnreachable(QuorumTimeout):
    """The lighthouse refused connections until the deadline."""


def lighthouse_endpoints(addr: str) -> list[tuple[str, int]]:
    """``[(host, port), ...]`` of ``http://host:port`` or of a primary and its standbys, ``http://a:p,http://b:q``
    (in order; dilocox/net/relay.py); a clear ValueError names the bad address."""
    out = []
    for part in addr.split(","):
        u = urlsplit(part.strip())
        try:
            port = u.port
        except ValueError:
            port = None
        if u.scheme not in ("http", "https") or not u.hostname or port is None:
            raise ValueError(
                f"elastic.lighthouse_addr={addr!r} is invalid: give it as http://host:port (a standby after a comma: "
                "http://host:port,http://standby:port)"
            )
        out.append((u.hostname, port))
    return out


def lighthouse_listening(addr: str, timeout_s: float = 0.5) -> bool:
    """True when a TCP connection to the lighthouse's address (to any of a primary and its standbys) is accepted
    (nothing is sent)."""
    for host, port in lighthouse_endpoints(addr):
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                return True
        except OSError:
            continue
    return False


@dataclass
class QuorumAttempts:
    """What ``start_quorum_with_failover`` did: seconds spent, requests sent, seconds the lighthouse was down."""

    seconds: float
    attempts: int
    lighthouse_down_s: float
    kept_last_quorum: bool = False


def start_quorum_with_failover(
    manager: Any,
    lighthouse_addr: str,
    deadline: float,
    attempt_s: float = DEFAULT_ATTEMPT_S,
    probe_every_s: float = 0.1,
    allow_heal: bool = False,
) -> QuorumAttempts:
    """``manager.start_quorum`` in attempts of at most ``attempt_s``, until a quorum or ``deadline`` (monotonic).

    Raises ``LighthouseUnreachable`` when the lighthouse refused connections at the deadline, else
    ``QuorumTimeout`` (a lighthouse that answers but forms no quorum with us: too few live replicas).
    Any other error of the manager is raised as is.
    """
    t0 = time.monotonic()
    attempts = 0
    down_since: float | None = None
    down_s = 0.0
    last_err = ""
    while True:
        now = time.monotonic()
        left = deadline - now
        if left <= 0:
            break
        if not lighthouse_listening(lighthouse_addr, timeout_s=min(0.5, max(0.05, left))):
            if down_since is None:
                down_since = now
                log.warning("lighthouse %s refuses connections; waiting (bounded, %.1fs left)", lighthouse_addr, left)
            time.sleep(min(probe_every_s, max(0.0, deadline - time.monotonic())))
            continue
        if down_since is not None:
            down_s += time.monotonic() - down_since
            log.warning("lighthouse %s listens again after %.2fs", lighthouse_addr, time.monotonic() - down_since)
            down_since = None
        attempts += 1
        t_attempt = time.monotonic()
        try:
            manager.start_quorum(allow_heal=allow_heal, timeout=timedelta(seconds=min(attempt_s, left)))
            return QuorumAttempts(seconds=time.monotonic() - t0, attempts=attempts, lighthouse_down_s=down_s)
        except Exception as e:  # the Rust client raises a plain RuntimeError ("Timeout expired", "tcp connect error")
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            if not _is_retryable(msg):
                raise
            last_err = msg
            # torchft keeps the failed future and start_quorum() re-raises it first; drop it (the attempt is over:
            # the Rust call returned), so that the next attempt sends a new request.
            manager._quorum_future = None
            log.info("quorum attempt %d failed (%s); retrying", attempts, msg[:200])
            # an attempt that failed fast (not by its timeout) is not repeated in a busy loop
            time.sleep(max(0.0, min(MIN_ATTEMPT_S - (time.monotonic() - t_attempt), deadline - time.monotonic())))
    if down_since is not None:
        down_s += time.monotonic() - down_since
        raise LighthouseUnreachable(
            f"the lighthouse at {lighthouse_addr} refused connections for the last "
            f"{time.monotonic() - down_since:.1f}s ({attempts} quorum request(s) sent)",
            down_s,
            attempts,
        )
    raise QuorumTimeout(
        f"no quorum after {attempts} request(s) in {time.monotonic() - t0:.1f}s (last: {last_err[:200]})",
        down_s,
        attempts,
    )


def _is_retryable(msg: str) -> bool:
    m = msg.lower()
    return any(s in m for s in ("timeout", "deadline", "cancelled", "unavailable", "connect", "transport", "broken"))


class _QuorumView:
    """torchft's ``QuorumResult`` (a Rust object) as ``Manager._async_quorum`` reads it, with a salted store address."""

    def __init__(self, inner: Any, store_address: str) -> None:
        self._inner = inner
        self.store_address = store_address

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def rendezvous_salt(max_step: int, replica_ids: list[str]) -> str:
    """Suffix of the store prefix, identical on every member of one quorum (same max step and members)."""
    h = hashlib.sha256("\n".join(sorted(replica_ids)).encode()).hexdigest()[:12]
    return f"dlx_s{max_step}_{h}"


class _QuorumGuard:
    """Proxy of ``Manager._client``: salts the rendezvous and forces a reconfigure on a same-id new membership."""

    def __init__(self, manager: Any, client: Any) -> None:
        self._manager = manager
        self._inner = client
        self.last_ids: list[str] | None = None
        self.last_quorum_id: int | None = None
        self.forced_reconfigures = 0
        self.force_reconfigure = False  # set by LighthouseFailover after a failed step on a kept quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _quorum(self, *args: Any, **kwargs: Any) -> _QuorumView:
        q = self._inner._quorum(*args, **kwargs)
        ids = list(q.replica_ids)
        if q.quorum_id == self.last_quorum_id and (ids != self.last_ids or self.force_reconfigure):
            # a restarted lighthouse reused the id for other members (or the kept group failed): reconfigure
            self._manager._quorum_id = -1
            self.forced_reconfigures += 1
            log.warning("quorum id %d reused (members %s): reconfiguring the process group", q.quorum_id, ids)
        self.force_reconfigure = False
        self.last_quorum_id, self.last_ids = q.quorum_id, ids
        return _QuorumView(q, f"{q.store_address}/{rendezvous_salt(q.max_step, ids)}")


def install_quorum_guard(manager: Any) -> _QuorumGuard:
    """Wrap ``manager``'s RPC client (once) with the guard described in the module docstring; returns the guard."""
    client = manager._client
    if isinstance(client, _QuorumGuard):
        return client
    guard = _QuorumGuard(manager, client)
    manager._client = guard
    return guard


class ReplicaAgreement:
    """One keep-or-wait decision for every rank of a replica (a replica of several ranks, each with its own torchft
    Manager): rank 0 decides from its own probe of the lighthouse and its manager's state, and writes the decision
    under a per-call key in the replica's own store (the TCPStore its ranks' managers meet on: nothing crosses the
    replica); the other ranks read it (bounded by the caller's deadline). Ranks call ``quorum`` in step (a quorum, a
    retry and the commit vote are replica-wide), so the n-th call of every rank reads the n-th decision."""

    PREFIX = "dilocox/failover/"

    def __init__(self, store: Any, rank: int) -> None:
        self.store, self.rank, self.calls = store, rank, 0

    def decide(self, mine: str, deadline: float) -> str:
        """``mine`` (rank 0's decision: "keep", "ask" or "down:<seconds>") for every rank."""
        key = f"{self.PREFIX}{self.calls}"
        self.calls += 1
        if self.rank == 0:
            self.store.set(key, mine)
            if self.calls > 3:  # every rank has read it: they are at most one call apart
                self.store.delete_key(f"{self.PREFIX}{self.calls - 4}")
            return mine
        left = max(0.01, deadline - time.monotonic())
        try:
            self.store.wait([key], timedelta(seconds=left))
        except Exception as e:  # noqa: BLE001 - the store raises a plain RuntimeError on timeout
            raise QuorumTimeout(
                f"rank {self.rank}: rank 0 of this replica did not say whether to keep the quorum within {left:.1f}s",
                0.0,
                0,
            ) from e
        return self.store.get(key).decode()


class LighthouseFailover:
    """One replica's quorum that survives the lighthouse: ``quorum(deadline)`` replaces ``manager.start_quorum``.

    With ``keep_last_quorum`` (default), while the lighthouse refuses connections the replica keeps its last
    quorum: it does not ask for one and runs the outer all-reduce on the process group it already has, with the
    members it already has (torchft's ``should_commit`` only talks to the replica's own ManagerServer). The
    all-reduce itself is the liveness check: when a member died meanwhile it fails, the step is not committed,
    and the next ``quorum`` call no longer keeps the quorum but waits (bounded) for the lighthouse, whose
    first quorum then re-forms the group without the dead member. Survivors thus lose no step to a lighthouse
    restart. The outage is bounded: once the lighthouse has refused connections for ``max_outage_s``,
    ``LighthouseUnreachable`` is raised. Without ``keep_last_quorum`` the replica waits (bounded) for the
    lighthouse at every step (``start_quorum_with_failover``).

    Conditions for keeping the quorum: this replica had one (``Manager._quorum_id >= 0``), it participates in
    it, its last step was committed, and its last quorum request did not fail. A replica of several ranks takes
    the decision once for all its ranks (``agreement``: rank 0's, through the replica's store); without it such a
    replica would have ranks that keep next to ranks that ask the restarted lighthouse (the ones that ask wait
    for the others at their ManagerServer, the ones that keep wait for them in the all-reduce).
    """

    def __init__(
        self,
        manager: Any,
        lighthouse_addr: str,
        max_outage_s: float,
        attempt_s: float = DEFAULT_ATTEMPT_S,
        keep_last_quorum: bool = True,
        agreement: ReplicaAgreement | None = None,
    ) -> None:
        lighthouse_endpoints(lighthouse_addr)  # a bad address fails here, with the field named
        self.manager = manager
        self.lighthouse_addr = lighthouse_addr
        self.max_outage_s = max_outage_s
        self.attempt_s = attempt_s
        self.keep_last_quorum = keep_last_quorum
        self.agreement = agreement
        self.guard = install_quorum_guard(manager)
        self.down_since: float | None = None  # first refused connection of the current outage (monotonic)
        self.kept_steps = 0  # outer steps run on a kept quorum
        self._last_kept = False
        # set by the group after a step on a kept quorum: whether ANY replica of it saw the lighthouse listening just
        # before that step (one slot of the step's all-reduce: the same answer on every one of them)
        self.peers_saw_up: bool | None = None

    @property
    def on_kept_quorum(self) -> bool:
        """The current step runs on a kept quorum (set by ``quorum``)."""
        return self._last_kept

    def _stay(self, was_kept: bool) -> bool:
        """Keep again without a probe: the last step ran on a kept quorum, committed, and no replica of it saw the
        lighthouse back. Every replica of that quorum decides the same (from the same all-reduced slot): the ones
        that would probe the returned lighthouse a moment after the others kept no longer wait for them at it
        while those wait in the kept all-reduce (that cost an all-reduce timeout, and ended a run whose
        quorum_timeout_s equals its timeout_s). They all ask at the step after one saw it."""
        in_bound = self.down_since is None or time.monotonic() - self.down_since < self.max_outage_s
        stay = was_kept and self.peers_saw_up is False and self._can_keep() and in_bound
        self.peers_saw_up = None
        return stay

    def _can_keep(self) -> bool:
        m = self.manager
        return (
            self.keep_last_quorum
            and m._quorum_id >= 0
            and m._participating_replica_rank is not None
            and m._commit_failures == 0
            and m.errored() is None
        )

    def _keep(self, t0: float, attempts: int, down: float, announce: bool) -> QuorumAttempts:
        m = self.manager
        if announce:
            log.warning(
                "lighthouse %s refuses connections: keeping the last quorum (id %d, %d participant(s)) for at "
                "most %.0fs more",
                self.lighthouse_addr,
                m._quorum_id,
                m._participating_replica_world_size,
                self.max_outage_s - down,
            )
        done: Future = Future()
        done.set_result(None)
        m._quorum_future = done  # what start_quorum leaves behind after a quorum, minus the request
        m._errored = None
        m._healing = False
        self._last_kept = True
        self.kept_steps += 1
        return QuorumAttempts(time.monotonic() - t0, attempts, down, kept_last_quorum=True)

    def _agreed_keep(self, t0: float, deadline: float, was_kept: bool) -> QuorumAttempts | None:
        """A replica of several ranks: keep the quorum when rank 0 says so (the lighthouse refuses connections and
        it may keep), stop together when rank 0 found the outage too long, else None (ask, every rank)."""
        mine = "ask"
        stay = self._stay(was_kept)
        if self.agreement.rank == 0 and stay:
            mine = "keep"
        elif self.agreement.rank == 0 and not lighthouse_listening(self.lighthouse_addr, timeout_s=0.5):
            now = time.monotonic()
            self.down_since = self.down_since or now
            down = now - self.down_since
            if down >= self.max_outage_s or now >= deadline:
                mine = f"down:{down:.3f}"
            elif self.keep_last_quorum and self._can_keep():
                mine = "keep"
        said = self.agreement.decide(mine, deadline)
        if said == "keep":
            down = 0.0 if self.down_since is None else time.monotonic() - self.down_since
            return self._keep(t0, 0, down, announce=not was_kept)
        if said.startswith("down:"):
            down = float(said[5:])
            raise LighthouseUnreachable(
                f"the lighthouse at {self.lighthouse_addr} refused connections for the last {down:.1f}s (rank 0 of "
                f"this replica; {self.kept_steps} outer step(s) on a kept quorum)",
                down,
                0,
            )
        return None

    def quorum(self, deadline: float, allow_heal: bool = False) -> QuorumAttempts:
        """A quorum for this outer step (kept or new) before ``deadline`` (monotonic); see the class docstring.

        ``allow_heal`` goes to ``Manager.start_quorum`` (a kept quorum heals nobody: no one can join without
        a lighthouse)."""
        m = self.manager
        if self._last_kept and m._commit_failures > 0:
            # the step on the kept group failed: its process group may be half broken, and the first quorum of
            # the new lighthouse may reuse the old id, so make torchft configure a fresh group
            self.guard.force_reconfigure = True
        was_kept, self._last_kept = self._last_kept, False
        t0 = time.monotonic()
        attempts = span_k = 0
        if self.agreement is not None:  # one decision for the replica's ranks, then each rank as usual
            kept = self._agreed_keep(t0, deadline, was_kept)
            if kept is not None:
                return kept
        elif self._stay(was_kept):
            return self._keep(t0, 0, 0.0, announce=False)
        while True:
            now = time.monotonic()
            if not lighthouse_listening(self.lighthouse_addr, timeout_s=min(0.5, max(0.05, deadline - now))):
                span_k = 0
                now = time.monotonic()
                self.down_since = self.down_since or now
                down = now - self.down_since
                if down >= self.max_outage_s or now >= deadline:
                    raise LighthouseUnreachable(
                        f"the lighthouse at {self.lighthouse_addr} refused connections for the last {down:.1f}s "
                        f"({attempts} quorum request(s) sent, {self.kept_steps} outer step(s) on a kept quorum)",
                        down,
                        attempts,
                    )
                if self.agreement is None and self._can_keep():
                    return self._keep(t0, attempts, down, announce=not was_kept)
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
                continue
            if self.down_since is not None:
                log.warning("lighthouse %s listens again after %.2fs", self.lighthouse_addr, now - self.down_since)
                self.down_since = None
            # one request (a lighthouse that dies meanwhile drops it: then it is kept, or waited for); a long wait
            # on a live lighthouse gets longer requests (x2 each, up to MAX_ATTEMPT_FACTOR x attempt_s): the
            # lighthouse may count a timed-out request in a quorum, so fewer request boundaries are safer
            span = self.attempt_s * min(2**span_k, MAX_ATTEMPT_FACTOR)
            span_k += 1
            try:
                r = start_quorum_with_failover(
                    m, self.lighthouse_addr, min(deadline, now + span), span, allow_heal=allow_heal
                )
                return QuorumAttempts(time.monotonic() - t0, attempts + r.attempts, r.lighthouse_down_s)
            except QuorumTimeout as e:
                attempts += e.attempts
                if time.monotonic() >= deadline:
                    raise QuorumTimeout(
                        f"no quorum after {attempts} request(s) in {time.monotonic() - t0:.1f}s ({e})",
                        0.0,
                        attempts,
                    ) from e


def _torchft_accessors() -> Any:
    """``dilocox.elastic.torchft`` (the module that imports torchft for dilocox). This file run as a script loads it
    by path instead: importing the dilocox package would import torch, which the fast lighthouse avoids."""
    if __name__ != "__main__":
        from dilocox.elastic import torchft

        return torchft
    here = os.path.dirname(os.path.realpath(__file__))
    # this directory is sys.path[0] of the script, and its torchft.py is not torchft: find the real package
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
    spec = importlib.util.spec_from_file_location("_dilocox_elastic_torchft", os.path.join(here, "torchft.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def lighthouse_main(argv: list[str] | None = None) -> int:
    """``python3 dilocox/elastic/failover.py lighthouse --min-replicas M [--bind HOST:PORT]``: a lighthouse that
    starts fast; prints ``{"address": ..., "start_s": ...}`` on one line, runs until SIGTERM/SIGINT or
    ``--lifetime`` seconds."""
    t0 = time.monotonic()
    p = argparse.ArgumentParser(prog="failover.py lighthouse", description=lighthouse_main.__doc__)
    p.add_argument("--min-replicas", type=int, required=True)
    p.add_argument("--bind", default="[::]:0")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=2000)
    p.add_argument("--join-timeout-ms", type=int, default=60000)
    p.add_argument("--quorum-tick-ms", type=int, default=20)
    p.add_argument("--lifetime", type=float, default=3600.0, help="seconds before it shuts itself down")
    a = p.parse_args(argv)
    for name in ("min_replicas", "heartbeat_timeout_ms", "join_timeout_ms", "quorum_tick_ms"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)} must be >= 1")
    stop: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.append(signum))
    lh = _torchft_accessors().native_lighthouse_server_class()(
        bind=a.bind,
        min_replicas=a.min_replicas,
        join_timeout_ms=a.join_timeout_ms,
        quorum_tick_ms=a.quorum_tick_ms,
        heartbeat_timeout_ms=a.heartbeat_timeout_ms,
    )
    print(json.dumps({"address": lh.address(), "start_s": round(time.monotonic() - t0, 4)}), flush=True)
    try:
        end = time.monotonic() + a.lifetime
        while not stop and time.monotonic() < end:
            time.sleep(0.1)
    finally:
        lh.shutdown()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["lighthouse"]:
        sys.exit("usage: python3 dilocox/elastic/failover.py lighthouse --min-replicas M [--bind HOST:PORT] ...")
    logging.basicConfig(level=logging.WARNING)
    sys.exit(lighthouse_main(sys.argv[2:]))
