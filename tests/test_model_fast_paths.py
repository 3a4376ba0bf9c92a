"""The opt-in fast paths of the model against the paths they replace (each off by default until a GPU measures it).

``model.fused_qkv``: q, k and v as one GEMM over their weights concatenated per call (Megatron's fused QKV) against
the three projections it replaces (``Attention.qkv`` with ``fused_qkv`` off, the reference): the same loss and
gradients on one process (GPT-2 with biases; Qwen with grouped-query attention and q/k/v-only biases) and under tensor
parallelism (each rank concatenates its own q/k/v shards); the parameters, their names and shapes do not change; an
fp8 linear is refused with it.

``model.loss_backend=torch``: ``F.cross_entropy`` in fp32 against the vocab-parallel cross-entropy at T = 1 (ignored
labels included): the same loss and gradients; refused with tensor parallelism."""

from __future__ import annotations

import os

import pytest
import torch

from dilocox.config import ConfigError, load_config
from dilocox.model.transformer import build_model
from tests.small_run import small_cfg
from tests.spawn import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _loss_and_grads(cfg, fused: bool, x, y):
    m = build_model(cfg.model, seed=1)
    for block in m.layers.values():
        block.attn.fused_qkv = fused
    loss = m.loss(m(x), y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in m.named_parameters()}, m


@pytest.mark.parametrize("model", ["gpt2-tiny", "qwen-tiny"])
def test_the_fused_gemm_equals_the_three_projections(model):
    cfg = load_config(os.path.join(ROOT, "configs", "model", f"{model}.yaml"), ["--model.n_layers=2"])
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.model.vocab_size, (2, 24), generator=g) for _ in range(2))
    ref, ref_grads, m0 = _loss_and_grads(cfg, False, x, y)
    got, grads, m1 = _loss_and_grads(cfg, True, x, y)
    assert all(b.attn.fused_qkv for b in m1.layers.values())
    assert got == pytest.approx(ref, rel=1e-6)
    assert grads.keys() == ref_grads.keys()
    for n, gr in grads.items():
        torch.testing.assert_close(gr, ref_grads[n], rtol=1e-5, atol=1e-7, msg=n)
    assert [(n, p.shape) for n, p in m0.named_parameters()] == [(n, p.shape) for n, p in m1.named_parameters()]


def test_the_config_knob_builds_fused_attention_and_refuses_fp8():
    cfg = load_config(None, ["--model.fused_qkv=true"])
    assert all(b.attn.fused_qkv for b in build_model(cfg.model, seed=0).layers.values())
    with pytest.raises(ConfigError, match="model.fused_qkv=True needs model.linear_backend=torch"):
        load_config(None, ["--model.fused_qkv=true", "--model.linear_backend=fp8"])


def _losses(rank, world, tmp, steps):
    from test_train import QWEN_ARGS

    from dilocox.train import Trainer

    out = {}
    for fused in ("false", "true"):
        t = Trainer(small_cfg(f"{tmp}/{fused}", "--parallel.tensor=2", "--checkpoint.every=0",
                              f"--model.fused_qkv={fused}", *QWEN_ARGS, steps=steps))  # fmt: skip
        out[fused] = [t.train_step() for _ in range(steps)]
        if t.run_lock is not None:
            t.run_lock.release()
        t.logger.close()
    return out


def test_tensor_parallel_ranks_fuse_their_own_shards(tmp_path):
    for out in run_ranks(2, _losses, str(tmp_path), 3):
        assert out["true"] == pytest.approx(out["false"], rel=1e-5), out


def test_torch_cross_entropy_equals_the_vocab_parallel_one():
    cfg = load_config(os.path.join(ROOT, "configs", "model", "gpt2-tiny.yaml"), ["--model.n_layers=1"])
    g = torch.Generator().manual_seed(2)
    x, y = (torch.randint(0, cfg.model.vocab_size, (3, 20), generator=g) for _ in range(2))
    y[0, :5] = y[2, -1] = -100  # ignored labels count in neither
    out = {}
    for backend in ("vocab_parallel", "torch"):
        cfg.model.loss_backend = backend
        m = build_model(cfg.model, seed=4)
        loss = m.loss(m(x), y)
        loss.backward()
        out[backend] = loss.item(), {n: p.grad for n, p in m.named_parameters()}
    (ref, ref_grads), (got, grads) = out["vocab_parallel"], out["torch"]
    assert got == pytest.approx(ref, rel=1e-6)
    for n, gr in grads.items():
        torch.testing.assert_close(gr, ref_grads[n], rtol=1e-5, atol=1e-7, msg=n)
    for backend in ("vocab_parallel", "torch"):  # every label ignored: 0, not 0/0
        cfg.model.loss_backend = backend
        m = build_model(cfg.model, seed=4)
        assert m.loss(m(x), torch.full_like(y, -100)).item() == 0.0
        with pytest.raises(ValueError, match="disagree"):
            m.loss(m(x), y.view(-1))
    with pytest.raises(ConfigError, match="model.loss_backend='torch' needs parallel.tensor=1"):
        load_config(None, ["--model.loss_backend=torch", "--parallel.tensor=2"])
