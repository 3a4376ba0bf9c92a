"""The planner: predict bytes, communication time and compute utilization before renting GPUs.

``dilocox plan --model configs/model/qwen1.5-107b.yaml --replicas 20 --bandwidth 1gbit``
prints, for each method preset, the bytes each replica sends per outer sync, the time of that
sync, the compute utilization, the predicted tokens/s and the inter-cluster bandwidth needed
for 90/95/99 % utilization.

Nothing here restates the code it predicts. The method settings (H, overlap, streaming K and
tau, quantizer, low-rank rank, CocktailSGD fractions) are read from ``configs/methods/<name>.yaml``,
the presets ``dilocox train`` includes. The parameters are those of the model the trainer
builds (``build_stage_model`` on the meta device: its names, shapes and tensor-parallel
split dims, per pipeline stage). The bytes come from the objects that send them: per rank
(stage x TP slice) and streaming fragment, ``build_compressor(...).wire_bytes(R)`` (group
padding, low-rank P/Q layout and the adaptive tail sketch included) for the DiLoCo family and
``allreduce``, and ``cocktail_payload_bytes`` (indices + values) for ``cocktailsgd``. So the
bytes per sync are what the outer stats of a real run count (``bytes_sent``; tested).
A replica's ranks share its link: the per-replica bytes are the sum over its P x T ranks
(a parameter replicated over TP, e.g. a norm, is sent by every TP rank, as in the code);
inner data parallelism (``shard_over_data``) spreads the same bytes over D ranks and is not modelled.

The time model is ALGORITHMS.md §10:

    T_comm = latency * steps_of_collective + wire_bytes * 8 / bandwidth
    T_step = 6 * N_params * tokens_per_step / (peak_flops * MFU)          (per replica)
    none:            utilization = H*T_step / (H*T_step + T_comm)
    delayed/eager:   utilization = H*T_step / max(H*T_step, T_comm)

generalised to streaming (K fragments, each synced once per H steps with overlap tau steps):
``wall = H*T_step + K * max(0, T_comm/K - tau*T_step)``; ``tau = 0`` is blocking and
``K = 1, tau = H`` is the one-outer-step overlap above, so one formula serves all methods.
Collective steps (for the latency term) follow the collective the code runs: fp32 (quant
``none``) is a ring all-reduce, 2(R-1) steps; the packed kinds (fp16, int8, int4) are an
all-gather (R-1 steps) for R <= 4 and reduce-scatter + all-gather (2(R-1)) above
(``compress.collective: auto``); CocktailSGD is one all-gather; low-rank adds the P round.
Bandwidth strings: ``100mbit``, ``1gbit``, ``10Gbit/s``, ``1Gbps`` (bits), ``125MB/s`` (bytes);
decimal prefixes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass

import torch

from dilocox.compress.cocktail import cocktail_payload_bytes
from dilocox.compress.collectives import resolve_mode
from dilocox.compress.compressor import build_compressor
from dilocox.config import CompressConfig, ConfigError, ModelConfig, OuterConfig, load_config
from dilocox.metrics import fmt_bytes
from dilocox.model.transformer import build_stage_model, param_layer_id
from dilocox.outer.fragments import assign_fragments
from dilocox.outer.gradsync import METHODS as PER_STEP

TARGETS = (0.90, 0.95, 0.99)
DEFAULT_TOKENS_PER_STEP = 2048 * 256  # per replica per inner step (256 sequences of 2048)
DEFAULT_GPU_FLOPS = 989e12  # H100 SXM dense bf16
DEFAULT_MFU = 0.4
DEFAULT_LATENCY_S = 0.02  # per collective step on a WAN link


# --------------------------------------------------------------------------- units

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}


def parse_bandwidth(text: str | float | int) -> float:
    """``"100mbit"`` -> 1e8 bits/s. Lowercase ``b``/``bit``/``bps`` are bits, ``B``/``byte`` bytes.

    Note ``1Gbps`` means gigabits here (as in the papers), unlike tc, where ``mbps`` is bytes.
    """
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z/]*)\s*", str(text))
        if not m:
            raise ValueError(
                f"bandwidth {text!r} is not a number with a unit; write e.g. 100mbit, 1gbit, 10Gbit/s, 125MB/s"
            )
        unit = m.group(2)
        unit = unit[:-2] if unit.endswith("/s") else unit
        um = re.fullmatch(r"([kKmMgGtT]i?)?(bit|bps|b|Bps|B|byte|bytes)?", unit)
        if not um:
            raise ValueError(
                f"bandwidth {text!r}: unknown unit {m.group(2)!r}; use bit, kbit, mbit, gbit (or Gbps, MB/s)"
            )
        scale = _PREFIX[(um.group(1) or "").lower()]
        per_byte = (um.group(2) or "bit") in ("Bps", "B", "byte", "bytes")
        value = float(m.group(1)) * scale * (8.0 if per_byte else 1.0)
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"bandwidth {text!r} must be a finite number > 0 bits/s")
    return value


def fmt_bandwidth(bps: float) -> str:
    if math.isinf(bps):
        return "unreachable"
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} bit/s"


def fmt_seconds(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.3g} h"
    if s >= 60:
        return f"{s / 60:.3g} min"
    return f"{s:.3g} s"


# --------------------------------------------------------------------------- payloads (§5-§6)


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


def configs_dir() -> str:
    """The ``configs/`` directory next to the installed package (``make install`` is an editable
    install, so it is the checkout's); ``DILOCOX_CONFIGS`` overrides it."""
    path = os.environ.get("DILOCOX_CONFIGS") or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs"
    )
    if not os.path.isdir(os.path.join(path, "methods")):
        raise FileNotFoundError(
            f"method presets not found: {path}/methods does not exist; install dilocox editable "
            "from its checkout (make install) or set DILOCOX_CONFIGS to a directory with methods/"
        )
    return path


