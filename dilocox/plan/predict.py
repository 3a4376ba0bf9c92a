"""The time model (ALGORITHMS §10) and the plan: utilization, throughput and bandwidth needed per method.

``plan`` combines a method's bytes per sync (``dilocox.plan.payloads.sync_bytes``) with a link's
bandwidth and latency and the inner step time (6 N tokens / (peak FLOP/s x MFU), or given) into the
communication time, wall time, utilization and tokens/s of one outer step, and inverts the model for
the bandwidth that reaches each target utilization; ``plan_all`` does it for every preset.
``paper_worked_example`` reproduces DiLoCoX §2.4.1.
"""

from __future__ import annotations

import math

from dilocox.config import ModelConfig
from dilocox.plan.methods import Method, load_method, method_names
from dilocox.plan.payloads import collective_cost, quant_bytes, sync_bytes

TARGETS = (0.90, 0.95, 0.99)
DEFAULT_TOKENS_PER_STEP = 2048 * 256  # per replica per inner step (256 sequences of 2048)
DEFAULT_GPU_FLOPS = 989e12  # H100 SXM dense bf16
DEFAULT_MFU = 0.4
DEFAULT_LATENCY_S = 0.02  # per collective step on a WAN link


def step_time(n_params: int, tokens_per_step: float, peak_flops: float, mfu: float) -> float:
    """Seconds of one inner step of one replica: 6 N tokens / (peak * MFU)."""
    return 6.0 * n_params * tokens_per_step / (peak_flops * mfu)


def wall_time(compute_s: float, comm_s: float, overlap_s: float, fragments: int = 1) -> float:
    """Wall time of H inner steps whose sync (split in K fragments) may hide behind overlap_s each."""
    return compute_s + fragments * max(0.0, comm_s / fragments - overlap_s)


