"""Activation recomputation (``train.recompute``): trade compute for the memory of a block's activations.

- ``none``: autograd keeps every activation a block's backward needs (about ``34 S B d + 5 a S^2 B`` bytes per
  layer in Korthikanti et al.'s count, the S^2 term gone with a fused attention kernel).
- ``full``: each transformer block runs under ``torch.utils.checkpoint`` (non-reentrant): only its input is kept, and
  the backward runs the block's forward again first (Megatron's ``--recompute-granularity full`` with
  ``--recompute-method uniform --recompute-num-layers 1``; torchtitan's ``activation_checkpoint.mode: full``).
  About one more forward per step (~+33 % of the FLOPs; MFU keeps counting model FLOPs only).
- ``selective``: the same region, but the outputs of the GEMMs and the attention kernel are kept and only the cheap
  ops between them (norms, activations, RoPE, residual adds, dropout) are run again (torchtitan's op-level
  selective checkpointing, with every GEMM kept): most of the memory of the elementwise ops back for a few
  percent of the step.

Results are unchanged bit for bit: the recomputed forward runs the same ops on the same inputs, and
``torch.utils.checkpoint`` restores the RNG state, so dropout draws the same masks (``tests/test_recompute.py``
compares losses and every gradient with ``none``). A block's tensor-parallel all-reduce runs again in the
recomputed forward, as in Megatron.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "full", "selective")

_aten = torch.ops.aten
# outputs kept by ``selective``: the GEMMs and the fused attention kernels (everything else is recomputed)
SAVED_OPS = frozenset(
    op
    for op in (
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
        getattr(_aten, "_scaled_mm", None) and _aten._scaled_mm.default,  # fp8 GEMMs (model/fp8.py)
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_cudnn_attention.default,
    )
    if op
)


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def run_block(block: nn.Module, mode: str, h: torch.Tensor, rope) -> torch.Tensor:
    """``block(h, rope)`` under the recompute ``mode`` (plain when no gradient is recorded: evaluation)."""
    if mode == "none" or not torch.is_grad_enabled():
        return block(h, rope)
    if mode == "full":
        return checkpoint(block, h, rope, use_reentrant=False)
    if mode == "selective":
        return checkpoint(
            block, h, rope, use_reentrant=False, context_fn=partial(create_selective_checkpoint_contexts, _policy)
        )
    raise ValueError(f"train.recompute={mode!r} is not one of {list(MODES)}")
