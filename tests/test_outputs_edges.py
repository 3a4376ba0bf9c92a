"""What a user reads and keeps after a run, at its edges: TensorBoard after a fresh start in a used run dir, `dilocox
generate` on a run dir moved away from its absolute checkpoint.dir, a tiny sampling temperature, a seed out of
torch's range."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tests.small_run import small_cfg
from tests.test_resume_edges import _run
from tests.test_user_edges import _tb_steps


def test_a_fresh_start_hides_the_set_aside_runs_tensorboard_events(tmp_path):
    """``checkpoint.resume=none`` (or an earlier run that died before its first checkpoint) moves the earlier run's
    records to metrics.discarded.jsonl, but its TensorBoard events stayed: TensorBoard showed two loss values at
    each of steps 1..4 and the discarded run's steps 5..6 after the new run's end."""
    pytest.importorskip("torch.utils.tensorboard")
    run = str(tmp_path / "run")
    _run(small_cfg(run, "--log.tensorboard=true", "--optim.lr=1e-3", steps=6))
    shutil.rmtree(os.path.join(run, "checkpoints"))  # (else resume=none refuses a dir holding another run's saves)
    t = _run(small_cfg(run, "--log.tensorboard=true", "--optim.lr=1e-2", steps=4))
    got = _tb_steps(os.path.join(run, "tb"))
    want = {r["step"]: [pytest.approx(r["loss"])] for r in t.history}
    assert got == want, got


def test_generate_reads_a_run_dir_moved_away_from_its_absolute_checkpoint_dir(tmp_path):
    """A run trained with an absolute ``checkpoint.dir`` whose checkpoints were then put under RUN_DIR/checkpoints (a
    run dir copied off a cluster's scratch): export found them, generate said "no complete checkpoint ...; train
    first"."""
    from dilocox.export import export_run
    from dilocox.generate import load_model

    run, ckpts = tmp_path / "run", tmp_path / "scratch" / "ckpts"
    _run(small_cfg(str(run), f"--checkpoint.dir={ckpts}", steps=2))
    shutil.move(str(ckpts), str(run / "checkpoints"))
    assert export_run(str(run), str(tmp_path / "hf")).startswith(str(run / "checkpoints"))
    model, tok, _ = load_model(str(run))
    assert tok.kind == "byte" and sum(p.numel() for p in model.parameters()) > 0


class _Fixed(torch.nn.Module):
    """A 'model' whose next-token logits are fixed (token 3 the most likely)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.0, 1.0, 2.0, 5.0, 4.0, -1.0]))
        self.mcfg = type("M", (), {"max_seq_len": 8})()

    def forward(self, x):
        return self.w.expand(x.shape[0], x.shape[1], -1)


@pytest.mark.parametrize("temperature", [1e-30, 1e-300, 5e-324])
def test_a_tiny_temperature_samples_greedily_not_a_nan_error(temperature):
    """``--temperature 1e-300`` passes the check (finite, >= 0) but logits / T overflowed to inf (and T is 0 in fp32),
    softmax gave nan and generate stopped with "probability tensor contains either inf, nan or element < 0"."""
    from dilocox.generate import sample

    assert sample(_Fixed(), [1], 4, temperature=temperature, top_k=0) == [3, 3, 3, 3]
    assert sample(_Fixed(), [1], 4, temperature=temperature, top_k=2) == [3, 3, 3, 3]


def test_a_seed_out_of_torchs_range_names_the_flag(capsys):
    """``--seed 99999999999999999999999`` (a valid int for argparse) stopped with torch's "Overflow when unpacking
    long long", which names neither the flag nor its range."""
    from dilocox.generate import main

    assert main(["nowhere", "--prompt", "hi", "--seed", str(2**70)]) == 2
    err = capsys.readouterr().err
    assert "--seed" in err and "Overflow" not in err, err


def test_export_of_another_runs_checkpoint_is_refused_naming_the_model_keys(tmp_path):
    """``dilocox export RUN --checkpoint STEP_DIR`` of another run's model: read with RUN's model config, a checkpoint
    with fewer layers gave a KeyError traceback, and one of another family was written as RUN's architecture with
    the wrong weights ("exported ..."), an HF directory neither transformers nor generate can load."""
    from dilocox.checkpoint import CheckpointError
    from dilocox.export import export_main, export_run

    _run(small_cfg(str(tmp_path / "a"), steps=1))
    other = _run(small_cfg(str(tmp_path / "b"), "--model.n_layers=1", steps=1))
    step_dir = os.path.join(other.ckpt_dir, "step_00000001")
    with pytest.raises(CheckpointError, match=r"model\.n_layers 1 there, 2 here"):
        export_run(str(tmp_path / "a"), str(tmp_path / "hf"), step_dir)
    assert export_main([str(tmp_path / "a"), "--to", "hf", str(tmp_path / "hf"), "--checkpoint", step_dir]) == 2
    assert not os.path.exists(tmp_path / "hf" / "model.safetensors")
    export_run(str(tmp_path / "b"), str(tmp_path / "hf"), step_dir)  # (its own run: exported)


def test_a_run_ended_by_max_tokens_counts_down_to_its_own_last_step(tmp_path, capsys):
    """``train.max_tokens`` ending a run before ``train.steps``: the log said "step 3/1000 ... eta 22s" at the last
    step and its last record was not printed unless it fell on ``log.every``. Fix: ``TrainConfig.last_step``."""
    import json

    cfg = small_cfg(str(tmp_path), "--log.every=100", steps=1000)
    cfg.train.max_tokens = 2 * cfg.train.batch_size * cfg.train.seq_len + 1  # reached during step 3
    assert cfg.train.last_step == 3
    t = _run(cfg)
    assert t.step == 3
    recs = [json.loads(line) for line in open(os.path.join(str(tmp_path), "metrics.jsonl"))]
    last = [r for r in recs if "loss" in r][-1]
    assert last["step"] == 3 and last["eta_s"] == 0.0, last
    out = capsys.readouterr().out
    assert "step      3/3" in out and "/1000" not in out, out
