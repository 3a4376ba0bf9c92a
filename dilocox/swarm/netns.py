"""``dilocox swarm --netns [--rate 100mbit]``: every SWARM peer in its own network namespace, behind its own capped
link (issue 11 point 7).

Topology (``dilocox.launch.netns.Cluster`` with one member per peer, ``hub=True``)::

    ns ...-r0 (s0p0, 198.18.0.1) ─veth─┐
    ns ...-r1 (s0p1, 198.18.0.2) ─veth─┼─ bridge in ns ...-sw (198.18.0.254): the address store + the lighthouses
    ns ...-r2 (s1p0, 198.18.0.3) ─veth─┤
    ns ...-r3 (s1p1, 198.18.0.4) ─veth─┘   tc tbf of --rate on each veth, both ways

Peer r (stages in order, then index) runs in namespace r, binds and advertises its namespace's address
(``--swarm.host``) and uses its veth for gloo (``GLOO_SOCKET_IFNAME``). The address store (a TCPStore) and one torchft
lighthouse per multi-peer stage run in ONE process in the switch namespace (``python -m dilocox.swarm.netns hub``),
reachable at ``HUB_ADDR`` from every peer; its traffic crosses the capped links like the peers' own. Every process
and namespace goes at the end (Cluster's teardown: ``with``/close, SIGINT/SIGTERM handlers, atexit, a reaper that
outlives a SIGKILLed launcher). The kernel's byte counters of each peer's veth are read before the teardown and
printed beside the bytes the peers counted on their pipeline links (``SwarmResult.net_bytes``).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Callable

from dilocox.config import Config, load_config
from dilocox.launch.netns import HUB_ADDR, Cluster, netns_available
from dilocox.swarm.common import peer_name
from dilocox.swarm.runtime import SwarmLauncher
from dilocox.swarm.services import service_secret, store_client, store_master

log = logging.getLogger("dilocox.swarm.netns")

STORE_PORT = 29400  # in the switch namespace (fresh, so a fixed port is free)
HUB_START_S = 60.0  # the hub process prints its addresses within this (torch + torchft import included)
HUB_EXIT_S = 10.0  # its output ended without the addresses: its exit code comes within this (see ready_line)
POLL_S = 0.2  # while waiting for the ready line: how often to check that the hub still runs


class HubStartError(RuntimeError):
    """The hub process (store + lighthouses) did not come up: the CLI prints it in one line (with the hub log's last
    line), exit 1; the namespaces are gone by then."""


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no iproute2): the CLI prints it in one line, exit 2."""


def peer_slots(pps: list[int]) -> dict[str, int]:
    """Peer name -> its namespace's index (stage by stage, then index): ``[2, 2]`` -> s0p0 0, s0p1 1, s1p0 2, ..."""
    slots: dict[str, int] = {}
    for j, m in enumerate(pps):
        for k in range(m):
            slots[peer_name(j, k)] = len(slots)
    return slots


