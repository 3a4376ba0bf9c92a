"""The one module that runs a codec's collectives on a process group (``compress/codec.py``'s ``Wire``).

A codec never calls ``torch.distributed``: its outer group hands it ``wire_of(pg)``. ``pg`` is any
``torch.distributed.ProcessGroup``: one of ``torch.distributed``'s own groups (``Topology.group("outer")``, gloo or
NCCL), the reconfigurable group of a torchft quorum (``elastic/group.py``) or the authenticated mesh
(``elastic/mesh.py``: a torchft ``ProcessGroup``). A group registered with ``torch.distributed`` (``registered``:
what ``wire_of`` builds for ``Topology``'s groups) goes through ``torch.distributed``'s functions, as every other
collective of the run (bounded by the group's timeout); any other group through its own methods (``allreduce``,
``allgather``, ``alltoall_base``), waiting for the work (bounded by ``timeout_s`` when given) and raising ``error``
when it did not finish or when the group reports a failed peer (``errored()``, a torchft group); so a caller that
retries a step (the elastic quorum) sees one exception type.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable

import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions, ReduceOp

from dilocox.compress.codec import SOLO, Wire

_OPS = {"sum": ReduceOp.SUM, "max": ReduceOp.MAX}


class ProcessGroupWire:
    """``Wire`` over one process group (module docstring). ``rank``: a function giving this member's rank when the
    group's own ``rank()`` does not (a torchft group reconfigured per quorum keeps it in its ``parent``)."""

    def __init__(
        self,
        pg,
        timeout_s: float | None = None,
        rank: Callable[[], int] | None = None,
        error: type[Exception] = RuntimeError,
        registered: bool = False,
    ) -> None:
        self.pg, self.error, self.registered = pg, error, registered
        self.timeout = timedelta(seconds=timeout_s) if timeout_s else None
        self._rank = rank if rank is not None else (lambda: dist.get_rank(pg)) if registered else pg.rank

    def size(self) -> int:
        return self.pg.size()

    def rank(self) -> int:
        return self._rank()

    def _wait(self, work) -> None:
        if self.timeout is None:
            work.wait()
        elif not work.wait(self.timeout):
            raise self.error(f"outer collective did not finish within {self.timeout.total_seconds():g}s")
        errored = getattr(self.pg, "errored", None)  # (torchft's groups: a peer failed while it was in flight)
        if errored is not None and (err := errored()) is not None:
            raise self.error(f"outer collective failed: {err}")

    def all_reduce(self, t: Tensor, op: str = "sum") -> None:
        if self.registered:
            dist.all_reduce(t, op=_OPS[op], group=self.pg)
            return
        opts = AllreduceOptions()
        opts.reduceOp = _OPS[op]
        self._wait(self.pg.allreduce([t], opts))

    def all_gather(self, out: list[Tensor], t: Tensor) -> None:
        if self.registered:
            dist.all_gather(out, t, group=self.pg)
            return
        self._wait(self.pg.allgather([out], [t], AllgatherOptions()))

    def all_to_all_single(self, out: Tensor, t: Tensor) -> None:
        if self.registered:
            dist.all_to_all_single(out, t, group=self.pg)
            return
        self._wait(self.pg.alltoall_base(out, t, [], [], AllToAllOptions()))


def wire_of(group) -> Wire:
    """The wire of ``group``: None (a group of one: nothing is sent), a wire already, or a process group registered
    with ``torch.distributed`` (``Topology``'s, ``dist.group.WORLD``)."""
    if group is None:
        return SOLO
    if isinstance(group, ProcessGroupWire) or not hasattr(group, "allreduce"):
        return group
    return ProcessGroupWire(group, registered=True)
