"""What a person running training wants to see, and the files a script wants to read.

One :class:`MetricsLogger` per rank; only the logging rank prints and writes. Each step's
record goes to ``<run_dir>/metrics.jsonl`` (one JSON object per line), to TensorBoard when
the package is installed, to Weights & Biases with ``log.wandb`` (:mod:`dilocox.trackers`), and to
stdout as one line::

    step 120/400 | loss 2.3141 | lr 3.9e-04 | gnorm 0.412 | 5,321 tok/s | mfu - | outer 3 H 40 sent 1.2 MB ...

On a TTY a progress bar is redrawn in place between full log lines. It moves when records arrive: the trainer
hands them over every ``log.every`` steps (the losses are read there, with no host sync in between), so the bar
jumps by ``log.every`` steps at a time.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

import torch

from dilocox.config import ConfigError
from dilocox.trackers import TrackerError, WandbTracker


class WandbStartError(ConfigError, TrackerError):
    """W&B could not start for ``log.wandb=true``: the command prints the one line (``config error: ...``, exit 2)."""


# Dense bf16 peak of the accelerators we report MFU against (vendor datasheets).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_flops(device: Any) -> float | None:
    """Peak dense bf16 FLOP/s of a CUDA device by name; None on CPU (MFU is not reported)."""
    try:
        if getattr(device, "type", str(device)) != "cuda" or not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name(device)
    except Exception:  # noqa: BLE001
        return None
    for key, val in PEAK_FLOPS.items():
        if key in name:
            return val
    return None


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000.0
    return f"{n:.1f} TB"


def fmt_time(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(round(s))
    if s >= 3600:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


STARTED_AT_ENV = "DILOCOX_STARTED_AT"  # set by `dilocox train --nproc N` for its ranks: when the command started


def process_age_s() -> float | None:
    """Seconds since this job's command started: ``DILOCOX_STARTED_AT`` when a launching ``dilocox train`` set it
    for its ranks, else this process's own age (Linux: /proc/self/stat's start time against /proc/uptime); None
    where neither is known. (A restarted replica's start-up: interpreter, imports, config, rank launch.)"""
    at = os.environ.get(STARTED_AT_ENV)
    if at:
        try:
            return max(0.0, time.time() - float(at))
        except ValueError:
            pass
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime (fields from 3 after ")")
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class MetricsLogger:
    def __init__(
        self,
        run_dir: str,
        enabled: bool,
        total_steps: int,
        jsonl: bool = True,
        tensorboard: bool = True,
        progress: bool = True,
        wandb_project: str | None = None,
        config: dict | None = None,
        name: str = "metrics",
    ):
        """``wandb_project``: also log to that Weights & Biases project, with ``config`` attached (None: no W&B).
        ``name``: the records go to ``run_dir/NAME.jsonl`` and TensorBoard's events to ``run_dir/tb`` (``metrics``,
        one trainer) or ``run_dir/tb/NAME`` (a SWARM peer ``s{j}p{i}``: one curve per peer, side by side)."""
        self.enabled = enabled
        self.wandb = None
        self.total_steps = total_steps
        self.jsonl = None
        self.tb = None
        self.tty = enabled and progress and sys.stdout.isatty()
        self.t0 = time.time()
        # Files are opened at the first record, not here: a run refused at start-up (run dir locked,
        # incompatible or finished resume) leaves the run dir's files as they were.
        self._sinks = (run_dir, jsonl, tensorboard, wandb_project, config)
        self.name = name
        self._opened = False
        self.purge_step: int | None = None

    def resume_at(self, step: int) -> None:
        """Records after ``step`` from an earlier run are being dropped: TensorBoard purges its events past it too.

        (TensorBoard's ``purge_step`` hides the events AT that step and later, so it is ``step + 1``: the resumed
        step's own events, written before its checkpoint, stay and are not written again.)"""
        self.purge_step = step + 1

    def prepare(self) -> None:
        """Do the slow part of opening now, writing no record: import TensorBoard's writer (about a second) and start
        the W&B run (``wandb.init`` may wait up to 120 s). A SWARM peer calls it before it serves, so its first
        step does not stall the other stages (their RPC and sync timeouts)."""
        if not self.enabled:
            return
        if self._sinks[2]:  # log.tensorboard
            try:
                import torch.utils.tensorboard  # noqa: F401
            except ImportError:
                pass  # (said at the first record)
        self._start_wandb()

    def _start_wandb(self) -> None:
        """The W&B run, once (``prepare`` or the first record): named after the run dir (and a SWARM peer's name)."""
        run_dir, _, _, wandb_project, config = self._sinks
        if wandb_project is not None and self.wandb is None:
            try:
                self.wandb = WandbTracker(run_dir, wandb_project, config, None if self.name == "metrics" else self.name)
            except TrackerError as e:
                raise WandbStartError(str(e)) from e

    def _open(self) -> None:
        self._opened = True
        run_dir, jsonl, tensorboard, _, _ = self._sinks
        os.makedirs(run_dir, exist_ok=True)
        if jsonl:
            self.jsonl = open(os.path.join(run_dir, f"{self.name}.jsonl"), "a")
        if tensorboard:
            try:
                # lazy: the optional tensorboard package is slow to import and often absent
                from torch.utils.tensorboard import SummaryWriter

                tb_dir = os.path.join(run_dir, "tb", *([] if self.name == "metrics" else [self.name]))
                self.tb = SummaryWriter(tb_dir, purge_step=self.purge_step)
            except ImportError:  # said once, on one line: the default asks for it
                self.tb = None
                self.info(
                    "warning: log.tensorboard=true but the tensorboard package is not installed, so no TensorBoard "
                    "events are written: pip install tensorboard (or --log.tensorboard=false)"
                )
            except Exception as e:  # noqa: BLE001 - optional
                self.tb = None
                self.info(f"warning: TensorBoard disabled: {type(e).__name__}: {e}")
        self._start_wandb()

    def write(self, record: dict) -> None:
        """Append one record (any keys) to the jsonl file and TensorBoard."""
        if not self.enabled:
            return
        if not self._opened:
            self._open()
        now = time.time()  # "wall": epoch seconds, to line up the records of separate jobs (elastic replicas)
        record = {"time": round(now - self.t0, 3), "wall": round(now, 3), **record}
        if self.jsonl:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        if self.tb is not None and "step" in record:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step", "time", "wall") and math.isfinite(v):
                    self.tb.add_scalar(k, v, record["step"])
        if self.wandb is not None:
            self.wandb.log(record)

    def line(self, rec: dict) -> str:
        step = rec["step"]
        parts = [f"step {step:>6}/{self.total_steps}", f"loss {rec['loss']:.4f}"]
        if "lr" in rec:
            parts.append(f"lr {rec['lr']:.1e}")
        if "grad_norm" in rec:
            parts.append(f"gnorm {rec['grad_norm']:.3f}")
        parts.append(f"{rec.get('tokens_per_s', 0):,.0f} tok/s")
        mfu = rec.get("mfu")
        parts.append(f"mfu {mfu * 100:4.1f}%" if mfu is not None else "mfu -")
        if "outer_step" in rec:
            parts.append(
                f"outer {rec['outer_step']} H {rec.get('H', '-')}"
                + (f" r {rec['rank']}" if rec.get("rank") else "")
                + f" sent {fmt_bytes(rec.get('bytes_sent', 0))} blocked {rec.get('blocked_s', 0.0):.2f}s"
            )
        if "val_loss" in rec:
            parts.append(f"val {rec['val_loss']:.4f} (ppl {math.exp(min(rec['val_loss'], 50)):.1f})")
        parts.append(f"eta {fmt_time(rec.get('eta_s', float('nan')))}")
        return " | ".join(parts)

    def log(self, rec: dict, printed: bool = True) -> None:
        if not self.enabled:
            return
        self.write(rec)
        if printed:
            if self.tty:
                sys.stdout.write("\r\033[K")
            print(self.line(rec), flush=True)
        elif self.tty:
            frac = rec["step"] / max(1, self.total_steps)
            bar = "#" * int(30 * frac)
            eta = fmt_time(rec.get("eta_s", float("nan")))
            sys.stdout.write(f"\r[{bar:<30}] {rec['step']}/{self.total_steps} loss {rec['loss']:.4f} eta {eta}")
            sys.stdout.flush()

    def info(self, msg: str) -> None:
        if self.enabled:
            if self.tty:
                sys.stdout.write("\r\033[K")
            print(msg, flush=True)

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()
