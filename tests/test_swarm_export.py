"""A SWARM run's model through ``dilocox export`` / ``dilocox generate`` (``dilocox/swarm/final.py``).

The peers' output is laid out here as the peers write it (``OUT/s{j}p{i}.pt`` + ``.jsonl`` after the run, or a SWARM
checkpoint written by ``swarm/checkpoint.save``), from a whole model split by the stages' own parameter names; the
real jobs are exported in ``tests/test_swarm_runtime.py``. Checked: transformers' logits of the export equal
dilocox's on the same weights; a stage whose peers end with different bytes is refused; a peer that stopped early is
not taken; an unfinished run falls back to the newest complete checkpoint (``swarm.sync=swarm``) and refuses a
DiLoCo one's local params unless ``--replica-params``.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from dilocox.checkpoint.layout import CheckpointError
from dilocox.config import load_config, to_yaml
from dilocox.model.transformer import build_model, build_stage_model
from dilocox.swarm import checkpoint as peer_ckpt
from dilocox.swarm.final import final_model, is_swarm_run

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(out, *extra):
    return load_config(
        os.path.join(ROOT, "configs", "tiny.yaml"),
        ["--model.n_layers=2", "--model.d_model=64", "--swarm.peers_per_stage=[1,2]", "--train.steps=4",
         f"--checkpoint.dir={out}/checkpoints", *extra],
    )  # fmt: skip


def _stages(cfg, seed=0) -> tuple[dict, list[dict]]:
    full = build_model(cfg.model, seed=seed).state_dict()
    n = len(cfg.swarm.peers_per_stage)
    parts = [
        {k: full[k].clone() for k in build_stage_model(cfg.model, j, n, device="meta").state_dict()} for j in range(n)
    ]
    return full, parts


def _write_peer(out, name, params, last_step):
    torch.save({"params": params, "visits": [], "records": []}, os.path.join(out, f"{name}.pt"))
    with open(os.path.join(out, f"{name}.jsonl"), "w") as f:
        for k in range(last_step + 1):
            f.write(json.dumps({"step": k, "loss": 1.0}) + "\n")


def _run_dir(tmp_path, *extra):
    out = str(tmp_path / "out")
    os.makedirs(out)
    cfg = _cfg(out, *extra)
    with open(os.path.join(out, "config.yaml"), "w") as f:
        f.write(to_yaml(cfg))
    return out, cfg


def test_a_finished_swarm_run_exports_its_stages_as_one_model(tmp_path):
    from dilocox.cli import main
    from dilocox.generate import load_model

    out, cfg = _run_dir(tmp_path)
    full, (s0, s1) = _stages(cfg)
    _write_peer(out, "s0p0", s0, 3)
    _write_peer(out, "s1p0", s1, 3)
    _write_peer(out, "s1p1", s1, 3)
    assert is_swarm_run(out) and not is_swarm_run(str(tmp_path))
    got, source = final_model(out, cfg)
    assert source == out and set(got) == set(full) and all(torch.equal(got[k], full[k]) for k in full)
    hf_dir = str(tmp_path / "hf")
    assert main(["export", out, "--to", "hf", hf_dir]) == 0
    ours = build_model(cfg.model)
    ours.load_state_dict(full)
    ours.eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    x = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(x), theirs(x).logits
    assert a.abs().max() > 0.1
    torch.testing.assert_close(b, a, rtol=1e-5, atol=2e-5)
    model, _, _ = load_model(out)  # dilocox generate reads the SWARM run directory the same way
    assert all(torch.equal(model.state_dict()[k], full[k]) for k in full)


def test_a_stage_whose_finishers_all_died_is_not_taken_from_a_peer_that_left_early(tmp_path):
    """Stage 1's only file is a peer's that left at step 1 (rebalancing); the run ended at step 3: the export does not
    mix it with stage 0's final params (no checkpoint: refused)."""
    out, cfg = _run_dir(tmp_path)
    _, (s0, s1) = _stages(cfg)
    _write_peer(out, "s0p0", s0, 3)
    _write_peer(out, "s1p1", s1, 1)
    with pytest.raises(CheckpointError, match="no final s1p"):
        final_model(out, cfg)


def test_tied_embeddings_of_a_one_stage_swarm_run_export(tmp_path):
    out, cfg = _run_dir(tmp_path, "--swarm.peers_per_stage=[2]", "--model.tie_embeddings=true")
    full, (s0,) = _stages(cfg)
    params = dict(build_model(cfg.model).named_parameters())  # (what a peer saves: the tied table once)
    assert "head.weight" not in params
    _write_peer(out, "s0p0", {k: v.detach() for k, v in params.items()}, 3)
    got, _ = final_model(out, cfg)
    assert set(got) == set(full) and torch.equal(got["head.weight"], got["embed.weight"])


