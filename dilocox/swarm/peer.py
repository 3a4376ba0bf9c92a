"""One SWARM peer: a process serving stage j of the model (``python -m dilocox.swarm.peer ...``).

The protocol (docs: the SWARM section of README; issue 11):

- The peer builds its stage with ``build_stage_model`` (same seed on every peer of a stage, so they start
  identical), serves a tensor RPC endpoint (``transport.RpcServer``) and publishes
  ``swarm/stage{j}/peer{k} -> host:port`` in the launcher's ``TCPStore``; it waits (bounded) for the
  addresses of every peer of the job.
- Step k: a stage-0 peer draws its batch of step k as random windows of its own (``TokenSampler(replica=k,
  n_replicas=m_0)``, seeded by (seed, k, step): i.i.d., not a disjoint shard), splits it into microbatches and sends
  each (``max_inflight`` at a time) forward to a stage-1 peer chosen by its router. A request ``forward`` carries
  (step, microbatch id, activation, ids and targets); the receiving peer runs its stage, sends the result on to a peer
  of the next stage chosen by ITS router, and the reply of that call is the gradient of the activation it sent: the
  backward pass returns along the same route, and each hop keeps its input activation (the autograd graph of the call)
  until the reply arrives. The last stage computes the loss (mean token cross-entropy of the microbatch) and
  backpropagates it. Every peer adds the gradients of all microbatches it served in a step (a sum).
- A peer serves requests of step k only after its own sync of step k-1 (earlier requests wait, bounded).
- End of step: a stage-0 peer, once all its microbatches returned, sends ``end_step(k)`` to every stage-1
  peer; a stage-j peer enters its sync when every upstream peer it expects said so (bounded: one that
  stays silent for ``swarm.step_timeout_s`` is dropped from the expected set for good), then forwards the
  marker downstream.
- Stage sync, ``swarm.sync=swarm``: ``[grad sum | microbatch count]`` is averaged over the stage's live
  peers (one flat all-reduce through ``ElasticOuterGroup``, torchft quorum; the mean of both parts gives
  sum/count exactly), grads = total sum / total count (the microbatch-weighted mean), one AdamW step:
  identical bytes in, identical params out on every peer. ``swarm.sync=diloco``: every peer takes its own
  AdamW step on its own mean gradient each step; every ``outer.sync_every`` steps the stage's peers average
  the pseudo-gradient θ - θ_m and apply the outer Nesterov step (``outer.state.OuterState``, ALGORITHMS §1).
- Faults: every RPC has a timeout (``swarm.rpc_timeout_s`` per hop, scaled by the hops below it); on a
  timeout or a dropped connection the sender bans the peer (router ``failed``) and re-sends the microbatch
  to another live peer of that stage (the rest of the route is chosen afresh from there). A stage with no
  live peer stops the job with ``NoLivePeer`` naming the stage. A request carries its caller's remaining budget:
  a peer that finishes after it (the caller gave up and re-sent) drops that microbatch instead of adding its
  gradient, so a re-sent microbatch is counted once (up to a margin of 10 % of the budget, at most 2 s). A
  downstream peer that gets no end-of-step from an upstream peer pings it after 1 s and drops it when it is
  unreachable (a silent but live one is waited for up to ``swarm.step_timeout_s``).
- Replay (nothing lost when a peer dies mid-step): a sender keeps, for the current step and per downstream
  peer, the microbatches that completed there (payload as sent, ids). At the end of the step, before its
  markers, it pings those peers; a dead one's microbatches (their gradients died with it) are re-sent to live
  peers of its stage as ``forward`` with ``replay``: the first hop accumulates and counts them, the hops below
  (which hold their gradient already) get ``grad_only`` and return only the input's gradient; the sender does not
  backward the reply. A hop given a microbatch id it already counted this step also treats it as ``grad_only``. A
  marker that cannot be delivered triggers the same replay, then the targets get their marker again; a replay
  reaching a peer already in its sync is refused there and counted as ``lost`` (docs/SWARM.md, remaining window).
- Join (``--join``, ``swarm.sync=swarm``): a restarted peer publishes its new address (callers re-read the store
  when a call fails), answers ``forward`` with ``NotServing`` (callers ban it briefly), takes part in its stage's
  next sync without contributing, receives a live peer's params + AdamW state from torchft's healing in that
  quorum, applies the same averaged step (so it leaves that sync bit-identical to the others), then serves.
  ``swarm.sync=diloco``: the same at the stage's next OUTER step (θ, outer momentum, schedule and the AdamW state;
  ``peer_sync.join_diloco``, docs/SWARM.md "Joining a running job").
- ``optim.grad_clip``: swarm: the global norm over the stages' averaged gradients (exchanged through the store);
  diloco: each peer's stage-local norm (``peer_sync``, docs/SWARM.md "Gradient clipping").

Results: ``OUT/s{j}p{k}.jsonl`` (a record per step), ``OUT/s{j}p{k}.pt`` (final params, dumped grads, the visits,
routes, bans of the last ``step_end.TRACE_STEPS`` steps and the newest records: memory stays bounded on long runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
from torch import Tensor

from dilocox.config import Config, ConfigError, load_config
from dilocox.elastic import ElasticError
from dilocox.fsutil import atomic_path
from dilocox.inner_step import InnerStep
from dilocox.metrics import MetricsLogger
from dilocox.model import build_stage_model
from dilocox.net.rpc import NotServing, RemoteError, RpcServer, run_encrypts, run_secret, use_secret
from dilocox.net.secure import SecretError, open_value, sign_value
from dilocox.optim import build_inner_optimizer
from dilocox.swarm import activations as act_codec
from dilocox.swarm import checkpoint as peer_ckpt
from dilocox.swarm import membership, peer_sync
from dilocox.swarm.common import DIGEST_ENV, SwarmError, check_place, make_router, peer_name, rpc_security, store_key
from dilocox.swarm.faults import Faults
from dilocox.swarm.hops import MicrobatchHops
from dilocox.swarm.membership import LoadMeter
from dilocox.swarm.routing import NoLivePeer
from dilocox.swarm.services import service_secret
from dilocox.swarm.step_end import StepEnd

# (re-exported: ``from dilocox.swarm.peer import DIGEST_ENV, make_router, ...`` keeps working)
__all__ = ["DIGEST_ENV", "SwarmError", "SwarmPeer", "main", "make_router", "peer_name"]

log = logging.getLogger("dilocox.swarm.peer")


class SwarmPeer(MicrobatchHops, StepEnd):
    """Stage ``stage``, peer ``index`` of a SWARM job (module docstring). The microbatch path is in
    ``swarm/hops.py``, the end of a step (markers, replay) in ``swarm/step_end.py``, the stage sync helpers and the
    join in ``swarm/peer_sync.py``."""

    def __init__(
        self,
        cfg: Config,
        stage: int,
        index: int,
        store,
        lighthouse: str | None,
        out_dir: str,
        steps: int | None = None,
        dump_grads: tuple[int, ...] = (),
        join: bool = False,
        resume: bool = False,
        faults: Faults = Faults(),
    ) -> None:
        self.cfg, self.s = cfg, cfg.swarm
        self.pps = list(self.s.peers_per_stage)
        self.n = len(self.pps)
        check_place(self.pps, stage, index, join)
        self.stage, self.index, self.m, self.name = stage, index, self.pps[stage], peer_name(stage, index)
        self.first, self.last, self.steps = stage == 0, stage == self.n - 1, cfg.train.steps if steps is None else steps
        self.out_dir, self.dump_grads = out_dir, set(dump_grads)
        lg = cfg.log  # OUT/s{j}p{i}.jsonl (the run's results: always), TensorBoard OUT/tb/s{j}p{i}, W&B as trainers
        self.metrics = MetricsLogger(out_dir, True, self.steps, tensorboard=lg.tensorboard, progress=False,
                                     wandb_project=lg.wandb_project if lg.wandb else None, config=cfg.to_dict(),
                                     name=self.name)  # fmt: skip
        self.faults = faults  # injected slowness and failure (tests, heterogeneous-peer benchmarks): swarm/faults.py
        self.store, self.lighthouse = store, lighthouse
        self.store_lock = threading.Lock()  # the store client is shared by the handler threads
        self.join = join  # a (re)started peer joining a running job: it gets its stage's state at its first sync
        self.resume = resume  # --resume: start from the newest complete SWARM checkpoint (swarm/checkpoint.py)
        self.serving = not join
        self._healed_step: int | None = None
        self.syncing = False  # in the sync of self.step (a DiLoCo joiner asks, to time its quorum request)
        self.digests = bool(os.environ.get(DIGEST_ENV))  # tests: a hash of params + AdamW state after each sync
        torch.manual_seed(cfg.train.seed)
        self.model = build_stage_model(cfg.model, stage=stage, n_stages=self.n, seed=cfg.train.seed)
        self.model.recompute = cfg.train.recompute
        self.codec = act_codec.ActCodec.from_config(cfg)  # of the activations and gradients at stage boundaries
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # the inner optimizer of `dilocox train` (dilocox.optim): optim.name, no weight decay on biases and norms
        self.opt = build_inner_optimizer(cfg, self.model, torch.device("cpu"))
        self.inner = InnerStep(self.opt, cfg)  # the step after the gradients: lr, clipping, AdamW, zero_grad
        self._init_step_state()
        if self.first:
            self._init_data()
        # set at the end of start(): the server answers from here on, but a forward must wait (bounded) until the
        # router and sync group exist (an upstream peer may send as soon as every address is published)
        self.ready = threading.Event()
        self.server = RpcServer(self._handle, host=self.s.host, name=self.name)

    def _init_step_state(self) -> None:
        """Locks, the step and its counters, markers, routing, replay and rebalancing state (none yet)."""
        self.lock = threading.Lock()  # model compute + grad accumulation + counters
        self.cv = threading.Condition()  # self.step and the end-of-step markers
        self.step = 0  # the step whose microbatches this peer accumulates now
        self.count = 0  # microbatches served in self.step
        self.active = 0  # forward requests being served now
        self.loss_sum = 0.0
        self.busy_s = 0.0  # seconds of own work (compute + serial delay) on the microbatches of this step
        self.markers: dict[int, dict[str, int]] = {}  # step -> upstream peer -> microbatches it routed here
        self.expected_up = [peer_name(self.stage - 1, i) for i in range(self.pps[self.stage - 1])] if self.stage else []
        self.dropped_up: list[dict] = []
        self._marker_step = 0
        self.routed: dict[str, int] = {}  # downstream peer -> microbatches routed there this step
        self.link_bytes: dict[str, list[int]] = {}  # downstream peer -> [bytes sent, bytes received] this step
        self.visits: list[tuple[int, str, str]] = []  # (step, microbatch id, fwd|bwd)
        self.routes: dict[str, list[str]] = {}  # stage 0: microbatch id -> peers visited, stage order
        self.grads_dump: dict[int, dict] = {}
        self.bans: list[dict] = []
        self.addrs: dict[str, str] = {}
        self.router = None
        self.router_lock = threading.Lock()
        self.last_done: dict[str, float] = {}  # downstream peer -> time of its last reply (router timing)
        # replay (a dead downstream peer's gradients die with it): step -> downstream peer -> the microbatches that
        # completed there (mb id, the peer's address then, activation payload, ActMeta dict, ids)
        self.completed: dict[int, dict[str, list[tuple]]] = {}
        self.counted: dict[int, set[str]] = {}  # step -> microbatch ids whose gradient this peer holds
        self.replayed = self.lost = 0  # this step, as a sender: microbatches replayed / lost with a dead peer
        self.replays: list[dict] = []
        self._sync_entered = -1  # the last step whose sync took the accumulated grads (later arrivals are refused)
        self.group = None
        self.outer = None
        self.records: list[dict] = []
        # rebalancing (dilocox.swarm.membership): load meter, leave request, peers that joined/left next to this one
        self.meter = LoadMeter()
        self.leave_requested = False
        self.down_peers: list[str] = []  # the next stage's peers this one sends end-of-step markers to
        self.up_from: dict[str, int] = {}  # upstream peer that joined -> first step whose marker it sends
        self.markers_sent = -1  # last step whose end-of-step markers this peer sent
        self.move_to: dict | None = None  # set by a ``leave`` RPC that moves it: its new stage, index, flags

    # ------------------------------------------------------------------ set-up
    def _init_data(self) -> None:
        from dilocox.data.prepare import prepare
        from dilocox.data.sampler import TokenSampler

        tokens = prepare(self.cfg.data).train_tokens()
        t = self.cfg.train
        # random windows seeded by (seed, index, step): a peer moved into stage 0 by rebalancing (index >= m_0) draws
        # its own stream, a restarted one the same stream as before
        n_rep = max(self.m, self.index + 1)
        self.sampler = TokenSampler(tokens, t.seq_len, t.batch_size, t.seed, replica=self.index, n_replicas=n_rep)

    def start(self) -> None:
        """Publish this peer's address, wait (bounded) for every other peer's, build router and sync group.
        A joiner answers forward requests with ``NotServing`` until it holds its stage's state (``_join``), but
        receives the end-of-step markers at once."""
        # the job's current peers: swarm.peers_per_stage, or the launcher's list after rebalancing moves (a joiner)
        members = membership.read_members(self.store, self.pps) if self.join else [list(range(m)) for m in self.pps]
        if self.join:
            members[self.stage] = sorted(set(members[self.stage]) | {self.index})
            self.m = len(members[self.stage])
        self.members = members
        if self.join and self.m == 1:
            raise SwarmError(f"{self.name}: cannot join: stage {self.stage} has no other peer to get its state from")
        # (before publishing: no peer trains, so none saves, until every peer has picked its resume step)
        resume_from = peer_ckpt.candidates(self) if self.resume and not self.join else None
        if not self.resume and not self.join:
            peer_ckpt.refuse_stale(self.cfg, self.out_dir)
        self.metrics.prepare()
        me = store_key(self.stage, self.index)
        self.store.set(me, sign_value(run_secret(), me, self.server.addr))  # (a stranger's entry fails the check)
        keys = [store_key(j, i) for j in range(self.n) for i in members[j]]
        try:
            self.store.wait(keys, timedelta(seconds=self.s.startup_timeout_s))
        except Exception as e:  # noqa: BLE001 - the store raises a plain RuntimeError on timeout
            raise SwarmError(
                f"{self.name}: not every peer of swarm.peers_per_stage={self.pps} published its address within "
                f"swarm.startup_timeout_s={self.s.startup_timeout_s}s; start them all (or raise the timeout)"
            ) from e
        for j in range(self.n):
            for i in members[j]:
                key = store_key(j, i)
                self.addrs[peer_name(j, i)] = open_value(run_secret(), key, self.store.get(key).decode())
        if self.stage:
            self.expected_up = [peer_name(self.stage - 1, i) for i in members[self.stage - 1]]
        if not self.last:
            down = [peer_name(self.stage + 1, i) for i in members[self.stage + 1]]
            self.down_peers = list(down)
            self.router = make_router(
                self.s.routing,
                down,
                f"stage {self.stage + 1}",
                self.s.ban_s,
                seed=self.cfg.train.seed + self.stage,
                offset=self.index,
            )
        if self.m > 1 or self.s.rebalance_period_s > 0:  # rebalancing: a one-peer stage may gain a peer later
            from dilocox.elastic import ElasticConfig, ElasticOuterGroup
            from dilocox.elastic.quorum import QuorumGroup

            if not self.lighthouse:
                raise SwarmError(f"{self.name}: stage {self.stage} has {self.m} peers but no lighthouse address")
            self.group = QuorumGroup(
                ElasticOuterGroup(
                    ElasticConfig(
                        lighthouse_addr=self.lighthouse,
                        replica_rank=self.index,
                        min_replicas=1,
                        initial_replicas=1 if self.join else self.m,  # a joiner meets the live peers, however many
                        max_replicas=max(self.m, sum(self.pps)),  # room for the index of a peer moved here
                        timeout_s=self.s.sync_timeout_s,
                        quorum_timeout_s=self.s.sync_timeout_s,
                        host=self.s.host,
                        secret=run_secret(),  # (the peers' RPC secret also guards a joiner's state)
                        lighthouse_auth=service_secret(self.cfg) is not None,  # the stage lighthouse: behind a guard
                        encrypt=run_encrypts(),
                    )
                )
            )
            if self.s.sync == "swarm":  # (diloco: the DiLoCo outer object sets its own state transfer)
                self.group.set_state_fns(
                    lambda: peer_sync.state_for_joiner(self),
                    lambda sd: peer_sync.load_from_peer(self, sd),
                    max_state_bytes=4 * sum(p.numel() * p.element_size() for p in self.params) + (64 << 20),
                )
        if self.s.sync == "diloco":
            self.outer = self._build_outer()
        if resume_from is not None:
            peer_ckpt.resume(self, resume_from)
        self.ready.set()

    def _build_outer(self):
        """The stage's DiLoCo outer loop: ``dilocox.outer.build_outer`` over the torchft quorum of the stage's peers
        (so outer.overlap and the compress options apply as in the replica mode); a one-peer stage without
        rebalancing has no quorum and is a single replica (``FixedGroup(None)``: the same outer step on its own)."""
        from dilocox.outer import build_outer

        outer = build_outer(
            list(self.model.named_parameters()),
            None,
            dataclasses.replace(self.cfg.outer, method="diloco"),
            self.cfg.compress,
            seed=self.cfg.train.seed,
            layer_of=self.model.param_layer_id,
            n_layers_total=self.cfg.model.n_layers,
            group=self.group,
        )
        outer.bound_waits(2 * self.s.sync_timeout_s, self.cfg.outer.warn_after_s)
        if self.group is not None:
            peer_sync.hand_over_adamw(self, outer)  # a joiner gets a live peer's AdamW state with θ and v
            peer_sync.note_quorums(self, self.group)  # (ping tells a joiner whether an outer quorum waits for it)
        return outer

    # ------------------------------------------------------------------ RPC handlers
    def _handle(self, method: str, meta: dict, tensors: dict[str, Tensor]):
        if method == "forward":
            return self._serve_forward(meta, tensors)
        if method in membership.METHODS:  # stats / leave / hello / bye (rebalancing)
            return membership.handle(self, method, meta)
        if method == "end_step":
            self._on_marker(meta)  # (step_end.py)
            return {}, {}
        if method == "ping":
            if self.faults.dies_at(int(meta.get("step", -1)), int(meta.get("held") or 0)):
                self._die(int(meta["step"]))
            return {"name": self.name, "step": self.step, **peer_sync.phase_info(self)}, {}
        raise ValueError(f"{self.name}: unknown method {method!r}")

    def enter_step(self, step: int, serving: bool | None = None) -> None:
        """Move to ``step`` (a sync, resume or join landed there), waking its waiting requests; ``serving``: set too."""
        with self.cv:
            self.step, self.serving = step, self.serving if serving is None else serving
            self.cv.notify_all()

    def drop_upstream(self, name: str) -> None:
        """An upstream peer left for good: no sync waits for its end-of-step marker again."""
        with self.cv:
            self.expected_up = [p for p in self.expected_up if p != name]
            self.cv.notify_all()

    def request_leave(self, move_to: dict | None) -> None:
        """Leave after the current step (or outer phase), then serve ``move_to`` if given."""
        self.move_to, self.leave_requested = (dict(move_to) if move_to is not None else self.move_to), True

    def _wait_step(self, step: int, what: str, deadline: float | None = None) -> None:
        wait = self.s.step_timeout_s if deadline is None else min(self.s.step_timeout_s, deadline - time.monotonic())
        with self.cv:
            ok = self.cv.wait_for(lambda: self.step >= step, timeout=max(0.0, wait))
            if not ok:
                raise SwarmError(
                    f"{self.name}: {what} of step {step} waited {max(0.0, wait):.1f}s (swarm.step_timeout_s="
                    f"{self.s.step_timeout_s}s, or its caller's budget) for this peer's sync of step {step - 1} (it is "
                    f"at step {self.step})"
                )
            if self.step > step:
                raise SwarmError(f"{self.name}: {what} of step {step} arrived after that step's sync (now {self.step})")

    def _serve_forward(self, meta: dict, tensors: dict[str, Tensor]):
        if not self.ready.wait(timeout=0.9 * self.caller_budget(meta)):
            raise NotServing(f"{self.name} is still starting (no router / sync group yet)")
        if not self.serving:
            raise NotServing(f"{self.name} is joining (waiting for its stage's state)")
        with self.cv:
            self.active += 1
        try:
            return self._serve_forward_inner(meta, tensors)
        finally:
            with self.cv:
                self.active -= 1
                self.cv.notify_all()

    def _serve_forward_inner(self, meta: dict, tensors: dict[str, Tensor]):
        step, mb = int(meta["step"]), str(meta["mb"])
        # the caller gives up after budget_s: past that, nothing of this microbatch may reach the gradients (the
        # caller re-sends it elsewhere); the margin covers the backward and the reply after the last check
        budget = self.caller_budget(meta)
        deadline = time.monotonic() + budget - min(2.0, 0.1 * budget)
        self._wait_step(step, f"microbatch {mb}", deadline)
        if not self.serving:  # it left its stage (rebalancing) while this request waited for the step
            raise NotServing(f"{self.name} left stage {self.stage}")
        x = self.codec.receive(tensors["x"], meta["act"], tensors["ids"]).float().requires_grad_(True)
        with self.lock:  # this peer (and the stages below) already hold its gradient: the input's gradient only
            grad_only = bool(meta.get("grad_only")) or mb in self.counted.get(step, ())
        if grad_only:
            gx, info = self._process_grad_only(step, mb, x, tensors["ids"], deadline)
        else:  # a replay's first hop: accumulate as usual, the stages below hold the gradient already
            down = "grad_only" if meta.get("replay") else ""
            gx, info = self._process(step, mb, x, tensors["ids"], deadline, down)
        payload, gmeta = self.codec.encode(gx)
        info["gact"] = gmeta.to_dict()
        return info, {"grad": payload}

    # ------------------------------------------------------------------ steps
    def run(self) -> None:
        start = peer_sync.join_swarm(self) if self.join else self.step  # (--resume: the checkpoint's step)
        if self.join:  # tell the neighbouring stages (a peer moved here by rebalancing is new to them)
            membership.announce(self, start, self.members)
        k = start
        while k < self.steps:
            t0 = time.monotonic()
            rec: dict = {"step": k, "peer": self.name}
            if self.first:
                rec.update(self._drive(k))
            self._end_of_step(k)
            with self.lock:
                rec["microbatches"] = self.count
                if not self.last:  # microbatches re-sent at the end of the step because their peer died
                    rec["replayed"], rec["lost"], self.replayed, self.lost = self.replayed, self.lost, 0, 0
                rec["busy_s"], self.busy_s = self.busy_s, 0.0  # own work on this step's microbatches (seconds)
                if self.link_bytes:  # pipeline traffic of this step on each link to the next stage (both ways)
                    rec["link_bytes"], self.link_bytes = self.link_bytes, {}
                if self.last and self.count:
                    rec["loss_served"] = self.loss_sum / self.count
            # rebalancing: this step is its last (diloco: the last of an outer phase, so its pseudo-gradient counts);
            # the next step's requests go elsewhere
            leaving = self.leave_requested and self._may_leave_after(k)
            if leaving:
                self.serving = False
            rec.update(self._sync(k))
            k = self.step - 1  # (a peer healed in a later round of its stage's sync took that round's step)
            rec["seconds"] = time.monotonic() - t0
            self._record(rec)  # (step_end.py: the .jsonl; in memory the newest records and steps only)
            if peer_ckpt.due(self.cfg, k + 1):  # (a leaving peer too: it may be its stage's writer)
                peer_ckpt.save(self, k + 1)
            self.saved_through = k + 1  # (--die-mid-step waits for it: the fault lands after this step's save)
            if leaving:
                membership.leave(self, k)
                break
            k += 1
        else:  # the end of the run (before outer.finish: a longer run's next step starts from what is pending)
            if self.cfg.checkpoint.every > 0:
                peer_ckpt.save(self, self.step)
        if self.outer is not None:
            self.outer.finish()  # applies what is in flight (outer.overlap delayed/eager)
        with self.cv:  # requests still running (ones their caller gave up on) end within their budget
            if not self.cv.wait_for(lambda: self.active == 0, timeout=self.s.step_timeout_s):
                log.warning("%s: %d request(s) still running at the end", self.name, self.active)

    def _may_leave_after(self, k: int) -> bool:
        """A peer asked to leave does so after step ``k``'s sync: any step with sync=swarm; with sync=diloco only a
        step that ends an outer phase (its H local steps enter the stage's outer step: none is thrown away; a streamed
        sync has no such step, so rebalancing refuses it: ``common.check_stage_streaming``)."""
        return self.s.sync == "swarm" or (k + 1) % self.cfg.outer.sync_every == 0

    def _drive(self, k: int) -> dict:
        tokens, labels = self.sampler.batch_at(k)
        mbs = self.s.microbatch_size
        chunks = list(zip(tokens.split(mbs), labels.split(mbs)))
        ids = [f"{self.name}:{k}:{i}" for i in range(len(chunks))]

        def one(i: int):
            x, y = chunks[i]
            _, info = self._process(k, ids[i], x, act_codec.pack_ids(x, y, self.cfg.model.vocab_size))
            return info

        if self.s.max_inflight == 1 or len(chunks) == 1:
            infos = [one(i) for i in range(len(chunks))]
        else:
            with ThreadPoolExecutor(max_workers=self.s.max_inflight, thread_name_prefix=f"{self.name}-mb") as ex:
                infos = list(ex.map(one, range(len(chunks))))
        losses = [i["loss"] for i in infos]
        for i, info in zip(ids, infos):
            self.routes[i] = info["route"]
        return {"loss": sum(losses) / len(losses), "mb_losses": losses}

    # ------------------------------------------------------------------ the stage sync
    def _flat_grads(self) -> Tensor:
        return torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in self.params]
        )

    def _set_grads(self, flat: Tensor) -> None:
        off = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[off : off + n].view_as(p).to(p.dtype).clone()
            off += n

    @torch.no_grad()
    def _sync(self, k: int) -> dict:
        t0 = time.monotonic()
        rec: dict = {}
        self.syncing = True
        with self.lock:
            count = self.count
            grad_sum = self._flat_grads()
            self._sync_entered = k  # a replay of step k arriving from now on is refused (_check_deadline)
            self.counted.pop(k, None)
            self.count, self.loss_sum = 0, 0.0
        if k in self.dump_grads:
            self.grads_dump[k] = {"grad_sum": grad_sum.clone(), "count": count}
        if self.s.sync == "swarm":
            flat = torch.cat([grad_sum, torch.tensor([float(count)])])
            if self.group is not None:
                [flat] = self.group.allreduce_mean([flat], k)
                rec["contributors"] = list(self.group.contributors)
                k = peer_sync.healed_round(self, k, rec)  # left out of the quorum of step k: healed in a later one
            rec.update(peer_sync.swarm_step(self, k, flat))  # optim.grad_clip: the global norm over the stages
        else:
            rec.update(peer_sync.local_step(self, k, grad_sum, count))  # optim.grad_clip: this peer's own norm
            self.outer.after_inner_step(k)
            if (k + 1) % self.cfg.outer.sync_every == 0:
                rec["outer"] = True
                if self.group is not None:
                    rec["outer_contributors"] = list(self.outer.contributors)
        rec["sync_s"] = time.monotonic() - t0
        if self.digests:
            rec["digest"] = peer_sync.state_digest(self)
        with self.cv:
            self.step = k + 1
            self.syncing = False
            self.cv.notify_all()
        return rec

    # ------------------------------------------------------------------ output
    def save(self) -> None:
        path = os.path.join(self.out_dir, f"{self.name}.pt")
        with atomic_path(path) as tmp:
            torch.save(
                {
                    "params": {n: p.detach().clone() for n, p in self.model.named_parameters()},
                    "visits": self.visits,
                    "routes": self.routes,
                    "grads": self.grads_dump,
                    "bans": self.bans,
                    "dropped_upstream": self.dropped_up,
                    "replays": self.replays,
                    "records": self.records,
                },
                tmp,
            )

    def close(self) -> None:
        self.server.close()
        self.__dict__.pop("_norm_store", None)  # (global_norm's second store client: its connection goes with it)
        self.metrics.close()
        if self.outer is not None:
            self.outer.close(timeout=5.0)
        if self.group is not None:
            self.group.close()


def main(argv: list[str] | None = None) -> int:
    """Run one peer; one moved by rebalancing serves its new stage in this process, its old stage's peer freed first."""
    argv = sys.argv[1:] if argv is None else list(argv)
    while True:
        rc, move_to = _serve(argv)
        if move_to is None:
            return rc
        argv = membership.moved_argv(argv, move_to)


