"""Start a SWARM job on this host: the TCPStore (addresses), one torchft lighthouse per multi-peer stage, and one
``python -m dilocox.swarm.peer`` process per (stage, index), each in its own process group (one peer's death is
not the job's). ``launch`` waits for the peers under one deadline and kills every process group it started at the
end, whatever happened. Results are read back from the peers' files in ``out_dir``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import torch

from dilocox.config import Config, to_yaml, validate
from dilocox.distributed.procs import kill_and_reap, spawn
from dilocox.net.rpc import use_secret
from dilocox.net.secure import load_or_create_secret
from dilocox.swarm.common import SwarmError, peer_name, rpc_security
from dilocox.swarm.services import service_secret, store_master

log = logging.getLogger("dilocox.swarm.runtime")


@dataclass
class PeerProc:
    stage: int
    index: int
    proc: subprocess.Popen
    log_path: str
    cmd: list[str]

    @property
    def name(self) -> str:
        return peer_name(self.stage, self.index)


@dataclass
class SwarmResult:
    out_dir: str
    returncodes: dict[str, int | None]  # a restarted peer's earlier runs are listed as "name#0", ...
    seconds: float
    peers: dict[str, dict] = field(default_factory=dict)  # name -> the peer's saved .pt (None when it died)
    records: dict[str, list[dict]] = field(default_factory=dict)  # name -> its jsonl records
    net_bytes: dict[str, tuple[int, int]] = field(default_factory=dict)  # --netns: name -> its veth's (tx, rx) bytes

    def log_tail(self, name: str, n: int = 40) -> str:
        try:
            with open(os.path.join(self.out_dir, f"{name}.log")) as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""


class SwarmLauncher:
    """The store, lighthouses and peer processes of one job (use ``launch`` for the whole lifecycle)."""

    def __init__(self, cfg: Config, out_dir: str) -> None:

        os.makedirs(out_dir, exist_ok=True)
        if cfg.security.authenticate:  # the run secret: the peers read it from this file (never a command line)
            path = os.path.abspath(cfg.security.secret_file or os.path.join(out_dir, "secret"))
            load_or_create_secret(path)  # (checks an existing one: mode 0600, long enough)
            cfg = dataclasses.replace(cfg, security=dataclasses.replace(cfg.security, secret_file=path))
        use_secret(*rpc_security(cfg))  # this process calls the peers too (the rebalancing thread)
        self.cfg, self.out_dir = cfg, out_dir
        s = cfg.swarm
        # (authenticated: on loopback behind a guard; the peers reach it through their relays: services.py)
        self.store, self.store_port, self._store_guard = store_master(
            s.host, 0, service_secret(cfg), timedelta(seconds=s.startup_timeout_s)
        )
        self.lighthouses: dict[int, object] = {}
        self.procs: list[PeerProc] = []
        self.config_path = os.path.join(out_dir, "config.yaml")
        with open(self.config_path, "w") as f:
            f.write(to_yaml(cfg))

    def lighthouse(self, stage: int) -> str | None:
        """The stage's lighthouse address (started on first use; None for a one-peer stage)."""
        if self.cfg.swarm.peers_per_stage[stage] <= 1 and not self.cfg.swarm.rebalance_period_s:
            return None  # (with rebalancing every stage has a group: a peer may move into a one-peer stage)
        if stage not in self.lighthouses:
            from dilocox.elastic import start_lighthouse
            from dilocox.elastic.lighthouse import quiet_rust_log

            s = self.cfg.swarm
            with quiet_rust_log():
                self.lighthouses[stage] = start_lighthouse(
                    min_replicas=1,
                    bind=f"{s.host}:0",
                    # a live but slower peer of the stage must still join the sync: wait as long as a sync may take
                    join_timeout_ms=int(s.sync_timeout_s * 1000),
                    heartbeat_timeout_ms=2000,
                    secret=service_secret(self.cfg),  # an authenticated job: only its peers (through a relay) reach it
                )
        return self.lighthouses[stage].address()

    def start_peer(
        self, stage: int, index: int, steps: int | None = None, extra: list[str] | None = None, delay_s: float = 0.0
    ) -> PeerProc:
        name = peer_name(stage, index)
        cmd = [
            sys.executable, "-m", "dilocox.swarm.peer", "--config", self.config_path, "--stage", str(stage),
            "--index", str(index), "--store", self.store_addr(), "--out", self.out_dir,
        ]  # fmt: skip
        lh = self.lighthouse(stage)
        if lh:
            cmd += ["--lighthouse", lh]
        if steps is not None:
            cmd += ["--steps", str(steps)]
        if delay_s:
            cmd += ["--delay-s", str(delay_s)]
        cmd += extra or []
        log_path = os.path.join(self.out_dir, f"{name}.log")
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        with open(log_path, "ab") as logf:
            proc = self._spawn(stage, index, cmd, env, logf)
        pp = PeerProc(stage, index, proc, log_path, cmd)
        self.procs.append(pp)
        return pp

    def control_store(self):
        """A store client for the calling thread (the rebalancing thread), able to reach the store and every peer
        (netns.NetnsSwarmLauncher: it moves the thread into the hub's namespace first)."""
        return self.store

    def store_addr(self) -> str:
        """host:port of the address store, as the peers reach it (netns.NetnsSwarmLauncher: in the hub)."""
        return f"{self.cfg.swarm.host}:{self.store_port}"

    def _spawn(self, stage: int, index: int, cmd: list[str], env: dict, logf) -> subprocess.Popen:
        """Start one peer's command in its own session (netns.NetnsSwarmLauncher: inside its namespace)."""
        return spawn(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)

    def wait(self, deadline: float) -> bool:
        """Wait until every peer exited or the deadline (monotonic) passed; True when all exited."""
        while time.monotonic() < deadline:
            if all(p.proc.poll() is not None for p in self.procs):
                return True
            time.sleep(0.1)
        return all(p.proc.poll() is not None for p in self.procs)

    def shutdown(self) -> None:
        for p in self.procs:
            kill_and_reap(p.proc, what="peer")
        for lh in self.lighthouses.values():
            try:
                lh.shutdown()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        self.lighthouses.clear()
        if getattr(self, "_store_guard", None) is not None:
            self._store_guard.close()


