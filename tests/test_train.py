"""End-to-end training: learning, exact resume, layout-independence of the loss."""

import json
import math
import os
import time

import pytest

from dilocox.config import load_config
from tests.spawn import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# the Qwen2 architecture on tiny_cfg's shape (RMSNorm, SwiGLU, RoPE, biases on q/k/v only, GQA with 2 kv heads)
QWEN_ARGS = (
    "--model.arch=qwen",
    "--model.norm=rmsnorm",
    "--model.activation=swiglu",
    "--model.pos_emb=rope",
    "--model.bias=false",
    "--model.qkv_bias=true",
    "--model.n_kv_heads=2",
)


def tiny_cfg(tmp, *extra, steps=12):
    return load_config(
        os.path.join(ROOT, "configs", "tiny.yaml"),
        [
            f"--log.run_dir={tmp}",
            f"--data.cache_dir={tmp}/cache",
            "--data.max_bytes=400000",
            f"--train.steps={steps}",
            "--train.batch_size=4",
            "--train.seq_len=64",
            "--train.eval_every=0",
            "--train.eval_batches=2",
            "--log.tensorboard=false",
            "--log.progress=false",
            "--optim.warmup_steps=2",
            *extra,
        ],
    )


def _train_and_resume(rank, world, tmp, extra, steps, stop):
    """Uninterrupted run vs. a run stopped at `stop` and resumed: return both loss sequences."""
    from dilocox.train import Trainer

    full = Trainer(tiny_cfg(f"{tmp}/full", *extra, "--checkpoint.resume=none", steps=steps))
    full_losses = [full.train_step() for _ in range(steps)]
    first = Trainer(tiny_cfg(f"{tmp}/part", *extra, steps=steps))
    part = [first.train_step() for _ in range(stop)]
    first.save()
    del first
    second = Trainer(tiny_cfg(f"{tmp}/part", *extra, steps=steps))  # resume=auto finds step `stop`
    assert second.step == stop
    part += [second.train_step() for _ in range(steps - stop)]
    return full_losses, part


def _assert_resume_exact(results):
    for full, part in results:
        assert len(full) == len(part)
        assert full == part, f"resumed losses differ:\n{full}\n{part}"


def test_resume_exact_single_rank(tmp_path):
    _assert_resume_exact(run_ranks(1, _train_and_resume, str(tmp_path), [], 8, 5))


@pytest.mark.slow  # ~17 s on 2 cores
def test_resume_exact_pp2_tp2(tmp_path):
    extra = ["--parallel.pipeline=2", "--parallel.tensor=2", "--parallel.microbatches=2"]
    _assert_resume_exact(run_ranks(4, _train_and_resume, str(tmp_path), extra, 6, 3))


def _losses(rank, world, tmp, extra, steps):
    from dilocox.train import Trainer

    t = Trainer(tiny_cfg(tmp, *extra, "--checkpoint.resume=none", steps=steps))
    return [t.train_step() for _ in range(steps)], t.validate()


@pytest.mark.slow  # ~17 s per arch on 2 cores
@pytest.mark.parametrize("arch", ["gpt2", "qwen"])
def test_pp2_tp2_training_equals_single_process(tmp_path, arch):
    """The same model trained with PP=2 x TP=2 on 4 ranks follows the 1-process loss curve."""
    extra = ["--parallel.microbatches=2"]
    if arch == "qwen":
        extra += [*QWEN_ARGS, "--model.d_ff=344"]
    ref_losses, ref_val = run_ranks(1, _losses, str(tmp_path / "ref"), extra, 5)[0]
    par = run_ranks(4, _losses, str(tmp_path / "par"), extra + ["--parallel.pipeline=2", "--parallel.tensor=2"], 5)
    for losses, val in par:
        assert losses == pytest.approx(ref_losses, rel=2e-5, abs=2e-5)
        assert val == pytest.approx(ref_val, rel=2e-5, abs=2e-5)


