"""Run ``dilocox train`` as a subprocess and collect what it wrote (shared by the benches)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")


def write_config(path: str, includes: list[str], body: str = "") -> str:
    """A run config that includes files from configs/ (absolute paths) plus extra YAML."""
    inc = ", ".join(os.path.join(CONFIGS, i) for i in includes)
    with open(path, "w") as f:
        f.write(f"include: [{inc}]\n{body}")
    return path


def clear_run_dir(run_dir: str) -> None:
    """A bench run always starts fresh: drop the metrics, rank summaries and checkpoints of the last one."""
    import shutil

    os.makedirs(run_dir, exist_ok=True)
    for name in os.listdir(run_dir):
        path = os.path.join(run_dir, name)
        if name == "metrics.jsonl" or name.startswith("rank_"):
            os.remove(path)
        elif name == "checkpoints":
            shutil.rmtree(path)


class TrainingFailed(RuntimeError):
    """``dilocox train`` exited non-zero; ``cause`` is the first error a rank raised (``root_cause``)."""

    def __init__(self, cause: str, message: str):
        super().__init__(message)
        self.cause = cause


# a rank's exception line as torchrun prefixes it ("[rank3]: FloatingPointError: loss is nan ..."), or unprefixed;
# or the one line dilocox prints for an error the user can act on (cli._error_kind: "training stopped (rank 1): ...")
_ERROR_LINE = re.compile(
    r"^(?:\[rank(\d+)\]:\s*)?((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception)\b.*)$"
    r"|^((?:config|data|export|checkpoint) error|training stopped|elastic run stopped)(?: \(rank (\d+)\))?: (.*)$"
    r"|^\[rank (\d+)\] error: (.*)$"  # a failed collective (signals.exit_watchdog): a consequence
)
# errors that follow from another rank's failure (its peer closed the connection), not causes
_CONSEQUENCE = ("CommTimeoutError", "DistBackendError", "ChildFailedError", "SignalException")


def root_cause(stderr: str) -> str:
    """The first exception a rank raised, from ``dilocox train``'s stderr; errors that only follow from another
    rank's exit (a collective whose peer went away) are passed over while a cause is there. '' when none is."""
    found = []
    for m in filter(None, map(_ERROR_LINE.match, stderr.splitlines())):
        if m.group(7) is not None:
            rank, text = m.group(6), f"CommTimeoutError: {m.group(7)}"
        else:
            rank, text = (m.group(1), m.group(2)) if m.group(2) else (m.group(4), f"{m.group(3)}: {m.group(5)}")
        found.append((rank, text.strip()[:500]))
    causes = [f for f in found if not f[1].split(":")[0].endswith(_CONSEQUENCE)]
    if not (causes or found):
        return ""
    rank, text = (causes or found)[0]
    return (f"rank {rank}: " if rank else "") + text


def run_train(
    config: str, nproc: int, run_dir: str, overrides: list[str] = (), env: dict | None = None, timeout: float = 3600
) -> dict:
    """Train ``config`` on ``nproc`` local ranks into ``run_dir``; return its records.

    Returns ``{"steps": [per-step records], "summary": {...}, "ranks": [per-rank summaries], "wall_s"}``.
    """
    clear_run_dir(run_dir)
    cmd = [
        sys.executable,
        "-m",
        "dilocox.cli",
        "train",
        config,
        "--nproc",
        str(nproc),
        f"--log.run_dir={run_dir}",
        "--checkpoint.resume=none",
        "--log.progress=false",
        "--log.tensorboard=false",
        *overrides,
    ]
    e = dict(
        os.environ,
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    e.update(env or {})
    t0 = time.time()
    proc = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=timeout)
    wall = time.time() - t0
    if proc.returncode != 0:
        cause = root_cause(proc.stderr)
        raise TrainingFailed(
            cause,
            f"training failed: {cause or f'exit code {proc.returncode}'}\n({' '.join(cmd)}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}",
        )
    return dict(read_run(run_dir), wall_s=wall, stdout=proc.stdout)


