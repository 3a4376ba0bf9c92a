"""The command line of SWARM mode: ``dilocox swarm ...`` and ``dilocox launch --swarm ...`` (issue 11 part 7).

    dilocox swarm CONFIG [--peers 2,2] [--steps N] [--out DIR] [--timeout-s S] [--section.key=value ...]
                  [--netns [--rate 100mbit] [--peer-rate s1p1=20mbit ...]]   (each peer in a network namespace,
                  capped links: dilocox/swarm/netns.py)
    dilocox launch --swarm CONFIG [...same options...]
    dilocox swarm store --port P [--bind 0.0.0.0] [--max-s S]     (the address store, for launcher/slurm/swarm.sbatch)
    dilocox swarm rebalance --config C --store H:P --out DIR --lighthouse J=URL ... [-- overrides]   (the mover)
    dilocox swarm peer --config C --stage J --index K --store H:P [...]   (one peer: python -m dilocox.swarm.peer)

The first form starts the whole job on this host (``dilocox.swarm.runtime.launch``: the TCPStore, one torchft
lighthouse per multi-peer stage, one process group per peer) and kills every process it started at the end.
The ``store`` and ``peer`` forms are the pieces a multi-node launcher starts on its own (SLURM: one srun step per
peer, store and lighthouses on the first node).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import threading
from datetime import timedelta

from dilocox.net.secure import HANDSHAKE_S


class SwarmUsageError(ValueError):
    """A malformed ``dilocox swarm`` command line (one line, exit 2)."""


MAX_LOCAL_PEERS = 256  # peers one `dilocox swarm` starts on its host


def parse_peers(text: str) -> list[int]:
    """``"2,2"`` / ``"[4, 4]"`` -> ``[2, 2]``; anything else is a one-line error naming --peers and the fix."""
    parts = [p.strip() for p in text.strip().strip("[]").split(",")]
    try:
        out = [int(p) for p in parts]
    except ValueError:
        out = []
    if not out or any(m < 1 for m in out):
        raise SwarmUsageError(f"--peers {text!r} must be peers per stage, integers >= 1 separated by commas, e.g. 2,2")
    return out


class _Parser(argparse.ArgumentParser):
    """argparse, but a malformed command line is one line (``dilocox swarm: ...``, exit 2), not usage + error."""

    def error(self, message: str):
        raise SwarmUsageError(f"{message} (see {self.prog} --help)")


def _run_parser(prog: str) -> argparse.ArgumentParser:
    ap = _Parser(
        prog=prog,
        description="Start a SWARM / DiLoCo-SWARM job on this host: one process per peer (docs/SWARM.md).",
        epilog="Any config key can follow as --section.key=value (e.g. --swarm.sync=diloco --outer.sync_every=10 "
        "--swarm.routing=random); every key is in docs/CONFIG.md.",
    )
    ap.add_argument("config", help="YAML config (e.g. configs/tiny.yaml); its swarm: section describes the job")
    ap.add_argument("--peers", default=None, help="peers per stage, e.g. 2,2 (overrides swarm.peers_per_stage)")
    ap.add_argument("--steps", type=int, default=None, help="steps to train (default: train.steps)")
    ap.add_argument("--out", default=None, help="output directory (default: <log.run_dir>/swarm)")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="bound on the whole job; then every peer is killed")
    ap.add_argument(
        "--resume", action="store_true",
        help="start every peer from the newest SWARM checkpoint that every stage completed (checkpoint.every > 0 "
        "writes them to OUT/checkpoints; --steps can go past the first run's)",
    )  # fmt: skip
    ap.add_argument(
        "--delay", action="append", default=[], metavar="PEER=SECONDS",
        help="inject a delay per microbatch on a peer, e.g. s1p1=0.2 (heterogeneous-peer experiments)",
    )  # fmt: skip
    ap.add_argument(
        "--rebalance-s", type=float, default=None, metavar="T",
        help="every T seconds move a peer of the least-loaded stage to the most-loaded one (sets "
        "swarm.rebalance_period_s; SWARM's T is 300; 0 = off). Each move is logged in OUT/rebalance.jsonl",
    )  # fmt: skip
    ap.add_argument(
        "--pace", action="append", default=[], metavar="PEER=SECONDS",
        help="each microbatch occupies the peer for max(SECONDS, its compute), e.g. s1p1=0.4: a peer paced at 2T is "
        "exactly 2x slower than one paced at T whatever the host's load (heterogeneous-peer experiments)",
    )  # fmt: skip
    ap.add_argument(
        "--netns", action="store_true",
        help="each peer in its own network namespace (needs root and iproute2), the address store and lighthouses in "
        "a hub namespace every peer reaches; the summary adds each peer's veth byte counts",
    )  # fmt: skip
    ap.add_argument(
        "--rate", default=None, metavar="BW",
        help="with --netns: cap every peer's link at BW each way (tc tbf), e.g. 100mbit, 1gbit (as dilocox launch)",
    )  # fmt: skip
    ap.add_argument(
        "--peer-rate", action="append", default=[], metavar="PEER=BW",
        help="with --netns: this peer's link gets its own cap, e.g. s1p1=20mbit (heterogeneous links; the others keep "
        "--rate, or no cap)",
    )  # fmt: skip
    ap.add_argument("--latency", default=None, help="with --netns: round trip added between peers, e.g. 50ms")
    ap.add_argument("--jitter", default=None, help="with --netns: spread of that round trip, e.g. 5ms")
    ap.add_argument("--loss", default=None, help="with --netns: frames lost between peers, e.g. 0.1%%")
    return ap


def parse_delay(netns: bool, latency: str | None, jitter: str | None, loss: str | None) -> tuple[float, float, float]:
    """--latency/--jitter/--loss -> (round trip ms, jitter ms, loss); a one-line error when they cannot be honoured."""
    from dilocox.launch.switch import SwitchError, parse_latency, parse_loss

    try:
        out = (parse_latency(latency, "--latency"), parse_latency(jitter, "--jitter"), parse_loss(loss))
    except SwitchError as e:
        raise SwarmUsageError(str(e)) from None
    if any(out) and not netns:
        raise SwarmUsageError("--latency/--jitter/--loss need --netns (the delay switch runs in the hub namespace)")
    if out[1] > out[0]:
        raise SwarmUsageError(
            f"--jitter {jitter} is larger than --latency {latency or 0}: the spread must fit in the delay"
        )
    return out


def parse_netns(netns: bool, rate: str | None) -> float | None:
    """--netns / --rate -> the cap in Mbit/s (None: uncapped); a one-line error when they cannot be honoured."""
    from dilocox.launch.netns import netns_available
    from dilocox.plan import parse_bandwidth

    if rate is not None and not netns:
        raise SwarmUsageError(f"--rate {rate} needs --netns (the cap is a tc tbf on each peer's namespace link)")
    try:
        mbit = None if rate is None else parse_bandwidth(rate) / 1e6
    except ValueError as e:
        raise SwarmUsageError(f"--rate: {e}") from None
    ok, why = netns_available() if netns else (True, "")
    if not ok:
        raise SwarmUsageError(f"--netns: network namespaces are unavailable here: {why}; run as root or drop --netns")
    return mbit


def parse_peer_rates(items: list[str], netns: bool) -> dict[str, float]:
    """--peer-rate PEER=BW ... -> {peer: Mbit/s}; a one-line error for a bad item or without --netns."""
    from dilocox.plan import parse_bandwidth

    out = {}
    for it in items:
        if not netns:
            raise SwarmUsageError(f"--peer-rate {it} needs --netns (the cap is a tc tbf on the peer's namespace link)")
        name, _, bw = it.partition("=")
        name = name.strip()
        if not (name.startswith("s") and "p" in name and bw):
            raise SwarmUsageError(f"--peer-rate {it!r} must be PEER=BW with PEER like s1p0, e.g. s1p1=20mbit")
        try:
            out[name] = parse_bandwidth(bw) / 1e6
        except ValueError as e:
            raise SwarmUsageError(f"--peer-rate {it}: {e}") from None
    return out


def parse_delays(items: list[str], flag: str = "--delay") -> dict[str, float]:
    out = {}
    for it in items:
        name, _, sec = it.partition("=")
        try:
            out[name.strip()] = float(sec)
        except ValueError:
            raise SwarmUsageError(f"{flag} {it!r} must be PEER=SECONDS, e.g. s1p1=0.2") from None
        if not name.strip().startswith("s") or "p" not in name or not 0 <= out[name.strip()] < math.inf:
            raise SwarmUsageError(f"{flag} {it!r} must be PEER=SECONDS with PEER like s1p0 and finite SECONDS >= 0")
    return out


def refuse_unsupported(cfg) -> None:
    """Train keys a SWARM peer does not read (it trains in fp32 on the CPU, eagerly, for --steps / train.steps):
    set to something else they would be silently ignored, so they are refused (one line naming key and fix)."""
    t = cfg.train
    bad = [
        ("train.max_tokens", t.max_tokens, t.max_tokens is not None, "stop by --steps instead"),
        ("train.device", t.device, t.device == "cuda", "SWARM peers run on the CPU; set it to auto or cpu"),
        ("train.dtype", t.dtype, t.dtype == "bf16", "SWARM peers compute in fp32; set it to auto or fp32"),
        ("train.compile", t.compile, bool(t.compile), "SWARM peers run eagerly; set it to false"),
        ("log.profile_start", cfg.log.profile_start, cfg.log.profile_start > 0, "SWARM peers are not profiled; set 0"),
        ("data.sampler", cfg.data.sampler, cfg.data.sampler != "random", "a stage-0 peer draws random windows of its "
         "own (a peer rebalanced into stage 0 too); set it to random"),
    ]  # fmt: skip
    for key, value, unsupported, fix in bad:
        if unsupported:
            raise SwarmUsageError(f"{key}={value!r} is not supported in SWARM mode (no peer reads it): {fix}")


class _Stopped(KeyboardInterrupt):
    """SIGTERM/SIGHUP to ``dilocox swarm``: unwinds ``launch`` as Ctrl-C does, so its teardown kills every peer."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _on_stop_signal(signum, _frame) -> None:
    raise _Stopped(signum)


