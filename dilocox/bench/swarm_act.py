"""``dilocox bench swarm --parts e`` (issue 24): activation codecs at SWARM's stage boundaries, bytes against loss.

The SWARM 4 x 2 tiny config of parts (a)/(d) (``dilocox.bench.swarm.BASE``: 2 stages x 4 peers, GPT-2 with
d_model 64 and 4 layers, sequences of 64, microbatches of 2), real peer processes on this host, equal steps (so
equal tokens) for every point, SWARM (gradients all-reduced in each stage every step) and DiLoCo-SWARM (outer step
every H steps), on both corpora of the frontier benchmark (``code``: the stdlib sources, ``prose``: CPython's
pydoc topics). The points (``POINTS``): fp32, int8 and int4 activations (the dense tensor), structured column top-k
(``colk-int8``: the 1/8 of the columns with the largest norm) and the subspace codecs on a model trained with
``model.subspace_rank`` k (``subspace``: k fp32 values per token, exact for that model, so its gap is the
constraint's own cost; then with int8 / int4 coefficients). Per point: the final validation loss of the trained
stages (peer 0 of each stage chained, no codec: the trained model), its gap against fp32 on the same corpus and
sync, the activation + gradient bytes per token per stage boundary (what the peers counted on their links, less
the ids the plan counts exactly: ``act_bytes``), the reduction against fp32, and the planned bytes (must equal the
counted ones).

    dilocox bench swarm --parts e [--steps 400] [--H 50] [--corpora code,prose] [--syncs swarm,diloco]
                                  [--points fp32,int8,...] [--peers 4,4] [--set=--model.d_model=256]
                                  [--out docs/bench/swarm-act] [--runs DIR] [--render]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from dilocox.bench.frontier import CORPORA
from dilocox.bench.runner import machine_line, out_dir, write_results

# label -> config overrides (on top of dilocox.bench.swarm.BASE)
_Q64 = "--swarm.activation_block=64"
POINTS = {
    "fp32": ["--swarm.activations=none"],
    "int8": ["--swarm.activations=int8"],
    "int4": ["--swarm.activations=int4", _Q64],
    "colk-int8 1/8": ["--swarm.activations=colk-int8", "--swarm.activation_cols=0.125", _Q64],
    "subspace k=8": ["--swarm.activations=subspace", "--model.subspace_rank=8"],
    "subspace-int8 k=8": ["--swarm.activations=subspace-int8", "--model.subspace_rank=8", _Q64],
    "subspace-int4 k=8": ["--swarm.activations=subspace-int4", "--model.subspace_rank=8", _Q64],
    "subspace-int4 k=4": ["--swarm.activations=subspace-int4", "--model.subspace_rank=4", _Q64],
    # for wider models (--set=--model.d_model=256): the same d/k = 16 as k = 4 at d = 64
    "subspace k=16": ["--swarm.activations=subspace", "--model.subspace_rank=16"],
    "subspace-int4 k=16": ["--swarm.activations=subspace-int4", "--model.subspace_rank=16", _Q64],
}
DEFAULT_POINTS = [p for p in POINTS if "k=16" not in p]
SYNCS = {"swarm": ["--swarm.sync=swarm"], "diloco": ["--swarm.sync=diloco"]}
PEERS = [4, 4]


def act_bytes_per_token(row: dict) -> float:
    """Activation + gradient bytes per token per stage boundary (the ids excluded)."""
    return row["act_bytes"] / row["tokens"]


def analyse(rows: list[dict]) -> list[dict]:
    """Add each point's gap (val loss against fp32's of the same corpus and sync) and its byte reduction."""
    base = {(r["corpus"], r["sync"]): r for r in rows if r["point"] == "fp32"}
    for r in rows:
        b = base.get((r["corpus"], r["sync"]))
        r["gap"] = None if b is None else r["val_loss"] / b["val_loss"] - 1.0
        r["reduction"] = None if b is None else b["act_bytes"] / r["act_bytes"]
    return rows


def run_point(
    root: str, corpus: str, sync: str, point: str, steps: int, H: int, timeout_s: float, peers=PEERS, sets=()
) -> dict:
    from dilocox.bench import swarm as bs

    extra = [*sets, CORPORA[corpus], *SYNCS[sync], *POINTS[point]]
    if sync == "diloco":
        extra += ["--swarm.routing=iwrr", f"--outer.sync_every={H}"]
    label = f"{corpus}-{sync}-{point}".replace(" ", "_").replace("/", "of").replace("=", "")
    r = bs._run_a(root, label, list(peers), extra, steps, H, timeout_s)
    from dilocox.swarm.plan import plan_config

    cfg = bs._cfg([*extra, f"--swarm.peers_per_stage=[{peers[0]},{peers[1]}]"])
    plan = plan_config(cfg)
    act = plan["act_bytes_per_link"] * steps
    ids = plan["ids_bytes_per_link"] * steps
    return {
        "corpus": corpus,
        "sync": sync,
        "point": point,
        "d_model": cfg.model.d_model,
        "codec": plan["act"],
        "subspace_rank": plan["subspace_rank"],
        "values_per_token": plan["act_values_per_token"],
        "val_loss": r["val_loss"],
        "train_loss_last": r["train_loss_last"],
        "tokens": r["tokens"],
        "pipeline_bytes": r["pipeline_bytes"],  # counted by the peers (activations, gradients, ids)
        "pipeline_bytes_planned": r["pipeline_bytes_planned"],
        "act_bytes": act,
        "ids_bytes": ids,
        "counted_equals_planned": r["pipeline_bytes"] == act + ids,
        "wall_s": r["wall_s"],
    }


def markdown(res: dict) -> str:
    rows = res["rows"]
    lines = [
        f"Measured {res['date']} on {res['machine']}; command: `{res['command']}`. SWARM, 2 stages x "
        f"{res.get('peers', PEERS)[0]} peer(s), the tiny config of parts (a)/(d)"
        + (f" with {' '.join(res['set'])}" if res.get("set") else "")
        + f" ({res['steps']} steps, equal tokens per point; DiLoCo-SWARM H = {res['H']}). Bytes: activations + their "
        "gradients per token per stage boundary, as the peers counted them on their links (the microbatch ids, "
        "1 byte per id, both input and target, are counted too and excluded here); val loss: the trained stages "
        "chained, without the codec. Gap: against fp32 of the same corpus and sync.",
        "",
        "| corpus | sync | point | values/token | act+grad bytes/token | fewer than fp32 | val loss | gap | "
        "counted = planned |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gap = "-" if r["gap"] is None else f"{r['gap']:+.2%}"
        red = "-" if r["reduction"] is None else f"{r['reduction']:.1f}x"
        lines.append(
            f"| {r['corpus']} | {r['sync']} | {r['point']} | {r['values_per_token']} | "
            f"{act_bytes_per_token(r):.2f} | {red} | {r['val_loss']:.4f} | {gap} | "
            f"{'yes' if r['counted_equals_planned'] else 'NO'} |"
        )
    best = [r for r in rows if r["reduction"] and r["reduction"] >= 100]
    lines.append("")
    if best:
        for corpus, sync in sorted({(r["corpus"], r["sync"]) for r in best}):
            g = min((r for r in best if (r["corpus"], r["sync"]) == (corpus, sync)), key=lambda r: r["gap"])
            ok = "meets" if g["gap"] <= 0.02 else "misses"
            lines.append(
                f"- {corpus}, {sync}: best point at >= 100x: {g['point']} ({g['reduction']:.0f}x, gap "
                f"{g['gap']:+.2%}): {ok} the issue's target (<= 2 %)."
            )
    else:
        lines.append("- no point reached 100x fewer activation bytes.")
    if res.get("plot"):
        lines += ["", f"![bytes vs loss]({os.path.basename(res['plot'])})"]
    return "\n".join(lines)


def family(point: str) -> str:
    """The codec family of a point (one line per family in the plot)."""
    return "subspace" if point.startswith("subspace") else "colk" if point.startswith("colk") else "dense"


def short(point: str) -> str:
    """A point's label in the plot: "subspace-int4 k=8" -> "int4 k=8", "subspace k=8" -> "fp32 k=8"."""
    name, _, k = point.partition(" ")
    if family(point) == "subspace":
        return f"{name.partition('-')[2] or 'fp32'} {k}"
    return name


