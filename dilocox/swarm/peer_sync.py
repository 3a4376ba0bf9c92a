"""What a SWARM peer's stage sync adds to the plain step (issue 11): its inner step with ``optim.grad_clip``'s norm,
and the DiLoCo-SWARM join.

Functions of the ``SwarmPeer`` (``peer.py`` calls them from its sync and its join; kept here because several
features meet in peer.py). docs/SWARM.md, sections "Gradient clipping" and "Joining a running job".

The inner step is ``dilocox.inner_step.InnerStep`` (the trainer's): lr, clipping, AdamW step, zero_grad. What is
the peer's own is the global norm it clips by (``optim.grad_clip`` > 0; grads × min(1, c / (norm + 1e-6)), the
coefficient in float64):

- ``swarm.sync=swarm``: after the stage all-reduce every peer of stage j holds the same mean gradient g_j, so the
  global norm over the whole model is sqrt(Σ_j ||g_j||²), as in one pipeline. Each peer writes ||g_j||² of step k
  under ``swarm/norm/{k}/stage{j}`` in the launcher's TCPStore (every peer of a stage writes the same value), waits
  (bounded by ``swarm.sync_timeout_s``) for every stage's value and sums them in stage order: the same norm on every
  peer. Once a peer has read step k's values it deletes its stage's key of step k - NORM_KEYS_KEPT: a live peer
  can be behind the others (left out of its stage's quorum of a step, late to it past the lighthouse's join
  timeout: the quorum went on without it), and one step behind it still found the key of step k-1 deleted (the
  next key was enough for the others) and timed out. Such a peer's all-reduce meets the stage's next round, where
  torchft heals it: it takes THAT round's step (``healed_round``), with that step's norms.
- ``swarm.sync=diloco``: each peer steps on its own gradient, which no peer of another stage shares; the norm is
  this peer's stage-local one (over its own stage's parameters), with no communication. With one stage it is the
  global clip; with n stages it clips less than the global norm would (a stage's norm is at most the model's).

DiLoCo-SWARM join (``--join`` with ``swarm.sync=diloco``): the stage's peers meet only every H = ``outer.sync_every``
steps, in the DiLoCo outer step over the torchft quorum (``build_outer(..., group=QuorumGroup)``). The joiner pings its
stage's peers until one is in the last inner step of an outer phase or in the outer sync that ends it, waiting for its
quorum (bounded by ``swarm.sync_timeout_s`` × H), then takes part in that outer step without contributing
(``DiLoCoOuter.join``): torchft heals it with the live peer's snapshot (θ, outer momentum, outer step, schedule, inner
step and, through ``hand_over_adamw``, the AdamW state), it applies the same outer step, so it leaves that sync with
params and AdamW state bit-identical to the source's, and serves from the next step. Why "or waiting for its
quorum": the joiner's torchft manager heartbeats the lighthouse from its start, and the lighthouse forms no quorum
while a heartbeating replica stays out of it (with two replicas: 1 participant of 2 healthy is not more than half;
with more: it waits ``join_timeout`` for the straggler). A live peer already in its outer quorum when the joiner came
up (or whose last inner step the joiner's pings missed) therefore waits for the joiner, and a joiner that waited for
a peer "not yet in its sync" waited for it in turn: both hung until the quorum timeout, and the stage's next forwards
with them (``note_quorums``, ``phase_info``: ``quorum_open``).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import time
from datetime import timedelta

import torch
from torch import Tensor

from dilocox.net.client import call
from dilocox.net.rpc import PeerUnavailable, RemoteError, run_secret
from dilocox.net.secure import open_value, sign_value
from dilocox.swarm.common import SwarmError

log = logging.getLogger("dilocox.swarm.peer")


NORM_KEYS_KEPT = 4  # steps whose stage-norm keys stay in the store after a peer read the current step's (above)


def norm_key(step: int, stage: int) -> str:
    return f"swarm/norm/{step}/stage{stage}"


def _norm_waiter(peer):
    """A second client of the peer's store, kept on the peer, for the blocking wait of ``global_norm``: the shared
    client stays free for the handler threads meanwhile."""
    w = getattr(peer, "_norm_store", None)
    if w is None:
        from torch.distributed import TCPStore

        w = peer._norm_store = TCPStore(
            peer.store.host, peer.store.port, is_master=False, timeout=timedelta(seconds=peer.s.sync_timeout_s)
        )
    return w


@torch.no_grad()
def global_norm(peer, k: int, g: Tensor | None) -> float:
    """``swarm.sync=swarm``: the norm over all stages of step ``k``'s averaged gradients, this stage's ``g`` (flat; None
    when the stage served no microbatch: its norm is 0) with every other stage's from the store (module docstring)."""
    sq = float(g.double().pow(2).sum()) if g is not None else 0.0
    keys = [norm_key(k, j) for j in range(peer.n)]
    with peer.store_lock:
        peer.store.set(keys[peer.stage], sign_value(run_secret(), keys[peer.stage], sq.hex()))
    wait = peer.s.sync_timeout_s
    try:  # blocks in the store until every stage's key exists (bounded), on a client of its own (no lock held)
        _norm_waiter(peer).wait(keys, timedelta(seconds=wait))
    except RuntimeError:  # DistStoreError: the timeout (or the store is gone)
        with peer.store_lock:
            missing = [j for j, key in enumerate(keys) if not peer.store.check([key])]
        raise SwarmError(
            f"{peer.name}: optim.grad_clip needs the gradient norm of every stage, and stage(s) {missing} sent "
            f"none for step {k} within swarm.sync_timeout_s={wait}s; is a stage without a live peer? (raise "
            f"the timeout for slow stages, or set optim.grad_clip=0)",
        ) from None
    with peer.store_lock:
        sqs = [float.fromhex(open_value(run_secret(), key, peer.store.get(key).decode())) for key in keys]
        if k >= NORM_KEYS_KEPT:
            peer.store.delete_key(norm_key(k - NORM_KEYS_KEPT, peer.stage))
    return math.sqrt(sum(sqs))


