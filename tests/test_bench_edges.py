"""The benches' tables and ``dilocox report`` on the edges of their inputs: a run without a final val loss
(``train.eval_batches=0`` writes ``final_val_loss: null``), a frontier run with no allreduce row (no ratio and no
gap exist, so none may be printed), and a resumed run whose first step comes late on its restarted clock."""

from __future__ import annotations

import copy
import json

from dilocox.bench import frontier, lengths, methods, scale, wan_report
from dilocox.runplots import load_metrics

META = dict(machine="m", date="d", corpora=["code"], seeds=[0], wall_min=1.0)


def _row(label, family, nbytes, loss, seed=0, steps=1000):
    return dict(label=label, family=family, bytes_sent_per_replica=nbytes, final_val_loss=loss, corpus="code",
                seed=seed, steps=steps)  # fmt: skip


def test_frontier_without_allreduce_prints_no_ratio_and_no_gap():
    """A point run alone (``--points "dilocox tau=0"``) has no allreduce to compare with: its table must not say
    "1x fewer bytes" and "+0.0 %" (it was 1,122x and +1.4 %), nor "no point at >= 1000x"."""
    rows = [_row("dilocox tau=0", "dilocox", 3_178_000, 1.6828)]
    frontier._mark_front(rows)
    md = frontier.markdown(rows, META)
    line = next(x for x in md.splitlines() if x.startswith("| code |"))
    assert "| 1x |" not in line and "+0.0 %" not in line
    assert line.endswith("| 3.178 MB | - | 1.6828 | - |")
    assert "no point at >= 1000x" not in md and "no allreduce row" in md


def test_methods_without_allreduce_prints_no_ratio_and_no_gap(monkeypatch):
    monkeypatch.setattr(methods, "machine_line", lambda: "m")
    rows = [dict(method="dilocox", final_val_loss=2.27, bytes_sent_per_replica=953_400, blocked_s=1.0,
                 tokens_per_s=8000.0)]  # fmt: skip
    line = methods.markdown(rows, 300, 20).splitlines()[-1]
    assert line == "| dilocox | 2.2700 | - | 0.95 MB | - | 1.00 | 8,000 |"


def _fake_run(losses: dict):
    """``run_train`` for ``methods.run``: each run's summary with the loss of its preset (None: no validation)."""

    def fake(cfg, nproc, run_dir, overrides=(), env=None, timeout=3600):
        m = run_dir.rsplit("-", 1)[-1]
        summary = dict(final_val_loss=losses[m], tokens_per_s=1.0, wall_s=1.0, tokens_per_replica=1, steps=10)
        ranks = [dict(coord="replica 0 stage 0", outer_bytes_sent=10**6 if m == "allreduce" else 10**3)]
        return dict(steps=[], summary=summary, ranks=ranks)

    return fake


def test_methods_run_with_a_null_final_val_loss(monkeypatch, tmp_path):
    """A preset run with train.eval_batches=0 (final_val_loss null) must not crash the sweep after its last run."""
    monkeypatch.setattr(methods, "run_train", _fake_run({"allreduce": 2.0, "diloco": None, "streaming": 2.2}))
    rows = methods.run(["allreduce", "diloco", "streaming"], 10, 5, str(tmp_path))
    by = {r["method"]: r for r in rows}
    assert "loss_vs_allreduce_pct" not in by["diloco"] and by["diloco"]["bytes_ratio_vs_allreduce"] == 1000
    assert abs(by["streaming"]["loss_vs_allreduce_pct"] - 10.0) < 1e-9
    assert by["diloco"]["val_curve"] == []  # (no made-up final point)
    monkeypatch.setattr(methods, "machine_line", lambda: "m")
    assert "| diloco | - | - | 0.00 MB | 1,000x |" in methods.markdown(rows, 10, 5)


def test_frontier_scale_lengths_with_a_null_final_val_loss():
    rows = [_row("allreduce", "allreduce", 10**9, 2.0), _row("dilocox", "dilocox", 10**6, None),
            _row("streaming H=20 K=2 fp32", "streaming", 5 * 10**7, 2.1)]  # fmt: skip
    frontier._mark_front(rows)
    assert frontier.pareto(rows) == {"allreduce", "streaming H=20 K=2 fp32"}
    md = frontier.markdown(rows, META)
    assert "| dilocox | 1.000 MB | 1,000x | - | - |" in md
    srows = [dict(r, width=64, params=1, replicas=2) for r in copy.deepcopy(rows)]
    for r in srows:
        if r["final_val_loss"] is not None:
            r["loss_vs_allreduce_pct"], r["bytes_ratio_vs_allreduce"] = 0.0, 1.0
    smeta = dict(machine="m", date="d", global_batch=16, steps=1000, corpus="code", seed=0, wall_min=1.0)
    assert "| dilocox | no final val loss |" in scale.markdown(srows, smeta)
    groups = lengths.table(copy.deepcopy(rows))
    verdict = lengths.verdicts(groups)
    assert verdict == []  # (the preset has no loss: nothing to grade)
    assert "| dilocox | no final val loss |" in lengths.markdown(groups, verdict, dict(machine="m", sources=["x"]))


def test_wan_render_with_a_null_final_val_loss():
    rows = []
    for m, loss in (("allreduce", 2.6), ("dilocox", None)):
        rows.append(dict(method=m, cap_bps=None, rtt_ms=0.0, steps=60, tokens_per_s=1e4, pct_of_uncapped=100.0,
                         utilization=0.9, blocked_s=1.0, final_val_loss=loss, bytes_framework=1e6, H_final=4,
                         rank_final=None, n_syncs=30))  # fmt: skip
    meta = dict(machine="m", date="d", load_avg=[1.0, 1.0, 1.0], emulation="netns", replicas=2, ranks_per_replica=2,
                H=20, steps=60, loss_steps=60, max_comm_s=15, reference=True, bench_wall_s=60.0,
                baseline_payload_bytes=None, frame_header_bytes=66, caps_bps=[])  # fmt: skip
    md = wan_report.markdown(dict(meta=meta, rows=rows))
    assert "| dilocox | - | - | 4 | - | 30 |" in md  # the loss table: no loss, no gap
    assert "dilocox loss at equal tokens" not in md  # no verdict without a loss


def test_report_resumed_segment_continues_the_clock(tmp_path):
    """A resumed segment's clock restarts at 0, but its first step can come later on it than the previous segment's
    last one (start-up: data, model, checkpoint, compile): the ``resume`` record starts the new segment."""
    recs = [{"step": s, "loss": 3.0, "time": 0.5 * s} for s in range(1, 7)]
    recs += [{"event": "resume", "resumed_at": 6, "time": 0.1}, {"event": "startup", "time": 0.2}]
    recs += [{"step": s, "loss": 2.0, "time": 4.0 + 0.5 * (s - 6)} for s in range(7, 10)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    t = {r["step"]: r["time"] for r in load_metrics(str(tmp_path))}
    assert t[6] == 3.0 and t[7] == 3.0 + 4.5 and t[9] == 3.0 + 5.5
    # a segment whose clock is seen to restart keeps working as before
    recs = [{"step": 1, "loss": 1.0, "time": 5.0}, {"step": 2, "loss": 1.0, "time": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    assert [r["time"] for r in load_metrics(str(tmp_path))] == [5.0, 6.0]
