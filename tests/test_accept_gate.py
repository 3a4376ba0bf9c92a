"""Issue 42 item 2: no lock-out by strangers before authentication.

Every accept loop of a run hands its handshake slots out through one ``secure.AcceptGate``: at most 4 connections
of one address (an IPv6 /64) that has not proven the secret are in their handshake at a time, a connection over its
cap is closed at once (``BUSY``, never queued), each handshake ends within ``security.handshake_s`` (2 s by
default), and addresses that proved the secret before (or are named members) keep reserved slots. Before, each
loop had one global pool (32 slots, 8 for the heal transport) held up to 5 s each: 300 silent connections from one
address made a secret holder's handshake time out after 18-22 s.

The flood test runs each kind of server (the victim) in a subprocess under a time bound; the attacker is 127.0.0.2,
the honest secret holder 127.0.0.1 (both loopback).
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
import time

import pytest

from dilocox.net.secure import BUSY, HANDSHAKE_S, AcceptGate, dial, handshake_s, set_handshake_s

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = bytes(range(32))

VICTIM = r"""
import socket, sys, threading
kind = sys.argv[1]
SECRET = bytes(range(32))
if kind == "rpc":
    from dilocox.net.rpc import RpcServer
    srv = RpcServer(lambda m, meta, t: ({"pong": 1}, {}), host="127.0.0.1", secret=SECRET)
    port = int(srv.addr.rsplit(":", 1)[1])
elif kind == "state":
    from dilocox.net.transfer import StateTransport
    srv = StateTransport("127.0.0.1", 5.0, SECRET)
    port = int(srv.metadata().rsplit(":", 1)[1])
elif kind in ("lighthouse", "store", "manager"):
    from dilocox.net.relay import LighthouseGuard
    up = socket.create_server(("127.0.0.1", 0))
    srv = LighthouseGuard(("127.0.0.1", 0), up.getsockname(), SECRET, kind)
    port = srv.port
elif kind == "mesh":
    from dilocox.net.mesh import PairServer
    srv = PairServer("127.0.0.1", SECRET, False)
    port = int(srv.addr.rsplit(":", 1)[1])
