"""Elastic launch (issue 10 §4): the torchft lighthouse plus one job per replica, on a kill/restart schedule.

    dilocox lighthouse --min-replicas M [--bind HOST:PORT] [--heartbeat-timeout-ms MS] [--join-timeout-ms MS]
    dilocox launch --elastic N CONFIG [--section.key=value ...] [--min-replicas M] [--kill R@SECONDS ...]
                   [--restart R@SECONDS ...] [--at time|step] [--netns | --no-netns] [--bandwidth 100mbit]
                   [--timeout SECONDS]

Replica r is ONE job: ``dilocox train CONFIG --nproc K --parallel.replicas=1 --outer.elastic.enabled=true
--outer.elastic.lighthouse=ADDR --outer.elastic.replica_rank=r --log.run_dir=RUN/replica{r}`` (K = data x
pipeline x tensor of the config; its torchrun has its own rendezvous), started in its own session and tagged
with its own ``DILOCOX_RUN_TAG``. With ``--at step``, R@X means "when a replica has logged training step X"
(``step_clock``). "kill" SIGKILLs the replica's whole process group and every process carrying
its tag (torchrun's workers live in their own session); "restart" starts the same command again. RUN is the
config's ``log.run_dir``; ``RUN/events.jsonl`` gets one line per event (``start``, ``kill``, ``restart``,
``exit``, ``lighthouse``, ``stop``) with the wall time (epoch seconds) and the seconds since the launch.

With ``--netns`` (default when root can create network namespaces) each replica runs in its own namespace
(``dilocox.launch.netns.Cluster``) behind a ``tc tbf`` cap of ``--bandwidth`` each way, and the lighthouse runs
in the switch namespace at ``HUB_ADDR`` (reachable from every replica; its heartbeats cross the capped links).
The replicas get ``GLOO_SOCKET_IFNAME`` and ``DILOCOX_ELASTIC_HOST`` (the namespace's address, for the torchft
manager to advertise). Without namespaces everything runs on loopback and a ``--bandwidth`` cap is exported as
``DILOCOX_EMULATED_BANDWIDTH_BPS`` (bits/s per rank = cap / K) for the outer comm layer's token bucket.

Every wait is bounded: the lighthouse must print its address within ``LIGHTHOUSE_START_S``; the whole run
within ``--timeout``; on SIGINT/SIGTERM (or the timeout) the replicas get SIGTERM (they save and exit), then
``--stop-timeout`` seconds, then SIGKILL; the lighthouse is stopped last. Nothing is left behind.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

from dilocox.distributed.signals import RUN_TAG_ENV, kill_tagged, tagged_pids
from dilocox.launch.netns import HUB_ADDR, Cluster, kill_group, netns_available

LIGHTHOUSE_PORT = 29510  # inside the switch namespace (fresh, so a fixed port is free)
LIGHTHOUSE_START_S = 60.0  # the lighthouse prints its address within this (torchft import included)
BANDWIDTH_ENV = "DILOCOX_EMULATED_BANDWIDTH_BPS"  # same name as dilocox.launch.emulate.BANDWIDTH_ENV
HOST_ENV = "DILOCOX_ELASTIC_HOST"  # the address a replica's torchft manager advertises (netns: its namespace's)
_ADDR_RE = re.compile(r"https?://\S+")


class LaunchError(Exception):
    """Bad elastic-launch input or a start-up failure: printed as one line."""


# --------------------------------------------------------------------------- the lighthouse


def lighthouse_main(argv: Sequence[str] | None = None) -> int:
    """``dilocox lighthouse``: a torchft lighthouse in the foreground until SIGINT/SIGTERM (exit 0).

    The first line of stdout is ``dilocox lighthouse: http://HOST:PORT ...``: the address to give the replicas
    as ``--outer.elastic.lighthouse`` (HOST is the bind host, or this machine's name when bound to all)."""
    p = argparse.ArgumentParser(prog="dilocox lighthouse", description=lighthouse_main.__doc__)
    p.add_argument("--min-replicas", type=int, required=True, help="fewest replicas a quorum may have")
    p.add_argument("--bind", default="0.0.0.0:0", help="HOST:PORT to listen on (port 0: any free port)")
    p.add_argument(
        "--heartbeat-timeout-ms", type=int, default=2000, help="a replica silent this long is dropped (detection)"
    )
    p.add_argument(
        "--join-timeout-ms",
        type=int,
        default=60000,
        help="how long a quorum waits for live stragglers; keep it above the replicas' phase-time skew",
    )
    a = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if a.min_replicas < 1:
        p.error(f"--min-replicas {a.min_replicas} must be >= 1")
    for name in ("heartbeat_timeout_ms", "join_timeout_ms"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)} must be >= 1 (milliseconds)")
    host, sep, port = a.bind.rpartition(":")
    if not sep or not host or not port.isdigit():
        p.error(f"--bind {a.bind!r} is not HOST:PORT (e.g. 0.0.0.0:29510, [::]:0)")
    stop = threading.Event()
    got: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        got.append(signum)
        stop.set()

    prev = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        from dilocox.elastic import start_lighthouse

        try:
            lh = start_lighthouse(
                a.min_replicas,
                bind=a.bind,
                heartbeat_timeout_ms=a.heartbeat_timeout_ms,
                join_timeout_ms=a.join_timeout_ms,
            )
        except ImportError as e:
            print(f"dilocox lighthouse: needs torchft: pip install torchft==0.2.0 ({e})", file=sys.stderr)
            return 2
        except Exception as e:  # noqa: BLE001 - e.g. the port is taken: one line naming the bind address
            print(f"dilocox lighthouse: cannot listen on {a.bind}: {e}", file=sys.stderr)
            return 1
        real_port = lh.address().rsplit(":", 1)[1]
        shown = lh.address() if host in ("0.0.0.0", "[::]", "::") else f"http://{host}:{real_port}"
        print(
            f"dilocox lighthouse: {shown} (min_replicas={a.min_replicas}, heartbeat_timeout_ms="
            f"{a.heartbeat_timeout_ms}, join_timeout_ms={a.join_timeout_ms}); stop with Ctrl-C or SIGTERM",
            flush=True,
        )
        try:
            while not stop.wait(0.5):
                pass
        finally:
            lh.shutdown()
        name = signal.Signals(got[0]).name if got else "?"
        print(f"dilocox lighthouse: stopped ({name})", file=sys.stderr, flush=True)
        return 0
    finally:
        for sig, h in prev.items():
            signal.signal(sig, h)


