"""Chunked top-k of the pseudo-gradient with error feedback and low-bit values (``compress.sparse``; issue 23 §2a).

The rule of SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky 2025, arXiv:2508.15706), per outer sync, for each
tensor Δ_i of this rank's shard, with the worker's error buffer e_i:

    e_i  = β e_i + Δ_i                           error feedback with decay β (``ef_decay``; 1 = plain EF)
    per chunk of C consecutive elements (the tensor's last chunk zero-padded; C = min(``chunk``, numel)):
        keep the k = ceil(density · C) entries of largest |e| (top-k within the chunk)
        s    = bf16(max |kept| / h),  h = (2^b − 1) / 2          one scale per chunk (``bits`` = b)
        code = clamp(floor(v / s + 2^(b−1)), 0, 2^b − 1)           nearest of the 2^b levels (c + ½ − 2^(b−1))·s
    sent_i = the decoded kept entries (zeros elsewhere)
    e_i  = e_i − sent_i
    out_i = (1/R) Σ_r sent_i^(r)                 all-gather of the payloads, decoded and summed in rank order

so the result is bit-identical on every rank. The levels have no zero (the kept entries are the large ones), a
chunk whose kept entries are all zero has s = 0 and decodes to zeros. SparseLoCo drops the outer momentum (the
decayed error buffer plays its part) and steps θ with the plain mean (outer lr α ≈ 1): the preset
``configs/methods/sparseloco.yaml`` sets ``outer.momentum: 0``; any outer optimizer can still be used.

Wire format of one rank's payload (uint8, the same size on every rank: k is fixed per tensor), per tensor, three
blocks for its n_c chunks: the k ascending indices of each chunk (``indices``: ``rice``, Rice-coded gaps in a
block of fixed size, or ``fixed``, each in ceil(log2 C) bits packed LSB-first into ceil(k·ib/8) bytes;
``compress/rice.py``); the k codes of each chunk in b bits, packed LSB-first into ceil(k·b/8) bytes; the n_c
scales as little-endian bf16. ``payload_bytes`` counts exactly those bytes; a sync sends (R − 1) × payload
(all-gather), which ``CommStats`` records. At density 1/64, b = 2, C = 4096: 82 bytes per 4096 elements with
``rice`` (114 with ``fixed``), 200x (144x) fewer than fp32 per sync.

``encode`` runs the compiled CPU kernel ``torch.ops.dilocox.sparse_encode`` (csrc/sparse_cpu.cpp) when the
extension is built, else the vectorised torch ops (any device: top-k per chunk, ties to the lower index; packing
with tensor ops); ``decode_accumulate`` is torch ops. ``reference_encode``/``reference_decode`` (``sparse_ref.py``)
are plain per-chunk Python loops of the same rule; the tests compare all three byte for byte. ``SparseCompressor`` runs
the same rule on all its tensors at once (``_Groups``: one matrix of chunks per chunk size; on a GPU a per-tensor
loop was thousands of kernel launches per sync), tested bit for bit against ``encode``/``decode_accumulate`` tensor
by tensor.
"""

from __future__ import annotations

import math
import time

import torch

from dilocox.compress import kernels, rice, sparse_rs
from dilocox.compress.codec import Wire, exchange, register
from dilocox.compress.collectives import CommStats

SPARSE_BITS = (2, 4, 8)
COLLECTIVES = ("allgather", "reduce_scatter")


def _has_op() -> bool:  # (an extension built before the op existed, or before it wrote Rice codes, lacks it)
    op = getattr(torch.ops.dilocox, "sparse_encode", None)
    return op is not None and any(a.name == "rice_b" for a in op.default._schema.arguments)


