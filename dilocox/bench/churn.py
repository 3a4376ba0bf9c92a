"""``dilocox bench churn`` (issue 45): goodput while replicas die and come back again and again.

R elastic replicas (one ``dilocox train`` job of one rank each, tiny GPT-2, the ``dilocox`` or ``streaming`` preset)
under ``dilocox launch --elastic``, twice with the same steps:

1. undisturbed: every replica from start to end (its wall time W and per-replica tokens/s set the yardstick);
2. churned: every ``--period`` seconds a random replica (seeded) is SIGKILLed (whole job) and restarted ``--down``
   seconds later, while the run lasts (``--lighthouse-kill T``: the lighthouse too, at T, back ``--down`` s later);
   with ``--standby S`` a warm standby (``outer.elastic.standby``) takes the
   killed replica's place at once and the restart refills the pool instead (dilocox/elastic/standby.py).

    dilocox bench churn [--replicas 4] [--steps 600] [--H 0] [--period 30] [--down 10] [--standby 0]
                        [--lighthouse-kill 0] [--method dilocox|streaming] [--seed 0] [--netns | --no-netns]
                        [--bandwidth 100mbit] [--latency 50ms]
                        [--out docs/bench/churn]
    dilocox bench churn --render [--out docs/bench/churn]    re-write OUT/results.md from OUT/results.json

Measured from the launcher's ``events.jsonl`` and every job's ``metrics.jsonl`` (``analyze``, pure):

- goodput: tokens of the steps that reached an outer step (per incarnation, the steps up to its last outer step:
  the ones after it died with the process) in the window from the moment every replica trained to the first
  replica's end, over R x the undisturbed run's tokens/s per replica x that window;
- rejoin per event: restart (or a standby's activation) -> that job's first step, and -> its first outer step;
- bit-identity: every step record carries a digest of θ after the last outer step (``DILOCOX_THETA_DIGEST``); at
  every outer step all jobs that took it must hold the same θ;
- final val loss of the first job by name (``replica0`` unless it died last) that logged a summary, against the
  undisturbed curve at the churned run's tokens (every job ends with the same θ: the digests above).

On a CPU-bound host (this one: 2 cores for R jobs) a dead replica's cores speed the survivors up, which a cluster
with one accelerator per replica does not do: goodput here is an upper bound of the cluster's for the same events.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

from dilocox.bench.elastic import read_jsonl, val_at_tokens
from dilocox.bench.runner import machine_line, out_dir, write_config, write_results

LAYOUT = "parallel: {replicas: 1}\n"
# the phases of a restarted job's start-up (its ``startup`` record, ``Trainer.startup``), in order
STARTUP = ("process_s", "distributed_s", "data_s", "model_s", "outer_s", "join_s")
TRAIN_FLAGS = ["--checkpoint.resume=none", "--checkpoint.every=0", "--log.progress=false", "--log.tensorboard=false",
               "--log.every=1"]  # fmt: skip


def kill_schedule(replicas: int, period_s: float, down_s: float, wall_s: float, seed: int) -> tuple[list, list]:
    """``--kill``/``--restart`` lists: a random replica (seeded) killed every ``period_s`` until ``wall_s`` minus
    ``down_s`` (its restart must land inside the run), each restarted ``down_s`` later."""
    if not 0 < down_s < period_s:
        raise ValueError(f"--down {down_s} must be in (0, --period {period_s})")
    rng, kills, restarts, t = random.Random(seed), [], [], period_s
    while t + down_s < wall_s:
        r = rng.randrange(replicas)
        kills.append(f"{r}@{t:g}")
        restarts.append(f"{r}@{t + down_s:g}")
        t += period_s
    return kills, restarts


def read_churn_run(run_dir: str) -> dict:
    """Events and every job's step records (``replica<r>``, ``standby<s>``), and their summaries."""
    jobs = {}
    for name in sorted(os.listdir(run_dir)):
        path = os.path.join(run_dir, name, "metrics.jsonl")
        if (name.startswith("replica") or name.startswith("standby")) and os.path.exists(path):
            recs = read_jsonl(path)
            jobs[name] = {
                "steps": [x for x in recs if "step" in x and "wall" in x and "loss" in x],
                "summary": next((x["summary"] for x in reversed(recs) if "summary" in x), {}),
                "startups": [x for x in recs if x.get("event") == "startup" and "wall" in x],
            }
    return {"events": read_jsonl(os.path.join(run_dir, "events.jsonl")), "jobs": jobs}


