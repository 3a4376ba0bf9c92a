"""Collectives on authenticated pair connections: the elastic outer group's instead of gloo's (issue 21).

torchft's ``ProcessGroupGloo`` connects the replicas of a quorum with gloo's own TCP pairs: nothing authenticates
them and nothing hides their bytes (the pseudo-gradients), so across sites they must run inside a private network.
With ``outer.elastic.collectives: authenticated`` (or ``auto`` behind a guarded lighthouse) the quorum's process group
is a ``Mesh`` instead (the torchft ``ProcessGroup`` around it: ``dilocox/elastic/mesh.py``): every pair of members
talks over one TCP connection that began with the run secret's mutual handshake (``dilocox.net.secure``) and carries
every message MACed, or sealed with ChaCha20-Poly1305 under ``security.encrypt`` (the tensor RPC's framing,
``net/rpc.py``: every length bounded before anything is allocated, here by the collective's own size; nothing
unpickled). Nothing here imports torchft.

A round (one ``configure`` of the process group, i.e. one quorum) is the set of pair connections made for it. At
each round a member draws a fresh nonce (``begin``) and publishes ``address nonce`` in the quorum's store (the
adapter does: reached through the guarded relay of ``elastic/stores.py``), signed with the run secret; it dials
each member of higher rank with a hello naming the round key and the nonce it read for that member, and adopts from
its ``PairServer`` the connection of each member of lower rank whose hello names its own current nonce (``join``).
A hello with another nonce (an earlier round's; a stale store entry) is never adopted: the dialer is told the
current nonce and may name it on the same connection. A round's connections (adopted or queued) are closed when the
member starts the next round or fails this one. So data only flows between two members in their current rounds:
nothing of an earlier attempt, or of a member that moved on, can be taken for this one; at worst a collective finds
a closed connection, fails at once, and the outer step is retried on a new quorum as with gloo.

Collectives (what ``compress/collectives.py`` and the elastic group use): ``all_gather``, ``all_to_all_single`` and a
SUM ``all_reduce`` as a reduce-scatter then an all-gather (each member sums its chunk over the members in rank
order, so every member ends with the same bits; 2 (W - 1) / W of the tensor sent per member, as a ring). A message
carries at most ``SEGMENT`` bytes: a larger all-reduce or all-gather runs segment by segment (the same bits;
a message is sealed in records of < 2 GiB under ``security.encrypt``; ``all_to_all_single``, used on compressed
payloads only, is not segmented). Every wait is bounded: a round's dials and adoptions by ``timeout_s``,
each segment of a collective by ``timeout_s``; a failure closes the round's connections (the peers fail fast too)
and raises ``MeshError``; the next ``begin`` starts a fresh round.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import secrets
import socket
import threading
import time

import torch
from torch import Tensor

from dilocox.net.rpc import (
    Crypter,
    Limits,
    _parse,
    _recv_exact,
    _recv_into,
    _send_all,
    channel,
    encode,
    read_message,
)
from dilocox.net.secure import AcceptGate, dial, handshake_s, listen_socket, server_handshake
from dilocox.net.tcp import keep_alive

log = logging.getLogger("dilocox.net.mesh")

HELLO_LIMITS = Limits(max_message_bytes=0)  # a hello and its answer: a header only
MAX_KEY = 512  # a round key (the quorum's store prefix) longer than this is not ours
SEGMENT = 256 << 20  # bytes of tensor per message at most
SERVICE = "mesh"  # the service name in every handshake of the pair connections
RESOLVE_S = 2.0  # a member announced by name: its addresses must be known within this to get reserved slots
RESOLVED_TTL_S = 60.0  # a name's addresses (or its failure) are looked up again after this


class MeshError(RuntimeError):
    """A collective of the authenticated mesh failed (a member died, timed out or broke the protocol)."""


def read_into(sock: socket.socket, deadline: float, limits: Limits, seal, dst: Tensor | None):
    """``read_message``, with a message whose one tensor ``t`` has ``dst``'s dtype and size received straight into
    ``dst`` (contiguous, CPU): no buffer of the message's size is allocated (nor zeroed) for it. The header's claims
    are checked as ``read_message`` checks them before a byte of the body is read, the MAC after the body (a
    message that fails it fails the collective; ``dst`` then holds garbage, as a failed gloo collective's output)."""
    if dst is None or isinstance(seal, Crypter) or not dst.is_contiguous() or dst.device.type != "cpu":
        return read_message(sock, deadline, limits, seal)  # (an encrypted message is opened whole anyway)
    return _parse(
        lambda n, d: _recv_exact(sock, n, d), deadline, limits, seal, dst, lambda v, d: _recv_into(sock, v, d)
    )


class PairServer:
    """Accepts the run's pair connections on ``host`` (a free port): the mutual handshake, then hellos
    ``{key, src, nonce}`` until one names this member's current nonce (at most 3); that connection then waits in a
    queue under (key, src), the newest kept, until the member adopts it (``take``). At most ``max_handshakes``
    connections in their handshake (``handshake_s`` each; None: the process's ``secure.handshake_s()``) and
    ``max_pending`` queued; a stranger (no secret) is closed after the challenge, a malformed hello closes that
    connection only. The handshake slots are a ``secure.AcceptGate``'s (at most 4 per address, or IPv6 /64, that is
    not a member of the current round and has not proven the secret before; one over its cap is closed at once, not
    queued; the members' addresses keep reserved slots), each held ``handshake_s`` at most."""

    def __init__(
        self,
        host: str,
        secret: bytes,
        encrypt: bool,
        max_pending: int = 256,
        max_handshakes: int = 32,
        handshake_s: float | None = None,
    ) -> None:
        self.secret, self.encrypt, self.handshake_s = secret, encrypt, handshake_s
        self.max_pending, self.max_handshakes = max_pending, max_handshakes
        self._sock = listen_socket(host, 0)  # (an IPv6 address too)
        self._sock.settimeout(0.2)
        self.addr = f"{host}:{self._sock.getsockname()[1]}"
        self._cv = threading.Condition()
        self._queued: dict[tuple[str, int], tuple[socket.socket, object]] = {}
        self.gate = AcceptGate(total=max_handshakes, reserved=max(1, max_handshakes // 2), per_member=max_handshakes)
        self.nonce: str | None = None  # this member's current round (None: between rounds, every hello refused)
        self.rejected = 0
        self._stop = threading.Event()
        threading.Thread(target=self._accept_loop, name="mesh-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError as e:  # (EMFILE, ECONNABORTED, ...: this one, not the server)
                if self._stop.is_set():
                    return
                log.warning("mesh: accept failed (%s); going on", e)
                time.sleep(0.05)
                continue
            self.gate.hand_off(conn, peer[0], functools.partial(self._hello, conn), "mesh-hello")

    def _hello(self, conn: socket.socket, slot) -> None:
        queued = False
        try:
            bound = self.handshake_s or handshake_s()
            deadline = time.monotonic() + bound
            conn.settimeout(bound)
            keep_alive(conn).setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                key = server_handshake(conn, self.secret, deadline, SERVICE)
            except BaseException:
                self.gate.release(slot)
                slot = None
                raise
            self.gate.release(slot, proven=True)  # (the slot is the handshake's; the hellos are bounded by deadline)
            slot = None
            seal = channel(key, "server", self.encrypt)
            for _ in range(3):
                method, meta, _ = read_message(conn, deadline, HELLO_LIMITS, seal)
                key, src, nonce = meta.get("key"), meta.get("src"), meta.get("nonce")
                if (
                    method != "pair"
                    or not isinstance(key, str)
                    or len(key) > MAX_KEY
                    or type(src) is not int
                    or src < 0
                ):
                    raise ValueError(f"not a pair hello: {method!r} {str(meta)[:80]}")
                with self._cv:
                    current = self.nonce
                ok = current is not None and nonce == current
                # the answer goes out before the connection can be adopted (no collective shares the socket yet)
                _send_all(
                    conn, encode("ok" if ok else "retry", {} if ok else {"nonce": current}), deadline, "pair", seal
                )
                if not ok:
                    continue
                old = None
                with self._cv:  # (queued only if the round did not change meanwhile)
                    if self.nonce == current and not self._stop.is_set():
                        old = self._queued.pop((key, src), None)
                        self._queued[(key, src)] = (conn, seal)
                        while len(self._queued) > self.max_pending:
                            self._queued.pop(next(iter(self._queued)))[0].close()
                        self._cv.notify_all()
                        queued = True
                if old is not None:
                    old[0].close()
                if not queued:
                    conn.close()  # (the round it named is over: the dialer's collective fails at once)
                return
            raise ValueError("no hello named this member's round")
        except Exception as e:  # a stranger, a wrong secret, a malformed or stale hello: this connection only
            with self._cv:
                self.rejected += 1
            log.debug("mesh: pair connection refused: %s", e)
            conn.close()
        finally:
            if slot is not None:
                self.gate.release(slot)

    def begin_round(self, nonce: str | None) -> None:
        """This member's round is now ``nonce`` (None: none); every queued connection (an earlier round's) is closed."""
        with self._cv:
            self.nonce = nonce
            queued, self._queued = list(self._queued.values()), {}
            self._cv.notify_all()
        for conn, _ in queued:
            conn.close()

    def take(self, key: str, src: int, deadline: float) -> tuple[socket.socket, object]:
        """The newest queued connection of member ``src`` for round ``key`` (MeshError past ``deadline``)."""
        with self._cv:
            while (key, src) not in self._queued:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    raise MeshError(f"member {src} did not connect for this round within the timeout")
                self._cv.wait(min(left, 0.5))
            return self._queued.pop((key, src))

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self.begin_round(None)


class MemberAddresses:
    """The IP addresses of the members' hosts, for ``AcceptGate.trust`` (whose reserved slots are matched against a
    connection's peer address, never a name). An IP literal is itself; a name is resolved (every name of a round at
    once, on daemon threads) and its answer, or its failure, kept ``ttl_s``; a name that fails to resolve, or does not
    within ``timeout_s``, grants no reserved slot (its connections still get a stranger's, then a proven address's,
    slots), logged once per name."""

    def __init__(self, timeout_s: float = RESOLVE_S, ttl_s: float = RESOLVED_TTL_S, resolve=None) -> None:
        self.timeout_s, self.ttl_s = timeout_s, ttl_s
        self._resolve = resolve or _resolve_host
        self._known: dict[str, tuple[float, frozenset[str]]] = {}  # name -> (when, addresses; empty: failed)
        self._logged: set[str] = set()

    def __call__(self, hosts) -> set[str]:
        out, names, now = set(), set(), time.monotonic()
        for h in hosts:
            h = str(h).strip("[]")
            try:
                ipaddress.ip_address(h.split("%")[0])
                out.add(h)
            except ValueError:
                hit = self._known.get(h)
                if hit is not None and now - hit[0] < self.ttl_s:
                    out |= hit[1]
                else:
                    names.add(h)
        if names:
            out |= self._lookup(sorted(names))
        return out

    def _lookup(self, names: list[str]) -> set[str]:
        got: dict[str, object] = {}
        lock = threading.Lock()

        def look(name: str) -> None:
            try:
                r: object = frozenset(self._resolve(name))
            except (OSError, UnicodeError) as e:  # (socket.gaierror; a name IDNA cannot encode)
                r = e
            with lock:
                got[name] = r
                if isinstance(r, frozenset) and r:  # (an answer after the deadline still serves the next rounds)
                    self._known[name] = (time.monotonic(), r)

        threads = [threading.Thread(target=look, args=(n,), name="mesh-resolve", daemon=True) for n in names]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.timeout_s
        for t in threads:  # (a lookup still running past the deadline is left to finish on its own)
            t.join(max(0.0, deadline - time.monotonic()))
        out, now = set(), time.monotonic()
        for n in names:
            with lock:
                r = got.get(n)
                ok = isinstance(r, frozenset) and r
                if not ok:
                    self._known[n] = (now, frozenset())
            if ok:
                out |= r
            elif n not in self._logged:
                self._logged.add(n)
                why = r if r is not None else f"no answer within {self.timeout_s:g} s"
                log.warning(
                    "mesh: the member host %r does not resolve (%s): no reserved handshake slots for it", n, why
                )
        return out


def _resolve_host(name: str) -> set[str]:
    return {ai[4][0] for ai in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)}


class Mesh:
    """One member's side of the authenticated mesh (module docstring): ``begin``, ``join`` a round, then the
    collectives."""

    def __init__(self, host: str, secret: bytes, encrypt: bool = False, timeout_s: float = 60.0) -> None:
        if not secret:
            raise ValueError("the authenticated mesh needs the run secret (security.secret_file)")
        self.secret, self.encrypt, self.timeout_s = secret, encrypt, float(timeout_s)
        self.server = PairServer(host, secret, encrypt)
        self.addr = self.server.addr
        self.member_addresses = MemberAddresses()  # the members' hosts (names resolved, bounded) for trust
        self.rank, self.world, self.key, self.nonce = 0, 1, None, None
        self.pairs: dict[int, tuple[socket.socket, object]] = {}
        self._seq = 0
        self._broken: str | None = "no round yet"
        self.bytes_sent = 0

    def begin(self) -> str:
        """End the current round (its connections closed) and start accepting the next; returns its nonce."""
        self._close_pairs()
        self._broken = "configuring a new round"
        self.nonce = secrets.token_hex(16)
        self.server.begin_round(self.nonce)
        return self.nonce

    def join(self, key: str, rank: int, members: list[tuple[str, str]]) -> None:
        """Round ``key`` as member ``rank`` of ``members`` (every member's (address, nonce), in rank order; this
        member's own nonce is the one ``begin`` returned)."""
        if self.nonce is None or members[rank][1] != self.nonce:
            raise MeshError("join: begin() the round first and publish its nonce")
        self.key, self.rank, self.world, self._seq = key, rank, len(members), 0
        hosts = [addr.rpartition(":")[0] for addr, _ in members]
        self.server.gate.trust(self.member_addresses(hosts))  # (reserved slots, by IP address: names resolved)
        deadline = time.monotonic() + self.timeout_s
        try:
            for j in range(rank + 1, self.world):  # dial first (never waits on the peer's configure), then adopt
                self.pairs[j] = self._dial(members[j], deadline)
            for i in range(rank):
                self.pairs[i] = self.server.take(key, i, deadline)
        except Exception as e:
            self._fail(f"joining the round: {type(e).__name__}: {e}")
        self._broken = None

    def _dial(self, member: tuple[str, str], deadline: float) -> tuple[socket.socket, object]:
        addr, nonce = member
        host, _, port = addr.rpartition(":")
        sock, key, _ = dial((host.strip("[]"), int(port)), self.secret, SERVICE, deadline)
        try:
            seal = channel(key, "client", self.encrypt)
            for _ in range(3):
                _send_all(
                    sock, encode("pair", {"key": self.key, "src": self.rank, "nonce": nonce}), deadline, addr, seal
                )
                answer, meta, _ = read_message(sock, deadline, HELLO_LIMITS, seal)
                if answer == "ok":
                    return sock, seal
                nonce = meta.get("nonce") if answer == "retry" else None
                if not isinstance(nonce, str):
                    break
            raise MeshError(f"member at {addr} is not in a round we can join")
        except BaseException:
            sock.close()
            raise

    def _close_pairs(self) -> None:
        for sock, _ in self.pairs.values():
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self.pairs = {}

    def fail_round(self, why: str) -> None:
        """End this round without raising (its connections closed, no hello adopted)."""
        self._broken = why
        self._close_pairs()
        self.server.begin_round(None)

    def _fail(self, why: str):
        self._broken = why
        self._close_pairs()  # the peers see the connection close at once instead of waiting out their timeout
        self.server.begin_round(None)  # (and no later hello of this round is adopted)
        raise MeshError(f"mesh member {self.rank}/{self.world}: {why}")

    def _exchange(
        self,
        sends: dict[int, Tensor],
        expect: dict[int, tuple[torch.dtype, int]],
        deadline: float,
        into: dict[int, Tensor] | None = None,
    ) -> dict[int, Tensor]:
        """Send ``sends[d]`` to every other member d and receive one tensor of ``expect[s]`` (dtype, numel) from each
        other member s (into ``into[s]`` where given), concurrently, by ``deadline``."""
        if self._broken is not None:
            raise MeshError(f"mesh member {self.rank}: {self._broken}; reconfigure first")
        seq, self._seq = self._seq, self._seq + 1
        errors: list[str] = []

        def send(d: int, pair: tuple[socket.socket, object], t: Tensor) -> None:
            try:
                _send_all(pair[0], encode("x", {"seq": seq}, {"t": t}), deadline, f"member {d}", pair[1])
            except Exception as e:
                errors.append(f"sending to member {d}: {type(e).__name__}: {e}")

        threads = [
            threading.Thread(target=send, args=(d, self.pairs[d], t), daemon=True)
            for d, t in sends.items()
            if d != self.rank
        ]
        for th in threads:
            th.start()
        got: dict[int, Tensor] = {}
        try:
            for s, (dtype, numel) in expect.items():
                sock, seal = self.pairs[s]
                limits = Limits(max_message_bytes=numel * torch.empty(0, dtype=dtype).element_size())
                dst = (into or {}).get(s)
                method, meta, tensors = read_into(sock, deadline, limits, seal, dst)
                t = tensors.get("t")
                if method != "x" or meta.get("seq") != seq or t is None or t.dtype != dtype or t.numel() != numel:
                    raise MeshError(f"member {s} sent {method!r} seq {meta.get('seq')} for seq {seq}: out of step")
                if dst is not None and t.data_ptr() != dst.data_ptr():
                    dst.view(-1).copy_(t.view(-1))
                got[s] = dst if dst is not None else t
        except Exception as e:
            self._fail(f"receiving: {type(e).__name__}: {e}")  # (closing the sockets ends the sender threads too)
        for th in threads:
            th.join(max(0.0, deadline - time.monotonic()))
        if errors or any(th.is_alive() for th in threads):
            self._fail(errors[0] if errors else "a send did not finish within the timeout")
        self.bytes_sent += sum(t.numel() * t.element_size() for d, t in sends.items() if d != self.rank)
        return got

    def _segments(self, n: int, itemsize: int) -> list[tuple[int, int]]:
        step = max(1, SEGMENT // max(1, itemsize))
        return [(a, min(n, a + step)) for a in range(0, max(n, 1), step)]

    def all_gather(self, out: list[Tensor], t: Tensor) -> None:
        mine = t.detach().reshape(-1).contiguous().cpu()
        flats = [o.view(-1) if o.is_contiguous() and o.device.type == "cpu" else None for o in out]
        dsts = [f if f is not None else torch.empty(o.numel(), dtype=o.dtype) for f, o in zip(flats, out)]
        for a, b in self._segments(mine.numel(), mine.element_size()):
            others = {s: dsts[s][a:b] for s in range(self.world) if s != self.rank}
            deadline = time.monotonic() + self.timeout_s
            expect = {s: (dsts[s].dtype, v.numel()) for s, v in others.items()}
            self._exchange({d: mine[a:b] for d in range(self.world)}, expect, deadline, into=others)
        dsts[self.rank].copy_(mine)
        for f, d, o in zip(flats, dsts, out):
            if f is None:
                o.copy_(d.view(o.shape))

    def all_to_all_single(self, out: Tensor, t: Tensor) -> None:
        """Equal splits of the flattened buffers: chunk d of ``t`` to member d, chunk s of ``out`` from member s."""
        w = self.world
        if t.numel() % w or out.numel() != t.numel():
            raise ValueError(f"all_to_all_single: {t.numel()} elements do not split equally over {w} members")
        mine = t.detach().reshape(-1).contiguous().cpu().view(w, -1)
        expect = {s: (out.dtype, out.numel() // w) for s in range(w) if s != self.rank}
        got = self._exchange({d: mine[d] for d in range(w)}, expect, time.monotonic() + self.timeout_s)
        res = torch.stack([mine[s] if s == self.rank else got[s].view(-1) for s in range(w)])
        out.copy_(res.view(out.shape))

    def all_reduce(self, t: Tensor) -> None:
        """In-place SUM over the members: reduce-scatter (member j sums chunk j in rank order), then all-gather
        (each member's sum received straight into its chunk of the result); segment by segment past ``SEGMENT``."""
        if self.world == 1:
            return
        flat = t.detach().reshape(-1)
        work = flat if flat.device.type == "cpu" and flat.data_ptr() == t.data_ptr() and t.is_contiguous() else None
        work = work if work is not None else flat.cpu().clone()
        for a, b in self._segments(work.numel(), work.element_size()):
            self._all_reduce_flat(work[a:b], time.monotonic() + self.timeout_s)
        if work.data_ptr() != t.data_ptr():
            t.copy_(work.view(t.shape))

    def _all_reduce_flat(self, work: Tensor, deadline: float) -> None:
        w = self.world
        step = -(-work.numel() // w)
        bounds = [(min(j * step, work.numel()), min((j + 1) * step, work.numel())) for j in range(w)]
        lo, hi = bounds[self.rank]
        bufs = {s: torch.empty(hi - lo, dtype=work.dtype) for s in range(w) if s != self.rank}  # (not zeroed)
        expect = {s: (work.dtype, hi - lo) for s in bufs}
        got = self._exchange({d: work[a:b] for d, (a, b) in enumerate(bounds)}, expect, deadline, into=bufs)
        parts = [work[lo:hi] if s == self.rank else got[s] for s in range(w)]
        if w == 2:  # (elementwise: writing over an input of the same element is safe)
            torch.add(parts[0], parts[1], out=work[lo:hi])
        else:
            acc = parts[0] + parts[1]
            for p in parts[2:]:
                acc += p
            work[lo:hi].copy_(acc)
        others = {s: work[a:b] for s, (a, b) in enumerate(bounds) if s != self.rank}
        expect = {s: (work.dtype, v.numel()) for s, v in others.items()}
        self._exchange({d: work[lo:hi] for d in range(w)}, expect, deadline, into=others)

    def close(self) -> None:
        self._close_pairs()
        self.server.close()
