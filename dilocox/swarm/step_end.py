"""The end of a step on a SWARM peer (``SwarmPeer`` mixes this in; the protocol: ``dilocox.swarm.peer``).

A stage-j peer (j > 0) waits, bounded, for the end-of-step marker of every upstream peer it expects (one that
refuses a ping, or stays silent for ``swarm.step_timeout_s``, is dropped); a sender first pings the downstream
peers that hold its completed microbatches of the step and REPLAYS those of a dead one to live peers of its stage
(their gradients died with it), then sends its markers. ``_die`` is the ``--die-mid-step`` fault trigger of the
tests: deterministic, at a sender's end-of-step ping.
"""

from __future__ import annotations

import logging
import time

from dilocox.net.client import call
from dilocox.net.rpc import PeerUnavailable, RemoteError
from dilocox.swarm import activations as act_codec
from dilocox.swarm.common import SwarmError

log = logging.getLogger("dilocox.swarm.peer")

# What a peer keeps in memory of its past (the rest is in OUT/s{j}p{i}.jsonl): the per-microbatch trail (visits,
# routes, bans, replays, dropped upstream peers) of its last TRACE_STEPS steps, and its newest RECORDS_KEPT records
# (the final .pt's "records": final.py reads their steps). Kept whole, they grew with every step of the run.
TRACE_STEPS = 256
RECORDS_KEPT = 8
MARKER_STEPS = 1024  # end-of-step markers are kept for at most this many steps at once, the nearest ones (a peer's
# senders are a step or two ahead: a caller that is no peer of this job may neither grow the dict without end nor
# crowd a real step's marker out)


def _drop_before(events: list, cut: int, step_of) -> None:
    """Delete the leading entries of ``events`` (appended in step order, give or take a late one) of steps < cut."""
    i = 0
    while i < len(events) and step_of(events[i]) < cut:
        i += 1
    del events[:i]


