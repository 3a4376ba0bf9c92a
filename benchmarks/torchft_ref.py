"""torchft's own DiLoCo as the reference row of the elastic benchmark (issue 10; outside the package, issue 43).

The same scenario as the elastic bench (N replicas, one SIGKILLed and restarted on a schedule), the same model
(``dilocox.model.build_stage_model``: the config's tiny GPT-2, one stage, one process per replica), the same data
(``dilocox.data.prepare`` + one ``TokenSampler`` per replica, sharded by replica index), the same inner AdamW
(``dilocox.train.build_inner_optimizer`` + ``lr_at``, global-norm clipping) and outer Nesterov SGD
(``configs/methods/diloco.yaml``: lr 0.7, momentum 0.9) -- but the outer loop is ``torchft.local_sgd.DiLoCo`` with
one torchft ``Manager`` per replica, used as torchft's own DiLoCo trainer uses it (``torchft/_test/
diloco_trainer.py``): synchronous quorum, the user state = model + inner optimizer (+ the inner step here, so a
healed replica continues the LR schedule and its data shard at the live step), ``init_sync=False`` (identical
seeded init), per-parameter all-reduces (torchft's default). The lighthouse and the kill/restart schedule are
``dilocox.elastic.launch.ElasticLaunch``'s (``dilocox lighthouse`` = ``dilocox.elastic.start_lighthouse``), so
``events.jsonl`` and the kill semantics are those of ``dilocox launch --elastic``.

A harness that measures another system, so it lives in the source checkout (``benchmarks/``, not installed with
dilocox) and imports torchft directly; dilocox itself imports torchft in ``dilocox/elastic/torchft.py`` only. It
is run by path, from a checkout whose dilocox is importable (``pip install -e .``):

    python3 benchmarks/torchft_ref.py --replicas 3 --steps 60 --sync-every 10 --kill 2@40 --restart 2@80 \\
        --out /tmp/tfref
    python3 benchmarks/torchft_ref.py --replicas 3 --steps 40 --sync-every 10 --die-at 2@20 --out /tmp/tfdie

Per replica ``RUN/replica<r>/metrics.jsonl`` has one record per inner step with dilocox's keys (``step``,
``loss``, ``lr``, ``wall`` epoch seconds, ``tokens_per_s`` of this replica, ``val_loss`` when evaluated,
``outer_step`` = torchft's committed step) and, at each sync, ``participants`` (torchft's ``num_participants``:
the divisor of its average), ``committed``, ``quorum_id``, ``sync_s`` (the optimizer step with torchft's quorum,
heal, all-reduce and outer step in it: a survivor's first sync after a kill shows the detection wait),
``pre_sync_sum`` (float64 sum of the local params just
before the sync) and on the healing replica ``healed`` + ``healed_from_sum`` (the same sum of the params it
received). A ``{"summary": {...}}`` record ends each incarnation. ``run_reference`` returns the elastic bench's
numbers (``dilocox.bench.elastic.analyze``) plus the torchft facts of issue 10 §6 (``torchft_facts``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from datetime import timedelta

from dilocox.bench.elastic import analyze, read_elastic_run
from dilocox.bench.runner import write_config
from dilocox.distributed.procs import child_env
from dilocox.elastic.torchft import check_torchft_version, quorum_id

HERE = os.path.abspath(__file__)  # the workers run this file too

TRAIN_DEFAULTS = ("--train.eval_batches=4",)


# --------------------------------------------------------------------------- one replica (subprocess)


def _params_sum(model) -> float:
    """float64 sum of every parameter (an exact fingerprint for "the same tensors": same order, same bytes)."""
    import torch

    with torch.no_grad():
        return float(sum(float(p.detach().double().sum()) for p in model.parameters()))


def wait_for_peers(ready_dir: str, r: int, n: int, timeout_s: float) -> bool:
    """Start barrier of the first incarnations (what dilocox's ``outer.elastic.initial_replicas`` does): replica
    ``r`` marks itself ready (its torchft manager heartbeats by now) and waits, bounded, until all ``n`` did, so
    the first quorum has every replica (torchft's lighthouse forms a quorum without a replica that is not
    heartbeating yet, which then heals at its first sync: a start-up skew, not the scenario). A restarted replica
    finds its own mark and goes on at once. Returns whether all ``n`` were ready."""
    os.makedirs(ready_dir, exist_ok=True)
    mine = os.path.join(ready_dir, f"replica{r}")
    if os.path.exists(mine):
        return True
    with open(mine, "w") as f:
        f.write(f"{time.time()}\n")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(ready_dir, f"replica{q}")) for q in range(n)):
            return True
        time.sleep(0.05)
    print(f"torchft_ref replica {r}: not all {n} replicas ready within {timeout_s:g} s; going on", flush=True)
    return False


def _worker_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The worker's options, and the config overrides (``--section.key=value``) among them."""
    p = argparse.ArgumentParser(prog="benchmarks/torchft_ref.py worker")
    p.add_argument("config")
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--min-replicas", type=int, required=True)
    p.add_argument("--timeout-s", type=float, default=60.0, help="torchft all-reduce / commit / checkpoint bound")
    p.add_argument("--quorum-timeout-s", type=float, default=180.0, help="bound on one quorum (> join timeout)")
    p.add_argument("--die-at-step", type=int, default=0, help="first incarnation SIGKILLs itself before this sync")
    return p.parse_known_args(argv)


def _manager(a: argparse.Namespace, state_dict, load_state_dict):
    """torchft's ``Manager`` of replica ``a.replica`` (one process, world size 1) and the ``TCPStore`` it uses
    (returned too: it must stay alive as long as the manager)."""
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    host = "127.0.0.1"
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=a.timeout_s))
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=a.timeout_s)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=a.min_replicas,
        use_async_quorum=False,  # DiLoCo requires it
        timeout=timedelta(seconds=a.timeout_s),
        quorum_timeout=timedelta(seconds=a.quorum_timeout_s),
        connect_timeout=timedelta(seconds=a.timeout_s),
        rank=0,
        world_size=1,
        store_addr=host,
        store_port=store.port,
        lighthouse_addr=a.lighthouse,
        replica_id=f"replica{a.replica}",
        hostname=host,
        init_sync=False,  # every replica starts from the same seeded init
    )
    return store, manager


