"""A rank that fails or dies: its partners and the launcher find out, and nothing is left running.

Each test fails on the code before its fix:

- a rank that raises inside ``train()`` left its outer comm thread running (the process then
  died with SIGABRT at interpreter exit instead of exiting with the error);
- ``run_ranks`` waited for its whole timeout when a rank was killed by a signal.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from tests.small_run import small_cfg
from tests.spawn import run_ranks


def _raise_in_training(rank, world, tmp):
    """Rank 1 raises at step 4 (an outer all-reduce was launched at step 3); both ranks fail."""
    import dilocox.train as T

    orig = T.Trainer.train_step

    def bad_step(self):
        if self.topo.rank == 1 and self.step == 4:
            raise FloatingPointError("injected")
        return orig(self)

    T.Trainer.train_step = bad_step
    cfg = small_cfg(
        f"{tmp}/r",
        "--parallel.replicas=2",
        "--outer.method=diloco",
        "--outer.sync_every=3",
        "--outer.overlap=delayed",
        steps=12,
    )
    try:
        T.train(cfg)
        err = None
    except Exception as e:  # noqa: BLE001 - what each rank saw
        err = type(e).__name__
    alive = [t.name for t in threading.enumerate() if t.name.startswith("outer-comm") and t.is_alive()]
    return err, alive


def test_failing_rank_stops_the_outer_comm_thread(tmp_path):
    # fresh processes: a rank that raised exits, as under torchrun (a warm pool worker would stay alive and
    # keep its end of the outer group's connections open, so its partner's clean-up waits for it)
    res = run_ranks(2, _raise_in_training, str(tmp_path), fresh=True)
    assert res[1][0] == "FloatingPointError"
    assert res[0][0] is not None  # its partner fails too (the peer left the outer group)
    for err, alive in res:
        assert alive == [], alive


def _one_rank_killed(rank, world):
    import signal

    import torch.distributed as dist

    # both ranks past init first: else rank 0 could finish init, return and close the mesh while rank 1 was still
    # connecting under load, and rank 1 failed in init ("Connection closed by peer") before it could be killed
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


@pytest.mark.fault
def test_run_ranks_names_a_killed_rank_quickly():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as ei:
        run_ranks(2, _one_rank_killed, timeout=240)
    assert time.monotonic() - t0 < 120
    assert "rank 1" in str(ei.value) and "-9" in str(ei.value)
