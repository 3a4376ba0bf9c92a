"""Resume on another layout: a PP=2 x TP=2 checkpoint resumed on 1 rank and on PP=1 x TP=2 continues
the uninterrupted run's loss sequence (model and inner AdamW resharded by global names); so does a
DiLoCo-family checkpoint (outer θ, momentum, in-flight result and error feedback resharded too)."""

import os

import pytest
import torch
import yaml

from dilocox import checkpoint as ckpt
from dilocox.config import load_config
from tests.spawn import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

STEPS, STOP = 6, 3
LAYOUTS = {
    "pp2tp2": ["--parallel.pipeline=2", "--parallel.tensor=2"],
    "tp2": ["--parallel.tensor=2"],
    "one": [],
    "dp2": ["--parallel.data=2"],
    "pp2": ["--parallel.pipeline=2"],
}
WORLD = {"pp2tp2": 4, "tp2": 2, "one": 1, "dp2": 2, "pp2": 2}
# configs/methods/diloco.yaml with a short H: sync points at steps 2, 4, 6, so the save at step 3 is mid-phase
# (local params != θ, momentum != 0) and, with overlap delayed/eager, holds the in-flight result of step 2's sync
DILOCO = [
    "--outer.method=diloco",
    "--outer.sync_every=2",
    "--outer.lr=0.7",
    "--outer.momentum=0.9",
    "--outer.nesterov=true",
    "--outer.streaming.fragments=1",
    "--outer.streaming.tau=0",
    "--compress.quant=none",
    "--compress.lowrank.enabled=false",
    "--compress.adaptive.enabled=false",
]


def _cfg(run_dir, *extra, resume="auto"):
    return load_config(
        os.path.join(ROOT, "configs", "tiny.yaml"),
        [
            f"--log.run_dir={run_dir}",
            f"--data.cache_dir={os.path.dirname(run_dir)}/cache",
            "--data.max_bytes=200000",
            f"--train.steps={STEPS}",
            "--train.batch_size=4",
            "--train.seq_len=32",
            "--train.eval_every=0",
            "--train.eval_batches=1",
            "--log.tensorboard=false",
            "--log.progress=false",
            "--optim.warmup_steps=1",
            "--model.n_layers=2",
            "--model.d_model=64",
            "--parallel.microbatches=2",
            f"--checkpoint.resume={resume}",
            *extra,
        ],
    )


def _full_and_save(rank, world, tmp, extra):
    """The uninterrupted run's losses; it saves at step STOP (in tmp/part) on the way (saving changes nothing)."""
    from dilocox.train import Trainer

    run = Trainer(_cfg(f"{tmp}/part", *extra, resume="none"))
    losses = [run.train_step() for _ in range(STOP)]
    run.save()
    return losses + [run.train_step() for _ in range(STEPS - STOP)]


def _resume(rank, world, run_dir, extra):
    from dilocox.train import Trainer

    t = Trainer(_cfg(run_dir, *extra))
    assert t.step == STOP, t.step
    return [t.train_step() for _ in range(STEPS - STOP)]


def _check(tmp_path, src, dst):
    full = run_ranks(WORLD[src], _full_and_save, str(tmp_path), LAYOUTS[src])[0]
    assert ckpt.read_meta(ckpt.find_latest(str(tmp_path / "part" / "checkpoints")))["layout"] == "R1xD1xP1xT2"
    for losses in run_ranks(WORLD[dst], _resume, str(tmp_path / "part"), LAYOUTS[dst]):
        assert losses == pytest.approx(full[STOP:], rel=2e-5, abs=2e-5), (losses, full[STOP:])
        assert losses != pytest.approx(full[: STEPS - STOP], rel=1e-3)  # really continued, not restarted