def incarnations(steps: list[dict]) -> list[list[dict]]:
    """A job's step records cut where a new process took over: the step does not follow the previous one."""
    out: list[list[dict]] = []
    for x in steps:
        if out and x["step"] == out[-1][-1]["step"] + 1:
            out[-1].append(x)
        else:
            out.append([x])
    return out


def useful(inc: list[dict]) -> list[dict]:
    """The records of one incarnation up to its last outer step (the later ones never reached one)."""
    o = [x.get("outer_step", 0) for x in inc]
    last = max((i for i in range(1, len(inc)) if o[i] > o[i - 1]), default=-1)
    return inc[: last + 1]


def digest_mismatches(jobs: dict) -> tuple[int, list[int]]:
    """(outer steps compared, those where two jobs held different θ)."""
    seen: dict[int, set] = {}
    for job in jobs.values():
        for x in job["steps"]:
            if "theta_digest" in x and x.get("outer_step", 0) > 0:
                seen.setdefault(x["outer_step"], set()).add(x["theta_digest"])
    return len(seen), sorted(k for k, v in seen.items() if len(v) > 1)


def _rejoins(run: dict) -> list[dict]:
    """Per restart / activation event: seconds to that job's first step and to its first outer step."""
    out = []
    for e in run["events"]:
        if e["event"] not in ("restart", "activate") or "skipped" in e:
            continue
        name = f"standby{e['standby']}" if e["event"] == "activate" else f"replica{e['replica']}"
        after = [x for x in run["jobs"].get(name, {"steps": []})["steps"] if x["wall"] > e["wall"]]
        rec = {"event": e["event"], "replica": e.get("replica"), "job": name, "t": e["t"]}
        ready = [x for x in run["jobs"].get(name, {}).get("startups", []) if x["wall"] > e["wall"]]
        if ready and e["event"] == "restart":  # where the restarted process's seconds went (Trainer.startup)
            rec["startup"] = {k: v for k, v in ready[0].items() if k.endswith("_s")}
        if after:
            o0 = after[0].get("outer_step", 0)
            outer = next((x["wall"] for x in after if x.get("outer_step", 0) > o0), None)
            rec.update(first_step_s=after[0]["wall"] - e["wall"], first_outer_step_s=None if outer is None else
                       outer - e["wall"], at_step=after[0]["step"])  # fmt: skip
        out.append(rec)
    return out


