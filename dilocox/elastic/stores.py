"""An elastic replica's own ``TCPStore`` behind the run secret (issue 21, docs/SECURITY.md).

Each replica hosts a ``TCPStore``: its torchft ``Manager`` keeps its own entries there, and when the lighthouse names
this replica's store for a quorum, every replica's process group meets there (gloo's rendezvous). torch's store
authenticates nobody, and its server listens on every interface whatever host it is given
(``TCPStore("127.0.0.1", 0, is_master=True)`` listens on ``*``), so a guard in front of it alone would be bypassed
by a stranger who connects to the store's own port. With ``ElasticConfig.lighthouse_auth`` (the run's elastic
services behind the secret):

- ``loopback_store`` (``net/store.py``): the store's listening socket is bound to 127.0.0.1 and handed to torch
  (``master_listen_fd``), so the store itself is reachable from this host only;
- a ``LighthouseGuard`` (``net/relay.py``: mutual HMAC handshake, then every chunk framed and MACed) holds a public
  port in front of it, and that is the address the replica's ``ManagerServer`` hands to the lighthouse
  (``advertise_store``: torchft's ``Manager`` passes one address both to its own client and to its server, so the
  server's is swapped for the guard's while the Manager is built);
- ``quorum_gloo``: torchft's reconfigurable gloo group whose ``configure`` reaches the store the quorum names
  through a local ``LighthouseRelay`` that proves the secret to that store's guard.

- ``ManagerGuard``: the replica's torchft ``ManagerServer`` (gRPC: the replica's own ranks' quorum calls, and a
  joiner's checkpoint-metadata call when it heals from this replica) listens on loopback, behind a guard at the
  address it advertises; every ``ManagerClient`` of the process dials a non-loopback manager through a relay that
  proves the secret.

A stranger who reaches a replica therefore cannot read or write its store (the gloo rendezvous, the Manager's
entries) or call its manager. Still reached directly (docs/SECURITY.md): the gloo pairs.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

from dilocox.elastic.torchft import manager_module
from dilocox.net.store import loopback_store

_PATCH_LOCK = threading.Lock()  # advertise_store swaps a torchft module attribute while a Manager is built


def guarded_replica_store(host: str, secret: bytes, timeout: timedelta, port: int = 0, service: str = "store"):
    """(the store, its local address, its public address, the guard): a loopback store and a guard on ``host:port``
    (0: any); also the SWARM address book's (dilocox/swarm/services.py, ``service="swarm-store"``)."""
    from dilocox.net.relay import LighthouseGuard

    store = loopback_store(timeout)
    local = ("127.0.0.1", store.port)
    guard = LighthouseGuard((host, port), local, secret, service)
    return store, local, (host, guard.port), guard


def replica_store(host: str, secret: bytes | None, timeout: timedelta):
    """A one-process replica's own store: (the store, the address its Manager uses, the address handed to the quorum
    or None for the same, the guard or None). With ``secret``: ``guarded_replica_store``; else a plain master."""
    if secret is not None:
        return guarded_replica_store(host, secret, timeout)
    from torch.distributed import TCPStore

    store = TCPStore(host_name=host, port=0, is_master=True, wait_for_workers=False, timeout=timeout)
    return store, (host, store.port), None, None


def multi_rank_replica_store(host: str, secret: bytes | None, one_host: bool, timeout: timedelta):
    """Rank 0's store of a replica of several ranks, as ``replica_store`` returns it. Guarded and on one host: the
    store on loopback; guarded on several hosts: the store listens at ``host`` (its ranks meet there) beside its
    guard, so it is reached directly from wherever ``host`` is reachable (docs/SECURITY.md)."""
    if secret is None or one_host:
        return replica_store(host, secret, timeout)
    from dilocox.net.relay import LighthouseGuard

    store, local, _, _ = replica_store(host, None, timeout)
    guard = LighthouseGuard((host, 0), local, secret, "store")
    return store, local, (host, guard.port), guard


def store_addrs_text(local: tuple[str, int], public: tuple[str, int] | None) -> str:
    """Rank 0's (local, public) store addresses as the text its other ranks receive (``store_addrs``)."""
    return json.dumps([list(local), list(public) if public else None])


def store_addrs(text: str) -> tuple[tuple[str, int], tuple[str, int] | None]:
    """``store_addrs_text``'s addresses, checked: each a [host, port] with a port in 1-65535 (ValueError else)."""

    def addr(x) -> tuple[str, int]:
        ok = isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) and 0 < len(x[0]) <= 255
        if not (ok and isinstance(x[1], int) and not isinstance(x[1], bool) and 0 < x[1] < 65536):
            raise ValueError(f"rank 0 sent a store address that is not [host, port]: {text[:200]!r}")
        return x[0], x[1]

    try:
        local, public = json.loads(text)
    except (ValueError, TypeError) as e:
        raise ValueError(f"rank 0 sent store addresses that are not [[host, port], [host, port] | null]: {e}") from e
    return addr(local), (addr(public) if public is not None else None)