def plot(res: dict, path: str) -> str | None:
    """One panel per (corpus, sync): val loss against bytes per token (log), a line per codec family."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = sorted({(r["corpus"], r["sync"]) for r in res["rows"]})
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.2 * rows), squeeze=False)
    for ax, (corpus, sync) in zip(axes.flat, panels):
        g = [r for r in res["rows"] if (r["corpus"], r["sync"]) == (corpus, sync)]
        for fam, marker in (("dense", "o"), ("subspace", "s"), ("colk", "^")):
            pts = sorted((r for r in g if family(r["point"]) == fam), key=lambda r: -r["act_bytes"])
            if pts:
                xs, ys = [act_bytes_per_token(r) for r in pts], [r["val_loss"] for r in pts]
                ax.plot(xs, ys, marker=marker, ms=4, label=fam)
                for r, x, y in zip(pts, xs, ys):
                    ax.annotate(short(r["point"]), (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_title(f"{corpus}, {sync}", fontsize=9)
        ax.set_xlabel("act + grad bytes / token", fontsize=8)
        ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_ylabel("final val loss")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _parser() -> argparse.ArgumentParser:
    """``dilocox bench swarm --parts e``'s options."""
    p = argparse.ArgumentParser(prog="dilocox bench swarm --parts e", description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="e", help="e (this driver)")
    p.add_argument("--steps", type=int, default=400, help="steps of every run (equal tokens per point)")
    p.add_argument("--H", type=int, default=50, help="DiLoCo-SWARM's outer period")
    p.add_argument("--corpora", default="code,prose", help=f"comma-separated, of {sorted(CORPORA)}")
    p.add_argument("--syncs", default="swarm,diloco", help="comma-separated, of swarm, diloco")
    p.add_argument("--points", default=",".join(DEFAULT_POINTS), help=f"comma-separated, of {list(POINTS)}")
    p.add_argument("--peers", default="4,4", help="peers per stage of every run (2 stages), e.g. 1,1: one pipeline")
    p.add_argument(
        "--set", action="append", default=[], metavar="--section.key=value",
        help="a config override of every run, e.g. --set=--model.d_model=256 (repeatable)",
    )  # fmt: skip
    p.add_argument("--timeout-s", type=float, default=900.0, help="bound on each run")
    p.add_argument(
        "--out", type=out_dir, default="docs/bench/swarm-act", help="results.json, results.md and act.png go here"
    )
    p.add_argument("--runs", type=out_dir, default=None, help="run dirs (default: a temporary directory)")
    p.add_argument("--render", action="store_true", help="only rewrite results.md and act.png from results.json")
    p.add_argument(
        "--append", action="store_true",
        help="keep the rows of --out's results.json that this run does not measure (e.g. another corpus)",
    )  # fmt: skip
    return p


