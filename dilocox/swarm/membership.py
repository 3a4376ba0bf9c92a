"""Peer side of SWARM rebalancing (issue 11 point 5; the launcher side is ``dilocox.swarm.mover``).

A peer answers four membership RPCs (``SwarmPeer._handle`` hands them here):

- ``stats``: its stage, index, step, whether it serves, and the cumulative counters of its ``LoadMeter`` (the
  launcher takes differences between two polls: mean queue length and microbatches per busy second over that
  window), so the peer keeps no window of its own.
- ``leave``: finish the current step (its sync included; ``swarm.sync=diloco``: the current outer phase, so
  its local steps enter the stage's outer step), then stop serving (requests of the next step get
  ``NotServing``: callers ban it briefly and re-send), say ``bye`` to the peers of the stages around it, leave the
  stage's torchft group (record ``{"left": true}``); with ``move_to`` (rebalancing) the same process then runs as
  a joining peer of its new stage (``moved_argv``), else it exits 0.
- ``hello`` (from a peer that joined the stage below or above): an upstream peer adds it to its router and to the
  peers it sends end-of-step markers to; a downstream peer expects its markers from the step it serves first.
- ``bye`` (from a peer that leaves): an upstream peer removes it from its router and marker list for good; a
  downstream peer stops expecting its markers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import threading
import time

from dilocox.net.client import call
from dilocox.net.rpc import PeerUnavailable, RemoteError, run_secret
from dilocox.net.secure import open_value
from dilocox.swarm.common import peer_name
from dilocox.swarm.rebalance import PeerLoad

log = logging.getLogger("dilocox.swarm.membership")

METHODS = ("stats", "leave", "hello", "bye")
MEMBERS_KEY = "swarm/members"  # JSON [[indices of stage 0], [stage 1], ...]: the job's current peers (launcher)


def parse_name(name: str) -> tuple[int, int]:
    """``s{j}p{k}`` -> (j, k)."""
    if not (name.startswith("s") and "p" in name):
        raise ValueError(f"peer name {name!r} is not of the form s<stage>p<index>")
    j, k = name[1:].split("p", 1)
    return int(j), int(k)


class LoadMeter:
    """Cumulative counters of one peer's compute queue: microbatches waiting for or holding its compute lock.

    ``area``: integral of the queue length over time (seconds x microbatches); ``busy``: seconds with a non-empty
    queue; ``done``: microbatches whose last local part (the backward) finished. Over a window between two
    snapshots: mean queue = d(area) / dt, throughput = d(done) / d(busy) (microbatches per busy second).
    """

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self.q = 0
        self.area = self.busy = 0.0
        self.done = 0
        self.t = clock()

    def _advance(self) -> None:
        now = self.clock()
        dt = now - self.t
        self.area += self.q * dt
        if self.q > 0:
            self.busy += dt
        self.t = now

    def enter(self) -> None:
        with self._lock:
            self._advance()
            self.q += 1

    def exit(self, done: bool = False) -> None:
        with self._lock:
            self._advance()
            self.q -= 1
            self.done += int(done)

    @contextlib.contextmanager
    def hold(self, lock, done: bool = False):
        """``with meter.hold(peer.lock, done=...)``: queued from now, through the wait for ``lock`` and the work
        under it; ``done`` counts a completed microbatch when the block ends without an exception."""
        self.enter()
        ok = False
        try:
            with lock:
                yield
            ok = True
        finally:
            self.exit(done=done and ok)

    def snapshot(self) -> dict:
        with self._lock:
            self._advance()
            return {"t": self.t, "area": self.area, "busy": self.busy, "done": self.done, "queue_now": self.q}


def window(a: dict, b: dict) -> tuple[float, float] | None:
    """(mean queue, microbatches per busy second) between snapshots ``a`` and ``b`` of one peer; None when it did no
    work in between (no throughput to measure)."""
    dt, busy, done = b["t"] - a["t"], b["busy"] - a["busy"], b["done"] - a["done"]
    if dt <= 0 or busy <= 0 or done <= 0:
        return None
    return (b["area"] - a["area"]) / dt, done / busy


def peer_loads(prev: dict[str, dict], cur: dict[str, dict]) -> tuple[list, bool]:
    """(``rebalance.PeerLoad`` of each serving peer over the window between two polls of ``stats``, warm).

    A peer that worked in the window reports its mean queue and throughput (``window``). A serving peer that was
    idle the whole window (no queue at all: the routers sent it nothing) is spare capacity of its stage: queue 0 and
    the mean throughput of the stage's working peers (it is one of them; the SWARM router starves a peer whose
    first microbatch was slow, e.g. on a loaded host, so an idle peer is common and the best one to move). A peer
    that held work without finishing any is left out (its speed is unknown). ``warm``: every peer had finished 2
    steps at the window's start (start-up costs are not steady state)."""
    loads, idle = [], []
    for n, b in cur.items():
        a = prev.get(n)
        if a is None or not b.get("serving") or b.get("leaving"):
            continue
        w = window(a, b)
        if w is not None:
            loads.append(PeerLoad(n, int(b["stage"]), w[0], w[1]))
        elif b["t"] > a["t"] and b["busy"] == a["busy"]:
            idle.append((n, int(b["stage"])))
    for n, j in idle:
        speeds = [p.throughput for p in loads if p.stage == j]
        if speeds:
            loads.append(PeerLoad(n, j, 0.0, sum(speeds) / len(speeds)))
    warm = all(prev[n]["step"] >= 2 for n in cur if n in prev)
    return loads, warm


