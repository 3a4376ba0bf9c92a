"""``dilocox bench scale``: the gap to all-reduce by model size and replica count, at equal tokens (issue 41 item 2).

Each cell (model width x replicas R) runs the same points (all-reduce, the best uncompressed DiLoCo-family point of
``bench frontier``, the ``dilocox`` preset) as ``dilocox train`` runs of R replicas x PP = 1 on R CPU ranks. The
global batch is held fixed (``--global-batch`` sequences of 128 tokens per step, split evenly over the replicas), so
every cell of a width trains on the same tokens in the same number of steps: more replicas means smaller local
batches, as in DiLoCo's scaling studies (Charles et al. 2025 hold the global batch fixed too).

    dilocox bench scale [--widths 64,128,256] [--replicas 2,4,8] [--steps 1000] [--corpus docs] [--seed 0] \\
[--out docs/bench/scale]
    dilocox bench scale --render [--merge DIR ...]   re-table and re-draw OUT/results.json (with other sweeps' cells)

The model is the tiny GPT-2 (4 layers, byte vocabulary) at width d (d / 32 heads). Bytes are replica 0's counters
(what its ranks sent to the other replicas). The table gives each point's final val loss and gap to all-reduce per
cell; ``gap.png`` draws the gap against replicas, one line per width and point.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

from dilocox.bench.frontier import CORPORA, LEVERS, POINTS
from dilocox.bench.methods import run as run_methods
from dilocox.bench.runner import has_loss, loss_gap_pct, machine_line, out_dir, write_results

DEFAULT_POINTS = "allreduce,streaming H=20 K=2 fp32,dilocox"
H_BASE = 20
SEQ = 128


def params_of(width: int, layers: int = 4, vocab: int = 256, seq: int = 256) -> int:
    """GPT-2 parameters (untied head, learned positions, biases): for the table's size column."""
    block = 12 * width * width + 13 * width
    return layers * block + 2 * vocab * width + seq * width + 2 * width


def cell_overrides(width: int, replicas: int, global_batch: int) -> list[str]:
    if width % 32 or width < 32:
        raise SystemExit(f"dilocox bench scale: --widths {width}: each width must be a multiple of 32 (heads of 32)")
    if global_batch % replicas:
        raise SystemExit(
            f"dilocox bench scale: --global-batch {global_batch} does not split over {replicas} replicas; "
            "pick a multiple of every --replicas value"
        )
    return [
        f"--model.d_model={width}",
        f"--model.n_heads={width // 32}",
        f"--train.batch_size={global_batch // replicas}",
        f"--train.seq_len={SEQ}",
    ]


def run(a: argparse.Namespace, points: list[tuple], save=None) -> list[dict]:
    """Every cell in turn; ``save(rows)`` after each, so a long sweep leaves its finished cells behind."""
    rows = []
    common = [CORPORA[a.corpus], f"--train.seed={a.seed}"]
    for width in a.widths:
        for R in a.replicas:
            extra = cell_overrides(width, R, a.global_batch)
            entries = [(label, preset, [*extra, *over]) for label, _, preset, over in points]
            layout = f"parallel: {{replicas: {R}, pipeline: 1}}\n"
            got = run_methods(
                entries,
                a.steps,
                H_BASE,
                os.path.join("runs", "bench-scale", f"d{width}-r{R}"),
                common,
                layout,
                R,
                keep_going=True,  # (a lever that diverges is a cell of its own: "failed", and the sweep goes on)
            )
            for r in got:
                label = r.pop("method")
                r.pop("val_curve", None)
                r.update(label=label, width=width, params=params_of(width), replicas=R, steps=a.steps,
                         corpus=a.corpus, seed=a.seed, global_batch=a.global_batch)  # fmt: skip
                print(f"d{width} R={R} {label}: {_cell(r)}", flush=True)
            rows += got
            if save is not None:
                save(rows)
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"Machine: {meta['machine']}; date {meta['date']}; tiny GPT-2 (4 layers, byte vocabulary) at each width, "
        f"R replicas x PP=1 on R CPU ranks (gloo); global batch {meta['global_batch']} x {SEQ} tokens per step split "
        f"over the replicas; {meta['steps']} steps; corpus {meta['corpus']}; seed {meta['seed']}; bench wall "
        f"{meta['wall_min']:.1f} min. Cells: final val loss (gap to all-reduce); bytes: fewer than all-reduce.",
    ]
    reps = sorted({r["replicas"] for r in rows})
    for width in sorted({r["width"] for r in rows}):
        g = [r for r in rows if r["width"] == width]
        lines += [
            "",
            f"| d={width} ({g[0]['params'] / 1e6:.2f}M params) | " + " | ".join(f"R={R}" for R in reps) + " |",
            "|---|" + "---|" * len(reps),
        ]
        for label in dict.fromkeys(r["label"] for r in g):
            cells = []
            for R in reps:
                r = next((x for x in g if x["label"] == label and x["replicas"] == R), None)
                cells.append("-" if r is None else _cell(r))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Issue 41 (at the largest width, the `dilocox` preset within 3 % of all-reduce):", *verdicts(rows)]
    return "\n".join(lines)


