"""The codec protocol: how a compressor averages tensors over replicas without owning the network.

A **codec** turns this replica's tensors into bytes, exchanges them through a ``Wire`` it is handed, and decodes the
mean. It never calls ``torch.distributed``: the caller (an ``OuterGroup``, ``outer/group.py``) passes the wire of its
process group (``dilocox/distributed/wire.py``: a ``torch.distributed`` group, a torchft quorum, the authenticated
mesh) or None for a group of one (the codec still applies its local round trip, so one replica sees the same
compression error as many). One call:

    out = codec.allreduce_mean(tensors, wire, step, stats)

- ``tensors``: the shard's fp32 tensors, the shapes the codec was built for; they are not modified.
- ``out``: the decoded mean, **bit-identical on every member of the wire** (payloads are decoded in member order).
- ``step``: the outer step (shared random draws are seeded by it: the same on every member).
- ``stats``: a ``CommStats`` the codec adds its bytes and seconds to (per member, the convention of
  ``compress/collectives.py``).

Besides the call, a codec says what it costs and what it keeps:

- ``lossy``: False only for an exact fp32 mean (the elastic group then sends it in one flat buffer itself);
- ``payload_bytes(rank=None)``: bytes of this member's message per call (independent of the group size);
- ``wire_bytes(world, rank=None)``: bytes one member sends per call among ``world`` members;
- ``state_dict()`` / ``load_state_dict(sd)``: its state across calls (error feedback, warm starts) as plain tensors,
  ints and str keys: what a checkpoint, a live join and a retried elastic step save and restore.

A codec whose size the adaptive controller tunes (ALGORITHMS §7: a low-rank rank) also satisfies ``RankAdaptive``;
``rank_of(codec)`` is 0 for every other codec.

A new codec is a module of ``compress/`` with a ``@register("name", enabled=...)`` builder, listed in
``compress/registered.py``; ``compressor.build_compressor`` picks the registered codec whose ``enabled(compress
config)`` is true (config/checks.py allows one at most), else the default (``compressor.Compressor``: error feedback
+ PowerSGD + quantization). ``compress/sign.py`` is the example: its module, its config section
(``config/sections.py``: a dataclass with ``enabled`` and ``problems()``), one line in ``registered.py``, its test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch
from torch import Tensor


class Wire(Protocol):
    """The collectives a codec may use, over the members of one group. Every call blocks until done (bounded by the
    group's timeout) and raises when a member failed; results are identical on every member."""

    def size(self) -> int: ...

    def rank(self) -> int: ...

    def all_reduce(self, t: Tensor, op: str = "sum") -> None:
        """In place: the SUM (or ``op="max"``) of ``t`` over the members."""

    def all_gather(self, out: list[Tensor], t: Tensor) -> None:
        """``out[i]`` = member i's ``t`` (same shape and dtype on every member)."""

    def all_to_all_single(self, out: Tensor, t: Tensor) -> None:
        """Equal splits: chunk j of ``t`` goes to member j; ``out``'s chunk i comes from member i."""


class Solo:
    """The wire of a group of one member: nothing is sent."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def all_reduce(self, t: Tensor, op: str = "sum") -> None:
        pass

    def all_gather(self, out: list[Tensor], t: Tensor) -> None:
        out[0].copy_(t)

    def all_to_all_single(self, out: Tensor, t: Tensor) -> None:
        out.copy_(t)


SOLO = Solo()


def solo_or(wire: Wire | None) -> Wire:
    """``wire``, or the one-member wire for None."""
    return SOLO if wire is None else wire


def exchange(wire: Wire | None, t: Tensor) -> tuple[list[Tensor], int]:
    """Every member's ``t`` in member order, and this member's place in it: ``([t], 0)`` alone on a one-member wire
    (None). The group size is the list's length: a codec that gathers needs nothing else of the wire."""
    if wire is None:
        return [t], 0
    world = wire.size()
    if world == 1:
        return [t], 0
    out = [torch.empty_like(t) for _ in range(world)]
    wire.all_gather(out, t)
    return out, wire.rank()


@runtime_checkable
class Codec(Protocol):
    """A compressor as the outer group sees it (module docstring)."""

    lossy: bool

    def allreduce_mean(self, tensors: list[Tensor], wire: Wire | None, step: int, stats=None) -> list[Tensor]: ...

    def payload_bytes(self, rank: int | None = None) -> int: ...

    def wire_bytes(self, world: int, rank: int | None = None) -> int: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, sd: dict) -> None: ...


@runtime_checkable
class RankAdaptive(Protocol):
    """A codec with a low-rank rank the adaptive controller reads and sets (ALGORITHMS §7), the same on every
    member (the σ's and tail energies it reports are bit-identical across the group)."""

    rank: int

    def set_rank(self, r: int) -> None: ...

    def max_rank(self) -> int: ...

    def sigmas(self) -> list[Tensor]: ...

    def tail_energy(self) -> Tensor | None: ...


def rank_of(codec) -> int:
    """The codec's low-rank rank; 0 for a codec without one (or None)."""
    return int(codec.rank) if isinstance(codec, RankAdaptive) else 0


@dataclass(frozen=True)
class Registered:
    name: str
    enabled: Callable[[object], bool]  # (CompressConfig) -> does the config select this codec
    build: Callable[..., Codec]  # (CompressConfig, shapes, seed, ids) -> the codec


REGISTRY: dict[str, Registered] = {}


def register(name: str, enabled: Callable[[object], bool]):
    """Decorator of a codec builder ``(ccfg, shapes, seed, ids) -> Codec``, selected when ``enabled(ccfg)``."""

    def deco(build):
        if name in REGISTRY:
            raise ValueError(f"codec {name!r} is registered twice")
        REGISTRY[name] = Registered(name, enabled, build)
        return build

    return deco
