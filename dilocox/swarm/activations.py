"""Compression of the activations and activation-gradients sent between SWARM stages.

Kinds (``swarm`` activation codec):

* ``none``: the fp32 bytes (4 per element).
* ``fp16``: a cast (2 per element); values beyond the fp16 range raise instead of becoming inf.
* ``int8``: blockwise absmax quantization, as the SWARM paper sends activations and their
  gradients (§4.3 and Appendix J, after Dettmers et al. 2021, "8-bit optimizers via block-wise
  quantization"): the flat tensor is cut in blocks of ``block`` elements, each with one scale
  ``s = bf16(absmax_block / 127)`` and ``q = clamp(rint(x / s), -127, 127)``; 1 + 2/block bytes per
  element. The paper uses Dettmers' dynamic (non-linear) 8-bit code; this is the linear absmax
  code of ``dilocox/compress`` (the same compiled kernels and bit layout as the int8
  pseudo-gradient quantizer: ``[int8 values | bf16 scales]``), which the issue asks for.
  Per-block error: ``|x - dec(enc(x))| <= s/2`` where ``|x| <= 127 s``, and ``<= absmax - 127 s
  <= absmax * 2^-8`` where the bf16 rounding made ``127 s`` fall short of the absmax; together
  ``<= absmax / 254 * (1 + 2^-8)`` (plus fp32 rounding of ``s*q``).

``encode(t, kind, block)`` returns ``(payload, meta)``: a flat uint8 tensor (what goes on the
wire; ``payload.numel() == wire_bytes(t.numel(), kind, block)``) and an ``ActMeta`` (kind, shape,
dtype, block) that ``decode(payload, meta)`` needs; ``meta.to_dict()``/``ActMeta.from_dict`` give a
plain form for the RPC header. No error feedback: every activation is sent once.

``use_kernel=False`` runs the pure-torch reference of ``dilocox/compress/kernels.py`` instead of the
compiled ops (the two agree bit for bit; tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dilocox.compress import quant

KINDS = ("none", "fp16", "int8")
DEFAULT_BLOCK = 2048  # Dettmers et al. 2021 use blocks of 2048 for their blockwise 8-bit code

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True)
class ActMeta:
    """What ``decode`` needs besides the payload."""

    kind: str
    shape: tuple[int, ...]
    dtype: str  # the sender's dtype, restored on decode (e.g. "float32", "bfloat16")
    block: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def to_dict(self) -> dict:
        return {"kind": self.kind, "shape": list(self.shape), "dtype": self.dtype, "block": self.block}

    @staticmethod
    def from_dict(d: dict) -> ActMeta:
        return ActMeta(str(d["kind"]), tuple(int(s) for s in d["shape"]), str(d["dtype"]), int(d["block"]))


def check_codec(kind: str, block: int = DEFAULT_BLOCK) -> None:
    if kind not in KINDS:
        raise ValueError(f"activation codec {kind!r} is not one of {list(KINDS)}")
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"activation codec block={block!r} must be a positive int (elements per int8 scale)")


def wire_bytes(numel: int, kind: str, block: int = DEFAULT_BLOCK) -> int:
    """Bytes of ``encode(t, kind, block)[0]`` for a tensor of ``numel`` elements."""
    check_codec(kind, block)
    return quant.payload_nbytes(kind, int(numel), block)


def encode(
    t: torch.Tensor, kind: str, block: int = DEFAULT_BLOCK, use_kernel: bool = True
) -> tuple[torch.Tensor, ActMeta]:
    """Compress a floating-point tensor for the wire; returns ``(uint8 payload, meta)``."""
    check_codec(kind, block)
    if not t.is_floating_point():
        raise ValueError(f"activation codec: expected a floating-point tensor, got {t.dtype}")
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"activation codec: dtype {t.dtype} is not one of {list(_DTYPES)}")
    x = t.detach().to(torch.float32).contiguous().view(-1)
    try:
        packed = quant.quantize(x, kind, block, use_kernel=use_kernel)
    except ValueError as e:  # quant's message talks about pseudo-gradients; say what this is
        raise ValueError(f"activation codec {kind}: cannot encode tensor of shape {tuple(t.shape)}: {e}") from None
    return packed.data, ActMeta(kind, tuple(int(s) for s in t.shape), dtype, block)


def decode(payload: torch.Tensor, meta: ActMeta, use_kernel: bool = True) -> torch.Tensor:
    """The tensor ``encode`` was given (exact for ``none``), on the payload's device, in the sender's dtype."""
    check_codec(meta.kind, meta.block)
    if meta.dtype not in _DTYPES:
        raise ValueError(f"activation codec: dtype {meta.dtype!r} is not one of {list(_DTYPES)}")
    expect = wire_bytes(meta.numel, meta.kind, meta.block)
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != expect:
        raise ValueError(
            f"activation payload for {meta.kind} shape {meta.shape} must be a flat uint8 tensor of {expect} bytes, "
            f"got {payload.dtype} with {payload.numel()} elements (truncated or mismatched message?)"
        )
    p = quant.Packed(meta.kind, meta.numel, meta.block, payload.contiguous())
    out = quant.dequantize(p, use_kernel=use_kernel)
    return out.view(meta.shape).to(_DTYPES[meta.dtype])


def roundtrip(t: torch.Tensor, kind: str, block: int = DEFAULT_BLOCK, use_kernel: bool = True) -> torch.Tensor:
    """``decode(*encode(t))``: what the receiver sees (for tests and single-process emulation)."""
    payload, meta = encode(t, kind, block, use_kernel)
    return decode(payload, meta, use_kernel)