# --------------------------------------------------------------------------- the schedule


@dataclass(frozen=True)
class Action:
    """``kill`` or ``restart`` replica ``replica`` at ``at_s`` seconds after the replicas were started."""

    kind: str
    replica: int
    at_s: float


def parse_schedule(kills: Sequence[str], restarts: Sequence[str], n: int) -> list[Action]:
    """``R@SECONDS`` specs -> actions sorted by time. A restart needs an earlier kill of the same replica;
    a replica is not killed twice without a restart in between."""
    acts = []
    for kind, specs in (("kill", kills), ("restart", restarts)):
        for spec in specs:
            r, sep, t = str(spec).partition("@")
            try:
                if not sep:
                    raise ValueError
                rr, tt = int(r), float(t)
            except ValueError:
                raise LaunchError(f"--{kind} {spec!r} is not R@SECONDS (e.g. --{kind} 2@40)") from None
            if not 0 <= rr < n:
                raise LaunchError(f"--{kind} {spec!r}: replica {rr} is not in [0, {n}) (--elastic {n})")
            if not (tt >= 0 and tt < float("inf")):
                raise LaunchError(f"--{kind} {spec!r}: the time must be a finite number of seconds >= 0")
            acts.append(Action(kind, rr, tt))
    acts.sort(key=lambda a: (a.at_s, a.kind != "kill"))
    alive = [True] * n
    for a in acts:
        if a.kind == "kill" and not alive[a.replica]:
            raise LaunchError(f"--kill {a.replica}@{a.at_s:g}: replica {a.replica} is already killed then")
        if a.kind == "restart" and alive[a.replica]:
            raise LaunchError(
                f"--restart {a.replica}@{a.at_s:g}: replica {a.replica} is running then; restart needs an earlier "
                f"--kill {a.replica}@SECONDS"
            )
        alive[a.replica] = a.kind == "restart"
    return acts


