"""The index block of the sparse codec: fixed-width indices, or Rice-coded gaps (``compress.sparse.indices``).

Each chunk of C entries sends the k indices it keeps, ascending. ``fixed`` writes each in ceil(log2 C) bits.
``rice`` writes the gaps between them, d_1 = i_1 and d_j = i_j − i_{j−1} − 1, each as a Rice code of parameter b
(Golomb 1966, Rice 1979; Sattler et al. 2019, "Sparse Binary Compression", code the positions of a sparse update
the same way): q = d >> b one-bits, a zero, then the b low bits of d (most significant first). The gaps of one
chunk sum to at most C − k, so their quotients sum to at most ⌊(C − k) / 2^b⌋, and a row's code never exceeds

    k·(b + 1) + ⌊(C − k) / 2^b⌋ bits

whatever the indices are: the row has that fixed size (zero-padded to whole bytes), so every replica's payload
keeps the same length, the all-gather needs no size exchange (no extra round trip), and nothing is dropped. b is
the value that makes the bound smallest (≈ log2((C − k)·ln 2 / k)). At C = 4,096 and k = 32 (the `dilocox`
preset's 1/128) that is b = 6: 32·7 + ⌊4,064 / 64⌋ = 287 → 288 bits per row, 9 bits an index against 12: 36
bytes against 48, 12 of the 58 bytes of a chunk's payload with 2-bit values (21 %).
The coding is lossless: the decoded indices, hence the training, are bit-identical to ``fixed``. Where the bound
is not smaller than the fixed width (tiny chunks, k close to C), ``rice`` keeps the fixed layout (``use_rice``),
so it never costs more.

Bits are packed LSB-first into bytes, as the fixed layout's (``pack_bits``). ``pack``/``unpack`` run the
compiled CPU kernels ``torch.ops.dilocox.rice_pack``/``rice_unpack`` (csrc/rice_cpu.cpp: one sequential scan per
row, rows in parallel) on CPU tensors when the extension is built, else ``pack_torch``/``unpack_torch``, the
vectorised torch ops (rows of chunks at once, any device; the decoder finds where each of the k codes of a row
starts by pointer doubling over the row's bit positions, in ceil(log2 k) rounds, not k passes);
``reference_pack``/``reference_unpack`` are the same codes as plain Python loops. The tests compare all three byte
for byte, on valid rows and on damaged ones (bits past a row's end read as zeros everywhere).
"""

from __future__ import annotations

import functools

import torch

from dilocox.compress import kernels

INDEX_CODES = ("rice", "fixed")


@functools.cache  # (pure functions of a few ints, called per tensor per sync)
def index_bits(c: int) -> int:
    """Bits of one fixed-width index of a chunk of ``c`` entries."""
    return max(1, (c - 1).bit_length())


@functools.cache  # (pure functions of a few ints, called per tensor per sync)
def param(c: int, k: int) -> int:
    """The Rice parameter b of a chunk of ``c`` entries keeping ``k``: the b in [0, index_bits(c)] (the smallest
    on a tie) with the smallest bound k·(b + 1) + ⌊(c − k) / 2^b⌋."""
    return min(range(index_bits(c) + 1), key=lambda b: (k * (b + 1) + ((c - k) >> b), b))


def rice_row_bits(c: int, k: int) -> int:
    """The bound on one row's Rice code (module docstring), at b = ``param(c, k)``."""
    b = param(c, k)
    return k * (b + 1) + ((c - k) >> b)


