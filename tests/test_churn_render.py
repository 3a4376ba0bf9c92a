"""``dilocox bench churn --render``: OUT/results.md re-drawn from OUT/results.json with nothing run; the median of an
even number of rejoins is the mean of the middle two; results stored before the start-up record existed render
without that column; a missing or corrupt results.json is one line and exit status 2."""

from __future__ import annotations

import json

import pytest

from dilocox.bench import churn


def _rejoin(t: float, first: float, outer: float, startup: dict | None = None) -> dict:
    r = {"event": "restart", "replica": 1, "job": "replica1", "t": t, "first_step_s": first,
         "first_outer_step_s": outer, "at_step": 10}  # fmt: skip
    if startup is not None:
        r["startup"] = startup
    return r


def _results(rejoins: list[dict]) -> dict:
    side = {"complete": True, "wall_s": 100.0, "tokens_per_s_per_replica": 1000.0, "goodput": 1.0,
            "outer_steps_compared": 20, "outer_steps_differing": [], "final_val_loss": 2.0}  # fmt: skip
    return {
        "replicas": 2, "method": "dilocox", "H": 4, "steps": 80, "period": 30.0, "down": 10.0, "standby": 0,
        "seed": 0, "emulation": "loopback (namespaces off)", "machine": "m", "date": "d", "command": "c",
        "undisturbed": side, "churned": {**side, "goodput": 0.9, "kills": 2, "lighthouse_kills": 0,
                                         "rejoins": rejoins}, "loss_vs_equal_tokens_pct": 0.5,
    }  # fmt: skip


def _render(tmp_path, res, capsys) -> tuple[int, str]:
    (tmp_path / "results.json").write_text(json.dumps(res))
    before = (tmp_path / "results.json").read_text()
    rc = churn.main(["--render", "--out", str(tmp_path)])
    capsys.readouterr()
    assert (tmp_path / "results.json").read_text() == before  # render never rewrites the stored results
    return rc, (tmp_path / "results.md").read_text() if (tmp_path / "results.md").exists() else ""


def test_render_reproduces_the_table(tmp_path, capsys):
    res = _results([_rejoin(30.0, 2.0, 3.0), _rejoin(60.0, 7.0, 8.0)])
    rc, md = _render(tmp_path, res, capsys)
    assert rc == 0
    assert md == churn.markdown(res) + "\n"  # what the bench itself writes
    assert "| rejoin: event → first outer step, median (max) over 2 | — | 5.5 s (8.0 s) |" in md  # (3 + 8) / 2
    assert "| event | t (s) | job | → first step (s) | → first outer step (s) |\n|---|---|---|---|---|\n" in md
    assert "| restart replica 1 | 30.0 | replica1 | 2.0 | 3.0 |\n" in md
    assert "start-up" not in md  # no row has a startup record: the column is left out


def test_render_keeps_the_startup_column_when_a_row_has_it(tmp_path, capsys):
    su = {"process_s": 1.25, "distributed_s": 0.1, "data_s": 0.05, "model_s": 0.2, "outer_s": 0.1, "join_s": 0.3}
    rc, md = _render(tmp_path, _results([_rejoin(30.0, 2.0, 3.0, su), _rejoin(60.0, 7.0, 8.0)]), capsys)
    assert rc == 0
    assert "| → first outer step (s) | a restart's start-up (s): process, groups, data, model, outer, join |" in md
    assert "| restart replica 1 | 30.0 | replica1 | 2.0 | 3.0 | 1.2, 0.1, 0.1, 0.2, 0.1, 0.3 |" in md
    assert "| restart replica 1 | 60.0 | replica1 | 7.0 | 8.0 | — |" in md  # a row without one: a dash, not a value


@pytest.mark.parametrize("content", [None, "{not json", '{"replicas": 2}', "[]"])
def test_render_without_usable_results_is_one_line_and_exit_2(tmp_path, capsys, content):
    if content is not None:
        (tmp_path / "results.json").write_text(content)
    assert churn.main(["--render", "--out", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("dilocox bench churn --render: cannot read ") and "results.json" in err
    assert not (tmp_path / "results.md").exists()


def test_the_stored_churn_tables_are_what_render_draws():
    """docs/bench/churn*/results.md are the current renderer's drawing of their results.json (no hand edits)."""
    import os

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "bench")
    for name in ("churn", "churn-standby", "churn-30min"):
        with open(os.path.join(root, name, "results.json")) as f:
            res = json.load(f)
        with open(os.path.join(root, name, "results.md")) as f:
            assert f.read() == churn.markdown(res) + "\n", name
