"""Regression tests for bugs found in review (train loop, config, CLI, comm thread, spawn).

Each test fails on the code before its fix:

- a rank that raises inside ``train()`` left its outer comm thread running (the process then
  died with SIGABRT at interpreter exit instead of exiting with the error);
- ``train.eval_batches=0`` reported a final validation loss of 0.0 (perplexity 1);
- ``log.every=0`` passed validation and crashed with ZeroDivisionError at the first step;
  a negative ``optim.min_lr_ratio`` passed and made the lr schedule negative;
  streaming/overlap/adaptive conflicts were only found after the ranks had started;
- under plain ``srun`` (SLURM_PROCID, no RANK) every rank wrote ``config.yaml``;
- ``train.device=cpu`` on a CUDA machine initialised NCCL, which cannot move CPU tensors;
- ``dilocox train`` with too few ranks printed a traceback instead of the config error;
- ``run_ranks`` waited for its whole timeout when a rank was killed by a signal.
"""

from __future__ import annotations

import math
import os
import threading
import time

import pytest
import torch

from dilocox.config import ConfigError, load_config
from dilocox.distributed.spawn import run_ranks
from test_train import tiny_cfg

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def small_cfg(tmp, *extra, steps=4):
    """``test_train.tiny_cfg`` made smaller still (2 layers x 64, 32-token sequences)."""
    return tiny_cfg(tmp, "--data.max_bytes=200000", "--train.seq_len=32", "--train.eval_batches=1", "--optim.warmup_steps=1",
                    "--model.n_layers=2", "--model.d_model=64", "--checkpoint.resume=none", *extra, steps=steps)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "overrides, needles",
    [
        (["--log.every=0"], ["log.every=0", "> 0"]),
        (["--train.eval_batches=-1"], ["train.eval_batches=-1", ">= 0"]),
        (["--checkpoint.every=-5"], ["checkpoint.every=-5", ">= 0"]),
        (["--train.max_tokens=0"], ["train.max_tokens=0", "> 0"]),
        (["--optim.min_lr_ratio=-0.5"], ["optim.min_lr_ratio=-0.5", "[0, 1]"]),
        (["--optim.min_lr_ratio=1.5"], ["optim.min_lr_ratio=1.5", "[0, 1]"]),
        # one fragment: tau must still be below H (was found only when the outer loop was built)
        (["--outer.method=diloco", "--outer.sync_every=4", "--outer.streaming.tau=4"], ["outer.streaming.tau=4", "[0, sync_every/fragments=4)"]),
        (["--outer.method=diloco", "--outer.overlap=delayed", "--outer.streaming.tau=1"], ["outer.streaming.tau=1", "overlap='delayed'"]),
        (["--outer.method=diloco", "--outer.sync_every=4", "--outer.streaming.fragments=2", "--compress.adaptive.enabled=true"],
         ["compress.adaptive.enabled=True", "fragments=2"]),
    ],
)
def test_impossible_settings_fail_at_load(overrides, needles):
    with pytest.raises(ConfigError) as ei:
        load_config(None, overrides)
    for n in needles:
        assert n in str(ei.value), (n, str(ei.value))


def test_valid_streaming_and_schedule_settings_still_load():
    load_config(None, ["--outer.method=diloco", "--outer.sync_every=4", "--outer.streaming.tau=3"])
    load_config(None, ["--optim.min_lr_ratio=0", "--log.every=1", "--train.eval_batches=0", "--checkpoint.every=0"])


# ----------------------------------------------------------------------------- train loop


def test_no_val_batches_gives_nan_not_zero(tmp_path):
    from dilocox.train import train

    summary = train(small_cfg(tmp_path, "--train.eval_batches=0", "--train.eval_every=1", steps=2))
    assert math.isnan(summary["final_val_loss"]), summary["final_val_loss"]
    import json

    recs = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in recs if "step" in r]
    assert len(steps) == 2 and all("val_loss" not in r for r in steps)


class _Stop(Exception):
    pass


def test_config_yaml_written_by_slurm_rank0_only(tmp_path, monkeypatch):
    import dilocox.train as T

    def stub(cfg):
        raise _Stop

    monkeypatch.setattr(T, "Trainer", stub)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for procid, written in (("1", False), ("0", True)):
        monkeypatch.setenv("SLURM_PROCID", procid)
        monkeypatch.setenv("SLURM_NTASKS", "2")
        run_dir = tmp_path / f"run{procid}"
        with pytest.raises(_Stop):
            T.train(small_cfg(run_dir))
        assert (run_dir / "config.yaml").exists() == written, procid


def test_cpu_device_initialises_gloo_even_with_cuda(tmp_path, monkeypatch):
    import dilocox.train as T

    seen = []

    def fake_init(backend=None, timeout_s=600.0):
        seen.append(backend)
        raise _Stop

    monkeypatch.setattr(T, "init_distributed", fake_init)
    with pytest.raises(_Stop):
        T.Trainer(small_cfg(tmp_path, "--train.device=cpu"))
    assert seen == ["gloo"]


