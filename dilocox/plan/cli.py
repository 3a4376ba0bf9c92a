"""``dilocox plan``: the command line of the planner (a table of every method preset, optional JSON).

Parses the model YAML, replica count, bandwidth and hardware assumptions, runs ``plan_all`` and
prints one row per preset (bytes per sync, T_comm, utilization, tokens/s, bandwidth for 90/95/99 %).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from dilocox.config import ConfigError, _read_yaml, load_config
from dilocox.metrics import fmt_bytes
from dilocox.plan.methods import Method, method_names
from dilocox.plan.predict import (
    DEFAULT_GPU_FLOPS,
    DEFAULT_LATENCY_S,
    DEFAULT_MFU,
    DEFAULT_TOKENS_PER_STEP,
    PRESET_PAIR,
    UTIL_TARGET,
    choose_preset,
    plan,
    plan_all,
)
from dilocox.plan.units import fmt_bandwidth, fmt_seconds, parse_bandwidth, parse_seconds

DESCRIPTION = "The planner: predict bytes, communication time and compute utilization before renting GPUs."


THIS_CONFIG = " (this config)"  # the suffix of the planned config's own row


def format_table(rows: list[dict]) -> str:
    tgt = list(rows[0]["bandwidth_for"]) if rows else []
    head = [
        "method",
        "H",
        "compression",
        "overlap",
        "collective",
        "sent/sync/replica",
        "ratio/sync",
        "vs allreduce/step",
        "T_comm",
        "H*T_step",
        "util",
        "tokens/s",
        "tau for 97%",
    ] + [f"BW for {float(u):.0%}" for u in tgt]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ov = r["overlap"] if r["fragments"] == 1 and not r["tau"] else f"streaming K={r['fragments']} tau={r['tau']}"
        cells = [
            r["method"],
            str(r["H"]),
            r["compression"],
            ov,
            r["collective"],
            fmt_bytes(r["wire_bytes_per_replica"]),
            f"{r['compression_ratio']:.0f}x",
            f"{r['vs_allreduce_per_step']:,.0f}x" if "vs_allreduce_per_step" in r else "-",
            fmt_seconds(r["t_comm_s"]),
            fmt_seconds(r["compute_s"]),
            f"{r['utilization']:.1%}",
            f"{r['tokens_per_s']:,.0f}",
            _tau_cell(r),
        ]
        cells += [fmt_bandwidth(r["bandwidth_for"][u]) for u in tgt]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _schedule(o, overlap: str) -> str:
    """The header's words for the config's outer schedule, as its row names it (streaming: fragments and tau)."""
    s = o.streaming
    if overlap == "none" and (s.fragments > 1 or s.tau > 0):
        return f"streaming K={s.fragments} tau={s.tau}"
    return f"overlap {overlap}"


def _tau_cell(r: dict) -> str:
    """The least streaming overlap that keeps 97 % (predict.smallest_tau); '-' where tau does not apply."""
    if r["outer_method"] != "diloco" or r["overlap"] != "none":
        return "-"
    if r.get("tau_for_97") is None:
        return f"none < {max(r['H'] // r['fragments'], 1)} (raise H)"
    return str(r["tau_for_97"])


def choice_line(name: str, rows: list[dict]) -> str:
    """What ``choose_preset`` picked on this link and why (each preset's predicted utilization)."""
    kept = ", ".join(f"`{r['method']}` {r['utilization']:.1%}" for r in rows)
    first = rows[0]["method"]
    if max(r["utilization"] for r in rows) < UTIL_TARGET:
        why = f"none keeps {UTIL_TARGET:.0%}: the one that keeps the most"
    else:
        why = f"it keeps >= {UTIL_TARGET:.0%} of the compute" + (
            "" if name == first else f" where `{first}` (the better loss) does not"
        )
    return (
        f"preset for this link: methods/{name}.yaml ({why}; predicted utilization {kept}; the trade-off: "
        "docs/BENCHMARKS.md §4i)"
    )


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
    ap = argparse.ArgumentParser(
        prog="dilocox plan",
        description=DESCRIPTION,
        epilog="SWARM / DiLoCo-SWARM (pipeline vs stage-sync bytes): dilocox plan --swarm --help",
    )
    ap.add_argument(
        "config",
        nargs="?",
        default=None,
        help="a run config (configs/*.yaml): its model, layout (replicas, PP, TP), batch x sequence and its own "
        "method are planned, allreduce beside it; a flag that contradicts it is an error",
    )
    ap.add_argument(
        "--model",
        default=None,
        help="YAML with a model: section (configs/model/*.yaml): every preset of configs/methods/ on it; a run "
        "config here is read like the positional CONFIG",
    )
    ap.add_argument("--replicas", type=int, default=None, help="R clusters joined by the slow link")
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
        "--tokens-per-step",
        type=float,
        default=None,
        help=f"tokens per replica per inner step (default {DEFAULT_TOKENS_PER_STEP:,}; a run config: its batch x seq)",
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
        type=_seconds,
        default=DEFAULT_LATENCY_S,
        help="time per collective step, e.g. 150ms or 0.15 (a bare number is seconds); over gloo a step costs one "
        "round trip: pass the link's RTT (measured: docs/BENCHMARKS.md section 5)",
    )
    ap.add_argument(
        "--pipeline", type=int, default=None, help="pipeline stages per replica (each syncs its own layers; default 1)"
    )
    ap.add_argument(
        "--tensor", type=int, default=None, help="tensor-parallel degree (low-rank is decided per shard; default 1)"
    )
    ap.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    return ap


