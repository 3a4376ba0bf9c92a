"""Full (unsharded) tensors of a checkpoint in one process: the final model for export and generation.

``dcp.load`` into full-size targets reads every saved chunk of a key (the TP slices, the stages' layers), so a
checkpoint of any R x D x P x T layout gives the whole model without a process group.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable

import torch

from dilocox.checkpoint import names
from dilocox.checkpoint.layout import CheckpointError, CorruptCheckpointError, dcp_dirs, read_meta, verify_files
from dilocox.checkpoint.load import check_meta
from dilocox.checkpoint.reader import reader


def load_keys(where: str, keep: Callable[[str], bool] = lambda k: True) -> dict[str, torch.Tensor]:
    """The keys of the one DCP checkpoint ``where`` that ``keep`` accepts, as full tensors, in this process alone
    (its index read by ``reader``; the caller has verified the files)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from dilocox.checkpoint.save import dcp_failures

    md = reader(where).read_metadata().state_dict_metadata
    want = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.items() if keep(k)}
    if want:
        try:
            with warnings.catch_warnings():  # (one process, no process group: DCP says so)
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(want, storage_reader=reader(where), no_dist=True)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP wraps a reader's error in a BaseException
            why = "; ".join(f"{type(x).__name__}: {str(x)[:300]}" for x in dcp_failures(e).values())
            raise CorruptCheckpointError(f"checkpoint {where} could not be read ({why})") from None
    return want


def full_tensors(step_dir: str, prefix: str, verify: bool = True) -> dict[str, torch.Tensor]:
    """Every saved key under ``prefix/`` as a full tensor, by the rest of its key (``verify``: every file's hash
    first; False only where the caller has just verified them)."""
    meta = read_meta(step_dir)
    check_meta(step_dir, meta, None)
    if verify:
        verify_files(step_dir, meta)  # every file's hash (the index is then read by ``reader``)
    for where in dcp_dirs(step_dir):
        md = reader(where).read_metadata().state_dict_metadata
        if any(k.startswith(prefix + "/") for k in md):
            break
    got = load_keys(where, lambda k: k.startswith(prefix + "/"))
    return {k[len(prefix) + 1 :]: v for k, v in got.items()}


def rank_rest(step_dir: str, rank: int = 0) -> dict:
    """Saved rank ``rank``'s rest (step, sampler, RNG, the outer loop's fields ...), decoded."""
    rk = names.key(f"rank{rank}", "rest")
    t = full_tensors(step_dir, f"rank{rank}")
    if "rest" not in t:
        raise CheckpointError(f"{step_dir} holds no state of rank {rank}")
    return names.decode(t["rest"], {f"{rk}/{k[5:]}": v for k, v in t.items() if k.startswith("rest/")})


def final_model(step_dir: str, mcfg=None, allow_replica_params: bool = False) -> dict[str, torch.Tensor]:
    """The full model of a checkpoint for export / generation.

    Without an outer method (one replica) that is the model state. For the DiLoCo family the final model is
    the outer params θ: ``Trainer.run`` calls ``outer.finish()`` (params := θ) before its last save, so the
    final checkpoint's model state IS θ. A mid-run checkpoint's model state is replica 0's local params (θ plus
    the local steps since the last sync), which is not θ: refused unless ``allow_replica_params``."""
    meta = read_meta(step_dir)
    check_model_config(step_dir, meta, mcfg)
    model = full_tensors(step_dir, names.key("replica0", "model"))
    if not model:
        raise CheckpointError(f"{step_dir} holds no model state of replica 0")
    rest = rank_rest(step_dir, 0)
    outer = rest.get("outer") or {}
    method = outer.get("method", meta.get("method"))
    if outer and not allow_replica_params and not meta.get("final", False) and not _is_final(step_dir, model, rest):
        raise CheckpointError(
            f"{step_dir} is a mid-run checkpoint of outer.method={method!r}: its model state is replica 0's "
            "local params, not the outer params θ (the final model). Export the final checkpoint of the run, or pass "
            "--replica-params to export replica 0's local params anyway"
        )
    return model


# model keys that do not change what the saved weights are (how they were made, or which kernels run them)
_NOT_THE_WEIGHTS = frozenset(
    {"init_from", "init_std", "dropout", "attn_backend", "linear_backend", "fused_qkv", "loss_backend"}
)


def check_model_config(step_dir: str, meta: dict, mcfg) -> None:
    """CheckpointError when the checkpoint was trained with another model than ``mcfg`` (e.g. ``--checkpoint``
    naming another run's step directory): read with ``mcfg`` its weights would fail by name or be exported as
    another architecture."""
    saved = (meta.get("config") or {}).get("model")
    if mcfg is None or not isinstance(saved, dict):
        return
    diff = []
    for f in dataclasses.fields(mcfg):
        have = getattr(mcfg, f.name)
        have = list(have) if isinstance(have, tuple) else have
        if f.name not in _NOT_THE_WEIGHTS and f.name in saved and saved[f.name] != have:
            diff.append(f"model.{f.name} {saved[f.name]!r} there, {have!r} here")
    if diff:
        raise CheckpointError(
            f"{step_dir} was trained with another model than the run's config.yaml ({'; '.join(diff)}): give a step "
            "directory of this run, or the run directory it belongs to"
        )


def _is_final(step_dir: str, model: dict[str, torch.Tensor], rest: dict) -> bool:
    """Whether this step is the run's last: at ``train.steps`` of the config it was saved with, or at its
    ``train.max_tokens`` (saved tokens_seen) with the params set to θ by ``outer.finish()`` (a save of
    ``checkpoint.every`` at that step, before the finish, holds replica-local params)."""
    meta = read_meta(step_dir)
    step = int(meta.get("step", -1))
    # the config this save was made under (COMPLETE.json): a checkpoint.dir outside the run dir has no config.yaml
    # two levels up, and a later resume with more steps rewrites config.yaml while this save stays final
    saved = (meta.get("config") or {}).get("train")
    if isinstance(saved, dict) and isinstance(saved.get("steps"), int):
        steps, max_tokens = saved["steps"], saved.get("max_tokens") or 0
    else:  # (older checkpoints: the run dir's config.yaml)
        cfg_path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(step_dir))), "config.yaml")
        if not os.path.exists(cfg_path):
            return False
        from dilocox.config import load_config

        train = load_config(cfg_path).train
        steps, max_tokens = train.steps, train.max_tokens
    if step >= steps:
        return True
    ended = bool(max_tokens) and int(rest.get("tokens_seen", 0)) >= max_tokens
    return ended and _params_are_theta(step_dir, model, rest.get("outer") or {})


def _params_are_theta(step_dir: str, model: dict[str, torch.Tensor], outer: dict) -> bool:
    """Whether the saved model IS the outer params θ, with no all-reduce in flight (replica-local params, the steps
    since the last sync, differ from θ)."""
    if any(outer.get("pending") or []):
        return False
    theta = full_tensors(step_dir, names.key("replica0", "outer", "theta"), verify=False)  # (final_model verified)
    return bool(theta) and all(
        n in model and model[n].shape == t.shape and torch.equal(model[n], t.to(model[n].dtype))
        for n, t in theta.items()
    )
