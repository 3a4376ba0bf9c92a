"""Checkpoint files: atomic, complete-or-ignored, corrupt shards give a clear error."""

import os

import pytest
import torch

from dilocox import checkpoint as ckpt


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _state(v):
    return {"w": torch.full((3,), float(v)), "step": v, "nested": {"lst": [1, 2], "none": None}}


def test_save_load_roundtrip_and_latest(tmp_path):
    d = str(tmp_path)
    for step in (10, 20, 30):
        ckpt.save_checkpoint(d, step, 0, 1, _state(step), meta={"layout": "R1"}, keep=2)
    latest = ckpt.find_latest(d)
    assert latest.endswith("step_00000030")
    sd = ckpt.load_checkpoint(latest, 0, 1, expect={"layout": "R1"})
    assert sd["step"] == 30 and torch.equal(sd["w"], torch.full((3,), 30.0))
    # keep=2: the oldest complete checkpoint was removed
    assert [os.path.basename(p) for p in ckpt.complete_steps(d)] == ["step_00000020", "step_00000030"]


def test_interrupted_save_never_becomes_latest(tmp_path):
    d = str(tmp_path)
    # a 2-rank checkpoint at step 10 (both shards), then a crash after rank 0 wrote step 20
    ckpt.save_checkpoint(d, 10, 1, 2, _state(10))
    ckpt.save_checkpoint(d, 10, 0, 2, _state(10))
    step20 = os.path.join(d, "step_00000020")
    os.makedirs(step20)
    torch.save(_state(20), ckpt.shard_path(step20, 0))  # no COMPLETE.json: interrupted
    assert ckpt.find_latest(d).endswith("step_00000010")
    with pytest.raises(ckpt.CheckpointError, match="interrupted"):
        ckpt.load_checkpoint(step20, 0)


def test_missing_rank_shard_is_not_marked_complete(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match=r"ranks \[1\]"):
        ckpt.save_checkpoint(str(tmp_path), 5, 0, 2, _state(5))
    assert ckpt.find_latest(str(tmp_path)) is None


def test_truncated_shard_clear_error_and_nothing_overwritten(tmp_path):
    d = str(tmp_path)
    ckpt.save_checkpoint(d, 10, 0, 1, _state(10))
    ckpt.save_checkpoint(d, 20, 0, 1, _state(20))
    bad = ckpt.shard_path(os.path.join(d, "step_00000020"), 0)
    os.truncate(bad, os.path.getsize(bad) // 2)
    good_before = _read(ckpt.shard_path(os.path.join(d, "step_00000010"), 0))
    with pytest.raises(ckpt.CheckpointError, match="corrupt or truncated") as ei:
        ckpt.load_checkpoint(ckpt.find_latest(d), 0, 1)
    assert "rank_00000.pt" in str(ei.value) and "resume" in str(ei.value)
    assert _read(ckpt.shard_path(os.path.join(d, "step_00000010"), 0)) == good_before


def test_layout_mismatch_is_refused(tmp_path):
    d = str(tmp_path)
    ckpt.save_checkpoint(d, 1, 0, 1, _state(1), meta={"layout": "R1xD1xP1xT1"})
    with pytest.raises(ckpt.CheckpointError, match="world_size|ranks"):
        ckpt.load_checkpoint(ckpt.find_latest(d), 0, 4)
    with pytest.raises(ckpt.CheckpointError, match="layout"):
        ckpt.load_checkpoint(ckpt.find_latest(d), 0, 1, expect={"layout": "R2xD1xP1xT1"})


def test_rng_state_roundtrip():
    st = ckpt.rng_state()
    a = torch.rand(4)
    ckpt.set_rng_state(st)
    assert torch.equal(a, torch.rand(4))


def test_saving_an_already_complete_step_leaves_it_untouched(tmp_path):
    d = str(tmp_path)
    ckpt.save_checkpoint(d, 10, 0, 1, _state(10))
    path = ckpt.shard_path(os.path.join(d, "step_00000010"), 0)
    before = _read(path)
    ckpt.save_checkpoint(d, 10, 0, 1, _state(99))
    assert _read(path) == before


def _save_per_node_dirs(rank, world, root, shared):
    """Each rank saves into its own directory (node-local disks) or into one shared one."""
    d = os.path.join(root, "shared" if shared else f"node{rank}")
    out = []
    for step in (1, 1):  # the second save at the same step must be a no-op on every rank
        try:
            ckpt.save_checkpoint(d, step, rank, world, _state(step), agree=ckpt.all_ranks_agree)
            out.append("ok")
        except ckpt.CheckpointError as e:
            out.append(str(e))
    return out, sorted(os.listdir(d))


def test_node_local_checkpoint_dirs_fail_on_every_rank_without_hanging(tmp_path):
    from tests.spawn import run_ranks

    res = run_ranks(2, _save_per_node_dirs, str(tmp_path), False, timeout=120)
    for out, listing in res:
        assert all("shared by all ranks" in m for m in out), out  # a clear error on both ranks, no deadlock
        assert "latest" not in listing
    assert ckpt.find_latest(str(tmp_path / "node0")) is None

    res = run_ranks(2, _save_per_node_dirs, str(tmp_path), True, timeout=120)
    assert [out for out, _ in res] == [["ok", "ok"], ["ok", "ok"]]
    assert ckpt.find_latest(str(tmp_path / "shared")).endswith(ckpt.step_dir_name(1))


def _save_with_a_failing_rank(rank, world, d):
    """Rank 1's state cannot be pickled (torch.save raises, as it does with RuntimeError on a full disk)."""
    state = _state(3) if rank == 0 else {"bad": lambda: None}
    try:
        ckpt.save_checkpoint(d, 3, rank, world, state, agree=ckpt.all_ranks_agree)
        return "ok", os.path.exists(os.path.join(d, ckpt.step_dir_name(3)))
    except ckpt.CheckpointError as e:
        return str(e), os.path.exists(os.path.join(d, ckpt.step_dir_name(3)))


def test_a_rank_failing_inside_torch_save_fails_every_rank(tmp_path):
    from tests.spawn import run_ranks

    ckpt.save_checkpoint(str(tmp_path), 1, 0, 1, _state(1))  # an earlier, complete checkpoint
    res = run_ranks(2, _save_with_a_failing_rank, str(tmp_path), timeout=120)
    assert "rank 1 could not write its shard" in res[1][0] and "another rank could not write" in res[0][0], res
    assert not res[0][1] and not res[1][1]  # no partial step dir (rank 0's shard removed too), no temp file
    assert ckpt.find_latest(str(tmp_path)).endswith(ckpt.step_dir_name(1))  # latest untouched
