"""The smallest training config the regression tests use (not a test module)."""

from __future__ import annotations

from test_train import tiny_cfg


def small_cfg(tmp, *extra, steps=4):
    """``test_train.tiny_cfg`` made smaller still (2 layers x 64, 32-token sequences)."""
    return tiny_cfg(
        tmp,
        "--data.max_bytes=200000",
        "--train.seq_len=32",
        "--train.eval_batches=1",
        "--optim.warmup_steps=1",
        "--model.n_layers=2",
        "--model.d_model=64",
        "--checkpoint.resume=none",
        *extra,
        steps=steps,
    )
