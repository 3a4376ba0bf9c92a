"""Outer state of one rank's shard: global params θ and Nesterov momentum v, flat fp32.

Only this rank's shard is stored (no rank-0 copy of the model): the dual-optimizer policy of
DiLoCoX §2.2. The two flat buffers live on the host (pinned when the params are on CUDA) or
on the params' device (``outer.state_device``). They are laid out fragment by fragment, so
fragment ``p`` is one contiguous slice and its outer step is a handful of vector ops.

The outer step is a ``torch.optim.Optimizer`` (``optimizer``) over per-parameter views of θ, built by
``make_optimizer`` (``dilocox.optim.build_outer_optimizer`` from ``outer.optimizer``); ``outer_step`` sets the views'
``.grad`` to the averaged pseudo-gradient of one fragment and calls its ``step()``. The default is
``dilocox.optim.OuterSGD`` (ALGORITHMS §1, torch.optim.SGD semantics without weight decay/dampening), whose v lives
in the flat ``momentum`` buffer:

    v ← μ v + g
    θ ← θ − η (g + μ v)     nesterov
    θ ← θ − η v             otherwise
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# (parameter indices, views of θ one per parameter, views of v one per parameter) -> the optimizer
MakeOptimizer = Callable[[list[int], list[Tensor], list[Tensor]], torch.optim.Optimizer]


class OuterState:
    """Flat θ and v of the params ``params`` (a rank's shard), grouped by ``fragments``."""

    def __init__(
        self,
        params: list[Tensor],
        fragments: list[list[int]],
        state_device: str = "host",
        make_optimizer: MakeOptimizer | None = None,
        lr: float = 0.7,
        momentum: float = 0.9,
        nesterov: bool = True,
    ) -> None:
        """``make_optimizer``: builds the outer optimizer over the views (None: ``OuterSGD`` with ``lr``,
        ``momentum``, ``nesterov``)."""
        if state_device not in ("host", "device"):
            raise ValueError(f"outer.state_device={state_device!r} is not one of ['host', 'device']")
        self.params = params
        self.fragments = fragments
        param_device = params[0].device if params else torch.device("cpu")
        self.device = torch.device("cpu") if state_device == "host" else param_device
        pin = state_device == "host" and param_device.type == "cuda"
        self.offsets: dict[int, tuple[int, int]] = {}  # param index -> (start, numel)
        self.bounds: list[tuple[int, int]] = []  # fragment -> [start, end)
        pos = 0
        for frag in fragments:
            start = pos
            for i in frag:
                self.offsets[i] = (pos, params[i].numel())
                pos += params[i].numel()
            self.bounds.append((start, pos))
        self.numel = pos
        self.theta = torch.empty(pos, dtype=torch.float32, device=self.device, pin_memory=pin)
        self.momentum = torch.zeros(pos, dtype=torch.float32, device=self.device, pin_memory=pin)
        with torch.no_grad():
            for i, (s, n) in self.offsets.items():
                self.theta[s : s + n].copy_(params[i].detach().reshape(-1))
        self._order = order = [i for frag in fragments for i in frag]
        self._views = {i: self.view(self.theta, i) for i in order}  # the optimizer's parameters: θ per parameter
        self.optimizer: torch.optim.Optimizer | None = None
        if order:
            if make_optimizer is None:
                from dilocox.optim import OuterSGD

                def make_optimizer(_, ts, vs):
                    return OuterSGD(ts, lr=lr, momentum=momentum, nesterov=nesterov, momentum_buffers=vs)

            self.optimizer = make_optimizer(
                order, [self._views[i] for i in order], [self.view(self.momentum, i) for i in order]
            )

    # ------------------------------------------------------------------ views
    def view(self, buf: Tensor, i: int) -> Tensor:
        s, n = self.offsets[i]
        return buf[s : s + n].view(self.params[i].shape)

    def frag(self, buf: Tensor, p: int) -> Tensor:
        s, e = self.bounds[p]
        return buf[s:e]

    def shapes(self, p: int) -> list[torch.Size]:
        return [self.params[i].shape for i in self.fragments[p]]

    # ------------------------------------------------------------------ the rules
    def _split(self, flat: Tensor, p: int) -> list[Tensor]:
        """Per-parameter views (their shapes) of a tensor laid out as fragment ``p``."""
        s0 = self.bounds[p][0]
        return [
            flat[self.offsets[i][0] - s0 :][: self.offsets[i][1]].view(self.params[i].shape) for i in self.fragments[p]
        ]

    @torch.no_grad()
    def pseudo_gradient(self, p: int, shift: float = 0.0) -> list[Tensor]:
        """Δ_p = θ_p − shift·v_p − θ_{m,p}: fresh fp32 tensors on the params' device, one per parameter. ``shift``:
        the look-ahead the phase started from (``load_params``), so Δ is the phase's own work from its start.
        Whole-fragment copies and foreach ops (a few kernels on a GPU, not a few per parameter)."""
        if not self.fragments[p]:
            return []
        ws = [self.params[i].detach().float() for i in self.fragments[p]]
        dev = ws[0].device
        out = torch._foreach_sub(self._split(self.frag(self.theta, p).to(dev, non_blocking=True), p), ws)
        if shift:
            torch._foreach_sub_(out, self._split(self.frag(self.momentum, p).to(dev), p), alpha=shift)
        return out

    def flatten(self, tensors: list[Tensor]) -> Tensor:
        """Concatenate per-parameter tensors of one fragment into one flat fp32 state-device tensor."""
        return torch.cat([t.reshape(-1).float() for t in tensors]).to(self.device)

    def set_lr_factor(self, factor: float) -> None:
        """Every group of the outer optimizer at ``factor`` x its configured lr (``outer.lr_schedule=inner``)."""
        if self.optimizer is None:
            return
        if not hasattr(self, "_base_lrs"):
            self._base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g, base in zip(self.optimizer.param_groups, self._base_lrs):
            g["lr"] = base * factor

    @torch.no_grad()
    def outer_step(self, p: int, grad: Tensor) -> None:
        """θ_p ← the outer optimizer's step on fragment ``p`` with ``grad`` (flat fp32 on the state device, laid out as
        the fragment): each parameter's ``.grad`` is its slice, then ``optimizer.step()``; the other fragments have
        no ``.grad`` and are left alone."""
        if not self.fragments[p]:
            return
        views = [self._views[i] for i in self.fragments[p]]
        for t, g in zip(views, self._split(grad, p)):
            t.grad = g
        try:
            self.optimizer.step()
        finally:
            for t in views:
                t.grad = None

    @torch.no_grad()
    def load_params(self, p: int, alpha: float = 0.0, shift: float = 0.0) -> None:
        """θ_{m,p} ← α θ_{m,p} + (1 − α) θ_p (α = 0: plain reset to the outer params); ``shift`` (α = 0 only): the
        reset goes to θ_p − shift·v_p instead (``outer.lookahead``; computed in fp32, then cast). One copy of the
        fragment to the params' device, then foreach ops (a parameter at a time when their dtypes differ)."""
        ws = [self.params[i] for i in self.fragments[p]]
        if not ws:
            return
        dev, dtype = ws[0].device, ws[0].dtype
        theta = self.frag(self.theta, p)
        if shift and alpha == 0.0:
            theta = theta - shift * self.frag(self.momentum, p)
        if alpha == 0.0:
            torch._foreach_copy_(ws, self._split(theta.to(dev), p))  # (blocking: θ changes on the host next)
        elif all(w.dtype == dtype for w in ws):
            torch._foreach_mul_(ws, alpha)
            torch._foreach_add_(ws, self._split(theta.to(dev, dtype), p), alpha=1.0 - alpha)
        else:
            for w, t in zip(ws, self._split(theta, p)):
                w.mul_(alpha).add_(t.to(w.device, w.dtype), alpha=1.0 - alpha)

    @torch.no_grad()
    def merge_from(self, p: int, alpha: float, step: Tensor) -> None:
        """θ_{m,p} ← θ_{m,p} + (1 − α)·step with step = θ_p − θ⁰_{m,p} (flat fp32; θ⁰: the fragment's params when its
        round was launched): ``load_params``' mix taken from θ⁰ instead of from θ_{m,p}, so the steps trained while
        the round flew keep their progress (``outer.streaming.merge=replay``, ALGORITHMS §4b)."""
        ws = [self.params[i] for i in self.fragments[p]]
        if not ws:
            return
        ds = self._split(step.to(ws[0].device), p)
        if all(w.dtype == torch.float32 for w in ws):
            torch._foreach_add_(ws, ds, alpha=1.0 - alpha)
        else:
            for w, d in zip(ws, ds):
                w.add_(d.to(w.dtype), alpha=1.0 - alpha)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """θ and v (flat), and the optimizer's own state where it keeps any beyond v (``outer.optimizer=muon``)."""
        sd = {"theta": self.theta.detach().cpu().clone(), "momentum": self.momentum.detach().cpu().clone()}
        extra = self.optimizer_extra()
        if extra is not None:
            sd["optimizer"] = extra
        return sd

    def _is_flat_momentum(self, t) -> bool:
        return torch.is_tensor(t) and t.untyped_storage().data_ptr() == self.momentum.untyped_storage().data_ptr()

    def optimizer_extra(self, copy: bool = True) -> dict | None:
        """The optimizer's per-parameter state beyond the views of ``momentum`` (Muon's own momentum), by position
        (a str) in the optimizer's parameter order; None when there is none (``OuterSGD``). ``copy``: host copies (a
        checkpoint); False: the live tensors (a live join's snapshot: they change only in ``outer_step``, on the main
        thread, after the all-reduce that may serve them was waited for, as θ and v)."""
        if self.optimizer is None:
            return None
        state = {}
        for k, i in enumerate(self._order):
            st = self.optimizer.state.get(self._views[i], {})
            rest = {
                n: (v.detach().cpu().clone() if copy else v) if torch.is_tensor(v) else v
                for n, v in st.items()
                if not self._is_flat_momentum(v)
            }
            if rest:
                state[str(k)] = rest
        return {"state": state} if state else None

    def load_state_dict(self, sd: dict) -> None:
        for key in ("theta", "momentum"):
            t = sd[key]
            if t.numel() != self.numel:
                raise ValueError(
                    f"outer state {key!r} in the checkpoint has {t.numel()} elements, this shard has "
                    f"{self.numel}: the checkpoint was written for a different model or parallel layout"
                )
            getattr(self, key).copy_(t)
        self.load_optimizer_extra(sd.get("optimizer"))

    def load_optimizer_extra(self, extra: dict | None) -> None:
        """Restore what ``optimizer_extra`` returned (None: nothing beyond v; the optimizer's own state is cleared, so
        a live join does not keep a state of the trajectory it left)."""
        if extra is None:
            if self.optimizer is not None:
                for i in self._order:
                    st = self.optimizer.state.get(self._views[i], {})
                    for n in [n for n, v in st.items() if not self._is_flat_momentum(v)]:
                        del st[n]
            return
        if self.optimizer is None or max(map(int, extra["state"]), default=-1) >= len(self._order):
            raise ValueError(
                "the checkpoint's outer optimizer state does not fit this shard's parameters: it was written "
                "for a different outer.optimizer, model or parallel layout"
            )
        for k, st in extra["state"].items():
            t = self._views[self._order[int(k)]]
            for n, v in st.items():
                self.optimizer.state[t][n] = v.to(t.device, copy=True) if torch.is_tensor(v) else v  # (never shared)
