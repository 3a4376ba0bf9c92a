"""Launch ``dilocox train`` as R emulated clusters on one host (``dilocox launch``).

Each replica is one torchrun node in its own network namespace (``dilocox.launch.netns``), all
nodes joined by a *static* rendezvous at replica 0's address (``--rdzv_backend c10d`` inside
namespaces failed to elect its store host on the dev machine), ``GLOO_SOCKET_IFNAME`` set to the
namespace's veth. Replica r is node r: global ranks r*N .. r*N+N-1, the contiguous block that
``dilocox.distributed.topology`` assigns to a replica.

Without root or ``ip netns`` (or where the kernel lacks veth or tbf) it falls back to ONE local torchrun of R*N
ranks and exports the cap as ``DILOCOX_EMULATED_BANDWIDTH_BPS`` (bits/s per rank: the cap / N, a replica's N ranks
sharing its link) for the outer comm layer's token bucket (``AsyncComm(bandwidth=bytes/s)``), printing
``emulation: token-bucket`` and why.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import Sequence

from dilocox.config import ConfigError, load_config
from dilocox.distributed.comm import BANDWIDTH_ENV
from dilocox.distributed.procs import child_env
from dilocox.distributed.signals import supervise
from dilocox.launch.local_run import MULTI_HOST, launch_exit_code, local_run_argv, loopback_env
from dilocox.launch.netns import SUBNET, Cluster, cleanup_stale, kill_group, netns_available
from dilocox.launch.switch import parse_latency, parse_loss
from dilocox.plan import fmt_bandwidth, parse_bandwidth

__all__ = ["Cluster", "cleanup_stale", "launch", "launch_main", "netns_available", "torchrun_argv", "BANDWIDTH_ENV"]


def torchrun_argv(
    nnodes: int, node_rank: int, nproc: int, master_addr: str, master_port: int, entry: Sequence[str]
) -> list[str]:
    """One node of a static rendezvous (c10d rendezvous failed to elect its host across namespaces): torchrun with its
    own stores (the nodes meet across the namespaces' links) and ``local_run``'s exit (a stop signal: 128 + signal and
    one line once the ranks saved, not torchrun's ``SignalException`` traceback)."""
    return [
        sys.executable,
        "-m",
        "dilocox.launch.local_run",
        MULTI_HOST,
        f"--nnodes={nnodes}",
        f"--node_rank={node_rank}",
        f"--nproc_per_node={nproc}",
        f"--master_addr={master_addr}",
        f"--master_port={master_port}",
        *entry,
    ]


def launch(
    config: str | None,
    replicas: int,
    per_replica_nproc: int,
    rate: str | float | None = None,
    overrides: Sequence[str] = (),
    *,
    entry: Sequence[str] | None = None,
    master_port: int = 29500,
    emulation: str = "auto",
    grace_s: float = 30.0,
    stop_timeout_s: float | None = None,
    log=print,
    latency: str | float | None = None,
    jitter: str | float | None = None,
    loss: str | float | None = None,
) -> list[int]:
    """Run ``dilocox train CONFIG`` as R emulated clusters of N ranks each; return exit codes.

    Replica r is torchrun node r (global ranks r*N .. r*N+N-1, the contiguous block topology.py
    gives a replica). ``entry`` replaces ``-m dilocox.cli train CONFIG overrides`` (tests).
    ``emulation``: auto | netns | token-bucket. After the first failing node the others get
    ``grace_s`` seconds to exit before they are killed (they may be stuck in a collective).
    SIGINT/SIGTERM: the ranks get ``stop_timeout_s`` (default: the config's train.stop_timeout_s)
    to save a checkpoint and exit, then they are killed and the namespaces deleted.
    """
    rtt_ms, jitter_ms = parse_latency(latency, "--latency"), parse_latency(jitter, "--jitter")
    loss_p = parse_loss(loss)
    delayed = rtt_ms > 0 or jitter_ms > 0 or loss_p > 0
    if jitter_ms > rtt_ms:
        raise ValueError(f"--jitter {jitter} is larger than --latency {latency or 0}: the spread must fit in the delay")
    if replicas < 1 or per_replica_nproc < 1:
        raise ValueError(f"replicas={replicas} and per_replica_nproc={per_replica_nproc} must be >= 1")
    if not 0 <= grace_s < float("inf"):  # (nan would never end the wait for the nodes after a failure)
        raise ValueError(f"--grace {grace_s:g} must be a finite number of seconds >= 0")
    if not 1 <= master_port <= 65535:  # (else each node's torchrun fails with a traceback of its own)
        raise ValueError(f"--master-port {master_port} must be a TCP port in [1, 65535]")
    if emulation not in ("auto", "netns", "token-bucket"):
        raise ValueError(f"emulation={emulation!r} is not one of auto, netns, token-bucket")
    overrides = [*overrides, f"--parallel.replicas={replicas}"]
    if config is not None:
        stop_timeout_s = _check_config(config, overrides, per_replica_nproc, stop_timeout_s)
    if entry is None:
        if config is None:
            raise ValueError("launch needs a config (or an explicit entry)")
        entry = ["-m", "dilocox.cli", "train", config, *overrides]
    rate_bps = None if rate is None else parse_bandwidth(rate)
    env = child_env()
    ok, why = netns_available()
    if emulation == "netns" and not ok:
        raise RuntimeError(f"emulation=netns requested but unavailable: {why}")
    if delayed and (emulation == "token-bucket" or not ok):
        raise RuntimeError(
            f"--latency/--jitter/--loss need network namespaces (the delay switch runs in them): "
            f"{why or 'emulation=token-bucket was requested'}"
        )
    if emulation == "token-bucket" or not ok:
        return _run_token_bucket(replicas, per_replica_nproc, rate_bps, entry, env, stop_timeout_s, why, log)
    log(
        f"emulation: netns ({replicas} namespaces, tbf {fmt_bandwidth(rate_bps) if rate_bps else 'uncapped'} "
        f"each way per replica, addresses {SUBNET}.1-{replicas}"
        + (f"; delay switch: +{rtt_ms:g} ms RTT, jitter {jitter_ms:g} ms, loss {loss_p:.3%}" if delayed else "")
        + ")"
    )
    with Cluster(
        replicas,
        None if rate_bps is None else rate_bps / 1e6,
        stop_grace_s=60.0 if stop_timeout_s is None else stop_timeout_s,
        rtt_ms=rtt_ms,
        jitter_ms=jitter_ms,
        loss=loss_p,
    ) as c:
        codes = _run_nodes(c, replicas, per_replica_nproc, env, entry, master_port, grace_s, log)
    return codes


def _check_config(config: str, overrides: list[str], per_replica_nproc: int, stop_timeout_s: float | None) -> float:
    """Load ``config`` with ``overrides``, check that a replica's ranks match ``per_replica_nproc``; returns
    ``stop_timeout_s``, or the config's train.stop_timeout_s when it is None."""
    full = load_config(config, list(overrides))
    pc = full.parallel
    if stop_timeout_s is None:
        stop_timeout_s = full.train.stop_timeout_s
    inner = pc.data * pc.pipeline * pc.tensor
    if inner != per_replica_nproc:
        raise ConfigError(
            f"--nproc-per-replica {per_replica_nproc} does not match parallel.data*pipeline*tensor = "
            f"{pc.data}*{pc.pipeline}*{pc.tensor} = {inner} in {config}; "
            f"pass --nproc-per-replica {inner}"
        )
    return stop_timeout_s


def _run_token_bucket(
    replicas: int,
    per_replica_nproc: int,
    rate_bps: float | None,
    entry: Sequence[str],
    env: dict[str, str],
    stop_timeout_s: float | None,
    why: str,
    log,
) -> list[int]:
    """The fallback without namespaces: ONE local torchrun of ``replicas * per_replica_nproc`` ranks, the cap exported
    for the outer comm layer's token bucket; returns its exit code (in a list). Each rank paces its own outer traffic
    and a replica's ranks share its one link (as under netns, one tbf per replica): each gets cap / ranks per replica,
    as ``dilocox launch --elastic`` and ``bench wan`` give them."""
    nproc, reason = replicas * per_replica_nproc, why or "requested"
    per_rank = rate_bps / per_replica_nproc if rate_bps else None
    cap = (
        f"{BANDWIDTH_ENV}={per_rank:.0f} (bits/s per rank: {fmt_bandwidth(rate_bps)} per replica shared by its "
        f"{per_replica_nproc} ranks) for the outer comm layer's token bucket"
        if per_rank
        else "no cap"
    )
    log(
        f"emulation: token-bucket ({reason}); one local torchrun with {nproc} ranks, "
        f"{cap}; less faithful than netns: only the outer all-reduce is paced"
    )
    if per_rank:
        env[BANDWIDTH_ENV] = f"{per_rank:.0f}"
    # one host: torchrun's stores and the ranks' pairs on loopback only (dilocox/launch/local_run.py)
    argv = local_run_argv(nproc, entry)
    return [supervise(argv, loopback_env(env), 60.0 if stop_timeout_s is None else stop_timeout_s, log=log)]


def _run_nodes(
    c: Cluster,
    replicas: int,
    per_replica_nproc: int,
    env: dict[str, str],
    entry: Sequence[str],
    master_port: int,
    grace_s: float,
    log,
) -> list[int]:
    """Start torchrun node r in namespace r for every replica, wait for all (``_wait_all``), log each replica's
    traffic; returns the exit codes."""
    procs = []
    for r in range(replicas):
        renv = dict(env, GLOO_SOCKET_IFNAME=c.ifname(r), NCCL_SOCKET_IFNAME=c.ifname(r), DILOCOX_EMULATION="netns")
        argv = torchrun_argv(replicas, r, per_replica_nproc, c.addr(0), master_port, entry)
        procs.append(c.exec(r, argv, env=renv))
    codes = _wait_all(procs, grace_s)
    for r in range(replicas):
        log(
            f"replica {r} ({c.addr(r)}): sent {c.tx_bytes(r) / 1e6:.2f} MB, "
            f"received {c.rx_bytes(r) / 1e6:.2f} MB, exit {codes[r]}"
        )
    return codes


def _wait_all(procs: list[subprocess.Popen], grace_s: float) -> list[int]:
    failed_at = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes  # type: ignore[return-value]
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace_s:
            for p in procs:
                if p.poll() is None:
                    kill_group(p.pid, signal.SIGKILL)
        time.sleep(0.2)


_FLAGS = {
    "--replicas": int,
    "--nproc-per-replica": int,
    "--bandwidth": str,
    "--master-port": int,
    "--emulation": str,
    "--grace": float,
    "--latency": str,
    "--jitter": str,
    "--loss": str,
}


def launch_main(argv: Sequence[str] | None = None) -> int:
    """``dilocox launch --replicas R --nproc-per-replica N --bandwidth 100mbit CONFIG [--a.b=v ...]``."""
    usage = (
        "usage: dilocox launch --replicas R --nproc-per-replica N [--bandwidth 100mbit] "
        "[--latency 50ms [--jitter 5ms] [--loss 0.1%]] [--emulation auto|netns|token-bucket] [--master-port P] "
        "CONFIG [--section.key=value ...]\n"
        "       dilocox launch --elastic N CONFIG [...]   (elastic replicas + lighthouse; options: --elastic 1 --help)"
    )
    args = list(sys.argv[1:] if argv is None else argv)
    opts: dict[str, object] = {}
    config, overrides = None, []
    i = 0
    while i < len(args):
        a = args[i]
        key, sep, val = a.partition("=")
        if key in ("-h", "--help"):
            print(usage)
            return 0
        if key in _FLAGS:
            if not val:
                if sep or i + 1 >= len(args):  # (`--bandwidth=` with nothing: not the next word as its value)
                    print(f"dilocox launch: {key} needs a value\n{usage}", file=sys.stderr)
                    return 2
                i += 1
                val = args[i]
            try:
                opts[key] = _FLAGS[key](val)
            except ValueError:
                print(f"dilocox launch: {key}={val!r} is not a valid {_FLAGS[key].__name__}", file=sys.stderr)
                return 2
        elif config is None and not a.startswith("-"):
            config = a
        else:
            overrides.append(a)
            if "=" not in a and i + 1 < len(args) and not args[i + 1].startswith("--"):
                overrides.append(args[i + 1])
                i += 1
        i += 1
    if config is None or "--replicas" not in opts or "--nproc-per-replica" not in opts:
        print(f"dilocox launch: CONFIG, --replicas and --nproc-per-replica are required\n{usage}", file=sys.stderr)
        return 2
    try:
        codes = launch(
            config,
            opts["--replicas"],
            opts["--nproc-per-replica"],
            opts.get("--bandwidth"),
            overrides,
            master_port=opts.get("--master-port", 29500),
            emulation=opts.get("--emulation", "auto"),
            grace_s=opts.get("--grace", 30.0),
            latency=opts.get("--latency"),
            jitter=opts.get("--jitter"),
            loss=opts.get("--loss"),
        )
    except (ConfigError, ValueError, RuntimeError) as e:
        print(f"dilocox launch: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the namespaces are gone already (Cluster's handler saved, then tore down)
        print("dilocox launch: interrupted (SIGINT); the ranks were asked to save a checkpoint", file=sys.stderr)
        return 130
    return launch_exit_code(codes)  # (a failed node's own code, not that of one killed after it)


if __name__ == "__main__":
    sys.exit(launch_main())
