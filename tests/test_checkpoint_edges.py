"""Checkpoint edges found by a review: a hand-edited ``latest``, a damaged COMPLETE.json with fallback, and the export
of a run that ``train.max_tokens`` ended (in-process, one rank, the tiny model)."""

from __future__ import annotations

import os

import torch

from dilocox import checkpoint as ckpt
from dilocox.checkpoint import names
from dilocox.checkpoint.full import final_model
from tests.small_run import small_cfg
from tests.test_resume_edges import _run


def _save(d: str, step: int) -> str:
    data, tensors = names.encode({"step": step}, "rank0/rest")
    state = {"replica0/model/w": torch.full((4,), float(step)), "rank0/rest": data, **tensors}
    return ckpt.save_checkpoint(d, step, 0, 1, state, meta={"step": step}, keep=0, part=("replica0", None, 1))


def _latest_step(d: str) -> tuple[str, float]:
    path, sd = ckpt.load_latest(d, 0, 1, ckpt.WholeReader("replica0", 1), warn=lambda m: None)
    return os.path.basename(path), float(sd["replica0/model/w"][0])


def test_a_latest_that_names_no_step_directory_is_ignored(tmp_path):
    """``latest`` edited by hand to ``step_X/`` (shell completion) or to a set-aside ``step_X.superseded``: the resume
    used to die with AttributeError ('NoneType' object has no attribute 'group') from the step-number parse."""
    d = str(tmp_path)
    for s in (2, 4):
        _save(d, s)
    with open(os.path.join(d, "latest"), "w") as f:
        f.write("step_00000002/\n")
    assert _latest_step(d) == ("step_00000002", 2.0)  # (the trailing "/" alone: still that step)
    os.rename(os.path.join(d, "step_00000004"), os.path.join(d, "step_00000004.superseded"))
    with open(os.path.join(d, "latest"), "w") as f:
        f.write("step_00000004.superseded\n")
    assert ckpt.find_latest(d) == os.path.join(d, "step_00000002")
    assert _latest_step(d) == ("step_00000002", 2.0)


def test_a_rewind_given_with_a_trailing_slash_points_latest_at_it(tmp_path):
    d = str(tmp_path)
    for s in (2, 4):
        _save(d, s)
    ckpt.set_aside_later(d, os.path.join(d, "step_00000002") + "/", warn=lambda m: None)
    with open(os.path.join(d, "latest")) as f:
        assert f.read().strip() == "step_00000002"  # (it was "": the basename of ".../step_00000002/")


def test_a_damaged_complete_json_of_the_newest_checkpoint_falls_back(tmp_path):
    """checkpoint.fallback=true (the default): a COMPLETE.json that no longer parses is passed over like a damaged
    shard. It used to stop the resume, since the config check read it before load_latest could fall back."""
    run = tmp_path / "run"
    ck = run / "checkpoints"
    _run(small_cfg(run, "--checkpoint.every=2", "--checkpoint.keep=0", steps=4))
    with open(ck / "step_00000004" / "COMPLETE.json", "w") as f:
        f.write("{")
    t = _run(small_cfg(run, "--checkpoint.every=2", "--checkpoint.keep=0", "--checkpoint.resume=auto", steps=6))
    assert t.resumed_from == str(ck / "step_00000002") and t.step == 6
    assert (ck / "step_00000004.corrupt").is_dir() and ckpt.find_latest(str(ck)) == str(ck / "step_00000006")


def test_the_final_checkpoint_of_a_run_ended_by_max_tokens_exports(tmp_path):
    """A DiLoCo run that train.max_tokens stops before train.steps: its final checkpoint holds θ (outer.finish ran
    before the save), yet export refused it as a mid-run checkpoint (only train.steps marked a checkpoint final)."""
    run = tmp_path / "run"
    diloco = ["--outer.method=diloco", "--outer.sync_every=4", "--outer.streaming.fragments=1"]
    diloco += ["--outer.streaming.tau=0", "--compress.quant=none", "--checkpoint.every=4"]
    _run(small_cfg(run, *diloco, "--train.max_tokens=1", steps=100))  # (one step: 4 x 32 tokens)
    step_dir = ckpt.find_latest(str(run / "checkpoints"))
    assert step_dir.endswith("step_00000001")
    model = final_model(step_dir)
    assert model and all(torch.isfinite(v).all() for v in model.values())