def read_results(out_dir: str, names: list[str]) -> tuple[dict[str, dict], dict[str, list[dict]]]:
    peers, records = {}, {}
    for n in names:
        pt = os.path.join(out_dir, f"{n}.pt")
        peers[n] = torch.load(pt, weights_only=True) if os.path.exists(pt) else None  # (tensors, plain values)
        jl = os.path.join(out_dir, f"{n}.jsonl")
        if os.path.exists(jl):
            with open(jl) as f:
                records[n] = [json.loads(line) for line in f if line.strip()]
    return peers, records


def _stage_flags(stage_paces: dict[int, float] | None, stage: int) -> list[str]:
    pace = (stage_paces or {}).get(stage)
    return ["--pace-s", str(pace)] if pace else []


def _check_checkpoints(cfg: Config, out_dir: str, steps: int | None, resume: bool) -> None:
    """``resume``: a complete SWARM checkpoint before the last step must exist; else no earlier run's checkpoint
    may be in the checkpoint dir (``dilocox.swarm.checkpoint``)."""
    from dilocox.swarm import checkpoint as peer_ckpt

    if resume:  # (no complete checkpoint: one line; a finished run: one line, as `dilocox train` says it)
        ckpt = peer_ckpt.checkpoint_dir(cfg, out_dir)
        at, _ = peer_ckpt.pick(ckpt, len(cfg.swarm.peers_per_stage), 0, 0, resplit=True)
        if at >= (steps or cfg.train.steps):
            raise SwarmError(
                f"--resume: the newest checkpoint in {ckpt} is at step {at}, at or past --steps "
                f"{steps or cfg.train.steps}: this run is finished and there is nothing to train; pass a larger --steps"
            )
    else:
        peer_ckpt.refuse_stale(cfg, out_dir)