def method_names(cdir: str | None = None) -> list[str]:
    """The presets in ``configs/methods/`` (file names without .yaml), in a fixed display order."""
    d = os.path.join(cdir or configs_dir(), "methods")
    names = sorted(f[:-5] for f in os.listdir(d) if f.endswith(".yaml"))
    order = ["allreduce", "cocktailsgd", "diloco", "opendiloco", "streaming", "eager", "dilocox"]
    return [n for n in order if n in names] + [n for n in names if n not in order]


@dataclass(frozen=True)
class Method:
    """One preset's outer and compress sections, as ``dilocox train`` would load them."""

    name: str
    outer: OuterConfig
    compress: CompressConfig

    @property
    def per_step(self) -> bool:
        return self.outer.method in PER_STEP

    @property
    def H(self) -> int:
        return 1 if self.per_step else self.outer.sync_every

    @property
    def overlap(self) -> str:
        """The overlap the time model uses: ``blocking: true`` puts the sync on the critical path."""
        return "none" if self.per_step or self.outer.blocking else self.outer.overlap

    @property
    def fragments(self) -> int:
        return 1 if self.per_step else self.outer.streaming.fragments

    @property
    def tau(self) -> int:
        return 0 if self.per_step else self.outer.streaming.tau

    def describe(self) -> str:
        c = self.compress
        q = {"none": "fp32"}.get(c.quant, c.quant) + (f"/G{c.group_size}" if c.quant in ("int4", "int8") else "")
        if self.outer.method == "cocktailsgd":
            return f"random {c.random_fraction:g} x top-k {c.topk_fraction:g} + {q}"
        if c.lowrank.enabled:
            r = c.lowrank.rank
            if c.adaptive.enabled:
                r = max(c.adaptive.rank_min, min(c.adaptive.rank_max, r))
            return f"lowrank r{r}{' (adaptive)' if c.adaptive.enabled else ''} + {q}"
        return q


