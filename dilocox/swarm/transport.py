"""Tensor RPC over TCP for SWARM peers: one request, one reply, every wait bounded.

Wire format of one message (request or reply), both directions the same::

    [8 bytes: big-endian header length][header: UTF-8 JSON][tensor 0 raw bytes][tensor 1 raw bytes]...

The header is ``{"method": str, "meta": {...JSON...}, "tensors": [[name, dtype, shape, nbytes], ...]}``;
a reply's method is ``"ok"``, ``"error"`` (then ``meta["error"]`` holds the server's one-line message) or
``"unavailable"`` (the handler raised ``NotServing``: the caller sees ``PeerUnavailable``).
Tensors travel as their raw contiguous bytes (any dtype, bf16 included), so nothing is pickled.

``RpcServer(handler)`` serves on a TCP port with one thread per connection; ``handler(method, meta,
tensors) -> (meta, tensors)`` runs in that thread (it may itself call other peers). ``call(addr, ...)``
opens a connection, sends, and waits for the reply under ONE deadline (``timeout_s``, enforced with
socket timeouts on every connect/send/recv). A connection refused / reset / timed out raises
``PeerUnavailable`` naming the address (the SWARM rule: the caller bans that peer and re-sends); an
exception inside the remote handler raises ``RemoteError`` (the peer is alive: not a reason to ban it).
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from typing import Callable

import torch
from torch import Tensor

log = logging.getLogger("dilocox.swarm.transport")

_LEN = struct.Struct("!Q")
MAX_HEADER = 1 << 24  # a header above 16 MiB is a corrupt stream, not a real message

Handler = Callable[[str, dict, dict[str, Tensor]], tuple[dict, dict[str, Tensor]]]


class PeerUnavailable(ConnectionError):
    """The peer at ``addr`` did not answer within the timeout, refused, or dropped the connection."""

    def __init__(self, addr: str, reason: str) -> None:
        super().__init__(f"peer {addr} unavailable: {reason}")
        self.addr, self.reason = addr, reason


class NotServing(RuntimeError):
    """Raised by a handler that is up but does not serve this request yet (a joining peer): the caller gets
    ``PeerUnavailable`` (ban and re-send elsewhere), not ``RemoteError``."""


class RemoteError(RuntimeError):
    """The peer at ``addr`` answered, but its handler raised (the message is the peer's)."""

    def __init__(self, addr: str, message: str) -> None:
        super().__init__(f"peer {addr} failed: {message}")
        self.addr, self.message = addr, message


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} on the wire")
    return dt


def encode(method: str, meta: dict, tensors: dict[str, Tensor] | None = None) -> list[bytes | memoryview]:
    """The frames of one message (header first); tensors are made contiguous CPU tensors."""
    specs, bufs = [], []
    for name, t in (tensors or {}).items():
        t = t.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        specs.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size()])
        bufs.append(memoryview(raw) if t.numel() else b"")
    header = json.dumps({"method": method, "meta": meta, "tensors": specs}).encode()
    return [_LEN.pack(len(header)), header, *bufs]


def _send_all(sock: socket.socket, frames: list, deadline: float, addr: str) -> None:
    for f in frames:
        view = memoryview(f).cast("B") if not isinstance(f, bytes) else memoryview(f)
        while len(view):
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("send timed out")
            sock.settimeout(left)
            n = sock.send(view)
            view = view[n:]


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("receive timed out")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionResetError("connection closed by the other side")
        got += k
    return buf


def read_message(sock: socket.socket, deadline: float | None) -> tuple[str, dict, dict[str, Tensor]]:
    """One message from ``sock`` (deadline None: wait while the peer keeps the connection open)."""
    (hlen,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline))
    if hlen > MAX_HEADER:
        raise ConnectionResetError(f"header of {hlen} bytes: not a dilocox swarm stream")
    header = json.loads(_recv_exact(sock, hlen, deadline).decode())
    tensors = {}
    for name, dtype, shape, nbytes in header["tensors"]:
        raw = _recv_exact(sock, nbytes, deadline) if nbytes else bytearray()
        dt = _dtype(dtype)
        t = torch.frombuffer(raw, dtype=torch.uint8).view(dt) if nbytes else torch.empty(0, dtype=dt)
        tensors[name] = t.reshape(shape)
    return header["method"], header["meta"], tensors