def _returncodes(procs: list[PeerProc]) -> dict[str, int | None]:
    """Each peer process's exit code (None: still running) by name."""
    rcs = {}
    for i, p in enumerate(procs):  # a restarted peer: its earlier runs are "name#0", "name#1", ...
        earlier = sum(1 for q in procs[:i] if q.name == p.name)
        later = any(q.name == p.name for q in procs[i + 1 :])
        rcs[f"{p.name}#{earlier}" if later else p.name] = p.proc.poll()
    return rcs


def launch(
    cfg: Config,
    out_dir: str,
    peers_per_stage: list[int] | None = None,
    steps: int | None = None,
    timeout_s: float = 300.0,
    dump_grads: tuple[int, ...] = (),
    delays: dict[str, float] | None = None,
    on_started=None,
    delay_serial: bool = False,
    paces: dict[str, float] | None = None,
    peer_args: dict[str, list[str]] | None = None,
    stage_paces: dict[int, float] | None = None,
    launcher: Callable[[Config, str], SwarmLauncher] | None = None,
    rebalancer: bool = True,
    resume: bool = False,
) -> SwarmResult:
    """Run a SWARM job of ``steps`` steps on this host and return what the peers wrote.

    ``peers_per_stage`` overrides ``cfg.swarm.peers_per_stage``; ``delays`` maps a peer name (``s1p0``) to an
    injected delay per microbatch (``delay_serial``: the delay occupies the peer, one microbatch at a time, i.e. a
    slower peer rather than a slower link); ``paces`` maps a peer name to its pace (``--pace-s``: each microbatch
    occupies it for max(pace, its compute) seconds); ``peer_args``: more flags of one peer's command;
    ``stage_paces`` maps a stage to the pace of every peer of it, also of peers moved there by rebalancing
    (``swarm.rebalance_period_s``: a ``mover.Mover`` thread runs beside the job);
    ``on_started(launcher)`` runs once every peer process is started
    (fault tests kill a peer from there). ``launcher(cfg, out_dir)`` makes the job's launcher: ``SwarmLauncher``
    by default (every process on this host's network), or the caller's choice, e.g.
    ``dilocox.swarm.netns.netns_launcher(rate_mbit, peer_rates)``: each peer in its own network namespace behind a
    capped link (the result's ``net_bytes``: each veth's byte counts); this module imports no launcher but its own.
    ``rebalancer=False``: no rebalancing thread here even with ``swarm.rebalance_period_s`` (``dilocox swarm
    rebalance`` in another process moves the peers). ``resume``: every peer starts from the newest complete SWARM
    checkpoint (``dilocox.swarm.checkpoint``); without it a checkpoint dir that holds an earlier run's is refused.
    Every process started here is killed by the end, also on errors and timeouts.
    """
    if peers_per_stage is not None:
        cfg = dataclasses.replace(cfg, swarm=dataclasses.replace(cfg.swarm, peers_per_stage=tuple(peers_per_stage)))
        validate(cfg)  # dataclasses.replace runs __post_init__, but say it: the new counts must be valid
    _check_checkpoints(cfg, out_dir, steps, resume)  # before anything starts
    t0 = time.monotonic()
    la = (launcher or SwarmLauncher)(cfg, out_dir)
    names: list[str] = []
    mover = None
    try:
        extra = ["--dump-grads", ",".join(map(str, dump_grads))] if dump_grads else []
        extra += ["--resume"] if resume else []
        for j, m in enumerate(cfg.swarm.peers_per_stage):
            for k in range(m):
                names.append(peer_name(j, k))
                d = (delays or {}).get(peer_name(j, k), 0.0)
                ex = [*extra, "--delay-serial"] if d and delay_serial else extra
                if (paces or {}).get(peer_name(j, k)):
                    ex = [*ex, "--pace-s", str(paces[peer_name(j, k)])]
                ex = [*ex, *(peer_args or {}).get(peer_name(j, k), [])]  # extra peer flags (tests: --die-mid-step)
                ex = [*ex, *_stage_flags(stage_paces, j)]
                la.start_peer(j, k, steps=steps, extra=ex, delay_s=d)
        if cfg.swarm.rebalance_period_s > 0 and rebalancer:  # (False: another process moves the peers)
            from dilocox.swarm.mover import Mover

            mover = Mover(la, steps, lambda j, k: _stage_flags(stage_paces, j))
            mover.start()
        if on_started is not None:
            on_started(la)
        finished = la.wait(t0 + timeout_s)
        if not finished:
            log.error("swarm job did not finish within %.0fs; killing its peers", timeout_s)
    finally:
        if mover is not None:
            mover.stop()
            mover.join(timeout=15.0)  # its waits check the stop flag; an RPC in flight ends within its timeout
        rcs = _returncodes(la.procs)
        la.shutdown()
    names += [n for n in moved_peers(out_dir) if n not in names]  # moved by rebalancing (this launcher's or not)
    peers, records = read_results(out_dir, names)
    return SwarmResult(out_dir, rcs, time.monotonic() - t0, peers, records, getattr(la, "net_bytes", {}))


