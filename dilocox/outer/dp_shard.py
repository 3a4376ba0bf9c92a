"""Inner-DP sharding of the DiLoCo outer work (``outer.shard_over_data``, parallel.data = D > 1).

The D ranks of one (replica, stage, tp) hold identical parameters (inner DP all-reduces the
gradients), so syncing the whole shard from each of them sends D copies over the slow link.
Instead every tensor gets one owner among them (per fragment, largest tensor first to the
least loaded rank: the same assignment on every rank, from the shapes alone); a rank keeps
outer state, compressor and outer all-reduce for its own tensors only, and after each outer
step every tensor is broadcast from its owner over the DP group. Per tensor the math is
unchanged (compression, groups, error feedback and the PowerSGD draws, keyed by the tensor's
place in the unsharded fragment, are per tensor), so with the all-gather collective (R ≤ 4)
the parameters are bit-identical to the unsharded run's; with ``reduce_scatter`` (R > 4) the
stochastic requantization and the summation order follow the buffer's chunking, so they
match in distribution, not bit for bit. Slow-link bytes drop D×. Per-step methods
(allreduce, cocktailsgd) are not sharded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from dilocox.config import ConfigError
from dilocox.distributed.topology import Coord, rank_of


@dataclass
class DataShard:
    """This DP rank's part of the outer work, and the broadcasts that give every DP rank all of it.

    ``mine``: indices (into the unsharded parameter list) of the tensors this rank owns;
    ``fragments``: the fragments as indices into ``mine``; ``frag_ids``: per fragment, each owned
    tensor's place in the unsharded fragment (its id for the compressor's shared random draws);
    ``buckets``: per fragment, ``(source rank, tensors)`` per (owner, dtype), in the same order on
    every DP rank.
    """

    mine: list[int]
    fragments: list[list[int]]
    frag_ids: list[list[int]]
    buckets: list[list[tuple[int, list[Tensor]]]]
    group: object
    rank: int

    def broadcast(self, frags) -> None:
        """Every tensor of the given fragments from its owner to the other inner-DP ranks."""
        for p in frags:
            for src, ts in self.buckets[p]:
                flat = torch.cat([t.reshape(-1) for t in ts])
                dist.broadcast(flat, src=src, group=self.group)
                if src == self.rank:
                    continue  # the owner's tensors already hold the values
                off = 0
                for t in ts:
                    t.copy_(flat[off : off + t.numel()].view_as(t))
                    off += t.numel()


def assign_owners(sizes: list[int], fragments: list[list[int]], D: int) -> list[int]:
    """The owning DP rank (0..D-1) of each tensor, from the tensor sizes alone (module docstring);
    also used by ``dilocox.checkpoint.legacy`` to find a tensor's outer state in a checkpoint of the earlier format."""
    owner = [0] * len(sizes)
    for p, frag in enumerate(fragments):
        if len(frag) < D:  # known to every DP rank alike, so all of them raise
            raise ConfigError(
                f"outer.shard_over_data=true: fragment {p} of this stage has {len(frag)} tensors, fewer than "
                f"parallel.data={D} ranks to share them; set outer.shard_over_data=false or use fewer fragments"
            )
        load = [0] * D
        for i in sorted(frag, key=lambda i: (-sizes[i], i)):
            d = min(range(D), key=lambda d: (load[d], d))
            owner[i], load[d] = d, load[d] + sizes[i]
    return owner


def shard_over_data(topo, params: list[Tensor], fragments: list[list[int]]) -> DataShard:
    """Owners of the tensors of ``params`` (grouped by ``fragments``) among the D ranks of this
    rank's DP group (module docstring). Raises ConfigError if a fragment has fewer than D tensors."""
    D, c = topo.D, topo.coord
    owner = assign_owners([t.numel() for t in params], fragments, D)
    src = [rank_of(Coord(c.replica, d, c.stage, c.tp), topo.R, D, topo.P, topo.T) for d in range(D)]
    buckets = []
    for frag in fragments:
        by_key: dict[tuple[int, str], list[Tensor]] = {}
        for i in frag:
            by_key.setdefault((src[owner[i]], str(params[i].dtype)), []).append(params[i].data)
        buckets.append([(key[0], by_key[key]) for key in sorted(by_key)])
    mine = [i for i in range(len(params)) if owner[i] == c.data]
    pos = {i: k for k, i in enumerate(mine)}
    return DataShard(
        mine=mine,
        fragments=[[pos[i] for i in frag if owner[i] == c.data] for frag in fragments],
        frag_ids=[[k for k, i in enumerate(frag) if owner[i] == c.data] for frag in fragments],
        buckets=buckets,
        group=topo.group("dp"),
        rank=topo.rank,
    )
