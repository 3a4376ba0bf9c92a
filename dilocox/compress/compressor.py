"""The default codec (``compress/codec.py``) of the outer sync, and ``build_compressor``, which picks the codec.

Per outer sync, for the tensors of this rank's shard (fp32 pseudo-gradients Δ_i):

    M_i = Δ_i + e_i                                  error feedback (per tensor, kept here)
    factored i (low-rank on, eligible matrix):  PowerSGD P round (sum) → P̂ → Q_i
    collective 1: quantized all-reduce SUM of [P_iᵀ | ...]                 (only with low-rank)
    collective 2: quantized all-reduce MEAN of [Q_iᵀ | ... | tail sketch_i | ... | M_j | ...]
    e_i = M_i − sent_i                                sent = what was actually put on the wire

So a sync is one collective without low-rank and two with it, whatever the number of
tensors. With ``quant="none"`` and no low-rank this is an exact fp32 all-reduce mean (e
stays zero and is not allocated).

Layout: for ``int4``/``int8`` every segment (one P_iᵀ, Q_iᵀ, sketch block or M_j) starts on
a quantization-group boundary and is zero-padded to whole groups (``ceil(k/G)·G``
elements), so a group never mixes two tensors. A tensor's scales, quantized values and
error feedback then depend on that tensor alone: a parameter replicated across the
tensor-parallel ranks (norms, row-parallel biases, position embeddings), whose Δ is
identical on every TP rank, gets a bit-identical result on every TP rank, although the
ranks' sharded tensors (and so their other groups) differ. The padding is on the wire and
counted by ``payload_bytes``/``wire_bytes``. (The ``reduce_scatter`` collective cuts its
chunks on group boundaries, so the owner's requantization keeps the groups too.)
``none``/``fp16`` have no groups: segments are packed back to back.

Tail sketch (only with ``tail_sketch=True``, which ``build_compressor`` sets when the
adaptive controller is on, ALGORITHMS §7): per factored matrix, this replica's a·b = 128
sketch values ``S_i = Gᵀ (I − P̂P̂ᵀ) M_i Z / √(ab)`` (``PowerSGD.tail_sketch``) ride on
collective 2 (no extra round trip), one segment per matrix after the Q segments. The mean
is the sketch of the averaged matrix, so ``tail_energy()[i] = ‖mean S_i‖²`` is an unbiased
estimate of the energy of M̄_i outside the rank-r basis, the same bits on every replica. The
block is not error-fed; the byte counts include it (int4, G = 128: 66 bytes per factored
matrix).

``wire=None`` is a one-member group: the same compression is applied locally, nothing is sent.
The result is bit-identical on every member of the wire (see ``collectives``).
"""

from __future__ import annotations

import torch

from dilocox.compress import registered
from dilocox.compress.codec import Codec, Registered, Wire, solo_or
from dilocox.compress.collectives import CommStats, nbytes, quantized_allreduce, resolve_mode, wire_bytes
from dilocox.compress.lowrank import SKETCH_COLS, SKETCH_ROWS, PowerSGD, as_matrix_shape
from dilocox.compress.sparse import load_error_buffers
from dilocox.config import QUANT_KINDS
from dilocox.seeding import mix_seed


