"""Layout-independent views of a sharded checkpoint: gather full tensors, reshard on load.

A checkpoint (``dilocox.checkpoint``) holds one shard per rank of an R x D x P x T grid. Model
parameters are named by GLOBAL layer index and each TP-sharded parameter is split into T equal
contiguous slices along its ``partition_dim`` (dilocox.model.parallel_layers), so the full tensor
of any name is the concatenation of the slices of the ranks ``(replica, data, stage owning it,
tp = 0..T-1)``. The inner optimizer state is stored by parameter index in the order
``build_inner_optimizer`` lists the stage's parameters (``optim.param_order``: matrices first, then vectors;
Muon's matrices first with optim.name=muon); that order is rebuilt here from a meta-device model and the
checkpoint's ``optim.name``, so ``exp_avg``/``exp_avg_sq``/``momentum_buffer`` gather the same way.

Resuming on another layout (``Trainer._maybe_resume`` when the saved ``layout`` differs; the
number of replicas R must be the same):

- resharded exactly: model params, inner AdamW (step, exp_avg, exp_avg_sq per param), step,
  tokens seen, the data sampler (per replica: parallel.replicas must not change), the RNG
  state (rank 0's; every rank of a 1-replica run draws the same batches, and dropout with TP
  is rejected, so nothing else depends on it).
- the DiLoCo family's outer state (``resharded_outer_state``), per replica (so eager's
  per-replica θ/v too): the flat fp32 outer params θ and momentum v are cut back into one
  tensor per global parameter name on the saved layout (fragment order, and with
  ``outer.shard_over_data`` the owning data rank of each tensor), TP slices are concatenated
  like the model's, and the tensors are re-sliced and re-flattened in the new layout's
  fragment / data-rank order. The same holds for the stored result of an in-flight
  all-reduce (``pending``; a checkpoint stores the finished result), eager's own previous
  pseudo-gradient, the compressors' error-feedback buffers (per tensor) and the outer optimizer's own state
  (``outer.optimizer=muon``: Muon's momentum per matrix; TP = 1 on both layouts). Carried over
  as they are: H, the outer step count, the sync schedule (next sync step per fragment), the
  low-rank rank (per fragment: the largest rank among the saved ranks whose tensors land in
  it), and the comm counters / byte stats (stats only: those of the first saved rank read).
  Streaming fragments must hold the same tensors on both layouts (fragments are assigned per
  pipeline stage, so a change of parallel.pipeline with fragments > 1 usually moves layers to
  another fragment and is refused); parallel.tensor / parallel.data may change freely.
- RESTARTED (re-initialised as in a fresh run, and a warning names them at resume,
  ``restart_notes``): the low-rank compressor's warm-start Q (redrawn from the seed at the
  carried-over rank: a TP slice's Q has no meaning for another slicing), its tail-energy
  estimate, and the adaptive controller's history and measured times. With quant=none and no
  low-rank compression nothing restarts and the resumed run continues the uninterrupted one
  exactly (up to the fp32 rounding of the other layout's inner steps); with compression the
  quantization groups and low-rank factors follow the new slicing, so it continues closely,
  not bit for bit.
"""

from __future__ import annotations

import os
import re

import torch

from dilocox import checkpoint as ckpt
from dilocox.config import Config, ModelConfig
from dilocox.outer.dp_shard import assign_owners
from dilocox.outer.fragments import assign_fragments

_LAYOUT_RE = re.compile(r"^R(\d+)xD(\d+)xP(\d+)xT(\d+)$")


def parse_layout(layout: str) -> tuple[int, int, int, int]:
    m = _LAYOUT_RE.match(str(layout))
    if not m:
        raise ckpt.CheckpointError(f"checkpoint layout {layout!r} is not of the form R<r>xD<d>xP<p>xT<t>")
    return tuple(int(g) for g in m.groups())  # type: ignore[return-value]


def rank_of(r: int, d: int, p: int, t: int, D: int, P: int, T: int) -> int:
    """Inverse of ``distributed.topology.coord_of``."""
    return ((r * D + d) * P + p) * T + t


