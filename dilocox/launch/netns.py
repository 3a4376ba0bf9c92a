"""Emulate R clusters on one host: a network namespace per replica, a bandwidth cap per link.

Topology (what worked on the dev machine; README "Using it" shows `dilocox launch`)::

    ns <tag>-r0: dxv0 198.18.0.1/24 ──veth── dxs0 ┐
    ns <tag>-r1: dxv1 198.18.0.2/24 ──veth── dxs1 ┼─ bridge dxbr in ns <tag>-sw ("the switch")
    ...                                           ┘
    tc tbf on dxv<r> (replica r's upload) and on dxs<r> (its download): rate X each way

Addresses come from 198.18.0.0/15 (RFC 2544, benchmarking) and exist only inside namespaces
this module creates; links are created directly inside them, so nothing appears on the host's
interfaces. Namespace names carry the pid and a counter, so concurrent runs do not clash (namespaces of a dead
run that had this pid, and so our names, are deleted before ours are made).
Traffic between ranks of ONE replica goes to a local address and stays uncapped (as inside a
real cluster); only traffic that crosses the bridge passes the tbf caps.

Cleanup runs on every exit path: ``with`` exit (normal or exception), SIGINT/SIGTERM (handler,
then the previous handler), interpreter exit (atexit), and even SIGKILL of this process: a tiny
shell "reaper" in its own session holds a pipe from us and tears everything down when the pipe
closes. Processes left in a namespace (a killed rank's children, say) are killed first.

Latency: this kernel has no netem. ``Cluster(..., rtt_ms=50, jitter_ms=5, loss=0.001)`` puts the delay switch
(``dilocox/launch/switch.py``, ``csrc/netswitch.cpp``) in the bridge's place: it forwards each frame between the
``dxs<r>`` ports (and ``dxhp``, the hub's port, whose other end ``dxhub`` holds HUB_ADDR) after ``rtt_ms / 2``;
the tbf caps stay where they are. Without these arguments the kernel bridge is used, as before.
``cleanup_stale()`` removes namespaces left by runs whose process no longer exists.
"""

from __future__ import annotations

import atexit
import itertools
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Sequence

from dilocox.distributed.procs import kill_group, spawn

SUBNET = "198.18.0"  # first /24 of 198.18.0.0/15
HUB_ADDR = f"{SUBNET}.254"  # the bridge's own address in the switch namespace (Cluster(hub=True))
# ``ip netns exec NS`` bind-mounts the files of ETC_NETNS/NS over /etc: a hosts file there names every node, so a
# reverse lookup of a peer's address (c10d's TCPStore does one per client) answers inside a namespace, which has no
# route to the host's DNS server; it failed with EAI_AGAIN, and each node printed "[c10d] The hostname of the client
# socket cannot be retrieved. err=-3" per connection (found by review)
ETC_NETNS = "/etc/netns"
_counter = itertools.count()


# The replica namespaces' TCP settings. "wan": what a host tuned for a long fat link runs (ESnet's
# fasterdata host tuning: buffers far above the bandwidth-delay product, which is 18.75 MB at 1 Gbit/s and
# 150 ms; no return to slow start after an idle pause, which a DiLoCo link has between syncs and a
# per-step method between steps). "default": the kernel's own (Linux: slow start again after one RTO idle,
# buffers up to 4-6 MB). Applied per namespace (these sysctls are per network namespace).
TCP_TUNINGS: dict[str, dict[str, str]] = {
    "wan": {
        "net.ipv4.tcp_slow_start_after_idle": "0",
        "net.ipv4.tcp_rmem": "4096 131072 67108864",
        "net.ipv4.tcp_wmem": "4096 16384 67108864",
    },
    "default": {},
}


def switch_argv(ports, rtt_ms, jitter_ms, loss):  # (lazy: the switch module compiles on first use)
    from dilocox.launch.switch import argv

    return argv(ports, rtt_ms, jitter_ms, loss)


def wait_switch_ready(proc, what):
    from dilocox.launch.switch import wait_ready

    wait_ready(proc, what)


