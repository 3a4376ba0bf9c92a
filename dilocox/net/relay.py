"""TCP relays and guards that prove the run secret, and a standby lighthouse (issue 22 item 5).

``LighthouseGuard`` holds a public port in front of a service on 127.0.0.1 and pipes a connection to it only after
the handshake of ``secure.py``; ``LighthouseRelay`` listens on 127.0.0.1 and pipes to the first of an ordered list of
endpoints that listens (with a secret: proving it to the guard there). They pipe the bytes of any TCP service
(torchft's lighthouse and ``ManagerServer``, a ``TCPStore``, the SWARM address book) and import nothing of torchft.
The standby lighthouse:

torchft's ``Manager`` takes one lighthouse address, and its ``ManagerServer`` (Rust) keeps one gRPC channel to it.
With ``outer.elastic.lighthouse: http://primary:29510,http://standby:29510`` each replica process starts a
``LighthouseRelay`` on 127.0.0.1 and gives the Manager the relay's address instead. The relay forwards every
connection to the FIRST lighthouse of the list that accepts a TCP connection (bounded: ``connect_timeout_s`` per
address), so while the primary lives everything goes to it, and when it dies the channel's reconnect lands on the
standby. The standby keeps no state either: it forms a quorum from the replicas' next requests, as a restarted
lighthouse does (dilocox/elastic/failover.py handles the reused quorum ids and the kept quorum meanwhile).

**Fail-back.** A connection relayed to a later lighthouse while an earlier one listens again is closed (checked
every ``check_every_s``): the replicas reconnect to the earlier one within about that time. Otherwise a replica
restarted after the primary came back would wait alone on the primary while the others stayed on the standby.

**Split brain.** Replicas that see different lighthouses (a partition between some replicas and the primary) can
form two quorums. Two quorums of ``min_replicas`` each cannot exist when ``min_replicas > max_replicas / 2``: set it
so where a partition is possible (docs/ELASTIC.md "A standby lighthouse").

Every wait is bounded: a connect by ``connect_timeout_s``, the accept loop and the monitor by the relay's own
close; a relayed pair ends when either side closes (the gRPC channel's keepalive and heartbeats keep it busy), and
both its sockets have TCP keepalive (``tcp.keep_alive``): a peer that vanished without a FIN or an RST ends the pair
within about 2 minutes instead of holding it for good. With no thread to be had for a connection (``RuntimeError`` of
``Thread.start``) that connection is closed, whatever it held given back, and the accept loop goes on.
"""

from __future__ import annotations

import functools
import logging
import select
import socket
import threading
import time

from dilocox.net.secure import (
    MAC_BYTES,
    AcceptGate,
    AuthError,
    Busy,
    ClosedSilently,
    Sealer,
    check_server_proof,
    client_hello,
    dial,
    handshake_s,
    peer_uid,
    recv_by,
    same_user,
    server_handshake,
)
from dilocox.net.tcp import keep_alive

# a guard's handshake with a connection ends within ``secure.handshake_s()`` (security.handshake_s, 2 s by default)
DIAL_TIMEOUT_S = 5.0  # a relay's connect and handshake with a guard (retried while the guard turns it away busy), or
# the handshake bound and a second when that is longer (a lossy link: its own handshakes take as long)

MAX_LOGGED = 4096  # source addresses a guard logs a refusal of (once each); more are only counted
MAX_PAIRS = 1024  # connections a guard pipes at a time (two threads and two descriptors each) ...
MAX_PAIRS_PER_ADDRESS = 256  # ... and of one source address (a host's ranks: a store client and a gRPC channel each)

log = logging.getLogger("dilocox.net.relay")


