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
    cfg.checkpoint.every = 2
    _fake(ck.checkpoint_dir(cfg, out), 4, 1, 0)  # (step 4 complete now: both stages)
    said = ck.describe_newest(cfg, out, 2, "my.yaml")  # (a stopped job's line: the resume names the config given)
    assert (
        f"step_00000004 (step 4, every stage); resume from it with `dilocox swarm my.yaml --out {out} --resume`" in said
    ), said
    cfg.checkpoint.every = 0
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
    writers = ["s0p0", "s1p0"] if sync == "swarm" else ["s0p0", "s0p1", "s1p0", "s1p1"]
    whole = launch(cfg, str(tmp_path / "whole"), peers_per_stage=[2, 2], steps=6, timeout_s=240)
    _check(whole)
    out = str(tmp_path / "split")
    first = launch(cfg, out, peers_per_stage=[2, 2], steps=3, timeout_s=240)
    _check(first)
    ckpt = os.path.join(out, "checkpoints")
    # step 2 (every=2) and step 3 (the end); swarm: one file per stage, written by its lowest live peer
    assert sorted(os.listdir(ckpt)) == ["step_00000002", "step_00000003"]
    for d in os.listdir(ckpt):
        step_dir = os.path.join(ckpt, d)  # one DCP directory per writer, its .json record beside it
        assert sorted(f for f in os.listdir(step_dir) if os.path.isdir(os.path.join(step_dir, f))) == writers
        assert sorted(f[:-5] for f in os.listdir(step_dir) if f.endswith(".json")) == writers
    with pytest.raises(SwarmError, match="--resume"):  # a fresh run into it is refused, nothing started
        launch(cfg, out, peers_per_stage=[2, 2], steps=6, timeout_s=60)
    if sync == "swarm":  # a flipped byte in stage 1's file of step 3: every stage goes back to step 2 together
        with open(os.path.join(ckpt, "step_00000003", "s1p0", "__0_0.distcp"), "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 1]))
    again = launch(cfg, out, peers_per_stage=[2, 2], steps=6, timeout_s=240, resume=True)
    _check(again)
    if sync == "swarm":
        with open(os.path.join(out, "s1p1.log")) as f:
            log = f.read()
        assert re.search(r"resumed from \S+/step_00000002/s1p0 at step 2\b", log)
        assert re.search(r"step_00000003/s1p0/__0_0\.distcp is corrupt .*s1p0\.json", log), log[-3000:]
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


# ---------------------------------------------------------------------------------------------- the DCP format


def _peer(cfg, stage, seed, out):
    """A SWARM peer's state as ``Peer`` holds it (``swarm.sync=diloco``): stage ``stage`` of 2, its AdamW and its
    DiLoCo outer loop on its own (no group), without a server."""
    import dataclasses

    from dilocox.model.transformer import build_stage_model
    from dilocox.optim import build_inner_optimizer
    from dilocox.outer import build_outer

    model = build_stage_model(cfg.model, stage, 2, seed=seed)
    opt = build_inner_optimizer(cfg, model, torch.device("cpu"))
    outer = build_outer(
        list(model.named_parameters()), None, dataclasses.replace(cfg.outer, method="diloco"), cfg.compress,
        seed=0, layer_of=model.param_layer_id, n_layers_total=cfg.model.n_layers, group=None,
    )  # fmt: skip
    s = types.SimpleNamespace(sync="diloco")
    return types.SimpleNamespace(
        s=s, group=None, cfg=cfg, out_dir=out, stage=stage, index=0, n=2, model=model, opt=opt, outer=outer,
        name=f"s{stage}p0",
    )  # fmt: skip


def _train(peer, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for k in range(steps):
        for p in peer.model.parameters():
            p.grad = torch.randn(p.shape, generator=g) * 0.01
        peer.opt.step()
        peer.outer.after_inner_step(k)


def test_a_peer_saves_one_dcp_checkpoint_by_global_names_and_loads_it_back_exactly(tmp_path):
    import torch.distributed.checkpoint as dcp

    cfg = _cfg("--swarm.sync=diloco", "--outer.sync_every=2", "--outer.overlap=delayed", "--model.n_layers=4")
    out = str(tmp_path)
    a = _peer(cfg, 1, seed=0, out=out)
    _train(a, 3, seed=1)  # an outer step at the end of step 1, in flight past step 2 (delayed overlap)
    where = ck.save(a, 3)
    assert where == os.path.join(out, "checkpoints", "step_00000003", "s1p0")
    keys = set(dcp.FileSystemReader(where).read_metadata().state_dict_metadata)
    # stage 1 of 2 of a 4-layer model holds layers 2 and 3, named as in the whole model
    w = "attn.q_proj.weight"
    assert f"replica0/model/layers.2.{w}" in keys and f"replica0/model/layers.0.{w}" not in keys
    assert {f"replica0/optim/layers.3.{w}/exp_avg", f"replica0/outer/theta/layers.3.{w}"} <= keys
    assert any(k.startswith("replica0/outer/pending/") for k in keys), "the in-flight outer result is not kept"
    assert "rank0/rest" in keys
    with open(os.path.join(os.path.dirname(where), "s1p0.json")) as f:
        rec = json.load(f)
    assert rec["dir"] == "s1p0" and {os.path.basename(n) for n in rec["files"]} == {".metadata", "__0_0.distcp"}

    b = _peer(cfg, 1, seed=5, out=out)  # other initial weights: everything must come from the file
    assert ck.load(b, where) == 3
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), n
    sa, sb = a.opt.state_dict(), b.opt.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i in sa["state"]:
        for k, v in sa["state"][i].items():
            assert torch.equal(v, sb["state"][i][k]), (i, k)
    oa, ob = a.outer.state_dict(), b.outer.state_dict()
    assert torch.equal(oa["state"]["theta"], ob["state"]["theta"])
    assert torch.equal(oa["state"]["momentum"], ob["state"]["momentum"])
    # the same steps after the load: the same bytes (the pending outer result is applied in step 3's sync)
    _train(a, 2, seed=9)
    _train(b, 2, seed=9)
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), n

    # the peer's stage must match: stage 0 refuses stage 1's file
    with pytest.raises(SwarmError, match="holds parameters"):
        ck.load(_peer(cfg, 0, seed=0, out=out), where)
    # a flipped byte in the data file: named by the verification, with its record
    data = os.path.join(where, "__0_0.distcp")
    with open(data, "r+b") as f:
        f.seek(64)
        byte = f.read(1)
        f.seek(64)
        f.write(bytes([byte[0] ^ 1]))
    assert re.search(r"__0_0\.distcp is corrupt .*s1p0\.json", ck._verify(os.path.dirname(where), rec))


