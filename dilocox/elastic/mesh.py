"""The authenticated mesh (``dilocox/net/mesh.py``) as the quorum's torchft process group (issue 21;
``outer.elastic.collectives: authenticated``).

``mesh_process_group`` is the torchft ``ProcessGroup`` (``Manager(pg=...)``) whose collectives run on a ``Mesh``: at
each ``configure`` (one quorum) it starts the member's next round, publishes ``address nonce`` in the quorum's store
(reached through the guarded relay of ``stores.py``), signed with the run secret, reads every member's entry (one
of a key read before, a quorum id reused, is waited on until it changes) and joins the round. The mesh itself (its
pair connections, rounds and collectives) imports nothing of torchft; this adapter takes torchft's names from
``torchft.py``.
"""

from __future__ import annotations

import time
from datetime import timedelta

from torch import Tensor

from dilocox.net.mesh import Mesh, MeshError
from dilocox.net.secure import open_value, sign_value


def publish_window(timeout_s: float) -> float:
    """How long the members of one quorum wait for each other's first key in the quorum's store (the mesh's address,
    gloo's presence): min(timeout_s, max(10 s, timeout_s / 4)). They all get the lighthouse's answer at once and
    publish first thing, so a member still silent then never got it: torchft's lighthouse counts a replica's request
    that timed out on the replica's side (it clears its participants only when a quorum forms), and a quorum formed
    just after includes a replica whose answer went nowhere. The others fail this step fast and retry on a new quorum
    (the lost member is in it if it asks again) instead of waiting the whole ``timeout_s``."""
    return min(timeout_s, max(10.0, timeout_s / 4))


def await_key(store, key: str, deadline: float, who: str) -> None:
    """Wait (until ``deadline``, monotonic) for ``key`` in ``store``; ``MeshError`` naming ``who`` past it."""
    try:
        store.wait([key], timedelta(seconds=max(0.01, deadline - time.monotonic())))
    except Exception as e:  # (torch raises DistStoreError / RuntimeError "wait timeout")
        raise MeshError(
            f"{who} did not publish in the quorum's store within the publish window: it lost the lighthouse's "
            f"answer (a quorum request that timed out on its side) or died; this step is retried on a new quorum "
            f"({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
        ) from e


def _read_members(store, secret: bytes, key: str, world_size: int, seen: dict, deadline: float) -> list:
    """Every member's (address, nonce) from the quorum's store, signed for this round key; an entry this member read
    before under the same key (a quorum id reused) is waited on until it changes (MeshError past ``deadline``)."""
    members = []
    for r in range(world_size):
        k = f"dxmesh/{r}"
        await_key(store, k, deadline, f"member {r}")
        while True:
            value = open_value(secret, f"{key}|{k}", store.get(k).decode())
            if value != seen.get(k):
                break
            if time.monotonic() > deadline:
                raise MeshError(f"member {r} did not publish this round's address within the timeout")
            time.sleep(0.05)
        seen[k] = value
        addr, _, nonce = value.rpartition(" ")
        members.append((addr, nonce))
    return members


def mesh_process_group(host: str, secret: bytes, encrypt: bool, timeout_s: float, relays):
    """A torchft process group (``Manager(pg=...)``) whose collectives run on a ``Mesh``; ``relays``
    (``stores.StoreRelays``) maps the quorum's store address to a local relay that proves the secret."""
    from torch.distributed import ReduceOp

    from dilocox.elastic.torchft import process_group_parts

    ProcessGroup, create_store_client, _DummyWork = process_group_parts()

    class _Parent:  # (the quorum's wire asks the reconfigured group's rank through ``parent``, as for gloo)
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
            self._seen: dict[str, dict] = {}  # round key -> the store entries read under it

        def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, *args, **kwargs) -> None:
            nonce = self.mesh.begin()  # (the old round is over whatever happens below)
            deadline = time.monotonic() + publish_window(timeout_s)
            try:
                store = create_store_client(self.relays.local(store_addr), timedelta(seconds=timeout_s))
                k = f"dxmesh/{rank}"
                store.set(k, sign_value(secret, f"{store_addr}|{k}", f"{self.mesh.addr} {nonce}"))
                while len(self._seen) >= 64:  # (keys of rounds long gone)
                    self._seen.pop(next(iter(self._seen)))
                seen = self._seen.setdefault(store_addr, {})
                members = _read_members(store, secret, store_addr, world_size, seen, deadline)
            except Exception as e:  # (this round is over: no pair of it is adopted, the peers fail fast)
                self.mesh.fail_round(f"configure: {type(e).__name__}: {e}")
                raise
            self.mesh.join(store_addr, rank, members)

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
            b = self.mesh._broken  # (a failed collective also raised; torchft asks before it commits)
            return MeshError(b) if b is not None and b != "no round yet" else None

        def close_relays(self) -> None:
            self.relays.close()
            self.mesh.close()

        def shutdown(self) -> None:
            self.close_relays()

    return MeshProcessGroup()