# the peer command's flags that belong to its old place (stage, index, stage lighthouse, injected slowness, test
# hooks); a moved peer gets its new stage's from the launcher: name -> whether the flag takes a value
_PLACE_FLAGS = {
    "--stage": True,
    "--index": True,
    "--lighthouse": True,
    "--delay-s": True,
    "--pace-s": True,
    "--die-mid-step": True,
    "--dump-grads": True,
    "--delay-serial": False,
    "--join": False,
    "--resume": False,
}  # fmt: skip (--resume: a moved peer joins its new stage, it does not resume)


def moved_argv(argv: list[str], move_to: dict) -> list[str]:
    """The peer command of a peer moved to ``move_to`` = {stage, index, lighthouse, args}: ``argv`` without its
    place flags, plus the new place and ``--join`` (it downloads the new stage's state first)."""
    out, skip = [], False
    for i, tok in enumerate(argv):
        if tok == "--":  # the config overrides: kept as they are
            out += argv[i:]
            break
        if skip:
            skip = False
            continue
        flag = tok.split("=", 1)[0]
        if flag in _PLACE_FLAGS:
            skip = _PLACE_FLAGS[flag] and "=" not in tok
            continue
        out.append(tok)
    place = ["--stage", str(int(move_to["stage"])), "--index", str(int(move_to["index"])), "--join"]
    if move_to.get("lighthouse"):
        place += ["--lighthouse", str(move_to["lighthouse"])]
    place += [str(x) for x in move_to.get("args", [])]
    # before a ``--`` (after it every token is a config override: ``--netns`` peers end with ``-- --swarm.host=...``)
    cut = out.index("--") if "--" in out else len(out)
    return out[:cut] + place + out[cut:]


_MOVE_ARGS = {"--pace-s"}  # (what a launcher's mover adds: the tests' per-stage pace, a float)
_ADDR = re.compile(r"^(https?://)?[\w.\-:\[\]]{1,255}:\d{1,5}$")


def checked_move_to(move_to, n_stages: int) -> dict | None:
    """``leave``'s ``move_to`` as the peer will act on it (its next command line): a stage of the layout, an index,
    a lighthouse address and only the arguments a mover sends; anything else raises ValueError (an authenticated
    caller still may not pass flags of its choosing: ``--out``, ``--config``, ``--store``)."""
    if move_to is None:
        return None
    if not isinstance(move_to, dict) or set(move_to) - {"stage", "index", "lighthouse", "args"}:
        raise ValueError(f"move_to {move_to!r}: keys stage, index, lighthouse, args only")
    stage, index, lh, args = (move_to.get(k) for k in ("stage", "index", "lighthouse", "args"))
    lh = lh.rstrip("/") if isinstance(lh, str) else lh  # (http://host:port/ as given to `swarm rebalance`)
    if not all(type(x) is int for x in (stage, index)) or not (0 <= stage < n_stages and 0 <= index < 4096):
        raise ValueError(f"move_to {move_to!r}: stage in [0, {n_stages}) and index in [0, 4096), as ints")
    if lh is not None and not (isinstance(lh, str) and _ADDR.match(lh) and not lh.startswith("-")):
        raise ValueError(f"move_to's lighthouse {lh!r} is not an address")
    args = list(args or [])
    flags, values = args[0::2], args[1::2]
    try:
        ok = len(flags) == len(values) and set(flags) <= _MOVE_ARGS and all(math.isfinite(float(v)) for v in values)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"move_to's args {args!r}: only {sorted(_MOVE_ARGS)} with a number each")
    return {"stage": stage, "index": index, "lighthouse": lh, "args": [str(x) for x in args]}


def read_members(store, pps: list[int]) -> list[list[int]]:
    """The job's current peers per stage: the launcher's ``swarm/members`` key when it set one (rebalancing), else
    every index of ``swarm.peers_per_stage``."""
    try:
        if store.check([MEMBERS_KEY]):
            raw = open_value(run_secret(), MEMBERS_KEY, store.get(MEMBERS_KEY).decode())
            return [list(map(int, s)) for s in json.loads(raw)]
    except Exception:  # noqa: BLE001 - an unreadable key (or not the run's): fall back to the configured layout
        log.warning("could not read %s from the store; using swarm.peers_per_stage", MEMBERS_KEY)
    return [list(range(m)) for m in pps]


