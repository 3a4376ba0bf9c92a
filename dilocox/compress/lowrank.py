"""PowerSGD low-rank compression of pseudo-gradients (ALGORITHMS §5, DiLoCoX Algorithm 1).

For each factored matrix ``M_m`` (n×m, already including the worker's error feedback):

    P_m = M_m Q            P = Σ_m P_m          (all-reduce SUM, quantized)
    P̂   = orth(P)          Householder QR in fp32: same input bits -> same output bits
    Q_m = M_mᵀ P̂           Q = (1/R) Σ_m Q_m    (all-reduce MEAN, quantized)
    M̂   = P̂ Qᵀ             the averaged compressed matrix
    e_m = M_m − P̂ Q_m,sentᵀ   (computed by the caller from ``expand``)

Q is warm-started from the previous outer step's averaged Q (identical on every
replica); the first Q is an orthonormalised Gaussian from a generator seeded by
``(seed, tensor index)``, so every replica starts from the same Q without communication.

Choices where the algorithm is silent:

- Only tensors with ≥ 2 dims whose ``(n + m)·r·2 < n·m / min_compression`` and ``r < min(n, m)``
  are factored (n = dim 0, m = the product of the other dims). Eligibility is re-evaluated when the
  rank changes; the rest go to plain quantization (the caller's job).
- Wire layout: Pᵀ (r×n) and Q_mᵀ (r×m) flattened, i.e. each *column* of P and Q is
  contiguous, so a quantization group never mixes columns of different magnitude σ_j
  (when n, m are multiples of the group size).
- The quantization error of P is not fed back: P only chooses the basis P̂, and the error
  feedback ``e_m = M_m − P̂ Q_m,sentᵀ`` uses the P̂ actually used. The quantization error
  of Q_m is in ``e_m`` because it subtracts the Q_m that was *sent* (after quantization).
- ``set_rank`` truncates Q, or appends random columns orthonormal to the current ones
  from a generator seeded by ``(seed, index, old rank, new rank)``.
- ``tail_sketch`` (for the adaptive rank rule, §7): per factored matrix the a×b random
  sketch ``S_m = Gᵀ (I − P̂P̂ᵀ) M_m Z / √(ab)`` of the part of M_m outside span(P̂), with
  Gaussian G (n×a), Z (m×b) drawn from ``(seed, index, step)``, shared by all replicas and
  fresh every sync (a, b = ``SKETCH_ROWS``, ``SKETCH_COLS``). It is linear in M_m, so the
  outer-group mean of the S_m is the sketch S̄ of the averaged matrix M̄, and ``‖S̄‖²`` is an
  unbiased estimate of ``‖(I − P̂P̂ᵀ) M̄‖²``, the energy a rank-r basis does not deliver
  (E_G,Z ‖GᵀAZ‖² = ab‖A‖²; G, Z are independent of P̂). Relative standard deviation: about
  0.14 for a spread-out tail, 0.64 when one direction holds the whole tail.

The staged methods (``p_step`` → collective → ``q_step`` → collective → ``finish``) let
the Compressor fuse other tensors into the Q collective; ``allreduce`` runs the whole
thing on its own.
"""

from __future__ import annotations

import math

import torch

from dilocox.compress.codec import Wire
from dilocox.compress.collectives import CommStats, quantized_allreduce
from dilocox.seeding import mix_seed

SKETCH_ROWS, SKETCH_COLS = 16, 8  # a, b of ``tail_sketch``: a·b = 128 values per factored matrix


def as_matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """(n, m) view of a tensor with ≥ 2 dims: dim 0 by the product of the rest."""
    return int(shape[0]), int(math.prod(shape[1:]))


def factorable(shape: torch.Size, rank: int, min_compression: float = 1.0) -> bool:
    """True when a rank-``rank`` factorisation of ``shape`` is worth sending (ALGORITHMS §5)."""
    if len(shape) < 2 or rank < 1:
        return False
    n, m = as_matrix_shape(shape)
    # rank < min(n, m): a larger rank factors nothing (P̂ would be n×min(n, r)); min_compression < 0.5 allows it
    return rank < min(n, m) and (n + m) * rank * 2 < n * m / min_compression


