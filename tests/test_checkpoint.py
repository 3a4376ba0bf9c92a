"""Checkpoint files on torch.distributed.checkpoint: atomic, complete-or-ignored, hashed, pickle-free; a damaged
file or a failing rank gives one clear error on every rank."""

import errno
import os

import pytest
import torch

from dilocox import checkpoint as ckpt
from dilocox.checkpoint import names


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _state(v):
    return {"w": torch.full((3,), float(v)), "step": torch.tensor(v)}


def _file(step_dir, rank=0):
    return ckpt.rank_files(step_dir, rank)[0]


def test_save_load_roundtrip_and_latest(tmp_path):
    d = str(tmp_path)
    for step in (10, 20, 30):
        ckpt.save_checkpoint(d, step, 0, 1, _state(step), meta={"layout": "R1"}, keep=2)
    latest = ckpt.find_latest(d)
    assert latest.endswith("step_00000030")
    sd = ckpt.load_checkpoint(latest, expect={"layout": "R1"})
    assert int(sd["step"]) == 30 and torch.equal(sd["w"], torch.full((3,), 30.0))
    # keep=2: the oldest complete checkpoint was removed
    assert [os.path.basename(p) for p in ckpt.complete_steps(d)] == ["step_00000020", "step_00000030"]
    meta = ckpt.read_meta(latest)  # every file DCP wrote is recorded with its size and hash
    assert meta["format"] == "dcp" and set(meta["files"]) == {".metadata", os.path.basename(_file(latest))}


def test_the_rest_is_json_not_pickle():
    obj = {"step": 3, "t": (1, 2.5, None), "ints": {4: "x"}, "nan": float("inf"), "rng": {"torch": torch.arange(5)}}
    data, tensors = names.encode(obj, "rank0/rest")
    assert data.dtype == torch.uint8 and set(tensors) == {"rank0/rest/rng/torch"}
    back = names.decode(data, tensors)
    assert back["t"] == (1, 2.5, None) and back["ints"] == {4: "x"} and back["nan"] == float("inf")
    assert torch.equal(back["rng"]["torch"], torch.arange(5))
    with pytest.raises(ckpt.CheckpointError, match="object"):
        names.encode({"x": object()}, "r")
    with pytest.raises(ckpt.CheckpointError, match="only tensors"):  # DCP would pickle it
        ckpt.save_checkpoint("/nonexistent", 1, 0, 1, {"step": 3})


def test_interrupted_save_never_becomes_latest_and_is_cleared(tmp_path):
    d = str(tmp_path)
    ckpt.save_checkpoint(d, 10, 0, 1, _state(10))
    step20 = os.path.join(d, "step_00000020")
    os.makedirs(step20)
    with open(os.path.join(step20, "__7_0.distcp"), "wb") as f:  # an interrupted save's file, no COMPLETE.json
        f.write(b"partial")
    assert ckpt.find_latest(d).endswith("step_00000010")
    with pytest.raises(ckpt.CheckpointError, match="interrupted"):
        ckpt.load_checkpoint(step20)
    ckpt.save_checkpoint(d, 20, 0, 1, _state(20))  # the next save at that step starts from an empty directory
    assert not os.path.exists(os.path.join(step20, "__7_0.distcp"))
    assert int(ckpt.load_checkpoint(ckpt.find_latest(d))["step"]) == 20


def test_missing_rank_files_are_not_marked_complete(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match=r"ranks \[1\]"):
        ckpt.save_checkpoint(str(tmp_path), 5, 0, 2, _state(5))
    assert ckpt.find_latest(str(tmp_path)) is None