class LighthouseRelay:
    """``address`` (``http://127.0.0.1:PORT``) relays to the first listening endpoint of ``endpoints``. With a
    ``secret`` (it proves the run's secret for whoever it relays) it serves only connections owned by this process's
    user or root (Linux, ``secure.same_user``: issue 42; another user of the host is closed at once)."""

    def __init__(
        self,
        endpoints: list[tuple[str, int]],
        connect_timeout_s: float = 1.0,
        check_every_s: float = 1.0,
        host: str = "127.0.0.1",
        secret: bytes | None = None,
        service: str = "",
    ):
        if not endpoints:
            raise ValueError("LighthouseRelay needs at least one lighthouse endpoint")
        if secret is not None and not service:
            raise ValueError("LighthouseRelay with a secret names the guarded service (lighthouse, store, manager)")
        self.service = service
        self.endpoints = list(endpoints)
        self.connect_timeout_s = connect_timeout_s
        self.secret = secret  # set: every lighthouse is behind a LighthouseGuard; the relay proves the secret to it
        self.check_every_s = check_every_s
        self._srv = socket.create_server((host, 0))
        self._srv.settimeout(0.5)  # the accept loop looks at `closed` at least this often
        self.address = f"http://{host}:{self._srv.getsockname()[1]}"
        self._lock = threading.Lock()
        self._pairs: list[tuple[int, socket.socket, socket.socket]] = []  # (endpoint index, client, upstream)
        self.used: list[int] = []  # the endpoint index of every relayed connection, in order (tests, logs)
        self._refused_uids: set = set()  # (logged once each)
        self.closed = False
        self._last_index: int | None = None
        self._threads = [
            threading.Thread(target=self._accept_loop, name="lighthouse-relay", daemon=True),
            threading.Thread(target=self._monitor, name="lighthouse-relay-monitor", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---------------------------------------------------------------- connections
    def _connect(self, upto: int | None = None) -> tuple[int, socket.socket, bytes | None] | None:
        """(index, socket, session key or None) of a connection to the first endpoint (before index ``upto``) that
        accepts one; None if none does."""
        for i, (h, p) in enumerate(self.endpoints[:upto]):
            if self.secret is None:
                try:
                    s = socket.create_connection((h, p), timeout=self.connect_timeout_s)
                except (OSError, UnicodeError):  # (UnicodeError: a name IDNA cannot encode, e.g. a label > 63)
                    continue
                return i, s, None
            try:  # both sides prove the run secret (for this service) before a byte of torchft's traffic is relayed
                deadline = time.monotonic() + max(DIAL_TIMEOUT_S, handshake_s() + 1.0)
                s, key, _ = dial((h, p), self.secret, self.service, deadline, connect_timeout=self.connect_timeout_s)
            except (ConnectionRefusedError, socket.gaierror, UnicodeError, socket.timeout, TimeoutError) as e:
                log.debug("lighthouse relay %s: %s:%d: %s", self.address, h, p, e)
                continue  # (nothing listens there, or it does not answer: the next endpoint)
            except (OSError, AuthError) as e:
                log.warning("lighthouse relay %s: %s:%d failed authentication: %s", self.address, h, p, e)
                continue
            return i, s, key
        return None

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                client, _ = self._srv.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self.closed:
                    return
                log.warning("lighthouse relay %s: accept failed (%s); going on", self.address, e)  # (EMFILE: this
                time.sleep(0.05)  # connection, not the relay: it waits in the backlog and is served once fds free up)
                continue
            if self.secret is not None and not same_user(client):  # (issue 42: the relay proves the run's secret
                uid = peer_uid(client)  # for whoever it serves: only this user's processes, not the host's others)
                if uid not in self._refused_uids:
                    self._refused_uids.add(uid)
                    log.warning("lighthouse relay %s: refused a connection of uid %s (not this run's user)",
                                self.address, uid)  # fmt: skip
                _close(client)
                continue
            up = self._connect()
            if up is None:
                client.close()  # no lighthouse listens: torchft sees its request fail, and retries (bounded)
                continue
            i, upstream, key = up
            keep_alive(upstream).settimeout(None)  # (an idle pair: a peer that vanished silently ends it, tcp.py)
            keep_alive(client).settimeout(None)
            with self._lock:
                if self.closed:
                    client.close()
                    upstream.close()
                    return
                self._pairs.append((i, client, upstream))
                self.used.append(i)
            if i != self._last_index:
                h, p = self.endpoints[i]
                role = "the primary" if i == 0 else f"standby {i} (the ones before it refuse connections)"
                log.warning("lighthouse relay %s: now relaying to %s:%d, %s", self.address, h, p, role)
                self._last_index = i
            # to a guard: every relayed chunk is framed and MACed under the handshake's session key (FramedPipe)
            pipe = FramedPipe(key, "client") if key is not None else None
            try:
                for a, b, how in ((client, upstream, "seal"), (upstream, client, "open")):
                    threading.Thread(target=self._pump, args=(a, b, pipe, how), daemon=True).start()
            except RuntimeError as e:  # no thread to be had: this pair ends (a pump that did start ends as its
                log.warning("lighthouse relay %s: no thread for a connection (%s); closed it", self.address, e)
                self._drop(client, upstream)  # sockets close), not the relay's accept loop

    def _pump(self, src: socket.socket, dst: socket.socket, pipe: FramedPipe | None, how: str) -> None:
        if pipe is None:
            _copy(src, dst)
        else:
            pipe.copy(src, dst, how, "lighthouse relay")
        self._drop(src, dst)

    def _drop(self, a: socket.socket, b: socket.socket) -> None:
        """Close a relayed pair (either side's end ends both directions)."""
        with self._lock:
            self._pairs = [x for x in self._pairs if a not in x[1:] and b not in x[1:]]
        _close(a, b)

    def _monitor(self) -> None:
        """Fail-back: close the pairs relayed to a later endpoint when an earlier one listens again."""
        while not self.closed:
            time.sleep(self.check_every_s)
            with self._lock:
                worst = max((i for i, _, _ in self._pairs), default=0)
            if worst == 0:
                continue
            probe = self._connect(upto=worst)
            if probe is None:
                continue
            i, s, _ = probe
            s.close()
            with self._lock:
                moved = [(c, u) for j, c, u in self._pairs if j > i]
            h, p = self.endpoints[i]
            log.warning("lighthouse relay %s: %s:%d listens again; moving %d connection(s) back to it", self.address,
                        h, p, len(moved))  # fmt: skip
            for c, u in moved:
                self._drop(c, u)

    def close(self) -> None:
        self.closed = True
        try:
            self._srv.shutdown(socket.SHUT_RDWR)  # wakes the accept()
        except OSError:
            pass
        self._srv.close()
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for _, c, u in pairs:
            _close(c, u)
        for t in self._threads:
            t.join(timeout=2.0)


def _close(*socks: socket.socket) -> None:
    """Shut down (wakes a thread blocked in recv) and close each socket."""
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()


def _copy(src: socket.socket, dst: socket.socket) -> None:
    """Bytes from ``src`` to ``dst`` until either side ends (EOF or an error)."""
    try:
        while True:
            data = src.recv(65536)
            if not data:
                return
            dst.sendall(data)
    except OSError:
        return


class FramedPipe:
    """The bytes between a ``LighthouseRelay`` and a ``LighthouseGuard`` after their handshake: each chunk one frame
    ``[4-byte length][chunk][HMAC-SHA256(session key, direction | sequence number | chunk)]`` (``secure.Sealer``),
    so a byte injected, changed, replayed or reordered on the path (a hijacked TCP connection) fails its MAC and
    ends the pair instead of reaching torchft. A length above ``MAX_FRAME`` is refused before anything is read.
    Authentication only: gRPC's bytes are not encrypted. One thread per direction (each has its own counter)."""

    MAX_FRAME = 65536
    FRAME_S = 60.0  # a frame's bytes after its first must arrive within this (a peer stalled mid-frame is closed)

    def __init__(self, key: bytes, role: str) -> None:
        self.sealer = Sealer(key, role)

    def copy(self, src: socket.socket, dst: socket.socket, how: str, who: str) -> None:
        """``how`` = "seal": plain bytes from ``src`` framed onto ``dst``; "open": frames from ``src`` checked and
        their bytes written to ``dst``. Returns when either side ends or a frame fails (logged)."""
        try:
            if how == "seal":
                while data := src.recv(self.MAX_FRAME):
                    h = self.sealer.sealer()
                    h.update(data)
                    dst.sendall(len(data).to_bytes(4, "big") + data + h.digest())
                return
            while first := _recv_exact(src, 1):  # (between frames a pair may idle: gRPC's channel, a store's client)
                head = _recv_exact(src, 3, self.FRAME_S)  # a frame that started must be whole within FRAME_S
                if head is None:
                    return
                n = int.from_bytes(first + head, "big")
                if not 0 < n <= self.MAX_FRAME:
                    raise AuthError(f"a relayed frame claims {n} bytes (at most {self.MAX_FRAME})")
                body = _recv_exact(src, n + MAC_BYTES, self.FRAME_S)
                if body is None:
                    return
                h = self.sealer.checker()
                h.update(body[:n])
                Sealer.verify(h, body[n:])
                dst.sendall(body[:n])
        except AuthError as e:
            log.warning("%s: closed a relayed connection: %s", who, e)
        except OSError:
            return


def _recv_exact(sock: socket.socket, n: int, within: float | None = None) -> bytes | None:
    """Exactly ``n`` bytes, or None at EOF (before or inside them); ``within``: seconds they must all arrive in, else
    socket.timeout (polled: the socket's own timeout is left alone, the other direction's thread sends on it)."""
    buf, deadline, poll = bytearray(), None if within is None else time.monotonic() + within, None
    while len(buf) < n:
        if deadline is not None:
            if sock.fileno() < 0:  # (the other direction closed the pair meanwhile)
                raise ConnectionAbortedError("the relayed pair was closed")
            if poll is None:
                poll = select.poll()
                poll.register(sock.fileno(), select.POLLIN)
            if not poll.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                raise socket.timeout("a relayed frame did not arrive whole in time")
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def unguarded(endpoints: list[tuple[str, int]], secret: bytes, service: str = "lighthouse", wait_s: float = 3.0):
    """Why the first of ``endpoints`` that accepts a TCP connection is not a guard of this run (one line), or None:
    it is one (the handshake for ``service`` completed, or it answered BUSY: only a guard does), or none is reachable
    yet (refused, or the connect itself timed out: the relay retries, bounded, as before). A plain torchft lighthouse
    says nothing until its client speaks (gRPC), so a server that accepted the connection and then sent no byte of a
    challenge within ``wait_s`` is taken for one; a guard always answers at once (its challenge, or BUSY)."""
    for h, p in endpoints:
        deadline = time.monotonic() + wait_s
        try:
            sock = socket.create_connection((h, p), timeout=min(1.0, wait_s))
        except OSError:  # refused, unreachable, or the SYN unanswered for now (a lost packet): not a verdict
            continue
        try:
            _, expect = client_hello(sock, secret, deadline, service)
            check_server_proof(recv_by(sock, MAC_BYTES, deadline), expect)
        except Busy:  # its handshake slots are full (a flood): a guard all the same
            return None
        except (socket.timeout, TimeoutError):
            return f"{h}:{p} sent no challenge of the run secret's handshake within {wait_s:.0f} s: a plain lighthouse"
        except AuthError as e:
            if "did not start" in str(e):
                return f"{h}:{p} does not start the run secret's handshake: a plain lighthouse"
            return f"{h}:{p} refused this replica's proof (another run secret there, or not a lighthouse): {e}"
        except OSError:
            continue
        finally:
            sock.close()
        return None
    return None


class LighthouseGuard:
    """``dilocox lighthouse --secret-file F`` (issue 21): the public port in front of torchft's lighthouse, which
    then listens on loopback only. Every connection must prove the run secret (the mutual HMAC handshake of
    dilocox/net/secure.py, within ``secure.handshake_s()``) before it is piped to the lighthouse; a stranger is closed
    without a byte reaching torchft, so it cannot join a quorum (and so take part in the outer all-reduce). At most
    ``max_pending`` connections are in their handshake at once, at most 4 from one address that has not proven the
    secret before (``secure.AcceptGate``: a connection over its cap is closed at once, not queued, and addresses
    that proved the secret keep reserved slots); a failed one is logged once per source address and counted in
    ``rejected``. ``service`` names what is behind it in every handshake (lighthouse, store, manager, ...). The
    replicas' side is ``LighthouseRelay(..., secret=, service=)`` (``outer.elastic.lighthouse_auth``). A connection
    that proved the secret is piped only while fewer than ``max_pairs_per_address`` of its address and ``max_pairs``
    in all are (else it is closed, logged once per address, counted in ``over_cap``). Authentication only: the
    relayed gRPC bytes are not encrypted."""

    def __init__(
        self,
        bind: tuple[str, int],
        upstream: tuple[str, int],
        secret: bytes,
        service: str,
        max_pending: int = 32,
        max_pairs: int = MAX_PAIRS,
        max_pairs_per_address: int = MAX_PAIRS_PER_ADDRESS,
    ):
        if not service:
            raise ValueError("LighthouseGuard names the service behind it (lighthouse, store, manager, ...)")
        self.upstream, self.secret, self.service = upstream, secret, service
        self.max_pairs, self.max_pairs_per_address = max_pairs, max_pairs_per_address
        self._pairs_of: dict[str, int] = {}  # AcceptGate.key(source address) -> its pairs being piped
        v6 = ":" in bind[0]  # "::" listens on IPv4 too, as torchft and TCPStore do
        self._srv = socket.create_server(bind, family=socket.AF_INET6 if v6 else socket.AF_INET, dualstack_ipv6=v6)
        self._srv.settimeout(0.5)
        self.port = self._srv.getsockname()[1]
        self.gate = AcceptGate(total=max_pending, reserved=max(1, max_pending // 2), per_member=max_pending)
        self.rejected, self._logged = 0, set()
        self.over_cap, self._capped = 0, set()  # pairs refused over a cap (tests, logs); addresses logged for it
        self._piped: set[socket.socket] = set()  # both sockets of every pair being piped (closed by ``close``)
        self._count_lock = threading.Lock()  # (handshakes run on their own threads)
        self.closed = False
        self._thread = threading.Thread(target=self._accept_loop, name=f"{service}-guard", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                conn, peer = self._srv.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self.closed:
                    return
                log.warning("%s guard: accept failed (%s); going on", self.service, e)  # (EMFILE, ...: this one)
                time.sleep(0.05)
                continue
            self.gate.hand_off(conn, peer[0], functools.partial(self._serve, conn, peer[0]), f"{self.service} guard")

    def _serve(self, conn: socket.socket, ip: str, slot) -> None:
        proven = False
        try:
            try:
                key = server_handshake(conn, self.secret, time.monotonic() + handshake_s(), self.service)
                proven = True
            except (OSError, AuthError) as e:
                with self._count_lock:  # counted, and logged once per address (a flood does not flood the log),
                    self.rejected += 1  # but a connection closed before its first byte is a port probe: not logged
                    first = not isinstance(e, ClosedSilently) and ip not in self._logged
                    first = first and len(self._logged) < MAX_LOGGED  # (bounded: past it, a flood from many
                    if first:  # addresses is counted, not remembered nor logged)
                        self._logged.add(ip)
                    last = "; further addresses are not logged" if len(self._logged) == MAX_LOGGED else ""
                if first:
                    log.warning("%s guard: refused %s (%s)%s", self.service, ip, e or type(e).__name__, last)
                _close(conn)
                return
        finally:
            self.gate.release(slot, proven)
        who = AcceptGate.key(ip)
        if not self._take_pair(who):
            _close(conn)
            return
        try:
            try:
                up = socket.create_connection(self.upstream, timeout=handshake_s())  # (loopback: at once)
            except OSError:
                _close(conn)
                return
            with self._count_lock:  # (``close`` ends the pairs it piped too)
                if self.closed:
                    _close(conn, up)
                    return
                self._piped |= {conn, up}
            self._pipe(conn, up, key)
        finally:
            with self._count_lock:
                self._pairs_of[who] -= 1
                if not self._pairs_of[who]:
                    del self._pairs_of[who]

    def _take_pair(self, who: str) -> bool:
        """Count a pair of ``who`` (an ``AcceptGate.key``) that proved the secret, or refuse it (logged once per
        address): at most ``max_pairs_per_address`` of one address and ``max_pairs`` in all are piped at a time, so
        one holder of the secret cannot take every thread and file descriptor of the service's host."""
        with self._count_lock:
            mine, total = self._pairs_of.get(who, 0), sum(self._pairs_of.values())
            ok = mine < self.max_pairs_per_address and total < self.max_pairs
            if ok:
                self._pairs_of[who] = mine + 1
            else:
                self.over_cap += 1
                first = who not in self._capped and len(self._capped) < MAX_LOGGED
                if first:
                    self._capped.add(who)
        if not ok and first:
            log.warning(
                "%s guard: closed a connection of %s: %d pairs of that address and %d in all are piped (at most %d "
                "and %d)", self.service, who, mine, total, self.max_pairs_per_address, self.max_pairs,
            )  # fmt: skip
        return ok

    def _pipe(self, conn: socket.socket, up: socket.socket, key: bytes) -> None:
        keep_alive(conn).settimeout(None)  # (an idle pair: a relay that vanished silently ends it, tcp.py)
        keep_alive(up).settimeout(None)
        pipe = FramedPipe(key, "server")  # the relay frames and MACs every chunk; so does this side
        t = threading.Thread(target=lambda: (pipe.copy(up, conn, "seal", "lighthouse guard"), _close(up, conn)))
        t.daemon = True
        try:
            t.start()
        except RuntimeError as e:  # (no thread to be had: this pair is closed, not left open and unread)
            log.warning("%s guard: no thread for a connection (%s); closed it", self.service, e)
        else:
            pipe.copy(conn, up, "open", "lighthouse guard")
        _close(conn, up)
        with self._count_lock:
            self._piped -= {conn, up}

    def close(self) -> None:
        """Stop accepting and end every connection piped so far (both its sides)."""
        self.closed = True
        _close(self._srv)
        with self._count_lock:
            piped, self._piped = list(self._piped), set()
        _close(*piped)
        self._thread.join(timeout=2.0)


class GuardedLighthouse:
    """A torchft lighthouse on 127.0.0.1 behind a ``LighthouseGuard`` on ``bind`` (``HOST:PORT``; port 0 = any): what
    ``dilocox lighthouse --secret-file`` runs, and the stage lighthouses of an authenticated SWARM job. Duck-types
    torchft's ``LighthouseServer`` (``address()``, ``shutdown()``); ``address()`` is the guard's public one."""

    def __init__(self, lighthouse, bind: str, secret: bytes) -> None:
        host, _, port = bind.rpartition(":")
        self.host = host.strip("[]")
        self.lighthouse = lighthouse
        inner = int(lighthouse.address().rsplit(":", 1)[1])
        try:
            self.guard = LighthouseGuard((self.host, int(port)), ("127.0.0.1", inner), secret, "lighthouse")
        except BaseException:
            lighthouse.shutdown()
            raise
        self.port = self.guard.port

    def address(self) -> str:
        shown = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{f'[{shown}]' if ':' in shown else shown}:{self.port}"

    def shutdown(self) -> None:
        self.guard.close()
        self.lighthouse.shutdown()
