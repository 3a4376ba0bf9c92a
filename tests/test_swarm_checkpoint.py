"""SWARM checkpoints and resume (issue 22 item 4; dilocox/swarm/checkpoint.py).

The layout rules (complete steps, pruning, the pick with damaged files, records past the resume step) on files
made here; then real jobs: a [2,2] job stopped after 3 steps and resumed to 6 ends with the same bytes as one run of
6 steps (fixed routing, one microbatch in flight: each stage-1 peer adds its microbatches in one order), and a
[1,1] DiLoCo-SWARM job (delayed overlap, a checkpoint mid-phase) whose stage-1 peer is killed stops naming the
newest checkpoint, and resumes from it to the same bytes as an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import re
import types

import pytest
import torch

from dilocox.config import Config, load_config
from dilocox.swarm import checkpoint as ck
from dilocox.swarm.common import SwarmError
from dilocox.swarm.runtime import launch
from tests.test_swarm_runtime import TINY as SWARM_TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [  # the SWARM runtime tests' tiny model; one order of microbatches per stage-1 peer; checkpoints every 2 steps
    *SWARM_TINY,
    "--swarm.max_inflight=1",
    "--swarm.routing=fixed",
    "--train.steps=6",
    "--checkpoint.every=2",
]


def _cfg(*extra: str):
    return load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [*TINY, *extra])


# ---------------------------------------------------------------------------------------------- layout rules


def _fake(ckpt: str, step: int, stage: int, index: int, payload: bytes = b"x" * 10, n_stages: int = 2) -> str:
    d = os.path.join(ckpt, f"step_{step:08d}")
    os.makedirs(d, exist_ok=True)
    stem = ck.file_stem(stage, index)
    with open(os.path.join(d, stem + ".pt"), "wb") as f:
        f.write(payload)
    import hashlib

    rec = {"file": stem + ".pt", "bytes": len(payload), "hash": "sha256", "sha256": hashlib.sha256(payload).hexdigest()}
    rec.update(step=step, stage=stage, index=index, n_stages=n_stages)
    with open(os.path.join(d, stem + ".json"), "w") as f:
        json.dump(rec, f)
    return d


def test_complete_steps_prune_and_pick(tmp_path):
    ckpt = str(tmp_path)
    for s in (2, 4, 6):
        _fake(ckpt, s, 0, 0)
        _fake(ckpt, s, 1, 1)
    _fake(ckpt, 8, 0, 0)  # stage 1 never wrote step 8: not complete
    assert [s for s, _ in ck.complete_steps(ckpt, 2)] == [2, 4, 6]
    assert ck.newest_complete(ckpt, 3) is None  # a third stage has no file anywhere
    # pick: the newest complete step; its own file, else the stage's lowest index
    assert ck.pick(ckpt, 2, 1, 1) == (6, os.path.join(ckpt, "step_00000006", "s1p1.pt"))
    _fake(ckpt, 6, 1, 0)
    assert ck.pick(ckpt, 2, 1, 3)[1].endswith("step_00000006/s1p0.pt")
    # a damaged file is skipped: s1p0's flipped byte -> s1p1's file of the same step
    with open(os.path.join(ckpt, "step_00000006", "s1p0.pt"), "r+b") as f:
        f.write(b"y")
    assert ck.pick(ckpt, 2, 1, 0)[1].endswith("step_00000006/s1p1.pt")
    # every file of a stage at the newest step damaged -> the previous complete step
    with open(os.path.join(ckpt, "step_00000006", "s1p1.pt"), "ab") as f:
        f.write(b"more")
    assert ck.pick(ckpt, 2, 1, 1) == (4, os.path.join(ckpt, "step_00000004", "s1p1.pt"))
    # prune to keep=2 complete: step 2 goes, 4 and 6 (complete) and 8 (newer, partial) stay
    ck.prune(ckpt, 2, keep=2)
    assert sorted(os.listdir(ckpt)) == ["step_00000004", "step_00000006", "step_00000008"]
    ck.prune(ckpt, 2, keep=0)  # keep=0: keep everything
    assert len(os.listdir(ckpt)) == 3
    with pytest.raises(SwarmError, match="no complete SWARM checkpoint"):
        ck.pick(str(tmp_path / "none"), 2, 0, 0)


def test_fresh_run_refuses_an_earlier_runs_checkpoints_and_records_past_the_resume_move_aside(tmp_path):
    cfg = Config()
    cfg.checkpoint.every = 2
    out = str(tmp_path)
    ck.refuse_stale(cfg, out)  # nothing there yet
    _fake(ck.checkpoint_dir(cfg, out), 4, 0, 0)
    with pytest.raises(SwarmError, match=r"already holds SWARM checkpoints .*--resume"):
        ck.refuse_stale(cfg, out)
    cfg.checkpoint.every = 0  # (a later --resume would go back to them, past this run's records)
    with pytest.raises(SwarmError, match=r"already holds SWARM checkpoints"):
        ck.refuse_stale(cfg, out)
    assert "checkpoint.every=0" in ck.describe_newest(cfg, out, 2)
    with open(os.path.join(out, "s0p0.jsonl"), "w") as f:
        f.writelines(json.dumps({"step": k, "loss": 1.0 / (k + 1)}) + "\n" for k in range(6))
    assert ck.discard_records(out, "s0p0", 4) == 2
    with open(os.path.join(out, "s0p0.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [0, 1, 2, 3]
    with open(os.path.join(out, "s0p0.discarded.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [4, 5]


def test_resume_refuses_another_stage_count_and_a_computation_change(tmp_path):
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), TINY)
    d = _fake(str(tmp_path), 4, 0, 0)
    rec_path = os.path.join(d, "s0p0.json")
    with open(rec_path) as f:
        rec = json.load(f)
    rec["config"] = cfg.to_dict()
    with open(rec_path, "w") as f:
        json.dump(rec, f)

    def peer(c, pps):
        return types.SimpleNamespace(cfg=c, n=len(pps), pps=pps, name="s0p0")

    ck.check_config(peer(cfg, [2, 2]), os.path.join(d, "s0p0.pt"))  # the same config
    moved = _cfg("--swarm.peers_per_stage=[3,1]", "--swarm.routing=iwrr")  # peers and routing may change
    ck.check_config(peer(moved, [3, 1]), os.path.join(d, "s0p0.pt"))
    with pytest.raises(SwarmError, match=r"a job of 2 stages, this one has 3"):
        ck.check_config(peer(_cfg("--swarm.peers_per_stage=[1,1,1]"), [1, 1, 1]), os.path.join(d, "s0p0.pt"))
    with pytest.raises(SwarmError, match=r"change the computation: optim.weight_decay"):
        ck.check_config(peer(_cfg("--optim.weight_decay=0.5"), [2, 2]), os.path.join(d, "s0p0.pt"))


def test_writer_is_the_lowest_live_index_with_sync_swarm_and_every_peer_with_diloco():
    def peer(sync, index, contributors):
        group = None if contributors is None else types.SimpleNamespace(contributors=contributors)
        return types.SimpleNamespace(s=types.SimpleNamespace(sync=sync), group=group, index=index)

    assert ck.writes(peer("swarm", 0, None))  # a one-peer stage
    assert ck.writes(peer("swarm", 1, [1, 2])) and not ck.writes(peer("swarm", 2, [1, 2]))  # p0 is dead
    assert not ck.writes(peer("swarm", 3, [0, 1]))  # a joiner healed in that sync (not a contributor)
    assert ck.writes(peer("diloco", 2, [0, 1, 2]))


# ---------------------------------------------------------------------------------------------- real jobs


def _params(res, name):
    return res.peers[name]["params"]


def _assert_same_params(a, b, names):
    for name in names:
        pa, pb = _params(a, name), _params(b, name)
        assert pa.keys() == pb.keys()
        for n in pa:
            assert torch.equal(pa[n], pb[n]), f"{name} {n} differs after the resume"


def _check(res):
    for name, rc in res.returncodes.items():
        assert rc == 0, f"{name} exited {rc}:\n{res.log_tail(name)}"


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["swarm", "diloco"])
def test_stop_and_resume_equals_one_run(tmp_path, sync):
    # diloco: H=2 with delayed overlap; each peer writes its own file (own AdamW state, own θ between outer steps)
    cfg = _cfg(f"--swarm.sync={sync}", "--outer.sync_every=2", "--outer.overlap=delayed")
    writers = ["s0p0.pt", "s1p0.pt"] if sync == "swarm" else ["s0p0.pt", "s0p1.pt", "s1p0.pt", "s1p1.pt"]
    whole = launch(cfg, str(tmp_path / "whole"), peers_per_stage=[2, 2], steps=6, timeout_s=240)
    _check(whole)
    out = str(tmp_path / "split")
    first = launch(cfg, out, peers_per_stage=[2, 2], steps=3, timeout_s=240)
    _check(first)
    ckpt = os.path.join(out, "checkpoints")
    # step 2 (every=2) and step 3 (the end); swarm: one file per stage, written by its lowest live peer
    assert sorted(os.listdir(ckpt)) == ["step_00000002", "step_00000003"]
    for d in os.listdir(ckpt):
        assert sorted(f for f in os.listdir(os.path.join(ckpt, d)) if f.endswith(".pt")) == writers
    with pytest.raises(SwarmError, match="--resume"):  # a fresh run into it is refused, nothing started
        launch(cfg, out, peers_per_stage=[2, 2], steps=6, timeout_s=60)
    if sync == "swarm":  # a flipped byte in stage 1's file of step 3: every stage goes back to step 2 together
        with open(os.path.join(ckpt, "step_00000003", "s1p0.pt"), "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 1]))
    again = launch(cfg, out, peers_per_stage=[2, 2], steps=6, timeout_s=240, resume=True)
    _check(again)
    if sync == "swarm":
        with open(os.path.join(out, "s1p1.log")) as f:
            assert re.search(r"resumed from \S+/step_00000002/s1p0\.pt at step 2\b", f.read())
        assert [d for d in os.listdir(ckpt) if d.startswith("step_00000003.stale-")], os.listdir(ckpt)
    _assert_same_params(whole, again, ["s0p0", "s0p1", "s1p0", "s1p1"])
    for name in ("s0p0", "s0p1"):  # the records: each step once, the resumed steps' losses those of one run
        recs = again.records[name]
        assert [r["step"] for r in recs] == list(range(6))
        assert [r["loss"] for r in recs] == [r["loss"] for r in whole.records[name]]
    with pytest.raises(SwarmError, match="at or past --steps 6: this run is finished"):  # refused before any start
        launch(cfg, out, peers_per_stage=[2, 2], steps=6, timeout_s=60, resume=True)
    # keep=2 complete steps: 2 and 3 are older than 4 and 6 (a moved-aside directory stays)
    assert sorted(d for d in os.listdir(ckpt) if ".stale-" not in d) == ["step_00000004", "step_00000006"]


@pytest.mark.fault
@pytest.mark.slow
def test_diloco_stage_losing_its_last_peer_names_the_checkpoint_and_resumes_bit_exactly(tmp_path):
    # delayed overlap, H=3: the outer all-reduce launched at the end of step 2 is applied at the end of step 5, so
    # the checkpoint of step 4 holds it in flight (kept pending) in the middle of a phase
    cfg = _cfg("--swarm.sync=diloco", "--outer.sync_every=3", "--outer.overlap=delayed")
    whole = launch(cfg, str(tmp_path / "whole"), peers_per_stage=[1, 1], steps=6, timeout_s=240)
    _check(whole)
    out = str(tmp_path / "killed")
    # s1p0 kills itself (-9) mid-step 4, after serving: stage 1 has no peer left, s0p0 stops at step 5's first send
    cut = launch(cfg, out, peers_per_stage=[1, 1], steps=6, timeout_s=240, peer_args={"s1p0": ["--die-mid-step", "4"]})
    assert cut.returncodes["s1p0"] not in (0, None) and cut.returncodes["s0p0"] == 3, cut.returncodes
    newest = os.path.join(out, "checkpoints", "step_00000004")
    assert f"the newest complete checkpoint is {newest} (step 4" in cut.log_tail("s0p0"), cut.log_tail("s0p0")
    again = launch(cfg, out, peers_per_stage=[1, 1], steps=6, timeout_s=240, resume=True)
    _check(again)
    _assert_same_params(whole, again, ["s0p0", "s1p0"])
    assert [r["step"] for r in again.records["s0p0"]] == list(range(6))
    with open(os.path.join(out, "s0p0.discarded.jsonl")) as f:  # step 4's record of the killed run
        assert [json.loads(line)["step"] for line in f] == [4]
