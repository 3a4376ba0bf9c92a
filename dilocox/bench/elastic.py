"""``dilocox bench elastic`` (issue 10): 3 elastic replicas x 2 pipeline stages, one killed and restarted.

Tiny GPT-2, DiLoCoX's own recipe, the ``dilocox-paper`` preset (``--method dilocox``: fixed rank 8 and H, comparable
with the recorded runs; ``dilocox-adaptive``: the preset's adaptive rank and H as well) or the Streaming DiLoCo preset
(``streaming``: 2 fragments, tau 2, int4), each replica one ``dilocox train`` job of 2 ranks (``dilocox launch
--elastic``), in network namespaces behind a ``--bandwidth`` (100 Mbit/s) tbf cap each way when root can create them,
else on loopback with the outer comm thread's token bucket (the output says which). Two runs of equal length:

1. uninterrupted: 3 replicas from start to end;
2. interrupted: replica ``--victim`` (2) is SIGKILLed (whole job) when a replica has logged step S/3 and
   started again at step 2S/3 (``dilocox launch --elastic --at step``): 1/3 and 2/3 of the run in training
   progress, not wall time (on a few shared CPU cores the survivors run faster while a replica is down, so
   a wall-time schedule would restart the victim when the others are nearly done).

    dilocox bench elastic [--method dilocox|dilocox-adaptive|streaming] [--steps 150] [--H 10]
                          [--bandwidth 100mbit] [--out docs/bench/elastic] [--runs DIR]

Measured from each replica's ``metrics.jsonl`` (one record per step, ``wall`` = epoch seconds) and the
launcher's ``events.jsonl`` (``analyze``, pure):

- kill -> survivors' next outer step: from the kill to the first record (wall) of the last survivor whose
  ``outer_step`` is above its value at the kill (resolution: one inner step);
- tokens/s before / during / after the outage: every replica's step records (batch x seq tokens each) in the
  window over its length; "before" starts when every replica has logged its first step, "during" is from the
  kill to the victim's first step after the restart, "after" from there to the first replica's end;
- rejoin: restart -> the victim's first step record (process start, torchft quorum, state transfer) and
  restart -> its first record with a higher ``outer_step`` than at its first step (it took part in an outer step);
- final val loss: a survivor's (replica 0) ``final_val_loss`` vs the uninterrupted run's replica 0, and vs the
  uninterrupted run's val-loss curve at the interrupted run's total tokens (linear interpolation, equal tokens).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

from dilocox.bench.runner import machine_line, out_dir, write_config, write_results

REPLICAS, STAGES = 3, 2
LAYOUT = "parallel: {replicas: 1, pipeline: 2, microbatches: 2}\n"
TRAIN_FLAGS = [
    "--checkpoint.resume=none",
    "--checkpoint.every=0",
    "--log.progress=false",
    "--log.tensorboard=false",
    "--log.every=1",
]


METHODS = ("dilocox", "dilocox-adaptive", "streaming")


def body(H: int, rank: int = 8, method: str = "dilocox") -> str:
    """The method's preset scaled to a short CPU run (``METHODS``; module docstring)."""
    if method == "streaming":
        return LAYOUT + f"outer: {{sync_every: {H}, streaming: {{fragments: 2, tau: 2}}}}\n"
    adaptive = (
        f"{{enabled: true, h_min: {max(2, H // 2)}, h_max: {2 * H}}}"
        if method == "dilocox-adaptive"
        else ("{enabled: false}")
    )
    compress = f"compress: {{lowrank: {{rank: {rank}}}, adaptive: {adaptive}}}\n"
    return LAYOUT + f"outer: {{sync_every: {H}}}\n" + compress


def preset(method: str) -> str:
    return "methods/streaming.yaml" if method == "streaming" else "methods/dilocox-paper.yaml"


def describe(method: str, rank: int, H: int) -> str:
    if method == "streaming":
        return f"Streaming DiLoCo preset (2 fragments, tau 2, alpha 0.5, int4) with H={H}"
    if method == "dilocox-adaptive":
        return f"dilocox-paper preset with adaptive rank (from {rank}) and H (from {H}, in [{max(2, H // 2)}, {2 * H}])"
    return f"dilocox-paper preset with rank {rank} and H={H} fixed"


# --------------------------------------------------------------------------- reading