def run_config_sections(path: str) -> dict | None:
    """The YAML at ``path`` merged with its includes, when it is a run config (it sets ``parallel``, ``train`` or
    ``outer``); None for a file with a model section only."""
    raw = _read_yaml(path)
    return raw if any(k in raw for k in ("parallel", "train", "outer")) else None


def _from_run_config(args: argparse.Namespace, path: str) -> tuple[list, list[str]]:
    """Fill ``args`` from the run config at ``path``; return ``(its Method, the assumption lines)``. A flag given
    with another value than the config's is a ValueError naming both (the plan would describe another run)."""
    cfg = load_config(path)
    if cfg.outer.method == "none" or cfg.parallel.replicas < 2 and not cfg.outer.elastic.enabled:
        raise ValueError(
            f"{path} trains one replica (outer.method={cfg.outer.method!r}, parallel.replicas="
            f"{cfg.parallel.replicas}): nothing crosses a slow link; plan a config with replicas, or pass "
            "--model with --replicas to compare the presets"
        )
    tokens = cfg.train.batch_size * cfg.train.seq_len
    el = cfg.outer.elastic
    # an elastic job is ONE replica of a run: planned at the replicas its first outer step waits for
    replicas = (
        (max(el.initial_replicas or el.min_replicas, 2), "outer.elastic.initial_replicas (or min_replicas, >= 2)")
        if el.enabled
        else (cfg.parallel.replicas, "parallel.replicas")
    )
    own = {
        "replicas": replicas,
        "pipeline": (cfg.parallel.pipeline, "parallel.pipeline"),
        "tensor": (cfg.parallel.tensor, "parallel.tensor"),
        "tokens_per_step": (tokens, "train.batch_size x train.seq_len"),
    }
    if cfg.outer.method not in ("allreduce", "cocktailsgd"):
        own["H"] = (cfg.outer.sync_every, "outer.sync_every")
    for key, (value, field) in own.items():
        given = getattr(args, key)
        if given is not None and given != value:
            flag = "--" + key.replace("_", "-")
            raise ValueError(
                f"{flag} {given:g} contradicts {path}'s {field} = {value:g}: drop the flag (the config's value is "
                f"used) or change the config"
            )
        setattr(args, key, value)
    if args.rank is not None or args.group_size is not None:
        raise ValueError(f"--rank/--group-size: {path} sets its own compress section; change it there")
    method = Method(f"{os.path.splitext(os.path.basename(path))[0]}{THIS_CONFIG}", cfg.outer, cfg.compress)
    notes = [
        f"from {path}: {cfg.model.arch} {cfg.model.n_layers} layers x d {cfg.model.d_model}, {args.replicas} replicas "
        f"of PP {args.pipeline} x TP {args.tensor}, {cfg.train.batch_size} x {cfg.train.seq_len} = {tokens:,} tokens "
        f"per replica per step, outer.method={cfg.outer.method}"
        + (f" (H = {cfg.outer.sync_every}, {_schedule(cfg.outer, method.overlap)})" if not method.per_step else ""),
        "assumed (not in the config): the GPUs (--gpus-per-replica, --gpu-tflops, --mfu or --step-time) and the "
        "link's latency (--latency)",
    ]
    return [method], notes


