"""Adaptive rank and H controller (ALGORITHMS §7, DiLoCoX §2.4.3 / Algorithm 3).

After every outer step, per compressed matrix (r = current rank, ε = ``energy_eps``):

    σ_j ≈ ‖Q̄[:, j]‖, sorted descending     C = Σ_{j≤r} σ_j² = ‖M̂‖²   (energy the sync delivered)
    T̂ ≈ ‖(I − P̂P̂ᵀ) M̄‖²                     energy of the averaged matrix outside the basis
    E  = C + T̂                               energy of the whole averaged, error-fed matrix M̄
    r_eff(matrix) = min{k : Σ_{j≤k} σ_j² ≥ (1 − ε) E}                     if C ≥ (1 − ε) E
                  = min(r_max, r + ceil(((1 − ε) E − C) / σ_r²))           otherwise
    r_eff         = ceil(mean over the compressed matrices of r_eff(matrix))
    r_{t+1}       = clamp(ceil(mean of the last w values of r_eff), r_min, r_max)
    H_{t+1}       = clamp(ceil(T_comm(r_{t+1}) / t_step), H_min, H_max)

Why T̂: with only the r estimated σ's the total would be Σ_{j≤r} σ_j², so r_eff ≤ r and the
rank could only fall (on real, power-law spectra it ratchets down to r_min and never
recovers). With the energy outside the basis counted, a rank that leaves more than ε of
the energy behind is too small. The components beyond r have σ ≤ σ_r (the spectrum is
sorted), so at least ``((1 − ε)E − C)/σ_r²`` more are needed: r_eff is that lower bound,
exact for a flat tail and an underestimate for a decaying one (the next steps, at the
larger rank, see the rest). When r is large enough, r_eff is the smallest k holding 1 − ε
of the whole energy: the effective rank of M̄ *in the basis PowerSGD has*. With a converged
basis that is the SVD effective rank (tests: a single replica follows a true rank 4 → 24
within ±1); while the warm start lags a moving subspace, or int4 blurs P̂, the basis needs
more rank than the SVD to hold 1 − ε, and the rule follows what the basis needs (the
two-replica test settles at 11–18 for an SVD effective rank of 6–8).

How T̂ is measured: each replica sends, on the Q all-reduce it already makes, a random
sketch ``S_m = Gᵀ (I − P̂P̂ᵀ) M_m Z / √(ab)`` of its error-fed matrix outside span(P̂)
(``PowerSGD.tail_sketch``, 128 values per matrix; G, Z Gaussian, shared, fresh each sync).
S_m is linear in M_m, so the all-reduce mean is exactly the sketch of M̄, and
``T̂ = ‖mean_m S_m‖²`` (``Compressor.tail_energy``) is an unbiased estimate of the energy of
M̄, not of the replicas, outside the basis, with the same bits on every replica. Its
relative standard deviation is about 0.14–0.64 (spread-out to single-direction tails, plus
≈1 % int4 noise); the mean over matrices and the window of w smooth it.

Which total energy, and why not ``mean_m ‖M_m‖²`` (each replica sending ‖M_m‖²): the rank is
chosen for the averaged matrix M̄, which M̂ = P̂ Q̄ᵀ approximates, and ‖M̄‖² = mean‖M_m‖² −
mean‖M_m − M̄‖²: the mean of the replicas' energies exceeds it by the inter-replica
variance, energy that no rank of M̄ can capture. DiLoCo replicas always disagree (different
data) and error feedback keeps each replica's unsent part, so with that proxy C stays
below (1 − ε)E at any rank and the rank sits at r_max (in the two-replica test
mean‖M_m‖² ≈ 1.6 ‖M̄‖², and it asks for r_max at every step). A replica-local captured
fraction (1 − ‖P̂ᵀM_m‖²/‖M_m‖², averaged) is tighter, but biased the same way by each
replica's private part outside span(P̂). The sketch averages *before* the square, so
``E = ‖M̂‖² + T̂`` estimates ‖M̄‖² itself (within a few % in that test): C = ‖M̂‖² ≤ E, and
E − C estimates exactly the energy M̂ misses.

Choices where the paper is silent (its equations did not survive):

- One rank for all matrices; the per-step r_eff is the mean over matrices (the max would
  let a single matrix, typically the embedding, dictate the rank of all the others).
- σ are sorted descending before the energy sum (power iteration does not order them).
- r_eff of one matrix is 1 for E = 0, and r_max when the basis captured nothing (σ_r = 0)
  while more than ε of the energy is outside it.
- ``T_comm`` is kept as an EMA of *seconds per byte* (measured time / payload bytes of
  that sync) and scaled by ``payload_fn(r_{t+1})``, so a sync measured at another rank
  still predicts the time of the new payload. ``t_step`` is an EMA of the inner step time.
  Both EMAs start at the first measurement; ``ema`` is the weight of a new measurement.
- r_max is lowered to the largest rank at which some matrix of the shard is still
  factored (``rank_cap``): a rank above it factors nothing, measures nothing, and would stay.
- Without T̂ (``tail=None``) T̂ = 0: the σ's are taken as the whole energy, and the rank
  can only fall (the rule before the tail was measured).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Callable, Sequence

import torch


class AdaptiveController:
    def __init__(
        self,
        energy_eps: float = 0.05,
        window: int = 5,
        rank_min: int = 2,
        rank_max: int = 64,
        h_min: int = 10,
        h_max: int = 1000,
        ema: float = 0.5,
    ):
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

    def effective_rank(self, sigmas: torch.Tensor | Sequence[float], tail: float = 0.0) -> int:
        """r_eff of one matrix from its r estimated σ's and the estimated energy ``tail``
        outside the rank-r basis (module docstring). ``tail = 0``: the smallest k whose top-k
        energy reaches (1 − ε) of Σσ_j²."""
        s = torch.as_tensor(sigmas, dtype=torch.float64).flatten().cpu()
        if s.numel() == 0:
            return 1
        e = torch.sort(s * s, descending=True).values
        captured, tail = float(e.sum()), max(float(tail), 0.0)
        if not (math.isfinite(captured) and math.isfinite(tail)):
            raise ValueError(
                f"non-finite singular values {s.tolist()} or tail energy {tail}: the pseudo-gradient diverged"
            )
        target = (1.0 - self.energy_eps) * (captured + tail)
        if target <= 0.0:
            return 1
        r = s.numel()
        if captured < target:  # the rank-r basis leaves more than ε of the energy behind: grow
            last = float(e[-1])
            extra = (target - captured) / last if last > 0.0 else math.inf
            return self.rank_max if extra >= self.rank_max else min(self.rank_max, r + math.ceil(extra))
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
        tail: torch.Tensor | Sequence[float] | None = None,
        rank_cap: int | None = None,
    ) -> tuple[int, int]:
        """Record one outer step and return the (rank, H) for the next one.

        ``tail``: per matrix (same order as ``sigmas_per_matrix``) the estimated energy of the
        averaged matrix outside the rank-r basis (``Compressor.tail_energy()``); None means 0
        for all. ``rank_cap`` (``Compressor.max_rank()``; None or 0: none) lowers r_max for
        this step to the largest rank at which some matrix is still factored: above it nothing
        is, no σ is measured, and the rank could never come back. Every input that sets the
        rank must be identical on the whole outer group.
        """
        hi = self.rank_max if not rank_cap else max(self.rank_min, min(self.rank_max, int(rank_cap)))
        if sigmas_per_matrix:
            if tail is None:
                tails = [0.0] * len(sigmas_per_matrix)
            else:
                tails = torch.as_tensor(tail, dtype=torch.float64).flatten().cpu().tolist()
                if len(tails) != len(sigmas_per_matrix):
                    raise ValueError(
                        f"tail has {len(tails)} values for {len(sigmas_per_matrix)} compressed matrices: "
                        f"pass one per matrix (Compressor.tail_energy())"
                    )
            per = [min(hi, self.effective_rank(s, t)) for s, t in zip(sigmas_per_matrix, tails)]
            self.history.append(math.ceil(sum(per) / len(per)))
        if self.history:
            rank = math.ceil(sum(self.history) / len(self.history))
        else:  # nothing is factored: keep the rank
            rank = self.rank if self.rank is not None else self.rank_max
        self.rank = max(self.rank_min, min(hi, rank))
        if payload_bytes_now > 0 and t_comm_measured >= 0:
            self.sec_per_byte = self._ema(self.sec_per_byte, t_comm_measured / payload_bytes_now)
        if t_step > 0:
            self.t_step = self._ema(self.t_step, t_step)
        return self.rank, self._predict_h(payload_fn)

    def _predict_h(self, payload_fn: Callable[[int], int]) -> int:
        t_comm = (self.sec_per_byte or 0.0) * payload_fn(self.rank)
        self.h = self.h_for(t_comm, self.t_step or 0.0) if self.t_step else self.h_max
        return self.h

    def agree_rank(self, rank: int, payload_fn: Callable[[int], int]) -> int:
        """The rank the replica's TP ranks agreed on (their max) replaces this rank's own choice, and H is
        predicted again from that rank's payload (``update`` predicted it from the rank before the max)."""
        self.rank = int(rank)
        return self._predict_h(payload_fn)

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict:
        return {
            "history": list(self.history),
            "sec_per_byte": self.sec_per_byte,
            "t_step": self.t_step,
            "rank": self.rank,
            "h": self.h,
        }

    def load_state_dict(self, sd: dict) -> None:
        self.history = deque((int(v) for v in sd["history"]), maxlen=self.window)
        self.sec_per_byte = sd["sec_per_byte"]
        self.t_step = sd["t_step"]
        self.rank = sd["rank"]
        self.h = sd["h"]