print(port, flush=True)
sys.stdin.read()  # until the test closes our stdin (or kills us)
"""

SERVICE = {"rpc": "swarm-rpc", "state": "state", "lighthouse": "lighthouse", "store": "store", "manager": "manager",
           "mesh": "mesh"}  # fmt: skip


def _start_victim(kind: str) -> tuple[subprocess.Popen, int]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen(
        [sys.executable, "-c", VICTIM, kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=ROOT
    )
    ready, _, _ = select.select([p.stdout], [], [], 60)
    if not ready:
        p.kill()
        p.wait(10)
        raise TimeoutError(f"the {kind} victim did not start within 60 s")
    return p, int(p.stdout.readline())


def _flood(src: str, port: int, n: int) -> list[socket.socket]:
    """``n`` silent connections to 127.0.0.1:``port`` from ``src`` (kept open: each holds what the server gives it)."""
    out = []
    for _ in range(n):
        s = socket.socket()
        s.settimeout(5)
        s.bind((src, 0))
        s.connect(("127.0.0.1", port))
        out.append(s)
    return out


def _turned_away(socks: list[socket.socket], within: float) -> int:
    """How many of ``socks`` the server closed (BUSY then EOF) within ``within`` s of now."""
    n, deadline = 0, time.monotonic() + within
    for s in socks:
        s.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            got = s.recv(64)
            n += got in (b"", BUSY)
        except OSError:  # (a timeout: the server still holds it, in a handshake slot)
            pass
    return n


def _honest(port: int, service: str) -> float:
    """Seconds a secret holder on 127.0.0.1 takes to complete the handshake (raises past 10 s)."""
    t0 = time.monotonic()
    sock, _, _ = dial(("127.0.0.1", port), SECRET, service, time.monotonic() + 10.0)
    sock.close()
    return time.monotonic() - t0


@pytest.mark.parametrize("kind", ["rpc", "state", "lighthouse", "mesh"])
def test_a_flood_from_one_address_does_not_lock_a_secret_holder_out(kind):
    victim, port = _start_victim(kind)
    socks: list[socket.socket] = []
    try:
        # 1. 300 silent connections from one address; the honest holder (never seen before) is served at once
        socks = _flood("127.0.0.2", port, 300)
        took = _honest(port, SERVICE[kind])
        # (< 5 s: a SYN dropped from a full backlog is resent after 1 s, then a starved victim drains the queue; the
        # lock-out this guards against took 18-22 s)
        assert took < 5.0, f"{kind}: a secret holder's handshake took {took:.2f} s under a flood from one address"
        away = _turned_away(socks[-250:], within=0.5)  # over the cap of 4: closed at once, not queued (a few more
        assert away >= 240, f"{kind}: {away} of the last 250 flood connections closed within 0.5 s"  # get a slot
        # as the first ones' 2 s run out while the flood is opened)
        for s in socks:
            s.close()
        # 2. the holder has proven the secret; strangers on 20 addresses fill every slot they may take: the reserved
        # ones still serve it
        socks = [s for i in range(3, 23) for s in _flood(f"127.0.0.{i}", port, 8)]
        took = _honest(port, SERVICE[kind])
        assert took < 5.0, f"{kind}: a proven holder's handshake took {took:.2f} s under a flood from 20 addresses"
    finally:
        for s in socks:
            s.close()
        victim.stdin.close()
        try:
            victim.wait(10)
        except subprocess.TimeoutExpired:
            victim.kill()
            victim.wait(10)


def test_accept_gate_caps_per_address_and_reserves_slots_for_proven_and_member_addresses():
    g = AcceptGate(per_address=4, total=8, reserved=2, per_member=6)
    a = [g.admit("10.0.0.1") for _ in range(5)]
    assert all(a[:4]) and a[4] is None  # 4 per stranger address
    b = [g.admit("10.0.0.2") for _ in range(4)]
    assert all(b) and g.admit("10.0.0.3") is None  # the strangers' pool (8) is full
    # a member (trusted) and an address that proved the secret get the reserved slots
    g.trust(["10.0.0.9"])
    m = g.admit("10.0.0.9")
    assert m is not None
    g.release(a[0], proven=True)  # 10.0.0.1 proved the secret: from now on it is known
    p = g.admit("::ffff:10.0.0.1")  # (an IPv4 client of a dual-stack socket: the same address)
    assert p is not None and p[1] is True
    assert g.admit("10.0.0.9") is not None  # 2 reserved + the one freed: 10 slots in all
    assert g.admit("10.0.0.9") is None and g.held() == 10
    for s in a[1:4] + b + [m, p]:
        g.release(s)
    assert g.held() == 1 and g.turned_away == 3
    with pytest.raises(ValueError, match="per_address"):
        AcceptGate(per_address=0)


def test_accept_gate_counts_an_ipv6_slash_64_as_one_address():
    """An IPv6 attacker owns a whole /64: the caps count per /64 (an IPv4-mapped address is its IPv4 address; IPv4
    stays per address). Synthetic addresses: the gate sees strings, no socket is needed."""
    g = AcceptGate(per_address=4, total=32, reserved=4, per_member=8)
    same64 = [g.admit(f"2001:db8:1:2:{i:x}::{i:x}") for i in range(1, 6)]  # 5 addresses of one /64
    assert all(same64[:4]) and same64[4] is None
    assert g.admit("[2001:db8:1:2:ffff:ffff:ffff:ffff]") is None  # (bracketed: the same /64, still full)
    assert g.admit("2001:db8:1:3::1") is not None  # the next /64 is another address
    assert g.admit("fe80::1%eth0") is not None and g.admit("fe80::2%eth1") is not None  # (zones: one /64)
    v4 = [g.admit(a) for a in ("192.0.2.1", "::ffff:192.0.2.1", "::FFFF:192.0.2.1", "192.0.2.1", "::ffff:192.0.2.1")]
    assert all(v4[:4]) and v4[4] is None  # mapped and plain are one IPv4 address
    assert g.admit("192.0.2.2") is not None  # IPv4: per address, not per prefix
    assert {s[0] for s in same64[:4]} == {"2001:db8:1:2::/64"} and v4[1][0] == "192.0.2.1"
    # proven and trusted are per /64 too (a host's temporary addresses stay in its /64)
    g.release(same64[0], proven=True)
    assert g.admit("2001:db8:1:2::beef")[1] is True
    g.trust(["2001:db8:9:9::1", "198.51.100.7"])
    assert g.admit("2001:db8:9:9:abcd::1")[1] is True and g.admit("198.51.100.8")[1] is False


@pytest.fixture
def bound():
    """Restores the process's handshake bound (``secure.set_handshake_s``) after the test."""
    yield
    set_handshake_s(HANDSHAKE_S)


def test_the_handshake_bound_is_two_seconds_by_default_and_checked():
    assert HANDSHAKE_S == handshake_s() == 2.0
    for bad in (0, -1, 30.5, float("nan"), True, "5"):
        with pytest.raises(ValueError, match=r"security.handshake_s=.*must be seconds in \(0, 30\]"):
            set_handshake_s(bad)
    assert handshake_s() == 2.0


