"""Checkpoint edges found by the second review (in-process, one rank, the tiny model)."""

from __future__ import annotations

import json
import os

import pytest

from dilocox import checkpoint as ckpt
from dilocox.checkpoint import CheckpointError
from dilocox.checkpoint.full import final_model
from tests.small_run import small_cfg
from tests.test_checkpoint_edges import _save
from tests.test_resume_edges import _run


def _lr_of(step_dir) -> float:
    with open(os.path.join(step_dir, "COMPLETE.json")) as f:
        return json.load(f)["config"]["optim"]["lr"]


def test_the_final_checkpoint_exports_with_checkpoint_dir_outside_the_run_dir(tmp_path):
    """The final save of an outer-method run is θ; ``final_model`` told it from a mid-run one by the run dir's
    config.yaml two levels above the step dir, so with ``checkpoint.dir`` elsewhere (or after a resume that raised
    train.steps) export refused the final model as "a mid-run checkpoint". It reads the save's own config now."""
    ck = tmp_path / "ck"
    args = ("--outer.method=diloco", "--outer.sync_every=2", f"--checkpoint.dir={ck}", "--checkpoint.every=2")
    t = _run(small_cfg(tmp_path / "run", *args, "--checkpoint.keep=0", steps=3))
    assert final_model(str(ck / "step_00000003"), t.cfg.model)  # the final save (params := θ)
    with pytest.raises(CheckpointError, match="mid-run checkpoint"):
        final_model(str(ck / "step_00000002"), t.cfg.model)  # a checkpoint.every save: replica-local params


def test_a_latest_edited_back_by_hand_sets_the_later_checkpoints_aside(tmp_path):
    """``latest`` pointed back at an earlier step by hand (as Megatron's tracker file is edited to rewind): the resume
    loaded it, but the later checkpoints stayed complete, so every save of the rewound run at their steps was
    skipped, the final one included: its training was never saved and ``latest`` kept naming the early step (a rerun
    trained the same steps again). They are set aside as ``.superseded``, as for checkpoint.resume=<step dir>."""
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    _run(small_cfg(run, "--checkpoint.every=2", "--checkpoint.keep=0", steps=4))
    (ck / "latest").write_text("step_00000002\n")
    cfg = small_cfg(run, "--checkpoint.every=2", "--checkpoint.keep=0", "--optim.lr=1e-4", steps=4)
    cfg.checkpoint.resume = "auto"
    t = _run(cfg)
    assert t.resumed_from == str(ck / "step_00000002")
    assert (ck / "latest").read_text().strip() == "step_00000004"
    assert _lr_of(ck / "step_00000004") == 1e-4  # the rewound run's own final checkpoint
    assert _lr_of(ck / "step_00000004.superseded") != 1e-4


def test_an_unreadable_complete_json_is_one_line_naming_it(tmp_path):
    """COMPLETE.json that cannot be opened (another user's file on a shared file system; here: a directory of that
    name) raised a bare OSError from ``read_meta`` (a traceback at resume); now a CheckpointError naming the file."""
    d = str(tmp_path)
    step_dir = _save(d, 2)
    os.remove(os.path.join(step_dir, "COMPLETE.json"))
    os.mkdir(os.path.join(step_dir, "COMPLETE.json"))
    with pytest.raises(CheckpointError, match="COMPLETE.json cannot be read"):
        ckpt.read_meta(step_dir)


def test_a_rewind_to_a_checkpoint_whose_recorded_step_is_not_a_number(tmp_path):
    """``set_aside_later`` (every resume) did ``int(meta["step"])``: a hand-edited COMPLETE.json with ``"step": "two"``
    ended the resume with a ValueError traceback after the state had loaded; the directory's name gives the step."""
    d = str(tmp_path)
    step_dir = [_save(d, s) for s in (2, 4)][0]
    path = os.path.join(step_dir, "COMPLETE.json")
    with open(path) as f:
        meta = json.load(f)
    with open(path, "w") as f:
        json.dump({**meta, "step": "two"}, f)
    moved = ckpt.set_aside_later(d, step_dir, warn=lambda m: None)
    assert [os.path.basename(m) for m in moved] == ["step_00000004.superseded"]


def test_a_save_that_ended_between_complete_json_and_latest_is_resumed_from(tmp_path):
    """A crash after a save's COMPLETE.json and before its ``latest``: ``latest`` names the save before, written
    before the newer checkpoint completed. That checkpoint is whole, so the resume takes it (setting it aside as a
    rewind would retrain its steps); a ``latest`` written after it (edited back by hand, above) is a rewind."""
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    _run(small_cfg(run, "--checkpoint.every=2", "--checkpoint.keep=0", steps=4))
    (ck / "latest").write_text("step_00000002\n")
    done = os.stat(ck / "step_00000004" / "COMPLETE.json").st_mtime_ns
    os.utime(ck / "latest", ns=(done - 10**9, done - 10**9))  # as step 2's save left it
    assert ckpt.find_latest(str(ck)) == str(ck / "step_00000004")
    cfg = small_cfg(run, "--checkpoint.every=2", "--checkpoint.keep=0", steps=6)
    cfg.checkpoint.resume = "auto"
    t = _run(cfg)
    assert t.resumed_from == str(ck / "step_00000004") and not list(ck.glob("*.superseded"))
    assert (ck / "latest").read_text().strip() == "step_00000006"


def test_a_kill_while_pruning_leaves_no_half_deleted_checkpoint_marked_complete(tmp_path, monkeypatch):
    """Pruning removed an old checkpoint with one ``rmtree``, its COMPLETE.json possibly last: a kill inside it left a
    directory with missing shard files still marked complete. The mark goes first now."""
    import torch

    from dilocox.checkpoint import names, save

    d = str(tmp_path)
    _save(d, 2)
    monkeypatch.setattr(save.shutil, "rmtree", lambda *a, **k: None)  # killed before it removed anything
    data, tensors = names.encode({"step": 4}, "rank0/rest")
    state = {"replica0/model/w": torch.full((4,), 4.0), "rank0/rest": data, **tensors}
    ckpt.save_checkpoint(d, 4, 0, 1, state, meta={"step": 4}, keep=1, part=("replica0", None, 1))
    assert [os.path.basename(p) for p in ckpt.complete_steps(d)] == ["step_00000004"]


def test_compile_attention_backend_and_init_std_may_change_on_resume():
    """A resume with ``--train.compile=true`` (to speed a run up), another attention backend or another ``init_std``
    (read at a fresh start only) was refused as a change of what a step computes; each is how the same step runs, as
    ``train.device`` (allowed) is. A change of the function itself is still refused."""
    from dilocox import rundir
    from dilocox.config import load_config

    base = load_config(None, []).to_dict()
    new = load_config(None, ["--train.compile=true", "--model.init_std=0.01", "--model.attn_backend=te"]).to_dict()
    math_, sched = rundir.config_changes(base, new)
    assert math_ == [] and sorted(k for k, _, _ in sched) == ["model.attn_backend", "model.init_std", "train.compile"]
    math_, _ = rundir.config_changes(base, load_config(None, ["--model.dropout=0.1"]).to_dict())
    assert [k for k, _, _ in math_] == ["model.dropout"]
