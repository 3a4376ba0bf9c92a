"""A SWARM job's shared services behind the run secret (issue 21, docs/SECURITY.md): the address store and the stage
lighthouses.

torch's ``TCPStore`` and torchft's lighthouse authenticate nobody: whoever reaches their port can delete or overwrite
the store's entries or join a stage's quorum. With ``security.authenticate`` and ``security.guard_services`` (both on
by default) the job's store and lighthouses listen on 127.0.0.1 only, a ``LighthouseGuard`` (dilocox/net/relay.py:
a mutual HMAC handshake, then every chunk framed and MACed) holds the public port, and every client (peer, mover,
launcher) reaches them through a local ``LighthouseRelay`` that proves the secret. A stranger gets the guard's
challenge and nothing else.
"""

from __future__ import annotations

import time
from datetime import timedelta

_RELAYS: dict = {}  # local port -> the relay of a store client of this process (closed by ``release``)


def service_secret(cfg) -> bytes | None:
    """The secret the job's store and lighthouses want (None: they are plain): the run secret when
    ``security.authenticate`` and ``security.guard_services``."""
    if not (cfg.security.authenticate and cfg.security.guard_services):
        return None
    from dilocox.swarm.common import rpc_security

    return rpc_security(cfg)[0]


class GuardedStore:
    """A ``TCPStore`` master on 127.0.0.1 and a guard on ``host:port`` (0 = any) in front of it: ``store`` is the
    master's own handle (it reaches the server directly), ``port`` the public one."""

    def __init__(self, host: str, port: int, secret: bytes, timeout: timedelta) -> None:
        from dilocox.elastic.stores import guarded_replica_store

        # (a TCPStore master given "127.0.0.1" still listens on every interface: the store binds its socket itself)
        self.store, _, (_, self.port), self.guard = guarded_replica_store(host, secret, timeout, port, "swarm-store")

    def close(self) -> None:
        self.guard.close()


def store_master(host: str, port: int, secret: bytes | None, timeout: timedelta):
    """(the master's store handle, its public port, the guard or None): plain when ``secret`` is None."""
    if secret is None:
        from torch.distributed import TCPStore

        store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)
        return store, store.port, None
    g = GuardedStore(host, port, secret, timeout)
    return g.store, g.port, g


def store_client(host: str, port: int, secret: bytes | None, timeout: timedelta):
    """A ``TCPStore`` client of the job's store at ``host:port``; with ``secret`` through a local relay that proves
    it to the store's guard (a wrong or missing secret: the relay closes the connection and the client's connect
    fails within ``timeout``)."""
    from torch.distributed import TCPStore

    if secret is None:
        try:
            return TCPStore(host, port, is_master=False, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - torch's DistNetworkError/DistStoreError: one line for the caller
            raise TimeoutError(
                f"the SWARM address store at {host}:{port} did not answer within "
                f"{timeout.total_seconds():.0f}s (not up yet, or another address): {e}"
            ) from e
    from dilocox.net.relay import LighthouseRelay

    wait_s = max(1.0, min(5.0, timeout.total_seconds()))
    relay = LighthouseRelay([(host.strip("[]"), port)], secret=secret, connect_timeout_s=wait_s, service="swarm-store")
    local = int(relay.address.rsplit(":", 1)[1])
    _RELAYS[local] = relay
    deadline = time.monotonic() + timeout.total_seconds()
    while True:  # the relay closes its side while the store's guard is not up yet: retry, as a plain client does
        try:
            return TCPStore("127.0.0.1", local, is_master=False, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - torch raises its own kinds (connection reset, timeout)
            if time.monotonic() + 0.5 >= deadline:
                raise TimeoutError(
                    f"the SWARM address store at {host}:{port} did not accept this process through its guard within "
                    f"{timeout.total_seconds():.0f}s (not up, or another run secret / security.guard_services=false "
                    f"there): {e}"
                ) from e
            time.sleep(0.5)


def release(store) -> None:
    """Close the relay behind a ``store_client`` (and so every connection through it: the store is not used after);
    nothing for a plain client."""
    relay = _RELAYS.pop(getattr(store, "port", None), None) if store is not None else None
    if relay is not None:
        relay.close()
