"""Hugging Face export / import: dilocox -> transformers logits equal, import gives them back."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from test_train import QWEN_ARGS

from dilocox import hf
from dilocox.config import load_config
from dilocox.model.transformer import build_model
from tests.spawn import run_ranks

transformers = pytest.importorskip("transformers")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

QWEN = [
    *QWEN_ARGS,
    "--model.d_ff=176",
    "--model.norm_eps=1e-6",
    "--model.rope_theta=5000",
]
FAMILIES = {
    "gpt2": ["--model.norm_eps=1e-5"],
    "gpt2-tied": ["--model.tie_embeddings=true"],
    "opt": ["--model.arch=opt", "--model.activation=relu"],
    "qwen": QWEN,
}
PP2_TP2 = ["--parallel.pipeline=2", "--parallel.tensor=2"]


def _cfg(run_dir, *extra, steps=2):
    return load_config(
        os.path.join(ROOT, "configs", "tiny.yaml"),
        [
            f"--log.run_dir={run_dir}",
            f"--data.cache_dir={os.path.dirname(run_dir)}/cache",
            "--data.max_bytes=200000",
            f"--train.steps={steps}",
            "--train.batch_size=4",
            "--train.seq_len=32",
            "--train.eval_every=0",
            "--train.eval_batches=1",
            "--log.tensorboard=false",
            "--log.progress=false",
            "--optim.warmup_steps=1",
            "--model.n_layers=2",
            "--model.d_model=64",
            "--parallel.microbatches=2",
            "--checkpoint.resume=none",
            *extra,
        ],
    )


def _train(rank, world, run_dir, extra):
    """Train through ``dilocox.train.train`` (writes config.yaml and the final checkpoint); return the full model."""
    from dilocox.train import train

    train(_cfg(run_dir, *extra))  # the weights are read back from the final checkpoint by the test


def _init_from(rank, world, run_dir, extra, hf_dir):
    """Build a Trainer with model.init_from on this layout; return its full (gathered) stage state dict."""
    from dilocox.train import Trainer

    t = Trainer(_cfg(run_dir, *extra, f"--model.init_from={hf_dir}"))
    return t.model.gather_full_state_dict()


def _dilocox_model(mcfg, full):
    m = build_model(mcfg, device="meta")
    m.to_empty(device="cpu")
    m.load_full_state_dict(full)
    return m.eval()


def _tokens(vocab=256):
    return torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(0))


def _export_and_check(tmp_path, family, layout):
    from dilocox import checkpoint as ckpt
    from dilocox.checkpoint.full import final_model
    from dilocox.cli import main

    run_dir, out = str(tmp_path / "run"), str(tmp_path / "hf")
    world = 4 if layout else 1
    run_ranks(world, _train, run_dir, FAMILIES[family] + layout)
    cfg = load_config(os.path.join(run_dir, "config.yaml"))
    step_dir = ckpt.find_latest(os.path.join(run_dir, "checkpoints"))
    full = final_model(step_dir, cfg.model)
    assert main(["export", run_dir, "--to", "hf", out]) == 0
    ours = _dilocox_model(cfg.model, full)
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    theirs.eval()
    assert type(theirs).__name__ == hf.HF_CLASSES[cfg.model.arch]
    x = _tokens()
    with torch.no_grad():
        a, b = ours(x), theirs(x).logits
    assert a.abs().max() > 0.1  # a real model, not zeros
    torch.testing.assert_close(b, a, rtol=1e-5, atol=2e-5)
    # import: the HF directory back into dilocox gives the same weights and logits
    back = hf.load_hf_full_state_dict(out, cfg.model)
    for k, v in full.items():
        assert torch.equal(back[k], v), k
    with torch.no_grad():
        torch.testing.assert_close(_dilocox_model(cfg.model, back)(x), a, rtol=0, atol=0)
    return cfg, out, full, x, a


# the quick loop (-m "not slow") keeps gpt2; the other families take ~7 s each
@pytest.mark.parametrize(
    "family", [f if f == "gpt2" else pytest.param(f, marks=pytest.mark.slow) for f in sorted(FAMILIES)]
)
def test_export_one_rank_matches_transformers(tmp_path, family):
    _, out, _, _, _ = _export_and_check(tmp_path, family, [])
    # generate reads the run directory (its final checkpoint) and the export alike
    from dilocox.generate import load_model, sample

    run_model, run_tok, _ = load_model(str(tmp_path / "run"))
    hf_model, hf_tok, _ = load_model(out)
    ids = run_tok.encode("import ")
    assert hf_tok.encode("import ") == ids
    assert sample(run_model, ids, 8, temperature=0.7, top_k=5, seed=3) == sample(hf_model, ids, 8, 0.7, 5, seed=3)
    if family == "gpt2-tied":
        assert "lm_head.weight" not in load_file(os.path.join(out, "model.safetensors"))
        with open(os.path.join(out, "config.json")) as f:
            assert json.load(f)["tie_word_embeddings"] is True
    # the byte tokenizer ships as a tokenizer.json that encodes exactly like dilocox's
    from dilocox.data.tokenizer import ByteTokenizer

    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n\treturn x  # héllo wörld ✓ \x00\x01\x7f 日本"
    assert tok(text, add_special_tokens=False)["input_ids"] == ByteTokenizer().encode(text)
    assert tok.decode(ByteTokenizer().encode(text)) == text


@pytest.mark.slow  # 4 ranks: ~30 s per family on 2 cores
@pytest.mark.parametrize("family", ["gpt2", "opt", "qwen"])
def test_export_pp2_tp2_matches_transformers_and_init_from_any_layout(tmp_path, family):
    _, out, full, _, _ = _export_and_check(tmp_path, family, PP2_TP2)
    # model.init_from splits the HF weights over PP=2 x TP=2: every stage holds exactly the exported tensors
    parts = run_ranks(4, _init_from, str(tmp_path / "cont"), FAMILIES[family] + PP2_TP2, out)
    seen = set()
    for sd in parts:
        for k, v in sd.items():
            assert torch.equal(v, full[k]), k
            seen.add(k)
    assert seen == set(full)


def test_init_from_one_rank_and_mismatch_error(tmp_path):
    """init_from on one rank loads the HF weights; an architecture mismatch names the field."""
    from dilocox.config import ConfigError
    from dilocox.data.tokenizer import ByteTokenizer

    cfg = _cfg(str(tmp_path / "a"), *QWEN)
    src = build_model(cfg.model, seed=7)
    out = str(tmp_path / "hf")
    hf.save_hf_dir(out, cfg.model, src.gather_full_state_dict(), ByteTokenizer())
    got = run_ranks(1, _init_from, str(tmp_path / "b"), QWEN, out)[0]
    for k, v in src.gather_full_state_dict().items():
        assert torch.equal(got[k], v), k
    bad = _cfg(str(tmp_path / "c"), *QWEN, "--model.d_ff=256", f"--model.init_from={out}")
    with pytest.raises(ConfigError, match="model.d_ff=256 .* has 176"):
        hf.check_model_matches(bad.model, out)


def test_import_cli_writes_model_section(tmp_path, capsys):
    from dilocox.cli import main
    from dilocox.data.tokenizer import ByteTokenizer

    cfg = _cfg(str(tmp_path / "a"), *FAMILIES["opt"])
    out = str(tmp_path / "hf")
    hf.save_hf_dir(out, cfg.model, build_model(cfg.model, seed=1).gather_full_state_dict(), ByteTokenizer())
    assert main(["import", out, "--out", str(tmp_path / "m.yaml")]) == 0
    again = load_config(str(tmp_path / "m.yaml"))
    for k in ("arch", "n_layers", "d_model", "n_heads", "ffn_dim", "activation", "norm", "bias", "vocab_size"):
        assert getattr(again.model, k) == getattr(cfg.model, k), k
    assert again.model.init_from == os.path.abspath(out)


@pytest.mark.parametrize(
    "override,field",
    [
        ("--model.bias=false", "model.bias"),
        ("--model.activation=relu", "model.activation"),
        ("--model.n_kv_heads=2", "model.n_kv_heads"),
    ],
)
def test_export_refuses_what_hf_cannot_express(tmp_path, override, field):
    cfg = _cfg(str(tmp_path / "a"), override)
    with pytest.raises(hf.ExportError, match=field):
        hf.hf_config(cfg.model)
    # and OPT's hard-coded LayerNorm eps
    opt = _cfg(str(tmp_path / "b"), *FAMILIES["opt"], "--model.norm_eps=1e-6")
    with pytest.raises(hf.ExportError, match="model.norm_eps"):
        hf.hf_config(opt.model)


def test_export_cli_refuses_cleanly(tmp_path, capsys):
    from dilocox.cli import main

    assert main(["export", str(tmp_path / "nope"), "--to", "hf", str(tmp_path / "out")]) == 2
    assert "config.yaml" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")


def test_trained_bpe_ships_as_the_hf_tokenizer(tmp_path):
    """A run's trained BPE is the exported tokenizer.json: transformers encodes like dilocox, EOT is eos."""
    from dilocox.data.tokenizer import train_bpe

    docs = [f"def f{i}(x):\n    return x * {i}  # naïve ✓\n" for i in range(200)]
    tok = train_bpe(docs, 300)
    cfg = _cfg(str(tmp_path / "a"), "--model.vocab_size=320")
    out = str(tmp_path / "hf")
    hf.save_hf_dir(out, cfg.model, build_model(cfg.model).gather_full_state_dict(), tok)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    text = "def f7(y):\n    return y * 12  # naïve ✓ 日本"
    assert theirs(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert len(tok.encode(text)) < len(text.encode())  # merges are used, not bytes
    assert theirs.eos_token_id == tok.eot_id
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["eos_token_id"] == tok.eot_id


@pytest.mark.slow  # 2 replicas: ~30 s alone on 2 cores
def test_diloco_export_is_theta_and_mid_run_checkpoint_is_refused(tmp_path):
    """DiLoCo: the final checkpoint's model state is θ (the same on both replicas) and is what export writes;
    a mid-run checkpoint (replica-local params) is refused unless --replica-params."""
    from dilocox import checkpoint as ckpt
    from dilocox.checkpoint.full import final_model, full_tensors
    from dilocox.cli import main

    run_dir = str(tmp_path / "run")
    run_ranks(
        2,
        _train,
        run_dir,
        [
            "--parallel.replicas=2",
            "--outer.method=diloco",
            "--outer.sync_every=2",
            "--checkpoint.every=3",
            "--checkpoint.keep=5",
            "--train.steps=6",
        ],
    )
    cfg = load_config(os.path.join(run_dir, "config.yaml"))
    mid, last = ckpt.complete_steps(os.path.join(run_dir, "checkpoints"))
    r0, r1 = (full_tensors(last, f"replica{r}/model") for r in (0, 1))
    for k in r0:
        assert torch.equal(r0[k], r1[k]), k  # θ: identical on every replica after finish()
    assert mid.endswith("step_00000004")  # due at 3, saved at the next outer sync (nothing crosses between syncs)
    m0, m1 = (full_tensors(mid, f"replica{r}/model") for r in (0, 1))
    assert all(torch.equal(m0[k], m1[k]) for k in m0)  # saved right after a sync: θ on both replicas
    with pytest.raises(ckpt.CheckpointError, match="mid-run"):
        final_model(mid, cfg.model)
    assert main(["export", run_dir, "--to", "hf", str(tmp_path / "mid"), "--checkpoint", mid]) == 2
    assert main(["export", run_dir, "--to", "hf", str(tmp_path / "mid"), "--checkpoint", mid, "--replica-params"]) == 0
    out = str(tmp_path / "hf")
    assert main(["export", run_dir, "--to", "hf", out]) == 0
    back = hf.load_hf_full_state_dict(out, cfg.model)
    for k in r0:
        assert torch.equal(back[k], r0[k]), k


@pytest.mark.slow
def test_export_of_a_subspace_model_is_its_dense_equivalent(tmp_path):
    """Issue 24 item 2: a model trained with model.subspace_rank (k-wide out-projections and embedding, fixed parts
    rebuilt from the shape) exports as the dense GPT-2 with the same function: transformers' logits equal ours."""
    from dilocox import checkpoint as ckpt
    from dilocox.checkpoint.full import final_model
    from dilocox.cli import main

    run_dir, out = str(tmp_path / "run"), str(tmp_path / "hf")
    run_ranks(1, _train, run_dir, ["--model.subspace_rank=8"])
    cfg = load_config(os.path.join(run_dir, "config.yaml"))
    full = final_model(ckpt.find_latest(os.path.join(run_dir, "checkpoints")), cfg.model)
    assert cfg.model.subspace_rank == 8 and full["embed.weight"].shape == (256, 8)
    assert main(["export", run_dir, "--to", "hf", out]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = _dilocox_model(cfg.model, full)
    x = _tokens()
    with torch.no_grad():
        a, b = ours(x), theirs(x).logits
    assert a.abs().max() > 0.1
    torch.testing.assert_close(b, a, rtol=1e-4, atol=2e-5)
