"""Edges of the model and the config a second review found: each case failed on the code before its fix.

- an impossible model setting that loaded and only failed later: ``model.rope_theta <= 0`` (a NaN rotation table,
  trained on silently) and ``model.arch=qwen`` left with GPT-2's blocks (refused only when the ranks built the model,
  under torchrun's failure report); ``model.dropout > 0`` with ``parallel.tensor > 1``, once refused the same way, is
  supported now (tests/test_tp_dropout.py);
- overrides whose text YAML types differently from what the field's coercion accepts: ``--model.bias=1`` / ``=0``
  (YAML's int, refused although the coercion takes "1"/"0"), ``--train.max_tokens=1e9`` (YAML 1.1's text "1e9",
  refused while ``1.0e9`` loaded);
- a section given a false-y value (``--model=0``, ``--model=``, ``model: []``) was taken as an empty section.
"""

from __future__ import annotations

import pytest
import torch

from dilocox.config import ConfigError, ModelConfig, load_config
from dilocox.model.transformer import build_model, rope_cos_sin
from tests.test_train import QWEN_ARGS

ROPE = ["--model.pos_emb=rope"]
QWEN = list(QWEN_ARGS[:-1])  # (the Qwen2 blocks, without the GQA kv heads)


def _err(overrides) -> str:
    with pytest.raises(ConfigError) as ei:
        load_config(None, overrides)
    return str(ei.value)


@pytest.mark.parametrize("theta", ["0", "-1", "-10000.0"])
def test_rope_theta_must_be_positive_at_load_and_build(theta):
    """Before: loaded, and the rotation table was NaN in every dimension but the first pair (0 ** x = 0, 1 / 0)."""
    assert rope_cos_sin(4, 8, float(theta))[0].isnan().any()  # what the model would have trained on
    msg = _err([*ROPE, f"--model.rope_theta={theta}"])
    assert msg.startswith(f"model.rope_theta={float(theta)!r} must be > 0") and "10000" in msg, msg
    with pytest.raises(ConfigError, match="model.rope_theta"):
        build_model(ModelConfig(n_layers=1, vocab_size=64, max_seq_len=16, pos_emb="rope", rope_theta=float(theta)))
    assert load_config(None, [*ROPE, "--model.rope_theta=1e6"]).model.rope_theta == 1e6


def test_dropout_with_tensor_parallel_loads():
    """Once refused (no TP-aware RNG); attention.tp_rank_dropout gives each TP rank its own attention masks now."""
    assert load_config(None, ["--model.dropout=0.1", "--parallel.tensor=2"]).model.dropout == 0.1
    assert load_config(None, ["--model.dropout=0.1"]).model.dropout == 0.1  # one TP rank: fine
    assert load_config(None, ["--parallel.tensor=2"]).parallel.tensor == 2


def test_qwen_label_with_gpt2_blocks_fails_at_load():
    """Before: loaded; refused only by the model's build (after the ranks had started)."""
    msg = _err(["--model.arch=qwen"])
    assert msg.startswith("model.arch='qwen' but model.norm/activation/pos_emb are the GPT-2 defaults"), msg
    assert "norm: rmsnorm" in msg and "qwen-tiny.yaml" in msg
    assert load_config(None, QWEN).model.arch == "qwen"
    with pytest.raises(ConfigError, match="model.arch"):  # the model built in code refuses it as before
        build_model(ModelConfig(arch="qwen"))


@pytest.mark.parametrize("text, want", [("1", True), ("0", False), ("true", True), ("off", False)])
def test_boolean_override_one_and_zero(text, want):
    """Before: `--model.bias=1` was 'model.bias=1 must be a boolean (true/false)' (YAML made the text an int)."""
    cfg = load_config(None, [f"--model.bias={text}", f"--model.qkv_bias={text}"])
    assert cfg.model.bias is want and cfg.model.qkv_bias is want


