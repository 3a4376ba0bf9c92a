"""``dilocox bench swarm`` (issue 11): SWARM and DiLoCo-SWARM on real peer processes (``dilocox.swarm.runtime``).

Tiny GPT-2 on the stdlib corpus, each peer one process on this host (loopback), short runs. Four parts:

(a) paper 000's main experiment at small scale, equal steps: the weak baseline (one pipeline, 1 peer per stage:
    a quarter of the tokens), SWARM 4 x 2 (per-step gradient all-reduce in each stage) and DiLoCo-SWARM 4 x 2
    (outer step every H steps; the paper's H = 50 by default), and a control: the same 4 x 2 peers with fixed
    wiring (s0pk -> s1pk), i.e. 4 plain DiLoCo replicas, so the cost of the stochastic wiring shows. Final
    validation loss of the trained stages (peer 0 of each stage chained; SWARM's and, after the last outer step,
    DiLoCo-SWARM's peers of a stage are identical), pipeline bytes (activations and their gradients, counted by
    the peers on their links) and stage-sync bytes (``dilocox.swarm.plan``: fp32 ring all-reduce of the stage's
    parameters per sync, per peer, times peers and syncs).
(b) heterogeneous peers, 2 stages x 2 peers, peer s1p1 2x slower than s1p0: both stage-1 peers paced (``--pace``
    and twice that: ``--pace-s``, each microbatch occupies the peer for max(pace, its compute) seconds, so the
    ratio is 2 whatever the host's load as long as the pace exceeds the compute); tokens/s of IWRR, random wiring
    and the static pipeline (``swarm.routing=fixed``: s0p0 -> s1p0, s0p1 -> s1p1) on the same peers. Capacity:
    stage 1 serves 1 + 0.5 = 1.5 units, the static pipeline 2 x 0.5 = 1.0 (each step waits for the slow pair), so
    IWRR can reach 1.5x static at most.
(c) a stage-1 peer killed (SIGKILL) at a third of a 2 x 2 IWRR run: tokens/s before / after, time from the kill
    to the first re-routed microbatch (the first ban of the dead peer by a stage-0 peer: the microbatch is re-sent
    at once) and the microbatches stage 1 trained per step (nothing lost: every step's batch trained once).
(d) the H ablation: DiLoCo-SWARM 4 x 2 at H in ``--ablation-H`` (10, 50, 200), the steps of (a), final val loss.

    dilocox bench swarm [--steps 400] [--H 50] [--ablation-H 10,50,200] [--hetero-steps 12] [--pace 0.2]
                        [--hetero-mb 12] [--parts a,b,c,d] [--out docs/bench/swarm]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

from dilocox.bench.runner import CONFIGS, line_plot, machine_line, out_dir, write_results
from dilocox.bench.runner import fmt_cell as _f
from dilocox.distributed.procs import kill_group

# the tiny model and short sequences: 8 peer processes share the host's cores
BASE = [
    "--model.n_layers=4",
    "--model.d_model=64",
    "--model.n_heads=4",
    "--data.max_bytes=400000",
    "--train.batch_size=4",
    "--train.seq_len=64",
    "--optim.lr=3e-3",
    "--optim.warmup_steps=0",
    "--optim.schedule=constant",
    "--swarm.microbatch_size=2",
    "--swarm.rpc_timeout_s=60",
    "--swarm.step_timeout_s=120",
    "--swarm.sync_timeout_s=60",
    "--swarm.startup_timeout_s=240",
]
VAL_BATCHES = 8


# --------------------------------------------------------------------------- analysis (pure: tested on synthetic data)


def pipeline_bytes(records: dict[str, list[dict]]) -> int:
    """Bytes on every inter-stage link over the run, both ways (activations + their gradients), as the senders
    counted them (``link_bytes``: peer -> [sent, received] per step)."""
    return sum(sum(a + b for a, b in r.get("link_bytes", {}).values()) for recs in records.values() for r in recs)


def stage_sync_count(records: dict[str, list[dict]], sync: str, H: int, steps: int) -> int:
    """Stage syncs in the run: SWARM one per step, DiLoCo-SWARM one per H steps (counted from the records)."""
    if sync == "swarm":
        return steps
    outer = {r["step"] for recs in records.values() for r in recs if r.get("outer")}
    return len(outer) if outer else steps // H


def step_seconds(records: dict[str, list[dict]], peer: str = "s0p0") -> list[float]:
    return [r["seconds"] for r in records.get(peer, []) if "seconds" in r and not r.get("joined")]


def tokens_per_s(seconds: list[float], tokens_per_step: int, lo: int = 0, hi: int | None = None) -> float | None:
    """Throughput over steps [lo, hi) from one stage-0 peer's step times (its step ends after the stage sync, so
    every stage-0 peer takes the same steps: the job's step time)."""
    s = seconds[lo:hi]
    return tokens_per_step * len(s) / sum(s) if s and sum(s) > 0 else None


