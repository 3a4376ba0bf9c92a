"""CocktailSGD-style per-step gradient compression (ALGORITHMS §8; the baseline of DiLoCoX).

Per inner step, on the gradient of a shard (its tensors g_i, flattened and concatenated:
``sizes`` gives their numels) with the worker's error buffer e:

    v    = g + e
    mask = shared random subset of each tensor's indices, fraction p (``random_fraction``),
           from (seed, step): identical on every replica, so it costs nothing on the wire
    top  = per tensor i: top-k_i by |v| among its K_i mask survivors, k_i = ceil(topk_fraction · K_i)
    send = (positions of ``top`` inside the mask, quantized values)   (§6, ``cfg.quant``)
    e    = v − dense(sent)                                             error feedback
    out  = (1/R) Σ_r dense(sent_r)      all-gather of the payloads, summed in rank order

Everything is per tensor, so a tensor's result depends on that tensor alone: the mask of
tensor i is stratified inside it (its range cut into K_i = ceil(p·n_i) equal strata, one
uniformly random index drawn in each, so indices come out sorted and unique and every
element is kept with probability ≈ p, at the cost of K random numbers instead of n), its
top-k competes only with its own survivors, and its k_i values are quantized on their own
(for ``int4``/``int8``: groups of G inside the tensor's values, the last one partial, so a
group never mixes two tensors; the per-tensor payloads go back to back, no padding). A parameter
replicated over the tensor-parallel ranks (norms,
row-parallel biases), with the same gradient on every TP rank, therefore gets the same
update on every TP rank although the ranks' sharded tensors differ. With one segment
(``sizes=None``) this is plain CocktailSGD on the flat vector.

Top-k positions differ per rank, so they are sent: as a bitmap over the K = Σ K_i survivors
(ceil(K/8) bytes) or as int32 positions (4k bytes, k = Σ k_i), whichever is smaller (the
bitmap for k/K > 1/32; e.g. the paper's 0.08 and 0.04). Both are counted
(``cocktail_payload_bytes``: index bytes + Σ_i bytes of k_i quantized values).

Values are quantized with ``cfg.quant`` (the CocktailSGD/DiLoCoX setting is int4; ``none``
sends fp32 values). No per-value error feedback inside the quantizer: the single error
buffer ``e`` already sees ``v − dense(sent)``, quantization error included.
"""

from __future__ import annotations

import math
import time
from typing import Sequence

import torch

from dilocox.compress.codec import Wire, exchange
from dilocox.compress.collectives import CommStats, nbytes
from dilocox.compress.quant import Packed, dequantize, payload_nbytes, quantize
from dilocox.seeding import mix_seed


def mask_count(numel: int, random_fraction: float) -> int:
    return min(numel, max(1, math.ceil(random_fraction * numel))) if numel else 0


def topk_count(survivors: int, topk_fraction: float) -> int:
    return min(survivors, max(1, math.ceil(topk_fraction * survivors))) if survivors else 0