def _stop_signals() -> dict:
    """SIGTERM/SIGHUP raise ``_Stopped`` in the main thread (the default action would end this process without its
    teardown, leaving every peer running); returns the previous handlers (none off the main thread). An ignored
    signal stays ignored (``nohup dilocox swarm ...``: SIGHUP)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    sigs = [sig for sig in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(sig) is not signal.SIG_IGN]
    return {sig: signal.signal(sig, _on_stop_signal) for sig in sigs}


def _out_dir(out: str) -> str:
    """``out``, made; one line naming --out when it cannot be (a file there, or a parent that cannot be made: it was
    a traceback from the launcher)."""
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise SwarmUsageError(f"--out {out}: cannot be the job's output directory ({e.strerror or e})") from None
    return out


def _check_peers(pps: list[int], netns: bool, per_peer) -> None:
    """The peer count fits this host (and one /24 with --netns); each per-peer flag (``--delay s1p0=...``) names a
    peer of the layout."""
    if sum(pps) > MAX_LOCAL_PEERS:  # (each is a Python process with torch: ~0.3 GB before its model)
        raise SwarmUsageError(f"{sum(pps)} peers on this host, at most {MAX_LOCAL_PEERS}; a larger job spreads over "
                              "nodes: launcher/slurm/swarm.sbatch")  # fmt: skip
    if netns and sum(pps) > 250:
        raise SwarmUsageError(f"--netns: {sum(pps)} peers, at most 250 (one namespace each in one /24); use fewer")
    for flag, name in [(f, n) for f, d in per_peer for n in d]:
        j, _, k = name[1:].partition("p")
        if not (j.isdigit() and k.isdigit() and int(j) < len(pps) and int(k) < pps[int(j)]):
            raise SwarmUsageError(f"{flag} {name}: no such peer in swarm.peers_per_stage={pps} (s<stage>p<index>)")


def run_main(argv: list[str], prog: str = "dilocox swarm") -> int:
    """Parse, start the job, print its summary; exit 0 when every peer exited 0."""
    from dilocox.config import load_config
    from dilocox.swarm import checkpoint as peer_ckpt
    from dilocox.swarm.common import SwarmError, validate_layout
    from dilocox.swarm.netns import HubStartError, netns_launcher
    from dilocox.swarm.runtime import launch, summarize

    ap = _run_parser(prog)
    a, rest = ap.parse_known_args(argv)
    bad = [i for i, r in enumerate(rest) if not r.startswith("--")]
    if bad:
        prev = rest[bad[0] - 1] if bad[0] else ""
        hint = f"{prev} is not an option of dilocox swarm (--help lists them); " if prev[:2] == "--" else ""
        raise SwarmUsageError(
            f"unexpected argument {rest[bad[0]]!r}: {hint}config keys are given as --section.key=value"
        )
    if a.steps is not None and a.steps < 1:
        raise SwarmUsageError(f"--steps {a.steps} must be at least 1")
    if not 0 < a.timeout_s < math.inf:  # (NaN too)
        raise SwarmUsageError(f"--timeout-s {a.timeout_s} must be > 0 seconds")
    peers = parse_peers(a.peers) if a.peers is not None else None
    delays = parse_delays(a.delay)
    paces = parse_delays(a.pace, "--pace")
    peer_rates = parse_peer_rates(a.peer_rate, a.netns)
    rate_mbit = parse_netns(a.netns, a.rate)
    delay = parse_delay(a.netns, a.latency, a.jitter, a.loss)
    overrides = list(rest)
    if peers is not None:
        overrides.append(f"--swarm.peers_per_stage=[{','.join(map(str, peers))}]")
    if a.rebalance_s is not None:
        overrides.append(f"--swarm.rebalance_period_s={a.rebalance_s}")
    cfg = load_config(a.config, overrides)  # a ConfigError names the key, the value and the fix (exit 2)
    validate_layout(cfg)
    refuse_unsupported(cfg)
    pps = list(cfg.swarm.peers_per_stage)
    _check_peers(pps, a.netns, (("--delay", delays), ("--pace", paces), ("--peer-rate", peer_rates)))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    out = _out_dir(a.out or os.path.join(cfg.log.run_dir, "swarm"))
    started = (
        f"swarm job: {sum(pps)} peers over {len(pps)} stages {pps} started{' (--resume)' if a.resume else ''}; "
        f"each peer's log is {out}/s<stage>p<index>.log; the summary comes at the end (Ctrl-C stops every peer)"
    )
    previous = _stop_signals()
    try:
        res = launch(
            cfg, out, steps=a.steps, timeout_s=a.timeout_s, delays=delays, delay_serial=True, paces=paces,
            launcher=netns_launcher(rate_mbit, peer_rates, delay) if a.netns else None, resume=a.resume,
            on_started=lambda la: print(started, file=sys.stderr, flush=True),
        )  # fmt: skip
    except KeyboardInterrupt as e:  # launch's teardown ran (peers killed; --netns: namespaces deleted first)
        signum = e.signum if isinstance(e, _Stopped) else signal.SIGINT
        name = signal.Signals(signum).name
        print(f"swarm job: interrupted ({name}); every peer was stopped; their logs are in {out}", file=sys.stderr)
        print(f"swarm job: {peer_ckpt.describe_newest(cfg, out, len(pps), a.config)}", file=sys.stderr)
        return 128 + signum
    except HubStartError as e:  # --netns: the namespaces are deleted already
        print(f"swarm job: {e}", file=sys.stderr)
        return 1
    except SwarmError as e:  # refused before any peer started (--resume without a checkpoint, a stale one without)
        raise SwarmUsageError(str(e)) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(summarize(res))
    moves = os.path.join(out, "rebalance.jsonl")
    if os.path.exists(moves):  # rebalancing: one line per move made, refused or failed
        with open(moves) as f:
            for rec in map(json.loads, f):
                why = rec.get("refused") or rec.get("error")
                print("  " + rec.get("line", f"{rec.get('plan', rec['peer'])}: {why}"))
    failed = {n: rc for n, rc in res.returncodes.items() if rc != 0}
    if failed:
        print(f"swarm job: peers {failed} did not exit 0; their logs are in {out}", file=sys.stderr)
        print(f"swarm job: {peer_ckpt.describe_newest(cfg, out, len(pps), a.config)}", file=sys.stderr)
    return 0 if not failed else 1


def _check_max_s(max_s: float) -> None:
    if not 0 < max_s < math.inf:  # (NaN too; a negative or NaN bound stopped the service at once, exit 0)
        raise SwarmUsageError(f"--max-s {max_s} must be a finite number of seconds > 0, e.g. 86400")


def store_main(argv: list[str]) -> int:
    """Serve the job's address store (a torch.distributed TCPStore) until SIGTERM/SIGINT or --max-s."""

    ap = _Parser(
        prog="dilocox swarm store", description="the address store of a multi-node SWARM job (peers publish here)"
    )
    ap.add_argument("--port", type=int, required=True, help="TCP port to listen on")
    ap.add_argument("--bind", default="0.0.0.0", help="address to listen on (default: all interfaces)")
    ap.add_argument("--max-s", type=float, default=7 * 86400.0, help="stop after this many seconds at the latest")
    ap.add_argument(
        "--secret-file",
        default="",
        help="the run secret: the store listens on loopback behind a guard that wants it (the peers of a job with "
        "security.authenticate and security.guard_services reach it through a relay; docs/SECURITY.md)",
    )
    ap.add_argument(
        "--insecure",
        action="store_true",
        help="serve the plain store on a --bind other hosts can reach, without --secret-file: whoever reaches it can "
        "read and rewrite the job's addresses (a closed network only; the peers need security.guard_services=false)",
    )
    ap.add_argument(
        "--handshake-s",
        type=float,
        default=HANDSHAKE_S,
        help="with --secret-file: the guard ends its handshake with a connection within this many seconds (the "
        "peers' security.handshake_s; at most 30)",
    )
    a = ap.parse_args(argv)
    _check_max_s(a.max_s)
    if not 0 < a.port < 65536:
        raise SwarmUsageError(f"--port {a.port} must be a TCP port in 1..65535")
    from dilocox.elastic.stores import _is_loopback

    if not a.secret_file and not a.insecure and not _is_loopback(a.bind.strip("[]")):
        raise SwarmUsageError(
            f"--bind {a.bind} is reachable from other hosts and has no --secret-file: pass --secret-file RUN_SECRET "
            "(the peers' security.secret_file), --bind 127.0.0.1, or --insecure on a closed network"
        )
    from dilocox.net.secure import set_handshake_s

    try:
        set_handshake_s(a.handshake_s, "--handshake-s")
    except ValueError as e:
        raise SwarmUsageError(str(e)) from None
    secret = None
    if a.secret_file:
        from dilocox.net.secure import SecretError, load_secret

        try:
            secret = load_secret(a.secret_file)
        except SecretError as e:
            raise SwarmUsageError(str(e)) from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    from dilocox.swarm.services import store_master

    try:  # (a port in use, an address not of this host: they were tracebacks)
        _, port, _guard = store_master(a.bind, a.port, secret, timedelta(seconds=60))
    except (OSError, RuntimeError) as e:
        raise SwarmUsageError(f"--bind {a.bind} --port {a.port}: the store cannot listen there ({e})") from None
    print(f"swarm store listening on {a.bind}:{port}" + (" (behind a guard)" if secret else ""), flush=True)
    stop.wait(timeout=a.max_s)
    print("swarm store: stopping", flush=True)
    return 0


