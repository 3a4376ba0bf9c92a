"""Who averages the outer tensors: ONE protocol for a fixed process group, a torchft quorum and a SWARM stage.

``DiLoCoOuter`` and ``GradientSync`` reach the other replicas through an ``OuterGroup`` only (issue 25), on their
comm thread. The protocol:

- ``allreduce_mean(tensors, step, codec=None, propose=None) -> list[Tensor]``: the mean of ``tensors`` over the
  replicas that contribute to this call (the inputs are not modified). ``codec``: the compressor that carries it (a
  ``compress/codec.py`` ``Codec``: the group hands it the wire of its process group, ``distributed/wire.py``), None
  for the plain fp32 mean. ``step`` seeds the codec's shared draws (the same on every replica). ``propose``: a
  positive integer (the adaptive controller's next H, ALGORITHMS §7); ``agreed`` is then the max of the values the
  contributors of this call proposed, the same on all of them.
- ``stats``: a ``CommStats`` the group counts every call's bytes in (the codec's or the plain mean's, and the small
  collectives beside it: the proposals' MAX, ``norm_check``'s all-gather); None: none.
- ``contributors``, ``agreed``: of the last call (read after waiting for it; ``agreed`` None when nothing was
  proposed).
- Membership (a group that ``heals``: replicas join a live run). ``set_state_fns(state_fn, load_fn,
  max_state_bytes)`` registers the outer loop's snapshot and restore hooks: what a live replica sends
  (``state_fn``) and how this one takes it (``load_fn``, called on the comm thread inside the call; the owner
  applies it after its wait). ``join(step, layout)``: take part in the live replicas' current round without
  contributing; ``layout()`` returns the ``(tensors, codec)`` of that round, called once this replica's heal (if
  any) is done: a replica joining a streaming run learns there which fragment's round it joins.

Implementations: ``FixedGroup`` (below: a ``torch.distributed`` process group, or None for a single replica) and
``dilocox.elastic.quorum.QuorumGroup`` (a torchft quorum of the replicas alive at each call: the replicas of
``outer.elastic`` and the peers of one SWARM stage). The outer loop has one code path for all of them: it takes
the outer step, then (a group that heals) snapshots what a joiner would get, then launches the next all-reduce.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable, Protocol

import torch
from torch import Tensor

from dilocox.compress.collectives import CommStats, wire_bytes
from dilocox.distributed.wire import wire_of

log = logging.getLogger("dilocox.outer")


def ring_bytes(b: int, world: int) -> int:
    """Bytes one member sends in a ring all-reduce of ``b`` bytes (``compress/collectives.py``'s convention)."""
    return -(-2 * (world - 1) * b // world) if world > 1 else 0


def count_side(stats: CommStats | None, sent: int, world: int, t0: float) -> None:
    """Count one of the small collectives an outer group runs beside the mean (the H proposals, ``norm_check``'s
    norms, an elastic quorum's count of contributors) in ``stats``, by the byte convention of
    ``compress/collectives.py``: ``sent`` bytes per member (:func:`ring_bytes` for an all-reduce, (R-1) x b for an
    all-gather), sent = received; nothing in a group of one. ``t0``: its ``time.perf_counter()`` start."""
    if stats is not None and world > 1:
        stats.add(sent, sent, time.perf_counter() - t0)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    k = len(xs)
    return 0.0 if k == 0 else (xs[k // 2] if k % 2 else 0.5 * (xs[k // 2 - 1] + xs[k // 2]))


def outliers(norms: list[float], ratio: float) -> list[int]:
    """The members whose norm is not finite or above ``ratio`` x the median of the finite norms (``outer.norm_check``;
    the true median: with 2 members neither is ever above 2 x their mean, so the check needs 3 or more)."""
    med = _median([n for n in norms if math.isfinite(n)])
    return [i for i, n in enumerate(norms) if not math.isfinite(n) or n > ratio * med]


def report_outliers(step: int, ratio: float, norms: dict[int, float], rejected: list[int]) -> None:
    """``outer.norm_check``: log who was left out of this mean (every member logs the same); every member left out:
    the run diverged, raise."""
    if len(rejected) == len(norms):
        raise RuntimeError(
            f"outer step {step}: every replica's pseudo-gradient failed outer.norm_check (norms {norms}): "
            "the run diverged; lower the learning rates or resume from an earlier checkpoint"
        )
    med = _median([n for n in norms.values() if math.isfinite(n)])
    log.warning(
        "outer step %d: left out of the mean by outer.norm_check=%g (median norm %.4g): %s",
        step, ratio, med, ", ".join(f"replica {i} (norm {norms[i]:.4g})" for i in rejected),
    )  # fmt: skip


class OuterGroup(Protocol):
    """The replicas an outer object averages over (module docstring)."""

    heals: bool
    contributors: list[int]
    agreed: int | None
    stats: CommStats | None

    def allreduce_mean(self, tensors: list[Tensor], step: int, codec=None, propose=None) -> list[Tensor]: ...

    def join(self, step: int, layout: Callable[[], tuple[list[Tensor], object]]) -> list[Tensor]: ...

    def set_state_fns(
        self, state_fn: Callable[[], dict], load_fn: Callable[[dict], None], max_state_bytes: int | None = None
    ) -> None: ...


class FixedGroup:
    """The replicas of one job: a ``torch.distributed`` process group over the same shard of every replica
    (``topo.group("outer")``), or None for a single replica (nothing is sent; a codec still applies its local round
    trip, so one replica sees the same compression error as many). Every member takes part in every call.

    ``norm_check`` = c > 0 (``outer.norm_check``, docs/SECURITY.md): before each mean the members all-gather the
    L2 norm of what they are about to send (one float each); a member whose norm is not finite or above c x the
    median of the finite ones is left out of that call's mean (it sends zeros; the mean is over the others) and
    ``rejected`` names it, the same on every member. Per shard: each rank's outer group checks its own tensors.
    The norms are self-reported: this stops a faulty replica (diverged, NaN), not a key holder that lies."""

    heals = False

    def __init__(self, pg, size: int = 1, norm_check: float = 0.0) -> None:
        if pg is None and size != 1:
            raise ValueError(f"FixedGroup: {size} replicas need a process group")
        if norm_check and norm_check <= 1.0:
            raise ValueError(f"FixedGroup: norm_check={norm_check} must be 0 (off) or above 1 (a ratio to the median)")
        self.pg, self.size, self.norm_check = pg, size, float(norm_check)
        self.wire = wire_of(pg)  # (a codec's collectives and this group's own run on it)
        self.contributors = list(range(size))
        self.rejected: list[int] = []  # of the last call (norm_check)
        self.norms: list[float] = []  # every member's norm at the last call (norm_check)
        self.agreed: int | None = None
        self.stats: CommStats | None = None

    @classmethod
    def of(cls, topo, norm_check: float = 0.0) -> FixedGroup:
        """The outer group of this rank in the Topology ``topo`` (None: a single process)."""
        if topo is None:
            return cls(None)
        return cls(topo.group("outer"), len(topo.ranks["outer"]), norm_check)

    def allreduce_mean(self, tensors: list[Tensor], step: int, codec=None, propose=None) -> list[Tensor]:
        self.agreed = None
        if propose is not None:  # a tiny MAX before the mean (latency only: it is not waited for on the main thread)
            dev = tensors[0].device if tensors else torch.device("cpu")  # (NCCL groups take device tensors only)
            t = torch.tensor([int(propose)], dtype=torch.int64, device=dev)
            t0 = time.perf_counter()
            self.wire.all_reduce(t, op="max")
            self.agreed = int(t.item())
            count_side(self.stats, ring_bytes(t.numel() * t.element_size(), self.size), self.size, t0)
        scale = 1.0
        if self.norm_check and self.pg is not None:
            tensors, scale = self._check_norms(tensors, step)
        if codec is not None:
            out = codec.allreduce_mean(tensors, self.wire, step, self.stats)
        else:
            out = self._plain_mean(tensors, self.stats)
        return out if scale == 1.0 else [o.mul_(scale) for o in out]

    def _plain_mean(self, tensors: list[Tensor], stats) -> list[Tensor]:
        out = [t.detach().float().clone() for t in tensors]
        if self.pg is not None:
            flat = torch.cat([t.reshape(-1) for t in out]) if out else torch.zeros(0)
            self.wire.all_reduce(flat)
            flat.div_(self.size)
            if stats is not None:
                b = wire_bytes(flat.numel(), self.size, "none")
                stats.add(b, b, 0.0)
            out = [c.view(t.shape) for c, t in zip(flat.split([t.numel() for t in out]), out)]
        return out

    def _check_norms(self, tensors: list[Tensor], step: int) -> tuple[list[Tensor], float]:
        """``norm_check``: all-gather the members' norms; (this member's inputs, or zeros if it is left out; the
        factor that turns the mean over all members into the mean over the accepted ones)."""
        dev = tensors[0].device if tensors else torch.device("cpu")
        sq = sum((t.detach().double().pow(2).sum() for t in tensors), torch.zeros((), dtype=torch.float64, device=dev))
        mine = sq.sqrt().reshape(1).to(dev)
        gathered = [torch.empty_like(mine) for _ in range(self.size)]
        t0 = time.perf_counter()
        self.wire.all_gather(gathered, mine)
        count_side(self.stats, (self.size - 1) * mine.numel() * mine.element_size(), self.size, t0)
        self.norms = [float(g.item()) for g in gathered]
        self.rejected = outliers(self.norms, self.norm_check)
        if self.rejected:
            report_outliers(step, self.norm_check, dict(enumerate(self.norms)), self.rejected)
        self.contributors = [i for i in range(self.size) if i not in self.rejected]
        if not self.rejected:
            return tensors, 1.0
        if self.wire.rank() in self.rejected:
            tensors = [torch.zeros_like(t) for t in tensors]
        return tensors, self.size / len(self.contributors)

    def set_state_fns(self, state_fn, load_fn, max_state_bytes: int | None = None) -> None:
        raise ValueError("a fixed outer group never heals a replica (use an elastic group: outer.elastic)")

    def join(self, step: int, layout) -> list[Tensor]:
        raise ValueError("a fixed outer group has no joiners: every replica contributes to every all-reduce")
