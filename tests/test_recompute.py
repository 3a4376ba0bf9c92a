"""``train.recompute`` (activation recomputation, dilocox/model/recompute.py): every mode trains bit-identically to
``none`` (losses and every gradient, dropout included: the RNG state is restored for the recomputed forward), on one
process, through the pipeline and through tensor parallelism (whose all-reduces run again in the recomputed
forward); ``full`` and ``selective`` hold fewer bytes than ``none``, ``selective`` more than ``full``; compiled, the
recomputed model still has no graph break; the bench measures the trade."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_train import QWEN_ARGS as QWEN

from dilocox.bench.memory import ActivationMeter
from dilocox.config import ConfigError, load_config
from dilocox.config.checks import _CHOICES
from dilocox.model.recompute import MODES
from dilocox.model.transformer import build_model
from tests.small_run import small_cfg
from tests.spawn import run_ranks

TINY = "configs/tiny.yaml"


def _step(cfg, mode: str, x, y):
    """Loss, every gradient, the bytes held after the forward and the peak over forward + backward."""
    m = build_model(cfg.model, seed=1)
    m.recompute = mode
    torch.manual_seed(5)  # the dropout masks
    with ActivationMeter() as meter:
        loss = m.loss(m(x), y)
        held = meter.current
        loss.backward()
    return loss.item(), {n: p.grad for n, p in m.named_parameters()}, held, meter.peak


@pytest.mark.parametrize("arch", ["gpt2", "qwen", "gpt2-fp8", "gpt2-fp8_all"])
def test_every_mode_gives_the_same_loss_and_gradients_bit_for_bit(arch):
    """(``gpt2-fp8``: model.linear_backend=fp8, emulated on the CPU: its per-tensor scales are recomputed from the
    same inputs, so the recomputed forward quantizes the same way; ``gpt2-fp8_all`` the same with the backward GEMMs in
    fp8, whose saved fp8 operands are recomputed too)"""
    fp8 = [f"--model.linear_backend={arch.split('-')[1]}"] if "fp8" in arch else []
    cfg = load_config(TINY, [*(QWEN if arch == "qwen" else ()), *fp8, "--model.dropout=0.1"])
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.model.vocab_size, (4, 64), generator=g) for _ in range(2))
    runs = {mode: _step(cfg, mode, x, y) for mode in MODES}
    loss, grads, held, peak = runs["none"]
    for mode in ("full", "selective"):
        assert runs[mode][0] == loss, mode
        assert all(torch.equal(runs[mode][1][n], grads[n]) for n in grads), mode
    # what each mode keeps between the forward and the backward, and at the peak
    assert runs["full"][2] < 0.3 * held, (runs["full"][2], held)
    assert runs["full"][2] < runs["selective"][2] < held, (runs["full"][2], runs["selective"][2], held)
    assert runs["full"][3] < 0.6 * peak and runs["selective"][3] < peak, (runs["full"][3], runs["selective"][3], peak)
    # dropout drew masks (a mode that lost the RNG state would have differed): the loss is not the eval loss
    cfg0 = load_config(TINY, [*(QWEN if arch == "qwen" else ()), *fp8])
    assert _step(cfg0, "none", x, y)[0] != loss


def test_evaluation_runs_the_blocks_plainly():
    cfg = load_config(TINY, [])
    m = build_model(cfg.model, seed=1)
    m.recompute = "full"
    x = torch.randint(0, cfg.model.vocab_size, (2, 16))
    with torch.no_grad(), ActivationMeter() as meter:
        out = m(x)
    m.recompute = "none"
    with torch.no_grad():
        assert torch.equal(out, m(x))
    assert meter.peak > 0


def _losses(rank, world, tmp, extra, steps):
    from dilocox.train import Trainer

    out = {}
    for mode in ("none", *extra[-1:]):
        t = Trainer(small_cfg(f"{tmp}/{mode}", "--checkpoint.resume=none", "--checkpoint.every=0",
                              f"--train.recompute={mode}", *extra[:-1], steps=steps))  # fmt: skip
        out[mode] = [t.train_step() for _ in range(steps)]
        if t.run_lock is not None:
            t.run_lock.release()
        t.logger.close()
    return out


@pytest.mark.parametrize(
    "layout",
    [
        ["--parallel.pipeline=2", "--parallel.microbatches=2", "--model.dropout=0.1", "full"],
        ["--parallel.tensor=2", "--model.dropout=0.1", "selective"],
    ],
    ids=["pp2-full-dropout", "tp2-selective-dropout"],
)
def test_the_trainer_with_recompute_follows_the_same_losses(tmp_path, layout):
    for out in run_ranks(2, _losses, str(tmp_path), layout, 3):
        (mode,) = set(out) - {"none"}
        assert out[mode] == out["none"] and all(math.isfinite(v) for v in out[mode]), out


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_compiled_with_recompute_has_no_graph_breaks(tmp_path, mode, monkeypatch):
    from torch._dynamo.utils import counters

    from dilocox.train import Trainer

    compile_ = torch.compile  # aot_eager: dynamo's graphs and breaks, without inductor's code generation
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "aot_eager"}))
    torch._dynamo.reset()
    counters.clear()
    t = Trainer(small_cfg(str(tmp_path), "--train.compile=true", f"--train.recompute={mode}",
                          "--checkpoint.every=0", "--train.eval_batches=0", steps=3))  # fmt: skip
    try:
        losses = [t.train_step() for _ in range(2)]
    finally:
        if t.run_lock is not None:
            t.run_lock.release()
        t.logger.close()
    assert all(math.isfinite(v) for v in losses)
    assert int(counters["stats"]["unique_graphs"]) == 1, dict(counters["stats"])
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_blocks_compiled_one_by_one_recompute_bit_for_bit(mode, monkeypatch):
    """Under P > 1 or T > 1, ``train.compile`` compiles each block by itself (train.py) and the checkpoint then wraps
    a compiled block: the recomputed forward runs the compiled graph again, and ``selective``'s policy sees the
    graph's ops from inside it. Losses and every gradient equal the eager model's without recompute."""
    compile_ = torch.compile  # aot_eager: the same aten ops as eager, without inductor's code generation
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "aot_eager"}))
    torch._dynamo.reset()
    cfg = load_config(TINY, [])
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.model.vocab_size, (2, 32), generator=g) for _ in range(2))
    loss, grads, *_ = _step(cfg, "none", x, y)
    m = build_model(cfg.model, seed=1)
    m.recompute = mode
    for block in m.layers.values():
        block.compile()
    torch.manual_seed(5)
    got = m.loss(m(x), y)
    got.backward()
    assert got.item() == loss
    assert all(torch.equal(p.grad, grads[n]) for n, p in m.named_parameters()), mode
    torch._dynamo.reset()


def test_config_names_the_modes():
    assert tuple(_CHOICES["train.recompute"]) == MODES
    with pytest.raises(ConfigError, match=r"train.recompute='ful' is not one of .*did you mean 'full'"):
        load_config(TINY, ["--train.recompute=ful"])


def test_bench_memory_writes_its_rows(tmp_path):
    from dilocox.bench import memory

    assert memory.main(["--cases", "tiny", "--warmup", "1", "--steps", "2", "--out", str(tmp_path)]) == 0
    rows = {r["recompute"]: r for r in json.loads((tmp_path / "results.json").read_text())}
    assert set(rows) == set(MODES)
    assert rows["full"]["held_bytes"] < rows["selective"]["held_bytes"] < rows["none"]["held_bytes"]
    assert rows["full"]["peak_bytes"] < rows["none"]["peak_bytes"]
    assert rows["none"]["held_vs_none"] == 1.0 and rows["full"]["step_s"] > 0
    assert "| tiny (" in (tmp_path / "results.md").read_text()
