"""The DiLoCo family's outer loop: dual optimizer per shard, overlap none|delayed|eager, streaming fragments.

``DiLoCoOuter`` sees only this rank's named parameters and its ``outer`` process group (the
ranks owning the same shard in every replica), so it works unchanged for any P×T layout.
The training loop calls ``after_inner_step(step)`` after every inner optimizer step (0-based
``step``, ``n = step + 1`` steps done) and ``finish()`` at the end (base.py).
DiLoCo keeps the inner optimizer state across phases (ALGORITHMS §1): it is not touched here.

Rules (ALGORITHMS.md; θ = outer params, θ_m = this replica's params, per fragment p; without
streaming there is one fragment holding every parameter and sync points n = H, 2H, ...):

- ``overlap: none`` (§1, §4). At n = s_p − τ: Δ_p = θ_p − θ_{m,p}; launch the all-reduce.
  At n = s_p: wait for Δ̄_p; θ_p ← OuterOpt(θ_p, Δ̄_p); θ_{m,p} ← θ_p, or, when streaming
  (fragments > 1 or τ > 0), θ_{m,p} ← α θ_{m,p} + (1 − α) θ_p.
- ``overlap: delayed`` (§2, needs τ = 0). At the end of phase t (n = s_p):
  Δ_p^t = θ_p^{t−1} − θ_{m,p}; launch its all-reduce (→ Δ̄^t, consumed one phase later);
  wait for Δ̄^{t−1} (zero at t = 1); θ_p^t ← OuterOpt(θ_p^{t−1}, Δ̄^{t−1});
  **θ_{m,p} ← θ_p^t**: the next phase starts from the outer params updated with the
  *previous* average, and this phase's local progress reaches θ only through Δ̄^t at the end
  of the next phase. θ^t is identical on all replicas (Δ̄ is bit-identical).
  ``outer.lookahead: γ`` > 0 (delay compensation by weight prediction, as SpecTrain predicts pipelined weights
  from the momentum, Chen et al. 2018): the in-flight average will move θ by about η·v (the Nesterov step with
  Δ̄^t ≈ (1 − μ) v, the momentum's steady state), so the next phase starts from **θ_{m,p} ← θ_p^t − γ η v_p^t**
  and its pseudo-gradient is taken from that start, Δ_p^{t+1} = θ_p^t − γ η v_p^t − θ_{m,p} (v is unchanged
  until that sync, so nothing is stored). θ and the averages stay as without it; only where the replicas
  compute their next phase moves. θ_{m,p} ← θ_p^t at ``finish``.
- ``overlap: eager`` (§3, needs τ = 0). As delayed, but with the replica's own fresh
  pseudo-gradient in place of its stale one: Δ̃_m^t = Δ̄^{t−1} + (Δ_m^t − Δ_m^{t−1})/R
  (Δ_m^0 = Δ̄^0 = 0; Δ_m^{t−1} is the uncompressed local pseudo-gradient, as in the paper's
  Algorithm 3); θ_m^t ← OuterOpt_m(θ_m^{t−1}, Δ̃_m^t); θ_{m,p} ← θ_m^t. θ and v are per
  replica and may drift apart.
- ``blocking: true`` waits for every all-reduce right after launching it (same math, no
  overlap; measures the cost of communication on the critical path).
- Adaptive compression (§7, fragments = 1 only): after each outer step the controller gets
  the compressor's σ's and the measured comm and step times; the new rank is applied to the
  compressor (before the next launch) and the new H sets the next sync point.

``finish()``: waits for every in-flight all-reduce and applies it with the mode's rule
(delayed: θ ← OuterOpt(θ, Δ̄^T); eager: the step Δ̃ = Δ̄^T − Δ_m^T/R, i.e. §3 with no new
local progress; none/streaming: the pending fragment's outer step), then sets every
parameter to the outer params θ. So the final model is the global model with every
communicated update applied; local progress that no all-reduce carried is dropped: each fragment's
inner steps after its last launch (``fragments.uncommunicated_tail``; the trainer warns at start-up).
With one fragment and tau = 0 that is nothing when train.steps is a multiple of H; with tau > 0 it
is at least the last tau steps, and with K > 1 fragments all but one fragment always lose the steps
since their last launch. A finished run resumed with more train.steps: the averages ``finish()``
applied are not applied again (their sync points pass with no outer step), and a phase that started from θ (nothing
in flight: the first one, or the first after ``finish()``) takes its pseudo-gradient from θ (no look-ahead shift).
With inner data parallelism (D > 1) and ``outer.shard_over_data`` (default), each DP rank owns
1/D of the tensors for all of the above and broadcasts them to the other DP ranks after every
outer step (``dp_shard.py``; after a heal, which reloads every fragment from θ, every fragment's): same parameters,
1/D of the slow-link bytes.
The replicas are an ``OuterGroup`` (group.py), the only way out of the replica: the fixed ``outer`` process
group (``FixedGroup``; with a single replica nothing is sent and the "all-reduce" is the compressor's local round
trip, the identity for quant none: one replica sees the same compression error as many), or a torchft quorum of
the replicas alive at each outer step (``elastic/quorum.QuorumGroup``: ``outer.elastic`` and a SWARM stage's
peers). One order for every group: the outer step, then the launch of the next all-reduce, so a snapshot taken
right before the launch holds θ^t.

Live join (a group that ``heals``, docs/ELASTIC.md): a replica that is behind (new, restarted, or one whose
commit failed) is healed inside the quorum: rank i of it receives the snapshot of rank i of a live replica taken
on the main thread right before that replica's launch: θ, the outer momentum, the outer step, the schedule and the
inner step ``n`` of the sync point (tensors by reference: the main thread does not touch θ or v until it has
waited for that all-reduce, and the peer has fetched them before it). The healed replica contributes nothing to
that step, takes the average like everyone, resets its error feedback and starts its next phase from θ at step
``n`` (``membership.pop_jump``); from then on it is bit-identical to the others (overlap none/delayed). Who joins
and how a heal travels is ``outer/membership.py``'s (this loop registers its snapshot and restore with it); the
owner may add its own state (``membership.add_extra``; the SWARM peer hands over its AdamW state so).
Eager's 1/R is the number of replicas that contributed to the last average.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dilocox.compress.adaptive import AdaptiveController
from dilocox.compress.codec import rank_of
from dilocox.compress.compressor import build_compressor
from dilocox.config import CompressConfig, ConfigError, OuterConfig, check_outer_schedule
from dilocox.distributed.comm import CommHandle, DoneHandle
from dilocox.optim import build_outer_optimizer
from dilocox.outer.base import OuterBase
from dilocox.outer.dp_shard import DataShard, shard_over_data
from dilocox.outer.fragments import SyncSchedule, assign_fragments
from dilocox.outer.group import OuterGroup
from dilocox.outer.membership import Membership
from dilocox.outer.state import OuterState

METHODS = ("diloco",)
MAX_H = 10_000_000  # (a healing replica's H: a live replica's beyond this is refused, as a nonpositive one)
DIGEST_ENV = "DILOCOX_THETA_DIGEST"  # set: every step record carries a digest of θ after the last outer step


class DiLoCoOuter(OuterBase):
    """Outer optimizer and communication of one rank's shard (see the module docstring).

    Args (besides OuterBase's):
        layer_of: parameter name -> global layer id, None outside the layers (fragments).
        n_layers_total: number of layers of the whole model (checks layer ids).
        group: the replicas (``OuterGroup``; default the fixed ``outer`` process group of ``topo``).
    """

    params_to_theta_at_finish = True  # (finish(): every parameter set to θ)

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        topo,
        ocfg: OuterConfig,
        ccfg: CompressConfig,
        seed: int,
        layer_of: Callable[[str], int | None] | None = None,
        n_layers_total: int = 0,
        comm_delay_s: float = 0.0,
        comm_bandwidth: float | None = None,
        group: OuterGroup | None = None,
    ) -> None:
        if ocfg.method not in METHODS:
            raise ValueError(f"DiLoCoOuter handles outer.method in {list(METHODS)}, not {ocfg.method!r}")
        super().__init__(named_params, topo, ocfg, ccfg, seed, comm_delay_s, comm_bandwidth, group)
        s = ocfg.streaming
        self.overlap, self.K, self.tau = ocfg.overlap, s.fragments, s.tau
        streaming = s.fragments > 1 or s.tau > 0
        self.alpha = s.alpha if (streaming and self.overlap == "none") else 0.0  # θ_m ← α θ_m + (1 − α) θ
        # merge=replay (tau > 0): the mix from the params at launch (θ − own Δ, kept in own_prev), the tau steps since
        self.replay = s.merge == "replay" and self.overlap == "none" and self.tau > 0
        if s.merge == "replay" and self.overlap != "none":  # (delayed/eager start every phase from θ: nothing to merge)
            raise ConfigError(
                f"outer.streaming.merge='replay' has no effect with outer.overlap={self.overlap!r} (it is the mix of "
                "a streaming sync, overlap none); set merge: mix or overlap: none"
            )
        if self.group.heals and self.K > 1 and self.overlap != "none":
            raise ValueError(
                f"outer.streaming.fragments={self.K} with outer.overlap={self.overlap!r} is not elastic: a joiner "
                "cannot get the other fragments' averages in flight; use overlap none (with tau) or one fragment"
            )
        if ocfg.lookahead and (self.overlap != "delayed" or self.group.heals):
            raise ValueError(f"outer.lookahead={ocfg.lookahead} needs overlap=delayed without elastic mode")
        self.shift = float(ocfg.lookahead) * ocfg.lr if self.overlap == "delayed" else 0.0  # look-ahead: shift·v
        self.replica_group = topo.group("replica") if topo is not None else None
        self.tp_group = topo.group("tp") if topo is not None else None
        layer_of = layer_of or (lambda name: None)
        if n_layers_total:
            for name in self.names:
                lid = layer_of(name)
                if lid is not None and not 0 <= lid < n_layers_total:
                    raise ValueError(f"layer_of({name!r}) = {lid} is outside [0, n_layers_total={n_layers_total})")
        fragments = assign_fragments(self.names, layer_of, s.fragments, s.pattern)
        check_outer_schedule(self.H, self.K, self.tau, self.overlap, ccfg.adaptive.enabled)
        self.dp_shard: DataShard | None = None
        frag_ids = None
        if topo is not None and getattr(topo, "D", 1) > 1 and ocfg.shard_over_data:
            self.dp_shard = shard_over_data(topo, self.params, fragments)
            self.names = [self.names[i] for i in self.dp_shard.mine]
            self.params = [self.params[i] for i in self.dp_shard.mine]
            fragments, frag_ids = self.dp_shard.fragments, self.dp_shard.frag_ids
        self.state = OuterState([p.data for p in self.params], fragments, ocfg.state_device, self._outer_optimizer)
        self.schedule = SyncSchedule(self.K, self.H, self.tau)
        self.compressors = [
            build_compressor(ccfg, self.state.shapes(p), seed + p, frag_ids[p] if frag_ids else None)
            for p in range(self.K)
        ]
        self.pending: list[CommHandle | None] = [None] * self.K
        self.own_prev: list[Tensor | None] = [None] * self.K  # eager: Δ_m^{t−1} per fragment
        self.controller = AdaptiveController.from_config(ccfg.adaptive) if ccfg.adaptive.enabled else None
        self._step_times: list[float] = []
        self._t_end: float | None = None
        self.lr_factor: Callable[[int], float] | None = None  # outer.lr_schedule=inner (set by the trainer)
        # the other replicas: contributors, the live join and the H agreement (outer/membership.py). A received state
        # holds θ, the outer momentum and the owner's extra (a SWARM peer's AdamW: 2 x params): 4 x (θ + momentum)
        # + 64 MiB bounds it, checked before anything is allocated (net/transfer.py)
        self.membership = Membership(self.group, self.replica_group)
        st_bytes = sum(t.numel() * t.element_size() for t in (self.state.theta, self.state.momentum))
        self.membership.register(self._snapshot, self._restore, self._on_receive, 4 * st_bytes + (64 << 20))
        self._c_prev = max(1, len(self.membership.contributors))  # eager's 1/R
        self._digest: tuple[int, str] = (-1, "")  # (outer step, digest of θ then): DIGEST_ENV
        self._healed_now = False  # this after_inner_step's syncs healed the replica (_after_wait)

    def _outer_optimizer(self, order: list[int], thetas: list[Tensor], vs: list[Tensor]) -> torch.optim.Optimizer:
        """``outer.optimizer`` over each parameter's θ (by global name: Muon's split needs them)."""
        return build_outer_optimizer(self.ocfg, [(self.names[i], t) for i, t in zip(order, thetas)], vs)

    def _launch(self, p: int, delta: list[Tensor], n: int) -> None:
        """Offer what a joiner would get (a group that heals), then launch fragment ``p``'s all-reduce with the H
        proposal of the last outer step (``Membership.agree_max``)."""
        self.membership.offer(n, p)
        self.pending[p] = self._submit(
            self.group.allreduce_mean, delta, n, self.compressors[p], self.membership.carry()
        )

    def _dp_broadcast(self, frags) -> None:
        if self.dp_shard is not None:
            self.dp_shard.broadcast(frags)

    # ------------------------------------------------------------------ the phase ends
    @torch.no_grad()
    def after_inner_step(self, step: int) -> None:
        """Phase ends: launch and/or finish outer steps (module docstring)."""
        now = time.perf_counter()
        if self._t_end is not None and self.controller is not None:  # (only §7 reads them; _adapt empties the list)
            self._step_times.append(now - self._t_end)  # the inner step itself, outer work excluded
        n = step + 1
        self._blocked_now = self._save_wait_s = 0.0
        if self.lr_factor is not None:  # outer.lr_schedule=inner: the outer steps of this step at the inner lr's ratio
            self.state.set_lr_factor(self.lr_factor(step))
        launching, syncing = self.schedule.at(n)
        self.crossed_replicas = bool(syncing or launching)
        self._healed_now = False  # (set by _after_wait: a heal reloads every fragment from θ)
        if self.overlap == "none":
            for p in launching:
                delta = self.state.pseudo_gradient(p)
                if self.replay:  # Δ = θ − θ_m: the params at launch are θ − Δ (θ_p stays until p's sync)
                    self.own_prev[p] = self.state.flatten(delta)
                self._launch(p, delta, n)
        for p in syncing:
            self._sync(p, n)
        # a heal (replica-wide: one torchft quorum and commit vote per replica, so every DP rank takes this path) set
        # every fragment's owned tensors to θ: all of them go out from their owners, as in join()
        self._dp_broadcast(range(self.K) if self._healed_now else syncing)
        if syncing or launching:  # (a launch blocks too: blocking, or tau > 0 where it is its own step)
            self._counters["blocked_s"] = self._blocked_now
        self._t_end = time.perf_counter()

    def _sync(self, p: int, n: int) -> None:
        st = self.state
        if self.overlap == "none":
            h, self.pending[p] = self.pending[p], None
            if h is None:  # a finished run resumed with more train.steps: finish() applied this sync already
                self.schedule.advance(p, self.H)
                return
            avg = st.flatten(self._wait(h))
            if self._after_wait():  # healed in the round launched tau steps ago: from θ now, at this step
                for q in range(self.K):
                    st.load_params(q, 0.0)
                self.membership.continue_at(n)
            own, self.own_prev[p] = self.own_prev[p] if self.replay else None, None  # (None after a heal: θ)
            if own is not None:  # own = Δ → Δ − θ_old = −θ⁰ (the params at launch), in place
                own.sub_(st.frag(st.theta, p))
            st.outer_step(p, avg)
            self._adapt(p, h)
            if own is not None:
                st.merge_from(p, self.alpha, own.add_(st.frag(st.theta, p)))  # θ_new − θ⁰
            else:
                st.load_params(p, self.alpha)
            self.outer_step += 1
            self.schedule.advance(p, self.H)
            return
        # the phase started from θ − shift·v only after an outer step that launched an average: with nothing in flight
        # (the first phase, v = 0, or the first phase after finish() set the params to θ) it started from θ
        delta = st.pseudo_gradient(p, self.shift if self.pending[p] is not None else 0.0)
        delta_flat = st.flatten(delta)  # a copy: the compressor may work in place on `delta`
        h, self.pending[p] = self.pending[p], None
        prev = st.flatten(self._wait(h)) if h is not None else torch.zeros_like(delta_flat)
        if self._after_wait():  # healed: this phase started from a stale θ; restart it from the live θ
            self._resume_healed(p, prev)
            return
        if h is not None:
            self._adapt(p, h)
        if self.overlap == "eager":
            own = self.own_prev[p] if self.own_prev[p] is not None else torch.zeros_like(delta_flat)
            grad = prev + (delta_flat - own) / self._c_prev
            self.own_prev[p] = delta_flat
            st.outer_step(p, grad)
        elif h is not None:  # delayed: θ^t ← OuterOpt(θ^{t−1}, Δ̄^{t−1})
            st.outer_step(p, prev)
        # (delayed with nothing in flight: the first phase, Δ̄^0 = 0, or a finished run resumed with more train.steps,
        # whose finish() applied the last average already: no outer step; a zero gradient would still move θ by the
        # momentum, −η μ² v)
        st.load_params(p, 0.0, self.shift)
        self.outer_step += 1
        self.schedule.advance(p, self.H)
        self._launch(p, delta, n)  # after the outer step: a joiner healed by this all-reduce gets θ^t

    def _adapt(self, p: int, h: CommHandle) -> None:
        """§7: new rank for the next launch, new H for the next phase (thread is idle here)."""
        if self.controller is None:
            return
        comp = self.compressors[p]
        times = self._step_times[-self.H :] or [0.0]
        t_step = sum(times) / len(times)
        rank, H = self.controller.update(
            comp.sigmas(),
            h.comm_s,
            comp.payload_bytes(),
            comp.payload_bytes,
            t_step,
            tail=comp.tail_energy(),
            rank_cap=comp.max_rank(),
        )
        if self.tp_group is not None and comp.rank > 0:
            # the σ's of TP shards differ, but a replicated matrix (position embedding) must be
            # compressed at the same rank on every TP rank, or its copies drift apart: take the max
            t = torch.tensor([rank], dtype=torch.int64, device=self.params[0].device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.tp_group)
            if int(t.item()) != rank:  # H was predicted from this rank's own choice: predict it at the agreed one
                rank = int(t.item())
                H = self.controller.agree_rank(rank, comp.payload_bytes)
        if comp.rank > 0 and rank != comp.rank:  # σ's are bit-identical across the outer group: so is rank
            comp.set_rank(rank)
        self.H = max(self.membership.agree_max(int(H), self.H, self.params[0].device), self.tau + 1)
        self._step_times = []

    @torch.no_grad()
    def finish(self) -> None:
        """Drain every in-flight all-reduce, apply it, set params to θ, stop the comm thread."""
        st = self.state
        self._blocked_now = self._save_wait_s  # (a state_dict since the last step, the continuation's: the drain)
        for p in range(self.K):
            h, self.pending[p] = self.pending[p], None
            if h is None:
                continue
            grad = st.flatten(self._wait(h))
            self._after_wait()
            if self.overlap == "eager" and self.own_prev[p] is not None:
                grad = grad - self.own_prev[p] / self._c_prev
                self.own_prev[p] = None
            st.outer_step(p, grad)
            self.outer_step += 1
        self.own_prev = [None] * self.K  # (merge=replay: the params are θ from here)
        self._counters["drain_s"] = self._blocked_now  # the wait for the last in-flight all-reduces (run's end)
        for p in range(self.K):
            st.load_params(p, 0.0)
        self._dp_broadcast(range(self.K))
        self.comm.shutdown()

    @property
    def stats(self) -> dict:
        out = super().stats
        out["replicas"] = len(self.membership.contributors)  # averaged in the last outer step (an outage shows)
        if os.environ.get(DIGEST_ENV):  # (bench churn: the replicas' θ compared at every outer step)
            if self._digest[0] != self.outer_step:
                raw = self.state.theta.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
                self._digest = (self.outer_step, hashlib.sha256(raw).hexdigest()[:16])
            out["theta_digest"] = self._digest[1]
        return out

    # ------------------------------------------------------------------ the live join (module docstring)
    @property
    def contributors(self) -> list[int]:
        return self.membership.contributors

    def _snapshot(self, n: int, p: int) -> dict:
        """What a joiner healed by fragment ``p``'s launch at step ``n`` gets (``Membership.offer``)."""
        return {
            "outer_step": self.outer_step,
            "H": self.H,
            "schedule": self.schedule.state_dict(),
            "theta": self.state.theta,
            "momentum": self.state.momentum,
            "optimizer": self.state.optimizer_extra(copy=False),  # the outer optimizer's state beyond v (Muon's)
            "overlap": self.overlap,
            "ranks": [rank_of(c) for c in self.compressors],  # the rank this launch is compressed at (adaptive)
            "controller": self.controller.state_dict() if self.controller is not None else None,
        }

    def _on_receive(self, sd: dict) -> None:
        """Comm thread, inside the all-reduce, before the codec runs: compress this step at the live replicas' rank."""
        for c, r in zip(self.compressors, sd.get("ranks") or []):
            if rank_of(c) > 0 and int(r) != c.rank:
                top = max(c.max_rank(), self.controller.rank_max if self.controller is not None else c.rank)
                if not 1 <= int(r) <= top:  # (a live replica's state: checked, as everything received)
                    raise RuntimeError(f"a live replica sent a low-rank rank of {r}, outside [1, {top}]")
                c.set_rank(int(r))

    def _restore(self, sd: dict) -> None:
        """Main thread: take a live replica's state (``Membership.settle``)."""
        st = self.state
        if sd["overlap"] != self.overlap:
            raise RuntimeError(
                f"the live replicas run outer.overlap={sd['overlap']!r}, this replica {self.overlap!r}: use one setting"
            )
        for name in ("theta", "momentum"):  # (copy_ would broadcast a smaller tensor over the whole state)
            got, mine = sd[name], getattr(st, name)
            if not isinstance(got, Tensor) or got.shape != mine.shape or got.dtype != mine.dtype:
                what = f"{tuple(got.shape)} {got.dtype}" if isinstance(got, Tensor) else type(got).__name__
                raise RuntimeError(f"a live replica sent {name} as {what}, this replica holds {tuple(mine.shape)} "
                                   f"{mine.dtype}: every replica must train the same model")  # fmt: skip
        outer_step, H = int(sd["outer_step"]), int(sd["H"])
        if outer_step < 0 or not 1 <= H <= MAX_H:
            raise RuntimeError(f"a live replica sent outer_step={outer_step}, H={H} (want >= 0 and 1..{MAX_H})")
        st.theta.copy_(sd["theta"].to(st.theta.device))
        st.momentum.copy_(sd["momentum"].to(st.momentum.device))
        st.load_optimizer_extra(sd.get("optimizer"))
        self.outer_step, self.H = outer_step, H
        self.schedule.load_state_dict(sd["schedule"])
        for c in self.compressors:
            c.errors = None  # error feedback reset: its residuals belong to a trajectory this replica left
        self.own_prev = [None] * self.K
        if self.controller is not None and sd.get("controller") is not None:
            self.controller.load_state_dict(sd["controller"])  # the same rank window: the same next rank

    def _after_wait(self) -> bool:
        """Main thread, after waiting for an all-reduce: who contributed (eager's 1/R), a heal applied. True if this
        replica was healed."""
        healed = self.membership.settle()
        self._c_prev = max(1, len(self.membership.contributors))
        self._healed_now = self._healed_now or healed
        return healed

    def _resume_healed(self, p: int, avg: Tensor) -> None:
        """delayed/eager after a heal: θ^t is the source's (it already stepped); the average ``avg`` of that step is
        consumed at the end of the next phase, which starts now from θ (the caller continues at
        ``membership.pop_jump()``)."""
        shapes = self.state.shapes(p)
        parts = avg.split([s.numel() for s in shapes])
        self.pending[p] = DoneHandle([t.view(s).clone() for t, s in zip(parts, shapes)], 0.0)
        self.state.load_params(p, 0.0)

    @torch.no_grad()
    def join(self) -> int | None:
        """Take part in the live replicas' current outer round without contributing (start-up of every elastic
        replica). Returns the inner step ``n`` to continue from when a live replica's state was received
        (θ, momentum, outer step, schedule; params set to θ), None when nobody was ahead (a fresh start, a
        whole-job restart from checkpoints: every replica keeps its own state, or a fixed group).

        Streaming (fragments > 1 or tau > 0; overlap none): the round is fragment p's, launched tau steps before its
        sync (the joiner learns p from its heal: the call's ``layout``). Every fragment's params start from θ (the
        live replicas' own mixes θ_m are theirs; a joiner has none), fragment p's average is kept until its sync
        tau steps later, or applied now when tau = 0, as on the live replicas."""
        if not self.group.heals:
            return None
        # nothing of this replica enters the round it joins: its codecs' state (error buffers, the reduce-scatter
        # owner's residual, PowerSGD's Q) is reset for it. With nobody ahead (a whole-job restart from checkpoints)
        # the replica keeps its own state: the checkpoint's, put back after the round (it was lost: not exact)
        kept = [c.state_dict() for c in self.compressors]
        kept_contributors = list(self.membership.contributors), list(self.group.contributors)
        for c in self.compressors:
            c.errors = None
        m = self.membership
        m.reset_join()

        # the live replicas send pseudo-gradients on the params' device (OuterState.pseudo_gradient): the joiner's zeros
        # go there too, so its codec runs on the device theirs does (not on the host of outer.state_device=host)
        dev = self.params[0].device if self.params else self.state.device

        def layout():  # comm thread, after the heal (if any): the round's fragment, its zeros and its compressor
            p = m.received_frag()
            shapes = self.state.shapes(p)
            return [torch.zeros(s, dtype=torch.float32, device=dev) for s in shapes], self.compressors[p]

        h = self._start(self.group.join, 0, layout)
        res = self._wait(h)
        if not self._after_wait():
            for c, sd in zip(self.compressors, kept):
                c.load_state_dict(sd)
            # (eager's 1/R: the last outer step's contributors, not the join round's none; the group's for a round the
            # checkpoint stored as a result, which settles with them)
            m.contributors, self.group.contributors = kept_contributors
            self._c_prev = max(1, len(m.contributors))
            return None
        n, p = m.healed_at, m.heal_frag
        st = self.state
        for q in range(self.K):
            st.load_params(q, 0.0)
        if self.overlap == "none" and self.tau == 0:  # the source launched at its sync point: finish it as it will
            if self.lr_factor is not None:  # at that step's outer lr (outer.lr_schedule=inner), as the source does
                st.set_lr_factor(self.lr_factor(n - 1))
            st.outer_step(p, st.flatten(res))
            self._adapt(p, h)  # (the same σ's, rank window and agreed H as the source: the same rank and H)
            self.outer_step += 1
            self.schedule.advance(p, self.H)
            st.load_params(p, self.alpha)
        elif self.overlap == "none":  # applied at fragment p's sync, tau steps from now
            self.pending[p] = DoneHandle([t.clone() for t in res], h.comm_s)
        else:
            self._resume_healed(p, st.flatten(res))
        self._dp_broadcast(range(self.K))  # (outer.shard_over_data: the other DP ranks' tensors, from their owners)
        return n

    # ------------------------------------------------------------------ checkpoints
    def _method_state_dict(self) -> dict:
        """The whole dual state; in-flight all-reduces are waited for and their RESULTS stored."""
        pend, pend_s, blocked = [], [], self._blocked_now
        for p, h in enumerate(self.pending):
            res = self._wait(h) if h is not None else None
            if h is not None:
                self.pending[p] = DoneHandle(res, h.comm_s)
            pend.append([t.detach().cpu().clone() for t in res] if res is not None else None)
            pend_s.append(h.comm_s if h is not None else 0.0)
        self._save_wait_s += self._blocked_now - blocked  # (finish after it: its drain, counted in drain_s)
        return dict(
            overlap=self.overlap,
            fragments=self.K,
            dp_sharded=self.dp_shard is not None,
            state=self.state.state_dict(),
            pending=pend,
            pending_comm_s=pend_s,
            own_prev=[t.detach().cpu().clone() if t is not None else None for t in self.own_prev],
            schedule=self.schedule.state_dict(),
            controller=self.controller.state_dict() if self.controller is not None else None,
            **self.membership.state_dict(),  # the H agreement: the max not yet applied, the proposal not yet sent
        )

    def _check_compatible(self, sd: dict) -> None:
        if sd["overlap"] != self.overlap or sd["fragments"] != self.K:
            raise ValueError(
                f"checkpoint was written with outer.overlap={sd['overlap']!r}, "
                f"outer.streaming.fragments={sd['fragments']}; "
                f"this run has {self.overlap!r}, {self.K}: resume with the same outer settings"
            )
        sharded = self.dp_shard is not None
        if sd.get("dp_sharded", False) != sharded:
            raise ValueError(
                f"checkpoint was written with the outer sync {'' if sd.get('dp_sharded') else 'not '}sharded over the "
                f"inner-DP "
                f"ranks, this run {'is' if sharded else 'is not'}: resume with the same outer.shard_over_data"
            )

    def _load_method_state(self, sd: dict) -> None:
        self.state.load_state_dict(sd["state"])
        self.schedule.load_state_dict(sd["schedule"])
        dev = self.params[0].device if self.params else torch.device("cpu")
        self.pending = [
            DoneHandle([t.to(dev) for t in r], s) if r is not None else None
            for r, s in zip(sd["pending"], sd["pending_comm_s"])
        ]
        self.own_prev = [t.to(self.state.device) if t is not None else None for t in sd["own_prev"]]
        if self.controller is not None and sd.get("controller") is not None:
            self.controller.load_state_dict(sd["controller"])
        self.membership.load_state_dict(sd)
        self._c_prev = max(1, len(self.membership.contributors))