def served_per_step(records: dict[str, list[dict]], stage: int) -> dict[int, int]:
    """Microbatches the peers of ``stage`` trained per step (summed over the stage's peers)."""
    out: dict[int, int] = {}
    for name, recs in records.items():
        if name.startswith(f"s{stage}p"):
            for r in recs:
                if not r.get("joined"):
                    out[r["step"]] = out.get(r["step"], 0) + int(r.get("microbatches", 0))
    return out


def share(records: dict[str, list[dict]], peer: str, stage: int, skip: int = 1) -> float | None:
    """Fraction of stage ``stage``'s microbatches that ``peer`` served (steps >= skip: after the first timing)."""
    mine = sum(r.get("microbatches", 0) for r in records.get(peer, []) if r["step"] >= skip)
    tot = sum(v for k, v in served_per_step(records, stage).items() if k >= skip)
    return mine / tot if tot else None


def predicted_share(records: dict[str, list[dict]], peer: str, stage: int, skip: int = 1) -> float | None:
    """The share of ``stage``'s microbatches that ``peer`` would get if each peer of the stage took microbatches in
    proportion to its throughput, 1 / (its own work per microbatch: ``busy_s`` / ``microbatches``, steps >= skip)."""
    thr = {}
    for name, recs in records.items():
        if name.startswith(f"s{stage}p"):
            busy = sum(r.get("busy_s", 0.0) for r in recs if r["step"] >= skip)
            n = sum(r.get("microbatches", 0) for r in recs if r["step"] >= skip)
            if n and busy > 0:
                thr[name] = n / busy
    return thr[peer] / sum(thr.values()) if peer in thr else None


def kill_analysis(records: dict, bans: list[dict], kill_t: float, kill_step: int, tokens_per_step: int) -> dict:
    """(c): throughput before the kill (steps 1 .. kill_step-1) and after it (the steps from kill_step+2 on: the
    kill step and the next absorb the ban and the sync quorum change); kill -> first ban of the victim."""
    secs = step_seconds(records)
    first_ban = min((b["t"] for b in bans), default=None)
    return {
        "kill_step": kill_step,
        "tokens_s_before": tokens_per_s(secs, tokens_per_step, 1, kill_step),
        "tokens_s_during": tokens_per_s(secs, tokens_per_step, kill_step, kill_step + 2),
        "tokens_s_after": tokens_per_s(secs, tokens_per_step, kill_step + 2),
        "kill_to_reroute_s": None if first_ban is None else first_ban - kill_t,
        "bans": len(bans),
    }


# --------------------------------------------------------------------------- running


def _cfg(extra: list[str]):
    from dilocox.config import load_config

    return load_config(os.path.join(CONFIGS, "tiny.yaml"), [*BASE, *extra])


def _run(cfg, out: str, peers: list[int], steps: int, timeout_s: float, **kw):
    from dilocox.swarm.runtime import launch

    res = launch(cfg, out, peers_per_stage=peers, steps=steps, timeout_s=timeout_s, **kw)
    bad = {n: rc for n, rc in res.returncodes.items() if rc != 0}
    return res, bad


