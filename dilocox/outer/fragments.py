"""Streaming DiLoCo fragments (ALGORITHMS §4): which parameters sync together, and when.

Assignment. The rank's shard holds some transformer layers (its pipeline stage) plus, on the
first/last stage, parameters that belong to no layer (embedding, final norm, lm head). With
``L`` local layers sorted by global layer id and local index ``i = 0..L-1``:

- ``sequential``: layer ``i`` goes to fragment ``floor(i * K / L)`` (contiguous blocks whose
  sizes differ by at most one);
- ``strided``: layer ``i`` goes to fragment ``i mod K``.

A parameter with no layer (``layer_of(name) is None``) joins the fragment of the nearest
*preceding* layered parameter in the shard's parameter order, or of the first layered
parameter if none precedes it. For the usual order (embedding, blocks, final norm, head)
the embedding travels with the first local layer and the final norm and head with the last.

Schedule. Inner steps are counted ``n = step + 1`` (the number of finished inner steps).
Fragment ``p`` syncs at every ``n > 0`` with ``n ≡ p·H/K (mod H)``: fragment 0 at H, 2H, ...;
fragment ``p ≥ 1`` first after ``p·H/K`` steps, then every ``H``. Its all-reduce is
launched ``tau`` steps before each sync point. The schedule keeps the next sync step per
fragment, so a changed ``H`` (adaptive controller) takes effect from the next sync on:
``next = this sync + H``.
"""

from __future__ import annotations

from typing import Callable, Sequence

from dilocox.config import ConfigError, check_outer_schedule


def assign_fragments(
    names: Sequence[str], layer_of: Callable[[str], int | None], k: int, pattern: str
) -> list[list[int]]:
    """Return ``k`` lists of parameter indices (into ``names``), in parameter order."""
    if k < 1:
        raise ConfigError(f"outer.streaming.fragments={k} must be >= 1")
    if k == 1:
        return [list(range(len(names)))]
    if pattern not in ("sequential", "strided"):
        raise ConfigError(f"outer.streaming.pattern={pattern!r} is not one of ['sequential', 'strided']")
    layers = [layer_of(n) for n in names]
    local = sorted({lid for lid in layers if lid is not None})
    if len(local) < k:
        raise ConfigError(
            f"outer.streaming.fragments={k} exceeds the {len(local)} layers of this rank's shard "
            f"(layer ids {local}); use at most {len(local)} fragments"
        )
    index = {lid: i for i, lid in enumerate(local)}
    n_local = len(local)

    def frag_of_layer(lid: int) -> int:
        i = index[lid]
        return i * k // n_local if pattern == "sequential" else i % k

    first_layered = next(lid for lid in layers if lid is not None)
    frags: list[list[int]] = [[] for _ in range(k)]
    last: int | None = None
    for i, lid in enumerate(layers):
        if lid is not None:
            last = lid
        frags[frag_of_layer(last if last is not None else first_layered)].append(i)
    return frags


def uncommunicated_tail(steps: int, h: int, k: int, tau: int) -> list[int]:
    """Per fragment, the last inner steps of a ``steps``-step run that no all-reduce carries: those after the
    fragment's last launch (``tau`` steps before each of its sync points; at the sync point with overlap delayed or
    eager, tau = 0), which the final model (``DiLoCoOuter.finish``: the outer params) leaves out. All ``steps`` of a
    fragment that never launched. A fixed ``h`` (not the adaptive controller's)."""
    check_outer_schedule(h, k, tau)
    out = []
    for p in range(k):
        first = (p * h // k if p > 0 else h) - tau
        last = first + (steps - first) // h * h if steps >= first else 0
        out.append(steps - last)
    return out


def tail_warning(steps: int, h: int, k: int, tau: int) -> str | None:
    """The start-up warning of a run whose final model leaves out local steps (``uncommunicated_tail``), or None."""
    lost = uncommunicated_tail(steps, h, k, tau)
    if k == 1 and tau == 0 and lost[0]:
        return (
            f"warning: train.steps={steps} is not a multiple of outer.sync_every={h}: the last {lost[0]} local steps "
            f"are never synchronised and the final model (the outer params) leaves them out; set train.steps to a "
            f"multiple of {h}"
        )
    if any(lost):
        return (  # (with K > 1 fragments inherent to streaming: a note, not a warning)
            f"{'note' if k > 1 else 'warning'}: with outer.streaming.fragments={k}, tau={tau} the final model (the "
            f"outer params) leaves out the last {' / '.join(map(str, lost))} local steps of train.steps={steps} (per "
            "fragment): they come after the fragment's last all-reduce launch and are never synchronised"
            + (f"; set train.steps to a multiple of {h} minus {tau} to lose none" if k == 1 else "")
        )
    return None


class SyncSchedule:
    """Next sync step of every fragment, and the launch step ``tau`` before it."""

    def __init__(self, k: int, h: int, tau: int) -> None:
        check_outer_schedule(h, k, tau)
        self.k, self.tau = k, tau
        self.next_sync = [p * h // k if p > 0 else h for p in range(k)]

    def launches_at(self, n: int) -> list[int]:
        """Fragments whose all-reduce is launched after inner step count ``n``."""
        return [p for p in range(self.k) if self.next_sync[p] - self.tau == n]

    def syncs_at(self, n: int) -> list[int]:
        """Fragments whose outer step happens after inner step count ``n``."""
        return [p for p in range(self.k) if self.next_sync[p] == n]

    def at(self, n: int) -> tuple[list[int], list[int]]:
        """``(launches_at(n), syncs_at(n))`` in one call (the outer loop asks both after every inner step)."""
        return [p for p in range(self.k) if self.next_sync[p] - self.tau == n], [
            p for p in range(self.k) if self.next_sync[p] == n
        ]

    def advance(self, p: int, h: int) -> None:
        """Fragment ``p`` just synced; its next sync is ``h`` steps later."""
        if h <= self.tau:
            raise ConfigError(f"sync interval H={h} must exceed outer.streaming.tau={self.tau}")
        self.next_sync[p] += h

    def state_dict(self) -> dict:
        return {"next_sync": list(self.next_sync), "tau": self.tau}

    def load_state_dict(self, sd: dict) -> None:
        if len(sd["next_sync"]) != self.k:
            raise ValueError(
                f"checkpoint has {len(sd['next_sync'])} fragments, this run has outer.streaming.fragments={self.k}"
            )
        self.next_sync = [int(x) for x in sd["next_sync"]]