@pytest.mark.slow  # 4 + 1 + 2 ranks on 2 cores: ~40 s
def test_pp2_tp2_checkpoint_resumes_on_one_rank_and_on_tp2(tmp_path):
    full = run_ranks(4, _full_and_save, str(tmp_path), LAYOUTS["pp2tp2"])[0]
    assert ckpt.read_meta(ckpt.find_latest(str(tmp_path / "part" / "checkpoints")))["layout"] == "R1xD1xP2xT2"
    for dst in ("one", "tp2"):
        for losses in run_ranks(WORLD[dst], _resume, str(tmp_path / "part"), LAYOUTS[dst]):
            assert losses == pytest.approx(full[STOP:], rel=2e-5, abs=2e-5), (dst, losses, full[STOP:])


@pytest.mark.slow  # 2 + 1 ranks: ~11 s (quick loop: test_diloco_delayed_tp2_...)
def test_tp2_checkpoint_resumes_on_one_rank(tmp_path):
    _check(tmp_path, "tp2", "one")


@pytest.mark.slow  # 2 + 1 ranks: ~40 s alone, more on a busy 2-core machine
def test_gather_full_equals_the_one_process_model(tmp_path):
    """The gathered model and AdamW moments of a TP=2 checkpoint equal a 1-rank checkpoint of the same run."""
    from dilocox.reshard import gather_full

    run_ranks(2, _full_and_save, str(tmp_path / "t"), LAYOUTS["tp2"])
    run_ranks(1, _full_and_save, str(tmp_path / "o"), [])
    cfg = _cfg(str(tmp_path / "x"))
    a = gather_full(ckpt.find_latest(str(tmp_path / "t" / "part" / "checkpoints")), cfg.model, optimizer=True)
    b = gather_full(ckpt.find_latest(str(tmp_path / "o" / "part" / "checkpoints")), cfg.model, optimizer=True)
    assert set(a["model"]) == set(b["model"]) and set(a["optimizer"]) == set(b["optimizer"])
    for k in a["model"]:
        # fp32 rounding of 3 Adam steps differs between layouts; a misplaced shard differs by ~init_std
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-3, atol=2e-4)
    for k in a["optimizer"]:
        assert int(a["optimizer"][k]["step"]) == int(b["optimizer"][k]["step"]) == STOP
        for m in ("exp_avg", "exp_avg_sq"):
            x, y = a["optimizer"][k][m], b["optimizer"][k][m]
            if y.dim() < 2:  # e.g. k_proj's bias has an exactly-zero gradient: its moments are rounding noise
                continue
            torch.testing.assert_close(x, y, rtol=1e-2, atol=1e-3 * float(y.abs().max()))


def _resume_outer(rank, world, run_dir, extra):
    """The resumed losses, and this rank's outer state right after the resume (before any step)."""
    from dilocox.train import Trainer

    t = Trainer(_cfg(run_dir, *extra))
    assert t.step == STOP, t.step
    o = t.outer
    pend = [None if h is None else [x.clone() for x in h.wait()] for h in o.pending]
    comp = [None if c.errors is None else [e.clone() for e in c.errors] for c in o.compressors]
    named = {
        n: (
            o.state.view(o.state.theta, i).clone(),
            o.state.view(o.state.momentum, i).clone(),
            p.partition_dim if getattr(p, "tensor_parallel", False) else None,
        )
        for i, (n, p) in enumerate(zip(o.names, o.params))
    }
    info = {
        "named": named,
        "pending": pend,
        "errors": comp,
        "H": o.H,
        "outer_step": o.outer_step,
        "next_sync": list(o.schedule.next_sync),
    }
    return [t.train_step() for _ in range(STEPS - STOP)], info


