"""``dilocox bench train``: the tiny GPT-2 on 1 CPU rank vs. 4 ranks (PP=2 x TP=2).

Shows the parallel overhead on this machine: tokens/s, peak RSS per rank, final validation
loss and the loss curves (PNG). Same model, data, seed and steps for both layouts.

    dilocox bench train [--steps 300] [--out docs/bench/train]
    dilocox bench train --reference [...]   dilocox's step next to a plain PyTorch loop (dilocox/bench/reference.py)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from dilocox.bench.runner import CONFIGS, line_plot, machine_line, out_dir, run_train, write_results

LAYOUTS = [("1 rank", "tiny.yaml", 1), ("PP=2 x TP=2 (4 ranks)", "tiny-pp2-tp2.yaml", 4)]


def run(steps: int, out: str) -> list[dict]:
    rows = []
    for name, cfg, nproc in LAYOUTS:
        res = run_train(
            os.path.join(CONFIGS, cfg),
            nproc,
            os.path.join("runs", "bench-train", cfg.replace(".yaml", "")),
            [f"--train.steps={steps}"],
        )
        s = res["summary"]
        rows.append(
            {
                "layout": name,
                "ranks": nproc,
                "tokens_per_s": s["tokens_per_s"],
                "wall_s": s["wall_s"],
                "final_val_loss": s["final_val_loss"],
                "peak_rss_mb": [r["peak_rss_mb"] for r in res["ranks"]],
                "curve": [(r["step"], r["loss"]) for r in res["steps"]],
                "val_curve": [(r["step"], r["val_loss"]) for r in res["steps"] if "val_loss" in r],
            }
        )
    return rows


def markdown(rows: list[dict], steps: int) -> str:
    lines = [
        f"Machine: {machine_line()}; date {time.strftime('%Y-%m-%d')}; {steps} steps of 8 x 128 tokens.",
        "",
        "| layout | tokens/s | wall (s) | final val loss | peak RSS per rank (MB) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        rss = ", ".join(f"{x:.0f}" for x in r["peak_rss_mb"])
        lines.append(
            f"| {r['layout']} | {r['tokens_per_s']:,.0f} | {r['wall_s']:.1f} | {r['final_val_loss']:.4f} | {rss} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    series = []
    for r in rows:
        series.append((f"{r['layout']} (train)", *zip(*r["curve"]), "-"))
        if r["val_curve"]:
            series.append((f"{r['layout']} (val)", *zip(*r["val_curve"]), "o--"))
    line_plot(path, series, "step", "loss (nats/token)", "tiny GPT-2 on the stdlib corpus", figsize=(6, 3.6))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--reference" in argv:  # dilocox train's step next to a plain PyTorch loop (reference.py)
        from dilocox.bench import reference

        argv.remove("--reference")
        return reference.main(argv)
    ap = argparse.ArgumentParser(
        prog="dilocox bench train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", type=out_dir, default="docs/bench/train")
    ap.add_argument("--reference", action="store_true", help="dilocox's step next to a plain loop (--reference --help)")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    rows = run(a.steps, a.out)
    md = markdown(rows, a.steps)
    write_results(a.out, rows, md)
    plot(rows, os.path.join(a.out, "loss.png"))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
