"""The inner optimizer and its schedule: one builder for every trainer (``dilocox train``, the SWARM peers,
the torchft reference), so a config trains the same way whichever runs it.

``build_inner_optimizer``: AdamW (or SGD, ``optim.name``) with weight decay on the matrices only, none on
biases and norms (the Megatron / nanoGPT convention); ``lr_at``: linear warm-up, then cosine / linear /
constant decay to ``optim.min_lr_ratio``; ``set_lr`` applies it to every parameter group.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dilocox.config import Config


def lr_at(step: int, cfg: Config) -> float:
    """Inner learning rate at (0-based) step: linear warm-up, then cosine/linear/constant decay."""
    o, total = cfg.optim, cfg.train.steps
    if o.warmup_steps and step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return o.lr
    span = max(1, total - o.warmup_steps)
    frac = min(1.0, (step - o.warmup_steps) / span)
    floor = o.lr * o.min_lr_ratio
    if o.schedule == "linear":
        return floor + (o.lr - floor) * (1.0 - frac)
    return floor + 0.5 * (o.lr - floor) * (1.0 + math.cos(math.pi * frac))


def build_inner_optimizer(cfg: Config, model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """AdamW without weight decay on biases and norms (Megatron/nanoGPT convention)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optim.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.optim.lr)
    kw: dict[str, Any] = {"lr": cfg.optim.lr, "betas": tuple(cfg.optim.betas), "eps": cfg.optim.eps}
    if device.type == "cuda":
        kw["fused"] = True
    return torch.optim.AdamW(groups, **kw)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """The learning rate of every parameter group (``lr_at`` of the step)."""
    for g in opt.param_groups:
        g["lr"] = lr
