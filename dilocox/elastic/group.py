"""Elastic outer group on torchft: one flat all-reduce per outer step over the replicas alive now.

Each replica (one process per replica in this slice) owns a torchft ``Manager`` whose
``ProcessGroupGloo`` is reconfigured by the ``Lighthouse`` quorum at every outer step. One call
of ``ElasticOuterGroup.allreduce_mean(flat)``:

1. asks for a quorum of live replicas (bounded by ``quorum_timeout_s``; the lighthouse forms it
   when every replica that still heartbeats has joined, so a ``kill -9``'d replica is dropped
   once its heartbeat expires);
2. all-reduces ONE flat buffer ``[flat | one-hot(replica_rank)]`` with SUM (bounded by
   ``timeout_s``). The one-hot tail counts the contributors from the data itself: a replica
   that torchft marks as not participating (healing / behind the max step) has its buffer
   zeroed, so it adds nothing to the sum and is not counted;
3. asks the replica's manager to commit; on a failed all-reduce (a peer died while it was in
   flight) nothing is returned half-done: the step is retried from the caller's untouched
   input with a fresh quorum, at most ``max_attempts`` times, within one overall deadline;
4. returns the sum divided by the number of contributors (the renormalised mean), which is
   bit-identical on every contributor (gloo returns the same reduced bytes to every rank).

Below ``min_replicas`` live contributors the survivors keep re-forming the quorum until the
deadline (``quorum_timeout_s``), then raise ``ElasticMinReplicasError`` naming the count, the
wait and the fix. Nothing waits forever.

torchft is imported lazily (on first construction) so that ``import dilocox`` works without it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import torch
from torch import Tensor

from dilocox.config.sections import ElasticSection
from dilocox.distributed.wire import ProcessGroupWire
from dilocox.elastic.failover import (
    DEFAULT_ATTEMPT_S,
    LighthouseFailover,
    LighthouseUnreachable,
    QuorumTimeout,
    ReplicaAgreement,
    lighthouse_endpoints,
    lighthouse_listening,
)
from dilocox.elastic.stores import ManagerGuard, advertise_store, quorum_pg, replica_store
from dilocox.elastic.torchft import manager_classes, quorum_id
from dilocox.net.relay import LighthouseRelay, unguarded
from dilocox.net.transfer import StateTransport

log = logging.getLogger("dilocox.elastic")


class _OneLineTorchftErrors(logging.Filter):
    """torchft's manager logs a failed collective with ``logger.exception`` (message + traceback) before it reports
    the error to the caller; the message already names the error and dilocox logs its own line for the retry or the
    stop, so the traceback is dropped: a replica's stderr stays one line per event (docs/RELIABILITY.md)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


logging.getLogger("torchft.manager").addFilter(_OneLineTorchftErrors())


class ElasticError(RuntimeError):
    """Base class of the elastic outer group's errors."""

    raise_as_is = True  # CommHandle.wait re-raises it unwrapped: the message names the setting and the fix


class ElasticMinReplicasError(ElasticError):
    """Fewer than ``min_replicas`` live replicas for longer than the configured wait."""


class ElasticStepError(ElasticError):
    """The outer all-reduce failed ``max_attempts`` times in a row (or ran past its deadline)."""


class ElasticBehindError(ElasticError):
    """This replica is behind the live replicas' outer step (a late joiner): it needs the live join of issue 10."""


_SECTION = ElasticSection()


