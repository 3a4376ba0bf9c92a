"""Single-process tests of the decoder: parameter counts, causality, RoPE/GQA, stage split, fp8."""

import glob
import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dilocox.config import ConfigError, ModelConfig, load_config
from dilocox.model.attention import SDPAttention, make_attention
from dilocox.model.fp8 import Float8Linear, quantize_dequantize
from dilocox.model.parallel_layers import clip_grad_norm_, is_tensor_parallel, vocab_parallel_cross_entropy
from dilocox.model.transformer import (
    apply_rope,
    build_model,
    build_stage_model,
    model_flops_per_token,
    param_layer_id,
    rope_cos_sin,
)
from tests.reference_attention import reference_attention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN = dict(arch="qwen", norm="rmsnorm", activation="swiglu", pos_emb="rope", bias=False, qkv_bias=True)
SMALL = dict(n_layers=2, n_heads=4, d_model=32, vocab_size=64, max_seq_len=32)
ARCHS = {
    "gpt2": ModelConfig(**SMALL),
    "gpt2-tied": ModelConfig(**SMALL, tie_embeddings=True),
    "opt": ModelConfig(arch="opt", activation="relu", d_ff=96, **SMALL),
    "qwen-gqa": ModelConfig(**QWEN, n_kv_heads=2, d_ff=88, **{**SMALL, "n_layers": 3}),
    "qwen-nobias": ModelConfig(**{**QWEN, "qkv_bias": False}, n_kv_heads=1, **SMALL),
    "swiglu-bias": ModelConfig(activation="swiglu", bias=True, d_ff=40, **SMALL),
}


def _tokens(mcfg, b=2, s=16, seed=0):
    return torch.randint(0, mcfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(ARCHS))
def test_num_params_matches_the_built_model(name):
    mcfg = ARCHS[name]
    model = build_model(mcfg)
    assert sum(p.numel() for p in model.parameters()) == mcfg.num_params()
    non_emb = sum(
        p.numel() for n, p in model.named_parameters() if param_layer_id(n) is not None or n.startswith("norm_f")
    )
    assert non_emb == mcfg.num_params(include_embedding=False)


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "model", "*.yaml"))))
def test_model_configs_load_and_count(path):
    """Every shipped model config validates, builds (on meta) and num_params() counts it exactly."""
    mcfg = load_config(path).model
    model = build_stage_model(mcfg, device="meta")
    assert sum(p.numel() for p in model.parameters()) == mcfg.num_params()
    if "107b" in path:
        assert 107e9 <= mcfg.num_params() <= 112e9


@pytest.mark.parametrize("name", ["gpt2", "opt", "qwen-gqa"])
def test_causal(name):
    """Changing token t changes no logit before t (and does change the logits at t)."""
    mcfg = ARCHS[name]
    model = build_model(mcfg, seed=1)
    x = _tokens(mcfg)
    t = 9
    y = x.clone()
    y[:, t] = (y[:, t] + 1) % mcfg.vocab_size
    with torch.no_grad():
        a, b = model(x), model(y)
    assert a.shape == (2, 16, mcfg.vocab_size)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    assert (a[:, t] - b[:, t]).abs().max() > 1e-4


def test_gqa_attention_matches_repeated_kv_reference():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 7, 4, 8, generator=g)
    k, v = torch.randn(2, 7, 2, 8, generator=g), torch.randn(2, 7, 2, 8, generator=g)
    torch.testing.assert_close(SDPAttention(4, 2)(q, k, v), reference_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_rope_is_relative_and_norm_preserving():
    cos, sin = rope_cos_sin(12, 8, 10000.0)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(8, generator=g), torch.randn(8, generator=g)
    rq = apply_rope(q.expand(1, 12, 1, 8), cos, sin)[0, :, 0]
    rk = apply_rope(k.expand(1, 12, 1, 8), cos, sin)[0, :, 0]
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(12), rtol=1e-5, atol=1e-5)
    # <rope(q, m), rope(k, n)> depends only on m - n
    torch.testing.assert_close(rq[5] @ rk[2], rq[9] @ rk[6], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(rq[5] @ rk[2], rq[5] @ rk[3])


def test_qwen_forward_backward_runs():
    mcfg = ARCHS["qwen-gqa"]
    model = build_model(mcfg)
    x = _tokens(mcfg)
    logits = model(x)
    loss = model.loss(logits[:, :-1], x[:, 1:])
    loss.backward()
    assert math.isfinite(loss.item()) and abs(loss.item() - math.log(mcfg.vocab_size)) < 0.5
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_vocab_parallel_cross_entropy_tp1_equals_torch():
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 5, 11, generator=g)).requires_grad_()
    labels = torch.randint(0, 11, (3, 5), generator=g)
    labels[0, 1] = labels[2, 4] = -100  # ignored tokens
    ref_logits = logits.detach().clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, labels)
    ref = F.cross_entropy(ref_logits.view(-1, 11), labels.view(-1), ignore_index=-100)
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-6)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-5, atol=1e-7)


