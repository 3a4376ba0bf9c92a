"""The delay switch of the namespace emulation: latency, jitter and loss where the kernel has no ``netem``.

``csrc/netswitch.cpp`` is a user-space Ethernet switch (AF_PACKET sockets, MAC learning, one FIFO per port released
after the configured one-way delay). ``netns.Cluster(..., rtt_ms=...)`` runs it in the switch namespace in place of
the kernel bridge, the ``tbf`` caps staying on the veths; this module builds it (g++, once per source hash, into
``~/.cache/dilocox``) and starts/stops it.

Semantics (``dilocox launch --latency 50ms --jitter 5ms --loss 0.1%``): ``latency`` is the round trip added between
any two sites (replicas, the hub): each frame waits ``latency / 2`` in the switch, ``± jitter / 2`` (uniform, a
port's frames keep their order); ``loss`` drops each frame that crosses the switch with that probability.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import subprocess

from dilocox.fsutil import atomic_path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCE = os.path.join(ROOT, "csrc", "netswitch.cpp")
START_S = 10.0  # the switch prints "ready" within this


class SwitchError(RuntimeError):
    """The delay switch cannot be built or started (one line naming the cause and the fix)."""


def build() -> str:
    """Path of the compiled switch for the current source (compiled on first use, atomically)."""
    if not os.path.exists(SOURCE):
        raise SwitchError(f"the delay switch's source {SOURCE} is missing (run dilocox from its source checkout)")
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha1(f.read()).hexdigest()[:12]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dilocox")
    out = os.path.join(cache, f"netswitch-{digest}")
    if os.path.exists(out):
        return out
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        raise SwitchError("--latency/--jitter/--loss need a C++ compiler (g++) to build the delay switch")
    os.makedirs(cache, exist_ok=True)
    with atomic_path(out) as tmp:  # atomic: a concurrent builder of the same source writes the same file
        r = subprocess.run([cxx, "-O2", "-std=c++17", "-o", tmp, SOURCE], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise SwitchError(f"building the delay switch failed ({cxx}): {r.stderr.strip().splitlines()[-1:]}")
        os.chmod(tmp, 0o755)
    return out


def argv(ports: list[str], rtt_ms: float, jitter_ms: float = 0.0, loss: float = 0.0, seed: int = 1) -> list[str]:
    """The switch's command line for ``ports`` (interfaces of the namespace it runs in)."""
    if not (math.isfinite(rtt_ms) and 0 <= jitter_ms <= rtt_ms) or not 0 <= loss < 1:  # (NaN fails every test)
        raise SwitchError(
            f"latency {rtt_ms:g} ms, jitter {jitter_ms:g} ms, loss {loss:g}: need latency >= jitter >= 0, both "
            f"finite, and 0 <= loss < 1"
        )
    return [
        build(),
        "--delay-us", f"{rtt_ms * 500.0:.3f}",
        "--jitter-us", f"{jitter_ms * 500.0:.3f}",
        "--loss", f"{loss:.9g}",
        "--seed", str(seed),
        *ports,
    ]  # fmt: skip


def wait_ready(proc: subprocess.Popen, what: str, timeout_s: float | None = None) -> None:
    """Bounded wait for the switch's "ready" line (its sockets are bound): SwitchError after ``timeout_s`` (default
    ``START_S``) even while the switch stays silent (the line is read by ``procs.read_ready_line``'s reader thread, not
    by a blocking ``readline`` here), or at once when it exits first."""
    from dilocox.distributed.procs import read_ready_line

    timeout_s = START_S if timeout_s is None else timeout_s
    try:
        if read_ready_line(proc, r"^ready\s*$", timeout_s) is not None:
            return
        why = f"printed no ready line within {timeout_s:g} s"
    except EOFError:  # its stdout closed: it exited (or closed it and runs on, which no "ready" follows)
        try:
            rc = proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            rc = None
        err = proc.stderr.read().strip() if proc.stderr is not None and rc is not None else ""
        why = f"exited with code {rc}" if rc is not None else "closed its output without a ready line (still running)"
        why += f": {err}" if err else ""
    raise SwitchError(f"the delay switch in {what} did not start: {why}")


def parse_latency(text: str | float | None, what: str = "--latency") -> float:
    """'50ms', '0.05s', '50' (ms) -> milliseconds."""
    if text is None:
        return 0.0
    if isinstance(text, (int, float)):
        ms = float(text)
    else:
        t = text.strip().lower()
        try:
            if t.endswith("ms"):
                ms = float(t[:-2])
            elif t.endswith("us"):
                ms = float(t[:-2]) / 1000.0
            elif t.endswith("s"):
                ms = float(t[:-1]) * 1000.0
            else:
                ms = float(t)
        except ValueError:
            raise SwitchError(f"{what} {text!r} is not a time (e.g. 50ms, 0.15s)") from None
    if not ms >= 0 or ms == float("inf"):
        raise SwitchError(f"{what} {text!r} must be a finite time >= 0")
    return ms


def parse_loss(text: str | float | None) -> float:
    """'0.1%' or '0.001' -> a probability."""
    if text is None:
        return 0.0
    t = str(text).strip()
    try:
        p = float(t[:-1]) / 100.0 if t.endswith("%") else float(t)
    except ValueError:
        raise SwitchError(f"--loss {text!r} is not a probability (e.g. 0.1% or 0.001)") from None
    if not 0 <= p < 1:
        raise SwitchError(f"--loss {text!r} must be in [0, 100%)")
    return p