@dataclass
class ElasticConfig:
    """Settings of one replica's elastic outer group (validated by ``validate``).

    lighthouse_addr: ``http://host:port`` of the torchft lighthouse (a primary and its standbys: comma-separated).
    replica_rank: this replica's index in ``[0, max_replicas)``; stable across restarts.
    min_replicas: fewest contributors an outer step may be averaged over.
    initial_replicas: replicas the FIRST outer step waits for (bounded by ``quorum_timeout_s``; then it goes on
        with at least ``min_replicas``); None means ``min_replicas``. A replica that misses the first step is
        behind for good in this slice (no live join yet) and stops with ``ElasticBehindError``.
    max_replicas: size of the one-hot contributor tail (upper bound on the number of replicas).
    timeout_s: bound on one all-reduce / commit (torchft Manager and gloo timeout).
    quorum_timeout_s: bound on forming a quorum, and on waiting below ``min_replicas``.
    max_attempts: retries of one outer step after a failed all-reduce.
    heartbeat_ms: how often the replica's manager heartbeats the lighthouse.
    lighthouse_auth: the lighthouse(s) sit behind a ``LighthouseGuard``: connect through a relay that proves ``secret``.
    host: address this replica advertises and binds its store and its state server to (loopback by default).
    secret: the run secret (``security.secret_file``): a joiner's state transfer is authenticated both ways
        (``net/transfer.py``); None: unauthenticated (still nothing unpickled, every length bounded).
    encrypt: the state transfer (and the authenticated collectives) are also encrypted (``security.encrypt``).
    collectives: the quorum's process group: ``gloo`` (torchft's), ``authenticated`` (``elastic/mesh.py``) or ``auto``
        (authenticated with ``lighthouse_auth``, else gloo).
    """

    lighthouse_addr: str
    replica_rank: int
    # the defaults are the config section's (``outer.elastic``, one source: ``ElasticSection``)
    min_replicas: int = _SECTION.min_replicas
    initial_replicas: int | None = _SECTION.initial_replicas
    max_replicas: int = _SECTION.max_replicas
    timeout_s: float = _SECTION.timeout_s
    quorum_timeout_s: float = _SECTION.quorum_timeout_s
    max_attempts: int = _SECTION.max_attempts
    heartbeat_ms: int = _SECTION.heartbeat_ms
    lighthouse_auth: bool | None = _SECTION.lighthouse_auth  # None: with the secret (the run authenticates)
    host: str = "127.0.0.1"
    secret: bytes | None = field(default=None, repr=False)
    encrypt: bool = False
    collectives: str = _SECTION.collectives

    def validate(self) -> None:
        def bad(name: str, fix: str) -> ValueError:
            return ValueError(f"elastic.{name}={getattr(self, name)!r} is invalid: {fix}")

        if self.lighthouse_auth is None:  # (secure by default: issue 42)
            self.lighthouse_auth = self.secret is not None

        if not isinstance(self.lighthouse_addr, str) or not all(
            a.strip().startswith(("http://", "https://")) for a in self.lighthouse_addr.split(",")
        ):
            raise bad("lighthouse_addr", "give the lighthouse address as http://host:port (standbys after commas)")
        lighthouse_endpoints(self.lighthouse_addr)  # (a port too: nothing is started for a bad one)
        if not (isinstance(self.max_replicas, int) and self.max_replicas >= 1):
            raise bad("max_replicas", "use an integer >= 1")
        if not (isinstance(self.replica_rank, int) and 0 <= self.replica_rank < self.max_replicas):
            raise bad("replica_rank", f"use an integer in [0, max_replicas={self.max_replicas})")
        if not (isinstance(self.min_replicas, int) and 1 <= self.min_replicas <= self.max_replicas):
            raise bad("min_replicas", f"use an integer in [1, max_replicas={self.max_replicas}]")
        ini = self.initial_replicas
        if ini is not None and not (isinstance(ini, int) and self.min_replicas <= ini <= self.max_replicas):
            raise bad(
                "initial_replicas",
                f"use null or an integer in [min_replicas={self.min_replicas}, max_replicas={self.max_replicas}]",
            )
        for name in ("timeout_s", "quorum_timeout_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0):
                raise bad(name, "use a positive number of seconds")
        if not (isinstance(self.max_attempts, int) and self.max_attempts >= 1):
            raise bad("max_attempts", "use an integer >= 1")
        if not (isinstance(self.heartbeat_ms, int) and self.heartbeat_ms >= 1):
            raise bad("heartbeat_ms", "use an integer >= 1 (milliseconds)")
        if self.lighthouse_auth and not self.secret:
            raise bad("lighthouse_auth", "needs the run secret (security.authenticate=true, security.secret_file)")
        if self.collectives not in ("auto", "gloo", "authenticated"):
            raise bad("collectives", "use auto, gloo or authenticated (elastic/mesh.py)")
        if self.collectives == "authenticated" and not self.lighthouse_auth:
            raise bad("collectives", "authenticated needs lighthouse_auth=true (the run secret)")


@dataclass
class ElasticResult:
    """One committed outer step: the renormalised mean and who contributed to it."""

    mean: Tensor
    contributors: list[int]
    quorum_id: int
    step: int
    attempts: int
    quorum_s: float
    allreduce_s: float
    healed: bool = False  # this replica received a live replica's state in this step (it did not contribute)
    world: int = 0  # members of the quorum's process group (contributors + healing/behind replicas)


class ElasticOuterGroup:
    """Per-outer-step quorum + one flat mean all-reduce over the live replicas (module docstring).

    One object per rank of a replica: ``group_rank``/``group_world`` are the rank's index and the number
    of ranks in its replica (its shard: stage x TP x DP position). torchft forms ONE quorum per replica
    (rank 0 of the replica hosts the ``ManagerServer``; the others reach it through the replica's
    ``store``) and connects rank i of every live replica into rank i's outer process group, so the
    outer groups of all the shards of a replica always have the same members, and ``should_commit``
    is voted by all the ranks of a replica: an outer step is applied by all its shards or by none.

    Live join: with ``set_state_fns(state_fn, load_fn)`` the quorum may heal this replica: a replica
    behind the newest outer step receives, shard by shard (rank i from rank i of a live replica),
    what ``state_fn`` of that replica returns, through ``load_fn`` (called on the calling thread,
    before the all-reduce). A healed replica contributes nothing to that step's average (its
    buffer is zero and not counted), but receives the average like everyone else.
    """

    def __init__(
        self,
        cfg: ElasticConfig,
        group_rank: int = 0,
        group_world: int = 1,
        store: tuple[str, int] | None = None,
        advertise: tuple[str, int] | None = None,
    ) -> None:
        cfg.validate()
        try:  # lazy: torchft is an optional dependency of the elastic mode only
            Manager, ProcessGroupGloo = manager_classes()
        except ImportError as e:
            raise ElasticError(f"the elastic outer group needs torchft 0.2: {e}") from e
        from torch.distributed import TCPStore

        self.cfg = cfg
        self._own_store, self.store_guard = None, None
        guarded = cfg.secret if cfg.lighthouse_auth else None  # the replicas' stores behind guards too (stores.py)
        if store is None:  # a replica of one process: its own store
            if group_world != 1:
                raise ValueError("ElasticOuterGroup: a replica of several ranks needs the replica's store (host, port)")
            self._own_store, store, advertise, self.store_guard = replica_store(
                cfg.host, guarded, timedelta(seconds=cfg.timeout_s)
            )
        self.group_rank, self.group_world = group_rank, group_world
        self._state_fn: Callable[[], dict] | None = None
        self._healed = False
        self._pg = self.transport = self.relay = self.manager_guard = None
        try:  # every server started here is closed again when a later part fails (its port would stay bound)
            self._pg = quorum_pg(ProcessGroupGloo, guarded, cfg.timeout_s, cfg.collectives, cfg.host, cfg.encrypt)
            self.transport = StateTransport(
                cfg.host, cfg.timeout_s, cfg.secret, name=f"heal-r{cfg.replica_rank}", encrypt=cfg.encrypt
            )
            self.relay = self._lighthouse_relay()
            # (rank 0 runs the ManagerServer: behind a guard with lighthouse_auth)
            self._manager = self._guarded_manager(Manager, store, guarded, advertise if group_rank == 0 else None)
            self.failover = self._new_failover(TCPStore, store)
        except BaseException:
            if self.transport is not None:
                self.transport.shutdown()
            self._close_guards()
            self._own_store = None  # (its listening socket goes with it)
            raise
        # the codecs' collectives on the quorum's group (distributed/wire.py): bounded by timeout_s, a failed peer
        # raises ElasticStepError (the caller retries the outer step); the rank is the reconfigured group's
        self.group = ProcessGroupWire(
            self._pg, cfg.timeout_s, rank=lambda: self._pg.parent.rank(), error=ElasticStepError
        )
        self.closed = False
        # called with the number of live replicas once a quorum is formed, before the all-reduce (tests, logging)
        self.on_quorum: Callable[[int], None] | None = None

    def _lighthouse_relay(self) -> LighthouseRelay | None:
        """The local relay the Manager talks to the lighthouse through: for a primary and its standbys
        (http://a:p,http://b:q, it forwards to the first one that listens: dilocox/net/relay.py; docs/ELASTIC.md "A
        standby lighthouse") or for a guarded lighthouse (it proves the secret); None for one plain lighthouse."""
        cfg = self.cfg
        endpoints = lighthouse_endpoints(cfg.lighthouse_addr)
        auth = cfg.secret if cfg.lighthouse_auth else None  # the lighthouse(s) behind a guard: prove the secret
        if auth is not None:  # a replica that authenticates refuses a plain lighthouse, in one line (issue 42)
            why = unguarded(endpoints, auth)
            if why is not None:
                raise ElasticError(
                    f"outer.elastic.lighthouse {why}; this replica authenticates (outer.elastic.lighthouse_auth "
                    "follows security.authenticate): start the lighthouse with `dilocox lighthouse --secret-file "
                    "RUN_SECRET`, or set outer.elastic.lighthouse_auth=false on every replica (a closed network only)"
                )
        return LighthouseRelay(endpoints, secret=auth, service="lighthouse") if len(endpoints) > 1 or auth else None

    def _guarded_manager(self, manager_cls, store: tuple[str, int], guarded: bytes | None, advertise):
        """The Manager, its server behind a ``ManagerGuard`` with ``guarded`` (rank 0 serves). The guard found the
        port free on 127.0.0.1, but torchft binds it a moment later: a process that took it meanwhile makes torchft
        fail to bind ("Address already in use"; nothing is served on a port another holds), and the guard is then
        made again on another port (at most 5 times; a fixed TORCHFT_MANAGER_PORT is not moved)."""
        serve = self.group_rank == 0
        for attempt in range(5):
            self.manager_guard = ManagerGuard(self.cfg.host, guarded, serve=serve) if guarded else None
            bind = getattr(self.manager_guard, "bind", None)
            try:
                with advertise_store(advertise, bind):
                    return self._new_manager(manager_cls, store)
            except RuntimeError as e:
                taken = "address already in use" in str(e).lower() and getattr(self.manager_guard, "guard", None)
                if not taken or os.environ.get("TORCHFT_MANAGER_PORT") or attempt == 4:
                    raise
                log.warning("replica %d: %s was taken before torchft bound it; another port", self.cfg.replica_rank,
                            bind)  # fmt: skip
                self.manager_guard.close()
        raise AssertionError("unreachable")

    def _new_manager(self, manager_cls, store: tuple[str, int]):
        """This rank's torchft ``Manager`` on the replica's store (``store``), healing through ``self.transport``."""
        cfg = self.cfg
        return manager_cls(
            pg=self._pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=cfg.min_replicas,
            use_async_quorum=False,
            timeout=timedelta(seconds=cfg.timeout_s),
            quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
            connect_timeout=timedelta(seconds=cfg.timeout_s),
            rank=self.group_rank,
            world_size=self.group_world,
            store_addr=store[0],
            store_port=store[1],
            lighthouse_addr=cfg.lighthouse_addr if self.relay is None else self.relay.address,
            replica_id=f"replica{cfg.replica_rank}",
            hostname=cfg.host,
            heartbeat_interval=timedelta(milliseconds=cfg.heartbeat_ms),
            init_sync=False,
            # a joiner's state: our own transport (torchft's HTTPTransport unpickles what it gets, serves anyone)
            checkpoint_transport=self.transport,
        )

    def _new_failover(self, store_cls, store: tuple[str, int]) -> LighthouseFailover:
        """The lighthouse is not a single point of failure (issue 10 §6b, dilocox/elastic/failover.py): quorum
        requests in short attempts, a restarted lighthouse is used at once, and meanwhile the replica keeps its
        last quorum (a replica of several ranks decides that once for all its ranks, through its own store)."""
        cfg, group_rank, group_world = self.cfg, self.group_rank, self.group_world
        agreement = None
        if group_world > 1:
            self._agree_store = store_cls(
                store[0], store[1], is_master=False, wait_for_workers=False, timeout=timedelta(seconds=cfg.timeout_s)
            )
            agreement = ReplicaAgreement(self._agree_store, group_rank)
        return LighthouseFailover(
            self._manager,
            cfg.lighthouse_addr,
            max_outage_s=cfg.quorum_timeout_s,
            attempt_s=DEFAULT_ATTEMPT_S if group_world == 1 else cfg.quorum_timeout_s,
            agreement=agreement,
        )

    def set_state_fns(
        self, state_fn: Callable[[], dict], load_fn: Callable[[dict], None], max_state_bytes: int | None = None
    ) -> None:
        """What a live replica sends a joiner (``state_fn``, called on the sender's quorum thread) and how a
        joiner takes it (``load_fn``). Every replica of a run must set them (torchft heals only then).
        ``max_state_bytes``: the most tensor bytes a received state may carry (from the caller's model; checked
        before anything is allocated for it)."""
        self._state_fn = state_fn
        if max_state_bytes is not None:
            self.transport.set_max_state_bytes(max_state_bytes)

        def _load(sd: dict) -> None:
            self._healed = True
            load_fn(sd)

        self._manager.register_state_dict_fn("dilocox", _load, state_fn)

    @property
    def step(self) -> int:
        """Committed outer steps (torchft's step counter)."""
        return self._manager.current_step()

    def _quorum(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ElasticMinReplicasError(self._below_msg(None))
        c = self.cfg
        try:  # dilocox/elastic/failover.py: waits (bounded) for a restarted lighthouse or keeps the last quorum
            q = self.failover.quorum(deadline, allow_heal=self._state_fn is not None)
        except LighthouseUnreachable as e:
            raise ElasticMinReplicasError(
                f"replica {c.replica_rank}: no quorum within elastic.quorum_timeout_s={c.quorum_timeout_s}s: {e}; "
                f"restart the lighthouse on the same address (live replicas reconnect by themselves) or raise "
                f"quorum_timeout_s"
            ) from e
        except QuorumTimeout as e:
            raise ElasticMinReplicasError(self._below_msg(None) + f" ({e})") from e
        except Exception as e:
            raise ElasticStepError(f"replica {c.replica_rank}: quorum failed: {e}") from e
        if (err := self._manager.errored()) is not None and self._healed is False and self._state_fn is not None:
            log.warning("replica %d: quorum/heal reported %s", self.cfg.replica_rank, err.original_exception)
        return q.seconds

    def _below_msg(self, n: int | None) -> str:
        c = self.cfg
        if n is None:
            return (
                f"replica {c.replica_rank}: no quorum within elastic.quorum_timeout_s={c.quorum_timeout_s}s: fewer "
                f"than elastic.min_replicas={c.min_replicas} live replicas joined, or the lighthouse at "
                f"{c.lighthouse_addr} is unreachable; restart the lost replicas or the lighthouse, lower "
                f"min_replicas, or raise quorum_timeout_s"
            )
        return (
            f"replica {c.replica_rank}: only {n} live replica(s) (elastic.min_replicas={c.min_replicas}) "
            f"joined the outer step within elastic.quorum_timeout_s={c.quorum_timeout_s}s; restart the lost "
            f"replicas, lower min_replicas, or raise quorum_timeout_s"
        )

    def allreduce_mean(self, flat: Tensor) -> ElasticResult:
        """Mean of ``flat`` (1-D, floating) over the replicas contributing to this outer step (one flat all-reduce).

        ``flat`` is not modified. Raises ``ElasticMinReplicasError`` below ``min_replicas`` after
        the bounded wait, ``ElasticStepError`` after ``max_attempts`` failed all-reduces.
        """
        if flat.dim() != 1 or not torch.is_floating_point(flat):
            raise ValueError(f"allreduce_mean takes a 1-D floating tensor, got shape {tuple(flat.shape)} {flat.dtype}")
        res = self.run_step(lambda contribute: self.flat_sum(flat, contribute))
        if res.mean is not None and res.contributors:
            res.mean.div_(len(res.contributors))
        return res

    def flat_sum(self, flat: Tensor, contribute: bool) -> tuple[Tensor, Tensor]:
        """ONE all-reduce of ``[flat | one-hot(replica_rank) | lighthouse seen]`` (zeros when not contributing);
        (sum, counts). The last slot: on a step run on a kept quorum (lighthouse down), 1 when this replica's probe
        just before it found the lighthouse listening again; the sum tells every replica of the kept quorum the same
        thing, so they all leave the kept quorum at the same next step (``LighthouseFailover.peers_saw_up``)."""
        from torch.distributed import ReduceOp

        n_el, c = flat.numel(), self.cfg
        kept = self.failover.on_kept_quorum
        buf = torch.zeros(n_el + c.max_replicas + 1, dtype=flat.dtype, device=flat.device)
        if contribute:
            buf[:n_el].copy_(flat)
            buf[n_el + c.replica_rank] = 1
        if kept and lighthouse_listening(c.lighthouse_addr, timeout_s=0.2):
            buf[-1] = 1
        work = self._manager.allreduce(buf, reduce_op=ReduceOp.SUM)
        try:
            work.wait(timedelta(seconds=c.timeout_s))
        except Exception as e:  # torchft normally records errors in the manager instead of raising
            self._manager.report_error(e)
        if kept:
            self.failover.peers_saw_up = bool(buf[-1].item() > 0)
        return buf[:n_el], buf[n_el : n_el + c.max_replicas]

    def _run_body(
        self, body: Callable[[bool], tuple[Tensor | None, Tensor]], contribute: bool
    ) -> tuple[Tensor | None, Tensor | None, float]:
        """``body(contribute)`` -> (sum or None, one-hot counts or None, seconds); a failure is reported to the
        manager (the replica then votes no on the commit) instead of raised."""
        t0 = time.monotonic()
        total, onehot = None, None
        try:
            total, onehot = body(contribute)
        except Exception as e:  # a peer died inside a compressed collective: vote no, retry
            self._manager.report_error(e)
        return total, onehot, time.monotonic() - t0

    def _committed(
        self,
        total: Tensor | None,
        onehot: Tensor,
        contribute: bool,
        healed: bool,
        attempts: int,
        quorum_s: float,
        allreduce_s: float,
    ) -> ElasticResult:
        """The result of a committed outer step, once its contributors are checked (``run_step``)."""
        c = self.cfg
        contributors = [int(i) for i in torch.nonzero(onehot).flatten().tolist()]
        if any(float(onehot[i]) != 1.0 for i in contributors):
            raise ElasticStepError(
                f"replica {c.replica_rank}: two live replicas share a replica_rank "
                f"(contributor counts {onehot[contributors].tolist()}); give each its own"
            )
        if contribute and not healed and c.replica_rank not in contributors:
            raise ElasticBehindError(
                f"replica {c.replica_rank} is behind the live replicas (its outer step "
                f"{self._manager.current_step() - 1} is not the newest; contributors were {contributors}) "
                f"and no state transfer is set up: joining a running job needs the live join "
                f"(ElasticOuterGroup.set_state_fns; `dilocox train` with outer.elastic sets it up)"
            )
        world = self.group.size()
        if contributors and max(len(contributors), world) < c.min_replicas:
            # too few members took part. A member healed in this step (a restarted replica) is live and
            # contributes from the next step on: it counts, or min_replicas = N would stop a job of N
            # replicas at the step that brings the N-th back
            raise ElasticMinReplicasError(self._below_msg(len(contributors)))
        return ElasticResult(
            mean=total,
            contributors=contributors,
            quorum_id=quorum_id(self._manager),
            step=self._manager.current_step(),
            attempts=attempts,
            quorum_s=quorum_s,
            allreduce_s=allreduce_s,
            healed=healed,
            world=world,
        )

    def run_step(self, body: Callable[[bool], tuple[Tensor | None, Tensor]], contribute: bool = True) -> ElasticResult:
        """One outer step: quorum (healing this replica if it is behind), ``body(contribute)`` -> (sum or None,
        one-hot counts), the replica-wide commit vote; retried on a new quorum when it fails (``body`` must then
        start again from its untouched inputs). Returns the SUM (``mean`` field, not yet divided) and contributors.
        """
        if self.closed:
            raise ElasticError("an outer step on a closed ElasticOuterGroup")
        c = self.cfg
        want = max(c.min_replicas, c.initial_replicas or 0) if self._manager.current_step() == 0 else c.min_replicas
        wait_since: float | None = None
        last_err: str = ""
        t_start = time.monotonic()
        deadline = t_start + c.quorum_timeout_s + c.max_attempts * c.timeout_s
        attempts = 0
        healed = False
        while attempts < c.max_attempts:
            quorum_deadline = min(deadline, (wait_since or time.monotonic()) + c.quorum_timeout_s)
            self._healed = False
            quorum_s = self._quorum(quorum_deadline)
            healed = healed or self._healed
            n_live = self._manager.num_participants()
            if n_live < want:
                now = time.monotonic()
                wait_since = wait_since or now
                if now - wait_since < c.quorum_timeout_s:
                    log.warning(
                        "replica %d: %d live replica(s) < %d wanted (min_replicas=%d); waiting (bounded, "
                        "%.0fs left) for a join",
                        c.replica_rank,
                        n_live,
                        want,
                        c.min_replicas,
                        c.quorum_timeout_s - (now - wait_since),
                    )
                    time.sleep(min(0.2, c.quorum_timeout_s / 10))
                    continue
                if n_live < c.min_replicas:
                    raise ElasticMinReplicasError(self._below_msg(n_live))
                log.warning(
                    "replica %d: going on with %d live replicas (initial_replicas=%s did not all join within %ss)",
                    c.replica_rank,
                    n_live,
                    c.initial_replicas,
                    c.quorum_timeout_s,
                )
                want = c.min_replicas
            if self.on_quorum is not None:
                self.on_quorum(n_live)
            attempts += 1
            # a healed replica trained its phase from a stale θ: it takes the average, adds nothing (§6a)
            total, onehot, allreduce_s = self._run_body(body, contribute and not healed)
            err = self._manager.errored()
            committed = self._manager.should_commit(timedelta(seconds=c.timeout_s))
            if committed and err is None and onehot is not None:
                return self._committed(total, onehot, contribute, healed, attempts, quorum_s, allreduce_s)
            last_err = str(err.original_exception if err is not None else "should_commit returned False")
            log.warning(
                "replica %d: outer all-reduce attempt %d failed (%s); retrying with a new quorum",
                c.replica_rank,
                attempts,
                last_err.splitlines()[0] if last_err else "",
            )
            if time.monotonic() >= deadline:
                break
        raise ElasticStepError(
            f"replica {c.replica_rank}: the outer all-reduce failed {attempts} time(s) within "
            f"{time.monotonic() - t_start:.1f}s (elastic.max_attempts={c.max_attempts}, "
            f"elastic.timeout_s={c.timeout_s}); last error: {last_err.splitlines()[0][:300]}"
        )

    def close(self) -> None:
        """Shut the manager down (no wait on peers beyond the configured timeouts)."""
        if not self.closed:
            self.closed = True
            self._manager.shutdown(wait=False)
            self._close_guards()

    def _close_guards(self) -> None:
        for obj in (self.relay, self.store_guard, self.manager_guard):
            if obj is not None:
                obj.close()
        if hasattr(self._pg, "close_relays"):
            self._pg.close_relays()