def rebalance_main(argv: list[str]) -> int:
    """``dilocox swarm rebalance``: the rebalancing thread of a job whose peers another launcher started (SLURM:
    ``launcher/slurm/swarm.sbatch`` with DILOCOX_SWARM_REBALANCE_S), until SIGTERM/SIGINT or --max-s."""
    from dilocox.config import load_config
    from dilocox.swarm.common import SwarmError, parse_store, validate_layout
    from dilocox.swarm.mover import Mover, RemoteControl

    ap = _Parser(
        prog="dilocox swarm rebalance",
        description="move peers of a running SWARM job to its most-loaded stage (docs/SWARM.md, Rebalancing)",
    )
    ap.add_argument("--config", required=True, help="the peers' config")
    ap.add_argument("--store", required=True, help="host:port of the job's address store")
    ap.add_argument("--out", required=True, help="the job's run directory (rebalance.jsonl goes there)")
    ap.add_argument(
        "--lighthouse", action="append", default=[], metavar="STAGE=URL",
        help="every stage's torchft lighthouse, e.g. 1=http://node0:29531 (a peer moved there joins through it)",
    )  # fmt: skip
    ap.add_argument("--max-s", type=float, default=7 * 86400.0, help="stop after this many seconds at the latest")
    ap.add_argument("overrides", nargs="*", help="config overrides, after --, as the peers get them")
    a = ap.parse_args(argv)
    _check_max_s(a.max_s)
    try:  # (a malformed one was a traceback in the mover's thread, then nothing moved until --max-s, exit 0)
        parse_store(a.store)
    except SwarmError as e:
        raise SwarmUsageError(str(e)) from None
    lighthouses = {}
    for it in a.lighthouse:
        j, _, url = it.partition("=")
        if not (j.strip().isdigit() and url.startswith("http")):
            raise SwarmUsageError(f"--lighthouse {it!r} must be STAGE=URL, e.g. 1=http://node0:29531")
        lighthouses[int(j)] = url
    cfg = load_config(a.config, a.overrides)
    from dilocox.net.rpc import use_secret
    from dilocox.net.secure import SecretError
    from dilocox.swarm.common import rpc_security

    validate_layout(cfg)
    n = len(cfg.swarm.peers_per_stage)
    if not cfg.swarm.rebalance_period_s > 0:
        raise SwarmUsageError("swarm.rebalance_period_s is 0: nothing to do (e.g. -- --swarm.rebalance_period_s=300)")
    missing = [j for j in range(n) if j not in lighthouses]
    if missing:
        raise SwarmUsageError(f"--lighthouse: no address for stage(s) {missing} (every stage needs one: peers move)")
    try:
        use_secret(*rpc_security(cfg))  # the mover calls the peers: the job's secret
    except SecretError as e:
        raise SwarmUsageError(str(e)) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    mover = Mover(RemoteControl(cfg, a.out, a.store, lighthouses), steps=None)
    mover.start()
    print(f"swarm rebalance: every {cfg.swarm.rebalance_period_s:g} s, store {a.store}, moves in {a.out}", flush=True)
    stop.wait(timeout=a.max_s)
    mover.stop()
    mover.join(timeout=30.0)
    print(f"swarm rebalance: stopping ({len([m for m in mover.moves if 'line' in m])} move(s) made)", flush=True)
    return 0


def main(argv: list[str]) -> int:
    """``dilocox swarm ...``: run (default) | store | rebalance | peer."""
    if argv and argv[0] == "store":
        return store_main(argv[1:])
    if argv and argv[0] == "rebalance":
        return rebalance_main(argv[1:])
    if argv and argv[0] == "peer":
        from dilocox.swarm.common import SwarmError
        from dilocox.swarm.peer import main as peer_main

        try:
            return peer_main(argv[1:])
        except SwarmError as e:  # (a peer that cannot be built: e.g. --stage/--index outside swarm.peers_per_stage)
            raise SwarmUsageError(str(e)) from None
    if not argv:
        raise SwarmUsageError("needs a CONFIG file: dilocox swarm CONFIG [--peers 2,2] [--steps N] (see --help)")
    return run_main(argv)


def launch_main(argv: list[str]) -> int:
    """``dilocox launch --swarm CONFIG ...`` (the launcher form of ``dilocox swarm CONFIG ...``)."""
    rest = [a for a in argv if a != "--swarm"]
    if not rest:
        raise SwarmUsageError("--swarm needs a CONFIG file: dilocox launch --swarm CONFIG [--peers 2,2] [--steps N]")
    return run_main(rest, prog="dilocox launch --swarm")