class StepEnd:
    """End-of-step markers, replay of a dead peer's microbatches, pings (module docstring)."""

    def _on_marker(self, meta: dict) -> None:
        """``end_step`` from an upstream peer: a restarted one is expected again; the marker is kept for the wait of
        its step, unless that wait is over (a re-send after a replay, a late or healed sender's: kept, nothing would
        read or drop it)."""
        with self.cv:
            sender, step = str(meta["sender"]), int(meta["step"])
            if self.stage and sender.startswith(f"s{self.stage - 1}p") and sender not in self.expected_up:
                self.expected_up.append(sender)  # a restarted upstream peer is back
                log.info("%s: upstream %s is back", self.name, sender)
            keep = step >= self._marker_step
            if keep and step not in self.markers and len(self.markers) >= MARKER_STEPS:
                far = max(self.markers)  # (full: the farthest step goes for a nearer one; a real one is the nearest)
                keep = step < far
                if keep:
                    del self.markers[far]
            if keep:
                self.markers.setdefault(step, {})[sender] = int(meta["n"])
            self.cv.notify_all()

    def _record(self, rec: dict) -> None:
        """Write ``rec`` (OUT/s{j}p{i}.jsonl), keep the newest records only, and forget what the steps up to the
        current one's sync left behind (``_trim``)."""
        self.metrics.write(rec)
        self.records.append(rec)
        del self.records[:-RECORDS_KEPT]
        self._trim(self.step - 1)

    def _trim(self, k: int) -> None:
        """After step k's sync: the markers of steps <= k (a joiner's of the steps before it joined, late ones), their
        counted microbatch ids, and the trail of the steps before the last TRACE_STEPS."""
        cut = k + 1 - TRACE_STEPS
        with self.cv:
            self._marker_step = max(self._marker_step, k + 1)
            for s in [s for s in self.markers if s <= k]:
                del self.markers[s]
        with self.lock:
            for s in [s for s in self.counted if s <= k]:
                del self.counted[s]
            _drop_before(self.visits, cut, lambda v: v[0])
        old = []
        for mb in self.routes:  # (stage 0: added in step order, ids "s0p{i}:{step}:{n}")
            if int(mb.rsplit(":", 2)[1]) >= cut:
                break
            old.append(mb)
        for mb in old:
            del self.routes[mb]
        for events in (self.bans, self.replays, self.dropped_up):
            _drop_before(events, cut, lambda e: e["step"])

    def _end_of_step(self, k: int) -> None:
        """Wait for every expected upstream marker (bounded), then tell every downstream peer."""
        if not self.first:
            self._marker_step = k
            deadline = time.monotonic() + self.s.step_timeout_s
            last_ping = time.monotonic()
            with self.cv:
                while True:
                    got = self.markers.get(k, {})
                    # (a peer that joined upstream by rebalancing sends markers from its first serving step on)
                    missing = [p for p in self.expected_up if p not in got and self.up_from.get(p, 0) <= k]
                    if not missing:
                        break
                    left = deadline - time.monotonic()
                    dead = missing if left <= 0 else []
                    if left > 0 and time.monotonic() - last_ping >= 1.0:  # waited a while: is it dead?
                        dead, last_ping = self._unreachable(missing), time.monotonic()
                    if dead:
                        why = "unreachable" if left > 0 else f"silent for {self.s.step_timeout_s:.0f}s"
                        log.warning("%s: no end-of-step %d from %s (%s): dropped", self.name, k, dead, why)
                        self.dropped_up += [{"step": k, "peer": p, "why": why} for p in dead]
                        self.expected_up = [p for p in self.expected_up if p not in dead]
                        if not self.expected_up:
                            raise SwarmError(f"{self.name}: stage {self.stage - 1} has no live peer left")
                        continue
                    self.cv.wait(timeout=min(left, 1.0))
                self.markers.pop(k, None)
                self._marker_step = k + 1  # (its wait is over: a marker of step k from now on is not kept)
        if not self.last:
            self._send_markers(k)

    def _deliver_marker(self, k: int, peer: str, n: int) -> bool:
        """``end_step(k)`` to ``peer`` (at its new address when it was restarted); False when it is unreachable."""
        meta = {"step": k, "sender": self.name, "n": n}
        try:
            call(self.addrs[peer], "end_step", meta, timeout_s=self.s.rpc_timeout_s)
        except PeerUnavailable as e:
            try:
                if not self._refresh_addr(peer):
                    raise
                call(self.addrs[peer], "end_step", meta, timeout_s=self.s.rpc_timeout_s)
            except PeerUnavailable:
                log.warning("%s: end-of-step %d not delivered to %s (%s)", self.name, k, peer, e.reason)
                return False
        return True

    def _send_markers(self, k: int) -> None:
        """End of step k on a sender: first replay the microbatches that completed at downstream peers that died
        since (their gradients died with them) to live peers of that stage, then send the markers. A peer found
        dead at its marker has its microbatches replayed too, and the replay targets get their marker again; a
        target that already entered its sync refuses the replay: counted as lost (the remaining window)."""
        with self.lock:
            holders = {p: list(e) for p, e in self.completed.get(k, {}).items() if e}
        for peer, entries in holders.items():
            held = {"step": k, "held": len(entries)}  # (what a --die-mid-step peer waits for: _die)
            try:
                call(self.addrs[peer], "ping", held, timeout_s=min(5.0, self.s.rpc_timeout_s))
                alive = True
            except PeerUnavailable:
                alive = self._refresh_addr(peer) and self._ping(peer)
            except RemoteError:
                alive = True
            # a peer restarted at a new address is a new process: what the old one held is gone as well
            lost = [e for e in entries if not alive or e[1] != self.addrs[peer]]
            if lost:
                self._replay(k, peer, lost)
        with self.lock:  # the next stage's current peers (rebalancing: hello/bye change them, under this lock)
            down = list(self.down_peers)
            self.markers_sent = k
        pending, sent = list(down), set()
        for _ in range(4 * len(down)):  # a bound: each round either sends a marker or empties a dead peer's list
            if not pending:
                break
            peer = pending.pop(0)
            with self.lock:
                n = self.routed.get(peer, 0)
            ok = self._deliver_marker(k, peer, n)
            if ok:
                sent.add(peer)
            with self.lock:
                held = self.completed.get(k, {}).get(peer, [])
                lost = [e for e in held if not ok or e[1] != self.addrs[peer]]
            if lost:
                for t in self._replay(k, peer, lost):
                    if t in sent and t not in pending:  # it has its marker already: again, with the replays counted
                        sent.discard(t)
                        pending.append(t)
        with self.lock:
            self.routed = {}
            for s in [s for s in self.completed if s <= k]:
                del self.completed[s]

    def _ping(self, peer: str) -> bool:
        try:
            call(self.addrs[peer], "ping", {}, timeout_s=min(5.0, self.s.rpc_timeout_s))
        except PeerUnavailable:
            return False
        except RemoteError:
            pass
        return True

    def _replay(self, k: int, peer: str, entries: list[tuple]) -> set[str]:
        """Re-send the microbatches of step k that completed at dead ``peer`` to live peers of its stage (request
        flag ``replay``: the first hop accumulates and counts it, the stages below only return the input's
        gradient, they hold its gradient already). This peer does not backward the reply: its grads include it.
        Returns the peers that took them."""
        ids = {e[0] for e in entries}
        with self.lock:  # they are no longer held there
            at = self.completed.get(k, {})
            at[peer] = [e for e in at.get(peer, []) if e[0] not in ids]
        with self.router_lock:
            self.router.failed(peer)
        ban = {"step": k, "mb": None, "peer": peer, "reason": "dead at the end of the step", "t": time.time()}
        self.bans.append(ban)
        targets: dict[str, int] = {}
        for mb, _, payload, ameta, ids in entries:
            try:
                enc = (payload, act_codec.ActMeta.from_dict(ameta))
                _, _, to = self._send(k, mb, None, ids, mode="replay", enc=enc)
            except (SwarmError, RemoteError) as e:
                with self.lock:
                    self.lost += 1
                self.replays.append({"step": k, "mb": mb, "from": peer, "to": None, "error": str(e)})
                log.warning("%s: microbatch %s of step %d lost with dead %s (%s)", self.name, mb, k, peer, e)
                continue
            targets[to] = targets.get(to, 0) + 1
            self.replays.append({"step": k, "mb": mb, "from": peer, "to": to})
            with self.lock:
                self.replayed += 1
                self.routed[to] = self.routed.get(to, 0) + 1
        if targets:
            n = sum(targets.values())
            log.warning(
                "%s: replayed %d microbatch(es) of step %d from dead %s to %s", self.name, n, k, peer, sorted(targets)
            )
        return set(targets)

    def _unreachable(self, peers: list[str]) -> list[str]:
        """The upstream peers among ``peers`` that refuse a ping (dead); a slow live one answers and is waited for.
        Called with ``self.cv`` held: released around the pings so that markers can still arrive."""
        out = []
        self.cv.release()
        try:
            for p in peers:
                try:
                    call(self.addrs[p], "ping", {}, timeout_s=min(2.0, self.s.rpc_timeout_s))
                except PeerUnavailable:
                    out.append(p)
                except RemoteError:
                    pass
        finally:
            self.cv.acquire()
        return [p for p in out if p not in self.markers.get(self._marker_step, {})]

    def _die(self, step: int) -> None:
        """--die-mid-step (tests): kill -9 of this process when a sender that holds microbatches of ``step`` (>= the
        flag's step) completed here pings it at the end of that step, before its marker: a point every run reaches
        in the first such step where this peer served, mid-step (it cannot sync the step before that marker) and
        after serving (the sender received those replies). Every sender then replays what completed here; requests
        still in flight here (another sender's) are re-sent."""
        deadline = time.monotonic() + 10.0  # requests of a step are served while its checkpoint is still being written:
        while getattr(self, "saved_through", step) < step and time.monotonic() < deadline:  # die after it (a test's
            time.sleep(0.01)  # "mid-step k" means after the checkpoint of step k), bounded
        with self.lock:
            served = len(self.counted.get(step, ()))
        self.faults.die(f"{self.name}: --die-mid-step: kill -9 of itself in step {step} after {served} microbatch(es)")
