"""Quantization of flat fp32 pseudo-gradients for the wire (DiLoCoX int4 compression).

Kinds (ALGORITHMS.md §6):

* ``int4`` / ``int8``: group quantization, groups of ``group_size`` (default 128), one bf16
  scale ``s = bf16(absmax/7)`` (int8: ``/127``) per group, ``q = clamp(rint(v/s))``;
  payload ``[packed | scales]``, 4 + 16/G (int8: 8 + 16/G) bits per element. The DiLoCoX
  paper compresses pseudo-gradients to int4 this way; CocktailSGD likewise quantizes with
  per-group scales and error feedback.
* ``fp16``: plain cast (payload = the fp16 bytes).
* ``none``: the fp32 bytes, unchanged.

Error feedback (worker side): pass ``error`` (fp32, same numel, updated in place): the
quantizer sends ``Q(x + error)`` and leaves ``error = (x + error) - deq(Q(x + error))``, so
over many steps ``sum(sent) + error == sum(x)`` (nothing is lost, only delayed).

Stochastic rounding (``stochastic=True``, int kinds only) draws ``u`` from a counter-based
hash of ``(seed, step, element index)`` - identical on CPU, CUDA and in the reference.

NaN/inf in ``x + error`` raise ``ValueError`` instead of silently poisoning the sum; after
such an error the contents of ``error`` are unspecified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dilocox.compress import kernels
from dilocox.config import QUANT_KINDS

_BITS = {"int4": 4, "int8": 8}


@dataclass
class Packed:
    """One compressed tensor: ``data`` is the uint8 wire payload of ``numel`` fp32 elements."""

    kind: str
    numel: int
    group_size: int
    data: torch.Tensor

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())


def _check_kind(kind: str, group_size: int) -> None:
    if kind not in QUANT_KINDS:
        raise ValueError(f"unknown quantization kind {kind!r}; expected one of {list(QUANT_KINDS)}")
    if kind in _BITS:
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {group_size!r}")
        if kind == "int4" and group_size % 2:
            raise ValueError(f"int4 needs an even group_size (two values per byte), got {group_size}")


def payload_nbytes(kind: str, numel: int, group_size: int = 128) -> int:
    """Exact size in bytes of ``quantize(x, kind, group_size).data`` for ``numel`` elements."""
    _check_kind(kind, group_size)
    if numel <= 0:
        return 0
    if kind == "none":
        return 4 * numel
    if kind == "fp16":
        return 2 * numel
    return kernels.quant_bytes(numel, _BITS[kind]) + 2 * kernels.num_groups(numel, group_size)


def _nonfinite_error(kind: str, what: str) -> ValueError:
    return ValueError(f"non-finite value in tensor passed to {kind} quantize (pseudo-gradient has NaN/inf): {what}")


def quantize(
    x: torch.Tensor,
    kind: str,
    group_size: int = 128,
    error: torch.Tensor | None = None,
    stochastic: bool = False,
    seed: int = 0,
    step: int = 0,
    use_kernel: bool = True,
    out: torch.Tensor | None = None,
    check_finite: bool = True,
) -> Packed:
    """Compress the fp32 tensor ``x`` (read flat). See the module docstring.

    error: fp32 residual buffer (same numel, contiguous, same device), updated in place.
    use_kernel=False forces the pure-torch reference. out: optional preallocated uint8
    payload of ``payload_nbytes(...)`` bytes (e.g. a slice of a send buffer).
    check_finite=False skips the NaN/inf check (on CUDA it costs one host sync).
    """
    _check_kind(kind, group_size)
    if x.dtype != torch.float32:
        raise ValueError(f"quantize expects a float32 tensor, got {x.dtype}")
    x = x.contiguous()
    n = x.numel()
    if error is not None:
        if error.dtype != torch.float32 or not error.is_contiguous() or error.numel() != n:
            raise ValueError(
                f"error buffer must be a contiguous float32 tensor with {n} elements, "
                f"got dtype={error.dtype} numel={error.numel()} contiguous={error.is_contiguous()}"
            )
        if error.device != x.device:
            raise ValueError(f"error buffer is on {error.device}, x on {x.device}")
    if stochastic and kind not in _BITS:
        raise ValueError(f"stochastic rounding is only defined for int4/int8, not {kind!r}")
    nbytes = payload_nbytes(kind, n, group_size)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    elif out.dtype != torch.uint8 or out.numel() != nbytes or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"out must be a contiguous uint8 tensor of {nbytes} bytes on {x.device}")

    if kind in _BITS:
        nbad = kernels.ef_quantize_pack(
            x, error, out, group_size, _BITS[kind], stochastic, seed, step, use_kernel=use_kernel
        )
        if check_finite:
            bad = int(nbad)
            if bad:
                raise _nonfinite_error(
                    kind,
                    f"{bad} of {kernels.num_groups(n, group_size)} groups of {group_size} contain NaN/inf (numel={n})",
                )
        return Packed(kind, n, group_size, out)

    v = x.view(-1) if error is None else x.view(-1) + error.view(-1)
    if check_finite and n and not bool(torch.isfinite(v).all()):
        bad = int((~torch.isfinite(v)).sum())
        raise _nonfinite_error(kind, f"{bad} of {n} elements are NaN/inf")
    if kind == "fp16":
        h = v.to(torch.float16)
        if check_finite and n and not bool(torch.isfinite(h).all()):
            raise ValueError(
                f"fp16 quantize: values overflow the fp16 range (|v| max {float(v.abs().max()):.4g} > 65504)"
            )
        out.copy_(h.view(torch.uint8))
        if error is not None:
            error.view(-1).copy_(v - h.to(torch.float32))
    else:  # none: exact fp32 bytes; nothing is left behind
        out.copy_(v.view(torch.uint8))
        if error is not None:
            error.zero_()
    return Packed(kind, n, group_size, out)


def _typed_view(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a uint8 payload as ``dtype``; copies when the slice is misaligned."""
    size = torch.empty((), dtype=dtype).element_size()
    if data.storage_offset() % size or data.data_ptr() % size or not data.is_contiguous():
        data = data.clone()
    return data.view(dtype)