def layout(numel: int, chunk: int, density: float) -> tuple[int, int, int]:
    """(chunk size C, kept per chunk k, chunks n_c) of a tensor of ``numel`` elements."""
    c = max(1, min(int(chunk), int(numel)))
    k = max(1, min(c, math.ceil(density * c - 1e-9)))
    return c, k, -(-int(numel) // c)


index_bits = rice.index_bits


def tensor_payload_bytes(numel: int, chunk: int, density: float, bits: int, indices: str = "rice") -> int:
    """Bytes one tensor puts on the wire (module docstring)."""
    if numel == 0:
        return 0
    c, k, n_c = layout(numel, chunk, density)
    return n_c * (rice.row_bytes(c, k, indices) + -(-k * bits // 8) + 2)


def _levels(bits: int) -> tuple[float, float]:
    """(h, offset): s = absmax / h; code = floor(v / s + offset); value = (code + 0.5 − offset) · s."""
    return (2**bits - 1) / 2.0, float(2 ** (bits - 1))


def _topk_indices(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the indices (ascending) of the k largest entries, ties to the lower index: every entry above the
    row's k-th largest value, then the lowest-index entries equal to it (so the payload is a function of e alone,
    whatever order ``torch.topk`` breaks ties in; 12x faster than a stable sort of the rows). A NaN counts as +inf:
    ``topk`` ranks it above everything, but it is neither above nor equal to a threshold, so a row holding one
    would choose fewer than k, and the rows' indices would shift into each other (or, at the end, read index -1).
    The callers refuse non-finite values; this keeps k per row for any input (an owner's mean of decoded payloads)."""
    mag = mag.nan_to_num(nan=math.inf, posinf=math.inf)
    thr = torch.topk(mag, k, dim=1).values[:, -1:]
    above = mag > thr
    equal = mag == thr
    room = k - above.sum(1, keepdim=True)
    chosen = above | (equal & (torch.cumsum(equal.to(torch.int32), 1) <= room))
    # exactly k per row, so the count is known: nonzero_static (the same indices, in the same order) needs no host
    # sync on a GPU, where nonzero waits for the device to learn its output's size
    return torch.nonzero_static(chosen, size=mag.shape[0] * k)[:, 1].view(mag.shape[0], k)


def _encode_rows(
    rows: torch.Tensor, k: int, bits: int, indices: str = "rice"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch encoder of chunks: ``rows`` (n_rows, C) fp32 -> index bytes (n_rows, ``rice.row_bytes``), code bytes
    (n_rows, ceil(k·b/8)) and bf16 scale bytes (n_rows, 2), uint8. Rows are independent, so the chunks of many
    tensors can go through it together (``_Groups``)."""
    idx = _topk_indices(rows.abs(), k)
    vals = torch.gather(rows, 1, idx)
    h, off = _levels(bits)
    amax = vals.abs().amax(dim=1)
    scale = (amax / torch.full_like(amax, h)).to(torch.bfloat16)  # (a tensor divisor: CUDA turns a scalar one into
    # a multiply by its reciprocal, which can differ in the last bit from the kernel and the loops)
    s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.clamp(torch.floor(vals / safe.unsqueeze(1) + off), 0, 2**bits - 1)
    codes = torch.where((s > 0).unsqueeze(1), codes, torch.full_like(codes, off))  # s = 0: any code decodes to 0
    scale_bytes = scale.view(torch.uint8).view(-1, 2) if scale.numel() else scale.view(torch.uint8).view(0, 2)
    return rice.pack_indices(idx, rows.shape[1], indices), rice.pack_bits(codes.to(torch.int64), bits), scale_bytes


def _decode_rows(ib: torch.Tensor, cb: torch.Tensor, sb: torch.Tensor, k: int, c: int, bits: int, indices="rice"):
    """Inverse of ``_encode_rows``: index, code and scale bytes of n_rows chunks -> (indices, values), each
    (n_rows, k): the kept entries of each chunk (``sb`` must be contiguous and 2-byte aligned). The values are
    never -0 (a half-integer times s > 0, or times s = 0: +0), so adding them or scattering them is the same."""
    idx, codes = rice.unpack_rows(ib, cb, k, c, bits, indices)
    s = sb.view(torch.bfloat16).float().view(-1)
    _, off = _levels(bits)
    return idx, (codes.float() + (0.5 - off)) * s.unsqueeze(1)


def _kernel_here(device: torch.device) -> bool:
    """Is the compiled ``sparse_encode`` used for a tensor on ``device``?"""
    return device.type == "cpu" and kernels.have_extension("cpu") and _has_op()


def _kernel_encode(flat: torch.Tensor, chunk: int, density: float, bits: int, indices: str = "rice") -> torch.Tensor:
    """``encode`` of a non-empty flat fp32 CPU tensor by the compiled kernel (``_kernel_here``); with Rice-coded
    indices it writes their codes itself (``rice_b``, ``compress/rice.py``)."""
    n = flat.numel()
    c, k, _ = layout(n, chunk, density)
    out = torch.empty(tensor_payload_bytes(n, chunk, density, bits, indices), dtype=torch.uint8)
    torch.ops.dilocox.sparse_encode(flat.contiguous(), out, c, k, bits, rice.kernel_param(c, k, indices))
    return out


def encode(
    e: torch.Tensor, chunk: int, density: float, bits: int, use_kernel: bool = True, indices: str = "rice"
) -> torch.Tensor:
    """One tensor's payload (uint8) from its error-fed values ``e`` (any shape, fp32): the compiled CPU kernel
    (csrc/sparse_cpu.cpp) when the extension is built, else the vectorised torch ops (any device)."""
    flat = e.reshape(-1).float()
    n = flat.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.uint8, device=e.device)
    c, k, n_c = layout(n, chunk, density)
    if use_kernel and _kernel_here(flat.device):
        return _kernel_encode(flat, chunk, density, bits, indices)
    padded = torch.zeros(n_c * c, dtype=torch.float32, device=e.device)
    padded[:n] = flat
    return torch.cat([t.reshape(-1) for t in _encode_rows(padded.view(n_c, c), k, bits, indices)])


def decode_accumulate(
    payload: torch.Tensor, out: torch.Tensor, chunk: int, density: float, bits: int, indices: str = "rice"
) -> None:
    """``out += decode(payload)`` for one tensor (``out`` flat fp32 of the tensor's numel)."""
    n = out.numel()
    if n == 0:
        return
    c, k, n_c = layout(n, chunk, density)
    ib_bytes, cb_bytes = rice.row_bytes(c, k, indices), -(-k * bits // 8)
    a, b = n_c * ib_bytes, n_c * (ib_bytes + cb_bytes)
    sb = payload[b : b + 2 * n_c].clone().view(n_c, 2)  # (clone: the slice may be unaligned)
    ib, cb = payload[:a].view(n_c, ib_bytes), payload[a:b].view(n_c, cb_bytes)
    idx, vals = _decode_rows(ib, cb, sb, k, c, bits, indices)
    dense = torch.zeros(n_c, c, dtype=torch.float32, device=out.device).scatter_(1, idx, vals)
    out.add_(dense.view(-1)[:n])


def load_error_buffers(sd: dict, shapes: list[torch.Size]) -> list[torch.Tensor] | None:
    """The error-feedback buffers of a compressor's ``state_dict`` (``{"errors": {"0": tensor, ...}}``), checked
    against this shard's tensor shapes; None when the state holds none."""
    errs = sd.get("errors") or {}
    if not errs:
        return None
    if len(errs) != len(shapes):
        raise ValueError(f"compressor state has {len(errs)} error buffers, this shard has {len(shapes)} tensors")
    out = []
    for i, s in enumerate(shapes):
        e = errs[str(i)]
        if e.shape != s:
            raise ValueError(f"error buffer {i} has shape {tuple(e.shape)}, expected {tuple(s)}")
        out.append(e.detach().clone().float())
    return out


def _l1_norms(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensors' L1 norms (None for no tensor), one read of the data (a fused kernel on a GPU) and no host sync:
    a NaN or inf entry makes its tensor's norm non-finite, as does a |sum| past the fp32 limit (~3.4e38: a run that
    far gone has diverged too)."""
    return torch.stack(torch._foreach_norm(tensors, 1)) if tensors else None


def _all_finite(*norms: torch.Tensor | None) -> list[bool]:
    """For each vector of ``_l1_norms``, are all of them finite; one host sync for all the vectors."""
    flags = [torch.isfinite(n).all() for n in norms if n is not None]
    read = iter(torch.stack(flags).tolist() if flags else ())
    return [True if n is None else next(read) for n in norms]


class _Groups:
    """A compressor's tensors grouped by chunk size C, each group's chunks the rows of one (rows, C) matrix.

    The compressor keeps its error buffers in these matrices (each tensor's chunks contiguous, its last chunk
    zero-padded; ``errors`` are views of them), so one sync encodes and decodes a few dozen tensor ops per group
    and row block, not per tensor: on a GPU the per-tensor loop was ~6,000 kernel launches and ~140 host syncs per
    fragment sync of GPT-2 small (the `dilocox` preset at 27 % of plain training's tokens/s, docs/BENCHMARKS.md
    §13). Rows are independent in the wire format, so the bytes are those of ``encode`` tensor by tensor (tested).
    Row blocks of at most ``block_elems`` elements bound the encoder's temporaries (~6 x a block's fp32 bytes)."""

    def __init__(self, shapes: list[torch.Size], chunk: int, density: float, bits: int, indices="rice") -> None:
        numels = [s.numel() for s in shapes]
        by_c: dict[int, list[int]] = {}
        for i, n in enumerate(numels):
            if n:
                by_c.setdefault(layout(n, chunk, density)[0], []).append(i)
        self.shapes, self.numels, self.bits, self.indices = shapes, numels, bits, indices
        self.groups: list[tuple[int, int, int]] = []  # (C, k, rows)
        self.place: dict[int, tuple[int, int, int]] = {}  # tensor -> (group, first row, chunks)
        for g, (c, members) in enumerate(by_c.items()):
            row = 0
            for i in members:
                n_c = -(-numels[i] // c)
                self.place[i] = (g, row, n_c)
                row += n_c
            self.groups.append((c, layout(c, chunk, density)[1], row))
        self.widths = [(rice.row_bytes(c, k, indices), -(-k * bits // 8)) for c, k, _ in self.groups]
        self.offsets = [0]  # each tensor's payload offset (wire order: tensor by tensor)
        for n in numels:
            self.offsets.append(self.offsets[-1] + tensor_payload_bytes(n, chunk, density, bits, indices))

    def buffers(self, device) -> list[torch.Tensor]:
        return [torch.zeros(rows, c, dtype=torch.float32, device=device) for c, _, rows in self.groups]

    def view(self, bufs: list[torch.Tensor], i: int) -> torch.Tensor:
        """Tensor ``i``'s values (its shape) inside the group matrices ``bufs``."""
        if i not in self.place:
            return bufs[0].new_zeros(self.shapes[i]) if bufs else torch.zeros(self.shapes[i])
        g, r0, _ = self.place[i]
        c = self.groups[g][0]
        return bufs[g].view(-1)[r0 * c : r0 * c + self.numels[i]].view(self.shapes[i])

    def kept(self, g: int, keep: int = 1) -> int:
        """Entries kept per chunk of group ``g`` at ``keep`` x its k (at most the chunk)."""
        c, k, _ = self.groups[g]
        return min(c, keep * k)

    def row_widths(self, g: int, keep: int = 1) -> tuple[int, int]:
        """(index bytes, code bytes) of one encoded row (chunk) of group ``g`` at ``keep`` x its k (+ 2 scale bytes)."""
        k = self.kept(g, keep)
        return rice.row_bytes(self.groups[g][0], k, self.indices), -(-k * self.bits // 8)

    def encode_rows(self, g: int, rows: torch.Tensor, keep: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``_encode_rows`` of rows of group ``g``'s matrix, keeping ``keep`` x its k per row."""
        return _encode_rows(rows, self.kept(g, keep), self.bits, self.indices)

    def decode_rows(self, g: int, ib: torch.Tensor, cb: torch.Tensor, sb: torch.Tensor, keep: int = 1):
        """``_decode_rows`` of rows of group ``g`` (encoded at ``keep`` x its k): (indices, values)."""
        return _decode_rows(ib, cb, sb, self.kept(g, keep), self.groups[g][0], self.bits, self.indices)

    def pads(self, bufs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The zero padding of each tensor's last chunk inside ``bufs`` (views; empty list when none is padded)."""
        out = []
        for i, (g, r0, n_c) in self.place.items():
            c = self.groups[g][0]
            if n_c * c > self.numels[i]:
                out.append(bufs[g].view(-1)[r0 * c + self.numels[i] : (r0 + n_c) * c])
        return out

    def blocks(self, g: int, block_elems: int):
        c, _, rows = self.groups[g]
        step = max(1, block_elems // c)
        return [(r, min(rows, r + step)) for r in range(0, rows, step)]

    def encode(self, bufs: list[torch.Tensor], block_elems: int) -> torch.Tensor:
        """The payload of the matrices ``bufs`` (the torch encoder, any device), tensor by tensor on the wire."""
        parts = []
        for g, (c, k, _) in enumerate(self.groups):
            blk = [_encode_rows(bufs[g][a:b], k, self.bits, self.indices) for a, b in self.blocks(g, block_elems)]
            parts.append([torch.cat(x) if len(x) > 1 else x[0] for x in zip(*blk)])
        pieces = []
        for i in sorted(self.place):
            g, r0, n_c = self.place[i]
            pieces += [t[r0 : r0 + n_c].reshape(-1) for t in parts[g]]
        return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.uint8)

    def decode(self, payload: torch.Tensor, g: int, block_elems: int):
        """Group ``g``'s chunks of ``payload``: yields ((first row, end row), (indices, values)) block by block."""
        c, k, rows = self.groups[g]
        wi, wc = self.widths[g]
        ib, cb, sb = [], [], []
        for i in sorted(self.place):
            gi, _, n_c = self.place[i]
            if gi != g:
                continue
            o = self.offsets[i]
            ib.append(payload[o : o + n_c * wi])
            cb.append(payload[o + n_c * wi : o + n_c * (wi + wc)])
            sb.append(payload[o + n_c * (wi + wc) : o + n_c * (wi + wc + 2)])
        ib, cb, sb = (torch.cat(x).view(rows, -1) for x in (ib, cb, sb))  # (cat: fresh, so sb is aligned)
        for a, b in self.blocks(g, block_elems):
            yield (a, b), _decode_rows(ib[a:b], cb[a:b], sb[a:b], k, c, self.bits, self.indices)


class SparseCompressor:
    """``compress.sparse``: a codec (``compress/codec.py``) for the rule above."""

    lossy = True

    def __init__(
        self,
        shapes: list[torch.Size],
        chunk: int,
        density: float,
        bits: int,
        ef_decay: float,
        collective: str = "allgather",
        owner_keep: int = 1,
        indices: str = "rice",
    ) -> None:
        if indices not in rice.INDEX_CODES:
            raise ValueError(f"compress.sparse.indices={indices!r} is not one of {list(rice.INDEX_CODES)}")
        if collective not in COLLECTIVES:
            raise ValueError(
                f"compress.collective={collective!r} with compress.sparse is not one of {list(COLLECTIVES)}"
            )
        if bits not in SPARSE_BITS:
            raise ValueError(f"compress.sparse.bits={bits} is not one of {list(SPARSE_BITS)}")
        if not 0 < density <= 1:
            raise ValueError(f"compress.sparse.density={density} must be in (0, 1]")
        if chunk < 2:
            raise ValueError(f"compress.sparse.chunk={chunk} must be >= 2")
        self.shapes = [torch.Size(s) for s in shapes]
        self.chunk, self.density, self.bits, self.ef_decay = int(chunk), float(density), int(bits), float(ef_decay)
        self.kind = f"top{density:g}/int{bits}"
        self.collective = collective  # allgather | reduce_scatter (compress/sparse_rs.py: bytes flat in R)
        self._owner = sparse_rs.OwnerResidual()
        self.owner_keep = int(owner_keep)  # the reduce-scatter's owner keeps owner_keep x k entries of the mean
        if self.owner_keep < 1:
            raise ValueError(f"compress.sparse.owner_keep={owner_keep} must be >= 1")
        # the error buffers: None, or one per tensor - views of the group matrices ``_err`` when this compressor
        # made them; anything else (a checkpoint's, a reset to None) is copied into fresh matrices at the next sync
        self.errors: list[torch.Tensor] | None = None
        self._err: list[torch.Tensor] = []
        self._views: list[torch.Tensor] | None = None
        self.indices = indices  # rice | fixed: the index block (compress/rice.py)
        self._groups = _Groups(self.shapes, self.chunk, self.density, self.bits, indices)
        self._sizes = [
            tensor_payload_bytes(s.numel(), self.chunk, self.density, self.bits, indices) for s in self.shapes
        ]
        self.use_kernel = True  # the compiled CPU encoder on CPU tensors (False: the batched torch ops everywhere)
        self._kernel_on: dict[str, bool] = {}  # device type -> is the compiled encoder there (_kernel_here)
        self.block_elems = 1 << 25

    def payload_bytes(self, rank: int | None = None) -> int:
        return sum(self._sizes)

    def wire_bytes(self, world: int, rank: int | None = None) -> int:
        if self.collective == "reduce_scatter" and world > 1:
            return sparse_rs.wire_bytes(self._groups, world, self.owner_keep)
        return (world - 1) * self.payload_bytes() if world > 1 else 0

    def allreduce_mean(
        self, tensors: list[torch.Tensor], wire: Wire | None, step: int, stats: CommStats | None = None
    ) -> list[torch.Tensor]:
        """Sparse mean of ``tensors`` over ``wire``'s members (blocking; module docstring). Bit-identical on each."""
        if len(tensors) != len(self.shapes) or any(t.shape != s for t, s in zip(tensors, self.shapes)):
            raise ValueError(
                f"allreduce_mean got tensors of shapes {[tuple(t.shape) for t in tensors]}, "
                f"the compressor was built for {[tuple(s) for s in self.shapes]}"
            )
        if not tensors:
            return []
        t0 = time.perf_counter()
        device, gr = tensors[0].device, self._groups
        self._own_buffers(device)
        vs = [tensors[i].detach().float() for i in gr.place]
        v_norms = _l1_norms(vs)
        mine_e = [self.errors[i] for i in gr.place]
        torch._foreach_mul_(mine_e, self.ef_decay)
        torch._foreach_add_(mine_e, vs)
        del vs
        # both checks read with one host sync, before anything is encoded or sent (on a GPU each sync waits for the
        # training's queued kernels). A failed check stops the run; the buffers it changed are not saved (a
        # checkpoint refuses non-finite tensors, checkpoint/state.py)
        v_ok, e_ok = _all_finite(v_norms, _l1_norms(self._err))
        if not v_ok:
            raise ValueError("the pseudo-gradient has NaN/inf entries: the inner steps diverged")
        if not e_ok:
            raise ValueError("the error-feedback buffer overflowed (|pseudo-gradient| near the fp32 limit)")
        if self.collective == "reduce_scatter" and wire is not None and (world := wire.size()) > 1:
            out = sparse_rs.sync(gr, self._err, wire, self._owner, self.ef_decay, self.block_elems, self.owner_keep)
            if stats is not None:
                b = self.wire_bytes(world)
                stats.add(b, b, time.perf_counter() - t0)
            return [gr.view(out, i).to(t.dtype) for i, t in enumerate(tensors)]
        if device.type not in self._kernel_on:  # (asked once per device, not once per call or tensor)
            self._kernel_on[device.type] = _kernel_here(device)
        if self.use_kernel and self._kernel_on[device.type]:
            mine = torch.cat(
                [
                    _kernel_encode(e.reshape(-1), self.chunk, self.density, self.bits, self.indices)
                    for e in self.errors
                    if e.numel()
                ]
                or [torch.zeros(0, dtype=torch.uint8)]
            )
        else:
            mine = gr.encode(self._err, self.block_elems)
        bufs, me = exchange(wire, mine)
        world = len(bufs)
        acc = [torch.empty_like(e) for e in self._err]
        for r, b in enumerate(bufs):  # decoded and summed in rank order: the same bits on every rank
            for g in range(len(gr.groups)):
                for (lo, hi), (idx, vals) in gr.decode(b, g, self.block_elems):
                    if r == 0:  # 0 + the first payload: the payload itself
                        acc[g][lo:hi].zero_().scatter_(1, idx, vals)
                    else:
                        acc[g][lo:hi].scatter_add_(1, idx, vals)  # (k distinct indices per row: one add each)
                    if r == me:  # e -= what this rank sent (its own payload, decoded)
                        self._err[g][lo:hi].scatter_add_(1, idx, vals.neg_())
        for pad in gr.pads(self._err):  # (a kept padding entry decodes to s/2: the padding stays zero)
            pad.zero_()
        for a in acc:
            a.div_(world)
        if stats is not None:
            wire = self.wire_bytes(world)
            stats.add(wire, wire, time.perf_counter() - t0)
        return [gr.view(acc, i).to(t.dtype) for i, t in enumerate(tensors)]

    def _own_buffers(self, device) -> None:
        """Make ``errors`` views of this compressor's group matrices on ``device`` (zeros, or a copy of what
        ``errors`` holds: a checkpoint's buffers, or its own on another device)."""
        if self.errors is not None and self.errors is self._views and self._err and self._err[0].device == device:
            return
        gr, old = self._groups, self.errors
        self._err = gr.buffers(device)
        self._views = self.errors = [gr.view(self._err, i) for i in range(len(self.shapes))]
        if old is not None:
            for i in gr.place:
                self.errors[i].copy_(old[i])
        else:  # a fresh start or a reset (a heal or a join: a trajectory this replica left): the owner's too
            self._owner = sparse_rs.OwnerResidual()

    def state_dict(self) -> dict:
        sd: dict = {"rank": 0, "errors": {}}
        if self.errors is not None:
            sd["errors"] = {str(i): e.clone() for i, e in enumerate(self.errors)}
        if self.collective == "reduce_scatter" and (owner := self._owner.state_dict()):
            sd["owner"] = owner
        return sd

    def load_state_dict(self, sd: dict) -> None:
        self.errors = load_error_buffers(sd, self.shapes)
        self._owner.load_state_dict(sd.get("owner") or {})


@register("sparse", enabled=lambda ccfg: ccfg.sparse.enabled)
def _build(ccfg, shapes, seed, ids) -> SparseCompressor:
    sp = ccfg.sparse
    # auto stays the all-gather: at R = 2 the reduce-scatter sends the same bytes and adds the owner's second top-k
    collective = "reduce_scatter" if ccfg.collective == "reduce_scatter" else "allgather"
    return SparseCompressor(shapes, sp.chunk, sp.density, sp.bits, sp.ef_decay, collective, sp.owner_keep, sp.indices)
