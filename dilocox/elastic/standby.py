"""Warm standby replicas (issue 45): a replica's job that is started before it is needed.

A restarted replica spent most of its rejoin in process start-up (interpreter, torch import, model, data and
optimizer built, the ranks' rendezvous: 20-30 s of ``bench elastic``'s 32.5 s on the loaded 2-core machine), not in
the join itself. A standby (``outer.elastic.standby: true``; ``dilocox launch --elastic N CONFIG --standby-replicas
S`` starts S of them) does all of that at the start of the run, then waits: no torchft manager yet (a heartbeating
replica that asks for no quorum would make the lighthouse wait ``join_timeout`` for it at every quorum), nothing
sent. When a replica dies the launcher writes ``activate.json`` into the standby's ``log.run_dir`` (atomically)
naming the dead replica's ``replica_rank``; the standby takes that identity (its data shard: a new sampler; the dead
replica's heartbeats have stopped, so the lighthouse drops it) and joins the live run at once, healed inside the
next quorum through the outer loop's membership component like any joiner (``outer/membership.py``).

Every wait is bounded: a standby that is not activated within ``outer.elastic.standby_timeout_s`` ends (exit 0,
``StandbyNotNeeded``); a signal ends it at once (the trainer's handlers are not installed yet: the default action).
"""

from __future__ import annotations

import json
import os
import time

from dilocox.distributed.procs import RUN_TAG_ENV
from dilocox.fsutil import atomic_write_text

ACTIVATE_NAME = "activate.json"
POLL_S = 0.05


class StandbyNotNeeded(Exception):
    """A standby's bounded wait ended without an activation (the run did not need it)."""


def activate(run_dir: str, replica_rank: int, tag: str | None = None) -> str:
    """Tell the standby whose ``log.run_dir`` is ``run_dir`` to become replica ``replica_rank`` (atomic write).
    ``tag``: the standby job's ``DILOCOX_RUN_TAG`` (the launcher's): it then takes the file whenever it was written,
    even before the job reached its wait; without one, only a file written after the job started counts."""
    path = os.path.join(run_dir, ACTIVATE_NAME)
    rec = {"replica_rank": int(replica_rank), "wall": time.time(), **({"tag": tag} if tag else {})}
    atomic_write_text(path, json.dumps(rec) + "\n")
    return path


def read_activation(path: str, max_replicas: int) -> dict | None:
    """The activation in ``path`` (``{"replica_rank": r, "wall": epoch seconds}``), None while there is none; a file
    that is not one (or names a rank outside [0, max_replicas)) is a ValueError naming it."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        rec = json.loads(text)
        r = rec["replica_rank"]
        ok = isinstance(r, int) and not isinstance(r, bool) and 0 <= r < max_replicas
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ValueError(
            f'{path} is not a standby activation ({text[:80]!r}): it must be {{"replica_rank": R}} with R in '
            f"[0, outer.elastic.max_replicas={max_replicas}) (written by `dilocox launch --elastic --standby-replicas`)"
        )
    return {"replica_rank": r, "wall": float(rec.get("wall", time.time())), "tag": rec.get("tag")}


def _ours(act: dict | None, since: float, tag: str | None) -> bool:
    if act is None:
        return False
    if act["tag"] is not None:  # the launcher's: for this very job (an earlier run's job had another tag)
        return act["tag"] == tag
    return act["wall"] >= since  # by hand: written after this job started (an older one is an earlier run's)


def await_activation(run_dir: str, max_replicas: int, timeout_s: float, since: float) -> dict:
    """Wait (bounded by ``timeout_s``) for this job's activation in ``run_dir`` (``_ours``: the launcher's names this
    job's ``DILOCOX_RUN_TAG``; one written by hand must be newer than ``since``, epoch seconds); ``StandbyNotNeeded``
    past the bound."""
    path = os.path.join(run_dir, ACTIVATE_NAME)
    deadline = time.monotonic() + timeout_s
    tag = os.environ.get(RUN_TAG_ENV) or None
    while not _ours(act := read_activation(path, max_replicas), since, tag):
        if time.monotonic() > deadline:
            raise StandbyNotNeeded(
                f"standby: no activation in {path} within outer.elastic.standby_timeout_s={timeout_s:g}s; the run did "
                "not need this replica (exit 0)"
            )
        time.sleep(POLL_S)
    return act
