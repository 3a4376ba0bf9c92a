"""Validation with no batches: ``train.eval_batches=0`` reported a final validation loss of 0.0
(perplexity 1) before its fix; it must be NaN and no step record may carry a ``val_loss``."""

from __future__ import annotations

import math

from tests.small_run import small_cfg


def test_no_val_batches_gives_nan_not_zero(tmp_path):
    from dilocox.train import train

    summary = train(small_cfg(tmp_path, "--train.eval_batches=0", "--train.eval_every=1", steps=2))
    assert math.isnan(summary["final_val_loss"]), summary["final_val_loss"]
    import json

    with open(tmp_path / "metrics.jsonl") as f:
        recs = [json.loads(x) for x in f]
    steps = [r for r in recs if "step" in r]
    assert len(steps) == 2 and all("val_loss" not in r for r in steps)
