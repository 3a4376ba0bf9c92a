"""Kept RPC connections (issue 42 item 2, ``dilocox/net/client.py``): SWARM peers call each other over
authenticated connections that stay open between calls, instead of a handshake per hop.

What could go wrong and is checked here: a kept connection used after the server closed it (restart, idle
timeout) must not fail the call nor run the request twice; a timed-out connection must not be reused (its reply
could arrive late on it); the MAC sequence continues across calls, so a request recorded on the connection and
replayed on it is refused.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dilocox.net import client
from dilocox.net.client import Pool, call
from dilocox.net.rpc import Limits, PeerUnavailable, RpcServer, _send_all, channel, encode

SECRET = bytes(range(32))


@pytest.fixture(autouse=True)
def fresh_pool(monkeypatch):
    pool = Pool()
    monkeypatch.setattr(client, "POOL", pool)
    yield pool
    pool.close_all()


class Counter:
    """A handler that counts every request it runs and adds one to its tensor."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.calls, self.delay_s, self.lock = 0, delay_s, threading.Lock()

    def __call__(self, method, meta, tensors):
        with self.lock:
            self.calls += 1
        time.sleep(self.delay_s)
        return {"n": meta.get("n")}, {"y": tensors["x"] + 1}


def _server(handler, secret=SECRET, port=0, **limits) -> RpcServer:
    return RpcServer(handler, host="127.0.0.1", port=port, secret=secret, limits=Limits(**limits) if limits else None)


@pytest.mark.parametrize("secret", [SECRET, None], ids=["authenticated", "plain"])
def test_calls_share_one_connection_and_run_once_each(fresh_pool, secret):
    h = Counter()
    srv = _server(h, secret=secret)
    try:
        for n in range(20):
            meta, t = call(srv.addr, "f", {"n": n}, {"x": torch.full((3,), float(n))}, timeout_s=10, secret=secret)
            assert meta == {"n": n} and torch.equal(t["y"], torch.full((3,), n + 1.0))
        assert h.calls == 20
        assert fresh_pool.dialed == 1 and fresh_pool.reused == 19
        if secret is not None:
            assert srv.gate.per_address >= 1 and srv.rejected["auth"] == 0
        # keep=False: a connection per call, closed after it (the joiner's one state download)
        for n in range(3):
            call(srv.addr, "f", {"n": n}, {"x": torch.zeros(1)}, timeout_s=10, secret=secret, keep=False)
        assert fresh_pool.dialed == 4 and fresh_pool.idle(srv.addr) == 1
    finally:
        srv.close()


def test_a_server_restarted_on_the_same_port_is_called_again_once(fresh_pool):
    h1 = Counter()
    srv = _server(h1)
    port = int(srv.addr.rsplit(":", 1)[1])
    call(srv.addr, "f", {"n": 0}, {"x": torch.zeros(1)}, timeout_s=10, secret=SECRET)
    srv.close()
    time.sleep(0.3)  # (its connection threads see the stop flag)
    h2 = Counter()
    srv2 = _server(h2, port=port)
    try:
        meta, t = call(srv2.addr, "f", {"n": 1}, {"x": torch.zeros(1)}, timeout_s=10, secret=SECRET)
        assert meta == {"n": 1} and h2.calls == 1 and h1.calls == 1
        assert fresh_pool.dialed == 2
    finally:
        srv2.close()


def test_a_connection_closed_after_the_check_is_sent_again_on_a_fresh_one(fresh_pool, monkeypatch):
    """The window the peek cannot see: the server closes the kept connection (its idle timeout) just as the request
    goes out. The request is sent once more on a fresh connection and runs exactly once."""
    h = Counter()
    srv = _server(h, idle_timeout_s=0.6)
    try:
        call(srv.addr, "f", {"n": 0}, {"x": torch.zeros(1)}, timeout_s=10, secret=SECRET)
        time.sleep(1.8)  # the server dropped it as idle
        assert srv.rejected["idle"] >= 1
        monkeypatch.setattr(client, "_still_open", lambda sock: True)  # (as if it closed right after the check)
        meta, _ = call(srv.addr, "f", {"n": 1}, {"x": torch.zeros(1)}, timeout_s=10, secret=SECRET)
        assert meta == {"n": 1} and h.calls == 2
        assert fresh_pool.dialed == 2 and fresh_pool.reused == 1
    finally:
        srv.close()


def test_an_idle_connection_past_the_pool_limit_is_not_reused(monkeypatch):
    pool = Pool(idle_s=0.2)
    monkeypatch.setattr(client, "POOL", pool)
    h = Counter()
    srv = _server(h)
    try:
        call(srv.addr, "f", {"n": 0}, {"x": torch.zeros(1)}, timeout_s=10, secret=SECRET)
        time.sleep(0.4)
        call(srv.addr, "f", {"n": 1}, {"x": torch.zeros(1)}, timeout_s=10, secret=SECRET)
        assert pool.dialed == 2 and pool.reused == 0 and h.calls == 2
    finally:
        pool.close_all()
        srv.close()


