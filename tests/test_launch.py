"""How a run starts: which rank writes the run dir, which backend, how a bad layout is reported.

Each test fails on the code before its fix:

- under plain ``srun`` (SLURM_PROCID, no RANK) every rank wrote ``config.yaml``;
- ``train.device=cpu`` on a CUDA machine initialised NCCL, which cannot move CPU tensors;
- ``dilocox train`` with too few ranks printed a traceback instead of the config error.
"""

from __future__ import annotations

import os

import pytest

from tests.small_run import small_cfg

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class _Stop(Exception):
    pass


def test_config_yaml_written_by_slurm_rank0_only(tmp_path, monkeypatch):
    """The Trainer's rank comes from env_rank_world (via init_distributed); only rank 0 writes the
    run dir's config history (Trainer._begin_run, dilocox.rundir)."""
    import types

    import dilocox.train as T
    from dilocox.distributed.topology import env_rank_world
    from dilocox.metrics import MetricsLogger

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for procid, written in (("1", False), ("0", True)):
        monkeypatch.setenv("SLURM_PROCID", procid)
        monkeypatch.setenv("SLURM_NTASKS", "2")
        run_dir = tmp_path / f"run{procid}"
        t = T.Trainer.__new__(T.Trainer)  # only what _begin_run reads: no process group needed
        t.cfg, t.step, t.tokens_seen, t.resumed_from = small_cfg(run_dir), 0, 0, None
        t.topo = types.SimpleNamespace(rank=env_rank_world()[0])
        t.prepared = types.SimpleNamespace(meta={}, dir=None)  # (byte data: no tokenizer.json to keep)
        t.logger = MetricsLogger(str(run_dir), enabled=False, total_steps=1)
        assert t._begin_run() is None
        assert (run_dir / "config.yaml").exists() == written, procid
        assert (run_dir / "config.0.yaml").exists() == written, procid


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
    rc = main(
        [
            "train",
            os.path.join(ROOT, "configs", "tiny-dilocox.yaml"),
            f"--log.run_dir={tmp_path}",
            f"--data.cache_dir={tmp_path}/cache",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "config error:" in err and "does not match the world size 1" in err and "--nproc 4" in err
