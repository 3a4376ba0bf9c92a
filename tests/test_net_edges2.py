"""Edges of dilocox/net found by its second review (2027-01): a relay whose accept loop ended for good on one failed
accept (out of file descriptors), and servers that could not listen on an IPv6 address.

Every socket has a timeout, every server is closed in a ``finally``, and a victim that must run out of file
descriptors runs in a subprocess under a time bound.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

import pytest

from dilocox.net import client
from tests.test_net_edges import SECRET, fresh_pool  # noqa: F401 - (the fixture: a fresh client pool per test)

_RELAY_EMFILE = textwrap.dedent(
    """
    import os, resource, socket, sys
    from dilocox.net.relay import LighthouseRelay

    up = socket.create_server(("127.0.0.1", 0))
    up.settimeout(20)
    relay = LighthouseRelay([("127.0.0.1", up.getsockname()[1])], connect_timeout_s=1.0)
    print(relay.address.rsplit(":", 1)[1], flush=True)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    hog = []
    try:
        while True:
            hog.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    print("full", flush=True)
    sys.stdin.readline()  # the test connected: the relay's accept fails (EMFILE) until the fds are freed
    import time; time.sleep(0.5)
    for fd in hog:
        os.close(fd)
    s, _ = up.accept()
    s.settimeout(20)
    print("relayed", s.recv(5).decode(), flush=True)
    relay.close()
    """
)


def test_a_relay_goes_on_accepting_after_an_accept_fails_for_want_of_file_descriptors():
    """The relay's accept loop returned on ANY OSError of accept: one EMFILE (a burst of connections) ended the
    relay for good, and every later connection of torchft's Manager waited in its backlog unserved."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _RELAY_EMFILE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    c = None
    try:
        port = int(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "full"
        c = socket.create_connection(("127.0.0.1", port), timeout=5)
        c.sendall(b"hello")
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out, _ = proc.communicate(timeout=30)
        assert "relayed hello" in out
    finally:
        if c is not None:
            c.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _ipv6_loopback() -> bool:
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this host")


@needs_ipv6
def test_an_rpc_server_and_a_state_transport_listen_on_an_ipv6_address():
    """RpcServer made an AF_INET socket whatever its host: ``swarm.host: "::1"`` (or any IPv6 address) failed with
    'Address family for hostname not supported'; a StateTransport on one fell back to 0.0.0.0 and the host name."""
    from dilocox.net.rpc import RpcServer
    from dilocox.net.transfer import StateTransport

    srv = RpcServer(lambda m, meta, t: ({"got": meta["n"]}, {}), host="::1", secret=SECRET)
    state = None
    try:
        assert client.call(srv.addr, "m", {"n": 3}, timeout_s=10, secret=SECRET) == ({"got": 3}, {})
        state = StateTransport("::1", 5.0, SECRET)
        assert state.metadata().startswith("dxstate:::1:")
    finally:
        srv.close()
        if state is not None:
            state.shutdown()


@needs_ipv6
def test_the_authenticated_mesh_runs_on_ipv6_addresses():
    """PairServer listened with socket.create_server's default AF_INET: a Mesh on an IPv6 host could not start."""
    import threading

    import torch

    from dilocox.net.mesh import Mesh

    meshes = []
    try:
        meshes = [Mesh("::1", SECRET, timeout_s=10.0) for _ in range(2)]
        members = [(m.addr, m.begin()) for m in meshes]
        out: list = [None, None]

        def run(r: int) -> None:
            try:
                meshes[r].join("q6", r, members)
                t = torch.full((5,), float(r + 1))
                meshes[r].all_reduce(t)
                out[r] = t
            except Exception as e:  # noqa: BLE001 - handed back to the test
                out[r] = e

        threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a member hung"
        assert all(isinstance(t, torch.Tensor) and torch.equal(t, torch.full((5,), 3.0)) for t in out), out
    finally:
        for m in meshes:
            m.close()


def test_a_guard_closes_a_pair_whose_peer_stalls_mid_frame(monkeypatch):
    """The guard (and the relay) read a frame's body with no bound: a peer that proved the secret and then stopped
    inside a frame held the guard's thread and its connection to the lighthouse forever."""
    from dilocox.net.relay import FramedPipe, LighthouseGuard
    from dilocox.net.secure import dial

    monkeypatch.setattr(FramedPipe, "FRAME_S", 0.5)
    up = socket.create_server(("127.0.0.1", 0))
    up.settimeout(5)
    guard = LighthouseGuard(("127.0.0.1", 0), ("127.0.0.1", up.getsockname()[1]), SECRET, "lighthouse")
    s = u = None
    try:
        s, _, _ = dial(("127.0.0.1", guard.port), SECRET, "lighthouse", time.monotonic() + 5)
        u, _ = up.accept()
        u.settimeout(5)
        s.sendall((100).to_bytes(4, "big") + b"x" * 10)  # a frame cut short: the rest never comes
        t0 = time.monotonic()
        assert u.recv(10) == b"" and time.monotonic() - t0 < 4  # the guard ended the pair (the lighthouse's side)
        s.settimeout(5)
        assert s.recv(10) == b""  # (and the stalled peer's)
    finally:
        for x in (s, u, up):
            if x is not None:
                x.close()
        guard.close()


def test_a_relayed_pair_may_idle_between_frames(monkeypatch):
    """(The bound is per frame, not per pair: a store's client or a gRPC channel may be quiet for long.)"""
    from dilocox.net.relay import FramedPipe, LighthouseGuard, LighthouseRelay

    monkeypatch.setattr(FramedPipe, "FRAME_S", 0.3)
    up = socket.create_server(("127.0.0.1", 0))
    up.settimeout(5)
    guard = LighthouseGuard(("127.0.0.1", 0), ("127.0.0.1", up.getsockname()[1]), SECRET, "store")
    relay = LighthouseRelay([("127.0.0.1", guard.port)], secret=SECRET, service="store")
    c = u = None
    try:
        c = socket.create_connection(("127.0.0.1", int(relay.address.rsplit(":", 1)[1])), timeout=5)
        u, _ = up.accept()
        u.settimeout(5)
        for word in (b"ping", b"again"):
            c.sendall(word)
            assert u.recv(16) == word
            u.sendall(word.upper())
            assert c.recv(16) == word.upper()
            time.sleep(0.8)  # idle longer than FRAME_S between frames
    finally:
        for x in (c, u, up):
            if x is not None:
                x.close()
        relay.close()
        guard.close()


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "guarded"])
def test_a_relay_whose_endpoint_name_cannot_be_encoded_goes_on_to_the_next(secret):
    """A lighthouse name IDNA cannot encode (a label over 63 characters) raised UnicodeError, not OSError, out of the
    relay's connect: its accept loop died and every later connection of the Manager waited unserved."""
    from dilocox.net.relay import LighthouseGuard, LighthouseRelay

    up = socket.create_server(("127.0.0.1", 0))
    up.settimeout(5)
    target = ("127.0.0.1", up.getsockname()[1])
    guard = LighthouseGuard(("127.0.0.1", 0), target, secret, "lighthouse") if secret else None
    second = ("127.0.0.1", guard.port) if guard else target
    relay = LighthouseRelay([("a" * 64, 29510), second], connect_timeout_s=0.5, secret=secret, service="lighthouse")
    socks: list[socket.socket] = []
    try:
        for word in (b"one", b"two"):  # (the loop survives the first)
            c = socket.create_connection(("127.0.0.1", int(relay.address.rsplit(":", 1)[1])), timeout=5)
            socks.append(c)
            c.sendall(word)
            u, _ = up.accept()
            socks.append(u)
            u.settimeout(5)
            assert u.recv(16) == word
        assert relay.used == [1, 1]
    finally:
        for x in (*socks, up):
            x.close()
        relay.close()
        if guard is not None:
            guard.close()
