"""Causal self-attention kernels behind one interface: ``sdpa`` | ``flash_attn`` | ``te``.

``make_attention(backend, n_heads, n_kv_heads, head_dim, dropout)`` returns a module that
maps ``q [B, S, H, hd]``, ``k, v [B, S, Hkv, hd]`` to ``[B, S, H, hd]`` (causal; grouped-query
attention when ``Hkv < H``). Head counts are the ones local to a tensor-parallel rank.

- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (always available; picks the
  flash / memory-efficient / math kernel itself). GQA via ``enable_gqa`` (torch >= 2.5).
- ``flash_attn``: Tri Dao's ``flash_attn_func`` (CUDA, fp16/bf16 only), guarded import.
- ``te``: Transformer Engine ``DotProductAttention``, guarded import.

Attention dropout under tensor parallelism (``tp_rank_dropout``): each TP rank holds other heads, so its
attention-probability masks must be drawn from its own stream, while the dropout of the activations the TP ranks
share (residual, embedding) must draw the same masks on every rank (Megatron's model-parallel RNG). The kernel runs
with the device's default generator seeded from ``(a draw of the CPU default generator, tp rank)`` and the
generator's state put back afterwards: every TP rank consumes the shared streams identically, the checkpointed RNG
state still resumes a run exactly, and a recomputed forward (``torch.utils.checkpoint`` restores the CPU state)
draws the same masks again.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dilocox.config import ConfigError
from dilocox.seeding import mix_seed

BACKENDS = ("sdpa", "flash_attn", "te")


def _import_flash_attn():
    try:
        from flash_attn import flash_attn_func
    except ImportError as e:
        raise ConfigError(
            "model.attn_backend='flash_attn' but the flash-attn package is not installed "
            f"({e}); pip install flash-attn or set model.attn_backend=sdpa"
        ) from None
    return flash_attn_func


def import_transformer_engine(field: str):
    """``transformer_engine.pytorch`` or a ConfigError naming ``field`` and the fix."""
    try:
        import transformer_engine.pytorch as te
    except ImportError as e:
        raise ConfigError(
            f"{field}='te' but the transformer-engine package is not installed ({e}); "
            f"pip install transformer-engine[pytorch] or set {field} to its default"
        ) from None
    return te


class SDPAttention(nn.Module):
    def __init__(self, n_heads: int, n_kv_heads: int, dropout: float = 0.0):
        super().__init__()
        self.gqa, self.dropout = n_kv_heads != n_heads, dropout

    def forward(self, q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, hd]
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=self.gqa)
        return y.transpose(1, 2)


class FlashAttention(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.fn, self.dropout = _import_flash_attn(), dropout

    def forward(self, q, k, v):
        if q.dtype not in (torch.float16, torch.bfloat16) or not q.is_cuda:
            raise RuntimeError(
                f"model.attn_backend='flash_attn' needs fp16/bf16 CUDA tensors, got {q.dtype} on {q.device}; "
                "use train.dtype=bf16 on a GPU or model.attn_backend=sdpa"
            )
        return self.fn(q, k, v, dropout_p=self.dropout if self.training else 0.0, causal=True)


class TEAttention(nn.Module):
    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, dropout: float = 0.0):
        super().__init__()
        te = import_transformer_engine("model.attn_backend")
        self.inner = te.DotProductAttention(
            n_heads,
            head_dim,
            num_gqa_groups=n_kv_heads,
            attention_dropout=dropout,
            qkv_format="bshd",
            attn_mask_type="causal",
        )

    def forward(self, q, k, v):
        # model.fused_qkv hands q/k/v as strided views of one GEMM's output; TE's bshd kernels are documented on
        # contiguous tensors, so they get them (a no-op for the separate projections' outputs, which are contiguous)
        q, k, v = (t.contiguous() for t in (q, k, v))
        y = self.inner(q, k, v)  # [B, S, H * hd]
        return y.view(q.shape)


def make_attention(backend: str, n_heads: int, n_kv_heads: int, head_dim: int, dropout: float = 0.0) -> nn.Module:
    """The attention kernel module for ``model.attn_backend`` (raises ConfigError if unusable)."""
    if backend == "sdpa":
        return SDPAttention(n_heads, n_kv_heads, dropout)
    if backend == "flash_attn":
        return FlashAttention(dropout)
    if backend == "te":
        return TEAttention(n_heads, n_kv_heads, head_dim, dropout)
    raise ConfigError(f"model.attn_backend={backend!r} is not one of {list(BACKENDS)}")


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    mod = torch.get_device_module(device.type)
    return mod.default_generators[device.index if device.index is not None else mod.current_device()]


def tp_rank_dropout(kernel: nn.Module, tp_rank: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``kernel(q, k, v)`` with its dropout drawn from a stream of this tensor-parallel rank's own (module doc).

    Not for ``torch.compile`` to trace (it swaps the generator's state): the caller wraps it in
    ``torch.compiler.disable`` (a graph break each side of the attention kernel)."""
    shared = int(torch.randint(0, 2**62, (1,)).item())  # the CPU default generator: the same on every TP rank
    gen = _default_generator(q.device)
    saved = gen.get_state()
    gen.manual_seed(mix_seed(shared, tp_rank))
    try:
        if q.is_cuda:  # (TE draws from the current device's generator: make it q's)
            with torch.cuda.device(q.device):
                return kernel(q, k, v)
        return kernel(q, k, v)
    finally:
        gen.set_state(saved)
