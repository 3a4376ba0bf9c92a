"""The rank grid: replicas x inner-DP x pipeline stages x tensor-parallel ranks.

Rank order (fastest-varying last): ``rank = ((r * D + d) * P + p) * T + t``. Tensor-parallel
ranks are adjacent (they share the fastest links: one node), a replica is a contiguous block
of ``D*P*T`` ranks (one cluster), and replicas are outermost (joined by the slow links).

Groups (all created explicitly, passed around, never read from globals):

- ``tp``        the T ranks of one (r, d, p): tensor-parallel collectives
- ``pp``        the P ranks of one (r, d, t): pipeline send/recv
- ``dp``        the D ranks of one (r, p, t): inner data-parallel gradient all-reduce
- ``mp``        the P*T ranks of one (r, d): model-parallel group (global grad norm, loss)
- ``outer``     the R ranks of one (d, p, t): they own the same shard in every replica;
                the pseudo-gradient all-reduce of DiLoCo runs here
- ``replica``   the D*P*T ranks of one replica

The env derivation accepts torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT) and plain SLURM's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dilocox.config import ConfigError, ParallelConfig


@dataclass(frozen=True)
class Coord:
    replica: int
    data: int
    stage: int
    tp: int


def group_world(group) -> int:
    """Number of ranks in a process group; ``None`` (what ``Topology.group`` gives for a size-1 kind) is one rank."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This process's rank in ``group``; 0 for ``None`` (a one-rank group)."""
    return 0 if group is None else dist.get_rank(group)


def rank_of(c: Coord, R: int, D: int, P: int, T: int) -> int:
    return ((c.replica * D + c.data) * P + c.stage) * T + c.tp