@contextmanager
def advertise_store(addr: tuple[str, int] | None, bind: str | None = None):
    """While a torchft ``Manager`` is built: its ``ManagerServer`` hands ``addr`` to the lighthouse as this replica's
    store (the Manager's own client keeps the address it was given) and, with ``bind``, listens there
    (``ManagerGuard.bind``). Nothing changes when both are None."""
    if addr is None and bind is None:
        yield
        return
    tm = manager_module()
    with _PATCH_LOCK:
        real = tm.ManagerServer

        def server(*args, **kwargs):
            if addr is not None:
                kwargs["store_addr"] = f"{_bracket(addr[0])}:{addr[1]}"
            if bind is not None:
                kwargs["bind"] = bind
            return real(*args, **kwargs)

        tm.ManagerServer = server
        try:
            yield
        finally:
            tm.ManagerServer = real


class StoreRelays(dict):
    """The quorum's store reached through a local relay that proves ``secret`` to the guard in front of it: one relay
    per store address (a dict: (host, port) -> relay); the previous quorum's are closed when another store is used.
    Without a secret the store's own address is used."""

    def __init__(self, secret: bytes | None, timeout_s: float) -> None:
        super().__init__()
        self.secret, self.timeout_s = secret, timeout_s

    def local(self, store_addr: str) -> str:
        """``host:port/prefix`` of the quorum's store -> the address to dial (a relay's on 127.0.0.1)."""
        if self.secret is None:
            return store_addr
        from dilocox.net.relay import LighthouseRelay

        addr, _, prefix = store_addr.partition("/")
        host, _, port = addr.rpartition(":")
        key = (host.strip("[]"), int(port))
        relay = self.get(key)
        if relay is None:
            wait_s = max(1.0, min(5.0, self.timeout_s))
            relay = self[key] = LighthouseRelay([key], secret=self.secret, connect_timeout_s=wait_s, service="store")
        for other in [k for k in self if k != key]:  # the old group is gone: so are its relays
            self.pop(other).close()
        return f"127.0.0.1:{relay.address.rsplit(':', 1)[1]}/{prefix}"

    def close(self) -> None:
        for relay in self.values():
            relay.close()
        self.clear()


def quorum_pg(pg_cls, secret: bytes | None, timeout_s: float, collectives: str = "gloo", host: str = "127.0.0.1",
              encrypt: bool = False):  # fmt: skip
    """The quorum's process group for torchft's ``Manager``: torchft's ``pg_cls`` (``ProcessGroupGloo``) or, with
    ``collectives="authenticated"`` (or ``"auto"`` and a ``secret``), dilocox's authenticated mesh
    (``elastic/mesh.py``). With a ``secret`` its store rendezvous goes through ``StoreRelays`` (``close_relays()``
    ends them)."""
    relays = StoreRelays(secret, timeout_s)
    if collectives == "auto":  # (the secret is there when the lighthouse and the stores are guarded)
        collectives = "authenticated" if secret is not None else "gloo"
    if collectives == "authenticated":
        from dilocox.elastic.mesh import mesh_process_group

        if secret is None:
            raise ValueError("outer.elastic.collectives=authenticated needs outer.elastic.lighthouse_auth (the secret)")
        return mesh_process_group(host, secret, encrypt, timeout_s, relays)

    class QuorumGloo(pg_cls):
        """torchft's gloo group; with a secret its rendezvous goes through a relay proving it. Before gloo's own
        rendezvous (bounded by the whole ``timeout_s``) every member says it is there and waits for the others
        within ``publish_window`` (``elastic/mesh.py``: a member that lost the quorum's answer fails the step
        fast)."""

        def __init__(self) -> None:
            super().__init__(timeout=timedelta(seconds=timeout_s))
            self.relays = relays

        def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, *args, **kwargs) -> None:
            if secret is not None:
                store_addr = self.relays.local(store_addr)
            self.abort(errored=False)  # (as torchft's configure does first: no collective runs on the old group)
            await_presence(store_addr, rank, world_size, timeout_s)
            super().configure(store_addr, replica_id, rank, world_size, *args, **kwargs)

        def close_relays(self) -> None:
            self.relays.close()

    return QuorumGloo()