def test_an_earlier_format_peer_file_still_resumes(tmp_path):
    cfg = _cfg("--swarm.sync=diloco", "--outer.sync_every=2", "--model.n_layers=4")
    a = _peer(cfg, 0, seed=0, out=str(tmp_path))
    _train(a, 2, seed=1)
    from dilocox.checkpoint.state import rng_state

    old = {  # what swarm/checkpoint.py VERSION 1 wrote with torch.save
        "version": 1, "step": 2, "stage": 0, "index": 0, "sync": "diloco",
        "params": {n: p.detach() for n, p in a.model.named_parameters()}, "opt": a.opt.state_dict(),
        "outer": a.outer.state_dict(), "rng": rng_state(),
    }  # fmt: skip
    path = os.path.join(str(tmp_path), "s0p0.pt")
    torch.save(old, path)
    b = _peer(cfg, 0, seed=3, out=str(tmp_path))
    assert ck.load(b, path) == 2
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), n
    assert torch.equal(a.outer.state_dict()["state"]["theta"], b.outer.state_dict()["state"]["theta"])


@pytest.mark.slow
def test_a_resume_onto_another_stage_count_takes_each_layer_by_name(tmp_path):
    # a [1, 1] job of a 4-layer model saves at step 2 and 3; resumed as [1, 1, 1, 1] (one layer per stage instead of
    # two), every layer's parameters and AdamW state come from whichever saved stage held them: the run goes on as
    # the uninterrupted [1, 1] one (equal up to the order in which the stages' gradient norms are summed)
    cfg = _cfg("--model.n_layers=4", "--optim.grad_clip=0")
    whole = launch(cfg, str(tmp_path / "whole"), peers_per_stage=[1, 1], steps=6, timeout_s=240)
    _check(whole)
    out = str(tmp_path / "split")
    _check(launch(cfg, out, peers_per_stage=[1, 1], steps=3, timeout_s=240))
    again = launch(cfg, out, peers_per_stage=[1, 1, 1, 1], steps=6, timeout_s=240, resume=True)
    _check(again)
    new = ["s0p0", "s1p0", "s2p0", "s3p0"]
    for name in new:
        with open(os.path.join(out, f"{name}.log")) as f:
            assert re.search(r"resume from a checkpoint of 2 stages onto 4: its layers are taken by name", f.read())
    a = {**_params(whole, "s0p0"), **_params(whole, "s1p0")}
    b = {k: v for name in new for k, v in _params(again, name).items()}
    assert a.keys() == b.keys()
    for n in a:
        assert torch.allclose(a[n], b[n], rtol=0, atol=1e-6), f"{n} differs by {(a[n] - b[n]).abs().max()}"
    assert [r["step"] for r in again.records["s0p0"]] == list(range(6))
    losses = lambda res: [r["loss"] for r in res.records["s0p0"]]  # noqa: E731
    assert losses(again)[:3] == losses(whole)[:3]
    assert losses(again)[3:] == pytest.approx(losses(whole)[3:], abs=1e-5)
    # the new stage count's checkpoints are complete on their own (step 4 and 6, 4 stages each)
    assert [s for s, _ in ck.complete_steps(os.path.join(out, "checkpoints"), 4)] == [4, 6]
