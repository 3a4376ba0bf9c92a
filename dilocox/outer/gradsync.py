"""Per-step gradient communication over the outer group: ``allreduce`` and ``cocktailsgd``.

After every backward pass (``on_gradients``) the gradients of this rank's shard are replaced
by their mean over the replicas: with the compressor's all-reduce (``allreduce``: plain or
quantized, ALGORITHMS §1 with H = 1) or with CocktailSGD's random + top-k sparsified,
quantized exchange with error feedback (``cocktailsgd``, §8). The inner optimizer then steps
on the averaged gradients, so there is no outer optimizer and no outer state.
With a single replica (outer group None) the gradients are left as they are.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dilocox.compress.cocktail import cocktail_allreduce
from dilocox.compress.compressor import build_compressor
from dilocox.config import CompressConfig, OuterConfig
from dilocox.outer.base import OuterBase

METHODS = ("allreduce", "cocktailsgd")


class GradientSync(OuterBase):
    """Mean of the gradients over the outer group after every backward (see the module docstring)."""

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        topo,
        ocfg: OuterConfig,
        ccfg: CompressConfig,
        seed: int,
        comm_delay_s: float = 0.0,
        comm_bandwidth: float | None = None,
    ) -> None:
        if ocfg.method not in METHODS:
            raise ValueError(f"GradientSync handles outer.method in {list(METHODS)}, not {ocfg.method!r}")
        super().__init__(named_params, topo, ocfg, ccfg, seed, comm_delay_s, comm_bandwidth)
        self.cocktail_error: Tensor | None = None
        if self.method == "allreduce":
            self.compressors = [build_compressor(ccfg, [p.shape for p in self.params], seed)]
        else:
            dev = self.params[0].device if self.params else torch.device("cpu")
            self.cocktail_error = torch.zeros(sum(p.numel() for p in self.params), dtype=torch.float32, device=dev)

    @torch.no_grad()
    def on_gradients(self, step: int) -> None:
        """Replace every gradient by its mean over the outer group (the compressed mean when compressing)."""
        if self.group is None:
            return
        self._blocked_now = 0.0
        grads = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if self.method == "allreduce":
            comp = self.compressors[0]
            h = self._submit(comp.allreduce_mean, [g.float() for g in grads], self.group, step, self.comm_stats)
            avg = self._wait(h)
        else:
            flat = torch.cat([g.reshape(-1).float() for g in grads])
            sizes = [g.numel() for g in grads]  # per-tensor top-k and groups
            h = self._submit(
                cocktail_allreduce,
                flat,
                self.group,
                self.cocktail_error,
                self.ccfg,
                step,
                self.comm_stats,
                self.seed,
                sizes,
            )
            out = self._wait(h)
            avg, pos = [], 0
            for g in grads:
                avg.append(out[pos : pos + g.numel()].view(g.shape))
                pos += g.numel()
        for g, a in zip(grads, avg):
            g.copy_(a)
        self._counters["blocked_s"] = self._blocked_now

    def _method_state_dict(self) -> dict:
        self.comm.drain()
        err = self.cocktail_error
        return {"cocktail_error": err.detach().cpu().clone() if err is not None else None}

    def _load_method_state(self, sd: dict) -> None:
        if self.cocktail_error is not None:
            self.cocktail_error.copy_(sd["cocktail_error"])
