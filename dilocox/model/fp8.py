"""Float8 linear layers (``model.linear_backend: fp8 | fp8_all``): per-tensor dynamic scaling.

Forward: ``x`` and ``W`` are each scaled so their absolute max maps to the largest
float8_e4m3fn value (448), cast to fp8 and multiplied by ``torch._scaled_mm`` (Hopper/Ada
tensor cores, fp32 accumulation), which undoes the scales. Backward is a straight-through
estimator: ``dX = dY W`` and ``dW = dY^T X`` in the input precision (so only the forward GEMM
runs in fp8; this keeps the code small at the cost of the two backward GEMMs' speed-up).

``fp8_all`` (``fp8_linear_all``) runs the two backward GEMMs in fp8 too, torchao's dynamic "tensorwise" recipe: the
output gradient is scaled into float8_e5m2 (max 57,344: more range, less precision, for gradients), ``dX = dY W`` and
``dW = dY^T X`` multiply it by the fp8 ``W`` and ``X`` kept from the forward (each linear's saved input in fp8: half
the bytes of bf16; plus its fp8 weight, a byte per parameter). All three GEMMs then run on the fp8 tensor cores; the
scales stay on the device (no host sync). Delayed scaling (an amax history) is not built: torchao deprecated and
deleted it for lack of accuracy and of speed over dynamic scaling once compiled (pytorch/ao#1680; torchtitan#698
measured 6,750 against dynamic's 6,810 tokens/s on Llama 3 8B).

``emulate=True`` quantizes and dequantizes through float8 (e4m3; e5m2 for ``fp8_all``'s gradients) and multiplies
in fp32: same rounding, any device, used by the CPU tests as the reference of the fast path (which this CPU torch runs
too: tests/test_fp8.py holds it to cuBLASLt's layout rules there).
``emulate=None`` (``model.linear_backend: fp8`` or ``fp8_all``) picks the fast path on CUDA devices with compute
capability >= 8.9 and ``torch._scaled_mm``, for weights whose two dims are multiples of 16; elsewhere it emulates,
and says so once per reason and process (a warning of ``dilocox.model.fp8`` naming why: a CPU, an older GPU, a torch
without ``torch._scaled_mm``, a weight's shape), at the model's build (``StageModel``: a ``train.compile`` graph
cannot log) and at a layer's first eager call. It is not refused at config load: the emulation is legitimately used
(the CPU tests of the numerics; SWARM peers, which run on CPU) and what ``train.device: auto`` picks is only known at
run time; a user who asked for fp8 to be fast is told that the run is emulating it instead.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
import torch.nn.functional as F

from dilocox.config import ConfigError

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448.0
E5M2 = torch.float8_e5m2  # gradients (fp8_all): 57,344 at most

log = logging.getLogger("dilocox.model.fp8")
_TOLD: set[str] = set()  # the reasons for emulating told so far (each once per process)


def emulation_reason(device, shape=None) -> str | None:
    """Why ``fp8_linear(emulate=None)`` (or ``fp8_linear_all``) emulates on ``device`` (for a weight of ``shape``, if
    given), or None: it runs the fp8 GEMMs (``torch._scaled_mm``)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the model runs on {device.type}, and fp8 GEMMs (torch._scaled_mm) need a CUDA GPU"
    if not hasattr(torch, "_scaled_mm"):
        return f"this torch ({torch.__version__}) has no torch._scaled_mm"
    cc = torch.cuda.get_device_capability(device)
    if cc < (8, 9):
        name = torch.cuda.get_device_name(device)
        return f"{name} has compute capability {cc[0]}.{cc[1]}; fp8 GEMMs need 8.9 or above (Ada, Hopper)"
    if shape is not None and (shape[0] % 16 or shape[1] % 16):
        return f"a {shape[0]}x{shape[1]} weight is not a multiple of 16 in both dims (torch._scaled_mm needs that)"
    return None


def fp8_supported(device: torch.device) -> bool:
    return emulation_reason(device) is None


