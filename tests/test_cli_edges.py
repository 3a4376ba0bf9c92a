"""Bad input on the command surface: one line naming the flag or the path and the fix, exit 2, no traceback
(the cases a review found printing a traceback or accepting nonsense)."""

from __future__ import annotations

import json
import os

import pytest

from dilocox.cli import main as cli_main
from dilocox.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
MODEL = os.path.join(ROOT, "configs", "model", "gpt2-tiny.yaml")


def _one_line_error(capsys, argv, *want: str) -> str:
    assert cli_main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and all(w in err for w in want), err
    return err.splitlines()[-1]


@pytest.mark.parametrize(
    "flag, value",
    [("--mfu", "0"), ("--mfu", "nan"), ("--mfu", "-0.4"), ("--gpus-per-replica", "0"), ("--gpu-tflops", "0"),
     ("--latency", "-1"), ("--step-time", "-1"), ("--tokens-per-step", "0")],
)  # fmt: skip
def test_plan_refuses_hardware_numbers_that_are_not_physical(capsys, flag, value):
    """Before: --gpus-per-replica 0 and --mfu 0 divided by zero (traceback); negative values printed negative step
    times and utilizations over 100 %; --tokens-per-step 0 silently became the default."""
    _one_line_error(capsys, ["plan", "--model", MODEL, "--replicas", "4", "--bandwidth", "1gbit", flag, value], flag)


def test_output_paths_that_cannot_be_written_are_one_line(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": 0.1, "loss": 3.0}) + "\n")
    _one_line_error(capsys, ["report", str(run), "--out", str(afile)], str(afile))
    plan = ["plan", "--model", MODEL, "--replicas", "2", "--bandwidth", "1gbit", "--json", str(afile / "x.json")]
    _one_line_error(capsys, plan, str(afile / "x.json"))


def test_report_names_a_record_whose_step_is_not_a_number(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    recs = [{"step": 1, "time": 0.1, "loss": 3.0}, {"step": "x", "loss": "abc"}, {"step": 3, "time": 0.3, "loss": 2.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    _one_line_error(capsys, ["report", str(run), "--out", str(tmp_path / "plots")], "metrics.jsonl:2", "'x'")


def test_a_stray_rank_environment_is_named(capsys, monkeypatch):
    """RANK set in the shell (a torchrun/SLURM leftover) with --nproc: before, --nproc was ignored in silence."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    _one_line_error(capsys, ["train", TINY, "--nproc", "4"], "RANK=0", "unset RANK and WORLD_SIZE")


def test_world_size_without_master_addr_is_a_config_error(monkeypatch):
    from dilocox.distributed.topology import init_distributed

    for k in ("MASTER_ADDR", "SLURM_NODELIST", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="MASTER_ADDR is not"):
        init_distributed()


def test_train_device_cuda_without_cuda_is_a_config_error(tmp_path):
    import torch

    from dilocox.train import pick_device

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    with pytest.raises(ConfigError, match="set --train.device=cpu"):
        pick_device(load_config(TINY, ["--train.device=cuda"]), 0)


def test_a_resume_path_that_is_no_step_directory_is_named(tmp_path):
    from dilocox.train_state import _resume_path_problem

    assert "does not exist" in _resume_path_problem(str(tmp_path / "nope"))
    ck = tmp_path / "checkpoints"
    (ck / "step_00000004").mkdir(parents=True)
    (ck / "step_00000004" / "COMPLETE.json").write_text("{}")
    assert f"--checkpoint.resume={ck / 'step_00000004'}" in _resume_path_problem(str(ck))
    assert _resume_path_problem(str(ck / "step_00000004")) is None
    (ck / "step_00000008").mkdir()  # interrupted while saving: read_meta says so
    assert _resume_path_problem(str(ck / "step_00000008")) is None


def test_swarm_timeout_nan_is_refused(capsys):
    assert cli_main(["swarm", TINY, "--timeout-s", "nan"]) == 2
    assert "--timeout-s nan" in capsys.readouterr().err


def test_an_unknown_swarm_option_is_named(capsys):
    assert cli_main(["swarm", TINY, "--stepz", "5"]) == 2
    assert "--stepz is not an option of dilocox swarm" in capsys.readouterr().err


def test_a_missing_init_from_path_says_it_does_not_exist(tmp_path):
    """Before: a local path that does not exist went to the hub client, whose repo-id error was all it printed."""
    from dilocox.hf import ExportError, resolve_hf_dir

    for path in (str(tmp_path / "nope"), "./nope", "~/models/nope", "a/b/c"):
        with pytest.raises(ExportError, match="does not exist; give a local Hugging Face model directory"):
            resolve_hf_dir(path)


def test_launch_elastic_zero_names_the_replica_count(capsys):
    assert cli_main(["launch", "--elastic", "0", os.path.join(ROOT, "configs", "tiny-dilocox.yaml")]) == 2
    err = capsys.readouterr().err
    assert "--elastic 0: the number of replicas must be at least 1" in err and "--min-replicas" not in err


def test_ctrl_c_before_a_commands_own_handlers_is_one_line_and_130(capsys, monkeypatch):
    """Ctrl-C during start-up (imports, config, before ``dilocox train`` sets its own handlers) printed a
    KeyboardInterrupt traceback and ended with -2 (a review's ``ctrl_c.py``): now one line, exit 130 (128 + SIGINT)."""
    from dilocox import cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_train", interrupted)
    assert cli_main(["train", TINY]) == 130
    err = capsys.readouterr().err.strip()
    assert err == "dilocox train: interrupted (SIGINT)", err