def _plan_rows(args: argparse.Namespace) -> tuple[float, list[dict]]:
    """``(bandwidth in bits/s, one plan row per selected preset)``; ValueError/OSError/ConfigError on bad input.

    A run config (positional, or given as --model) plans its own method on its own layout and batch, with
    allreduce beside it (or the --methods presets on that layout); a model file plans every preset. Each row gets
    ``bytes_per_step`` (what one replica sends per inner step) and ``vs_allreduce_per_step`` (allreduce's bytes per
    step over the row's: the saving a user compares, where ``compression_ratio`` is per sync)."""
    if args.config and args.model and args.config != args.model:
        raise ValueError("give the run config once: as CONFIG or as --model, not both")
    path = args.config or args.model
    if path is None:
        raise ValueError("name a run config (dilocox plan configs/tiny-dilocox.yaml ...) or --model MODEL.yaml")
    bw = parse_bandwidth(args.bandwidth)
    _check_numbers(args)
    mcfg = load_config(path).model
    known = method_names()
    methods: list = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    bad = [m for m in methods or [] if m not in known]
    if bad:
        raise ValueError(f"--methods: unknown {bad}; choose from {known} (configs/methods/*.yaml)")
    args.notes = []
    if run_config_sections(path) is not None:
        own, args.notes = _from_run_config(args, path)
        methods = methods or ["allreduce", *own]
    elif args.replicas is None:
        raise ValueError(f"--replicas is needed: {path} has no parallel section (it is a model file)")
    args.pipeline, args.tensor = args.pipeline or 1, args.tensor or 1
    args.tokens_per_step = DEFAULT_TOKENS_PER_STEP if args.tokens_per_step is None else args.tokens_per_step
    kw = dict(
        tokens_per_step=args.tokens_per_step,
        peak_flops=args.gpus_per_replica * args.gpu_tflops * 1e12,
        mfu=args.mfu,
        latency_s=args.latency,
        step_time_s=args.step_time,
        pipeline=args.pipeline,
        tensor=args.tensor,
    )
    args.mcfg, args.plan_kw = mcfg, kw
    rows = []
    for m in methods or known:
        if isinstance(m, Method):
            rows.append(plan(mcfg, args.replicas, bw, method=m, **kw))
        else:
            rows += plan_all(mcfg, args.replicas, bw, [m], H=args.H, rank=args.rank, group_size=args.group_size, **kw)
    ar = plan(mcfg, args.replicas, bw, method="allreduce", **kw)
    ar_step = ar["wire_bytes_per_replica"] / ar["H"]
    for r in rows:
        r["bytes_per_step"] = r["wire_bytes_per_replica"] / r["H"]
        r["vs_allreduce_per_step"] = ar_step / r["bytes_per_step"] if r["bytes_per_step"] else math.inf
    return bw, rows


def _seconds(text: str) -> float:
    try:
        return parse_seconds(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _check_numbers(args: argparse.Namespace) -> None:
    """The assumed hardware numbers must be physical (NaN included): a ValueError naming the flag otherwise."""
    rules = [
        ("--mfu", args.mfu, lambda v: 0 < v <= 1, "a fraction in (0, 1]"),
        ("--gpus-per-replica", args.gpus_per_replica, lambda v: v > 0, "> 0"),
        ("--gpu-tflops", args.gpu_tflops, lambda v: v > 0, "> 0"),
        ("--latency", args.latency, lambda v: 0 <= v < math.inf, "seconds >= 0"),
        ("--step-time", args.step_time, lambda v: v is None or 0 < v < math.inf, "seconds > 0"),
        ("--tokens-per-step", args.tokens_per_step, lambda v: v is None or v > 0, "> 0"),
        ("--replicas", args.replicas, lambda v: v is None or v >= 2, "an int >= 2 (R replicas joined by the link)"),
        ("--pipeline", args.pipeline, lambda v: v is None or v >= 1, "an int >= 1 (stages per replica)"),
        ("--tensor", args.tensor, lambda v: v is None or v >= 1, "an int >= 1 (tensor-parallel degree)"),
    ]
    for flag, value, ok, want in rules:
        if not ok(value):
            raise ValueError(f"{flag} {value} must be {want}")


def _choice(args: argparse.Namespace, bw: float, rows: list[dict]) -> str:
    """The choice line, among the presets of the pair whose own settings fit this model and layout (streaming
    fragments need as many layers per stage: the rows above may plan a layout the pair's K does not fit)."""
    fits, why = [], []
    for name in PRESET_PAIR:
        try:
            plan(args.mcfg, args.replicas, bw, method=name, **args.plan_kw)
            fits.append(name)
        except (ValueError, ConfigError) as e:
            why.append(f"`{name}` does not fit this model and layout: {e}")
    if not fits:
        return "preset for this link: none; " + "; ".join(why)
    name, preset_rows = choose_preset(args.mcfg, args.replicas, bw, pair=tuple(fits), **args.plan_kw)
    line = choice_line(name, preset_rows)
    own = [r for r in rows if r["method"].endswith(THIS_CONFIG)]
    best = max(r["utilization"] for r in preset_rows)
    if own and own[0]["utilization"] >= UTIL_TARGET and own[0]["utilization"] > best:
        # (the presets are the advice for a config without outer settings of its own: this one does better here)
        line = (
            f"this config's own method keeps {own[0]['utilization']:.1%} of the compute on this link (the `dilocox` "
            f"presets {best:.1%} at most): keep it. Otherwise, " + line
        )
    return "; ".join([line, *why])


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
        f"# plan: {args.config or args.model}, {args.replicas} replicas, {fmt_bandwidth(bw)} per replica link, "
        f"latency {args.latency * 1e3:g} ms/collective step\n"
    )
    for line in getattr(args, "notes", []):
        print(line)
    print(f"\ninner step: {step}\n")
    print(format_table(rows))
    if set(PRESET_PAIR) <= set(method_names()):
        print("\n" + _choice(args, bw, rows))
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
