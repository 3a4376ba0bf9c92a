"""Elastic launch (issue 10 §4): the torchft lighthouse plus one job per replica, on a kill/restart schedule.

    dilocox lighthouse --min-replicas M [--bind HOST:PORT] [--heartbeat-timeout-ms MS] [--join-timeout-ms MS]
    dilocox launch --elastic N CONFIG [--section.key=value ...] [--min-replicas M] [--kill R@SECONDS ...]
                   [--restart R@SECONDS ...] [--at time|step] [--netns | --no-netns] [--bandwidth 100mbit]
                   [--timeout SECONDS]

Replica r is ONE job: ``dilocox train CONFIG --nproc K --parallel.replicas=1 --outer.elastic.enabled=true
--outer.elastic.lighthouse=ADDR --outer.elastic.replica_rank=r --log.run_dir=RUN/replica{r}`` (K = data x
pipeline x tensor of the config; its torchrun has its own rendezvous), started in its own session and tagged
with its own ``DILOCOX_RUN_TAG``. With ``--at step``, R@X means "when a replica has logged training step X"
(``step_clock``); R = ``L`` is the lighthouse (killed, then restarted on its address). "kill" SIGKILLs the replica's
whole process group and every process carrying
its tag (torchrun's workers live in their own session); "restart" starts the same command again. RUN is the
config's ``log.run_dir``; ``RUN/events.jsonl`` gets one line per event (``start``, ``kill``, ``restart``,
``exit``, ``lighthouse``, ``stop``) with the wall time (epoch seconds) and the seconds since the launch.

``--standby-replicas S`` starts S warm standbys (``outer.elastic.standby``, ``RUN/standby{s}``): a replica that dies is
replaced by an idle one at once (``activate.json``, ``dilocox/elastic/standby.py``); a later restart of its slot starts
a new standby instead; idle ones are stopped at the end.

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
import os
import sys
from typing import Callable, Sequence

from dilocox.distributed.comm import BANDWIDTH_ENV

# the lighthouse command, the process supervisor and the schedule live in their own modules; re-exported here
# so every ``dilocox.elastic.launch.X`` import (and a test's monkeypatch of ``ElasticLaunch``) keeps working
from dilocox.elastic.lighthouse import lighthouse_main as lighthouse_main
from dilocox.elastic.schedule import Action as Action
from dilocox.elastic.schedule import LaunchError as LaunchError
from dilocox.elastic.schedule import last_step as last_step
from dilocox.elastic.schedule import parse_schedule as parse_schedule
from dilocox.elastic.schedule import step_clock as step_clock
from dilocox.elastic.supervisor import _ADDR_RE as _ADDR_RE
from dilocox.elastic.supervisor import HOST_ENV as HOST_ENV
from dilocox.elastic.supervisor import LIGHTHOUSE_PORT as LIGHTHOUSE_PORT
from dilocox.elastic.supervisor import LIGHTHOUSE_START_S as LIGHTHOUSE_START_S
from dilocox.elastic.supervisor import ElasticLaunch as ElasticLaunch
from dilocox.elastic.supervisor import _Replica as _Replica
from dilocox.launch.netns import Cluster, netns_available
from dilocox.launch.switch import SwitchError, parse_latency, parse_loss
from dilocox.net.secure import HANDSHAKE_S, SecretError, load_or_create_secret

# --------------------------------------------------------------------------- `dilocox launch --elastic`


def train_argv(
    config: str,
    r: int,
    n: int,
    nproc: int,
    lighthouse: str,
    min_replicas: int,
    run_dir: str,
    overrides: Sequence[str],
    standby: int | None = None,
) -> list[str]:
    """The command of replica r of n: one ``dilocox train`` job of ``nproc`` ranks, its own run dir; ``standby`` s:
    the command of warm standby s instead (``outer.elastic.standby``; its replica_rank comes with its activation)."""
    name = f"replica{r}" if standby is None else f"standby{standby}"
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
        *(["--outer.elastic.standby=true"] if standby is not None else []),
        f"--log.run_dir={os.path.join(run_dir, name)}",
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


def _parse_delay(latency: str | None, jitter: str | None, loss: str | None) -> tuple[float, float, float]:
    """The delay switch's settings (netns only): (round trip ms, jitter ms, loss probability)."""
    try:
        rtt_ms, jitter_ms = parse_latency(latency, "--latency"), parse_latency(jitter, "--jitter")
        loss_p = parse_loss(loss)
    except SwitchError as e:
        raise LaunchError(str(e)) from None
    if jitter_ms > rtt_ms:
        raise LaunchError(
            f"--jitter {jitter} is larger than --latency {latency or 0}: the spread must fit in the delay"
        )
    return rtt_ms, jitter_ms, loss_p