def load_method(
    name: str,
    *,
    H: int | None = None,
    rank: int | None = None,
    group_size: int | None = None,
    quant: str | None = None,
    overlap: str | None = None,
    fragments: int | None = None,
    tau: int | None = None,
    cdir: str | None = None,
) -> Method:
    """``configs/methods/<name>.yaml`` with the given settings overridden (None: the preset's).

    ``rank`` 0 turns low-rank off; a rank outside an adaptive preset's [rank_min, rank_max] widens it.
    ``H`` applies only to the DiLoCo family (per-step methods sync every step)."""
    path = os.path.join(cdir or configs_dir(), "methods", f"{name}.yaml")
    if not os.path.exists(path):
        raise ValueError(f"method {name!r}: no preset {path}; choose from {method_names(cdir)}")
    raw = load_config(path)
    ov: dict = {"outer": {}, "compress": {}}
    if H is not None and raw.outer.method not in PER_STEP:
        ov["outer"]["sync_every"] = H
        ad = raw.compress.adaptive
        if ad.enabled:
            ov["compress"]["adaptive"] = {"h_min": min(ad.h_min, H), "h_max": max(ad.h_max, H)}
    if overlap is not None:
        ov["outer"]["overlap"] = overlap
        if overlap != "none":  # asking for an overlap means not waiting on the critical path (opendiloco blocks)
            ov["outer"]["blocking"] = False
    if fragments is not None or tau is not None:
        ov["outer"]["streaming"] = {k: v for k, v in (("fragments", fragments), ("tau", tau)) if v is not None}
    if quant is not None:
        ov["compress"]["quant"] = quant
    if group_size is not None:
        ov["compress"]["group_size"] = group_size
    if rank is not None:
        if rank < 0:
            raise ValueError(f"rank={rank} must be >= 0 (0 = no low-rank)")
        ov["compress"]["lowrank"] = {"enabled": rank > 0, **({"rank": rank} if rank else {})}
        ad = raw.compress.adaptive
        if rank and ad.enabled:
            ov["compress"].setdefault("adaptive", {}).update(
                rank_min=min(ad.rank_min, rank), rank_max=max(ad.rank_max, rank)
            )
    cfg = load_config(path, ov) if ov["outer"] or ov["compress"] else raw
    return Method(name, cfg.outer, cfg.compress)


_SHAPES: dict[tuple, list] = {}


def rank_shards(model: ModelConfig, pipeline: int = 1, tensor: int = 1) -> list[list[tuple[str, tuple[int, ...]]]]:
    """``[(name, shape)]`` of the parameters of every rank of one replica (stage-major, then TP
    rank), as ``build_stage_model`` makes them (built on the meta device: no memory)."""
    key = (json.dumps(asdict(model), sort_keys=True), pipeline, tensor)
    if key not in _SHAPES:
        if pipeline < 1 or tensor < 1:
            raise ValueError(f"pipeline={pipeline}, tensor={tensor}: both must be >= 1")
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
            if comp.lowrank is not None:
                fact = comp.lowrank.factored_for(comp.rank)
                if fact:
                    n_coll = 2
                    lowrank += sum(sum(shapes[idx[i]]) * comp.rank for i in fact if len(shapes[idx[i]]) == 2)
    if method.outer.method == "cocktailsgd":
        coll = "allgather"
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


# --------------------------------------------------------------------------- time model (§10)


def step_time(n_params: int, tokens_per_step: float, peak_flops: float, mfu: float) -> float:
    """Seconds of one inner step of one replica: 6 N tokens / (peak * MFU)."""
    return 6.0 * n_params * tokens_per_step / (peak_flops * mfu)


def wall_time(compute_s: float, comm_s: float, overlap_s: float, fragments: int = 1) -> float:
    """Wall time of H inner steps whose sync (split in K fragments) may hide behind overlap_s each."""
    return compute_s + fragments * max(0.0, comm_s / fragments - overlap_s)


