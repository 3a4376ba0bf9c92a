"""The ``OuterGroup`` of a torchft quorum (dilocox/outer/group.py): the elastic replicas and a SWARM stage's peers.

``QuorumGroup`` wraps an ``ElasticOuterGroup`` (group.py: quorum, commit vote, retries, live join). One call of
``allreduce_mean`` is one outer step of the quorum of the replicas alive now:

- plain (``codec`` None or lossless): ONE flat all-reduce of ``[tensors | one-hot(replica)]``; the mean is the sum
  over the contributors divided by their count (the count carried by the same buffer).
- compressed: a ``max_replicas``-float count, then the codec's own collectives over the quorum's process group
  (a ``ProcessGroupWire``); its mean over the group is rescaled to the mean over the contributors. A failed attempt is
  retried from the codec's state as it was before it (warm start, error feedback).
- a replica behind the newest outer step is healed inside the quorum (``set_state_fns``): it receives a live
  replica's state, contributes nothing and receives the mean like everyone (``healed`` is True after that call).
- ``propose``: each replica writes its value into its own slot of ``max_replicas`` more floats of the same buffer
  (the count's buffer when compressed; always there, so a joiner that proposes nothing has the live replicas'
  layout); ``agreed`` is the max over the slots, i.e. over this call's contributors (a replica that does not
  contribute sends zeros), None when none proposed. Exact for integers below 2^24.

- ``norm_check`` = c > 0 (``outer.norm_check``, docs/SECURITY.md; FixedGroup's rule): each contributor writes the L2
  norm of what it is about to send into its own slot of ``max_replicas`` more floats of the count's buffer (the
  plain path then takes the count first: one more tiny all-reduce); a contributor whose norm is not finite or above
  c x the median of the contributors' finite norms sends zeros instead, and the sum is divided by the accepted
  ones only. Every replica computes the same ``rejected`` from the same sums, per attempt (the quorum may change).
- ``stats``: bytes by FixedGroup's convention (outer/group.py ``count_side``: per member, sent = received): the
  plain path's one all-reduce (of the committed attempt), the codec's collectives and the count's all-reduce beside
  them (of every attempt).

``DILOCOX_ELASTIC_TRACE=DIR`` records every committed step (contributors, what this replica sent, the mean) as
``DIR/r{replica}_g{rank}_s{step:05d}.pt`` for the tests' oracle.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import torch
from torch import Tensor

from dilocox.compress.codec import rank_of
from dilocox.compress.collectives import wire_bytes
from dilocox.elastic.group import ElasticOuterGroup
from dilocox.outer.group import count_side, outliers, report_outliers, ring_bytes

TRACE_ENV = "DILOCOX_ELASTIC_TRACE"  # a directory: every elastic outer step is recorded there (tests)


class QuorumGroup:
    """``OuterGroup`` over the torchft quorum of ``elastic`` (module docstring)."""

    heals = True

    def __init__(self, elastic: ElasticOuterGroup, norm_check: float = 0.0) -> None:
        if norm_check and norm_check <= 1.0:
            raise ValueError(f"QuorumGroup: norm_check={norm_check} must be 0 (off) or above 1 (a ratio to the median)")
        self.elastic, self.norm_check = elastic, float(norm_check)
        self.rejected: list[int] = []  # of the last committed call (norm_check): replica ranks left out of the mean
        self.norms: dict[int, float] = {}  # every contributor's norm at the last committed call (norm_check)
        self.contributors: list[int] = []  # of the last committed call (without the rejected ones)
        self.healed = False  # the last call healed this replica
        self.agreed: int | None = None  # the max of the last call's proposals
        self.stats = None  # a CommStats every call's bytes are counted in (outer/group.py)
        self._trace = os.environ.get(TRACE_ENV)

    @property
    def on_quorum(self) -> Callable[[int], None] | None:
        return self.elastic.on_quorum

    @on_quorum.setter
    def on_quorum(self, fn: Callable[[int], None] | None) -> None:
        self.elastic.on_quorum = fn

    def set_state_fns(
        self, state_fn: Callable[[], dict], load_fn: Callable[[dict], None], max_state_bytes: int | None = None
    ) -> None:
        self.elastic.set_state_fns(state_fn, load_fn, max_state_bytes=max_state_bytes)

    def allreduce_mean(self, tensors: list[Tensor], step: int, codec=None, propose=None) -> list[Tensor]:
        return self._round(tensors, step, True, codec, propose, None)

    def join(self, step: int, layout: Callable[[], tuple[list[Tensor], object]]) -> list[Tensor]:
        return self._round(None, step, False, None, None, layout)

    def _round(self, tensors, step: int, contribute: bool, codec, propose, layout) -> list[Tensor]:
        """One round of the quorum (module docstring); ``layout`` (a joiner) resolves the inputs after its heal."""
        el, stats = self.elastic, self.stats
        mr, check = el.cfg.max_replicas, bool(self.norm_check)
        side = torch.zeros(2 * mr if check else mr)  # [proposals | norms (norm_check)]
        if propose is not None:
            if not 0 < int(propose) < 1 << 24:
                raise ValueError(f"propose={propose} must be a positive integer below 2^24 (exact in fp32)")
            side[el.cfg.replica_rank] = float(propose)
        sides = [side]  # the slots of the attempt that committed
        io: dict = {}  # the inputs, resolved at the first attempt (``layout``: after this replica's heal, if any)

        def inputs() -> dict:
            if not io:
                ts, cd = layout() if layout is not None else (tensors, codec)
                flat = torch.cat([t.reshape(-1).float() for t in ts]) if ts else torch.zeros(0)
                io.update(tensors=ts, codec=cd, flat=flat, lossy=cd is not None and cd.lossy)
                if check:
                    side[mr + el.cfg.replica_rank] = torch.linalg.vector_norm(flat, dtype=torch.float64).float()
                elif not io["lossy"]:
                    io["buf"] = torch.cat([flat, side.to(flat.device)])  # (side: host slots; flat: the device's)
            return io

        saved: list[dict] = []
        tries = [0]
        chk: dict = {"rejected": [], "norms": {}}  # of the latest attempt (norm_check)

        def count(c: bool) -> tuple[Tensor, bool]:
            return self._count(side, c, sides, chk)

        def body(c: bool):
            x = inputs()
            n = x["flat"].numel()
            if not x["lossy"]:
                if check:  # the norms first, then the sum without the rejected ones
                    _, out = count(c)
                    return el.flat_sum(torch.zeros_like(x["flat"]) if out else x["flat"], c)
                total, onehot = el.flat_sum(x["buf"], c)
                sides[0] = total[n:]
                return total[:n], onehot
            cd = x["codec"]
            if tries[0]:  # a failed attempt may have moved the warm start / error feedback (a heal, the rank)
                rank = rank_of(cd)
                cd.load_state_dict(saved[0])
                if rank != rank_of(cd):
                    cd.set_rank(rank)
            else:
                saved.append(cd.state_dict())  # (after this call's heal, if any, set the rank)
            tries[0] += 1
            onehot, out = count(c)
            ins = x["tensors"] if c and not out else [torch.zeros_like(t) for t in x["tensors"]]
            outs = cd.allreduce_mean(ins, el.group, step, stats)
            world = el.group.size()
            return torch.cat([o.reshape(-1).float() for o in outs]).mul_(world), onehot

        res = el.run_step(body, contribute)
        x = inputs()
        flat_in, n = x["flat"], x["flat"].numel()
        top = int(sides[0][:mr].max().item())
        self.agreed = top if top > 0 else None
        accepted = self._accepted(res.contributors, chk, step)
        n_c = len(accepted)
        mean = res.mean.div_(n_c) if n_c else torch.zeros_like(flat_in)
        if not x["lossy"] and stats is not None:  # the codec counts its own bytes; the count (_count) its own
            # [flat | proposals | one-hot | lighthouse seen]; norm_check: [flat | one-hot | seen], after the count
            b = wire_bytes(n + mr + 1 if check else n + 2 * mr + 1, max(res.world, 1), "none")
            stats.add(b, b, res.allreduce_s)
        self.contributors, self.healed = accepted, res.healed
        if self._trace:
            self._record(res, step, mean, flat_in if (contribute and not res.healed) else None)
        ts = x["tensors"]
        return [m.view(t.shape) for m, t in zip(mean.split([t.numel() for t in ts]), ts)]

    def _count(self, side: Tensor, c: bool, sides: list, chk: dict) -> tuple[Tensor, bool]:
        """The count (with the proposals and, norm_check, the norms) alone: (the one-hot counts, whether this replica
        is left out). The rejected ones are those of this attempt's contributors (``chk``). Counted in ``stats`` (each
        attempt, as the codec counts its collectives: what is sent) as FixedGroup counts its side collectives."""
        el = self.elastic
        t0 = time.perf_counter()
        sides[0], onehot = el.flat_sum(side, c)
        world = el.group.size()  # (the quorum's process group, the codec's too)
        # fp32 [proposals | norms (norm_check) | one-hot | lighthouse seen] (ElasticOuterGroup.flat_sum's buffer)
        count_side(self.stats, ring_bytes(4 * (side.numel() + el.cfg.max_replicas + 1), world), world, t0)
        if self.norm_check:
            members = [int(i) for i in torch.nonzero(onehot).flatten().tolist()]
            norms = {i: float(sides[0][el.cfg.max_replicas + i]) for i in members}
            bad = outliers([norms[i] for i in members], self.norm_check)
            chk["norms"], chk["rejected"] = norms, [members[j] for j in bad]
        return onehot, el.cfg.replica_rank in chk["rejected"]

    def _accepted(self, contributors: list[int], chk: dict, step: int) -> list[int]:
        """The contributors of the committed attempt without the ones norm_check left out (logged)."""
        rejected = chk["rejected"] if self.norm_check else []
        if rejected:
            report_outliers(step, self.norm_check, chk["norms"], rejected)
        self.rejected, self.norms = list(rejected), dict(chk["norms"])
        return [i for i in contributors if i not in rejected]

    def _record(self, res, n: int, mean: Tensor, sent: Tensor | None) -> None:
        el = self.elastic
        os.makedirs(self._trace, exist_ok=True)
        rec = {
            "step": res.step,
            "n": n,
            "contributors": res.contributors,
            "healed": res.healed,
            "attempts": res.attempts,
            "sent": sent.clone() if sent is not None else None,
            "mean": mean.clone(),
        }
        torch.save(rec, os.path.join(self._trace, f"r{el.cfg.replica_rank}_g{el.group_rank}_s{res.step:05d}.pt"))

    def close(self) -> None:
        self.elastic.close()
