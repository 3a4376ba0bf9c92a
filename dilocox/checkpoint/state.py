"""What goes into a shard: walking a training state's tensors, finding NaN/Inf, sizing it, RNG state.

``nonfinite_tensors`` is the check that keeps a diverged state from replacing a good checkpoint;
``state_nbytes`` and ``estimate_bytes`` size a rank's shard for the free-space checks;
``rng_state``/``set_rng_state`` capture torch (CPU, CUDA) and Python ``random`` state as values a
``weights_only`` load accepts.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import torch


def iter_tensors(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted path, tensor) for every tensor in nested dicts/lists/tuples, whatever their class."""
    if isinstance(obj, torch.Tensor):
        yield path, obj.to_local() if hasattr(obj, "placements") else obj  # (a DTensor: this rank's slice)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_tensors(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{path}.{i}" if path else str(i))


def nonfinite_tensors(state: Any, limit: int = 4) -> list[str]:
    """Paths of the (first ``limit``) floating tensors in ``state`` holding a NaN or Inf.

    Fast path: a tensor's sum is finite only if every element is (a reduction, ~20x faster on a
    CPU than ``isfinite(t).all()``, which allocates a mask); only a tensor whose sum is not finite
    (a NaN/Inf, or finite values whose sum overflows) gets the exact elementwise check. One
    device synchronisation per device for the fast path, not one per tensor."""
    by_dev: dict[torch.device, tuple[list[str], list[torch.Tensor], list[torch.Tensor]]] = {}
    for p, t in iter_tensors(state):
        if (t.is_floating_point() or t.is_complex()) and t.numel():
            names, tensors, sums = by_dev.setdefault(t.device, ([], [], []))
            names.append(p)
            tensors.append(t)
            acc = t.sum() if t.is_complex() or t.dtype == torch.float64 else t.sum(dtype=torch.float32)
            sums.append(torch.isfinite(acc).all())
    bad: list[str] = []
    for names, tensors, sums in by_dev.values():
        ok = torch.stack(sums).cpu().tolist()
        bad += [n for n, t, f in zip(names, tensors, ok) if not f and not bool(torch.isfinite(t).all())]
    return bad[:limit] + ([f"... {len(bad) - limit} more"] if len(bad) > limit else [])


def state_nbytes(state: Any) -> int:
    """Bytes of tensor data ``torch.save`` writes for ``state`` (shared storages counted once)."""
    seen, total = set(), 0
    for _, t in iter_tensors(state):
        st = t.untyped_storage()
        key = (t.device, st.data_ptr(), st.nbytes())
        if key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


# DCP's framing per tensor: ~1.6 KB of torch.save records around its bytes in the .distcp file and ~0.25 KB in
# .metadata (measured with torch 2.13: 150 tensors, 1.80 MB of data, wrote 2.04 MB + 34 KB); 2 KiB each
DCP_PER_TENSOR = 2048


def estimate_bytes(state: Any, optimizer: torch.optim.Optimizer | None = None, copies: int = 1, own=()) -> int:
    """Size of this rank's share of a checkpoint: ``state``'s tensors and DCP's framing of each (+1% and 64 KiB for
    the container), plus the moments an optimizer that has not stepped yet will hold (Adam-style: 2, SGD momentum: 1).

    ``copies`` = D > 1 data-parallel ranks holding the same tensors under the same keys: DCP writes such a key once
    per checkpoint (``dedup_save_plans``, spread over the ranks), so every top-level entry of ``state`` not named in
    ``own`` (this rank's own: its step, RNG, data position ...) counts 1/D here; the D ranks' shares add up to one
    copy. A checkpoint's size is then the sum of its ranks' shares (``preflight``)."""

    def size(x: Any, opt=None) -> int:
        n, k = state_nbytes(x), sum(1 for _ in iter_tensors(x))
        if opt is not None and not opt.state:
            for g in opt.param_groups:
                # Adam-style: 2 moments; Muon ("ns_steps"): its momentum buffer, always; SGD: one with momentum
                per = 2 if "betas" in g else (1 if "ns_steps" in g or g.get("momentum", 0) else 0)
                n += per * sum(p.numel() * p.element_size() for p in g["params"])
                k += per * len(g["params"])
        return n + k * DCP_PER_TENSOR

    if isinstance(state, dict) and copies > 1:
        mine = {k: v for k, v in state.items() if k in own}
        shared = {k: v for k, v in state.items() if k not in own}
        n = size(mine) + -(-size(shared, optimizer) // copies)
    else:
        n = size(state, optimizer)
    return int(n * 1.01) + 64 * 1024


def rng_state() -> dict:
    """torch (CPU, and CUDA when in use) and Python ``random`` state, as weights_only-loadable values.

    Python's state is (version, 625 ints, gauss_next); gauss_next is the cached second value of
    ``random.gauss`` and must be kept too, or the next gauss() after a resume differs."""
    version, internal, gauss_next = random.getstate()
    st = {
        "torch": torch.get_rng_state(),
        "python": list(internal),
        "python_version": version,
        "python_gauss_next": gauss_next,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate((st.get("python_version", 3), tuple(st["python"]), st.get("python_gauss_next")))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])
