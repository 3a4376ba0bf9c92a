"""The process side of ``dilocox launch --elastic``: ``ElasticLaunch`` starts the lighthouse and one job per
replica (in network namespaces or on loopback), applies the kill/restart schedule, and stops everything.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Callable, Sequence

from dilocox.distributed.procs import (
    RUN_TAG_ENV,
    kill_and_reap,
    kill_group,
    kill_tagged,
    read_ready_line,
    spawn,
    tagged_pids,
)
from dilocox.elastic.schedule import LIGHTHOUSE, Action, LaunchError, interrupted_line, last_error, last_summary
from dilocox.elastic.standby import ACTIVATE_NAME, activate
from dilocox.launch.local_run import launch_exit_code
from dilocox.launch.netns import HUB_ADDR, Cluster

LIGHTHOUSE_PORT = 29510  # inside the switch namespace (fresh, so a fixed port is free)
LIGHTHOUSE_START_S = 60.0  # the lighthouse prints its address within this (torchft import included)
HOST_ENV = "DILOCOX_ELASTIC_HOST"  # the address a replica's torchft manager advertises (netns: its namespace's)
_ADDR_RE = re.compile(r"https?://\S+")


class _Replica:
    def __init__(self, r: int, spare: bool = False, ns: int | None = None) -> None:
        self.r = r  # the replica's slot (a spare: its standby index)
        self.spare = spare  # a warm standby (``--standby-replicas``): started idle, activated into a slot
        self.name = f"standby{r}" if spare else f"replica{r}"  # its log and run dir
        self.ns = r if ns is None else ns  # its network namespace (``Cluster`` index)
        self.serves: int | None = None if spare else r  # the slot it trains as (a spare: once activated)
        self.proc: subprocess.Popen | None = None
        self.tag = ""
        self.incarnation = -1
        self.killed = False  # by the schedule; its exit is not a failure
        self.code: int | None = None  # exit code of the current incarnation once it exited
        self.log = None


class ElasticLaunch:
    """Start the lighthouse and N replica jobs, run the schedule, and clean everything up (``run``).

    ``replica_argv(r, lighthouse_addr)``: the command of replica r. ``lighthouse_argv(bind)``: the
    lighthouse's command (default: ``python -m dilocox.cli lighthouse``); the launcher reads the address it
    prints. ``cluster``: a started ``Cluster(n, hub=True)`` to run in (None: this namespace, loopback).
    """

    def __init__(
        self,
        n: int,
        replica_argv: Callable[[int, str], list[str]],
        run_dir: str,
        *,
        min_replicas: int = 1,
        schedule: Sequence[Action] = (),
        env: dict | None = None,
        cluster: Cluster | None = None,
        lighthouse_argv: Callable[[str], list[str]] | None = None,
        lighthouse_opts: Sequence[str] = (),
        timeout_s: float = 3600.0,
        stop_timeout_s: float = 60.0,
        log: Callable[[str], None] | None = None,
        clock: Callable[[], float] | None = None,
        standby: bool = False,
        spares: int = 0,
        spare_argv: Callable[[int, str], list[str]] | None = None,
    ) -> None:
        if n < 1:
            raise LaunchError(f"--elastic {n}: the number of replicas must be >= 1")
        self.n, self.replica_argv, self.run_dir = n, replica_argv, run_dir
        self.min_replicas, self.schedule = min_replicas, sorted(schedule, key=lambda a: a.at_s)
        self.env = dict(os.environ if env is None else env)
        self.cluster, self.timeout_s, self.stop_timeout_s = cluster, timeout_s, stop_timeout_s
        self.clock = clock  # what the schedule's times are read against (None: seconds since the replicas started)
        self.lighthouse_opts = list(lighthouse_opts)
        self._lh_argv = lighthouse_argv or (
            lambda bind: [
                sys.executable,
                "-m",
                "dilocox.cli",
                "lighthouse",
                "--min-replicas",
                str(min_replicas),
                "--bind",
                bind,
                *self.lighthouse_opts,
                *self._plain_in_hub(),
            ]
        )
        self.log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        self.launch_id = uuid.uuid4().hex[:12]
        self.replicas = [_Replica(r) for r in range(n)]
        # warm standbys (dilocox/elastic/standby.py): ``spare_argv(s, addr)`` is standby s's command; a replica that
        # dies (killed or crashed) is replaced at once by an idle one (``slots[r]``: the process training as r)
        if spares and spare_argv is None:
            raise LaunchError("--standby-replicas needs the standbys' command (spare_argv)")
        self.spare_argv = spare_argv
        self.spares = [_Replica(s, spare=True, ns=n + s) for s in range(spares)]
        self.slots = list(self.replicas)
        self.lighthouse: subprocess.Popen | None = None
        self.standby_lighthouse: subprocess.Popen | None = None
        self.standby = standby
        self.lighthouse_addr = ""
        self.t0 = time.time()
        self.events_path = os.path.join(run_dir, "events.jsonl")
        self._events = None
        self._signals: list[int] = []

    # events ---------------------------------------------------------------------------
    def event(self, kind: str, **fields: object) -> dict:
        now = time.time()
        rec = {"event": kind, "wall": round(now, 3), "t": round(now - self.t0, 3), **fields}
        if self._events is not None:
            self._events.write(json.dumps(rec) + "\n")
            self._events.flush()
        return rec

    # processes ------------------------------------------------------------------------
    def _popen(self, argv: list[str], env: dict, r: int | None, **kw: object) -> subprocess.Popen:
        if self.cluster is None:
            return spawn(argv, die_with_parent=True, env=env, **kw)  # (nothing runs on after a SIGKILLed launcher)
        if r is None:
            return self.cluster.exec_hub(argv, env=env, **kw)
        return self.cluster.exec(r, argv, env=env, **kw)

    def _plain_in_hub(self) -> list[str]:
        """``--insecure`` for a plain lighthouse in the emulation's switch namespace (its address is reachable from
        this host's namespaces only, not from other hosts), which `dilocox lighthouse` would otherwise refuse."""
        plain = "--secret-file" not in self.lighthouse_opts and "--insecure" not in self.lighthouse_opts
        return ["--insecure"] if plain and self.cluster is not None else []

    def _start_lighthouse(self) -> None:
        """The lighthouse, and with ``standby`` a second one (the replicas' relays use it while the first refuses
        connections: dilocox/net/relay.py); ``lighthouse_addr`` lists both, primary first."""
        in_hub = self.cluster is not None
        self.lighthouse, addr = self._start_one_lighthouse(
            f"{HUB_ADDR}:{LIGHTHOUSE_PORT}" if in_hub else "127.0.0.1:0", "lighthouse"
        )
        addrs = [addr]
        self.event("lighthouse", address=addr, pid=self.lighthouse.pid)
        self.log(f"dilocox launch: lighthouse at {addr}")
        if self.standby:
            self.standby_lighthouse, addr = self._start_one_lighthouse(
                f"{HUB_ADDR}:{LIGHTHOUSE_PORT + 1}" if in_hub else "127.0.0.1:0", "lighthouse-standby"
            )
            addrs.append(addr)
            self.event("lighthouse", address=addr, pid=self.standby_lighthouse.pid, standby=True)
            self.log(f"dilocox launch: standby lighthouse at {addr}")
        self.lighthouse_addr = ",".join(addrs)

    def _start_one_lighthouse(self, bind: str, name: str) -> tuple[subprocess.Popen, str]:
        err = open(os.path.join(self.run_dir, f"{name}.log"), "a")
        proc = self._popen(self._lh_argv(bind), self.env, None, stdout=subprocess.PIPE, stderr=err, text=True)
        err.close()
        if name == "lighthouse":
            self.lighthouse = proc  # (stopped by _shutdown even if it never prints its address)
        else:
            self.standby_lighthouse = proc
        try:
            m = read_ready_line(proc, _ADDR_RE, LIGHTHOUSE_START_S, abort=lambda: bool(self._signals))
        except EOFError:  # its stdout closed: it exited, or closed it and runs on (no address follows)
            try:
                what = f"exited ({proc.wait(timeout=10)})"
            except subprocess.TimeoutExpired:  # (stopped by _shutdown, as any lighthouse)
                what = "closed its output (still running)"
            raise LaunchError(
                f"the {name.replace('-', ' ')} {what} before printing its address; see {self.run_dir}/{name}.log"
            ) from None
        if m is None:
            raise LaunchError(
                f"the {name.replace('-', ' ')} printed no address within {LIGHTHOUSE_START_S:.0f} s (see "
                f"{self.run_dir}/{name}.log)"
                if not self._signals
                else "interrupted while starting the lighthouse"
            )
        return proc, m.group(0)

    def _start_replica(self, rep: _Replica, kind: str) -> None:
        rep.incarnation += 1
        rep.tag = f"dilocox-elastic-{self.launch_id}-{rep.name}-{rep.incarnation}"  # (unique: kill_tagged kills it)
        env = dict(self.env, **{RUN_TAG_ENV: rep.tag})
        if self.cluster is not None:
            ifname = self.cluster.ifname(rep.ns)
            env.update(GLOO_SOCKET_IFNAME=ifname, DILOCOX_EMULATION="netns", **{HOST_ENV: self.cluster.addr(rep.ns)})
        log_path = os.path.join(self.run_dir, f"{rep.name}.log")
        if rep.log is None:
            rep.log = open(log_path, "a")
        rep.log.write(f"==== {kind} (incarnation {rep.incarnation}) at {time.time():.3f}\n")
        rep.log.flush()
        if rep.spare:
            stale = os.path.join(self.run_dir, rep.name, ACTIVATE_NAME)  # (an earlier run's activation)
            if os.path.exists(stale):
                os.remove(stale)
            argv = self.spare_argv(rep.r, self.lighthouse_addr)
        else:
            argv = self.replica_argv(rep.r, self.lighthouse_addr)
        rep.proc = self._popen(argv, env, rep.ns, stdout=rep.log, stderr=subprocess.STDOUT)
        rep.killed, rep.code = False, None
        who = {"standby": rep.r} if rep.spare else {"replica": rep.r}
        self.event(kind, **who, pid=rep.proc.pid, incarnation=rep.incarnation)

    def _activate_spare(self, r: int, why: str) -> None:
        """Slot ``r`` lost its process (``why``): the first idle live standby becomes replica r (its activation file);
        none idle: the slot stays empty until a scheduled restart."""
        if not [x for i, x in enumerate(self.slots) if i != r and x.code is None and x.proc.poll() is None]:
            return  # nobody left to heal from: as a restart then, nothing is started (the run is over)
        spare = next((x for x in self.spares if x.serves is None and x.proc is not None and x.proc.poll() is None),
                     None)  # fmt: skip
        if spare is None:
            return
        activate(os.path.join(self.run_dir, spare.name), r, tag=spare.tag)
        spare.serves, self.slots[r] = r, spare
        self.event("activate", replica=r, standby=spare.r, pid=spare.proc.pid, why=why)
        self.log(f"dilocox launch: standby {spare.r} takes replica {r}'s place ({why})")

    def _kill_replica(self, rep: _Replica, sig: int = signal.SIGKILL) -> list[int]:
        """``sig`` to the replica's process group and to every process with its tag (other sessions too)."""
        if rep.proc is None:
            return []
        kill_group(rep.proc.pid, sig)
        return kill_tagged(rep.tag, sig) if rep.tag else []

    def _reap_replica(self, rep: _Replica, timeout_s: float = 10.0) -> None:
        """Wait (bounded) until the replica's process and everything with its tag is gone (after a SIGKILL)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if rep.proc is not None and rep.proc.poll() is None:
                time.sleep(0.05)
                continue
            if not tagged_pids(rep.tag):
                return
            kill_tagged(rep.tag, signal.SIGKILL)
            time.sleep(0.05)
        self.log(f"dilocox launch: {rep.name}: processes {tagged_pids(rep.tag)} still there after SIGKILL")

    # the run --------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: object) -> None:
        self._signals.append(signum)

    def run(self) -> int:
        """Run everything; return 0 when every replica's last incarnation exited 0 (128+sig after a signal)."""
        os.makedirs(self.run_dir, exist_ok=True)
        self._events = open(self.events_path, "a")
        main = threading.current_thread() is threading.main_thread()
        prev = {}
        if main:
            prev = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.t0 = time.time()
            try:
                self._start_lighthouse()
            except LaunchError:
                if not self._signals:
                    raise
                return self._stopped_at_start()  # (Ctrl-C while the lighthouse started: a stop, not bad input)
            for rep in self.replicas:
                self._start_replica(rep, "start")
            for rep in self.spares:
                self._start_replica(rep, "standby")
            return self._loop()
        finally:
            self._shutdown()
            for sig, h in prev.items():
                signal.signal(sig, h)
            self._events.close()
            self._events = None
            for rep in self.replicas + self.spares:
                if rep.log is not None:
                    rep.log.close()

    def _stopped_at_start(self) -> int:
        sig = signal.Signals(self._signals[0])
        self.event("stop", signal=sig.name)
        self.log(f"dilocox launch: stopped by {sig.name} while the lighthouse was starting; no replica was started")
        return 128 + sig

    def _loop(self) -> int:
        t_start = time.monotonic()
        pending = list(self.schedule)
        while True:
            now = time.monotonic() - t_start
            at = now if self.clock is None else self.clock()
            if self._signals:
                sig = self._signals[0]
                self.event("stop", signal=signal.Signals(sig).name)
                live = [(r, rep) for r, rep in enumerate(self.slots) if rep.proc is not None and rep.code is None]
                self._stop_replicas(signal.SIGTERM)
                self._report_stop(signal.Signals(sig).name, live)
                return 128 + sig
            if now > self.timeout_s:
                self.event("stop", reason="timeout", timeout_s=self.timeout_s)
                self.log(f"dilocox launch: the run passed --timeout {self.timeout_s:g} s: stopping it")
                self._stop_replicas(signal.SIGTERM)
                return 124
            self._note_exits()
            while pending and pending[0].at_s <= at and not self._signals:  # (a stop: next turn, SIGTERM first)
                self._apply(pending.pop(0), now, at)
            if not [rep for rep in self.slots if rep.code is None]:
                break
            time.sleep(0.05)
        for act in pending:
            self._skip(act, "the run ended first")
        self._stop_idle_spares()
        self._report_losses()
        codes = [rep.code for rep in self.slots if not rep.killed]  # (a failed replica a standby replaced: not here)
        return launch_exit_code(codes)  # (a replica killed by a signal: 128 + N, as a shell says it)

    def _note_exits(self) -> None:
        """Record every process that exited by itself; a slot's process that failed is replaced by a standby."""
        for rep in self.replicas + self.spares:
            if rep.proc is None or rep.code is not None or (code := rep.proc.poll()) is None:
                continue
            rep.code = code
            if rep.killed:
                continue
            who = {"standby": rep.r, "serves": rep.serves} if rep.spare else {"replica": rep.r}
            self.event("exit", **who, code=code, incarnation=rep.incarnation)
            level = "finished" if code == 0 else f"exited with code {code}"
            log_path = os.path.join(self.run_dir, f"{rep.name}.log")
            label = f"standby {rep.r}" if rep.spare else f"replica {rep.r}"
            self.log(f"dilocox launch: {label} {level} (log {log_path})")
            if code != 0 and (why := last_error(log_path)):  # its own one line, not just a code
                self.log(f"dilocox launch: {rep.name}: {why}")
            if code != 0 and rep.serves is not None and self.slots[rep.serves] is rep:
                self._activate_spare(rep.serves, f"{rep.name} exited with code {code}")

    def _apply(self, act: Action, now: float, at: float) -> None:
        """One scheduled action on slot ``act.replica``: kill the process training as it (a standby then takes its
        place), or restart it (when a standby already serves it: a new standby instead, the pool refilled)."""
        r = act.replica
        if r == LIGHTHOUSE:
            self._lighthouse_action(act.kind, now, at)
            return
        rep = self.slots[r]
        if act.kind == "kill":
            if rep.code is not None:
                self._skip(act, "already exited")
                return
            rep.killed = True
            pids = self._kill_replica(rep, signal.SIGKILL)
            self._reap_replica(rep)
            rep.code = rep.proc.poll() if rep.proc.poll() is not None else -signal.SIGKILL
            self.event("kill", replica=r, pid=rep.proc.pid, tagged_pids=pids, incarnation=rep.incarnation, at=at,
                       **({"standby": rep.r} if rep.spare else {}))  # fmt: skip
            self.log(f"dilocox launch: killed replica {r} (SIGKILL) at {now:.1f} s{self._where(at)}")
            self._activate_spare(r, "killed")
            return
        if not [x for x in self.slots if x.code is None]:
            self._skip(act, "no replica left running")
            return
        if rep.code is None and rep.spare:  # a standby trains as r: refill the pool instead, in r's namespace
            spare = _Replica(len(self.spares), spare=True, ns=r)
            self.spares.append(spare)
            self._start_replica(spare, "standby")
            self.log(f"dilocox launch: replica {r} is served by standby {rep.r}: started standby {spare.r} instead "
                     f"at {now:.1f} s{self._where(at)}")  # fmt: skip
            return
        self.slots[r] = self.replicas[r]
        self._start_replica(self.replicas[r], "restart")
        self.log(f"dilocox launch: restarted replica {r} at {now:.1f} s{self._where(at)}")

    def _lighthouse_action(self, kind: str, now: float, at: float) -> None:
        """``L@T``: SIGKILL the primary lighthouse, or start it again on the same address (the replicas' relays and
        torchft's clients reconnect; they keep their last quorum meanwhile: dilocox/elastic/failover.py)."""
        if kind == "kill":
            if self.lighthouse is None or self.lighthouse.poll() is not None:
                self.event("lighthouse_kill", skipped="not running")
                return
            kill_and_reap(self.lighthouse, what="lighthouse")
            self.event("lighthouse_kill", pid=self.lighthouse.pid, at=at)
            self.log(f"dilocox launch: killed the lighthouse (SIGKILL) at {now:.1f} s{self._where(at)}")
            return
        primary = self.lighthouse_addr.split(",")[0]
        bind = primary.split("://", 1)[-1].rstrip("/")
        if self.cluster is None and bind.startswith(("localhost", socket.gethostname())):
            bind = "127.0.0.1:" + bind.rsplit(":", 1)[1]  # (torchft prints the host's name; it was bound on loopback)
        try:
            _, addr = self._start_one_lighthouse(bind, "lighthouse")
        except LaunchError:
            if not self._signals:
                raise
            return  # (a stop signal while it started: the loop stops the replicas as for any signal, SIGTERM first)
        self.event("lighthouse_restart", address=addr, pid=self.lighthouse.pid, at=at)
        self.log(f"dilocox launch: restarted the lighthouse at {now:.1f} s{self._where(at)} ({addr})")

    def _stop_idle_spares(self) -> None:
        """The run is over: standbys never activated are ended (they hold nothing)."""
        idle = [x for x in self.spares if x.serves is None and x.proc is not None and x.proc.poll() is None]
        for rep in idle:
            rep.killed = True
            kill_group(rep.proc.pid, signal.SIGTERM)
        for rep in idle:
            self._reap_replica(rep, timeout_s=self.stop_timeout_s)
            self.event("stop_standby", standby=rep.r)

    def _where(self, at: float) -> str:
        return "" if self.clock is None else f" (schedule clock {at:g})"

    def _skip(self, act: Action, why: str) -> None:
        """A scheduled kill/restart that did not happen: in events.jsonl and on the console (a user who asked for a
        restart must see that none happened, and why)."""
        self.event(act.kind, replica=act.replica, skipped=why, at_s=act.at_s)
        unit = "step" if self.clock is not None else "s"
        self.log(f"dilocox launch: --{act.kind} {act.replica}@{act.at_s:g} ({unit}) skipped: {why}")

    def _report_losses(self) -> None:
        """One line per replica: its final validation loss (the summary its last incarnation logged), or why none."""
        for r, rep in enumerate(self.slots):
            summary = None
            via = f" (standby {rep.r})" if rep.spare else ""
            if not rep.killed and rep.code == 0:  # (a summary in the file could be an earlier run's otherwise)
                summary = last_summary(os.path.join(self.run_dir, rep.name, "metrics.jsonl"))
            if summary is None or summary.get("final_val_loss") is None:
                why = "killed" if rep.killed else f"exit code {rep.code}" if rep.code else "no summary logged"
                self.log(f"dilocox launch: replica {r}{via}: no final val loss ({why})")
                continue
            self.log(
                f"dilocox launch: replica {r}{via}: final val loss {float(summary['final_val_loss']):.4f} "
                f"after {summary.get('steps')} steps (incarnation {rep.incarnation})"
            )

    def _report_stop(self, name: str, live: list) -> None:
        """On the console, as a plain launch says it: each replica that was running, where it stopped (the line its
        trainer logged: step, checkpoint), and that the same command resumes."""
        for r, rep in live:
            log_path = os.path.join(self.run_dir, f"{rep.name}.log")
            said = interrupted_line(log_path)
            via = f" (standby {rep.r})" if rep.spare else ""
            code = "none yet" if (c := rep.proc.poll()) is None else c
            self.log(f"dilocox launch: replica {r}{via}: "
                     f"{said or f'exit code {code}; its log names no checkpoint ({log_path})'}")  # fmt: skip
        self.log(f"dilocox launch: interrupted ({name}); the replicas were asked to save a checkpoint; run the same "
                 "command again to resume")  # fmt: skip

    def _stop_replicas(self, sig: int) -> None:
        """Ask (``sig``; torchrun forwards it: the ranks save and exit), wait ``stop_timeout_s``, then SIGKILL."""
        live = [rep for rep in self.replicas + self.spares if rep.proc is not None and rep.proc.poll() is None]
        for rep in live:
            kill_group(rep.proc.pid, sig)
        deadline = time.monotonic() + self.stop_timeout_s
        for rep in live:
            try:
                rep.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.log(f"dilocox launch: {rep.name} did not stop within {self.stop_timeout_s:g} s: SIGKILL")

    def _shutdown(self) -> None:
        # replicas still running here: the run ended on an error (a failed lighthouse restart, say); they are asked
        # first, as on a stop signal, so each saves its checkpoint, then SIGKILLed after stop_timeout_s
        self._stop_replicas(signal.SIGTERM)
        for rep in self.replicas + self.spares:
            if rep.proc is not None:
                self._kill_replica(rep, signal.SIGKILL)
                self._reap_replica(rep)
        for lh in (self.standby_lighthouse, self.lighthouse):
            if lh is not None and lh.poll() is None:
                kill_group(lh.pid, signal.SIGTERM)
                try:
                    lh.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    kill_and_reap(lh, what="lighthouse")
        if self.lighthouse is not None and self._events is not None:
            self.event("lighthouse_stopped", code=self.lighthouse.returncode)
