"""``dilocox bench frontier``: every point is a valid config of its family, the front and the target verdicts
are computed right (synthetic rows), and --render redraws from results.json."""

import json
import os

import pytest

from dilocox.bench import frontier
from dilocox.bench.methods import method_body
from dilocox.bench.runner import write_config
from dilocox.config import load_config


@pytest.mark.parametrize("point", frontier.POINTS + frontier.LEVERS, ids=lambda p: p[0])
@pytest.mark.parametrize("corpus", sorted(frontier.CORPORA))
def test_points_load_on_both_corpora(tmp_path, point, corpus):
    label, family, preset, extra = point
    path = write_config(str(tmp_path / "c.yaml"), ["tiny.yaml", f"methods/{preset}.yaml"], method_body(preset, 20))
    cfg = load_config(path, [frontier.CORPORA[corpus], "--train.seed=1", *extra])
    assert cfg.data.source == {"code": "stdlib", "prose": "prose", "docs": "docs"}[corpus]
    for o in extra:  # the knob the label names is the one set
        key, val = o.removeprefix("--").split("=")
        sec, *rest = key.split(".")
        obj = getattr(cfg, sec)
        for k in rest:
            obj = getattr(obj, k)
        assert str(obj) == val or float(obj) == float(val), (label, key, obj)
    assert set(frontier.QUICK) <= {p[0] for p in frontier.POINTS}


def _row(label, family, nbytes, loss, corpus="code", seed=0):
    return dict(label=label, family=family, bytes_sent_per_replica=nbytes, final_val_loss=loss, corpus=corpus,
                seed=seed, steps=300)  # fmt: skip


def test_front_and_verdicts():
    rows = [
        _row("allreduce", "allreduce", 1_000_000_000, 2.20),
        _row("diloco H=20", "diloco", 50_000_000, 2.40),
        _row("dilocox", "dilocox", 900_000, 2.25),  # 1111x, +2.3 %
        _row("sparseloco H=20 1/64 2-bit", "sparseloco", 400_000, 2.30),
        _row("worse and dearer", "diloco", 60_000_000, 2.50),
    ]
    assert frontier.pareto(rows) == {"allreduce", "dilocox", "sparseloco H=20 1/64 2-bit"}
    frontier._mark_front(rows)
    md = frontier.markdown(rows, dict(machine="m", date="d", corpora=["code"], seeds=[0], wall_min=1.0))
    assert "dilocox *" in md and "worse and dearer *" not in md
    assert "1,111x at +2.3 % -> target (>= 1000x, <= +3 %, nothing cheaper and better) met" in md
    assert "best point at >= 1000x: dilocox" in md
    rows[3]["final_val_loss"] = 2.21  # now sparseloco is cheaper AND better than dilocox: the target is missed
    frontier._mark_front(rows)
    md = frontier.markdown(rows, dict(machine="m", date="d", corpora=["code"], seeds=[0], wall_min=1.0))
    assert "NOT met (cheaper and better: sparseloco H=20 1/64 2-bit)" in md


def test_render_redraws_from_results(tmp_path):
    rows = [_row("allreduce", "allreduce", 10**9, 2.2), _row("dilocox", "dilocox", 10**6, 2.3),
            _row("allreduce", "allreduce", 10**9, 2.4, corpus="prose"), _row("dilocox", "dilocox", 10**6, 2.5,
            corpus="prose")]  # fmt: skip
    meta = dict(machine="m", date="d", corpora=["code", "prose"], seeds=[0], wall_min=1.0)
    (tmp_path / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    assert frontier.main(["--render", "--out", str(tmp_path)]) == 0
    assert os.path.getsize(tmp_path / "frontier.png") > 10_000
    assert "| prose | 0 | 300 | dilocox * |" in (tmp_path / "results.md").read_text()


def test_render_without_results_is_one_line_exit_2(tmp_path, capsys):
    assert frontier.main(["--render", "--out", str(tmp_path / "none")]) == 2
    assert "cannot read" in capsys.readouterr().err
