"""``dilocox bench lengths``: the gap to all-reduce by run length, drawn from ``dilocox bench frontier`` results
(issue 41 item 1: "does the gap grow?" as one picture). Nothing is trained here.

    dilocox bench lengths DIR [DIR ...] [--out docs/bench/length]

Each DIR holds a frontier ``results.json`` (e.g. ``--steps 1000`` and ``--steps 3000`` runs of the same points). Rows
are grouped by (corpus, seed, point); a table gives each point's final val loss and gap to all-reduce at every
length, and whether the compressed ``dilocox`` preset is at or below the best uncompressed DiLoCo-family point of its
(corpus, seed, length) (issue 41: compression for free); ``gap.png`` draws gap against steps per point and corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from dilocox.bench.runner import has_loss, loss_gap_pct, out_dir, write_results


def uncompressed(label: str) -> bool:
    """A DiLoCo-family point that sends its pseudo-gradients whole: DiLoCo (fp32), Streaming DiLoCo's fp32 points
    (its preset sends int4; OpenDiLoCo sends fp16)."""
    first = label.split()[0]
    return first == "diloco" or (first == "streaming" and "fp32" in label.split())


def collect(dirs: list[str]) -> list[dict]:
    rows = []
    for d in dirs:
        path = os.path.join(d, "results.json")
        try:
            with open(path) as f:
                got = json.load(f)["rows"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"dilocox bench lengths: cannot read {path} ({type(e).__name__}: {e})") from None
        rows += [dict(r, source=d) for r in got]
    return rows


def table(rows: list[dict]) -> dict:
    """{(corpus, seed): {"steps": [...], "points": {label: {steps: row}}}}"""
    out: dict = {}
    for r in rows:
        g = out.setdefault((r["corpus"], r["seed"]), {"steps": set(), "points": {}})
        g["steps"].add(r["steps"])
        prev = g["points"].setdefault(r["label"], {}).get(r["steps"])
        if prev is not None:  # (the later row would hide the first, and gaps taken against either all-reduce mix)
            raise SystemExit(
                f"dilocox bench lengths: {r['label']!r} at {r['steps']} steps ({r['corpus']}, seed {r['seed']}) is "
                f"in both {prev.get('source')} and {r.get('source')}: give each (corpus, seed, point, steps) once"
            )
        g["points"][r["label"]][r["steps"]] = r
    for g in out.values():
        g["steps"] = sorted(g["steps"])
        base = g["points"].get("allreduce", {})
        for per in g["points"].values():  # a point run on its own (no allreduce in its frontier run): its gap is
            for steps, r in per.items():  # to the allreduce row of the same corpus, seed and length in another DIR
                gap = loss_gap_pct(r, base.get(steps))
                if "loss_vs_allreduce_pct" not in r and gap is not None:
                    r["loss_vs_allreduce_pct"] = gap
    return out


PRESETS = ("dilocox", "dilocox-far")  # the compressed presets graded (frontier labels = preset names)


def verdicts(groups: dict) -> list[dict]:
    """Per (corpus, seed, steps) and `dilocox` preset run there: it against the best uncompressed DiLoCo-family
    point."""
    out = []
    for (corpus, seed), g in sorted(groups.items()):
        for steps in g["steps"]:
            unc = [p[steps] for label, p in g["points"].items() if uncompressed(label) and steps in p]
            unc = [r for r in unc if "loss_vs_allreduce_pct" in r and has_loss(r)]  # (each with a loss and a gap)
            for preset in PRESETS:
                ours = g["points"].get(preset, {}).get(steps)
                if ours is None or not unc or "loss_vs_allreduce_pct" not in ours or not has_loss(ours):
                    continue
                best = min(unc, key=lambda r: r["final_val_loss"])
                out.append({"corpus": corpus, "seed": seed, "steps": steps, "preset": preset,
                            "loss": ours["final_val_loss"], "gap_pct": ours["loss_vs_allreduce_pct"],
                            "best_uncompressed": best["label"], "best_uncompressed_loss": best["final_val_loss"],
                            "best_uncompressed_gap_pct": best["loss_vs_allreduce_pct"],
                            "free": ours["final_val_loss"] <= best["final_val_loss"]})  # fmt: skip
    return out


def _cell(r: dict) -> str:
    gap = r.get("loss_vs_allreduce_pct")
    if not has_loss(r):
        return "no final val loss"
    return f"{r['final_val_loss']:.4f} " + (f"({gap:+.1f} %)" if gap is not None else "(no allreduce run)")


def markdown(groups: dict, verdict: list[dict], meta: dict) -> str:
    lines = [f"Machine: {meta['machine']}; from {', '.join(meta['sources'])}. Val loss (gap to all-reduce).", ""]
    for (corpus, seed), g in sorted(groups.items()):
        steps = g["steps"]
        lines += [
            f"| {corpus}, seed {seed} | " + " | ".join(f"{s} steps" for s in steps) + " |",
            "|---|" + "---|" * len(steps),
        ]
        for label, per in g["points"].items():
            cells = [_cell(per[s]) if s in per else "-" for s in steps]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    if verdict:
        lines.append("Compression for free (issue 41: a `dilocox` preset's val loss <= the best uncompressed")
        lines.append("DiLoCo-family point of the same corpus, seed and length):")
        for v in verdict:
            lines.append(
                f"- {v['corpus']}, seed {v['seed']}, {v['steps']} steps: {v['preset']} {v['loss']:.4f} "
                f"({v['gap_pct']:+.1f} %) vs {v['best_uncompressed']} {v['best_uncompressed_loss']:.4f} "
                f"({v['best_uncompressed_gap_pct']:+.1f} %) -> {'met' if v['free'] else 'NOT met'}"
            )
    return "\n".join(lines).rstrip()


def plot(groups: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (corpus, seed), g in sorted(groups.items()):
        for label, per in g["points"].items():
            if label == "allreduce":
                continue
            xs = sorted(s for s in per if "loss_vs_allreduce_pct" in per[s])
            style = "-" if label == "dilocox" else "--"
            gaps = [per[s]["loss_vs_allreduce_pct"] for s in xs]
            ax.plot(xs, gaps, marker="o", linestyle=style, label=f"{label} ({corpus}, seed {seed})")
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xscale("log")
    ax.set_xlabel("steps (log)")
    ax.set_ylabel("final val loss vs all-reduce (%)")
    ax.set_title("The gap to all-reduce by run length")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dilocox bench lengths", description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", help="frontier result directories (each with results.json)")
    ap.add_argument("--out", type=out_dir, default=os.path.join("docs", "bench", "length"))
    a = ap.parse_args(argv)
    rows = collect(a.dirs)
    groups = table(rows)
    verdict = verdicts(groups)
    meta = {"machine": rows[0].get("machine") or _machine(a.dirs[0]), "sources": a.dirs,
            "command": "dilocox bench lengths " + " ".join(argv if argv is not None else sys.argv[1:])}  # fmt: skip
    md = markdown(groups, verdict, meta)
    os.makedirs(a.out, exist_ok=True)
    flat = [{k: v for k, v in r.items() if k != "source"} | {"source": r["source"]} for r in rows]
    write_results(a.out, {"meta": meta, "rows": flat, "verdicts": verdict}, md)
    plot(groups, os.path.join(a.out, "gap.png"))
    print(md)
    return 0


def _machine(d: str) -> str:
    with open(os.path.join(d, "results.json")) as f:
        return json.load(f)["meta"]["machine"]


if __name__ == "__main__":
    raise SystemExit(main())
