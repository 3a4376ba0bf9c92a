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
            raise RuntimeError(WANDB_MISSING) from e
        os.makedirs(run_dir, exist_ok=True)
        name = os.path.basename(os.path.normpath(os.path.abspath(run_dir))) + (f"-{part}" if part else "")
        # init_timeout: the wait for wandb's service process is bounded (seconds)
        self.run = wandb.init(
            project=project,
            name=name,
            dir=run_dir,
            config=config or {},
            settings=wandb.Settings(init_timeout=120, console="off"),
        )

    def log(self, record: dict) -> None:
        if "step" in record:
            self.run.log(_scalars(record, skip=("step", "time")), step=int(record["step"]))
        elif isinstance(record.get("summary"), dict):
            self.run.summary.update(_scalars(record["summary"]))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