def test_two_stages_chained_equal_the_whole_model():
    """The pipeline contract: stage1(stage0(x)) gives the 1-process loss and every grad."""
    for mcfg in (ARCHS["gpt2"], ARCHS["qwen-gqa"].__class__(**{**ARCHS["qwen-gqa"].__dict__, "n_layers": 4})):
        ref = build_model(mcfg, seed=3)
        s0 = build_stage_model(mcfg, 0, 2, seed=3)
        s1 = build_stage_model(mcfg, 1, 2, seed=3)
        assert (s0.is_first, s0.is_last, s1.is_first, s1.is_last) == (True, False, False, True)
        assert s0.layer_ids + s1.layer_ids == list(range(mcfg.n_layers))
        x = _tokens(mcfg, seed=4)
        h = s0(x)
        h_in = h.detach().requires_grad_()
        loss = s1.loss(s1(h_in)[:, :-1], x[:, 1:])
        loss.backward()
        h.backward(h_in.grad)
        ref_loss = ref.loss(ref(x)[:, :-1], x[:, 1:])
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-5)
        ref_p = dict(ref.named_parameters())
        staged = {**dict(s0.named_parameters()), **dict(s1.named_parameters())}
        assert sorted(staged) == sorted(ref_p)
        for n, p in staged.items():
            torch.testing.assert_close(p, ref_p[n], rtol=0, atol=0)  # same seeded init by name
            torch.testing.assert_close(p.grad, ref_p[n].grad, rtol=1e-4, atol=1e-6)


def test_param_layer_id_and_state_dict_roundtrip():
    mcfg = ARCHS["gpt2"]
    s1 = build_stage_model(mcfg, 1, 2)
    ids = {param_layer_id(n) for n, _ in s1.named_parameters()}
    assert ids == {1, None} and s1.layer_ids == [1]
    assert param_layer_id("module._orig_mod.layers.12.mlp.up_proj.weight") == 12
    assert param_layer_id("embed.weight") is None and param_layer_id("head.weight") is None
    full = build_model(mcfg, seed=9).state_dict()
    s1.load_full_state_dict(full)
    for n, t in s1.state_dict().items():
        assert torch.equal(t, full[n])


@pytest.mark.parametrize("name", ["gpt2-tied", "qwen-gqa"])
def test_meta_build_then_init_equals_direct_build(name):
    mcfg = ARCHS[name]
    model = build_stage_model(mcfg, device="meta")
    model.to_empty(device="cpu")
    model.init_weights(seed=5)
    ref = build_model(mcfg, seed=5)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]  # tying kept
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
        sharded = n.startswith(("embed.", "head.")) or n.endswith(
            ("_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias", "up_proj.bias", "gate_proj.bias")
        )
        assert is_tensor_parallel(p) == is_tensor_parallel(q) == sharded, n


def test_clip_grad_norm_single_process_matches_torch():
    mcfg = ARCHS["opt"]
    a, b = build_model(mcfg), build_model(mcfg)
    x = _tokens(mcfg)
    for m in (a, b):
        m.loss(m(x)[:, :-1], x[:, 1:]).backward()
    norm = clip_grad_norm_(a.parameters(), 0.1)
    ref = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1)
    torch.testing.assert_close(norm, ref, rtol=1e-5, atol=0)
    assert norm > 0.1  # so clipping did happen
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("name", ["gpt2-tied", "qwen-gqa"])
def test_model_flops_per_token_counts_every_matmul(name):
    """6 N + 12 L d S with N = every parameter but the embedding lookups; a tied head still counts."""
    mcfg = ARCHS[name]
    model = build_model(mcfg)
    n = sum(p.numel() for k, p in model.named_parameters() if not k.startswith(("embed.", "pos_embed.")))
    n += model.head.weight.numel() if mcfg.tie_embeddings else 0
    assert model_flops_per_token(mcfg, 24) == 6 * n + 12 * mcfg.n_layers * mcfg.d_model * 24


def test_fp8_emulate_close_to_fp32_linear():
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(64, 48)
    f8 = Float8Linear(64, 48, emulate=True)
    f8.load_state_dict(lin.state_dict())
    x = torch.randn(4, 8, 64, generator=g)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y = lin(x1), f8(x2)
    assert not torch.equal(y, y_ref)  # it did quantize
    assert (y - y_ref).norm() / y_ref.norm() < 0.08  # e4m3 has a 3-bit mantissa
    gy = torch.randn(y.shape, generator=g)
    y.backward(gy)
    y_ref.backward(gy)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-6)  # straight-through backward
    torch.testing.assert_close(f8.weight.grad, lin.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(f8.bias.grad, lin.bias.grad, rtol=1e-5, atol=1e-6)
    q = quantize_dequantize(x)
    assert torch.isclose(q.abs().max(), x.abs().max(), rtol=1e-6)  # amax maps onto fp8 max exactly


def test_fp8_backend_model_trains_on_cpu():
    mcfg = ModelConfig(**{**SMALL, "linear_backend": "fp8"})
    ref, m = build_model(ModelConfig(**SMALL)), build_model(mcfg)
    x = _tokens(mcfg)
    loss, ref_loss = m.loss(m(x)[:, :-1], x[:, 1:]), ref.loss(ref(x)[:, :-1], x[:, 1:])
    assert abs(loss.item() - ref_loss.item()) < 1e-2 and loss.item() != ref_loss.item()


def test_optional_backends_fail_clearly():
    for backend, module, fix in (
        ("flash_attn", "flash_attn", "pip install flash-attn"),
        ("te", "transformer_engine", "transformer-engine"),
    ):
        try:
            __import__(module)
            continue  # installed: nothing to check here
        except ImportError:
            pass
        with pytest.raises(ConfigError, match=fix):
            make_attention(backend, 4, 4, 8)
    with pytest.raises(ConfigError, match="model.arch"):
        build_model(ModelConfig(arch="qwen"))
    with pytest.raises(ConfigError, match="model.n_layers"):
        build_stage_model(ARCHS["qwen-gqa"], 0, 2)