def _cell(r: dict) -> str:
    if "failed" in r:  # (the rank's error: a diverged run names its step, e.g. "loss is nan at step 540")
        err = re.sub(r"^rank \d+: ", "", r["failed"])
        if err.startswith(("FloatingPointError: loss is", "training stopped: loss is")):
            return "diverged: " + err.split(": ", 1)[1].split(";")[0][:80]
        return "failed: " + err[:80]
    if not has_loss(r):  # (train.eval_batches=0: final_val_loss null)
        return "no final val loss"
    if "loss_vs_allreduce_pct" not in r:  # (a sweep without allreduce: no gap to give)
        return f"{r['final_val_loss']:.4f} (no allreduce run)"
    return f"{r['final_val_loss']:.4f} ({r['loss_vs_allreduce_pct']:+.1f} %, {r['bytes_ratio_vs_allreduce']:,.0f}x)"


def verdicts(rows: list[dict]) -> list[str]:
    out = []
    if not rows:
        return out
    top = max(r["width"] for r in rows)
    for R in sorted({r["replicas"] for r in rows}):
        ours = next((r for r in rows if r["width"] == top and r["replicas"] == R and r["label"] == "dilocox"), None)
        if ours is None or "loss_vs_allreduce_pct" not in ours:
            continue
        gap = ours["loss_vs_allreduce_pct"]
        out.append(f"- d={top}, R={R}: dilocox {gap:+.1f} % -> {'met' if gap <= 3 else 'NOT met'}")
    return out


