"""Compression of the activations and activation-gradients sent between SWARM stages.

Kinds (``swarm`` activation codec):

* ``none``: the fp32 bytes (4 per element).
* ``fp16``: a cast (2 per element); values beyond the fp16 range raise instead of becoming inf.
* ``int8``: blockwise absmax quantization, as the SWARM paper sends activations and their
  gradients (§4.3 and Appendix J, after Dettmers et al. 2021, "8-bit optimizers via block-wise
  quantization"): the flat tensor is cut in blocks of ``block`` elements, each with one scale
  ``s = bf16(absmax_block / 127)`` and ``q = clamp(rint(x / s), -127, 127)``; 1 + 2/block bytes per
  element. The paper uses Dettmers' dynamic (non-linear) 8-bit code; this is the linear absmax
  code of ``dilocox/compress`` (the same compiled kernels and bit layout as the int8
  pseudo-gradient quantizer: ``[int8 values | bf16 scales]``), which the issue asks for.
  Per-block error: ``|x - dec(enc(x))| <= s/2`` where ``|x| <= 127 s``, and ``<= absmax - 127 s
  <= absmax * 2^-8`` where the bf16 rounding made ``127 s`` fall short of the absmax; together
  ``<= absmax / 254 * (1 + 2^-8)`` (plus fp32 rounding of ``s*q``).

``encode(t, kind, block)`` returns ``(payload, meta)``: a flat uint8 tensor (what goes on the
wire; ``payload.numel() == wire_bytes(t.numel(), kind, block)``) and an ``ActMeta`` (kind, shape,
dtype, block) that ``decode(payload, meta)`` needs; ``meta.to_dict()``/``ActMeta.from_dict`` give a
plain form for the RPC header. No error feedback: every activation is sent once.

``use_kernel=False`` runs the pure-torch reference of ``dilocox/compress/kernels.py`` instead of the
compiled ops (the two agree bit for bit; tested).

Structured codecs (issue 24; ``ActCodec``, built from a run's config by ``ActCodec.from_config``): a structure
that cuts the values per token, then one of the value codes above (``none`` = fp32, ``fp16``, ``int8``, ``int4``),
for the forward activations and the backward gradients alike:

* ``int4``: the dense tensor in blockwise int4 (``q in [-7, 7]``, ``s = bf16(absmax/7)``), 0.5 + 2/block bytes
  per element.
* ``subspace[-int8|-int4]``: for a model with ``model.subspace_rank = k`` (``dilocox/model/subspace.py``):
  forward ``c = (x - x0(tokens)) U`` ([B, S, k]), the receiver rebuilds ``x0(tokens) + c U^T``; backward
  ``U^T g``, rebuilt as ``U U^T g``. Exact (up to fp32 rounding) for such a model: its stage outputs lie in
  ``x0 + span(U)`` and its parameters see the gradient only through ``U``. d/k fewer values, then the value code.
* ``colk[-int8|-int4]``: structured column-wise top-k (Pluralis' "Beyond Top-K", ICLR 2025 MCDC workshop: keep
  whole feature columns, not scattered elements): the ``cols`` columns of the last dim with the largest L2 norm over
  the microbatch's tokens (ties: the lower index), sent as ``[int32 column indices | values [B, S, cols]]``; the
  others arrive as 0. Lossy; no error feedback (every activation and gradient is sent once; there is no sum over
  steps for a residual to join).

Every ``ActCodec.decode`` checks the header it is given against the run (the same kind, block and width; at most
the microbatch's tokens; indices sorted, distinct, in range) before it allocates the output, so a peer's claim
cannot make another allocate more than the run's largest activation. ``*_reference`` functions beside the fast
paths compute the same in float64 with plain loops (tests compare them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dilocox.compress import quant
from dilocox.config import QUANT_KINDS

KINDS = QUANT_KINDS  # the value codes: none | fp16 | int8 | int4 (dense kinds: ``encode``/``decode`` below)
STRUCTURES = ("subspace", "colk")
CODECS = KINDS + tuple(f"{st}{suf}" for st in STRUCTURES for suf in ("", "-int8", "-int4"))  # swarm.activations
DEFAULT_BLOCK = 2048  # Dettmers et al. 2021 use blocks of 2048 for their blockwise 8-bit code

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True)
class ActMeta:
    """What ``decode`` needs besides the payload."""

    kind: str
    shape: tuple[int, ...]
    dtype: str  # the sender's dtype, restored on decode (e.g. "float32", "bfloat16")
    block: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def to_dict(self) -> dict:
        return {"kind": self.kind, "shape": list(self.shape), "dtype": self.dtype, "block": self.block}

    @staticmethod
    def from_dict(d: dict) -> ActMeta:
        return ActMeta(str(d["kind"]), tuple(int(s) for s in d["shape"]), str(d["dtype"]), int(d["block"]))


def check_codec(kind: str, block: int = DEFAULT_BLOCK) -> None:
    if kind not in KINDS:
        raise ValueError(f"activation codec {kind!r} is not one of {list(KINDS)}")
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"activation codec block={block!r} must be a positive int (elements per int8 scale)")
    if kind == "int4" and block % 2:
        raise ValueError(f"activation codec int4 needs an even block (two values per byte), got {block}")


def wire_bytes(numel: int, kind: str, block: int = DEFAULT_BLOCK) -> int:
    """Bytes of ``encode(t, kind, block)[0]`` for a tensor of ``numel`` elements."""
    check_codec(kind, block)
    return quant.payload_nbytes(kind, int(numel), block)


def encode(
    t: torch.Tensor, kind: str, block: int = DEFAULT_BLOCK, use_kernel: bool = True
) -> tuple[torch.Tensor, ActMeta]:
    """Compress a floating-point tensor for the wire; returns ``(uint8 payload, meta)``."""
    check_codec(kind, block)
    if not t.is_floating_point():
        raise ValueError(f"activation codec: expected a floating-point tensor, got {t.dtype}")
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"activation codec: dtype {t.dtype} is not one of {list(_DTYPES)}")
    x = t.detach().to(torch.float32).contiguous().view(-1)
    try:
        packed = quant.quantize(x, kind, block, use_kernel=use_kernel)
    except ValueError as e:  # quant's message talks about pseudo-gradients; say what this is
        raise ValueError(f"activation codec {kind}: cannot encode tensor of shape {tuple(t.shape)}: {e}") from None
    return packed.data, ActMeta(kind, tuple(int(s) for s in t.shape), dtype, block)


def decode(payload: torch.Tensor, meta: ActMeta, use_kernel: bool = True) -> torch.Tensor:
    """The tensor ``encode`` was given (exact for ``none``), on the payload's device, in the sender's dtype."""
    check_codec(meta.kind, meta.block)
    if meta.dtype not in _DTYPES:
        raise ValueError(f"activation codec: dtype {meta.dtype!r} is not one of {list(_DTYPES)}")
    expect = wire_bytes(meta.numel, meta.kind, meta.block)
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != expect:
        raise ValueError(
            f"activation payload for {meta.kind} shape {meta.shape} must be a flat uint8 tensor of {expect} bytes, "
            f"got {payload.dtype} with {payload.numel()} elements (truncated or mismatched message?)"
        )
    p = quant.Packed(meta.kind, meta.numel, meta.block, payload.contiguous())
    out = quant.dequantize(p, use_kernel=use_kernel)
    return out.view(meta.shape).to(_DTYPES[meta.dtype])


def roundtrip(t: torch.Tensor, kind: str, block: int = DEFAULT_BLOCK, use_kernel: bool = True) -> torch.Tensor:
    """``decode(*encode(t))``: what the receiver sees (for tests and single-process emulation)."""
    payload, meta = encode(t, kind, block, use_kernel)
    return decode(payload, meta, use_kernel)


# --------------------------------------------------------------------------- structured codecs (issue 24)


def split_codec(codec: str) -> tuple[str, str]:
    """``"subspace-int4"`` -> ("subspace", "int4"); ``"int8"`` -> ("dense", "int8"); ``"colk"`` -> ("colk", "none")."""
    if codec not in CODECS:
        raise ValueError(f"activation codec {codec!r} is not one of {list(CODECS)}")
    if codec in KINDS:
        return "dense", codec
    structure, _, values = codec.partition("-")
    return structure, values or "none"


def colk_columns(d: int, frac: float) -> int:
    """Columns ``colk`` keeps of ``d``: round(frac * d), at least 1, at most d."""
    return max(1, min(d, round(float(frac) * d)))


@dataclass(frozen=True)
class ActCodec:
    """The codec of one run's stage boundaries (module docstring). ``width``: values per token on the wire
    (d, k, or the kept columns); ``mcfg``: the model config (``subspace`` rebuilds ``x0`` and ``U`` from it)."""

    codec: str
    d: int
    block: int = DEFAULT_BLOCK
    k: int = 0  # subspace rank (model.subspace_rank)
    cols: int = 0  # colk: columns kept
    mcfg: object = None
    max_tokens: int = 0  # a decoded tensor holds at most this many tokens (0: unchecked; a peer sets mb * seq)

    @staticmethod
    def from_config(cfg) -> ActCodec:
        s, m = cfg.swarm, cfg.model
        structure, _ = split_codec(s.activations)
        return ActCodec(
            s.activations,
            m.d_model,
            s.activation_block,
            k=m.subspace_rank if structure == "subspace" else 0,
            cols=colk_columns(m.d_model, s.activation_cols) if structure == "colk" else 0,
            mcfg=m,
            max_tokens=s.microbatch_size * cfg.train.seq_len,
        )

    def __post_init__(self):
        structure, values = split_codec(self.codec)
        check_codec(values, self.block)
        if structure == "subspace" and not 0 < self.k < self.d:
            raise ValueError(
                f"swarm.activations={self.codec} needs model.subspace_rank in [1, d_model={self.d}); it is {self.k} "
                "(train the model with the constraint, or pick another codec)"
            )
        if structure == "colk" and not 0 < self.cols <= self.d:
            raise ValueError(f"swarm.activations={self.codec}: columns kept {self.cols} must be in [1, {self.d}]")

    @property
    def structure(self) -> str:
        return split_codec(self.codec)[0]

    @property
    def values(self) -> str:
        return split_codec(self.codec)[1]

    @property
    def needs_tokens(self) -> bool:
        """Whether the forward codec needs the microbatch's token ids (``subspace``: ``x0(tokens)``)."""
        return self.structure == "subspace"

    @property
    def width(self) -> int:
        return {"dense": self.d, "subspace": self.k, "colk": self.cols}[self.structure]

    def wire_bytes(self, tokens: int) -> int:
        """Bytes of one encoded tensor of ``tokens`` tokens (forward and backward alike)."""
        idx = 4 * self.cols if self.structure == "colk" and tokens > 0 else 0
        return idx + quant.payload_nbytes(self.values, tokens * self.width, self.block)

    def _basis(self, like: torch.Tensor) -> torch.Tensor:
        from dilocox.model.subspace import basis

        return basis(self.d, self.k, device=like.device)

    def _base(self, tokens: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
        if tokens is None:
            return None
        from dilocox.model.subspace import stream_base

        return stream_base(self.mcfg, tokens, device=like.device)

    def encode(
        self, t: torch.Tensor, tokens: torch.Tensor | None = None, use_kernel: bool = True
    ) -> tuple[torch.Tensor, ActMeta]:
        """``t`` [..., d] -> (uint8 payload, meta). ``tokens`` [...] (ids): a forward activation under
        ``subspace`` (its ``x0`` is taken out); None: a gradient."""
        if self.structure == "dense":
            return encode(t, self.codec, self.block, use_kernel)
        if not t.is_floating_point() or t.dim() < 2 or t.shape[-1] != self.d:
            raise ValueError(
                f"activation codec {self.codec}: expected a float tensor [..., {self.d}], got {t.dtype} "
                f"{tuple(t.shape)}"
            )
        dtype = str(t.dtype).removeprefix("torch.")
        x = t.detach().float()
        meta = ActMeta(self.codec, tuple(int(s) for s in t.shape), dtype, self.block)
        if self.structure == "subspace":
            base = self._base(tokens, x)
            if base is not None:
                x = x - base.reshape(x.shape)
            vals = x.reshape(-1, self.d) @ self._basis(x)
            head = b""
        else:
            cols = colk_select(x, self.cols)
            vals = x.reshape(-1, self.d)[:, cols]
            head = cols.to(torch.int32).cpu().numpy().tobytes()
        packed = quant.quantize(vals.contiguous().reshape(-1), self.values, self.block, use_kernel=use_kernel)
        if not head:
            return packed.data, meta
        idx = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(packed.data.device)
        return torch.cat([idx, packed.data]), meta

    def encode_act(self, y: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ActMeta]:
        """A stage's output for the next stage; ``ids``: the microbatch's ``pack_ids``."""
        return self.encode(y, ids[0] if self.needs_tokens else None)

    def receive(self, payload: torch.Tensor, meta: dict, ids: torch.Tensor) -> torch.Tensor:
        """A received activation (its header ``meta`` and ``ids`` checked against the run, module doc), decoded."""
        tokens = check_ids(ids, self.mcfg.vocab_size, self.max_tokens)[0]
        return self.decode(payload, ActMeta.from_dict(meta), tokens if self.needs_tokens else None)

    def check_meta(self, payload: torch.Tensor, meta: ActMeta) -> int:
        """The header of a received tensor against this run; returns its token count."""
        if (meta.kind, meta.block) != (self.codec, self.block):
            raise ValueError(
                f"activation header says codec {meta.kind}/block {meta.block}; this run sends "
                f"{self.codec}/block {self.block} (every peer of a run must use the same swarm.activations)"
            )
        if meta.dtype not in _DTYPES:
            raise ValueError(f"activation codec: dtype {meta.dtype!r} is not one of {list(_DTYPES)}")
        if len(meta.shape) < 2 or meta.shape[-1] != self.d or any(s < 0 for s in meta.shape):
            raise ValueError(f"activation header shape {meta.shape} is not [..., d_model={self.d}]")
        tokens = meta.numel // self.d
        if self.max_tokens and tokens > self.max_tokens:
            raise ValueError(
                f"activation header claims {tokens} tokens; a microbatch of this run has at most {self.max_tokens}"
            )
        expect = self.wire_bytes(tokens)
        if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != expect:
            raise ValueError(
                f"activation payload for {meta.kind} shape {meta.shape} must be a flat uint8 tensor of "
                f"{expect} bytes, got {payload.dtype} with {payload.numel()} elements"
            )
        return tokens

    def decode(
        self, payload: torch.Tensor, meta: ActMeta, tokens: torch.Tensor | None = None, use_kernel: bool = True
    ) -> torch.Tensor:
        """What ``encode`` was given as the receiver sees it, in the sender's dtype (``tokens``: as for encode)."""
        n = self.check_meta(payload, meta)
        if self.structure == "dense":
            return decode(payload, meta, use_kernel)
        off = 4 * self.cols if self.structure == "colk" and n else 0
        p = quant.Packed(self.values, n * self.width, self.block, payload[off:].contiguous())
        vals = quant.dequantize(p, use_kernel=use_kernel).view(n, self.width)
        if self.structure == "subspace":
            out = vals @ self._basis(vals).T
            base = self._base(tokens, out)
            if base is not None:
                if base.numel() != out.numel():
                    raise ValueError(f"activation of shape {meta.shape} came with {tokens.numel()} token ids")
                out = out + base.reshape(n, self.d)
        else:
            cols = (
                torch.frombuffer(bytearray(payload[:off].cpu().numpy().tobytes()), dtype=torch.int32).long()
                if n
                else torch.empty(0, dtype=torch.long)
            )
            if n and (bool((cols < 0).any()) or bool((cols >= self.d).any()) or bool((cols[1:] <= cols[:-1]).any())):
                raise ValueError(f"colk column indices must be sorted, distinct and in [0, {self.d})")
            out = vals.new_zeros(n, self.d)
            out[:, cols] = vals
        return out.view(meta.shape).to(_DTYPES[meta.dtype])


def colk_select(x: torch.Tensor, cols: int) -> torch.Tensor:
    """The ``cols`` columns (last dim) of ``x`` with the largest L2 norm over all its tokens, ties to the lower
    index, sorted ascending."""
    norms = x.reshape(-1, x.shape[-1]).float().pow(2).sum(0)
    order = torch.sort(-norms, stable=True).indices[:cols]
    return torch.sort(order).values


def colk_select_reference(x: torch.Tensor, cols: int) -> list[int]:
    """Plain reference of ``colk_select``: float64 norms, a Python sort."""
    rows = x.reshape(-1, x.shape[-1]).double().tolist()
    norms = [sum(r[j] ** 2 for r in rows) for j in range(x.shape[-1])]
    return sorted(sorted(range(len(norms)), key=lambda j: (-norms[j], j))[:cols])


def subspace_reference(x: torch.Tensor, U: torch.Tensor, base: torch.Tensor | None = None) -> torch.Tensor:
    """Plain reference of the subspace code and rebuild without quantization: per token, the float64 dot
    products ``c_i = <x - x0, u_i>`` and ``x0 + sum_i c_i u_i``."""
    d, k = U.shape
    rows = x.reshape(-1, d).double()
    b = base.reshape(-1, d).double() if base is not None else torch.zeros_like(rows)
    out = torch.empty_like(rows)
    for t in range(rows.shape[0]):
        r = rows[t] - b[t]
        coef = [float((r * U[:, i].double()).sum()) for i in range(k)]
        out[t] = b[t] + sum(c * U[:, i].double() for i, c in enumerate(coef))
    return out.view(x.shape)


# --------------------------------------------------------------------------- token ids on the wire


def ids_dtype(vocab_size: int) -> torch.dtype:
    """The smallest dtype that holds every token id: uint8 (byte vocabularies), int16, int32."""
    return torch.uint8 if vocab_size <= 256 else torch.int16 if vocab_size <= 32768 else torch.int32


def pack_ids(tokens: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A microbatch's input ids and next-token targets as one ``[2, B, S]`` tensor of ``ids_dtype`` (what a hop
    sends beside the activation: the last stage needs the targets, a ``subspace`` codec the inputs)."""
    return torch.stack([tokens, targets]).to(ids_dtype(vocab_size)).contiguous()


def check_ids(ids: torch.Tensor, vocab_size: int, max_tokens: int) -> torch.Tensor:
    """Received ids against the run (dtype, ``[2, B, S]`` within ``max_tokens``, ids < vocab); int64 back."""
    want = ids_dtype(vocab_size)
    if ids.dtype != want or ids.dim() != 3 or ids.shape[0] != 2 or ids.shape[1] * ids.shape[2] > max_tokens:
        raise ValueError(
            f"microbatch ids must be {want} [2, batch, seq] with at most {max_tokens} tokens, got {ids.dtype} "
            f"{tuple(ids.shape)}"
        )
    out = ids.long()
    if out.numel() and (int(out.min()) < 0 or int(out.max()) >= vocab_size):
        raise ValueError(f"microbatch ids must be in [0, {vocab_size})")
    return out
