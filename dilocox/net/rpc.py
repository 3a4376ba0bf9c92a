"""Tensor RPC over TCP (the SWARM peers' calls, an elastic joiner's state transfer): one request, one reply, every
wait bounded.

Wire format of one message (request or reply), both directions the same::

    [8 bytes: big-endian header length][header: UTF-8 JSON][tensor 0 raw bytes][tensor 1 raw bytes]...

The header is ``{"method": str, "meta": {...JSON...}, "tensors": [[name, dtype, shape, nbytes], ...]}``;
a reply's method is ``"ok"``, ``"error"`` (then ``meta["error"]`` holds the server's one-line message) or
``"unavailable"`` (the handler raised ``NotServing``: the caller sees ``PeerUnavailable``).
Tensors travel as their raw contiguous bytes (any dtype, bf16 included), so nothing is pickled.

With a run secret (``use_secret``, from ``security.secret_file``; ``dilocox.net.secure``) every connection
first runs the mutual HMAC challenge-response, and every message is followed by a 32-byte HMAC tag of the
connection's key, direction and sequence number: a stranger is served nothing, a changed or replayed
message closes the connection. With ``security.encrypt`` (``use_secret(..., encrypt=True)``) each message is
instead sent as ``[8-byte length][ChaCha20-Poly1305 ciphertext + tag]`` of the same bytes (``secure.Crypter``; one
such record per ``MAX_SEALED`` bytes, the AEAD's bound, each with its own nonce): the same checks, and its content is
hidden from the path. Nothing read from the network is trusted before it is checked
(``Limits``): the header's length, its JSON shape, every tensor's dtype, shape and byte count (which must
agree) and the message's total bytes are bounded BEFORE any buffer is allocated; a server keeps at most
``max_connections`` authenticated connections (at the cap, a newcomer that proves the secret makes the connection idle
longest, for at least ``EVICT_AFTER_S``, close: callers keep their connections, ``net/client.py``; else new ones
wait in the listen backlog, unaccepted) and hands the
handshake slots out through a ``secure.AcceptGate`` (``max_unauthenticated`` in all, at most
``max_unauthenticated_per_address`` per source address that has not proven the secret before; a connection over its
cap is closed at once, not queued), each handshake done within ``handshake_timeout_s``; it drops a connection
idle for ``idle_timeout_s`` or slower than ``message_timeout_s`` per message, and a malformed message closes
that connection only (logged once per peer address).

``RpcServer(handler)`` serves on a TCP port with one thread per connection; ``handler(method, meta,
tensors) -> (meta, tensors[, release])`` runs in that thread (it may itself call other peers; ``release()``, when
given, is called once the reply's bytes are sent: the handler may hand out live tensors until then); a connection
carries any number of requests, one after the other. ``dilocox.net.client.call(addr, ...)`` sends one request on a
kept connection (or a new one) and waits for the reply under ONE deadline (``timeout_s``, enforced with
socket timeouts on every connect/send/recv). A connection refused / reset / timed out raises
``PeerUnavailable`` naming the address (the SWARM rule: the caller bans that peer and re-sends); an
exception inside the remote handler raises ``RemoteError`` (the peer is alive: not a reason to ban it).
"""

from __future__ import annotations

import json
import logging
import math
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from dilocox.net.secure import (
    MAC_BYTES,
    AcceptGate,
    AuthError,
    Crypter,
    Sealer,
    handshake_s,
    listen_socket,
    server_handshake,
    turn_away,
)
from dilocox.net.tcp import keep_alive

log = logging.getLogger("dilocox.net.rpc")

_LEN = struct.Struct("!Q")
MAX_HEADER = 1 << 16  # a header is a few hundred bytes of JSON; above 64 KiB it is not a dilocox message
WIRE_DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
}


