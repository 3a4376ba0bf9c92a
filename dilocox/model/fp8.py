"""Float8 linear layers (``model.linear_backend: fp8``): per-tensor dynamic scaling.

Forward: ``x`` and ``W`` are each scaled so their absolute max maps to the largest
float8_e4m3fn value (448), cast to fp8 and multiplied by ``torch._scaled_mm`` (Hopper/Ada
tensor cores, fp32 accumulation), which undoes the scales. Backward is a straight-through
estimator: ``dX = dY W`` and ``dW = dY^T X`` in the input precision (so only the forward GEMM
runs in fp8; this keeps the code small at the cost of the two backward GEMMs' speed-up).

``emulate=True`` quantizes and dequantizes through float8_e4m3fn and multiplies in fp32: same
rounding, any device, used by the CPU tests as the reference of the fast path.
``emulate=None`` (``model.linear_backend: fp8``) picks the fast path on CUDA devices with compute capability >= 8.9
and ``torch._scaled_mm``, for weights whose two dims are multiples of 16; elsewhere it emulates, and says so once per
reason and process (a warning of ``dilocox.model.fp8`` naming why: a CPU, an older GPU, a torch without
``torch._scaled_mm``, a weight's shape), at the model's build (``StageModel``: a ``train.compile`` graph cannot log)
and at a layer's first eager call. It is not refused at config load: the emulation is legitimately used (the CPU
tests of the numerics; SWARM peers, which run on CPU) and what ``train.device: auto`` picks is only known at run
time; a user who asked for fp8 to be fast is told that the run is emulating it instead.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
import torch.nn.functional as F

from dilocox.config import ConfigError

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448.0

log = logging.getLogger("dilocox.model.fp8")
_TOLD: set[str] = set()  # the reasons for emulating told so far (each once per process)


def emulation_reason(device, shape=None) -> str | None:
    """Why ``fp8_linear(emulate=None)`` emulates on ``device`` (for a weight of ``shape``, if given), or None: it runs
    the fp8 GEMM (``torch._scaled_mm``)."""
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
    """Whether ``fp8_linear(emulate=None)`` emulates (``emulation_reason``); the first time for a reason, a warning
    says why and that the run emulates the fp8 GEMM (the module docstring)."""
    reason = emulation_reason(device, shape)
    if reason is not None and reason not in _TOLD:
        _TOLD.add(reason)
        log.warning(
            "model.linear_backend=fp8: %s; emulating the fp8 GEMM instead (quantized through float8_e4m3fn, multiplied "
            "in fp32: the fp8 numerics, no fp8 speed-up, slower than model.linear_backend=torch)",
            reason,
        )
    return reason is not None


def tell_if_emulated(model: nn.Module) -> None:
    """At a model's build: ``emulating`` for every layer of it that runs ``fp8_linear``, on its weight's device
    (nothing on the meta device: no GEMM runs there)."""
    for m in model.modules():
        w = getattr(m, "weight", None)
        if getattr(m, "linear_fn", None) is fp8_linear and isinstance(w, torch.Tensor) and w.device.type != "meta":
            emulating(w.device, w.shape)


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
    if emulate is None:  # (no logging inside a torch.compile graph: ``tell_if_emulated`` told at the build)
        if torch.compiler.is_compiling():
            emulate = emulation_reason(x.device, weight.shape) is not None
        else:
            emulate = emulating(x.device, weight.shape)
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