def test_peers_of_a_stage_that_end_apart_are_refused_and_an_early_stopper_is_not_taken(tmp_path):
    out, cfg = _run_dir(tmp_path)
    full, (s0, s1) = _stages(cfg)
    other = {k: v + 1.0 for k, v in s1.items()}
    _write_peer(out, "s0p0", s0, 3)
    _write_peer(out, "s1p0", s1, 3)
    _write_peer(out, "s1p1", other, 1)  # it left (or died after writing) at step 1: not the run's end
    got, _ = final_model(out, cfg)
    assert all(torch.equal(got[k], full[k]) for k in full)
    _write_peer(out, "s1p1", other, 3)
    with pytest.raises(CheckpointError, match=r"s1p0.pt and s1p1.pt end the run with different parameters of stage 1"):
        final_model(out, cfg)


def _save_checkpoint(out, cfg, stage, index, params, step, sync):
    model = torch.nn.Module()
    for k, v in params.items():  # (a module whose named_parameters are the stage's, by their dotted names)
        *path, leaf = k.split(".")
        m = model
        for p in path:
            if not hasattr(m, p):
                m.add_module(p, torch.nn.Module())
            m = getattr(m, p)
        m.register_parameter(leaf, torch.nn.Parameter(v.clone()))
    opt = torch.optim.AdamW(model.parameters())
    n = len(cfg.swarm.peers_per_stage)
    peer = SimpleNamespace(s=SimpleNamespace(sync=sync), group=None, cfg=cfg, out_dir=out, stage=stage, index=index,
                           n=n, model=model, opt=opt, outer=None, name=f"s{stage}p{index}")  # fmt: skip
    assert peer_ckpt.save(peer, step) is not None


@pytest.mark.parametrize("sync", ["swarm", "diloco"])
def test_an_unfinished_run_exports_its_newest_checkpoint_or_refuses_local_params(tmp_path, sync):
    out, cfg = _run_dir(tmp_path, "--checkpoint.every=2", f"--swarm.sync={sync}")
    full, (s0, s1) = _stages(cfg)
    with pytest.raises(CheckpointError, match="no complete SWARM checkpoint"):
        final_model(out, cfg)
    _write_peer(out, "s0p0", s0, 3)  # stage 0 finished; stage 1's peers died: no final file of stage 1
    for j, part in enumerate((s0, s1)):
        _save_checkpoint(out, cfg, j, 0, part, 2, sync)
    if sync == "diloco":
        with pytest.raises(CheckpointError, match="--replica-params"):
            final_model(out, cfg)
        got, source = final_model(out, cfg, allow_replica_params=True)
    else:
        got, source = final_model(out, cfg)
    assert source.endswith("step_00000002") and all(torch.equal(got[k], full[k]) for k in full)
    # a newer step whose stage-1 file is damaged: every stage goes back to step 2 together (hashes checked)
    later = {k: v * 2.0 for k, v in s0.items()}
    _save_checkpoint(out, cfg, 0, 0, later, 4, sync)
    _save_checkpoint(out, cfg, 1, 0, {k: v * 2.0 for k, v in s1.items()}, 4, sync)
    pt = os.path.join(os.path.dirname(source), "step_00000004", "s1p0", "__0_0.distcp")
    raw = bytearray(open(pt, "rb").read())
    raw[-10] ^= 0xFF
    open(pt, "wb").write(bytes(raw))
    got, source = final_model(out, cfg, allow_replica_params=True)
    assert source.endswith("step_00000002") and all(torch.equal(got[k], full[k]) for k in full)
    # --checkpoint STEP_DIR: that step, or a refusal naming it when one of its files is damaged
    got, source = final_model(out, cfg, allow_replica_params=True, step_dir=source)
    assert all(torch.equal(got[k], full[k]) for k in full)
    with pytest.raises(CheckpointError, match="step_00000004: not a complete SWARM checkpoint step"):
        final_model(out, cfg, allow_replica_params=True, step_dir=os.path.dirname(os.path.dirname(pt)))


def test_a_changed_model_config_is_named(tmp_path):
    out, cfg = _run_dir(tmp_path)
    _, (s0, s1) = _stages(cfg)
    _write_peer(out, "s0p0", s0, 3)
    _write_peer(out, "s1p0", {k: v for k, v in s1.items() if "norm_f" not in k}, 3)
    with pytest.raises(CheckpointError, match="norm_f"):
        final_model(out, cfg)
