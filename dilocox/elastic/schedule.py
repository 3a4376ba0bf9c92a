"""The kill/restart schedule of ``dilocox launch --elastic``: ``R@X`` specs, and the step clock they can run on.

Also ``LaunchError``, the one-line error of bad elastic-launch input (shared by the launcher modules).
"""

from __future__ import annotations

import glob
import json
import os
import re
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from dilocox.elastic.standby import ACTIVATE_NAME


class LaunchError(Exception):
    """Bad elastic-launch input or a start-up failure: printed as one line."""


LIGHTHOUSE = -1  # ``Action.replica`` of the lighthouse (``L@SECONDS``)


@dataclass(frozen=True)
class Action:
    """``kill`` or ``restart`` replica ``replica`` (``LIGHTHOUSE``: the primary lighthouse) at ``at_s`` seconds after
    the replicas were started."""

    kind: str
    replica: int
    at_s: float


def parse_schedule(kills: Sequence[str], restarts: Sequence[str], n: int) -> list[Action]:
    """``R@SECONDS`` specs -> actions sorted by time (R = ``L``: the lighthouse, restarted on its address). A restart
    needs an earlier kill of the same replica; a replica is not killed twice without a restart in between."""
    acts = []
    for kind, specs in (("kill", kills), ("restart", restarts)):
        for spec in specs:
            r, sep, t = str(spec).partition("@")
            try:
                if not sep:
                    raise ValueError
                is_lh = r.strip().upper() == "L"
                rr, tt = LIGHTHOUSE if is_lh else int(r), float(t)
            except ValueError:
                raise LaunchError(
                    f"--{kind} {spec!r} is not R@SECONDS (e.g. --{kind} 2@40; L@40: the lighthouse)"
                ) from None
            if not (0 <= rr < n or is_lh):  # (-1 is LIGHTHOUSE's number inside, not a name for it)
                raise LaunchError(f"--{kind} {spec!r}: replica {rr} is not in [0, {n}) (--elastic {n})")
            if not (tt >= 0 and tt < float("inf")):
                raise LaunchError(f"--{kind} {spec!r}: the time must be a finite number of seconds >= 0")
            acts.append(Action(kind, rr, tt))
    acts.sort(key=lambda a: (a.at_s, a.kind != "kill"))
    alive = dict.fromkeys([LIGHTHOUSE, *range(n)], True)
    for a in acts:
        who = "L" if a.replica == LIGHTHOUSE else a.replica
        what = "the lighthouse" if a.replica == LIGHTHOUSE else f"replica {a.replica}"
        if a.kind == "kill" and not alive[a.replica]:
            raise LaunchError(f"--kill {who}@{a.at_s:g}: {what} is already killed then")
        if a.kind == "restart" and alive[a.replica]:
            raise LaunchError(
                f"--restart {who}@{a.at_s:g}: {what} is running then; restart needs an earlier --kill {who}@SECONDS"
            )
        alive[a.replica] = a.kind == "restart"
    return acts


# --------------------------------------------------------------------------- the step clock


def _tail_lines(path: str, nbytes: int) -> list[str] | None:
    """The lines of the last ``nbytes`` of a file (the first may be cut by the seek); None when it is missing."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - nbytes))
            return f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None


def _tail_records(metrics_path: str, nbytes: int):
    """The JSON objects of the last ``nbytes`` of a ``metrics.jsonl``, newest first (a line cut by the seek or by a
    kill is skipped); nothing when the file is missing."""
    for line in reversed(_tail_lines(metrics_path, nbytes) or []):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            yield rec


def last_step(metrics_path: str) -> int:
    """The last ``step`` logged in a ``metrics.jsonl`` (0 if none yet); reads only the file's tail."""
    return next((int(rec["step"]) for rec in _tail_records(metrics_path, 8192) if "step" in rec), 0)


def last_summary(metrics_path: str) -> dict | None:
    """The ``summary`` record a run logged last in ``metrics.jsonl`` (None if there is none yet)."""
    return next((r["summary"] for r in _tail_records(metrics_path, 65536) if isinstance(r.get("summary"), dict)), None)


# the one-line errors `dilocox train` prints (cli.py: ``<label>[ (rank R)]: <message>``; a timed-out wait:
# ``[rank R] error: ...``)
_ERROR_LINE = re.compile(
    r"^(?:(?:config|data|export|checkpoint) error|training stopped|elastic run stopped)(?: \(rank \d+\))?: .*"
    r"|^\[rank \d+\] error: .*"
)


# the line a replica's trainer logs when a stop signal ended it (distributed/signals.py: ``Interrupted``), after the
# logger's own prefix
_INTERRUPTED = re.compile(r"interrupted by SIG\w+ at step \d+; .*")


def last_error(log_path: str, nbytes: int = 65536, pattern: re.Pattern = _ERROR_LINE) -> str | None:
    """The last one-line error of the replica's latest incarnation in its log (the part after the launcher's last
    ``==== `` marker line), or None; ``pattern``: another kind of line (what it matches: the part after a logger's
    prefix)."""
    lines = _tail_lines(log_path, nbytes)
    if lines is None:
        return None
    start = max((i for i, line in enumerate(lines) if line.startswith("==== ")), default=-1)
    hits = [m.group(0).strip() for line in lines[start + 1 :] if (m := pattern.search(line))]
    return hits[-1][:400] if hits else None


def interrupted_line(log_path: str) -> str | None:
    """What the replica's latest incarnation said when a stop signal ended it (the step, its checkpoint), or None."""
    return last_error(log_path, pattern=_INTERRUPTED)


def step_clock(run_dir: str, n: int) -> Callable[[], float]:
    """A schedule clock in training steps: the highest step any replica logged in RUN/replica<r>/metrics.jsonl, or
    a warm standby activated in this run (its ``activate.json`` newer than the clock) in RUN/standby<s>/: one that
    took a slot trains as that replica there."""
    paths = [os.path.join(run_dir, f"replica{r}", "metrics.jsonl") for r in range(n)]
    since = time.time() - 1.0  # (an earlier run's activation is older; 1 s: coarse file times)

    def active_standbys() -> list[str]:
        out = []
        for d in glob.glob(os.path.join(glob.escape(run_dir), "standby*")):
            try:
                if os.stat(os.path.join(d, ACTIVATE_NAME)).st_mtime >= since:
                    out.append(os.path.join(d, "metrics.jsonl"))
            except OSError:
                continue
        return out

    return lambda: float(max(last_step(p) for p in paths + active_standbys()))