def analyze(run: dict, tokens_per_step: int, replicas: int, rate_per_replica: float | None = None) -> dict:
    """The numbers of one run (module docstring); ``rate_per_replica``: the undisturbed run's tokens/s per replica
    (None: this is the undisturbed run, whose rate is computed)."""
    jobs = run["jobs"]
    firsts = sorted(j["steps"][0]["wall"] for j in jobs.values() if j["steps"])
    ends = [j["steps"][-1]["wall"] for j in jobs.values() if j["steps"] and j["summary"]]
    if len(firsts) < replicas or not ends:
        return {"complete": False}
    t0, t1 = firsts[replicas - 1], min(ends)  # (from when R jobs had trained: a job killed early may never have)
    start = min((e["wall"] for e in run["events"] if e["event"] == "start"), default=min(firsts))
    steps_in = lambda recs: [x for x in recs if t0 < x["wall"] <= t1]  # noqa: E731
    all_tokens = sum(len(steps_in(j["steps"])) for j in jobs.values()) * tokens_per_step
    good = sum(len(steps_in(useful(inc))) for j in jobs.values() for inc in incarnations(j["steps"]))
    out: dict = {"complete": True, "wall_s": max(ends) - start, "window_s": t1 - t0, "ready_t": t0 - start}
    out["tokens_per_s_per_replica"] = all_tokens / (t1 - t0) / replicas
    rate = rate_per_replica or out["tokens_per_s_per_replica"]
    out["goodput"] = good * tokens_per_step / (replicas * rate * (t1 - t0))
    out["tokens_lost"] = all_tokens - good * tokens_per_step
    compared, bad = digest_mismatches(jobs)
    out.update(outer_steps_compared=compared, outer_steps_differing=bad)
    out["kills"] = sum(1 for e in run["events"] if e["event"] == "kill")
    out["lighthouse_kills"] = sum(1 for e in run["events"] if e["event"] == "lighthouse_kill" and "skipped" not in e)
    out["rejoins"] = _rejoins(run)
    done = next(j for n, j in sorted(jobs.items()) if j["summary"])
    out["final_val_loss"] = done["summary"].get("final_val_loss")
    out["tokens_total"] = sum(len(j["steps"]) for j in jobs.values()) * tokens_per_step
    return out


def val_curve(run: dict, tokens_per_step: int) -> list[tuple[float, float]]:
    """(tokens of all jobs by then, val loss of replica 0) at each of its evaluations, its final one last."""
    walls = sorted(x["wall"] for j in run["jobs"].values() for x in j["steps"])
    rep = run["jobs"].get("replica0", {"steps": [], "summary": {}})
    pts = [(sum(1 for w in walls if w <= x["wall"]) * tokens_per_step, x["val_loss"]) for x in rep["steps"]
           if "val_loss" in x]  # fmt: skip
    if rep["summary"].get("final_val_loss") is not None:
        pts.append((len(walls) * tokens_per_step, rep["summary"]["final_val_loss"]))
    return pts