def await_presence(store_addr: str, rank: int, world_size: int, timeout_s: float) -> None:
    """Say ``rank`` is here in the quorum's store (``host:port/prefix``) and wait for every other member within
    ``publish_window(timeout_s)`` (``MeshError`` naming the first missing one)."""
    from dilocox.elastic.mesh import await_key, publish_window
    from dilocox.elastic.torchft import process_group_parts

    create_store_client = process_group_parts()[1]
    deadline = time.monotonic() + publish_window(timeout_s)
    store = create_store_client(store_addr, timedelta(seconds=timeout_s))
    try:
        store.set(f"dlx_present/{rank}", b"1")
        for r in range(world_size):
            await_key(store, f"dlx_present/{r}", deadline, f"member {r}")
    finally:
        del store  # (its connection, not kept alive by a failed step's traceback)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _ips(host: str) -> list:
    """The IP addresses ``host`` names (itself if it is one; a name resolved, [] where it does not resolve)."""
    try:
        return [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        pass
    try:
        return [ipaddress.ip_address(ai[4][0].split("%")[0]) for ai in socket.getaddrinfo(host, None)]
    except (OSError, ValueError):
        return []


def _is_loopback(host: str) -> bool:
    ips = _ips(host)
    return bool(ips) and all(ip.is_loopback for ip in ips)


def _free_on_loopback(port: int) -> bool:
    try:
        socket.create_server(("127.0.0.1", port)).close()
        return True
    except OSError:
        return False


class ManagerGuard:
    """A replica's torchft ``ManagerServer`` behind the run secret (``outer.elastic.lighthouse_auth``; see above).

    torchft's server listens on ``[::]:port`` and advertises ``http://{hostname}:{port}`` (made in its Rust code), so
    the guard takes the replica's address at some port P and the server listens on 127.0.0.1 at the same P
    (``bind``, handed to the ``ManagerServer`` by ``advertise_store``): what torchft advertises is the guard. With a
    loopback address there is nothing to guard (and no second address for P): the server just listens there
    instead of on every interface. While any guard of the process is open, torchft's ``ManagerClient`` is swapped for
    one that dials a non-loopback manager through a ``LighthouseRelay`` proving the secret (this replica's own ranks,
    and a joiner's call to the replica it heals from; managers on loopback are dialed directly). One relay per remote
    manager, kept until the last guard of the process closes. A side effect: torchft's lighthouse cannot call the
    manager any more (its kill request), as no stranger can."""

    _clients_lock = threading.Lock()
    _open = 0
    _real_client = None
    _relays: dict[tuple[str, int], object] = {}

    def __init__(self, host: str, secret: bytes, serve: bool) -> None:
        from dilocox.net.relay import LighthouseGuard

        self.secret, self.guard, self.bind = secret, None, None
        port = int(os.environ.get("TORCHFT_MANAGER_PORT", 0))  # (torchft's own knob for the server's port)
        if serve and any(ip.is_unspecified for ip in _ips(host)):
            raise ValueError(
                f"outer.elastic host {host!r} is not an address other replicas can reach: give this replica's "
                "address (DILOCOX_ELASTIC_HOST or MASTER_ADDR), or 127.0.0.1 for a run on one host"
            )
        if serve and _is_loopback(host):
            self.bind = f"{_bracket(host)}:{port}"
        elif serve:
            for _ in range(20):  # P must be free on the replica's address (the guard) and on 127.0.0.1 (the server)
                guard = LighthouseGuard((host, port), ("127.0.0.1", 0), secret, "manager")
                if _free_on_loopback(guard.port):
                    break
                guard.close()
                if port:
                    raise OSError(f"TORCHFT_MANAGER_PORT={port} is taken on 127.0.0.1 (the guarded manager needs both)")
            else:
                raise OSError("no port free both on the replica's address and on 127.0.0.1 in 20 tries")
            guard.upstream = ("127.0.0.1", guard.port)  # the server takes the same port on loopback
            self.guard, self.bind = guard, f"127.0.0.1:{guard.port}"
        self._install(secret)
        self.closed = False

    @classmethod
    def _install(cls, secret: bytes) -> None:
        from dilocox.net.relay import LighthouseRelay

        tm = manager_module()
        with cls._clients_lock:
            cls._open += 1
            if cls._open > 1:
                return
            real = cls._real_client = tm.ManagerClient

            def client(addr: str, *args, **kwargs):
                hostport = addr.split("://", 1)[-1].rstrip("/")
                host, _, port = hostport.rpartition(":")
                if _is_loopback(host):
                    return real(addr, *args, **kwargs)
                key = (host.strip("[]"), int(port))
                with cls._clients_lock:
                    relay = cls._relays.get(key)
                    if relay is None:
                        relay = cls._relays[key] = LighthouseRelay(
                            [key], secret=secret, connect_timeout_s=5.0, service="manager"
                        )
                return real(relay.address, *args, **kwargs)

            tm.ManagerClient = client

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.guard is not None:
            self.guard.close()
        tm = manager_module()
        cls = type(self)
        with cls._clients_lock:
            cls._open -= 1
            if cls._open == 0 and cls._real_client is not None:
                tm.ManagerClient, cls._real_client = cls._real_client, None
                for relay in cls._relays.values():
                    relay.close()
                cls._relays.clear()
