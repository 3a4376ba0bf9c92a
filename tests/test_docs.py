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
