"""CocktailSGD-style per-step gradient compression (ALGORITHMS §8; the baseline of DiLoCoX).

Per inner step, on the flat gradient g of a shard, with the worker's error buffer e:

    v    = g + e
    mask = shared random subset of the indices, fraction p (``random_fraction``), from
           (seed, step): identical on every replica, so it costs nothing on the wire
    top  = top-k by |v| among the K mask survivors, k = ceil(topk_fraction · K)
    send = (positions of ``top`` inside the mask, quantized values)   (§6, ``cfg.quant``)
    e    = v − dense(sent)                                             error feedback
    out  = (1/R) Σ_r dense(sent_r)      all-gather of the payloads, summed in rank order

The mask is *stratified*: the index range is cut into K equal strata and one uniformly
random index is drawn in each, so K = ceil(p·n) exactly, indices come out sorted and
unique, and every element is kept with probability ≈ p — at the cost of K random numbers
instead of n. Top-k positions differ per rank, so they are sent: as a bitmap over the K
survivors (ceil(K/8) bytes) or as int32 positions (4k bytes), whichever is smaller (the
bitmap for k/K > 1/32; e.g. the paper's 0.08 and 0.04). Both are counted.

Values are quantized with ``cfg.quant`` (the CocktailSGD/DiLoCoX setting is int4; ``none``
sends fp32 values). No per-value error feedback inside the quantizer: the single error
buffer ``e`` already sees ``v − dense(sent)``, quantization error included.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from dilocox.compress.collectives import CommStats, group_world, mix_seed, nbytes
from dilocox.compress.quant import Packed, dequantize, quantize


def mask_count(numel: int, random_fraction: float) -> int:
    return min(numel, max(1, math.ceil(random_fraction * numel))) if numel else 0


def topk_count(survivors: int, topk_fraction: float) -> int:
    return min(survivors, max(1, math.ceil(topk_fraction * survivors))) if survivors else 0


def index_encoding(survivors: int, k: int) -> tuple[str, int]:
    """("bitmap" | "int32", bytes) for k positions among ``survivors``: the smaller one."""
    bitmap, ints = -(-survivors // 8), 4 * k
    return ("bitmap", bitmap) if bitmap <= ints else ("int32", ints)


def cocktail_payload_bytes(numel: int, random_fraction: float, topk_fraction: float, kind: str = "int4", group_size: int = 128) -> int:
    """Bytes one rank's message takes (indices + values); the same on every rank and step."""
    K = mask_count(numel, random_fraction)
    k = topk_count(K, topk_fraction)
    return index_encoding(K, k)[1] + nbytes(kind, k, group_size)


def shared_mask(numel: int, random_fraction: float, seed: int, step: int, device: torch.device) -> torch.Tensor:
    """Sorted int64 indices of the stratified random mask for (seed, step); same on every rank."""
    K = mask_count(numel, random_fraction)
    g = torch.Generator(device=device).manual_seed(mix_seed(seed, step))
    u = torch.rand(K, generator=g, device=device, dtype=torch.float64)
    bounds = torch.arange(K + 1, device=device, dtype=torch.int64) * numel // K
    width = bounds[1:] - bounds[:-1]
    return bounds[:-1] + torch.clamp((u * width).long(), max=width - 1)


def _encode_positions(pos: torch.Tensor, survivors: int, enc: str) -> torch.Tensor:
    if enc == "int32":
        return pos.to(torch.int32).view(torch.uint8)
    bits = torch.zeros(-(-survivors // 8) * 8, dtype=torch.uint8, device=pos.device)
    bits[pos] = 1
    weights = (1 << torch.arange(8, device=pos.device, dtype=torch.int32)).to(torch.uint8)
    return (bits.view(-1, 8) * weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def _decode_positions(raw: torch.Tensor, survivors: int, enc: str) -> torch.Tensor:
    if enc == "int32":
        return raw.view(torch.int32).long()
    shifts = torch.arange(8, device=raw.device, dtype=torch.uint8)
    bits = ((raw.unsqueeze(1) >> shifts) & 1).reshape(-1)[:survivors]
    return torch.nonzero(bits, as_tuple=False).reshape(-1)


def _pack_values(vals: torch.Tensor, kind: str, group_size: int) -> torch.Tensor:
    if kind == "none":
        return vals.contiguous().view(torch.uint8)
    return quantize(vals.contiguous(), kind, group_size).data


def _unpack_values(raw: torch.Tensor, k: int, kind: str, group_size: int) -> torch.Tensor:
    if kind == "none":
        return raw.clone().view(torch.float32)
    return dequantize(Packed(kind, k, group_size, raw))


def cocktail_allreduce(grad: torch.Tensor, group, error: torch.Tensor | None, cfg, step: int, stats: CommStats | None = None, seed: int = 0) -> torch.Tensor:
    """Mean over ``group`` of the compressed ``grad`` (flat fp32); ``error`` is updated in place.

    ``cfg`` is a ``CompressConfig`` (random_fraction, topk_fraction, quant, group_size).
    """
    if grad.dtype != torch.float32 or grad.dim() != 1:
        raise ValueError(f"cocktail_allreduce needs a flat fp32 gradient, got {grad.dtype} {tuple(grad.shape)}")
    t0 = time.perf_counter()
    n, kind, G = grad.numel(), cfg.quant, cfg.group_size
    world = group_world(group)
    v = grad + error if error is not None else grad
    mask = shared_mask(n, cfg.random_fraction, seed, step, grad.device)
    K = mask.numel()
    k = topk_count(K, cfg.topk_fraction)
    enc, idx_bytes = index_encoding(K, k)
    surv = v[mask]
    pos = torch.sort(torch.topk(surv.abs(), k, sorted=False).indices).values
    vals_raw = _pack_values(surv[pos], kind, G)
    payload = torch.cat([_encode_positions(pos, K, enc), vals_raw])
    if error is not None:
        error.copy_(v)
        error[mask[pos]] -= _unpack_values(vals_raw, k, kind, G)

    bufs = [payload]
    if world > 1:
        bufs = [torch.empty_like(payload) for _ in range(world)]
        dist.all_gather(bufs, payload, group=group)
    out = torch.zeros(n, dtype=torch.float32, device=grad.device)
    for b in bufs:  # rank order: bit-identical on every rank
        p = _decode_positions(b[:idx_bytes], K, enc)
        out.index_add_(0, mask[p], _unpack_values(b[idx_bytes:], k, kind, G))
    if world > 1:
        out.div_(world)
    if stats is not None:
        sent = (world - 1) * payload.numel()
        stats.add(sent, sent, time.perf_counter() - t0)
    return out
