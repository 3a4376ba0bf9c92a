"""An elastic replica's own TCPStore behind the run secret (issue 21, dilocox/elastic/stores.py): the store listens
on loopback only, the quorum is handed its guard's address, and the quorum's gloo group meets there through a relay
that proves the secret; a stranger's store client gets nothing."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest
import torch


def _listening_on(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} write them) with a socket listening on ``port``."""
    out = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            addr, _, p = local.rpartition(":")
            if state == "0A" and int(p, 16) == port:  # 0A = LISTEN
                out.add(addr)
    return out


LOOPBACK = "0100007F"  # 127.0.0.1 in /proc/net/tcp


def test_a_plain_store_master_listens_everywhere_and_the_loopback_store_does_not():
    """The reason for ``loopback_store``: torch's store master given 127.0.0.1 still listens on every interface."""
    from torch.distributed import TCPStore

    from dilocox.net.store import loopback_store

    plain = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    assert _listening_on(plain.port) and _listening_on(plain.port) != {LOOPBACK}  # (the check can fail)
    store = loopback_store(timedelta(seconds=5))
    assert _listening_on(store.port) == {LOOPBACK}
    client = TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5))
    client.set("k", "v")
    assert store.get("k") == b"v"


def test_swarm_guarded_store_listens_on_loopback_only():
    from dilocox.swarm.services import GuardedStore

    g = GuardedStore("127.0.0.1", 0, b"s" * 32, timedelta(seconds=5))
    try:
        assert _listening_on(g.store.port) == {LOOPBACK}
    finally:
        g.close()


def test_the_quorum_meets_at_the_replica_stores_guard_through_a_relay():
    """A guarded replica (``lighthouse_auth``) in a quorum of one: its store is on loopback, the lighthouse was handed
    the guard's address (the gloo group's rendezvous went through a relay to exactly that port), the outer mean is
    right, and a plain TCPStore client at the guard's port is refused within its timeout."""
    pytest.importorskip("torchft", reason="torchft==0.2.0 is not installed (pip install torchft==0.2.0)")
    from torch.distributed import TCPStore

    from dilocox.elastic import ElasticConfig, ElasticOuterGroup, start_lighthouse

    secret = b"s" * 32
    lh = start_lighthouse(1, bind="127.0.0.1:0", secret=secret, join_timeout_ms=200)
    cfg = ElasticConfig(lighthouse_addr=lh.address(), replica_rank=0, min_replicas=1, max_replicas=2, timeout_s=20,
                        quorum_timeout_s=20, host="127.0.0.1", lighthouse_auth=True, secret=secret)  # fmt: skip
    group = ElasticOuterGroup(cfg)
    try:
        assert _listening_on(group._own_store.port) == {LOOPBACK}
        manager_port = int(group._manager._manager.address().rsplit(":", 1)[1])
        assert _listening_on(manager_port) == {LOOPBACK}  # (torchft's own binds [::]: every interface)
        res = group.allreduce_mean(torch.arange(4.0))
        assert res.contributors == [0] and torch.equal(res.mean, torch.arange(4.0))
        assert set(group._pg.relays) == {("127.0.0.1", group.store_guard.port)}
        with pytest.raises(Exception):  # noqa: B017 - torch raises its own kinds (reset, timeout)
            TCPStore("127.0.0.1", group.store_guard.port, is_master=False, timeout=timedelta(seconds=3))
        deadline = time.monotonic() + 10  # (the guard counts on its own thread)
        while group.store_guard.rejected < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert group.store_guard.rejected >= 1
    finally:
        group.close()
        lh.shutdown()
    with pytest.raises(OSError):  # closed with the group
        socket.create_connection(("127.0.0.1", group.store_guard.port), timeout=1).close()


