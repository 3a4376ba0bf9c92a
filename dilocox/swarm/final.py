"""The whole model of a SWARM run (``dilocox swarm CONFIG --out OUT``) for ``dilocox export`` and ``dilocox generate``
(issue 43 item 4: a SWARM run's model goes where a ``dilocox train`` run's goes).

Each peer serves one stage's layers, named as in the whole model (``layers.<global i>``, ``embed`` on stage 0,
``norm_f``/``head`` on the last), so the stages' parameters together are the model's state dict. Where they come
from, in this order:

1. the run finished: every peer that ended it wrote ``OUT/s{j}p{i}.pt`` after its last sync (``swarm.sync=swarm``:
   every peer of a stage holds the same bytes; ``swarm.sync=diloco``: after ``outer.finish()``, θ, the same on every
   peer of the stage). Per stage the files of the peers whose records reach the stage's last step are taken; they
   must be equal (else the run is refused, naming the files);
2. else the newest complete SWARM checkpoint (``swarm/checkpoint.py``, every file's SHA-256 checked): its stage
   parameters are the model for ``swarm.sync=swarm``; for ``swarm.sync=diloco`` a mid-run file holds a peer's local
   parameters, not θ, so it is refused unless ``allow_replica_params`` (``--replica-params``), as for ``dilocox
   train``'s DiLoCo checkpoints.

A peer's final ``.pt`` is read with ``torch.load(weights_only=True)`` (tensors and plain values only); a checkpoint
through DCP with the restricted index reader (``dilocox.checkpoint.reader``).
"""

from __future__ import annotations

import json
import os
import re

import torch

from dilocox.checkpoint.layout import CheckpointError

PEER_RE = re.compile(r"^s(\d+)p(\d+)\.(pt|jsonl)$")


def is_swarm_run(run_dir: str) -> bool:
    """A SWARM job's --out: peers' records or results (``s{j}p{i}.jsonl`` / ``.pt``) beside its config.yaml."""
    try:
        return any(PEER_RE.match(n) for n in os.listdir(run_dir))
    except OSError:
        return False


def _last_step(run_dir: str, name: str) -> int:
    path = os.path.join(run_dir, f"{name}.jsonl")
    last = -1
    try:
        with open(path) as f:
            for line in f:
                try:
                    last = max(last, int(json.loads(line).get("step", -1)))
                except (ValueError, AttributeError):
                    continue  # (a line cut by a crash)
    except OSError:
        pass
    return last


def _finished_stages(run_dir: str, n_stages: int) -> dict[int, dict[str, dict]]:
    """{stage: {peer name: its final params}} of the peers that ended the run: those whose records reach the run's
    last step (the highest over all stages' peers) and whose ``.pt`` is of that run (its own records end there: a
    ``--resume`` with a larger ``--steps`` that stopped early leaves the first run's ``.pt``). A stage without one
    (its finishers died before their final save; a peer that left mid-run does not count) is missing from the
    result."""
    steps: dict[int, dict[str, int]] = {}
    for n in os.listdir(run_dir):
        m = PEER_RE.match(n)
        if m and m.group(3) == "pt" and int(m.group(1)) < n_stages:
            steps.setdefault(int(m.group(1)), {})[n[:-3]] = _last_step(run_dir, n[:-3])
    top = max((k for per in steps.values() for k in per.values()), default=-1)
    out = {}
    for j, per in steps.items():
        last = {}
        for p in sorted(per):
            if per[p] != top:
                continue
            pt = torch.load(os.path.join(run_dir, f"{p}.pt"), map_location="cpu", weights_only=True)
            own = [r.get("step") for r in pt.get("records") or [] if isinstance(r, dict)]
            own = [int(s) for s in own if isinstance(s, int)]
            if own and max(own) != top:  # an earlier run's file: a resumed run stopped before it wrote its own
                continue
            last[p] = pt["params"]
        if last:
            out[j] = last
    return out


