"""Who averages the outer tensors: ONE protocol for a fixed process group, a torchft quorum and a SWARM stage.

``DiLoCoOuter`` and ``GradientSync`` reach the other replicas through an ``OuterGroup`` only (issue 25), on their
comm thread. The protocol:

- ``allreduce_mean(tensors, step, contribute=True, codec=None, stats=None, propose=None) -> list[Tensor]``: the
  mean of ``tensors`` over the replicas that contribute to this call (the inputs are not modified). ``codec``: the
  compressor that carries it (``compress/compressor.py``: anything with ``lossy`` and ``allreduce_mean(tensors,
  process_group, step, stats)``; it counts its bytes in ``stats``), None for the plain fp32 mean.
  ``contribute=False``: take part and receive the mean without adding to it (a replica joining a live run).
  ``propose``: a positive integer (the adaptive controller's next H, ALGORITHMS §7); ``agreed`` is then the max of
  the values the contributors of this call proposed, the same on all of them.
  ``layout``: a function returning ``(tensors, codec)`` that takes their place, called inside the call once this
  replica's heal (if any) is done: a replica joining a streaming run learns there which fragment's round it joins.
- ``contributors``, ``agreed``: of the last call (read after waiting for it; ``agreed`` None when nothing was
  proposed).
- ``heals``: whether a call may hand this replica a live replica's state. Then ``set_state_fns(state_fn, load_fn,
  max_state_bytes)`` says what a live replica sends (``state_fn``) and how this one takes it (``load_fn``, called
  on the comm thread inside the call; the owner applies it after its wait).

Implementations: ``FixedGroup`` (below: a ``torch.distributed`` process group, or None for a single replica) and
``dilocox.elastic.quorum.QuorumGroup`` (a torchft quorum of the replicas alive at each call: the replicas of
``outer.elastic`` and the peers of one SWARM stage). The outer loop has one code path for all of them: it takes
the outer step, then (a group that heals) snapshots what a joiner would get, then launches the next all-reduce.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from dilocox.compress.collectives import wire_bytes


class OuterGroup(Protocol):
    """The replicas an outer object averages over (module docstring)."""

    heals: bool
    contributors: list[int]
    agreed: int | None

    def allreduce_mean(
        self,
        tensors: list[Tensor],
        step: int,
        contribute: bool = True,
        codec=None,
        stats=None,
        propose=None,
        layout: Callable[[], tuple[list[Tensor], object]] | None = None,
    ) -> list[Tensor]: ...

    def set_state_fns(
        self, state_fn: Callable[[], dict], load_fn: Callable[[dict], None], max_state_bytes: int | None = None
    ) -> None: ...


class FixedGroup:
    """The replicas of one job: a ``torch.distributed`` process group over the same shard of every replica
    (``topo.group("outer")``), or None for a single replica (nothing is sent; a codec still applies its local round
    trip, so one replica sees the same compression error as many). Every member contributes to every call."""

    heals = False

    def __init__(self, pg, size: int = 1) -> None:
        if pg is None and size != 1:
            raise ValueError(f"FixedGroup: {size} replicas need a process group")
        self.pg, self.size = pg, size
        self.contributors = list(range(size))
        self.agreed: int | None = None

    @classmethod
    def of(cls, topo) -> FixedGroup:
        """The outer group of this rank in the Topology ``topo`` (None: a single process)."""
        if topo is None:
            return cls(None)
        return cls(topo.group("outer"), len(topo.ranks["outer"]))

    def allreduce_mean(
        self,
        tensors: list[Tensor],
        step: int,
        contribute: bool = True,
        codec=None,
        stats=None,
        propose=None,
        layout: Callable[[], tuple[list[Tensor], object]] | None = None,
    ) -> list[Tensor]:
        if layout is not None:  # (no heal here: the layout is known now)
            tensors, codec = layout()
        if not contribute:
            raise ValueError("a fixed outer group has no joiners: every replica contributes to every all-reduce")
        self.agreed = None
        if propose is not None:  # a tiny MAX before the mean (latency only: it is not waited for on the main thread)
            dev = tensors[0].device if tensors else torch.device("cpu")  # (NCCL groups take device tensors only)
            t = torch.tensor([int(propose)], dtype=torch.int64, device=dev)
            if self.pg is not None:
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg)
            self.agreed = int(t.item())
        if codec is not None:
            return codec.allreduce_mean(tensors, self.pg, step, stats)
        out = [t.detach().float().clone() for t in tensors]
        if self.pg is not None:
            flat = torch.cat([t.reshape(-1) for t in out]) if out else torch.zeros(0)
            dist.all_reduce(flat, group=self.pg)
            flat.div_(self.size)
            if stats is not None:
                b = wire_bytes(flat.numel(), self.size, "none")
                stats.add(b, b, 0.0)
            out = [c.view(t.shape) for c, t in zip(flat.split([t.numel() for t in out]), out)]
        return out

    def set_state_fns(self, state_fn, load_fn, max_state_bytes: int | None = None) -> None:
        raise ValueError("a fixed outer group never heals a replica (use an elastic group: outer.elastic)")
