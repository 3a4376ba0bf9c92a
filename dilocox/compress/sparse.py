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
blocks for its n_c chunks: the k indices of each chunk, each in ceil(log2 C) bits, packed LSB-first into
ceil(k·ib/8) bytes per chunk; the k codes of each chunk in b bits, packed the same way into ceil(k·b/8) bytes;
the n_c scales as little-endian bf16. ``payload_bytes`` counts exactly those bytes; a sync sends (R − 1) ×
payload (all-gather), which ``CommStats`` records. At density 1/64, b = 2, C = 4096: 114 bytes per 4096
elements, 144x fewer than fp32 per sync.

``encode`` runs the compiled CPU kernel ``torch.ops.dilocox.sparse_encode`` (csrc/sparse_cpu.cpp) when the
extension is built, else the vectorised torch ops (any device: top-k per chunk, ties to the lower index; packing
with tensor ops); ``decode_accumulate`` is torch ops. ``reference_encode``/``reference_decode`` beside them are
plain per-chunk Python loops of the same rule; the tests compare all three byte for byte.
"""

from __future__ import annotations

import math
import time

import torch

from dilocox.compress import kernels
from dilocox.compress.collectives import CommStats, _all_gather
from dilocox.distributed.topology import group_rank, group_world

SPARSE_BITS = (2, 4, 8)


def _has_op() -> bool:  # (an extension built before the op existed lacks it)
    return hasattr(torch.ops.dilocox, "sparse_encode")


def layout(numel: int, chunk: int, density: float) -> tuple[int, int, int]:
    """(chunk size C, kept per chunk k, chunks n_c) of a tensor of ``numel`` elements."""
    c = max(1, min(int(chunk), int(numel)))
    k = max(1, min(c, math.ceil(density * c - 1e-9)))
    return c, k, -(-int(numel) // c)


def index_bits(c: int) -> int:
    return max(1, (c - 1).bit_length())


def tensor_payload_bytes(numel: int, chunk: int, density: float, bits: int) -> int:
    """Bytes one tensor puts on the wire (module docstring)."""
    if numel == 0:
        return 0
    c, k, n_c = layout(numel, chunk, density)
    return n_c * (-(-k * index_bits(c) // 8) + -(-k * bits // 8) + 2)


def _pack_bits(vals: torch.Tensor, nbits: int) -> torch.Tensor:
    """(rows, k) non-negative ints < 2^nbits -> (rows, ceil(k·nbits/8)) uint8, LSB-first bit order."""
    rows, k = vals.shape
    shifts = torch.arange(nbits, device=vals.device, dtype=torch.int32)
    bitmat = ((vals.to(torch.int32).unsqueeze(-1) >> shifts) & 1).to(torch.uint8).reshape(rows, k * nbits)
    nbytes = -(-k * nbits // 8)
    pad = nbytes * 8 - k * nbits
    if pad:
        bitmat = torch.cat([bitmat, bitmat.new_zeros(rows, pad)], dim=1)
    weights = (1 << torch.arange(8, device=vals.device, dtype=torch.int32)).to(torch.uint8)
    return (bitmat.view(rows, nbytes, 8) * weights).sum(-1, dtype=torch.int32).to(torch.uint8)


def _unpack_bits(raw: torch.Tensor, k: int, nbits: int) -> torch.Tensor:
    """Inverse of ``_pack_bits``: (rows, nbytes) uint8 -> (rows, k) int64."""
    rows = raw.shape[0]
    shifts = torch.arange(8, device=raw.device, dtype=torch.int32)
    bitmat = ((raw.to(torch.int32).unsqueeze(-1) >> shifts) & 1).reshape(rows, -1)[:, : k * nbits]
    weights = 1 << torch.arange(nbits, device=raw.device, dtype=torch.int64)
    return (bitmat.view(rows, k, nbits).to(torch.int64) * weights).sum(-1)


def _levels(bits: int) -> tuple[float, float]:
    """(h, offset): s = absmax / h; code = floor(v / s + offset); value = (code + 0.5 − offset) · s."""
    return (2**bits - 1) / 2.0, float(2 ** (bits - 1))


def _topk_indices(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the indices (ascending) of the k largest entries, ties to the lower index: every entry above the
    row's k-th largest value, then the lowest-index entries equal to it (so the payload is a function of e alone,
    whatever order ``torch.topk`` breaks ties in; 12x faster than a stable sort of the rows)."""
    thr = torch.topk(mag, k, dim=1).values[:, -1:]
    above = mag > thr
    equal = mag == thr
    room = k - above.sum(1, keepdim=True)
    chosen = above | (equal & (torch.cumsum(equal.to(torch.int32), 1) <= room))
    return chosen.nonzero()[:, 1].view(mag.shape[0], k)


