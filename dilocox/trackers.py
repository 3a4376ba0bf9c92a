"""Experiment trackers beside metrics.jsonl and TensorBoard: Weights & Biases (``log.wandb: true``).

Only the logging rank (rank 0) opens a tracker (:class:`dilocox.metrics.MetricsLogger` is disabled on
the others). The run is named after ``log.run_dir``, its files go to ``RUN_DIR/wandb/``, and the whole
resolved config is attached. ``WANDB_MODE=offline`` records without a network (``wandb sync`` uploads
later). A resumed run starts a new W&B run (a W&B run's steps must only increase).
"""

from __future__ import annotations

import math
import os
from typing import Any

WANDB_MISSING = (
    "log.wandb=true needs the wandb package: pip install wandb (WANDB_MODE=offline needs no network), "
    "or set --log.wandb=false"
)


class TrackerError(RuntimeError):
    """``log.wandb=true`` but W&B cannot start (not importable, not logged in, no network); the message names the
    fix. :class:`dilocox.metrics.MetricsLogger` raises it as a ``ConfigError`` (one line, exit 2, no traceback)."""


def _scalars(record: dict, skip: tuple[str, ...] = ()) -> dict[str, float]:
    return {
        k: v
        for k, v in record.items()
        if k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


class WandbTracker:
    """One W&B run: step records become history rows, the end-of-run summary the run's summary."""

    def __init__(
        self, run_dir: str, project: str, config: dict[str, Any] | None = None, part: str | None = None
    ) -> None:
        """One W&B run named after ``run_dir`` (``part``: a SWARM peer's name, appended: one run per peer)."""
        try:
            import wandb  # lazy on purpose: an optional dependency, imported only when log.wandb is true
        except ImportError as e:
            raise TrackerError(WANDB_MISSING) from e
        except Exception as e:  # noqa: BLE001 - installed but broken (e.g. a protobuf it cannot use)
            raise TrackerError(
                f"log.wandb=true, but the installed wandb package fails to import ({type(e).__name__}: {e}); "
                "reinstall it (pip install -U wandb) or set --log.wandb=false"
            ) from e
        os.makedirs(run_dir, exist_ok=True)
        name = os.path.basename(os.path.normpath(os.path.abspath(run_dir))) + (f"-{part}" if part else "")
        # init_timeout: the wait for wandb's service process is bounded (seconds)
        try:
            self.run = wandb.init(
                project=project,
                name=name,
                dir=run_dir,
                config=config or {},
                settings=wandb.Settings(init_timeout=120, console="off"),
            )
        except Exception as e:  # noqa: BLE001 - wandb's own errors (no API key, no network, a bad project name)
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise TrackerError(
                f"log.wandb=true, but the W&B run did not start ({type(e).__name__}: {first}): run `wandb login`, "
                "or set WANDB_MODE=offline to record without a network (`wandb sync` uploads later), or set "
                "--log.wandb=false"
            ) from e

    def log(self, record: dict) -> None:
        if "step" in record:
            self.run.log(_scalars(record, skip=("step", "time")), step=int(record["step"]))
        elif isinstance(record.get("summary"), dict):
            self.run.summary.update(_scalars(record["summary"]))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