def read_jsonl(path: str) -> list[dict]:
    """Records of a jsonl file; a last line cut short by a kill is skipped."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def read_elastic_run(run_dir: str, n: int = REPLICAS) -> dict:
    """``{"events": [...], "replicas": [{"steps": [...], "summary": {...}}, ...]}`` of one elastic launch."""
    reps = []
    for r in range(n):
        recs = read_jsonl(os.path.join(run_dir, f"replica{r}", "metrics.jsonl"))
        reps.append(
            {
                "steps": [x for x in recs if "step" in x and "wall" in x],
                "summary": next((x["summary"] for x in reversed(recs) if "summary" in x), {}),
            }
        )
    return {"events": read_jsonl(os.path.join(run_dir, "events.jsonl")), "replicas": reps}


# --------------------------------------------------------------------------- analysis (pure)


def _rate(reps: list[dict], t0: float, t1: float, tokens_per_step: int, skip: int | None = None) -> float | None:
    """Tokens/s of the step records with wall in (t0, t1], of every replica but ``skip``."""
    if not t1 > t0:
        return None
    n = sum(1 for r, rep in enumerate(reps) if r != skip for x in rep["steps"] if t0 < x["wall"] <= t1)
    return n * tokens_per_step / (t1 - t0)


def _outer_at(steps: list[dict], t: float) -> int:
    before = [x for x in steps if x["wall"] <= t]
    return before[-1].get("outer_step", 0) if before else 0


def analyze(run: dict, tokens_per_step: int, victim: int) -> dict:
    """The numbers of one run (``read_elastic_run``): see the module docstring. ``tokens_per_step``: one
    replica's tokens per inner step (batch x seq). Without a kill event only the throughput is computed."""
    ev, reps = run["events"], run["replicas"]
    starts = [x["steps"][0]["wall"] for x in reps if x["steps"]]
    ends = [x["steps"][-1]["wall"] for x in reps if x["steps"]]
    out: dict = {"replicas": len(reps)}
    if not starts:
        return out
    t_all = max(starts)
    kill = next((e for e in ev if e["event"] == "kill" and e.get("replica") == victim and "skipped" not in e), None)
    restart = next(
        (e for e in ev if e["event"] == "restart" and e.get("replica") == victim and "skipped" not in e), None
    )
    # the end of the common window: the first replica to finish (the victim's last record is its kill, not an end)
    t_end = min(x["steps"][-1]["wall"] for r, x in enumerate(reps) if x["steps"] and (kill is None or r != victim))
    first_start = min((e["wall"] for e in ev if e["event"] == "start"), default=min(starts))
    last_end = max(ends)
    out["wall_s"] = last_end - first_start
    out["ready_t"] = t_all - first_start  # every replica has trained its first step (start-up done)
    out["end_t"] = t_end - first_start  # the first replica logged its last step
    out["tokens_total"] = sum(len(x["steps"]) for x in reps) * tokens_per_step
    if kill is None:
        out["tokens_per_s"] = _rate(reps, t_all, t_end, tokens_per_step)
        return out
    tk = kill["wall"]
    survivors = [r for r in range(len(reps)) if r != victim]
    nexts, extras, medians = [], [], []
    for r in survivors:
        steps = reps[r]["steps"]
        o = _outer_at(steps, tk)
        nxt = next((x["wall"] for x in steps if x["wall"] > tk and x.get("outer_step", 0) > o), None)
        nexts.append(nxt)
        # outer-step times (the record where outer_step went up): the gap across the kill vs the usual interval
        ups = [b["wall"] for a, b in zip(steps, steps[1:]) if b.get("outer_step", 0) > a.get("outer_step", 0)]
        before = [t for t in ups if t <= tk]
        gaps = sorted(b - a for a, b in zip(before, before[1:]))
        if gaps and nxt is not None:
            medians.append(statistics.median(gaps))
            extras.append(nxt - before[-1] - medians[-1])
    out["kill_t"] = tk - first_start
    out["kill_to_next_outer_s"] = None if None in nexts else max(nexts) - tk
    out["outer_interval_s"] = max(medians) if medians else None  # median outer-step interval before the kill
    out["kill_extra_s"] = max(extras) if extras else None  # the interval across the kill minus that median
    vsteps = reps[victim]["steps"]
    back = None
    if restart is not None:
        tr = restart["wall"]
        out["restart_t"] = tr - first_start
        after = [x for x in vsteps if x["wall"] > tr]
        if after:
            back = after[0]["wall"]
            out["rejoin_first_step_s"] = back - tr
            o0 = after[0].get("outer_step", 0)
            joined = next((x["wall"] for x in after if x.get("outer_step", 0) > o0), None)
            out["rejoin_outer_step_s"] = None if joined is None else joined - tr
            out["rejoin_at_step"] = after[0]["step"]
    out["tokens_per_s_before"] = _rate(reps, t_all, tk, tokens_per_step)
    out["tokens_per_s_outage"] = _rate(reps, tk, back if back is not None else t_end, tokens_per_step, skip=victim)
    out["tokens_per_s_after"] = _rate(reps, back, t_end, tokens_per_step) if back is not None else None
    b, d = out["tokens_per_s_before"], out["tokens_per_s_outage"]
    out["outage_ratio"] = d / b if b and d is not None else None
    return out


