"""Validation with no batches: ``train.eval_batches=0`` reported a final validation loss of 0.0
(perplexity 1) before one fix, then a bare ``NaN`` in metrics.jsonl and rank_*.json (not JSON: strict parsers
refuse it) before the next; it must be ``null``, and no step record may carry a ``val_loss``."""

from __future__ import annotations

import glob
import json

from tests.small_run import small_cfg


def _strict(text: str):
    def refuse(c):
        raise ValueError(f"not strict JSON: {c}")

    return json.loads(text, parse_constant=refuse)


def test_no_val_batches_gives_null_not_zero_or_nan(tmp_path):
    from dilocox.train import train

    summary = train(small_cfg(tmp_path, "--train.eval_batches=0", "--train.eval_every=1", steps=2))
    assert summary["final_val_loss"] is None and summary["final_val_ppl"] is None, summary
    with open(tmp_path / "metrics.jsonl") as f:
        recs = [_strict(x) for x in f]
    steps = [r for r in recs if "step" in r]
    assert len(steps) == 2 and all("val_loss" not in r for r in steps)
    assert [r["summary"]["final_val_loss"] for r in recs if "summary" in r] == [None]
    (rank_file,) = glob.glob(str(tmp_path / "rank_*.json"))
    with open(rank_file) as f:
        assert _strict(f.read())["final_val_loss"] is None