def test_a_timed_out_connection_is_dropped_and_never_retried(fresh_pool):
    h = Counter(delay_s=1.0)
    srv = _server(h)
    try:
        call(srv.addr, "f", {"n": 0}, {"x": torch.zeros(1)}, timeout_s=10, secret=SECRET)
        with pytest.raises(PeerUnavailable, match="within 0.3s"):
            call(srv.addr, "f", {"n": 1}, {"x": torch.zeros(1)}, timeout_s=0.3, secret=SECRET)
        assert fresh_pool.idle(srv.addr) == 0  # its late reply must not be read as the next call's
        time.sleep(1.0)
        meta, _ = call(srv.addr, "f", {"n": 2}, {"x": torch.zeros(1)}, timeout_s=10, secret=SECRET)
        assert meta == {"n": 2} and h.calls == 3  # the timed-out request ran once: not sent again
        assert fresh_pool.dialed == 2
    finally:
        srv.close()


def test_a_request_replayed_on_a_kept_connection_is_refused(fresh_pool):
    """A recorded request (the first one on the connection, its MAC of sequence 0) sent again on that connection
    after later calls: the server's check is at a later sequence number, so it closes the connection unserved."""
    h = Counter()
    srv = _server(h)
    try:
        for n in range(3):
            call(srv.addr, "f", {"n": n}, {"x": torch.zeros(1)}, timeout_s=10, secret=SECRET)
        (conns,) = fresh_pool._idle.values()
        c = conns[0]
        recorded = []
        key = _session_key_of(c)
        _send_all(_Recorder(recorded), encode("f", {"n": 0}, {"x": torch.zeros(1)}), time.monotonic() + 5, "x",
                  channel(key, "client", False))  # fmt: skip
        c.sock.settimeout(5)
        c.sock.sendall(b"".join(recorded))
        assert c.sock.recv(1) == b""  # closed, no reply
        assert h.calls == 3 and srv.rejected["auth"] == 1
    finally:
        srv.close()


class _Recorder:
    def __init__(self, out: list) -> None:
        self.out = out

    def settimeout(self, t) -> None:
        pass

    def send(self, view) -> int:
        self.out.append(bytes(view))
        return len(view)


def _session_key_of(c) -> bytes:
    return c.seal.key


def test_a_server_at_its_cap_closes_its_longest_idle_connection_for_a_new_caller(fresh_pool):
    """Callers keep their connections: a server whose authenticated connections are all idle and at
    ``max_connections`` makes room (the idle one closed, its caller dials again when it needs to) instead of
    leaving the new caller in the listen backlog until an idle timeout."""
    h = Counter(delay_s=0.3)
    srv = _server(h, max_connections=2, idle_timeout_s=120.0)
    try:
        with ThreadPoolExecutor(2) as ex:  # two kept connections, both idle afterwards
            list(ex.map(lambda n: call(srv.addr, "f", {"n": n}, {"x": torch.zeros(1)}, timeout_s=10, secret=SECRET),
                        range(2)))  # fmt: skip
        assert fresh_pool.idle(srv.addr) == 2
        # a stranger's connections at the cap (silent, or garbage for the challenge) never make room: only a
        # newcomer that proved the secret does, and never at the cost of a connection idle under EVICT_AFTER_S
        time.sleep(1.1)  # (rpc.EVICT_AFTER_S: both kept connections now idle long enough to make way)
        for payload in (b"", b"\x00" * 64):
            with socket.create_connection(("127.0.0.1", int(srv.addr.rsplit(":", 1)[1])), timeout=5) as s:
                assert s.recv(4) == b"DXA1"  # accepted (there is room), challenged ...
                if payload:
                    s.sendall(payload)
                time.sleep(0.3)
        time.sleep(0.3)
        assert srv.rejected["evicted"] == 0 and srv.rejected["auth"] >= 1  # ... refused, and nothing made way
        t = time.monotonic()
        meta, _ = client.call(srv.addr, "f", {"n": 9}, {"x": torch.zeros(1)}, timeout_s=5, secret=SECRET, keep=False)
        assert meta == {"n": 9} and time.monotonic() - t < 2.0
        assert srv.rejected["evicted"] == 1
        for n in range(3):  # the first caller's kept connections: the closed one is skipped, the other serves
            call(srv.addr, "f", {"n": n}, {"x": torch.zeros(1)}, timeout_s=10, secret=SECRET)
        assert h.calls == 6 and fresh_pool.dialed == 3 and srv.rejected["evicted"] == 1
    finally:
        srv.close()
