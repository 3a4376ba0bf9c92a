"""``log.profile_start`` / ``log.profile_steps`` (dilocox/profiling.py): a torch.profiler trace of a window of
training steps per rank, written when the window ends (or when the run ends inside it), nothing outside it."""

from __future__ import annotations

import json

import pytest

from dilocox.config import ConfigError, load_config
from tests.small_run import small_cfg


def _run(tmp_path, *extra, steps=4):
    from dilocox.train import Trainer

    t = Trainer(small_cfg(str(tmp_path), "--checkpoint.every=0", *extra, steps=steps))
    t.run()
    if t.run_lock is not None:
        t.run_lock.release()
    return t


def _step_marks(path) -> set[str]:
    trace = json.loads(path.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return {e["name"] for e in events if str(e.get("name", "")).startswith("train_step#")}


def test_the_window_of_steps_is_traced_and_nothing_else(tmp_path):
    _run(tmp_path, "--log.profile_start=2", "--log.profile_steps=2", steps=4)
    files = sorted(p.name for p in (tmp_path / "profile").iterdir())
    assert files == ["rank0_steps2-3.json", "rank0_steps2-3.txt"]
    assert _step_marks(tmp_path / "profile" / "rank0_steps2-3.json") == {"train_step#2", "train_step#3"}
    table = (tmp_path / "profile" / "rank0_steps2-3.txt").read_text()
    assert "Self CPU" in table and ("aten::mm" in table or "aten::addmm" in table), table[:2000]


def test_a_run_that_ends_inside_the_window_writes_what_it_recorded(tmp_path):
    _run(tmp_path, "--log.profile_start=3", "--log.profile_steps=5", steps=4)
    assert _step_marks(tmp_path / "profile" / "rank0_steps3-4.json") == {"train_step#3", "train_step#4"}


def test_off_by_default(tmp_path):
    _run(tmp_path, steps=2)
    assert not (tmp_path / "profile").exists()


@pytest.mark.parametrize("bad", ["--log.profile_steps=0", "--log.profile_start=-1"])
def test_bad_values_are_named(bad):
    with pytest.raises(ConfigError, match=bad.split("=")[0][2:]):
        load_config("configs/tiny.yaml", [bad])


def test_swarm_refuses_it():
    from dilocox.swarm.cli import SwarmUsageError, refuse_unsupported

    with pytest.raises(SwarmUsageError, match="log.profile_start"):
        refuse_unsupported(load_config("configs/tiny.yaml", ["--log.profile_start=2"]))