def _checked(p: argparse.ArgumentParser, a: argparse.Namespace) -> tuple[dict[str, list[str]], list[int]]:
    """The run's corpora, syncs and points (``{flag: items}``) and its peers per stage; a bad option exits 2."""
    if a.parts.replace(",", "") != "e":
        p.error(f"--parts {a.parts!r}: this driver runs part e alone (run a, b, c, d separately)")
    lists = {}
    for flag, value, known in (("--corpora", a.corpora, CORPORA), ("--syncs", a.syncs, SYNCS),
                               ("--points", a.points, POINTS)):  # fmt: skip
        items = [x.strip() for x in value.split(",") if x.strip()]
        bad = [x for x in items if x not in known]
        if not items or bad:
            p.error(f"{flag} {value!r}: unknown {bad}; choose from {list(known)}")
        lists[flag] = items
    if a.steps < a.H or a.steps % a.H:
        p.error(f"--steps {a.steps} must be a positive multiple of --H {a.H}")
    if "fp32" not in lists["--points"]:
        p.error("--points must include fp32 (every gap and reduction is against it)")
    try:
        peers = [int(x) for x in a.peers.split(",")]
    except ValueError:
        peers = []
    if len(peers) != 2 or min(peers) < 1:
        p.error(f"--peers {a.peers!r} must be two counts >= 1, e.g. 4,4")
    bad = [x for x in a.set if not (x.startswith("--") and "=" in x)]
    if bad:
        p.error(f"--set {bad[0]!r} must be a config override --section.key=value, e.g. --set=--model.d_model=256")
    return lists, peers


def _append(p: argparse.ArgumentParser, a: argparse.Namespace, res: dict, peers: list[int]) -> None:
    """``--append``: keep the rows of ``--out``'s results.json that this run did not measure, and its command and
    date next to this run's (a results.json of other --steps/--H/--peers/--set exits 2: its rows' gaps would be
    against another run's fp32 row, and the table names one H)."""
    prev = os.path.join(a.out, "results.json")
    if a.append and os.path.exists(prev):
        with open(prev) as f:
            old = json.load(f)
        if (old.get("steps"), old.get("H"), old.get("peers"), old.get("set")) != (a.steps, a.H, peers, list(a.set)):
            p.error(f"--append: {prev} was measured with other --steps/--H/--peers/--set; use another --out")
        done = {(r["corpus"], r["sync"], r["point"]) for r in res["rows"]}
        res["rows"] = [r for r in old["rows"] if (r["corpus"], r["sync"], r["point"]) not in done] + res["rows"]
        res["command"] = "; ".join([old["command"], res["command"]])
        res["date"] = f"{old['date']} and {res['date']}"


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    if a.render:
        if not os.path.isfile(os.path.join(a.out, "results.json")):
            p.error(f"--render: {a.out} has no results.json (run the bench into --out first)")
        with open(os.path.join(a.out, "results.json")) as f:
            res = json.load(f)
        return finish(res, a.out)
    lists, peers = _checked(p, a)
    res: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine_line(),
        "steps": a.steps,
        "H": a.H,
        "peers": peers,
        "set": list(a.set),
        "command": " ".join(["dilocox bench swarm", *(argv if argv is not None else sys.argv[1:])]),
        "rows": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for corpus in lists["--corpora"]:
            for sync in lists["--syncs"]:
                for point in lists["--points"]:
                    t0 = time.monotonic()
                    row = run_point(a.runs or tmp, corpus, sync, point, a.steps, a.H, a.timeout_s, peers, a.set)
                    res["rows"].append(row)
                    bpt, dt = act_bytes_per_token(row), time.monotonic() - t0
                    print(
                        f"bench swarm e: {corpus} {sync} {point}: val {row['val_loss']:.4f}, {bpt:.2f} B/tok, {dt:.0f}s"
                    )
    _append(p, a, res, peers)
    return finish(res, a.out)


def finish(res: dict, out: str) -> int:
    """Gaps and reductions, the plot, results.json and results.md in ``out``; the table on stdout."""
    analyse(res["rows"])
    os.makedirs(out, exist_ok=True)
    res["plot"] = plot(res, os.path.join(out, "act.png"))
    md = markdown(res)
    write_results(out, res, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