@dataclass(frozen=True)
class Limits:
    """What a message from the network may claim, checked before anything is allocated for it."""

    max_header: int = MAX_HEADER
    max_message_bytes: int = 256 << 20  # all tensors of one message (a peer sets it from its model: ``for_run``)
    max_tensors: int = 64
    max_dims: int = 8
    max_connections: int = 64  # a server's authenticated connections; more wait in the listen backlog (not accepted)
    max_unauthenticated: int = 32  # connections in their handshake (secure.AcceptGate: + half as many reserved for
    max_unauthenticated_per_address: int = 4  # addresses that proved the secret before; at most this many per other
    # address: one over its cap is closed at once, not queued), each done within ...
    handshake_timeout_s: float | None = None  # ... this (None: the process's ``secure.handshake_s()``,
    # security.handshake_s, 2 s by default): a silent stranger holds a slot that long at most
    idle_timeout_s: float = 300.0  # a connection with no request for this long is closed
    message_timeout_s: float = 60.0  # a message that started must be complete within this

    @staticmethod
    def for_run(largest_message_bytes: int, **kw) -> "Limits":
        """Limits for a run whose largest legitimate message carries ``largest_message_bytes`` (x2 + 1 MiB slack)."""
        return Limits(max_message_bytes=2 * int(largest_message_bytes) + (1 << 20), **kw)

    @property
    def max_dim(self) -> int:
        return max(1, self.max_message_bytes)  # no dimension of a tensor that fits can exceed its bytes


MAX_LOGGED = 4096  # peer addresses a server logs a closed connection of (once each); more are only counted
EVICT_AFTER_S = 1.0  # a server at its cap closes a connection idle this long for a newcomer that proved the secret
SWARM_RPC = "swarm-rpc"  # the service name of a SWARM peer's RPC in every handshake (secure.server_handshake)


class ProtocolError(ConnectionError):
    """A message that breaks the wire format or the limits: the connection is closed."""


_state = {"secret": None, "limits": Limits(), "encrypt": False}
_DEFAULT = object()
MAX_SEALED = (1 << 31) - 1  # the AEAD's largest message in the cryptography package (security.encrypt)


def channel(key: bytes, role: str, encrypt: bool) -> Sealer | Crypter:
    """The per-connection protection after the handshake: a MAC per message, or an AEAD (``encrypt``)."""
    return Crypter(key, role) if encrypt else Sealer(key, role)


def run_secret() -> bytes | None:
    """This process's run secret (``use_secret``), e.g. to sign the SWARM address book's entries."""
    return _state["secret"]


def use_secret(secret: bytes | None, limits: Limits | None = None, encrypt: bool = False) -> None:
    """This process's run secret (None: unauthenticated, for a run without one), optionally its limits, and
    whether messages are encrypted (``security.encrypt``; needs a secret): the defaults of every ``RpcServer``
    and ``call`` made after it."""
    if encrypt and secret is None:
        raise ValueError("security.encrypt needs security.authenticate=true (the key comes from the handshake)")
    _state["secret"] = secret
    _state["encrypt"] = bool(encrypt)
    if limits is not None:
        _state["limits"] = limits


def run_encrypts() -> bool:
    """Whether this process's connections are encrypted (``use_secret``)."""
    return _state["encrypt"]


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
    dt = WIRE_DTYPES.get(name) if isinstance(name, str) else None
    if dt is None:
        raise ProtocolError(f"tensor dtype {name!r} is not one of {sorted(WIRE_DTYPES)}")
    return dt