def _check_packed(p: Packed) -> None:
    _check_kind(p.kind, p.group_size)
    expect = payload_nbytes(p.kind, p.numel, p.group_size)
    if p.data.dtype != torch.uint8 or p.data.numel() != expect:
        raise ValueError(
            f"Packed({p.kind}, numel={p.numel}, G={p.group_size}) needs a uint8 payload of "
            f"{expect} bytes, got dtype={p.data.dtype} with {p.data.numel()} elements"
        )


def _dequant(p: Packed, out: torch.Tensor, accumulate: bool, use_kernel: bool = True) -> torch.Tensor:
    _check_packed(p)
    if out.dtype != torch.float32 or out.numel() != p.numel or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous float32 tensor with {p.numel} elements, "
            f"got dtype={out.dtype} numel={out.numel()} contiguous={out.is_contiguous()}"
        )
    if out.device != p.data.device:
        raise ValueError(f"out is on {out.device}, payload on {p.data.device}")
    if p.numel == 0:
        return out
    if p.kind in _BITS:
        data = p.data if p.data.is_contiguous() else p.data.contiguous()
        kernels.dequantize_into(data, out, p.group_size, _BITS[p.kind], accumulate, use_kernel=use_kernel)
        return out
    src = _typed_view(p.data, torch.float16 if p.kind == "fp16" else torch.float32).view(out.shape)
    if accumulate:
        out.add_(src.to(torch.float32))
    else:
        out.copy_(src)
    return out


def dequantize(p: Packed, out: torch.Tensor | None = None, use_kernel: bool = True) -> torch.Tensor:
    """Decode ``p`` to a flat fp32 tensor (written into ``out`` when given)."""
    if out is None:
        out = torch.empty(p.numel, dtype=torch.float32, device=p.data.device)
    return _dequant(p, out, accumulate=False, use_kernel=use_kernel)


def dequantize_accumulate(p: Packed, out: torch.Tensor, use_kernel: bool = True) -> torch.Tensor:
    """``out += dequantize(p)`` in one pass (receive side of a quantized all-reduce)."""
    return _dequant(p, out, accumulate=True, use_kernel=use_kernel)
