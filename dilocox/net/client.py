"""The caller's side of the tensor RPC (``dilocox.net.rpc``): ``call``, over connections that are KEPT between
calls (issue 42 item 2: persistent authenticated connections between SWARM peers, not a handshake per hop).

A call to ``host:port`` for one service, secret and ``security.encrypt`` setting takes an idle connection of that
key from this process's pool when one is there, else dials (TCP connect + the server's challenge + the client's
proof, the request right behind it: ``secure.dial(full=False)``). After a whole reply the connection goes back to
the pool, its per-message MAC or AEAD sequence counters running on (``secure.Sealer``/``Crypter``: a message
replayed from an earlier call on it still fails). On a link of round trip r a kept connection saves the TCP connect
and the challenge, about 1.5 r per call, and the handshake's HMACs; under a flood of strangers an honest caller with
a kept connection needs no handshake slot at all.

When a kept connection is not used:

- it is older than ``POOL_IDLE_S`` since its last reply (the server closes one idle for ``Limits.idle_timeout_s``,
  300 s by default): closed, a new one is dialed;
- the server closed it meanwhile (a restart, its idle timeout): a non-blocking peek sees the end of the stream (or
  bytes nobody asked for) and it is closed;
- the request went out on it but the connection ended before the FIRST byte of the reply, within ``STALE_RETRY_S``
  of the send: it is closed and the request is sent once more on a fresh connection, within the same deadline. This
  is safe for every method: the server reads a request whole before its handler runs and always answers or closes
  because it stops, and a stopped server refuses the fresh connection (the caller then sees ``PeerUnavailable``, as
  before). A timeout, a reply cut short or a bad tag is never retried (the handler may have run).

Any error closes the connection it happened on. At most ``POOL_PER_KEY`` idle connections are kept per key (a
peer's ``max_inflight`` concurrent calls to one peer open that many; the rest are closed when they return); idle ones
past ``POOL_IDLE_S`` are closed every few seconds, whichever peer they lead to.
``call(..., keep=False)`` dials and closes as before (a joiner's one state download).
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from dataclasses import dataclass

from torch import Tensor

from dilocox.net.rpc import (
    _DEFAULT,
    SWARM_RPC,
    Limits,
    PeerUnavailable,
    RemoteError,
    _recv_exact,
    _send_all,
    _state,
    channel,
    encode,
    read_message,
)
from dilocox.net.secure import MAC_BYTES, AuthError, check_server_proof, dial
from dilocox.net.tcp import keep_alive

POOL_IDLE_S = 60.0  # a kept connection unused for longer is closed, not reused (well inside the server's 300 s)
POOL_PER_KEY = 8
STALE_RETRY_S = 0.25  # a request is sent again on a fresh connection only if the kept one ended this soon after it
# went out (its meta, e.g. a SWARM forward's budget, was written for the first send)


def _parse_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"peer address {addr!r} is not host:port")
    return host.strip("[]"), int(port)


@dataclass
class _Conn:
    sock: socket.socket
    seal: object  # Sealer | Crypter | None
    expect: bytes | None  # the server's proof still to be read (a fresh authenticated connection), else None
    idle_since: float = 0.0

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class Pool:
    """Idle connections by (address, service, secret, encrypt); thread-safe."""

    def __init__(self, per_key: int = POOL_PER_KEY, idle_s: float = POOL_IDLE_S) -> None:
        self.per_key, self.idle_s = per_key, idle_s
        self._idle: dict[tuple, list[_Conn]] = {}
        self._lock = threading.Lock()
        self.dialed = 0  # connections made (tests, the rpc bench)
        self.reused = 0
        self._swept = time.monotonic()

    def take(self, key: tuple) -> _Conn | None:
        """The most recently used idle connection of ``key`` that is still open, or None."""
        now = time.monotonic()
        while True:
            with self._lock:
                conns = self._idle.get(key)
                if not conns:
                    return None
                c = conns.pop()
            if now - c.idle_since <= self.idle_s and _still_open(c.sock):
                with self._lock:
                    self.reused += 1
                return c
            c.close()

    def count_dial(self) -> None:
        with self._lock:
            self.dialed += 1

    def give_back(self, key: tuple, c: _Conn) -> None:
        now = c.idle_since = time.monotonic()
        stale: list[_Conn] = []
        with self._lock:
            if now - self._swept > min(5.0, self.idle_s):  # connections to peers that went away: closed in time
                self._swept = now
                for k in list(self._idle):
                    keep = [x for x in self._idle[k] if now - x.idle_since <= self.idle_s]
                    stale += [x for x in self._idle[k] if now - x.idle_since > self.idle_s]
                    if keep:
                        self._idle[k] = keep
                    else:
                        del self._idle[k]
            conns = self._idle.setdefault(key, [])
            if len(conns) < self.per_key:
                conns.append(c)
                c = None
        for x in stale + ([c] if c is not None else []):
            x.close()

    def close_all(self) -> None:
        with self._lock:
            conns = [c for cs in self._idle.values() for c in cs]
            self._idle.clear()
        for c in conns:
            c.close()

    def idle(self, addr: str | None = None) -> int:
        with self._lock:
            return sum(len(cs) for k, cs in self._idle.items() if addr is None or k[0] == addr)


POOL = Pool()


def _still_open(sock: socket.socket) -> bool:
    """False when the server closed the connection (or sent something unasked): it must not carry a request."""
    try:
        sock.settimeout(0)  # (a timeout would make the peek wait for data: Python polls before recv)
        sock.recv(1, socket.MSG_PEEK)
        return False  # the end of the stream (b""), or bytes nobody asked for
    except (BlockingIOError, InterruptedError):
        return True  # nothing to read: open and quiet
    except OSError:
        return False


class _Stale(Exception):
    """A kept connection ended before the first byte of the reply: send again on a fresh one."""


def _exchange(c: _Conn, frames: list, deadline: float, addr: str, reused: bool, service: str, limits):
    """Send one request on ``c`` and read its reply: (status, meta, tensors)."""
    sent = time.monotonic()
    try:
        _send_all(c.sock, frames, deadline, addr, c.seal)
        if c.expect is not None:
            proof = bytes(_recv_exact(c.sock, MAC_BYTES, deadline))
            check_server_proof(proof, c.expect)
            c.expect = None
        elif reused:  # the first byte of the reply, or the end of a connection the server had closed
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("no reply before the deadline")
            c.sock.settimeout(left)
            if c.sock.recv(1, socket.MSG_PEEK) == b"":
                if time.monotonic() - sent > STALE_RETRY_S:
                    raise ConnectionResetError("the peer closed the connection before its reply")
                raise _Stale()
    except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError) as e:
        if reused and time.monotonic() - sent <= STALE_RETRY_S:
            raise _Stale() from e
        if c.expect is None:
            raise
        raise AuthError(
            "the server closed the connection right after our proof: it holds another run secret "
            "(security.secret_file must be the same file on every host), serves another service than "
            f"{service!r}, runs with another security.encrypt, or it died"
        ) from None
    return read_message(c.sock, deadline, limits, c.seal)


def call(
    addr: str,
    method: str,
    meta: dict,
    tensors: dict[str, Tensor] | None = None,
    timeout_s: float = 30.0,
    secret=_DEFAULT,
    limits: Limits | None = None,
    encrypt=_DEFAULT,
    service: str = SWARM_RPC,
    keep: bool = True,
) -> tuple[dict, dict[str, Tensor]]:
    """Send one request to ``addr`` (``host:port``) and return the reply's ``(meta, tensors)``.

    Everything (connect, authentication, send, the remote handler's work, receive) must finish within
    ``timeout_s``, else ``PeerUnavailable``; ``RemoteError`` when the remote handler raised. ``secret``
    (default: ``use_secret``'s) authenticates both sides for ``service`` (the server's must be the same); a server
    without the secret, or of another service, is unavailable. ``keep``: take and return the connection through
    the pool (module docstring); False: a connection of its own, closed after the reply.
    """
    secret = _state["secret"] if secret is _DEFAULT else secret
    encrypt = _state["encrypt"] if encrypt is _DEFAULT else encrypt
    deadline = time.monotonic() + timeout_s
    host, port = _parse_addr(addr)
    frames = encode(method, meta, tensors)
    key = (addr, service, secret, bool(encrypt))
    c = POOL.take(key) if keep else None
    try:
        while True:
            reused = c is not None
            if c is None:
                c = _dial(host, port, secret, service, deadline, timeout_s, encrypt)
            try:
                status, rmeta, rtensors = _exchange(c, frames, deadline, addr, reused, service, limits)
                break
            except _Stale:
                c.close()
                c = None
    except (socket.timeout, TimeoutError) as e:
        _drop(c)
        raise PeerUnavailable(addr, f"no reply to {method!r} within {timeout_s:.1f}s ({e})") from e
    except (OSError, json.JSONDecodeError, struct.error) as e:  # AuthError and ProtocolError are ConnectionErrors
        _drop(c)
        raise PeerUnavailable(addr, f"{method!r}: {type(e).__name__}: {e}") from e
    except BaseException:
        _drop(c)
        raise
    if keep:
        POOL.give_back(key, c)
    else:
        c.close()
    if status == "unavailable":
        raise PeerUnavailable(addr, f"{method!r}: not serving: {rmeta.get('error', '')}")
    if status == "error":
        raise RemoteError(addr, str(rmeta.get("error", "unknown error")))
    return rmeta, rtensors


def _drop(c: _Conn | None) -> None:
    if c is not None:
        c.close()


def _dial(host: str, port: int, secret, service: str, deadline: float, timeout_s: float, encrypt) -> _Conn:
    POOL.count_dial()
    if secret is not None:  # the request follows the client's proof at once; the server's proof is checked
        sock, key, expect = dial((host, port), secret, service, deadline, full=False)  # before its reply is read
        return _Conn(sock, channel(key, "client", encrypt), expect)
    sock = socket.create_connection((host, port), timeout=max(0.01, timeout_s))
    keep_alive(sock).setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return _Conn(sock, None, None)