def _check(res, bad: dict, what: str) -> None:
    if bad:
        name = next(iter(bad))
        raise RuntimeError(f"bench swarm {what}: peers {bad} failed; {name}'s log:\n{res.log_tail(name)}")


def val_loss(cfg, peers: dict[str, dict], n_stages: int, n_batches: int = VAL_BATCHES) -> float:
    """Validation loss of the trained model: peer 0 of each stage, chained, on the fixed validation windows."""
    import torch

    from dilocox.data.prepare import prepare
    from dilocox.model import build_stage_model

    stages = []
    for j in range(n_stages):
        m = build_stage_model(cfg.model, stage=j, n_stages=n_stages, seed=cfg.train.seed)
        m.load_state_dict(peers[f"s{j}p0"]["params"], strict=False)
        stages.append(m.eval())
    batches = prepare(cfg.data).val_batches(n_batches, cfg.train.batch_size, cfg.train.seq_len)
    tot = 0.0
    with torch.no_grad():
        for x, y in batches:
            h = x
            for m in stages:
                h = m(h)
            tot += float(stages[-1].loss(h.float(), y))
    return tot / len(batches)


def _run_a(root: str, label: str, peers: list[int], extra: list[str], steps: int, H: int, timeout_s: float) -> dict:
    """One run of (a) / (d): train, then the final validation loss, bytes and syncs of the run."""
    from dilocox.swarm.plan import plan_config

    cfg = _cfg([*extra, f"--swarm.peers_per_stage=[{peers[0]},{peers[1]}]"])
    t0 = time.monotonic()
    res, bad = _run(cfg, os.path.join(root, label.replace(" ", "_").replace("=", "")), peers, steps, timeout_s)
    _check(res, bad, label)
    plan = plan_config(cfg, label)
    sync = cfg.swarm.sync
    n_sync = stage_sync_count(res.records, sync, H, steps)
    per_sync = plan["swarm_sync_bytes"] if sync == "swarm" else plan["diloco_sync_bytes_per_sync"]
    losses = [r["loss"] for r in res.records["s0p0"]]
    tps = peers[0] * cfg.train.batch_size * cfg.train.seq_len
    return {
        "peers": peers,
        "sync": sync,
        "H": H if sync == "diloco" else 1,
        "val_loss": val_loss(cfg, res.peers, len(peers)),
        "train_loss_last": sum(losses[-3:]) / len(losses[-3:]),
        "losses": losses,
        "tokens": steps * tps,
        "stage_syncs": n_sync,
        "pipeline_bytes": pipeline_bytes(res.records),
        "pipeline_bytes_planned": plan["pipeline_bytes"] * steps,
        "sync_bytes": n_sync * per_sync,
        "tokens_s": tokens_per_s(step_seconds(res.records), tps, 1),
        "wall_s": time.monotonic() - t0,
    }


def diloco_label(H: int) -> str:
    return f"DiLoCo-SWARM 4x2 H={H}"


def control_label(H: int) -> str:
    return f"control: 4 DiLoCo replicas, fixed wiring, H={H}"


def _diloco_extra(H: int) -> list[str]:
    return ["--swarm.sync=diloco", "--swarm.routing=iwrr", f"--outer.sync_every={H}"]


def part_a(root: str, steps: int, H: int, timeout_s: float, sets: tuple[str, ...] = ()) -> dict:
    """``sets``: config overrides of every run of (a) (``--set``, e.g. DiLoCo-SWARM's outer optimizer)."""
    runs = {
        "baseline 1x2": ([1, 1], ["--swarm.sync=swarm", "--swarm.routing=fixed"]),
        "SWARM 4x2": ([4, 4], ["--swarm.sync=swarm", "--swarm.routing=iwrr"]),
        diloco_label(H): ([4, 4], _diloco_extra(H)),
        # the control: the same 4 x 2 peers with fixed wiring (s0pk -> s1pk) are 4 plain DiLoCo replicas of a
        # 2-stage pipeline: DiLoCo-SWARM minus the stochastic wiring
        control_label(H): ([4, 4], ["--swarm.sync=diloco", "--swarm.routing=fixed", f"--outer.sync_every={H}"]),
    }
    return {label: _run_a(root, label, peers, [*ex, *sets], steps, H, timeout_s) for label, (peers, ex) in runs.items()}


