"""The outer loop: dual optimizer per shard, overlap none|delayed|eager, streaming fragments.

``OuterLoop`` sees only this rank's named parameters and its ``outer`` process group (the
ranks owning the same shard in every replica), so it works unchanged for any P×T layout.
The training loop calls, per inner step (0-based ``step``, ``n = step + 1`` steps done):

    loss.backward(); outer.on_gradients(step)      # allreduce / cocktailsgd: per-step grads
    clip; inner_opt.step(); outer.after_inner_step(step)   # DiLoCo family: phase ends
    ...; outer.finish()                             # end of training

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
communicated update applied; local progress since a fragment's last sync point that was
never communicated is dropped (choose train.steps as a multiple of H to lose nothing).
With inner data parallelism (D > 1) and ``outer.shard_over_data`` (default), each DP rank owns
1/D of the tensors for all of the above and broadcasts them to the other DP ranks after every
outer step (``_shard_over_data``): same parameters, 1/D of the slow-link bytes.
With a single replica (outer group None) nothing is sent and the "all-reduce" is the
compressor's local round trip (the identity for quant none): one replica sees the same
compression error as many.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dilocox.config import CompressConfig, ConfigError, OuterConfig
from dilocox.distributed.comm import AsyncComm, CommHandle, DoneHandle
from dilocox.outer.fragments import SyncSchedule, assign_fragments
from dilocox.outer.state import OuterState

FAMILY = ("diloco",)
PER_STEP = ("allreduce", "cocktailsgd")


class OuterLoop:
    """Outer optimizer and communication of one rank's shard (see the module docstring).

    Args:
        named_params: this rank's ``(name, parameter)`` list (its stage and TP slice).
        topo: the Topology; only ``topo.group("outer")`` and ``topo.ranks["outer"]`` are used.
        ocfg, ccfg: ``outer`` and ``compress`` config sections.
        seed: shared by all replicas (compressor random projections/masks).
        layer_of: parameter name -> global layer id, None outside the layers (fragments).
        n_layers_total: number of layers of the whole model (checks layer ids).
        inner_optimizer: accepted for the training loop's convenience and left untouched:
            DiLoCo keeps the inner optimizer state across phases (ALGORITHMS §1).
        comm_delay_s, comm_bandwidth: link emulation on the comm thread (seconds per
            all-reduce; bytes/s token bucket), see distributed/comm.py.
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], topo, ocfg: OuterConfig, ccfg: CompressConfig,
                 seed: int, layer_of: Callable[[str], int | None] | None = None, n_layers_total: int = 0,
                 inner_optimizer=None, comm_delay_s: float = 0.0, comm_bandwidth: float | None = None) -> None:
        self.ocfg, self.ccfg, self.method, self.seed = ocfg, ccfg, ocfg.method, seed
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.inner_optimizer = inner_optimizer
        self.topo = topo
        self.group = topo.group("outer") if topo is not None else None
        self.replica_group = topo.group("replica") if topo is not None else None
        self.tp_group = topo.group("tp") if topo is not None else None
        self.R = len(topo.ranks["outer"]) if topo is not None else 1
        self.H = ocfg.sync_every
        self.outer_step = 0
        self._counters = {"blocked_s": 0.0, "blocked_total_s": 0.0, "comm_s": 0.0, "n_syncs": 0}
        self._comm_total_before = 0.0  # comm-thread seconds of earlier runs (restored on resume)
        self._blocked_now = 0.0
        self._step_times: list[float] = []
        self._t_end: float | None = None
        if self.method == "none":
            return
        if self.method not in FAMILY + PER_STEP:
            raise ConfigError(f"outer.method={self.method!r} is not one of ['none', 'allreduce', 'diloco', 'cocktailsgd']")
        if self.method in PER_STEP:
            self._init_per_step(seed)
        else:
            self._init_diloco(seed, layer_of, n_layers_total)
        from dilocox.compress.collectives import CommStats

        self.comm_stats = CommStats()
        self.comm = AsyncComm(delay_s=comm_delay_s, bandwidth=comm_bandwidth,
                              sent_bytes=lambda: self.comm_stats.bytes_sent, name=f"outer-comm-{topo.rank if topo else 0}")

    # ------------------------------------------------------------------ construction
    def _init_per_step(self, seed: int) -> None:
        from dilocox.compress.compressor import build_compressor

        self.compressors = [build_compressor(self.ccfg, [p.shape for p in self.params], seed)] if self.method == "allreduce" else []
        numel = sum(p.numel() for p in self.params)
        dev = self.params[0].device if self.params else torch.device("cpu")
        self.cocktail_error = torch.zeros(numel, dtype=torch.float32, device=dev) if self.method == "cocktailsgd" else None

    def _init_diloco(self, seed: int, layer_of, n_layers_total: int) -> None:
        o, s = self.ocfg, self.ocfg.streaming
        self.overlap, self.K, self.tau = o.overlap, s.fragments, s.tau
        if self.overlap in ("delayed", "eager") and s.tau > 0:
            raise ConfigError(
                f"outer.streaming.tau={s.tau} cannot be combined with outer.overlap={self.overlap!r}: the one-outer-step "
                f"overlap already hides the all-reduce behind a whole phase; set tau: 0 or overlap: none"
            )
        if self.ccfg.adaptive.enabled and s.fragments > 1:
            raise ConfigError(
                f"compress.adaptive.enabled=true is not supported with outer.streaming.fragments={s.fragments} "
                f"(one controller sets one H for the whole shard); use fragments: 1 or disable adaptive"
            )
        self.streaming = s.fragments > 1 or s.tau > 0
        self.alpha = s.alpha if (self.streaming and self.overlap == "none") else 0.0
        layer_of = layer_of or (lambda name: None)
        if n_layers_total:
            for name in self.names:
                lid = layer_of(name)
                if lid is not None and not 0 <= lid < n_layers_total:
                    raise ValueError(f"layer_of({name!r}) = {lid} is outside [0, n_layers_total={n_layers_total})")
        fragments = assign_fragments(self.names, layer_of, s.fragments, s.pattern)
        fragments = self._shard_over_data(fragments)
        self.state = OuterState([p.data for p in self.params], fragments, o.state_device)
        self.schedule = SyncSchedule(self.K, self.H, self.tau)
        from dilocox.compress.compressor import build_compressor

        self.compressors = [build_compressor(self.ccfg, self.state.shapes(p), seed + p, self._frag_ids[p] if self._frag_ids else None)
                            for p in range(self.K)]
        self.pending: list[CommHandle | None] = [None] * self.K
        self.own_prev: list[Tensor | None] = [None] * self.K  # eager: Δ_m^{t−1} per fragment
        self.controller = None
        if self.ccfg.adaptive.enabled:
            from dilocox.compress.adaptive import AdaptiveController

            a = self.ccfg.adaptive
            self.controller = AdaptiveController(a.energy_eps, a.window, a.rank_min, a.rank_max, a.h_min, a.h_max)

    def _shard_over_data(self, fragments: list[list[int]]) -> list[list[int]]:
        """Inner-DP sharding of the outer work (``outer.shard_over_data``, parallel.data = D > 1).

        The D ranks of one (replica, stage, tp) hold identical parameters (inner DP all-reduces
        the gradients), so syncing the whole shard from each of them sends D copies over the
        slow link. Instead every tensor gets one owner among them (per fragment, largest tensor
        first to the least loaded rank: the same assignment on every rank, from the shapes
        alone); a rank keeps outer state, compressor and outer all-reduce for its own tensors
        only, and after each outer step every tensor is broadcast from its owner over the DP
        group. Per tensor the math is unchanged (compression, groups, error feedback and the
        PowerSGD draws, keyed by the tensor's place in the unsharded fragment, are per tensor), so
        with the all-gather collective (R ≤ 4) the parameters are bit-identical to the unsharded
        run's; with ``reduce_scatter`` (R > 4) the stochastic requantization and the summation
        order follow the buffer's chunking, so they match in distribution, not bit for bit.
        Slow-link bytes drop D×. Per-step methods (allreduce, cocktailsgd) are not sharded.
        Returns the fragments as indices into the (now owned-only) ``self.params``.
        """
        self.dp_group, self._bcast, self._frag_ids = None, None, None
        topo = self.topo
        if topo is None or getattr(topo, "D", 1) == 1 or not self.ocfg.shard_over_data:
            return fragments
        from dilocox.distributed.topology import Coord, rank_of

        D, c = topo.D, topo.coord
        owner = [0] * len(self.params)
        for p, frag in enumerate(fragments):
            if len(frag) < D:  # known to every DP rank alike, so all of them raise
                raise ConfigError(
                    f"outer.shard_over_data=true: fragment {p} of this stage has {len(frag)} tensors, fewer than "
                    f"parallel.data={D} ranks to share them; set outer.shard_over_data=false or use fewer fragments"
                )
            load = [0] * D
            for i in sorted(frag, key=lambda i: (-self.params[i].numel(), i)):
                d = min(range(D), key=lambda d: (load[d], d))
                owner[i], load[d] = d, load[d] + self.params[i].numel()
        src = [rank_of(Coord(c.replica, d, c.stage, c.tp), topo.R, D, topo.P, topo.T) for d in range(D)]
        self.dp_group = topo.group("dp")
        # per fragment: one broadcast bucket per (owner, dtype), in the same order on every DP rank
        self._bcast = []
        for frag in fragments:
            buckets: dict[tuple[int, str], list[Tensor]] = {}
            for i in frag:
                buckets.setdefault((src[owner[i]], str(self.params[i].dtype)), []).append(self.params[i].data)
            self._bcast.append([(key[0], buckets[key]) for key in sorted(buckets)])
        mine = [i for i in range(len(self.params)) if owner[i] == c.data]
        pos = {i: k for k, i in enumerate(mine)}
        self.names = [self.names[i] for i in mine]
        self.params = [self.params[i] for i in mine]
        # a tensor's id for the compressor's shared random draws: its place in the unsharded fragment
        self._frag_ids = [[k for k, i in enumerate(frag) if owner[i] == c.data] for frag in fragments]
        return [[pos[i] for i in frag if owner[i] == c.data] for frag in fragments]

    def _dp_broadcast(self, frags) -> None:
        """Every tensor of the given fragments from its owner to the other inner-DP ranks."""
        if self.dp_group is None:
            return
        me = self.topo.rank
        for p in frags:
            for src, ts in self._bcast[p]:
                flat = torch.cat([t.reshape(-1) for t in ts])
                dist.broadcast(flat, src=src, group=self.dp_group)
                if src == me:
                    continue  # the owner's tensors already hold the values
                off = 0
                for t in ts:
                    t.copy_(flat[off: off + t.numel()].view_as(t))
                    off += t.numel()

    # ------------------------------------------------------------------ communication
    def _allreduce(self, comp, tensors: list[Tensor], step: int) -> list[Tensor]:
        """Runs on the comm thread: the compressor's blocking mean over the outer group.

        With one replica (group None) nothing is sent; the compressor still applies its
        round trip, so the result is Δ itself for quant none and C(Δ) otherwise."""
        return comp.allreduce_mean(tensors, self.group, step, self.comm_stats)

    def _submit(self, fn, *args) -> CommHandle:
        self._counters["n_syncs"] += 1
        h = self.comm.submit(fn, *args)
        if self.ocfg.blocking:
            self._wait(h)  # on the critical path; a later wait() returns at once
        return h

    def _wait(self, h: CommHandle):
        before = h.blocked_s
        out = h.wait()
        blocked = h.blocked_s - before
        self._blocked_now += blocked
        self._counters["blocked_total_s"] += blocked
        self._counters["comm_s"] = h.comm_s
        return out

    # ------------------------------------------------------------------ per-step methods
    @torch.no_grad()
    def on_gradients(self, step: int) -> None:
        """allreduce: mean of the grads over the outer group; cocktailsgd: §8. Else no-op."""
        if self.method not in PER_STEP or self.group is None:
            return
        self._blocked_now = 0.0
        grads = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if self.method == "allreduce":
            h = self._submit(self._allreduce, self.compressors[0], [g.float() for g in grads], step)
            avg = self._wait(h)
        else:
            from dilocox.compress.cocktail import cocktail_allreduce

            flat = torch.cat([g.reshape(-1).float() for g in grads])
            h = self._submit(cocktail_allreduce, flat, self.group, self.cocktail_error, self.ccfg, step, self.comm_stats, self.seed,
                             [g.numel() for g in grads])  # per-tensor top-k and groups
            out = self._wait(h)
            avg, pos = [], 0
            for g in grads:
                avg.append(out[pos:pos + g.numel()].view(g.shape))
                pos += g.numel()
        for g, a in zip(grads, avg):
            g.copy_(a)
        self._counters["blocked_s"] = self._blocked_now

    # ------------------------------------------------------------------ DiLoCo family
    @torch.no_grad()
    def after_inner_step(self, step: int) -> None:
        """Phase ends of the DiLoCo family: launch and/or finish outer steps (module docstring)."""
        if self.method not in FAMILY:
            return
        now = time.perf_counter()
        if self._t_end is not None:
            self._step_times.append(now - self._t_end)  # the inner step itself, outer work excluded
        n = step + 1
        self._blocked_now = 0.0
        syncing = self.schedule.syncs_at(n)
        if self.overlap == "none":
            for p in self.schedule.launches_at(n):
                self.pending[p] = self._submit(self._allreduce, self.compressors[p], self.state.pseudo_gradient(p), n)
        for p in syncing:
            self._sync(p, n)
        self._dp_broadcast(syncing)
        if syncing:
            self._counters["blocked_s"] = self._blocked_now
        self._t_end = time.perf_counter()

    def _sync(self, p: int, n: int) -> None:
        st, o = self.state, self.ocfg
        if self.overlap == "none":
            h, self.pending[p] = self.pending[p], None
            avg = st.flatten(self._wait(h))
            st.outer_step(p, avg, o.lr, o.momentum, o.nesterov)
            self._adapt(p, h)
            st.load_params(p, self.alpha)
        else:
            delta = st.pseudo_gradient(p)
            delta_flat = st.flatten(delta)  # a copy: the compressor may work in place on `delta`
            h, self.pending[p] = self.pending[p], None
            prev = st.flatten(self._wait(h)) if h is not None else torch.zeros_like(delta_flat)
            if h is not None:
                self._adapt(p, h)
            self.pending[p] = self._submit(self._allreduce, self.compressors[p], delta, n)
            if self.overlap == "eager":
                own = self.own_prev[p] if self.own_prev[p] is not None else torch.zeros_like(delta_flat)
                grad = prev + (delta_flat - own) / self.R
                self.own_prev[p] = delta_flat
            else:
                grad = prev
            st.outer_step(p, grad, o.lr, o.momentum, o.nesterov)
            st.load_params(p, 0.0)
        self.outer_step += 1
        self.schedule.advance(p, self.H)

    def _adapt(self, p: int, h: CommHandle) -> None:
        """§7: new rank for the next launch, new H for the next phase (thread is idle here)."""
        if self.controller is None:
            return
        comp = self.compressors[p]
        times = self._step_times[-self.H:] or [0.0]
        t_step = sum(times) / len(times)
        rank, H = self.controller.update(comp.sigmas(), h.comm_s, comp.payload_bytes(), comp.payload_bytes, t_step, tail=comp.tail_energy(), rank_cap=comp.max_rank())
        if self.tp_group is not None and comp.rank > 0:
            # the σ's of TP shards differ, but a replicated matrix (position embedding) must be
            # compressed at the same rank on every TP rank, or its copies drift apart: take the max
            t = torch.tensor([rank], dtype=torch.int64, device=self.params[0].device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.tp_group)
            rank = int(t.item())
        if comp.rank > 0 and rank != comp.rank:  # σ's are bit-identical across the outer group: so is rank
            comp.set_rank(rank)
        self.H = max(self._agree_max(int(H)), self.tau + 1)
        self._step_times = []

    def _agree_max(self, value: int) -> int:
        """The largest proposal over the outer group, then over this replica's ranks.

        H comes from measured times, which differ between ranks, but every rank must sync at
        the same steps: the max (the slowest link/step still hidden) is taken over the outer
        group on the comm thread (idle here) and over the replica group on this thread, so
        all ranks of all replicas and stages agree. Costs one tiny collective per outer step.
        """
        t = torch.tensor([value], dtype=torch.int64, device=self.params[0].device)
        if self.group is not None:
            self._wait(self.comm.submit(dist.all_reduce, t, op=dist.ReduceOp.MAX, group=self.group))
        if self.replica_group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.replica_group)
        return int(t.item())

    @torch.no_grad()
    def finish(self) -> None:
        """Drain every in-flight all-reduce, apply it, set params to θ, stop the comm thread."""
        if self.method == "none":
            return
        if self.method in FAMILY:
            st, o = self.state, self.ocfg
            self._blocked_now = 0.0
            for p in range(self.K):
                h, self.pending[p] = self.pending[p], None
                if h is None:
                    continue
                grad = st.flatten(self._wait(h))
                if self.overlap == "eager" and self.own_prev[p] is not None:
                    grad = grad - self.own_prev[p] / self.R
                    self.own_prev[p] = None
                st.outer_step(p, grad, o.lr, o.momentum, o.nesterov)
                self.outer_step += 1
            for p in range(self.K):
                st.load_params(p, 0.0)
            self._dp_broadcast(range(self.K))
        self.comm.shutdown()

    # ------------------------------------------------------------------ logs and checkpoints
    @property
    def stats(self) -> dict:
        if self.method == "none":
            return {}
        rank = self.compressors[0].rank if self.compressors else 0  # 0: no low-rank compression
        out = {"outer_step": self.outer_step, "H": self.H, "rank": int(rank),
               "bytes_sent": int(self.comm_stats.bytes_sent), "bytes_received": int(self.comm_stats.bytes_received)}
        out.update(self._counters)
        out["comm_total_s"] = self._comm_total_before + self.comm.busy_s
        return out

    def state_dict(self) -> dict:
        """The whole dual state; in-flight all-reduces are waited for and their RESULTS stored."""
        if self.method == "none":
            return {"method": "none"}
        sd: dict = {"version": 1, "method": self.method, "H": self.H, "outer_step": self.outer_step}
        if self.method in FAMILY:
            pend, pend_s = [], []
            for p, h in enumerate(self.pending):
                res = self._wait(h) if h is not None else None
                if h is not None:
                    self.pending[p] = DoneHandle(res, h.comm_s)
                pend.append([t.detach().cpu().clone() for t in res] if res is not None else None)
                pend_s.append(h.comm_s if h is not None else 0.0)
            sd.update(overlap=self.overlap, fragments=self.K, dp_sharded=self.dp_group is not None, state=self.state.state_dict(), pending=pend, pending_comm_s=pend_s,
                      own_prev=[t.detach().cpu().clone() if t is not None else None for t in self.own_prev],
                      schedule=self.schedule.state_dict(),
                      controller=self.controller.state_dict() if self.controller is not None else None)
        else:
            self.comm.drain()
            sd["cocktail_error"] = self.cocktail_error.detach().cpu().clone() if self.cocktail_error is not None else None
        sd["compressors"] = [c.state_dict() for c in self.compressors]
        sd["counters"] = dict(self._counters, comm_total_s=self.stats["comm_total_s"])  # after the waits above
        sd["comm_stats"] = {k: getattr(self.comm_stats, k) for k in ("bytes_sent", "bytes_received", "n_calls", "seconds")}
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("method") != self.method:
            raise ValueError(f"outer state in the checkpoint is for outer.method={sd.get('method')!r}, this run has {self.method!r}")
        if self.method == "none":
            return
        if self.method in FAMILY:  # settings that change the state's shapes: checked before loading any of it
            if sd["overlap"] != self.overlap or sd["fragments"] != self.K:
                raise ValueError(
                    f"checkpoint was written with outer.overlap={sd['overlap']!r}, outer.streaming.fragments={sd['fragments']}; "
                    f"this run has {self.overlap!r}, {self.K}: resume with the same outer settings"
                )
            if sd.get("dp_sharded", False) != (self.dp_group is not None):
                raise ValueError(
                    f"checkpoint was written with the outer sync {'' if sd.get('dp_sharded') else 'not '}sharded over the inner-DP "
                    f"ranks, this run {'is' if self.dp_group is not None else 'is not'}: resume with the same outer.shard_over_data"
                )
        self.H, self.outer_step = int(sd["H"]), int(sd["outer_step"])
        counters = dict(sd["counters"])
        self._comm_total_before = float(counters.pop("comm_total_s", 0.0)) - self.comm.busy_s
        self._counters.update(counters)
        for k, v in sd["comm_stats"].items():
            setattr(self.comm_stats, k, v)
        if len(sd["compressors"]) != len(self.compressors):
            raise ValueError(f"checkpoint has {len(sd['compressors'])} compressors, this run {len(self.compressors)}")
        for c, csd in zip(self.compressors, sd["compressors"]):
            c.load_state_dict(csd)
        if self.method in FAMILY:
            self.state.load_state_dict(sd["state"])
            self.schedule.load_state_dict(sd["schedule"])
            dev = self.params[0].device if self.params else torch.device("cpu")
            self.pending = [DoneHandle([t.to(dev) for t in r], s) if r is not None else None
                            for r, s in zip(sd["pending"], sd["pending_comm_s"])]
            self.own_prev = [t.to(self.state.device) if t is not None else None for t in sd["own_prev"]]
            if self.controller is not None and sd.get("controller") is not None:
                self.controller.load_state_dict(sd["controller"])
        elif self.cocktail_error is not None:
            self.cocktail_error.copy_(sd["cocktail_error"])
