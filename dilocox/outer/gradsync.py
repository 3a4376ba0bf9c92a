"""Per-step gradient communication over the outer group: ``allreduce`` and ``cocktailsgd``.

After every backward pass (``on_gradients``) the gradients of this rank's shard are replaced
by their mean over the replicas: with the compressor's all-reduce (``allreduce``: plain or
quantized, ALGORITHMS §1 with H = 1) or with CocktailSGD's random + top-k sparsified,
quantized exchange with error feedback (``cocktailsgd``, §8). The inner optimizer then steps
on the averaged gradients, so there is no outer optimizer and no outer state.
Both go through the outer group (``OuterGroup``, group.py) with their codec: the compressor, or
``CocktailCodec``. With a single replica the gradients are left as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from dilocox.compress.cocktail import CocktailCodec
from dilocox.compress.compressor import build_compressor
from dilocox.config import CompressConfig, OuterConfig
from dilocox.outer.base import OuterBase
from dilocox.outer.group import OuterGroup

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
        group: OuterGroup | None = None,
    ) -> None:
        if ocfg.method not in METHODS:
            raise ValueError(f"GradientSync handles outer.method in {list(METHODS)}, not {ocfg.method!r}")
        super().__init__(named_params, topo, ocfg, ccfg, seed, comm_delay_s, comm_bandwidth, group)
        self.H = 1  # every inner step's gradients are averaged (outer.sync_every is the DiLoCo family's)
        self.cocktail: CocktailCodec | None = None
        if self.method == "allreduce":
            self.compressors = [build_compressor(ccfg, [p.shape for p in self.params], seed)]
            self.codec = self.compressors[0]
        else:
            dev = self.params[0].device if self.params else torch.device("cpu")
            self.cocktail = CocktailCodec(ccfg, [p.numel() for p in self.params], seed, dev)
            self.codec = self.cocktail

    @torch.no_grad()
    def on_gradients(self, step: int) -> None:
        """Replace every gradient by its mean over the outer group (the compressed mean when compressing)."""
        if self.R == 1:
            return
        self._blocked_now = 0.0
        grads = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        h = self._submit(self.group.allreduce_mean, [g.float() for g in grads], step, self.codec)
        for g, a in zip(grads, self._wait(h)):
            g.copy_(a)
        self.outer_step += 1  # (one average per inner step: what the logs and stats count as outer steps)
        self._counters["blocked_s"] = self._blocked_now

    def _method_state_dict(self) -> dict:
        self.comm.drain()
        return {"cocktail_error": self.cocktail.state_dict()["error"] if self.cocktail is not None else None}

    def _load_method_state(self, sd: dict) -> None:
        self.H = 1  # (checkpoints before it was reported wrote outer.sync_every here)
        if self.cocktail is not None:
            self.cocktail.load_state_dict({"error": sd["cocktail_error"]})