def plot(rows: list[dict], path: str) -> list[str]:
    """Gap to all-reduce against replicas: one line per (width, point), the point as the marker (markers and line
    styles repeat past 5 points and 4 widths: every line is drawn). Returns the lines' labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    labels = [lb for lb in dict.fromkeys(r["label"] for r in rows) if lb != "allreduce"]
    widths = sorted({r["width"] for r in rows})
    drawn = []
    for i, label in enumerate(labels):
        for j, width in enumerate(widths):
            pts = sorted((r for r in rows if r["label"] == label and r["width"] == width
                          and "loss_vs_allreduce_pct" in r), key=lambda r: r["replicas"])  # fmt: skip
            if pts:
                drawn.append(f"{label}, d={width}")
                ax.plot([r["replicas"] for r in pts], [r["loss_vs_allreduce_pct"] for r in pts], marker="osD^v"[i % 5],
                        linestyle=("-", "--", ":", "-.")[j % 4], label=drawn[-1])  # fmt: skip
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("replicas (equal global batch and tokens)")
    ax.set_ylabel("val loss gap to all-reduce (%)")
    ax.set_title("the gap by model width and replica count")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def regap(rows: list[dict]) -> list[dict]:
    """Each row's gap and byte ratio against the all-reduce row of its own cell (width, replicas), as
    ``methods.run`` computes them within one sweep: after ``--merge`` a cell may hold rows of two sweeps, and a row
    kept from one must not carry its gap to an all-reduce row the other sweep replaced."""
    for r in rows:
        if "failed" in r:
            continue
        base = next((b for b in rows if (b["width"], b["replicas"]) == (r["width"], r["replicas"])
                     and b["label"] == "allreduce" and "failed" not in b), None)  # fmt: skip
        r.pop("loss_vs_allreduce_pct", None)
        r.pop("bytes_ratio_vs_allreduce", None)
        if base is None:
            continue
        gap = loss_gap_pct(r, base)
        if gap is not None:
            r["loss_vs_allreduce_pct"] = gap
        r["bytes_ratio_vs_allreduce"] = base["bytes_sent_per_replica"] / max(1, r["bytes_sent_per_replica"])
    return rows


def _read(out: str) -> tuple[dict, list[dict]]:
    path = os.path.join(out, "results.json")
    try:
        with open(path) as f:
            got = json.load(f)
        return got["meta"], got["rows"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"dilocox bench scale --render: cannot read {path} ({type(e).__name__}: {e})") from None


def _ints(s: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x]
    except ValueError:
        raise SystemExit(f"dilocox bench scale: {flag} {s!r}: give a comma list of integers, e.g. 2,4,8") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="dilocox bench scale", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--widths", default="64,128,256", help="model widths d_model (multiples of 32)")
    ap.add_argument("--replicas", default="2,4,8")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--global-batch", type=int, default=16, help="sequences per step over all replicas")
    ap.add_argument("--corpus", default="docs", choices=sorted(CORPORA))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--points", default=DEFAULT_POINTS, help="comma list of bench frontier point labels")
    ap.add_argument("--out", type=out_dir, default=os.path.join("docs", "bench", "scale"))
    ap.add_argument("--render", action="store_true", help="only re-table and re-draw OUT/results.json")
    ap.add_argument("--merge", nargs="*", default=[], metavar="DIR",
                    help="with --render: add the cells of other sweeps' DIR/results.json to OUT's")  # fmt: skip
    a = ap.parse_args(argv)
    if a.render:
        meta, rows = _read(a.out)
        for d in a.merge:  # another sweep's cells (e.g. the largest width at fewer R), the later run's row kept
            more_meta, more = _read(d)
            differ = [k for k in ("steps", "global_batch", "corpus", "seed") if more_meta.get(k) != meta.get(k)]
            if differ:
                raise SystemExit(
                    f"dilocox bench scale --merge {d}: its {', '.join(differ)} differ from {a.out}'s "
                    f"({', '.join(f'{k} {more_meta.get(k)} vs {meta.get(k)}' for k in differ)}); merge sweeps of "
                    "the same steps, batch, corpus and seed only"
                )
            keys = {(r["width"], r["replicas"], r["label"]) for r in more}
            rows = [r for r in rows if (r["width"], r["replicas"], r["label"]) not in keys] + more
            meta["wall_min"] = meta.get("wall_min", 0.0) + more_meta.get("wall_min", 0.0)
        rows.sort(key=lambda r: (r["width"], r["replicas"]))
        if a.merge:
            regap(rows)  # (a merged cell: every gap against the all-reduce row it shows)
        write_results(a.out, {"meta": meta, "rows": rows}, markdown(rows, meta))
        plot(rows, os.path.join(a.out, "gap.png"))
        return 0
    a.widths, a.replicas = _ints(a.widths, "--widths"), _ints(a.replicas, "--replicas")
    known = {p[0]: p for p in POINTS + LEVERS}
    wanted = [s.strip() for s in a.points.split(",") if s.strip()]
    missing = [w for w in wanted if w not in known]
    if missing:
        raise SystemExit(f"dilocox bench scale: --points: unknown {missing}; choose from {sorted(known)}")
    for w in a.widths:
        for R in a.replicas:
            cell_overrides(w, R, a.global_batch)  # every cell checked before the first run
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()

    def save(rows: list[dict]) -> str:
        meta = dict(machine=machine_line(), date=time.strftime("%Y-%m-%d"), steps=a.steps, corpus=a.corpus,
                    seed=a.seed, global_batch=a.global_batch, wall_min=(time.time() - t0) / 60)  # fmt: skip
        md = markdown(rows, meta)
        write_results(a.out, {"meta": meta, "rows": rows}, md)
        plot(rows, os.path.join(a.out, "gap.png"))
        return md

    print(save(run(a, [known[w] for w in wanted], save)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