def val_at_tokens(curve: list[tuple[float, float]], tokens: float) -> float | None:
    """Linear interpolation of ``(tokens, val_loss)`` points (sorted) at ``tokens``; None outside the curve."""
    pts = sorted(curve)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= tokens <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
    if pts and tokens == pts[-1][0]:
        return pts[-1][1]
    return None


def val_curve(run: dict, tokens_per_step: int, replica: int = 0) -> list[tuple[float, float]]:
    """(total tokens of all replicas up to that wall time, val loss of ``replica``) at each of its evaluations,
    its final validation last."""
    reps = run["replicas"]
    walls = sorted(x["wall"] for rep in reps for x in rep["steps"])
    pts = []
    for x in reps[replica]["steps"]:
        if "val_loss" in x:
            pts.append((sum(1 for w in walls if w <= x["wall"]) * tokens_per_step, x["val_loss"]))
    fin = reps[replica]["summary"].get("final_val_loss")
    if fin is not None:
        pts.append((len(walls) * tokens_per_step, fin))
    return pts


def compare_loss(full: dict, cut: dict, tokens_per_step: int) -> dict:
    """Final val loss of replica 0 in the interrupted run vs the uninterrupted one (same steps; equal tokens)."""
    f = full["replicas"][0]["summary"].get("final_val_loss")
    c = cut["replicas"][0]["summary"].get("final_val_loss")
    tokens = sum(len(x["steps"]) for x in cut["replicas"]) * tokens_per_step
    eq = val_at_tokens(val_curve(full, tokens_per_step), tokens)
    pct = lambda a, b: None if a is None or b is None else 100.0 * (a / b - 1.0)  # noqa: E731
    return {
        "final_val_loss_uninterrupted": f,
        "final_val_loss_interrupted": c,
        "loss_vs_uninterrupted_pct": pct(c, f),
        "uninterrupted_val_at_equal_tokens": eq,
        "loss_vs_equal_tokens_pct": pct(c, eq),
        "tokens_interrupted": tokens,
    }


# --------------------------------------------------------------------------- plot and table