def test_boolean_field_still_refuses_other_numbers():
    assert "model.bias=2 must be a boolean" in _err(["--model.bias=2"])
    assert "must be a boolean" in _err(["--model.bias=0.5"])


@pytest.mark.parametrize(
    "override, key, want",
    [
        ("--train.max_tokens=1e9", "max_tokens", 10**9),
        ("--train.steps=1e3", "steps", 1000),
        ("--train.steps=2E2", "steps", 200),
        ("--train.max_tokens=1.5e6", "max_tokens", 1_500_000),
    ],
)
def test_integer_in_exponent_notation(override, key, want):
    """Before: '1e9' (text to YAML 1.1, which wants a dot) was 'must be an integer' while '1.0e9' loaded."""
    got = getattr(load_config(None, [override]).train, key)
    assert got == want and type(got) is int


@pytest.mark.parametrize("text", ["1.5", "1e-3", "inf", "nan", "1e400", "ten"])
def test_integer_field_refuses_what_is_not_a_whole_number(text):
    msg = _err([f"--train.steps={text}"])
    assert msg.startswith("train.steps=") and "must be an integer" in msg, msg


@pytest.mark.parametrize("value", ["0", "false", "[]", ""])
def test_a_false_section_value_is_refused(value):
    """Before: `--model=0`, `--model=false`, `--model=[]` and `--model=` loaded as the default model section."""
    msg = _err([f"--model={value}"])
    assert msg.startswith("model must be a mapping") and "--model.KEY=VALUE" in msg, msg
    assert "outer.streaming must be a mapping" in _err([f"--outer.streaming={value}"])


def test_a_false_section_value_in_yaml_is_refused_and_an_empty_one_is_the_default(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: []\n")
    with pytest.raises(ConfigError, match="model must be a mapping"):
        load_config(str(bad))
    empty = tmp_path / "empty.yaml"
    empty.write_text("model:\ntrain:\n  steps: 3\n")
    cfg = load_config(str(empty))
    assert cfg.model == ModelConfig() and cfg.train.steps == 3


def test_rope_table_of_a_valid_base_is_finite():
    cos, sin = rope_cos_sin(8, 16, 0.5)  # a base below 1 is odd but defined
    assert torch.isfinite(cos).all() and torch.isfinite(sin).all()


@pytest.mark.parametrize(
    "overrides, named",
    [(["--train.device=cpu"], "train.device='cpu'"), (["--train.dtype=fp32"], "train.dtype='fp32'")],
)
def test_flash_attn_on_a_cpu_or_in_fp32_fails_at_load(overrides, named):
    """Before: loaded; with flash-attn installed every rank raised 'needs fp16/bf16 CUDA tensors' at its first forward
    (model/attention.py), after the run had started."""
    msg = _err(["--model.attn_backend=flash_attn", *overrides])
    assert msg.startswith("model.attn_backend='flash_attn' needs fp16/bf16 CUDA tensors") and named in msg, msg
    assert "model.attn_backend=sdpa" in msg


def test_flash_attn_loads_where_it_can_run():
    for overrides in ([], ["--train.device=cuda", "--train.dtype=bf16"], ["--train.dtype=bf16"]):
        assert load_config(None, ["--model.attn_backend=flash_attn", *overrides]).model.attn_backend == "flash_attn"
    assert load_config(None, ["--train.device=cpu", "--train.dtype=fp32"]).model.attn_backend == "sdpa"


@pytest.mark.parametrize("method", ["allreduce", "cocktailsgd"])
def test_streaming_tau_with_a_per_step_method_is_refused(method):
    """``outer.streaming.tau`` loaded with the per-step methods and did nothing (they average every step's gradients;
    fragments and overlap were refused already)."""
    with pytest.raises(ConfigError, match=r"outer.streaming.tau=1 has no effect with outer.method="):
        load_config(None, ["--parallel.replicas=2", f"--outer.method={method}", "--outer.streaming.tau=1"])
