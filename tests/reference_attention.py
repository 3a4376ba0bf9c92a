"""Plain causal softmax attention, the oracle of the attention kernels (tests/test_model.py)."""

from __future__ import annotations

import torch


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention with an explicit mask and repeated kv heads; q, k, v are [B, S, H, D]."""
    h, hkv = q.shape[2], k.shape[2]
    k, v = (t.repeat_interleave(h // hkv, dim=2) for t in (k, v))
    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
    s = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)