class Compressor:
    """Error feedback + optional PowerSGD + quantization + the collective, for one shard."""

    def __init__(
        self,
        shapes: list[torch.Size],
        quant: str = "none",
        group_size: int = 128,
        collective: str = "auto",
        error_feedback: bool = True,
        lowrank_rank: int | None = None,
        min_compression: float = 1.0,
        seed: int = 0,
        tail_sketch: bool = False,
        ids: list[int] | None = None,
    ):
        if quant not in QUANT_KINDS:
            raise ValueError(f"compress.quant={quant!r} is not one of {list(QUANT_KINDS)}")
        if group_size < 2 or group_size % 2:
            raise ValueError(
                f"compress.group_size={group_size} must be an even number >= 2 (int4 packs two values per byte)"
            )
        resolve_mode(collective, 1)  # validates the name
        self.shapes = [torch.Size(s) for s in shapes]
        self.kind = quant
        self.group_size = int(group_size)
        self.collective = collective
        self.error_feedback = bool(error_feedback)
        self.seed = int(seed)
        self.lowrank = PowerSGD(self.shapes, lowrank_rank, seed, min_compression, ids) if lowrank_rank else None
        self.errors: list[torch.Tensor] | None = None  # allocated on first use (device of the inputs)
        self.tail_sketch = bool(tail_sketch) and self.lowrank is not None
        self._tail: torch.Tensor | None = None  # tail-energy estimates of the last sync, per factored matrix

    # ------------------------------------------------------------------ properties

    @property
    def rank(self) -> int:
        """Current low-rank rank (0 without low-rank)."""
        return self.lowrank.rank if self.lowrank is not None else 0

    @property
    def lossy(self) -> bool:
        return self.kind != "none" or self.lowrank is not None

    def sigmas(self) -> list[torch.Tensor]:
        return self.lowrank.sigmas() if self.lowrank is not None else []

    def max_rank(self) -> int:
        """Largest rank at which some matrix of the shard is still factored (0 without low-rank);
        above it nothing is factored and the adaptive rule would have no σ's to measure."""
        return self.lowrank.max_rank() if self.lowrank is not None else 0

    def tail_energy(self) -> torch.Tensor | None:
        """Estimated ‖(I − P̂P̂ᵀ) M̄_i‖² (module docstring) of the last sync, float64, one per
        ``sigmas()`` entry; None before the first sync, after a rank change, or with
        ``tail_sketch`` off. Bit-identical on every replica of the group."""
        return self._tail

    def set_rank(self, r: int) -> None:
        """Change the low-rank rank (no-op without low-rank: an adaptive run may tune H only)."""
        if self.lowrank is not None:
            if int(r) != self.lowrank.rank:
                self._tail = None  # measured for the old basis (and maybe other matrices)
            self.lowrank.set_rank(int(r))

    def _slot(self, k: int) -> int:
        """Elements a segment of k values takes in a buffer: whole groups for the int kinds."""
        if self.kind in ("int4", "int8"):
            return -(-k // self.group_size) * self.group_size
        return k

    def _segments(self, rank: int | None) -> tuple[list[int], list[int], list[int]]:
        """Segment sizes (unpadded) at ``rank``: (collective 1, collective 2, rest indices).

        Collective 2 holds the Q_iᵀ, then the tail sketches, then the M_j of ``rest``.
        """
        n_all = [s.numel() for s in self.shapes]
        if self.lowrank is None:
            return [], n_all, list(range(len(self.shapes)))
        r = self.lowrank.rank if rank is None else rank
        fact = self.lowrank.factored_for(r)
        dims = [as_matrix_shape(self.shapes[i]) for i in fact]
        rest = [i for i in range(len(self.shapes)) if i not in set(fact)]
        sketch = [SKETCH_ROWS * SKETCH_COLS] * len(fact) if self.tail_sketch else []
        return [r * n for n, _ in dims], [r * m for _, m in dims] + sketch + [n_all[i] for i in rest], rest

    def _offsets(self, sizes: list[int]) -> tuple[list[int], int]:
        """Start of each segment and the buffer length (each segment padded by ``_slot``)."""
        offs, pos = [], 0
        for k in sizes:
            offs.append(pos)
            pos += self._slot(k)
        return offs, pos

    def _layout(self, rank: int | None) -> tuple[int, int]:
        """Elements (padding included) of collective 1 and collective 2 at ``rank``."""
        p_sizes, sizes, _ = self._segments(rank)
        return self._offsets(p_sizes)[1], self._offsets(sizes)[1]

    def payload_bytes(self, rank: int | None = None) -> int:
        """Bytes of this rank's compressed message per sync (R-independent; fp32 is 4/element)."""
        n1, n2 = self._layout(rank)
        return nbytes(self.kind, n1, self.group_size) + nbytes(self.kind, n2, self.group_size)

    def wire_bytes(self, world: int, rank: int | None = None) -> int:
        """Bytes one rank sends per sync among ``world`` ranks (what CommStats counts)."""
        n1, n2 = self._layout(rank)
        mode = resolve_mode(self.collective, world)
        return wire_bytes(n1, world, self.kind, self.group_size, mode) + wire_bytes(
            n2, world, self.kind, self.group_size, mode
        )

    def _pack(self, parts: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, list[int]]:
        """One zero-initialised buffer holding ``parts`` (flattened) at group-aligned offsets."""
        offs, total = self._offsets([t.numel() for t in parts])
        buf = torch.zeros(total, dtype=torch.float32, device=device)
        for o, t in zip(offs, parts):
            buf[o : o + t.numel()] = t.reshape(-1)
        return buf, offs

    @staticmethod
    def _unpack(buf: torch.Tensor, offs: list[int], sizes: list[int]) -> torch.Tensor:
        """The segments of ``buf`` (padding dropped), concatenated."""
        if not sizes:
            return buf[:0]
        return torch.cat([buf[o : o + k] for o, k in zip(offs, sizes)])

    # ------------------------------------------------------------------ the sync

    def allreduce_mean(
        self, tensors: list[torch.Tensor], wire: Wire | None, step: int, stats: CommStats | None = None
    ) -> list[torch.Tensor]:
        """Compressed mean of ``tensors`` over the members of ``wire`` (blocking). Bit-identical on every member."""
        self._check_shapes(tensors)
        if not tensors:
            return []
        world = solo_or(wire).size()
        mode = resolve_mode(self.collective, world)
        device = tensors[0].device
        use_ef = self.error_feedback and self.lossy
        ms = self._error_fed(tensors, device, use_ef)

        lr = self.lowrank
        p_sizes, sizes, rest = self._segments(None)
        nf = len(p_sizes)  # factored matrices, in lr.factored order
        q_sizes = sizes[:nf]
        q_local, parts, sketch = self._p_round(ms, wire, step, stats, mode, device, p_sizes, q_sizes)
        parts += [ms[i] for i in rest]
        buf, offs = self._pack(parts, device)
        scratch = torch.zeros_like(buf)  # after the call: buf - sent (the quantization residual)
        res = quantized_allreduce(
            buf,
            wire,
            self.kind,
            self.group_size,
            mode,
            op="mean",
            error=scratch,
            stats=stats,
            seed=mix_seed(self.seed, step, 2),
            step=step,
        )

        outs: list[torch.Tensor | None] = [None] * len(ms)
        self._tail = None
        if sketch is not None:  # ‖mean_m S_m‖² per matrix, in float64
            self._tail = (
                torch.stack([res[o : o + k] for o, k in zip(offs[nf : 2 * nf], sizes[nf : 2 * nf])])
                .double()
                .square()
                .sum(1)
            )
        if nf:
            for i, m_hat in lr.finish(self._unpack(res, offs[:nf], q_sizes)).items():
                outs[i] = m_hat.to(tensors[i].dtype)
            if use_ef:
                sent = lr.expand(q_local - self._unpack(scratch, offs[:nf], q_sizes))
                for i in lr.factored:
                    self.errors[i] = ms[i] - sent[i]
        first = len(parts) - len(rest)
        for i, o in zip(rest, offs[first:]):
            k = ms[i].numel()
            outs[i] = res[o : o + k].view(self.shapes[i]).to(tensors[i].dtype)
            if use_ef:
                self.errors[i] = scratch[o : o + k].view(self.shapes[i]).clone()
        return outs  # type: ignore[return-value]

    def _check_shapes(self, tensors: list[torch.Tensor]) -> None:
        """``allreduce_mean``'s inputs must be the tensors the compressor was built for."""
        if len(tensors) != len(self.shapes) or any(t.shape != s for t, s in zip(tensors, self.shapes)):
            got = [tuple(t.shape) for t in tensors]
            raise ValueError(
                f"allreduce_mean got tensors of shapes {got}, "
                f"the compressor was built for {[tuple(s) for s in self.shapes]}"
            )

    def _error_fed(self, tensors: list[torch.Tensor], device: torch.device, use_ef: bool) -> list[torch.Tensor]:
        """``M_i = Δ_i + e_i`` in fp32 (``Δ_i`` alone without error feedback); allocates / moves the buffers."""
        if use_ef and self.errors is None:
            self.errors = [torch.zeros(s, dtype=torch.float32, device=device) for s in self.shapes]
        if self.errors is not None and self.errors[0].device != device:  # e.g. loaded from a checkpoint
            self.errors = [e.to(device) for e in self.errors]
        return [
            t.detach().float() + e if use_ef else t.detach().float()
            for t, e in zip(tensors, self.errors or [None] * len(tensors))
        ]

    def _p_round(
        self,
        ms: list[torch.Tensor],
        wire: Wire | None,
        step: int,
        stats: CommStats | None,
        mode: str,
        device: torch.device,
        p_sizes: list[int],
        q_sizes: list[int],
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
        """Collective 1 (only with factored matrices): the PowerSGD P round (sum), then the local Q step.
        Returns ``(q_local, the Q_iᵀ and tail-sketch segments of collective 2, the sketch or None)``."""
        lr = self.lowrank
        q_local = torch.zeros(0, dtype=torch.float32, device=device)
        parts: list[torch.Tensor] = []
        sketch = None
        if p_sizes:
            p_buf, p_offs = self._pack(list(lr.p_step(ms).split(p_sizes)), device)
            p_sum = quantized_allreduce(
                p_buf,
                wire,
                self.kind,
                self.group_size,
                mode,
                op="sum",
                stats=stats,
                seed=mix_seed(self.seed, step, 1),
                step=step,
            )
            q_local = lr.q_step(ms, self._unpack(p_sum, p_offs, p_sizes))
            parts = list(q_local.split(q_sizes))
            if self.tail_sketch:
                sketch = lr.tail_sketch(ms, q_local, step).view(len(p_sizes), -1)
                parts += list(sketch.unbind(0))
        return q_local, parts, sketch

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict:
        """Error-feedback buffers, low-rank Q warm starts, rank, last tail energies (plain tensors/ints/str keys)."""
        sd: dict = {"rank": self.rank, "errors": {}}
        if self.errors is not None:
            sd["errors"] = {str(i): e.clone() for i, e in enumerate(self.errors)}
        if self.lowrank is not None:
            sd["q"] = self.lowrank.state_dict()["q"]
        if self._tail is not None:
            sd["tail_energy"] = self._tail.detach().clone()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if self.lowrank is not None:
            self.lowrank.load_state_dict({"rank": sd["rank"], "q": sd.get("q", {})})
        tail = sd.get("tail_energy")
        self._tail = tail.detach().clone().double() if tail is not None and self.tail_sketch else None
        self.errors = load_error_buffers(sd, self.shapes)


def selected(ccfg) -> Registered | None:
    """The registered codec (``compress/registered.py``) the config enables; None: the default ``Compressor``."""
    on = [r for r in registered.REGISTRY.values() if r.enabled(ccfg)]
    if len(on) > 1:  # (config/checks.py refuses it first)
        raise ValueError(f"compress.{on[0].name} and compress.{on[1].name} are both enabled: enable one codec")
    return on[0] if on else None


def build_compressor(ccfg, shapes: list[torch.Size], seed: int, ids: list[int] | None = None) -> Codec:
    """The shard's codec for a ``CompressConfig``: the registered codec the config enables (``codec.selected``:
    compress.sparse, compress.sign, ...), else ``Compressor``. ``seed`` must be the same on every replica of the
    outer group (it seeds the shared PowerSGD Q and the stochastic rounding); ``ids`` are stable per-tensor ids for
    the shared draws (see ``PowerSGD``)."""
    reg = selected(ccfg)
    if reg is not None:
        return reg.build(ccfg, shapes, seed, ids)
    lr = ccfg.lowrank
    rank = lr.rank
    if lr.enabled and ccfg.adaptive.enabled:
        rank = max(ccfg.adaptive.rank_min, min(ccfg.adaptive.rank_max, rank))
    return Compressor(
        shapes,
        quant=ccfg.quant,
        group_size=ccfg.group_size,
        collective=ccfg.collective,
        error_feedback=ccfg.error_feedback,
        lowrank_rank=rank if lr.enabled else None,
        min_compression=lr.min_compression,
        seed=seed,
        tail_sketch=lr.enabled and ccfg.adaptive.enabled,
        ids=ids,
    )
