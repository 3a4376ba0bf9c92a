"""Before a model is built: refuse one whose weights, gradients and AdamW state cannot fit the machine at all.

A typo such as ``--model.vocab_size=1e10`` failed inside the first allocation with a C++ traceback (or a multi-GB
allocation attempt first). The estimate is deliberately low, so it refuses only what cannot fit: 16 bytes per
parameter of a rank (an fp32 weight, its gradient and AdamW's two moments), the model split evenly over
``parallel.pipeline x parallel.tensor``, against this host's physical memory on a CPU and 10 TB on an accelerator
(none has as much; its own out-of-memory error names the rest). Activations, the outer state and the data are not
counted."""

from __future__ import annotations

import math
import os

BYTES_PER_PARAM = 16  # fp32 weight + gradient + AdamW exp_avg + exp_avg_sq
ACCELERATOR_BYTES = 10 * 10**12


def host_memory_bytes() -> int | None:
    """This host's physical memory, or None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_model_fits(cfg, on_cpu: bool, memory: int | None = None) -> None:
    """ConfigError when one rank's share of the model's training state exceeds ``memory`` (default: this host's
    physical memory on a CPU, ``ACCELERATOR_BYTES`` on an accelerator)."""
    from dilocox.config import ConfigError

    m, p = cfg.model, cfg.parallel
    params = m.num_params()
    need = params * BYTES_PER_PARAM // (p.pipeline * p.tensor)
    have = memory if memory is not None else (host_memory_bytes() if on_cpu else ACCELERATOR_BYTES)
    if have is None or need <= have:
        return
    raise ConfigError(
        f"the model (model.vocab_size={_num(m.vocab_size)}, d_model={_num(m.d_model)}, n_layers={_num(m.n_layers)}: "
        f"{_num(params)} parameters) needs at least {_num(need, 1e9)} GB per rank for its weights, gradients and AdamW "
        f"state with parallel.pipeline={p.pipeline} x tensor={p.tensor}, more than the {_num(have, 1e9)} GB "
        f"{'of this host' if on_cpu else 'any accelerator has'}; lower model.vocab_size, d_model or n_layers, or "
        "split it over more pipeline/tensor ranks"
    )


def _num(x: int, unit: float = 1.0) -> str:
    """``x / unit`` in three significant digits, also for an int too large for a float (1e300 given as an int)."""
    try:
        return f"{x / unit:.3g}"
    except OverflowError:
        return f"~1e{len(str(int(x))) - 1 - round(math.log10(unit))}"
