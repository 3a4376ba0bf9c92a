"""Edges of the bench harnesses' pure parts (renderers, merges, gap and median rules), each found by a review and
checked against values worked out by hand."""

import argparse
import json

import pytest


def _scale_row(label: str, loss: float, sent: int, width: int = 128, replicas: int = 4, **kw) -> dict:
    common = dict(params=1, steps=1000, corpus="docs", seed=0, global_batch=16)
    return dict(
        label=label, final_val_loss=loss, bytes_sent_per_replica=sent, width=width, replicas=replicas, **common, **kw
    )


def _scale_results(path, rows: list[dict]) -> None:
    path.mkdir()
    meta = dict(machine="m", date="d", steps=1000, corpus="docs", seed=0, global_batch=16, wall_min=1.0)
    (path / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}))


def test_scale_merge_gives_every_gap_against_the_allreduce_row_the_cell_shows(tmp_path):
    from dilocox.bench import scale

    # sweep A: allreduce 2.0 and dilocox 2.2 (+10 %); sweep B re-ran the cell's allreduce (2.1): the merged cell
    # shows B's allreduce, so A's dilocox row is 2.2 / 2.1 - 1 = +4.76 % from it, not the +10 % of A's own
    a_rows = [_scale_row("allreduce", 2.0, 1000), _scale_row("dilocox", 2.2, 2)]
    for r in a_rows:
        r.update(loss_vs_allreduce_pct=100.0 * (r["final_val_loss"] / 2.0 - 1), bytes_ratio_vs_allreduce=1000 / r[
            "bytes_sent_per_replica"])  # fmt: skip
    _scale_results(tmp_path / "a", a_rows)
    _scale_results(tmp_path / "b", [_scale_row("allreduce", 2.1, 1200, loss_vs_allreduce_pct=0.0,
                                               bytes_ratio_vs_allreduce=1.0)])  # fmt: skip
    assert scale.main(["--render", "--out", str(tmp_path / "a"), "--merge", str(tmp_path / "b")]) == 0
    rows = json.loads((tmp_path / "a" / "results.json").read_text())["rows"]
    dx = next(r for r in rows if r["label"] == "dilocox")
    assert dx["loss_vs_allreduce_pct"] == pytest.approx(100.0 * (2.2 / 2.1 - 1))
    assert dx["bytes_ratio_vs_allreduce"] == pytest.approx(600.0)
    md = (tmp_path / "a" / "results.md").read_text()
    assert "| allreduce | 2.1000 (+0.0 %, 1x) |" in md and "| dilocox | 2.2000 (+4.8 %, 600x) |" in md
    assert "- d=128, R=4: dilocox +4.8 % -> NOT met" in md


def test_scale_plot_draws_every_point_at_every_width(tmp_path, monkeypatch):
    import matplotlib.axes

    from dilocox.bench import scale

    seen, plot_ = [], matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda ax, *a, **kw: seen.append(kw.get("label")) or plot_(
        ax, *a, **kw))  # fmt: skip

    labels = ["allreduce"] + [f"dilocox lever {i}" for i in range(6)]  # 6 points and 5 widths: 30 lines
    rows = []
    for width in (32, 64, 96, 128, 160):
        for R in (2, 4):
            for i, label in enumerate(labels):
                rows.append(_scale_row(label, 2.0 + i / 100, 10, width, R, loss_vs_allreduce_pct=float(i)))
    drawn = scale.plot(rows, str(tmp_path / "gap.png"))
    assert len(seen) == 30 and "dilocox lever 5, d=160" in seen and drawn == seen


def test_swarm_act_append_refuses_results_of_another_H(tmp_path):
    from dilocox.bench import swarm_act

    old = {"steps": 400, "H": 50, "peers": [4, 4], "set": [], "command": "c", "date": "d",
           "rows": [{"corpus": "code", "sync": "diloco", "point": "int8"}]}  # fmt: skip
    (tmp_path / "results.json").write_text(json.dumps(old))
    p = swarm_act._parser()
    res = {"rows": [{"corpus": "code", "sync": "diloco", "point": "fp32"}], "command": "c2", "date": "d2"}
    a = argparse.Namespace(out=str(tmp_path), append=True, steps=400, H=10, set=[])
    with pytest.raises(SystemExit) as e:  # the old int8 row (H = 50) would be graded against an fp32 row of H = 10
        swarm_act._append(p, a, res, [4, 4])
    assert e.value.code == 2
    a.H = 50  # the same settings: the rows are kept
    swarm_act._append(p, a, res, [4, 4])
    assert [r["point"] for r in res["rows"]] == ["int8", "fp32"]


def test_churn_rejoin_median_of_an_even_count(tmp_path):
    from dilocox.bench import churn

    rejoins = [{"event": "restart", "replica": 0, "job": "replica0", "t": 10.0 * i, "first_step_s": s - 0.5,
                "first_outer_step_s": s} for i, s in enumerate((4.0, 1.0, 10.0, 2.0))]  # fmt: skip
    res = dict(replicas=4, method="dilocox", H=4, steps=40, period=30, down=10, standby=0, emulation="loopback",
               date="d", machine="m", command="c", undisturbed={}, churned={"rejoins": rejoins})  # fmt: skip
    md = churn.markdown(res)
    assert "median (max) over 4 | — | 3.0 s (10.0 s) |" in md  # (2 + 4) / 2, not the upper middle 4.0


def test_elastic_outer_interval_is_the_median_of_the_intervals_before_the_kill():
    from dilocox.bench.elastic import analyze

    # survivors' outer steps land at 1, 2 and 5 s (intervals 1 and 3: median 2), the kill at 5.5 s, the next outer
    # step at 9 s: 9 - 5 - 2 = 2 s beyond the usual interval
    recs = [(1, 0.5, 0), (2, 1.0, 1), (3, 2.0, 2), (4, 5.0, 3), (5, 6.0, 3), (6, 9.0, 4)]
    steps = [{"step": s, "wall": w, "outer_step": o} for s, w, o in recs]
    reps = [{"steps": steps, "summary": {"final_val_loss": 2.0}} for _ in range(2)]
    reps.append({"steps": steps[:4], "summary": {}})
    ev = [{"event": "start", "wall": 0.0}, {"event": "kill", "replica": 2, "wall": 5.5}]
    out = analyze({"events": ev, "replicas": reps}, 100, victim=2)
    assert out["outer_interval_s"] == pytest.approx(2.0) and out["kill_extra_s"] == pytest.approx(2.0)
    assert out["kill_to_next_outer_s"] == pytest.approx(3.5)


def test_wan_header_names_the_batch_an_override_set():
    """`bench wan --set=--train.batch_size=2` wrote "8 x 128 tokens per replica per step" in its header."""
    from dilocox.bench.wan_report import _batch

    assert _batch([]) == "8 x 128"
    assert _batch(["--model.d_model=256", "--train.batch_size=2"]) == "2 x 128"
    assert _batch(["--train.seq_len=64", "--train.batch_size=4"]) == "4 x 64"
