"""The delay switch (issue 20 item 1): latency, jitter and loss in the namespace emulation, where the kernel has no
netem. Its reference is the kernel bridge it replaces: the same transfer counts the same bytes on the replica's veth,
the round trip through it is within 10 % of the setting (+40 ms) and TCP fills the tbf cap (50 Mbit/s) as through
the bridge; jitter spreads the round trip and loss drops frames at its rate; the switch dies with its Cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dilocox.launch.netns import netns_available
from dilocox.launch.switch import SwitchError, argv, parse_latency, parse_loss

OK, WHY = netns_available()
needs_netns = pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")

SERVER = textwrap.dedent("""
    import socket, threading, time
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 5201)); s.listen(1)
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("0.0.0.0", 5301)); u.settimeout(0.2)
    try:  # room for the whole burst even if this process waits for a core (root: past net.core.rmem_max)
        u.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE
    except OSError:
        u.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    seen = [0, time.monotonic()]  # datagrams, time of the last one (read as they come: a socket buffer holds ~160)
    def count():
        while True:
            try:
                u.recv(2048); seen[0] += 1; seen[1] = time.monotonic()
            except OSError:
                pass
    threading.Thread(target=count, daemon=True).start()
    c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        d = c.recv(65536)
        if not d: break
        if d[:1] == b"p": c.sendall(d)
        if d[:1] == b"u":  # the burst is over once 1 s passed without a datagram
            while time.monotonic() - seen[1] < 1.0: time.sleep(0.05)
            c.sendall(f"{seen[0]:08d}".encode())
    c.sendall(b"k")
""")

CLIENT = textwrap.dedent("""
    import json, socket, sys, time
    host, mbytes, n_udp = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    for attempt in range(20):  # with --loss, ARP's 3 tries can all be lost ("No route to host"): try again
        try:
            c = socket.create_connection((host, 5201), timeout=60); break
        except OSError:
            if attempt == 19: raise
            time.sleep(0.5)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(15):
        t = time.perf_counter(); c.sendall(b"p" * 64); got = b""
        while len(got) < 64: got += c.recv(64)
        rtts.append((time.perf_counter() - t) * 1e3)
    got = None
    if n_udp:
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for _ in range(n_udp): u.sendto(b"x" * 200, (host, 5301)); time.sleep(0.0005)
        c.sendall(b"u"); got = b""
        while len(got) < 8: got += c.recv(8 - len(got))
        got = int(got)
    buf, sent, warm = b"b" * (1 << 16), 0, int(4e6)  # the rate after the first 4 MB (past TCP's slow start)
    n = int(mbytes * 1e6); t0 = t1 = time.perf_counter()
    while sent < n:
        c.sendall(buf); sent += len(buf)
        if sent <= warm: t1 = time.perf_counter()
    c.shutdown(socket.SHUT_WR); c.recv(1); t2 = time.perf_counter()
    print(json.dumps({"rtts": rtts, "mbit": (sent - warm) * 8 / (t2 - t1) / 1e6, "udp": got, "bytes": sent}))