def read_run(run_dir: str) -> dict:
    """Rank 0's per-step records and summary (``metrics.jsonl``), and every rank's ``rank_*.json``."""
    steps, summary = [], {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "summary" in rec:
                summary = rec["summary"]
            elif "step" in rec:
                steps.append(rec)
    ranks = []
    for name in sorted(os.listdir(run_dir)):
        if name.startswith("rank_") and name.endswith(".json"):
            with open(os.path.join(run_dir, name)) as f:
                ranks.append(json.load(f))
    return {"steps": steps, "summary": summary, "ranks": ranks}


def has_loss(r: dict, key: str = "final_val_loss") -> bool:
    """Whether ``r[key]`` is a finite number: a run with ``train.eval_batches=0`` writes ``final_val_loss: null``
    and a failed one NaN; such a row has no gap, is on no front and gets no verdict."""
    v = r.get(key)
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def loss_gap_pct(r: dict | None, base: dict | None) -> float | None:
    """``r``'s final val loss against ``base``'s, in percent; None where either is missing or has none
    (``has_loss``)."""
    if r is None or base is None or not (has_loss(r) and has_loss(base)):
        return None
    return 100.0 * (r["final_val_loss"] / base["final_val_loss"] - 1.0)


def fmt_cell(x, fmt: str = ".4f", unit: str = "", scale: float = 1.0) -> str:
    """A table cell of a value that may be missing: "-" for None (a run without a final val loss, a row without an
    all-reduce row to compare with), never a made-up 0 % or 1x; ``scale`` divides first (bytes to MB)."""
    return "-" if x is None else format(x / scale if scale != 1.0 else x, fmt) + unit


def out_path_problem(path: str, directory: bool, example: str = "results.json") -> str | None:
    """Why a bench could not write its output at ``path`` (a directory it makes, or a file it writes; either may be
    missing still, its missing parent directories made when written), as a sentence that names the path and the fix
    (a file path suggests ``example`` in a directory given); None when it can. Checked while the arguments are parsed
    (``out_dir``/``out_file``), before minutes of work: a path that is the wrong kind of thing, lies under a regular
    file, or in a directory without write permission. Nothing is created here."""
    full = os.path.abspath(path)
    if os.path.exists(full):
        if directory and not os.path.isdir(full):
            return f"{path} is a file, not a directory; give a directory (made if missing) or remove the file"
        if not directory and os.path.isdir(full):
            return f"{path} is a directory; give a file path, e.g. {os.path.join(path, example)}"
        if not os.access(full, os.W_OK | (os.X_OK if directory else 0)):
            return f"cannot write {path} (permission denied); give a path you can write"
        return None
    if not directory and path.endswith(("/", os.sep)):
        return f"{path} names a directory; give a file path, e.g. {os.path.join(path, example)}"
    parent = os.path.dirname(full)
    while not os.path.exists(parent):  # the nearest existing ancestor: the missing ones are made in it
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is a file, not a directory, so {path} cannot be made; give a path outside it"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot write {path}: {parent} is not writable (permission denied); give a path you can write"
    return None


def out_dir(path: str) -> str:
    """argparse ``type=`` of a bench's output directory (``--out``, ``--runs``): a bad one exits 2 with one line
    (``argument --out: ...``) before any work; the directory is made later, by the bench, as before."""
    problem = out_path_problem(path, directory=True)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return path


def out_file(path: str) -> str:
    """argparse ``type=`` of a bench's output file (``--json``): as ``out_dir``."""
    problem = out_path_problem(path, directory=False)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return path


def write_results(out_dir: str, rows, md: str) -> None:
    """``results.json`` (the rows) and ``results.md`` (the table ``dilocox.bench.report`` pastes into the docs)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(md + "\n")


MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">")
LINESTYLES = ("-", "--", "-.", ":")


def series_style(i: int) -> tuple[str, str]:
    """(marker, linestyle) of the i-th curve: no two of the first 40 curves look alike, so curves that
    lie on top of each other stay distinguishable (colour alone does not)."""
    return MARKERS[i % len(MARKERS)], LINESTYLES[(i // len(MARKERS) + i) % len(LINESTYLES)]


def line_plot(
    path: str,
    series: list[tuple[str, list, list, str | None]],
    xlabel: str,
    ylabel: str,
    title: str,
    figsize: tuple[float, float] = (6.4, 3.8),
) -> dict:
    """One PNG of ``(label, xs, ys, matplotlib format)`` lines (matplotlib imported only here).

    A format of None gets ``series_style(i)``. The legend goes to the right of the axes, outside
    the curves. Returns what was drawn: ``{"title", "styles": [(label, marker, linestyle)], "legend_outside"}``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize)
    styles = []
    for i, (label, xs, ys, fmt) in enumerate(series):
        if fmt is None:
            marker, ls = series_style(i)
            (line,) = ax.plot(xs, ys, marker=marker, linestyle=ls, ms=4, label=label, alpha=0.85)
        else:
            (line,) = ax.plot(xs, ys, fmt, ms=3, label=label, alpha=0.85)
        styles.append((label, line.get_marker(), line.get_linestyle()))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    legend = ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.savefig(path, dpi=110, bbox_inches="tight", bbox_extra_artists=[legend])
    plt.close(fig)
    return {"title": title, "styles": styles, "legend_outside": True}


def machine_line() -> str:
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"
