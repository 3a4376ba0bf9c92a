"""Every deterministic seed of dilocox, in one place (stable across processes, ranks and Python versions).

Three functions, on purpose different (each keeps the values it has always produced, so
initial weights, batches and compression draws of earlier runs are reproduced bit for bit):

- ``splitmix64(z)``: the splitmix64 finalizer on a 64-bit integer: the same function as
  ``mix64`` in csrc/quant_core.h, which the stochastic-rounding kernels use (the Python
  reference in compress/kernels.py builds ``sr_uniform`` from it).
- ``mix_seed(*ints)``: a chain of ``splitmix64`` over integers: the compressors' per-step seeds
  (PowerSGD projections, CocktailSGD masks, stochastic rounding), cheap enough for every call.
- ``text_seed(text)``: blake2b of a string, for keys that contain names: the per-parameter
  initialization (``"<seed>/<param name>"``) and the data sampler (``repr`` of its key tuple).

All return non-negative ints that fit ``torch.Generator.manual_seed`` (63 bits) except
``splitmix64``, which returns the full 64 bits.
"""

from __future__ import annotations

import hashlib

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / φ, splitmix64's increment
C1, C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's multipliers
_M63 = (1 << 63) - 1


def splitmix64(z: int) -> int:
    """splitmix64 finalizer on Python ints (mod 2^64)."""
    z &= M64
    z = ((z ^ (z >> 30)) * C1) & M64
    z = ((z ^ (z >> 27)) * C2) & M64
    return z ^ (z >> 31)


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers: z ← splitmix64(z + part + GOLDEN) for each part, from z = GOLDEN."""
    z = GOLDEN
    for p in parts:
        z = splitmix64(z + (int(p) & M64) + GOLDEN)
    return z & _M63


def text_seed(text: str) -> int:
    """A 63-bit seed from a string (blake2b, 8 bytes, little endian)."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _M63