def stage_params(mcfg: ModelConfig, stage: int, n_stages: int) -> list[tuple[str, int | None, bool]]:
    """``(name, partition_dim or None, is_matrix)`` of a stage's parameters, in ``named_parameters`` order."""
    from dilocox.model.parallel_layers import is_tensor_parallel
    from dilocox.model.transformer import StageModel

    m = StageModel(mcfg, stage, n_stages, 0, 1, None, device="meta")
    return [(n, p.partition_dim if is_tensor_parallel(p) else None, p.dim() >= 2) for n, p in m.named_parameters()]


def optimizer_order(params: list[tuple[str, int | None, bool]], optim_name: str = "adamw") -> list[str]:
    """Parameter names by optimizer state index (``optim.param_order``: the groups of ``build_inner_optimizer``)."""
    from dilocox.optim import param_order

    return [n for g in param_order([(n, mat) for n, _, mat in params], optim_name) for n in g]


def _cat(parts: list[torch.Tensor], dim: int | None) -> torch.Tensor:
    return parts[0].clone() if dim is None else torch.cat(parts, dim)


def gather_full(
    step_dir: str,
    mcfg: ModelConfig,
    replica: int = 0,
    data: int = 0,
    stages: list[int] | None = None,
    optimizer: bool = False,
) -> dict:
    """Full tensors of a checkpoint: ``{"model": {name: tensor}, "optimizer": {name: {k: tensor}},
    "rank0": rank 0's shard (step, sampler, rng, outer, ...)}`` for one replica / data rank.
    ``stages``: only read the shards of these stages (default all)."""
    meta = ckpt.read_meta(step_dir)
    R, D, P, T = parse_layout(meta.get("layout", "R1xD1xP1xT1"))
    if replica >= R or data >= D:
        raise ckpt.CheckpointError(
            f"{step_dir} has {R} replicas x {D} data ranks; no replica {replica}, data rank {data}"
        )
    model: dict[str, torch.Tensor] = {}
    opt: dict[str, dict] = {}
    rank0 = None
    for p in range(P) if stages is None else stages:
        params = stage_params(mcfg, p, P)
        shards = [ckpt.load_checkpoint(step_dir, rank_of(replica, data, p, t, D, P, T)) for t in range(T)]
        if rank_of(replica, data, p, 0, D, P, T) == 0:
            rank0 = shards[0]
        for name, dim, _ in params:
            model[name] = _cat([s["model"][name] for s in shards], dim)
        if "head.weight" in shards[0]["model"] and "head.weight" not in model:  # tied: named_parameters dedups
            model["head.weight"] = model["embed.weight"]
        if optimizer:
            order = optimizer_order(params, (meta.get("config") or {}).get("optim", {}).get("name", "adamw"))
            dims = {n: d for n, d, _ in params}
            states = [s["optimizer"]["state"] for s in shards]
            for idx, name in enumerate(order):
                if idx not in states[0]:
                    continue
                entry = {}
                for k, v in states[0][idx].items():
                    if torch.is_tensor(v) and v.dim() > 0:
                        entry[k] = _cat([st[idx][k] for st in states], dims[name])
                    else:
                        entry[k] = v.clone() if torch.is_tensor(v) else v
                opt[name] = entry
    if rank0 is None:
        rank0 = ckpt.load_checkpoint(step_dir, 0)
    return {"model": model, "optimizer": opt, "rank0": rank0, "meta": meta}


def final_model(step_dir: str, mcfg: ModelConfig, allow_replica_params: bool = False) -> dict[str, torch.Tensor]:
    """The full model of a checkpoint for export / generation.

    Without an outer method (one replica) that is the model state. For the DiLoCo family the
    final model is the outer params θ: ``Trainer.run`` calls ``outer.finish()`` (params := θ)
    before its last save, so the final checkpoint's model state IS θ. A mid-run checkpoint's model
    state is replica 0's local params (θ plus the local steps since the last sync), which is not
    θ: refused unless ``allow_replica_params``."""
    meta = ckpt.read_meta(step_dir)
    out = gather_full(step_dir, mcfg)
    outer = out["rank0"].get("outer") or {}
    if outer and not allow_replica_params and not meta.get("final", False) and not _is_final(step_dir):
        raise ckpt.CheckpointError(
            f"{step_dir} is a mid-run checkpoint of outer.method={outer.get('method')!r}: "
            "its model state is replica 0's "
            "local params, not the outer params θ (the final model). Export the final checkpoint of the run, or pass "
            "--replica-params to export replica 0's local params anyway"
        )
    return out["model"]