def _validate(model, val: list) -> float:
    """Mean loss of ``model`` on the validation batches ``val`` (nan without any)."""
    import torch

    model.eval()
    with torch.no_grad():
        losses = [float(model.loss(model(x), y)) for x, y in val]
    model.train()
    return sum(losses) / len(losses) if losses else float("nan")


def _train(
    cfg, r: int, model, inner, manager, sampler, val: list, st: dict, syncs: dict, out, die_step: int, t_start: float
) -> None:
    """The inner steps up to ``train.steps`` inside torchft's ``DiLoCo`` (every H-th ``inner.step()`` syncs), one
    metrics.jsonl record each; ``die_step``: SIGKILL this process right before the sync of that step (0: never)."""
    import torch

    from dilocox.optim import lr_at

    tr, H = cfg.train, cfg.outer.sync_every
    tps = tr.batch_size * tr.seq_len
    t_last = t_start
    while st["step"] < tr.steps:
        step = st["step"]
        lr = lr_at(step, cfg)
        for g in inner.param_groups:
            g["lr"] = lr
        x, y = sampler.batch_at(step)
        loss = model.loss(model(x), y)
        loss.backward()
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        if step + 1 == die_step:  # right before its quorum: peers wait on it
            print(f"torchft_ref replica {r}: SIGKILL myself before the sync of step {step + 1}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        outer_before, t_step = manager.current_step(), time.time()
        inner.step()  # DiLoCo's post hook: at every H-th step the quorum (heal), all-reduce, outer step
        inner.zero_grad(set_to_none=True)
        st["step"] += 1  # a heal inside the hook set it to the peer's step
        now = time.time()
        rec = {
            "step": st["step"],
            "loss": float(loss),
            "lr": lr,
            "wall": now,
            "tokens_per_s": tps / max(1e-9, now - t_last),
            "outer_step": manager.current_step(),
            "replica": r,
        }
        t_last = now
        if (step + 1) % H == 0:  # torchft synced after this inner step
            committed = manager.current_step() > outer_before
            syncs["commits" if committed else "failed"] += 1
            rec.update(
                participants=manager.num_participants(),
                committed=committed,
                quorum_id=quorum_id(manager),
                sync_s=now - t_step,  # inner step + torchft's quorum (heal), all-reduce, outer step
                pre_sync_sum=st["pre_sync_sum"],
            )
            if st["healed_from_sum"] is not None:
                syncs["heals"] += 1
                rec.update(healed=True, healed_from_sum=st["healed_from_sum"], healed_at_step=step + 1)
                st["healed_from_sum"] = None
        if tr.eval_every and val and st["step"] % tr.eval_every == 0:
            rec["val_loss"] = _validate(model, val)
        out.write(json.dumps(rec) + "\n")
        out.flush()


def worker_main(argv: list[str]) -> int:
    """``python3 benchmarks/torchft_ref.py worker CONFIG --replica R ... [--section.key=value ...]``."""
    import torch

    check_torchft_version()
    from torchft.local_sgd import DiLoCo

    from dilocox.config import load_config
    from dilocox.data import TokenSampler, prepare
    from dilocox.model.transformer import build_stage_model
    from dilocox.optim import build_inner_optimizer

    a, overrides = _worker_args(argv)
    torch.set_num_threads(1)
    cfg = load_config(a.config, overrides)
    tr, H, r = cfg.train, cfg.outer.sync_every, a.replica
    torch.manual_seed(tr.seed)
    data = prepare(cfg.data)
    sampler = TokenSampler(data.train_tokens(), tr.seq_len, tr.batch_size, tr.seed, r, a.replicas)
    val = data.val_batches(tr.eval_batches, tr.batch_size, tr.seq_len) if tr.eval_batches else []
    model = build_stage_model(cfg.model, seed=tr.seed)
    inner = build_inner_optimizer(cfg, model, torch.device("cpu"))
    o = cfg.outer
    outer = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum, nesterov=o.nesterov)
    st = {"step": 0, "healed_from_sum": None, "pre_sync_sum": None}

    def state_dict() -> dict:
        return {"model": model.state_dict(), "inner_optim": inner.state_dict(), "step": st["step"]}

    def load_state_dict(sd: dict) -> None:  # torchft calls it on the replica that heals (the peer's state)
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner_optim"])
        st["step"] = int(sd["step"])
        st["healed_from_sum"] = _params_sum(model)

    store, manager = _manager(a, state_dict, load_state_dict)  # the store lives as long as this function

    ready_dir = os.path.join(os.path.dirname(os.path.abspath(a.run_dir)), "ready")  # RUN/ready/replica<r>
    first_incarnation = not os.path.exists(os.path.join(ready_dir, f"replica{r}"))
    wait_for_peers(ready_dir, r, a.replicas, a.quorum_timeout_s)

    # registered before DiLoCo's hooks, so it runs first: the local params just before torchft's sync
    def pre_sync(_opt, _args, _kw) -> None:
        if (st["step"] + 1) % H == 0:
            st["pre_sync_sum"] = _params_sum(model)

    hook = inner.register_step_post_hook(pre_sync)
    os.makedirs(a.run_dir, exist_ok=True)
    out = open(os.path.join(a.run_dir, "metrics.jsonl"), "a")
    tps = tr.batch_size * tr.seq_len
    t_start = time.time()
    start_step = 0
    syncs = {"commits": 0, "failed": 0, "heals": 0}
    die_step = a.die_at_step if first_incarnation else 0  # only the first incarnation dies

    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=H, backup_device=torch.device("cpu"), pin_memory=False):
            _train(cfg, r, model, inner, manager, sampler, val, st, syncs, out, die_step, t_start)
        wall = time.time() - t_start
        final = _validate(model, val)
        summary = {
            "steps": st["step"],
            "final_val_loss": final,
            "final_val_ppl": math.exp(min(final, 50)) if final == final else None,
            "wall_s": wall,
            "tokens_per_s": tps * (st["step"] - start_step) / max(wall, 1e-9),
            "outer_steps": manager.current_step(),
            **{f"torchft_{k}": v for k, v in syncs.items()},
        }
        out.write(json.dumps({"summary": summary}) + "\n")
        print(f"torchft_ref replica {r}: done {json.dumps(summary)}", flush=True)
        return 0
    finally:
        hook.remove()
        out.close()
        manager.shutdown(wait=False)


