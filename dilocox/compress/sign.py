"""``compress.sign``: scaled sign with error feedback (EF-signSGD), the smallest codec (``compress/codec.py``).

Per outer sync, for each tensor i of the shard (flat, fp32), with its error buffer e_i:

    m = Δ_i + e_i
    per block b of ``block`` consecutive values (the last block of a tensor may be short; a block never spans two
    tensors, so a tensor replicated on every TP rank gets the same bits on each):
        s_b = mean(|m_b|)                                    one fp32 scale
        sent_b = s_b · sign(m_b)                             sign(0) = +1
    e_i = m − sent                                           what was not sent is kept for the next sync

The message of one tensor is ``[scales: 4 bytes per block | sign bits: 8 per byte, LSB first, padded to whole
bytes per block]``; the members all-gather their messages and every member decodes and sums them **in member
order**, then divides by the member count, so the mean is bit-identical on every member. Bytes per message:
``Σ_i nblocks_i · (4 + block/8)`` (≈ 1.125 bits per value at block 256: 28× fewer than fp32).

The rule is Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression Schemes" (ICML 2019):
the scale is the l1 norm over the count, their Algorithm 2's compressor applied per block. ``reference_encode`` /
``reference_decode`` are the same rule written value by value in plain Python (tests compare them).
"""

from __future__ import annotations

import struct
import time

import torch
import torch.nn.functional as F

from dilocox.compress.codec import Wire, exchange, register
from dilocox.compress.collectives import CommStats
from dilocox.compress.sparse import load_error_buffers

_BITS = 1 << torch.arange(8, dtype=torch.int32)  # bit j of a byte is value 8k + j of the block


