"""The DiLoCo family over an elastic outer group (``outer.elastic``, docs/ELASTIC.md; issue 10).

``DiLoCoOuter`` mixes this in. With an ``ElasticOuterGroup`` (torchft quorum per outer step) instead
of a fixed ``outer`` process group:

- every outer all-reduce (on the comm thread) first forms a quorum of the replicas alive now; the
  mean is over the replicas that contributed (sum / count, the count carried by the same buffer);
  a replica that died while it was in flight makes the step fail and it is retried on a new
  quorum from the untouched inputs, never applied half (``ElasticOuterGroup.run_step``). Under
  ``outer.overlap: delayed|eager`` the in-flight all-reduce simply finishes among the survivors:
  the one-step-delay overlap keeps working across a membership change.
- uncompressed (``compress.quant: none``, no low-rank): ONE flat all-reduce of
  ``[Δ | one-hot(replica)]`` per sync. Compressed: a ``max_replicas``-float count, then the
  compressor's own collectives over the quorum's process group (``TorchftGroup``); its mean over
  the group is rescaled to the mean over the contributors.
- live join: a replica that is behind (new, restarted, or one whose commit failed) is healed by
  torchft inside the quorum: rank i of it receives ``_elastic_state()`` of rank i of a live
  replica, i.e. the snapshot taken on the main thread right before that replica's launch:
  θ, the outer momentum, the outer step, the schedule and the inner step ``n`` of the sync point
  (tensors by reference: the main thread does not touch θ or v until it has waited for that
  all-reduce, and the peer has fetched them before it). The healed replica contributes nothing
  to that step (§6a of the issue), takes the average like everyone, resets its error feedback
  and starts its next phase from θ. From then on it is bit-identical to the others (overlap
  none/delayed). The owner may add its own state to the snapshot (``snapshot_extra`` /
  ``load_extra``; the SWARM peer hands over its AdamW state so).
"""

from __future__ import annotations

import os
from typing import Callable

import torch
from torch import Tensor

from dilocox.compress.collectives import wire_bytes
from dilocox.distributed.comm import DoneHandle

TRACE_ENV = "DILOCOX_ELASTIC_TRACE"  # a directory: every elastic outer step is recorded there (tests)


class ElasticMixin:
    """The elastic parts of ``DiLoCoOuter`` (module docstring). Needs ``state``, ``schedule``, ``compressors``,
    ``pending``, ``own_prev``, ``comm``, ``outer_step``, ``H``, ``overlap``, ``K`` from it."""

    def _init_elastic(self, elastic) -> None:
        self.elastic = elastic
        self._snap: dict | None = None  # what a joiner gets (set on the main thread at each launch)
        self._healed_sd: dict | None = None  # what this replica got (set on the comm thread by the heal)
        self._meta: dict = {}  # the last elastic step: contributors, healed, step (set on the comm thread)
        self._c_prev = 1  # contributors of the last average (eager's 1/R)
        self._jump: int | None = None  # set by a heal: the inner step to continue from
        self.contributors: list[int] = []
        self._trace = os.environ.get(TRACE_ENV)
        # the owner's own part of what a joiner gets (the SWARM peer: its AdamW state): ``snapshot_extra()`` is called
        # with every snapshot (main thread, right before the launch; return copies of what the main thread changes
        # while that all-reduce may still run), ``load_extra(obj)`` with what a heal received (main thread)
        self.snapshot_extra: Callable[[], object] | None = None
        self.load_extra: Callable[[object], None] | None = None
        # a received state holds θ, the outer momentum and the owner's extra (a SWARM peer's AdamW: 2 x params):
        # 4 x (θ + momentum) + 64 MiB bounds it, checked before anything is allocated (elastic/transfer.py)
        st_bytes = sum(t.numel() * t.element_size() for t in (self.state.theta, self.state.momentum))
        elastic.set_state_fns(self._elastic_state, self._elastic_load, max_state_bytes=4 * st_bytes + (64 << 20))

    @property
    def stats(self) -> dict:
        out = super().stats
        if self.elastic is not None:  # replicas averaged in the last outer step (logged: the outage shows)
            out["replicas"] = len(self.contributors)
        return out

    def _R_prev(self) -> int:
        return self._c_prev if self.elastic is not None else self.R

    # ------------------------------------------------------------------ state transfer
    def _elastic_snapshot(self, n: int) -> None:
        self._snap = {
            "valid": True,
            "n": n,
            "outer_step": self.outer_step,
            "H": self.H,
            "schedule": self.schedule.state_dict(),
            "theta": self.state.theta,
            "momentum": self.state.momentum,
            "overlap": self.overlap,
            "extra": self.snapshot_extra() if self.snapshot_extra is not None else None,
        }

    def _elastic_state(self) -> dict:
        return self._snap if self._snap is not None else {"valid": False}

    def _elastic_load(self, sd: dict) -> None:
        if not sd.get("valid", False):
            raise RuntimeError("the live replica chosen to heal this one has not launched an outer step yet")
        self._healed_sd = sd  # applied on the main thread (_after_elastic_wait)

    def _after_elastic_wait(self) -> bool:
        """Main thread, after waiting for an elastic all-reduce: apply a heal. True if this replica was healed."""
        if self.elastic is None:
            return False
        meta = self._meta
        self._c_prev = max(1, len(meta.get("contributors", [])))
        self.contributors = list(meta.get("contributors", []))
        sd, self._healed_sd = self._healed_sd, None
        if sd is None:
            return False
        st = self.state
        if sd["overlap"] != self.overlap:
            raise RuntimeError(
                f"the live replicas run outer.overlap={sd['overlap']!r}, this replica {self.overlap!r}: use one setting"
            )
        st.theta.copy_(sd["theta"].to(st.theta.device))
        st.momentum.copy_(sd["momentum"].to(st.momentum.device))
        self.outer_step = int(sd["outer_step"])
        self.H = int(sd["H"])
        self.schedule.load_state_dict(sd["schedule"])
        for c in self.compressors:
            c.errors = None  # error feedback reset: its residuals belong to a trajectory this replica left
        self.own_prev = [None] * self.K
        self.healed_at = int(sd["n"])
        self._jump = self.healed_at
        if self.load_extra is not None and sd.get("extra") is not None:
            self.load_extra(sd["extra"])
        return True

    def _resume_healed(self, p: int, avg: Tensor) -> None:
        """delayed/eager after a heal: θ^t is the source's (it already stepped); the average ``avg`` of that step is
        consumed at the end of the next phase, which starts now from θ (the caller continues at ``pop_jump()``)."""
        shapes = self.state.shapes(p)
        parts = avg.split([s.numel() for s in shapes])
        self.pending[p] = DoneHandle([t.view(s).clone() for t, s in zip(parts, shapes)], 0.0)
        self.state.load_params(p, 0.0)

    def pop_jump(self) -> int | None:
        """After a heal: the inner step the live replicas are at (the caller continues there, from θ); else None."""
        n, self._jump = self._jump, None
        return n

    # ------------------------------------------------------------------ joining
    @torch.no_grad()
    def join(self) -> int | None:
        """Take part in the live replicas' current outer step without contributing (start-up of every elastic
        replica). Returns the inner step ``n`` to continue from when a live replica's state was received
        (θ, momentum, outer step, schedule; params set to θ), None when nobody was ahead (a fresh start, or
        a whole-job restart from checkpoints: every replica keeps its own state)."""
        zeros = [torch.zeros(s, dtype=torch.float32, device=self.state.device) for s in self.state.shapes(0)]
        h = self.comm.submit(self._allreduce, self.compressors[0], zeros, 0, False)
        avg = self.state.flatten(self._wait(h))
        if not self._after_elastic_wait():
            return None
        n = self.healed_at
        st, o = self.state, self.ocfg
        if self.overlap == "none":  # the source launched before its outer step: finish it as the source will
            st.outer_step(0, avg, o.lr, o.momentum, o.nesterov)
            self.outer_step += 1
            self.schedule.advance(0, self.H)
        else:
            self._resume_healed(0, avg)
        st.load_params(0, 0.0)
        return n