def index_encoding(survivors: int, k: int) -> tuple[str, int]:
    """("bitmap" | "int32", bytes) for k positions among ``survivors``: the smaller one."""
    bitmap, ints = -(-survivors // 8), 4 * k
    return ("bitmap", bitmap) if bitmap <= ints else ("int32", ints)


def _segment_sizes(numel: int, sizes: Sequence[int] | None) -> list[int]:
    """The tensors' numels (one segment of ``numel`` when None); they must add up to ``numel``."""
    if sizes is None:
        return [int(numel)]
    sizes = [int(x) for x in sizes]
    if any(x < 0 for x in sizes) or sum(sizes) != numel:
        raise ValueError(
            f"cocktail segment sizes must be >= 0 and add up to the gradient's numel={numel}, "
            f"got {len(sizes)} sizes summing to {sum(sizes)} (pass the numels of the concatenated tensors)"
        )
    return sizes


def _counts(sizes: list[int], random_fraction: float, topk_fraction: float) -> tuple[list[int], list[int]]:
    """(K_i mask survivors, k_i kept values) per segment."""
    Ks = [mask_count(n, random_fraction) for n in sizes]
    return Ks, [topk_count(K, topk_fraction) for K in Ks]


def cocktail_payload_bytes(
    sizes: int | Sequence[int], random_fraction: float, topk_fraction: float, kind: str = "int4", group_size: int = 128
) -> int:
    """Bytes one rank's message takes (indices + values) for tensors of numels ``sizes``
    (an int: one tensor); the same on every rank and step."""
    sizes = [int(sizes)] if isinstance(sizes, int) else [int(x) for x in sizes]
    Ks, ks = _counts(sizes, random_fraction, topk_fraction)
    return index_encoding(sum(Ks), sum(ks))[1] + sum(nbytes(kind, k, group_size) for k in ks)


def shared_mask(
    numel: int, random_fraction: float, seed: int, step: int, device: torch.device, sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """Sorted int64 indices of the mask for (seed, step), stratified inside each segment of
    ``sizes`` (default: one segment); the same on every rank."""
    sizes = _segment_sizes(numel, sizes)
    Ks = [mask_count(n, random_fraction) for n in sizes]
    K = sum(Ks)
    g = torch.Generator(device=device).manual_seed(mix_seed(seed, step))
    u = torch.rand(K, generator=g, device=device, dtype=torch.float64)
    seg = torch.repeat_interleave(torch.arange(len(sizes), device=device), torch.tensor(Ks, device=device))
    n_seg = torch.tensor(sizes, device=device, dtype=torch.int64)[seg]
    K_seg = torch.tensor(Ks, device=device, dtype=torch.int64)[seg]
    start = (torch.tensor([0] + sizes[:-1], device=device, dtype=torch.int64).cumsum(0))[seg]
    j = (
        torch.arange(K, device=device, dtype=torch.int64)
        - torch.tensor([0] + Ks[:-1], device=device, dtype=torch.int64).cumsum(0)[seg]
    )
    lo, hi = j * n_seg // K_seg, (j + 1) * n_seg // K_seg
    return start + lo + torch.clamp((u * (hi - lo)).long(), max=hi - lo - 1)


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


def _check_positions(ps: list[torch.Tensor], K: int, k: int) -> None:
    """Each member's decoded positions: k of them, each in [0, K). A payload from another member is not trusted: a
    negative int32 position would index ``mask`` from its end without a word, a bitmap may set another count."""
    for r, p in enumerate(ps):
        if p.numel() != k:
            raise ValueError(f"cocktail payload of member {r}: {p.numel()} positions where {k} were due")
    if k and ps and bool(((torch.cat(ps) < 0) | (torch.cat(ps) >= K)).any()):
        raise ValueError(f"cocktail payload: a position outside [0, {K}) (a member sent what no encoder writes)")


def _pack_values(vals: torch.Tensor, ks: list[int], kind: str, group_size: int) -> torch.Tensor:
    """Each tensor's k_i values (consecutive in ``vals``) quantized on their own, back to back."""
    sizes = [nbytes(kind, k, group_size) for k in ks]
    out = torch.empty(sum(sizes), dtype=torch.uint8, device=vals.device)
    lo = 0
    for v, b in zip(vals.split(ks), sizes):
        if b:
            quantize(v.contiguous(), kind, group_size, out=out[lo : lo + b], check_finite=kind != "none")
        lo += b
    return out


def _unpack_values(raw: torch.Tensor, ks: list[int], kind: str, group_size: int) -> torch.Tensor:
    parts, lo = [], 0
    for k in ks:
        b = nbytes(kind, k, group_size)
        parts.append(dequantize(Packed(kind, k, group_size, raw[lo : lo + b])))
        lo += b
    return torch.cat(parts) if parts else raw.new_zeros(0, dtype=torch.float32)


def cocktail_allreduce(
    grad: torch.Tensor,
    wire: Wire | None,
    error: torch.Tensor | None,
    cfg,
    step: int,
    stats: CommStats | None = None,
    seed: int = 0,
    sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Mean over ``wire``'s members of the compressed ``grad`` (flat fp32); ``error`` is updated in place.

    ``cfg`` is a ``CompressConfig`` (random_fraction, topk_fraction, quant, group_size);
    ``sizes`` the numels of the tensors concatenated in ``grad`` (None: one tensor).
    """
    if grad.dtype != torch.float32 or grad.dim() != 1:
        raise ValueError(f"cocktail_allreduce needs a flat fp32 gradient, got {grad.dtype} {tuple(grad.shape)}")
    t0 = time.perf_counter()
    n, kind, G = grad.numel(), cfg.quant, cfg.group_size
    sizes = _segment_sizes(n, sizes)
    v = grad + error if error is not None else grad
    mask = shared_mask(n, cfg.random_fraction, seed, step, grad.device, sizes)
    Ks, ks = _counts(sizes, cfg.random_fraction, cfg.topk_fraction)
    K, k = sum(Ks), sum(ks)
    enc, idx_bytes = index_encoding(K, k)
    surv = v[mask]
    pos_parts, lo = [], 0
    for K_i, k_i in zip(Ks, ks):  # top-k inside each tensor's own survivors
        if k_i:
            top = torch.topk(surv[lo : lo + K_i].abs(), k_i, sorted=False).indices
            pos_parts.append(torch.sort(top).values + lo)
        lo += K_i
    pos = torch.cat(pos_parts) if pos_parts else torch.zeros(0, dtype=torch.int64, device=grad.device)
    vals_raw = _pack_values(surv[pos], ks, kind, G)
    payload = torch.cat([_encode_positions(pos, K, enc), vals_raw])
    if error is not None:
        error.copy_(v)
        error[mask[pos]] -= _unpack_values(vals_raw, ks, kind, G)

    bufs, _ = exchange(wire, payload)
    world = len(bufs)
    out = torch.zeros(n, dtype=torch.float32, device=grad.device)
    ps = [_decode_positions(b[:idx_bytes], K, enc) for b in bufs]  # sorted: tensor by tensor, like the values
    _check_positions(ps, K, k)
    for b, p in zip(bufs, ps):  # rank order: bit-identical on every rank
        out.index_add_(0, mask[p], _unpack_values(b[idx_bytes:], ks, kind, G))
    if world > 1:
        out.div_(world)
    if stats is not None:
        sent = (world - 1) * payload.numel()
        stats.add(sent, sent, time.perf_counter() - t0)
    return out


class CocktailCodec:
    """CocktailSGD as a codec (``compress/codec.py``) of an outer group: the tensors (numels ``sizes``; an int: one
    tensor) are concatenated (per-tensor top-k and groups kept), exchanged with ``cocktail_allreduce`` and split back.
    Its state is the error feedback ``error`` (flat fp32 of every element, updated in place by each call; it stays
    zero with ``compress.error_feedback=false``: what is not sent is dropped)."""

    lossy = True

    def __init__(self, cfg, sizes: int | Sequence[int], seed: int, device: torch.device | None = None) -> None:
        self.cfg, self.seed = cfg, seed
        try:  # at start-up, not on the comm thread at the first step (int4 needs an even group_size)
            payload_nbytes(cfg.quant, 1, cfg.group_size)
        except ValueError as e:
            raise ValueError(f"compress.quant={cfg.quant!r} with compress.group_size={cfg.group_size!r}: {e}") from None
        self.sizes = [int(sizes)] if isinstance(sizes, int) else [int(x) for x in sizes]
        self.error = torch.zeros(sum(self.sizes), dtype=torch.float32, device=device or torch.device("cpu"))

    def payload_bytes(self, rank: int | None = None) -> int:
        c = self.cfg
        return cocktail_payload_bytes(self.sizes, c.random_fraction, c.topk_fraction, c.quant, c.group_size)

    def wire_bytes(self, world: int, rank: int | None = None) -> int:
        return (world - 1) * self.payload_bytes() if world > 1 else 0

    def allreduce_mean(self, tensors: list[torch.Tensor], wire: Wire | None, step: int, stats=None) -> list:
        sizes = [t.numel() for t in tensors]
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        error = self.error if getattr(self.cfg, "error_feedback", True) else None  # compress.error_feedback=false: none
        out = cocktail_allreduce(flat, wire, error, self.cfg, step, stats, self.seed, sizes)
        return [o.view(t.shape) for o, t in zip(out.split(sizes), tensors)]

    def state_dict(self) -> dict:
        return {"error": self.error.detach().cpu().clone()}

    def load_state_dict(self, sd: dict) -> None:
        err = sd["error"]
        if tuple(err.shape) != tuple(self.error.shape):  # (copy_ would broadcast a 1-element buffer silently)
            raise ValueError(
                f"CocktailSGD error buffer has shape {tuple(err.shape)}, expected {tuple(self.error.shape)}"
            )
        self.error.copy_(err)
