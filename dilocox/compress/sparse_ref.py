"""The sparse codec's rule as plain per-chunk Python loops (the tests' oracle; ``compress/sparse.py`` has the
vectorised ops and the compiled kernel, ``compress/rice.py`` the index codes)."""

from __future__ import annotations

import math

import torch

from dilocox.compress import rice
from dilocox.compress.sparse import _levels, index_bits, layout


def reference_encode(e: torch.Tensor, chunk: int, density: float, bits: int, indices: str = "rice") -> torch.Tensor:
    """``sparse.encode`` as plain loops over chunks, entries and bits (the test's oracle)."""
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
        idx_bytes += rice.reference_pack(kept, c) if rice.use_rice(c, k, indices) else pack(kept, ib)
        code_bytes += pack(codes, bits)
        scales.append(s_bf16)
    sc = torch.stack(scales).view(torch.uint8).reshape(-1).tolist()
    return torch.tensor(idx_bytes + code_bytes + sc, dtype=torch.uint8)


def reference_decode(
    payload: torch.Tensor, numel: int, chunk: int, density: float, bits: int, indices: str = "rice"
) -> torch.Tensor:
    """``sparse.decode_accumulate`` into zeros, as plain loops."""
    out = [0.0] * numel
    if numel == 0:
        return torch.zeros(0)
    c, k, n_c = layout(numel, chunk, density)
    ib = index_bits(c)
    ib_bytes, cb_bytes = rice.row_bytes(c, k, indices), -(-k * bits // 8)
    raw = payload.tolist()
    _, off = _levels(bits)

    def unpack(data: list[int], count: int, nbits: int) -> list[int]:
        return [sum(((data[(j * nbits + t) // 8] >> ((j * nbits + t) % 8)) & 1) << t for t in range(nbits))
                for j in range(count)]  # fmt: skip

    base_codes, base_scales = n_c * ib_bytes, n_c * (ib_bytes + cb_bytes)
    for r in range(n_c):
        row = raw[r * ib_bytes : (r + 1) * ib_bytes]
        idx = rice.reference_unpack(row, k, c) if rice.use_rice(c, k, indices) else unpack(row, k, ib)
        codes = unpack(raw[base_codes + r * cb_bytes : base_codes + (r + 1) * cb_bytes], k, bits)
        s = float(payload[base_scales + 2 * r : base_scales + 2 * r + 2].clone().view(torch.bfloat16).float())
        for j, q in zip(idx, codes):
            if not 0 <= j < c:  # (a damaged payload: refused, as ``decode_accumulate``'s scatter does)
                raise ValueError(f"chunk {r}: index {j} is outside the chunk of {c}")
            v = float(torch.tensor((q + 0.5 - off), dtype=torch.float32) * torch.tensor(s, dtype=torch.float32))
            if r * c + j < numel:
                out[r * c + j] += v
    return torch.tensor(out, dtype=torch.float32)


def reference_reduce_scatter(
    deltas: list[list[torch.Tensor]],
    errors: list[list[torch.Tensor]],
    residual: dict,
    chunk: int,
    density: float,
    bits: int,
    beta: float,
    owner_keep: int = 1,
) -> list[torch.Tensor]:
    """One sync of every member at once, as plain per-chunk Python: ``deltas[r]``/``errors[r]`` are member r's
    tensors (``errors`` updated in place), ``residual`` maps (tensor, chunk) to the owner's residual chunk (updated).
    Chunks are owned as in ``sparse_rs.sync``: per chunk size, the tensors' chunks in tensor order are one list of
    rows split into R contiguous ranges. Returns the mean every member applies (one list of tensors)."""
    world = len(deltas)
    shapes = [t.shape for t in deltas[0]]
    rows_of: dict[int, list[tuple[int, int]]] = {}  # chunk size -> its rows (tensor, chunk) in order
    for i, s in enumerate(shapes):
        if s.numel():
            c, _, n_c = layout(s.numel(), chunk, density)
            rows_of.setdefault(c, []).extend((i, j) for j in range(n_c))

    def chunk_of(t: torch.Tensor, c: int, j: int) -> torch.Tensor:
        flat = t.reshape(-1)
        piece = torch.zeros(c)
        part = flat[j * c : (j + 1) * c]
        piece[: part.numel()] = part
        return piece

    sent = []  # sent[r][(i, j)] = member r's decoded chunk
    for r in range(world):
        mine = {}
        for i, s in enumerate(shapes):
            e = errors[r][i]
            e.mul_(beta).add_(deltas[r][i].float())
            if not s.numel():
                continue
            c, _, n_c = layout(s.numel(), chunk, density)
            flat = e.reshape(-1)
            for j in range(n_c):
                x = chunk_of(e, c, j)
                d = reference_decode(reference_encode(x, c, density, bits), c, c, density, bits)
                mine[(i, j)] = d
                n = min(c, s.numel() - j * c)
                flat[j * c : j * c + n] -= d[:n]
        sent.append(mine)
    out = [torch.zeros(s) for s in shapes]
    for c, rows in rows_of.items():
        for i, j in rows:
            n = min(c, shapes[i].numel() - j * c)
            m = torch.zeros(c)
            for r in range(world):
                m += sent[r][(i, j)]
            m /= world
            m[n:] = 0.0
            res = residual.setdefault((i, j), torch.zeros(c))
            res.mul_(beta).add_(m)
            k2 = min(c, owner_keep * layout(c, chunk, density)[1])  # the owner keeps owner_keep x k
            d = reference_decode(reference_encode(res, c, k2 / c, bits), c, c, k2 / c, bits)
            res -= d
            res[n:] = 0.0
            out[i].reshape(-1)[j * c : j * c + n] = d[:n]
    return out