def _use_netns(netns: bool | None, delayed: bool) -> tuple[bool, str]:
    """Whether the replicas run in network namespaces (``netns``: None = when available), and why not if not."""
    ok, why = netns_available()
    if netns and not ok:
        raise LaunchError(f"--netns requested but network namespaces are unavailable: {why}")
    use_netns = ok if netns is None else netns
    if delayed and not use_netns:
        raise LaunchError(f"--latency/--jitter/--loss need network namespaces: {why or '--no-netns was given'}")
    return use_netns, why


def _replica_env() -> dict[str, str]:
    """The replicas' environment: this one, one thread per rank by default, this package importable, no cap."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    env.pop(BANDWIDTH_ENV, None)
    return env


def _security_args(cfg, run_dir: str, overrides, lighthouse_opts, auth_lighthouse: bool | None) -> tuple[list, list]:
    """The replicas' overrides and the lighthouse's options for the run secret (docs/SECURITY.md): the replicas read
    it from a file, by path; with ``auth_lighthouse`` (None: whenever the run authenticates, the default) the
    lighthouse(s) sit behind a guard that wants it."""
    overrides, lighthouse_opts = list(overrides), list(lighthouse_opts)
    if auth_lighthouse is None:
        auth_lighthouse = bool(cfg.security.authenticate)
    if cfg.security.authenticate:
        overrides.append(f"--security.secret_file={_run_secret(cfg, run_dir)}")
    if auth_lighthouse:
        if not cfg.security.authenticate:
            raise LaunchError("--authenticate-lighthouse needs security.authenticate=true (the run secret)")
        overrides.append("--outer.elastic.lighthouse_auth=true")
        lighthouse_opts += ["--secret-file", _run_secret(cfg, run_dir)]
        if cfg.security.handshake_s != HANDSHAKE_S and "--handshake-s" not in lighthouse_opts:  # (the replicas
            lighthouse_opts += ["--handshake-s", repr(float(cfg.security.handshake_s))]  # read it from their config)
    else:  # asked for (or no secret): a plain lighthouse, and replicas that do not try to authenticate to it
        overrides.append("--outer.elastic.lighthouse_auth=false")
        lighthouse_opts += ["--insecure"]
    return overrides, lighthouse_opts


def _probe_config(config: str, overrides: list[str], auth_lighthouse: bool | None):
    """The config as replica 0 sees it (load_config's errors are one line here); the guarded lighthouse that
    ``outer.elastic.collectives=authenticated`` needs is this launcher's to set (``_security_args``), so it is checked
    here against ``security.authenticate`` and ``auth_lighthouse``."""
    from dilocox.config import load_config

    cfg = load_config(config, [*overrides, "--outer.elastic.collectives=gloo"])
    asked = load_config(config, [*overrides, "--outer.elastic.enabled=false"]).outer.elastic.collectives
    if asked == "authenticated" and not (cfg.security.authenticate and auth_lighthouse is not False):
        raise LaunchError(
            "outer.elastic.collectives=authenticated needs the guarded lighthouse: keep security.authenticate=true "
            "and drop --no-authenticate-lighthouse"
        )
    return cfg


def _run_secret(cfg, run_dir: str) -> str:
    """The path of the run secret (docs/SECURITY.md), created if missing; the replicas read it from that file."""
    path = os.path.abspath(cfg.security.secret_file or os.path.join(run_dir, "secret"))
    try:
        load_or_create_secret(path)  # (checks an existing one: mode 0600, long enough)
    except SecretError as e:
        raise LaunchError(str(e)) from None
    return path


def _make_run_dir(run_dir: str) -> None:
    """RUN, created if missing; an empty or uncreatable one is a one-line LaunchError, not an OSError traceback."""
    if not run_dir:
        raise LaunchError("log.run_dir is empty: give the run's directory, e.g. --log.run_dir=runs/elastic (RUN)")
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as e:
        raise LaunchError(f"log.run_dir={run_dir!r} cannot be created: {e.strerror or e}") from None


def _check_counts(n: int, min_replicas: int | None, timeout_s: float, at: str, standby_replicas: int) -> int:
    """The numeric options of ``launch --elastic`` (one-line LaunchErrors); returns min_replicas (default N-1)."""
    min_replicas = max(1, n - 1) if min_replicas is None else min_replicas
    if n < 1 or not 1 <= min_replicas <= n:
        raise LaunchError(f"--elastic {n}: the number of replicas must be at least 1" if n < 1 else
                          f"--min-replicas {min_replicas} must be in [1, --elastic {n}]")  # fmt: skip
    if not 0 < timeout_s < float("inf"):
        raise LaunchError(f"--timeout {timeout_s:g} must be a finite number of seconds > 0 (the whole run's bound)")
    if at not in ("time", "step") or standby_replicas < 0:
        raise LaunchError(f"--at {at!r} must be time or step" if standby_replicas >= 0 else
                          f"--standby-replicas {standby_replicas} must be >= 0")  # fmt: skip
    return min_replicas


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
    latency: str | None = None,
    jitter: str | None = None,
    loss: str | None = None,
    standby: bool = False,
    auth_lighthouse: bool | None = None,
    standby_replicas: int = 0,
) -> int:
    """``dilocox launch --elastic N CONFIG ...`` as a function; returns the exit code. ``at``: the schedule's
    R@X means X seconds after the replicas started ("time") or the first time a replica logged step X ("step")."""
    from dilocox.plan import fmt_bandwidth, parse_bandwidth

    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    run_dir, overrides = _split_overrides(overrides)
    min_replicas = _check_counts(n, min_replicas, timeout_s, at, standby_replicas)
    schedule = parse_schedule(kills, restarts, n)
    rtt_ms, jitter_ms, loss_p = _parse_delay(latency, jitter, loss)
    delayed = rtt_ms > 0 or jitter_ms > 0 or loss_p > 0
    # the config as replica 0 sees it: a bad key or layout is one line here, not N tracebacks later
    # (without replica 0's own --log.run_dir, the last item: RUN is the config's log.run_dir unless one was given)
    probe = train_argv(config, 0, n, 1, "http://127.0.0.1:1", min_replicas, run_dir or "", overrides)
    cfg = _probe_config(config, probe[probe.index("--nproc") + 2 : -1], auth_lighthouse)
    if run_dir is None:
        run_dir = cfg.log.run_dir
    pc = cfg.parallel
    nproc = pc.data * pc.pipeline * pc.tensor
    use_netns, why = _use_netns(netns, delayed)
    rate_bps = None if bandwidth is None else parse_bandwidth(bandwidth)
    env = _replica_env()
    _make_run_dir(run_dir)
    overrides, lighthouse_opts = _security_args(cfg, run_dir, overrides, lighthouse_opts, auth_lighthouse)

    def argv(r: int, addr: str, standby: int | None = None) -> list[str]:  # (standby s: its replica_rank comes later)
        return train_argv(config, r, n, nproc, addr, min_replicas, run_dir, overrides, standby=standby)

    kw = dict(
        min_replicas=min_replicas,
        schedule=schedule,
        timeout_s=timeout_s,
        stop_timeout_s=cfg.train.stop_timeout_s,
        lighthouse_opts=lighthouse_opts,
        log=log,
        clock=step_clock(run_dir, n) if at == "step" else None,
        standby=standby,
        spares=standby_replicas,
        spare_argv=lambda s, addr: argv(0, addr, s),
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
    extra = f"; delay switch +{rtt_ms:g} ms RTT, jitter {jitter_ms:g} ms, loss {loss_p:.3%}" if delayed else ""
    log(f"dilocox launch: elastic, {n} replicas x {nproc} ranks in network namespaces, tbf {cap} each way{extra}")
    rate_mbit = None if rate_bps is None else rate_bps / 1e6
    with Cluster(n + standby_replicas, rate_mbit, hub=True, stop_grace_s=5.0, rtt_ms=rtt_ms, jitter_ms=jitter_ms,
                 loss=loss_p) as c:  # fmt: skip
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
    sched = {"action": "append", "default": [], "metavar": "R@SECONDS"}  # R = L: the lighthouse (elastic/schedule.py)
    p.add_argument("--kill", **sched, help="SIGKILL replica R's job then (L@SECONDS: the lighthouse)")
    p.add_argument("--restart", **sched, help="start replica R again (L@SECONDS: the lighthouse)")
    p.add_argument("--netns", dest="netns", action="store_true", default=None, help="namespaces (default if root)")
    p.add_argument("--no-netns", dest="netns", action="store_false", help="loopback, no namespaces")
    p.add_argument("--bandwidth", default=None, help="cap per replica link each way, e.g. 100mbit")
    p.add_argument("--latency", default=None, help="round trip added between sites, e.g. 50ms (netns: delay switch)")
    p.add_argument("--jitter", default=None, help="spread of that round trip, e.g. 5ms")
    p.add_argument("--loss", default=None, help="frames lost crossing the switch, e.g. 0.1%%")
    p.add_argument(
        "--at", choices=("time", "step"), default="time", help="R@X: X seconds after the start, or at training step X"
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="bound on the whole run in seconds")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=2000, help="lighthouse: drop a silent replica after")
    p.add_argument("--join-timeout-ms", type=int, default=60000, help="lighthouse: wait for live stragglers")
    p.add_argument(
        "--standby-lighthouse", action="store_true", help="also start a standby lighthouse (docs/ELASTIC.md)"
    )
    p.add_argument(
        "--standby-replicas",
        type=int,
        default=0,
        metavar="S",
        help="S warm standby jobs (built, idle): a replica that dies is replaced by one at once (docs/ELASTIC.md)",
    )
    p.add_argument(
        "--authenticate-lighthouse",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the lighthouse(s) accept only connections that prove the run secret (default: whenever "
        "security.authenticate, itself on by default; --no-authenticate-lighthouse for a plain one; docs/SECURITY.md)",
    )
    a, overrides = p.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    for flag in ("heartbeat_timeout_ms", "join_timeout_ms"):  # (here, not in the lighthouse's log after its start)
        if getattr(a, flag) < 1:
            print(f"dilocox launch: error: --{flag.replace('_', '-')} {getattr(a, flag)} must be >= 1 (milliseconds)",
                  file=sys.stderr)  # fmt: skip
            return 2
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
            latency=a.latency,
            jitter=a.jitter,
            loss=a.loss,
            standby=a.standby_lighthouse,
            auth_lighthouse=a.authenticate_lighthouse,
            standby_replicas=a.standby_replicas,
        )
    except (LaunchError, ConfigError, ValueError) as e:
        print(f"dilocox launch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(launch_main())