def _servers():
    """One server of each kind with an accept loop (in this process): {kind: (port, close)}."""
    from dilocox.net.mesh import PairServer
    from dilocox.net.relay import LighthouseGuard
    from dilocox.net.rpc import RpcServer
    from dilocox.net.transfer import StateTransport

    rpc = RpcServer(lambda m, meta, t: ({}, {}), host="127.0.0.1", secret=SECRET)
    state = StateTransport("127.0.0.1", 5.0, SECRET)
    up = socket.create_server(("127.0.0.1", 0))
    guard = LighthouseGuard(("127.0.0.1", 0), up.getsockname(), SECRET, "lighthouse")
    mesh = PairServer("127.0.0.1", SECRET, False)
    return {
        "rpc": (int(rpc.addr.rsplit(":", 1)[1]), rpc.close),
        "state": (int(state.metadata().rsplit(":", 1)[1]), state.shutdown),
        "lighthouse": (guard.port, lambda: (guard.close(), up.close())),
        "mesh": (int(mesh.addr.rsplit(":", 1)[1]), mesh.close),
    }


def _silent_for(port: int, within: float) -> float | None:
    """Seconds until the server closes a connection that reads its challenge and says nothing (None: still open
    after ``within``)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    t0 = time.monotonic()
    try:
        assert s.recv(36)[:4] == b"DXA1"
        s.settimeout(within)
        try:
            return time.monotonic() - t0 if s.recv(64) == b"" else None
        except OSError:  # (a timeout: still held; a reset: closed)
            return None if time.monotonic() - t0 >= within else time.monotonic() - t0
    finally:
        s.close()


@pytest.mark.parametrize("seconds", [0.4, 2.8])
def test_every_accept_loop_ends_a_handshake_within_the_configured_bound(seconds, bound):
    """security.handshake_s (secure.set_handshake_s: what every process of the run sets from its config) is the
    bound of the RPC server, the state transfer, the guards and the mesh's pair server: a silent connection is
    closed after it, not after the 2 s default."""
    set_handshake_s(seconds)
    servers = _servers()
    try:
        took: dict[str, float | None] = {}
        threads = [
            threading.Thread(target=lambda k=k, p=p: took.__setitem__(k, _silent_for(p, min(seconds + 1.5, 2.5))))
            for k, (p, _) in servers.items()
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        for kind, t in took.items():
            if seconds < HANDSHAKE_S:  # closed after the short bound
                assert t is not None and seconds - 0.05 <= t < seconds + 1.0, (kind, t)
            else:  # still waiting past the 2 s default
                assert t is None or t >= seconds - 0.05, (kind, t)
    finally:
        for _, close in servers.values():
            close()


def test_security_handshake_s_reaches_the_config_the_launcher_and_the_service_commands(tmp_path, bound):
    from dilocox.config import ConfigError, load_config
    from dilocox.elastic.launch import _security_args
    from dilocox.elastic.lighthouse import lighthouse_main
    from dilocox.net.secure import secret_for
    from dilocox.swarm.cli import SwarmUsageError, store_main

    cfg = os.path.join(ROOT, "configs", "tiny-pp2-tp2.yaml")
    for bad in ("0", "31"):
        with pytest.raises(ConfigError, match=r"^security.handshake_s=.* must be seconds in \(0, 30\].*handshake_s=5"):
            load_config(cfg, [f"--security.handshake_s={bad}"])
    c = load_config(cfg, ["--security.handshake_s=5", "--security.authenticate=false"])
    assert c.security.handshake_s == 5.0
    secret_for(c.security, "test")  # what every process of a run calls before it serves: sets its bound
    assert handshake_s() == 5.0
    c = load_config(cfg, ["--security.handshake_s=4.5", f"--security.secret_file={tmp_path / 'secret'}"])
    overrides, opts = _security_args(c, str(tmp_path), [], [], None)  # dilocox launch --elastic
    assert opts[opts.index("--handshake-s") + 1] == "4.5" and "--secret-file" in opts
    c = load_config(cfg, [f"--security.secret_file={tmp_path / 'secret'}"])
    assert "--handshake-s" not in _security_args(c, str(tmp_path), [], [], None)[1]  # (the default: the same)
    with pytest.raises(SystemExit) as e:
        lighthouse_main(["--min-replicas", "1", "--bind", "127.0.0.1:0", "--handshake-s", "0"])
    assert e.value.code == 2
    with pytest.raises(SwarmUsageError, match=r"--handshake-s=40.0 must be seconds in \(0, 30\]"):
        store_main(["--port", "1", "--bind", "127.0.0.1", "--handshake-s", "40"])


def test_the_slurm_recipes_hand_dilocox_handshake_s_to_the_services_and_the_processes(tmp_path):
    from tests.test_launch_elastic import run_elastic_sbatch
    from tests.test_launch_swarm import run_sbatch

    (tmp_path / "e").mkdir()
    p, lines = run_elastic_sbatch(tmp_path / "e", "gpu03 gpu04", DILOCOX_NODES_PER_REPLICA="1", DILOCOX_HANDSHAKE_S="5")
    assert p.returncode == 0, p.stderr
    lh, train = [x for x in lines if " lighthouse " in x], [x for x in lines if " train " in x]
    assert len(lh) == 1 and "--secret-file" in lh[0] and lh[0].endswith("--handshake-s 5"), lines
    assert len(train) == 2 and all("--security.handshake_s=5" in x for x in train), train
    (tmp_path / "s").mkdir()
    p, lines = run_sbatch(tmp_path / "s", "gpu03", peers="2", extra_env={"DILOCOX_HANDSHAKE_S": "5"})
    assert p.returncode == 0, p.stderr
    services = [x for x in lines if "cli lighthouse " in x or "swarm store " in x]
    peers = [x for x in lines if ".peer " in x]
    assert len(services) == 2 and all(x.endswith("--handshake-s 5") for x in services), services
    assert len(peers) == 2 and all("--security.handshake_s=5" in x for x in peers), peers


@pytest.mark.slow
def test_a_swarm_run_under_a_flood_from_another_address_bans_nobody_and_ends_bit_equal(tmp_path):
    """A SWARM job (2 stages x 1 peer, fixed routing) while 127.0.0.2 floods every peer's RPC port for the whole
    run (silent connections opened without waiting, 300 per peer kept open, and garbage answers to the challenge):
    no peer bans another, every peer ends bit-equal to the same job undisturbed, and the steps stay about as fast.
    Before issue 42 the silent connections took every handshake slot for 5 s each and filled the listen backlog:
    the peers' calls waited behind them (the issue: 20.4 s steps and a live peer banned)."""
    import random
    import statistics
    import threading

    import torch

    from dilocox.net.rpc import run_secret
    from dilocox.net.secure import open_value
    from dilocox.swarm.common import store_key
    from dilocox.swarm.runtime import launch
    from tests.flood import garbage_answer, silent
    from tests.swarm_noise import assert_exited_zero, launch_beside
    from tests.test_swarm_runtime import _cfg

    cfg = _cfg("--swarm.routing=fixed")
    steps = 30  # (long enough that the flood overlaps the training steps, not only the start-up)
    quiet = launch(cfg, str(tmp_path / "quiet"), peers_per_stage=[1, 1], steps=steps, timeout_s=240)
    stop = threading.Event()
    sent = {"connections": 0, "at_first_step": None}

    def flood(la):
        rng = random.Random(5)
        secret, addrs, deadline = run_secret(), [], time.monotonic() + 60
        while len(addrs) < 2 and time.monotonic() < deadline and not stop.is_set():
            try:
                addrs = [open_value(secret, store_key(j, 0), la.store.get(store_key(j, 0)).decode()) for j in (0, 1)]
            except Exception:  # noqa: BLE001 - not registered yet
                time.sleep(0.05)
        held: dict[str, list[socket.socket]] = {a: [] for a in addrs}
        try:
            while not stop.is_set():
                for addr in addrs:
                    host, port = addr.rsplit(":", 1)
                    for i in range(20):  # silent connections, opened without waiting (kept: 300 per peer)
                        s = silent("127.0.0.2", host, int(port))
                        if s is None:
                            continue
                        sent["connections"] += 1
                        if sent["at_first_step"] is None and os.path.exists(os.path.join(la.out_dir, "s0p0.jsonl")):
                            sent["at_first_step"] = sent["connections"]
                        held[addr].append(s)
                        if len(held[addr]) > 300:
                            held[addr].pop(0).close()
                    garbage_answer("127.0.0.2", host, int(port), rng.randbytes(64))  # and a garbage answer
                time.sleep(0.01)
        finally:
            for socks in held.values():
                for s in socks:
                    s.close()

    loud = launch_beside(cfg, str(tmp_path / "loud"), steps, flood, stop)
    assert_exited_zero(quiet, loud)
    assert sent["connections"] >= 1000 and sent["connections"] - (sent["at_first_step"] or 0) >= 500, sent
    for name in ("s0p0", "s1p0"):
        assert loud.peers[name]["bans"] == [], (name, loud.peers[name]["bans"])
        a, b = quiet.peers[name]["params"], loud.peers[name]["params"]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name

    def step_s(res):
        return statistics.median(r["seconds"] for r in res.records["s0p0"] if "seconds" in r)

    print(f"SWARM step (median, s0p0): quiet {step_s(quiet):.2f} s, under the flood {step_s(loud):.2f} s; "
          f"{sent['connections']} flood connections")  # fmt: skip
    # (the flood's own thread takes a core of a loaded 2-core VM; the lock-out was 20.4 s vs 1.7 s)
    assert step_s(loud) < 4 * step_s(quiet) + 4.0