def test_max_tokens_ending_on_a_checkpoint_step_saves_the_final_model_not_the_mid_run_one(tmp_path):
    """max_tokens ends the run at step 4, a checkpoint.every step: the boundary saved a mid-run checkpoint there
    (replica params, before outer.finish) and the final save was skipped as that step existed; export refused it."""
    run = tmp_path / "run"
    diloco = ["--outer.method=diloco", "--outer.sync_every=3", "--outer.streaming.fragments=1"]
    diloco += ["--outer.streaming.tau=0", "--compress.quant=none", "--checkpoint.every=4"]
    t = _run(small_cfg(run, *diloco, "--train.max_tokens=400", steps=100))  # (4 steps of 4 x 32 tokens: 512)
    step_dir = ckpt.find_latest(str(run / "checkpoints"))
    assert t.step == 4 and step_dir.endswith("step_00000004")
    model = final_model(step_dir)
    assert model and all(torch.isfinite(v).all() for v in model.values())


def test_a_conversion_killed_in_its_final_swap_is_completed_by_the_next_convert(tmp_path):
    """`dilocox checkpoint convert` moves the old step dir aside (.pre-dcp), then the converted one in (.dcp-tmp): a
    kill between the two left the step without a directory, and the next convert said there was nothing to convert
    (the resume went back to an older checkpoint, or to none)."""
    from dilocox.checkpoint.legacy import convert

    d = str(tmp_path)
    step = _save(d, 3)  # (stands in for the converted checkpoint, complete in its staging directory)
    os.rename(step, step + ".dcp-tmp")
    os.makedirs(step + ".pre-dcp")
    assert ckpt.find_latest(d) is None
    assert convert(d) == [step]
    assert ckpt.find_latest(d) == step and _latest_step(d) == ("step_00000003", 3.0)
    assert convert(d) == []  # (done: nothing left to convert)


def test_a_record_naming_a_file_outside_the_checkpoint_is_refused_not_hashed_forever(tmp_path):
    """COMPLETE.json is written by whoever can write the checkpoint directory (docs/SECURITY.md's threat model): an
    entry "/dev/zero" of 0 bytes passed the size check and every rank hashed the endless device, a resume hung."""
    import json
    import signal

    d = str(tmp_path)
    _save(d, 2)
    step = _save(d, 4)
    meta = ckpt.read_meta(step)
    meta["files"]["/dev/zero"] = {"bytes": 0, "sha256": "0" * 64}
    with open(os.path.join(step, "COMPLETE.json"), "w") as f:
        json.dump(meta, f)

    class Hung(BaseException):  # (not an Exception: the loader must not take it for a damaged file)
        pass

    def hung(*_):
        raise Hung("the resume hashed /dev/zero")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(15)
    try:
        assert _latest_step(d) == ("step_00000002", 2.0)  # (falls back, the record set aside as damaged)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert os.path.isdir(step + ".corrupt")


def test_a_checkpoint_path_that_is_missing_or_the_checkpoint_dir_is_named_so(tmp_path):
    """`dilocox export --checkpoint PATH` (and every read of COMPLETE.json): a mistyped path, or the checkpoints
    directory itself, was called "not a complete checkpoint: it was interrupted while saving"."""
    import pytest

    d = str(tmp_path)
    _save(d, 2)
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        ckpt.read_meta(os.path.join(d, "step_00000009"))
    with pytest.raises(ckpt.CheckpointError, match="a directory of checkpoints, not one checkpoint.*step_00000002"):
        ckpt.read_meta(d)
    os.makedirs(os.path.join(d, "step_00000004"))
    with pytest.raises(ckpt.CheckpointError, match="interrupted while saving"):
        ckpt.read_meta(os.path.join(d, "step_00000004"))


def test_a_rerun_past_max_tokens_names_the_limit_it_is_at(tmp_path, capsys):
    """A run train.max_tokens ended, rerun with a larger train.steps: nothing to train, and the message said "raise
    --train.steps", which trains nothing either (found by review). It names train.max_tokens; a run at both limits
    names both."""
    run = tmp_path / "run"
    _run(small_cfg(run, "--train.max_tokens=256", steps=6))  # (2 steps of 4 x 32 tokens)
    capsys.readouterr()
    t = _run(small_cfg(run, "--train.max_tokens=256", "--checkpoint.resume=auto", steps=20))
    out = capsys.readouterr().out
    assert t.step == 2 and "already finished" in out and "raise --train.max_tokens (now 256" in out, out
    assert "--train.steps" not in out.split("raise")[1].split(";")[0], out
    _run(small_cfg(run, "--train.max_tokens=256", "--checkpoint.resume=auto", steps=2))
    out = capsys.readouterr().out
    assert "raise --train.steps (now 2) and --train.max_tokens (now 256" in out, out
