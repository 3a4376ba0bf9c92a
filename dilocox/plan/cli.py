"""``dilocox plan``: the command line of the planner (a table of every method preset, optional JSON).

Parses the model YAML, replica count, bandwidth and hardware assumptions, runs ``plan_all`` and
prints one row per preset (bytes per sync, T_comm, utilization, tokens/s, bandwidth for 90/95/99 %).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from dilocox.config import ConfigError, load_config
from dilocox.metrics import fmt_bytes
from dilocox.plan.methods import method_names
from dilocox.plan.predict import DEFAULT_GPU_FLOPS, DEFAULT_LATENCY_S, DEFAULT_MFU, DEFAULT_TOKENS_PER_STEP, plan_all
from dilocox.plan.units import fmt_bandwidth, fmt_seconds, parse_bandwidth

DESCRIPTION = "The planner: predict bytes, communication time and compute utilization before renting GPUs."


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


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dilocox plan", description=DESCRIPTION)
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
    ap.add_argument("--gpus-per-replica", type=int, default=8, help="GPUs per replica (the compute estimate)")
    ap.add_argument(
        "--gpu-tflops", type=float, default=DEFAULT_GPU_FLOPS / 1e12, help="peak TFLOP/s per GPU (H100 bf16: 989)"
    )
    ap.add_argument("--mfu", type=float, default=DEFAULT_MFU, help="model FLOP utilisation assumed for the step time")
    ap.add_argument(
        "--step-time", type=float, default=None, help="seconds per inner step (overrides the FLOP estimate)"
    )
    ap.add_argument(
        "--latency",
        type=float,
        default=DEFAULT_LATENCY_S,
        help="seconds per collective step; over gloo a step costs one round trip: pass the link's RTT "
        "(measured: docs/BENCHMARKS.md section 5)",
    )
    ap.add_argument("--pipeline", type=int, default=1, help="pipeline stages per replica (each syncs its own layers)")
    ap.add_argument("--tensor", type=int, default=1, help="tensor-parallel degree (low-rank is decided per shard)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    return ap


def _plan_rows(args: argparse.Namespace) -> tuple[float, list[dict]]:
    """``(bandwidth in bits/s, one plan row per selected preset)``; ValueError/OSError/ConfigError on bad input."""
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
    return bw, rows


def _print_report(args: argparse.Namespace, bw: float, rows: list[dict]) -> None:
    """The header (link, latency, inner step time), the table and the optional JSON file."""
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        bw, rows = _plan_rows(args)
    except (ValueError, OSError, ConfigError) as e:
        print(f"dilocox plan: error: {e}", file=sys.stderr)
        return 2
    _print_report(args, bw, rows)
    return 0