def _specs(header: object, limits: Limits) -> tuple[str, dict, list[tuple[str, torch.dtype, list[int], int]]]:
    """The checked (method, meta, tensor specs) of a decoded header: every claim bounded and consistent."""
    if not isinstance(header, dict) or set(header) != {"method", "meta", "tensors"}:
        raise ProtocolError("the header is not {method, meta, tensors}")
    method, meta, tensors = header["method"], header["meta"], header["tensors"]
    if not isinstance(method, str) or not isinstance(meta, dict) or not isinstance(tensors, list):
        raise ProtocolError("the header's method/meta/tensors have the wrong types")
    if len(tensors) > limits.max_tensors:
        raise ProtocolError(f"{len(tensors)} tensors in one message (limit {limits.max_tensors})")
    out, total = [], 0
    for spec in tensors:
        if not isinstance(spec, list) or len(spec) != 4:
            raise ProtocolError("a tensor spec is not [name, dtype, shape, nbytes]")
        name, dtype, shape, nbytes = spec
        dt = _dtype(dtype)
        if not isinstance(name, str) or not isinstance(shape, list) or len(shape) > limits.max_dims:
            raise ProtocolError(f"tensor spec {str(spec)[:80]}: bad name or shape")
        if any(type(d) is not int or not 0 <= d <= limits.max_dim for d in shape) or type(nbytes) is not int:
            raise ProtocolError(f"tensor {name[:40]!r}: shape and nbytes must be integers in [0, the message limit]")
        want = math.prod(shape) * dt.itemsize
        if nbytes != want:
            raise ProtocolError(f"tensor {name[:40]!r}: nbytes {nbytes} != shape {shape} x {dt.itemsize} bytes")
        total += nbytes
        if total > limits.max_message_bytes:
            raise ProtocolError(
                f"a message of more than {total} tensor bytes (limit {limits.max_message_bytes}: the run's largest)"
            )
        out.append((name, dt, shape, nbytes))
    return method, meta, out


def encode(method: str, meta: dict, tensors: dict[str, Tensor] | None = None) -> list[bytes | memoryview]:
    """The frames of one message (header first); tensors are made contiguous CPU tensors. ValueError for a dtype that
    is not on the wire (every receiver would close the connection, and the caller take it for a dead peer)."""
    specs, bufs = [], []
    for name, t in (tensors or {}).items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in WIRE_DTYPES:
            raise ValueError(f"tensor {name!r}: a {dtype} tensor cannot be sent (dtypes: {sorted(WIRE_DTYPES)})")
        t = t.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        specs.append([name, dtype, list(t.shape), t.numel() * t.element_size()])
        bufs.append(memoryview(raw) if t.numel() else b"")
    header = json.dumps({"method": method, "meta": meta, "tensors": specs}).encode()
    return [_LEN.pack(len(header)), header, *bufs]


def _send_all(
    sock: socket.socket, frames: list, deadline: float, addr: str, seal: Sealer | Crypter | None = None
) -> None:
    if isinstance(seal, Crypter):  # the message sealed in records of <= MAX_SEALED bytes: [8-byte length][ct + tag]
        plain, frames = memoryview(b"".join(frames)), []
        for a in range(0, len(plain), MAX_SEALED):
            sealed = seal.encrypt(plain[a : a + MAX_SEALED])
            frames += [_LEN.pack(len(sealed)), sealed]
    elif seal is not None:  # the message's tag follows it
        h = seal.sealer()
        for f in frames:
            h.update(f)
        frames = [*frames, h.digest()]
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
    _recv_into(sock, memoryview(buf), deadline)
    return buf


class _Sealed:
    """``_recv_exact`` over the plaintext of a sealed message, record by record (``security.encrypt``): each record's
    length is bounded (by ``MAX_SEALED`` and what is left of the message's limit) before it is read, and its tag is
    checked before a byte of it is used."""

    def __init__(self, sock: socket.socket, seal: Crypter, most: int) -> None:
        self.sock, self.seal, self.left = sock, seal, most
        self.view, self.pos = memoryview(bytearray()), 0

    def _next(self, deadline: float | None) -> None:
        (n,) = _LEN.unpack(_recv_exact(self.sock, _LEN.size, deadline))
        most = min(self.left, MAX_SEALED) + Crypter.TAG_BYTES
        if not Crypter.TAG_BYTES < n <= most:
            raise ProtocolError(f"a sealed record of {n} bytes (limit {most}: the run's largest)")
        plain = self.seal.decrypt(_recv_exact(self.sock, n, deadline))
        self.left -= len(plain)
        self.view, self.pos = memoryview(bytearray(plain)), 0  # (writable: tensors are made over it)

    def read(self, n: int, deadline: float | None = None) -> bytearray | memoryview:
        if self.pos + n <= len(self.view):  # (within one record: no copy)
            self.pos += n
            return self.view[self.pos - n : self.pos]
        out, got = bytearray(n), 0  # (n was bounded by the limits before this read)
        while got < n:
            if self.pos == len(self.view):
                self._next(deadline)
            k = min(n - got, len(self.view) - self.pos)
            out[got : got + k] = self.view[self.pos : self.pos + k]
            got, self.pos = got + k, self.pos + k
        return out


