"""Units of the planner: bandwidth strings in and out (``100mbit``, ``1Gbps``, ``125MB/s``), durations.

``parse_bandwidth`` turns a link speed as people write it into bits/s (decimal prefixes; lowercase
``b``/``bit``/``bps`` are bits, ``B``/``byte`` bytes, ``/s`` optional); ``fmt_bandwidth`` and
``fmt_seconds`` print the planner's numbers back. Also used by the emulation and launch commands
that take a ``--bandwidth``.
"""

from __future__ import annotations

import math
import re

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}


def parse_bandwidth(text: str | float | int) -> float:
    """``"100mbit"`` -> 1e8 bits/s. Lowercase ``b``/``bit``/``bps`` are bits, ``B``/``byte`` bytes.

    Note ``1Gbps`` means gigabits here (as in the papers), unlike tc, where ``mbps`` is bytes.
    """
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z/]*)\s*", str(text))
        if not m:
            raise ValueError(
                f"bandwidth {text!r} is not a number with a unit; write e.g. 100mbit, 1gbit, 10Gbit/s, 125MB/s"
            )
        unit = m.group(2)
        if not unit and 0 < float(m.group(1)) < 1000:  # ("--bandwidth 100": 100 bit/s, a link no run finishes on)
            raise ValueError(f"bandwidth {text!r} has no unit: {m.group(1)} bit/s; write e.g. {m.group(1)}mbit")
        unit = unit[:-2] if unit.endswith("/s") else unit
        um = re.fullmatch(r"([kKmMgGtT]i?)?(bit|bps|b|Bps|B|byte|bytes)?", unit)
        if not um:
            raise ValueError(
                f"bandwidth {text!r}: unknown unit {m.group(2)!r}; use bit, kbit, mbit, gbit (or Gbps, MB/s)"
            )
        scale = _PREFIX[(um.group(1) or "").lower()]
        per_byte = (um.group(2) or "bit") in ("Bps", "B", "byte", "bytes")
        value = float(m.group(1)) * scale * (8.0 if per_byte else 1.0)
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"bandwidth {text!r} must be a finite number > 0 bits/s")
    return value


def parse_seconds(text: str | float) -> float:
    """``"150ms"``, ``"0.15s"``, ``"50us"`` or a bare number of seconds -> seconds (``dilocox plan --latency``; the
    launchers' ``--latency`` takes the same suffixed forms, but there a bare number is milliseconds)."""
    t, scale = str(text).strip().lower(), 1.0
    for suffix, k in (("ms", 1e-3), ("us", 1e-6), ("s", 1.0)):
        if t.endswith(suffix):
            t, scale = t[: -len(suffix)], k
            break
    try:
        return float(t) * scale
    except ValueError:
        raise ValueError(f"{text!r} is not a time; write e.g. 150ms, 0.15s (a bare number is seconds)") from None


def fmt_bandwidth(bps: float) -> str:
    if math.isinf(bps):
        return "unreachable"
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} bit/s"


def fmt_seconds(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.3g} h"
    if s >= 60:
        return f"{s / 60:.3g} min"
    return f"{s:.3g} s"