def part_d(
    root: str, steps: int, Hs: list[int], timeout_s: float, done: dict | None = None, sets: tuple[str, ...] = ()
) -> dict:
    """The H ablation: DiLoCo-SWARM 4x2 at each H of ``Hs``, same steps; a run of (a) with the same H is reused."""
    out = {}
    for H in Hs:
        label = diloco_label(H)
        if done and label in done:
            out[label] = dict(done[label], reused=True)
        else:
            out[label] = _run_a(root, label, [4, 4], [*_diloco_extra(H), *sets], steps, H, timeout_s)
    return out


def busy_per_mb(records: dict[str, list[dict]], peer: str, skip: int = 1) -> float | None:
    """``peer``'s own work per microbatch (``busy_s`` / ``microbatches`` over steps >= skip): with ``--pace-s`` at
    least its pace, more when its compute alone takes longer."""
    recs = [r for r in records.get(peer, []) if r["step"] >= skip]
    n = sum(r.get("microbatches", 0) for r in recs)
    return sum(r.get("busy_s", 0.0) for r in recs) / n if n else None


def part_b(root: str, steps: int, pace: float, mb_per_peer: int, timeout_s: float) -> dict:
    paces = {"s1p0": pace, "s1p1": 2 * pace}
    out = {}
    for routing in ("iwrr", "random", "fixed"):
        # 2 stage-0 peers x mb_per_peer microbatches per step: IWRR can split them 2:1 between the 1x and 0.5x peers
        cfg = _cfg([f"--swarm.routing={routing}", f"--train.batch_size={2 * mb_per_peer}",
                    f"--swarm.max_inflight={max(1, mb_per_peer // 2)}"])  # fmt: skip
        res, bad = _run(cfg, os.path.join(root, f"hetero-{routing}"), [2, 2], steps, timeout_s, paces=paces)
        _check(res, bad, f"hetero {routing}")
        tps = 2 * cfg.train.batch_size * cfg.train.seq_len
        fast, slow = busy_per_mb(res.records, "s1p0"), busy_per_mb(res.records, "s1p1")
        out[routing] = {
            "tokens_s": tokens_per_s(step_seconds(res.records), tps, 1),
            "slow_share": share(res.records, "s1p1", 1),
            "slow_share_predicted": predicted_share(res.records, "s1p1", 1),
            "busy_ratio": slow / fast if fast and slow else None,
            "busy_s_per_mb": [fast, slow],
            "step_s": step_seconds(res.records),
            "served_slow_per_step": [r.get("microbatches", 0) for r in res.records.get("s1p1", [])],
        }
    static = out["fixed"]["tokens_s"]
    for r in out.values():
        r["vs_static"] = r["tokens_s"] / static if static else None
        r["of_bound"] = r["vs_static"] / 1.5 if r["vs_static"] else None
    return out


