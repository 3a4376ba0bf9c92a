"""``dilocox checkpoint convert``: checkpoints of dilocox's earlier format onto ``torch.distributed.checkpoint``.

The earlier format held one ``torch.save`` file per rank of an R x D x P x T grid (``rank_00003.pt``, loaded
with ``weights_only=True``) and COMPLETE.json with each file's hash. Converting rebuilds, in one process, the
state every saved rank would save today (``names.flatten`` of its shard), joins the tensor-parallel slices of each
key into the full tensor (a DCP checkpoint may hold a key as one full chunk: any layout reads its slices from
it), keeps each rank's ``rest`` as it was (so a resume on the saved layout is exact) and writes it with
``dcp.save`` and a new COMPLETE.json. The old directory is kept beside it as ``<step dir>.pre-dcp``.

Where a saved rank's parameters and their order come from: a meta-device model of the checkpoint's config
(``StageModel``), its TP partition dims, the inner optimizer's parameter order (``optim.param_order``) and the
outer's fragments (``assign_fragments`` then, with ``outer.shard_over_data``, ``assign_owners``), as
``DiLoCoOuter`` builds them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings

import torch

from dilocox.checkpoint import names
from dilocox.checkpoint.layout import (
    HASH,
    CheckpointError,
    CorruptCheckpointError,
    _atomic_write_text,
    file_hash,
    read_meta,
    record,
)

_LAYOUT_RE = re.compile(r"^R(\d+)xD(\d+)xP(\d+)xT(\d+)$")


def parse_layout(layout: str) -> tuple[int, int, int, int]:
    m = _LAYOUT_RE.match(str(layout))
    if not m:
        raise CheckpointError(f"checkpoint layout {layout!r} is not of the form R<r>xD<d>xP<p>xT<t>")
    return tuple(int(g) for g in m.groups())  # type: ignore[return-value]


def is_legacy(step_dir: str) -> bool:
    meta = read_meta(step_dir)
    return "shards" in meta and "files" not in meta


def _load_shard(step_dir: str, rank: int, meta: dict) -> dict:
    """One saved rank's state, checked against its size and hash in COMPLETE.json."""
    path = os.path.join(step_dir, f"rank_{rank:05d}.pt")
    rec = (meta.get("shards") or {}).get(os.path.basename(path))
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint shard {path} is missing; the checkpoint is incomplete")
    algo = meta.get("hash", HASH)
    if rec is not None and (os.path.getsize(path) != rec["bytes"] or file_hash(path, algo) != rec[algo]):
        raise CorruptCheckpointError(f"checkpoint shard {path} is corrupt or truncated (size or hash differs)")
    return torch.load(path, map_location="cpu", weights_only=True)


def _rank_structure(cfg, stage: int, P: int, T: int, data: int, D: int, outer: dict | None):
    """What a saved rank held: its model tensors' TP dims, its optimizer's parameter names by index, and its
    outer's ``(names, local shapes, fragments)`` (None without per-parameter outer state)."""
    from dilocox.model.parallel_layers import is_tensor_parallel
    from dilocox.model.transformer import StageModel, param_layer_id
    from dilocox.optim import param_order
    from dilocox.outer.dp_shard import assign_owners
    from dilocox.outer.fragments import assign_fragments

    m = StageModel(cfg.model, stage, P, 0, 1, None, device="meta")  # full shapes (T=1 needs no TP group)
    dims = {n: t.partition_dim for n, t in m.state_dict(keep_vars=True).items() if is_tensor_parallel(t)}
    named = [(n, q) for n, q in m.named_parameters() if q.requires_grad]
    opt_names = [n for g in param_order([(n, q.dim() >= 2) for n, q in named], cfg.optim.name) for n in g]
    if not outer or "state" not in outer:
        return dims, opt_names, None
    shapes = []
    for n, q in named:
        s = list(q.shape)
        if n in dims:
            s[dims[n]] //= T
        shapes.append(torch.Size(s))
    pnames = [n for n, _ in named]
    frags = assign_fragments(pnames, param_layer_id, int(outer["fragments"]), cfg.outer.streaming.pattern)
    if outer.get("dp_sharded") and D > 1:
        owner = assign_owners([s.numel() for s in shapes], frags, D)
        mine = [i for i in range(len(pnames)) if owner[i] == data]
        pos = {i: k for k, i in enumerate(mine)}
        frags = [[pos[i] for i in f if owner[i] == data] for f in frags]
        pnames, shapes = [pnames[i] for i in mine], [shapes[i] for i in mine]
    return dims, opt_names, (pnames, shapes, frags)