def healed_round(peer, k: int, rec: dict) -> int:
    """``swarm.sync=swarm``: the step whose sync a live peer's all-reduce of step ``k`` was. Left out of its stage's
    quorum of step k (late to it past the lighthouse's join timeout), it met the stage's next round, where torchft
    healed it (``load_from_peer``: a live peer's params and AdamW state as they enter that round's step h): it takes
    step h (its lr, clip norm and records), bit-identical to the others, and goes on from h + 1. Its gradients of
    step k went with the heal (the others' round of step k was over). It sends its end-of-step markers of the steps it
    skipped, so that the next stage does not wait for them."""
    h, peer._healed_step = peer._healed_step, None
    if not peer.group.healed or h is None or h <= k:
        return k
    log.warning(
        "%s: left out of stage %d's sync of step %d, healed in the round of step %d", peer.name, peer.stage, k, h
    )
    rec["healed_to"] = h
    if not peer.last:
        for s in range(k + 1, h + 1):
            peer._send_markers(s)
    return h


def _inner_step(peer, k: int, g: Tensor | None, norm_fn) -> dict:
    """The peer's inner step ``k`` (``InnerStep.apply``) on the mean gradient ``g`` (flat; None: no microbatch this
    step, so no AdamW step). Returns the record's lr, grad_norm, clip_coef."""
    if g is not None:
        peer._set_grads(g)
    return peer.inner.apply(k, norm_fn, take_step=g is not None)


def swarm_step(peer, k: int, mean: Tensor) -> dict:
    """``swarm.sync=swarm``: the inner step on the stage's all-reduced ``[grad sum | microbatch count]`` (the mean
    of both parts: sum / total count exactly), clipped by the global norm over the stages."""
    total = float(mean[-1])
    g = mean[:-1] / total if total > 0 else None
    return _inner_step(peer, k, g, lambda: global_norm(peer, k, g))