def _checkpoint_stages(run_dir: str, cfg, n: int, step_dir: str | None) -> tuple[dict[int, dict[str, dict]], str]:
    """Every stage's file of one SWARM checkpoint step (``step_dir``, else the newest step where every stage has a
    file that verifies: a damaged file moves all stages back together); hashes checked."""
    from dilocox.swarm import checkpoint as peer_ckpt
    from dilocox.swarm.common import SwarmError

    ckpt_dir = os.path.dirname(os.path.abspath(step_dir)) if step_dir else peer_ckpt.checkpoint_dir(cfg, run_dir)
    try:
        per_stage = [dict(peer_ckpt.candidates_in(ckpt_dir, n, j, 0)) for j in range(n)]
    except SwarmError as e:
        raise CheckpointError(f"{run_dir}: {e}") from None
    common = set.intersection(*(set(c) for c in per_stage))
    if step_dir is not None:
        want = next((s for s in common if os.path.samefile(os.path.dirname(per_stage[0][s]), step_dir)), None)
        if want is None:
            raise CheckpointError(f"{step_dir}: not a complete SWARM checkpoint step whose files all verify")
        common = {want}
    if not common:
        raise CheckpointError(f"{ckpt_dir}: no SWARM checkpoint step where every stage's file verifies (see warnings)")
    step = max(common)
    stages = {
        j: {os.path.basename(c[step]).split(".")[0]: peer_ckpt.read_state(c[step])["model"]}
        for j, c in enumerate(per_stage)
    }
    return stages, os.path.dirname(per_stage[0][step])


def _one_per_stage(stages: dict[int, dict[str, dict]], where: str) -> dict[str, torch.Tensor]:
    full: dict[str, torch.Tensor] = {}
    for j in sorted(stages):
        (first, params), *rest = stages[j].items()
        for other, theirs in rest:
            if set(theirs) != set(params) or any(not torch.equal(theirs[k], params[k]) for k in params):
                raise CheckpointError(
                    f"{where}: {first}.pt and {other}.pt end the run with different parameters of stage {j} (the "
                    "peers of a stage must hold the same bytes after the last sync); export a SWARM checkpoint step "
                    "with --checkpoint STEP_DIR, or check the run's logs"
                )
        full.update(params)
    return full


def final_model(
    run_dir: str, cfg, allow_replica_params: bool = False, step_dir: str | None = None
) -> tuple[dict[str, torch.Tensor], str]:
    """(the whole model's state dict, where it came from) of the SWARM run in ``run_dir`` (module docstring);
    ``step_dir``: that SWARM checkpoint step instead (``dilocox export --checkpoint``)."""
    from dilocox.model.transformer import build_model
    from dilocox.swarm import checkpoint as peer_ckpt

    n = len(cfg.swarm.peers_per_stage)
    stages, source = ({}, run_dir) if step_dir else (_finished_stages(run_dir, n), run_dir)
    if len(stages) < n:
        newest = peer_ckpt.newest_complete(peer_ckpt.checkpoint_dir(cfg, run_dir), n)
        missing = sorted(set(range(n)) - set(stages))
        if step_dir is None and newest is None:
            raise CheckpointError(
                f"{run_dir}: the SWARM run did not finish (no final s{missing[0]}p*.pt of stage {missing[0]} at the "
                f"run's last step) and it holds no complete SWARM checkpoint: nothing to export (checkpoint.every > 0)"
            )
        if cfg.swarm.sync == "diloco" and not allow_replica_params:
            raise CheckpointError(
                f"{run_dir}: {'a' if step_dir else 'the run did not finish; its newest'} SWARM checkpoint "
                f"({step_dir or newest[1]}) holds each peer's local parameters, not the outer params θ "
                "(swarm.sync=diloco). Finish the run (--resume), or pass --replica-params to export them anyway"
            )
        stages, source = _checkpoint_stages(run_dir, cfg, n, step_dir)
    full = _one_per_stage(stages, source)
    want = set(build_model(cfg.model, device="meta").state_dict())
    if cfg.model.tie_embeddings and "head.weight" in want and "embed.weight" in full:
        full.setdefault("head.weight", full["embed.weight"])  # (tied: named_parameters lists the table once)
    if set(full) != want:
        odd = sorted(set(full) ^ want)
        raise CheckpointError(
            f"{source}: the stages' parameters do not make the model of {run_dir}/config.yaml (differ in "
            f"{odd[:4]}{' ...' if len(odd) > 4 else ''}): was the config changed after the run?"
        )
    return full, source
