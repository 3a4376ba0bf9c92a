"""Toy elastic "training" on loopback: the lighthouse, replica processes and the measurement driver.

Used by tests/test_elastic.py, tests/test_elastic_lighthouse.py and tests/test_launch_elastic.py, and to measure
torchft here (docs/ELASTIC.md); run from the repository root (a harness, not part of the dilocox package):

    python3 -m tools.elastic_toy measure            # 3 replicas, kill -9 one, prints the numbers as JSON
    python3 -m tools.elastic_toy lighthouse --min-replicas 2
    python3 -m tools.elastic_toy replica --lighthouse http://HOST:PORT --rank 0 --steps 5 --out r0.jsonl

Replica ``r`` contributes, at outer step ``s``, the vector ``v_r,s = (r + 1) * 1000 + s + arange(size)`` (exact
in float32, and so are sums of a few of them) and applies ``theta <- theta - mean``. With ``--die-at-step k``
the replica SIGKILLs itself in the middle of its phase before step ``k``'s all-reduce. Each committed step is one
JSON line (flushed) in ``--out``: the contributors, the mean's and theta's SHA-256, the quorum and all-reduce time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch

from dilocox.distributed.procs import kill_and_reap, kill_group, spawn
from dilocox.elastic import failover as failover_mod
from dilocox.elastic.failover import DEFAULT_ATTEMPT_S
from dilocox.elastic.group import (
    ElasticConfig,
    ElasticError,
    ElasticMinReplicasError,
    ElasticOuterGroup,
)
from dilocox.elastic.lighthouse import start_lighthouse
from tools import child_env


class PlainOuterGroup(ElasticOuterGroup):
    """torchft's own quorum call, without dilocox/elastic/failover.py: the baseline of ``--no-failover``."""

    def _quorum(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ElasticMinReplicasError(self._below_msg(None))
        t0 = time.monotonic()
        try:
            self._manager.start_quorum(allow_heal=False, timeout=timedelta(seconds=left))
        except Exception as e:  # the Rust client raises a plain RuntimeError on timeout
            raise ElasticMinReplicasError(self._below_msg(None) + f" (torchft: {str(e).splitlines()[0]})") from e
        return time.monotonic() - t0


def contribution(rank: int, step: int, size: int) -> torch.Tensor:
    """The vector replica ``rank`` contributes at outer step ``step``."""
    return torch.arange(size, dtype=torch.float32) + float((rank + 1) * 1000 + step)


def oracle(schedule: list[list[int]], size: int) -> list[tuple[str, str]]:
    """(mean sha, theta sha) per step for a membership schedule (contributors of each step)."""
    theta = torch.zeros(size, dtype=torch.float32)
    out = []
    for step, live in enumerate(schedule):
        total = torch.zeros(size, dtype=torch.float32)
        for r in sorted(live):
            total += contribution(r, step, size)
        mean = total / len(live)
        theta -= mean
        out.append((sha(mean), sha(theta)))
    return out


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def run_replica(a: argparse.Namespace) -> int:
    cfg = ElasticConfig(
        lighthouse_addr=a.lighthouse,
        replica_rank=a.rank,
        min_replicas=a.min_replicas,
        initial_replicas=a.initial_replicas,
        max_replicas=a.max_replicas,
        timeout_s=a.timeout,
        quorum_timeout_s=a.quorum_timeout,
    )
    out = open(a.out, "a", buffering=1)

    def emit(rec: dict) -> None:
        out.write(json.dumps(rec) + "\n")
        out.flush()

    t0 = time.time()
    group = PlainOuterGroup(cfg) if a.no_failover else ElasticOuterGroup(cfg)
    if not a.no_failover:
        group.failover.attempt_s = a.attempt_s
        group.failover.keep_last_quorum = group.failover.keep_last_quorum and not a.no_keep
    emit({"event": "started", "t": time.time(), "init_s": time.time() - t0})
    theta = torch.zeros(a.size, dtype=torch.float32)
    code = 0
    cur = {"step": -1}

    def die_in_flight(n_live: int) -> None:  # after the quorum, before this replica's all-reduce
        if cur["step"] == a.die_at_step:
            emit({"event": "kill", "step": cur["step"], "t": time.time(), "mode": "inflight", "n_live": n_live})
            os.kill(os.getpid(), signal.SIGKILL)

    if a.die_mode == "inflight":
        group.on_quorum = die_in_flight
    try:
        for step in range(a.steps):
            cur["step"] = step
            if a.die_at_step == step and a.die_mode == "phase":
                time.sleep(a.phase_s / 2)
                emit({"event": "kill", "step": step, "t": time.time()})
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(a.phase_s)  # the inner phase
            delta = contribution(a.rank, step, a.size)
            t_call = time.time()
            try:
                res = group.allreduce_mean(delta)
            except ElasticError as e:
                emit(
                    {
                        "event": "error",
                        "step": step,
                        "t": time.time(),
                        "wait_s": time.time() - t_call,
                        "type": type(e).__name__,
                        "msg": str(e),
                    }
                )
                print(f"elastic error: {e}", file=sys.stderr, flush=True)
                code = 3
                break
            theta -= res.mean
            emit(
                {
                    "event": "step",
                    "step": step,
                    "t": time.time(),
                    "call_s": time.time() - t_call,
                    "contributors": res.contributors,
                    "attempts": res.attempts,
                    "quorum_id": res.quorum_id,
                    "quorum_s": res.quorum_s,
                    "allreduce_s": res.allreduce_s,
                    "mean": sha(res.mean),
                    "theta": sha(theta),
                    "committed_step": res.step,
                    "kept_total": 0 if a.no_failover else group.failover.kept_steps,
                }
            )
    finally:
        group.close()
        out.close()
    os._exit(code)  # torchft's background threads must not keep the process alive


def run_lighthouse(a: argparse.Namespace) -> int:
    t0 = time.monotonic()
    lh = start_lighthouse(
        a.min_replicas, bind=a.bind, heartbeat_timeout_ms=a.heartbeat_timeout_ms, join_timeout_ms=a.join_timeout_ms
    )
    print(json.dumps({"address": lh.address(), "start_s": time.monotonic() - t0}), flush=True)
    try:
        deadline = time.monotonic() + a.lifetime
        while time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        lh.shutdown()
    return 0


def replica_cmd(
    addr: str,
    rank: int,
    out: str,
    steps: int,
    size: int,
    min_replicas: int,
    timeout: float,
    quorum_timeout: float,
    phase_s: float,
    die_at_step: int | None = None,
    die_mode: str = "phase",
    initial_replicas: int | None = None,
    failover: bool = True,
    attempt_s: float = DEFAULT_ATTEMPT_S,
    keep_last_quorum: bool = True,
) -> list[str]:
    """The command of one toy replica (``python -m tools.elastic_toy replica ...``). Run it with ``env=child_env()``
    (or the repository root on ``PYTHONPATH`` otherwise): then it finds ``tools`` from any working directory."""
    cmd = [
        sys.executable,
        "-m",
        "tools.elastic_toy",
        "replica",
        "--lighthouse",
        addr,
        "--rank",
        str(rank),
        "--out",
        out,
        "--steps",
        str(steps),
        "--size",
        str(size),
        "--min-replicas",
        str(min_replicas),
        "--timeout",
        str(timeout),
        "--quorum-timeout",
        str(quorum_timeout),
        "--phase-s",
        str(phase_s),
    ]
    if die_at_step is not None:
        cmd += ["--die-at-step", str(die_at_step), "--die-mode", die_mode]
    if initial_replicas is not None:
        cmd += ["--initial-replicas", str(initial_replicas)]
    if not failover:
        cmd += ["--no-failover"]
    cmd += ["--attempt-s", str(attempt_s)] + ([] if keep_last_quorum else ["--no-keep"])
    return cmd


def read_records(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_measure(a: argparse.Namespace) -> int:
    """3 replicas + lighthouse on loopback; replica 2 is killed with SIGKILL before step ``kill_step``."""
    import tempfile

    t0 = time.monotonic()
    lh = start_lighthouse(2, heartbeat_timeout_ms=a.heartbeat_timeout_ms, join_timeout_ms=a.join_timeout_ms)
    lh_start_s = time.monotonic() - t0
    tmp = tempfile.mkdtemp(prefix="elastic_measure_")
    procs = []
    try:
        for r in range(3):
            procs.append(
                spawn(
                    replica_cmd(
                        lh.address(),
                        r,
                        f"{tmp}/r{r}.jsonl",
                        a.steps,
                        a.size,
                        2,
                        a.timeout,
                        a.quorum_timeout,
                        a.phase_s,
                        a.kill_step if r == 2 else None,
                        a.die_mode,
                        initial_replicas=3,
                    ),
                    env=child_env(),
                )
            )
        for p in procs:
            p.wait(timeout=a.steps * (a.phase_s + a.timeout) + a.quorum_timeout + 60)
    finally:
        for p in procs:
            kill_and_reap(p)
        lh.shutdown()
    recs = [read_records(f"{tmp}/r{r}.jsonl") for r in range(3)]
    steps0 = [x for x in recs[0] if x["event"] == "step"]
    t_kill = next(x["t"] for x in recs[2] if x["event"] == "kill")
    after = next(x for x in steps0 if x["step"] == a.kill_step)
    steady = [x for x in steps0 if 0 < x["step"] < a.kill_step or x["step"] > a.kill_step]
    res = {
        "lighthouse_start_s": lh_start_s,
        "first_quorum_3_replicas_s": steps0[0]["quorum_s"],
        "steady_quorum_s_median": sorted(x["quorum_s"] for x in steady)[len(steady) // 2],
        "allreduce_MB": a.size * 4 / 1e6,
        "allreduce_3_replicas_s_median": sorted(x["allreduce_s"] for x in steps0 if 0 < x["step"] < a.kill_step)[
            (a.kill_step - 1) // 2
        ],
        "allreduce_2_replicas_after_reconfigure_s": [x["allreduce_s"] for x in steps0 if x["step"] >= a.kill_step],
        "kill_to_survivor_step_done_s": after["t"] - t_kill,
        "quorum_after_kill_s": after["quorum_s"],
        "attempts_at_kill_step": after["attempts"],
        "contributors_per_step": [x["contributors"] for x in steps0],
        "survivors_bit_identical": [x["theta"] for x in steps0]
        == [x["theta"] for x in recs[1] if x["event"] == "step"],
        "exit_codes": [p.returncode for p in procs],
    }
    print(json.dumps(res, indent=1))
    return 0


def _read_json_line(proc: subprocess.Popen, timeout_s: float) -> dict:
    """The first stdout line of ``proc`` as JSON, waiting at most ``timeout_s``."""
    import threading

    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout_s)
    if not box or not box[0].strip():
        raise RuntimeError(f"the lighthouse process printed no address within {timeout_s}s")
    return json.loads(box[0])


def lighthouse_scenario(
    tmp: str,
    replicas: int = 2,
    steps: int = 8,
    kill_step: int = 3,
    restart_after: float | None = None,
    failover: bool = True,
    attempt_s: float = DEFAULT_ATTEMPT_S,
    keep_last_quorum: bool = True,
    replica_die_step: int | None = None,
    timeout: float = 5.0,
    quorum_timeout: float = 15.0,
    phase_s: float = 0.5,
    heartbeat_timeout_ms: int = 2000,
    size: int = 1000,
) -> dict:
    """Replicas on loopback with the lighthouse in its own process, SIGKILLed once replica 0 committed step
    ``kill_step`` and (``restart_after`` seconds later) restarted on the same port. With ``replica_die_step``
    the last replica SIGKILLs itself mid-phase before that step (a membership change before the lighthouse
    dies). Every process has a time bound; returns the times (epoch seconds) and each replica's records."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the torch-free lighthouse (failover.py run as a script) listens within ~0.1 s of its (re)start
    lh_cmd = [sys.executable, failover_mod.__file__, "lighthouse", "--min-replicas", "2"]
    lh_cmd += ["--bind", f"[::]:{port}", "--lifetime", "300", "--heartbeat-timeout-ms", str(heartbeat_timeout_ms)]
    procs: list[subprocess.Popen] = []
    lhs = [spawn(lh_cmd, stdout=subprocess.PIPE, text=True)]
    res: dict = {"replicas": replicas, "kill_step": kill_step, "restart_after": restart_after, "failover": failover}
    res["keep_last_quorum"] = failover and keep_last_quorum
    res["size"] = size
    bound = steps * (phase_s + 2 * timeout) + 3 * quorum_timeout + 60
    try:
        addr = _read_json_line(lhs[0], 60)["address"]
        for r in range(replicas):
            cmd = replica_cmd(
                addr,
                r,
                f"{tmp}/r{r}.jsonl",
                steps,
                size,
                2,
                timeout,
                quorum_timeout,
                phase_s,
                replica_die_step if r == replicas - 1 else None,
                initial_replicas=replicas,
                failover=failover,
                attempt_s=attempt_s,
                keep_last_quorum=keep_last_quorum,
            )
            procs.append(spawn(cmd, env=child_env()))
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            if any(x.get("step") == kill_step for x in read_records(f"{tmp}/r0.jsonl")):
                break
            if procs[0].poll() is not None:
                raise RuntimeError(f"replica 0 exited ({procs[0].returncode}) before step {kill_step}")
            time.sleep(0.02)
        kill_group(lhs[0])
        res["t_lighthouse_kill"] = time.time()
        lhs[0].wait(timeout=10)
        if restart_after is not None:
            time.sleep(restart_after)
            lhs.append(spawn(lh_cmd, stdout=subprocess.PIPE, text=True))
            res["t_lighthouse_restart"] = time.time()
            _read_json_line(lhs[1], 60)
            res["t_lighthouse_listening"] = time.time()
        end = time.monotonic() + bound
        for p in procs:
            p.wait(timeout=max(1.0, end - time.monotonic()))
    finally:
        for p in procs + lhs:
            kill_and_reap(p)
    res["exit_codes"] = [p.returncode for p in procs]
    res["records"] = [read_records(f"{tmp}/r{r}.jsonl") for r in range(replicas)]
    return res


def summarize_lighthouse(res: dict) -> dict:
    """The numbers of a ``lighthouse_scenario`` run (times relative to the lighthouse kill / restart)."""
    t_kill = res["t_lighthouse_kill"]
    keys = ("replicas", "kill_step", "restart_after", "failover", "keep_last_quorum", "exit_codes")
    out: dict = {k: res[k] for k in keys}
    if "t_lighthouse_restart" in res:
        out["restart_to_listening_s"] = round(res["t_lighthouse_listening"] - res["t_lighthouse_restart"], 3)
    for r, recs in enumerate(res["records"]):
        after = [x for x in recs if x["event"] in ("step", "error") and x["step"] > res["kill_step"]]
        rel = []
        for x in after:
            y = {k: x[k] for k in ("event", "step", "contributors", "attempts", "kept_total", "type") if k in x}
            y["t_after_kill"] = round(x["t"] - t_kill, 2)
            if "t_lighthouse_restart" in res:
                y["t_after_restart"] = round(x["t"] - res["t_lighthouse_restart"], 2)
                y["t_after_listening"] = round(x["t"] - res["t_lighthouse_listening"], 2)
            if x["event"] == "error":
                y["wait_s"] = round(x["wait_s"], 2)
                y["msg"] = x["msg"][:400]
            rel.append(y)
        out[f"replica{r}"] = rel
    steps = [[x for x in recs if x["event"] == "step"] for recs in res["records"]]
    schedule = [x["contributors"] for x in steps[0]]
    want = oracle(schedule, res.get("size", 1000)) if schedule else []
    # every replica's steps: the oracle mean and theta of replica 0's membership schedule, bit for bit
    out["oracle_ok"] = [
        [(x["mean"], x["theta"]) for x in st] == want[: len(st)]
        and [y["contributors"] for y in st] == schedule[: len(st)]
        for st in steps
    ]
    return out


def run_measure_lighthouse(a: argparse.Namespace) -> int:
    """The lighthouse killed (and, with ``--restart-after S``, restarted on the same port) mid-run."""
    import tempfile

    res = lighthouse_scenario(
        tempfile.mkdtemp(prefix="elastic_lh_"),
        replicas=a.replicas,
        steps=a.steps,
        kill_step=a.kill_step,
        restart_after=a.restart_after,
        failover=not a.no_failover,
        attempt_s=a.attempt_s,
        keep_last_quorum=not a.no_keep,
        replica_die_step=a.replica_die_step,
        timeout=a.timeout,
        quorum_timeout=a.quorum_timeout,
        phase_s=a.phase_s,
        heartbeat_timeout_ms=a.heartbeat_timeout_ms,
    )
    print(json.dumps(summarize_lighthouse(res), indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tools.elastic_toy", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("replica")
    r.add_argument("--lighthouse", required=True)
    r.add_argument("--rank", type=int, required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--steps", type=int, default=5)
    r.add_argument("--size", type=int, default=1000)
    r.add_argument("--min-replicas", type=int, default=1)
    r.add_argument("--max-replicas", type=int, default=8)
    r.add_argument("--timeout", type=float, default=10.0)
    r.add_argument("--quorum-timeout", type=float, default=20.0)
    r.add_argument("--phase-s", type=float, default=0.2)
    r.add_argument("--die-at-step", type=int, default=None)
    r.add_argument(
        "--die-mode",
        choices=("phase", "inflight"),
        default="phase",
        help="phase: SIGKILL mid-phase; inflight: SIGKILL after the quorum, while the peers all-reduce",
    )
    r.add_argument("--initial-replicas", type=int, default=None)
    r.add_argument("--no-failover", action="store_true", help="torchft's own quorum call (no elastic/failover.py)")
    r.add_argument("--attempt-s", type=float, default=DEFAULT_ATTEMPT_S, help="seconds of the first quorum request")
    r.add_argument("--no-keep", action="store_true", help="wait for a lost lighthouse, do not keep the last quorum")
    lh = sub.add_parser("lighthouse")
    lh.add_argument("--min-replicas", type=int, default=1)
    lh.add_argument("--heartbeat-timeout-ms", type=int, default=2000)
    lh.add_argument("--join-timeout-ms", type=int, default=60000)
    lh.add_argument("--bind", default="[::]:0")
    lh.add_argument("--lifetime", type=float, default=600.0, help="seconds before it shuts itself down")
    m = sub.add_parser("measure")
    m.add_argument("--steps", type=int, default=8)
    m.add_argument("--kill-step", type=int, default=4)
    m.add_argument("--size", type=int, default=1 << 20, help="float32 elements all-reduced per step (1M = 4 MB)")
    m.add_argument("--timeout", type=float, default=10.0)
    m.add_argument("--quorum-timeout", type=float, default=20.0)
    m.add_argument("--phase-s", type=float, default=0.5)
    m.add_argument("--heartbeat-timeout-ms", type=int, default=2000)
    m.add_argument("--join-timeout-ms", type=int, default=60000)
    m.add_argument("--die-mode", choices=("phase", "inflight"), default="phase")
    ml = sub.add_parser("measure-lighthouse")
    ml.add_argument("--steps", type=int, default=8)
    ml.add_argument("--kill-step", type=int, default=3)
    ml.add_argument("--restart-after", type=float, default=None)
    ml.add_argument("--timeout", type=float, default=5.0)
    ml.add_argument("--quorum-timeout", type=float, default=15.0)
    ml.add_argument("--phase-s", type=float, default=0.5)
    ml.add_argument("--no-failover", action="store_true", help="torchft's own quorum call (the baseline)")
    ml.add_argument("--attempt-s", type=float, default=DEFAULT_ATTEMPT_S)
    ml.add_argument("--no-keep", action="store_true", help="wait for the lighthouse, do not keep the quorum")
    ml.add_argument("--heartbeat-timeout-ms", type=int, default=2000)
    ml.add_argument("--replicas", type=int, default=2)
    ml.add_argument(
        "--replica-die-step", type=int, default=None, help="the last replica SIGKILLs itself before this step"
    )
    a = ap.parse_args(argv)
    return {
        "replica": run_replica,
        "lighthouse": run_lighthouse,
        "measure": run_measure,
        "measure-lighthouse": run_measure_lighthouse,
    }[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