def utilization(compute_s: float, comm_s: float, overlap: str) -> float:
    """§10 as written: none -> C/(C+T); delayed/eager -> C/max(C, T)."""
    if overlap == "none":
        return compute_s / (compute_s + comm_s)
    if overlap in ("delayed", "eager"):
        return compute_s / max(compute_s, comm_s)
    raise ValueError(f"overlap={overlap!r} is not one of none, delayed, eager")


def bandwidth_for(
    target: float, compute_s: float, wire_bytes: float, latency_total_s: float, overlap_s: float, fragments: int = 1
) -> float:
    """Smallest bandwidth (bits/s) at which utilization reaches ``target`` (inf if none does)."""
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target utilization {target} must be in (0, 1]")
    if wire_bytes == 0:
        return 0.0
    avail = overlap_s + compute_s * (1.0 / target - 1.0) / fragments - latency_total_s / fragments
    return math.inf if avail <= 0 else wire_bytes * 8.0 / fragments / avail


# --------------------------------------------------------------------------- the plan


def plan(
    model: ModelConfig | int,
    replicas: int,
    bandwidth_bps: float,
    *,
    method: str | Method = "dilocox",
    H: int | None = None,
    rank: int | None = None,
    group_size: int | None = None,
    quant: str | None = None,
    overlap: str | None = None,
    fragments: int | None = None,
    tau: int | None = None,
    tokens_per_step: float = DEFAULT_TOKENS_PER_STEP,
    peak_flops: float = 8 * DEFAULT_GPU_FLOPS,
    mfu: float = DEFAULT_MFU,
    latency_s: float = DEFAULT_LATENCY_S,
    step_time_s: float | None = None,
    pipeline: int = 1,
    tensor: int = 1,
    targets: tuple[float, ...] = TARGETS,
    cdir: str | None = None,
) -> dict:
    """Predict one method's communication, utilization and throughput (ALGORITHMS §10).

    ``model`` is a ModelConfig or a bare parameter count; ``method`` a preset name in
    ``configs/methods/`` (its settings overridden by the keyword arguments that are not None, see
    ``load_method``) or a loaded ``Method``; ``peak_flops`` is per replica (all its GPUs);
    ``step_time_s`` overrides the 6*N*tokens/(peak*MFU) estimate.
    """
    if replicas < 1:
        raise ValueError(f"replicas={replicas} must be >= 1")
    if not bandwidth_bps > 0:
        raise ValueError(f"bandwidth_bps={bandwidth_bps} must be > 0")
    if isinstance(method, str):
        method = load_method(
            method,
            H=H,
            rank=rank,
            group_size=group_size,
            quant=quant,
            overlap=overlap,
            fragments=fragments,
            tau=tau,
            cdir=cdir,
        )
    by = sync_bytes(model, method, replicas, pipeline, tensor)
    H, K, tau_steps, ov = method.H, method.fragments, method.tau, method.overlap
    wire = float(by["wire_bytes"])
    lat = latency_s * by["collective_steps"]  # every fragment's collective pays the latency
    t_comm = lat + wire * 8.0 / bandwidth_bps
    t_step = step_time_s if step_time_s is not None else step_time(by["n_params"], tokens_per_step, peak_flops, mfu)
    compute = H * t_step
    # one-outer-step overlap: each fragment's sync hides behind its H/K-step slot of the next phase
    overlap_s = compute / K if ov in ("delayed", "eager") else tau_steps * t_step
    wall = wall_time(compute, t_comm, overlap_s, K)
    c = method.compress
    r = c.lowrank.rank if c.lowrank.enabled else 0
    if r and c.adaptive.enabled:
        r = max(c.adaptive.rank_min, min(c.adaptive.rank_max, r))
    return {
        "method": method.name,
        "outer_method": method.outer.method,
        "replicas": replicas,
        "bandwidth_bps": bandwidth_bps,
        "H": H,
        "compression": method.describe(),
        "quant": c.quant,
        "group_size": c.group_size,
        "rank": r,
        "overlap": ov,
        "fragments": K,
        "tau": tau_steps,
        "collective": by["collective"],
        "pipeline": pipeline,
        "tensor": tensor,
        "n_params": by["n_params"],
        "payload_bytes": by["payload_bytes"],
        "compression_ratio": by["ratio"],
        "lowrank_elements": by["lowrank_elements"],
        "wire_bytes_per_replica": wire,
        "peak_wire_bytes": wire / K,
        "collective_steps": by["collective_steps"],
        "t_comm_s": t_comm,
        "t_step_s": t_step,
        "compute_s": compute,
        "wall_s": wall,
        "idle_s": wall - compute,
        "utilization": compute / wall,
        "tokens_per_s": replicas * tokens_per_step * H / wall,
        "bandwidth_for": {f"{u:.2f}": bandwidth_for(u, compute, wire, lat, overlap_s, K) for u in targets},
    }