def emulating(device, shape=None) -> bool:
    """Whether ``fp8_linear(emulate=None)`` (or ``fp8_linear_all``) emulates (``emulation_reason``); the first time
    for a reason, a warning says why and that the run emulates the fp8 GEMMs (the module docstring)."""
    reason = emulation_reason(device, shape)
    if reason is not None and reason not in _TOLD:
        _TOLD.add(reason)
        log.warning(
            "model.linear_backend=fp8/fp8_all: %s; emulating the fp8 GEMMs instead (quantized through float8, "
            "multiplied in fp32: the fp8 numerics, no fp8 speed-up, slower than model.linear_backend=torch)",
            reason,
        )
    return reason is not None


def tell_if_emulated(model: nn.Module) -> None:
    """At a model's build: ``emulating`` for every layer of it that runs ``fp8_linear(_all)``, on its weight's device
    (nothing on the meta device: no GEMM runs there)."""
    for m in model.modules():
        w = getattr(m, "weight", None)
        fp8 = getattr(m, "linear_fn", None) in (fp8_linear, fp8_linear_all)
        if fp8 and isinstance(w, torch.Tensor) and w.device.type != "meta":
            emulating(w.device, w.shape)


def quantize(t: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor dynamic scaling: ``(t * scale)`` in ``dtype`` (float8_e4m3fn or float8_e5m2), its absolute max onto
    the format's largest value, and ``1 / scale`` (fp32, on t's device)."""
    fmax = torch.finfo(dtype).max
    amax = t.detach().abs().max().float().clamp(min=1e-12)
    scale = fmax / amax
    q = (t.float() * scale).clamp(-fmax, fmax).to(dtype)
    return q, scale.reciprocal()


def quantize_dequantize(t: torch.Tensor) -> torch.Tensor:
    q, inv = quantize(t)
    return q.float() * inv


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _scaled_mm(x2: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The forward GEMM of ``fp8_linear`` on the fp8 tensor cores (rows padded: ``_pad_rows``)."""
    xq, sx = quantize(_pad_rows(x2))
    wq, sw = quantize(w)
    return _mm(xq, sx, wq.t(), sw, out_dtype, emulate=False)[: x2.shape[0]]  # wq.t(): column-major, no copy


class _Float8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, emulate):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        dtype = _compute_dtype(x)
        x2 = x.reshape(-1, x.shape[-1])
        with torch.autocast(x.device.type, enabled=False):  # the output dtype is chosen above
            if emulate:
                y = (quantize_dequantize(x2) @ quantize_dequantize(weight).t()).to(dtype)
            else:
                y = _scaled_mm(x2, weight, dtype)
        y = y.view(*x.shape[:-1], weight.shape[0])
        return y + bias.to(dtype) if bias is not None else y

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1]).to(grad.dtype)
        grad_x = (g2 @ weight.to(grad.dtype)).view(x.shape).to(x.dtype)
        grad_w = (g2.t() @ x2).to(weight.dtype)
        grad_b = g2.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with zero rows up to a multiple of 16 (``torch._scaled_mm`` wants every dim one): a zero row changes no
    amax and no product, and its output row is dropped."""
    pad = (-t.shape[0]) % 16
    return F.pad(t, (0, 0, 0, pad)) if pad else t


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the same values, stored column-major (cuBLASLt's fp8 GEMM takes row-major @ column-major)."""
    return t.t().contiguous().t()


def _mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, out_dtype, emulate: bool, fast=False):
    """``(a * sa) @ (b * sb)`` of two fp8 operands and their inverse scales, in ``out_dtype``: ``torch._scaled_mm``
    (``a`` row-major, ``b`` column-major, never two e5m2; ``fast``: Hopper's fast accumulation, which skips the
    periodic promotion to fp32), or its emulation (dequantized, multiplied in fp32)."""
    if emulate:
        return ((a.float() * sa) @ (b.float() * sb)).to(out_dtype)
    b = b if b.t().is_contiguous() else _col_major(b)
    kw = {"use_fast_accum": True} if fast else {}
    return torch._scaled_mm(a.contiguous(), b, scale_a=sa, scale_b=sb, out_dtype=out_dtype, **kw)


