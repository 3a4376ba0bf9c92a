"""Edge cases of the bench reports found by the numbers audit: a derived column must use the right baseline."""

from __future__ import annotations

import pytest

from dilocox.bench import lengths
from dilocox.bench import swarm as bs


def _run(val_loss: float, **kw) -> dict:
    return {"peers": [4, 4], "val_loss": val_loss, "train_loss_last": val_loss, "losses": [5.0, 4.0], "tokens": 1000,
            "stage_syncs": 8, "pipeline_bytes": 1e6, "pipeline_bytes_planned": 1e6, "sync_bytes": 1e6,
            "tokens_s": 100.0, **kw}  # fmt: skip


def _swarm_res(a_set: list[str], d_set: list[str], a_steps: int = 400) -> dict:
    """(d) run now with ``d_set``; (a) carried over from an earlier run of ``a_set`` and ``a_steps``."""
    return {"date": "NEW", "machine": "m", "load_before": "1", "load_after": "2", "command": "dilocox bench swarm",
            "steps": 400, "H": 50, "set": d_set, "ablation_H": [10],
            "d": {bs.diloco_label(10): _run(2.2, H=10, stage_syncs=40)},
            "a": {"SWARM 4x2": _run(2.0, stage_syncs=400), bs.diloco_label(50): _run(2.4)},
            "earlier": {"a": {"date": "OLD", "load_before": "3", "load_after": "4", "command": "dilocox x",
                              "steps": a_steps, "H": 50, "set": a_set}}}  # fmt: skip


def test_swarm_part_d_gap_only_against_a_part_a_of_the_same_settings():
    """``--parts d`` into an --out whose (a) was measured with another --set (batch, outer lr) or length: (d)'s
    "vs SWARM 4x2" must not be a gap to that other run's SWARM (it was: +10.0 % against a SWARM of batch 16)."""
    same = bs.markdown(_swarm_res(["--train.batch_size=64"], ["--train.batch_size=64"]))
    assert "| 10 | 40 | 2.2000 | +10.0 % |" in same
    other = bs.markdown(_swarm_res(["--train.batch_size=16"], ["--train.batch_size=64"]))
    assert "| 10 | 40 | 2.2000 | - |" in other and "+10.0 %" not in other
    longer = bs.markdown(_swarm_res([], [], a_steps=2000))
    assert "| 10 | 40 | 2.2000 | - |" in longer
    outer = bs.markdown(_swarm_res([], ["--outer.lr=0.5"]))  # SWARM has no outer step: its row stays the baseline
    assert "| 10 | 40 | 2.2000 | +10.0 % |" in outer


def _row(label: str, loss: float, source: str, gap: float | None = None) -> dict:
    r = {"corpus": "docs", "seed": 0, "steps": 1000, "label": label, "final_val_loss": loss, "source": source}
    return r if gap is None else dict(r, loss_vs_allreduce_pct=gap)


def test_lengths_refuses_a_point_given_twice_for_one_corpus_seed_and_length():
    """Two DIRs holding the same (corpus, seed, point, steps): the table showed the later row only, while the other
    points kept their gaps to the earlier DIR's all-reduce, i.e. a gap not to the all-reduce row printed beside it."""
    rows = [_row("allreduce", 2.0, "A", 0.0), _row("dilocox", 2.1, "A", 5.0), _row("allreduce", 1.9, "B", 0.0)]
    with pytest.raises(SystemExit, match=r"'allreduce' at 1000 steps \(docs, seed 0\) is in both A and B"):
        lengths.table(rows)
    ok = lengths.table([_row("allreduce", 2.0, "A", 0.0), _row("dilocox", 2.1, "B")])  # one each: gap across DIRs
    assert ok[("docs", 0)]["points"]["dilocox"][1000]["loss_vs_allreduce_pct"] == pytest.approx(5.0)


def test_methods_table_and_plot_take_a_failed_row(tmp_path):
    """`dilocox bench methods --keep-going` keeps a failed run as a row without blocked time, tokens/s or a curve:
    the table raised KeyError on it (and the plot unpacked its empty curve), losing the rows that had run."""
    from dilocox.bench import methods

    ok = {"method": "allreduce", "final_val_loss": 3.5, "bytes_sent_per_replica": 2e6, "blocked_s": 0.5,
          "tokens_per_s": 1000.0, "val_curve": [(10, 4.0), (20, 3.5)]}  # fmt: skip
    bad = {"method": "diloco lr=9", "preset": "diloco", "overrides": [], "failed": "non-finite loss | at step 7\nmore",
           "final_val_loss": float("nan"), "bytes_sent_per_replica": 0, "val_curve": []}  # fmt: skip
    md = methods.markdown([ok, bad], steps=20, H=10)
    row = [line for line in md.splitlines() if line.startswith("| diloco lr=9")]
    assert row == ["| diloco lr=9 | failed: non-finite loss / at step 7 | - | - | - | - | - |"], md
    assert "| allreduce | 3.5000 |" in md
    drawn = methods.plot([ok, bad], str(tmp_path / "val_loss.png"))
    assert [s[0] for s in drawn["styles"]] == ["allreduce"] and (tmp_path / "val_loss.png").exists()
