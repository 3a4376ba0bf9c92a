"""Issue 42 item 2: no lock-out by strangers before authentication.

Every accept loop of a run hands its handshake slots out through one ``secure.AcceptGate``: at most 4 connections
of one address that has not proven the secret are in their handshake at a time, a connection over its cap is closed
at once (``BUSY``, never queued), each handshake ends within ``HANDSHAKE_S`` (2 s), and addresses that proved the
secret before (or are named members) keep reserved slots. Before, each loop had one global pool (32 slots, 8 for the
heal transport) held up to 5 s each: 300 silent connections from one address made a secret holder's handshake time
out after 18-22 s.

The flood test runs each kind of server (the victim) in a subprocess under a time bound; the attacker is 127.0.0.2,
the honest secret holder 127.0.0.1 (both loopback).
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time

import pytest

from dilocox.net.secure import BUSY, HANDSHAKE_S, AcceptGate, dial

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
        assert took < 2.0, f"{kind}: a secret holder's handshake took {took:.2f} s under a flood from one address"
        away = _turned_away(socks[-250:], within=0.5)  # over the cap of 4: closed at once, not queued (a few more
        assert away >= 240, f"{kind}: {away} of the last 250 flood connections closed within 0.5 s"  # get a slot
        # as the first ones' 2 s run out while the flood is opened)
        for s in socks:
            s.close()
        # 2. the holder has proven the secret; strangers on 20 addresses fill every slot they may take: the reserved
        # ones still serve it
        socks = [s for i in range(3, 23) for s in _flood(f"127.0.0.{i}", port, 8)]
        took = _honest(port, SERVICE[kind])
        assert took < 2.0, f"{kind}: a proven holder's handshake took {took:.2f} s under a flood from 20 addresses"
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


def test_handshake_bound_is_two_seconds_at_most():
    from dilocox.net.mesh import PairServer
    from dilocox.net.relay import AUTH_TIMEOUT_S
    from dilocox.net.rpc import Limits

    assert HANDSHAKE_S <= 2.0 and AUTH_TIMEOUT_S <= 2.0 and Limits().handshake_timeout_s <= 2.0
    assert PairServer.__init__.__defaults__[-1] <= 2.0


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
                        s = socket.socket()
                        s.setblocking(False)
                        try:
                            s.bind(("127.0.0.2", 0))
                            s.connect_ex((host, int(port)))
                        except OSError:
                            s.close()
                            continue
                        sent["connections"] += 1
                        if sent["at_first_step"] is None and os.path.exists(os.path.join(la.out_dir, "s0p0.jsonl")):
                            sent["at_first_step"] = sent["connections"]
                        held[addr].append(s)
                        if len(held[addr]) > 300:
                            held[addr].pop(0).close()
                    s = socket.socket()  # and a garbage answer to the challenge
                    s.settimeout(0.2)
                    try:
                        s.bind(("127.0.0.2", 0))
                        s.connect((host, int(port)))
                        if s.recv(36)[:4] == b"DXA1":
                            s.sendall(rng.randbytes(64))
                    except OSError:
                        pass
                    s.close()
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
    assert step_s(loud) < 3 * step_s(quiet) + 2.0  # (a loaded 2-core VM: the lock-out was 20.4 s vs 1.7 s)
