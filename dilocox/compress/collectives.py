"""Quantized all-reduce over an outer group, with byte and time accounting (ALGORITHMS §6).

int4/int8 payloads cannot be summed on the wire, so a quantized all-reduce is built from
collectives that only *move* bytes:

- ``allgather`` (default for R <= 4): every rank quantizes its vector (worker error
  feedback when ``error`` is given), all-gathers the packed uint8 payloads and
  dequantize-sums them locally in fp32 **in group-rank order**, so every rank computes
  the same bits. Then /R for a mean.
- ``reduce_scatter`` (R > 4): the vector is cut into R group-aligned chunks; chunk j of
  every rank goes to rank j (all-to-all of packed chunks); rank j dequantize-sums its
  chunk in fp32 (rank order), takes the mean, requantizes it with *stochastic* rounding
  (worker error feedback cannot see this hop, so it must be unbiased) and all-gathers
  it. Every rank dequantizes the same gathered bytes, so the result is again identical.
- ``kind="none"``: a plain fp32 ``all_reduce`` (ring), then /R.
- ``kind="fp16"``: handled like int4/int8 (fp16 bytes are all-gathered and summed in
  fp32), so no sum is ever rounded to fp16 on the wire and the result is bit-identical.

The members are reached through a ``Wire`` (``compress/codec.py``; the caller builds it from its process group
with ``dilocox.distributed.wire.wire_of``): nothing here calls ``torch.distributed``. ``wire=None`` means a group
of one member: nothing is sent, but the vector is still quantized and dequantized, so a one-replica run sees the
same compression error as a multi-replica one.

Byte convention (``CommStats``): per rank, the bytes this rank itself puts on (and takes
off) the wire under the collective's algorithm, assuming ring algorithms:

=====================  =========================================  ======================
collective             bytes sent by one rank                     bytes received
=====================  =========================================  ======================
all-gather, b bytes    (R-1)·b                                    (R-1)·b
all-to-all, chunk c    (R-1)·c (own chunk stays local)            (R-1)·c
ring all-reduce, B     ceil(2(R-1)·B/R)                           same
=====================  =========================================  ======================

Chunk payloads are padded to the size of a full chunk (the all-to-all and all-gather
need equal sizes); the padding is on the wire and is counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dilocox.compress.codec import Wire, solo_or
from dilocox.compress.quant import Packed, dequantize, dequantize_accumulate, payload_nbytes, quantize
from dilocox.config import QUANT_KINDS
from dilocox.seeding import mix_seed

MODES = ("auto", "allgather", "reduce_scatter")
AUTO_ALLGATHER_MAX_RANKS = 4  # auto: all-gather up to this many ranks, reduce-scatter above


@dataclass
class CommStats:
    """Per-rank communication counters (see the module docstring for the byte convention).

    ``seconds`` is the wall time of the whole call (quantize + wire + dequantize-sum), on the
    thread that ran it; ``n_calls`` counts collective calls (a low-rank sync makes two).
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    n_calls: int = 0
    seconds: float = 0.0

    def add(self, sent: int, received: int, seconds: float = 0.0, calls: int = 1) -> None:
        self.bytes_sent += int(sent)
        self.bytes_received += int(received)
        self.seconds += float(seconds)
        self.n_calls += calls

    def as_dict(self) -> dict:
        return {
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "n_calls": self.n_calls,
            "seconds": self.seconds,
        }


# --------------------------------------------------------------------------- helpers


def resolve_mode(mode: str, world: int) -> str:
    """``auto`` -> ``allgather`` for R <= 4, else ``reduce_scatter``."""
    if mode not in MODES:
        raise ValueError(f"collective mode={mode!r} is not one of {list(MODES)} (compress.collective)")
    if mode == "auto":
        return "allgather" if world <= AUTO_ALLGATHER_MAX_RANKS else "reduce_scatter"
    return mode


def nbytes(kind: str, numel: int, group_size: int) -> int:
    """Bytes of one packed payload of ``numel`` elements (fp32 for ``none``)."""
    if numel == 0:
        return 0
    if kind == "none":
        return 4 * numel
    return payload_nbytes(kind, numel, group_size)