class _Float8LinearAll(torch.autograd.Function):
    """All three GEMMs in fp8 (``model.linear_backend: fp8_all``; the module docstring). Saves the fp8 ``X`` and
    ``W`` and their scales for the backward, not the high-precision tensors."""

    @staticmethod
    def forward(ctx, x, weight, bias, emulate):
        dtype = _compute_dtype(x)
        x2 = x.reshape(-1, x.shape[-1])
        m = x2.shape[0]
        with torch.autocast(x.device.type, enabled=False):  # the output dtypes are chosen here
            xq, sx = quantize(x2 if emulate else _pad_rows(x2))
            wq, sw = quantize(weight)
            # W stored row-major is W^T column-major: no copy. Fast accumulation in the forward GEMM only, as torchao's
            # tensorwise recipe does (the gradients' GEMMs accumulate in full fp32)
            y = _mm(xq, sx, wq.t(), sw, dtype, emulate, fast=True)[:m]
        ctx.save_for_backward(xq, sx, wq, sw)
        ctx.x_meta, ctx.w_dtype, ctx.has_bias, ctx.emulate = (x.shape, x.dtype), weight.dtype, bias is not None, emulate
        y = y.view(*x.shape[:-1], weight.shape[0])
        return y + bias.to(dtype) if bias is not None else y

    @staticmethod
    def backward(ctx, grad):
        xq, sx, wq, sw = ctx.saved_tensors
        (x_shape, x_dtype), emulate = ctx.x_meta, ctx.emulate
        g2 = grad.reshape(-1, grad.shape[-1])
        m = g2.shape[0]
        with torch.autocast(grad.device.type, enabled=False):
            gq, sg = quantize(g2 if emulate else _pad_rows(g2), E5M2)
            grad_x = grad_w = grad_b = None
            if ctx.needs_input_grad[0]:  # dY [M, N] @ W [N, K]
                grad_x = _mm(gq, sg, wq, sw, grad.dtype, emulate)[:m].view(x_shape).to(x_dtype)
            if ctx.needs_input_grad[1]:  # dY^T [N, M] @ X [M, K]
                grad_w = _mm(gq.t(), sg, xq, sx, ctx.w_dtype, emulate)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b, None


def _emulate(x: torch.Tensor, weight: torch.Tensor, emulate: bool | None) -> bool:
    if emulate is None:  # (no logging inside a torch.compile graph: ``tell_if_emulated`` told at the build)
        if torch.compiler.is_compiling():
            return emulation_reason(x.device, weight.shape) is not None
        return emulating(x.device, weight.shape)
    return bool(emulate)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, emulate: bool | None = None
) -> torch.Tensor:
    """``F.linear`` with an fp8 forward GEMM (see the module docstring)."""
    return _Float8Linear.apply(x, weight, bias, _emulate(x, weight, emulate))


def fp8_linear_all(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, emulate: bool | None = None
) -> torch.Tensor:
    """``F.linear`` with its forward and both backward GEMMs in fp8 (``model.linear_backend: fp8_all``)."""
    return _Float8LinearAll.apply(x, weight, bias, _emulate(x, weight, emulate))


class Float8Linear(nn.Linear):
    """Drop-in ``nn.Linear`` whose forward runs through ``fp8_linear``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, emulate: bool | None = None, **kw):
        super().__init__(in_features, out_features, bias, **kw)
        self.emulate = emulate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.emulate)


def select_linear_fn(backend: str):
    """The ``(x, weight, bias) -> y`` function for ``model.linear_backend``."""
    if backend == "torch":
        return F.linear
    if backend == "fp8":
        return fp8_linear
    if backend == "fp8_all":
        return fp8_linear_all
    raise ConfigError(
        f"model.linear_backend={backend!r} is not one of ['torch', 'fp8', 'fp8_all'] (config validation rejects 'te')"
    )