def part_c(root: str, steps: int, timeout_s: float) -> dict:
    from dilocox.swarm.runtime import launch

    cfg = _cfg(["--swarm.routing=iwrr", "--swarm.ban_s=600", "--train.batch_size=8"])
    kill_step = steps // 3
    killed: dict = {}
    out_dir = os.path.join(root, "kill")

    def on_started(la):
        victim = next(p for p in la.procs if p.name == "s1p1")
        path = os.path.join(out_dir, "s1p1.jsonl")

        def watch():
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and victim.proc.poll() is None:
                try:
                    with open(path) as f:
                        n = sum(1 for line in f if line.strip())
                except OSError:
                    n = 0
                if n >= kill_step:  # s1p1 finished step kill_step-1: kill it during step kill_step
                    time.sleep(0.3)
                    killed["t"] = time.time()
                    kill_group(victim.proc)
                    return
                time.sleep(0.05)

        threading.Thread(target=watch, daemon=True).start()

    res = launch(cfg, out_dir, peers_per_stage=[2, 2], steps=steps, timeout_s=timeout_s, on_started=on_started)
    bad = {n: rc for n, rc in res.returncodes.items() if rc != 0 and n != "s1p1"}
    _check(res, bad, "kill")
    if "t" not in killed:
        raise RuntimeError("bench swarm kill: s1p1 was not killed (it never reached the kill step)")
    bans = [b for n in ("s0p0", "s0p1") for b in (res.peers[n] or {}).get("bans", []) if b["peer"] == "s1p1"]
    tps = 2 * cfg.train.batch_size * cfg.train.seq_len
    # the step the kill landed in: the victim's records end with the last step it finished (fast steps may run
    # past the watcher's kill_step before the kill lands)
    landed = len([r for r in res.records.get("s1p1") or [] if "step" in r])
    out = kill_analysis(res.records, bans, killed["t"], landed, tps)
    served = served_per_step({n: r for n, r in res.records.items() if n.startswith("s1")}, 1)
    expected = 2 * cfg.train.batch_size // cfg.swarm.microbatch_size
    out["served_per_step"] = [served.get(k, 0) for k in range(steps)]
    out["expected_per_step"] = expected
    out["steps_with_all_microbatches"] = sum(1 for k in range(steps) if served.get(k, 0) == expected)
    out["steps"] = steps
    out["victim_rc"] = res.returncodes.get("s1p1")
    return out


# --------------------------------------------------------------------------- report


PART_PARAMS = {
    "a": ("steps", "H", "set"),
    "d": ("steps", "ablation_H", "set"),
    "b": ("hetero_steps", "pace", "hetero_mb"),
    "c": (),
}
RUN_META = ("date", "machine", "load_before", "load_after", "command")


def carry_over(res: dict, old: dict, parts: set[str]) -> dict:
    """Keep the parts not run now (``--parts``) from the previous results in the same ``--out``, each with the date,
    load, command and parameters of the run that measured it (``res["earlier"][part]``), so that re-running one part
    leaves the others in the report."""
    for p in "adbc":
        if p in parts or p not in old:
            continue
        res[p] = old[p]
        earlier = (old.get("earlier") or {}).get(p) or {k: old.get(k) for k in (*RUN_META, *PART_PARAMS[p])}
        res.setdefault("earlier", {})[p] = earlier
    return res


def _params(res: dict, part: str) -> dict:
    """The run parameters of ``part``: this run's, or the earlier run's that measured it (``carry_over``)."""
    return {**res, **(res.get("earlier") or {}).get(part, {})}


