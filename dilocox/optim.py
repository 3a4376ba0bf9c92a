"""The inner optimizer and its schedule: one builder for every trainer (``dilocox train``, the SWARM peers,
the torchft reference), so a config trains the same way whichever runs it.

``build_inner_optimizer``: AdamW (or SGD, ``optim.name``) with weight decay on the matrices only, none on
biases and norms (the Megatron / nanoGPT convention), or ``optim.name=muon``: ``torch.optim.Muon`` on the
hidden matrices of the transformer blocks and AdamW on the rest (embeddings, head, biases, norms), the split of
Muon's authors and of MuLoCo (Thérien et al. 2025: Muon as DiLoCo's inner optimizer); ``lr_at``: linear
warm-up, then cosine / linear / constant decay to ``optim.min_lr_ratio``, or warmup-stable-decay (``wsd``,
``wsd-sqrt``); ``set_lr`` applies it to every parameter group. ``param_order`` is the index order of the
optimizer's state (checkpoints, resharding).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dilocox.config import Config


def lr_at(step: int, cfg: Config) -> float:
    """Inner learning rate at (0-based) step: linear warm-up to ``optim.lr`` at step ``warmup_steps - 1``, then
    cosine/linear/constant decay from ``optim.lr`` at step ``warmup_steps`` to ``optim.lr * min_lr_ratio`` at the
    last step, ``train.steps - 1`` (a span of ``steps - 1 - warmup_steps``; over ``steps - warmup_steps`` the last
    step stayed above the floor). A run with at most one step after the warm-up has no decay (``optim.lr``)."""
    o, total = cfg.optim, cfg.train.steps
    if o.warmup_steps and step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return o.lr
    span = max(1, total - 1 - o.warmup_steps)
    frac = min(1.0, (step - o.warmup_steps) / span)
    floor = o.lr * o.min_lr_ratio
    if o.schedule == "linear":
        return floor + (o.lr - floor) * (1.0 - frac)
    if o.schedule.startswith("wsd"):  # held at lr, then the last decay_fraction of the span cools down to the floor
        stable = 1.0 - o.decay_fraction
        if frac <= stable:  # (compared, not clamped: 1 - (1 - frac) / share rounds to ~1e-16 at the boundary,
            return o.lr  # and wsd-sqrt's sqrt made that a ~1e-8 dip below the peak on the stable phase's last step)
        p = 1.0 if frac >= 1.0 else min(1.0, (frac - stable) / o.decay_fraction)  # the floor exactly at the end
        return floor + (o.lr - floor) * (1.0 - (math.sqrt(p) if o.schedule == "wsd-sqrt" else p))
    return floor + 0.5 * (o.lr - floor) * (1.0 + math.cos(math.pi * frac))


def is_muon_param(name: str, is_matrix: bool) -> bool:
    """A hidden matrix of a transformer block (``layers.<i>....weight``, 2-D): Muon's; the embeddings, the head,
    biases and norms stay with AdamW."""
    return is_matrix and (name.startswith("layers.") or ".layers." in name)


def param_order(params: list[tuple[str, bool]], optim_name: str) -> list[list[str]]:
    """The parameter groups of ``build_inner_optimizer`` as names, in optimizer index order, from
    ``(name, is_matrix)`` in ``named_parameters`` order: [matrices, vectors], or for muon [Muon's matrices,
    AdamW's matrices, vectors]."""
    if optim_name == "muon":
        return [
            [n for n, m in params if is_muon_param(n, m)],
            [n for n, m in params if m and not is_muon_param(n, m)],
            [n for n, m in params if not m],
        ]
    return [[n for n, m in params if m], [n for n, m in params if not m]]


class MuonAdamW(torch.optim.Optimizer):
    """``optim.name=muon``: ``torch.optim.Muon`` over its matrices, ``torch.optim.AdamW`` over the rest, seen as
    ONE optimizer: ``param_groups`` is both lists (the same dicts, so ``set_lr`` reaches both), ``state`` is one
    dict both write to, and ``state_dict`` / ``load_state_dict`` are torch's own over those (index order =
    ``param_order``)."""

    def __init__(
        self,
        muon_groups: list[dict],
        adamw_groups: list[dict],
        muon_kw: dict,
        adamw_kw: dict,
        rest: type[torch.optim.Optimizer] = torch.optim.AdamW,
    ) -> None:
        """``rest``: the optimizer of the parameters Muon does not take (AdamW inside a replica; ``OuterSGD`` for
        ``outer.optimizer=muon``)."""
        self._muon = torch.optim.Muon(muon_groups, **muon_kw)
        self._adamw = rest(adamw_groups, **adamw_kw)
        groups = self._muon.param_groups + self._adamw.param_groups
        super().__init__([{"params": g["params"]} for g in groups], {})
        self._n_muon = len(self._muon.param_groups)
        self._link(groups)

    def _link(self, groups: list[dict]) -> None:
        self.param_groups = groups
        self._muon.param_groups, self._adamw.param_groups = groups[: self._n_muon], groups[self._n_muon :]
        self._muon.state = self._adamw.state = self.state

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon.step()
        self._adamw.step()
        return loss

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "_n_muon"):  # (torch's __init__ adds the groups once, before the halves are linked)
            raise NotImplementedError("MuonAdamW: build a new optimizer (optim.name=muon) instead of adding groups")
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # (replaces param_groups and state: link them again)
        self._link(self.param_groups)


