"""``dilocox bench methods``: every method preset at equal tokens, R=2 replicas x PP=2 (4 ranks).

Same model (tiny GPT-2), data, seed and token budget for all presets; reports the final
validation loss and its curve (PNG), bytes sent between replicas (the framework's counters,
summed over the ranks of a replica) and the compression ratio against ``allreduce``.

    dilocox bench methods [--steps 300] [--H 20] [--methods allreduce,diloco,...] [--set=--train.seed=1] \
[--out docs/bench/methods]
    dilocox bench methods --ablation [--out docs/bench/ablation]

``--ablation`` runs ``allreduce`` and ``dilocox-paper`` (DiLoCoX as the paper describes it) with its
parts switched off one at a time (``ABLATION``), to show which of them costs loss at this scale.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from dilocox.bench.runner import (
    TrainingFailed,
    fmt_cell,
    has_loss,
    line_plot,
    loss_gap_pct,
    machine_line,
    out_dir,
    run_train,
    write_config,
    write_results,
)

METHODS = [
    "allreduce", "diloco", "opendiloco", "cocktailsgd", "streaming", "eager", "dilocox-paper", "dilocox", "sparseloco",
    "muloco", "streaming-sparse",
]  # fmt: skip
LAYOUT = """parallel: {replicas: 2, pipeline: 2, microbatches: 2}
"""


# presets whose H is part of their point on the frontier (per-step methods, and the `dilocox` presets whose
# density is set for their own H): the benches leave their ``outer.sync_every`` as the YAML has it
OWN_H = ("allreduce", "cocktailsgd", "dilocox", "dilocox-far")


def method_body(method: str, H: int, layout: str = LAYOUT) -> str:
    """Per-method settings scaled to a short CPU run (the papers' H=100..500 are for 4k-step runs). The presets of
    ``OWN_H`` keep their own H (`dilocox`: 4, a fragment every 2 steps; its density sets its bytes, not H)."""
    extra = {
        "opendiloco": "",
        "streaming": "",
        "dilocox-paper": (
            f"compress: {{lowrank: {{rank: 8}}, adaptive: {{h_min: {max(2, H // 2)}, h_max: {2 * H}, rank_max: 16}}}}\n"
        ),
    }.get(method, "")
    sync = "" if method in OWN_H else f"outer: {{sync_every: {H}}}\n"
    return layout + sync + extra


# (label, preset, overrides): DiLoCoX with one part at a time switched off or changed
_OFF = ["--compress.lowrank.enabled=false", "--compress.quant=none", "--compress.adaptive.enabled=false"]
ABLATION = [
    ("allreduce", "allreduce", []),
    ("dilocox-paper", "dilocox-paper", []),
    ("dilocox-paper, no adaptive (rank 8, H fixed)", "dilocox-paper", ["--compress.adaptive.enabled=false"]),
    ("dilocox-paper, no low rank (int4 only)", "dilocox-paper", ["--compress.lowrank.enabled=false"]),
    ("dilocox-paper, no compression", "dilocox-paper", _OFF),
    ("dilocox-paper, outer momentum 0.5", "dilocox-paper", ["--outer.momentum=0.5"]),
    ("dilocox-paper, eager instead of delay", "dilocox-paper", ["--outer.overlap=eager"]),
    ("dilocox-paper, no delay (blocking)", "dilocox-paper", ["--outer.overlap=none"]),
    ("dilocox-paper, no delay, outer momentum 0.5", "dilocox-paper", ["--outer.overlap=none", "--outer.momentum=0.5"]),
    ("dilocox-paper, no delay, no compression, outer 0.7/0.9 (= diloco)",
        "dilocox-paper",
        ["--outer.overlap=none", *_OFF, "--outer.lr=0.7", "--outer.momentum=0.9"],
    ),
    # the delay remedy tried for issue 23 item 2c (outer.lookahead, ALGORITHMS §3b); without the adaptive
    # controller the runs are deterministic, so the delay's own cost is read without its timing noise
    ("dilocox-paper, look-ahead start (lookahead 1)", "dilocox-paper", ["--outer.lookahead=1.0"]),
    ("dilocox-paper, no adaptive, no delay (blocking)", "dilocox-paper",
     ["--compress.adaptive.enabled=false", "--outer.overlap=none"]),
    ("dilocox-paper, no adaptive, look-ahead start (lookahead 1)", "dilocox-paper",
     ["--compress.adaptive.enabled=false", "--outer.lookahead=1.0"]),
    ("dilocox-paper, no adaptive, look-ahead start (lookahead 0.5)", "dilocox-paper",
     ["--compress.adaptive.enabled=false", "--outer.lookahead=0.5"]),
]  # fmt: skip


def run(
    methods: list[str] | list[tuple[str, str, list[str]]],
    steps: int,
    H: int,
    run_root: str,
    common: list[str] = (),
    layout: str = LAYOUT,
    nproc: int = 4,
    keep_going: bool = False,
) -> list[dict]:
    """Run each entry (a preset name, or ``(label, preset, overrides)``) at equal tokens;
    ``common`` overrides (e.g. ``--train.seed=1``) apply to every run; ``layout`` (YAML) and ``nproc`` set the
    replicas and stages (``bench scale`` runs R replicas x PP=1 on R ranks). ``keep_going``: a run that fails (a
    learning-rate lever that diverges) becomes a row with ``failed`` (its rank's error) and a NaN loss, and the
    sweep goes on; else the failure is raised."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, entry in enumerate(methods):
            label, m, extra = (entry, entry, []) if isinstance(entry, str) else entry
            cfg = write_config(
                os.path.join(tmp, f"{i}-{m}.yaml"), ["tiny.yaml", f"methods/{m}.yaml"], method_body(m, H, layout)
            )
            try:
                res = run_train(
                    cfg,
                    nproc,
                    os.path.join(run_root, f"{i}-{m}"),
                    [f"--train.steps={steps}", "--train.eval_every=50", *common, *extra],
                )
            except TrainingFailed as e:
                if not keep_going:
                    raise
                print(f"dilocox bench: {label} failed: {e.cause or e}; going on", file=sys.stderr, flush=True)
                rows.append({"method": label, "preset": m, "overrides": list(extra), "failed": e.cause or str(e)[:500],
                             "final_val_loss": float("nan"), "bytes_sent_per_replica": 0, "val_curve": []})  # fmt: skip
                continue
            s = res["summary"]
            # bytes sent to the other replicas by the ranks (stages) of replica 0
            sent = sum(r.get("outer_bytes_sent", 0) for r in res["ranks"] if "replica 0" in r["coord"])
            blocked = max((r.get("outer_blocked_total_s", 0.0) for r in res["ranks"]), default=0.0)
            rows.append(
                {
                    "method": label,
                    "preset": m,
                    "overrides": list(extra),
                    "final_val_loss": s["final_val_loss"],
                    "tokens_per_s": s["tokens_per_s"],
                    "wall_s": s["wall_s"],
                    "bytes_sent_per_replica": sent,
                    "blocked_s": blocked,
                    "tokens_per_replica": s["tokens_per_replica"],
                    "val_curve": [(r["step"], r["val_loss"]) for r in res["steps"] if "val_loss" in r]
                    + ([(s["steps"], s["final_val_loss"])] if has_loss(s) else []),
                }
            )
    base = next((r for r in rows if r["method"] == "allreduce" and "failed" not in r), None)
    for r in rows:
        if base and "failed" not in r:
            gap = loss_gap_pct(r, base)  # (None where a run has no final val loss: train.eval_batches=0)
            if gap is not None:
                r["loss_vs_allreduce_pct"] = gap
            r["bytes_ratio_vs_allreduce"] = base["bytes_sent_per_replica"] / max(1, r["bytes_sent_per_replica"])
    return rows


def markdown(rows: list[dict], steps: int, H: int, common: list[str] = (), load: tuple | None = None) -> str:
    """The table; ``load`` = (load average before, after) the runs: tokens/s and blocked time move with it, the
    losses and bytes do not (the runs are deterministic but for ``dilocox-paper``'s timed adaptive controller)."""
    extra = f"; every run with {' '.join(common)}" if common else ""
    if load is not None:
        extra += "; load average before {:.2f}, after {:.2f} (1 min)".format(*load)
    lines = [
        f"Machine: {machine_line()}; date {time.strftime('%Y-%m-%d')}; tiny GPT-2, 2 replicas x 2 pipeline stages "
        f"(4 CPU ranks, gloo), {steps} steps x 8 x 128 tokens per replica, H={H} for the local-step methods{extra}.",
        "",
        "| method | final val loss | vs allreduce | bytes sent per replica | fewer bytes than allreduce "
        "| blocked on outer (s) | tokens/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "failed" in r:  # a row of --keep-going: its error instead of numbers it does not have
            why = str(r["failed"]).splitlines()[0][:120].replace("|", "/")
            lines.append(f"| {r['method']} | failed: {why} | - | - | - | - | - |")
            continue
        lines.append(
            f"| {r['method']} | {fmt_cell(r['final_val_loss'])} | "
            f"{fmt_cell(r.get('loss_vs_allreduce_pct'), '+.1f', ' %')} | {r['bytes_sent_per_replica'] / 1e6:,.2f} MB | "
            f"{fmt_cell(r.get('bytes_ratio_vs_allreduce'), ',.0f', 'x')} | "
            f"{r['blocked_s']:.2f} | {r['tokens_per_s']:,.0f} |"
        )
    return "\n".join(lines)


TITLES = {
    False: "methods at equal tokens, 2 replicas x PP=2",
    True: "DiLoCoX ablation: one part changed at a time, 2 replicas x PP=2",
}


def plot(rows: list[dict], path: str, ablation: bool = False) -> dict:
    """val_loss.png: one curve per row, each with its own marker and line style (see ``series_style``)."""
    return line_plot(
        path,
        [(r["method"], *zip(*r["val_curve"]), None) for r in rows if r["val_curve"]],  # (a failed row: none)
        "step (equal tokens per replica)",
        "validation loss",
        TITLES[ablation],
        figsize=(6.4, 4.0),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="dilocox bench methods", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--H", type=int, default=20)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument(
        "--set",
        dest="common",
        action="append",
        default=[],
        metavar="--KEY=VALUE",
        help="a config override for every run, e.g. --set=--train.seed=1 (repeatable)",
    )
    ap.add_argument(
        "--ablation", action="store_true", help="dilocox-paper with its parts switched off one at a time (ABLATION)"
    )
    ap.add_argument(
        "--out", type=out_dir, default=None, help="default docs/bench/methods (docs/bench/ablation with --ablation)"
    )
    ap.add_argument("--render", action="store_true", help="only re-draw val_loss.png from OUT/results.json")
    a = ap.parse_args(argv)
    a.out = a.out or os.path.join("docs", "bench", "ablation" if a.ablation else "methods")
    os.makedirs(a.out, exist_ok=True)
    if a.render:
        with open(os.path.join(a.out, "results.json")) as f:
            plot(json.load(f), os.path.join(a.out, "val_loss.png"), a.ablation)
        return 0
    entries = ABLATION if a.ablation else a.methods.split(",")
    load0 = os.getloadavg()[0]
    rows = run(
        entries, a.steps, a.H, os.path.join("runs", "bench-ablation" if a.ablation else "bench-methods"), a.common
    )
    md = markdown(rows, a.steps, a.H, a.common, load=(load0, os.getloadavg()[0]))
    write_results(a.out, rows, md)
    plot(rows, os.path.join(a.out, "val_loss.png"), a.ablation)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