class NetnsSwarmLauncher(SwarmLauncher):
    """``SwarmLauncher`` whose peers each run in a network namespace (see the module doc). ``rate_mbit``: the tbf cap
    of every peer's link in each direction (None: uncapped)."""

    def __init__(
        self,
        cfg: Config,
        out_dir: str,
        rate_mbit: float | None = None,
        peer_rates: dict[str, float] | None = None,
        delay: tuple[float, float, float] = (0.0, 0.0, 0.0),
    ) -> None:
        ok, why = netns_available()
        if not ok:
            raise NetnsUnavailable(f"--netns: network namespaces are unavailable here: {why}")
        slots = peer_slots(list(cfg.swarm.peers_per_stage))
        unknown = sorted(set(peer_rates or {}) - set(slots))
        if unknown:
            raise ValueError(f"peer rate for {unknown[0]}: no such peer among {list(slots)}")
        super().__init__(cfg, out_dir)  # (its loopback store stays unused: the peers use the hub's)
        self.slots = slots
        self.net_bytes: dict[str, tuple[int, int]] = {}  # peer -> (veth tx, veth rx) bytes, read at shutdown
        rates = [(peer_rates or {}).get(n) for n in slots]  # slot order; None: rate_mbit
        rtt_ms, jitter_ms, loss = delay  # the delay switch (--latency/--jitter/--loss; dilocox.launch.switch)
        self.cluster = Cluster(
            len(slots), rate_mbit, hub=True, stop_grace_s=1.0, rates_mbit=rates, rtt_ms=rtt_ms, jitter_ms=jitter_ms,
            loss=loss,
        )  # fmt: skip
        self.cluster.start()
        try:
            self._start_hub()
        except BaseException:
            self.cluster.close()
            raise
        c = self.cluster
        links = f"{rate_mbit:g} Mbit/s (tc tbf)" if rate_mbit else "uncapped"
        if peer_rates:
            links += "; " + ", ".join(f"{n} {m:g} Mbit/s" for n, m in sorted(peer_rates.items()))
        log.info(
            "--netns: %d peers in namespaces %s-r0..r%d (%s), store %s and lighthouses %s in %s; links %s each way",
            c.n, c.tag, c.n - 1, ", ".join(f"{n} {c.addr(r)}" for n, r in self.slots.items()), self.hub_store,
            self.hub_lighthouses, c.switch, links,
        )  # fmt: skip

    def _start_hub(self) -> None:
        s = self.cfg.swarm  # (a lighthouse per multi-peer stage; with rebalancing every stage: peers may move in)
        multi = [j for j, m in enumerate(s.peers_per_stage) if m > 1 or s.rebalance_period_s > 0]
        argv = [
            sys.executable, "-m", "dilocox.swarm.netns", "hub", "--config", self.config_path, "--bind", HUB_ADDR,
            "--store-port", str(STORE_PORT), "--stages", ",".join(map(str, multi)),
        ]  # fmt: skip
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        with open(os.path.join(self.out_dir, "hub.log"), "ab") as err:
            self.hub = self.cluster.exec_hub(argv, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        line, why = ready_line(self.hub, HUB_START_S, "addresses")
        try:
            got = json.loads(line) if line is not None else None
            store, lhs = got["store"], {int(j): a for j, a in got["lighthouses"].items()}
        except (ValueError, TypeError, KeyError, AttributeError):
            if line is not None:
                why = f"printed {line.strip()[:200]!r} instead of its addresses"
            raise HubStartError(f"the swarm hub (store + lighthouses) {why}{_last_line(self.out_dir)}") from None
        self.hub_store, self.hub_lighthouses = store, lhs

    # hooks of SwarmLauncher ------------------------------------------------------------------------------------
    def store_addr(self) -> str:
        return self.hub_store

    def lighthouse(self, stage: int) -> str | None:
        return self.hub_lighthouses.get(stage)

    def control_store(self):
        """The rebalancing thread's store client: the thread enters the switch namespace (setns, that thread only),
        from where the hub's store and every peer's address are reachable."""
        self.cluster.enter_hub()
        host, _, port = self.hub_store.rpartition(":")
        timeout = timedelta(seconds=self.cfg.swarm.startup_timeout_s)
        return store_client(host, int(port), service_secret(self.cfg), timeout)

    def _spawn(self, stage: int, index: int, cmd: list[str], env: dict, logf) -> subprocess.Popen:
        r = self.slots[peer_name(stage, index)]
        env = dict(env, GLOO_SOCKET_IFNAME=self.cluster.ifname(r))
        cmd = [*cmd, "--", f"--swarm.host={self.cluster.addr(r)}"]  # (after --: the peer's config overrides)
        return self.cluster.exec(r, cmd, env=env, stdout=logf, stderr=subprocess.STDOUT)

    def shutdown(self) -> None:
        try:
            super().shutdown()
            if self.cluster._up:  # (a signal handler may have torn the namespaces down already)
                for name, r in self.slots.items():
                    try:
                        self.net_bytes[name] = (self.cluster.tx_bytes(r), self.cluster.rx_bytes(r))
                    except RuntimeError:
                        pass
        finally:
            self.cluster.close()


def netns_launcher(
    rate_mbit: float | None = None,
    peer_rates: dict[str, float] | None = None,
    delay: tuple[float, float, float] = (0.0, 0.0, 0.0),
) -> Callable[[Config, str], NetnsSwarmLauncher]:
    """The ``launcher`` argument of ``dilocox.swarm.runtime.launch`` that puts every peer in its own namespace:
    links capped at ``rate_mbit`` each way (None: uncapped), ``peer_rates`` (peer name -> Mbit/s) a peer's own cap,
    ``delay`` = (round trip ms, jitter ms, loss probability) added by the delay switch between any two peers."""
    return functools.partial(NetnsSwarmLauncher, rate_mbit=rate_mbit, peer_rates=peer_rates, delay=delay)


def ready_line(
    proc: subprocess.Popen, start_s: float, what: str = "ready line", exit_s: float = HUB_EXIT_S
) -> tuple[str | None, str]:
    """``(line, "")``: the first line ``proc`` printed on its stdout (a text pipe) within ``start_s``; later lines
    are read and dropped (the pipe never fills). Else ``(None, why)``, every wait bounded:

    - ``exited with code N``: its output ended (EOF) and it exited. A process's pipe closes while it exits, a moment
      before its exit code can be collected, so after EOF the exit code is awaited up to ``exit_s`` (a ``poll()``
      right at EOF may still see it running); or it exited while something else (a child of its) holds its
      output open: checked every ``POLL_S``, so that is reported at once too, not after ``start_s``;
    - ``closed its output without printing <what> but was still running Ns later``: EOF, no exit within ``exit_s``;
    - ``printed no <what> within Ns``: it runs and printed nothing for ``start_s``.
    """
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True, name=f"ready-line-{proc.pid}").start()
    deadline = time.monotonic() + start_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None, f"printed no {what} within {start_s:g}s"
        try:
            line = lines.get(timeout=min(POLL_S, left))
        except queue.Empty:
            rc = proc.poll()
            if rc is not None:  # exited; its output is still open (held by another process) or EOF is on its way
                return None, f"exited with code {rc}"
            continue
        if line is not None:
            return line, ""
        try:  # EOF: it is exiting (or closed its stdout): its exit code, bounded
            return None, f"exited with code {proc.wait(timeout=exit_s)}"
        except subprocess.TimeoutExpired:
            return None, f"closed its output without printing {what} but was still running {exit_s:g}s later"