def read_message(
    sock: socket.socket, deadline: float | None, limits: Limits | None = None, seal: Sealer | Crypter | None = None
) -> tuple[str, dict, dict[str, Tensor]]:
    """One message from ``sock`` (deadline None: wait while the peer keeps the connection open), its claims
    checked against ``limits`` before anything is allocated and its tag against ``seal`` (if any; a ``Crypter``:
    each sealed record's length is bounded by the limits, then it is decrypted whole and parsed: ``_Sealed``)."""
    limits = limits or _state["limits"]
    if isinstance(seal, Crypter):
        buf = _Sealed(sock, seal, _LEN.size + limits.max_header + limits.max_message_bytes)
        out = _parse(buf.read, deadline, limits, None)
        if buf.pos != len(buf.view):
            raise ProtocolError("a sealed message longer than its header claims")
        return out
    return _parse(lambda k, d: _recv_exact(sock, k, d), deadline, limits, seal)


def _recv_into(sock: socket.socket, view: memoryview, deadline: float | None) -> None:
    """``_recv_exact`` into a buffer the caller owns."""
    got = 0
    while got < len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("receive timed out")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], len(view) - got)
        if k == 0:
            raise ConnectionResetError("connection closed by the other side")
        got += k


def _parse(
    read, deadline: float | None, limits: Limits, seal: Sealer | None, dst: Tensor | None = None, fill=None
) -> tuple[str, dict, dict[str, Tensor]]:
    """One message through ``read(n, deadline)``. With ``dst`` (contiguous, CPU) and ``fill(view, deadline)``: a
    message of one tensor ``t`` of ``dst``'s dtype and size is received by ``fill`` straight into ``dst``'s bytes."""
    raw_len = read(_LEN.size, deadline)
    (hlen,) = _LEN.unpack(raw_len)
    if hlen > limits.max_header:
        raise ProtocolError(f"a header of {hlen} bytes (limit {limits.max_header}): not a dilocox swarm message")
    raw_header = read(hlen, deadline)
    try:
        header = json.loads(bytes(raw_header).decode())
    except (ValueError, RecursionError) as e:  # (JSONDecodeError, UnicodeDecodeError, a 4300-digit integer)
        raise ProtocolError(f"the header is not JSON ({type(e).__name__})") from None
    method, meta, specs = _specs(header, limits)
    h = seal.checker() if seal is not None else None
    if h is not None:
        h.update(raw_len)
        h.update(raw_header)
    tensors = {}
    for name, dt, shape, nbytes in specs:
        if fill is not None and dst is not None and len(specs) == 1 and name == "t" and nbytes and dt == dst.dtype:
            if nbytes == dst.numel() * dst.element_size():  # (no buffer of the message's size allocated for it)
                raw = memoryview(dst.view(-1).view(torch.uint8).numpy())
                fill(raw, deadline)
                if h is not None:
                    h.update(raw)
                tensors[name] = dst.view(-1).view(shape)
                continue
        raw = read(nbytes, deadline) if nbytes else bytearray()
        if h is not None and nbytes:
            h.update(raw)
        try:
            t = torch.frombuffer(raw, dtype=torch.uint8).view(dt) if nbytes else torch.empty(0, dtype=dt)
            tensors[name] = t.reshape(shape)
        except RuntimeError as e:  # (shape and nbytes were checked to agree: this is a corner torch refuses)
            raise ProtocolError(f"tensor {name[:40]!r}: {str(e).splitlines()[0][:80]}") from None
    if h is not None:
        Sealer.verify(h, bytes(read(MAC_BYTES, deadline)))
    return method, meta, tensors