def _serve(argv: list[str]) -> tuple[int, dict | None]:
    """One peer's life (``main``): its exit code, and where rebalancing moved it (None: it did not move)."""
    ap = argparse.ArgumentParser(prog="python -m dilocox.swarm.peer", description="one SWARM peer (stage, index)")
    ap.add_argument("--config", required=True)
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--store", required=True, help="host:port of the launcher's TCPStore")
    ap.add_argument("--lighthouse", default=None, help="http://host:port of this stage's torchft lighthouse")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--dump-grads", default="", help="comma-separated steps whose gradient sums are saved")
    ap.add_argument("--delay-s", type=float, default=0.0, help="injected delay per microbatch (tests)")
    ap.add_argument("--join", action="store_true", help="a (re)started peer joining a running job")
    ap.add_argument("--delay-serial", action="store_true", help="the delay occupies the peer (slower compute)")
    ap.add_argument("--pace-s", type=float, default=0.0, help="each microbatch occupies the peer >= this many seconds")
    ap.add_argument("--die-mid-step", type=int, default=None, help="(tests) kill -9 itself mid-step >= this step")
    ap.add_argument("--resume", action="store_true", help="start from the newest complete SWARM checkpoint")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    fmt = f"%(asctime)s s{a.stage}p{a.index} %(levelname)s %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt, force=True)  # (force: a moved peer logs under its new name)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from dilocox.swarm.common import check_lighthouse, parse_store, validate_layout
    from dilocox.swarm.services import release, service_secret, store_client

    try:  # one line before the peer is built: bad input (exit 2, as `dilocox swarm peer`), no store (exit 3)
        cfg = load_config(a.config, a.overrides)
        validate_layout(cfg)  # (the stage count must divide model.n_layers)
        check_place(list(cfg.swarm.peers_per_stage), a.stage, a.index, a.join)
        host, port = parse_store(a.store)
        use_secret(*rpc_security(cfg))  # every RPC this peer serves or makes: authenticated, bounded
        store = store_client(host, port, service_secret(cfg), timedelta(seconds=cfg.swarm.startup_timeout_s))
        check_lighthouse(cfg, a.stage, a.lighthouse)  # (before it publishes its address; the process ends on it)
    except (ConfigError, SwarmError, SecretError, TimeoutError) as e:
        log.error("%s", e)
        return (3 if isinstance(e, TimeoutError) else 2), None
    dump = tuple(int(s) for s in a.dump_grads.split(",") if s.strip())
    faults = Faults(a.delay_s, a.delay_serial, a.pace_s, a.die_mid_step)
    peer = SwarmPeer(cfg, a.stage, a.index, store, a.lighthouse, a.out, a.steps, dump, a.join, a.resume, faults)
    try:
        peer.start()
        peer.run()
        peer.save()
    except (SwarmError, NoLivePeer, RemoteError, ElasticError) as e:
        log.error("%s; %s", e, peer_ckpt.describe_newest(cfg, a.out, len(cfg.swarm.peers_per_stage)))
        return 3, None
    finally:
        peer.close()
        release(store)  # (a peer moved by rebalancing opens a new client for its new stage)
    log.info("done: %d steps", peer.steps)
    return 0, peer.move_to  # (moved: main runs the new stage once this frame, and so this peer, is gone)


if __name__ == "__main__":
    sys.exit(main())