def local_step(peer, k: int, grad_sum: Tensor, count: int) -> dict:
    """``swarm.sync=diloco``: the inner step on this peer's own mean gradient, clipped by its stage-local norm (no
    microbatch this step: the learning rate only, no norm)."""
    if not count:
        return _inner_step(peer, k, None, None)
    g = grad_sum / count
    return _inner_step(peer, k, g, lambda: math.sqrt(float(g.double().pow(2).sum())))


def state_digest(peer) -> str:
    """sha1 of this peer's params and AdamW state, in parameter order (tests: two peers hold the same bytes)."""
    h = hashlib.sha1()
    for p in peer.params:
        h.update(p.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        for name, t in sorted(peer.opt.state.get(p, {}).items()):
            h.update(name.encode())
            if isinstance(t, Tensor):
                h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(t).encode())
    return h.hexdigest()


def hand_over_adamw(peer, outer) -> None:
    """Add the peer's AdamW state to the DiLoCo outer snapshot that torchft sends a joiner
    (``outer.membership.add_extra``). With outer.overlap none and no streaming delay the snapshot holds
    references: the main thread waits for that all-reduce (which the joiner joins only after its download) before
    its next AdamW step. Otherwise the inner steps go on while the all-reduce runs, and the state is copied at the
    snapshot."""
    live = outer.overlap == "none" and outer.tau == 0

    def snapshot():
        sd = peer.opt.state_dict()
        return sd if live else copy.deepcopy(sd)

    outer.membership.add_extra(snapshot, peer.opt.load_state_dict)


def note_quorums(peer, group) -> None:
    """A live peer notes the step whose outer quorum formed (torchft's quorum thread calls ``on_quorum``; the step of a
    sync is ``peer.step`` until it ends): ``phase_info`` tells a joiner whether a quorum is still waiting for it."""
    peer.quorum_step = -1
    group.on_quorum = lambda n_live: setattr(peer, "quorum_step", peer.step)


def phase_info(peer) -> dict:
    """For ``ping``: whether this peer is in its sync, whether the sync of its current step is an outer step (the
    DiLoCo outer all-reduce is launched then: a joiner times its quorum request by it), and whether it is in that
    sync with its quorum not formed yet (``quorum_open``: a heartbeating joiner must join it, module docstring)."""
    out = {"syncing": peer.syncing}
    sched = getattr(peer.outer, "schedule", None)
    if sched is not None:
        at = sched.launches_at if peer.outer.overlap == "none" else sched.syncs_at
        out["outer_next"] = bool(at(peer.step + 1))
        out["quorum_open"] = bool(peer.syncing and getattr(peer, "quorum_step", -1) != peer.step)
    return out


def _await_phase_end(peer) -> str:
    """Ping the stage's other peers until one is in the last inner step of an outer phase, or in its outer sync with
    the quorum not formed yet (bounded by swarm.sync_timeout_s × H); returns its name."""
    H = peer.cfg.outer.sync_every
    wait = peer.s.sync_timeout_s * H
    members = getattr(peer, "members", None)  # the job's current peers (rebalancing may have moved some)
    idx = members[peer.stage] if members else range(peer.m)
    others = [f"s{peer.stage}p{i}" for i in idx if i != peer.index]
    deadline = time.monotonic() + wait
    seen: dict[str, object] = {}
    answered = time.monotonic()  # the last time some peer of the stage answered
    while time.monotonic() < deadline:
        for p in others:
            try:
                meta, _ = call(peer.addrs[p], "ping", {}, timeout_s=min(2.0, peer.s.rpc_timeout_s))
            except (PeerUnavailable, RemoteError) as e:
                seen[p] = f"unreachable ({e})"[:80]
                peer._refresh_addr(p)  # it may have been restarted at a new address
                continue
            seen[p], answered = meta.get("step"), time.monotonic()
            # (a peer whose quorum formed without this joiner is past it: wait for the next phase's end)
            if meta.get("outer_next") and (not meta.get("syncing") or meta.get("quorum_open")):
                return p
        if time.monotonic() - answered > peer.s.rpc_timeout_s:
            raise SwarmError(
                f"{peer.name}: cannot join: no peer of stage {peer.stage} answered for swarm.rpc_timeout_s="
                f"{peer.s.rpc_timeout_s}s ({seen}); start a joiner only while its stage is training",
            )
        time.sleep(0.02)
    raise SwarmError(
        f"{peer.name}: no live peer of stage {peer.stage} reached the end of an outer phase (outer.sync_every={H}) "
        f"within swarm.sync_timeout_s x H = {wait:.0f}s (its peers: {seen}); start a joiner only while its stage "
        f"is training, or raise swarm.sync_timeout_s",
    )