def _f(x, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def markdown(res: dict) -> str:
    u, c = res["undisturbed"], res["churned"]
    rj = [r for r in c.get("rejoins", []) if r.get("first_outer_step_s") is not None]
    med = sorted(r["first_outer_step_s"] for r in rj)
    lines = [
        f"{res['replicas']} elastic replicas (one `dilocox train` job of one rank each), tiny GPT-2, the "
        f"`{res['method']}` preset with H={res['H']}, {res['steps']} steps; {res['emulation']}. Churned: a random "
        f"replica SIGKILLed every {res['period']:g} s and restarted {res['down']:g} s later ({c.get('kills', 0)} "
        f"kills; the lighthouse killed {c.get('lighthouse_kills', 0)} time(s)), {res['standby']} warm standby "
        f"job(s). Measured {res['date']} on {res['machine']}; `{res['command']}`.",
        "",
        "| quantity | undisturbed | churned |",
        "|---|---|---|",
        f"| wall time | {_f(u.get('wall_s'), '.1f')} s | {_f(c.get('wall_s'), '.1f')} s |",
        f"| tokens/s per replica (all steps) | {_f(u.get('tokens_per_s_per_replica'), ',.0f')} | "
        f"{_f(c.get('tokens_per_s_per_replica'), ',.0f')} |",
        f"| goodput (target ≥ 0.90) | {_f(u.get('goodput'), '.3f')} | {_f(c.get('goodput'), '.3f')} |",
        f"| outer steps where the jobs' θ were compared / differed | {u.get('outer_steps_compared', '—')} / "
        f"{len(u.get('outer_steps_differing', []))} | {c.get('outer_steps_compared', '—')} / "
        f"{len(c.get('outer_steps_differing', []))} |",
        f"| rejoin: event → first outer step, median (max) over {len(med)} | — | "
        f"{_f(statistics.median(med) if med else None, '.1f')} s ({_f(med[-1] if med else None, '.1f')} s) |",
        f"| final val loss | {_f(u.get('final_val_loss'), '.4f')} | {_f(c.get('final_val_loss'), '.4f')} "
        f"({_f(res.get('loss_vs_equal_tokens_pct'), '+.2f')} % vs undisturbed at equal tokens; target within 1 %) |",
        "",
        *_rejoin_table(c.get("rejoins", [])),
    ]
    return "\n".join(lines)


def _rejoin_table(rejoins: list[dict]) -> list[str]:
    """One row per rejoin; the start-up column only when some row has a ``startup`` record (results measured before
    the record existed have none: the column is left out rather than filled with dashes)."""
    with_startup = any("startup" in r for r in rejoins)
    head = "| event | t (s) | job | → first step (s) | → first outer step (s) |"
    if with_startup:
        head += " a restart's start-up (s): process, groups, data, model, outer, join |"
    lines = [head, "|---" * (6 if with_startup else 5) + "|"]
    for r in rejoins:
        times = f"{_f(r.get('first_step_s'), '.1f')} | {_f(r.get('first_outer_step_s'), '.1f')}"
        row = f"| {r['event']} replica {r['replica']} | {r['t']:.1f} | {r['job']} | {times} |"
        if with_startup:
            su = r.get("startup") or {}
            row += f" {', '.join(_f(su.get(k), '.1f') for k in STARTUP) if su else '—'} |"
        lines.append(row)
    return lines


def render(out: str) -> int:
    """``--render``: re-write OUT/results.md from OUT/results.json as the current ``markdown`` draws it (nothing runs;
    the bench draws no plot). A missing or unreadable results.json is one line and exit status 2."""
    import json

    path = os.path.join(out, "results.json")
    try:
        with open(path) as f:
            md = markdown(json.load(f))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        why = f"{type(e).__name__}: {e}"
        print(f"dilocox bench churn --render: cannot read {path} ({why}); run the bench first (without --render) "
              "or give --out the directory that holds its results.json", file=sys.stderr)  # fmt: skip
        return 2
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    return 0


def _launch(cfg_path: str, run_dir: str, replicas: int, overrides: list, netns, **kw) -> dict:
    import shutil

    from dilocox.elastic.launch import launch_elastic

    shutil.rmtree(run_dir, ignore_errors=True)
    rc = launch_elastic(cfg_path, replicas, [*overrides, f"--log.run_dir={run_dir}"], min_replicas=1, netns=netns,
                        lighthouse_opts=["--heartbeat-timeout-ms", "2000", "--join-timeout-ms", "30000"],
                        **kw)  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"elastic launch failed with exit code {rc}; logs: {run_dir}/*.log")
    return read_churn_run(run_dir)