def _diloco_case(tmp_path, src, dst, extra, rel=2e-5):
    """Save on ``src`` at step STOP; resume on ``dst``: the losses after the resume equal the uninterrupted run's."""
    R = 2 if "--parallel.replicas=2" in extra else 1
    full = run_ranks(R * WORLD[src], _full_and_save, str(tmp_path), LAYOUTS[src] + extra)
    step_dir = ckpt.find_latest(str(tmp_path / "part" / "checkpoints"))
    shard = ckpt.load_checkpoint(step_dir, 0)
    assert shard["outer"]["method"] == "diloco" and shard["outer"]["outer_step"] == 1  # a real mid-run outer state
    if "--outer.overlap=delayed" in extra:  # v is still 0 (Δ̄^0 = 0); the in-flight Δ̄^1 is what matters
        assert float(shard["outer"]["pending"][0][0].abs().max()) > 0
    else:
        assert float(shard["outer"]["state"]["momentum"].abs().max()) > 0
    out = run_ranks(R * WORLD[dst], _resume_outer, str(tmp_path / "part"), LAYOUTS[dst] + extra)
    for r, (losses, info) in enumerate(out):
        want = full[(r // WORLD[dst]) * WORLD[src]][STOP:]  # the same replica's uninterrupted losses
        assert losses == pytest.approx(want, rel=rel, abs=rel), (r, losses, want)
        assert info["outer_step"] == 1 and info["next_sync"] == [4] and info["H"] == 2
    return full, out, step_dir


def test_diloco_delayed_tp2_checkpoint_resumes_on_one_rank(tmp_path):
    """R=1 DiLoCo with overlap delayed: θ, v and the stored in-flight result of step 2's sync, saved as TP=2,
    are resharded onto 1 rank; the resumed losses equal the uninterrupted run's (nothing restarts)."""
    full, out, step_dir = _diloco_case(tmp_path, "tp2", "one", DILOCO + ["--outer.overlap=delayed"])
    info = out[0][1]
    assert info["pending"][0] is not None  # the in-flight result was carried over
    # θ, v and the in-flight result of the one rank are the concatenations of the two TP ranks' (per name)
    parts = _saved_tp2_by_name(tmp_path, step_dir)
    assert any(d is not None for _, _, d in info["named"].values())
    for k, (name, (theta, mom, dim)) in enumerate(info["named"].items()):
        for got, kind in ((theta, "theta"), (mom, "momentum"), (info["pending"][0][k], "pending")):
            want = parts[0][kind][name] if dim is None else torch.cat([p[kind][name] for p in parts], dim)
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_muon_outer_checkpoint_resumes_on_another_layout(tmp_path):
    """outer.optimizer=muon saved as PP=2 and resumed on one rank: Muon's momentum is resharded by parameter name
    with θ and v (it used to be refused), and the resumed losses equal the uninterrupted run's."""
    extra = DILOCO + ["--outer.overlap=none", "--outer.optimizer=muon"]
    full, out, step_dir = _diloco_case(tmp_path, "pp2", "one", extra)
    saved = [ckpt.load_checkpoint(step_dir, r)["outer"]["state"]["optimizer"]["state"] for r in range(2)]
    assert all(saved), "each stage saved Muon's momentum"


def _saved_tp2_by_name(tmp_path, step_dir):
    """The outer entries of a 1-replica TP=2 checkpoint's two ranks, per parameter name."""
    from dilocox.reshard import _outer_by_name, _saved_outer_order

    cfg = _cfg(str(tmp_path / "x"))
    parts = []
    for t in range(2):
        o = ckpt.load_checkpoint(step_dir, t)["outer"]
        named, frags = _saved_outer_order(cfg.model, 0, 1, 2, 0, 1, 1, "sequential", False)
        parts.append(_outer_by_name(o, named, frags, "test"))
    return parts


@pytest.mark.slow  # 2 + 2 ranks: ~12 s (quick loop: test_diloco_delayed_tp2_...)
def test_diloco_data_sharded_checkpoint_resumes_on_tp2(tmp_path):
    """R=1 DiLoCo (overlap none) with D=2 and outer.shard_over_data (each DP rank owns half the tensors' outer
    state) resumed on TP=2: every tensor's θ/v is found on its owner and re-sliced."""
    _diloco_case(tmp_path, "dp2", "tp2", DILOCO + ["--outer.overlap=none", "--outer.shard_over_data=true"])


@pytest.mark.slow  # 2 + 1 ranks: ~11 s each (quick loop: test_diloco_delayed_tp2_...)
@pytest.mark.parametrize("lowrank", [False, True])
def test_diloco_error_feedback_is_resharded(tmp_path, lowrank):
    """int8 quantization with error feedback (R=1: the compressor's local round trip), optionally with PowerSGD:
    the error buffers are carried over by name (TP slices concatenated), not zeroed. The losses continue closely,
    not bit for bit: the quantization groups and the low-rank factors of a matrix follow the new slicing, and
    PowerSGD's warm-start Q restarts (redrawn from the seed)."""
    extra = [a for a in DILOCO if not a.startswith(("--compress.quant", "--compress.lowrank"))]
    extra += [
        "--compress.quant=int8",
        "--compress.error_feedback=true",
        "--outer.overlap=none",
        f"--compress.lowrank.enabled={str(lowrank).lower()}",
        "--compress.lowrank.rank=4",
    ]
    # measured (loss after the resume vs uninterrupted): int8 alone <= 5e-7 relative; with PowerSGD rank 4 about
    # 6e-3 (the uninterrupted TP=2 run factors each TP slice of a matrix separately, the 1-rank run the whole
    # matrix, so even a carried-over Q could not make it exact)
    full, out, step_dir = _diloco_case(tmp_path, "tp2", "one", extra, rel=2e-2 if lowrank else 2e-5)
    info = out[0][1]
    errs = info["errors"][0]
    assert errs is not None and max(float(e.abs().max()) for e in errs) > 0
    parts = _saved_tp2_by_name(tmp_path, step_dir)
    for k, (name, (_, _, dim)) in enumerate(info["named"].items()):
        want = parts[0]["errors"][name] if dim is None else torch.cat([p["errors"][name] for p in parts], dim)
        torch.testing.assert_close(errs[k], want, rtol=0, atol=0)


def _preset(name: str) -> list[str]:
    """configs/methods/<name>.yaml as --key=value overrides."""
    with open(os.path.join(ROOT, "configs", "methods", f"{name}.yaml")) as f:
        data = yaml.safe_load(f)

    def flat(d, pre):
        for k, v in d.items():
            yield from flat(v, f"{pre}{k}.") if isinstance(v, dict) else [f"--{pre}{k}={str(v).lower()}"]

    return list(flat(data, ""))


# short-run overrides; streaming: fragment 1 syncs at 2, 6 and fragment 0 at 4, launched tau=1 step earlier, so
# the save at step 3 holds fragment 0's in-flight all-reduce
PRESETS = {
    "dilocox": ["--outer.sync_every=4"],  # 2 fragments, tau=1, the sparse codec's error buffers resliced
    "dilocox-paper": [
        "--outer.sync_every=2",
        "--compress.adaptive.h_min=2",
        "--compress.adaptive.h_max=4",
        "--compress.lowrank.rank=4",
        "--compress.group_size=32",
    ],
    "streaming": ["--outer.sync_every=4", "--outer.streaming.tau=1", "--compress.group_size=32"],
}


@pytest.mark.slow  # ~11 s each (quick loop: test_diloco_delayed_tp2_...)
@pytest.mark.parametrize("name", sorted(PRESETS))  # 2 + 1 ranks: ~13 s each
def test_presets_resume_on_another_layout(tmp_path, name):
    """The dilocox-paper preset (int4 + PowerSGD + adaptive controller, overlap delayed), the streaming preset
    (2 fragments, tau, alpha, int4) and the dilocox preset (the same schedule, top-k + error feedback) saved on TP=2
    resume on 1 rank: close to the uninterrupted run (int4 groups
    and low-rank factors follow the new slicing; Q and the controller restart), and the schedule carries over."""
    full = run_ranks(2, _full_and_save, str(tmp_path), LAYOUTS["tp2"] + _preset(name) + PRESETS[name])[0]
    step_dir = ckpt.find_latest(str(tmp_path / "part" / "checkpoints"))
    saved = ckpt.load_checkpoint(step_dir, 0)["outer"]
    assert any(p is not None for p in saved["pending"])
    losses, info = run_ranks(1, _resume_outer, str(tmp_path / "part"), _preset(name) + PRESETS[name])[0]
    assert info["next_sync"] == saved["schedule"]["next_sync"] and info["H"] == saved["H"]
    assert info["outer_step"] == saved["outer_step"] >= 1
    assert [p is None for p in info["pending"]] == [p is None for p in saved["pending"]]
    assert losses == pytest.approx(full[STOP:], rel=2e-2), (losses, full[STOP:])


@pytest.mark.slow  # 4 + 2 ranks on 2 cores
@pytest.mark.parametrize("overlap", ["none", "eager"])
def test_diloco_two_replicas_pp2_resumes_on_pp1(tmp_path, overlap):
    """The issue's case with R=2: DiLoCo saved on P=2 (world 4) resumed on P=1 (world 2), per replica (eager:
    per-replica θ/v); each replica's losses after the resume equal its uninterrupted ones."""
    _diloco_case(tmp_path, "pp2", "one", DILOCO + ["--parallel.replicas=2", f"--outer.overlap={overlap}"])


@pytest.mark.slow  # 2 + 1 ranks: ~11 s (quick loop: test_diloco_delayed_tp2_...)
def test_streaming_fragments_moved_by_a_pipeline_change_are_refused(tmp_path):
    """Streaming fragments are assigned per pipeline stage: 4 layers on P=2 with 2 fragments put layer 1 in
    fragment 1, on P=1 in fragment 0 (another sync schedule): refused with an error naming the fix."""
    extra = DILOCO + ["--outer.overlap=none", "--outer.streaming.fragments=2", "--model.n_layers=4"]
    run_ranks(2, _full_and_save, str(tmp_path), LAYOUTS["pp2"] + extra)
    with pytest.raises(RuntimeError, match="was in streaming fragment 1, on this layout it is in fragment 0"):
        run_ranks(1, _resume, str(tmp_path / "part"), extra)


def test_outer_state_needs_an_outer_method(tmp_path):
    """A checkpoint holding DiLoCo outer state cannot be resharded into a run without an outer method."""
    from dilocox.reshard import resharded_state

    step_dir = tmp_path / "ck" / "step_00000003"
    os.makedirs(step_dir)
    cfg = _cfg(str(tmp_path / "x"))
    from dilocox.model.transformer import build_model
    from dilocox.train import build_inner_optimizer

    model = build_model(cfg.model)
    opt = build_inner_optimizer(cfg, model, torch.device("cpu"))
    for r in range(2):
        shard = {"step": 3, "model": model.state_dict(), "optimizer": opt.state_dict(), "outer": {"method": "diloco"}}
        torch.save(shard, ckpt.shard_path(str(step_dir), r))
    (step_dir / "COMPLETE.json").write_text('{"step": 3, "world_size": 2, "layout": "R1xD1xP1xT2", "method": "none"}')

    class Topo:
        R, replica = 1, 0

    with pytest.raises(ckpt.CheckpointError, match="no outer method"):
        resharded_state(str(step_dir), cfg, Topo(), model, opt)


@pytest.mark.slow  # 2 + 1 ranks
def test_muon_pp2_checkpoint_resumes_on_one_rank(tmp_path):
    """optim.name=muon: the inner state (Muon's momentum buffers, AdamW's moments) is stored in Muon's index order
    (optim.param_order); resharding rebuilds that order from the checkpoint's optim.name."""
    full = run_ranks(2, _full_and_save, str(tmp_path), ["--parallel.pipeline=2", "--optim.name=muon"])[0]
    for losses in run_ranks(1, _resume, str(tmp_path / "part"), ["--optim.name=muon"]):
        assert losses == pytest.approx(full[STOP:], rel=2e-5, abs=2e-5), (losses, full[STOP:])
        assert losses != pytest.approx(full[: STEPS - STOP], rel=1e-3)