def _parse(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"peer address {addr!r} is not host:port")
    return host.strip("[]"), int(port)


def call(
    addr: str, method: str, meta: dict, tensors: dict[str, Tensor] | None = None, timeout_s: float = 30.0
) -> tuple[dict, dict[str, Tensor]]:
    """Send one request to ``addr`` (``host:port``) and return the reply's ``(meta, tensors)``.

    Everything (connect, send, the remote handler's work, receive) must finish within ``timeout_s``,
    else ``PeerUnavailable``; ``RemoteError`` when the remote handler raised.
    """
    deadline = time.monotonic() + timeout_s
    host, port = _parse(addr)
    frames = encode(method, meta, tensors)
    try:
        with socket.create_connection((host, port), timeout=max(0.01, timeout_s)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _send_all(sock, frames, deadline, addr)
            status, rmeta, rtensors = read_message(sock, deadline)
    except (socket.timeout, TimeoutError) as e:
        raise PeerUnavailable(addr, f"no reply to {method!r} within {timeout_s:.1f}s ({e})") from e
    except (OSError, json.JSONDecodeError, struct.error) as e:
        raise PeerUnavailable(addr, f"{method!r}: {type(e).__name__}: {e}") from e
    if status == "unavailable":
        raise PeerUnavailable(addr, f"{method!r}: not serving: {rmeta.get('error', '')}")
    if status == "error":
        raise RemoteError(addr, str(rmeta.get("error", "unknown error")))
    return rmeta, rtensors


class RpcServer:
    """Serves ``handler`` on ``host:port`` (port 0: a free one; see ``.addr``), one thread per connection."""

    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0, name: str = "rpc") -> None:
        self.handler, self.name = handler, name
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(128)
        self._sock.settimeout(0.2)  # the accept loop polls the stop flag
        self.addr = f"{host}:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (socket.timeout, TimeoutError):
                continue
            except OSError:
                break
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name=f"{self.name}-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while not self._stop.is_set():
                try:
                    # an idle connection may wait for its next request, but wakes up to see the stop flag
                    method, meta, tensors = self._read_idle(conn)
                except (ConnectionError, OSError, ValueError, json.JSONDecodeError):
                    return
                if method is None:
                    return
                try:
                    rmeta, rtensors = self.handler(method, meta, tensors)
                    frames = encode("ok", rmeta or {}, rtensors)
                except NotServing as e:
                    frames = encode("unavailable", {"error": str(e)})
                except Exception as e:  # noqa: BLE001 - reported to the caller as RemoteError
                    log.debug("%s: handler %r raised", self.name, method, exc_info=True)
                    first = str(e).splitlines()[0] if str(e) else ""
                    frames = encode("error", {"error": f"{type(e).__name__}: {first}"})
                try:
                    _send_all(conn, frames, time.monotonic() + 60.0, "caller")
                except (OSError, socket.timeout):
                    return  # the caller gave up (its timeout): nothing to answer to
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _read_idle(self, conn: socket.socket):
        conn.settimeout(0.5)
        while True:
            try:
                first = conn.recv(1, socket.MSG_PEEK)
            except (socket.timeout, TimeoutError):
                if self._stop.is_set():
                    return None, None, None
                continue
            if not first:
                return None, None, None
            # a message has started: the rest must follow within a bound
            return read_message(conn, time.monotonic() + 60.0)

    def close(self) -> None:
        """Stop accepting, drop open connections (their callers see PeerUnavailable)."""
        self._stop.set()
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=2.0)