def nblocks(numel: int, block: int) -> int:
    return -(-numel // block)


def message_bytes(numel: int, block: int) -> int:
    """Bytes of one tensor's message: a scale and ``block / 8`` bytes of signs per block."""
    return nblocks(numel, block) * (4 + block // 8)


def encode(m: torch.Tensor, block: int) -> torch.Tensor:
    """The message (uint8) of one flat fp32 tensor ``m`` (module docstring)."""
    n = m.numel()
    nb = nblocks(n, block)
    if nb == 0:  # an empty tensor: an empty message
        return torch.zeros(0, dtype=torch.uint8, device=m.device)
    x = F.pad(m, (0, nb * block - n)).view(nb, block)
    counts = torch.full((nb,), float(block), dtype=torch.float64, device=m.device)
    counts[-1] = n - (nb - 1) * block
    scales = x.abs().sum(1, dtype=torch.float64).div_(counts).float()  # (float64: the reference's sum, exactly)
    bits = (x >= 0).view(nb, block // 8, 8).to(torch.int32).mul_(_BITS.to(m.device)).sum(2).to(torch.uint8)
    return torch.cat([scales.view(torch.uint8), bits.view(-1)])


def decode(payload: torch.Tensor, numel: int, block: int) -> torch.Tensor:
    """The values (flat fp32, ``numel``) of one tensor's message."""
    nb = nblocks(numel, block)
    scales = payload[: 4 * nb]
    if scales.storage_offset() % 4 or scales.data_ptr() % 4:  # (a tensor's message inside a shard's may be unaligned)
        scales = scales.clone()
    scales = scales.view(torch.float32)
    bits = payload[4 * nb :].view(nb, block // 8, 1).to(torch.int32)
    pos = bits.bitwise_and(_BITS.to(payload.device)).ne(0).view(nb, block)
    vals = torch.where(pos, scales[:, None], -scales[:, None])
    return vals.reshape(-1)[:numel]


def reference_encode(m: list[float], block: int) -> bytes:
    """``encode`` value by value in plain Python (the scale's sum in float64, rounded to fp32 once, as ``encode``)."""
    n = len(m)
    out_scales, out_bits = b"", b""
    for b in range(nblocks(n, block)):
        vals = m[b * block : (b + 1) * block]
        out_scales += struct.pack("<f", sum(abs(v) for v in vals) / len(vals))
        vals = vals + [0.0] * (block - len(vals))
        for k in range(block // 8):
            byte = sum(1 << j for j in range(8) if vals[8 * k + j] >= 0)
            out_bits += bytes([byte])
    return out_scales + out_bits


def reference_decode(payload: bytes, numel: int, block: int) -> list[float]:
    nb = nblocks(numel, block)
    out = []
    for b in range(nb):
        (s,) = struct.unpack("<f", payload[4 * b : 4 * b + 4])
        for j in range(block):
            byte = payload[4 * nb + b * (block // 8) + j // 8]
            out.append(s if byte >> (j % 8) & 1 else -s)
    return out[:numel]


class SignCodec:
    """``compress.sign`` as a codec (``compress/codec.py``): the rule of the module docstring per tensor."""

    lossy = True

    def __init__(self, shapes: list[torch.Size], block: int = 256) -> None:
        if block < 8 or block % 8:
            raise ValueError(f"compress.sign.block={block} must be a multiple of 8 (8 sign bits per byte)")
        self.shapes, self.block = [torch.Size(s) for s in shapes], int(block)
        self.errors: list[torch.Tensor] | None = None  # allocated at the first sync (the inputs' device)

    def payload_bytes(self, rank: int | None = None) -> int:
        return sum(message_bytes(s.numel(), self.block) for s in self.shapes)

    def wire_bytes(self, world: int, rank: int | None = None) -> int:
        return (world - 1) * self.payload_bytes() if world > 1 else 0

    def allreduce_mean(
        self, tensors: list[torch.Tensor], wire: Wire | None, step: int, stats: CommStats | None = None
    ) -> list[torch.Tensor]:
        if [t.shape for t in tensors] != self.shapes:
            raise ValueError(f"allreduce_mean got shapes {[tuple(t.shape) for t in tensors]}, built for {self.shapes}")
        if not tensors:
            return []
        t0 = time.perf_counter()
        dev = tensors[0].device
        if self.errors is None:
            self.errors = [torch.zeros(s, device=dev) for s in self.shapes]
        elif self.errors[0].device != dev:  # (loaded from a checkpoint)
            self.errors = [e.to(dev) for e in self.errors]
        ms = [t.detach().float().reshape(-1) + e.reshape(-1) for t, e in zip(tensors, self.errors)]
        if not all(bool(torch.isfinite(m).all()) for m in ms):
            raise ValueError("the pseudo-gradient has NaN/inf entries: the inner steps diverged")
        sizes = [message_bytes(m.numel(), self.block) for m in ms]
        mine = torch.cat([encode(m, self.block) for m in ms])
        outs = [torch.zeros_like(m) for m in ms]
        payloads, me = exchange(wire, mine)
        for r, payload in enumerate(payloads):  # member order: the same bits on every member
            for i, part in enumerate(payload.split(sizes)):
                vals = decode(part, ms[i].numel(), self.block)
                outs[i].add_(vals)
                if r == me:
                    self.errors[i] = (ms[i] - vals).view(self.shapes[i])
        world = len(payloads)
        if stats is not None:
            b = self.wire_bytes(world)
            stats.add(b, b, time.perf_counter() - t0)
        return [o.div_(world).view(s).to(t.dtype) for o, s, t in zip(outs, self.shapes, tensors)]

    def state_dict(self) -> dict:
        return {"errors": {str(i): e.clone() for i, e in enumerate(self.errors)} if self.errors is not None else {}}

    def load_state_dict(self, sd: dict) -> None:
        self.errors = load_error_buffers(sd, self.shapes)


@register("sign", enabled=lambda ccfg: ccfg.sign.enabled)
def _build(ccfg, shapes, seed, ids) -> SignCodec:
    return SignCodec(shapes, ccfg.sign.block)