# --------------------------------------------------------------------------- the launcher


class _Replica:
    def __init__(self, r: int) -> None:
        self.r = r
        self.proc: subprocess.Popen | None = None
        self.tag = ""
        self.incarnation = -1
        self.killed = False  # by the schedule; its exit is not a failure
        self.code: int | None = None  # exit code of the current incarnation once it exited
        self.log = None


class ElasticLaunch:
    """Start the lighthouse and N replica jobs, run the schedule, and clean everything up (``run``).

    ``replica_argv(r, lighthouse_addr)``: the command of replica r. ``lighthouse_argv(bind)``: the
    lighthouse's command (default: ``python -m dilocox.cli lighthouse``); the launcher reads the address it
    prints. ``cluster``: a started ``Cluster(n, hub=True)`` to run in (None: this namespace, loopback).
    """

    def __init__(
        self,
        n: int,
        replica_argv: Callable[[int, str], list[str]],
        run_dir: str,
        *,
        min_replicas: int = 1,
        schedule: Sequence[Action] = (),
        env: dict | None = None,
        cluster: Cluster | None = None,
        lighthouse_argv: Callable[[str], list[str]] | None = None,
        lighthouse_opts: Sequence[str] = (),
        timeout_s: float = 3600.0,
        stop_timeout_s: float = 60.0,
        log: Callable[[str], None] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if n < 1:
            raise LaunchError(f"--elastic {n}: the number of replicas must be >= 1")
        self.n, self.replica_argv, self.run_dir = n, replica_argv, run_dir
        self.min_replicas, self.schedule = min_replicas, sorted(schedule, key=lambda a: a.at_s)
        self.env = dict(os.environ if env is None else env)
        self.cluster, self.timeout_s, self.stop_timeout_s = cluster, timeout_s, stop_timeout_s
        self.clock = clock  # what the schedule's times are read against (None: seconds since the replicas started)
        self.lighthouse_opts = list(lighthouse_opts)
        self._lh_argv = lighthouse_argv or (
            lambda bind: [
                sys.executable,
                "-m",
                "dilocox.cli",
                "lighthouse",
                "--min-replicas",
                str(min_replicas),
                "--bind",
                bind,
                *self.lighthouse_opts,
            ]
        )
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.launch_id = uuid.uuid4().hex[:12]
        self.replicas = [_Replica(r) for r in range(n)]
        self.lighthouse: subprocess.Popen | None = None
        self.lighthouse_addr = ""
        self.t0 = time.time()
        self.events_path = os.path.join(run_dir, "events.jsonl")
        self._events = None
        self._signals: list[int] = []

    # events ---------------------------------------------------------------------------
    def event(self, kind: str, **fields: object) -> dict:
        now = time.time()
        rec = {"event": kind, "wall": round(now, 3), "t": round(now - self.t0, 3), **fields}
        if self._events is not None:
            self._events.write(json.dumps(rec) + "\n")
            self._events.flush()
        return rec

    # processes ------------------------------------------------------------------------
    def _popen(self, argv: list[str], env: dict, r: int | None, **kw: object) -> subprocess.Popen:
        if self.cluster is None:
            return subprocess.Popen(argv, env=env, start_new_session=True, **kw)
        if r is None:
            return self.cluster.exec_hub(argv, env=env, **kw)
        return self.cluster.exec(r, argv, env=env, **kw)

    def _start_lighthouse(self) -> None:
        bind = f"{HUB_ADDR}:{LIGHTHOUSE_PORT}" if self.cluster is not None else "127.0.0.1:0"
        err = open(os.path.join(self.run_dir, "lighthouse.log"), "a")
        argv = self._lh_argv(bind)
        self.lighthouse = self._popen(argv, self.env, None, stdout=subprocess.PIPE, stderr=err, text=True)
        err.close()
        lines: queue.Queue = queue.Queue()

        def pump(f) -> None:  # reads stdout to its end: the address line first, later lines are dropped
            for line in f:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, args=(self.lighthouse.stdout,), daemon=True).start()
        deadline = time.monotonic() + LIGHTHOUSE_START_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self._signals:
                raise LaunchError(
                    f"the lighthouse printed no address within {LIGHTHOUSE_START_S:.0f} s (see {self.run_dir}/"
                    f"lighthouse.log)"
                    if not self._signals
                    else "interrupted while starting the lighthouse"
                )
            try:
                line = lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line is None:
                code = self.lighthouse.wait(timeout=10)
                raise LaunchError(
                    f"the lighthouse exited ({code}) before printing its address; see {self.run_dir}/lighthouse.log"
                )
            m = _ADDR_RE.search(line)
            if m:
                self.lighthouse_addr = m.group(0)
                break
        self.event("lighthouse", address=self.lighthouse_addr, pid=self.lighthouse.pid)
        self.log(f"dilocox launch: lighthouse at {self.lighthouse_addr}")

    def _start_replica(self, rep: _Replica, kind: str) -> None:
        rep.incarnation += 1
        rep.tag = f"dilocox-elastic-{self.launch_id}-r{rep.r}-{rep.incarnation}"
        env = dict(self.env, **{RUN_TAG_ENV: rep.tag})
        if self.cluster is not None:
            ifname = self.cluster.ifname(rep.r)
            env.update(GLOO_SOCKET_IFNAME=ifname, DILOCOX_EMULATION="netns", **{HOST_ENV: self.cluster.addr(rep.r)})
        log_path = os.path.join(self.run_dir, f"replica{rep.r}.log")
        if rep.log is None:
            rep.log = open(log_path, "a")
        rep.log.write(f"==== {kind} (incarnation {rep.incarnation}) at {time.time():.3f}\n")
        rep.log.flush()
        argv = self.replica_argv(rep.r, self.lighthouse_addr)
        rep.proc = self._popen(argv, env, rep.r, stdout=rep.log, stderr=subprocess.STDOUT)
        rep.killed, rep.code = False, None
        self.event(kind, replica=rep.r, pid=rep.proc.pid, incarnation=rep.incarnation)

    def _kill_replica(self, rep: _Replica, sig: int = signal.SIGKILL) -> list[int]:
        """``sig`` to the replica's process group and to every process with its tag (other sessions too)."""
        if rep.proc is None:
            return []
        kill_group(rep.proc.pid, sig)
        return kill_tagged(rep.tag, sig) if rep.tag else []

    def _reap_replica(self, rep: _Replica, timeout_s: float = 10.0) -> None:
        """Wait (bounded) until the replica's process and everything with its tag is gone (after a SIGKILL)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if rep.proc is not None and rep.proc.poll() is None:
                time.sleep(0.05)
                continue
            if not tagged_pids(rep.tag):
                return
            kill_tagged(rep.tag, signal.SIGKILL)
            time.sleep(0.05)
        self.log(f"dilocox launch: replica {rep.r}: processes {tagged_pids(rep.tag)} still there after SIGKILL")

    # the run --------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: object) -> None:
        self._signals.append(signum)

    def run(self) -> int:
        """Run everything; return 0 when every replica's last incarnation exited 0 (128+sig after a signal)."""
        os.makedirs(self.run_dir, exist_ok=True)
        self._events = open(self.events_path, "a")
        main = threading.current_thread() is threading.main_thread()
        prev = {}
        if main:
            prev = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.t0 = time.time()
            self._start_lighthouse()
            for rep in self.replicas:
                self._start_replica(rep, "start")
            return self._loop()
        finally:
            self._shutdown()
            for sig, h in prev.items():
                signal.signal(sig, h)
            self._events.close()
            self._events = None
            for rep in self.replicas:
                if rep.log is not None:
                    rep.log.close()

    def _loop(self) -> int:
        t_start = time.monotonic()
        pending = list(self.schedule)
        while True:
            now = time.monotonic() - t_start
            at = now if self.clock is None else self.clock()
            if self._signals:
                sig = self._signals[0]
                self.event("stop", signal=signal.Signals(sig).name)
                self._stop_replicas(signal.SIGTERM)
                return 128 + sig
            if now > self.timeout_s:
                self.event("stop", reason="timeout", timeout_s=self.timeout_s)
                self.log(f"dilocox launch: the run passed --timeout {self.timeout_s:g} s: stopping it")
                self._stop_replicas(signal.SIGTERM)
                return 124
            for rep in self.replicas:
                if rep.proc is not None and rep.code is None and (code := rep.proc.poll()) is not None:
                    rep.code = code
                    if not rep.killed:
                        self.event("exit", replica=rep.r, code=code, incarnation=rep.incarnation)
                        level = "finished" if code == 0 else f"exited with code {code}"
                        self.log(f"dilocox launch: replica {rep.r} {level} (log {self.run_dir}/replica{rep.r}.log)")
            running = [rep for rep in self.replicas if rep.code is None]
            while pending and pending[0].at_s <= at:
                act = pending.pop(0)
                rep = self.replicas[act.replica]
                if act.kind == "kill":
                    if rep.code is not None:
                        self.event("kill", replica=rep.r, skipped="already exited")
                        continue
                    rep.killed = True
                    pids = self._kill_replica(rep, signal.SIGKILL)
                    self._reap_replica(rep)
                    rep.code = rep.proc.poll() if rep.proc.poll() is not None else -signal.SIGKILL
                    self.event(
                        "kill", replica=rep.r, pid=rep.proc.pid, tagged_pids=pids, incarnation=rep.incarnation, at=at
                    )
                    self.log(f"dilocox launch: killed replica {rep.r} (SIGKILL) at {now:.1f} s{self._where(at)}")
                else:
                    if not running:
                        self.event("restart", replica=rep.r, skipped="no replica left running")
                        continue
                    self._start_replica(rep, "restart")
                    self.log(f"dilocox launch: restarted replica {rep.r} at {now:.1f} s{self._where(at)}")
                running = [rep for rep in self.replicas if rep.code is None]
            if not running:
                break
            time.sleep(0.05)
        for act in pending:
            self.event(act.kind, replica=act.replica, skipped="the run ended first", at_s=act.at_s)
        codes = [rep.code for rep in self.replicas if not rep.killed]
        return next((c for c in codes if c), 0)

    def _where(self, at: float) -> str:
        return "" if self.clock is None else f" (schedule clock {at:g})"

    def _stop_replicas(self, sig: int) -> None:
        """Ask (``sig``; torchrun forwards it: the ranks save and exit), wait ``stop_timeout_s``, then SIGKILL."""
        live = [rep for rep in self.replicas if rep.proc is not None and rep.proc.poll() is None]
        for rep in live:
            kill_group(rep.proc.pid, sig)
        deadline = time.monotonic() + self.stop_timeout_s
        for rep in live:
            try:
                rep.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.log(f"dilocox launch: replica {rep.r} did not stop within {self.stop_timeout_s:g} s: SIGKILL")

    def _shutdown(self) -> None:
        for rep in self.replicas:
            if rep.proc is not None:
                self._kill_replica(rep, signal.SIGKILL)
                self._reap_replica(rep)
        if self.lighthouse is not None and self.lighthouse.poll() is None:
            kill_group(self.lighthouse.pid, signal.SIGTERM)
            try:
                self.lighthouse.wait(timeout=10)
            except subprocess.TimeoutExpired:
                kill_group(self.lighthouse.pid, signal.SIGKILL)
                self.lighthouse.wait(timeout=10)
        if self.lighthouse is not None and self._events is not None:
            self.event("lighthouse_stopped", code=self.lighthouse.returncode)