# --------------------------------------------------------------------------- analysis (pure)


def torchft_facts(run: dict, victim: int | None) -> dict:
    """Issue 10 §6 facts from a run (``dilocox.bench.elastic.read_elastic_run``): final val losses, and for the
    heal of ``victim``: the step, torchft's participant count (the divisor of its average), the peer whose params
    it received (``pre_sync_sum`` equal to the received ``healed_from_sum`` at the same sync), and whether the
    received state makes its pseudo-gradient a copy of that peer's (it does when both sums agree exactly)."""
    reps = run["replicas"]
    out: dict = {
        "final_val_loss": reps[0]["summary"].get("final_val_loss") if reps else None,
        "final_val_loss_per_replica": [rep["summary"].get("final_val_loss") for rep in reps],
        "commits_per_replica": [sum(1 for x in rep["steps"] if x.get("committed")) for rep in reps],
        "failed_syncs_per_replica": [sum(1 for x in rep["steps"] if x.get("committed") is False) for rep in reps],
    }
    syncs = [(r, x) for r, rep in enumerate(reps) for x in rep["steps"] if "participants" in x]
    out["participants_seen"] = sorted({x["participants"] for _, x in syncs})
    full = max(out["participants_seen"], default=0)
    normal = sorted(x["sync_s"] for _, x in syncs if x["participants"] == full and "sync_s" in x)
    out["median_sync_s"] = normal[len(normal) // 2] if normal else None
    shrunk = [x for _, x in syncs if x["participants"] < full and "sync_s" in x]
    if shrunk:  # the survivors' first sync without the dead replica: its quorum waited for the lighthouse to drop it
        first = min(x["step"] for x in shrunk)
        out["first_shrunk_sync_step"] = first
        out["first_shrunk_sync_s"] = max(x["sync_s"] for x in shrunk if x["step"] == first)
        done = max(x["wall"] for x in shrunk if x["step"] == first)
        kill = next((e["wall"] for e in run["events"] if e["event"] == "kill" and "skipped" not in e), None)
        if kill is None and victim is not None and victim < len(reps):  # it died by itself: its last record
            kill = max((x["wall"] for x in reps[victim]["steps"] if x["wall"] < done), default=None)
        # the dead replica's end -> the survivors finished the sync without it (>= heartbeat timeout when it died
        # right before the quorum: the lighthouse waits until its heartbeat expires)
        out["dead_to_shrunk_sync_s"] = None if kill is None else done - kill
    if victim is None:
        return out
    heal = next((x for x in reps[victim]["steps"] if x.get("healed")), None) if victim < len(reps) else None
    if heal is None:
        out["healed"] = False
        return out
    restart = next(
        (e for e in run["events"] if e["event"] == "restart" and e.get("replica") == victim and "skipped" not in e),
        None,
    )
    if restart is not None:
        fresh = [x for x in reps[victim]["steps"] if restart["wall"] < x["wall"] < heal["wall"]]
        out["rejoin_heal_s"] = heal["wall"] - restart["wall"]  # restart -> the sync it healed in (finished)
        # inner steps trained from its fresh init and then replaced by the heal (the heal step's own one too)
        out["victim_steps_discarded"] = len(fresh) + 1
    same_sync = [(r, x) for r, x in syncs if r != victim and x["step"] == heal["step"]]
    src = [r for r, x in same_sync if x.get("pre_sync_sum") == heal["healed_from_sum"]]
    out.update(
        healed=True,
        heal_step=heal["step"],
        heal_participants=heal["participants"],
        heal_peer_participants=sorted({x["participants"] for _, x in same_sync}),
        heal_source_replica=src[0] if src else None,
        heal_counts_copy=bool(src) and heal["participants"] == len(same_sync) + 1,
    )
    return out


def summarize(run: dict, tokens_per_step: int, victim: int | None) -> dict:
    """The elastic bench's numbers (``dilocox.bench.elastic.analyze``, same definitions) + ``torchft_facts``."""
    return {**analyze(run, tokens_per_step, -1 if victim is None else victim), **torchft_facts(run, victim)}


# --------------------------------------------------------------------------- the run


def reference_config(path: str, sync_every: int) -> str:
    """The run's config file: tiny GPT-2 + the DiLoCo preset (configs/methods/diloco.yaml), H = ``sync_every``."""
    return write_config(path, ["tiny.yaml", "methods/diloco.yaml"], f"outer: {{sync_every: {sync_every}}}\n")


def _scenario(replicas: int, steps: int, sync_every: int, kill: str | None, restart: str | None, die_at: str | None):
    """The checked scenario: ``ElasticLaunch``'s kill/restart schedule, the victim (None: no one dies) and the
    replica that SIGKILLs itself with its step (``-1, 0``: none). ValueError for a bad one."""
    from dilocox.elastic.launch import parse_schedule

    if replicas < 1 or steps < 1 or sync_every < 1 or steps % sync_every:
        raise ValueError(f"steps={steps} must be a positive multiple of sync_every={sync_every} (replicas={replicas})")
    schedule = parse_schedule([kill] if kill else [], [restart] if restart else [], replicas)
    victim = schedule[0].replica if schedule else None
    die_r, die_step = -1, 0
    if die_at:
        rr, _, ss = die_at.partition("@")
        if not (rr.isdigit() and ss.isdigit() and int(rr) < replicas and int(ss) % sync_every == 0 and int(ss) > 0):
            raise ValueError(f"die_at={die_at!r} must be R@STEP, R < {replicas}, STEP a multiple of {sync_every}")
        die_r, die_step = int(rr), int(ss)
        victim = die_r if victim is None else victim
    return schedule, victim, die_r, die_step


def _reference_setup(out_dir: str, steps: int, sync_every: int, cfg_overrides: list[str]):
    """A fresh ``out_dir`` with the run's config file; returns its path, the workers' overrides and the loaded
    config (checked: plain DiLoCo), with the data prepared once."""
    import shutil

    from dilocox.config import load_config
    from dilocox.data import prepare

    shutil.rmtree(out_dir, ignore_errors=True)  # a bench run starts fresh
    os.makedirs(out_dir)
    config = reference_config(os.path.join(out_dir, "ref.yaml"), sync_every)
    overrides = [*TRAIN_DEFAULTS, f"--train.steps={steps}", f"--train.eval_every={2 * sync_every}", *cfg_overrides]
    cfg = load_config(config, overrides)  # a bad override is one line here, not N tracebacks later
    if cfg.outer.method != "diloco" or cfg.outer.streaming.fragments != 1:
        raise ValueError("the torchft reference runs plain DiLoCo (outer.method=diloco, outer.streaming.fragments=1)")
    prepare(cfg.data)  # once, before N processes would race to build it
    return config, overrides, cfg


def _worker_argv(
    config: str,
    r: int,
    addr: str,
    replicas: int,
    out_dir: str,
    min_replicas: int,
    join_timeout_ms: int,
    die_step: int,
    overrides: list[str],
) -> list[str]:
    """The command line of replica ``r``'s worker (``die_step``: that replica's ``--die-at-step``)."""
    return [
        sys.executable,
        HERE,
        "worker",
        config,
        f"--replica={r}",
        f"--replicas={replicas}",
        f"--lighthouse={addr}",
        f"--run-dir={os.path.join(out_dir, f'replica{r}')}",
        f"--min-replicas={min_replicas}",
        f"--quorum-timeout-s={max(60.0, 3 * join_timeout_ms / 1000)}",
        f"--die-at-step={die_step}",
        *overrides,
    ]


def run_reference(
    cfg_overrides: list[str],
    replicas: int,
    steps: int,
    kill: str | None,
    restart: str | None,
    out_dir: str,
    *,
    sync_every: int = 10,
    min_replicas: int | None = None,
    heartbeat_timeout_ms: int = 2000,
    join_timeout_ms: int = 60000,
    timeout_s: float = 1800.0,
    die_at: str | None = None,
    log=None,
) -> dict:
    """Run the scenario with torchft's DiLoCo into ``out_dir`` (``replica<r>/metrics.jsonl``, ``events.jsonl``,
    ``replica<r>.log``, ``ref.yaml``); returns ``dilocox.bench.elastic.analyze``'s fields (kill -> survivors' next
    outer step, tokens/s before / during / after the outage, rejoin times) + ``torchft_facts`` + the settings.
    ``kill``/``restart``: ``"R@SECONDS"`` (seconds after the replicas were started) or None. Every process runs
    under ``timeout_s`` and is SIGKILLed at the end whatever happens (``ElasticLaunch``). ``die_at``:
    ``"R@STEP"``: replica R SIGKILLs itself right before its sync after inner step STEP (a multiple of H), so the
    survivors' quorum of that sync waits for the lighthouse to drop it (the detection time, ``torchft_facts``).
    """
    from dilocox.elastic.launch import ElasticLaunch

    schedule, victim, die_r, die_step = _scenario(replicas, steps, sync_every, kill, restart, die_at)
    min_replicas = max(1, replicas - 1) if min_replicas is None else min_replicas
    config, overrides, cfg = _reference_setup(out_dir, steps, sync_every, cfg_overrides)

    def argv(r: int, addr: str) -> list[str]:
        die = die_step if r == die_r else 0
        return _worker_argv(config, r, addr, replicas, out_dir, min_replicas, join_timeout_ms, die, overrides)

    launch = ElasticLaunch(
        replicas,
        argv,
        out_dir,
        min_replicas=min_replicas,
        schedule=schedule,
        env=child_env(),
        lighthouse_opts=[
            *("--heartbeat-timeout-ms", str(heartbeat_timeout_ms)),
            *("--join-timeout-ms", str(join_timeout_ms)),
        ],
        timeout_s=timeout_s,
        stop_timeout_s=10.0,
        log=log,
    )
    rc = launch.run()
    run = read_elastic_run(out_dir, replicas)
    tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
    res = {
        "method": "torchft.local_sgd.DiLoCo (torchft 0.2.0)",
        "exit_code": rc,
        "replicas": replicas,
        "steps": steps,
        "sync_every": sync_every,
        "kill": kill,
        "restart": restart,
        "heartbeat_timeout_ms": heartbeat_timeout_ms,
        "join_timeout_ms": join_timeout_ms,
        **summarize(run, tokens_per_step, victim),
    }
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    bad = [e for e in run["events"] if e["event"] == "exit" and e.get("code") and e.get("replica") != die_r]
    if rc != 0 and (bad or die_r < 0):  # the self-killed replica's exit (-9) is the scenario, not a failure
        raise RuntimeError(f"torchft reference run failed with exit code {rc}; logs: {out_dir}/replica*.log")
    return res


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        return worker_main(argv[1:])
    p = argparse.ArgumentParser(prog="python3 benchmarks/torchft_ref.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--steps", type=int, default=60, help="inner steps per replica (a multiple of --sync-every)")
    p.add_argument("--sync-every", type=int, default=10, help="H: inner steps per outer step")
    p.add_argument("--kill", default=None, help="R@SECONDS: SIGKILL replica R then")
    p.add_argument("--restart", default=None, help="R@SECONDS: start replica R again then")
    p.add_argument("--die-at", default=None, help="R@STEP: replica R SIGKILLs itself right before its sync at STEP")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=2000)
    p.add_argument("--join-timeout-ms", type=int, default=60000)
    p.add_argument("--timeout", type=float, default=1800.0, help="bound on the whole run (seconds)")
    p.add_argument("--out", required=True, help="run dir: replica<r>/metrics.jsonl, events.jsonl, results.json")
    a, overrides = p.parse_known_args(argv)
    from dilocox.elastic.launch import LaunchError  # lazy like the rest of the launch machinery

    bad = [o for o in overrides if not o.startswith("--")]
    if bad:
        p.error(f"unexpected arguments {bad}; config overrides look like --train.batch_size=4")
    try:
        res = run_reference(
            overrides,
            a.replicas,
            a.steps,
            a.kill,
            a.restart,
            a.out,
            sync_every=a.sync_every,
            heartbeat_timeout_ms=a.heartbeat_timeout_ms,
            join_timeout_ms=a.join_timeout_ms,
            timeout_s=a.timeout,
            die_at=a.die_at,
        )
    except (ValueError, RuntimeError, LaunchError) as e:
        print(f"torchft_ref: {e}", file=sys.stderr)
        return 1
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