def elastic_allreduce(outer, comp, tensors: list[Tensor], step: int, contribute: bool) -> list[Tensor]:
    """Comm thread: the mean of ``tensors`` over the replicas contributing to this outer step (module docstring)."""
    el = outer.elastic
    shapes = [t.shape for t in tensors]
    flat_in = torch.cat([t.reshape(-1).float() for t in tensors]) if tensors else torch.zeros(0)
    if not contribute:
        for c in outer.compressors:
            c.errors = None
    if not comp.lossy:

        def body(c: bool):
            return el._flat_sum(flat_in, c)

    else:
        saved = comp.state_dict()
        tries = [0]

        def body(c: bool):
            if tries[0]:
                comp.load_state_dict(saved)  # a failed attempt may have moved the warm start / error feedback
            tries[0] += 1
            onehot = el.count_contributors(c)
            ins = tensors if c else [torch.zeros_like(t) for t in tensors]
            outs = comp.allreduce_mean(ins, el.group, step, outer.comm_stats)
            world = el.group.size()
            return torch.cat([o.reshape(-1).float() for o in outs]).mul_(world), onehot

    res = el.run_step(body, contribute)
    n_c = len(res.contributors)
    mean = res.mean.div_(n_c) if n_c else torch.zeros_like(flat_in)
    if not comp.lossy:  # the compressed path counts its own bytes
        b = wire_bytes(flat_in.numel() + el.cfg.max_replicas, max(res.world, 1), "none")
        outer.comm_stats.add(b, b, res.allreduce_s)
    outer._meta = {"contributors": res.contributors, "healed": res.healed, "step": res.step, "world": res.world}
    if outer._trace:
        os.makedirs(outer._trace, exist_ok=True)
        rec = {
            "step": res.step,
            "n": step,
            "contributors": res.contributors,
            "healed": res.healed,
            "attempts": res.attempts,
            "sent": flat_in.clone() if (contribute and not res.healed) else None,
            "mean": mean.clone(),
        }
        torch.save(rec, os.path.join(outer._trace, f"r{el.cfg.replica_rank}_g{el.group_rank}_s{res.step:05d}.pt"))
    out, off = [], 0
    for s in shapes:
        k = s.numel()
        out.append(mean[off : off + k].view(s))
        off += k
    return out