_probe: tuple[bool, str] | None = None
_probe_lock = threading.Lock()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run one iproute2 command (``ip`` or ``tc``); raise with its stderr on failure."""
    try:
        p = subprocess.run(list(args), capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`{' '.join(args)}` did not finish within 60 s") from None
    if check and p.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed ({p.returncode}): {p.stderr.strip()}")
    return p


# The emulated links carry IPv4 only. With IPv6 on, every veth sends Router Solicitations for the life of the
# run (70-byte ICMPv6 frames at a backoff of 4, 8, 16 ... s: net.ipv6.conf.*.router_solicitations = -1) and MLD
# reports at link-up: frames that cross a replica link without being dilocox's (they were the "unknown 4-byte
# sender" of test_replicas_quiet: 70 = 66 bytes of Ethernet + IPv4 + TCP headers + 4). Off in every namespace.
IPV6_OFF = ("net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1")


def _add_namespace(name: str) -> None:
    """``ip netns add`` + loopback up + IPv6 off (before any link is made in it; a kernel without IPv6 has
    nothing to turn off)."""
    _ip("ip", "netns", "add", name)
    _ip("ip", "netns", "exec", name, "sysctl", "-q", "-w", *IPV6_OFF, check=False)
    _ip("ip", "-n", name, "link", "set", "lo", "up")


def enter_netns(name: str) -> None:
    """setns(2) the calling thread into the named network namespace (``ip netns`` keeps it in /run/netns)."""
    fd = os.open(os.path.join("/run/netns", name), os.O_RDONLY)
    try:
        if hasattr(os, "setns"):  # Python >= 3.12
            os.setns(fd, os.CLONE_NEWNET)
        else:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
                err = ctypes.get_errno()
                raise OSError(err, f"setns into network namespace {name!r} failed: {os.strerror(err)}")
    finally:
        os.close(fd)


def netns_available() -> tuple[bool, str]:
    """(True, "") when namespaces + veth + tbf can be created here, else (False, why). Cached; one probe per process
    (threads that ask at once wait for it: they shared one probe name, and a loser's "File exists" was cached)."""
    global _probe
    with _probe_lock:
        if _probe is None:
            _probe = _run_probe()
    return _probe


def _run_probe() -> tuple[bool, str]:
    if os.name != "posix" or os.geteuid() != 0:
        return (False, "not running as root (network namespaces need CAP_NET_ADMIN)")
    if not shutil.which("ip") or not shutil.which("tc"):
        return (False, "iproute2's `ip`/`tc` not found")
    name = f"dilocox-{os.getpid()}-probe"
    _ip("ip", "netns", "del", name, check=False)  # left by a dead process that had our pid (only we use the name)
    p = _ip("ip", "netns", "add", name, check=False)
    if p.returncode != 0:
        return (False, f"`ip netns add` failed: {p.stderr.strip()}")
    try:  # the links and caps a Cluster makes (a kernel or container may lack the veth or sch_tbf module)
        for cmd in (
            ("ip", "-n", name, "link", "add", "dxpa", "type", "veth", "peer", "name", "dxpb"),
            ("tc", "-n", name, "qdisc", "add", "dev", "dxpa", "root", "tbf", "rate", "1mbit", "burst", "65536",
             "latency", "100ms"),
        ):  # fmt: skip
            p = _ip(*cmd, check=False)
            if p.returncode != 0:
                return (False, f"`{' '.join(cmd[:1] + cmd[3:])}` failed: {p.stderr.strip()}")
        return (True, "")
    finally:
        _ip("ip", "netns", "del", name, check=False)


def _check_values(rate_mbit, per, burst_bytes, latency_ms, rtt_ms, jitter_ms, loss) -> None:
    """ValueError naming the field for a cap, queue bound, delay or loss that tc / the delay switch cannot honour (a
    negative or NaN delay or loss used to turn the delay switch off without a word; a negative tbf latency wrapped to
    859 s, an infinite rate raised OverflowError)."""
    for r, m in enumerate([rate_mbit, *per]):
        what = "rate_mbit" if r == 0 else f"rates_mbit[{r - 1}]"
        if m is not None and not (m > 0 and math.isfinite(m)):
            raise ValueError(f"{what}={m} must be > 0 and finite (or None for no cap)")
        if m is not None and m * 1e6 < 1.0:
            raise ValueError(f"{what}={m} Mbit/s is below tc's smallest rate (1 bit/s); the unit is Mbit/s")
    if burst_bytes is not None and not (isinstance(burst_bytes, int) and burst_bytes >= 0):
        raise ValueError(f"burst_bytes={burst_bytes!r} must be an int >= 0 (None or 0: the default)")
    if not (latency_ms > 0 and math.isfinite(latency_ms)):
        raise ValueError(f"latency_ms={latency_ms} (tbf's queue bound) must be a finite number > 0")
    for what, v in (("rtt_ms", rtt_ms), ("jitter_ms", jitter_ms)):
        if not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"{what}={v} must be a finite number >= 0 (milliseconds)")
    if jitter_ms > rtt_ms:
        raise ValueError(f"jitter_ms={jitter_ms} is larger than rtt_ms={rtt_ms}: the spread must fit in the delay")
    if not 0 <= loss < 1:
        raise ValueError(f"loss={loss} must be a probability in [0, 1)")


