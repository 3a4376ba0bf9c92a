"""``dilocox bench lengths``: the gap by run length and the "compression for free" verdict, on hand-made rows."""

from __future__ import annotations

import json
import os

from dilocox.bench import lengths


def _dir(tmp_path, name, steps, losses):
    rows = []
    for label, loss in losses.items():
        rows.append({"label": label, "corpus": "docs", "seed": 0, "steps": steps, "final_val_loss": loss,
                     "loss_vs_allreduce_pct": 100.0 * (loss / losses["allreduce"] - 1.0)})  # fmt: skip
    d = tmp_path / name
    d.mkdir()
    (d / "results.json").write_text(json.dumps({"meta": {"machine": "m"}, "rows": rows}))
    return str(d)


def test_uncompressed_means_whole_pseudo_gradients():
    assert lengths.uncompressed("diloco H=20") and lengths.uncompressed("streaming H=20 K=2 fp32")
    for label in ("streaming H=20 K=2 int4", "opendiloco H=20 (fp16)", "dilocox", "sparseloco H=20 1/64 2-bit"):
        assert not lengths.uncompressed(label), label


def test_the_verdict_takes_the_best_uncompressed_point_per_length(tmp_path):
    a = _dir(tmp_path, "a", 1000, {"allreduce": 1.8, "streaming H=20 K=2 fp32": 2.0, "diloco H=20": 1.95,
                                   "streaming H=20 K=2 int4": 1.5, "dilocox": 1.93})  # fmt: skip
    b = _dir(tmp_path, "b", 3000, {"allreduce": 1.3, "streaming H=20 K=2 fp32": 1.35, "dilocox": 1.36,
                                   "dilocox-far": 1.34})  # fmt: skip
    out = tmp_path / "out"
    assert lengths.main([a, b, "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    v = {x["steps"]: x for x in res["verdicts"] if x["preset"] == "dilocox"}
    far = [x for x in res["verdicts"] if x["preset"] == "dilocox-far"]  # graded where it ran: at 3000 only
    assert [(x["steps"], x["free"]) for x in far] == [(3000, True)]
    # 1000: the best uncompressed is diloco (1.95), not the int4 streaming point (1.5, compressed): dilocox 1.93 wins
    assert v[1000]["best_uncompressed"] == "diloco H=20" and v[1000]["free"] is True
    assert v[3000]["best_uncompressed"] == "streaming H=20 K=2 fp32" and v[3000]["free"] is False
    md = (out / "results.md").read_text()
    assert "| dilocox | 1.9300 (+7.2 %) | 1.3600 (+4.6 %) |" in md
    assert "3000 steps: dilocox 1.3600 (+4.6 %) vs streaming H=20 K=2 fp32 1.3500 (+3.8 %) -> NOT met" in md
    assert "3000 steps: dilocox-far 1.3400 (+3.1 %) vs streaming H=20 K=2 fp32 1.3500 (+3.8 %) -> met" in md
    assert os.path.getsize(out / "gap.png") > 1000


def test_a_point_run_alone_takes_its_gap_from_the_allreduce_of_another_dir(tmp_path):
    """``bench frontier --points "dilocox tau=0"`` runs no allreduce: its gap is to the allreduce row of the same
    corpus, seed and length in another DIR; with none anywhere the cell says so."""
    a = _dir(tmp_path, "a", 1000, {"allreduce": 2.0, "dilocox": 2.1})
    lone = tmp_path / "lone"
    lone.mkdir()
    rows = [{"label": "dilocox tau=0", "corpus": "docs", "seed": 0, "steps": s, "final_val_loss": 2.05}
            for s in (1000, 3000)]  # fmt: skip
    (lone / "results.json").write_text(json.dumps({"meta": {}, "rows": rows}))
    out = tmp_path / "out"
    assert lengths.main([a, str(lone), "--out", str(out)]) == 0
    md = (out / "results.md").read_text()
    assert "| dilocox tau=0 | 2.0500 (+2.5 %) | 2.0500 (no allreduce run) |" in md
