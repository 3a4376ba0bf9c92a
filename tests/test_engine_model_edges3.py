"""Edge cases of the pipeline engine and the tensor-parallel model (third review).

- The engine compared only first/last of the stage model with this rank's place in the grid: a model cut for
  another number of stages (stage 0 of 4 and stage 3 of 4 on a 2-stage grid) trained a 2-of-4-layer model with no
  error (loss 4.1770 vs the 1-process 4.1802 on the tiny GPT-2), and a model without this rank's TP slice went on.
- ``seq_len > model.max_seq_len`` with learned positions was accepted by the engine: the first stage failed at its
  first forward while the other stages waited on its activations until the group's timeout.
- Layouts the other files do not run (PP x DP, TP x DP with tied embeddings, PP x TP under GPipe with M not a multiple
  of P, TP = 4 with tied embeddings): loss, every gradient and the clipping norm against the 1-process model.
"""

from __future__ import annotations

import pytest
import torch

from dilocox.config import ConfigError, ModelConfig, ParallelConfig
from dilocox.distributed.topology import build_topology
from dilocox.engine import PipelineEngine
from dilocox.model.parallel_layers import global_grad_norm, is_tensor_parallel, shard_tensor
from dilocox.model.transformer import build_stage_model
from tests.spawn import run_ranks
from tests.test_model import QWEN

SMALL = dict(n_layers=4, n_heads=4, d_model=32, vocab_size=64, max_seq_len=32)
MODELS = {
    "gpt2": ModelConfig(**SMALL),
    "tied": ModelConfig(tie_embeddings=True, **SMALL),
    "qwen": ModelConfig(n_kv_heads=2, d_ff=88, **QWEN, **SMALL),
}
SEQ, SEED = 8, 5


def _batch(n: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (n, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _grid(rank: int, **layout):
    """A rank's coordinates in a grid, without process groups (no process group is started)."""
    pcfg = ParallelConfig(schedule="1f1b", microbatches=2, **layout)
    return pcfg, build_topology(pcfg, rank=rank, world_size=pcfg.world_size)


# --------------------------------------------------------------------------- the stage model against the grid


@pytest.mark.parametrize(
    "rank,stage,n_stages",
    [(0, 0, 4), (1, 3, 4)],  # first and last stage of a 4-stage cut on a 2-stage grid: first/last flags agree
)
def test_engine_refuses_a_stage_model_cut_for_another_number_of_stages(rank, stage, n_stages):
    mcfg = MODELS["gpt2"]
    pcfg, topo = _grid(rank, pipeline=2)
    model = build_stage_model(mcfg, stage, n_stages, seed=SEED)
    with pytest.raises(ValueError, match=rf"n_stages={n_stages} \(this rank: 2\)"):
        PipelineEngine(model, topo, pcfg, mcfg, SEQ, "cpu")
    PipelineEngine(build_stage_model(mcfg, rank, 2, seed=SEED), topo, pcfg, mcfg, SEQ, "cpu")  # the right cut


def test_engine_refuses_a_middle_stage_of_another_rank():
    mcfg = MODELS["gpt2"]
    pcfg, topo = _grid(1, pipeline=4)  # stage 1 of 4
    with pytest.raises(ValueError, match=r"stage=2 \(this rank: 1\)"):
        PipelineEngine(build_stage_model(mcfg, 2, 4, seed=SEED), topo, pcfg, mcfg, SEQ, "cpu")


def test_engine_refuses_a_model_without_this_ranks_tensor_parallel_slice():
    mcfg = MODELS["gpt2"]
    pcfg, topo = _grid(1, tensor=2)
    with pytest.raises(ValueError, match=r"tp_size=1 \(this rank: 2\)"):
        PipelineEngine(build_stage_model(mcfg, seed=SEED), topo, pcfg, mcfg, SEQ, "cpu")


def test_engine_refuses_a_sequence_longer_than_the_learned_positions():
    """Every stage refuses it when built (the last one too: it would have waited for the first one's activations)."""
    mcfg = MODELS["gpt2"]
    for rank in (0, 1):
        pcfg, topo = _grid(rank, pipeline=2)
        model = build_stage_model(mcfg, rank, 2, seed=SEED)
        with pytest.raises(ConfigError, match="max_seq_len=32"):
            PipelineEngine(model, topo, pcfg, mcfg, mcfg.max_seq_len + 8, "cpu")
        PipelineEngine(model, topo, pcfg, mcfg, mcfg.max_seq_len, "cpu")


# --------------------------------------------------------------------------- layouts against one process

CASES = [  # (layout, schedule, microbatches, model, batch, steps)
    ({"pipeline": 2, "data": 2}, "1f1b", 2, "gpt2", 8, 2),
    ({"tensor": 2, "data": 2}, "1f1b", 2, "tied", 4, 1),
    ({"pipeline": 2, "tensor": 2}, "gpipe", 3, "qwen", 6, 1),
    ({"tensor": 4}, "1f1b", 2, "tied", 4, 1),
]


def _run(layout: dict, schedule: str, M: int, name: str, n: int, steps: int) -> dict:
    pcfg = ParallelConfig(**layout, schedule=schedule, microbatches=M)
    topo = build_topology(pcfg)
    mcfg = MODELS[name]
    model = build_stage_model(mcfg, topo.stage, topo.P, topo.tp_rank, topo.T, topo.group("tp"), SEED)
    engine = PipelineEngine(model, topo, pcfg, mcfg, SEQ, "cpu")
    x, y = _batch(n, mcfg.vocab_size)
    losses = [engine.forward_backward(x, y) for _ in range(steps)]
    norm = global_grad_norm(list(model.parameters()), topo.tp_rank, topo.group("mp")).item()
    grads = {
        n: (p.grad.numpy().copy(), p.partition_dim if is_tensor_parallel(p) else None, topo.tp_rank, topo.T)
        for n, p in model.named_parameters()
    }
    return {"losses": losses, "eval": engine.evaluate(x, y), "norm": norm, "grads": grads}


def _job(rank: int, world: int) -> list[dict]:
    return [_run(*case) for case in CASES]


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(4, _job, timeout=240)


@pytest.mark.slow  # 4 spawned ranks, 4 layouts: ~15 s on 2 cores
@pytest.mark.parametrize(
    "i", range(len(CASES)), ids=[f"{'x'.join(f'{k}{v}' for k, v in c[0].items())}-{c[3]}" for c in CASES]
)
def test_layouts_match_one_process(four_ranks, i):
    layout, schedule, M, name, n, steps = CASES[i]
    model = build_stage_model(MODELS[name], seed=SEED)
    x, y = _batch(n, MODELS[name].vocab_size)
    for _ in range(steps):
        loss = model.loss(model(x), y)
        loss.backward()
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    ref = dict(model.named_parameters())
    seen = set()
    for rank, res in enumerate(four_ranks):
        r = res[i]
        assert all(abs(v - loss.item()) < 1e-5 for v in r["losses"]), (rank, r["losses"], loss.item())
        assert abs(r["eval"] - loss.item()) < 1e-5
        assert abs(r["norm"] - ref_norm) < 1e-5 * ref_norm, (rank, r["norm"], ref_norm)
        for pname, (g, pdim, tp_rank, T) in r["grads"].items():
            want = ref[pname].grad if pdim is None else shard_tensor(ref[pname].grad, pdim, tp_rank, T)
            err = (torch.from_numpy(g) - want).abs().max().item()
            assert err <= 1e-4 * want.abs().max().item() + 1e-7, f"rank {rank} {pname}: max err {err}"
            seen.add(pname)
    assert seen == set(ref), f"parameters never compared: {set(ref) - seen}"