def plan_all(
    model: ModelConfig | int,
    replicas: int,
    bandwidth_bps: float,
    methods=None,
    H: int | None = None,
    rank: int | None = None,
    group_size: int | None = None,
    cdir: str | None = None,
    **kw,
) -> list[dict]:
    """One plan per method preset (default: every file in configs/methods/); ``H`` applies to the
    DiLoCo family, ``rank`` to presets with low-rank on, ``group_size`` to all."""
    rows = []
    for m in methods or method_names(cdir):
        probe = load_method(m, cdir=cdir)
        rows.append(
            plan(
                model,
                replicas,
                bandwidth_bps,
                method=m,
                H=H,
                group_size=group_size,
                cdir=cdir,
                rank=rank if probe.compress.lowrank.enabled else None,
                **kw,
            )
        )
    return rows


def paper_worked_example(
    n_params: float = 100e9, replicas: int = 3, bandwidth_bps: float = 1e9, local_steps: int = 500, step_s: float = 1.0
) -> dict:
    """DiLoCoX §2.4.1: fp32 pseudo-gradients of 100B params, 3 clusters, ring all-reduce, 1 Gbit/s.

    Ring all-reduce sends 2(R-1)/R * 400 GB = 533.3 GB per replica; 533.3e9*8/1e9 s = 1.185 h;
    500 local steps of 1 s = 0.139 h; with the one-step overlap the idle time is the rest,
    1.046 h (the paper prints these truncated: 533.3 GB, 1.18 h, 0.13 h, 1.04 h).
    """
    payload = quant_bytes(int(n_params), "none")
    wire, _ = collective_cost(payload, replicas, "ring")
    t_comm = wire * 8.0 / bandwidth_bps
    compute = local_steps * step_s
    return {
        "payload_bytes": payload,
        "wire_bytes": wire,
        "comm_h": t_comm / 3600,
        "local_h": compute / 3600,
        "idle_h": (wall_time(compute, t_comm, compute) - compute) / 3600,
        "utilization_delayed": utilization(compute, t_comm, "delayed"),
        "utilization_none": utilization(compute, t_comm, "none"),
    }


# --------------------------------------------------------------------------- CLI


