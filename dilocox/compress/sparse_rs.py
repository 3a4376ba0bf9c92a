"""The sparse codec's reduce-scatter (``compress.collective: reduce_scatter`` with ``compress.sparse``): flat in R.

The all-gather of ``compress/sparse.py`` sends each replica's payload P to every other replica: (R − 1) · P per
replica per sync, while a ring all-reduce of the dense shard sends 2 (R − 1) / R of it. So the codec's advantage
over all-reduce halves with every doubling of R (1,092x fewer bytes at R = 2, 273x at R = 8; docs/BENCHMARKS.md
§4h). This collective reduces inside the network instead, as gTop-k and Ok-Topk do (Shi et al. 2019; Li and
Hoefler 2022):

    each group's chunk rows are split into R contiguous ranges; range j is owned by member j
    all-to-all:  member i sends member j its encoded rows of range j (the payload of ``sparse.py``, row by row)
    owner j:     m = (1/R) Σ_i decoded rows of member i, summed in member order (padding entries zeroed)
                 r_j = β r_j + m              the owner's residual (β = ``ef_decay``, as the members' own buffers)
                 encode r_j's rows (top-k, b bits: the same rule and k), r_j −= the decoded rows
    all-gather:  every member gets every owner's encoded rows and decodes them: the mean applied on every member

so each member sends 2 (R − 1) · P / R (both phases, padded to the largest range), about 2P whatever R is, and
every member decodes the same bytes: the result is bit-identical on each. The owner's second top-k keeps the k
largest entries of the mean per chunk (the union of R members' picks has up to R·k); what it drops stays in its
residual for the next sync, as a member's error buffer does. The residual belongs to a (member count, rank) pair:
when the membership changes (an elastic replica leaves or joins) it starts from zero, and a checkpoint keeps it
only for the same pair. At R = 2 the bytes equal the all-gather's, and the second top-k only adds error: the
collective is for R >= 4. ``sparse_ref.reference_reduce_scatter`` is the same rule as plain per-chunk Python over
``sparse_ref.reference_encode``/``reference_decode``; the tests compare them bit for bit on real gloo ranks.
"""

from __future__ import annotations

import torch

from dilocox.compress.codec import Wire