def orthonormal_random(m: int, r: int, seed: int, basis: torch.Tensor | None = None) -> torch.Tensor:
    """m×r orthonormal columns from Gaussian(seed); orthogonal to ``basis`` (m×k) if given."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(m, r, generator=g, dtype=torch.float32)
    if basis is None:
        return torch.linalg.qr(x, mode="reduced").Q.contiguous()
    k = basis.shape[1]
    full = torch.cat([basis.detach().to("cpu", torch.float32), x], dim=1)
    return torch.linalg.qr(full, mode="reduced").Q[:, k:].contiguous()


class PowerSGD:
    """Rank-r PowerSGD state (warm-start Q per factored tensor) and its staged math.

    ``shapes`` lists every tensor of the shard (index = position); only the eligible
    ones are factored (``factored``), the others are ignored by this class.
    """

    def __init__(
        self,
        shapes: list[torch.Size],
        rank: int,
        seed: int = 0,
        min_compression: float = 1.0,
        ids: list[int] | None = None,
    ):
        """``ids``: a stable id per tensor for the shared random draws (default: its index), so a
        tensor draws the same Q and sketches whichever subset of tensors this instance holds."""
        if rank < 1:
            raise ValueError(f"compress.lowrank.rank={rank} must be >= 1")
        if not (0.0 < float(min_compression) < math.inf):
            raise ValueError(f"compress.lowrank.min_compression={min_compression} must be a finite number > 0")
        self.shapes = [torch.Size(s) for s in shapes]
        self.seed = int(seed)
        self.ids = list(ids) if ids is not None else list(range(len(self.shapes)))
        if len(self.ids) != len(self.shapes):
            raise ValueError(f"{len(self.ids)} tensor ids for {len(self.shapes)} shapes")
        self.min_compression = float(min_compression)
        self.rank = int(rank)
        self.q: dict[int, torch.Tensor] = {}  # warm-start Q (m×r), identical on every replica
        self._p_hat: dict[int, torch.Tensor] = {}  # P̂ (n×r) of the step in flight
        for i in self.factored_for(self.rank):
            n, m = as_matrix_shape(self.shapes[i])
            self.q[i] = orthonormal_random(m, self.rank, mix_seed(self.seed, self.ids[i]))

    # ------------------------------------------------------------------ structure

    def factored_for(self, rank: int) -> list[int]:
        return [i for i, s in enumerate(self.shapes) if factorable(s, rank, self.min_compression)]

    @property
    def factored(self) -> list[int]:
        """Indices of the tensors compressed by PowerSGD at the current rank (ascending)."""
        return sorted(self.q)

    def max_rank(self) -> int:
        """Largest rank at which at least one tensor is still factored (0: none ever is)."""
        best = 0
        for s in self.shapes:
            if len(s) < 2:
                continue
            n, m = as_matrix_shape(s)
            if n * m == 0:  # an empty matrix is never factored (and n + m may be 0)
                continue
            r = min(min(n, m) - 1, int(n * m / self.min_compression / (2 * (n + m))) + 1)
            while r > 0 and not factorable(s, r, self.min_compression):
                r -= 1
            best = max(best, r)
        return best

    def set_rank(self, rank: int) -> None:
        """Change r: truncate Q, or append shared-seed random columns orthonormal to it."""
        if rank < 1:
            raise ValueError(f"low-rank rank={rank} must be >= 1")
        new: dict[int, torch.Tensor] = {}
        for i in self.factored_for(rank):
            n, m = as_matrix_shape(self.shapes[i])
            old = self.q.get(i)
            if old is None:
                q = orthonormal_random(m, rank, mix_seed(self.seed, self.ids[i]))
            elif rank <= old.shape[1]:
                q = old[:, :rank].contiguous()
            else:
                extra = orthonormal_random(
                    m, rank - old.shape[1], mix_seed(self.seed, self.ids[i], old.shape[1], rank), basis=old
                )
                q = torch.cat([old, extra.to(old.device)], dim=1).contiguous()
            new[i] = q
        self.q = new
        self.rank = int(rank)
        self._p_hat = {}

    def sigmas(self) -> list[torch.Tensor]:
        """Singular-value estimates σ_j ≈ ‖Q[:, j]‖ per factored matrix (P̂ is orthonormal)."""
        return [self.q[i].norm(dim=0) for i in self.factored]

    # ------------------------------------------------------------------ staged math

    def _matrix(self, i: int, t: torch.Tensor) -> torch.Tensor:
        n, m = as_matrix_shape(self.shapes[i])
        if t.shape != self.shapes[i]:
            raise ValueError(f"tensor {i} has shape {tuple(t.shape)}, PowerSGD was built for {tuple(self.shapes[i])}")
        return t.reshape(n, m).float()

    def _q(self, i: int, device: torch.device) -> torch.Tensor:
        if self.q[i].device != device:
            self.q[i] = self.q[i].to(device)
        return self.q[i]

    def p_step(self, ms: list[torch.Tensor]) -> torch.Tensor:
        """Flat [P_iᵀ for each factored i] with P_i = M_i Q_i (local, before the sum)."""
        parts = []
        for i in self.factored:
            m = self._matrix(i, ms[i])
            parts.append((m @ self._q(i, m.device)).t().reshape(-1))
        return _cat(parts, ms)

    def q_step(self, ms: list[torch.Tensor], p_sum: torch.Tensor) -> torch.Tensor:
        """Orthonormalise the summed P (stores P̂) and return flat [Q_iᵀ = P̂ᵀ M_i]."""
        self._p_hat = {}
        parts, off = [], 0
        for i in self.factored:
            n, _ = as_matrix_shape(self.shapes[i])
            p = p_sum[off : off + self.rank * n].view(self.rank, n).t()
            off += self.rank * n
            p_hat = torch.linalg.qr(p, mode="reduced").Q.contiguous()
            self._p_hat[i] = p_hat
            parts.append((p_hat.t() @ self._matrix(i, ms[i])).reshape(-1))
        return _cat(parts, ms)

    def tail_sketch(self, ms: list[torch.Tensor], q_flat: torch.Tensor, step: int) -> torch.Tensor:
        """Flat [S_i for each factored i], S_i = Gᵀ (I − P̂P̂ᵀ) M_i Z / √(ab) (a·b values each).

        ``q_flat`` is this replica's ``q_step`` output for the same ``ms`` (Q_iᵀ = P̂ᵀ M_i,
        before quantization), so (I − P̂P̂ᵀ) M_i Z = M_i Z − P̂ (Q_iᵀ Z) costs one n×m by m×b
        product. G and Z depend only on (seed, i, step): identical on every replica.
        """
        a, b = SKETCH_ROWS, SKETCH_COLS
        parts, off = [], 0
        for i in self.factored:
            n, m = as_matrix_shape(self.shapes[i])
            mat = self._matrix(i, ms[i])
            qt = q_flat[off : off + self.rank * m].view(self.rank, m)
            off += self.rank * m
            gen = torch.Generator(device="cpu").manual_seed(mix_seed(self.seed, self.ids[i], step, 0x7A11))
            g = torch.randn(n, a, generator=gen, dtype=torch.float32).to(mat.device)
            z = torch.randn(m, b, generator=gen, dtype=torch.float32).to(mat.device)
            resid = mat @ z - self._p_hat[i] @ (qt @ z)
            parts.append((g.t() @ resid).reshape(-1) / math.sqrt(a * b))
        return _cat(parts, ms)

    def expand(self, q_flat: torch.Tensor) -> dict[int, torch.Tensor]:
        """P̂ Qᵀ (in each tensor's shape) for a flat [Q_iᵀ] buffer, e.g. the averaged or the sent Q."""
        out, off = {}, 0
        for i in self.factored:
            _, m = as_matrix_shape(self.shapes[i])
            qt = q_flat[off : off + self.rank * m].view(self.rank, m)
            off += self.rank * m
            out[i] = (self._p_hat[i] @ qt).view(self.shapes[i])
        return out

    def finish(self, q_mean: torch.Tensor) -> dict[int, torch.Tensor]:
        """Store the averaged Q for the warm start and return M̂ = P̂ Qᵀ per factored tensor."""
        out = self.expand(q_mean)
        off = 0
        for i in self.factored:
            _, m = as_matrix_shape(self.shapes[i])
            self.q[i] = q_mean[off : off + self.rank * m].view(self.rank, m).t().contiguous()
            off += self.rank * m
        return out

    def p_hat(self) -> dict[int, torch.Tensor]:
        """P̂ of the last step (for tests: must be bit-identical on every replica)."""
        return dict(self._p_hat)

    # ------------------------------------------------------------------ standalone use

    def allreduce(
        self,
        ms: list[torch.Tensor],
        wire: Wire | None,
        kind: str = "none",
        group_size: int = 128,
        mode: str = "allgather",
        step: int = 0,
        stats: CommStats | None = None,
    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """Compressed mean of the factored ``ms`` over ``wire``'s members.

        Returns ``(m_hat, residual)``: the averaged approximation and ``M_m − P̂ Q_m,sentᵀ``
        (the new error-feedback value) per factored index. Standalone PowerSGD (tests, one-off
        use): the factors of all tensors are packed back to back, so a quantization group may
        span two tensors; training goes through ``Compressor``, which keeps groups per tensor.
        """
        p = quantized_allreduce(
            self.p_step(ms),
            wire,
            kind,
            group_size,
            mode,
            op="sum",
            stats=stats,
            seed=mix_seed(self.seed, 1),
            step=step,
        )
        q_local = self.q_step(ms, p)
        scratch = torch.zeros_like(q_local)  # receives q_local - sent
        q_mean = quantized_allreduce(
            q_local,
            wire,
            kind,
            group_size,
            mode,
            op="mean",
            error=scratch,
            stats=stats,
            seed=mix_seed(self.seed, 2),
            step=step,
        )
        sent = self.expand(q_local - scratch)
        residual = {i: ms[i].float() - sent[i] for i in self.factored}
        return self.finish(q_mean), residual

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict:
        return {"rank": self.rank, "q": {str(i): q.clone() for i, q in self.q.items()}}

    def load_state_dict(self, sd: dict) -> None:
        self.set_rank(int(sd["rank"]))
        for k, q in sd["q"].items():
            i = int(k)
            if i not in self.q or q.shape != self.q[i].shape:
                raise ValueError(
                    f"low-rank state for tensor {i} has shape {tuple(q.shape)}, "
                    f"expected {tuple(self.q[i].shape) if i in self.q else 'no Q (not factored at this rank)'}"
                )
            self.q[i] = q.detach().clone().float().to(self.q[i].device)


def _cat(parts: list[torch.Tensor], like: list[torch.Tensor]) -> torch.Tensor:
    if parts:
        return torch.cat(parts)
    dev = next((t.device for t in like if t is not None), torch.device("cpu"))
    return torch.zeros(0, dtype=torch.float32, device=dev)