def chunk_numel(numel: int, world: int, group_size: int) -> int:
    """Elements per reduce-scatter chunk: ceil(n/R) rounded up to whole quantization groups."""
    per = -(-numel // world)
    return -(-per // group_size) * group_size


def _chunk_bounds(numel: int, world: int, group_size: int) -> list[tuple[int, int]]:
    c = chunk_numel(numel, world, group_size)
    return [(min(j * c, numel), min((j + 1) * c, numel)) for j in range(world)]


def wire_bytes(numel: int, world: int, kind: str, group_size: int = 128, mode: str = "allgather") -> int:
    """Bytes one rank sends in ``quantized_allreduce`` of ``numel`` fp32 elements (= received)."""
    if world <= 1 or numel == 0:
        return 0
    if kind == "none":
        return -(-2 * (world - 1) * 4 * numel // world)
    mode = resolve_mode(mode, world)
    if mode == "allgather":
        return (world - 1) * nbytes(kind, numel, group_size)
    pb = nbytes(kind, chunk_numel(numel, world, group_size), group_size)
    return 2 * (world - 1) * pb  # all-to-all + all-gather of padded chunk payloads


def _check_input(x: torch.Tensor, kind: str, op: str, error: torch.Tensor | None) -> None:
    if kind not in QUANT_KINDS:
        raise ValueError(f"quant kind={kind!r} is not one of {list(QUANT_KINDS)} (compress.quant)")
    if op not in ("mean", "sum"):
        raise ValueError(f"op={op!r} must be 'mean' or 'sum'")
    if x.dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous():
        raise ValueError(
            f"quantized_allreduce needs a flat contiguous fp32 tensor, got dtype={x.dtype} shape={tuple(x.shape)}"
        )
    if error is not None and (error.shape != x.shape or error.dtype != torch.float32 or not error.is_contiguous()):
        raise ValueError(
            f"error buffer must be a contiguous fp32 tensor of shape {tuple(x.shape)}, "
            f"got {error.dtype} {tuple(error.shape)}"
        )


# --------------------------------------------------------------------------- the all-reduce


def quantized_allreduce(
    x: torch.Tensor,
    wire: Wire | None,
    kind: str,
    group_size: int = 128,
    mode: str = "allgather",
    op: str = "mean",
    error: torch.Tensor | None = None,
    stats: CommStats | None = None,
    seed: int = 0,
    step: int = 0,
) -> torch.Tensor:
    """All-reduce (mean or sum) of a flat fp32 vector through ``kind`` payloads over the members of ``wire``.

    ``error`` (optional, same shape) is the worker's error-feedback buffer: the vector sent
    is ``v = x + error`` and ``error`` is overwritten in place with ``v - sent``. Returns a
    new tensor, bit-identical on every member of ``wire``. ``x`` is not modified.
    """
    _check_input(x, kind, op, error)
    t0 = time.perf_counter()
    wire = solo_or(wire)
    world = wire.size()
    n = x.numel()
    if n == 0:
        return x.clone()
    mode = resolve_mode(mode, world)
    if kind == "none":
        out = x.clone()
        if error is not None:
            out.add_(error)
            error.zero_()
        if world > 1:
            wire.all_reduce(out)
    elif world == 1:
        out = dequantize(quantize(x, kind, group_size, error=error))
    elif mode == "allgather":
        out = _allgather(x, wire, kind, group_size, error)
    else:
        out = _reduce_scatter(x, wire, kind, group_size, error, seed, step, op == "mean")
    if op == "mean" and world > 1 and (kind == "none" or mode == "allgather"):
        out.div_(world)  # reduce_scatter took the mean before requantizing
    if stats is not None:
        b = wire_bytes(n, world, kind, group_size, mode)
        stats.add(b, b, time.perf_counter() - t0)
    return out


def _allgather(x, wire: Wire, kind, group_size, error) -> torch.Tensor:
    """Quantize, all-gather the packed payloads, dequantize-sum in member order."""
    n = x.numel()
    mine = quantize(x, kind, group_size, error=error)
    bufs = [torch.empty_like(mine.data) for _ in range(wire.size())]
    wire.all_gather(bufs, mine.data)
    out = torch.zeros(n, dtype=torch.float32, device=x.device)
    for b in bufs:
        dequantize_accumulate(Packed(kind, n, group_size, b), out)
    return out


def _reduce_scatter(x, wire: Wire, kind, group_size, error, seed, step, mean) -> torch.Tensor:
    """All-to-all of packed chunks, owner sums + averages + requantizes (stochastic), all-gather."""
    n, world = x.numel(), wire.size()
    bounds = _chunk_bounds(n, world, group_size)
    pb = nbytes(kind, chunk_numel(n, world, group_size), group_size)
    send = torch.zeros(world * pb, dtype=torch.uint8, device=x.device)
    for j, (lo, hi) in enumerate(bounds):
        if hi > lo:
            size = nbytes(kind, hi - lo, group_size)
            quantize(
                x[lo:hi],
                kind,
                group_size,
                error=None if error is None else error[lo:hi],
                out=send[j * pb : j * pb + size],
            )
    recv = torch.empty_like(send)
    wire.all_to_all_single(recv, send)

    me = wire.rank()
    lo, hi = bounds[me]
    mine = torch.zeros(pb, dtype=torch.uint8, device=x.device)
    if hi > lo:
        size = nbytes(kind, hi - lo, group_size)
        acc = torch.zeros(hi - lo, dtype=torch.float32, device=x.device)
        for r in range(world):
            dequantize_accumulate(Packed(kind, hi - lo, group_size, recv[r * pb : r * pb + size]), acc)
        if mean:
            acc.div_(world)
        stochastic = kind in ("int4", "int8")
        quantize(acc, kind, group_size, stochastic=stochastic, seed=mix_seed(seed, me), step=step, out=mine[:size])
    gathered = [torch.empty_like(mine) for _ in range(world)]
    wire.all_gather(gathered, mine)
    out = torch.empty(n, dtype=torch.float32, device=x.device)
    for j, (lo, hi) in enumerate(bounds):
        if hi > lo:
            size = nbytes(kind, hi - lo, group_size)
            dequantize(Packed(kind, hi - lo, group_size, gathered[j][:size]), out=out[lo:hi])
    return out