@pytest.mark.slow  # 40-60 s on 2 cores
def test_short_training_beats_unigram_entropy(tmp_path):
    """The tiny config learns: validation loss falls well below the corpus' unigram entropy. 180 of its 300 steps
    (schedule shortened with it) to save CI a minute: 2.438 there vs the bound 0.8 * 3.151 = 2.521 (2.326 at 300)."""
    from dilocox.data import unigram_entropy
    from dilocox.train import train

    cfg = load_config(
        os.path.join(ROOT, "configs", "tiny.yaml"),
        [
            f"--log.run_dir={tmp_path}",
            f"--data.cache_dir={tmp_path}/cache",
            "--log.tensorboard=false",
            "--log.progress=false",
            "--train.steps=180",
        ],
    )
    summary = train(cfg)
    from dilocox.data import prepare

    h1 = unigram_entropy(prepare(cfg.data).train_tokens())
    assert summary["final_val_loss"] < 0.8 * h1, (summary["final_val_loss"], h1)
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in lines if "step" in r]
    assert steps[-1]["step"] == cfg.train.steps and all(math.isfinite(r["loss"]) for r in steps)
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.0


def test_the_start_up_is_timed_by_phase_in_the_runs_first_record(tmp_path):
    """Where a (re)started job's seconds go before its first step (issue 45): one ``startup`` record, the run's
    first, with the command's age at the Trainer's start and each phase of the Trainer's construction."""
    from dilocox.metrics import STARTED_AT_ENV, process_age_s
    from dilocox.train import train

    cfg = load_config(
        os.path.join(ROOT, "configs", "tiny.yaml"),
        [f"--log.run_dir={tmp_path}", f"--data.cache_dir={tmp_path}/cache", "--log.tensorboard=false",
         "--log.progress=false", "--train.steps=2", "--train.eval_every=0", "--checkpoint.every=0"],
    )  # fmt: skip
    t0 = time.time()
    train(cfg)
    took = time.time() - t0
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    su = lines[0]
    assert su["event"] == "startup" and "step" not in su
    phases = ("distributed_s", "data_s", "model_s", "outer_s", "resume_s")
    assert all(su[k] >= 0 for k in phases) and sum(su[k] for k in phases) < took
    assert su["process_s"] >= 0  # (this test's process: its age at the Trainer's start)
    assert any("loss" in r for r in lines[1:])  # the step records follow it
    # a launching `dilocox train --nproc N` hands its ranks the command's start: the age counts from there
    os.environ[STARTED_AT_ENV] = repr(time.time() - 12.5)
    try:
        assert 12.5 <= process_age_s() < 20.0
    finally:
        del os.environ[STARTED_AT_ENV]


@pytest.mark.parametrize("steps,warns", [(7, True), (10, False)])
def test_warns_when_the_last_phase_would_be_dropped(tmp_path, capsys, steps, warns):
    from dilocox.train import Trainer

    cfg = tiny_cfg(
        str(tmp_path), "--outer.method=diloco", "--outer.sync_every=5", "--checkpoint.resume=none", steps=steps
    )
    Trainer(cfg).run()
    out = capsys.readouterr().out
    if warns:
        assert "train.steps=7 is not a multiple of outer.sync_every=5: the last 2 local steps" in out, out[-2000:]
    else:
        assert "is not a multiple of outer.sync_every" not in out, out[-2000:]


def test_fresh_start_refuses_a_dir_with_checkpoints_of_an_earlier_run(tmp_path):
    from dilocox import checkpoint as ckpt
    from dilocox.config import ConfigError
    from dilocox.train import Trainer

    Trainer(tiny_cfg(str(tmp_path), "--checkpoint.resume=none", steps=2)).run()
    before = ckpt.find_latest(str(tmp_path / "checkpoints"))
    assert before is not None
    with pytest.raises(ConfigError, match="checkpoint.resume=none, but .* already holds checkpoints"):
        Trainer(tiny_cfg(str(tmp_path), "--checkpoint.resume=none", steps=2))
    assert ckpt.find_latest(str(tmp_path / "checkpoints")) == before  # nothing touched
    t = Trainer(tiny_cfg(str(tmp_path), "--checkpoint.resume=auto", steps=2))  # the way to continue it
    assert t.step == 2
