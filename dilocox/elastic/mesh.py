"""The elastic outer group's collectives on authenticated pair connections instead of gloo's (issue 21).

torchft's ``ProcessGroupGloo`` connects the replicas of a quorum with gloo's own TCP pairs: nothing authenticates
them and nothing hides their bytes (the pseudo-gradients), so across sites they must run inside a private network.
With ``outer.elastic.collectives: authenticated`` the quorum's process group is a ``Mesh`` instead: every pair of
members talks over one TCP connection that began with the run secret's mutual handshake (``dilocox.security``) and
carries every message MACed, or sealed with ChaCha20-Poly1305 under ``security.encrypt`` (the SWARM RPC's framing,
``swarm/transport.py``: lengths bounded before anything is allocated, nothing unpickled).

A round (one ``configure`` of torchft, i.e. one quorum) is the set of pair connections made for it: each member
dials the members of higher rank (``PairServer`` queues an incoming connection under (round key, dialer's rank),
keeping only the newest) and adopts the queued connection of each member of lower rank; all of the round's
connections are closed when the member configures the next round. So data only ever flows between two members that
both adopted the same connection: a message of an earlier round, or of a member that already moved on, can never be
taken for this round's (at worst it finds a closed connection: the collective fails, the outer step is retried with
a new quorum, as with gloo). Member addresses come from the quorum's store (reached through the guarded relay of
``elastic/stores.py``), signed with the run secret.

Collectives (what ``compress/collectives.py`` and the elastic group use): ``all_gather``, ``all_to_all_single`` and a
SUM ``all_reduce`` as a reduce-scatter then an all-gather (each member sums its chunk over the members in rank
order, so every member ends with the same bits; 2 (W - 1) / W of the tensor sent per member, as a ring). Every wait
is bounded by ``timeout_s``; a failure closes the round's connections (the peers fail fast too) and raises
``MeshError``; the next ``configure`` starts a fresh round.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from datetime import timedelta

import torch
from torch import Tensor

from dilocox.security import client_handshake, open_value, server_handshake, sign_value
from dilocox.swarm.transport import Crypter, Limits, _parse, _send_all, channel, encode, read_message

log = logging.getLogger("dilocox.elastic.mesh")

HELLO_LIMITS = Limits(max_message_bytes=0)  # a pair's first message: a header only
MAX_KEY = 512  # a round key (the quorum's store prefix) longer than this is not ours


class MeshError(RuntimeError):
    """A collective of the authenticated mesh failed (a member died, timed out or broke the protocol)."""


class PairServer:
    """Accepts the run's pair connections on ``host`` (a free port): the mutual handshake (``handshake_s``), then one
    ``pair`` message ``{key, src}``; the connection then waits in a queue under (key, src), the newest one kept, until
    the member adopts it (``take``). At most ``max_pending`` queued and 32 in their handshake; a stranger (no secret)
    is closed after the challenge, a malformed hello closes that connection only."""

    def __init__(self, host: str, secret: bytes, encrypt: bool, max_pending: int = 64, handshake_s: float = 5.0):
        self.secret, self.encrypt, self.max_pending, self.handshake_s = secret, encrypt, max_pending, handshake_s
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(0.2)
        self.addr = f"{host}:{self._sock.getsockname()[1]}"
        self._cv = threading.Condition()
        self._queued: dict[tuple[str, int], tuple[socket.socket, object]] = {}
        self._in_handshake = 0
        self.rejected = 0
        self._stop = threading.Event()
        threading.Thread(target=self._accept_loop, name="mesh-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            with self._cv:
                if self._in_handshake >= 32:
                    conn.close()
                    continue
                self._in_handshake += 1
            threading.Thread(target=self._hello, args=(conn,), name="mesh-hello", daemon=True).start()

    def _hello(self, conn: socket.socket) -> None:
        try:
            deadline = time.monotonic() + self.handshake_s
            conn.settimeout(self.handshake_s)
            seal = channel(server_handshake(conn, self.secret, deadline), "server", self.encrypt)
            method, meta, _ = read_message(conn, deadline, HELLO_LIMITS, seal)
            key, src = meta.get("key"), meta.get("src")
            if method != "pair" or not isinstance(key, str) or len(key) > MAX_KEY or type(src) is not int or src < 0:
                raise ValueError(f"not a pair hello: {method!r} {str(meta)[:80]}")
        except Exception as e:  # a stranger, a wrong secret, a malformed hello: this connection only
            with self._cv:
                self._in_handshake -= 1
                self.rejected += 1
            log.debug("mesh: pair connection refused: %s", e)
            conn.close()
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._cv:
            self._in_handshake -= 1
            old = self._queued.pop((key, src), None)
            self._queued[(key, src)] = (conn, seal)
            while len(self._queued) > self.max_pending:
                oldest = next(iter(self._queued))
                self._queued.pop(oldest)[0].close()
            self._cv.notify_all()
        if old is not None:
            old[0].close()

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
        with self._cv:
            for conn, _ in self._queued.values():
                conn.close()
            self._queued.clear()
            self._cv.notify_all()


def _recv_into(sock: socket.socket, view: memoryview, deadline: float) -> None:
    got = 0
    while got < len(view):
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("receive timed out")
        sock.settimeout(left)
        k = sock.recv_into(view[got:], len(view) - got)
        if k == 0:
            raise ConnectionResetError("connection closed by the other side")
        got += k


def read_into(sock: socket.socket, deadline: float, limits: Limits, seal, dst: Tensor | None):
    """``read_message``, with a message's one tensor received straight into ``dst`` (contiguous, CPU) when its
    claimed size is ``dst``'s: no buffer of the message's size is allocated (nor zeroed) for it. The claims are
    checked exactly as ``read_message`` does, before a byte of the body is read."""
    if dst is None or isinstance(seal, Crypter) or not dst.is_contiguous() or dst.device.type != "cpu":
        return read_message(sock, deadline, limits, seal)  # (an encrypted message is opened whole anyway)
    target = memoryview(dst.view(-1).view(torch.uint8).numpy()) if dst.numel() else None
    calls = [0]

    def read(n: int, d):
        calls[0] += 1
        if calls[0] == 3 and target is not None and n == len(target):  # (length, header, then the tensor)
            _recv_into(sock, target, d)
            return target
        buf = bytearray(n)
        _recv_into(sock, memoryview(buf), d)
        return buf

    return _parse(read, deadline, limits, seal)


class Mesh:
    """One member's side of the authenticated mesh (module docstring): ``join`` a round, then the collectives."""

    def __init__(self, host: str, secret: bytes, encrypt: bool = False, timeout_s: float = 60.0) -> None:
        if not secret:
            raise ValueError("the authenticated mesh needs the run secret (security.secret_file)")
        self.secret, self.encrypt, self.timeout_s = secret, encrypt, float(timeout_s)
        self.server = PairServer(host, secret, encrypt)
        self.addr = self.server.addr
        self.rank, self.world, self.key = 0, 1, None
        self.pairs: dict[int, tuple[socket.socket, object]] = {}
        self._seq = 0
        self._broken: str | None = None
        self.bytes_sent = 0

    def join(self, key: str, rank: int, addrs: list[str]) -> None:
        """Start round ``key`` as member ``rank`` of ``addrs`` (every member's ``addr``, in rank order)."""
        self._close_pairs()
        self.key, self.rank, self.world, self._seq, self._broken = key, rank, len(addrs), 0, None
        deadline = time.monotonic() + self.timeout_s
        try:
            for j in range(rank + 1, self.world):  # dial first (never waits on the peer's configure), then adopt
                host, _, port = addrs[j].rpartition(":")
                sock = socket.create_connection((host.strip("[]"), int(port)), timeout=self.timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                seal = channel(client_handshake(sock, self.secret, deadline), "client", self.encrypt)
                _send_all(sock, encode("pair", {"key": key, "src": rank}), deadline, addrs[j], seal)
                self.pairs[j] = (sock, seal)
            for i in range(rank):
                self.pairs[i] = self.server.take(key, i, deadline)
        except Exception as e:
            self._fail(f"joining the round: {type(e).__name__}: {e}")

    def _close_pairs(self) -> None:
        for sock, _ in self.pairs.values():
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self.pairs = {}

    def _fail(self, why: str):
        self._broken = why
        self._close_pairs()  # the peers see the connection close at once instead of waiting out their timeout
        raise MeshError(f"mesh member {self.rank}/{self.world}: {why}")

    def _exchange(
        self,
        sends: dict[int, Tensor],
        expect: dict[int, tuple[torch.dtype, int]],
        into: dict[int, Tensor] | None = None,
    ) -> dict[int, Tensor]:
        """Send ``sends[d]`` to every other member d and receive one tensor of ``expect[s]`` (dtype, numel) from each
        other member s (into ``into[s]`` where given), concurrently, within one deadline."""
        if self._broken is not None:
            raise MeshError(f"mesh member {self.rank}: the round failed ({self._broken}); reconfigure first")
        seq, self._seq = self._seq, self._seq + 1
        deadline = time.monotonic() + self.timeout_s
        errors: list[str] = []

        def send(d: int, t: Tensor) -> None:
            sock, seal = self.pairs[d]
            try:
                _send_all(sock, encode("x", {"seq": seq}, {"t": t}), deadline, f"member {d}", seal)
            except Exception as e:
                errors.append(f"sending to member {d}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=send, args=(d, t), daemon=True) for d, t in sends.items() if d != self.rank]
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
            self._fail(f"receiving: {type(e).__name__}: {e}")
        for th in threads:
            th.join(max(0.0, deadline - time.monotonic()))
        if errors or any(th.is_alive() for th in threads):
            self._fail(errors[0] if errors else "a send did not finish within the timeout")
        self.bytes_sent += sum(t.numel() * t.element_size() for d, t in sends.items() if d != self.rank)
        return got

    def all_gather(self, out: list[Tensor], t: Tensor) -> None:
        mine = t.detach().contiguous().cpu()
        got = self._exchange(
            {d: mine for d in range(self.world)},
            {s: (out[s].dtype, out[s].numel()) for s in range(self.world) if s != self.rank},
        )
        for s in range(self.world):
            out[s].copy_((mine if s == self.rank else got[s]).view(out[s].shape))

    def all_to_all_single(self, out: Tensor, t: Tensor) -> None:
        """Equal splits: chunk d of ``t`` to member d, chunk s of ``out`` from member s."""
        w = self.world
        if t.numel() % w or out.numel() != t.numel():
            raise ValueError(f"all_to_all_single: {t.numel()} elements do not split equally over {w} members")
        mine = t.detach().contiguous().cpu().view(w, -1)
        got = self._exchange({d: mine[d] for d in range(w)}, {s: (out.dtype, out.numel() // w) for s in range(w)
                                                               if s != self.rank})  # fmt: skip
        dst = out.view(w, -1)
        for s in range(w):
            dst[s].copy_(mine[s] if s == self.rank else got[s])

    def all_reduce(self, t: Tensor) -> None:
        """In-place SUM over the members: reduce-scatter (member j sums chunk j in rank order), then all-gather
        (each member's sum received straight into its chunk of the result)."""
        w = self.world
        if w == 1:
            return
        flat = t.detach().reshape(-1)
        work = flat if flat.device.type == "cpu" and flat.data_ptr() == t.data_ptr() else flat.cpu().clone()
        step = -(-work.numel() // w)
        bounds = [(min(j * step, work.numel()), min((j + 1) * step, work.numel())) for j in range(w)]
        lo, hi = bounds[self.rank]
        bufs = {s: torch.empty(hi - lo, dtype=work.dtype) for s in range(w) if s != self.rank}  # (not zeroed)
        got = self._exchange({d: work[a:b] for d, (a, b) in enumerate(bounds)},
                             {s: (work.dtype, hi - lo) for s in bufs}, into=bufs)  # fmt: skip
        parts = [work[lo:hi] if s == self.rank else got[s] for s in range(w)]
        if w == 2:  # (elementwise: writing over an input of the same element is safe)
            torch.add(parts[0], parts[1], out=work[lo:hi])
        else:
            acc = parts[0] + parts[1]
            for p in parts[2:]:
                acc += p
            work[lo:hi].copy_(acc)
        others = {s: work[a:b] for s, (a, b) in enumerate(bounds) if s != self.rank}
        self._exchange({d: work[lo:hi] for d in range(w)}, {s: (work.dtype, v.numel()) for s, v in others.items()},
                       into=others)  # fmt: skip
        if work.data_ptr() != t.data_ptr():
            t.copy_(work.view(t.shape))

    def close(self) -> None:
        self._close_pairs()
        self.server.close()


def mesh_process_group(host: str, secret: bytes, encrypt: bool, timeout_s: float, relays):
    """A torchft process group (``Manager(pg=...)``) whose collectives run on a ``Mesh``; ``relays``
    (``stores.StoreRelays``) maps the quorum's store address to a local relay that proves the secret."""
    from torch.distributed import ReduceOp
    from torchft.process_group import ProcessGroup, create_store_client
    from torchft.work import _DummyWork

    class _Parent:  # (TorchftGroup asks the reconfigured group's rank through ``parent``, as for gloo)
        def __init__(self, mesh: Mesh) -> None:
            self.mesh = mesh

        def rank(self) -> int:
            return self.mesh.rank

    class MeshProcessGroup(ProcessGroup):
        def __init__(self) -> None:
            super().__init__(0, 1)
            self.mesh = Mesh(host, secret, encrypt, timeout_s)
            self.parent = _Parent(self.mesh)
            self.relays = relays

        def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, *args, **kwargs) -> None:
            store = create_store_client(self.relays.local(store_addr), timedelta(seconds=timeout_s))
            key = f"dxmesh/{rank}"
            store.set(key, sign_value(secret, key, self.mesh.addr))
            addrs = []
            for r in range(world_size):  # (a stale entry is harmless: a member's address is fixed for its life)
                k = f"dxmesh/{r}"
                addrs.append(open_value(secret, k, store.get(k).decode()))
            self.mesh.join(store_addr, rank, addrs)

        def allreduce(self, tensors: list[Tensor], opts) -> object:
            op = getattr(opts, "reduceOp", opts)
            if op != ReduceOp.SUM:
                raise ValueError(f"the authenticated mesh all-reduces with SUM only, not {op}")
            for t in tensors:
                self.mesh.all_reduce(t)
            return _DummyWork(tensors)

        def allgather(self, output_tensors: list[list[Tensor]], input_tensor: list[Tensor], opts) -> object:
            for out, t in zip(output_tensors, input_tensor):
                self.mesh.all_gather(out, t)
            return _DummyWork(output_tensors)

        def alltoall_base(self, output_buffer, input_buffer, output_split_sizes, input_split_sizes, opts) -> object:
            if output_split_sizes or input_split_sizes:
                raise ValueError("the authenticated mesh's all_to_all takes equal splits only")
            self.mesh.all_to_all_single(output_buffer, input_buffer)
            return _DummyWork(output_buffer)

        def size(self) -> int:
            return self.mesh.world

        def getBackendName(self) -> str:
            return "dilocox-mesh"

        def errored(self):
            return None  # (a failed collective raises; the elastic group reports it to the manager)

        def close_relays(self) -> None:
            self.relays.close()
            self.mesh.close()

        def shutdown(self) -> None:
            self.close_relays()

    return MeshProcessGroup()