def ranges(rows: int, world: int) -> list[tuple[int, int]]:
    """Member j's rows [a, b) of a group of ``rows`` chunk rows (contiguous, sizes differing by at most one)."""
    return [(rows * j // world, rows * (j + 1) // world) for j in range(world)]


def segment_bytes(gr, world: int, keep: int = 1) -> int:
    """Bytes of the largest member's range over all groups, its rows encoded at ``keep`` x k: what one member sends
    another in the all-to-all (``keep`` = 1) and in the all-gather (the owner's ``keep``)."""
    per = [0] * world
    for g, (_, _, rows) in enumerate(gr.groups):
        for j, (a, b) in enumerate(ranges(rows, world)):
            per[j] += (b - a) * (sum(gr.row_widths(g, keep)) + 2)
    return max(per)


def wire_bytes(gr, world: int, keep: int) -> int:
    """Bytes one member sends per sync: (R − 1) segments in the all-to-all, (R − 1) in the all-gather."""
    return (world - 1) * (segment_bytes(gr, world) + segment_bytes(gr, world, keep)) if world > 1 else 0


def _pad_cols(gr, g: int, a: int, b: int) -> list[tuple[int, int]]:
    """(row − a, first padding column) of each tensor's zero-padded last chunk that falls in rows [a, b)."""
    c = gr.groups[g][0]
    out = []
    for i, (gi, r0, n_c) in gr.place.items():
        last = r0 + n_c - 1
        col = gr.numels[i] - (n_c - 1) * c
        if gi == g and a <= last < b and col < c:
            out.append((last - a, col))
    return out


def _pack(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], size: int, device) -> torch.Tensor:
    """Rows' (index, code, scale) bytes, group by group, into one zero-padded segment of ``size`` bytes."""
    seg = torch.zeros(size, dtype=torch.uint8, device=device)
    o = 0
    for t in (x for p in parts for x in p):
        n = t.numel()
        seg[o : o + n] = t.reshape(-1)
        o += n
    return seg


def _unpack(seg: torch.Tensor, gr, spans: list[tuple[int, int]], keep: int = 1):
    """Inverse of ``_pack`` for the row spans [a, b) of each group (encoded at ``keep`` x k): yields (group,
    indices, values)."""
    o = 0
    for g, (a, b) in enumerate(spans):
        wi, wc = gr.row_widths(g, keep)
        n = b - a
        ib = seg[o : o + n * wi].view(n, wi)
        cb = seg[o + n * wi : o + n * (wi + wc)].view(n, wc)
        sb = seg[o + n * (wi + wc) : o + n * (wi + wc + 2)].clone().view(n, 2)  # (clone: aligned)
        o += n * (wi + wc + 2)
        if n:
            yield g, *gr.decode_rows(g, ib, cb, sb, keep)


class OwnerResidual:
    """The owner's residual rows of one (member count, rank) pair (module docstring)."""

    def __init__(self) -> None:
        self.key: tuple[int, int] | None = None
        self.rows: list[torch.Tensor] = []

    def take(self, gr, world: int, me: int, device) -> list[torch.Tensor]:
        """This member's residual rows per group: kept when the pair (and the rows) are the same, else zeros."""
        want = [(ranges(rows, world)[me], c) for c, _, rows in gr.groups]
        shapes = [(b - a, c) for (a, b), c in want]
        if self.key != (world, me) or [tuple(r.shape) for r in self.rows] != shapes:
            self.rows = [torch.zeros(s, device=device) for s in shapes]
            self.key = (world, me)
        elif self.rows and self.rows[0].device != device:
            self.rows = [r.to(device) for r in self.rows]
        return self.rows

    def state_dict(self) -> dict:
        if self.key is None:
            return {}
        return {"world": self.key[0], "rank": self.key[1], "rows": {str(g): r.clone() for g, r in enumerate(self.rows)}}

    def load_state_dict(self, sd: dict) -> None:
        self.key, self.rows = None, []
        if sd and "rows" in sd:
            self.key = (int(sd["world"]), int(sd["rank"]))
            self.rows = [sd["rows"][str(g)].detach().clone().float() for g in range(len(sd["rows"]))]


def sync(gr, err: list[torch.Tensor], wire: Wire, owner: OwnerResidual, beta: float, block_elems: int, keep: int):
    """One reduce-scatter sync of the error-fed group matrices ``err`` (``SparseCompressor``): subtracts what this
    member sent from ``err`` and returns the mean as group matrices (rows of every range, identical on each member).
    The owners keep ``keep`` x k entries per chunk of the mean."""
    world, me = wire.size(), wire.rank()
    device = err[0].device
    enc = []  # per group: (index, code, scale) bytes of every row
    for g in range(len(gr.groups)):
        blk = [gr.encode_rows(g, err[g][a:b]) for a, b in gr.blocks(g, block_elems)]
        enc.append([torch.cat(x) if len(x) > 1 else x[0] for x in zip(*blk)])
        for a, b in gr.blocks(g, block_elems):  # e −= what this member sent
            idx, vals = gr.decode_rows(g, enc[g][0][a:b], enc[g][1][a:b], enc[g][2][a:b].contiguous())
            err[g][a:b].scatter_add_(1, idx, vals.neg_())
    for pad in gr.pads(err):
        pad.zero_()
    spans = [ranges(rows, world) for _, _, rows in gr.groups]
    size = segment_bytes(gr, world)
    send = torch.cat(
        [
            _pack([tuple(t[a:b] for t in enc[g]) for g, (a, b) in enumerate(s[j] for s in spans)], size, device)
            for j in range(world)
        ]
    )
    recv = torch.empty_like(send)
    wire.all_to_all_single(recv, send)
    mine = [s[me] for s in spans]
    res = owner.take(gr, world, me, device)
    acc = [torch.zeros(b - a, gr.groups[g][0], device=device) for g, (a, b) in enumerate(mine)]
    for i in range(world):  # decoded and summed in member order
        for g, idx, vals in _unpack(recv[i * size : (i + 1) * size], gr, mine):
            acc[g].scatter_add_(1, idx, vals)
    parts = []
    for g, (a, b) in enumerate(mine):
        if b == a:  # (a group with fewer rows than members)
            parts.append(tuple(torch.zeros(0, dtype=torch.uint8, device=device) for _ in "ics"))
            continue
        acc[g].div_(world)
        for row, col in _pad_cols(gr, g, a, b):
            acc[g][row, col:] = 0.0
        res[g].mul_(beta).add_(acc[g])
        part = gr.encode_rows(g, res[g], keep)
        idx, vals = gr.decode_rows(g, part[0], part[1], part[2].contiguous(), keep)
        res[g].scatter_add_(1, idx, vals.neg_())  # r −= what the owner sent
        for row, col in _pad_cols(gr, g, a, b):
            res[g][row, col:] = 0.0
        parts.append(part)
    size = segment_bytes(gr, world, keep)
    gathered = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(world)]
    wire.all_gather(gathered, _pack(parts, size, device))
    out = [torch.zeros(rows, c, device=device) for c, _, rows in gr.groups]
    for j in range(world):
        owned = [s[j] for s in spans]
        for g, idx, vals in _unpack(gathered[j], gr, owned, keep):
            a, b = owned[g]
            out[g][a:b].scatter_(1, idx, vals)
    return out
