"""Compiled compression kernels, their dispatcher, and the pure-torch reference of every op.

Format (ALGORITHMS.md §6; DiLoCoX int4 pseudo-gradient compression, error feedback as in
CocktailSGD): flat fp32 in groups of ``G``; per group ``s = bf16(absmax / L)`` (L = 7 for
int4, 127 for int8; the bf16-rounded scale is the one used), ``q = clamp(rint(v / s), -L, L)``
(stochastic: ``floor(v / s + u)``), ``s == 0`` -> ``q = 0``. int4 nibbles: element 2k in the
low nibble. Payload = ``[packed bytes | scales as little-endian bf16 bytes]``.

Ops (same semantics for the compiled ``torch.ops.dilocox.*`` and the references here):

* ``ef_quantize_pack(x, error, payload, group_size, bits, stochastic, seed, step)``:
  ``v = x + error`` (``error`` may be None), writes ``payload`` and (in place) the new
  residual ``error = v - s*q``; returns a 0-dim int64 tensor = number of groups with a
  NaN/inf in ``v`` (those groups are left unwritten; callers must raise).
* ``dequantize_into(payload, out, group_size, bits, accumulate)``: ``out = s*q`` or
  ``out += s*q`` (product rounded to fp32 first, then one add).

The references use only exact IEEE ops in the same order as the kernels (true division,
no fused multiply-add), so kernel and reference agree bit for bit - including stochastic
rounding, whose uniform draws come from the same splitmix64 counter hash, computed here
with wrapping int64 tensor ops.

Dispatch: the compiled op runs when its extension is importable for the tensor's device
(``dilocox._C`` for CPU, ``dilocox._C_cuda`` for CUDA), otherwise the reference, with one
log message on logger ``"dilocox"``. ``DILOCOX_NO_EXT=1`` forces the reference.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

# splitmix64 on python ints and its constants: the one definition is dilocox/seeding.py (mix64 in csrc/quant_core.h)
from dilocox.seeding import C1 as _C1
from dilocox.seeding import C2 as _C2
from dilocox.seeding import GOLDEN as _GOLDEN
from dilocox.seeding import M64 as _M64
from dilocox.seeding import splitmix64 as _mix64_int

log = logging.getLogger("dilocox")

_EXT_ERRORS: dict[str, str] = {}
_EXT_LOADED: dict[str, bool] = {"cpu": False, "cuda": False}
_WARNED: set[str] = set()

try:  # registers the schemas + CPU kernels of torch.ops.dilocox
    from dilocox import _C  # noqa: F401

    _EXT_LOADED["cpu"] = True
except ImportError as exc:  # not built (no compiler, failed build, pure-python install)
    _EXT_ERRORS["cpu"] = f"dilocox._C: {exc}"
if _EXT_LOADED["cpu"]:
    try:
        from dilocox import _C_cuda  # noqa: F401

        _EXT_LOADED["cuda"] = True
    except ImportError as exc:
        _EXT_ERRORS["cuda"] = f"dilocox._C_cuda: {exc}"
else:
    _EXT_ERRORS["cuda"] = "dilocox._C_cuda needs dilocox._C (which is not available)"


def _device_type(device) -> str:
    return torch.device(device).type if not isinstance(device, torch.device) else device.type


def ext_disabled() -> bool:
    """True when ``DILOCOX_NO_EXT`` is set (to anything but '' or '0')."""
    return os.environ.get("DILOCOX_NO_EXT", "0") not in ("", "0")


def have_extension(device="cpu") -> bool:
    """Whether the compiled kernels will be used for tensors on ``device``."""
    return not ext_disabled() and _EXT_LOADED.get(_device_type(device), False)


def _use_ext(device: torch.device, use_kernel: bool) -> bool:
    if not use_kernel or ext_disabled():
        return False
    kind = device.type
    if _EXT_LOADED.get(kind, False):
        return True
    if kind not in _WARNED:
        _WARNED.add(kind)
        reason = _EXT_ERRORS.get(kind, f"no compiled kernels for device type {kind!r}")
        log.warning(
            "dilocox compiled compression kernels unavailable for %s (%s); using the "
            "pure-torch reference (slower). Build them with `pip install --no-build-isolation -e .`",
            kind,
            reason,
        )
    return False


def cpu_isas() -> list[int]:
    """The code paths of the CPU kernels this machine can run: 0 baseline x86-64/other, 1 AVX2, 2 AVX-512 (empty
    without the extension, or with one built before ``select_cpu_isa`` existed)."""
    if not have_extension("cpu") or not hasattr(torch.ops.dilocox, "select_cpu_isa"):
        return []
    return list(range(int(torch.ops.dilocox.select_cpu_isa(-2)) + 1))  # (-2: a query, nothing switched)


@contextlib.contextmanager
def forced_cpu_isa(isa: int):
    """Run the CPU kernels' ``isa`` code path inside the block (tests compare every path with the reference);
    yields the ISA in use (lower than asked where the CPU lacks it). Not thread-safe: a process-wide switch."""
    if not cpu_isas():  # no extension (or an old one): nothing to switch
        yield -1
        return
    before = int(torch.ops.dilocox.select_cpu_isa(-3))  # (-3: the ISA in use, nothing switched)
    got = int(torch.ops.dilocox.select_cpu_isa(isa))
    try:
        yield got
    finally:
        torch.ops.dilocox.select_cpu_isa(-1 if before == cpu_isas()[-1] else before)


# ----------------------------------------------------------------------------------------
# helpers shared with quant.py
def levels(bits: int) -> int:
    return 7 if bits == 4 else 127


def num_groups(n: int, group_size: int) -> int:
    return -(-n // group_size)


def quant_bytes(n: int, bits: int) -> int:
    """Bytes of the packed values (before the scales)."""
    return (n + 1) // 2 if bits == 4 else n


def to_i64(v: int) -> int:
    """Python int -> the int64 with the same low 64 bits (how seeds/steps reach the kernel)."""
    v = int(v) & _M64
    return v - (1 << 64) if v >> 63 else v


def _lsr(t: torch.Tensor, k: int) -> torch.Tensor:  # logical right shift of int64 bits
    return (t >> k) & ((1 << (64 - k)) - 1)


def _mix64_t(z: torch.Tensor) -> torch.Tensor:  # same, on int64 tensors (wrapping multiply)
    z = (z ^ _lsr(z, 30)) * to_i64(_C1)
    z = (z ^ _lsr(z, 27)) * to_i64(_C2)
    return z ^ _lsr(z, 31)


def sr_uniform(seed: int, step: int, numel: int, device="cpu") -> torch.Tensor:
    """u[i] in [0, 1) for element i: top 24 bits of mix64(base + (i+1)*GOLDEN) * 2^-24,
    base = mix64(mix64(seed) + step) - identical to ``sr_uniform`` in csrc/quant_core.h."""
    base = _mix64_int(_mix64_int(seed) + (int(step) & _M64))
    z = torch.arange(1, numel + 1, dtype=torch.int64, device=device) * to_i64(_GOLDEN) + to_i64(base)
    return _lsr(_mix64_t(z), 40).to(torch.float32) * (2.0**-24)


def bf16_round(f: torch.Tensor) -> torch.Tensor:
    """fp32 -> nearest-even bf16 value, kept in fp32 (integer formula of c10::BFloat16, so it
    does not depend on the hardware conversion path). For finite f >= 0 (scales)."""
    u = f.contiguous().view(torch.int32)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & -65536
    return u.view(torch.float32)


# ----------------------------------------------------------------------------------------
# references
def ref_ef_quantize_pack(
    x, error, payload, group_size: int, bits: int, stochastic: bool = False, seed: int = 0, step: int = 0
) -> torch.Tensor:
    n, G, L = x.numel(), group_size, levels(bits)
    if n == 0:
        return torch.zeros((), dtype=torch.int64, device=x.device)
    ng = num_groups(n, G)
    v = x.reshape(-1) if error is None else x.reshape(-1) + error.reshape(-1)
    vg = torch.nn.functional.pad(v, (0, ng * G - n)).view(ng, G)
    finite = torch.isfinite(vg).all(dim=1)
    nbad = (~finite).sum()
    amax = vg.abs().amax(dim=1)
    amax = torch.where(finite, amax, torch.zeros_like(amax))
    s = bf16_round(amax / torch.full_like(amax, float(L)))  # tensor / tensor: IEEE division
    sg = s[:, None]
    ok = (sg > 0) & finite[:, None]
    y = vg / torch.where(ok, sg, torch.ones_like(sg))
    if stochastic:
        y = (y + sr_uniform(seed, step, ng * G, x.device).view(ng, G)).clamp(-L, L).floor()
    else:
        y = torch.round(y.clamp(-L, L))  # round half to even
    q = torch.where(ok, y, torch.zeros_like(y)).to(torch.int32)
    if error is not None:
        new_e = vg - sg * q.to(torch.float32)  # product exact, one rounding on the subtract
        eg = torch.nn.functional.pad(error.reshape(-1), (0, ng * G - n)).view(ng, G)
        error.view(-1).copy_(torch.where(finite[:, None], new_e, eg).view(-1)[:n])
    nq = quant_bytes(n, bits)
    qf = q.view(-1)
    if bits == 4:
        qq = qf[: 2 * nq]  # elements >= n are padding zeros -> odd tail high nibble 0
        packed = ((qq[0::2] & 15) | ((qq[1::2] & 15) << 4)).to(torch.uint8)
    else:
        packed = qf[:n].to(torch.int8).view(torch.uint8)
    sbits = s.view(torch.int32) >> 16
    scale_bytes = torch.stack([sbits & 0xFF, (sbits >> 8) & 0xFF], dim=1).view(-1).to(torch.uint8)
    payload[:nq].copy_(packed)
    payload[nq:].copy_(scale_bytes)
    return nbad


def ref_dequantize_into(payload, out, group_size: int, bits: int, accumulate: bool = False) -> None:
    n, G = out.numel(), group_size
    if n == 0:
        return
    ng, nq = num_groups(n, G), quant_bytes(n, bits)
    sb = payload[nq : nq + 2 * ng].to(torch.int32)
    s = ((sb[0::2] | (sb[1::2] << 8)) << 16).view(torch.float32)
    if bits == 4:
        b = payload[:nq].to(torch.int32)
        q = torch.stack([((b & 15) ^ 8) - 8, ((b >> 4) ^ 8) - 8], dim=1).view(-1)
    else:
        q = payload[:n].view(torch.int8).to(torch.int32)
    q = torch.nn.functional.pad(q[:n], (0, ng * G - n)).view(ng, G)
    d = (s[:, None] * q.to(torch.float32)).view(-1)[:n]
    o = out.view(-1)
    if accumulate:
        o.add_(d)
    else:
        o.copy_(d)


# ----------------------------------------------------------------------------------------
# dispatchers
def ef_quantize_pack(
    x,
    error,
    payload,
    group_size: int,
    bits: int,
    stochastic: bool = False,
    seed: int = 0,
    step: int = 0,
    use_kernel: bool = True,
) -> torch.Tensor:
    """Fused (error-feedback) quantize + pack into ``payload``; returns the non-finite group count."""
    if _use_ext(x.device, use_kernel):
        return torch.ops.dilocox.ef_quantize_pack(
            x, error, payload, group_size, bits, stochastic, to_i64(seed), to_i64(step)
        )
    return ref_ef_quantize_pack(x, error, payload, group_size, bits, stochastic, seed, step)


def dequantize_into(
    payload, out, group_size: int, bits: int, accumulate: bool = False, use_kernel: bool = True
) -> None:
    """``out = deq(payload)`` or ``out += deq(payload)``."""
    if _use_ext(out.device, use_kernel):
        torch.ops.dilocox.dequantize_into(payload, out, group_size, bits, accumulate)
    else:
        ref_dequantize_into(payload, out, group_size, bits, accumulate)