def build_inner_optimizer(cfg: Config, model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """AdamW without weight decay on biases and norms (Megatron/nanoGPT convention), SGD, or Muon + AdamW."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    by_name = dict(named)
    order = param_order([(n, p.dim() >= 2) for n, p in named], cfg.optim.name)
    wd = cfg.optim.weight_decay
    kw: dict[str, Any] = {"lr": cfg.optim.lr, "betas": tuple(cfg.optim.betas), "eps": cfg.optim.eps}
    if device.type == "cuda":
        kw["fused"] = True
    else:  # torch's default off CUDA is a loop over the tensors; foreach is the same update, bit for bit (issue 39)
        kw["foreach"] = True
    if cfg.optim.name == "muon":
        muon, mats, vecs = ([by_name[n] for n in g] for g in order)
        # adjust_lr_fn="match_rms_adamw": Muon's update scaled to AdamW's RMS, so optim.lr and its schedule are
        # the same numbers as for AdamW (Liu et al. 2025, "Muon is scalable for LLM training")
        muon_kw = {"lr": cfg.optim.lr, "momentum": cfg.optim.muon_momentum, "adjust_lr_fn": "match_rms_adamw"}
        return MuonAdamW(
            [{"params": muon, "weight_decay": wd}],
            [{"params": mats, "weight_decay": wd}, {"params": vecs, "weight_decay": 0.0}],
            muon_kw,
            kw,
        )
    decay, no_decay = ([by_name[n] for n in g] for g in order)
    groups = [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optim.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.optim.lr)
    return torch.optim.AdamW(groups, **kw)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """The learning rate of every parameter group (``lr_at`` of the step)."""
    for g in opt.param_groups:
        g["lr"] = lr


# --------------------------------------------------------------------------- the outer optimizer (issue 43)

OUTER_OPTIMIZERS = ("sgd", "muon")


class OuterSGD(torch.optim.Optimizer):
    """The outer step of ALGORITHMS §1 as a ``torch.optim.Optimizer``; the gradient is the averaged pseudo-gradient:

        v ← μ v + g
        θ ← θ − η (g + μ v)     nesterov
        θ ← θ − η v             otherwise

    ``torch.optim.SGD``'s rule (dampening 0, no weight decay; the same bits), except that v is kept at μ = 0 too
    (v = g there: ``outer.lookahead`` reads it). ``momentum_buffers`` (one per parameter, in order): the tensors
    that hold v, views of the flat outer state, so checkpoints and resharding see one flat buffer; without them v
    starts at zeros of each parameter's shape."""

    def __init__(self, params, lr: float, momentum: float = 0.0, nesterov: bool = False, momentum_buffers=None):
        if lr < 0 or momentum < 0:
            raise ValueError(f"OuterSGD: lr={lr} and momentum={momentum} must be >= 0")
        super().__init__(params, {"lr": lr, "momentum": momentum, "nesterov": nesterov})
        if momentum_buffers is not None:
            ps = [p for g in self.param_groups for p in g["params"]]
            if len(ps) != len(momentum_buffers):
                raise ValueError(f"OuterSGD: {len(momentum_buffers)} momentum buffers for {len(ps)} parameters")
            for p, b in zip(ps, momentum_buffers):
                if b.shape != p.shape:
                    raise ValueError(f"OuterSGD: a momentum buffer of shape {tuple(b.shape)} for {tuple(p.shape)}")
                self.state[p]["momentum_buffer"] = b

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            if not ps:
                continue
            lr, mu = group["lr"], group["momentum"]
            gs = [p.grad for p in ps]
            vs = []
            for p in ps:  # (the flat buffer's views; zeros only for a parameter that has none yet)
                st = self.state[p]
                if st.get("momentum_buffer") is None:
                    st["momentum_buffer"] = torch.zeros_like(p)
                vs.append(st["momentum_buffer"])
            torch._foreach_mul_(vs, mu)
            torch._foreach_add_(vs, gs)
            upd = torch._foreach_add(gs, vs, alpha=mu) if group["nesterov"] else vs
            torch._foreach_sub_(ps, upd, alpha=lr)
        return loss


def build_outer_optimizer(
    ocfg: Any, named: list[tuple[str, torch.Tensor]], momentum_buffers: list[torch.Tensor]
) -> torch.optim.Optimizer:
    """The outer optimizer of a rank's shard (``outer.optimizer``) over ``named``: (global name, θ of that parameter,
    a view of the flat outer state), with ``momentum_buffers`` (views of the flat v, same order) for the SGD rule.

    - ``sgd``: ``OuterSGD`` (outer.lr, outer.momentum, outer.nesterov), the papers' outer Nesterov;
    - ``muon``: ``torch.optim.Muon`` (lr outer.lr, momentum outer.momentum, Nesterov, no weight decay, its update
      scaled to AdamW's RMS) on the hidden matrices of the blocks (``is_muon_param``), ``OuterSGD`` on the rest.

    Any ``torch.optim.Optimizer`` fits here: the outer loop sets each parameter's ``.grad`` to its averaged
    pseudo-gradient and calls ``step()``; the parameters it sets none for (other fragments) are left alone."""
    name = getattr(ocfg, "optimizer", "sgd")
    sgd_kw = {"lr": ocfg.lr, "momentum": ocfg.momentum, "nesterov": bool(ocfg.nesterov)}
    if name == "sgd":
        return OuterSGD([t for _, t in named], momentum_buffers=momentum_buffers, **sgd_kw)
    if name == "muon":
        muon = [(t, b) for (n, t), b in zip(named, momentum_buffers) if is_muon_param(n, t.dim() == 2)]
        rest = [(t, b) for (n, t), b in zip(named, momentum_buffers) if not is_muon_param(n, t.dim() == 2)]
        if not muon:  # (a DP shard may hold only the embedding and head: the SGD rule on all of it)
            return OuterSGD([t for _, t in named], momentum_buffers=momentum_buffers, **sgd_kw)
        muon_kw = {"lr": ocfg.lr, "momentum": ocfg.momentum, "nesterov": bool(ocfg.nesterov), "weight_decay": 0.0}
        muon_kw["adjust_lr_fn"] = "match_rms_adamw"
        opt = MuonAdamW(
            [{"params": [t for t, _ in muon]}], [{"params": [t for t, _ in rest]}], muon_kw, sgd_kw, OuterSGD
        )
        for t, b in rest:  # v of the SGD half in the flat buffer (Muon keeps its own momentum in its state)
            opt.state[t]["momentum_buffer"] = b
        return opt
    raise ValueError(f"outer.optimizer={name!r} is not one of {list(OUTER_OPTIMIZERS)}")