class Cluster:
    """R emulated clusters joined by capped links. Use as a context manager.

    ``rate_mbit`` caps each replica's link in each direction (None = uncapped); ``rates_mbit``
    (one entry per replica, None = ``rate_mbit``) gives replicas caps of their own (heterogeneous
    links); ``burst_bytes`` defaults to max(64 KiB, 2 ms at the link's rate); ``latency_ms`` bounds
    the tbf queue.
    ``stop_grace_s``: on close (or SIGINT/SIGTERM), how long the processes started with
    ``exec`` get after SIGTERM to save a checkpoint and exit before they are SIGKILLed.
    """

    def __init__(
        self,
        n_replicas: int,
        rate_mbit: float | None = None,
        *,
        burst_bytes: int | None = None,
        latency_ms: float = 100.0,
        stop_grace_s: float = 3.0,
        hub: bool = False,
        rates_mbit: Sequence[float | None] | None = None,
        rtt_ms: float = 0.0,
        jitter_ms: float = 0.0,
        loss: float = 0.0,
        tcp_tuning: str = "wan",
    ) -> None:
        if tcp_tuning not in TCP_TUNINGS:
            raise ValueError(f"tcp_tuning={tcp_tuning!r} is not one of {sorted(TCP_TUNINGS)}")
        if not 1 <= n_replicas <= 250:
            raise ValueError(f"n_replicas={n_replicas} must be in [1, 250] (one /24 of 198.18.0.0/15)")
        if rates_mbit is not None and len(rates_mbit) != n_replicas:
            raise ValueError(f"rates_mbit has {len(rates_mbit)} entries for {n_replicas} replicas (one each)")
        per = list(rates_mbit) if rates_mbit is not None else [None] * n_replicas
        _check_values(rate_mbit, per, burst_bytes, latency_ms, rtt_ms, jitter_ms, loss)
        self.n = n_replicas
        self.rate_bps = None if rate_mbit is None else float(rate_mbit) * 1e6
        # each replica's cap (bits/s, None: uncapped) and its tbf burst
        self.rates_bps = [self.rate_bps if m is None else float(m) * 1e6 for m in per]
        self.bursts = [burst_bytes or (max(65536, int(b / 8 * 0.002)) if b else 0) for b in self.rates_bps]
        self.latency_ms = latency_ms  # tbf's queue bound (not a delay)
        # the delay switch (dilocox/launch/switch.py) in place of the bridge: round trip added between any two sites
        self.rtt_ms, self.jitter_ms, self.loss = float(rtt_ms), float(jitter_ms), float(loss)
        self.delayed = self.rtt_ms > 0 or self.jitter_ms > 0 or self.loss > 0
        self.tcp_tuning = tcp_tuning  # the replica namespaces' TCP settings (TCP_TUNINGS)
        self._switch: subprocess.Popen | None = None
        self.stop_grace_s = stop_grace_s
        self.hub = hub  # True: the bridge gets HUB_ADDR, so a service in the switch namespace (exec_hub) is reachable
        self.tag = f"dilocox-{os.getpid()}-{next(_counter)}"
        self.switch = f"{self.tag}-sw"
        self._procs: list[subprocess.Popen] = []
        self._reaper: subprocess.Popen | None = None
        self._prev_handlers: dict[int, object] = {}
        self._up = False

    # names and addresses ----------------------------------------------------------------
    def ns(self, r: int) -> str:
        return f"{self.tag}-r{self._check(r)}"

    def addr(self, r: int) -> str:
        return f"{SUBNET}.{self._check(r) + 1}"

    def ifname(self, r: int) -> str:
        """The replica's veth inside its namespace (set GLOO_SOCKET_IFNAME to this)."""
        return f"dxv{self._check(r)}"

    def namespaces(self) -> list[str]:
        return [self.ns(r) for r in range(self.n)] + [self.switch]

    def _check(self, r: int) -> int:
        if not 0 <= r < self.n:
            raise IndexError(f"replica {r} out of range [0, {self.n})")
        return r

    # lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        if self._up or self._reaper is not None:
            raise RuntimeError(f"Cluster {self.tag} was already started; create a new Cluster")
        ok, why = netns_available()
        if not ok:
            raise RuntimeError(f"cannot emulate clusters with network namespaces: {why}")
        self._remove_leftovers()
        self._start_reaper()
        self._install_handlers()
        atexit.register(self.close)
        self._up = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        sw = self.switch
        _add_namespace(sw)
        if self.delayed:  # the delay switch forwards between the ports; the hub is one more port (veth dxhub-dxhp)
            argv_sw = switch_argv([], self.rtt_ms, self.jitter_ms, self.loss)  # (checks the values, builds it)
            if self.hub:
                _ip("ip", "-n", sw, "link", "add", "dxhub", "type", "veth", "peer", "name", "dxhp")
                _ip("ip", "-n", sw, "addr", "add", f"{HUB_ADDR}/24", "dev", "dxhub")
                _ip("ip", "-n", sw, "link", "set", "dxhub", "up")
                _ip("ip", "-n", sw, "link", "set", "dxhp", "up")
        else:
            _ip("ip", "-n", sw, "link", "add", "dxbr", "type", "bridge")
            _ip("ip", "-n", sw, "link", "set", "dxbr", "up")
            if self.hub:
                _ip("ip", "-n", sw, "addr", "add", f"{HUB_ADDR}/24", "dev", "dxbr")
        for r in range(self.n):
            ns, inner, outer = self.ns(r), self.ifname(r), f"dxs{r}"
            _add_namespace(ns)
            _ip("ip", "link", "add", inner, "netns", ns, "type", "veth", "peer", "name", outer, "netns", sw)
            if self.delayed:
                _ip("ip", "-n", sw, "link", "set", outer, "up")
            else:
                _ip("ip", "-n", sw, "link", "set", outer, "master", "dxbr", "up")
            _ip("ip", "-n", ns, "addr", "add", f"{self.addr(r)}/24", "dev", inner)
            _ip("ip", "-n", ns, "link", "set", inner, "up")
            sysctls = TCP_TUNINGS[self.tcp_tuning]
            if sysctls:
                _ip("ip", "netns", "exec", ns, "sysctl", "-q", "-w", *(f"{k}={v}" for k, v in sysctls.items()))
            if self.rates_bps[r]:
                for where, dev in ((ns, inner), (sw, outer)):
                    _ip(
                        "tc",
                        "-n",
                        where,
                        "qdisc",
                        "add",
                        "dev",
                        dev,
                        "root",
                        "tbf",
                        "rate",
                        f"{int(self.rates_bps[r])}bit",
                        "burst",
                        str(self.bursts[r]),
                        "latency",
                        f"{self.latency_ms:g}ms",
                    )
        self._write_hosts()
        if self.delayed:
            ports = [f"dxs{r}" for r in range(self.n)] + (["dxhp"] if self.hub else [])
            self._switch = spawn(
                ["ip", "netns", "exec", sw, *argv_sw, *ports], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            wait_switch_ready(self._switch, sw)  # (it stops with the namespace: the teardown kills its processes)

    def _write_hosts(self) -> None:
        """ETC_NETNS/<ns>/hosts for each namespace: the host's own entries, then every node's address and name."""
        try:
            with open("/etc/hosts") as f:
                base = f.read()
        except OSError:
            base = "127.0.0.1 localhost\n"
        named = [(self.addr(r), self.ns(r)) for r in range(self.n)] + [(HUB_ADDR, self.switch)] * self.hub
        named.append(("127.0.0.1", "localhost"))  # (its IPv4-mapped form: c10d's server sockets are dual-stack)
        nodes = [f"{a} {name}" for a, name in named[:-1]] + [f"::ffff:{a} {name}" for a, name in named]
        text = base.rstrip("\n") + "\n# dilocox.launch.netns: the emulated nodes\n" + "\n".join(nodes) + "\n"
        for ns in self.namespaces():
            os.makedirs(os.path.join(ETC_NETNS, ns), exist_ok=True)
            with open(os.path.join(ETC_NETNS, ns, "hosts"), "w") as f:
                f.write(text)

    def _remove_leftovers(self) -> None:
        """Delete namespaces that already carry our names: a dead run's whose pid this process now has (its
        launcher and reaper SIGKILLed together, say by a cgroup kill); ``ip netns add`` would fail on them. No live
        run can own them: the names hold our pid and a counter value this process hands out once."""
        listed = {line.split(" ")[0] for line in _ip("ip", "netns", "list", check=False).stdout.splitlines()}
        if listed & set(self.namespaces()):
            subprocess.run(["sh", "-c", self._teardown_script()], capture_output=True, timeout=120)

    def _teardown_script(self) -> str:
        """Shell commands that kill every process in our namespaces and delete them (idempotent)."""
        lines = []
        for ns in self.namespaces():
            lines.append(f"for p in $(ip netns pids {ns} 2>/dev/null); do kill -9 $p 2>/dev/null; done")
        lines += [f"ip -n {self.switch} link del dxs{r} 2>/dev/null" for r in range(self.n)]
        lines.append(f"ip -n {self.switch} link del dxhub 2>/dev/null")
        lines += [f"ip netns del {ns} 2>/dev/null" for ns in self.namespaces()]
        lines += [f"rm -rf {ETC_NETNS}/{ns}" for ns in self.namespaces()]
        return "\n".join(lines) + "\ntrue\n"

    def _start_reaper(self) -> None:
        # Reads its stdin until EOF (our exit, however it happens), then tears everything down.
        script = "cat >/dev/null 2>&1\n" + self._teardown_script()
        self._reaper = spawn(
            ["sh", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread; atexit + reaper still apply
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._prev_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        prev = self._prev_handlers.get(signum, signal.SIG_DFL)
        self.close()
        if callable(prev):
            prev(signum, frame)  # e.g. Python's default SIGINT handler raises KeyboardInterrupt
        elif prev != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def close(self) -> None:
        """Kill our processes, delete namespaces, links and qdiscs. Safe to call repeatedly."""
        up, self._up = self._up, False
        if not up:
            return
        main = threading.current_thread() is threading.main_thread()
        if main:  # a second Ctrl-C must not interrupt the teardown; it is delivered afterwards
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            self._teardown()
        finally:
            if main:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})

    def _teardown(self) -> None:
        asked = False
        for p in self._procs:  # ask politely first (torchrun forwards SIGTERM to its workers, which save)
            if p.poll() is None:
                kill_group(p.pid, signal.SIGTERM)
                asked = True
        if asked and self.stop_grace_s > 3.0:
            print(
                f"dilocox launch: stopping: the ranks save a checkpoint and exit (up to {self.stop_grace_s:.0f} s), "
                f"then the namespaces are deleted",
                file=sys.stderr,
                flush=True,
            )
        deadline = time.monotonic() + self.stop_grace_s
        for p in self._procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_group(p.pid, signal.SIGKILL)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:  # (uninterruptible in the kernel: the namespaces go regardless)
                    print(f"dilocox launch: pid {p.pid} outlived SIGKILL by 10 s", file=sys.stderr, flush=True)
        try:
            subprocess.run(["sh", "-c", self._teardown_script()], capture_output=True, timeout=120)
        except subprocess.TimeoutExpired:  # (the reaper below runs the teardown once more)
            print("dilocox launch: deleting the namespaces took over 120 s", file=sys.stderr, flush=True)
        if self._switch is not None:  # killed with the namespace's processes just above
            try:
                self._switch.wait(timeout=10)
            except subprocess.TimeoutExpired:
                kill_group(self._switch.pid, signal.SIGKILL)
        if self._reaper is not None:
            self._reaper.stdin.close()  # the reaper re-runs the (now empty) teardown and exits
            try:
                self._reaper.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._reaper.kill()
        for sig, prev in self._prev_handlers.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, prev)
        self._prev_handlers.clear()
        atexit.unregister(self.close)

    # use --------------------------------------------------------------------------------
    def exec(self, r: int, argv: Sequence[str], **popen_kw: object) -> subprocess.Popen:
        """Start ``argv`` inside replica r's namespace, in its own session (killed on close)."""
        if not self._up:
            raise RuntimeError("Cluster is not running: use it inside `with Cluster(...) as c:`")
        p = spawn(["ip", "netns", "exec", self.ns(r), *argv], **popen_kw)
        self._procs.append(p)
        return p

    def exec_hub(self, argv: Sequence[str], **popen_kw: object) -> subprocess.Popen:
        """Start ``argv`` in the switch namespace (reachable at HUB_ADDR from every replica with ``hub=True``;
        e.g. the elastic lighthouse); its own session, killed on close like ``exec``."""
        if not self._up or not self.hub:
            raise RuntimeError("exec_hub needs a running Cluster(..., hub=True)")
        p = spawn(["ip", "netns", "exec", self.switch, *argv], **popen_kw)
        self._procs.append(p)
        return p

    def enter_hub(self) -> None:
        """Move the CALLING THREAD into the switch namespace (setns(2) changes one thread's network namespace; the
        other threads of this process stay where they are): its sockets then reach HUB_ADDR and every replica."""
        if not self._up or not self.hub:
            raise RuntimeError("enter_hub needs a running Cluster(..., hub=True)")
        enter_netns(self.switch)

    def _stat(self, r: int, which: str) -> int:
        path = f"/sys/class/net/{self.ifname(r)}/statistics/{which}"
        return int(_ip("ip", "netns", "exec", self.ns(r), "cat", path).stdout)

    def tx_bytes(self, r: int) -> int:
        """Bytes replica r has sent over its link (its veth's tx counter, L2 headers included)."""
        return self._stat(r, "tx_bytes")

    def rx_bytes(self, r: int) -> int:
        return self._stat(r, "rx_bytes")

    def tx_packets(self, r: int) -> int:
        """Frames replica r has sent (a GSO frame counts once and carries one set of headers)."""
        return self._stat(r, "tx_packets")


def cleanup_stale() -> list[str]:
    """Delete ``dilocox-<pid>-*`` namespaces whose creating process is gone; return their names."""
    listed = _ip("ip", "netns", "list", check=False).stdout.split("\n")
    stale = []
    for line in listed:
        name = line.split(" ")[0]
        m = re.fullmatch(r"dilocox-(\d+)-(?:\d+-(?:r\d+|sw)|probe)", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            stale.append(name)
    script = "".join(
        f"for p in $(ip netns pids {ns}); do kill -9 $p; done; ip netns del {ns}; rm -rf {ETC_NETNS}/{ns}\n"
        for ns in stale
    )
    if script:
        subprocess.run(["sh", "-c", script], capture_output=True, timeout=120)
    return stale
