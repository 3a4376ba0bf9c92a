"""Resume at the edges of a run: a rewind to an earlier checkpoint, more steps after a finished streaming run, and a
stop asked for during the last step (in-process Trainers on the tiny model)."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from dilocox import checkpoint as ckpt
from dilocox.checkpoint.full import final_model
from dilocox.train import Trainer
from tests.small_run import small_cfg


def _run(cfg, before_step=None) -> Trainer:
    t = Trainer(cfg)
    if before_step is not None:
        step = t.train_step

        def hooked():
            before_step(t)
            return step()

        t.train_step = hooked
    try:
        t.run()
    finally:
        if t.run_lock:
            t.run_lock.release()
        t.logger.close()
    return t


def test_a_rewind_sets_the_later_checkpoints_aside_and_saves_its_own(tmp_path):
    """checkpoint.resume=<an earlier step dir> in the same run dir (the divergence message's advice: rewind with a
    lower optim.lr): the later checkpoints become <step dir>.superseded, so the rewound run's saves at those steps
    are written (a save at a complete step is skipped) and latest names them."""
    run = tmp_path / "run"
    ck = run / "checkpoints"
    _run(small_cfg(run, "--checkpoint.every=2", "--checkpoint.keep=0", steps=6))
    old = final_model(str(ck / "step_00000006"))
    _run(
        small_cfg(
            run, "--checkpoint.every=2", "--checkpoint.keep=0", "--optim.lr=1e-4",
            f"--checkpoint.resume={ck / 'step_00000002'}", steps=6,
        )
    )  # fmt: skip
    names = sorted(os.listdir(ck))
    assert "step_00000004.superseded" in names and "step_00000006.superseded" in names, names
    assert ckpt.find_latest(str(ck)) == str(ck / "step_00000006")
    new = final_model(str(ck / "step_00000006"))
    assert any(not torch.equal(old[k], new[k]) for k in old)  # the rewound run's own weights
    assert torch.equal(
        next(iter(final_model(str(ck / "step_00000006.superseded")).values())), next(iter(old.values()))
    )  # nothing of the first run lost
    events = [json.loads(x) for x in open(run / "metrics.jsonl")]
    saved = [e["path"] for e in events if e.get("event") == "checkpoint"]
    assert saved[-2:] == [str(ck / "step_00000002"), str(ck / "step_00000004")]  # (the final save logs no event)


def test_more_steps_after_a_finished_streaming_run_with_a_fragment_in_flight(tmp_path, capsys):
    """A streaming run (2 fragments, tau 1, overlap none) ends with a fragment's sync in flight: finish() applies it.
    Resumed with a larger train.steps, the run reaches that fragment's sync point with nothing pending: it goes on
    (it died on `_wait(None)`), and the replica's params after the extension are finite and moved. The resume says
    that it goes on from θ (found by review: a user took it for an exact continuation of a longer run); a resume from
    a mid-run checkpoint, or of a run that went on after its finish, does not."""
    run = tmp_path / "run"
    method = (
        "--outer.method=diloco",
        "--outer.sync_every=4",
        "--outer.streaming.fragments=2",
        "--outer.streaming.tau=1",
    )
    keep = ("--checkpoint.every=3", "--checkpoint.keep=0", "--checkpoint.continuation=false")  # (from θ: below)
    _run(small_cfg(run, *method, *keep, steps=5))
    first = final_model(str(run / "checkpoints" / "step_00000005"))
    capsys.readouterr()
    t = _run(small_cfg(run, *method, *keep, "--checkpoint.resume=auto", steps=10))
    assert t.step == 10
    out = capsys.readouterr().out
    assert "continuing a finished run from step 5" in out and "outer params θ" in out, out
    last = final_model(str(run / "checkpoints" / "step_00000010"))
    assert all(torch.isfinite(v).all() for v in last.values())
    assert any(not torch.equal(first[k], last[k]) for k in first)
    ck = run / "checkpoints" / "step_00000003"  # a mid-run checkpoint: its params are the local ones, nothing to say
    _run(small_cfg(run, *method, *keep, f"--checkpoint.resume={ck}", steps=11))
    assert "continuing a finished run" not in capsys.readouterr().out


def test_a_stop_during_the_last_step_ends_the_run_as_finished(tmp_path):
    """SIGINT/SIGTERM while the last step runs: the run ends as a finished one (outer.finish, the final save), equal
    to an uninterrupted run, instead of a mid-run checkpoint at train.steps that a rerun takes as final."""
    method = ("--outer.method=diloco", "--outer.sync_every=4")
    _run(small_cfg(tmp_path / "full", *method, steps=6))

    def sigint_in_last(t):
        if t.step == 5:
            t.stop.signum = signal.SIGINT

    t = _run(small_cfg(tmp_path / "int", *method, steps=6), sigint_in_last)  # no signals.Interrupted
    assert t.step == 6
    full = final_model(str(tmp_path / "full" / "checkpoints" / "step_00000006"))
    got = final_model(str(tmp_path / "int" / "checkpoints" / "step_00000006"))
    assert all(torch.equal(full[k], got[k]) for k in full)


STREAMING = ("--outer.method=diloco", "--outer.sync_every=4", "--outer.streaming.fragments=2",
             "--outer.streaming.tau=1")  # fmt: skip
DELAYED = ("--outer.method=diloco", "--outer.sync_every=3", "--outer.overlap=delayed", "--compress.quant=int4")


@pytest.mark.parametrize("method", [STREAMING, DELAYED], ids=["streaming", "delayed-int4"])
def test_a_finished_run_resumed_with_more_steps_goes_on_as_one_longer_run(tmp_path, capsys, method):
    """The end of a DiLoCo-family run (outer.finish) sets every parameter to θ, so a finished run resumed with more
    train.steps went on from θ: not where one longer run would be (a review measured a loss of 5.24 against 3.77 at
    the first extended step). The state before the finish is saved beside the final checkpoint
    (checkpoint.continuation, <checkpoint dir>/continue/): 5 steps, then the same run to 10, now trains the losses of
    one 10-step run and ends on its final model, bit for bit (constant schedule: its length changes nothing else).
    The control, checkpoint.continuation=false, goes on from θ and differs."""
    args = (*method, "--optim.schedule=constant", "--checkpoint.every=0")
    full = _run(small_cfg(tmp_path / "full", *args, steps=10))
    for run, extra in (("ext", ()), ("theta", ("--checkpoint.continuation=false",))):
        _run(small_cfg(tmp_path / run, *args, *extra, steps=5))
        assert os.path.isdir(tmp_path / run / "checkpoints" / "continue" / "step_00000005") == (not extra)
    capsys.readouterr()
    ext = _run(small_cfg(tmp_path / "ext", *args, "--checkpoint.resume=auto", steps=10))
    out = capsys.readouterr().out
    assert f"continuing from {tmp_path / 'ext' / 'checkpoints' / 'continue' / 'step_00000005'}" in out, out
    assert "continuing a finished run from step 5" not in out  # (the note for a run that goes on from θ)
    assert [r["loss"] for r in ext.history] == [r["loss"] for r in full.history[5:]]
    want = final_model(str(tmp_path / "full" / "checkpoints" / "step_00000010"))
    got = final_model(str(tmp_path / "ext" / "checkpoints" / "step_00000010"))
    assert all(torch.equal(want[k], got[k]) for k in want)
    # the extension's own end replaced the continuation: the one at step 10 now, named by its final checkpoint
    assert ckpt.complete_steps(str(tmp_path / "ext" / "checkpoints" / "continue"))[-1:] == [
        str(tmp_path / "ext" / "checkpoints" / "continue" / "step_00000010")
    ] and not os.path.exists(tmp_path / "ext" / "checkpoints" / "continue" / "step_00000005")
    theta = _run(small_cfg(tmp_path / "theta", *args, "--checkpoint.continuation=false", "--checkpoint.resume=auto",
                           steps=10))  # fmt: skip
    assert "continuing a finished run from step 5" in capsys.readouterr().out
    assert [r["loss"] for r in theta.history] != [r["loss"] for r in full.history[5:]]
    # a rewind to step 5's final checkpoint: its continuation was replaced by step 10's; said, not taken silently
    five = tmp_path / "ext" / "checkpoints" / "step_00000005"
    _run(small_cfg(tmp_path / "ext", *args, f"--checkpoint.resume={five}", steps=7))
    out = capsys.readouterr().out
    assert f"warning: the continuation {five} was saved with is gone" in out, out


def test_an_extension_that_fails_at_its_end_leaves_the_earlier_continuation_to_resume_from(tmp_path, monkeypatch):
    """Found by a review: an extension's end removed the earlier end's continuation before its own final checkpoint
    was complete, so a kill (or a failed save) in that window left `latest` = the earlier final checkpoint with its
    continuation gone: the next resume went on from θ. Now the earlier continuation goes only once the final
    checkpoint is complete; the run resumed after the failure still trains the losses of one 10-step run."""
    from dilocox.train_state import TrainerState

    args = (*STREAMING, "--optim.schedule=constant", "--checkpoint.every=0")
    full = _run(small_cfg(tmp_path / "full", *args, steps=10))
    _run(small_cfg(tmp_path / "ext", *args, steps=5))
    save = TrainerState.save

    def failing_final(self, record=True):
        if not record:
            raise OSError("killed before the final checkpoint was complete")
        return save(self, record)

    monkeypatch.setattr(TrainerState, "save", failing_final)
    with pytest.raises(OSError, match="killed before"):
        _run(small_cfg(tmp_path / "ext", *args, "--checkpoint.resume=auto", steps=8))
    monkeypatch.setattr(TrainerState, "save", save)
    cont = tmp_path / "ext" / "checkpoints" / "continue"
    assert (cont / "step_00000005" / "COMPLETE.json").exists() and (cont / "step_00000008").exists()
    ext = _run(small_cfg(tmp_path / "ext", *args, "--checkpoint.resume=auto", steps=10))
    assert [r["loss"] for r in ext.history] == [r["loss"] for r in full.history[5:]]
    assert sorted(d for d in os.listdir(cont) if d.startswith("step_")) == ["step_00000010"]  # (the earlier: gone)


def test_a_continuation_without_room_for_it_and_the_final_checkpoint_is_skipped(tmp_path, capsys, monkeypatch):
    """Found by review: the continuation took the room the final checkpoint needed (start-up checks room for keep + 1
    checkpoints), so the final save failed after training. It is saved only with room for both; else one warning,
    and the run ends with its final checkpoint as before."""
    monkeypatch.setattr(ckpt, "disk_free", lambda path: 0)  # (the continuation's check only: saves use their own)
    preflight, seen = ckpt.preflight, []  # and the start-up check counts the continuation (a warning of its own)
    monkeypatch.setattr(ckpt, "preflight", lambda *a, **k: seen.append(k["continuation"]) or preflight(*a, **k))
    t = _run(small_cfg(tmp_path / "run", *STREAMING, steps=5))
    assert t.step == 5 and (tmp_path / "run" / "checkpoints" / "step_00000005" / "COMPLETE.json").exists()
    assert not (tmp_path / "run" / "checkpoints" / "continue").exists()
    assert "warning: no continuation saved (" in capsys.readouterr().out
    _run(small_cfg(tmp_path / "off", *STREAMING, "--checkpoint.continuation=false", steps=1))
    assert seen == [True, False]


def _continuation_runs(rank, world, tmp, extra):
    """On every rank: one 8-step run, and a 4-step run resumed to 8 (each replica's losses, and its final params)."""
    args = ("--parallel.replicas=2", "--parallel.data=2", "--parallel.microbatches=1", "--optim.schedule=constant",
            "--checkpoint.every=0", *extra)  # fmt: skip
    out = {}
    for name, plan in (("full", [(8, "none")]), ("ext", [(4, "none"), (8, "auto")])):
        for steps, resume in plan:
            tr = Trainer(small_cfg(f"{tmp}/{name}", *args, f"--checkpoint.resume={resume}", steps=steps))
            tr.run()
        out[name] = ([r["loss"] for r in tr.history], [p.detach().clone() for p in tr.model.parameters()])
    return out


@pytest.mark.slow  # 4 ranks, three short runs: ~15 s
def test_the_continuation_of_a_finished_run_is_exact_over_replicas_and_sharded_outer_state(tmp_path):
    """The same over 2 replicas x 2 data-parallel ranks (the outer state sharded over the DP ranks, eager's
    per-replica θ, the sparse codec's error buffers): each rank's losses after the resume are those of its
    uninterrupted run, and the final params equal."""
    from tests.spawn import run_ranks

    extra = ("--outer.method=diloco", "--outer.sync_every=3", "--outer.overlap=eager", "--compress.sparse.enabled=true",
             "--compress.sparse.density=0.25")  # fmt: skip
    for out in run_ranks(4, _continuation_runs, str(tmp_path), extra):
        assert out["ext"][0] == out["full"][0][4:]
        assert all(torch.equal(a, b) for a, b in zip(out["ext"][1], out["full"][1]))


def _resume_on_node_local_dirs(rank, world, tmp):
    """Both ranks train 2 steps into one directory; then each resumes from its own: rank 0's holds that checkpoint,
    rank 1's nothing (node-local disks)."""
    args = ("--parallel.data=2", "--parallel.microbatches=1", "--checkpoint.every=0")
    Trainer(small_cfg(f"{tmp}/shared", *args, steps=2)).run()
    mine = f"{tmp}/shared/checkpoints" if rank == 0 else f"{tmp}/node{rank}"
    try:
        Trainer(small_cfg(f"{tmp}/again", *args, f"--checkpoint.dir={mine}", "--checkpoint.resume=auto", steps=4))
    except ckpt.CheckpointError as e:
        return str(e)
    return "started"


def test_ranks_that_see_different_checkpoint_dirs_stop_with_one_error_not_a_hang(tmp_path):
    """Found by a review: whether to resume was decided per rank, so a rank that found a checkpoint went into the
    resume's collectives while one that found none went into a fresh start's, and they met in mismatched
    collectives (a gloo error on one side, the group timeout on the other). Now it is agreed first."""
    from tests.spawn import run_ranks

    for msg in run_ranks(2, _resume_on_node_local_dirs, str(tmp_path), timeout=240):
        assert "some ranks find a checkpoint there and others none" in msg, msg


def test_a_rewind_sets_a_final_checkpoints_continuation_aside_with_it(tmp_path, capsys):
    """A rewind renamed the later checkpoints to .superseded but left the final one's continuation at continue/step_N,
    where the rewound run's first save removed it (it keeps only the continuation it went on from): renaming the
    superseded checkpoint back then went on from θ. Now the continuation is set aside with it, the rewound run's
    saves leave it, and renaming both back resumes the first trajectory as one longer run would."""
    import shutil

    args = (*STREAMING, "--optim.schedule=constant", "--checkpoint.every=4", "--checkpoint.keep=0")
    full = _run(small_cfg(tmp_path / "full", *args, steps=14))
    run = tmp_path / "run"
    ck, cont = run / "checkpoints", run / "checkpoints" / "continue"
    _run(small_cfg(run, *args, steps=10))
    assert (cont / "step_00000010" / "COMPLETE.json").exists()
    _run(small_cfg(run, *args, "--optim.lr=1e-4", f"--checkpoint.resume={ck / 'step_00000004'}", steps=10))
    assert (cont / "step_00000010.superseded" / "COMPLETE.json").exists()  # set aside with its checkpoint, kept
    assert (cont / "step_00000010" / "COMPLETE.json").exists()  # (the rewound run's own)
    # undo the rewind: the rewound run's end aside, the first run's back
    for d in (ck / "step_00000008", ck / "step_00000010", cont / "step_00000010"):
        shutil.rmtree(d)
    for d in (ck / "step_00000008", ck / "step_00000010", cont / "step_00000010"):
        os.replace(f"{d}.superseded", d)
    (ck / "latest").write_text("step_00000010\n")
    capsys.readouterr()
    ext = _run(small_cfg(run, *args, "--checkpoint.resume=auto", steps=14))
    assert f"continuing from {cont / 'step_00000010'}" in capsys.readouterr().out
    assert [r["loss"] for r in ext.history] == [r["loss"] for r in full.history[10:]]


def test_a_second_rewind_finds_a_free_name_beside_its_checkpoint_and_under_continue(tmp_path):
    """(From a review: a set-aside continuation left under continue/ after its checkpoint's .superseded was deleted
    made the next rewind's rename fail: the name was checked beside the checkpoint only.)"""
    ck = tmp_path / "checkpoints"
    for d in (ck / "step_00000004", ck / "step_00000010", ck / "continue" / "step_00000010"):
        d.mkdir(parents=True)
        (d / "COMPLETE.json").write_text(json.dumps({"step": int(d.name[5:])}))
    (ck / "continue" / "step_00000010.superseded").mkdir()  # the first rewind's, its checkpoint's deleted
    (ck / "continue" / "step_00000010.superseded" / "x").write_text("kept")
    moved = ckpt.set_aside_later(str(ck), str(ck / "step_00000004"), warn=lambda m: None)
    assert len(moved) == 1 and os.path.basename(moved[0]).startswith("step_00000010.superseded.")
    assert (ck / "continue" / os.path.basename(moved[0]) / "COMPLETE.json").exists()
    assert (ck / "continue" / "step_00000010.superseded" / "x").read_text() == "kept"
