"""Adaptive rank and H controller (ALGORITHMS §7, DiLoCoX §2.4.3 / Algorithm 3).

After every outer step:

    r_eff(matrix) = min{k : Σ_{j≤k} σ_j² ≥ (1 − ε) Σ_j σ_j²}       σ_j ≈ ‖Q[:, j]‖
    r_eff         = ceil(mean over the compressed matrices of r_eff(matrix))
    r_{t+1}       = clamp(ceil(mean of the last w values of r_eff), r_min, r_max)
    H_{t+1}       = clamp(ceil(T_comm(r_{t+1}) / t_step), H_min, H_max)

Choices where the paper is silent (its equations did not survive):

- One rank for all matrices; the per-step r_eff is the mean over matrices (the max would
  let a single matrix, typically the embedding, dictate the rank of all the others).
- σ are sorted descending before the energy sum (power iteration does not order them).
- ``T_comm`` is kept as an EMA of *seconds per byte* (measured time / payload bytes of
  that sync) and scaled by ``payload_fn(r_{t+1})``, so a sync measured at another rank
  still predicts the time of the new payload. ``t_step`` is an EMA of the inner step time.
  Both EMAs start at the first measurement; ``ema`` is the weight of a new measurement.
- r_eff can never exceed the current rank, so the rank only falls (or stays): the
  controller follows the rank-diminishing behaviour the paper relies on. Start at
  ``rank_max`` to let it find the level.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Callable, Sequence

import torch


class AdaptiveController:
    def __init__(self, energy_eps: float = 0.05, window: int = 5, rank_min: int = 2, rank_max: int = 64, h_min: int = 10, h_max: int = 1000, ema: float = 0.5):
        if not 0.0 < energy_eps < 1.0:
            raise ValueError(f"compress.adaptive.energy_eps={energy_eps} must be in (0, 1)")
        if window < 1:
            raise ValueError(f"compress.adaptive.window={window} must be >= 1")
        if not 1 <= rank_min <= rank_max:
            raise ValueError(f"compress.adaptive.rank_min={rank_min} must be in [1, rank_max={rank_max}]")
        if not 1 <= h_min <= h_max:
            raise ValueError(f"compress.adaptive.h_min={h_min} must be in [1, h_max={h_max}]")
        if not 0.0 < ema <= 1.0:
            raise ValueError(f"ema={ema} must be in (0, 1]")
        self.energy_eps = float(energy_eps)
        self.window = int(window)
        self.rank_min, self.rank_max = int(rank_min), int(rank_max)
        self.h_min, self.h_max = int(h_min), int(h_max)
        self.ema = float(ema)
        self.history: deque[int] = deque(maxlen=self.window)
        self.sec_per_byte: float | None = None
        self.t_step: float | None = None
        self.rank: int | None = None
        self.h: int | None = None

    @classmethod
    def from_config(cls, acfg) -> "AdaptiveController":
        """Build from a ``CompressConfig.adaptive`` section."""
        return cls(acfg.energy_eps, acfg.window, acfg.rank_min, acfg.rank_max, acfg.h_min, acfg.h_max)

    # ------------------------------------------------------------------ rules

    def effective_rank(self, sigmas: torch.Tensor | Sequence[float]) -> int:
        """Smallest k whose top-k energy Σσ_j² reaches (1 − ε) of the total (1 for all-zero σ)."""
        s = torch.as_tensor(sigmas, dtype=torch.float64).flatten()
        if s.numel() == 0:
            return 1
        e = torch.sort(s * s, descending=True).values
        total = float(e.sum())
        if not math.isfinite(total):
            raise ValueError(f"non-finite singular values {s.tolist()}: the pseudo-gradient diverged")
        if total <= 0.0:
            return 1
        cum = torch.cumsum(e, 0)
        k = int(torch.searchsorted(cum, (1.0 - self.energy_eps) * total).item()) + 1
        return min(k, s.numel())

    def h_for(self, t_comm: float, t_step: float) -> int:
        """Smallest H with H·t_step ≥ t_comm, clamped to [h_min, h_max]."""
        if t_step <= 0:
            return self.h_max
        return max(self.h_min, min(self.h_max, math.ceil(t_comm / t_step)))

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1.0 - self.ema) * old + self.ema * new

    def update(
        self,
        sigmas_per_matrix: Sequence[torch.Tensor],
        t_comm_measured: float,
        payload_bytes_now: int,
        payload_fn: Callable[[int], int],
        t_step: float,
    ) -> tuple[int, int]:
        """Record one outer step and return the (rank, H) for the next one."""
        if sigmas_per_matrix:
            per = [self.effective_rank(s) for s in sigmas_per_matrix]
            self.history.append(math.ceil(sum(per) / len(per)))
        if self.history:
            rank = math.ceil(sum(self.history) / len(self.history))
        else:  # nothing is factored: keep the rank
            rank = self.rank if self.rank is not None else self.rank_max
        self.rank = max(self.rank_min, min(self.rank_max, rank))
        if payload_bytes_now > 0 and t_comm_measured >= 0:
            self.sec_per_byte = self._ema(self.sec_per_byte, t_comm_measured / payload_bytes_now)
        if t_step > 0:
            self.t_step = self._ema(self.t_step, t_step)
        t_comm = (self.sec_per_byte or 0.0) * payload_fn(self.rank)
        self.h = self.h_for(t_comm, self.t_step or 0.0) if self.t_step else self.h_max
        return self.rank, self.h

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict:
        return {"history": list(self.history), "sec_per_byte": self.sec_per_byte, "t_step": self.t_step, "rank": self.rank, "h": self.h}

    def load_state_dict(self, sd: dict) -> None:
        self.history = deque((int(v) for v in sd["history"]), maxlen=self.window)
        self.sec_per_byte = sd["sec_per_byte"]
        self.t_step = sd["t_step"]
        self.rank = sd["rank"]
        self.h = sd["h"]
