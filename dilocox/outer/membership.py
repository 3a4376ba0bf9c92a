"""Membership of the outer steps: who contributed, the live join, and the agreement on H (issue 43 item 3).

The outer loop (``DiLoCoOuter``) owns its state (θ, momentum, schedule, compressors); this component owns what is
about the OTHER replicas, over an ``OuterGroup`` (``outer/group.py``):

- ``contributors``: the replicas averaged in the last outer step (read after waiting for it);
- the live join (a group that ``heals``, docs/ELASTIC.md): the snapshot offered to a joiner at every launch
  (``offer``, main thread, right before the all-reduce: tensors by reference, the main thread does not touch them
  until it has waited for that all-reduce), the state a heal brought (``receive`` on the comm thread inside the
  all-reduce, applied by ``settle`` on the main thread after the wait), and the inner step to continue from
  (``pop_jump``);
- the H agreement (``agree_max``): a proposal rides on the next all-reduce (``carry``), the group's max is read
  after it and applied one outer step later, so it never waits on the slow link.

The loop registers three hooks with ``register``: ``snapshot(n, p) -> dict`` (its state as a joiner must get it),
``restore(sd)`` (main thread: take a received state) and ``on_receive(sd)`` (comm thread, before the codec runs:
e.g. the compressors' ranks). An owner adds its own state with ``add_extra(snapshot, load)`` (the SWARM peer hands
over its AdamW state so). Nothing here knows what θ is; nothing in the loop knows how a heal travels.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from dilocox.outer.group import OuterGroup


class Membership:
    def __init__(self, group: OuterGroup, replica_group=None) -> None:
        self.group = group
        self.replica_group = replica_group  # (this replica's ranks: the H agreement's second max, inside the replica)
        self.contributors: list[int] = list(group.contributors)
        self.healed_at: int | None = None  # the inner step of the last heal
        self.heal_frag = 0  # the fragment whose round the last heal was
        self._snap: dict | None = None
        self._healed_sd: dict | None = None
        self._jump: int | None = None
        self._hooks: tuple | None = None
        self._extra: tuple[Callable[[], object], Callable[[object], None]] | None = None
        # H agreement: this replica's proposal not yet sent, the one the in-flight all-reduce carries, and the group's
        # max of the last carried proposals not yet applied
        self._proposal: int | None = None
        self._carried: int | None = None
        self._agreed: int | None = None

    @property
    def heals(self) -> bool:
        return self.group.heals

    def register(
        self,
        snapshot: Callable[[int, int], dict],
        restore: Callable[[dict], None],
        on_receive: Callable[[dict], None],
        max_state_bytes: int,
    ) -> None:
        """The loop's hooks (module docstring); a received state is bounded by ``max_state_bytes`` (checked before
        anything is allocated for it)."""
        self._hooks = (snapshot, restore, on_receive)
        if self.group.heals:
            self.group.set_state_fns(self._state, self._receive, max_state_bytes=max_state_bytes)

    def add_extra(self, snapshot: Callable[[], object], load: Callable[[object], None]) -> None:
        """The owner's part of a snapshot: ``snapshot()`` at every offer (main thread: return copies of what the main
        thread changes while that all-reduce may still run), ``load(obj)`` with what a heal received."""
        self._extra = (snapshot, load)

    # ------------------------------------------------------------------ the launch side
    def offer(self, n: int, p: int) -> None:
        """Main thread, right before fragment ``p``'s launch at inner step ``n``: what a joiner healed by this
        all-reduce gets."""
        if not self.group.heals:
            return
        extra = self._extra[0]() if self._extra is not None else None
        self._snap = {"valid": True, "n": n, "frag": p, **self._hooks[0](n, p), "extra": extra}

    def carry(self) -> int | None:
        """The H proposal the launch now being made carries (``OuterGroup.allreduce_mean(propose=)``)."""
        self._carried, self._proposal = self._proposal, None
        return self._carried

    def _state(self) -> dict:  # (the heal's source: comm thread)
        return self._snap if self._snap is not None else {"valid": False}

    def _receive(self, sd: dict) -> None:  # (the healed replica: comm thread, inside the all-reduce)
        if not sd.get("valid", False):
            raise RuntimeError("the live replica chosen to heal this one has not launched an outer step yet")
        self._hooks[2](sd)
        self._healed_sd = sd  # the rest is applied on the main thread (settle)

    # ------------------------------------------------------------------ the wait side
    def settle(self) -> bool:
        """Main thread, after waiting for an all-reduce: who contributed, the H agreement's max, and a heal applied
        (the loop's ``restore``, then the owner's extra). True if this replica was healed."""
        self.contributors = list(self.group.contributors)
        sd, self._healed_sd = self._healed_sd, None
        if sd is None:
            if self._carried is not None:  # the max of the proposals that all-reduce carried (``agree_max``)
                self._agreed, self._carried = self.group.agreed, None
            return False
        self._hooks[1](sd)
        self.healed_at = self._jump = int(sd["n"])
        self.heal_frag = int(sd.get("frag", 0))
        self._agreed, self._carried, self._proposal = self.group.agreed, None, None  # as the live replicas'
        if self._extra is not None and sd.get("extra") is not None:
            self._extra[1](sd["extra"])
        return True

    def received_frag(self) -> int:
        """Comm thread, during a join's all-reduce after its heal: the fragment whose round it is (0 without one)."""
        return int(self._healed_sd.get("frag", 0)) if self._healed_sd is not None else 0

    def continue_at(self, n: int) -> None:
        """A heal's state is applied at inner step ``n`` (not the heal's own): the caller continues there."""
        self.healed_at = self._jump = n

    def pop_jump(self) -> int | None:
        """After a heal: the inner step the live replicas are at (the caller continues there, from θ); else None."""
        n, self._jump = self._jump, None
        return n

    def reset_join(self) -> None:
        self.heal_frag = 0

    # ------------------------------------------------------------------ H
    def agree_max(self, value: int, current: int, device) -> int:
        """The largest H proposed at the PREVIOUS outer step over the outer group, then over this replica's ranks;
        this step's proposal ``value`` goes out with the next launch and is used at the next outer step.

        H comes from measured times, which differ between ranks, but every rank must sync at the same steps: the max
        (the slowest link/step still hidden) over the outer group and then over the replica group makes all ranks of
        all replicas and stages agree. The outer-group max rides on the next pseudo-gradient all-reduce (a MAX
        before it on a fixed group, a slot per replica in the same buffer on a torchft quorum, so the max is over the
        replicas that contributed to that very step) and is read at the next outer step, after that all-reduce was
        waited for: it never waits on the slow link (a blocking tiny all-reduce here cost about two round trips per
        outer step, 0.3 s at 150 ms RTT). So a new H applies one phase later, like the all-reduce itself. The
        replica-group max (inside the replica) stays blocking. The first outer step keeps ``current`` (the same on
        every rank); a healed replica takes the max its heal step carried."""
        agreed, self._agreed = self._agreed, None
        self._proposal = int(value)
        if agreed is None:
            return current
        got = torch.tensor([agreed], dtype=torch.int64, device=device)
        if self.replica_group is not None:
            dist.all_reduce(got, op=dist.ReduceOp.MAX, group=self.replica_group)
        return int(got.item())

    def state_dict(self) -> dict:
        """The H agreement (checkpoints; in-flight all-reduces were waited for: the carried max is read here)."""
        return {
            "h_agreed": self.group.agreed if self._carried is not None else self._agreed,
            "h_proposed": self._proposal,
            # eager's 1/R after a resume: the last settled outer step's contributors, and the group's (the last call's:
            # an in-flight round the checkpoint stored as a result settles with them)
            "contributors": list(self.contributors),
            "group_contributors": list(self.group.contributors),
        }

    def load_state_dict(self, sd: dict) -> None:
        self._agreed, self._proposal, self._carried = sd.get("h_agreed"), sd.get("h_proposed"), None
        if sd.get("contributors") is not None:  # (checkpoints before 2026-12-03 hold none: the group's own then)
            self.contributors = [int(i) for i in sd["contributors"]]
        if sd.get("group_contributors") is not None:
            self.group.contributors = [int(i) for i in sd["group_contributors"]]
