"""Bytes of one outer sync, counted by the objects that send them (ALGORITHMS §5-§6).

``rank_shards`` builds the model of every rank of one replica on the meta device (names, shapes,
tensor-parallel split dims; cached), and ``sync_bytes`` adds up what each rank's compressor
(``build_compressor(...).wire_bytes(R)``) or CocktailSGD payload sends per streaming fragment, with
the collective the code runs and its sequential steps: what a real run's outer stats count.
``quant_bytes`` and ``collective_cost`` are the textbook formulas of the paper's worked example.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import torch

from dilocox.compress.cocktail import cocktail_payload_bytes
from dilocox.compress.collectives import resolve_mode
from dilocox.compress.compressor import build_compressor, selected
from dilocox.config import ModelConfig, ParallelConfig
from dilocox.config.checks import check_model_layout
from dilocox.model.transformer import build_stage_model, param_layer_id
from dilocox.outer.fragments import assign_fragments
from dilocox.outer.gradsync import METHODS as PER_STEP
from dilocox.plan.methods import Method


def quant_bytes(n: int, quant: str, group_size: int = 128) -> float:
    """Bytes of a flat buffer of n elements under §6 (packed nibbles + one bf16 scale per group).

    The formula of the paper's worked example; the planner's rows use the compressor's own count."""
    groups = math.ceil(n / group_size)
    return {"none": 4.0 * n, "fp16": 2.0 * n, "int8": n + 2.0 * groups, "int4": math.ceil(n / 2) + 2.0 * groups}[quant]


def collective_cost(payload: float, replicas: int, collective: str, n_collectives: int = 1) -> tuple[float, int]:
    """(bytes each replica sends, sequential latency steps) of one sync over R replicas (textbook formulas)."""
    R = replicas
    if R <= 1:
        return 0.0, 0
    if collective in ("ring", "reduce_scatter"):
        return 2.0 * (R - 1) / R * payload, 2 * (R - 1) * n_collectives
    if collective == "allgather":
        return (R - 1) * payload, (R - 1) * n_collectives
    raise ValueError(f"collective={collective!r} is not one of ring, allgather, reduce_scatter")


_SHAPES: dict[tuple, list] = {}


def rank_shards(model: ModelConfig, pipeline: int = 1, tensor: int = 1) -> list[list[tuple[str, tuple[int, ...]]]]:
    """``[(name, shape)]`` of the parameters of every rank of one replica (stage-major, then TP
    rank), as ``build_stage_model`` makes them (built on the meta device: no memory)."""
    key = (json.dumps(asdict(model), sort_keys=True), pipeline, tensor)
    if key not in _SHAPES:
        if pipeline < 1 or tensor < 1:
            raise ValueError(f"pipeline={pipeline}, tensor={tensor}: both must be >= 1")
        # the rules training applies (whole heads and kv heads per TP rank, ...): the meta build below is at tp_size 1
        check_model_layout(model, ParallelConfig(pipeline=pipeline, tensor=tensor))
        out = []
        for s in range(pipeline):
            stage = build_stage_model(model, s, pipeline, device="meta")  # tp_size 1: full shapes, split dims marked
            shard = []
            for name, p in stage.named_parameters():
                shape = list(p.shape)
                d = getattr(p, "partition_dim", None)
                if d is not None and tensor > 1:
                    if shape[d] % tensor:
                        raise ValueError(
                            f"--tensor {tensor}: {name} has {shape[d]} rows/cols along its split dim {d}, "
                            f"not divisible by {tensor}; choose a tensor degree that divides it"
                        )
                    shape[d] //= tensor
                shard.append((name, tuple(shape)))
            out += [shard] * tensor  # every TP rank holds the same shapes
        _SHAPES[key] = out
    return _SHAPES[key]


def sync_bytes(model: ModelConfig | int, method: Method, replicas: int, pipeline: int = 1, tensor: int = 1) -> dict:
    """Bytes of one full sync (every fragment once) of one replica, counted by the code that sends them.

    ``payload_bytes``: the compressed messages of the replica's ranks (R-independent);
    ``wire_bytes``: what its ranks send over the outer groups (what the outer stats' ``bytes_sent``
    add up to); ``collective``/``collective_steps``: the collective run and its sequential steps
    over one sync (ranks of a replica run theirs in parallel; fragments one after another).
    ``model`` may be a bare parameter count (one flat tensor; no low-rank).
    """
    if isinstance(model, int):
        if method.compress.lowrank.enabled and method.outer.method not in PER_STEP:
            raise ValueError("low-rank payloads need the matrix shapes: pass a ModelConfig, not a parameter count")
        if pipeline != 1 or tensor != 1:
            raise ValueError("pipeline/tensor layouts need a ModelConfig, not a parameter count")
        K = method.fragments
        shards = [[(f"params.{k}", (model // K + (k < model % K),)) for k in range(K)]]
        frag_of = lambda names: [[i] for i in range(len(names))]  # noqa: E731 - one flat piece per fragment
    else:
        shards = rank_shards(model, pipeline, tensor)

        def frag_of(names):
            return assign_fragments(names, param_layer_id, method.fragments, method.outer.streaming.pattern)

    c = method.compress
    payload = wire = lowrank = 0
    n_coll = 1
    for shard in shards:
        names = [n for n, _ in shard]
        shapes = [torch.Size(s) for _, s in shard]
        if method.outer.method == "cocktailsgd":
            pb = cocktail_payload_bytes(
                [s.numel() for s in shapes], c.random_fraction, c.topk_fraction, c.quant, c.group_size
            )
            payload += pb
            wire += (replicas - 1) * pb if replicas > 1 else 0
            continue
        frags = [list(range(len(shapes)))] if method.per_step else frag_of(names)
        for p, idx in enumerate(frags):
            with torch.device("meta"):  # PowerSGD draws its Q matrices: shapes only, no memory
                comp = build_compressor(c, [shapes[i] for i in idx], seed=p)
            payload += comp.payload_bytes()
            wire += comp.wire_bytes(replicas)
            if getattr(comp, "lowrank", None) is not None:
                fact = comp.lowrank.factored_for(comp.rank)
                if fact:
                    n_coll = 2
                    lowrank += sum(sum(shapes[idx[i]]) * comp.rank for i in fact if len(shapes[idx[i]]) == 2)
    if method.outer.method == "cocktailsgd" or selected(c) is not None:  # (the registered codecs all-gather ...)
        rs = c.sparse.enabled and c.collective == "reduce_scatter"  # (... but the sparse one may reduce-scatter)
        coll = "reduce_scatter" if rs else "allgather"
    elif c.quant == "none":
        coll = "ring"
    else:
        coll = resolve_mode(c.collective, replicas)
    per = {"ring": 2 * (replicas - 1), "reduce_scatter": 2 * (replicas - 1), "allgather": replicas - 1}[coll]
    steps = per * n_coll * method.fragments if replicas > 1 else 0
    n_params = model if isinstance(model, int) else model.num_params()
    return {
        "n_params": n_params,
        "payload_bytes": payload,
        "wire_bytes": wire,
        "lowrank_elements": lowrank,
        "collective": coll,
        "collective_steps": steps,
        "ratio": 4.0 * n_params / payload if payload else math.inf,
    }
