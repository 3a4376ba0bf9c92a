"""The Trainer's state as one flat, layout-independent ``torch.distributed.checkpoint`` (DCP) state dict, and back.

Every rank contributes its part of its replica's state dict (one DCP checkpoint per replica, ``replicaR/``, saved by
the replica's ranks over their own group) whose keys name what a tensor IS, not where it lived::

    replica0/model/layers.3.attn.qkv.weight        the replica's local parameters (and buffers)
    replica0/optim/layers.3.attn.qkv.weight/exp_avg  the inner optimizer's state, by parameter name
    replica0/outer/theta/layers.3.attn.qkv.weight  the DiLoCo family's outer state by parameter name: theta,
                                                   momentum, pending (an in-flight result), own_prev (eager, replay),
                                                   errors (error feedback), opt.<k> (the outer optimizer's own
                                                   state, e.g. Muon's), frag / rank (its fragment, its low-rank rank)
    rank5/rest                                     everything else of rank 5 (step, tokens, sampler, RNG, the outer
    rank5/rest/<path>                              loop's counters and schedule ...): JSON bytes + its tensors

A tensor-parallel slice is a ``DTensor`` sharded along its ``partition_dim`` over the TP group, so DCP records
its global offset; data-parallel copies of the same key are written once (DCP dedups them). Loading builds the
same keys for the CURRENT layout (``load_targets``) and ``dcp.load`` fills them: on another pipeline/tensor/data
layout DCP reads whatever saved chunks overlap each target, so resharding is DCP's, not ours. Only the per-rank
``rest`` is layout-bound: a resume on the same layout reads its own rank's; on another layout the replica's first
rank's, and the parts with no meaning there restart (``restart_notes`` in dilocox.reshard).

No value of ours is pickled: DCP would store a non-tensor value with ``torch.save`` and load it with a full
unpickler (``torch.load`` without weights_only), so the ``rest`` is written as JSON in a uint8 tensor
(``encode``/``decode``).
(DCP's own index, ``.metadata``, is a pickle: every load checks its SHA-256 against COMPLETE.json first and reads
it with ``dilocox.checkpoint.reader``'s restricted unpickler.)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from dilocox.checkpoint.layout import CheckpointError

_TENSOR, _TUPLE, _ITEMS = "__tensor__", "__tuple__", "__items__"
OUTER_KINDS = ("theta", "momentum", "pending", "own_prev", "errors", "frag", "rank")


def key(*parts: object) -> str:
    return "/".join(str(p) for p in parts)


def param_of(k: str) -> str | None:
    """The parameter a key belongs to (``replicaR/model/NAME``, ``replicaR/optim/NAME/k``,
    ``replicaR/outer/KIND/NAME``), or None (a rank's rest)."""
    parts = k.split("/")
    if len(parts) == 3 and parts[1] == "model":
        return parts[2]
    if len(parts) == 4 and parts[1] in ("optim", "outer"):
        return parts[2] if parts[1] == "optim" else parts[3]
    return None


def opt_param_names(model: torch.nn.Module, optim_name: str) -> list[str]:
    """Parameter names by inner-optimizer index (``optim.param_order``, as ``build_inner_optimizer`` lists them)."""
    from dilocox.optim import param_order

    named = [(n, p.dim() >= 2) for n, p in model.named_parameters() if p.requires_grad]
    return [n for g in param_order(named, optim_name) for n in g]


def outer_layout(outer) -> tuple | None:
    """``(names, shapes, fragments)`` of a DiLoCo-family outer state, for :func:`flatten`; None for no outer or
    one without per-parameter state (saved whole in the rank's rest)."""
    if outer is None or not hasattr(getattr(outer, "state", None), "fragments"):
        return None
    return outer.names, [p.shape for p in outer.params], outer.state.fragments


# ---------------------------------------------------------------------------------------------- the rest (JSON)
def encode(obj: Any, prefix: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``obj`` (nested dicts/lists/tuples of scalars, strings and tensors) as JSON bytes in a uint8 tensor, with
    its tensors pulled out under ``prefix/<path>``: ``(bytes tensor, {key: tensor})``."""
    tensors: dict[str, torch.Tensor] = {}

    def enc(x: Any, path: str) -> Any:
        if torch.is_tensor(x):
            tensors[path] = x.detach().cpu()
            return {_TENSOR: path}
        if isinstance(x, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in x):
                return {k: enc(v, f"{path}/{k}") for k, v in x.items()}
            return {_ITEMS: [[enc(k, f"{path}/k{i}"), enc(v, f"{path}/{i}")] for i, (k, v) in enumerate(x.items())]}
        if isinstance(x, tuple):
            return {_TUPLE: [enc(v, f"{path}/{i}") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [enc(v, f"{path}/{i}") for i, v in enumerate(x)]
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise CheckpointError(f"checkpoint state {path}: a {type(x).__name__} cannot be saved (not a tensor or scalar)")

    text = json.dumps(enc(obj, prefix)).encode()
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).clone(), tensors


def decode(data: torch.Tensor, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`encode`."""

    def dec(x: Any) -> Any:
        if isinstance(x, list):
            return [dec(v) for v in x]
        if isinstance(x, dict):
            if _TENSOR in x:
                return tensors[x[_TENSOR]]
            if _TUPLE in x:
                return tuple(dec(v) for v in x[_TUPLE])
            if _ITEMS in x:
                return {dec(k): dec(v) for k, v in x[_ITEMS]}
            return {k: dec(v) for k, v in x.items()}
        return x

    return dec(json.loads(bytes(data.tolist()).decode()))


# ---------------------------------------------------------------------------------------------- the outer state
def outer_by_name(osd: dict, names: list[str], shapes: list[torch.Size], fragments: list[list[int]]) -> tuple:
    """A DiLoCo-family ``state_dict`` cut into per-parameter tensors: ``(kind -> name -> tensor, the rest)``.

    ``names``/``shapes``/``fragments`` describe the outer's parameters (its flat buffers hold them in fragment
    order). The rest keeps every other field, with markers where a per-name part was taken out."""
    per: dict[str, dict[str, torch.Tensor]] = {k: {} for k in OUTER_KINDS}
    st = osd["state"]
    extra = (st.get("optimizer") or {}).get("state") or {}
    pos, g = 0, 0
    for f, frag in enumerate(fragments):
        comp = osd["compressors"][f]
        errs = comp.get("errors") or {}
        start = pos
        for k, i in enumerate(frag):
            name, shape = names[i], shapes[i]
            n = shape.numel()
            per["theta"][name] = st["theta"][pos : pos + n].view(shape)
            per["momentum"][name] = st["momentum"][pos : pos + n].view(shape)
            per["frag"][name] = torch.tensor(f, dtype=torch.int64)
            per["rank"][name] = torch.tensor(int(comp.get("rank", 0)), dtype=torch.int64)
            if osd["pending"][f] is not None:
                per["pending"][name] = osd["pending"][f][k]
            if osd["own_prev"][f] is not None:
                per["own_prev"][name] = osd["own_prev"][f][pos - start : pos - start + n].view(shape)
            if errs:
                per["errors"][name] = errs[str(k)]
            for sk, v in (extra.get(str(g)) or {}).items():
                per.setdefault(f"opt.{sk}", {})[name] = v if torch.is_tensor(v) else torch.tensor(v)
            pos, g = pos + n, g + 1
    if pos != st["theta"].numel():
        raise CheckpointError(
            f"the outer state has {st['theta'].numel()} elements but its parameters need {pos}: it was written "
            "for a different model or outer settings"
        )
    rest = {k: v for k, v in osd.items() if k not in ("state", "pending", "own_prev", "compressors")}
    rest["pending"] = [p is not None for p in osd["pending"]]
    rest["own_prev"] = [p is not None for p in osd["own_prev"]]
    rest["compressors"] = [{k: v for k, v in c.items() if k != "errors"} for c in osd["compressors"]]
    return per, rest


def outer_from_names(per: dict, rest: dict, outer, same_layout: bool, where: str) -> dict:
    """``outer.load_state_dict`` input from per-name local tensors (this layout's slices) and a saved rank's rest.
    On another layout the compressors keep only their rank (the largest saved for the fragment's tensors) and
    error feedback, and the adaptive controller restarts."""
    st = outer.state
    theta = torch.zeros(st.numel, dtype=torch.float32)
    mom = torch.zeros(st.numel, dtype=torch.float32)
    pending, own_prev, comps, extra = [], [], [], {}
    order = [i for frag in st.fragments for i in frag]
    for g, i in enumerate(order):
        opt = {k[4:]: d[outer.names[i]] for k, d in per.items() if k.startswith("opt.") and outer.names[i] in d}
        if opt:
            extra[str(g)] = {k: v if v.dim() else v.item() for k, v in opt.items()}
    for f, frag in enumerate(st.fragments):
        names = [outer.names[i] for i in frag]
        for i, name in zip(frag, names):
            if name not in per["theta"]:
                raise CheckpointError(f"{where} holds no outer state for parameter {name}: written for another model")
            if int(per["frag"][name]) != f:
                raise CheckpointError(
                    f"{where}: {name} was in streaming fragment {int(per['frag'][name])}, on this layout it is in "
                    f"fragment {f} (fragments are assigned per pipeline stage), so its sync schedule would change; "
                    "resume with the saved parallel.pipeline (parallel.tensor/data may change)"
                )
            st.view(theta, i).copy_(per["theta"][name])
            st.view(mom, i).copy_(per["momentum"][name])
        pend = [per["pending"].get(n) for n in names]
        if any(x is None for x in pend) != all(x is None for x in pend):
            raise CheckpointError(f"{where}: fragment {f} has an in-flight result for some of its tensors only")
        pending.append(pend if names and pend[0] is not None else None)
        own = [per["own_prev"].get(n) for n in names]
        own_prev.append(torch.cat([x.reshape(-1) for x in own]) if names and None not in own else None)
        errs = [per["errors"].get(n) for n in names]
        errors = {str(k): e for k, e in enumerate(errs)} if names and None not in errs else {}
        if same_layout:
            comps.append({**rest["compressors"][f], **({"errors": errors} if errors else {})})
        else:
            comps.append({"rank": max((int(per["rank"][n]) for n in names), default=0), "errors": errors})
    sd = dict(rest)
    sd["state"] = {"theta": theta, "momentum": mom, **({"optimizer": {"state": extra}} if extra else {})}
    sd.update(pending=pending, own_prev=own_prev, compressors=comps, dp_sharded=outer.dp_shard is not None)
    if not same_layout:
        sd["controller"] = None  # restarted (dilocox.reshard.restart_notes)
    return sd


# ---------------------------------------------------------------------------------------------- one rank's state
def flatten(
    sd: dict,
    replica: int,
    rank: int,
    opt_names: list[str],
    outer_layout: tuple | None,
    wrap: Callable[[str, torch.Tensor], Any] = lambda name, t: t,
) -> dict:
    """One rank's ``Trainer.state_dict()`` as DCP entries (module docstring). ``opt_names``: parameter names by
    inner-optimizer index; ``outer_layout``: ``(names, shapes, fragments)`` of its outer state; ``wrap(name, t)``
    turns a local slice of parameter ``name`` into what DCP saves (a DTensor for a TP slice)."""
    r = f"replica{replica}"
    flat: dict[str, Any] = {}
    for n, t in sd["model"].items():
        flat[key(r, "model", n)] = wrap(n, t.detach().cpu())
    osd = sd["optimizer"]
    other: dict[str, dict] = {}
    for idx, st in osd["state"].items():
        name = opt_names[int(idx)]
        for k, v in st.items():
            if torch.is_tensor(v):
                flat[key(r, "optim", name, k)] = wrap(name, v.detach().cpu()) if v.dim() else v.detach().cpu()
            else:
                other.setdefault(name, {})[k] = v
    rest: dict[str, Any] = {k: v for k, v in sd.items() if k not in ("model", "optimizer", "outer")}
    rest["optimizer"] = {"param_groups": osd["param_groups"], "other": other}
    if sd.get("outer") and "state" in sd["outer"] and outer_layout is not None:  # the DiLoCo family: by name
        per, rest["outer"] = outer_by_name(sd["outer"], *outer_layout)
        rest["outer_by_name"] = True
        for kind, d in per.items():
            for n, t in d.items():
                t = t.detach().cpu()
                flat[key(r, "outer", kind, n)] = wrap(n, t) if t.dim() else t
    else:  # none, or per-step sync (its error feedback is this rank's): whole, in the rank's rest
        rest["outer"] = sd.get("outer") or {}
    data, tensors = encode(rest, key(f"rank{rank}", "rest"))
    flat[key(f"rank{rank}", "rest")] = data
    flat.update(tensors)
    return flat


def wanted(md: dict, replica: int, src: int, model_keys: list[str], opt_names: list[str], outer_names, make) -> dict:
    """The DCP load targets of one rank: every saved key of its replica that names one of its model keys,
    optimizer parameters or outer parameters, and the ``rest`` of saved rank ``src``. ``md``: the checkpoint's
    ``state_dict_metadata``; ``make(name or None, metadata)``: an empty target (a DTensor for a TP slice)."""
    r, mine_opt, mine_outer, keys = f"replica{replica}", set(opt_names), set(outer_names or ()), set(model_keys)
    missing = [n for n in model_keys if key(r, "model", n) not in md]
    if missing:
        raise CheckpointError(
            f"the checkpoint holds no {r} parameters {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}: "
            "it was written for another model or parallel.replicas"
        )
    want, rest = {}, key(f"rank{src}", "rest")
    for k, m in md.items():
        parts = k.split("/")
        if len(parts) == 3 and parts[0] == r and parts[1] == "model" and parts[2] in keys:
            want[k] = make(parts[2], m)
        elif len(parts) == 4 and parts[0] == r and parts[1] == "optim" and parts[2] in mine_opt:
            want[k] = make(parts[2], m)
        elif len(parts) == 4 and parts[0] == r and parts[1] == "outer" and parts[3] in mine_outer:
            want[k] = make(parts[3], m)
        elif k == rest or k.startswith(rest + "/"):
            want[k] = make(None, m)
    if rest not in want:
        raise CheckpointError(f"the checkpoint holds no state of rank {src} ({rest}): it is incomplete")
    return want


def unflatten(
    got: dict,
    replica: int,
    src: int,
    model_keys: list[str],
    opt_names: list[str],
    outer,
    same_layout: bool,
    fresh_groups: list,
    where: str,
) -> dict:
    """``Trainer.load_state_dict`` input from the loaded targets of :func:`wanted` (DTensors as their local
    slices). On another layout the optimizer keeps this run's param_groups (its parameter indices)."""
    local = {k: v.to_local() if hasattr(v, "placements") else v for k, v in got.items()}
    r, rk = f"replica{replica}", key(f"rank{src}", "rest")
    rest = decode(local[rk], {k: v for k, v in local.items() if k.startswith(rk + "/")})
    sd = {k: v for k, v in rest.items() if k not in ("optimizer", "outer", "outer_by_name")}
    sd["model"] = {n: local[key(r, "model", n)] for n in model_keys}
    state: dict[int, dict] = {}
    other = rest["optimizer"].get("other") or {}
    for idx, name in enumerate(opt_names):
        entry = {k.split("/")[3]: v for k, v in local.items() if k.startswith(key(r, "optim", name) + "/")}
        entry.update(other.get(name) or {})
        if entry:
            state[idx] = entry
    sd["optimizer"] = {
        "state": state,
        "param_groups": rest["optimizer"]["param_groups"] if same_layout else fresh_groups,
    }
    sd["outer"] = rest.get("outer") or {}
    if rest.get("outer_by_name"):
        if outer is None:
            raise CheckpointError(
                f"{where} holds outer state of outer.method={sd['outer'].get('method')!r} but this run has no outer "
                "method to load it into; resume with the same outer.method"
            )
        per: dict[str, dict] = {k: {} for k in OUTER_KINDS}
        for k, v in local.items():
            parts = k.split("/")
            if len(parts) == 4 and parts[0] == r and parts[1] == "outer":
                per.setdefault(parts[2], {})[parts[3]] = v
        sd["outer"] = outer_from_names(per, sd["outer"], outer, same_layout, where)
    return sd
