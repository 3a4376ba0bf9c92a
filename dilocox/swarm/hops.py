"""The microbatch path of a SWARM peer (``SwarmPeer`` mixes this in; the protocol: ``dilocox.swarm.peer``).

A forward request runs this stage, sends the result on to a peer of the next stage (``_send``: router choice,
timeouts, bans, re-sends, bytes counted per link as sent) and backwards the gradient that comes back; the last
stage computes the loss. ``_process_grad_only``: a microbatch whose parameter gradient this peer already holds (a
replay below its first hop) returns only its input's gradient.

Uses the peer's state (set in ``SwarmPeer.__init__``): ``model``, ``lock``, ``meter``, ``router``/``router_lock``,
``addrs``, ``store``/``store_lock``, the per-step counters and logs.
"""

from __future__ import annotations

import logging
import math
import time

import torch
from torch import Tensor

from dilocox.net.client import call
from dilocox.net.rpc import PeerUnavailable, RemoteError, run_secret
from dilocox.net.secure import open_value
from dilocox.swarm import activations as act_codec
from dilocox.swarm.common import SwarmError, split_peer_name, store_key
from dilocox.swarm.routing import NoLivePeer

log = logging.getLogger("dilocox.swarm.peer")


class MicrobatchHops:
    """Forward, send on, backward: one microbatch through this peer (module docstring)."""

    def _process(
        self, step: int, mb: str, x: Tensor, ids: Tensor, deadline: float | None = None, down_mode: str = ""
    ) -> tuple[Tensor | None, dict]:
        """Forward this stage on ``x``, the rest of the route, and backward; returns (grad of x, info). ``ids``: the
        microbatch's ``[2, B, S]`` input ids and targets (``activations.pack_ids``)."""
        busy = 0.0  # this peer's own work on the microbatch (compute, serial delay): not queues, not downstream
        self.faults.before_compute()  # injected slowness (tests, heterogeneous-peer benchmarks: swarm/faults.py)
        with self.meter.hold(self.lock):  # (the meter: this peer's queue and throughput, for rebalancing)
            t = time.monotonic()
            self.faults.in_compute()  # injected slower compute: holds the compute lock
            out = self.model(x)
            self.visits.append((step, mb, "fwd"))
            busy += time.monotonic() - t
        if self.last:
            with self.meter.hold(self.lock, done=True):
                t = time.monotonic()
                self._check_deadline(deadline, step, mb)
                loss = self.model.loss(out.float(), ids[1].long())
                loss.backward()
                self.visits.append((step, mb, "bwd"))
                self.count += 1
                self.counted.setdefault(step, set()).add(mb)
                self.loss_sum += float(loss.detach())
                self.faults.pace(busy + time.monotonic() - t)
                self.busy_s += busy + time.monotonic() - t
            info = {"loss": float(loss.detach()), "route": [self.name]}
        else:
            gy, info, peer = self._send(step, mb, out.detach(), ids, deadline, mode=down_mode)
            with self.meter.hold(self.lock, done=True):
                t = time.monotonic()
                self._check_deadline(deadline, step, mb)
                out.backward(gy.to(out.dtype))
                self.visits.append((step, mb, "bwd"))
                self.count += 1
                self.counted.setdefault(step, set()).add(mb)
                self.routed[peer] = self.routed.get(peer, 0) + 1
                self.faults.pace(busy + time.monotonic() - t)
                self.busy_s += busy + time.monotonic() - t
            info["route"] = [self.name, *info["route"]]
        return (x.grad if x.requires_grad else None), info

    def _process_grad_only(
        self, step: int, mb: str, x: Tensor, ids: Tensor, deadline: float | None
    ) -> tuple[Tensor, dict]:
        """A microbatch whose parameter gradient this peer (and every stage below) holds already (a replay below its
        first hop, or an id it counted this step): forward, the rest of the route, and only the gradient of ``x``."""
        with self.lock:
            self._check_deadline(deadline, step, mb)
            out = self.model(x)
        if self.last:
            with self.lock:
                self._check_deadline(deadline, step, mb)
                loss = self.model.loss(out.float(), ids[1].long())
                (gx,) = torch.autograd.grad(loss, x)
            info = {"loss": float(loss.detach()), "route": [self.name]}
        else:
            gy, info, _ = self._send(step, mb, out.detach(), ids, deadline, mode="grad_only")
            with self.lock:
                self._check_deadline(deadline, step, mb)
                (gx,) = torch.autograd.grad(out, x, gy.to(out.dtype))
            info["route"] = [self.name, *info["route"]]
        with self.lock:
            self.visits.append((step, mb, "grad_only"))
        return gx, info

    def _send(
        self,
        step: int,
        mb: str,
        y: Tensor | None,
        ids: Tensor,
        deadline: float | None = None,
        mode: str = "",
        enc: tuple | None = None,
    ) -> tuple[Tensor, dict, str]:
        """``mode``: "" | "replay" | "grad_only" (a flag of the request, module doc); ``enc``: (payload, ActMeta)
        already encoded (a replay re-sends what it sent before)."""
        payload, ameta = enc if enc is not None else self.codec.encode_act(y, ids)
        failures, why = 0, ""
        while True:
            with self.router_lock:
                try:
                    peer = self.router.choose()
                except NoLivePeer as e:
                    raise SwarmError(f"{self.name}: {e}") from e
                # every peer of the next stage failed this microbatch twice: an error that does not clear (a ban
                # shorter than a failure would otherwise re-send it without end)
                if failures >= 2 * (len(self.router.live()) + len(self.router.banned())):
                    raise SwarmError(
                        f"{self.name}: microbatch {mb} failed {failures} times on the next stage's peers "
                        f"(last: {why}); giving it up"
                    )
            timeout = self.hop_timeout()
            if deadline is not None:
                timeout = min(timeout, deadline - time.monotonic())
                if timeout <= 0:
                    raise SwarmError(f"{self.name}: no time left to send microbatch {mb} on (its caller gave up)")
            t0 = time.monotonic()
            flag = {mode: True} if mode else {}
            try:
                meta, tens = call(
                    self.addrs[peer],
                    "forward",
                    {"step": step, "mb": mb, "budget_s": timeout, "act": ameta.to_dict(), **flag},
                    {"x": payload, "ids": ids},
                    timeout_s=timeout,
                )
            except PeerUnavailable as e:
                if self._refresh_addr(peer):
                    continue  # it was restarted at a new address: try it there
                self._ban(step, mb, peer, e.reason)
                failures, why = failures + 1, e.reason
                continue
            except RemoteError as e:  # (it dropped the microbatch, e.g. at its deadline: as a timeout, not the end)
                if mode == "replay":  # (its caller counts it lost: the stage's peers may be in their sync already)
                    raise
                self._ban(step, mb, peer, str(e))
                failures, why = failures + 1, str(e)
                continue
            now = time.monotonic()
            with self.router_lock:
                # the peer's time per microbatch as this sender sees it: from the later of this request's send and
                # the previous reply from that peer (when several of this sender's requests queue there, the round
                # trip would count the queue too, and IWRR would equalise latencies instead of following throughput)
                self.router.done(peer, now - max(t0, self.last_done.get(peer, t0)))
                self.last_done[peer] = now
            with self.lock:
                link = self.link_bytes.setdefault(peer, [0, 0])
                link[0] += payload.numel() + ids.numel() * ids.element_size()
                link[1] += tens["grad"].numel()
            gy = self.codec.decode(tens["grad"], act_codec.ActMeta.from_dict(meta.pop("gact")))
            if mode != "grad_only":  # it completed there: that peer holds its gradient (replayed if it dies)
                with self.lock:
                    entry = (mb, self.addrs[peer], payload, ameta.to_dict(), ids)
                    self.completed.setdefault(step, {}).setdefault(peer, []).append(entry)
            return gy, meta, peer

    def _ban(self, step: int, mb: str, peer: str, reason: str) -> None:
        """The hop to ``peer`` failed (no reply in time, or its handler dropped the microbatch): ban it (the caller
        re-sends to another live peer of its stage)."""
        with self.router_lock:
            self.router.failed(peer)
        self.bans.append({"step": step, "mb": mb, "peer": peer, "reason": reason, "t": time.time()})
        log.warning("%s: banned %s for %.0fs (%s); re-sending microbatch %s", self.name, peer, self.s.ban_s, reason, mb)

    def _check_deadline(self, deadline: float | None, step: int, mb: str) -> None:
        if deadline is not None and time.monotonic() > deadline:
            self.visits.append((step, mb, "abandoned"))
            raise SwarmError(f"{self.name}: microbatch {mb} came back after its caller's timeout: dropped here")
        if self._sync_entered >= step:  # a replay that came too late: its gradient would miss (or corrupt) the sync
            self.visits.append((step, mb, "late"))
            raise SwarmError(f"{self.name}: microbatch {mb} arrived after that step's sync (step {step}): dropped")

    def caller_budget(self, meta: dict) -> float:
        """A call's ``budget_s`` (how long its caller waits), bounded: at most the longest hop timeout of the job,
        0 for a negative or non-finite one (a JSON header may carry Infinity or NaN)."""
        b = float(meta.get("budget_s", 0.0))
        return min(b, self.s.rpc_timeout_s * 2**self.n) if math.isfinite(b) and b > 0 else 0.0

    def hop_timeout(self) -> float:
        """Bound on a call from this stage: the next hop's work and one re-send per stage below it."""
        return self.s.rpc_timeout_s * 2 ** max(0, self.n - 2 - self.stage)

    def _refresh_addr(self, peer: str) -> bool:
        """Re-read ``peer``'s address from the store; True when it changed (the peer was restarted)."""
        j, i = split_peer_name(peer)
        try:
            with self.store_lock:
                new = open_value(run_secret(), store_key(j, i), self.store.get(store_key(j, i)).decode())
        except Exception:  # noqa: BLE001 - the store is gone (end of the job) or the entry is not the run's: keep it
            return False
        if new == self.addrs.get(peer):
            return False
        log.info("%s: %s moved to %s", self.name, peer, new)
        self.addrs[peer] = new
        return True