def smallest_tau(compute_s: float, comm_s: float, t_step: float, fragments: int, H: int, target: float = 0.97):
    """The least overlap tau (inner steps, in [0, H/K), as the config allows) at which the predicted
    utilization reaches ``target``; None when even the deepest does not. The loss side of the trade: a deeper tau
    costs loss at equal tokens (docs/BENCHMARKS.md §4g: tau = 0 is the best-loss point), so a run takes the least
    tau its link needs."""
    for tau in range(max(H // fragments, 1)):
        if compute_s / wall_time(compute_s, comm_s, tau * t_step, fragments) >= target:
            return tau
    return None


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


def _check_plan_args(replicas: int, bandwidth_bps: float, goodput: float) -> None:
    if replicas < 1:
        raise ValueError(f"replicas={replicas} must be >= 1")
    if not bandwidth_bps > 0:
        raise ValueError(f"bandwidth_bps={bandwidth_bps} must be > 0")
    if not 0.0 < goodput <= 1.0:
        raise ValueError(f"goodput={goodput} must be in (0, 1] (the payload fraction of the link's bit rate)")


def _load_preset(
    name: str,
    H: int | None,
    rank: int | None,
    group_size: int | None,
    quant: str | None,
    overlap: str | None,
    fragments: int | None,
    tau: int | None,
    cdir: str | None,
) -> Method:
    """The preset ``name`` with the settings that are not None overridden (``load_method``)."""
    return load_method(
        name,
        H=H,
        rank=rank,
        group_size=group_size,
        quant=quant,
        overlap=overlap,
        fragments=fragments,
        tau=tau,
        cdir=cdir,
    )


def _outer_step_times(
    by: dict, method: Method, bandwidth_bps: float, goodput: float, latency_s: float, t_step: float
) -> tuple[float, float, float, float, float, float]:
    """The time model of one outer step: ``(wire bytes, latency total, t_comm, compute, overlap_s, wall)``."""
    H, K, tau_steps, ov = method.H, method.fragments, method.tau, method.overlap
    wire = float(by["wire_bytes"])
    lat = latency_s * by["collective_steps"]  # every fragment's collective pays the latency
    t_comm = lat + wire * 8.0 / (bandwidth_bps * goodput)
    compute = H * t_step
    # one-outer-step overlap: each fragment's sync hides behind its H/K-step slot of the next phase
    overlap_s = compute / K if ov in ("delayed", "eager") else tau_steps * t_step
    wall = wall_time(compute, t_comm, overlap_s, K)
    return wire, lat, t_comm, compute, overlap_s, wall


def _effective_rank(c) -> int:
    """The low-rank rank a compress config starts at (0 without low-rank; clamped by the adaptive bounds)."""
    r = c.lowrank.rank if c.lowrank.enabled else 0
    if r and c.adaptive.enabled:
        r = max(c.adaptive.rank_min, min(c.adaptive.rank_max, r))
    return r


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
    goodput: float = 1.0,
) -> dict:
    """Predict one method's communication, utilization and throughput (ALGORITHMS §10).

    ``model`` is a ModelConfig or a bare parameter count; ``method`` a preset name in
    ``configs/methods/`` (its settings overridden by the keyword arguments that are not None, see
    ``load_method``) or a loaded ``Method``; ``peak_flops`` is per replica (all its GPUs);
    ``step_time_s`` overrides the 6*N*tokens/(peak*MFU) estimate; ``goodput`` is the fraction of the link's bit
    rate that carries payload (1.0: none lost to headers; a link capped on Ethernet frames of 1448 TCP payload
    bytes carries 1448/1514 = 0.956 of it, see ``dilocox bench wan``).
    """
    _check_plan_args(replicas, bandwidth_bps, goodput)
    if isinstance(method, str):
        method = _load_preset(method, H, rank, group_size, quant, overlap, fragments, tau, cdir)
    by = sync_bytes(model, method, replicas, pipeline, tensor)
    H, K = method.H, method.fragments
    t_step = step_time_s if step_time_s is not None else step_time(by["n_params"], tokens_per_step, peak_flops, mfu)
    wire, lat, t_comm, compute, overlap_s, wall = _outer_step_times(
        by, method, bandwidth_bps, goodput, latency_s, t_step
    )
    c = method.compress
    return {
        "method": method.name,
        "outer_method": method.outer.method,
        "replicas": replicas,
        "bandwidth_bps": bandwidth_bps,
        "H": H,
        "compression": method.describe(),
        "quant": c.quant,
        "group_size": c.group_size,
        "rank": _effective_rank(c),
        "overlap": method.overlap,
        "fragments": K,
        "tau": method.tau,
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
        "bandwidth_for": {f"{u:.2f}": bandwidth_for(u, compute, wire, lat, overlap_s, K) / goodput for u in targets},
        # the DiLoCo family without the one-step delay: the least tau that keeps 97 % of the compute on this link
        "tau_for_97": smallest_tau(compute, t_comm, t_step, K, H) if _has_tau(method) else None,
    }


# issue 41 item 4's pair, best loss first: the `dilocox` preset (a fragment every 2 steps, tau = 1) and
# `dilocox-far` (the same bytes per step, more steps of compute to hide each sync behind): see their YAML headers
PRESET_PAIR = ("dilocox", "dilocox-far")
UTIL_TARGET = 0.97


def choose_preset(
    model: ModelConfig | int, replicas: int, bandwidth_bps: float, pair=PRESET_PAIR, target: float = UTIL_TARGET, **kw
) -> tuple[str, list[dict]]:
    """``(name, rows)``: the first preset of ``pair`` (ordered best loss first) whose predicted utilization on this
    link reaches ``target``, else the one that keeps the most compute; ``rows``: the plan of each (``kw``: ``plan``'s
    keywords: step time, latency, layout, ...)."""
    rows = [plan(model, replicas, bandwidth_bps, method=m, **kw) for m in pair]
    ok = [r for r in rows if r["utilization"] >= target]
    return (ok[0] if ok else max(rows, key=lambda r: r["utilization"]))["method"], rows


def _has_tau(method: Method) -> bool:
    """Whether ``outer.streaming.tau`` applies: the DiLoCo family with overlap none (any K)."""
    return method.outer.method == "diloco" and method.overlap == "none"


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