def convert_step(step_dir: str) -> str:
    """Convert one step directory in place (the old one kept as ``<step dir>.pre-dcp``); returns the new one."""
    import torch.distributed.checkpoint as dcp

    from dilocox.config import from_dict

    meta = read_meta(step_dir)
    if not ("shards" in meta and "files" not in meta):
        raise CheckpointError(f"{step_dir} is not a checkpoint of the earlier format (nothing to convert)")
    cfg = from_dict(meta["config"])
    R, D, P, T = parse_layout(meta.get("layout", "R1xD1xP1xT1"))
    parts: dict[str, dict[int, torch.Tensor]] = {}  # key -> tp rank -> its slice
    cat_dim: dict[str, int] = {}
    flat: dict[str, torch.Tensor] = {}
    for rank in range(R * D * P * T):
        r, d, p, t = rank // (D * P * T), (rank // (P * T)) % D, (rank // T) % P, rank % T
        sd = _load_shard(step_dir, rank, meta)
        dims, opt_names, outer_layout = _rank_structure(cfg, p, P, T, d, D, sd.get("outer"))

        for k, v in names.flatten(sd, r, rank, opt_names, outer_layout).items():
            name = names.param_of(k)
            if name is None:
                flat[k] = v  # a rank's rest: its own key
            elif name in dims and v.dim() > dims[name]:
                parts.setdefault(k, {}).setdefault(t, v)  # (data-parallel copies: the first one)
                cat_dim[k] = dims[name]
            else:
                flat.setdefault(k, v)
    for k, slices in parts.items():
        if len(slices) != T:
            raise CheckpointError(f"{step_dir}: {k} has {len(slices)} of {T} tensor-parallel slices")
        flat[k] = torch.cat([slices[t] for t in range(T)], cat_dim[k])
    staged = step_dir + ".dcp-tmp"  # (a whole directory, swapped in below)
    shutil.rmtree(staged, ignore_errors=True)
    paths = []
    for r in range(R):  # one DCP checkpoint per replica, as the Trainer saves them
        mine = {k: v for k, v in flat.items() if _replica_of(k, D * P * T) == r}
        where = os.path.join(staged, f"replica{r}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(mine, storage_writer=dcp.FileSystemWriter(where, single_file_per_rank=True), no_dist=True)
        paths += [os.path.join(where, n) for n in sorted(os.listdir(where))]
    info = {k: v for k, v in meta.items() if k != "shards"}
    info.update({"format": "dcp", "hash": HASH, "files": record(paths, staged), "converted": time.time()})
    _atomic_write_text(os.path.join(staged, "COMPLETE.json"), json.dumps(info, indent=1))
    os.replace(step_dir, step_dir + ".pre-dcp")
    os.rename(staged, step_dir)
    return step_dir


def _replica_of(key: str, per_replica: int) -> int:
    """The replica a key belongs to: ``replicaR/...``, or ``rankG/...`` of a rank of replica G // per_replica."""
    head = key.split("/")[0]
    return int(head[len("replica") :]) if head.startswith("replica") else int(head[len("rank") :]) // per_replica


def finish_interrupted(path: str) -> list[str]:
    """Complete the swap of a conversion that was killed between moving the old step directory aside
    (``<step dir>.pre-dcp``) and moving the converted one in (``<step dir>.dcp-tmp``, complete): until then the step
    has no directory, and neither a resume nor ``convert`` sees it. ``path``: a checkpoint dir or one step dir.
    Returns the step directories moved into place."""
    norm = os.path.normpath(path)
    one = os.path.basename(norm).startswith("step_") and not os.path.isdir(norm)  # (a step dir, gone meanwhile)
    parent, name = (os.path.dirname(norm), os.path.basename(norm)) if one else (norm, None)
    done = []
    for n in sorted(os.listdir(parent)) if os.path.isdir(parent) else []:
        step = n[: -len(".dcp-tmp")]
        if not n.endswith(".dcp-tmp") or (name is not None and step != name):
            continue
        staged, step_dir = os.path.join(parent, n), os.path.join(parent, step)
        complete = os.path.exists(os.path.join(staged, "COMPLETE.json"))
        if complete and not os.path.exists(step_dir) and os.path.isdir(step_dir + ".pre-dcp"):
            os.rename(staged, step_dir)
            done.append(step_dir)
    return done


def convert(path: str) -> list[str]:
    """Convert every earlier-format step directory under ``path`` (a checkpoint dir, or one step dir); a conversion
    interrupted in its final swap is completed first (and counted as converted)."""
    from dilocox.checkpoint.layout import complete_steps

    resumed = finish_interrupted(path)
    steps = [path] if os.path.exists(os.path.join(path, "COMPLETE.json")) else complete_steps(path)
    if not steps:
        raise CheckpointError(f"{path}: no complete checkpoint (a step_XXXXXXXX dir with COMPLETE.json) to convert")
    return resumed + [convert_step(s) for s in steps if is_legacy(s)]
