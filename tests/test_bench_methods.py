"""``dilocox bench methods``: every preset and every ablation variant builds a valid config
that differs from ``dilocox-paper`` (DiLoCoX's own recipe) in exactly what its label says."""

import os

import pytest

from dilocox.bench.methods import ABLATION, METHODS, method_body
from dilocox.bench.runner import write_config
from dilocox.config import load_config


def _load(tmp_path, preset, overrides=(), H=20):
    path = write_config(
        os.path.join(tmp_path, "c.yaml"), ["tiny.yaml", f"methods/{preset}.yaml"], method_body(preset, H)
    )
    return load_config(path, list(overrides))


@pytest.mark.parametrize("method", METHODS)
def test_presets_load_on_the_bench_layout(tmp_path, method):
    cfg = _load(tmp_path, method)
    assert cfg.parallel.replicas == 2 and cfg.parallel.pipeline == 2
    if method == "dilocox":  # the preset's own H: its density, not H, sets its bytes
        assert cfg.outer.sync_every == 4 and cfg.compress.sparse.enabled and cfg.outer.streaming.tau == 1
    elif method not in ("allreduce", "cocktailsgd"):
        assert cfg.outer.sync_every == 20


def _knobs(cfg):
    return {
        "overlap": cfg.outer.overlap,
        "lr": cfg.outer.lr,
        "momentum": cfg.outer.momentum,
        "quant": cfg.compress.quant,
        "lowrank": cfg.compress.lowrank.enabled,
        "adaptive": cfg.compress.adaptive.enabled,
        "lookahead": cfg.outer.lookahead,
    }


def test_ablation_variants_switch_off_what_they_name(tmp_path):
    full = _knobs(_load(tmp_path, "dilocox-paper"))
    assert full == {
        "overlap": "delayed",
        "lr": 0.5,
        "momentum": 0.0,
        "quant": "int4",
        "lowrank": True,
        "adaptive": True,
        "lookahead": 0.0,
    }
    labels = [label for label, _, _ in ABLATION]
    assert len(set(labels)) == len(labels) and "allreduce" in labels and "dilocox-paper" in labels
    for label, preset, extra in ABLATION:
        if label == "allreduce":
            continue
        assert preset == "dilocox-paper", label
        got = _knobs(_load(tmp_path, preset, extra))
        changed = {k for k in full if got[k] != full[k]}
        expect = set()
        if "no delay" in label or "eager" in label:
            expect.add("overlap")
            assert got["overlap"] == ("eager" if "eager" in label else "none")
        if "momentum 0.5" in label:
            expect.add("momentum")
            assert got["momentum"] == 0.5
        if "no compression" in label:
            expect |= {"quant", "lowrank", "adaptive"}
            assert got["quant"] == "none" and not got["lowrank"]
        if "no low rank" in label:
            expect.add("lowrank")
        if "no adaptive" in label:
            expect.add("adaptive")
        if "look-ahead" in label:
            expect.add("lookahead")
            assert got["lookahead"] == float(label.rsplit("lookahead ", 1)[1].rstrip(")"))
        if "0.7/0.9" in label:
            expect |= {"lr", "momentum"}
            assert (got["lr"], got["momentum"]) == (0.7, 0.9)
        assert changed == expect, (label, changed, expect)


def test_plots_carry_their_own_title_and_distinguishable_curves(tmp_path):
    from dilocox.bench.methods import plot

    rows = [{"method": label, "val_curve": [(50, 3.0), (100, 2.5)]} for label, _, _ in ABLATION]  # identical curves
    ab = plot(rows, str(tmp_path / "ablation.png"), ablation=True)
    me = plot(rows[:2], str(tmp_path / "methods.png"), ablation=False)
    assert "ablation" in ab["title"].lower() and "ablation" not in me["title"].lower()
    looks = [(m, ls) for _, m, ls in ab["styles"]]
    assert len(set(looks)) == len(rows)  # curves on top of each other still differ by marker/line style
    assert ab["legend_outside"] and (tmp_path / "ablation.png").stat().st_size > 0
