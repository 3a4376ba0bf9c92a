"""Docs that are generated must stay in sync with the code."""

import os

from dilocox.config import reference_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_config_reference_is_current():
    with open(os.path.join(ROOT, "docs", "CONFIG.md")) as f:
        assert f.read().strip() == reference_markdown().strip(), "regenerate: python -m dilocox.config > docs/CONFIG.md"


def test_every_shipped_config_loads():
    from dilocox.config import load_config

    for folder in ("configs", "configs/methods"):
        d = os.path.join(ROOT, folder)
        for name in sorted(os.listdir(d)):
            if name.endswith(".yaml"):
                load_config(os.path.join(d, name))


def test_every_measured_table_of_benchmarks_is_what_its_bench_wrote():
    """docs/BENCHMARKS.md's tables between ``<!-- bench:NAME -->`` markers are docs/bench/NAME/results.md as the
    bench wrote it (``python -m dilocox.bench.report`` puts them there): no number edited by hand, none stale."""
    from dilocox.bench.report import BLOCK

    with open(os.path.join(ROOT, "docs", "BENCHMARKS.md")) as f:
        blocks = list(BLOCK.finditer(f.read()))
    assert len(blocks) > 50, len(blocks)  # (the markers are found)
    for m in blocks:
        path = os.path.join(ROOT, "docs", "bench", m.group(2), "results.md")
        assert os.path.exists(path), f"bench:{m.group(2)} has no {path}"
        with open(path) as f:
            assert m.group(3).strip() == f.read().strip(), f"bench:{m.group(2)}: run python -m dilocox.bench.report"
