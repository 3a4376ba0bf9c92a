"""Float8 linear layers (``model.linear_backend: fp8``): per-tensor dynamic scaling.

Forward: ``x`` and ``W`` are each scaled so their absolute max maps to the largest
float8_e4m3fn value (448), cast to fp8 and multiplied by ``torch._scaled_mm`` (Hopper/Ada
tensor cores, fp32 accumulation), which undoes the scales. Backward is a straight-through
estimator: ``dX = dY W`` and ``dW = dY^T X`` in the input precision (so only the forward GEMM
runs in fp8; this keeps the code small at the cost of the two backward GEMMs' speed-up).

``emulate=True`` quantizes and dequantizes through float8_e4m3fn and multiplies in fp32: same
rounding, any device, used by the CPU tests as the reference of the fast path.
``emulate=None`` picks the fast path on CUDA devices with compute capability >= 8.9.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dilocox.config import ConfigError

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448.0


def fp8_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor dynamic scaling: ``(t * scale)`` in float8_e4m3fn and ``1 / scale`` (fp32)."""
    amax = t.detach().abs().max().float().clamp(min=1e-12)
    scale = E4M3_MAX / amax
    q = (t.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale.reciprocal()


def quantize_dequantize(t: torch.Tensor) -> torch.Tensor:
    q, inv = quantize(t)
    return q.float() * inv


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _scaled_mm(x2: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    m = x2.shape[0]
    pad = (-m) % 16  # _scaled_mm wants every dim a multiple of 16
    if pad:
        x2 = F.pad(x2, (0, 0, 0, pad))
    xq, sx = quantize(x2)
    wq, sw = quantize(w)
    y = torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=out_dtype)  # wq.t(): column-major
    return y[:m]


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


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, emulate: bool | None = None
) -> torch.Tensor:
    """``F.linear`` with an fp8 forward GEMM (see the module docstring)."""
    if emulate is None:
        emulate = not fp8_supported(x.device) or weight.shape[0] % 16 or weight.shape[1] % 16
    return _Float8Linear.apply(x, weight, bias, bool(emulate))


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
    raise ConfigError(
        f"model.linear_backend={backend!r} is not one of ['torch', 'fp8'] (config validation rejects 'te')"
    )
