"""CLI edges (third review): a space-separated override before CONFIG, and an empty ``--flag=`` value."""

from __future__ import annotations

import os

import pytest

from dilocox.config import ConfigError, load_config
from dilocox.launch import emulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_value_taken_for_the_config_file_says_the_config_comes_first(tmp_path, monkeypatch):
    """``dilocox launch --elastic 2 --train.steps 5 CONFIG`` took ``5`` as the config file: "config file '5' does not
    exist", with nothing on why. A missing path that is no YAML file now says the CONFIG comes first."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"'.*/5' does not exist; the CONFIG file comes first"):
        load_config("5", [])
    with pytest.raises(ConfigError) as e:  # a YAML path that is missing: just that
        load_config("missing.yaml", [])
    assert "comes first" not in str(e.value)


def test_an_empty_flag_value_is_an_error_not_the_next_word(monkeypatch, capsys):
    """``dilocox launch --bandwidth= --replicas 2 ...`` took ``--replicas`` as the bandwidth (then failed on the 2)."""
    monkeypatch.setattr(emulate, "launch", lambda *a, **k: pytest.fail("launched"))
    rc = emulate.launch_main(["--bandwidth=", "--replicas", "2", "--nproc-per-replica", "1", "c.yaml"])
    assert rc == 2
    assert "--bandwidth needs a value" in capsys.readouterr().err