def _outward_address() -> str | None:
    """This host's address on its default route (no packet is sent), None where there is none or it is loopback."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))
        addr = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if addr.startswith("127.") else addr


def test_the_manager_server_listens_on_loopback_behind_a_guard_at_the_replicas_address():
    """``ManagerGuard``: a guarded replica at a non-loopback address: its torchft ``ManagerServer`` listens on
    127.0.0.1:P and the guard on address:P (the port torchft advertises), the replica's own quorum calls go through a
    relay that proves the secret, and torchft's plain ``ManagerClient`` at the advertised address is refused."""
    pytest.importorskip("torchft", reason="torchft==0.2.0 is not installed (pip install torchft==0.2.0)")
    host = _outward_address()
    if host is None:
        pytest.skip("no non-loopback address on this host")
    from torchft._torchft import ManagerClient

    from dilocox.elastic import ElasticConfig, ElasticOuterGroup, start_lighthouse
    from dilocox.elastic.stores import ManagerGuard

    secret = b"s" * 32
    lh = start_lighthouse(1, bind="127.0.0.1:0", secret=secret, join_timeout_ms=200)
    cfg = ElasticConfig(lighthouse_addr=lh.address(), replica_rank=0, min_replicas=1, max_replicas=2, timeout_s=20,
                        quorum_timeout_s=20, host=host, lighthouse_auth=True, secret=secret)  # fmt: skip
    group = ElasticOuterGroup(cfg)
    guard = group.manager_guard.guard
    try:
        port = guard.port
        assert group._manager._manager.address() == f"http://{host}:{port}"
        assert _listening_on(port) == {LOOPBACK, socket.inet_aton(host)[::-1].hex().upper()}
        res = group.allreduce_mean(torch.arange(4.0))
        assert res.contributors == [0] and torch.equal(res.mean, torch.arange(4.0))
        assert (host, port) in ManagerGuard._relays  # the replica's own client dialed its manager through a relay
        with pytest.raises(Exception):  # noqa: B017 - torchft raises its own kinds (transport error, timeout)
            ManagerClient(f"http://{host}:{port}", connect_timeout=timedelta(seconds=3))._checkpoint_metadata(
                0, timeout=timedelta(seconds=3)
            )
        deadline = time.monotonic() + 10  # (the guard counts on its own thread)
        while guard.rejected < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert guard.rejected >= 1
    finally:
        group.close()
        lh.shutdown()
    assert not ManagerGuard._relays and ManagerGuard._open == 0  # torchft's client is back


def test_a_manager_port_taken_between_the_check_and_torchfts_bind_moves_the_guard(monkeypatch):
    """Issue 42: the guard finds P free on 127.0.0.1, then another process takes 127.0.0.1:P before torchft binds it
    (here: right after the check). torchft fails to bind (nothing is served on a port another holds); the replica
    makes its guard again on another port and runs, its manager on a port nobody else holds."""
    pytest.importorskip("torchft", reason="torchft==0.2.0 is not installed (pip install torchft==0.2.0)")
    host = _outward_address()
    if host is None:
        pytest.skip("no non-loopback address on this host")
    from dilocox.elastic import ElasticConfig, ElasticOuterGroup, start_lighthouse, stores

    taken: list[int] = []
    held: list[socket.socket] = []
    real = stores._free_on_loopback

    def check_then_taken(port: int) -> bool:
        free = real(port)
        if free and not taken:  # the other process wins the race, once
            taken.append(port)
            try:  # with SO_REUSEADDR, as the check binds: a TIME_WAIT on P must not fail the test's own bind
                held.append(socket.create_server(("127.0.0.1", port)))
            except OSError:
                pass  # a real other process took P first: the race this test stages, all the same
        return free

    monkeypatch.setattr(stores, "_free_on_loopback", check_then_taken)
    monkeypatch.delenv("TORCHFT_MANAGER_PORT", raising=False)
    secret = b"s" * 32
    lh = start_lighthouse(1, bind="127.0.0.1:0", secret=secret, join_timeout_ms=200)
    cfg = ElasticConfig(lighthouse_addr=lh.address(), replica_rank=0, min_replicas=1, max_replicas=2, timeout_s=20,
                        quorum_timeout_s=20, host=host, lighthouse_auth=True, secret=secret)  # fmt: skip
    group = None
    try:
        group = ElasticOuterGroup(cfg)
        port = group.manager_guard.guard.port
        assert taken and port != taken[0]
        assert group._manager._manager.address() == f"http://{host}:{port}"
        res = group.allreduce_mean(torch.arange(4.0))
        assert res.contributors == [0] and torch.equal(res.mean, torch.arange(4.0))
    finally:
        if group is not None:
            group.close()
        lh.shutdown()
        for s in held:
            s.close()
    assert not stores.ManagerGuard._relays and stores.ManagerGuard._open == 0
