"""SWARM planner (dilocox/swarm/plan.py, `dilocox plan --swarm`): square-cube trend, bytes = the codec's."""

import json
import os

import pytest
import torch

from dilocox.cli import main as cli_main
from dilocox.compress.collectives import wire_bytes as allreduce_wire_bytes
from dilocox.config import ModelConfig, load_config
from dilocox.model.transformer import build_stage_model
from dilocox.plan import load_method, sync_bytes
from dilocox.swarm.activations import encode, wire_bytes
from dilocox.swarm.plan import GPT2_SHAPES, gpt2_model, main, plan_config, swarm_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILY = list(GPT2_SHAPES)


@pytest.fixture(scope="module")
def family_rows():
    return {act: [swarm_plan(gpt2_model(n), act=act, name=n) for n in FAMILY] for act in ("none", "int8")}


@pytest.mark.parametrize("act", ["none", "int8"])
def test_sync_share_grows_with_model_size(family_rows, act):
    # square-cube law (SWARM §3.1; paper 000 Fig. "Communication Cost Scaling"): PP bytes ~ d_model,
    # stage-sync bytes ~ n_layers * d_model^2 -> the sync share rises across GPT-2 small..XL
    rows = family_rows[act]
    assert [r["model"] for r in rows] == FAMILY
    params = [r["n_params"] for r in rows]
    assert params == sorted(params) and params[-1] > 1.5e9
    for key in ("swarm_sync_share", "diloco_sync_share", "diloco_total_reduction"):
        vals = [r[key] for r in rows]
        assert all(a < b for a, b in zip(vals, vals[1:])), (key, vals)
    # fp32 activations, 4x2, 512 x 1024 per peer: PP dominates for small, the sync for XL (paper 000's picture)
    if act == "none":
        assert rows[0]["swarm_sync_share"] < 0.5 < rows[-1]["swarm_sync_share"]
    for r in rows:  # DiLoCo-SWARM syncs H = 50 x less often with the same fp32 payload
        assert r["diloco_sync_bytes_per_step"] < r["swarm_sync_bytes"] / 49


def test_int8_activations_shrink_pipeline_bytes_about_4x(family_rows):
    for a, b in zip(family_rows["none"], family_rows["int8"]):
        assert a["act_bytes_per_link"] / b["act_bytes_per_link"] == pytest.approx(4 / (1 + 2 / 2048), rel=1e-3)
        assert a["ids_bytes_per_link"] == b["ids_bytes_per_link"] > 0
        assert a["swarm_sync_bytes"] == b["swarm_sync_bytes"]


@pytest.mark.parametrize("act", ["none", "fp16", "int8"])
def test_pipeline_bytes_are_the_codecs_wire_bytes_of_the_real_stage_output(act):
    # tiny model; 3 stages; 2 stage-0 peers; batch 5 with microbatches of 2 -> sizes 2, 2, 1
    m = ModelConfig(n_layers=3, n_heads=2, d_model=32, vocab_size=64, max_seq_len=16)
    row = swarm_plan(m, stages=3, peers=[2, 1, 3], batch_size=5, microbatch_size=2, seq_len=16, act=act, block=64)
    torch.manual_seed(0)
    stage0 = build_stage_model(m, 0, 3)
    stage1 = build_stage_model(m, 1, 3)
    link = 0
    for b in (2, 2, 1):
        h = stage0(torch.randint(0, 64, (b, 16)))
        h.retain_grad()
        h1 = stage1(h)
        h1.sum().backward()  # the gradient that goes back over the link has h's shape
        fwd, _ = encode(h, act, 64)
        bwd, _ = encode(h.grad, act, 64)
        link += fwd.numel() + bwd.numel() + 2 * b * 16  # + the ids: inputs and targets, uint8 (vocab 64)
        assert h1.shape == h.shape  # the 1->2 link carries the same shape
    assert row["microbatches_per_step"] == 2 * 3
    assert row["pipeline_bytes_per_link"] == 2 * link  # two stage-0 peers
    assert row["pipeline_bytes"] == 2 * 2 * link  # two links
    assert row["act_bytes_per_link"] == 2 * sum(2 * wire_bytes(b * 16 * 32, act, 64) for b in (2, 2, 1))