def handle(peer, method: str, meta: dict):
    """The membership RPCs of ``peer`` (a ``SwarmPeer``)."""
    if method == "stats":
        snap = peer.meter.snapshot()
        snap.update(stage=peer.stage, index=peer.index, step=peer.step, serving=peer.serving)
        snap["leaving"] = peer.leave_requested
        return snap, {}
    if method == "leave":
        peer.request_leave(checked_move_to(meta.get("move_to"), len(peer.pps)))
        when = "its current step" if peer.s.sync == "swarm" else "its current outer phase"
        log.info("%s: asked to leave stage %d after %s (then: %s)", peer.name, peer.stage, when, peer.move_to)
        return {"step": peer.step}, {}
    sender = str(meta["sender"])
    j, _ = parse_name(sender)
    if method == "hello":
        if j == peer.stage + 1:  # a new peer downstream: route to it, send it our end-of-step markers
            with peer.router_lock:
                peer.addrs[sender] = str(meta["addr"])
                peer.router.add(sender)
            with peer.lock:
                if sender not in peer.down_peers:
                    peer.down_peers.append(sender)
                sent = peer.markers_sent
            log.info("%s: %s joined the next stage (routing to it from now on)", peer.name, sender)
            return {"markers_sent": sent}, {}
        if j == peer.stage - 1:  # a new peer upstream: expect its markers from the step it serves first
            with peer.cv:
                peer.addrs[sender] = str(meta["addr"])
                peer.up_from[sender] = int(meta["from_step"])
                if sender not in peer.expected_up:
                    peer.expected_up.append(sender)
                peer.cv.notify_all()
            log.info("%s: %s joined the previous stage (markers from step %s)", peer.name, sender, meta["from_step"])
            return {"step": peer.step}, {}
    if method == "bye":
        if j == peer.stage + 1:
            with peer.router_lock:
                if sender in peer.router.until:
                    peer.router.remove(sender)
            with peer.lock:
                if sender in peer.down_peers:
                    peer.down_peers.remove(sender)
            log.info("%s: %s left the next stage", peer.name, sender)
            return {}, {}
        if j == peer.stage - 1:
            peer.drop_upstream(sender)
            log.info("%s: %s left the previous stage", peer.name, sender)
            return {}, {}
    raise ValueError(f"{peer.name}: {method} from {sender}, which is not in a neighbouring stage")


def _tell(peer, targets: list[str], method: str, meta: dict) -> dict[str, dict]:
    out = {}
    for t in targets:
        try:
            out[t], _ = call(peer.addrs[t], method, meta, timeout_s=min(5.0, peer.s.rpc_timeout_s))
        except (PeerUnavailable, RemoteError) as e:  # a dead neighbour: its own stage handles it
            log.warning("%s: %s to %s failed (%s)", peer.name, method, t, e)
    return out


def announce(peer, first_step: int, members: list[list[int]]) -> None:
    """A joined peer (serving from ``first_step``) says hello to the peers of the stages before and after it."""
    meta = {"sender": peer.name, "addr": peer.server.addr, "from_step": first_step}
    if peer.stage > 0:
        ups = [peer_name(peer.stage - 1, i) for i in members[peer.stage - 1]]
        for up, rep in _tell(peer, ups, "hello", meta).items():
            if int(rep.get("markers_sent", -1)) >= first_step:  # it sent that step's markers before our hello
                with peer.cv:
                    peer.up_from[up] = int(rep["markers_sent"]) + 1
                    peer.cv.notify_all()
    if not peer.last:
        _tell(peer, [peer_name(peer.stage + 1, i) for i in members[peer.stage + 1]], "hello", meta)


def say_bye(peer) -> None:
    """A leaving peer tells its neighbours (after its last sync): they stop routing to it / expecting it."""
    meta = {"sender": peer.name}
    if peer.stage > 0:
        with peer.cv:
            ups = list(peer.expected_up)
        _tell(peer, ups, "bye", meta)
    if not peer.last:
        with peer.lock:
            downs = list(peer.down_peers)
        _tell(peer, downs, "bye", meta)


def leave(peer, step: int) -> None:
    """The end of a peer asked to leave (called after its sync of ``step``; it serves no more): bye to its
    neighbours, out of its stage's torchft group (the next quorum goes on without it), a ``left`` record."""
    t0 = time.monotonic()
    say_bye(peer)
    if peer.group is not None:
        peer.group.close()
        peer.group = None
    rec = {"step": step, "peer": peer.name, "left": True, "seconds": time.monotonic() - t0}
    if peer.move_to is not None:
        rec["moved_to"] = f"s{peer.move_to['stage']}p{peer.move_to['index']}"
    peer._record(rec)
    log.info("%s: left stage %d after step %d", peer.name, peer.stage, step)