def test_cli_reports_layout_world_mismatch_as_config_error(tmp_path, capsys, monkeypatch):
    from dilocox.cli import main

    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    rc = main(["train", os.path.join(ROOT, "configs", "tiny-dilocox.yaml"), f"--log.run_dir={tmp_path}",
               f"--data.cache_dir={tmp_path}/cache"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "config error:" in err and "does not match the world size 1" in err and "--nproc 4" in err


def _raise_in_training(rank, world, tmp):
    """Rank 1 raises at step 4 (an outer all-reduce was launched at step 3); both ranks fail."""
    import dilocox.train as T

    orig = T.Trainer.train_step

    def bad_step(self):
        if self.topo.rank == 1 and self.step == 4:
            raise FloatingPointError("injected")
        return orig(self)

    T.Trainer.train_step = bad_step
    cfg = small_cfg(f"{tmp}/r", "--parallel.replicas=2", "--outer.method=diloco", "--outer.sync_every=3",
                    "--outer.overlap=delayed", steps=12)
    try:
        T.train(cfg)
        err = None
    except Exception as e:  # noqa: BLE001 - what each rank saw
        err = type(e).__name__
    alive = [t.name for t in threading.enumerate() if t.name.startswith("outer-comm") and t.is_alive()]
    return err, alive


def test_failing_rank_stops_the_outer_comm_thread(tmp_path):
    res = run_ranks(2, _raise_in_training, str(tmp_path))
    assert res[1][0] == "FloatingPointError"
    assert res[0][0] is not None  # its partner fails too (the peer left the outer group)
    for err, alive in res:
        assert alive == [], alive


# ----------------------------------------------------------------------------- spawn


def _one_rank_killed(rank, world):
    import signal

    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def test_run_ranks_names_a_killed_rank_quickly():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as ei:
        run_ranks(2, _one_rank_killed, timeout=240)
    assert time.monotonic() - t0 < 120
    assert "rank 1" in str(ei.value) and "-9" in str(ei.value)


# ----------------------------------------------------------------------------- inner-DP sharding of the outer sync
def _dp_sharded(rank, world, tmp, cases):
    from dilocox.train import Trainer

    out = {}
    for name, extra in cases.items():
        cfg = small_cfg(f"{tmp}/{name}", "--parallel.replicas=2", "--parallel.data=2", "--parallel.microbatches=1",
                        "--outer.method=diloco", "--outer.sync_every=3", *extra, steps=9)
        tr = Trainer(cfg)
        tr.run()
        out[name] = {"params": {n: p.detach().clone() for n, p in tr.model.named_parameters()},
                     "bytes": tr.outer.stats["bytes_sent"], "coord": tr.topo.coord}
    return out


def test_outer_sync_sharded_over_inner_dp_equals_unsharded_at_1_over_d_bytes(tmp_path):
    comp = ["--compress.quant=int4", "--compress.lowrank.enabled=true", "--compress.lowrank.rank=2", "--compress.group_size=32"]
    cases = {
        "sharded": ["--outer.overlap=delayed", *comp],
        "unsharded": ["--outer.overlap=delayed", "--outer.shard_over_data=false", *comp],
        "eager_sharded": ["--outer.overlap=eager", "--outer.lr=0.5", "--outer.momentum=0.5"],
        "eager_unsharded": ["--outer.overlap=eager", "--outer.lr=0.5", "--outer.momentum=0.5", "--outer.shard_over_data=false"],
        # adaptive: each DP rank's controller sees only its own tensors' spectra (ranks may differ per
        # DP rank), H is agreed by all; the global model must still be one model on all 4 ranks
        "adaptive_sharded": ["--outer.overlap=delayed", *comp, "--compress.adaptive.enabled=true", "--compress.adaptive.h_min=2",
                             "--compress.adaptive.h_max=4", "--compress.adaptive.rank_min=1", "--compress.adaptive.rank_max=4"],
    }
    res = run_ranks(4, _dp_sharded, str(tmp_path), cases)  # rank = replica * 2 + dp
    for a, b in (("sharded", "unsharded"), ("eager_sharded", "eager_unsharded")):
        for r in res:
            for n, v in r[a]["params"].items():
                assert torch.equal(v, r[b]["params"][n]), (a, n, r[a]["coord"])  # same math, bit for bit
        for r in res[1:]:  # and the DP ranks of a replica hold the same model
            for n, v in r[a]["params"].items():
                if r[a]["coord"].replica == 0:
                    assert torch.equal(v, res[0][a]["params"][n]), (a, n)
        sent_sharded = sum(r[a]["bytes"] for r in res)
        sent_unsharded = sum(r[b]["bytes"] for r in res)
        assert sent_unsharded > 0 and sent_sharded * 2 == sent_unsharded, (a, sent_sharded, sent_unsharded)
        assert all(0 < r[a]["bytes"] < r[b]["bytes"] for r in res)  # each DP rank sends a real share
    for r in res[1:]:
        for n, v in r["adaptive_sharded"]["params"].items():
            assert torch.equal(v, res[0]["adaptive_sharded"]["params"][n]), n
