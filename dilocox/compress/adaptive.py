"""Adaptive rank and H controller (ALGORITHMS §7, DiLoCoX §2.4.3 / Algorithm 3).

After every outer step, per compressed matrix (r = current rank, ε = ``energy_eps``):

    σ_j ≈ ‖Q̄[:, j]‖, sorted descending       C = Σ_{j≤r} σ_j² = ‖M̂‖²  (energy the sync delivered)
    μ  = outer-group mean of μ_m = ‖M_m − P̂ P̂ᵀ M_m‖² / ‖M_m‖²        (energy the basis P̂ missed)
    E  = C / (1 − μ)                           estimated energy of the whole averaged matrix M̄
    r_eff(matrix) = min{k : Σ_{j≤k} σ_j² ≥ (1 − ε) E}                       if μ ≤ ε
                  = min(r_max, r + ceil(((1 − ε) E − C) / σ_r²))             if μ > ε
    r_eff         = ceil(mean over the compressed matrices of r_eff(matrix))
    r_{t+1}       = clamp(ceil(mean of the last w values of r_eff), r_min, r_max)
    H_{t+1}       = clamp(ceil(T_comm(r_{t+1}) / t_step), H_min, H_max)

Why the missed fraction μ: with only the r estimated σ's the total energy would be Σ_{j≤r}
σ_j², so r_eff ≤ r and the rank could only fall (on real, power-law spectra it ratchets down
to r_min). μ is the rest of the energy: each replica m measures the fraction of its own
error-fed matrix M_m outside span(P̂) (``‖M_m‖² − ‖P̂ᵀM_m‖²``, exact because P̂ is
orthonormal), and the outer group averages it in the Q all-reduce (``Compressor``), so
every replica gets the same bits and takes the same decision. μ ≤ ε: the rank-r basis
holds the (1 − ε) energy target, and r_eff is the smallest k that does. μ > ε: r is too
small; the components beyond r are at most σ_r each (the spectrum is sorted), so at least
``((1 − ε)E − C)/σ_r²`` more are needed: r_eff is that lower bound, exact for a flat tail,
an underestimate for a decaying one (the next steps, at the larger rank, correct it).

The proxy ``E = C/(1 − μ)`` assumes the averaged matrix M̄ has the same fraction inside
span(P̂) as the replicas' own matrices. The energy we would want, ‖M̄‖², cannot be had
without sending M̄; the obvious alternative ``mean_m ‖M_m‖²`` exceeds it by the
inter-replica variance (‖M̄‖² = mean‖M_m‖² − mean‖M_m − M̄‖²), so as soon as replicas
disagree (they always do in DiLoCo) it reports energy that no rank can capture and pins
the rank at r_max. Ours is bounded by both: ‖M̂‖² = C ≤ E ≤ mean_m ‖M_m‖² (convexity:
‖mean_m Q_m‖² ≤ mean_m ‖Q_m‖²); it is exact with one replica or identical replicas, and
replicas that differ only inside span(P̂) (e.g. different coefficients on the same
directions) miss nothing and do not inflate it. μ ∈ [0, 1] is scale-free, so it survives
the int4/fp16 wire (see ``Compressor``) to about 3 significant digits.

Choices where the paper is silent (its equations did not survive):

- One rank for all matrices; the per-step r_eff is the mean over matrices (the max would
  let a single matrix, typically the embedding, dictate the rank of all the others).
- σ are sorted descending before the energy sum (power iteration does not order them).
- r_eff of one matrix is 1 for a zero matrix, and r_max when the basis captured nothing
  (C = 0 or σ_r = 0) of a non-zero one.
- ``T_comm`` is kept as an EMA of *seconds per byte* (measured time / payload bytes of
  that sync) and scaled by ``payload_fn(r_{t+1})``, so a sync measured at another rank
  still predicts the time of the new payload. ``t_step`` is an EMA of the inner step time.
  Both EMAs start at the first measurement; ``ema`` is the weight of a new measurement.
- Without μ (``missed=None``) μ = 0: the σ's are taken as the whole energy, and the rank
  can only fall (the rule before μ was measured).
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

    def effective_rank(self, sigmas: torch.Tensor | Sequence[float], missed: float = 0.0) -> int:
        """r_eff of one matrix from its r estimated σ's and the missed fraction μ (module docstring).

        μ = 0 (the default): the smallest k whose top-k energy reaches (1 − ε) of Σσ_j².
        """
        s = torch.as_tensor(sigmas, dtype=torch.float64).flatten().cpu()
        if s.numel() == 0:
            return 1
        e = torch.sort(s * s, descending=True).values
        captured, mu = float(e.sum()), float(missed)
        if not math.isfinite(captured):
            raise ValueError(f"non-finite singular values {s.tolist()}: the pseudo-gradient diverged")
        if not math.isfinite(mu):
            raise ValueError(f"non-finite missed energy fraction {mu}: the pseudo-gradient diverged")
        mu = min(max(mu, 0.0), 1.0)
        r, eps = s.numel(), self.energy_eps
        if mu > eps:  # the rank-r basis leaves more than ε of the energy behind: grow
            tail = float(e[-1])
            if captured <= 0.0 or tail <= 0.0 or mu >= 1.0:
                return self.rank_max
            extra = captured * (mu - eps) / ((1.0 - mu) * tail)  # ((1 − ε)E − C) / σ_r²
            return self.rank_max if extra >= self.rank_max else min(self.rank_max, r + math.ceil(extra))
        if captured <= 0.0:
            return 1
        target = (1.0 - eps) * captured / (1.0 - mu)  # (1 − ε) E, at most C since μ ≤ ε
        cum = torch.cumsum(e, 0)
        k = int(torch.searchsorted(cum, target).item()) + 1
        return min(k, r)

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
        missed: torch.Tensor | Sequence[float] | None = None,
    ) -> tuple[int, int]:
        """Record one outer step and return the (rank, H) for the next one.

        ``missed``: per matrix (same order as ``sigmas_per_matrix``) the outer-group mean μ
        of the fraction of the error-fed matrix outside span(P̂) (``Compressor.missed()``);
        None means μ = 0 for all. Every input must be identical on the whole outer group.
        """
        if sigmas_per_matrix:
            if missed is None:
                mus = [0.0] * len(sigmas_per_matrix)
            else:
                mus = torch.as_tensor(missed, dtype=torch.float64).flatten().cpu().tolist()
                if len(mus) != len(sigmas_per_matrix):
                    raise ValueError(f"missed has {len(mus)} values for {len(sigmas_per_matrix)} compressed matrices: pass one per matrix (Compressor.missed())")
            per = [self.effective_rank(s, mu) for s, mu in zip(sigmas_per_matrix, mus)]
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
