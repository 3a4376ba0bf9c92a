"""Lossy compression keeps tensor-parallel replicas of a parameter bit-identical.

Parameters not tagged ``tensor_parallel`` (norms, row-parallel biases, position embeddings)
are replicated: every TP rank holds the same copy and computes the same update. The outer
all-reduce compresses each TP rank's shard on its own, and its quantization groups, top-k
and error feedback must therefore see a replicated tensor alone: if a group mixed it with
the rank's sharded values (which differ per TP rank), the copies would drift apart.
"""

from __future__ import annotations

import math

import pytest
import torch

from dilocox.compress.cocktail import cocktail_allreduce, cocktail_payload_bytes
from dilocox.compress.collectives import nbytes
from dilocox.compress.compressor import Compressor
from dilocox.compress.quant import dequantize, quantize
from dilocox.config import CompressConfig, LowRankConfig, ModelConfig, OuterConfig, ParallelConfig
from dilocox.distributed.topology import build_topology
from dilocox.model.parallel_layers import is_tensor_parallel
from dilocox.model.transformer import build_stage_model, param_layer_id
from dilocox.outer import build_outer
from tests.spawn import run_ranks

# one TP rank's shard: sharded tensors (different on each TP rank) around replicated ones
SHAPES = [
    torch.Size([24, 40]),
    torch.Size([40]),
    torch.Size([7]),
    torch.Size([16, 48]),
    torch.Size([33]),
    torch.Size([3, 50]),
]
REPLICATED = [1, 3, 4]  # [40] norm weight, [16, 48] position embedding (factored by PowerSGD), [33] bias


def _up(k: int, g: int) -> int:
    return math.ceil(k / g) * g


def _tp_inputs(tp: int, step: int) -> list[torch.Tensor]:
    """Replicated tensors: the same on both TP ranks; sharded ones: this rank's own values."""
    same = torch.Generator().manual_seed(100 + step)
    own = torch.Generator().manual_seed(1000 * (tp + 1) + step)
    return [
        torch.randn(s, generator=same if i in REPLICATED else own) * (1 + 9 * (i not in REPLICATED))
        for i, s in enumerate(SHAPES)
    ]


def test_compressor_result_of_a_tensor_depends_on_it_alone():
    for kind, G, rank in (("int4", 32, None), ("int8", 16, None), ("int4", 32, 2), ("int4", 128, 2)):
        comps = [
            Compressor(SHAPES, quant=kind, group_size=G, lowrank_rank=rank, seed=3, tail_sketch=rank is not None)
            for _ in range(2)
        ]
        for step in range(3):  # error feedback carries each tensor's residual to the next step
            ins = [_tp_inputs(tp, step) for tp in range(2)]
            outs = [c.allreduce_mean(x, None, step) for c, x in zip(comps, ins)]
            for i in REPLICATED:
                assert torch.equal(outs[0][i], outs[1][i]), (kind, G, rank, i)
                assert torch.equal(comps[0].errors[i], comps[1].errors[i]), (kind, G, rank, i)
            assert not torch.equal(outs[0][0], outs[1][0])  # the sharded tensors really differ
            if step == 0 and rank is None:  # a plain-quantized tensor is quantized exactly as on its own
                for i in range(len(SHAPES)):
                    assert torch.equal(outs[0][i].reshape(-1), dequantize(quantize(ins[0][i].reshape(-1), kind, G))), (
                        kind,
                        i,
                    )
        fact = [i for i, s in enumerate(SHAPES) if rank and len(s) == 2 and (s[0] + s[1]) * rank * 2 < s.numel()]
        if rank is not None:  # the replicated matrix goes through PowerSGD; its tail estimate agrees too
            j = fact.index(3)
            assert torch.equal(comps[0].tail_energy()[j], comps[1].tail_energy()[j])
        # bytes: every segment padded to whole groups (each P_i; each Q_i, 128 sketch values, rest tensor)
        rest = [i for i in range(len(SHAPES)) if i not in fact]
        n1 = sum(_up(rank * SHAPES[i][0], G) for i in fact)
        n2 = sum(_up(rank * SHAPES[i][1], G) + _up(128, G) for i in fact) + sum(_up(SHAPES[i].numel(), G) for i in rest)
        assert comps[0].payload_bytes() == nbytes(kind, n1, G) + nbytes(kind, n2, G), (kind, G, rank)


