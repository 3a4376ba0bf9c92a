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


def test_tokens_per_s_leaves_validation_out(tmp_path, monkeypatch):
    """A review found tokens/s counting validation as training time (a step with an eval logged 20x below the
    others, and the summary's rate fell with eval_batches). Validation made to take 1 s here: the eval step's rate
    still implies a step far under that, the summary's rate is over the loop's time less ``eval_s``, and ``eval_s``
    holds the two evals."""
    import time

    from dilocox.train import Trainer, train

    real = Trainer.validate

    def slow(self):
        if self.step < self.cfg.train.steps:  # (the mid-run evals; the final one is outside the loop anyway)
            time.sleep(1.0)
        return real(self)

    monkeypatch.setattr(Trainer, "validate", slow)
    summary = train(small_cfg(tmp_path, "--train.eval_every=3", "--log.every=1", steps=7))
    with open(tmp_path / "metrics.jsonl") as f:
        recs = {r["step"]: r for r in map(json.loads, f) if "step" in r}
    loop_tokens = summary["tokens_per_replica"]  # (one replica)
    tokens_per_step = loop_tokens / summary["steps"]
    assert "val_loss" in recs[3] and "val_loss" in recs[6]
    for n in (3, 6):  # one step each: its time is the step's, not the step's plus 1 s of validation
        assert tokens_per_step / recs[n]["tokens_per_s"] < 0.5, recs[n]
    assert summary["eval_s"] >= 2.0, summary
    assert summary["tokens_per_s"] == loop_tokens / (summary["wall_s"] - summary["eval_s"])
    assert summary["tokens_per_s"] > loop_tokens / (summary["wall_s"] - 1.5)  # (with the evals in, it would not be)
