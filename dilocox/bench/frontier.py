"""``dilocox bench frontier``: final validation loss against bytes sent between replicas, every method family
swept over its bytes knobs at equal tokens, on two corpora and several seeds; the Pareto front drawn (issue 23).

Every point is one ``dilocox train`` run of the ``bench methods`` layout (tiny GPT-2, 2 replicas x 2 pipeline
stages, 4 CPU ranks, 8 x 128 tokens per replica per step) with a preset and its knob overrides. Bytes are the
framework's counters (what replica 0's ranks sent to the other replica). The corpora: ``code`` (the embedded
stdlib sources, ``data.source=stdlib``) and ``prose`` (CPython's ``pydoc_data.topics``, ``data.source=prose``).

    dilocox bench frontier --quick                 one seed, the six points of QUICK, both corpora (about 15 min)
    dilocox bench frontier [--seeds 0,1] [--steps 300] [--long-steps 1000] [--out docs/bench/frontier]
    dilocox bench frontier --render                re-draw and re-table OUT/results.json

A point is on the front of its (corpus, seed) when no other point has both fewer bytes and a lower loss.
``--long-steps N`` re-runs the points on the front of the first seed at N steps. The table reports issue 23's
target for the ``dilocox`` preset (>= 1000x fewer bytes than allreduce at <= 3 % val-loss gap, and no point
both cheaper and better) and, per corpus, the best point at >= 1000x.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from dilocox.bench.methods import run as run_methods
from dilocox.bench.runner import fmt_cell, has_loss, loss_gap_pct, machine_line, out_dir, write_results

CORPORA = {"code": "--data.source=stdlib", "prose": "--data.source=prose", "docs": "--data.source=docs"}

# (label, family, preset, overrides): the knobs that set the bytes of each family
POINTS = [
    ("allreduce", "allreduce", "allreduce", []),
    ("diloco H=20", "diloco", "diloco", ["--outer.sync_every=20"]),
    ("diloco H=50", "diloco", "diloco", ["--outer.sync_every=50"]),
    ("opendiloco H=20 (fp16)", "diloco", "opendiloco", ["--outer.sync_every=20"]),
    ("streaming H=20 K=2 int4", "streaming", "streaming", ["--outer.sync_every=20"]),
    ("streaming H=50 K=2 int4", "streaming", "streaming", ["--outer.sync_every=50"]),
    ("cocktailsgd", "cocktailsgd", "cocktailsgd", []),
    # the `dilocox` preset as it is (its own H = 4, top 1/128 2-bit on the streaming schedule, tau = 1) and
    # DiLoCoX as the paper describes it (`dilocox-paper`: low rank + int4, one-step delay, adaptive rank and H)
    ("dilocox", "dilocox", "dilocox", []),
    ("dilocox-paper H=20", "dilocox-paper", "dilocox-paper", []),
    ("dilocox-paper H=50", "dilocox-paper", "dilocox-paper",
     ["--outer.sync_every=50", "--compress.adaptive.h_max=100"]),
    ("sparseloco H=20 1/64 2-bit", "sparseloco", "sparseloco", ["--outer.sync_every=20"]),
    ("sparseloco H=50 1/64 2-bit", "sparseloco", "sparseloco", ["--outer.sync_every=50"]),
    ("sparseloco H=20 1/16 2-bit", "sparseloco", "sparseloco",
     ["--outer.sync_every=20", "--compress.sparse.density=0.0625"]),
    ("sparseloco H=20 1/64 4-bit", "sparseloco", "sparseloco", ["--outer.sync_every=20", "--compress.sparse.bits=4"]),
    ("streaming-sparse H=20 K=2 1/32 2-bit", "streaming", "streaming-sparse", ["--outer.sync_every=20"]),
    ("streaming-sparse H=20 K=2 1/16 2-bit", "streaming", "streaming-sparse",
     ["--outer.sync_every=20", "--compress.sparse.density=0.0625"]),
    # the same bytes per step as H=20 1/32, synced more often and sparser (2026-11-26 screening, BENCHMARKS §4c)
    ("streaming-sparse H=4 K=2 1/160 2-bit tau=1", "streaming", "streaming-sparse",
     ["--outer.sync_every=4", "--compress.sparse.density=0.00625", "--outer.streaming.tau=1"]),
    ("streaming-sparse H=2 K=2 1/320 2-bit tau=0", "streaming", "streaming-sparse",
     ["--outer.sync_every=2", "--compress.sparse.density=0.003125", "--outer.streaming.tau=0"]),
    ("streaming-sparse H=2 K=2 1/272 2-bit tau=0", "streaming", "streaming-sparse",
     ["--outer.sync_every=2", "--compress.sparse.density=0.0036764705882352941", "--outer.streaming.tau=0"]),
    ("streaming-sparse H=4 K=2 1/128 2-bit tau=1", "streaming", "streaming-sparse",
     ["--outer.sync_every=4", "--compress.sparse.density=0.0078125", "--outer.streaming.tau=1"]),
    ("muloco H=20 1/64 2-bit (Muon inner)", "muloco", "muloco", ["--outer.sync_every=20"]),
    ("diloco H=20, Muon inner", "muloco", "diloco", ["--outer.sync_every=20", "--optim.name=muon"]),
]  # fmt: skip
# issue 41's levers on the `dilocox` preset (and the uncompressed streaming baseline), run by label with --points
# (not in the default sweep): each changes one thing of the preset
LEVERS = [
    ("streaming H=20 K=2 fp32", "streaming", "streaming", ["--outer.sync_every=20", "--compress.quant=none"]),
    ("dilocox outer lr follows inner", "dilocox", "dilocox", ["--outer.lr_schedule=inner"]),
    ("dilocox Muon outer", "dilocox", "dilocox", ["--outer.optimizer=muon"]),
    ("dilocox EF decay 0.9", "dilocox", "dilocox", ["--compress.sparse.ef_decay=0.9"]),
    ("dilocox tau=0", "dilocox", "dilocox", ["--outer.streaming.tau=0"]),
    ("dilocox merge=replay", "dilocox", "dilocox", ["--outer.streaming.merge=replay"]),
    ("dilocox 1/64 (2x bytes)", "dilocox", "dilocox", ["--compress.sparse.density=0.015625"]),
    ("dilocox outer momentum 0.9", "dilocox", "dilocox", ["--outer.momentum=0.9"]),
    # the index block of the fixed-width format the tables before 2026-11-30 ran (compress/rice.py: lossless)
    ("dilocox fixed indices", "dilocox", "dilocox", ["--compress.sparse.indices=fixed"]),
    # item 4's far-link preset (configs/methods/dilocox-far.yaml) and the candidates it was chosen from: more steps
    # to hide a fragment's all-gather behind, the same bytes per step
    ("dilocox-far", "dilocox-far", "dilocox-far", []),
    ("dilocox H=6 tau=2 3/256", "dilocox", "dilocox",
     ["--outer.sync_every=6", "--compress.sparse.density=0.01171875", "--outer.streaming.tau=2"]),
    ("dilocox K=1 tau=2", "dilocox", "dilocox", ["--outer.streaming.fragments=1", "--outer.streaming.tau=2"]),
    ("dilocox K=1 tau=3", "dilocox", "dilocox", ["--outer.streaming.fragments=1", "--outer.streaming.tau=3"]),
    # ... with the replay merge (ALGORITHMS §4b), which keeps the tau steps trained while the sync flew
    ("dilocox K=1 tau=2 replay", "dilocox", "dilocox",
     ["--outer.streaming.fragments=1", "--outer.streaming.tau=2", "--outer.streaming.merge=replay"]),
    # the inner learning rate (configs/tiny.yaml: 3e-3), for the scale sweep's smaller local batches
    ("dilocox inner lr 1.5e-3", "dilocox", "dilocox", ["--optim.lr=1.5e-3"]),
    ("dilocox inner lr 6e-3", "dilocox", "dilocox", ["--optim.lr=6e-3"]),
    ("dilocox inner lr 1.2e-2", "dilocox", "dilocox", ["--optim.lr=1.2e-2"]),
    ("allreduce lr 6e-3", "allreduce-tuned", "allreduce", ["--optim.lr=6e-3"]),
    # the mixing weight of the far-link preset (Streaming DiLoCo's alpha, 0.5 as shipped)
    ("dilocox-far alpha=0.25", "dilocox-far", "dilocox-far", ["--outer.streaming.alpha=0.25"]),
    ("dilocox-far alpha=0.75", "dilocox-far", "dilocox-far", ["--outer.streaming.alpha=0.75"]),
    ("dilocox H=6 tau=2 3/256 replay", "dilocox", "dilocox",
     ["--outer.sync_every=6", "--compress.sparse.density=0.01171875", "--outer.streaming.tau=2",
      "--outer.streaming.merge=replay"]),
    # the stretch (>= 4,000x all-reduce's bytes): a quarter of the preset's bytes per step, by syncing 4x less often,
    # by a 4x sparser top-k, or half of each
    ("dilocox H=16 (1/4 bytes)", "dilocox", "dilocox", ["--outer.sync_every=16"]),
    ("dilocox 1/512 (1/4 bytes)", "dilocox", "dilocox", ["--compress.sparse.density=0.001953125"]),
    ("dilocox H=8 1/256 (1/4 bytes)", "dilocox", "dilocox",
     ["--outer.sync_every=8", "--compress.sparse.density=0.00390625"]),
    # the scale sweep's learning rates, each method at its own best (R = 4: all-reduce gains from 6e-3 too)
    ("allreduce lr 1.2e-2", "allreduce-tuned", "allreduce", ["--optim.lr=1.2e-2"]),
    ("allreduce lr 1.5e-3", "allreduce-tuned", "allreduce", ["--optim.lr=1.5e-3"]),  # (width 256: 3e-3 is too high)
    ("dilocox inner lr 2.4e-2", "dilocox", "dilocox", ["--optim.lr=2.4e-2"]),
    ("dilocox inner lr 1.2e-2 outer lr 1.0", "dilocox", "dilocox", ["--optim.lr=1.2e-2", "--outer.lr=1.0"]),
    ("dilocox outer lr 1.0", "dilocox", "dilocox", ["--outer.lr=1.0"]),
    ("dilocox inner lr 6e-3 outer lr 1.0", "dilocox", "dilocox", ["--optim.lr=6e-3", "--outer.lr=1.0"]),
    ("dilocox inner lr 1.2e-2 outer lr 1.4", "dilocox", "dilocox", ["--optim.lr=1.2e-2", "--outer.lr=1.4"]),
    ("dilocox inner lr 6e-3 outer lr 1.4", "dilocox", "dilocox", ["--optim.lr=6e-3", "--outer.lr=1.4"]),
    ("dilocox inner lr 6e-3 outer lr 1.7", "dilocox", "dilocox", ["--optim.lr=6e-3", "--outer.lr=1.7"]),
    ("dilocox inner lr 6e-3 outer lr 2.0", "dilocox", "dilocox", ["--optim.lr=6e-3", "--outer.lr=2.0"]),
    ("dilocox inner lr 3e-3 outer lr 1.4", "dilocox", "dilocox", ["--optim.lr=3e-3", "--outer.lr=1.4"]),
    ("dilocox inner lr 1.5e-3 outer lr 1.4", "dilocox", "dilocox", ["--optim.lr=1.5e-3", "--outer.lr=1.4"]),
    # R = 8 (two sequences a replica): its own pair
    ("dilocox inner lr 2.4e-2 outer lr 1.0", "dilocox", "dilocox", ["--optim.lr=2.4e-2", "--outer.lr=1.0"]),
    ("dilocox inner lr 2.4e-2 outer lr 1.4", "dilocox", "dilocox", ["--optim.lr=2.4e-2", "--outer.lr=1.4"]),
    # the sparse reduce-scatter (compress/sparse_rs.py): each chunk's owner averages and re-sparsifies, ~2 payloads
    # sent per sync whatever R, where the all-gather sends R - 1
    ("dilocox reduce-scatter", "dilocox", "dilocox", ["--compress.collective=reduce_scatter"]),
    ("dilocox inner lr 2.4e-2 outer lr 1.4 reduce-scatter", "dilocox", "dilocox",
     ["--optim.lr=2.4e-2", "--outer.lr=1.4", "--compress.collective=reduce_scatter"]),
    ("dilocox inner lr 6e-3 outer lr 1.4 reduce-scatter", "dilocox", "dilocox",
     ["--optim.lr=6e-3", "--outer.lr=1.4", "--compress.collective=reduce_scatter"]),
    ("dilocox inner lr 6e-3 outer lr 1.0 reduce-scatter", "dilocox", "dilocox",
     ["--optim.lr=6e-3", "--outer.lr=1.0", "--compress.collective=reduce_scatter"]),
    ("dilocox inner lr 1.2e-2 outer lr 1.0 reduce-scatter", "dilocox", "dilocox",
     ["--optim.lr=1.2e-2", "--outer.lr=1.0", "--compress.collective=reduce_scatter"]),
    ("dilocox reduce-scatter keep 2", "dilocox", "dilocox",
     ["--compress.collective=reduce_scatter", "--compress.sparse.owner_keep=2"]),
    ("dilocox inner lr 6e-3 outer lr 1.0 reduce-scatter keep 2", "dilocox", "dilocox",
     ["--optim.lr=6e-3", "--outer.lr=1.0", "--compress.collective=reduce_scatter", "--compress.sparse.owner_keep=2"]),
]  # fmt: skip
QUICK = [
    "allreduce",
    "diloco H=20",
    "streaming H=20 K=2 int4",
    "dilocox-paper H=20",
    "sparseloco H=20 1/64 2-bit",
    "dilocox",
]
H_BASE = 20  # method_body's H (the presets' sync_every unless a point overrides it; dilocox-paper's adaptive range)


def pareto(rows: list[dict]) -> set[str]:
    """Labels of the points no other point beats on both bytes and loss (ties: both stay); a point without a final
    val loss (``train.eval_batches=0``) is on no front and beats none."""
    rows = [r for r in rows if has_loss(r)]
    front = set()
    for r in rows:
        if not any(
            o["bytes_sent_per_replica"] <= r["bytes_sent_per_replica"]
            and o["final_val_loss"] <= r["final_val_loss"]
            and (o["bytes_sent_per_replica"], o["final_val_loss"]) != (r["bytes_sent_per_replica"], r["final_val_loss"])
            for o in rows
        ):
            front.add(r["label"])
    return front


def run(points: list[tuple], corpora: list[str], seeds: list[int], steps: int, run_root: str) -> list[dict]:
    rows = []
    for corpus in corpora:
        for seed in seeds:
            common = [CORPORA[corpus], f"--train.seed={seed}"]
            entries = [(label, preset, extra) for label, _, preset, extra in points]
            got = run_methods(entries, steps, H_BASE, os.path.join(run_root, f"{corpus}-s{seed}-{steps}"), common)
            fam = {label: family for label, family, _, _ in points}
            for r in got:
                label = r.pop("method")
                r.update(label=label, family=fam[label], corpus=corpus, seed=seed, steps=steps)
                r.pop("val_curve", None)
            rows += got
    return rows


def _mark_front(rows: list[dict]) -> None:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["corpus"], r["seed"], r["steps"]), []).append(r)
    for g in groups.values():
        front = pareto(g)
        base = next((r for r in g if r["family"] == "allreduce"), None)
        for r in g:
            r["on_front"] = r["label"] in front
            if base is not None:
                gap = loss_gap_pct(r, base)
                if gap is not None:
                    r["loss_vs_allreduce_pct"] = gap
                r["bytes_ratio_vs_allreduce"] = base["bytes_sent_per_replica"] / max(1, r["bytes_sent_per_replica"])


def _verdicts(rows: list[dict]) -> list[str]:
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["corpus"], r["seed"], r["steps"]), []).append(r)
    for (corpus, seed, steps), g in sorted(groups.items()):
        dx = next((r for r in g if r["label"] == "dilocox"), None)
        cheap = [r for r in g if r.get("bytes_ratio_vs_allreduce", 0) >= 1000 and "loss_vs_allreduce_pct" in r]
        best = min(cheap, key=lambda r: r["final_val_loss"]) if cheap else None
        line = f"- {corpus}, seed {seed}, {steps} steps: "
        if not any(r["family"] == "allreduce" for r in g):  # (a run of a few points alone: no ratio, no gap)
            out.append(line + "no allreduce row in this run, so no ratio or gap to grade")
            continue
        if dx is not None and "loss_vs_allreduce_pct" in dx:
            beaten = [
                r["label"]
                for r in g
                if has_loss(r)
                and r["bytes_sent_per_replica"] < dx["bytes_sent_per_replica"]
                and r["final_val_loss"] < dx["final_val_loss"]
            ]
            ok = dx["bytes_ratio_vs_allreduce"] >= 1000 and dx["loss_vs_allreduce_pct"] <= 3 and not beaten
            line += (
                f"the `dilocox` preset {dx['bytes_ratio_vs_allreduce']:,.0f}x at {dx['loss_vs_allreduce_pct']:+.1f} % "
                f"-> target (>= 1000x, <= +3 %, nothing cheaper and better) {'met' if ok else 'NOT met'}"
                + (f" (cheaper and better: {', '.join(beaten)})" if beaten else "")
                + "; "
            )
        if best is not None:
            line += (
                f"best point at >= 1000x: {best['label']} ({best['bytes_ratio_vs_allreduce']:,.0f}x, "
                f"{best['loss_vs_allreduce_pct']:+.1f} %)"
            )
        else:
            line += "no point at >= 1000x"
        out.append(line)
    return out


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"Machine: {meta['machine']}; date {meta['date']}; tiny GPT-2, 2 replicas x 2 pipeline stages (4 CPU ranks, "
        f"gloo), 8 x 128 tokens per replica per step; corpora {', '.join(meta['corpora'])}; seeds "
        f"{', '.join(map(str, meta['seeds']))}; bench wall {meta['wall_min']:.1f} min. `*` = on the Pareto front of "
        f"its corpus and seed (no point with fewer bytes and a lower loss).",
        "",
        "| corpus | seed | steps | point | bytes sent per replica | fewer bytes than allreduce | final val loss | "
        "vs allreduce |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["corpus"], r["seed"], r["steps"], -r["bytes_sent_per_replica"])):
        star = " *" if r.get("on_front") else ""
        lines.append(
            f"| {r['corpus']} | {r['seed']} | {r['steps']} | {r['label']}{star} | "
            f"{r['bytes_sent_per_replica'] / 1e6:,.3f} MB | {fmt_cell(r.get('bytes_ratio_vs_allreduce'), ',.0f', 'x')}"
            f" | {fmt_cell(r['final_val_loss'])} | {fmt_cell(r.get('loss_vs_allreduce_pct'), '+.1f', ' %')} |"
        )
    lines += ["", "Issue 23's targets:", *_verdicts(rows)]
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """One panel per corpus: loss against bytes (log axis), a marker per family, the front of each seed as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corpora = sorted({r["corpus"] for r in rows})
    fams = sorted({r["family"] for r in rows})
    markers = dict(zip(fams, "osD^vPX*<>"))
    fig, axes = plt.subplots(1, len(corpora), figsize=(5.2 * len(corpora), 4.0), squeeze=False)
    for ax, corpus in zip(axes[0], corpora):
        for (seed, steps), ls in zip(
            sorted({(r["seed"], r["steps"]) for r in rows if r["corpus"] == corpus}), ("-", "--", ":", "-.") * 4
        ):
            g = [r for r in rows if r["corpus"] == corpus and r["seed"] == seed and r["steps"] == steps]
            for fam in fams:
                pts = [r for r in g if r["family"] == fam and has_loss(r)]
                if pts:
                    ax.scatter([max(1, r["bytes_sent_per_replica"]) for r in pts], [r["final_val_loss"] for r in pts],
                               marker=markers[fam], s=28, alpha=0.8, label=fam if ls == "-" else None)  # fmt: skip
            front = sorted((r for r in g if r.get("on_front")), key=lambda r: r["bytes_sent_per_replica"])
            ax.step([max(1, r["bytes_sent_per_replica"]) for r in front], [r["final_val_loss"] for r in front],
                    where="post", linestyle=ls, color="k", alpha=0.5, lw=1,
                    label=f"front, seed {seed}, {steps} steps")  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel("bytes sent per replica (log)")
        ax.set_ylabel("final validation loss")
        ax.set_title(f"bytes vs loss, {corpus}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="dilocox bench frontier", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="one seed, the points of QUICK (about 15 min)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default=None, help="comma list (default 0,1; --quick: 0)")
    ap.add_argument("--corpora", default="code,prose")
    ap.add_argument(
        "--points", default=None, help="comma list of point labels (default: all but LEVERS, --quick: QUICK)"
    )
    ap.add_argument("--long-steps", type=int, default=0, help="re-run the first seed's front points at N steps")
    ap.add_argument("--out", type=out_dir, default=os.path.join("docs", "bench", "frontier"))
    ap.add_argument("--render", action="store_true", help="only re-draw the plot and table from OUT/results.json")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    res_path = os.path.join(a.out, "results.json")
    if a.render:
        try:
            with open(res_path) as f:
                saved = json.load(f)
            rows, meta = saved["rows"], saved["meta"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"dilocox bench frontier --render: cannot read {res_path} ({type(e).__name__}: {e}); run the "
                  "bench first (without --render) or give --out the directory that holds its results.json",
                  file=sys.stderr)  # fmt: skip
            return 2
    else:
        corpora = a.corpora.split(",")
        bad = [c for c in corpora if c not in CORPORA]
        if bad:
            ap.error(f"--corpora: unknown {bad}; choose from {sorted(CORPORA)}")
        seeds = [int(x) for x in (a.seeds or ("0" if a.quick else "0,1")).split(",")]
        wanted = a.points.split(",") if a.points else (QUICK if a.quick else [p[0] for p in POINTS])
        points = [p for p in POINTS + LEVERS if p[0] in wanted]
        if len(points) != len(wanted):
            ap.error(f"--points: unknown {sorted(set(wanted) - {p[0] for p in points})}")
        t0 = time.time()
        rows = run(points, corpora, seeds, a.steps, os.path.join("runs", "bench-frontier"))
        if a.long_steps:
            _mark_front(rows)
            for corpus in corpora:
                front = [p for p in points if any(
                    r["label"] == p[0] and r["on_front"] and r["corpus"] == corpus and r["seed"] == seeds[0]
                    for r in rows)]  # fmt: skip
                base = [p for p in points if p[1] == "allreduce"]
                long_pts = base + [p for p in front if p not in base]
                rows += run(long_pts, [corpus], seeds[:1], a.long_steps, os.path.join("runs", "bench-frontier"))
        meta = {
            "machine": machine_line(),
            "date": time.strftime("%Y-%m-%d"),
            "corpora": corpora,
            "seeds": seeds,
            "steps": a.steps,
            "wall_min": (time.time() - t0) / 60,
            "command": "dilocox bench frontier " + " ".join(argv if argv is not None else sys.argv[1:]),
        }
    _mark_front(rows)
    md = markdown(rows, meta)
    write_results(a.out, {"meta": meta, "rows": rows}, md)
    plot(rows, os.path.join(a.out, "frontier.png"))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