def test_cocktail_result_of_a_tensor_depends_on_it_alone():
    sizes = [s.numel() for s in SHAPES]
    cfg = CompressConfig(quant="int4", group_size=32, random_fraction=0.3, topk_fraction=0.25)
    errs = [torch.zeros(sum(sizes)) for _ in range(2)]
    for step in range(3):
        ins = [torch.cat([t.reshape(-1) for t in _tp_inputs(tp, step)]) for tp in range(2)]
        outs = [cocktail_allreduce(x, None, e, cfg, step, seed=5, sizes=sizes) for x, e in zip(ins, errs)]
        parts = [[o.split(sizes) for o in pair] for pair in (outs, errs)]
        for i in REPLICATED:
            for a, b in parts:
                assert torch.equal(a[i], b[i]), (step, i)
        assert not torch.equal(parts[0][0][0], parts[0][1][0])
    # per tensor: K_i = ceil(0.3 n_i) survivors, k_i = ceil(0.25 K_i) values quantized on their own
    Ks = [math.ceil(0.3 * n) for n in sizes]
    ks = [math.ceil(0.25 * K) for K in Ks]
    want = min(math.ceil(sum(Ks) / 8), 4 * sum(ks)) + sum((k + 1) // 2 + 2 * math.ceil(k / 32) for k in ks)
    assert cocktail_payload_bytes(sizes, 0.3, 0.25, "int4", 32) == want


# ----------------------------------------------------------------------------- R=2 x T=2 training

MODEL = ModelConfig(
    n_layers=2, n_heads=4, d_model=48, vocab_size=64, max_seq_len=64
)  # pos_embed 64x48: factored up to rank 13
CASES = {
    "diloco_int4": dict(method="diloco", quant="int4"),
    "diloco_int4_reduce_scatter": dict(method="diloco", quant="int4", collective="reduce_scatter"),
    "lowrank_int4": dict(method="diloco", quant="int4", lowrank=2, overlap="delayed"),
    "cocktailsgd_int4": dict(method="cocktailsgd", quant="int4"),
    "allreduce_int4": dict(method="allreduce", quant="int4"),
    # DiLoCoX: the rank moves with the σ's, which differ between the TP shards; the TP ranks must
    # still agree on it (a replicated matrix compressed at two ranks would drift)
    "adaptive_lowrank_int4": dict(
        method="diloco", quant="int4", lowrank=4, overlap="delayed", adaptive=(1, 12, 2, 3), eps=0.4, steps=14
    ),
}
STEPS, H, SEED = 6, 2, 17


def _train(rank: int, world: int, cases: dict) -> dict:
    topo = build_topology(ParallelConfig(replicas=2, tensor=2))
    out = {}
    for name, c in cases.items():
        model = build_stage_model(MODEL, 0, 1, topo.tp_rank, 2, topo.group("tp"), seed=SEED)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        ocfg = OuterConfig(method=c["method"], sync_every=H, lr=0.7, momentum=0.9, overlap=c.get("overlap", "none"))
        ccfg = CompressConfig(
            quant=c["quant"],
            group_size=32,
            collective=c.get("collective", "auto"),
            random_fraction=0.3,
            topk_fraction=0.25,
            lowrank=LowRankConfig(enabled="lowrank" in c, rank=c.get("lowrank", 4)),
        )
        if "adaptive" in c:  # (rank_min, rank_max, h_min, h_max); window 1: the rank follows each step
            a = ccfg.adaptive
            a.enabled, a.window, (a.rank_min, a.rank_max, a.h_min, a.h_max) = True, 1, c["adaptive"]
            a.energy_eps = c.get("eps", a.energy_eps)
        loop = build_outer(
            list(model.named_parameters()),
            topo,
            ocfg,
            ccfg,
            seed=SEED,
            layer_of=param_layer_id,
            n_layers_total=MODEL.n_layers,
        )
        for step in range(c.get("steps", STEPS)):
            x = torch.randint(
                0, MODEL.vocab_size, (2, 16), generator=torch.Generator().manual_seed(50 * topo.replica + step)
            )
            model.loss(model(x)[:, :-1], x[:, 1:]).backward()
            loop.on_gradients(step)
            opt.step()
            opt.zero_grad()
            loop.after_inner_step(step)
        loop.finish()
        out[name] = {
            n: (p.detach().clone(), is_tensor_parallel(p), float((p.detach() - start[n]).abs().max()))
            for n, p in model.named_parameters()
        }
        out[name]["rank"] = loop.stats["rank"]
    return out


@pytest.mark.slow  # ~14 s on 2 cores
def test_replicated_params_stay_identical_across_tp_ranks():
    res = run_ranks(4, _train, CASES)  # rank = replica * 2 + tp_rank
    assert res[0]["adaptive_lowrank_int4"]["rank"] != 4  # the adaptive rule really moved the rank
    for name in CASES:
        for r in range(4):
            res[r][name].pop("rank")
        replicated = [n for n, (_, tp, _) in res[0][name].items() if not tp]
        assert {"pos_embed.weight", "norm_f.weight", "layers.0.attn.o_proj.bias"} <= set(replicated), replicated
        for n in replicated:
            assert max(res[r][name][n][2] for r in range(4)) > 0, (name, n)  # trained
            for r in (0, 2):  # the two TP ranks of each replica
                assert torch.equal(res[r][name][n][0], res[r + 1][name][n][0]), (name, n, r)
        for n in res[0][name]:  # one global model: the replicas agree bit for bit (TP shards too)
            for tp in (0, 1):
                assert torch.equal(res[tp][name][n][0], res[2 + tp][name][n][0]), (name, n, tp)
