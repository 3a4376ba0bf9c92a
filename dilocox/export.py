"""``dilocox export RUN_DIR --to hf OUT`` and ``dilocox import HF_DIR``.

export: the run's final model (the latest complete checkpoint of any R x D x P x T layout,
gathered by global names; the outer params θ for the DiLoCo family, see
``dilocox.checkpoint.full.final_model``; a SWARM run's ``--out``: its stages' parameters together,
``dilocox.swarm.final``) becomes a Hugging Face directory: ``config.json``,
``model.safetensors`` and the tokenizer (the run's trained BPE, or a byte-level
``tokenizer.json`` equivalent to dilocox's byte tokenizer). Architectures without an exact HF
equivalent are refused (``dilocox.hf.check_exportable``).

import: prints (or writes with ``--out``) the ``model:`` YAML section of an HF checkpoint of
the supported families with ``init_from`` set, to include in a training config: training then
starts from those weights, split over any layout (continued pre-training).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

EXPORT_USAGE = "dilocox export RUN_DIR --to hf OUT [--checkpoint STEP_DIR] [--replica-params] [--force]"
IMPORT_USAGE = "dilocox import HF_DIR|HUB_NAME [--out model.yaml] [--force]"
# the files an export writes: with --force they are replaced in an existing OUT, nothing else there is touched
EXPORT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "dilocox_model.json")


def check_export_out(out_dir: str, force: bool = False) -> None:
    """ExportError unless ``out_dir`` is new or empty, or (``force``) a directory whose only weights are an export's
    ``model.safetensors``: checkpoints rotate, so an earlier export may be the only copy of a model."""
    from dilocox.hf import ExportError

    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ExportError(f"OUT {out_dir} is a file; give a new (or empty) directory to export into")
    held = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    if held and not force:
        names = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise ExportError(
            f"OUT {out_dir} exists and is not empty ({names}); choose another directory or pass --force to replace "
            f"the exported files in it ({', '.join(EXPORT_FILES)}; other files are kept)"
        )
    other = [f for f in held if f.endswith(".safetensors") and f != "model.safetensors"]
    if other:  # (a reader of the directory would load them with the export's weights)
        raise ExportError(
            f"OUT {out_dir} holds other weights ({', '.join(other[:3])}) that would be read with the export's "
            "model.safetensors; choose another directory (--force keeps files it does not write)"
        )


def export_run(
    run_dir: str, out_dir: str, step_dir: str | None = None, allow_replica_params: bool = False, force: bool = False
) -> str:
    """Export a run's final model to ``out_dir`` (new or empty, or ``force``: see :func:`check_export_out`); returns
    the checkpoint step directory used."""
    from dilocox import checkpoint as ckpt
    from dilocox import hf
    from dilocox.checkpoint.full import final_model
    from dilocox.config import load_config
    from dilocox.generate import run_checkpoint_dir, run_tokenizer
    from dilocox.model.subspace import dense_state_dict

    check_export_out(out_dir, force)  # before any checkpoint is read
    cfg_path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"{run_dir} has no config.yaml; give the log.run_dir of a dilocox training run")
    cfg = load_config(cfg_path)
    hf.check_exportable(cfg.model)  # refuse before reading any shard
    from dilocox.swarm import final as swarm_final

    if swarm_final.is_swarm_run(run_dir):  # a `dilocox swarm --out` directory (--checkpoint: one of its steps)
        full, step_dir = swarm_final.final_model(run_dir, cfg, allow_replica_params, step_dir)
    else:
        if step_dir is None:
            ckpt_dir = run_checkpoint_dir(run_dir, cfg)
            step_dir = ckpt.find_latest(ckpt_dir)
            if step_dir is None:
                raise FileNotFoundError(f"{run_dir}: no complete checkpoint under {ckpt_dir}; nothing to export")
        full = final_model(step_dir, cfg.model, allow_replica_params)
    # a subspace-constrained model (model.subspace_rank) exports as the dense model with the same function
    full, mcfg = dense_state_dict(cfg.model, full), dataclasses.replace(cfg.model, subspace_rank=0)
    hf.save_hf_dir(out_dir, mcfg, full, run_tokenizer(cfg, run_dir))
    return step_dir


def export_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="dilocox export", usage=EXPORT_USAGE)
    ap.add_argument("run_dir", help="the run directory (log.run_dir) whose checkpoint is exported")
    ap.add_argument("--to", required=True, choices=["hf"], help="the format: hf (a Hugging Face transformers dir)")
    ap.add_argument("out", help="the directory to write (config.json, model.safetensors, the tokenizer)")
    ap.add_argument("--checkpoint", default=None, help="a step directory (default: the latest complete one)")
    ap.add_argument(
        "--replica-params",
        action="store_true",
        help="allow a mid-run checkpoint of a DiLoCo run (exports replica 0's local params, not θ)",
    )
    ap.add_argument("--force", action="store_true", help="replace the exported files in an existing, non-empty OUT")
    a = ap.parse_args(argv)
    from dilocox.checkpoint import CheckpointError
    from dilocox.hf import ExportError

    try:
        step = export_run(a.run_dir, a.out, a.checkpoint, a.replica_params, a.force)
    except (ExportError, CheckpointError, FileNotFoundError) as e:
        print(f"export: {e}", file=sys.stderr)
        return 2
    print(f"exported {step} -> {a.out}")
    return 0


def import_yaml(hf_name: str) -> str:
    """The ``model:`` YAML section (with ``init_from``) equivalent to an HF checkpoint."""
    from dilocox import hf

    hf_dir = hf.resolve_hf_dir(hf_name)
    fields = hf.model_fields_from_hf(hf.read_hf_config(hf_dir))
    lines = [f"# imported from {hf_dir} by `dilocox import`", "model:"]
    for k, v in {**fields, "init_from": os.path.abspath(hf_dir) if os.path.isdir(hf_name) else hf_name}.items():
        lines.append(f"  {k}: {'null' if v is None else str(v).lower() if isinstance(v, bool) else v}")
    return "\n".join(lines) + "\n"


def check_import_out(out: str, force: bool = False) -> None:
    """ExportError naming ``--out`` where it is a directory, is in a missing directory, or exists (unless ``force``)."""
    from dilocox.hf import ExportError

    if os.path.isdir(out):
        raise ExportError(f"--out {out} is a directory; give a file path for the YAML (e.g. --out {out}/model.yaml)")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise ExportError(f"--out {out}: the directory {parent} does not exist; create it or choose another path")
    if os.path.exists(out) and not force:
        raise ExportError(f"--out {out} exists; choose another path or pass --force to replace it")


def import_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="dilocox import", usage=IMPORT_USAGE)
    ap.add_argument("hf_dir", help="a Hugging Face model directory, or a hub name (needs a network)")
    ap.add_argument("--out", default=None, help="write the model: YAML section here (default: print it)")
    ap.add_argument("--force", action="store_true", help="replace an existing --out file")
    a = ap.parse_args(argv)
    from dilocox.fsutil import atomic_write_text
    from dilocox.hf import ExportError

    try:
        if a.out:
            check_import_out(a.out, a.force)  # (before a hub download)
        text = import_yaml(a.hf_dir)
    except ExportError as e:
        print(f"import: {e}", file=sys.stderr)
        return 2
    if a.out:
        atomic_write_text(a.out, text)  # (a temporary file renamed over --out: never half a file)
        print(f"wrote {a.out}; include it in a training config (include: {a.out}) to continue pre-training")
    else:
        sys.stdout.write(text)
    return 0