# --------------------------------------------------------------------------- `dilocox launch --elastic`


def last_step(metrics_path: str) -> int:
    """The last ``step`` logged in a ``metrics.jsonl`` (0 if none yet); reads only the file's tail."""
    try:
        with open(metrics_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            tail = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return 0
    for line in reversed(tail):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the seek or by a kill
        if isinstance(rec, dict) and "step" in rec:
            return int(rec["step"])
    return 0


def step_clock(run_dir: str, n: int) -> Callable[[], float]:
    """A schedule clock in training steps: the highest step any replica logged in RUN/replica<r>/metrics.jsonl."""
    paths = [os.path.join(run_dir, f"replica{r}", "metrics.jsonl") for r in range(n)]
    return lambda: float(max(last_step(p) for p in paths))


def train_argv(
    config: str, r: int, n: int, nproc: int, lighthouse: str, min_replicas: int, run_dir: str, overrides: Sequence[str]
) -> list[str]:
    """The command of replica r of n: one ``dilocox train`` job of ``nproc`` ranks, its own run dir."""
    return [
        sys.executable,
        "-m",
        "dilocox.cli",
        "train",
        config,
        "--nproc",
        str(nproc),
        *overrides,
        "--parallel.replicas=1",
        "--outer.elastic.enabled=true",
        f"--outer.elastic.lighthouse={lighthouse}",
        f"--outer.elastic.replica_rank={r}",
        f"--outer.elastic.min_replicas={min_replicas}",
        f"--outer.elastic.initial_replicas={n}",  # the first outer step waits (bounded) for every replica's start-up
        f"--log.run_dir={os.path.join(run_dir, f'replica{r}')}",
    ]


def _split_overrides(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """Pull ``--log.run_dir`` out of the overrides (each replica gets RUN/replica{r})."""
    run_dir, out, i = None, [], 0
    args = list(args)
    while i < len(args):
        a = args[i]
        if a.startswith("--log.run_dir="):
            run_dir = a.split("=", 1)[1]
        elif a == "--log.run_dir" and i + 1 < len(args):
            run_dir = args[i + 1]
            i += 1
        else:
            out.append(a)
        i += 1
    return run_dir, out


def launch_elastic(
    config: str,
    n: int,
    overrides: Sequence[str] = (),
    *,
    min_replicas: int | None = None,
    kills: Sequence[str] = (),
    restarts: Sequence[str] = (),
    netns: bool | None = None,
    bandwidth: str | None = None,
    timeout_s: float = 3600.0,
    lighthouse_opts: Sequence[str] = (),
    log: Callable[[str], None] | None = None,
    at: str = "time",
) -> int:
    """``dilocox launch --elastic N CONFIG ...`` as a function; returns the exit code. ``at``: the schedule's
    R@X means X seconds after the replicas started ("time") or the first time a replica logged step X ("step")."""
    from dilocox.config import load_config
    from dilocox.plan import fmt_bandwidth, parse_bandwidth

    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    run_dir, overrides = _split_overrides(overrides)
    if min_replicas is None:
        min_replicas = max(1, n - 1)
    if not 1 <= min_replicas <= n:
        raise LaunchError(f"--min-replicas {min_replicas} must be in [1, --elastic {n}]")
    if at not in ("time", "step"):
        raise LaunchError(f"--at {at!r} must be time or step")
    schedule = parse_schedule(kills, restarts, n)
    # the config as replica 0 sees it: a bad key or layout is one line here, not N tracebacks later
    probe = train_argv(config, 0, n, 1, "http://127.0.0.1:1", min_replicas, run_dir or "runs/x", overrides)
    cfg = load_config(config, probe[probe.index("--nproc") + 2 :])
    if run_dir is None:
        run_dir = cfg.log.run_dir
    pc = cfg.parallel
    nproc = pc.data * pc.pipeline * pc.tensor
    ok, why = netns_available()
    if netns and not ok:
        raise LaunchError(f"--netns requested but network namespaces are unavailable: {why}")
    use_netns = ok if netns is None else netns
    rate_bps = None if bandwidth is None else parse_bandwidth(bandwidth)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    env.pop(BANDWIDTH_ENV, None)
    os.makedirs(run_dir, exist_ok=True)

    def argv(r: int, addr: str) -> list[str]:
        return train_argv(config, r, n, nproc, addr, min_replicas, run_dir, overrides)

    kw = dict(
        min_replicas=min_replicas,
        schedule=schedule,
        timeout_s=timeout_s,
        stop_timeout_s=cfg.train.stop_timeout_s,
        lighthouse_opts=lighthouse_opts,
        log=log,
        clock=step_clock(run_dir, n) if at == "step" else None,
    )
    cap = fmt_bandwidth(rate_bps) if rate_bps else "uncapped"
    if not use_netns:
        if rate_bps:
            env[BANDWIDTH_ENV] = f"{rate_bps / nproc:.0f}"
        log(
            f"dilocox launch: elastic, {n} replicas x {nproc} ranks on loopback ({why or 'namespaces off'}); "
            f"{'token-bucket ' + cap + ' per replica (outer comm thread)' if rate_bps else 'no bandwidth cap'}"
        )
        return ElasticLaunch(n, argv, run_dir, env=env, **kw).run()
    log(f"dilocox launch: elastic, {n} replicas x {nproc} ranks in network namespaces, tbf {cap} each way")
    with Cluster(n, None if rate_bps is None else rate_bps / 1e6, hub=True, stop_grace_s=5.0) as c:
        return ElasticLaunch(n, argv, run_dir, env=env, cluster=c, **kw).run()


def launch_main(argv: Sequence[str] | None = None) -> int:
    """``dilocox launch --elastic N CONFIG [overrides] [options]`` (module docstring)."""
    p = argparse.ArgumentParser(
        prog="dilocox launch --elastic",
        usage="dilocox launch --elastic N CONFIG [--section.key=value ...] [options]",
        description="Start a torchft lighthouse and N elastic replica jobs (docs/ELASTIC.md).",
        allow_abbrev=False,  # a config override must never be taken for an abbreviated option
    )
    p.add_argument("--elastic", type=int, required=True, metavar="N", help="number of replica jobs")
    p.add_argument("config", help="the run's YAML config (each replica: parallel.replicas=1)")
    p.add_argument("--min-replicas", type=int, default=None, help="outer.elastic.min_replicas (default N-1)")
    p.add_argument("--kill", action="append", default=[], metavar="R@SECONDS", help="SIGKILL replica R's job then")
    p.add_argument("--restart", action="append", default=[], metavar="R@SECONDS", help="start replica R again")
    p.add_argument("--netns", dest="netns", action="store_true", default=None, help="namespaces (default if root)")
    p.add_argument("--no-netns", dest="netns", action="store_false", help="loopback, no namespaces")
    p.add_argument("--bandwidth", default=None, help="cap per replica link each way, e.g. 100mbit")
    p.add_argument(
        "--at", choices=("time", "step"), default="time", help="R@X: X seconds after the start, or at training step X"
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="bound on the whole run in seconds")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=2000, help="lighthouse: drop a silent replica after")
    p.add_argument("--join-timeout-ms", type=int, default=60000, help="lighthouse: wait for live stragglers")
    a, overrides = p.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    lh_opts = ["--heartbeat-timeout-ms", str(a.heartbeat_timeout_ms), "--join-timeout-ms", str(a.join_timeout_ms)]
    from dilocox.config import ConfigError

    try:
        return launch_elastic(
            a.config,
            a.elastic,
            overrides,
            min_replicas=a.min_replicas,
            kills=a.kill,
            restarts=a.restart,
            netns=a.netns,
            bandwidth=a.bandwidth,
            timeout_s=a.timeout,
            lighthouse_opts=lh_opts,
            at=a.at,
        )
    except (LaunchError, ConfigError, ValueError) as e:
        print(f"dilocox launch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(launch_main())