def _md_part_a(res: dict) -> list[str]:
    """Part (a)'s section of ``markdown``: the runs' table, then DiLoCo-SWARM against SWARM and the control."""
    a, pa = res["a"], _params(res, "a")
    per_peer = [r["tokens"] // (pa["steps"] * r["peers"][0]) for r in a.values()][0]  # batch x seq, every run
    lines = [
        f"**(a) Paper 000's experiment, small scale** ({pa['steps']} steps each, tiny GPT-2 4 layers d=64, "
        f"2 stages, {per_peer:,} tokens per stage-0 peer and step; DiLoCo-SWARM H={pa['H']}"
        + ("" if pa["H"] == 50 else " instead of the paper's 50")
        + (
            f"; every run with {' '.join(pa['set'])}"
            if pa.get("set")
            else "; outer Nesterov lr 0.7, momentum 0.9 as the paper"
        )
        + ").",
        "",
        "| run | peers | tokens | final val loss | train loss (last 3) | stage syncs | pipeline MB | sync MB | "
        "sync share | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in a.items():
        tot = r["pipeline_bytes"] + r["sync_bytes"]
        lines.append(
            f"| {label} | {r['peers'][0]}+{r['peers'][1]} | {r['tokens']} | {r['val_loss']:.4f} | "
            f"{r['train_loss_last']:.4f} | {r['stage_syncs']} | {r['pipeline_bytes'] / 1e6:.2f} | "
            f"{r['sync_bytes'] / 1e6:.2f} | {r['sync_bytes'] / tot:.0%} | {_f(r['tokens_s'], '.0f')} |"
        )
    sw = next((r for k, r in a.items() if k.startswith("SWARM")), None)
    dl = next((r for k, r in a.items() if k.startswith("DiLoCo")), None)
    if sw and dl:
        lines += [
            "",
            f"DiLoCo-SWARM vs SWARM: final val loss {100 * (dl['val_loss'] / sw['val_loss'] - 1):+.1f} % "
            f"with {sw['stage_syncs'] / max(dl['stage_syncs'], 1):.0f}x fewer stage syncs and "
            f"{sw['sync_bytes'] / max(dl['sync_bytes'], 1):.0f}x fewer sync bytes. Pipeline bytes are the peers' "
            "own counts (planned by `dilocox plan --swarm`: "
            + ", ".join(f"{r['pipeline_bytes_planned'] / 1e6:.2f}" for r in a.values())
            + " MB); sync bytes are planned (fp32 ring all-reduce per peer x peers x syncs).",
        ]
    ctl = next((r for k, r in a.items() if k.startswith("control")), None)
    if dl and ctl:
        lines += [
            "",
            f"The control (the same peers with fixed wiring s0pk -> s1pk: 4 plain DiLoCo replicas) ends at "
            f"{ctl['val_loss']:.4f}, DiLoCo-SWARM at {dl['val_loss']:.4f} "
            f"({100 * (dl['val_loss'] / ctl['val_loss'] - 1):+.1f} %): what the stochastic wiring costs or gains.",
        ]
    lines.append("")
    return lines


def markdown(res: dict) -> str:
    lines = [
        f"Measured {res['date']} on {res['machine']}; load average before the runs {res['load_before']}, after "
        f"{res['load_after']} (the host's 2 cores are shared with other jobs: throughput numbers are noisy). "
        f"Command: `{res['command']}`.",
    ]
    earlier: dict[str, list[str]] = {}
    for p, e in sorted((res.get("earlier") or {}).items()):
        key = (
            f"measured {e.get('date')}, load average before {e.get('load_before')}, after {e.get('load_after')}; "
            f"command `{e.get('command')}`"
        )
        earlier.setdefault(key, []).append(f"({p})")
    for key, ps in earlier.items():
        lines.append(f"{' and '.join(ps)} from an earlier run: {key}.")
    lines.append("")
    if "a" in res:
        lines += _md_part_a(res)
    if "d" in res:
        d, pa, pd = res["d"], _params(res, "a"), _params(res, "d")
        key = lambda p: (p.get("steps"), sorted(x for x in p.get("set") or [] if not x.startswith("--outer.")))  # noqa: E731
        same = key(pa) == key(pd)  # (a) of another run (batch, length) is no baseline; SWARM has no outer step
        sw = next((r for k, r in res.get("a", {}).items() if k.startswith("SWARM")), None) if same else None
        lines += [
            f"**(d) H ablation** (DiLoCo-SWARM 4x2, {pd['steps']} steps each, same data and seed"
            + (f", every run with {' '.join(pd['set'])}" if pd.get("set") else "")
            + "; the paper's loss rises monotonically with H).",
            "",
            "| H | stage syncs | final val loss | vs SWARM 4x2 | train loss (last 3) | sync MB |",
            "|---|---|---|---|---|---|",
        ]
        for r in sorted(d.values(), key=lambda r: r["H"]):
            vs = f"{100 * (r['val_loss'] / sw['val_loss'] - 1):+.1f} %" if sw else "-"
            lines.append(
                f"| {r['H']} | {r['stage_syncs']} | {r['val_loss']:.4f} | {vs} | {r['train_loss_last']:.4f} | "
                f"{r['sync_bytes'] / 1e6:.2f} |"
            )
        vals = [r["val_loss"] for r in sorted(d.values(), key=lambda r: r["H"])]
        mono = all(x < y for x, y in zip(vals, vals[1:]))
        lines += ["", f"Final val loss {'rises' if mono else 'does not rise'} monotonically with H here.", ""]
    if "b" in res:
        b = res["b"]
        pb = _params(res, "b")
        mb = pb.get("hetero_mb", 12)
        lines += [
            f"**(b) Heterogeneous peers** (2 x 2, {pb['hetero_steps']} steps; stage-1 peers paced at {pb['pace']} s "
            f"and {2 * pb['pace']:g} s per microbatch (`--pace-s`: the microbatch occupies the peer for max(pace, "
            f"its compute)); {2 * mb} microbatches per step). Capacity bound: 1.5 units vs 1.0 for the static "
            "pipeline.",
            "",
            "| routing | tokens/s | vs static | of the 1.5x bound | slow peer's share | its throughput share | "
            "busy s/mb fast, slow (ratio) |",
            "|---|---|---|---|---|---|---|",
        ]
        for k, r in b.items():
            label = {"fixed": "static pipeline (pairs fixed)", "iwrr": "IWRR", "random": "random wiring"}[k]
            bpm = r.get("busy_s_per_mb") or [None, None]
            lines.append(
                f"| {label} | {_f(r['tokens_s'], '.0f')} | {_f(r['vs_static'], '.2f')}x | {_f(r['of_bound'], '.0%')} | "
                f"{_f(r['slow_share'], '.2f')} | {_f(r.get('slow_share_predicted'), '.2f')} | "
                f"{_f(bpm[0], '.3f')}, {_f(bpm[1], '.3f')} ({_f(r.get('busy_ratio'), '.2f')}) |"
            )
        lines.append("")
    if "c" in res:
        c = res["c"]
        lines += [
            f"**(c) A stage-1 peer killed** (2 x 2 IWRR, {c['steps']} steps, `kill -9` of s1p1 during step "
            f"{c['kill_step']}): tokens/s before {_f(c['tokens_s_before'], '.0f')}, during (kill step and next) "
            f"{_f(c['tokens_s_during'], '.0f')}, after {_f(c['tokens_s_after'], '.0f')} (one stage-1 peer left); "
            f"kill -> first re-routed microbatch {_f(c['kill_to_reroute_s'], '.2f')} s; "
            f"{c['steps_with_all_microbatches']}/{c['steps']} steps had all {c['expected_per_step']} microbatches "
            f"trained once by stage 1 (per step: {c['served_per_step']}).",
            "",
        ]
    if res.get("plot"):
        lines.append(f"Plot: `{res['plot']}`.")
    return "\n".join(lines).rstrip()


def smooth(ys: list[float], points: int = 40) -> tuple[list[float], list[float]]:
    """Means of consecutive windows (about ``points`` of them) and their centre steps: a readable curve of a long,
    noisy per-step loss."""
    w = max(1, len(ys) // points)
    chunks = [ys[i : i + w] for i in range(0, len(ys) - w + 1, w)]
    return [i * w + (w - 1) / 2 for i in range(len(chunks))], [sum(c) / len(c) for c in chunks]


def plot(res: dict, path: str) -> str | None:
    runs = {**res.get("a", {}), **res.get("d", {})}
    if not runs:
        return None
    series = [(k, *smooth(r["losses"]), None) for k, r in runs.items()]
    title = "SWARM vs DiLoCo-SWARM vs one pipeline"
    line_plot(path, series, "step", "train loss of s0p0's batches (window mean)", title)
    return path


def _load() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dilocox bench swarm", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400, help="steps of each run of parts (a) and (d) (a multiple of H)")
    p.add_argument("--H", type=int, default=50, help="DiLoCo-SWARM's outer period in (a) (the paper: 50)")
    p.add_argument("--ablation-H", default="10,50,200", help="(d) the outer periods compared, comma-separated")
    p.add_argument("--hetero-steps", type=int, default=12, help="steps of each run of parts (b) and (c)")
    p.add_argument("--pace", type=float, default=0.2, help="(b) pace of the fast stage-1 peer (the slow one: 2x)")
    p.add_argument("--hetero-mb", type=int, default=12, help="(b) microbatches per stage-0 peer and step")
    p.add_argument("--parts", default="abcd", help="any of a, b, c, d (e.g. a,b,d); or e alone (its own options)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="bound on each run")
    p.add_argument("--out", type=out_dir, default="docs/bench/swarm", help="results.json/.md, swarm.png go here")
    p.add_argument("--runs", type=out_dir, default=None, help="run dirs (default: a temporary directory)")
    p.add_argument(
        "--set", action="append", default=[], metavar="--section.key=value",
        help="a config override of every run of (a) and (d), e.g. --set=--outer.lr=0.5 (repeatable)",
    )  # fmt: skip
    a = p.parse_args(argv)
    parts = set(a.parts.replace(",", ""))
    if not parts or parts - set("abcd"):  # (e) has its own driver: `dilocox bench swarm --parts e` (swarm_act.py)
        p.error(f"--parts {a.parts!r} must be letters among a, b, c, d (e.g. a,b,d), or e alone")
    try:
        Hs = [int(h) for h in a.ablation_H.split(",")]
    except ValueError:
        p.error(f"--ablation-H {a.ablation_H!r} must be comma-separated integers, e.g. 10,50,200")
    for flag, H in [("--H", a.H), *(("--ablation-H", h) for h in (Hs if "d" in parts else []))]:
        if H < 1 or a.steps < H or a.steps % H:
            p.error(f"--steps {a.steps} must be a positive multiple of {flag} {H}")
    if a.hetero_steps < 4:
        p.error(f"--hetero-steps {a.hetero_steps} must be at least 4")
    if not a.pace > 0:
        p.error(f"--pace {a.pace} must be > 0 seconds")
    bad = [x for x in a.set if not (x.startswith("--") and "=" in x)]
    if bad:
        p.error(f"--set {bad[0]!r} must be a config override --section.key=value, e.g. --set=--outer.lr=0.5")
    if a.set:
        _cfg(list(a.set))  # a ConfigError names the key and the fix before any run starts
    if a.hetero_mb < 2:
        p.error(f"--hetero-mb {a.hetero_mb} must be at least 2 (microbatches per stage-0 peer and step)")
    res: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine_line(),
        "load_before": _load(),
        "steps": a.steps,
        "H": a.H,
        "hetero_steps": a.hetero_steps,
        "pace": a.pace,
        "hetero_mb": a.hetero_mb,
        "ablation_H": Hs,
        "set": list(a.set),
        "command": " ".join(["dilocox bench swarm", *(argv if argv is not None else sys.argv[1:])]),
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = a.runs or tmp
        if "a" in parts:
            res["a"] = part_a(root, a.steps, a.H, a.timeout_s, tuple(a.set))
        if "d" in parts:
            res["d"] = part_d(root, a.steps, Hs, a.timeout_s, res.get("a"), tuple(a.set))
        if "b" in parts:
            res["b"] = part_b(root, a.hetero_steps, a.pace, a.hetero_mb, a.timeout_s)
        if "c" in parts:
            res["c"] = part_c(root, max(a.hetero_steps, 9), a.timeout_s)
    res["load_after"] = _load()
    os.makedirs(a.out, exist_ok=True)
    prev = os.path.join(a.out, "results.json")
    if os.path.exists(prev):
        try:
            with open(prev) as f:
                carry_over(res, json.load(f), parts)
        except (OSError, ValueError) as e:
            print(f"bench swarm: {prev} unreadable ({e}); only the parts run now are reported", file=sys.stderr)
    res["plot"] = plot(res, os.path.join(a.out, "swarm.png"))
    md = markdown(res)
    write_results(a.out, res, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