class RpcServer:
    """Serves ``handler`` on ``host:port`` (port 0: a free one; see ``.addr``), one thread per connection.

    ``secret`` (default: ``use_secret``'s; None: no authentication), ``limits`` and ``encrypt`` (defaults:
    ``use_secret``'s) as in the module docstring; ``service`` names what it serves in every handshake (a caller's
    ``call`` must name the same)."""

    def __init__(
        self,
        handler: Handler,
        host: str = "127.0.0.1",
        port: int = 0,
        name: str = "rpc",
        secret=_DEFAULT,
        limits: Limits | None = None,
        encrypt=_DEFAULT,
        service: str = SWARM_RPC,
    ) -> None:
        self.handler, self.name, self.service = handler, name, service
        self.secret = _state["secret"] if secret is _DEFAULT else secret
        self.encrypt = _state["encrypt"] if encrypt is _DEFAULT else encrypt
        self.limits = limits or _state["limits"]
        self._sock = listen_socket(host, port)  # (an IPv6 address too; closed if the bind fails)
        self._sock.settimeout(0.2)  # the accept loop polls the stop flag
        self.addr = f"{host}:{self._sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._logged: set[str] = set()  # peer addresses whose bad connection was logged already (once each)
        lim = self.limits
        self.gate = AcceptGate(  # handshake slots: per source address, with a reserve for addresses proven before
            per_address=lim.max_unauthenticated_per_address,
            total=lim.max_unauthenticated,
            reserved=max(1, lim.max_unauthenticated // 2),
            per_member=lim.max_unauthenticated,
        )
        self._handshaking = 0  # connections in _conns still in their handshake (not counted in max_connections)
        self._idle_since: dict[socket.socket, float] = {}  # connections waiting for their next request: since when
        self._was_full = False  # (over_cap counts the times a cap was reached, not the polls while it holds)
        self.rejected = {"over_cap": 0, "auth": 0, "malformed": 0, "idle": 0, "evicted": 0}  # counters (tests, logs)
        self._thread = threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True)
        self._thread.start()

    def _note(self, kind: str, peer: str, why: str) -> None:
        with self._lock:
            self.rejected[kind] += 1
            first = peer not in self._logged and len(self._logged) < MAX_LOGGED  # (bounded: a flood from many
            if first:  # addresses is counted in ``rejected``, not remembered nor logged past MAX_LOGGED of them)
                self._logged.add(peer)
            last = "; further addresses are not logged" if len(self._logged) == MAX_LOGGED else ""
        if first:  # once per peer address: a flood of bad messages does not flood the log
            log.warning("%s: closed a connection from %s (%s): %s%s", self.name, peer, kind, why, last)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:  # authenticated connections at their cap: new ones wait in the kernel's listen backlog,
                full = len(self._conns) - self._handshaking >= self.limits.max_connections
                room = full and self._longest_idle() is not None  # unless one of them idles: accepted, and once it
            if full and not room:  # proves the secret, the longest idle makes way (_make_room; a stranger never does)
                self.rejected["over_cap"] += 1 if not self._was_full else 0
                self._was_full = True
                time.sleep(0.01)
                continue
            self._was_full = False
            try:
                conn, peer = self._sock.accept()
            except (socket.timeout, TimeoutError):
                continue
            except OSError as e:
                if self._stop.is_set():
                    break
                log.warning("%s: accept failed (%s); retrying", self.name, e)  # e.g. out of file descriptors
                time.sleep(0.05)
                continue
            ip = peer[0]
            slot = None
            if self.secret is not None:
                slot = self.gate.admit(ip)
                if slot is None:  # over its address's cap (a flood from one address): closed at once, not queued
                    turn_away(conn)
                    with self._lock:
                        self.rejected["over_cap"] += 1
                    continue
            with self._lock:
                self._conns.add(conn)
                self._handshaking += slot is not None
            try:
                threading.Thread(
                    target=self._serve, args=(conn, ip, slot), name=f"{self.name}-conn", daemon=True
                ).start()
            except RuntimeError as e:  # (no thread to be had: this connection, not the server)
                log.warning("%s: no thread for a connection (%s)", self.name, e)
                self._handshake_done(slot)
                with self._lock:
                    self._conns.discard(conn)
                conn.close()

    def _longest_idle(self) -> socket.socket | None:
        """(under the lock) The connection idle longest, if for at least ``EVICT_AFTER_S`` (never a fresh one)."""
        if not self._idle_since:
            return None
        conn = min(self._idle_since, key=self._idle_since.__getitem__)
        return conn if time.monotonic() - self._idle_since[conn] >= EVICT_AFTER_S else None

    def _make_room(self) -> None:
        """A connection that proved the secret (or any, without one) took the server over its cap: close the one
        idle longest (a caller's kept connection: it dials again when it needs it). One per newcomer."""
        with self._lock:
            if len(self._conns) - self._handshaking <= self.limits.max_connections:
                return
            conn = self._longest_idle()
            if conn is None:
                return  # (all busy: one over the cap until one ends)
            del self._idle_since[conn]  # (its thread sees this and serves no further request on it)
            self._conns.discard(conn)
            self.rejected["evicted"] += 1
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _handshake_done(self, slot, proven: bool = False) -> None:
        if slot is None:
            return
        self.gate.release(slot, proven)
        with self._lock:
            self._handshaking -= 1

    def _serve(self, conn: socket.socket, peer: str = "?", slot=None) -> None:
        seal = None
        try:
            keep_alive(conn).setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.secret is not None:
                proven = False
                try:
                    deadline = time.monotonic() + (self.limits.handshake_timeout_s or handshake_s())
                    key = server_handshake(conn, self.secret, deadline, self.service)
                    proven = True
                except (AuthError, OSError) as e:  # (socket.timeout is an OSError: a slow or silent stranger)
                    self._note("auth", peer, str(e))
                    return
                finally:
                    self._handshake_done(slot, proven)
                    slot = None
                seal = channel(key, "server", self.encrypt)
            self._make_room()
            while not self._stop.is_set():
                try:
                    # an idle connection may wait for its next request, but wakes up to see the stop flag
                    method, meta, tensors = self._read_idle(conn, seal)
                except (ProtocolError, AuthError) as e:
                    self._note("malformed" if isinstance(e, ProtocolError) else "auth", peer, str(e))
                    return
                except (ConnectionError, OSError, ValueError, RuntimeError):
                    return  # closed or timed out mid-message
                if method is None:
                    return
                release = None
                try:
                    rmeta, rtensors, *rest = self.handler(method, meta, tensors)
                    release = rest[0] if rest else None
                    frames = encode("ok", rmeta or {}, rtensors)
                except NotServing as e:
                    frames = encode("unavailable", {"error": str(e)})
                except Exception as e:  # noqa: BLE001 - reported to the caller as RemoteError
                    log.debug("%s: handler %r raised", self.name, method, exc_info=True)
                    first = str(e).splitlines()[0] if str(e) else ""
                    frames = encode("error", {"error": f"{type(e).__name__}: {first}"})
                try:
                    _send_all(conn, frames, time.monotonic() + self.limits.message_timeout_s, "caller", seal)
                except (OSError, socket.timeout):
                    return  # the caller gave up (its timeout): nothing to answer to
                finally:
                    if release is not None:  # the handler's tensors may change from now on
                        release()
        finally:
            self._handshake_done(slot)  # (setsockopt failed before the handshake)
            with self._lock:
                self._conns.discard(conn)
                self._idle_since.pop(conn, None)
            conn.close()

    def _read_idle(self, conn: socket.socket, seal: Sealer | None = None):
        conn.settimeout(0.5)
        idle_until = time.monotonic() + self.limits.idle_timeout_s
        with self._lock:
            self._idle_since[conn] = time.monotonic()
        while True:
            try:
                first = conn.recv(1, socket.MSG_PEEK)
            except (socket.timeout, TimeoutError):
                if self._stop.is_set():
                    return None, None, None
                if time.monotonic() > idle_until:
                    with self._lock:
                        self.rejected["idle"] += 1
                    return None, None, None
                continue
            with self._lock:
                evicted = self._idle_since.pop(conn, None) is None
            if not first or evicted:
                return None, None, None
            # a message has started: the rest must follow within a bound
            return read_message(conn, time.monotonic() + self.limits.message_timeout_s, self.limits, seal)

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