def moved_peers(out_dir: str) -> list[str]:
    """The new names of the peers that rebalancing moved (``OUT/rebalance.jsonl``, written by whichever mover ran:
    this launcher's thread or ``dilocox swarm rebalance``)."""
    path = os.path.join(out_dir, "rebalance.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            j = rec.get("joiner")
            if j and j not in out and os.path.exists(os.path.join(out_dir, f"{j}.jsonl")):  # (it ran under that name)
                out.append(j)
    return out


def summarize(res: SwarmResult) -> str:
    """A few lines: exit codes, stage-0 loss first -> last, pipeline bytes per step, sync time."""
    lines = [f"swarm job: {len(res.returncodes)} peers, {res.seconds:.1f}s, out {res.out_dir}"]
    for name, rc in sorted(res.returncodes.items()):
        recs = res.records.get(name, [])
        syncs = [r["sync_s"] for r in recs if "sync_s" in r]  # (a `left` or `joined` record has none)
        line = f"  {name}: exit {rc}, {len([r for r in recs if not r.get('left')])} steps"
        losses = [r["loss"] for r in recs if "loss" in r]
        if losses:
            line += f", loss {losses[0]:.4f} -> {losses[-1]:.4f}"
        sent = [sum(v[0] + v[1] for v in r.get("link_bytes", {}).values()) for r in recs]
        if any(sent):
            line += f", {sum(sent) / len(sent) / 1e6:.3f} MB/step on its links"
        if syncs:
            line += f", sync {sum(syncs) / len(syncs) * 1e3:.1f} ms/step"
        if name in res.net_bytes:  # --netns: what the kernel counted on its veth vs what it counted on its links
            tx, rx = res.net_bytes[name]
            lk = [sum(v[i] for r in recs for v in r.get("link_bytes", {}).values()) for i in (0, 1)]
            line += f"; veth tx {tx / 1e6:.3f} MB rx {rx / 1e6:.3f} MB (links: {lk[0] / 1e6:.3f} / {lk[1] / 1e6:.3f})"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from dilocox.config import load_config

    ap = argparse.ArgumentParser(prog="python -m dilocox.swarm.runtime", description="run a SWARM job on this host")
    ap.add_argument("config")
    ap.add_argument("--out", default=None, help="output directory (default: <log.run_dir>/swarm)")
    ap.add_argument("--steps", type=int, default=None, help="default: train.steps")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="bound on the whole job; then every peer is killed")
    ap.add_argument("overrides", nargs="*", help="--section.key=value")
    a, rest = ap.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    cfg = load_config(a.config, [*a.overrides, *rest])
    res = launch(cfg, a.out or os.path.join(cfg.log.run_dir, "swarm"), steps=a.steps, timeout_s=a.timeout_s)
    print(summarize(res))
    return 0 if all(rc == 0 for rc in res.returncodes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
