"""`dilocox bench checkpoint` runs end to end on the tiny model and its table holds what it measured."""

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_checkpoint_tiny(tmp_path):
    from dilocox.bench import checkpoint

    out = tmp_path / "out"
    model = os.path.join(ROOT, "configs", "model", "gpt2-tiny.yaml")
    args = ["--model", model, "--layouts", "pp2", "--repeats", "1", "--out", str(out), "--workdir", str(tmp_path / "w")]
    assert checkpoint.main(args) == 0
    rows = json.loads((out / "results.json").read_text())
    assert [r["layout"] for r in rows] == ["pp2"] and rows[0]["ranks"] == 2
    r = rows[0]
    # the DCP checkpoint holds what the per-rank torch.save holds (within the metadata and JSON overheads)
    assert 0.9 < r["bytes"] / r["ref_bytes"] < 1.2, r
    assert all(x > 0 for x in r["save"] + r["ref_save"] + r["load"] + r["reshard"]), r
    assert "| pp2 | 2 |" in (out / "results.md").read_text()