@functools.cache  # (pure functions of a few ints, called per tensor per sync)
def use_rice(c: int, k: int, indices: str) -> bool:
    """Is a chunk of ``c`` keeping ``k`` Rice-coded under ``compress.sparse.indices=indices``?"""
    if indices not in INDEX_CODES:
        raise ValueError(f"compress.sparse.indices={indices!r} is not one of {list(INDEX_CODES)}")
    return indices == "rice" and -(-rice_row_bits(c, k) // 8) < -(-k * index_bits(c) // 8)


@functools.cache  # (pure functions of a few ints, called per tensor per sync)
def row_bytes(c: int, k: int, indices: str) -> int:
    """Bytes of one chunk's index block."""
    return -(-(rice_row_bits(c, k) if use_rice(c, k, indices) else k * index_bits(c)) // 8)


@functools.cache
def kernel_param(c: int, k: int, indices: str) -> int:
    """The compiled encoder's ``rice_b`` argument: b for a Rice-coded chunk, -1 for fixed-width indices."""
    return param(c, k) if use_rice(c, k, indices) else -1


def pack_indices(idx: torch.Tensor, c: int, indices: str) -> torch.Tensor:
    """(rows, k) ascending indices of chunks of ``c`` -> their index blocks, (rows, ``row_bytes``) uint8."""
    return pack(idx, c) if use_rice(c, idx.shape[1], indices) else pack_bits(idx, index_bits(c))


def unpack_indices(raw: torch.Tensor, k: int, c: int, indices: str) -> torch.Tensor:
    """Inverse of ``pack_indices``: (rows, ``row_bytes``) uint8 -> (rows, k) int64."""
    return unpack(raw, k, c) if use_rice(c, k, indices) else unpack_bits(raw, k, index_bits(c))


def unpack_rows(ib: torch.Tensor, cb: torch.Tensor, k: int, c: int, bits: int, indices: str):
    """The integers of encoded rows of chunks of ``c``: their index blocks ``ib`` and ``bits``-bit code blocks
    ``cb`` -> (indices, codes), each (rows, k) int64."""
    return unpack_indices(ib, k, c, indices), unpack_bits(cb, k, bits)


def pack_bits(vals: torch.Tensor, nbits: int) -> torch.Tensor:
    """(rows, k) non-negative ints < 2^nbits -> (rows, ceil(k·nbits/8)) uint8, LSB-first bit order (fixed-width
    indices, and the sparse codec's value codes)."""
    rows, k = vals.shape
    shifts = torch.arange(nbits, device=vals.device, dtype=torch.int32)
    bitmat = ((vals.to(torch.int32).unsqueeze(-1) >> shifts) & 1).to(torch.uint8).reshape(rows, k * nbits)
    nbytes = -(-k * nbits // 8)
    pad = nbytes * 8 - k * nbits
    if pad:
        bitmat = torch.cat([bitmat, bitmat.new_zeros(rows, pad)], dim=1)
    return _bytes_of(bitmat)


def unpack_bits(raw: torch.Tensor, k: int, nbits: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: (rows, nbytes) uint8 -> (rows, k) int64."""
    bitmat = _bits_of(raw)[:, : k * nbits]
    weights = 1 << torch.arange(nbits, device=raw.device, dtype=torch.int64)
    return (bitmat.view(raw.shape[0], k, nbits) * weights).sum(-1)


def _bytes_of(bitmat: torch.Tensor) -> torch.Tensor:
    """(rows, 8·n) 0/1 uint8 -> (rows, n) uint8, LSB-first."""
    rows = bitmat.shape[0]
    weights = (1 << torch.arange(8, device=bitmat.device, dtype=torch.int32)).to(torch.uint8)
    return (bitmat.view(rows, bitmat.shape[1] // 8, 8) * weights).sum(-1, dtype=torch.int32).to(torch.uint8)


def _bits_of(raw: torch.Tensor) -> torch.Tensor:
    """(rows, n) uint8 -> (rows, 8·n) int64 0/1, LSB-first."""
    shifts = torch.arange(8, device=raw.device, dtype=torch.int32)
    return ((raw.to(torch.int32).unsqueeze(-1) >> shifts) & 1).reshape(raw.shape[0], 8 * raw.shape[1]).to(torch.int64)


def pack_torch(idx: torch.Tensor, c: int) -> torch.Tensor:
    """(rows, k) ascending indices in [0, c) -> (rows, row_bytes(c, k, "rice")) uint8 Rice codes."""
    rows, k = idx.shape
    b = param(c, k)
    width = 8 * -(-rice_row_bits(c, k) // 8)
    if rows == 0:
        return torch.zeros(0, width // 8, dtype=torch.uint8, device=idx.device)
    idx = idx.to(torch.int64)
    prev = torch.cat([idx.new_full((rows, 1), -1), idx[:, :-1]], dim=1)
    d = idx - prev - 1
    q = d >> b
    start = torch.cumsum(q + 1 + b, dim=1) - (q + 1 + b)  # where each code begins
    edges = torch.zeros(rows, width + 1, dtype=torch.int64, device=idx.device)
    edges.scatter_add_(1, start, torch.ones_like(start))  # +1 where a unary run begins, -1 where it ends
    edges.scatter_add_(1, start + q, -torch.ones_like(start))
    bitmat = torch.cumsum(edges, dim=1)[:, :width].to(torch.uint8)
    if b:
        t = torch.arange(b, device=idx.device)
        pos = (start + q + 1).unsqueeze(-1) + t  # the b low bits after the zero, most significant first
        low = (d.unsqueeze(-1) >> (b - 1 - t)) & 1
        bitmat.scatter_(1, pos.reshape(rows, -1), low.reshape(rows, -1).to(torch.uint8))
    return _bytes_of(bitmat)


def unpack_torch(raw: torch.Tensor, k: int, c: int) -> torch.Tensor:
    """Inverse of ``pack``: (rows, row bytes) uint8 -> (rows, k) int64 indices. A damaged row decodes to the
    indices ``reference_unpack`` reads (bits past the row's end read as zeros): strictly ascending, never negative,
    possibly >= c (the caller's scatter refuses those); it never reads outside the row.

    Where each code starts depends on the codes before it, so a walk code by code takes k passes (k tiny kernels
    each: ~9k launches per row block on a GPU). Instead every bit position p of a row is decoded as if a code
    started there: its gap d(p) (the run of ones from p, then the b bits after the zero) and the position
    next(p) where the following code starts; positions at or past the row's end all behave as the end does (a
    zero, gap 0), so they are one position, W. The starts of codes 0..k-1 are next^i(0), which pointer doubling
    gives in ceil(log2 k) rounds (next^(2^j) by composing next^(2^(j-1)) with itself, each round moving the starts
    whose i has bit j): about the same number of kernels whatever k is (~90), none of them waiting for the host."""
    rows = raw.shape[0]
    b = param(c, k)
    if rows == 0:
        return torch.zeros(0, k, dtype=torch.int64, device=raw.device)
    bits = _bits_of(raw)
    width = bits.shape[1]  # W: the row's end, standing for every position at or past it (bit W and beyond: zeros)
    bits = torch.cat([bits, bits.new_zeros(rows, 1 + b)], dim=1)  # (b more zeros: a code's low bits past the end)
    pos = torch.arange(width + 1, device=raw.device)
    zero_at = torch.where(bits[:, : width + 1] == 0, pos, torch.full_like(pos, width))
    z = torch.flip(torch.cummin(torch.flip(zero_at, [1]), dim=1).values, [1])  # first zero at or after p (<= W)
    gap = (z - pos) << b
    for t in range(b):  # the b low bits after the zero, most significant first (past the end: zeros)
        gap = gap + (bits.gather(1, (z + 1 + t).clamp(max=width + b)) << (b - 1 - t))
    nxt = (z + 1 + b).clamp(max=width)  # (from W itself: W, a gap of 0)
    starts = torch.zeros(rows, k, dtype=torch.int64, device=raw.device)
    i = torch.arange(k, device=raw.device)
    j = 0
    while (1 << j) < k:  # nxt holds next^(2^j)
        starts = torch.where(((i >> j) & 1).bool(), nxt.gather(1, starts), starts)
        j += 1
        if (1 << j) < k:
            nxt = nxt.gather(1, nxt)
    return torch.cumsum(gap.gather(1, starts) + 1, dim=1) - 1  # i_j = i_{j-1} + d_j + 1, i_{-1} = -1


def _kernel_here(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and kernels.have_extension("cpu") and hasattr(torch.ops.dilocox, "rice_unpack")


def pack(idx: torch.Tensor, c: int) -> torch.Tensor:
    """(rows, k) ascending indices in [0, c) -> (rows, row_bytes(c, k, "rice")) uint8 Rice codes (the compiled
    kernel on CPU when built, else ``pack_torch``)."""
    if not _kernel_here(idx):
        return pack_torch(idx, c)
    rows, k = idx.shape
    out = torch.empty(rows, -(-rice_row_bits(c, k) // 8), dtype=torch.uint8)
    torch.ops.dilocox.rice_pack(idx.to(torch.int64).contiguous(), out, c, param(c, k))
    return out


def unpack(raw: torch.Tensor, k: int, c: int) -> torch.Tensor:
    """Inverse of ``pack``: (rows, row bytes) uint8 -> (rows, k) int64 indices (``unpack_torch``'s rule for a damaged
    row: bits past its end read as zeros)."""
    if not _kernel_here(raw):
        return unpack_torch(raw, k, c)
    out = torch.empty(raw.shape[0], k, dtype=torch.int64)
    torch.ops.dilocox.rice_unpack(raw.contiguous(), out, c, param(c, k))
    return out


def reference_pack(idx: list[int], c: int) -> list[int]:
    """``pack`` of one row, as plain loops: the bytes."""
    k = len(idx)
    b = param(c, k)
    bits: list[int] = []
    prev = -1
    for i in idx:
        d = i - prev - 1
        prev = i
        bits += [1] * (d >> b) + [0] + [(d >> (b - 1 - t)) & 1 for t in range(b)]
    nbytes = -(-rice_row_bits(c, k) // 8)
    assert len(bits) <= 8 * nbytes, "the bound of the module docstring"
    bits += [0] * (8 * nbytes - len(bits))
    return [sum(bits[8 * j + t] << t for t in range(8)) for j in range(nbytes)]


def reference_unpack(data: list[int], k: int, c: int) -> list[int]:
    """``unpack`` of one row, as plain loops: the indices."""
    b = param(c, k)
    bits = [(byte >> t) & 1 for byte in data for t in range(8)]
    out, prev, p = [], -1, 0
    for _ in range(k):
        q = 0
        while p < len(bits) and bits[p] == 1:
            q, p = q + 1, p + 1
        p += 1
        low = 0
        for _t in range(b):
            low = (low << 1) | (bits[p] if p < len(bits) else 0)
            p += 1
        prev = prev + ((q << b) | low) + 1
        out.append(prev)
    return out
