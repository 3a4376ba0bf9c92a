"""The user docs say what the code does: README's "Using it" commands name flags, config keys, files and bench
kinds that exist, and the preset table's bytes are the codec's."""

import os
import re

import pytest

from dilocox.cli import main
from dilocox.config.loading import _all_keys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _using_it_commands() -> list[str]:
    """The ``dilocox ...`` lines of README's "Using it" block, continuation lines joined."""
    text = open(os.path.join(ROOT, "README.md")).read()
    block = text.split("## Using it", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    block = re.sub(r"\\\n\s*", " ", block)
    return [ln.split("#", 1)[0].strip() for ln in block.splitlines() if ln.strip().startswith("dilocox ")]


def _help(capsys, argv: list[str]) -> str:
    try:
        main(argv)
    except SystemExit:
        pass
    out = capsys.readouterr()
    return out.out + out.err


def _help_argv(words: list[str]) -> list[str]:
    cmd = words[1]
    if cmd == "plan" and "--swarm" in words:
        return ["plan", "--swarm", "--help"]
    if cmd == "launch" and "--elastic" in words:
        return ["launch", "--elastic", "1", "--help"]
    if cmd == "data":
        return ["data", "prepare", "--help"]
    return [cmd, "--help"]


def test_using_it_block_is_found():
    cmds = _using_it_commands()
    assert len(cmds) >= 15 and any(c.startswith("dilocox bench ") for c in cmds)


@pytest.mark.parametrize("line", [c for c in _using_it_commands() if not c.startswith("dilocox bench ")])
def test_every_flag_key_and_file_of_using_it_exists(capsys, line):
    words = line.replace("[", " ").replace("]", " ").split()
    keys = set(_all_keys())
    helptext = _help(capsys, _help_argv(words))
    for w in words[2:]:
        if w.startswith("--") and "." in w.split("=", 1)[0]:
            key = w[2:].split("=", 1)[0]
            assert key in keys, f"README 'Using it': {line}: no config key {key}"
        elif w.startswith("--") and w != "--help":
            assert re.search(re.escape(w) + r"(?![\w-])", helptext), f"README 'Using it': {line}: no option {w}"
        elif w.endswith(".yaml"):
            assert os.path.isfile(os.path.join(ROOT, w)), f"README 'Using it': {line}: no file {w}"


def test_every_bench_kind_of_using_it_exists(capsys):
    (line,) = [c for c in _using_it_commands() if c.startswith("dilocox bench ")]
    listed = [k.strip() for k in line[len("dilocox bench ") :].split("|")]
    usage = _help(capsys, ["--help"])
    kinds = re.findall(r"^    (\w+)\s{2,}", usage.split("bench kinds", 1)[1], flags=re.M)
    assert sorted(listed) == sorted(kinds)


def test_preset_table_bytes_match_the_sparse_codec():
    """README's "sent per sync" of the sparse presets is the codec's payload (Rice-coded indices, the default)."""
    from dilocox.compress.sparse import tensor_payload_bytes

    text = open(os.path.join(ROOT, "README.md")).read()
    n = 4096 * 1024
    for preset, density in (("dilocox", 1 / 128), ("dilocox-far", 1 / 128), ("streaming-sparse", 1 / 32)):
        row = re.search(r"^\| `%s` \|.*$" % re.escape(preset), text, flags=re.M).group(0)
        stated = float(re.search(r"~([0-9.]+) % of fp32", row).group(1))
        actual = 100 * tensor_payload_bytes(n, 4096, density, 2) / (4 * n)
        assert abs(stated - actual) <= 0.05 * actual + 0.01, f"{preset}: README {stated} %, codec {actual:.3f} %"


def test_swarm_doc_config_block_states_the_defaults():
    """docs/SWARM.md's ``swarm:`` block shows every key it lists at its default (config/sections.py)."""
    import yaml

    from dilocox.config.sections import SwarmConfig

    text = open(os.path.join(ROOT, "docs", "SWARM.md")).read()
    block = text.split("## Config (`swarm:` section", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    shown = yaml.safe_load(block)["swarm"]
    defaults = SwarmConfig()
    for key, value in shown.items():
        default = getattr(defaults, key)
        assert (list(default) if isinstance(default, tuple) else default) == value, f"swarm.{key}: {value} vs {default}"