def format_table(rows: list[dict]) -> str:
    tgt = list(rows[0]["bandwidth_for"]) if rows else []
    head = [
        "method",
        "H",
        "compression",
        "overlap",
        "collective",
        "sent/sync/replica",
        "ratio",
        "T_comm",
        "H*T_step",
        "util",
        "tokens/s",
    ] + [f"BW for {float(u):.0%}" for u in tgt]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ov = r["overlap"] if r["fragments"] == 1 else f"streaming K={r['fragments']} tau={r['tau']}"
        cells = [
            r["method"],
            str(r["H"]),
            r["compression"],
            ov,
            r["collective"],
            fmt_bytes(r["wire_bytes_per_replica"]),
            f"{r['compression_ratio']:.0f}x",
            fmt_seconds(r["t_comm_s"]),
            fmt_seconds(r["compute_s"]),
            f"{r['utilization']:.1%}",
            f"{r['tokens_per_s']:,.0f}",
        ]
        cells += [fmt_bandwidth(r["bandwidth_for"][u]) for u in tgt]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _finite(x):
    """JSON has no infinity: an unreachable bandwidth is written as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dilocox plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="YAML with a model: section (configs/model/*.yaml)")
    ap.add_argument("--replicas", type=int, required=True, help="R clusters joined by the slow link")
    ap.add_argument("--bandwidth", required=True, help="per-replica link, e.g. 100mbit, 1gbit, 10Gbit/s")
    ap.add_argument("--methods", default=None, help="comma list of presets in configs/methods/ (default: all)")
    ap.add_argument("--H", type=int, default=None, help="inner steps per outer step (local-step methods)")
    ap.add_argument(
        "--rank",
        type=int,
        default=None,
        help="low-rank rank of the presets that use it (0 = off; default: the preset's; the paper's 107B: 2048)",
    )
    ap.add_argument("--group-size", type=int, default=None, help="quantization group G (default: the preset's)")
    ap.add_argument(
        "--tokens-per-step", type=float, default=DEFAULT_TOKENS_PER_STEP, help="tokens per replica per inner step"
    )
    ap.add_argument("--gpus-per-replica", type=int, default=8)
    ap.add_argument(
        "--gpu-tflops", type=float, default=DEFAULT_GPU_FLOPS / 1e12, help="peak TFLOP/s per GPU (H100 bf16: 989)"
    )
    ap.add_argument("--mfu", type=float, default=DEFAULT_MFU)
    ap.add_argument(
        "--step-time", type=float, default=None, help="seconds per inner step (overrides the FLOP estimate)"
    )
    ap.add_argument("--latency", type=float, default=DEFAULT_LATENCY_S, help="seconds per collective step")
    ap.add_argument("--pipeline", type=int, default=1, help="pipeline stages per replica (each syncs its own layers)")
    ap.add_argument("--tensor", type=int, default=1, help="tensor-parallel degree (low-rank is decided per shard)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    args = ap.parse_args(argv)
    try:
        bw = parse_bandwidth(args.bandwidth)
        mcfg = load_config(args.model).model
        known = method_names()
        methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else known
        bad = [m for m in methods if m not in known]
        if bad:
            raise ValueError(f"--methods: unknown {bad}; choose from {known} (configs/methods/*.yaml)")
        rows = plan_all(
            mcfg,
            args.replicas,
            bw,
            methods,
            H=args.H,
            rank=args.rank,
            group_size=args.group_size,
            tokens_per_step=args.tokens_per_step,
            peak_flops=args.gpus_per_replica * args.gpu_tflops * 1e12,
            mfu=args.mfu,
            latency_s=args.latency,
            step_time_s=args.step_time,
            pipeline=args.pipeline,
            tensor=args.tensor,
        )
    except (ValueError, OSError, ConfigError) as e:
        print(f"dilocox plan: error: {e}", file=sys.stderr)
        return 2
    r0 = rows[0]
    step = (
        f"{args.step_time} s (given)"
        if args.step_time
        else (
            f"{fmt_seconds(r0['t_step_s'])} = 6 x {r0['n_params'] / 1e9:.3g}B params x "
            f"{args.tokens_per_step:,.0f} tokens / "
            f"({args.gpus_per_replica} x {args.gpu_tflops:g} TFLOP/s x MFU {args.mfu})"
        )
    )
    print(
        f"# plan: {args.model}, {args.replicas} replicas, {fmt_bandwidth(bw)} per replica link, "
        f"latency {args.latency * 1e3:g} ms/collective step\n\ninner step: {step}\n"
    )
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_finite(rows), f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