def _last_line(out_dir: str) -> str:
    """``: <the hub log's last line> (OUT/hub.log)`` (the error of a hub that died), or just where the log is."""
    path = os.path.join(out_dir, "hub.log")
    try:
        with open(path, errors="replace") as f:
            lines = [x.strip() for x in f if x.strip()]
    except OSError:
        lines = []
    return f": {lines[-1][:300]} ({path})" if lines else f" (see {path})"


def hub_main(argv: list[str]) -> int:
    """The switch namespace's process: the job's TCPStore and a lighthouse per listed stage; prints one JSON line
    ``{"store": "H:P", "lighthouses": {"j": "http://H:P"}}`` once all listen, then serves until SIGTERM/--max-s."""
    from dilocox.elastic import start_lighthouse

    ap = argparse.ArgumentParser(prog="python -m dilocox.swarm.netns hub")
    ap.add_argument("--config", required=True)
    ap.add_argument("--bind", required=True)
    ap.add_argument("--store-port", type=int, required=True)
    ap.add_argument("--stages", default="", help="stages that get a lighthouse, e.g. 0,1")
    ap.add_argument("--max-s", type=float, default=7 * 86400.0)
    a = ap.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    cfg = load_config(a.config)
    s, secret = cfg.swarm, service_secret(cfg)  # an authenticated job: store and lighthouses behind guards
    store, store_port, _guard = store_master(a.bind, a.store_port, secret, timedelta(seconds=s.startup_timeout_s))
    lhs = {}
    for j in (int(x) for x in a.stages.split(",") if x.strip()):
        lhs[j] = start_lighthouse(
            min_replicas=1,
            bind=f"{a.bind}:0",
            join_timeout_ms=int(s.sync_timeout_s * 1000),  # as SwarmLauncher.lighthouse
            heartbeat_timeout_ms=2000,
            secret=secret,  # an authenticated job: behind a guard, as SwarmLauncher.lighthouse
        )
    addrs = {j: f"http://{a.bind}:{lh.address().rsplit(':', 1)[1]}" for j, lh in lhs.items()}
    print(json.dumps({"store": f"{a.bind}:{store_port}", "lighthouses": addrs}), flush=True)
    stop.wait(timeout=a.max_s)
    for lh in lhs.values():
        lh.shutdown()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["hub"]:
        sys.exit(hub_main(sys.argv[2:]))
    sys.exit("usage: python -m dilocox.swarm.netns hub --config C --bind H --store-port P [--stages 0,1]")
