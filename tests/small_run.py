"""The smallest training config the regression tests use (not a test module)."""

from __future__ import annotations

from test_train import tiny_cfg

# the same small run as command-line overrides, for tests that start `dilocox train/launch` processes
TINY_RUN_ARGS = (
    "--data.max_bytes=200000",
    "--model.n_layers=2",
    "--model.d_model=64",
    "--train.seq_len=32",
    "--train.batch_size=2",
    "--train.eval_every=0",
    "--train.eval_batches=1",
    "--log.every=1",
    "--log.progress=false",
    "--log.tensorboard=false",
)


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