""")


def _exchange(rtt_ms=0.0, jitter_ms=0.0, loss=0.0, mbytes=12.0, n_udp=0):
    """One TCP ping-pong + bulk (and a UDP burst) from replica 0 to replica 1 of a 50 Mbit/s Cluster."""
    import json

    from dilocox.launch.netns import Cluster

    with Cluster(2, 50.0, rtt_ms=rtt_ms, jitter_ms=jitter_ms, loss=loss, hub=True) as c:
        srv = c.exec(1, [sys.executable, "-c", SERVER], stdout=subprocess.DEVNULL)
        time.sleep(0.5)
        before = c.tx_bytes(0)
        cmd = ["ip", "netns", "exec", c.ns(0), sys.executable, "-c", CLIENT, c.addr(1), str(mbytes), str(n_udp)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr[-2000:]
        res = json.loads(out.stdout)
        res["veth_tx"] = c.tx_bytes(0) - before
        srv.wait(timeout=30)
        switch = c._switch if c.delayed else None
    if switch is not None:  # this Cluster's switch stopped with it (by its pid: another test's switch, running the
        # same cached binary under pytest-xdist, once made a `pgrep -f BINARY` here fail)
        assert switch.poll() is not None, f"the delay switch (pid {switch.pid}) outlived its Cluster"
    return res


@pytest.mark.slow
@needs_netns
def test_switch_delays_by_the_setting_and_counts_the_bytes_of_the_bridge():
    bridge = _exchange(mbytes=24.0)
    delayed = _exchange(rtt_ms=40.0, mbytes=24.0)
    rtt = sorted(delayed["rtts"])[len(delayed["rtts"]) // 2]
    base = sorted(bridge["rtts"])[len(bridge["rtts"]) // 2]
    # the added round trip: never early (the delay is applied: within 10 % below +40 ms), and late by at most 25 %:
    # the switch's forwarding thread waits for a core on a loaded 2-core host (CI, 2026-11-29: +44.3 ms while the
    # other xdist worker ran elastic fault tests; a timing bound, not a speed target)
    assert -4.0 <= rtt - base - 40.0 <= 10.0, (rtt, base)
    # the tbf cap holds behind the switch: TCP fills it as through the bridge (idle host: 47.8 vs 47.6 Mbit/s; the
    # bounds leave room for a host busy with other tests, where a Python sender gets ~43 through either; CI,
    # 2026-12-03: 38.8 behind the switch vs 45.7 through the bridge, 0.85 of it: the bound is 0.8)
    assert delayed["mbit"] <= 1.02 * 50 and bridge["mbit"] <= 1.02 * 50, (delayed["mbit"], bridge["mbit"])
    assert delayed["mbit"] >= 0.8 * bridge["mbit"] and bridge["mbit"] >= 0.7 * 50, (delayed["mbit"], bridge["mbit"])
    # the same transfer: the same bytes on the replica's veth as through the bridge (TCP's ACK/retransmit noise)
    assert abs(delayed["veth_tx"] - bridge["veth_tx"]) <= 0.02 * bridge["veth_tx"], (delayed, bridge)
    print(f"RTT {base:.2f} ms -> {rtt:.2f} ms (+40 ms set); rate {bridge['mbit']:.1f} / {delayed['mbit']:.1f} Mbit/s")


@pytest.mark.slow
@needs_netns
def test_switch_jitter_spreads_and_loss_drops_at_the_rate():
    res = _exchange(rtt_ms=20.0, jitter_ms=10.0, loss=0.2, mbytes=0.5, n_udp=400)
    rtts = res["rtts"]
    # each way waits 10 +- 5 ms: a round trip in [10, 30] ms (plus the base and TCP's retransmits of lost frames)
    assert min(rtts) >= 9.5 and max(rtts) - min(rtts) > 1.0, rtts
    got = res["udp"] / 400  # one crossing per datagram: about 80 % arrive
    assert 0.72 <= got <= 0.88, got


@needs_netns
def test_switch_is_killed_with_a_killed_owner(tmp_path):
    """SIGKILL of the process that owns the Cluster: the reaper kills the switch with the namespaces."""
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})
        from dilocox.launch.netns import Cluster
        c = Cluster(2, None, rtt_ms=10.0); c.start(); print(c.tag, flush=True); time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        tag = p.stdout.readline().strip()
        assert tag.startswith("dilocox-"), tag
        binary = argv([], 1.0)[0]
        assert subprocess.run(["pgrep", "-f", binary], capture_output=True, text=True).stdout.split()
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
        deadline = time.monotonic() + 20
        while subprocess.run(["pgrep", "-f", binary], capture_output=True, text=True).stdout.split():
            assert time.monotonic() < deadline, "the delay switch survived its owner's SIGKILL"
            time.sleep(0.2)
        while tag in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout:
            assert time.monotonic() < deadline, "the reaper left the namespaces"  # (it kills first, then deletes)
            time.sleep(0.2)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


def test_latency_jitter_loss_parse_and_bad_values_name_the_flag():
    assert parse_latency("50ms") == 50.0 and parse_latency("0.15s") == 150.0 and parse_latency("20") == 20.0
    assert parse_latency(None) == 0.0 and parse_loss("0.1%") == pytest.approx(0.001) and parse_loss("0.02") == 0.02
    with pytest.raises(SwitchError, match="--latency 'fast' is not a time"):
        parse_latency("fast")
    with pytest.raises(SwitchError, match="--jitter '-1ms' must be a finite time"):
        parse_latency("-1ms", "--jitter")
    with pytest.raises(SwitchError, match=r"--loss '100%' must be in"):
        parse_loss("100%")
    with pytest.raises(SwitchError, match="need latency >= jitter"):
        argv([], 10.0, 20.0)


def test_launch_rejects_bad_latency_in_one_line(capsys):
    from dilocox.launch.emulate import launch_main

    cfg = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny.yaml")
    rc = launch_main(["--replicas", "2", "--nproc-per-replica", "1", "--latency", "soon", cfg])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["dilocox launch: error: --latency 'soon' is not a time (e.g. 50ms, 0.15s)"], err
    rc = launch_main(["--replicas", "2", "--nproc-per-replica", "1", "--latency", "5ms", "--jitter", "9ms", cfg])
    assert rc == 2 and "--jitter 9ms is larger than --latency 5ms" in capsys.readouterr().err


@pytest.mark.parametrize(
    "code,want",
    [
        ("import time; time.sleep(30)", "printed no ready line within 1 s"),  # silent: the deadline still fires
        ("import sys; sys.stderr.write('no port'); sys.exit(3)", "exited with code 3: no port"),
        ("print('starting'); print('ready', flush=True); import time; time.sleep(30)", None),
    ],
    ids=["silent", "exits", "ready"],
)
def test_wait_ready_is_bounded(code, want):
    """wait_ready returns on the "ready" line, fails at once on an exit and after its timeout on a silent switch
    (it once called a blocking readline(), so a child that printed nothing held it forever)."""
    from dilocox.launch.switch import wait_ready

    p = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    t0 = time.monotonic()
    try:
        if want is None:
            wait_ready(p, "test", timeout_s=20)
        else:
            with pytest.raises(SwitchError, match=want):
                wait_ready(p, "test", timeout_s=1)
        assert time.monotonic() - t0 < 15
    finally:
        p.kill()
        p.wait(timeout=10)
