"""Review of ``train.recompute`` / ``dilocox bench memory`` / ``optim.schedule: wsd``: cases the first tests missed.

* ``ActivationMeter`` told storages apart by ``data_ptr()``: a storage an op grows in place (``out=``,
  ``resize_``) frees its old block while it lives on, a new storage given that block was then not counted, and the
  old storage's finalizer dropped the entry the new one shared (and the growth itself was never counted).
* ``wsd-sqrt``: the last step of the stable phase (``frac == 1 - decay_fraction``) fell ~1e-8 below the peak
  (``1 - (1 - frac) / share`` rounds to ~1e-16 there, and ``sqrt`` lifts it to ~1e-8), with the default
  ``decay_fraction=0.2`` at e.g. ``train.steps=11`` (those cases are in tests/test_optim_edges.py).
* a resume refused ``train.recompute`` (same results, as
  ``train.compile``) and ``optim.decay_fraction`` (the schedule, as ``optim.warmup_steps``) as math changes.
"""

from __future__ import annotations

import pytest
import torch

from dilocox.bench.memory import ActivationMeter


def test_meter_counts_storages_resized_in_place_and_the_one_that_reuses_their_old_block():
    with ActivationMeter() as meter:
        o = torch.empty(1000)  # 4000 B, counted
        o.resize_(2000)  # grows in place: 8000 B somewhere else, the 4000-B block freed, o's storage still alive
        assert meter.current == 8000, meter.current
        c = torch.ones(1000)  # a new 4000-B storage (on glibc it gets o's old block: the address collision)
        assert meter.current == 12000, meter.current
        big = torch.ones(3000)
        torch.add(big, 1, out=o)  # an out= op growing o again (12000 B)
        assert meter.current == 12000 + 12000 + 4000, meter.current
        del o
        assert meter.current == 4000 + 12000, meter.current  # c and big are alive
        del big, c
        assert meter.current == 0 and meter.live == {}, (meter.current, meter.live)
    assert meter.peak == 12000 + 12000 + 4000


def test_meter_counts_a_storage_grown_from_zero_bytes_by_an_out_op():
    with ActivationMeter() as meter:
        o = torch.empty(0)
        torch.add(torch.ones(1000), 1, out=o)
        assert meter.current == 4000, meter.current
        del o
        assert meter.current == 0, meter.current


@pytest.mark.parametrize("key", ["train.recompute", "optim.decay_fraction"])
def test_a_resume_may_change_recompute_and_the_decay_fraction(key):
    from dilocox.rundir import is_schedule_key

    assert is_schedule_key(key)
