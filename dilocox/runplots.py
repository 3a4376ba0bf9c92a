"""``dilocox report RUN_DIR [RUN_DIR ...] [--out DIR]``: PNG plots of training runs from their metrics.jsonl.

One PNG per quantity, every run overlaid (colour, line style and marker differ per run, so curves
that lie on top of each other stay distinguishable); legends sit outside the axes, to the right.

- ``loss_vs_step.png`` / ``loss_vs_time.png``: training loss (line) and validation loss (markers,
  dashed) against the step and against wall-clock seconds;
- ``tokens_per_s.png``: throughput as logged (averaged over each printed interval);
- ``bytes_sent.png``: cumulative bytes this rank sent to the other replicas (outer sync);
- ``blocked.png``: cumulative seconds the training loop waited for the outer communication;
- ``adaptive.png``: the adaptive controller's sync interval H and low-rank rank per step, for the runs whose
  ``config.yaml`` enables it (``compress.adaptive.enabled``; every DiLoCo-family run logs H and rank, most of them
  constant); a run without a readable config.yaml counts when its H or rank changed.

A figure is skipped when no run logged its quantity (e.g. ``outer.method=none`` has no bytes).
Not to be confused with ``dilocox.bench.report`` (benchmark tables).

The step records are those the logging rank wrote (records with a ``step``). A resumed run appends
to the same file: a later record for a step replaces the earlier one, and the wall clock of each
appended segment (``time`` restarts at 0; the segment starts at its ``resume`` record) continues from where the
previous segment ended.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

# (file stem, title, y label, [(record key, legend suffix, kind)], x key); kind "line" or "points"
FIGURES: list[tuple[str, str, str, list[tuple[str, str, str]], str]] = [
    (
        "loss_vs_step",
        "Loss vs step",
        "loss (nats/token)",
        [("loss", "train", "line"), ("val_loss", "val", "points")],
        "step",
    ),
    (
        "loss_vs_time",
        "Loss vs wall time",
        "loss (nats/token)",
        [("loss", "train", "line"), ("val_loss", "val", "points")],
        "time",
    ),
    ("tokens_per_s", "Throughput", "tokens/s (all replicas)", [("tokens_per_s", "", "line")], "step"),
    (
        "bytes_sent",
        "Bytes sent to other replicas (cumulative, logging rank)",
        "MB",
        [("bytes_sent", "", "line")],
        "step",
    ),
    (
        "blocked",
        "Time blocked on outer communication (cumulative)",
        "seconds",
        [("blocked_total_s", "", "line")],
        "step",
    ),
]
ADAPTIVE = ("adaptive", "Adaptive controller", [("H", "sync interval H"), ("rank", "low-rank rank")])
X_LABELS = {"step": "step", "time": "wall time (s)"}
SCALE = {"bytes_sent": 1e-6}
STYLES = ["-", "--", "-.", ":"]
MARKERS = ["o", "s", "^", "D", "v", "x", "P", "*"]


class ReportError(ValueError):
    """A run directory or metrics file that cannot be plotted (the message names it and the fix)."""


def load_metrics(run_dir: str) -> list[dict[str, Any]]:
    """The step records of ``run_dir/metrics.jsonl``, one per step in step order, with a monotonic ``time``."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ReportError(f"{path} not found: RUN_DIR must be a run directory written with log.jsonl=true")
    with open(path, "rb") as f:  # (bytes: a line that is not UTF-8 is named like one that is not JSON)
        lines = f.read().split(b"\n")
    by_step: dict[int, dict] = {}
    offset, last_raw, last_time, new_segment = 0.0, None, 0.0, False
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        why = None
        try:
            rec = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            why = f"not UTF-8 text (byte {line[e.start]:#04x} at column {e.start + 1})"
        except json.JSONDecodeError as e:
            why = f"not a JSON record ({e.msg})"
        if why is not None:
            if i == len(lines) - 1:  # a last line cut short by a killed run: the rest is still good
                print(f"report: ignoring the incomplete last line of {path}", file=sys.stderr)
                break
            raise ReportError(f"{path}:{i + 1}: {why}; fix or delete that line")
        if isinstance(rec, dict) and rec.get("event") == "resume":  # a resumed segment starts: its clock restarted
            new_segment = True  # (its first step may come later on that clock than the last one here: start-up)
            continue
        if not isinstance(rec, dict) or "step" not in rec:
            continue
        try:
            step, t = int(rec["step"]), float(rec.get("time", math.nan))
        except (TypeError, ValueError):
            raise ReportError(
                f"{path}:{i + 1}: step {rec['step']!r} / time {rec.get('time')!r} are not numbers; fix or delete "
                "that line"
            ) from None
        if last_raw is not None and (new_segment or t < last_raw):  # a resumed segment: its clock restarted at 0
            offset = last_time
        last_raw, new_segment = t, False
        rec = dict(rec, time=t + offset)
        last_time = rec["time"]
        by_step[step] = rec
    if not by_step:
        raise ReportError(f"{path} has no step records (the run logged no step yet)")
    return [by_step[s] for s in sorted(by_step)]


