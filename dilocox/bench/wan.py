"""``dilocox bench wan``: the method presets over capped inter-cluster links, measured vs planned.

Every method runs the same model (tiny GPT-2), data, seed and per-step token budget with
2 replicas x 2 pipeline stages (4 ranks; the per-method settings of ``bench methods``), once
per bandwidth cap and once uncapped. Each replica is one torchrun node in its own network
namespace joined to the other by veth links with ``tc tbf`` caps (``dilocox.launch``); without
root or netns the caps fall back to the outer comm layer's token bucket (said in the output).

    dilocox bench wan [--bandwidth 10mbit 100mbit 1gbit] [--methods allreduce,...,dilocox]
                      [--steps 60] [--loss-steps 200] [--H 20] [--out docs/bench/wan]

Definitions (per run; "replica" = the 2 ranks in one namespace, which share one link):

- tokens/s (steady state): tokens of both replicas in steps 2..N over the time from the end of
  step 1 (rank 0's log; step 1 holds one-off warm-up) to the end of step N on the slowest rank.
  Outside: the drain of the last in-flight all-reduce after step N (a one-off of the run's end, like
  final validation and checkpoint; a rank's ``outer_drain_s``, or its last ``outer_comm_s`` for a
  run that predates it); ``tokens_per_s_end_to_end`` in results.json includes it.
- blocked: max over ranks of the time the training thread waited for a cross-replica
  collective (``outer_blocked_total_s``); compute utilization = 1 - blocked / wall.
- bytes: per replica (mean of the two), framework = sum of ``outer_bytes_sent`` of its ranks;
  veth = ``tx_bytes`` of its veth; veth payload = tx_bytes - 66 B x tx_packets (Ethernet 14 +
  IPv4 20 + TCP 20 + timestamps 12 per frame; a GSO frame counts once and carries one header)
  minus the payload of a no-sync baseline run (torchrun's store, gloo connection setup, the
  checkpoint barrier: everything but the outer collectives).
- plan: ``dilocox.plan.plan`` for the run's own settings (H, quant, rank, fragments, overlap),
  2 replicas, the cap, one RTT per collective step (``GLOO_STEP_RTTS``) and the step time measured
  uncapped (wall / steps of the method's uncapped no-delay run: the collectives' own CPU time is in it,
  the plan adds what the cap and the delay add).

Capped and uncapped runs have the same length, so "% of uncapped" compares like with like.
Slow combinations are shortened: a run's step count is cut so that its predicted
communication time stays under ``--max-comm-s`` (allreduce at 10 Mbit/s: ~3 s per step),
the table's steps cell says so, and that run is compared with the same steps 2..n of the
uncapped run (its per-step times). Loss at equal tokens comes from the uncapped runs (``--loss-steps``,
default = ``--steps``): the update rules do not depend on the bandwidth, except DiLoCoX's
adaptive H and rank, which read measured times.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from dilocox.bench.methods import method_body
from dilocox.bench.runner import ROOT, clear_run_dir, machine_line, out_dir, read_run, run_train, write_config

# the plan side lives in wan_plan, the tables, targets, plots and output files in wan_report (both only read a
# finished result); re-exported here so ``wan.predict``, ``wan.markdown``, ``wan.write_outputs``, ... keep working
from dilocox.bench.wan_plan import FRAME_HEADER_BYTES, REPLICAS, add_own_plan, join, predict, steps_within
from dilocox.bench.wan_plan import GLOO_STEP_RTTS as GLOO_STEP_RTTS
from dilocox.bench.wan_plan import PER_REPLICA as PER_REPLICA
from dilocox.bench.wan_plan import TBF_GOODPUT as TBF_GOODPUT
from dilocox.bench.wan_plan import own_step_time as own_step_time
from dilocox.bench.wan_plan import run_method as run_method
from dilocox.bench.wan_report import NOTES as NOTES
from dilocox.bench.wan_report import _cap as _cap
from dilocox.bench.wan_report import _f as _f
from dilocox.bench.wan_report import _json_safe as _json_safe
from dilocox.bench.wan_report import _steps_cell as _steps_cell
from dilocox.bench.wan_report import markdown as markdown
from dilocox.bench.wan_report import merge
from dilocox.bench.wan_report import plot as plot
from dilocox.bench.wan_report import targets as targets
from dilocox.bench.wan_report import write_outputs as write_outputs
from dilocox.launch.emulate import BANDWIDTH_ENV, Cluster, netns_available, torchrun_argv
from dilocox.launch.switch import SwitchError, parse_latency
from dilocox.plan import fmt_bandwidth, parse_bandwidth

METHODS = ["allreduce", "diloco", "streaming", "dilocox-paper", "dilocox"]
CAPS = ["1mbit", "10mbit", "100mbit", "1gbit"]
RTTS = ["0ms", "50ms", "150ms"]
TRAIN_FLAGS = [
    "--checkpoint.resume=none",
    "--log.progress=false",
    "--log.tensorboard=false",
    "--train.eval_every=0",
    "--log.every=1",
]


# --------------------------------------------------------------------------- running


def run_netns(
    config: str, cap_bps: float | None, run_dir: str, overrides: list[str], timeout: float = 900, rtt_ms: float = 0.0
) -> dict:
    """One torchrun node per replica namespace; returns ``read_run`` plus the veth counters.

    ``rtt_ms`` > 0 puts the delay switch between the namespaces (round trip added between the replicas)."""
    clear_run_dir(run_dir)
    entry = ["-m", "dilocox.cli", "train", config, f"--log.run_dir={os.path.abspath(run_dir)}", *overrides]
    env = {k: v for k, v in os.environ.items() if k != BANDWIDTH_ENV}
    env.update(
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        PYTHONPATH=os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p),
    )
    log_path = os.path.join(run_dir, "train.log")
    t0 = time.time()
    with open(log_path, "w") as log, Cluster(REPLICAS, None if cap_bps is None else cap_bps / 1e6, rtt_ms=rtt_ms) as c:
        procs = []
        for r in range(REPLICAS):
            renv = dict(env, GLOO_SOCKET_IFNAME=c.ifname(r), DILOCOX_EMULATION="netns")
            argv = torchrun_argv(REPLICAS, r, PER_REPLICA, c.addr(0), 29500, entry)
            procs.append(c.exec(r, argv, env=renv, stdout=log, stderr=subprocess.STDOUT))
        codes = [None] * REPLICAS
        while any(x is None for x in codes):
            codes = [p.poll() for p in procs]
            if any(x not in (None, 0) for x in codes) or time.time() - t0 > timeout:
                break  # leaving the `with` kills the rest
            time.sleep(0.2)
        veth = [
            {"tx_bytes": c.tx_bytes(r), "tx_packets": c.tx_packets(r), "retrans_segs": tcp_retrans_segs(c.ns(r))}
            for r in range(REPLICAS)
        ]
    if codes != [0] * REPLICAS:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        why = f"timed out after {timeout:.0f} s" if None in codes else f"exit codes {codes}"
        raise RuntimeError(f"training in namespaces failed ({why}; log {log_path}):\n{tail}")
    return {**read_run(run_dir), "veth": veth}


def tcp_retrans_segs(ns: str) -> int:
    """TCP segments retransmitted inside a namespace (its own /proc/net/snmp): sent twice on the
    wire, counted once by the framework."""
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "cat", "/proc/net/snmp"], capture_output=True, text=True, timeout=30
    ).stdout
    head, vals = [line.split()[1:] for line in out.splitlines() if line.startswith("Tcp:")][:2]
    return int(vals[head.index("RetransSegs")])


def run_token_bucket(
    config: str, cap_bps: float | None, run_dir: str, overrides: list[str], rtt_ms: float = 0.0
) -> dict:
    """The fallback: one local torchrun; each rank's outer comm thread paced at cap / ranks per
    replica (the replica's ranks share one link). Only the outer collectives are paced; no delay
    (``bench`` refuses an RTT without namespaces)."""
    env = {BANDWIDTH_ENV: f"{cap_bps / PER_REPLICA:.0f}" if cap_bps else ""}  # "" = no cap
    return {**run_train(config, REPLICAS * PER_REPLICA, run_dir, overrides, env=env), "veth": None}


# --------------------------------------------------------------------------- measuring


def elapsed_at_steps(records: list[dict], tokens_per_step: int) -> list[float]:
    """Loop seconds at each record. Runs log every step (``--log.every=1``), so each record's
    ``tokens_per_s`` covers exactly its own step: elapsed is the running sum of step times."""
    out, t, last = [], 0.0, 0
    for rec in records:
        t += tokens_per_step * (rec["step"] - last) / max(rec["tokens_per_s"], 1e-9)
        out.append(t)
        last = rec["step"]
    return out


def summarize(run: dict, tokens_per_step: int, baseline: list[int] | None = None, overlapped: bool = False) -> dict:
    """The measured numbers of one run (pure: reads only ``run``, see ``read_run``).

    ``tokens_per_step``: both replicas together; ``baseline``: per-replica veth payload bytes of
    the no-sync run (None: not subtracted); ``overlapped``: the method leaves an all-reduce in flight at
    the end (its drain is not steady state: a rank's ``outer_drain_s``, or its last ``outer_comm_s`` where
    a run predates that counter).
    """
    recs, s, ranks = run["steps"], run["summary"], run["ranks"]
    if len(recs) < 2 or not ranks:
        raise ValueError("the run left fewer than 2 per-step records or no rank_*.json: did it finish?")
    el = elapsed_at_steps(recs, tokens_per_step)
    sent: dict[int, int] = {}
    for r in ranks:
        rep = int(re.search(r"replica (\d+)", r["coord"]).group(1))
        sent[rep] = sent.get(rep, 0) + int(r.get("outer_bytes_sent", 0))
    fw = [sent[k] for k in sorted(sent)]
    wall = max(r["wall_s"] for r in ranks)
    drain = [float(r.get("outer_drain_s", r.get("outer_comm_s", 0.0) if overlapped else 0.0) or 0.0) for r in ranks]
    loop_end = max(r["wall_s"] - d for r, d in zip(ranks, drain))
    blocked = max(r.get("outer_blocked_total_s", 0.0) for r in ranks)
    out = {
        "steps": s["steps"],
        # steady state: from the end of step 1 (rank 0) to the end of step N on the slowest rank, without the
        # drain of the last in-flight all-reduce (a one-off of the run's end, like the final checkpoint)
        "tokens_per_s": tokens_per_step * (s["steps"] - 1) / max(loop_end - el[0], 1e-9),
        "tokens_per_s_end_to_end": tokens_per_step * (s["steps"] - 1) / (wall - el[0]),
        "first_step_s": el[0],
        "wall_s": wall,
        "blocked_s": blocked,
        "utilization": 1.0 - blocked / wall,
        "final_val_loss": s["final_val_loss"],
        "H_final": s.get("outer_H"),
        "rank_final": s.get("outer_rank"),
        "n_syncs": s.get("outer_n_syncs"),
        "bytes_framework": sum(fw) / len(fw),
        "bytes_framework_by_replica": fw,
        "loss_vs_time": [[round(t, 3), round(rec["loss"], 4)] for t, rec in zip(el, recs)],
    }
    veth = run.get("veth")
    if veth:
        tx = [v["tx_bytes"] for v in veth]
        payload = [
            v["tx_bytes"] - FRAME_HEADER_BYTES * v["tx_packets"] - (baseline[i] if baseline else 0)
            for i, v in enumerate(veth)
        ]
        out.update(
            veth_tx_bytes=tx,
            veth_payload_bytes=payload,
            bytes_veth=sum(tx) / len(tx),
            bytes_veth_payload=sum(payload) / len(payload),
            retrans_segs=[v.get("retrans_segs") for v in veth],
        )
        if out["bytes_framework"] > 0:
            out["veth_diff_raw_pct"] = 100.0 * (out["bytes_veth"] / out["bytes_framework"] - 1.0)
            out["veth_diff_pct"] = 100.0 * (out["bytes_veth_payload"] / out["bytes_framework"] - 1.0)
    return out


# --------------------------------------------------------------------------- planning: bench/wan_plan.py

# --------------------------------------------------------------------------- the bench


def _emulation(emulation: str, rtts_ms: list[float], log):
    """The link emulation the bench can use (``mode``, why not netns, the runner of one training run)."""
    ok, why = netns_available()
    if emulation == "netns" and not ok:
        raise RuntimeError(f"--emulation netns requested but unavailable: {why}")
    mode = "netns" if ok and emulation != "token-bucket" else "token-bucket"
    if mode != "netns" and any(rtts_ms):
        raise RuntimeError(
            f"--rtt {', '.join(f'{x:g}ms' for x in rtts_ms)}: a delay needs the namespaces and the delay switch "
            f"({why or 'token-bucket emulation requested'}); run as root or pass --rtt 0ms"
        )
    runner = run_netns if mode == "netns" else run_token_bucket
    log(f"emulation: {mode}" + ("" if mode == "netns" else f" ({why or 'requested'}; veth byte counters unavailable)"))
    return mode, why, runner


def _baseline(runner, tmp: str, run_root: str, steps: int, log) -> list[int]:
    """Per-replica veth payload of the no-sync run: everything that crosses the link except the outer collectives."""
    cfg = write_config(
        os.path.join(tmp, "baseline.yaml"),
        ["tiny.yaml", "methods/diloco.yaml"],
        method_body("diloco", steps + 1),
    )
    run = runner(cfg, None, os.path.join(run_root, "baseline"), [f"--train.steps={steps}", *TRAIN_FLAGS])
    baseline = [v["tx_bytes"] - FRAME_HEADER_BYTES * v["tx_packets"] for v in run["veth"]]
    log(f"baseline (no outer sync, {steps} steps): veth payload {baseline} bytes per replica")
    return baseline


def _measured_row(
    run: dict, cfg, m: str, cap, rtt: float, name: str, n: int, steps: int, loss_steps: int, tokens: int, baseline
) -> dict:
    """One run's row: what it measured, and its role (capped, the reference of its length, the loss run)."""
    row = {
        "method": m,
        "cap_bps": cap,
        "rtt_ms": rtt,
        "run": name,
        "overlapped": cfg.outer.overlap != "none",
        "load_avg_1min": os.getloadavg()[0],
        **summarize(run, tokens, baseline, overlapped=cfg.outer.overlap != "none"),
    }
    row["shortened_from"] = steps if cap is not None and n < steps else None
    # (results before 2026-11-26 also have "reference for a shortened run": an uncapped run of each shortened length;
    # join now compares a shortened run with steps 2..n of the "reference")
    row["role"] = "capped" if cap is not None else ("reference" if n == steps else "loss")
    if m in ("allreduce", "cocktailsgd"):
        row["H_final"] = None  # per-step methods have no phases (the logged H is unused)
    return row


def _add_plans(row: dict, cfg, m: str, cap, rtt: float, t_step: float, tokens: int, rows: list[dict]) -> None:
    """The plans of ``row``: at ``t_step`` with the configured settings, at the H and rank it ran with, and at the
    run's own compute speed (``add_own_plan``, against the method's reference among ``rows``)."""
    p = predict(cfg, m, cap, t_step, rtt_ms=rtt)
    row["plan"] = {k: v for k, v in p.items() if k != "bandwidth_for"}
    if row["n_syncs"]:  # dilocox's adaptive controller changes H and rank while it runs
        H_run = max(1, round(row["steps"] * row["plan"]["fragments"] / row["n_syncs"]))
        p = predict(cfg, m, cap, t_step, H=H_run, rank=row["rank_final"], rtt_ms=rtt)
        row["plan_as_run"] = {k: p[k] for k in ("H", "rank", "wire_bytes_per_replica", "tokens_per_s", "utilization")}
    row["plan_step_time_s"] = t_step
    row["tokens_per_step"] = tokens
    ref = next((r for r in rows if r["method"] == m and r["role"] == "reference"), None)
    add_own_plan(row, ref, cfg, m)


def bench(
    methods: list[str],
    caps: list[float],
    steps: int,
    loss_steps: int | None,
    H: int,
    run_root: str,
    max_comm_s: float = 15.0,
    emulation: str = "auto",
    reference: bool = True,
    baseline_run: bool = True,
    log=print,
    rtts_ms: list[float] = (0.0,),
    overrides: list[str] = (),
) -> dict:
    """Run every (method, cap, RTT) and the uncapped no-delay references; return ``{"meta", "rows"}``.

    ``reference=False`` skips the uncapped runs ("% of uncapped" stays empty and the plan takes the step time of each
    run itself); ``baseline_run=False`` skips the no-sync run (its few kB are then left in the veth payload). Both only
    to make quick checks quicker. ``overrides`` (``--set``) apply to every method's runs and to its plan."""
    from dilocox.config import load_config

    rtts_ms = sorted(set(float(x) for x in rtts_ms))
    mode, why, runner = _emulation(emulation, rtts_ms, log)
    loss_steps = steps if loss_steps is None else max(loss_steps, steps)
    rows, t0, flags = [], time.time(), [*TRAIN_FLAGS, *overrides]
    with tempfile.TemporaryDirectory() as tmp:
        baseline = None
        if mode == "netns" and baseline_run:  # everything that crosses the link except the outer collectives
            baseline = _baseline(runner, tmp, run_root, steps, log)
        for m in methods:
            path = write_config(os.path.join(tmp, f"{m}.yaml"), ["tiny.yaml", f"methods/{m}.yaml"], method_body(m, H))
            cfg = load_config(path, list(overrides))
            tokens = cfg.train.batch_size * cfg.train.seq_len * REPLICAS
            t_step = None
            capped = [(cap, rtt, steps_within(cfg, cap, steps, max_comm_s, rtt)) for rtt in rtts_ms for cap in caps]
            # the uncapped no-delay reference (a shortened capped run is compared with the same steps of it: ``join``),
            # the longest first (its compute time per step feeds the plan), plus the loss-at-equal-tokens run
            lengths = sorted({steps, loss_steps}, reverse=True) if reference else []
            for cap, rtt, n in [(None, 0.0, k) for k in lengths] + capped:
                name = run_name(m, cap, rtt, n, steps)
                run = runner(path, cap, os.path.join(run_root, name), [f"--train.steps={n}", *flags], rtt_ms=rtt)
                row = _measured_row(run, cfg, m, cap, rtt, name, n, steps, loss_steps, tokens, baseline)
                if (cap is None and t_step is None) or not reference:
                    # the step time uncapped, the collectives' own CPU time (gloo's copies and reductions,
                    # compression) included: the plan adds only what the cap and the delay add to it
                    t_step = row["wall_s"] / row["steps"]
                _add_plans(row, cfg, m, cap, rtt, t_step, tokens, rows)
                rows.append(row)
                log(
                    f"{name:>28}: {n} steps, {row['tokens_per_s']:,.0f} tok/s, util {row['utilization']:.1%}, "
                    f"plan {row['plan']['tokens_per_s']:,.0f} tok/s, "
                    f"sent {row['bytes_framework'] / 1e6:.3f} MB/replica, val loss {_f(row['final_val_loss'], '.4f')} "
                    f"[{time.time() - t0:.0f} s]"
                )
    meta = {
        "machine": machine_line(),
        "date": time.strftime("%Y-%m-%d"),
        "git": git_state(),
        "emulation": mode,
        "why": why or "requested",
        "methods": methods,
        "caps_bps": caps,
        "rtts_ms": rtts_ms,
        "steps": steps,
        "loss_steps": loss_steps,
        "H": H,
        "overrides": list(overrides),
        "max_comm_s": max_comm_s,
        "reference": reference,
        "reference_window": True,  # shortened runs are compared with steps 2..n of the uncapped run
        "replicas": REPLICAS,
        "ranks_per_replica": PER_REPLICA,
        "baseline_payload_bytes": baseline,
        "frame_header_bytes": FRAME_HEADER_BYTES,
        "bench_wall_s": time.time() - t0,
        "load_avg": os.getloadavg(),
    }
    return {"meta": meta, "rows": join(rows)}


def run_name(method: str, cap: float | None, rtt: float, n: int, steps: int) -> str:
    """The run directory's name under ``--run-root`` (``dilocox-100Mbitps-150ms``, ``diloco-uncapped-20steps``)."""
    name = f"{method}-{'uncapped' if cap is None else fmt_bandwidth(cap).replace(' ', '').replace('/', 'p')}"
    if rtt:
        name += f"-{rtt:g}ms"
    if cap is None and n != steps:
        name += f"-{n}steps"
    return name


def method_configs(meta: dict) -> dict:
    """Each method's config of a finished bench (its ``meta``), as ``bench`` wrote it for its runs."""
    from dilocox.config import load_config

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for m in meta["methods"]:
            body = method_body(m, meta.get("H", 20))
            path = write_config(os.path.join(tmp, f"{m}.yaml"), ["tiny.yaml", f"methods/{m}.yaml"], body)
            out[m] = load_config(path, list(meta.get("overrides") or []))
    return out


def resummarize(res: dict, run_root: str) -> dict:
    """Recompute every row's tokens/s from its run directory under ``run_root`` (the per-step logs and rank
    summaries the runs left) with the current definition, then "% of uncapped" and the plan errors; the veth
    counters, bytes and plans stay as measured. For a change of definition without re-running the bench."""
    from dilocox.config import load_config

    meta = res["meta"]
    overlapped = {m: cfg.outer.overlap != "none" for m, cfg in method_configs(meta).items()}
    for row in res["rows"]:
        m = row["method"]
        name = row.get("run") or run_name(m, row["cap_bps"], row.get("rtt_ms") or 0.0, row["steps"], meta["steps"])
        d = os.path.join(run_root, name)
        run, rcfg = read_run(d), load_config(os.path.join(d, "config.yaml"))
        tokens = rcfg.train.batch_size * rcfg.train.seq_len * REPLICAS
        s = summarize(run, tokens, overlapped=row.get("overlapped", overlapped[m]))
        row["tokens_per_s"], row["tokens_per_s_end_to_end"] = s["tokens_per_s"], s["tokens_per_s_end_to_end"]
    meta["resummarized"] = time.strftime("%Y-%m-%d")
    return {"meta": meta, "rows": join(res["rows"])}


def replan(res: dict) -> dict:
    """``--render --replan``: recompute every row's plans (at the step time it was planned with, and at the run's
    own compute speed) with the current planner, from the measured rows alone; the measurements stay as they are.
    For a change of the time model without re-running the bench."""
    meta, rows = res["meta"], res["rows"]
    cfgs = method_configs(meta)
    for r in rows:
        m, cfg = r["method"], cfgs[r["method"]]
        r["tokens_per_step"] = cfg.train.batch_size * cfg.train.seq_len * REPLICAS
        rtt = r.get("rtt_ms") or 0.0
        p = predict(cfg, m, r["cap_bps"], r["plan_step_time_s"], rtt_ms=rtt)
        r["plan"] = {k: v for k, v in p.items() if k != "bandwidth_for"}
        if r.get("plan_as_run"):
            q = predict(cfg, m, r["cap_bps"], r["plan_step_time_s"], H=r["plan_as_run"]["H"],
                        rank=r["plan_as_run"]["rank"], rtt_ms=rtt)  # fmt: skip
            r["plan_as_run"] = {k: q[k] for k in ("H", "rank", "wire_bytes_per_replica", "tokens_per_s", "utilization")}
        ref = next((x for x in rows if x["method"] == m and x.get("role") == "reference"), None)
        add_own_plan(r, ref, cfg, m)
    meta["replanned"] = f"{time.strftime('%Y-%m-%d')} (code {git_state()})"
    return {"meta": meta, "rows": join(rows)}


def git_state() -> str | None:
    """The commit the bench ran on, and the files that differed from it (None outside git)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return None
    files = [line[3:] for line in dirty.splitlines() if line[3:].endswith(".py") or line[3:].endswith(".yaml")]
    return head + (f" + uncommitted changes to {', '.join(files)}" if files else "")


def _parser() -> argparse.ArgumentParser:
    """``dilocox bench wan``'s options (the module docstring is its description)."""
    ap = argparse.ArgumentParser(
        prog="dilocox bench wan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--bandwidth", nargs="+", default=CAPS, help="caps per replica link, each way (e.g. 10mbit 100mbit 1gbit)"
    )
    ap.add_argument(
        "--rtt", nargs="+", default=RTTS, help="round trips added between the replicas (delay switch), e.g. 0ms 50ms"
    )
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument(
        "--steps", type=int, default=60, help="steps of the capped runs (60: 3 phases at H=20; the bench in < 30 min)"
    )
    ap.add_argument(
        "--loss-steps",
        type=int,
        default=None,
        help="steps of the uncapped run for the loss at equal tokens (default: --steps, so one uncapped run "
        "serves both; a longer one is an extra run)",
    )
    ap.add_argument("--H", type=int, default=20, help="inner steps per outer step of the local-step methods")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="--section.key=value",
        help="a config override for every method's runs and plans, e.g. --set=--outer.streaming.tau=0 (repeatable)",
    )
    ap.add_argument(
        "--max-comm-s",
        type=float,
        default=15.0,
        help="cut a capped run's steps to keep its predicted communication under this (at least 2 steps or 1 phase)",
    )
    ap.add_argument("--emulation", choices=("auto", "netns", "token-bucket"), default="auto")
    ap.add_argument("--no-uncapped", action="store_true", help="skip the uncapped reference runs (quick checks)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the no-sync baseline run (quick checks)")
    ap.add_argument(
        "--render", metavar="RESULTS_JSON", help="only re-write results.md and the plots from a results.json"
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="RESULTS_JSON",
        default=[],
        help="with --render: more results.json to render in the same tables (each method labelled with its --set)",
    )
    ap.add_argument(
        "--resummarize",
        action="store_true",
        help="with --render: first recompute tokens/s from the run directories under --run-root",
    )
    ap.add_argument(
        "--replan",
        action="store_true",
        help="with --render: recompute the plans of every row with the current planner (measurements unchanged)",
    )
    ap.add_argument("--out", type=out_dir, default="docs/bench/wan")
    ap.add_argument("--run-root", type=out_dir, default=os.path.join("runs", "bench-wan"))
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    if (a.replan or a.resummarize or a.merge) and not a.render:
        ap.error("--replan, --resummarize and --merge work on finished results: add --render RESULTS_JSON")
    if a.merge and (a.replan or a.resummarize):
        ap.error("--merge renders finished results as they are: --replan and --resummarize work on one at a time")
    if a.render:
        loaded = []
        for path in [a.render, *a.merge]:
            try:
                with open(path) as f:
                    loaded.append(json.load(f))
            except (OSError, json.JSONDecodeError) as e:
                print(f"dilocox bench wan: error: --render/--merge {path}: {e}", file=sys.stderr)
                return 2
        res = merge(loaded, [a.render, *a.merge]) if a.merge else loaded[0]
        if a.resummarize:
            res = resummarize(res, a.run_root)
        if a.replan:
            res = replan(res)
        print(write_outputs(res, a.out))
        return 0
    try:
        caps = sorted(parse_bandwidth(b) for b in a.bandwidth)
        rtts = [parse_latency(x, "--rtt") for x in a.rtt]
        methods = [m.strip() for m in a.methods.split(",") if m.strip()]
        bad = [m for m in methods if not os.path.exists(os.path.join(ROOT, "configs", "methods", f"{m}.yaml"))]
        if bad:
            raise ValueError(
                f"--methods: no preset configs/methods/<name>.yaml for {bad}; choose from {METHODS + ['diloco']}"
            )
        if a.steps < 2 or a.H < 1:
            raise ValueError(f"--steps={a.steps} must be >= 2 (tokens/s leaves out step 1) and --H={a.H} >= 1")
        method_configs({"methods": methods, "H": a.H, "overrides": a.set})  # a bad --set: one line, before any run
        res = bench(
            methods,
            caps,
            a.steps,
            a.loss_steps,
            a.H,
            a.run_root,
            a.max_comm_s,
            a.emulation,
            reference=not a.no_uncapped,
            baseline_run=not a.no_baseline,
            rtts_ms=rtts,
            overrides=a.set,
        )
    except (ValueError, RuntimeError, SwitchError) as e:
        print(f"dilocox bench wan: error: {e}", file=sys.stderr)
        return 2
    print(write_outputs(res, a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