def test_truncated_file_clear_error_and_nothing_overwritten(tmp_path):
    d = str(tmp_path)
    ckpt.save_checkpoint(d, 10, 0, 1, _state(10))
    ckpt.save_checkpoint(d, 20, 0, 1, _state(20))
    bad = _file(os.path.join(d, "step_00000020"))
    os.truncate(bad, os.path.getsize(bad) // 2)
    good_before = _read(_file(os.path.join(d, "step_00000010")))
    with pytest.raises(ckpt.CorruptCheckpointError, match="corrupt or truncated") as ei:
        ckpt.load_checkpoint(ckpt.find_latest(d))
    assert "__0_0.distcp" in str(ei.value)
    assert _read(_file(os.path.join(d, "step_00000010"))) == good_before


def test_setting_mismatch_and_earlier_format_are_refused(tmp_path):
    d = str(tmp_path)
    ckpt.save_checkpoint(d, 1, 0, 1, _state(1), meta={"method": "diloco"})
    with pytest.raises(ckpt.CheckpointError, match="method"):
        ckpt.load_checkpoint(ckpt.find_latest(d), expect={"method": "none"})
    old = os.path.join(d, "step_00000002")  # a COMPLETE.json of the earlier format (one torch.save file per rank)
    os.makedirs(old)
    with open(os.path.join(old, "COMPLETE.json"), "w") as f:
        f.write('{"step": 2, "shards": {"rank_00000.pt": {"bytes": 1, "sha256": "x"}}}')
    with pytest.raises(ckpt.CheckpointError, match="dilocox checkpoint convert"):
        ckpt.load_checkpoint(old)


def test_rng_state_roundtrip():
    st = ckpt.rng_state()
    a = torch.rand(4)
    ckpt.set_rng_state(st)
    assert torch.equal(a, torch.rand(4))


def test_saving_an_already_complete_step_leaves_it_untouched(tmp_path):
    d = str(tmp_path)
    ckpt.save_checkpoint(d, 10, 0, 1, _state(10))
    path = _file(os.path.join(d, "step_00000010"))
    before = _read(path)
    ckpt.save_checkpoint(d, 10, 0, 1, _state(99))
    assert _read(path) == before


def _save_per_node_dirs(rank, world, root, shared):
    """Each rank saves into its own directory (node-local disks) or into one shared one."""
    d = os.path.join(root, "shared" if shared else f"node{rank}")
    out = []
    for step in (1, 1):  # the second save at the same step must be a no-op on every rank
        try:
            ckpt.save_checkpoint(d, step, rank, world, {f"w{rank}": torch.ones(2) * rank}, agree=ckpt.all_ranks_agree)
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
    step = ckpt.find_latest(str(tmp_path / "shared"))
    assert step.endswith(ckpt.step_dir_name(1))
    sd = ckpt.load_checkpoint(step)  # both ranks' keys in one checkpoint
    assert torch.equal(sd["w0"], torch.zeros(2)) and torch.equal(sd["w1"], torch.ones(2))


def _save_with_a_full_disk_on_rank_1(rank, world, d):
    """Rank 1's disk fills while DCP writes its file (ENOSPC inside DCP's writer)."""
    import torch.distributed.checkpoint.filesystem as fs

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    real = fs._write_item
    if rank == 1:
        fs._write_item = full
    try:
        ckpt.save_checkpoint(d, 3, rank, world, {f"w{rank}": torch.ones(4)}, agree=ckpt.all_ranks_agree)
        return "ok", os.path.exists(os.path.join(d, ckpt.step_dir_name(3)))
    except ckpt.CheckpointError as e:
        return str(e), os.path.exists(os.path.join(d, ckpt.step_dir_name(3)))
    finally:
        fs._write_item = real  # (the rank pool's processes run later tests)


def test_a_rank_failing_inside_dcp_fails_every_rank(tmp_path):
    from tests.spawn import run_ranks

    ckpt.save_checkpoint(str(tmp_path), 1, 0, 1, _state(1))  # an earlier, complete checkpoint
    res = run_ranks(2, _save_with_a_full_disk_on_rank_1, str(tmp_path), timeout=120)
    assert all("no space left on device" in r[0] and "older checkpoints are intact" in r[0] for r in res), res
    assert not res[0][1] and not res[1][1]  # no partial step dir
    assert ckpt.find_latest(str(tmp_path)).endswith(ckpt.step_dir_name(1))  # latest untouched


def test_a_save_removes_the_partial_step_dirs_a_kill_left_before_it(tmp_path):
    """Found by a review: a save killed mid-write, or a prune killed inside its rmtree (COMPLETE.json already gone),
    left a directory no resume takes and no prune removed (prune looks at complete ones): a whole checkpoint's room
    lost each time, against the keep + 1 the start-up check counts. A save now removes the incomplete step dirs
    before its own step; a complete one, a later one and anything not named like a step dir stay."""
    d = str(tmp_path)
    ckpt.save_checkpoint(d, 10, 0, 1, _state(10), keep=3)
    for name in ("step_00000005", "step_00000015", "step_00000030", "step_00000012.corrupt"):
        os.makedirs(os.path.join(d, name, "replica0"))
        with open(os.path.join(d, name, "replica0", "__0_0.distcp"), "wb") as f:
            f.write(b"x" * 100)
    ckpt.save_checkpoint(d, 20, 0, 1, _state(20), keep=3)
    assert sorted(os.listdir(d)) == [
        "latest", "step_00000010", "step_00000012.corrupt", "step_00000020", "step_00000030"
    ]  # fmt: skip
    ckpt.remove_step_dir(os.path.join(d, "step_00000010"))  # (a prune's removal: COMPLETE.json first)
    assert not os.path.exists(os.path.join(d, "step_00000010"))
    assert ckpt.find_latest(d).endswith("step_00000020")


def _save_with_latest_failing_on_rank_0(rank, world, d):
    """Rank 0 writes COMPLETE.json, then fails to write `latest`; rank 1's file system does not show COMPLETE.json
    yet (a stale lookup on a network file system)."""
    import dilocox.checkpoint.save as save

    if rank == 0:
        real = save._atomic_write_text

        def fail_latest(path, text):
            if os.path.basename(path) == "latest":
                raise OSError("no latest here")
            return real(path, text)

        save._atomic_write_text = fail_latest
    else:
        real_exists = os.path.exists
        os.path.exists = lambda p: False if str(p).endswith("COMPLETE.json") else real_exists(p)
    try:
        ckpt.save_checkpoint(d, 3, rank, world, {f"w{rank}": torch.ones(2)}, agree=ckpt.all_ranks_agree)
    except ckpt.CheckpointError as e:
        return str(e)
    return "saved"


def test_ranks_agree_on_keeping_a_checkpoint_whose_latest_failed(tmp_path):
    """Found by a review: after a failed save, whether the step dir was complete (only `latest` failed: keep it) was
    each rank's own look at COMPLETE.json, and a rank that did not see it yet went into two more agreements that
    rank 0 never entered (a wait for the group's timeout). Rank 0's view now decides, on every rank alike."""
    from tests.spawn import run_ranks

    out = run_ranks(2, _save_with_latest_failing_on_rank_0, str(tmp_path), timeout=120)
    assert all("step_00000003" in m and "saved" != m for m in out), out
    assert os.path.exists(tmp_path / "step_00000003" / "COMPLETE.json")  # (kept: a valid checkpoint)
