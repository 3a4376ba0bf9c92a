"""The run secret and the authenticated channel of dilocox's own TCP services (docs/SECURITY.md).

Every process of one run holds the same secret (``security.secret_file``: 32 random bytes, hex, a file
of mode 0600 that ``dilocox swarm`` writes when absent and passes to its peers by path, never on a
command line). A connection is authenticated both ways by an HMAC-SHA256 challenge-response over the
secret, the construction of Python's own ``multiprocessing.connection`` (``deliver_challenge`` /
``answer_challenge``), here mutual and with a per-connection key:

    server -> client   "DXA1" + 32-byte random challenge Cs
    client -> server   32-byte random challenge Cc + HMAC(secret, "client" | service | Cs | Cc)
    server -> client   HMAC(secret, "server" | service | Cs | Cc)
    session key        K = HMAC(secret, "session" | service | Cs | Cc)

``service`` names what the server serves (swarm-rpc, state, mesh, lighthouse, store, swarm-store, manager): a
handshake made for one service of the run is refused by every other (issue 42). Before its challenge a server asks
an ``AcceptGate`` for a handshake slot (per source address, per /64 for IPv6; ``BUSY`` and closed at once over the
cap) and every handshake ends within ``handshake_s()`` (``security.handshake_s``, default ``HANDSHAKE_S`` = 2 s).

After that every message carries ``HMAC(K, direction | sequence number | message bytes)`` (``Sealer``):
a message changed on the way, replayed within the connection or from another one, or sent in the other
direction fails its check. With ``security.encrypt`` the message is instead sealed whole with
ChaCha20-Poly1305 (``Crypter``: key ``HMAC(K, "chacha20-poly1305")``, nonce = direction | sequence number; the
same checks, and nobody on the path reads it; the AEAD of TLS 1.3 and WireGuard, 1.8x AES-GCM's encryption rate
on the development CPU). The primitives are the standard library's ``hmac``, ``hashlib`` and ``secrets`` and, for
encryption, the ``cryptography`` package's ChaCha20Poly1305; nothing here is a cipher of its own.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import stat
import sys
import threading
import time

from dilocox.net.tcp import keep_alive

MAGIC = b"DXA1"
CHALLENGE_BYTES = 32
MAC_BYTES = 32  # SHA-256
SECRET_MIN_BYTES = 32  # 256 bits: a sniffed handshake cannot be brute-forced offline (``dilocox secret`` writes 32)
HANDSHAKE_S = 2.0  # every server's handshake with a connection that has not proven the secret ends within this (the
# default of security.handshake_s: ``set_handshake_s``; at most MAX_HANDSHAKE_S)
MAX_HANDSHAKE_S = 30.0
BUSY = b"DXB1"  # sent instead of the challenge to a connection over its address's cap, then closed (AcceptGate)


class AuthError(ConnectionError):
    """The other side does not hold the run secret, or a message failed its check."""


class ClosedSilently(AuthError):
    """The other side closed before a byte of the message awaited (on a server: of the client's proof), or reset the
    connection before the proof: a port probe, such as ``failover.lighthouse_listening``'s, not an attempt at the
    secret (a server counts it and need not log it)."""


class Busy(AuthError):
    """The server turned the connection away before its challenge (its slots for our address were full): retry."""


class SecretError(ValueError):
    """The secret file is missing, unreadable, too short, or readable by others."""


def _mac(key: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(4, "big"))
        h.update(p)
    return h.digest()


def create_secret(path: str) -> bytes:
    """Write a new random secret to ``path`` with mode 0600 (created exclusively: never overwrites)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    key = secrets.token_hex(32)
    tmp = os.path.join(d, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        os.link(tmp, path)  # whole or absent (a reader never sees it half-written); FileExistsError if it exists
    finally:
        os.unlink(tmp)
    return bytes.fromhex(key)


def load_secret(path: str) -> bytes:
    """The secret in ``path``: hex (64 digits from ``create_secret``) or any text of >= 32 bytes.

    Refuses, with one line naming the file and the fix, a file that the group or others may read or write
    (``chmod 600 <path>``), one owned by another user (a secret someone else can change or read), and one shorter
    than ``SECRET_MIN_BYTES`` (a short passphrase is brute-forced offline from one sniffed handshake)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # (a FIFO does not block the open)
    except OSError as e:
        raise SecretError(f"security.secret_file={path!r}: {e.strerror}; create it with `dilocox secret {path}`") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # (before fdopen, which raises IsADirectoryError on a directory)
        os.close(fd)
        raise SecretError(f"security.secret_file={path!r} is not a regular file; create one with `dilocox secret`")
    with os.fdopen(fd, "rb") as f:  # (checked on the open file: nothing can swap it between the check and the read)
        st = os.fstat(f.fileno())
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise SecretError(
                f"security.secret_file={path!r} is owned by uid {st.st_uid}, not this user (uid {os.getuid()}): "
                f"another user can read or replace it; make this user's own copy (`dilocox secret NEWPATH`, or "
                f"`cp {path} NEWPATH && chmod 600 NEWPATH`)"
            )
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecretError(
                f"security.secret_file={path!r} has mode {stat.S_IMODE(st.st_mode):o}: others may read it; "
                f"run `chmod 600 {path}`"
            )
        raw = f.read(4096).strip()
    try:
        key = bytes.fromhex(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        key = raw
    if len(key) < SECRET_MIN_BYTES:
        raise SecretError(
            f"security.secret_file={path!r} holds {len(key)} bytes; a secret needs >= {SECRET_MIN_BYTES}: "
            f"write a new one with `dilocox secret NEWPATH` (32 random bytes) and use it on every host"
        )
    return key


_bound = {"handshake_s": HANDSHAKE_S}


def handshake_s() -> float:
    """This process's bound on a server's handshake with a connection (every accept loop's, read per connection)."""
    return _bound["handshake_s"]


def set_handshake_s(seconds: float, name: str = "security.handshake_s") -> None:
    """Set ``handshake_s()`` (``security.handshake_s``; ``dilocox lighthouse`` / ``dilocox swarm store``
    ``--handshake-s``): a lossy WAN link may need more than the default 2 s (several retransmits of a 150 ms RTT), at
    the price of a silent stranger holding each of its address's slots that much longer. ValueError (one line naming
    the field and the fix) outside (0, MAX_HANDSHAKE_S]."""
    v = seconds
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= MAX_HANDSHAKE_S:
        raise ValueError(
            f"{name}={v!r} must be seconds in (0, {MAX_HANDSHAKE_S:g}]: e.g. 2 (the default) on a LAN, "
            f"5 on a lossy WAN link"
        )
    _bound["handshake_s"] = float(v)


def secret_for(sec, writer: str) -> bytes | None:
    """The run secret a process of this run uses, from its ``security`` config section: None when
    ``security.authenticate`` is false, else the file's secret; ``writer`` names who writes the file when the
    setting is empty (the one-line fix in the error). Also sets this process's handshake bound from
    ``security.handshake_s`` (``set_handshake_s``): every process of a run reads its secret here, before it serves."""
    set_handshake_s(getattr(sec, "handshake_s", HANDSHAKE_S))
    if not sec.authenticate:
        return None
    if not sec.secret_file:
        raise SecretError(
            f"security.secret_file is empty and security.authenticate is true: {writer}; a process started by hand "
            "needs --security.secret_file=PATH (the run's file, mode 0600: `dilocox secret PATH` writes one)"
        )
    return load_secret(sec.secret_file)


def load_or_create_secret(path: str) -> bytes:
    """``load_secret(path)``, after creating the file (0600) if there is none."""
    if not os.path.exists(path):
        try:
            return create_secret(path)
        except FileExistsError:  # another process of the run created it first
            pass
    return load_secret(path)


def recv_by(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Exactly ``n`` bytes of a handshake by ``deadline`` (socket.timeout after it, AuthError at EOF)."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("authentication timed out")
        sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise (AuthError if buf else ClosedSilently)("connection closed during authentication")
        buf += chunk
    return bytes(buf)


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("authentication timed out")
    sock.settimeout(left)
    sock.sendall(data)


def _service(service: str) -> bytes:
    if not isinstance(service, str) or not service or len(service) > 64:
        raise ValueError(f"service={service!r}: every handshake names its service (a short non-empty string)")
    return service.encode()


def server_handshake(sock: socket.socket, secret: bytes, deadline: float, service: str) -> bytes:
    """Authenticate the client that connected to ``sock`` for ``service``; return the session key (AuthError if it
    fails: no secret, or a proof made for another service)."""
    svc = _service(service)
    cs = secrets.token_bytes(CHALLENGE_BYTES)
    try:  # (a probe that closes at once resets the connection when our challenge reaches it unread)
        _send(sock, MAGIC + cs, deadline)
        reply = recv_by(sock, CHALLENGE_BYTES + MAC_BYTES, deadline)
    except (BrokenPipeError, ConnectionResetError) as e:
        raise ClosedSilently(f"the client reset the connection before its proof ({e})") from None
    cc, proof = reply[:CHALLENGE_BYTES], reply[CHALLENGE_BYTES:]
    if not hmac.compare_digest(proof, _mac(secret, b"client", svc, cs, cc)):
        raise AuthError(f"the client does not hold the run secret (or it asked for another service than {service!r})")
    _send(sock, _mac(secret, b"server", svc, cs, cc), deadline)
    return _mac(secret, b"session", svc, cs, cc)


def client_handshake(sock: socket.socket, secret: bytes, deadline: float, service: str) -> bytes:
    """Authenticate the server ``sock`` is connected to as ``service`` and prove the secret to it; return the session
    key. ``Busy`` when the server turned the connection away before its challenge (a retry may be served)."""
    key, expect = client_hello(sock, secret, deadline, service)
    check_server_proof(recv_by(sock, MAC_BYTES, deadline), expect)
    return key


def client_hello(sock: socket.socket, secret: bytes, deadline: float, service: str) -> tuple[bytes, bytes]:
    """The client's half without waiting for the server's proof: (session key, the proof the server must send).

    A caller may send its (sealed) request right away and check the proof (``check_server_proof``) before it
    reads the reply, which saves a round trip per connection on a far link; the request then reaches a server
    before it proved the secret (it cannot forge a reply; it can read the request, as anyone on the path can,
    since nothing is encrypted). Every MAC of the transcript covers ``service``: a handshake made for one service
    of the run is refused by every other (and the session keys differ)."""
    svc = _service(service)
    magic = recv_by(sock, len(MAGIC), deadline)
    if magic == BUSY:
        raise Busy("the server turned this connection away before authenticating (its slots for this address are full)")
    if magic != MAGIC:
        raise AuthError("the server did not start a dilocox authentication (no run secret on its side?)")
    cs = recv_by(sock, CHALLENGE_BYTES, deadline)
    cc = secrets.token_bytes(CHALLENGE_BYTES)
    _send(sock, cc + _mac(secret, b"client", svc, cs, cc), deadline)
    return _mac(secret, b"session", svc, cs, cc), _mac(secret, b"server", svc, cs, cc)


def check_server_proof(proof: bytes, expect: bytes) -> None:
    if not hmac.compare_digest(proof, expect):
        raise AuthError("the server does not hold the run secret (or it serves another service)")


def dial(
    addr: tuple[str, int],
    secret: bytes,
    service: str,
    deadline: float,
    full: bool = True,
    connect_timeout: float | None = None,
) -> tuple[socket.socket, bytes, bytes]:
    """A TCP connection to ``addr`` and the client's side of the handshake for ``service``, all by ``deadline``:
    (socket, session key, the server's expected proof). ``full``: the proof is read and checked here (else the
    caller checks it with ``check_server_proof`` before it reads a reply); ``connect_timeout`` bounds each TCP connect
    apart (a dead address). A server that turned the connection away
    (``Busy``: its handshake slots for this address were full) is dialed again after a short pause while time is
    left; any other failure raises (OSError, AuthError)."""
    pause = 0.02
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout(f"no handshake with {addr[0]}:{addr[1]} ({service}) within the deadline")
        sock = socket.create_connection(addr, timeout=max(0.01, min(left, connect_timeout or left)))
        try:
            keep_alive(sock).setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # (tcp.py: a long-lived pair)
            key, expect = client_hello(sock, secret, deadline, service)
            if full:
                check_server_proof(recv_by(sock, MAC_BYTES, deadline), expect)
            return sock, key, expect
        except Busy:
            sock.close()
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(0.5, pause * 2)
        except BaseException:
            sock.close()
            raise


class AcceptGate:
    """Who may hold one of a server's handshake slots (issue 42: no lock-out by strangers).

    Every accept loop of the run (the SWARM RPC and state transfer, the lighthouse/store/manager guards, the mesh's
    pair server) accepts every connection at once and asks ``admit(ip)``: at most ``per_address`` connections of one
    source address may be in their handshake at a time, and at most ``total`` in all; an address that proved the
    secret before (``proven``, called after a handshake that succeeded) or is named ``trust``-ed (the run's members)
    may hold up to ``per_member`` and also use ``reserved`` slots no stranger can take. A connection over its cap is
    not queued: it is sent ``BUSY`` and closed at once (an honest client's ``dial`` tries again, bounded by its
    deadline). Each admitted handshake must end within ``handshake_s()`` (the server's deadline), so a silent
    stranger holds a slot that long at most, and a flood from one address takes ``per_address`` slots, never the
    run's. "One address" is one IPv4 address (an IPv4-mapped ``::ffff:a.b.c.d`` is its IPv4 address) or one IPv6
    /64 (``key``): whoever holds one IPv6 address usually holds its whole /64, so the caps, the proven addresses and
    the trusted ones are all counted per /64 (a host's temporary IPv6 addresses stay in its /64 as well)."""

    def __init__(
        self, per_address: int = 4, total: int = 32, reserved: int = 16, per_member: int = 32, remember: int = 4096
    ) -> None:
        for name, v in (("per_address", per_address), ("total", total), ("per_member", per_member)):
            if v < 1:
                raise ValueError(f"AcceptGate {name}={v} must be >= 1")
        self.per_address, self.total, self.reserved, self.per_member = per_address, total, max(0, reserved), per_member
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}  # source address -> its connections in their handshake
        self._strangers = 0  # slots held by addresses that are neither proven nor trusted
        self._members = 0
        self._proven: dict[str, None] = {}  # (insertion-ordered: the oldest forgotten past ``remember``)
        self._trusted: frozenset[str] = frozenset()
        self._remember = remember
        self.turned_away = 0  # connections closed at once over a cap (tests, logs)

    @staticmethod
    def key(ip: str) -> str:
        """What the gate counts ``ip`` under: an IPv4 address itself (also when mapped into IPv6: the client of a
        dual-stack socket), an IPv6 address's /64 (``2001:db8:1:2::/64``); anything else (a name) as given."""
        text = str(ip).strip().strip("[]").split("%")[0]  # (a link-local address's zone does not matter)
        try:
            a = ipaddress.ip_address(text)
        except ValueError:
            return text
        if a.version == 4:
            return str(a)
        if a.ipv4_mapped is not None:
            return str(a.ipv4_mapped)
        return str(ipaddress.IPv6Network((a, 64), strict=False))

    def _known(self, ip: str) -> bool:
        return ip in self._trusted or ip in self._proven

    def admit(self, ip: str) -> tuple[str, bool] | None:
        """A handshake slot for a connection from ``ip`` (give it back with ``release``), or None: over a cap, close
        the connection at once (``turn_away``)."""
        ip = self.key(ip)
        with self._lock:
            held = self._held.get(ip, 0)
            member = self._known(ip)
            used = self._strangers + self._members
            if member:
                ok = held < self.per_member and used < self.total + self.reserved
            else:
                ok = held < self.per_address and self._strangers < self.total and used < self.total + self.reserved
            if not ok:
                self.turned_away += 1
                return None
            self._held[ip] = held + 1
            if member:
                self._members += 1
            else:
                self._strangers += 1
            return ip, member

    def release(self, slot: tuple[str, bool], proven: bool = False) -> None:
        """The handshake that ``admit`` gave ``slot`` is over; ``proven``: it succeeded (the address is then known)."""
        ip, member = slot
        with self._lock:
            n = self._held.get(ip, 0) - 1
            if n > 0:
                self._held[ip] = n
            else:
                self._held.pop(ip, None)
            if member:
                self._members -= 1
            else:
                self._strangers -= 1
            if proven:
                self._proven.pop(ip, None)
                self._proven[ip] = None
                while len(self._proven) > self._remember:
                    self._proven.pop(next(iter(self._proven)))

    def hand_off(self, conn: socket.socket, ip: str, serve, what: str) -> bool:
        """The accept loop's step for one connection: ``admit`` it and run ``serve(slot)`` on a daemon thread (which
        must ``release`` the slot). Over its address's cap it is turned away at once; with no thread to be had its slot
        is given back and it is closed (logged as ``what``). True when ``serve`` runs."""
        slot = self.admit(ip)
        if slot is None:  # over its address's cap (a flood from one address): closed at once, not queued
            turn_away(conn)
            return False
        try:
            threading.Thread(target=serve, args=(slot,), name=what, daemon=True).start()
            return True
        except RuntimeError as e:  # (no thread to be had: this connection, not the server)
            self.release(slot)
            try:
                conn.close()
            except OSError:
                pass
            logging.getLogger(__name__).warning("%s: no thread for a connection (%s)", what, e)
            return False

    def trust(self, ips) -> None:
        """The run's member addresses (e.g. from a signed member list; IP addresses, not names: ``admit`` is asked
        with a socket's peer address): they may use the reserved slots."""
        keys = frozenset(self.key(ip) for ip in ips)
        with self._lock:
            self._trusted = keys

    def held(self) -> int:
        with self._lock:
            return self._strangers + self._members


def _proc_net_addr(ip: str, port: int) -> list[str]:
    """How ``ip:port`` is written in /proc/net/tcp (IPv4) and /proc/net/tcp6 (IPv6, and IPv4 mapped into it): 32-bit
    words of the address in the host's byte order, the port big-endian, both in upper-case hex."""
    order = sys.byteorder
    out = []
    if ip.lower().startswith("::ffff:") and "." in ip:
        ip = ip[7:]  # (an IPv4 peer of a dual-stack socket: its own socket is in /proc/net/tcp)
    try:
        v4 = socket.inet_aton(ip) if ":" not in ip else None
    except OSError:
        v4 = None
    if v4 is not None:
        out.append(f"{int.from_bytes(v4, order):08X}:{port:04X}")
        packed = b"\0" * 10 + b"\xff\xff" + v4
    else:
        packed = socket.inet_pton(socket.AF_INET6, ip.split("%")[0])
    words = "".join(f"{int.from_bytes(packed[i : i + 4], order):08X}" for i in range(0, 16, 4))
    out.append(f"{words}:{port:04X}")
    return out


def peer_uid(conn: socket.socket) -> int | None:
    """The uid that owns the other end of a TCP connection from this host (Linux: the peer's socket in
    /proc/net/tcp and tcp6, whose local address is our remote one and whose remote address is our local one); None
    where that cannot be told (another OS, another host, or the peer already gone)."""
    try:
        peer, me = conn.getpeername(), conn.getsockname()
    except OSError:
        return None
    theirs = set(_proc_net_addr(peer[0], peer[1]))
    ours = set(_proc_net_addr(me[0], me[1]))
    # (this THREAD's network namespace: a thread may have entered another one with setns, e.g. the SWARM rebalancer's
    # store relay in the emulation's switch namespace; /proc/net is the process's first thread's)
    base = "/proc/thread-self/net" if os.path.exists("/proc/thread-self/net") else "/proc/net"
    for table in (f"{base}/tcp", f"{base}/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) > 7 and cols[1] in theirs and cols[2] in ours:
                        return int(cols[7])
        except OSError:
            continue
    return None


def same_user(conn: socket.socket) -> bool:
    """Whether the other end of a loopback connection belongs to this process's user (or root): what a loopback
    service that acts with the run's secret (``net/relay.py::LighthouseRelay``) asks before it serves anyone
    (issue 42: another user of the host does not get the run's powers). Where the owner cannot be told (not Linux)
    it answers True, as before; on Linux a peer it cannot find is refused."""
    if not sys.platform.startswith("linux") or not hasattr(os, "getuid"):
        return True
    uid = peer_uid(conn)
    return uid is not None and uid in (os.getuid(), 0)


def listen_socket(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A TCP socket listening on ``host:port``: IPv6 for an IPv6 literal (``::`` takes IPv4 as well where the system
    can), IPv4 for an IPv4 literal or a name (the RpcServer's and the mesh's PairServer's)."""
    host = host.strip("[]")
    v6 = ":" in host
    dual = host == "::" and socket.has_dualstack_ipv6()
    family = socket.AF_INET6 if v6 else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=backlog, dualstack_ipv6=dual)


def turn_away(conn: socket.socket) -> None:
    """Close a connection over its address's cap at once: ``BUSY`` (so a key holder knows to retry), then close."""
    try:
        conn.setblocking(False)
        conn.send(BUSY)  # (a fresh connection's send buffer is empty: this never waits)
    except OSError:
        pass
    try:
        conn.close()
    except OSError:
        pass


def sign_value(secret: bytes | None, key: str, value: str) -> str:
    """``value`` with a tag that binds it to the store ``key`` and the run secret (``value`` itself without one).

    For the entries of a store that authenticates nobody (torch's TCPStore: the SWARM address book): a stranger
    who reaches the store can still write, but what it writes fails ``open_value`` on every peer."""
    if secret is None:
        return value
    return value + "#" + _mac(secret, b"store", key.encode(), value.encode()).hex()


def open_value(secret: bytes | None, key: str, raw: str) -> str:
    """The value of a ``sign_value`` entry, after checking its tag (AuthError: not written by the run)."""
    if secret is None:
        return raw
    value, sep, tag = raw.rpartition("#")
    want = _mac(secret, b"store", key.encode(), value.encode()).hex()
    if not sep or not tag.isascii() or not hmac.compare_digest(tag, want):
        raise AuthError(f"the store entry {key!r} is not signed with the run secret (written by a stranger?)")
    return value


class Sealer:
    """Per-connection message MACs: ``seal`` for what this side sends, ``check`` for what it receives.

    ``role`` is "client" or "server"; each direction has its own sequence counter, so a message
    replayed, reordered, or reflected back to its sender fails."""

    def __init__(self, key: bytes, role: str) -> None:
        if role not in ("client", "server"):
            raise ValueError(f"role={role!r} is not client or server")
        self.key = key
        self._out_dir = role.encode()
        self._in_dir = b"server" if role == "client" else b"client"
        self._out_seq = 0
        self._in_seq = 0

    def _start(self, direction: bytes, seq: int):
        h = hmac.new(self.key, digestmod=hashlib.sha256)
        h.update(direction + b"|" + seq.to_bytes(8, "big"))
        return h

    def sealer(self):
        """A running MAC for the next message this side sends (``update`` each frame, ``digest`` last)."""
        h = self._start(self._out_dir, self._out_seq)
        self._out_seq += 1
        return h

    def checker(self):
        """A running MAC for the next message this side receives (compare with ``verify``)."""
        h = self._start(self._in_dir, self._in_seq)
        self._in_seq += 1
        return h

    @staticmethod
    def verify(h, tag: bytes) -> None:
        if not hmac.compare_digest(h.digest(), tag):
            raise AuthError("a message failed its authentication check (changed, replayed or not from the peer)")


class Crypter:
    """Per-connection ChaCha20-Poly1305 (``security.encrypt``): ``encrypt`` what this side sends, ``decrypt`` what it
    receives (AuthError when a message was changed, replayed, reordered or reflected). The key is derived from
    the handshake's session key; the 12-byte nonce is the direction (1 byte) and the message's sequence number in
    that direction (11 bytes), so no nonce is ever used twice under one key."""

    TAG_BYTES = 16

    def __init__(self, key: bytes, role: str) -> None:
        try:
            from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
        except ImportError as e:  # pragma: no cover - cryptography is in requirements.txt
            raise SecretError(f"security.encrypt needs the cryptography package (pip install cryptography): {e}")
        if role not in ("client", "server"):
            raise ValueError(f"role={role!r} is not client or server")
        self._aead = ChaCha20Poly1305(_mac(key, b"chacha20-poly1305"))
        self._out_dir = b"\x01" if role == "client" else b"\x02"
        self._in_dir = b"\x02" if role == "client" else b"\x01"
        self._out_seq = 0
        self._in_seq = 0

    def encrypt(self, data: bytes) -> bytes:
        nonce = self._out_dir + self._out_seq.to_bytes(11, "big")
        self._out_seq += 1
        return self._aead.encrypt(nonce, data, None)

    def decrypt(self, data: bytes) -> bytes:
        from cryptography.exceptions import InvalidTag

        nonce = self._in_dir + self._in_seq.to_bytes(11, "big")
        self._in_seq += 1
        try:
            return self._aead.decrypt(nonce, data, None)
        except InvalidTag:
            raise AuthError("a message failed its decryption check (changed, replayed or not from the peer)") from None
