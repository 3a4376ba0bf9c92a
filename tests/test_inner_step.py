"""dilocox/inner_step.py: the one inner step after the backward pass (``dilocox train`` and the SWARM peers), with
each caller's clipping bits as before the seam: a tensor norm clips as ``clip_grad_norm_`` (the trainer's), a float
norm with the float64 coefficient on the flat gradient (the SWARM peers')."""

from __future__ import annotations

import os

import torch

from dilocox.config import load_config
from dilocox.inner_step import InnerStep
from dilocox.model import build_model, clip_grad_norm_
from dilocox.model.parallel_layers import global_grad_norm
from dilocox.optim import build_inner_optimizer, lr_at

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup(clip: float, *extra: str):
    cfg = load_config(
        os.path.join(ROOT, "configs", "tiny.yaml"),
        ["--model.n_layers=2", "--model.d_model=64", f"--optim.grad_clip={clip}", *extra],
    )
    torch.manual_seed(0)
    model = build_model(cfg.model)
    tok = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    model(tok).float().logsumexp(-1).mean().backward()
    return cfg, model, InnerStep(build_inner_optimizer(cfg, model, torch.device("cpu")), cfg)


def test_a_tensor_norm_clips_as_clip_grad_norm():
    for opt in ("adamw", "muon"):  # (the optimizer's group order is not the model's: the same bits)
        cfg, model, inner = _setup(0.05, f"--optim.name={opt}")
        want = [p.grad.clone() for p in model.parameters()]
        ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in want]
        for p, g in zip(ref, want):
            p.grad = g
        want_norm = clip_grad_norm_(ref, 0.05)
        rec = inner.clip(global_grad_norm(list(model.parameters())))
        assert torch.equal(rec["grad_norm"], want_norm) and set(rec) == {"grad_norm"} and float(want_norm) > 0.05
        for p, r in zip(model.parameters(), ref):
            assert torch.equal(p.grad, r.grad)


def test_a_float_norm_is_the_float64_rule_on_the_flat_gradient():
    for clip in (0.05, 1e9):  # clipped, and untouched below the limit
        cfg, model, inner = _setup(clip)
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        norm = float(flat.double().pow(2).sum()) ** 0.5
        coef = min(1.0, clip / (norm + 1e-6))
        if coef < 1.0:
            flat.mul_(coef)  # what the SWARM peer did before the seam
        assert inner.clip(norm) == {"grad_norm": norm, "clip_coef": coef}
        assert torch.equal(torch.cat([p.grad.reshape(-1) for p in model.parameters()]), flat)


def test_apply_sets_the_lr_steps_and_zeroes():
    cfg, model, inner = _setup(0.0, "--optim.warmup_steps=3")
    before = [p.detach().clone() for p in model.parameters()]
    calls = []
    # clipping off: no norm asked for; the step's lr on every group, the step taken, the grads gone
    assert inner.apply(1, lambda: calls.append(1)) == {"lr": lr_at(1, cfg)}
    assert calls == [] and all(g["lr"] == lr_at(1, cfg) for g in inner.optimizer.param_groups)
    assert all(p.grad is None for p in model.parameters())
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    # take_step False (a SWARM peer without a microbatch): lr and zero_grad only; the norm still asked for
    cfg.optim.grad_clip = 1.0
    after = [p.detach().clone() for p in model.parameters()]
    model.embed.weight.grad = torch.ones_like(model.embed.weight)
    assert inner.apply(2, lambda: 0.0, take_step=False) == {"lr": lr_at(2, cfg), "grad_norm": 0.0, "clip_coef": 1.0}
    assert all(torch.equal(p, a) and p.grad is None for p, a in zip(model.parameters(), after))