def encode(e: torch.Tensor, chunk: int, density: float, bits: int, use_kernel: bool = True) -> torch.Tensor:
    """One tensor's payload (uint8) from its error-fed values ``e`` (any shape, fp32): the compiled CPU kernel
    (csrc/sparse_cpu.cpp) when the extension is built, else the vectorised torch ops below (any device)."""
    flat = e.reshape(-1).float()
    n = flat.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.uint8, device=e.device)
    c, k, n_c = layout(n, chunk, density)
    if use_kernel and flat.device.type == "cpu" and kernels.have_extension("cpu") and _has_op():
        out = torch.empty(tensor_payload_bytes(n, chunk, density, bits), dtype=torch.uint8)
        torch.ops.dilocox.sparse_encode(flat.contiguous(), out, c, k, bits)
        return out
    padded = torch.zeros(n_c * c, dtype=torch.float32, device=e.device)
    padded[:n] = flat
    rows = padded.view(n_c, c)
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
    return torch.cat(
        [
            _pack_bits(idx, index_bits(c)).reshape(-1),
            _pack_bits(codes.to(torch.int64), bits).reshape(-1),
            scale.view(torch.uint8).reshape(-1) if scale.numel() else scale.view(torch.uint8),
        ]
    )


def decode_accumulate(payload: torch.Tensor, out: torch.Tensor, chunk: int, density: float, bits: int) -> None:
    """``out += decode(payload)`` for one tensor (``out`` flat fp32 of the tensor's numel)."""
    n = out.numel()
    if n == 0:
        return
    c, k, n_c = layout(n, chunk, density)
    ib_bytes, cb_bytes = -(-k * index_bits(c) // 8), -(-k * bits // 8)
    a, b = n_c * ib_bytes, n_c * (ib_bytes + cb_bytes)
    idx = _unpack_bits(payload[:a].view(n_c, ib_bytes), k, index_bits(c))
    codes = _unpack_bits(payload[a:b].view(n_c, cb_bytes), k, bits)
    s = payload[b : b + 2 * n_c].clone().view(torch.bfloat16).float()  # (clone: the slice may be unaligned)
    _, off = _levels(bits)
    vals = (codes.float() + (0.5 - off)) * s.unsqueeze(1)
    dense = torch.zeros(n_c, c, dtype=torch.float32, device=out.device)
    dense.scatter_(1, idx, vals)
    out.add_(dense.view(-1)[:n])


# --------------------------------------------------------------------------- the plain reference


def reference_encode(e: torch.Tensor, chunk: int, density: float, bits: int) -> torch.Tensor:
    """``encode`` as plain loops over chunks, entries and bits (the test's oracle)."""
    flat = [float(x) for x in e.reshape(-1).float().tolist()]
    n = len(flat)
    if n == 0:
        return torch.zeros(0, dtype=torch.uint8)
    c, k, n_c = layout(n, chunk, density)
    h, off = _levels(bits)
    ib = index_bits(c)
    idx_bytes, code_bytes, scales = [], [], []

    def pack(values: list[int], nbits: int) -> list[int]:
        out = [0] * (-(-len(values) * nbits // 8))
        for j, v in enumerate(values):
            for t in range(nbits):
                if (v >> t) & 1:
                    pos = j * nbits + t
                    out[pos // 8] |= 1 << (pos % 8)
        return out

    for r in range(n_c):
        row = [flat[r * c + j] if r * c + j < n else 0.0 for j in range(c)]
        order = sorted(range(c), key=lambda j: (-abs(row[j]), j))[:k]
        kept = sorted(order)
        vals = [row[j] for j in kept]
        f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731 - every op rounded to fp32 as in encode
        s_bf16 = (f32(max(abs(v) for v in vals)) / f32(h)).to(torch.bfloat16)
        s = s_bf16.float()
        codes = [min(2**bits - 1, max(0, math.floor(float(f32(v) / s + f32(off))))) if s > 0
                 else int(off) for v in vals]  # fmt: skip
        idx_bytes += pack(kept, ib)
        code_bytes += pack(codes, bits)
        scales.append(s_bf16)
    sc = torch.stack(scales).view(torch.uint8).reshape(-1).tolist()
    return torch.tensor(idx_bytes + code_bytes + sc, dtype=torch.uint8)


def reference_decode(payload: torch.Tensor, numel: int, chunk: int, density: float, bits: int) -> torch.Tensor:
    """``decode_accumulate`` into zeros, as plain loops."""
    out = [0.0] * numel
    if numel == 0:
        return torch.zeros(0)
    c, k, n_c = layout(numel, chunk, density)
    ib = index_bits(c)
    ib_bytes, cb_bytes = -(-k * ib // 8), -(-k * bits // 8)
    raw = payload.tolist()
    _, off = _levels(bits)

    def unpack(data: list[int], count: int, nbits: int) -> list[int]:
        return [sum(((data[(j * nbits + t) // 8] >> ((j * nbits + t) % 8)) & 1) << t for t in range(nbits))
                for j in range(count)]  # fmt: skip

    base_codes, base_scales = n_c * ib_bytes, n_c * (ib_bytes + cb_bytes)
    for r in range(n_c):
        idx = unpack(raw[r * ib_bytes : (r + 1) * ib_bytes], k, ib)
        codes = unpack(raw[base_codes + r * cb_bytes : base_codes + (r + 1) * cb_bytes], k, bits)
        s = float(payload[base_scales + 2 * r : base_scales + 2 * r + 2].clone().view(torch.bfloat16).float())
        for j, q in zip(idx, codes):
            v = float(torch.tensor((q + 0.5 - off), dtype=torch.float32) * torch.tensor(s, dtype=torch.float32))
            if r * c + j < numel:
                out[r * c + j] += v
    return torch.tensor(out, dtype=torch.float32)


# --------------------------------------------------------------------------- the compressor


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


class SparseCompressor:
    """``compress.sparse``: the ``Compressor`` interface (``build_compressor``) for the rule above."""

    lowrank = None  # (plan/payloads.py asks)
    tail_sketch = False

    def __init__(self, shapes: list[torch.Size], chunk: int, density: float, bits: int, ef_decay: float) -> None:
        if bits not in SPARSE_BITS:
            raise ValueError(f"compress.sparse.bits={bits} is not one of {list(SPARSE_BITS)}")
        if not 0 < density <= 1:
            raise ValueError(f"compress.sparse.density={density} must be in (0, 1]")
        if chunk < 2:
            raise ValueError(f"compress.sparse.chunk={chunk} must be >= 2")
        self.shapes = [torch.Size(s) for s in shapes]
        self.chunk, self.density, self.bits, self.ef_decay = int(chunk), float(density), int(bits), float(ef_decay)
        self.kind = f"top{density:g}/int{bits}"
        self.errors: list[torch.Tensor] | None = None
        self._sizes = [tensor_payload_bytes(s.numel(), self.chunk, self.density, self.bits) for s in self.shapes]

    rank = 0
    lossy = True

    def sigmas(self) -> list[torch.Tensor]:
        return []

    def max_rank(self) -> int:
        return 0

    def tail_energy(self):
        return None

    def set_rank(self, r: int) -> None:
        pass

    def payload_bytes(self, rank: int | None = None) -> int:
        return sum(self._sizes)

    def wire_bytes(self, world: int, rank: int | None = None) -> int:
        return (world - 1) * self.payload_bytes() if world > 1 else 0

    def allreduce_mean(
        self, tensors: list[torch.Tensor], group, step: int, stats: CommStats | None = None
    ) -> list[torch.Tensor]:
        """Sparse mean of ``tensors`` over ``group`` (blocking; module docstring). Bit-identical on every rank."""
        if len(tensors) != len(self.shapes) or any(t.shape != s for t, s in zip(tensors, self.shapes)):
            raise ValueError(
                f"allreduce_mean got tensors of shapes {[tuple(t.shape) for t in tensors]}, "
                f"the compressor was built for {[tuple(s) for s in self.shapes]}"
            )
        if not tensors:
            return []
        t0 = time.perf_counter()
        device = tensors[0].device
        if self.errors is None:
            self.errors = [torch.zeros(s, dtype=torch.float32, device=device) for s in self.shapes]
        if self.errors[0].device != device:
            self.errors = [e.to(device) for e in self.errors]
        vs = [t.detach().float() for t in tensors]
        if not all(bool(torch.isfinite(v).all()) for v in vs):  # (checked before any buffer changes)
            raise ValueError("the pseudo-gradient has NaN/inf entries: the inner steps diverged")
        for e, v in zip(self.errors, vs):
            e.mul_(self.ef_decay).add_(v)
        if not all(bool(torch.isfinite(e).all()) for e in self.errors):
            raise ValueError("the error-feedback buffer overflowed (|pseudo-gradient| near the fp32 limit)")
        mine = torch.cat([encode(e, self.chunk, self.density, self.bits) for e in self.errors])
        world = group_world(group)
        if world > 1:
            bufs = [torch.empty_like(mine) for _ in range(world)]
            _all_gather(bufs, mine, group)
        else:
            bufs = [mine]
        outs = [torch.zeros(s.numel(), dtype=torch.float32, device=device) for s in self.shapes]
        offs = [0]
        for n in self._sizes:
            offs.append(offs[-1] + n)
        for r, b in enumerate(bufs):  # decoded and summed in rank order: the same bits on every rank
            for i, out in enumerate(outs):
                decode_accumulate(b[offs[i] : offs[i + 1]], out, self.chunk, self.density, self.bits)
        me = 0 if world <= 1 else group_rank(group)
        for i, e in enumerate(self.errors):  # e -= what this rank sent (its own payload, decoded)
            sent = torch.zeros(e.numel(), dtype=torch.float32, device=device)
            decode_accumulate(bufs[me][offs[i] : offs[i + 1]], sent, self.chunk, self.density, self.bits)
            e.sub_(sent.view(e.shape))
        if stats is not None:
            wire = self.wire_bytes(world)
            stats.add(wire, wire, time.perf_counter() - t0)
        return [(o / world).view(s).to(t.dtype) for o, s, t in zip(outs, self.shapes, tensors)]

    def state_dict(self) -> dict:
        sd: dict = {"rank": 0, "errors": {}}
        if self.errors is not None:
            sd["errors"] = {str(i): e.clone() for i, e in enumerate(self.errors)}
        return sd

    def load_state_dict(self, sd: dict) -> None:
        self.errors = load_error_buffers(sd, self.shapes)
