"""The inner step once the gradients exist, ONE for ``dilocox train`` and the SWARM peers (issue 43 item 4):
``InnerStep(optimizer, cfg).apply(step, norm_fn)`` sets step ``step``'s learning rate (``dilocox.optim.lr_at``),
clips to ``optim.grad_clip`` = c by ``norm_fn()``, the global gradient norm as the caller's topology defines it
(the trainer's over its model-parallel group; a SWARM peer's over all stages through the store, or its stage's
own: ``swarm/peer_sync.py``), steps the optimizer and zeroes the grads. It returns the step record's ``lr``,
``grad_norm`` and (float norms) ``clip_coef``.

The grads are scaled by min(1, c / (norm + 1e-6)) computed where the norm is, so each caller keeps its bits: a
tensor norm (the trainer's, on the device) through torch's ``clip_grads_with_norm_`` in fp32 with no host sync; a
float norm (a SWARM peer's, summed in float64) in float64, scaling only when the coefficient is below 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dilocox.config import Config
from dilocox.optim import lr_at, set_lr


class InnerStep:
    """The part of an inner step after the backward pass (module docstring); its owner may replace ``optimizer``
    (an elastic replica that took the live state starts a fresh one)."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: Config) -> None:
        self.optimizer, self.cfg = optimizer, cfg

    def set_lr(self, step: int) -> float:
        lr = lr_at(step, self.cfg)
        set_lr(self.optimizer, lr)
        return lr

    def clip(self, norm: float | Tensor) -> dict:
        """Scale the grads to ``optim.grad_clip`` by the global norm ``norm`` (before clipping)."""
        c = self.cfg.optim.grad_clip
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if isinstance(norm, Tensor):
            torch.nn.utils.clip_grads_with_norm_(params, c, norm)
            return {"grad_norm": norm}
        coef = min(1.0, c / (norm + 1e-6))
        if coef < 1.0 and params:
            torch._foreach_mul_([p.grad for p in params], coef)
        return {"grad_norm": norm, "clip_coef": coef}

    @torch.no_grad()
    def apply(self, step: int, norm_fn: Callable[[], float | Tensor] | None, take_step: bool = True) -> dict:
        """``norm_fn``: called once when ``optim.grad_clip`` > 0 (None: no clipping). ``take_step`` False (a SWARM
        peer without a gradient this step): no optimizer step; the lr, the norm and zero_grad as always."""
        rec: dict = {"lr": self.set_lr(step)}
        if norm_fn is not None and self.cfg.optim.grad_clip > 0:
            rec.update(self.clip(norm_fn()))
        if take_step:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return rec
