"""PipelineEngine against the 1-process model: loss and every gradient, for every schedule.

Each multi-rank layout is spawned once (module-scoped fixtures) and runs all its cases; the
tests then compare the returned losses / grads with the same-seed model built in this process
on the full batch. TP shards are compared slice-wise with the full gradients.
"""

from __future__ import annotations

import os

import pytest
import torch

from dilocox.config import ModelConfig, ParallelConfig, load_config
from dilocox.distributed.topology import build_topology
from dilocox.engine import PipelineEngine
from dilocox.model.parallel_layers import is_tensor_parallel, shard_tensor
from dilocox.model.transformer import build_stage_model
from tests.spawn import run_ranks

SEED, BATCH, SEQ = 7, 4, 16
LOSS_TOL, GRAD_RTOL = 1e-5, 1e-4

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "model")
MODELS = {"gpt2": "gpt2-tiny.yaml", "qwen": "qwen-tiny.yaml"}  # the repo's debug models


def mcfg_of(arch: str) -> ModelConfig:
    return load_config(os.path.join(CONFIGS, MODELS[arch])).model


def batch(arch: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    ids = torch.randint(0, mcfg_of(arch).vocab_size, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def reference(arch: str) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and grads of the 1-process model on the full batch (mean token loss)."""
    model = build_stage_model(mcfg_of(arch), 0, 1, 0, 1, None, SEED)
    tokens, labels = batch(arch)
    loss = model.loss(model(tokens), labels)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


REF = {}


def ref(arch: str):
    if arch not in REF:
        REF[arch] = reference(arch)
    return REF[arch]


# --------------------------------------------------------------------------- rank side


def _run_case(topo, pcfg: ParallelConfig, arch: str, steps: int = 1, autocast=None) -> dict:
    mcfg = mcfg_of(arch)
    model = build_stage_model(mcfg, topo.stage, topo.P, topo.tp_rank, topo.T, topo.group("tp"), SEED)
    engine = PipelineEngine(model, topo, pcfg, mcfg, SEQ, "cpu", autocast_dtype=autocast)
    tokens, labels = batch(arch)
    losses = [engine.forward_backward(tokens, labels) for _ in range(steps)]
    # numpy, not tensors: torch's queue would share tensors through fds that die with the rank
    grads = {
        n: (p.grad.numpy().copy(), p.partition_dim if is_tensor_parallel(p) else None, topo.tp_rank, topo.T)
        for n, p in model.named_parameters()
    }
    return {"losses": losses, "eval": engine.evaluate(tokens, labels), "grads": grads}


def _job(rank: int, world: int, layouts: list[tuple[dict, list[tuple]]]) -> dict:
    """Run every (schedule, arch, microbatches[, autocast]) case of every layout, keyed by case."""
    out = {}
    for layout, cases in layouts:
        base = ParallelConfig(**layout)
        topo = build_topology(base)
        for case in cases:
            schedule, arch, mb, autocast = (*case, None)[:4]
            pcfg = ParallelConfig(**layout, schedule=schedule, microbatches=mb)
            # fp32 gpipe runs two steps: grads must accumulate (the schedule must not rescale them)
            steps = 2 if schedule == "gpipe" and autocast is None else 1
            out[(tuple(sorted(layout.items())), *case)] = _run_case(topo, pcfg, arch, steps, autocast)
    return out


PP2 = ({"pipeline": 2}, [(s, a, mb) for a in MODELS for s, mb in (("gpipe", 2), ("1f1b", 4), ("reference", 2))])
DP2 = ({"data": 2}, [("1f1b", a, 2) for a in MODELS])
PP2_BF16 = ({"pipeline": 2}, [(s, "qwen", 2, torch.bfloat16) for s in ("gpipe", "1f1b", "reference")])
PP2_TP2 = ({"pipeline": 2, "tensor": 2}, [(s, a, mb) for a in MODELS for s, mb in (("1f1b", 2), ("reference", 2))])


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(2, _job, [PP2, DP2, PP2_BF16])


@pytest.fixture(scope="module")
def four_ranks():  # the slowest part of this file (4 spawned ranks); kept in the default run
    return run_ranks(4, _job, [PP2_TP2])


# --------------------------------------------------------------------------- checks


def _check(results: list[dict], layout: dict, schedule: str, arch: str, mb: int) -> None:
    key = (tuple(sorted(layout.items())), schedule, arch, mb)
    ref_loss, ref_grads = ref(arch)
    steps = len(results[0][key]["losses"])
    seen = set()
    for rank, res in enumerate(results):
        r = res[key]
        for loss in r["losses"]:
            assert abs(loss - ref_loss) <= LOSS_TOL, f"rank {rank} {key}: loss {loss} != {ref_loss}"
        assert abs(r["eval"] - ref_loss) <= LOSS_TOL, f"rank {rank} {key}: eval {r['eval']} != {ref_loss}"
        assert r["losses"] == results[0][key]["losses"], "the loss must be identical on every rank"
        for name, (grad, pdim, tp_rank, T) in r["grads"].items():
            grad = torch.from_numpy(grad)
            want = steps * ref_grads[name]
            if pdim is not None:
                want = shard_tensor(want, pdim, tp_rank, T)
            assert grad.shape == want.shape, f"{name}: {grad.shape} vs {want.shape}"
            err = (grad - want).abs().max().item()
            assert err <= GRAD_RTOL * want.abs().max().item() + 1e-7, f"rank {rank} {key} {name}: max err {err}"
            seen.add(name)
    assert seen == set(ref_grads), f"parameters never checked: {set(ref_grads) - seen}"


@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("schedule,mb", [("gpipe", 2), ("1f1b", 4), ("reference", 2)])
def test_pp2_matches_single_process(two_ranks, schedule, mb, arch):
    _check(two_ranks, PP2[0], schedule, arch, mb)


@pytest.mark.parametrize("arch", list(MODELS))
def test_dp2_matches_full_batch(two_ranks, arch):
    _check(two_ranks, DP2[0], "1f1b", arch, 2)


@pytest.mark.slow  # the four_ranks fixture: ~12 s on 2 cores
@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("schedule", ["1f1b", "reference"])
def test_pp2_tp2_matches_single_process(four_ranks, schedule, arch):
    _check(four_ranks, PP2_TP2[0], schedule, arch, 2)


def test_single_process_microbatching_matches():
    """P = D = T = 1: plain grad accumulation over 4 microbatches, and evaluate()."""
    pcfg = ParallelConfig(microbatches=4, schedule="gpipe")
    topo = build_topology(pcfg)
    for arch in MODELS:
        mcfg = mcfg_of(arch)
        model = build_stage_model(mcfg, 0, 1, 0, 1, None, SEED)
        engine = PipelineEngine(model, topo, pcfg, mcfg, SEQ, "cpu")
        tokens, labels = batch(arch)
        ref_loss, ref_grads = ref(arch)
        assert abs(engine.forward_backward(tokens, labels) - ref_loss) <= LOSS_TOL
        assert abs(engine.evaluate(tokens, labels) - ref_loss) <= LOSS_TOL
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=GRAD_RTOL, atol=1e-7)


def test_bad_batch_names_the_fields():
    pcfg = ParallelConfig(microbatches=3)
    mcfg = mcfg_of("gpt2")
    engine = PipelineEngine(build_stage_model(mcfg, seed=SEED), build_topology(pcfg), pcfg, mcfg, SEQ, "cpu")
    tokens, labels = batch("gpt2")
    with pytest.raises(ValueError, match="parallel.microbatches"):
        engine.forward_backward(tokens, labels)
    with pytest.raises(ValueError, match="seq_len"):
        engine.forward_backward(tokens[:, :8], labels[:, :8])


def test_pp2_bf16_autocast_schedules_agree(two_ranks):
    """bf16 autocast: activations cross stages in bf16; every schedule computes the same thing
    (same ops in the same microbatch order), close to the 1-process bf16 model."""
    layout = tuple(sorted(PP2_BF16[0].items()))
    runs = {
        s: [res[(layout, s, "qwen", 2, torch.bfloat16)] for res in two_ranks] for s in ("gpipe", "1f1b", "reference")
    }
    model = build_stage_model(mcfg_of("qwen"), 0, 1, 0, 1, None, SEED)
    tokens, labels = batch("qwen")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
    want = model.loss(logits.float(), labels).item()
    assert abs(runs["reference"][0]["losses"][0] - want) < 2e-2
    for s in ("gpipe", "1f1b"):
        for rank in range(2):
            got, oracle = runs[s][rank], runs["reference"][rank]
            assert abs(got["losses"][0] - oracle["losses"][0]) <= LOSS_TOL
            assert abs(got["eval"] - oracle["eval"]) <= LOSS_TOL
            for name, (g, *_rest) in got["grads"].items():
                torch.testing.assert_close(
                    torch.from_numpy(g), torch.from_numpy(oracle["grads"][name][0]), rtol=GRAD_RTOL, atol=1e-6
                )
