"""Launcher side of SWARM rebalancing (issue 11 point 5, SWARM Appendix D): the thread that moves peers.

Every ``swarm.rebalance_period_s`` seconds the ``Mover`` (a thread of ``SwarmLauncher``, which owns the peer
processes, or of ``dilocox swarm rebalance`` beside a job another launcher started: ``RemoteControl``) asks
every current peer for its ``stats`` (short timeout; a peer that does not answer is left out), turns the counters
into each peer's mean queue length and microbatches per busy second over the period (``membership.window``) and
asks ``rebalance.plan_move`` for a move. A peer moved into stage 0 becomes a data source too: it draws its own batch
of ``train.batch_size`` windows per step (random windows seeded by its index), so the job's batch per step grows by
one peer's, as it shrinks when a stage-0 peer moves out. The move:

1. the job's member list (store key ``swarm/members``) is updated (the peer out of its stage, in the target stage
   at the smallest index free there, ``s{j}p{m}``) and ``leave`` with ``move_to`` goes to the chosen peer. It
   finishes its step (sync included; ``swarm.sync=diloco``: its outer phase, up to the next outer step), says bye
   to its neighbours, leaves its stage's torchft group, and the SAME process then runs as peer ``s{j}p{m}`` with
   ``--join`` (``membership.moved_argv``): it downloads the target stage's params and AdamW state (diloco: with
   θ and the outer momentum) from a live peer of that stage through torchft at the stage's next sync (diloco: its
   next outer step; the peer is idle until then), says hello to the neighbouring stages (their routers add it)
   and serves. No new process, so no start-up cost.
2. tokens/s is measured on the stage-0 peers' counters over the period before the move and over one period after
   the moved peer serves and finished 2 steps (one-off costs of the join left out); one log line
   ``rebalance: ... measured X -> Y tokens/s`` and a record in ``OUT/rebalance.jsonl`` (also for refused moves and
   failures).

Every wait is bounded; the thread stops with the job (``stop``) and never raises.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

from dilocox.net.client import call
from dilocox.net.rpc import PeerUnavailable, RemoteError, run_secret
from dilocox.net.secure import open_value, sign_value
from dilocox.swarm.common import peer_name, split_peer_name, store_key
from dilocox.swarm.membership import MEMBERS_KEY, peer_loads
from dilocox.swarm.rebalance import plan_move

log = logging.getLogger("dilocox.swarm.mover")


class Mover(threading.Thread):
    """Rebalancing thread of one job. ``extra_for(stage, index) -> list[str]``: extra peer arguments (the
    per-stage injected delay of the tests); ``steps``: the job's ``--steps``."""

    def __init__(self, launcher, steps: int | None, extra_for=None) -> None:
        super().__init__(name="swarm-rebalance", daemon=True)
        self.la, self.steps, self.extra_for = launcher, steps, extra_for or (lambda j, k: [])
        s = launcher.cfg.swarm
        self.s, self.period = s, float(s.rebalance_period_s)
        self.members = [list(range(m)) for m in s.peers_per_stage]
        self.tokens_per_mb = s.microbatch_size * launcher.cfg.train.seq_len
        self.stop_event = threading.Event()
        self.prev: dict[str, dict] = {}  # peer -> its stats at the previous poll
        self.moves: list[dict] = []
        self.joined: dict = {}  # new peer name -> the PeerProc of the process that moved there
        self.path = os.path.join(launcher.out_dir, "rebalance.jsonl")
        self.store = None  # the store client of this thread (``SwarmLauncher.control_store``), made in ``run``

    # ------------------------------------------------------------------ helpers
    def _set_members(self) -> None:
        self.store.set(MEMBERS_KEY, sign_value(run_secret(), MEMBERS_KEY, json.dumps(self.members)))

    def _addr(self, name: str) -> str | None:
        key = store_key(*split_peer_name(name))
        try:  # (get would block until the key exists: check first)
            return open_value(run_secret(), key, self.store.get(key).decode()) if self.store.check([key]) else None
        except Exception:  # noqa: BLE001 - not published (yet), or not by the run
            return None

    def _names(self) -> list[str]:
        return [peer_name(j, k) for j, ks in enumerate(self.members) for k in ks]

    def _stats(self, names: list[str]) -> dict[str, dict]:
        out = {}
        for n in names:
            addr = self._addr(n)
            if addr is None:
                continue
            try:
                out[n], _ = call(addr, "stats", {}, timeout_s=min(2.0, self.s.rpc_timeout_s))
            except (PeerUnavailable, RemoteError):
                continue
        return out

    def _tokens_rate(self, a: dict[str, dict], b: dict[str, dict]) -> float | None:
        """Stage-0 tokens/s between two polls, over the stage-0 peers present in both."""
        both = [n for n in a if n in b and n.startswith("s0p")]
        if not both:
            return None
        done = sum(b[n]["done"] - a[n]["done"] for n in both)
        dt = max(b[n]["t"] - a[n]["t"] for n in both)
        return done * self.tokens_per_mb / dt if dt > 0 else None

    def _record(self, rec: dict) -> None:
        rec = {"t": time.time(), **rec}
        self.moves.append(rec)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def _proc(self, name: str):
        procs = [p for p in self.la.procs if p.name == name]
        return procs[-1] if procs else None

    # ------------------------------------------------------------------ the loop
    def stop(self) -> None:
        self.stop_event.set()

    def run(self) -> None:
        try:  # --netns: this thread enters the hub's namespace, where the store and every peer are reachable
            self.store = self.la.control_store()
            self._set_members()
        except Exception:  # noqa: BLE001 - no rebalancing, the job goes on
            log.exception("rebalance: cannot reach the job's store; no rebalancing in this job")
            return
        while not self.stop_event.wait(self.period):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - rebalancing is best effort; the job goes on without it
                log.exception("rebalance: round failed")

    def tick(self) -> None:
        cur = self._stats(self._names())
        prev, self.prev = self.prev, cur
        loads, warm = peer_loads(prev, cur)
        if len({p.stage for p in loads}) < 2 or not warm:
            return  # not steady state (start-up: a peer had not finished 2 steps at the window's start): no decision
        move = plan_move(loads, len(self.members), self.s.rebalance_min_gain)
        if move is None:
            load = {j: [f"{p.peer}:q{p.queue:.2f}/{p.throughput:.3g}mb/s" for p in loads if p.stage == j]
                    for j in range(len(self.members))}  # fmt: skip
            log.info("rebalance: no move (answered %d of %d peers): %s", len(cur), len(self._names()), load)
            return
        self.carry_out(move, self._tokens_rate(prev, cur))

    def carry_out(self, move, before: float | None) -> None:
        s, src, dst = self.s, move.from_stage, move.to_stage
        name = str(move.peer)
        t0 = time.monotonic()
        new = min(set(range(sum(s.peers_per_stage))) - set(self.members[dst]))
        joiner = peer_name(dst, new)
        rec: dict = {"peer": name, "from": src, "to": dst, "joiner": joiner, "plan": move.describe()}
        rec["tokens_s_before"] = before
        old = [list(m) for m in self.members]
        self.members[src].remove(split_peer_name(name)[1])
        self.members[dst].append(new)
        self._set_members()  # before the leave: the moved peer reads it when it joins its new stage
        move_to = {"stage": dst, "index": new, "lighthouse": self.la.lighthouse(dst), "args": self.extra_for(dst, new)}
        log.info("%s: asking %s to leave and serve as %s", move.describe(), name, joiner)
        try:
            call(self._addr(name), "leave", {"move_to": move_to}, timeout_s=min(5.0, s.rpc_timeout_s))
        except (PeerUnavailable, RemoteError) as e:
            self.members = old
            self._set_members()
            self._record({**rec, "error": f"leave not delivered: {e}"})
            return
        p = self._proc(name)
        if p is not None:
            self.joined[joiner] = p
        # the same process serves the new stage once it has its state: bounded by a step, a sync and the join;
        # sync=diloco: by the rest of its outer phase and the target stage's next outer step (2 H steps at most)
        H = self.la.cfg.outer.sync_every if s.sync == "diloco" else 1
        deadline = time.monotonic() + H * (s.step_timeout_s + 2 * s.sync_timeout_s) + s.startup_timeout_s
        serving = False
        while not serving and time.monotonic() < deadline and (p is None or p.proc.poll() is None):
            if self.stop_event.wait(0.2):
                self._record({**rec, "error": f"the job ended before {joiner} served"})
                return
            serving = bool(self._stats([joiner]).get(joiner, {}).get("serving"))
        if not serving:
            rc = None if p is None else p.proc.poll()
            self._record({**rec, "error": f"{joiner} did not serve within the bound (process exit code {rc})"})
            return
        rec["move_s"] = time.monotonic() - t0
        # settle: the first steps after a join carry one-off costs (the stages' next quorums, the router's first
        # timings of the new peer); the after-window starts once the moved peer finished 2 steps (at most T s)
        first = self._stats([joiner]).get(joiner, {}).get("step")
        t_settle = time.monotonic() + self.period
        while first is not None and time.monotonic() < t_settle and not self.stop_event.wait(0.2):
            st = self._stats([joiner]).get(joiner)
            if st is None or int(st["step"]) >= int(first) + 2:
                break
        a = self._stats(self._names())
        t_end = time.monotonic() + self.period
        b = a
        while time.monotonic() < t_end and not self.stop_event.is_set():  # the job may end: keep the last answers
            self.stop_event.wait(min(0.5, max(0.0, t_end - time.monotonic())))
            got = self._stats([n for n in a if n.startswith("s0p")])
            if not got:
                break
            b = {**b, **got}
        after = self._tokens_rate(a, b)
        rec["tokens_s_after"] = after
        fmt = lambda x: "n/a" if x is None else f"{x:.0f}"  # noqa: E731
        line = f"{move.describe()}; {joiner} serves; measured {fmt(before)} -> {fmt(after)} tokens/s"
        log.info("%s", line)
        rec["line"] = line
        self._record(rec)
        self.prev = {}  # the next decision measures a fresh window


class RemoteControl:
    """What a ``Mover`` needs from a launcher, for a rebalancer that owns no peer process (``dilocox swarm
    rebalance``, started by ``launcher/slurm/swarm.sbatch``): the config, the run directory, the job's store and
    each stage's lighthouse address. A moved peer is the same process either way, so no process handle is needed
    (``procs`` is empty: the wait for the moved peer is bounded by time alone)."""

    def __init__(self, cfg, out_dir: str, store_addr: str, lighthouses: dict[int, str]) -> None:
        self.cfg, self.out_dir, self.store_addr, self.lighthouses = cfg, out_dir, store_addr, dict(lighthouses)
        self.procs: list = []

    def lighthouse(self, stage: int) -> str | None:
        return self.lighthouses.get(stage)

    def control_store(self):
        from datetime import timedelta

        from dilocox.swarm.services import service_secret, store_client

        host, _, port = self.store_addr.rpartition(":")
        timeout = timedelta(seconds=self.cfg.swarm.startup_timeout_s)
        return store_client(host, int(port), service_secret(self.cfg), timeout)