def series(records: list[dict], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """``(xs, ys)`` of the records that carry a finite number under ``key``."""
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(float(r[x]))
            ys.append(float(v))
    return xs, ys


def run_labels(run_dirs: list[str]) -> list[str]:
    """Short unique labels: the directory names, or the paths below their common parent when names repeat."""
    paths = [os.path.normpath(os.path.abspath(d)) for d in run_dirs]
    names = [os.path.basename(p) for p in paths]
    if len(set(names)) == len(names):
        return names
    common = os.path.commonpath(paths) if len(paths) > 1 else os.path.dirname(paths[0])
    return [os.path.relpath(p, common) if p != common else names[i] for i, p in enumerate(paths)]


def _style(i: int) -> dict:
    return {"color": f"C{i % 10}", "linestyle": STYLES[i % len(STYLES)], "marker": MARKERS[i % len(MARKERS)]}


def _save(fig, ax_with_legend, path: str) -> None:
    handles, labels = ax_with_legend.get_legend_handles_labels()
    if handles:  # outside the axes, to the right: never over a curve
        ax_with_legend.legend(
            handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8, frameon=False
        )
    fig.savefig(path, dpi=110, bbox_inches="tight")


def _lines_of(ax) -> dict[str, tuple]:
    """``{legend label: (xs, ys)}`` of the lines drawn on ``ax``."""
    return {
        ln.get_label(): (list(map(float, ln.get_xdata())), list(map(float, ln.get_ydata()))) for ln in ax.get_lines()
    }


def _draw_run(ax, i: int, label: str, recs: list[dict], keys: list[tuple[str, str, str]], x: str) -> None:
    """Run ``i``'s curves of one figure: a line per "line" key, dashed markers per "points" key."""
    st = _style(i)
    n = max(1, len(recs) // 12)  # ~12 markers per line: identifies the run without hiding the curve
    for key, suffix, kind in keys:
        xs, ys = series(recs, key, x)
        if not xs:
            continue
        ys = [y * SCALE.get(key, 1.0) for y in ys]
        name = f"{label} {suffix}".strip()
        if kind == "line":
            ax.plot(
                xs,
                ys,
                color=st["color"],
                linestyle=st["linestyle"],
                marker=st["marker"],
                markevery=n,
                markersize=4,
                linewidth=1.4,
                label=name,
            )
        else:
            ax.plot(
                xs,
                ys,
                color=st["color"],
                linestyle=":",
                marker=st["marker"],
                markersize=6,
                markerfacecolor="none",
                linewidth=1.0,
                label=name,
            )


def _plot_figure(spec: tuple, labels: list[str], runs: list[list[dict]], out_dir: str, drawn: dict) -> None:
    """One figure of ``FIGURES``, every run overlaid; written (and added to ``drawn``) unless nothing was drawn."""
    from matplotlib.figure import Figure  # lazy: matplotlib is only needed for plots (no pyplot state)

    stem, title, ylabel, keys, x = spec
    fig = Figure(figsize=(7.5, 4.2))
    ax = fig.add_subplot()
    for i, (label, recs) in enumerate(zip(labels, runs)):
        _draw_run(ax, i, label, recs, keys, x)
    if not ax.get_lines():
        return
    ax.set_title(title)
    ax.set_xlabel(X_LABELS[x])
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    path = os.path.join(out_dir, f"{stem}.png")
    _save(fig, ax, path)
    drawn[path] = _lines_of(ax)


def ran_adaptive(run_dir: str, recs: list[dict]) -> bool:
    """Whether the run's adaptive controller was on: its ``config.yaml`` says (``compress.adaptive.enabled``);
    without a readable one, whether the H or rank it logged ever changed."""
    import yaml

    try:
        with open(os.path.join(run_dir, "config.yaml")) as f:
            cfg = yaml.safe_load(f)
        enabled = cfg["compress"]["adaptive"]["enabled"]
        if isinstance(enabled, bool):
            return enabled
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        pass
    return any(len(set(series(recs, key)[1])) > 1 for key, _ in ADAPTIVE[2])


def _plot_adaptive(labels: list[str], runs: list[list[dict]], out_dir: str, drawn: dict, which: list[bool]) -> None:
    """The adaptive controller's H and rank (one panel each, step plots) of the runs ``which`` marks (``ran_adaptive``);
    written only if one of them logged them."""
    from matplotlib.figure import Figure  # lazy: matplotlib is only needed for plots (no pyplot state)

    stem, title, keys = ADAPTIVE
    fig = Figure(figsize=(7.5, 5.2))
    axes = fig.subplots(len(keys), 1, sharex=True)
    for ax, (key, ylabel) in zip(axes, keys):
        for i, (label, recs) in enumerate(zip(labels, runs)):
            xs, ys = series(recs, key) if which[i] else ([], [])
            if xs:
                st = _style(i)
                ax.step(xs, ys, where="post", color=st["color"], linestyle=st["linestyle"], linewidth=1.4, label=label)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    if any(ax.get_lines() for ax in axes):
        axes[0].set_title(title)
        axes[-1].set_xlabel("step")
        path = os.path.join(out_dir, f"{stem}.png")
        _save(fig, axes[0], path)
        drawn[path] = {f"{key}:{lab}": xy for ax, (key, _) in zip(axes, keys) for lab, xy in _lines_of(ax).items()}


def plot_runs(run_dirs: list[str], out_dir: str, labels: list[str] | None = None) -> dict[str, dict[str, tuple]]:
    """Write the PNGs into ``out_dir``; return ``{png path: {legend label: (xs, ys) as drawn}}``.

    The returned series are read back from the drawn matplotlib lines, so a test can compare what
    was plotted with the jsonl.
    """
    # lazy: matplotlib is only needed for plots (no pyplot state); imported first, so that a missing
    # matplotlib fails before any run is read
    from matplotlib.figure import Figure  # noqa: F401

    if not run_dirs:
        raise ReportError("report needs at least one RUN_DIR")
    labels = labels or run_labels(run_dirs)
    runs = [load_metrics(d) for d in run_dirs]
    os.makedirs(out_dir, exist_ok=True)
    drawn: dict[str, dict[str, tuple]] = {}
    for spec in FIGURES:
        _plot_figure(spec, labels, runs, out_dir, drawn)
    _plot_adaptive(labels, runs, out_dir, drawn, [ran_adaptive(d, recs) for d, recs in zip(run_dirs, runs)])
    return drawn


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="dilocox report", description="PNG plots of one or more runs from their metrics.jsonl"
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (log.run_dir) with a metrics.jsonl")
    p.add_argument(
        "--out", default=None, help="output directory (default: RUN_DIR/plots for one run, ./report for several)"
    )
    args = p.parse_args(argv)
    out = args.out or (os.path.join(args.run_dirs[0], "plots") if len(args.run_dirs) == 1 else "report")
    try:
        drawn = plot_runs(args.run_dirs, out)
    except ReportError as e:
        print(f"report: {e}", file=sys.stderr)
        return 2
    for path in drawn:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