def test_sync_bytes_are_the_compressors():
    model = load_config(os.path.join(ROOT, "configs", "model", "gpt2-tiny.yaml")).model
    row = swarm_plan(model, stages=2, peers=[3, 2], batch_size=4, microbatch_size=2, seq_len=64, preset="diloco")
    # SWARM: fp32 ring all-reduce of [stage grads | 1 counter] among the m_j peers, sent by each of them
    for P, mj, got in zip(row["stage_params"], row["peers"], row["swarm_sync_bytes_per_stage"]):
        assert got == mj * allreduce_wire_bytes(P + 1, mj, "none")
    assert sum(row["stage_params"]) == model.num_params()
    # DiLoCo-SWARM with equal peer counts: m x what dilocox.plan counts per replica of a 2-stage pipeline
    for preset in ("diloco", "dilocox", "streaming"):
        row = swarm_plan(model, stages=2, peers=4, batch_size=4, microbatch_size=2, seq_len=64, preset=preset, H=10)
        ref = sync_bytes(model, load_method(preset), 4, pipeline=2)["wire_bytes"]
        assert row["diloco_sync_bytes_per_sync"] == 4 * ref
        assert row["diloco_sync_bytes_per_step"] == pytest.approx(4 * ref / 10)
    fp32 = swarm_plan(model, seq_len=64)["diloco_sync_bytes_per_sync"]
    assert 0 < swarm_plan(model, preset="dilocox", seq_len=64)["diloco_sync_bytes_per_sync"] < fp32 / 4


def test_builtin_gpt2_shapes_match_the_configs(tmp_path):
    os.makedirs(tmp_path / "methods")
    for name in FAMILY:
        path = os.path.join(ROOT, "configs", "model", f"{name}.yaml")
        builtin = gpt2_model(name, cdir=str(tmp_path))  # no model/ dir there: the built-in shape
        if os.path.exists(path):
            assert builtin.num_params() == load_config(path).model.num_params()
    xl = gpt2_model("gpt2-xl", cdir=str(tmp_path))
    assert (xl.n_layers, xl.n_heads, xl.d_model) == (48, 25, 1600)
    with pytest.raises(ValueError, match="unknown GPT-2 size"):
        gpt2_model("gpt2-huge")


def test_bad_arguments():
    m = gpt2_model("gpt2-small")
    with pytest.raises(ValueError, match="one peer count per stage"):
        swarm_plan(m, stages=2, peers=[1, 2, 3])
    with pytest.raises(ValueError, match=">= 2 stages"):
        swarm_plan(m, stages=1)
    with pytest.raises(ValueError, match="max_seq_len"):
        swarm_plan(m, seq_len=4096)
    with pytest.raises(ValueError, match="DiLoCo-family preset"):
        swarm_plan(m, preset="allreduce")
    with pytest.raises(ValueError, match="activation codec"):
        swarm_plan(m, act="int2")


def test_cli(tmp_path, capsys):
    out = tmp_path / "swarm.json"
    assert cli_main(["plan", "--swarm", "--model", "gpt2-small", "--act", "int8", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| gpt2-small |" in text and "SWARM sync share" in text
    rows = json.loads(out.read_text())
    assert rows[0]["act"] == "int8" and rows[0]["peers"] == [4, 4]
    assert main(["--model", "gpt2-small", "--peers", "4,x"]) == 2
    assert "--peers '4,x'" in capsys.readouterr().err
    assert main(["--model", "nope.yaml"]) == 2
    assert "--model 'nope.yaml': no such file" in capsys.readouterr().err
    assert main(["--model", "gpt2-small", "--H", "0"]) == 2
    assert "H=0 must be a positive int" in capsys.readouterr().err


def test_plan_of_a_run_config(tmp_path, capsys):
    ov = {
        "swarm": {"peers_per_stage": [3, 2], "microbatch_size": 2, "activations": "int8", "sync": "diloco"},
        "train": {"batch_size": 6, "seq_len": 32},
        "outer": {"method": "diloco", "sync_every": 7},
        "compress": {"quant": "int8"},
    }
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), ov)
    row = plan_config(cfg)
    assert row["peers"] == [3, 2] and row["act"] == "int8" and row["H"] == 7
    assert row["microbatches_per_step"] == 3 * 3
    d = cfg.model.d_model
    assert row["pipeline_bytes_per_link"] == 3 * 3 * (2 * wire_bytes(2 * 32 * d, "int8") + 2 * 2 * 32)
    ref = swarm_plan(cfg.model, peers=[3, 2], batch_size=6, microbatch_size=2, seq_len=32, act="int8", H=7)
    assert row["swarm_sync_bytes"] == ref["swarm_sync_bytes"]
    # int8 all-gathered among 3 (2 payloads of ~1 B/param) vs the fp32 ring (2 x 2/3 x 4 B/param)
    assert row["diloco_sync_bytes_per_sync"] < ref["diloco_sync_bytes_per_sync"] / 2
    path = tmp_path / "run.yaml"
    path.write_text(
        "include: " + os.path.join(ROOT, "configs", "tiny.yaml") + "\n"
        "swarm: {peers_per_stage: [3, 2], microbatch_size: 2, activations: int8}\n"
        "train: {batch_size: 6, seq_len: 32}\n"
    )
    out = tmp_path / "rows.json"
    assert cli_main(["plan", "--swarm", "--config", str(path), "--json", str(out)]) == 0
    assert json.loads(out.read_text())[0]["pipeline_bytes_per_link"] == row["pipeline_bytes_per_link"]
    assert cli_main(["plan", "--swarm", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "--config" in capsys.readouterr().err