def throughput_series(run: dict, tokens_per_step: int, t0: float, bin_s: float) -> tuple[list[float], list[float]]:
    """Tokens/s of all replicas together in ``bin_s`` bins (x: bin centre, seconds since ``t0``)."""
    walls = sorted(x["wall"] - t0 for rep in run["replicas"] for x in rep["steps"])
    if not walls:
        return [], []
    nb = int(math.ceil(walls[-1] / bin_s)) or 1
    counts = [0] * nb
    for w in walls:
        counts[min(nb - 1, max(0, int(w // bin_s)))] += 1
    return [(i + 0.5) * bin_s for i in range(nb)], [c * tokens_per_step / bin_s for c in counts]


def plot(full: dict, cut: dict, res: dict, tokens_per_step: int, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7.5, 6.0), sharex=True)
    for run, label, fmt in ((full, "uninterrupted", "--"), (cut, "replica 2 killed / restarted", "-")):
        t0 = min((e["wall"] for e in run["events"] if e["event"] == "start"), default=0.0)
        xs, ys = throughput_series(run, tokens_per_step, t0, res["bin_s"])
        a1.plot(xs, ys, fmt, label=label, drawstyle="steps-mid")
        for r, rep in enumerate(run["replicas"] if run is cut else run["replicas"][:1]):
            pts = [(x["wall"] - t0, x["val_loss"]) for x in rep["steps"] if "val_loss" in x]
            if pts:
                a2.plot(*zip(*pts), fmt, marker="os^"[r % 3], ms=4, label=f"{label}: replica {r}")
    t0 = min(e["wall"] for e in cut["events"] if e["event"] == "start")
    marks = [
        (e["wall"] - t0, e["event"]) for e in cut["events"] if e["event"] in ("kill", "restart") and "skipped" not in e
    ]
    if res["interrupted"].get("rejoin_first_step_s") is not None:
        marks.append((res["interrupted"]["restart_t"] + res["interrupted"]["rejoin_first_step_s"], "rejoined"))
    for ax in (a1, a2):
        for x, name in marks:
            ax.axvline(x, color={"kill": "red", "restart": "green"}.get(name, "purple"), ls=":", lw=1)
        ax.grid(alpha=0.3)
    for x, name in marks:
        a1.annotate(name, (x, a1.get_ylim()[1]), rotation=90, va="top", ha="right", fontsize=7)
    a1.set_ylabel(f"tokens/s, all replicas ({res['bin_s']:g} s bins)")
    a2.set_ylabel("validation loss")
    a2.set_xlabel("wall time since the replicas were started (s)")
    name = {"streaming": "Streaming DiLoCo", "dilocox-adaptive": "DiLoCoX (adaptive)"}.get(res.get("method"), "DiLoCoX")
    where = "namespaces" if res["emulation"].startswith("network") else "loopback"
    a1.set_title(f"Elastic {name}: {REPLICAS} replicas x {STAGES} stages, {where}, {res.get('bandwidth')}", fontsize=10)
    a1.legend(fontsize=7)
    a2.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _f(x, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def markdown(res: dict) -> str:
    i, u, lo = res["interrupted"], res["uninterrupted"], res["loss"]
    lines = [
        f"{REPLICAS} replicas x {STAGES} pipeline stages (one `dilocox train` job of 2 ranks each), tiny GPT-2, "
        f"{describe(res.get('method', 'dilocox'), res['rank'], res['H'])}, {res['steps']} steps per replica, "
        f"{res['emulation']}. "
        f"Replica {res['victim']} SIGKILLed (whole job) at step {res['steps'] // 3} of the others "
        f"({_f(i.get('kill_t'), '.1f')} s after the start) and started again at their step {2 * res['steps'] // 3} "
        f"({_f(i.get('restart_t'), '.1f')} s); the uninterrupted run took {_f(u.get('wall_s'), '.1f')} s"
        f"{' (reused from an earlier call)' if res.get('uninterrupted_reused') else ''}. "
        f"Measured {res.get('date', '—')} on {res['machine']}; `{res.get('command', 'dilocox bench elastic')}`.",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| kill → survivors' next outer step | {_f(i.get('kill_to_next_outer_s'), '.2f')} s |",
        f"| survivors' outer step across the kill, beyond the usual interval ({_f(i.get('outer_interval_s'), '.1f')} s)"
        f" | {_f(i.get('kill_extra_s'), '+.2f')} s |",
        f"| tokens/s before the kill (3 replicas) | {_f(i.get('tokens_per_s_before'), ',.0f')} |",
        f"| tokens/s during the outage (2 replicas) | {_f(i.get('tokens_per_s_outage'), ',.0f')} "
        f"({_f(i.get('outage_ratio'), '.2f')} of before; expected ≈ 0.67) |",
        f"| tokens/s after the rejoin | {_f(i.get('tokens_per_s_after'), ',.0f')} |",
        f"| tokens/s uninterrupted | {_f(u.get('tokens_per_s'), ',.0f')} |",
        f"| restart → victim's first step | {_f(i.get('rejoin_first_step_s'), '.2f')} s "
        f"(joined at step {i.get('rejoin_at_step', '—')}) |",
        f"| restart → victim's first outer step | {_f(i.get('rejoin_outer_step_s'), '.2f')} s |",
        f"| final val loss, uninterrupted (replica 0) | {_f(lo['final_val_loss_uninterrupted'], '.4f')} |",
        f"| final val loss, interrupted (replica 0) | {_f(lo['final_val_loss_interrupted'], '.4f')} "
        f"({_f(lo['loss_vs_uninterrupted_pct'], '+.2f')} % at equal steps) |",
        f"| uninterrupted val loss at the interrupted run's tokens | "
        f"{_f(lo['uninterrupted_val_at_equal_tokens'], '.4f')} "
        f"(interrupted: {_f(lo['loss_vs_equal_tokens_pct'], '+.2f')} %; target within 1 %) |",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- running


def _complete(run_dir: str) -> bool:
    run = read_elastic_run(run_dir)
    return bool(run["events"]) and all(rep["summary"] for rep in run["replicas"])


def _run(config: str, run_dir: str, overrides: list[str], bandwidth: str | None, netns: bool | None, **kw) -> dict:
    import shutil

    from dilocox.elastic.launch import launch_elastic

    shutil.rmtree(run_dir, ignore_errors=True)  # a bench run starts fresh (events, metrics, checkpoints)
    rc = launch_elastic(
        config,
        REPLICAS,
        [*overrides, f"--log.run_dir={run_dir}"],
        min_replicas=REPLICAS - 1,
        netns=netns,
        bandwidth=bandwidth,
        lighthouse_opts=["--heartbeat-timeout-ms", "2000", "--join-timeout-ms", "60000"],
        **kw,
    )
    if rc != 0:
        raise RuntimeError(f"elastic launch failed with exit code {rc}; logs: {run_dir}/replica*.log")
    return read_elastic_run(run_dir)


def bench(
    steps: int,
    H: int,
    bandwidth: str | None,
    victim: int,
    run_root: str,
    netns: bool | None,
    reuse: bool = False,
    method: str = "dilocox",
) -> tuple[dict, dict, dict, int]:
    """Both runs; returns (results, uninterrupted run, interrupted run, tokens per replica step)."""
    from dilocox.config import load_config
    from dilocox.launch.netns import netns_available

    ok, why = netns_available()
    use = ok if netns is None else netns
    emulation = (
        f"network namespaces, tbf {bandwidth} each way per replica"
        if use
        else f"loopback ({why or 'namespaces off'}), outer comm token bucket {bandwidth}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = write_config(
            os.path.join(tmp, "elastic.yaml"), ["tiny.yaml", preset(method)], body(H, method=method)
        )
        overrides = [*TRAIN_FLAGS, f"--train.steps={steps}", f"--train.eval_every={H * 2}"]
        cfg = load_config(
            cfg_path, [*overrides, "--outer.elastic.enabled=true", "--outer.elastic.lighthouse=http://x:1"]
        )
        tps = cfg.train.batch_size * cfg.train.seq_len
        full_dir = os.path.join(run_root, "uninterrupted")
        reused = reuse and _complete(full_dir)
        full = read_elastic_run(full_dir) if reused else _run(cfg_path, full_dir, overrides, bandwidth, netns)
        fu = analyze(full, tps, victim)
        cut = _run(
            cfg_path,
            os.path.join(run_root, "interrupted"),
            overrides,
            bandwidth,
            netns,
            kills=[f"{victim}@{steps // 3}"],
            restarts=[f"{victim}@{2 * steps // 3}"],
            at="step",
        )
    res = {
        "steps": steps,
        "method": method,
        "H": H,
        "rank": 8,
        "victim": victim,
        "bandwidth": bandwidth,
        "emulation": emulation,
        "machine": machine_line(),
        "uninterrupted": fu,
        "interrupted": analyze(cut, tps, victim),
        "loss": compare_loss(full, cut, tps),
        "bin_s": max(1.0, round(fu["wall_s"] / 40, 1)),
        "uninterrupted_reused": reused,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    return res, full, cut, tps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dilocox bench elastic", description=__doc__.split("\n\n")[0])
    p.add_argument("--method", choices=METHODS, default="dilocox", help="the preset each replica trains")
    p.add_argument("--steps", type=int, default=150, help="inner steps per replica (a multiple of --H)")
    p.add_argument("--H", type=int, default=10, help="inner steps per outer step")
    p.add_argument("--bandwidth", default="100mbit", help="cap per replica link each way ('none': uncapped)")
    p.add_argument("--victim", type=int, default=2, help="the replica killed at 1/3 and restarted at 2/3")
    p.add_argument("--netns", dest="netns", action="store_true", default=None)
    p.add_argument("--no-netns", dest="netns", action="store_false")
    p.add_argument(
        "--out", type=out_dir, default="docs/bench/elastic", help="results.json, results.md and elastic.png go here"
    )
    p.add_argument("--runs", type=out_dir, default=None, help="run dirs (default: a temporary directory)")
    p.add_argument("--reuse", action="store_true", help="keep a complete RUNS/uninterrupted from an earlier call")
    a = p.parse_args(argv)
    if a.method == "streaming" and a.H % 2:
        p.error(f"--H {a.H} must be even with --method streaming (2 fragments sync H/2 steps apart)")
    if a.steps < 3 * a.H or a.steps % a.H:
        p.error(f"--steps {a.steps} must be a multiple of --H {a.H} and at least 3 outer steps")
    if not 0 <= a.victim < REPLICAS:
        p.error(f"--victim {a.victim} must be in [0, {REPLICAS})")
    bw = None if a.bandwidth in ("none", "") else a.bandwidth
    with tempfile.TemporaryDirectory() as tmp:
        res, full, cut, tps = bench(a.steps, a.H, bw, a.victim, a.runs or tmp, a.netns, a.reuse, a.method)
        res["command"] = " ".join(["dilocox bench elastic", *(argv if argv is not None else sys.argv[1:])])
        os.makedirs(a.out, exist_ok=True)
        res["plot"] = plot(full, cut, res, tps, os.path.join(a.out, "elastic.png"))
    md = markdown(res)
    write_results(a.out, res, md)
    print(md)
    return 0
