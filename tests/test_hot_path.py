"""Issue 39, the CPU part: dilocox's training step next to a plain PyTorch loop.

- ``train.compile`` at TP = PP = 1 compiles forward + loss as one graph with zero graph breaks (gpt2 and qwen, and
  qwen with ``model.fused_qkv`` and ``model.loss_backend=torch``);
- no host sync inside a training step between two log steps (counted by ``bench.reference.SyncCounter``, which is
  shown to catch a per-step ``.item()``);
- the reference loop of ``dilocox bench train --reference`` computes dilocox's loss from the same weights, and keeps
  doing so over a few AdamW steps (the comparison is between the same function);
- a non-finite loss still stops the run (read at the next log step) and nothing non-finite is saved;
- the bench itself runs on CPU and writes its rows (GPU rows stay unmeasured).
"""

from __future__ import annotations

import glob
import json
import math
import os

import pytest
import torch
from test_train import QWEN_ARGS as QWEN

from dilocox.bench import reference as R
from tests.small_run import small_cfg


def _cfg(tmp, *extra, steps=12):
    return small_cfg(str(tmp), "--train.eval_batches=0", "--checkpoint.every=0", *extra, steps=steps)


def _trainer(cfg):
    from dilocox.train import Trainer

    return Trainer(cfg)


def _close(tr):
    if tr.run_lock is not None:
        tr.run_lock.release()
    tr.logger.close()


@pytest.mark.parametrize("arch", ["gpt2", "qwen", "qwen-fused-qkv-torch-loss", "gpt2-fp8-all", "gpt2-fp8-all-fast"])
def test_train_compile_has_no_graph_breaks_at_tp_pp_1(tmp_path, arch, monkeypatch):
    from torch._dynamo.utils import counters

    # graph breaks are dynamo's (the trace); aot_eager also traces the backward (AOTAutograd) but generates no
    # inductor code: the same graphs and breaks as train.compile's default backend, in seconds instead of minutes
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "aot_eager"}))
    torch._dynamo.reset()
    counters.clear()
    fused = ["--model.fused_qkv=true", "--model.loss_backend=torch"] if arch.endswith("torch-loss") else []
    if "fp8" in arch:  # fp8_all: emulated on this CPU, or (-fast) through torch._scaled_mm as on a Hopper GPU
        fused = ["--model.linear_backend=fp8_all"]
        if arch.endswith("fast"):
            monkeypatch.setattr("dilocox.model.fp8.emulation_reason", lambda device, shape=None: None)
    tr = _trainer(_cfg(tmp_path, "--train.compile=true", *(QWEN if "qwen" in arch else ()), *fused, steps=3))
    try:
        losses = [tr.train_step() for _ in range(2)]
    finally:
        _close(tr)
    assert all(math.isfinite(x) for x in losses)
    assert int(counters["stats"]["unique_graphs"]) >= 1, dict(counters["stats"])  # it did compile
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    # one graph for forward + loss: the blocks are not compiled one by one at TP = PP = 1
    assert int(counters["stats"]["unique_graphs"]) == 1, dict(counters["stats"])
    torch._dynamo.reset()


def _count_syncs(tr, steps):
    t0 = 0.0
    tr.start_clock(t0)
    with R.SyncCounter(R.optimizer_step_tensors(tr.optimizer)) as sc:
        for _ in range(steps):
            tr.loop_step(0, t0, False)
    return sc


def test_no_host_sync_inside_a_step_between_two_log_steps(tmp_path):
    tr = _trainer(_cfg(tmp_path, "--log.every=5", "--optim.grad_clip=1.0", steps=40))
    try:
        tr.defer_sync = True  # what run() sets
        _count_syncs(tr, 2)  # the optimizer state exists from here on
        while tr.step % 5:  # start at a log-step boundary
            tr.loop_step(0, 0.0, False)
        sc = _count_syncs(tr, 10)
        assert sc.count == 2, sc.calls  # one read of the pending losses and grad norms per log step, nothing else
        assert all("train.py" in k and "tolist" in k for k in sc.calls), sc.calls
        recs = [r for r in tr.history if r["step"] <= tr.step]
        assert all(isinstance(r["loss"], float) and isinstance(r["grad_norm"], float) for r in recs)

        # the counter catches a per-step sync: the same loop with the loss read at every step (defer_sync off)
        tr.defer_sync = False
        sc = _count_syncs(tr, 10)
        assert sc.count >= 10, sc.calls
    finally:
        _close(tr)


@pytest.mark.parametrize("arch", ["gpt2", "qwen"])
def test_the_reference_loop_computes_dilocox_loss_from_the_same_weights(tmp_path, arch):
    from dilocox.optim import lr_at

    cfg = _cfg(tmp_path, "--optim.grad_clip=1.0", *(QWEN if arch == "qwen" else ()), steps=8)
    tr = _trainer(cfg)
    try:
        ref = R.ReferenceSide(cfg, weights=tr.model.state_dict())
        x, y = ref.sampler.batch_at(0)
        with torch.no_grad():  # the same function: the losses agree to float32 rounding before any step
            mine = tr.model.loss(tr.model(x), y).item()
            theirs = ref.loop.model(x, y).item()
        assert abs(mine - theirs) <= 1e-5 * abs(mine), (mine, theirs)
        for step in range(4):  # and after AdamW steps (theirs foreach, ours per tensor: rounding only)
            a = tr.train_step()
            bx, by = ref.sampler.next_batch()
            b = ref.loop.step(bx, by, lr=lr_at(step, cfg)).item()
            assert abs(a - b) <= 2e-4 * abs(a), (step, a, b)
    finally:
        _close(tr)


