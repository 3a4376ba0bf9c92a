"""``dilocox report``: the PNGs exist, and what they draw is what metrics.jsonl holds."""

from __future__ import annotations

import json
import math
import os

import pytest

from dilocox.cli import main as cli_main
from dilocox.runplots import ReportError, load_metrics, plot_runs
from tests.small_run import small_cfg

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write(run_dir, records, tail=""):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
        f.write(tail)


def _diloco_records():
    """8 steps, then a crash and a resume from step 4 (its clock restarts at 0), then steps 5..10."""
    recs = []
    for s in range(1, 9):
        r = {
            "time": 0.5 * s,
            "step": s,
            "loss": 5.0 - 0.2 * s,
            "tokens_per_s": 1000.0 + s,
            "outer_step": s // 4,
            "H": 4,
            "rank": 8,
            "bytes_sent": 1_000_000 * (s // 4),
            "blocked_total_s": 0.1 * (s // 4),
        }
        if s % 4 == 0:
            r["val_loss"] = 4.5 - 0.1 * s
        recs.append(r)
    recs.append({"time": 4.1, "summary": {"steps": 8}})  # not a step record
    for s in range(5, 11):  # the resumed segment replaces steps 5..8
        r = {
            "time": 0.25 * (s - 4),
            "step": s,
            "loss": 4.0 - 0.1 * s,
            "tokens_per_s": 2000.0 + s,
            "outer_step": s // 4,
            "H": 2 if s > 8 else 4,
            "rank": 4 if s > 8 else 8,
            "bytes_sent": 1_500_000 * (s // 4),
            "blocked_total_s": 0.2 * (s // 4),
            "val_loss": float("nan") if s == 10 else None,
        }
        if r["val_loss"] is None:
            del r["val_loss"]
        recs.append(r)
    return recs


def _allreduce_records():
    return [{"time": 0.3 * s, "step": s, "loss": 4.8 - 0.15 * s, "tokens_per_s": 1500.0} for s in range(1, 11)]


def test_report_pngs_match_the_jsonl(tmp_path):
    a, b, out = tmp_path / "dilocox", tmp_path / "allreduce", tmp_path / "plots"
    _write(a, _diloco_records(), tail='{"time": 9.0, "step": 11, "lo')  # a last line cut short by a kill
    _write(b, _allreduce_records())
    drawn = plot_runs([str(a), str(b)], str(out))

    names = {os.path.basename(p) for p in drawn}
    assert names == {
        "loss_vs_step.png",
        "loss_vs_time.png",
        "tokens_per_s.png",
        "bytes_sent.png",
        "blocked.png",
        "adaptive.png",
    }
    for path in drawn:
        with open(path, "rb") as f:
            head = f.read(8)
        assert head == PNG_MAGIC and os.path.getsize(path) > 10_000, path

    steps = list(range(1, 11))
    # what the resumed run's file means: steps 1..4 from the first segment, 5..10 from the second
    loss_a = [5.0 - 0.2 * s for s in range(1, 5)] + [4.0 - 0.1 * s for s in range(5, 11)]
    time_a = [0.5 * s for s in range(1, 5)] + [4.0 + 0.25 * (s - 4) for s in range(5, 11)]
    loss_step = drawn[str(out / "loss_vs_step.png")]
    assert loss_step["dilocox train"] == (steps, pytest.approx(loss_a))
    assert loss_step["dilocox val"] == ([4.0], pytest.approx([4.1]))  # step 8's val was replaced; step 10's is NaN
    assert loss_step["allreduce train"] == ([float(s) for s in steps], pytest.approx([4.8 - 0.15 * s for s in steps]))
    assert "allreduce val" not in loss_step

    loss_time = drawn[str(out / "loss_vs_time.png")]
    assert loss_time["dilocox train"] == (pytest.approx(time_a), pytest.approx(loss_a))
    assert loss_time["allreduce train"][0] == pytest.approx([0.3 * s for s in steps])

    tps = drawn[str(out / "tokens_per_s.png")]
    assert tps["dilocox"][1] == pytest.approx([1000.0 + s for s in range(1, 5)] + [2000.0 + s for s in range(5, 11)])
    assert tps["allreduce"][1] == [1500.0] * 10

    mb = drawn[str(out / "bytes_sent.png")]  # megabytes; allreduce logged none, so it is not drawn
    assert set(mb) == {"dilocox"}
    assert mb["dilocox"][1] == pytest.approx(
        [1.0 * (s // 4) for s in range(1, 5)] + [1.5 * (s // 4) for s in range(5, 11)]
    )
    assert drawn[str(out / "blocked.png")]["dilocox"][1] == pytest.approx(
        [0.1 * (s // 4) for s in range(1, 5)] + [0.2 * (s // 4) for s in range(5, 11)]
    )

    adaptive = drawn[str(out / "adaptive.png")]
    assert set(adaptive) == {"H:dilocox", "rank:dilocox"}
    assert adaptive["H:dilocox"] == (steps, [4.0] * 8 + [2.0] * 2)
    assert adaptive["rank:dilocox"][1] == [8.0] * 8 + [4.0] * 2


@pytest.mark.parametrize("enabled", [True, False, None])
def test_adaptive_png_draws_the_runs_whose_controller_was_on(tmp_path, enabled):
    """Bug: adaptive.png was drawn for every DiLoCo-family run (each logs H and rank, constant unless the controller
    is on). A run's config.yaml decides now; without one (None here), whether its H or rank changed."""
    recs = [{"time": 0.1 * s, "step": s, "loss": 3.0, "H": 4, "rank": 8} for s in range(1, 7)]
    _write(tmp_path / "run", recs)
    if enabled is not None:
        (tmp_path / "run" / "config.yaml").write_text(f"compress:\n  adaptive:\n    enabled: {str(enabled).lower()}\n")
    drawn = plot_runs([str(tmp_path / "run")], str(tmp_path / "out"))
    assert (str(tmp_path / "out" / "adaptive.png") in drawn) == bool(enabled)
    assert os.path.exists(tmp_path / "out" / "adaptive.png") == bool(enabled)
    if enabled:  # (a controller that never moved is still drawn: flat lines say so)
        assert drawn[str(tmp_path / "out" / "adaptive.png")]["H:run"][1] == [4.0] * 6


def test_report_skips_what_no_run_logged(tmp_path):
    _write(tmp_path / "run", _allreduce_records())
    drawn = plot_runs([str(tmp_path / "run")], str(tmp_path / "out"))
    assert sorted(os.path.basename(p) for p in drawn) == ["loss_vs_step.png", "loss_vs_time.png", "tokens_per_s.png"]
    assert sorted(os.listdir(tmp_path / "out")) == sorted(os.path.basename(p) for p in drawn)


def test_report_cli_and_its_errors(tmp_path, capsys):
    _write(tmp_path / "run", _allreduce_records())
    assert cli_main(["report", str(tmp_path / "run")]) == 0
    assert os.path.getsize(tmp_path / "run" / "plots" / "loss_vs_step.png") > 10_000  # default: RUN_DIR/plots
    capsys.readouterr()

    assert cli_main(["report", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl not found" in err and "nowhere" in err and "log.jsonl=true" in err

    recs = _allreduce_records()
    _write(tmp_path / "bad", recs[:2])
    with open(tmp_path / "bad" / "metrics.jsonl", "a") as f:
        f.write("{not json\n" + json.dumps(recs[2]) + "\n")
    with pytest.raises(ReportError, match=r"metrics.jsonl:3: not a JSON record"):
        load_metrics(str(tmp_path / "bad"))
    _write(tmp_path / "empty", [{"time": 0.1, "summary": {}}])
    with pytest.raises(ReportError, match="no step records"):
        load_metrics(str(tmp_path / "empty"))


def test_report_of_a_real_run(tmp_path):
    """The keys the trainer really logs (a 2-step-sync DiLoCo run on 1 rank) reach the plots."""
    from dilocox.train import Trainer

    tr = Trainer(
        small_cfg(tmp_path / "run", "--outer.method=diloco", "--outer.sync_every=2", "--train.eval_every=2", steps=4)
    )
    tr.run()
    drawn = plot_runs([str(tmp_path / "run")], str(tmp_path / "out"))
    assert {os.path.basename(p) for p in drawn} == {
        "loss_vs_step.png",
        "loss_vs_time.png",
        "tokens_per_s.png",
        "bytes_sent.png",
        "blocked.png",
    }  # (no adaptive.png: its controller is off)
    hist = tr.history
    loss = drawn[str(tmp_path / "out" / "loss_vs_step.png")]
    assert loss["run train"] == ([float(r["step"]) for r in hist], pytest.approx([r["loss"] for r in hist]))
    vals = [(float(r["step"]), r["val_loss"]) for r in hist if "val_loss" in r and math.isfinite(r["val_loss"])]
    assert vals and loss["run val"] == ([s for s, _ in vals], pytest.approx([v for _, v in vals]))