def bench(a, run_root: str) -> dict:
    from dilocox.config import load_config
    from dilocox.launch.netns import netns_available
    from dilocox.outer.diloco import DIGEST_ENV

    os.environ[DIGEST_ENV] = "1"
    ok, why = netns_available()
    use = ok if a.netns is None else a.netns
    link = ", ".join(x for x in (a.bandwidth and f"{a.bandwidth} each way", a.latency and f"{a.latency} round trip")
                     if x) or "uncapped"  # fmt: skip
    emulation = f"network namespaces ({link})" if use else f"loopback ({why or 'namespaces off'})"
    preset = "methods/streaming.yaml" if a.method == "streaming" else "methods/dilocox.yaml"
    with tempfile.TemporaryDirectory() as tmp:
        body = LAYOUT + (f"outer: {{sync_every: {a.H}}}\n" if a.H else "")  # (0: the preset's own H)
        cfg_path = write_config(os.path.join(tmp, "churn.yaml"), ["tiny.yaml", preset], body)
        overrides = [*TRAIN_FLAGS, f"--train.steps={a.steps}"]
        cfg = load_config(
            cfg_path, [*overrides, "--outer.elastic.enabled=true", "--outer.elastic.lighthouse=http://x:1"]
        )
        a.H = cfg.outer.sync_every
        if a.steps % a.H or a.steps < 3 * a.H:
            raise ValueError(f"--steps {a.steps} must be a multiple of H={a.H} with at least 3 outer steps")
        overrides.append(f"--train.eval_every={a.H * 10}")
        tps = cfg.train.batch_size * cfg.train.seq_len
        wan = {k: v for k, v in (("bandwidth", a.bandwidth), ("latency", a.latency)) if v}
        full = _launch(cfg_path, os.path.join(run_root, "undisturbed"), a.replicas, overrides, a.netns, **wan)
        u = analyze(full, tps, a.replicas)
        kills, restarts = kill_schedule(a.replicas, a.period, a.down, u.get("wall_s", 0.0), a.seed)
        if a.lighthouse_kill > 0:  # the lighthouse too, once: SIGKILLed, back on its address --down s later
            kills.append(f"L@{a.lighthouse_kill:g}")
            restarts.append(f"L@{a.lighthouse_kill + a.down:g}")
        bound = max(600.0, 4 * u.get("wall_s", 0))
        cut = _launch(cfg_path, os.path.join(run_root, "churned"), a.replicas, overrides, a.netns, kills=kills,
                      restarts=restarts, standby_replicas=a.standby, timeout_s=bound, **wan)  # fmt: skip
    c = analyze(cut, tps, a.replicas, u.get("tokens_per_s_per_replica"))
    eq = val_at_tokens(val_curve(full, tps), c.get("tokens_total", 0))
    fin = c.get("final_val_loss")
    return {
        "replicas": a.replicas, "method": a.method, "H": a.H, "steps": a.steps, "period": a.period, "down": a.down,
        "standby": a.standby, "seed": a.seed, "emulation": emulation, "machine": machine_line(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "kills": kills, "restarts": restarts,
        "undisturbed": u, "churned": c, "undisturbed_val_at_equal_tokens": eq,
        "loss_vs_equal_tokens_pct": None if eq is None or fin is None else 100.0 * (fin / eq - 1.0),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dilocox bench churn", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--steps", type=int, default=600, help="inner steps per replica (a multiple of --H)")
    p.add_argument("--H", type=int, default=0, help="inner steps per outer step (0: the preset's own)")
    p.add_argument("--period", type=float, default=30.0, help="seconds between kills")
    p.add_argument("--down", type=float, default=10.0, help="seconds from a kill to its restart")
    p.add_argument("--standby", type=int, default=0, help="warm standby jobs (outer.elastic.standby)")
    p.add_argument("--method", choices=("dilocox", "streaming"), default="dilocox")
    p.add_argument("--seed", type=int, default=0, help="which replica each kill hits")
    p.add_argument("--lighthouse-kill", type=float, default=0.0, help="SIGKILL the lighthouse then (s; 0: never)")
    p.add_argument("--bandwidth", default=None, help="cap each replica's link, e.g. 100mbit (network namespaces)")
    p.add_argument("--latency", default=None, help="round trip between the sites, e.g. 50ms (the delay switch)")
    p.add_argument("--netns", dest="netns", action="store_true", default=None)
    p.add_argument("--no-netns", dest="netns", action="store_false")
    p.add_argument("--out", type=out_dir, default="docs/bench/churn")
    p.add_argument("--runs", type=out_dir, default=None, help="run dirs (default: a temporary directory)")
    p.add_argument("--render", action="store_true", help="only re-write OUT/results.md from OUT/results.json")
    a = p.parse_args(argv)
    if a.render:
        return render(a.out)
    if a.replicas < 2:
        p.error("--replicas must be >= 2")
    if not 0 < a.down < a.period:
        p.error(f"--down {a.down} must be in (0, --period {a.period})")
    with tempfile.TemporaryDirectory() as tmp:
        res = bench(a, a.runs or tmp)
    res["command"] = " ".join(["dilocox bench churn", *(argv if argv is not None else sys.argv[1:])])
    os.makedirs(a.out, exist_ok=True)
    md = markdown(res)
    write_results(a.out, res, md)
    print(md)
    return 0
