"""One definition of each shared helper (issue 12 item 4): seeds, process-group helpers, quant kinds, τ rules."""

from __future__ import annotations

import ast
import pathlib

import pytest

from dilocox.config import QUANT_KINDS, CompressConfig, Config, ConfigError, OuterConfig, StreamingConfig, validate
from dilocox.outer.fragments import SyncSchedule
from dilocox.seeding import mix_seed, splitmix64, text_seed

PKG = pathlib.Path(__file__).resolve().parent.parent / "dilocox"


def _package_trees() -> dict[str, ast.AST]:
    return {str(p.relative_to(PKG.parent)): ast.parse(p.read_text(), str(p)) for p in sorted(PKG.rglob("*.py"))}


def test_seed_functions_keep_their_values():
    """The values the four former copies produced (initial weights, batches and compression draws of
    earlier runs depend on them): mix_seed = compress/collectives.py's, text_seed(f"{seed}/{name}") =
    model/transformer.py's _param_seed, text_seed(repr(tuple)) = data/sampler.py's mix_seed."""
    assert mix_seed(7, 3, 1) == 7362018936073737808
    assert mix_seed() == 2177342782468422677
    assert mix_seed(2**64 + 5, -1) == 2297278680379809788
    assert text_seed("7/embed.weight") == 3654282023073634624
    assert text_seed(repr((7, 0, 12))) == 3831360653651250584
    assert text_seed(repr((7, "epoch", 2))) == 4054921877526935520
    assert splitmix64(0) == 0 and splitmix64(12345) == 17540659726606785873  # mix64 of csrc/quant_core.h


def test_each_helper_defined_once():
    names = (
        "mix_seed",
        "text_seed",
        "splitmix64",
        "_param_seed",
        "_mix64_int",
        "group_rank",
        "group_world",
        "group_size",
        "check_outer_schedule",
        "reference_attention",
    )
    where: dict[str, list[str]] = {n: [] for n in names}
    for path, tree in _package_trees().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in where:
                where[node.name].append(path)
    for name in ("mix_seed", "text_seed", "splitmix64"):
        assert where[name] == ["dilocox/seeding.py"], (name, where[name])
    assert where["group_rank"] == where["group_world"] == ["dilocox/distributed/topology.py"]
    assert where["check_outer_schedule"] == ["dilocox/config/checks.py"]
    for gone in ("_param_seed", "_mix64_int", "group_size", "reference_attention"):  # reference_attention: tests/
        assert where[gone] == [], (gone, where[gone])


def test_quant_kinds_listed_once():
    """No module spells the list of quantization kinds again: they import config.QUANT_KINDS."""
    kinds = set(QUANT_KINDS)
    found = []
    for path, tree in _package_trees().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) == len(kinds):
                values = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                if values == kinds:
                    found.append(f"{path}:{node.lineno}")
    assert len(found) == 1 and found[0].startswith("dilocox/config/checks.py:"), found


def test_linear_backend_te_rejected_at_validation():
    cfg = Config()
    cfg.model.linear_backend = "te"
    with pytest.raises(ConfigError, match=r"model.linear_backend='te' is not supported.*use model.linear_backend=fp8"):
        validate(cfg)
    cfg.model.linear_backend = "fp8"
    validate(cfg)


@pytest.mark.parametrize(
    "H,K,tau,overlap,match",
    [
        (6, 4, 0, "none", r"outer.streaming.fragments=4 must divide outer.sync_every=6"),
        (8, 2, 4, "none", r"outer.streaming.tau=4 must be in \[0, sync_every/fragments=4\)"),
        (4, 1, 1, "delayed", r"outer.streaming.tau=1 cannot be combined with outer.overlap='delayed'"),
    ],
)
def test_tau_rules_same_from_config_and_schedule(H, K, tau, overlap, match):
    """validate() and the outer loop's SyncSchedule apply one rule with one message."""
    cfg = Config()
    s = StreamingConfig(fragments=K, tau=tau)
    cfg.outer = OuterConfig(method="diloco", sync_every=H, overlap=overlap, streaming=s)
    cfg.model.n_layers = 4
    with pytest.raises(ConfigError, match=match):
        validate(cfg)
    if overlap == "none":
        with pytest.raises(ConfigError, match=match):
            SyncSchedule(K, H, tau)


def test_adaptive_with_fragments_rejected_by_validate():
    cfg = Config()
    cfg.model.n_layers = 4
    cfg.outer = OuterConfig(method="diloco", sync_every=4, streaming=StreamingConfig(fragments=2))
    cfg.compress = CompressConfig()
    cfg.compress.adaptive.enabled = True
    with pytest.raises(
        ConfigError,
        match=r"compress.adaptive.enabled=True is not supported with "
        r"outer.streaming.fragments=2",
    ):
        validate(cfg)