def _is_final(step_dir: str) -> bool:
    """Whether this step is the run's last (``train.steps`` of the run's config.yaml)."""
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(step_dir)))
    step = int(ckpt.read_meta(step_dir).get("step", -1))
    cfg_path = os.path.join(run_dir, "config.yaml")
    if os.path.exists(cfg_path):
        from dilocox.config import load_config

        return step >= load_config(cfg_path).train.steps
    return False


def resharded_state(
    step_dir: str, cfg: Config, topo, model: torch.nn.Module, optimizer: torch.optim.Optimizer, outer=None
) -> dict:
    """This rank's ``Trainer.load_state_dict`` input from a checkpoint saved on another layout.
    ``outer``: this rank's (already built) outer object; its state is resharded too (module docstring)."""
    meta = ckpt.read_meta(step_dir)
    R, D, P, T = parse_layout(meta["layout"])
    for k in ("method", "arch"):
        want = {"method": cfg.outer.method, "arch": cfg.model.arch}[k]
        if k in meta and meta[k] != want:
            raise ckpt.CheckpointError(
                f"checkpoint {step_dir} has {k}={meta[k]!r} but this run has {k}={want!r}; "
                "resume with the same setting or start a fresh run_dir"
            )
    if R != topo.R:
        raise ckpt.CheckpointError(
            f"checkpoint {step_dir} has parallel.replicas={R}, this run {topo.R}: the data "
            "sampler and outer state are per replica; resume with the same parallel.replicas"
        )
    # which old stages hold this rank's parameters
    per_old, mine = cfg.model.n_layers // P, set(model.layer_ids)
    stages = {lid // per_old for lid in mine} | ({0} if model.is_first else set())
    stages = sorted(stages | ({P - 1} if model.is_last else set()))
    full = gather_full(step_dir, cfg.model, replica=topo.replica, data=0, stages=stages, optimizer=True)
    sd0 = full["rank0"]
    if sd0.get("outer") and outer is None:
        raise ckpt.CheckpointError(
            f"checkpoint {step_dir} (layout {meta['layout']}) holds outer state of "
            f"outer.method={meta.get('method')!r} but this run has no outer method to load it into; resume with "
            f"outer.method={meta.get('method')!r}"
        )
    sd = {k: v for k, v in sd0.items() if k not in ("model", "optimizer")}
    if topo.replica != 0:
        sd["sampler"] = ckpt.load_checkpoint(step_dir, rank_of(topo.replica, 0, 0, 0, D, P, T))["sampler"]
    sd["model"] = model.shard_full_state_dict(full["model"])
    osd = optimizer.state_dict()
    named = list(model.named_parameters())
    order = optimizer_order([(n, None, p.dim() >= 2) for n, p in named], cfg.optim.name)
    params = dict(model.named_parameters())
    from dilocox.model.parallel_layers import is_tensor_parallel, shard_tensor

    state = {}
    for idx, name in enumerate(order):
        if name not in full["optimizer"]:
            continue
        p = params[name]
        entry = {}
        for k, v in full["optimizer"][name].items():
            if torch.is_tensor(v) and v.dim() > 0 and is_tensor_parallel(p):
                v = shard_tensor(v, p.partition_dim, model.tp_rank, model.tp_size).clone()
            entry[k] = v
        state[idx] = entry
    osd["state"] = state
    sd["optimizer"] = osd
    sd["outer"] = {}
    if sd0.get("outer") and outer is not None:
        sd["outer"] = resharded_outer_state(step_dir, cfg, topo, model, outer, stages)
    return sd


# ---------------------------------------------------------------------- the DiLoCo family's outer state
def _saved_outer_order(
    mcfg: ModelConfig, stage: int, P: int, T: int, data: int, D: int, K: int, pattern: str, dp_sharded: bool
) -> tuple[list[tuple[str, torch.Size, int | None]], list]:
    """What ``DiLoCoOuter`` of a saved rank (data, stage, any tp) held: its ``(name, local shape, partition_dim)``
    list in the outer's order and its fragments (indices into that list), rebuilt from a meta-device model
    exactly as ``DiLoCoOuter.__init__`` builds them (``assign_fragments``, then ``assign_owners``)."""
    from dilocox.model.parallel_layers import is_tensor_parallel
    from dilocox.model.transformer import StageModel, param_layer_id

    m = StageModel(mcfg, stage, P, 0, 1, None, device="meta")  # full shapes (T=1 needs no TP group)
    named = []
    for n, q in m.named_parameters():
        dim = q.partition_dim if is_tensor_parallel(q) else None
        shape = list(q.shape)
        if dim is not None:  # the rank's slice: T equal contiguous parts (parallel_layers.shard_tensor)
            shape[dim] //= T
        named.append((n, torch.Size(shape), dim))
    frags = assign_fragments([n for n, _, _ in named], param_layer_id, K, pattern)
    if dp_sharded and D > 1:
        owner = assign_owners([s.numel() for _, s, _ in named], frags, D)
        mine = [i for i in range(len(named)) if owner[i] == data]
        pos = {i: k for k, i in enumerate(mine)}
        frags = [[pos[i] for i in f if owner[i] == data] for f in frags]
        named = [named[i] for i in mine]
    return named, frags


def _outer_by_name(o: dict, named: list, frags: list, where: str) -> dict:
    """One saved rank's outer entry cut into per-name tensors (its local TP slices); ``optimizer``: the outer
    optimizer's own state per name (Muon's momentum; keyed by position in the fragments' order when saved)."""
    theta, mom = o["state"]["theta"], o["state"]["momentum"]
    extra = (o["state"].get("optimizer") or {}).get("state") or {}
    extra = {int(k): v for k, v in extra.items()}
    kinds = ("theta", "momentum", "pending", "own_prev", "errors", "frag", "rank", "dim", "optimizer")
    out: dict = {k: {} for k in kinds}
    need = sum(named[i][1].numel() for frag in frags for i in frag)
    if need != theta.numel():
        raise ckpt.CheckpointError(
            f"outer state of {where} has {theta.numel()} elements, but its layout's parameters "
            f"need {need}: the checkpoint was written for a different model or outer settings; "
            "resume it on its own layout with its own config"
        )
    pos = 0
    for f, frag in enumerate(frags):
        start = pos
        comp = o["compressors"][f]
        errs = comp.get("errors") or {}
        for k, i in enumerate(frag):
            name, shape, dim = named[i]
            n = shape.numel()
            out["frag"][name], out["rank"][name], out["dim"][name] = f, int(comp.get("rank", 0)), dim
            out["theta"][name] = theta[pos : pos + n].view(shape)
            out["momentum"][name] = mom[pos : pos + n].view(shape)
            if o["pending"][f] is not None:
                out["pending"][name] = o["pending"][f][k]
            if o["own_prev"][f] is not None:
                out["own_prev"][name] = o["own_prev"][f][pos - start : pos - start + n].view(shape)
            if errs:
                out["errors"][name] = errs[str(k)]
            if extra.get(len(out["theta"]) - 1):
                out["optimizer"][name] = extra[len(out["theta"]) - 1]
            pos += n
    return out


def _gather_saved_outer(step_dir: str, cfg: Config, topo, stages: list[int], layout: tuple, pattern: str):
    """Read the outer entries of the saved ranks holding this rank's parameters (this replica, every stage of
    ``stages``, every TP rank, and every data rank when the outer state was sharded over data). Returns
    ``(ref, full)``: the first entry read (its carried-over fields) and kind -> name -> {tp rank: its slice}."""
    R, D, P, T = layout
    ref = None
    full: dict = {}  # kind -> name -> {tp rank: its slice} (theta, momentum, pending, own_prev, errors, ...)
    for p in stages:
        for t in range(T):
            for d in range(D):
                rank = rank_of(topo.replica, d, p, t, D, P, T)
                o = ckpt.load_checkpoint(step_dir, rank)["outer"]
                if ref is None:
                    ref = o
                    if o.get("method") != cfg.outer.method or "state" not in o:
                        raise ckpt.CheckpointError(
                            f"checkpoint {step_dir} holds outer state of outer.method={o.get('method')!r}, "
                            f"this run has {cfg.outer.method!r}; resume with the same outer.method"
                        )
                sharded = bool(o.get("dp_sharded", False))
                named, frags = _saved_outer_order(cfg.model, p, P, T, d, D, int(o["fragments"]), pattern, sharded)
                part = _outer_by_name(o, named, frags, f"{step_dir} rank {rank}")
                for kind, per in part.items():
                    for name, v in per.items():
                        slots = full.setdefault(kind, {}).setdefault(name, {})
                        slots.setdefault((t, d) if kind == "rank" else t, v)  # rank: max over all, below
                if not sharded:
                    break  # the D data ranks hold the same outer state
    if ref is None:
        raise ckpt.CheckpointError(f"checkpoint {step_dir}: no saved rank holds this rank's parameters")
    return ref, full


def _gathered_outer(full: dict, step_dir: str, T: int, kind: str, name: str) -> torch.Tensor | None:
    """The full tensor of ``name``'s saved ``kind`` (its TP slices concatenated), or None if none was saved."""
    slots = full.get(kind, {}).get(name)
    if not slots:
        return None
    dim = full["dim"][name][0]
    if dim is None:
        return slots[0]
    if len(slots) != T:
        raise ckpt.CheckpointError(f"checkpoint {step_dir}: {kind} of {name} has {len(slots)} of {T} TP slices")
    return torch.cat([slots[t] for t in range(T)], dim)


def _local_outer(
    full: dict, step_dir: str, T: int, model: torch.nn.Module, outer, kind: str, i: int
) -> torch.Tensor | None:
    """This rank's slice of the outer's ``i``-th parameter's saved ``kind`` (fp32 copy), or None."""
    from dilocox.model.parallel_layers import is_tensor_parallel, shard_tensor

    name, prm = outer.names[i], outer.params[i]
    v = _gathered_outer(full, step_dir, T, kind, name)
    if v is None:
        return None
    if is_tensor_parallel(prm):
        v = shard_tensor(v, prm.partition_dim, model.tp_rank, model.tp_size)
    if v.shape != prm.shape:
        raise ckpt.CheckpointError(
            f"checkpoint {step_dir}: outer {kind} of {name} has shape {tuple(v.shape)} on "
            f"this layout, the parameter {tuple(prm.shape)}"
        )
    return v.detach().float().clone()


def _check_fragment_of(full: dict, step_dir: str, layout_str: str, P: int, name: str, f: int) -> None:
    """Refuse a parameter that has no saved outer state, or that moved to another streaming fragment."""
    if name not in full.get("theta", {}):
        raise ckpt.CheckpointError(
            f"checkpoint {step_dir} holds no outer state for parameter {name}; it was written for another model"
        )
    old_f = full["frag"][name][min(full["frag"][name])]
    if old_f != f:
        raise ckpt.CheckpointError(
            f"checkpoint {step_dir} (layout {layout_str}): {name} was in streaming fragment {old_f}, on "
            f"this layout it is in fragment {f} (fragments are assigned per pipeline stage), so its sync "
            f"schedule would change; resume with parallel.pipeline={P} (parallel.tensor/data may change)"
        )


def _relayout_outer(full: dict, step_dir: str, layout_str: str, P: int, T: int, model: torch.nn.Module, outer):
    """The gathered outer state re-sliced and re-flattened in this layout's fragment order: ``(theta, momentum,
    pending, own_prev, compressors)`` as ``DiLoCoOuter.load_state_dict`` takes them."""

    def local(kind: str, i: int) -> torch.Tensor | None:
        return _local_outer(full, step_dir, T, model, outer, kind, i)

    st = outer.state
    theta = torch.zeros(st.numel, dtype=torch.float32)
    mom = torch.zeros(st.numel, dtype=torch.float32)
    pending, own_prev, comps = [], [], []
    extra = {}  # the outer optimizer's own state by position in this layout's fragment order (TP = 1: whole tensors)
    for g, i in enumerate(i for frag in st.fragments for i in frag):
        saved = full.get("optimizer", {}).get(outer.names[i])
        if saved:
            got = {n: v.detach().clone() if torch.is_tensor(v) else v for n, v in saved[0].items()}
            bad = [n for n, v in got.items() if torch.is_tensor(v) and v.shape != outer.params[i].shape]
            if T != 1 or bad:
                raise ckpt.CheckpointError(
                    f"checkpoint {step_dir}: the outer optimizer's state of {outer.names[i]} does not fit this "
                    "layout (outer.optimizer=muon needs parallel.tensor=1 on both layouts)"
                )
            extra[str(g)] = got
    for f, frag in enumerate(st.fragments):
        for i in frag:
            _check_fragment_of(full, step_dir, layout_str, P, outer.names[i], f)
            st.view(theta, i).copy_(local("theta", i))
            st.view(mom, i).copy_(local("momentum", i))
        pend = [local("pending", i) for i in frag]
        if any(x is None for x in pend) and not all(x is None for x in pend):
            raise ckpt.CheckpointError(
                f"checkpoint {step_dir}: fragment {f} has an in-flight result for some of "
                "its tensors only; the checkpoint is inconsistent"
            )
        pending.append(pend if frag and pend[0] is not None else None)
        own = [local("own_prev", i) for i in frag]
        own_prev.append(torch.cat([x.reshape(-1) for x in own]) if frag and all(x is not None for x in own) else None)
        errs = [local("errors", i) for i in frag]
        ranks = [max(full["rank"][outer.names[i]].values()) for i in frag]
        comps.append(
            {
                "rank": max(ranks, default=0),
                "errors": {str(k): e for k, e in enumerate(errs)} if frag and all(e is not None for e in errs) else {},
            }
        )
    return theta, mom, pending, own_prev, comps, ({"state": extra} if extra else None)


def resharded_outer_state(step_dir: str, cfg: Config, topo, model: torch.nn.Module, outer, stages: list[int]) -> dict:
    """``outer.load_state_dict`` input for this rank from a DiLoCo-family checkpoint of another layout
    (module docstring: what is resharded, carried over and restarted). ``stages``: the saved stages
    holding this rank's parameters."""
    meta = ckpt.read_meta(step_dir)
    layout = parse_layout(meta["layout"])
    R, D, P, T = layout
    saved_cfg = (meta.get("config") or {}).get("outer") or {}
    pattern = (saved_cfg.get("streaming") or {}).get("pattern", cfg.outer.streaming.pattern)
    ref, full = _gather_saved_outer(step_dir, cfg, topo, stages, layout, pattern)
    theta, mom, pending, own_prev, comps, extra = _relayout_outer(full, step_dir, meta["layout"], P, T, model, outer)
    return {
        "version": ref.get("version", 1),
        "method": ref["method"],
        "H": ref["H"],
        "outer_step": ref["outer_step"],
        "overlap": ref["overlap"],
        "fragments": ref["fragments"],
        "dp_sharded": outer.dp_shard is not None,
        "state": {"theta": theta, "momentum": mom, **({"optimizer": extra} if extra else {})},
        "pending": pending,
        "pending_comm_s": list(ref.get("pending_comm_s", [0.0] * len(pending))),
        "own_prev": own_prev,
        "schedule": ref["schedule"],
        "controller": None,  # restarted (module docstring)
        "compressors": comps,
        "counters": dict(ref["counters"]),
        "comm_stats": dict(ref["comm_stats"]),
    }


def restart_notes(cfg: Config) -> list[str]:
    """What a resharded resume of ``cfg`` re-initialises instead of resharding (logged as warnings)."""
    from dilocox.outer.diloco import METHODS as FAMILY

    if cfg.outer.method not in FAMILY:
        return []
    c, notes = cfg.compress, []
    if c.lowrank.enabled:
        notes.append(
            "the low-rank compressor's warm-start Q (redrawn from the seed at the saved rank) and its "
            "tail-energy estimate"
        )
    if c.adaptive.enabled:
        notes.append("the adaptive controller's rank history and measured comm/step times (H and the rank carry over)")
    return notes