def coord_of(rank: int, R: int, D: int, P: int, T: int) -> Coord:
    t = rank % T
    p = (rank // T) % P
    d = (rank // (T * P)) % D
    r = rank // (T * P * D)
    return Coord(r, d, p, t)


def group_ranks(kind: str, R: int, D: int, P: int, T: int) -> list[list[int]]:
    """All rank lists of one group kind, in a deterministic order (every rank creates all)."""
    dims = {"replica": R, "data": D, "stage": P, "tp": T}
    varying = {
        "tp": ("tp",),
        "pp": ("stage",),
        "dp": ("data",),
        "mp": ("stage", "tp"),
        "outer": ("replica",),
        "replica": ("data", "stage", "tp"),
        "world": ("replica", "data", "stage", "tp"),
    }[kind]
    fixed = [k for k in ("replica", "data", "stage", "tp") if k not in varying]
    out: list[list[int]] = []

    def rec(keys: list[str], acc: dict[str, int], into: list[dict[str, int]]) -> None:
        if not keys:
            into.append(dict(acc))
            return
        for i in range(dims[keys[0]]):
            acc[keys[0]] = i
            rec(keys[1:], acc, into)

    fixed_vals: list[dict[str, int]] = []
    rec(fixed, {}, fixed_vals)
    for fv in fixed_vals:
        members: list[dict[str, int]] = []
        rec(list(varying), dict(fv), members)
        out.append(sorted(rank_of(Coord(**m), R, D, P, T) for m in members))
    return out


@dataclass
class Topology:
    """This rank's place in the grid and its process groups (None when world size is 1)."""

    rank: int
    world_size: int
    R: int
    D: int
    P: int
    T: int
    coord: Coord
    groups: dict[str, Any] = field(default_factory=dict)
    ranks: dict[str, list[int]] = field(default_factory=dict)

    # convenient views -------------------------------------------------------
    @property
    def replica(self) -> int:
        return self.coord.replica

    @property
    def stage(self) -> int:
        return self.coord.stage

    @property
    def tp_rank(self) -> int:
        return self.coord.tp

    @property
    def dp_rank(self) -> int:
        return self.coord.data

    @property
    def is_first_stage(self) -> bool:
        return self.coord.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coord.stage == self.P - 1

    def group(self, kind: str) -> Any:
        return self.groups.get(kind)

    def stage_rank(self, stage: int) -> int:
        """Global rank of the given stage in this rank's pipeline (same r, d, t)."""
        c = self.coord
        return rank_of(Coord(c.replica, c.data, stage, c.tp), self.R, self.D, self.P, self.T)

    def describe(self) -> str:
        c = self.coord
        return (
            f"rank {self.rank}/{self.world_size} = replica {c.replica}, dp {c.data}, stage {c.stage}, tp {c.tp} "
            f"(grid R{self.R}xD{self.D}xP{self.P}xT{self.T})"
        )


def env_rank_world() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun or plain SLURM variables; (0, 1, 0) if none.

    A value that is not a whole number, a world size below 1 or a rank outside [0, world size) is a ConfigError
    naming the variable (it was a ValueError traceback, or an init that waited for ranks that do not exist), and so
    is RANK without WORLD_SIZE or the reverse (a leftover RANK=3 ran as the single rank 0)."""
    env = os.environ
    if ("RANK" in env) != ("WORLD_SIZE" in env):
        have, lack = ("RANK", "WORLD_SIZE") if "RANK" in env else ("WORLD_SIZE", "RANK")
        raise ConfigError(
            f"{have}={env[have]} is set in the environment but {lack} is not (torchrun and srun set both): launch the "
            f"ranks with `dilocox train CONFIG --nproc N` or torchrun, or unset {have} for one process"
        )
    for rank_key, world_key, local_key in (
        ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
        ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ):
        if rank_key in env and world_key in env:
            rank, world, local = (_env_int(k, d) for k, d in ((rank_key, None), (world_key, None), (local_key, "0")))
            if world < 1 or not 0 <= rank < world or local < 0:
                raise ConfigError(
                    f"{rank_key}={rank} {world_key}={world} {local_key}={local} from the environment: want "
                    f"{world_key} >= 1 and 0 <= {rank_key} < {world_key} (launch the ranks with `dilocox train CONFIG "
                    f"--nproc N`, torchrun or srun, or unset {rank_key} and {world_key} for one process)"
                )
            return rank, world, local
    return 0, 1, 0


def _env_int(key: str, default: str | None) -> int:
    raw = os.environ.get(key, default)
    try:
        return int(raw or "")
    except ValueError:
        raise ConfigError(f"{key}={raw!r} in the environment is not a whole number (a rank or world size)") from None


def slurm_master_addr(nodelist: str) -> str:
    """First host of a SLURM nodelist, as ``scontrol show hostnames | head -1`` would print.

    Handles ``gpu[01-04,07],cpu3``, ``rack[1-2]-node[01-02]`` and ``n[1-2]x``: the first item
    at bracket depth 0, with every bracket group replaced by the start of its first range.
    """
    depth, first = 0, []
    for ch in nodelist:
        if ch == "," and depth == 0:
            break
        depth += ch == "["
        depth -= ch == "]"
        first.append(ch)
    item, out, i = "".join(first), [], 0
    while i < len(item):
        if item[i] == "[":
            j = item.index("]", i)
            out.append(item[i + 1 : j].split(",")[0].split("-")[0])
            i = j + 1
        else:
            out.append(item[i])
            i += 1
    return "".join(out)


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> tuple[int, int, int]:
    """Initialise the default process group from the environment (no-op for one process)."""
    rank, world, local = env_rank_world()
    if world == 1 or dist.is_initialized():
        return rank, world, local
    env = os.environ
    if "MASTER_ADDR" not in env and "SLURM_NODELIST" in env:
        env["MASTER_ADDR"] = slurm_master_addr(env["SLURM_NODELIST"])
    if "MASTER_ADDR" not in env:
        raise ConfigError(
            f"WORLD_SIZE={world} and RANK={rank} are set but MASTER_ADDR is not: launch the ranks with `dilocox train "
            f"CONFIG --nproc {world}`, torchrun or srun (which set it), or unset RANK and WORLD_SIZE for one process"
        )
    env.setdefault("MASTER_PORT", "29500")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world, local


def build_topology(
    pc: ParallelConfig,
    rank: int | None = None,
    world_size: int | None = None,
    backend: str | None = None,
    outer_timeout_s: float | None = None,
) -> Topology:
    """Create every process group of the grid. Must be called by all ranks (collective).

    Groups inside a replica get ``pc.timeout_s``; the ``outer`` group (it crosses the slow links)
    gets ``outer_timeout_s`` (``outer.timeout_s``), so a collective on a dead link fails in time."""
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    R, D, P, T = pc.replicas, pc.data, pc.pipeline, pc.tensor
    if R * D * P * T != world_size:
        raise ConfigError(
            f"parallel layout replicas*data*pipeline*tensor = {R}*{D}*{P}*{T} = {R * D * P * T} "
            f"does not match the world size {world_size}; launch {R * D * P * T} ranks "
            f"(dilocox train CONFIG --nproc {R * D * P * T}) or change parallel.*"
        )
    topo = Topology(rank, world_size, R, D, P, T, coord_of(rank, R, D, P, T))
    for kind in ("tp", "pp", "dp", "mp", "outer", "replica"):
        for ranks in group_ranks(kind, R, D, P, T):
            g = None
            if world_size > 1 and dist.is_initialized():
                # new_group is collective over the whole world: every rank creates every group.
                # Always a fresh communicator (even when it spans the world), so the outer
                # group's background thread never shares one with the main thread.
                t_s = outer_timeout_s if kind == "outer" and outer_timeout_s else getattr(pc, "timeout_s", None)
                g = dist.new_group(ranks, backend=backend, timeout=datetime.timedelta(seconds=t_s) if t_s else None)
            if rank in ranks:
                topo.groups[kind] = g if len(ranks) > 1 else None
                topo.ranks[kind] = ranks
    return topo


def default_group_device() -> torch.device:
    """Where a tensor for a collective of the default group lives: this rank's GPU with NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _encode_text(text: str, limit: int) -> torch.Tensor:
    raw = text.encode()
    if len(raw) > limit:
        raise ValueError(f"{text[:40]!r}...: {len(raw)} bytes, more than the {limit} a rank may send")
    buf = torch.zeros(limit + 4, dtype=torch.uint8)
    data = len(raw).to_bytes(4, "little") + raw  # (a length, then the bytes; the rest stays zero)
    buf[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    return buf.to(default_group_device())


def _decode_text(buf: torch.Tensor, limit: int) -> str:
    raw = bytes(buf.cpu().tolist())
    n = int.from_bytes(raw[:4], "little")
    if n > limit:  # (a rank of this run sends at most `limit`: anything else is not one of them)
        raise ValueError(f"a rank sent a text of {n} bytes, more than {limit}")
    return raw[4 : 4 + n].decode("utf-8", errors="strict")


def all_gather_text(text: str, limit: int = 256) -> list[str]:
    """Every rank's ``text`` (at most ``limit`` UTF-8 bytes) over the default group, as fixed-size byte tensors: what
    ``all_gather_object`` does without pickling what the other ranks sent (nothing from the network is unpickled)."""
    mine = _encode_text(text, limit)
    bufs = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(bufs, mine)
    return [_decode_text(b, limit) for b in bufs]


def broadcast_text(text: str | None, src: int = 0, limit: int = 2048) -> str:
    """``src``'s ``text`` on every rank of the default group (the others pass None): ``broadcast_object_list``
    without pickling."""
    buf = _encode_text(text or "", limit)
    dist.broadcast(buf, src=src)
    return _decode_text(buf, limit)