def join_diloco(peer) -> int:
    """The DiLoCo-SWARM join (module docstring). Returns the step the peer serves from."""
    t0 = time.monotonic()
    source = _await_phase_end(peer)
    try:
        n = peer.outer.join()
    except RuntimeError as e:
        raise SwarmError(f"{peer.name}: joining stage {peer.stage}'s outer step failed: {e}") from e
    peer.outer.membership.pop_jump()  # join() returned it
    if n is None:
        raise SwarmError(
            f"{peer.name}: joined stage {peer.stage}'s outer step, but no live peer sent its state (contributors "
            f"{peer.outer.contributors}); start a joiner only while its stage is training",
        )
    k = n - 1
    rec = {"step": k, "peer": peer.name, "joined": True, "outer": True, "contributors": list(peer.outer.contributors)}
    if peer.digests:
        rec["digest"] = state_digest(peer)
    peer.enter_step(n, serving=True)
    rec["seconds"] = time.monotonic() - t0
    peer._record(rec)
    log.info(
        "%s: joined stage %d's outer step at step %d (pinged %s; θ, momentum and AdamW state from a live peer), "
        "serving from step %d",
        peer.name,
        peer.stage,
        k,
        source,
        n,
    )
    return n


def state_for_joiner(peer) -> dict:
    """What a joining peer of this stage receives (called by torchft during the sync of step ``peer.step``,
    before this peer's AdamW step: params and optimizer state as they enter that step)."""
    with peer.lock:
        return {
            "params": [p.detach().clone() for p in peer.params],
            "opt": copy.deepcopy(peer.opt.state_dict()),
            "step": peer.step,
        }


@torch.no_grad()
def load_from_peer(peer, sd: dict) -> None:
    for i, (p, t) in enumerate(zip(peer.params, sd["params"], strict=True)):
        if not isinstance(t, torch.Tensor) or t.shape != p.shape or t.dtype != p.dtype:  # (copy_ would broadcast)
            what = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise RuntimeError(f"a live peer sent parameter {i} as {what}, this peer holds {tuple(p.shape)} {p.dtype}")
    for p, t in zip(peer.params, sd["params"]):
        p.copy_(t)
    peer.opt.load_state_dict(sd["opt"])
    peer._healed_step = int(sd["step"])


def join_swarm(peer) -> int:
    """Take part in the next sync of the stage without contributing: torchft heals this peer with a live
    peer's state, it applies the same averaged step, so it leaves the sync bit-identical to the others; then
    it serves from the next step on. Returns that step."""
    if peer.s.sync == "diloco":
        return join_diloco(peer)
    t0 = time.monotonic()
    n = sum(p.numel() for p in peer.params)
    group = peer.group
    [mean] = group.allreduce_mean([torch.zeros(n + 1)], 0)  # healed: contributes nothing, receives the mean
    if not group.healed or peer._healed_step is None:
        raise SwarmError(
            f"{peer.name}: joined, but no live peer of stage {peer.stage} sent its state (contributors "
            f"{group.contributors}); start a joiner only while its stage is training"
        )
    k = peer._healed_step
    rec = {"step": k, "peer": peer.name, "joined": True, "contributors": list(group.contributors)}
    rec.update(swarm_step(peer, k, mean))
    if peer.digests:
        rec["digest"] = state_digest(peer)
    peer.enter_step(k + 1, serving=True)
    rec["seconds"] = time.monotonic() - t0
    peer._record(rec)
    log.info("%s: joined at step %d (state from the stage's live peers), serving from step %d", peer.name, k, k + 1)
    return k + 1