def test_a_non_finite_loss_stops_the_run_at_the_next_log_step_and_is_never_saved(tmp_path):
    tr = _trainer(_cfg(tmp_path, "--log.every=4", "--checkpoint.every=8", steps=12))
    orig = tr.engine.forward_backward_async

    def bad(x, y):
        loss = orig(x, y)
        return loss * float("nan") if tr.step == 5 else loss

    tr.engine.forward_backward_async = bad
    try:
        # (the 6th step's loss: metrics.jsonl numbers it 6; the message said 5, the 0-based index)
        with pytest.raises(FloatingPointError, match="loss is nan at step 6 .*; stopped at step 8") as e:
            tr.run()
        # (the clip is on by default: the advice names its value, not "set optim.grad_clip"; found by review)
        assert "a lower optim.grad_clip (now 1)" in str(e.value), str(e.value)
    finally:
        _close(tr)
    assert glob.glob(os.path.join(str(tmp_path), "checkpoints", "step_*")) == []
    recs = [json.loads(line) for line in open(os.path.join(str(tmp_path), "metrics.jsonl"))]
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3, 4, 5]  # the good records before it are logged


def test_bench_train_reference_runs_on_cpu_and_keeps_gpu_rows_unmeasured(tmp_path):
    out = tmp_path / "out"
    argv = ["--device", "cpu", "--cases", "tiny", "--modes", "eager", "--steps", "3", "--warmup", "1"]
    assert R.main([*argv, "--out", str(out), "--md", str(out / "results.md")]) == 0
    rows = json.load(open(out / "results.json"))
    cpu = [r for r in rows if r["gpu"].startswith("none (CPU")]
    assert [(r["model"], r["mode"]) for r in cpu] == [("tiny", "eager")]
    r = cpu[0]
    assert r["dilocox_tokens_per_s"] > 0 and r["reference_tokens_per_s"] > 0 and r["ratio"] > 0
    assert r["mfu"] is None  # no peak FLOP/s for a CPU: no MFU invented
    assert r["dilocox"]["syncs_per_step"] <= 0.1 + 1e-9  # one read per 10 steps
    gpu = [r for r in rows if not r["gpu"].startswith("none")]
    assert {(r["model"], r["mode"]) for r in gpu} == set(R.GPU_TABLE)
    assert all(r["gpu"].startswith("unmeasured") and r["dilocox_tokens_per_s"] is None for r in gpu)
    assert "unmeasured" in (out / "results.md").read_text()


@pytest.mark.slow  # inductor compiles forward and backward on the CPU: ~30-90 s on 2 shared cores
def test_whole_model_compile_trains_as_eager_and_keeps_the_parameter_names(tmp_path):
    torch._dynamo.reset()
    runs = {}
    for mode in ("eager", "compiled"):
        tr = _trainer(_cfg(tmp_path / mode, f"--train.compile={'true' if mode == 'compiled' else 'false'}", steps=4))
        try:
            runs[mode] = ([tr.train_step() for _ in range(4)], sorted(tr.model.state_dict()))
        finally:
            _close(tr)
    (eager, names), (compiled, names_c) = runs["eager"], runs["compiled"]
    assert names_c == names and "layers.0.attn.q_proj.weight" in names  # not wrapped: checkpoints unchanged
    assert max(abs(a - b) / abs(a) for a, b in zip(eager, compiled)) < 1e-4, (eager, compiled)
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--modes", "foo"], "--modes 'foo': unknown word"),  # (ran as eager, saved a row named foo, exit 0)
        (["--modes", "eager, compiled"], "exactly one of eager or compiled"),
        (["--modes", "compiled, comm stream"], "add 'dilocox preset'"),
        (["--cases", "nope"], "--cases 'nope': not a case"),  # (a KeyError line, exit 0)
        (["--steps", "0"], "steps must be >= 1"),  # (a ZeroDivisionError line, exit 0)
    ],
)
def test_bench_train_reference_refuses_bad_arguments_before_running(args, needle, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        R.main(["--device", "cpu", "--out", str(tmp_path), *args])
    assert e.value.code == 2 and needle in capsys.readouterr().err
    assert not os.listdir(tmp_path)


def test_bench_train_reference_writes_its_table_beside_its_out(tmp_path, monkeypatch):
    """Found by review: ``--out`` elsewhere still rewrote docs/bench/gpu-train-reference/results.md (the table's
    default) with the other file's rows. The table goes to OUT/results.md unless --out is the docs' own."""
    row = {"gpu": "none (CPU: x)", "dilocox_tokens_per_s": 1.0, "reference_tokens_per_s": 1.0, "ratio": 1.0}
    monkeypatch.setattr(R, "run_case", lambda case, mode, *a: {"model": case, "mode": mode, **row})
    monkeypatch.setattr(R, "markdown", lambda rows: f"{len(rows)} rows")
    monkeypatch.chdir(tmp_path)  # (the docs' default paths, relative, land here if written)
    out = tmp_path / "elsewhere"
    assert R.main(["--device", "cpu", "--cases", "tiny", "--modes", "eager", "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["results.json", "results.md"]
    assert not (tmp_path / "docs").exists()
    assert R.main(["--device", "cpu", "--cases", "tiny", "--modes", "eager", "--out", R.DEFAULT_OUT]) == 0
    assert (tmp_path / R.DEFAULT_MD).exists()  # (the docs' own --out: the docs' table)
