"""Weights & Biases tracking (``log.wandb``): offline run files with the metrics and the config, rank 0 only,
and a clear error when the package is missing."""

from __future__ import annotations

import glob
import importlib.util
import os
import signal
import subprocess
import sys

import pytest

from dilocox.config import ConfigError, load_config
from dilocox.metrics import MetricsLogger
from dilocox.trackers import WandbTracker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group (wandb starts a service process); kill the group on timeout."""
    p = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate(timeout=30)
        pytest.fail(f"timed out after {timeout} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out)


@pytest.mark.slow  # ~10 s: a training subprocess plus the wandb service
def test_wandb_offline_writes_its_run_files(tmp_path):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install -r requirements.txt installs it)")
    run_dir, home = tmp_path / "run-wb", tmp_path / "home"
    env = dict(
        os.environ,
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_CONFIG_DIR=str(home / "config"),
        WANDB_CACHE_DIR=str(home / "cache"),
        WANDB_DATA_DIR=str(home / "data"),
        OMP_NUM_THREADS="1",
    )
    env.pop("WANDB_API_KEY", None)
    res = _run(
        [
            sys.executable,
            "-m",
            "dilocox.cli",
            "train",
            os.path.join(ROOT, "configs", "tiny.yaml"),
            f"--log.run_dir={run_dir}",
            f"--data.cache_dir={tmp_path}/cache-for-wandb-test",
            "--data.max_bytes=200000",
            "--train.steps=4",
            "--train.batch_size=2",
            "--train.seq_len=32",
            "--train.eval_every=2",
            "--train.eval_batches=1",
            "--model.n_layers=2",
            "--model.d_model=64",
            "--optim.warmup_steps=1",
            "--log.tensorboard=false",
            "--log.progress=false",
            "--log.wandb=true",
            "--log.wandb_project=h7-test",
        ],
        env,
    )
    assert res.returncode == 0, res.stdout[-4000:]
    runs = glob.glob(str(run_dir / "wandb" / "offline-run-*"))
    assert len(runs) == 1, os.listdir(run_dir)
    files = glob.glob(os.path.join(runs[0], "run-*.wandb"))
    assert len(files) == 1 and os.path.getsize(files[0]) > 1000, files
    with open(files[0], "rb") as f:
        data = f.read()
    # the history rows (step records) and the attached config travel in the run file
    for needle in (
        b"loss",
        b"val_loss",
        b"tokens_per_s",
        b"cache-for-wandb-test",
        b"sync_every",
        b"h7-test",
        b"run-wb",
    ):
        assert needle in data, needle
    assert os.path.isfile(run_dir / "metrics.jsonl")  # beside the jsonl, not instead of it


def test_wandb_only_on_the_logging_rank(tmp_path, monkeypatch):
    made = []
    monkeypatch.setattr("dilocox.metrics.WandbTracker", lambda *a, **k: made.append(a))
    MetricsLogger(
        str(tmp_path / "other-rank"), enabled=False, total_steps=1, tensorboard=False, wandb_project="p"
    ).close()
    assert made == [] and not os.path.exists(tmp_path / "other-rank")


def test_missing_wandb_is_a_clear_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"log.wandb=true needs the wandb package: pip install wandb"):
        load_config(None, ["--log.wandb=true"])
    load_config(None, ["--log.wandb=false"])  # off: no need for the package
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    with pytest.raises(RuntimeError, match="pip install wandb"):
        WandbTracker("unused", "p")
    with pytest.raises(ConfigError, match="log.wandb_project"):
        load_config(None, ["--log.wandb_project= "])
