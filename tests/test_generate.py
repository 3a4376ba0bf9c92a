"""``dilocox generate``: deterministic for a fixed seed; greedy equals transformers' greedy decoding."""

import os

import pytest
import torch

from dilocox import hf
from dilocox.config import load_config
from dilocox.data.tokenizer import ByteTokenizer
from dilocox.generate import load_model, sample
from dilocox.model.transformer import build_model

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    cfg = load_config(
        os.path.join(ROOT, "configs", "model", "qwen-tiny.yaml"), ["--model.n_layers=2", "--model.init_std=0.2"]
    )
    out = str(tmp_path_factory.mktemp("gen") / "hf")
    hf.save_hf_dir(out, cfg.model, build_model(cfg.model, seed=5).gather_full_state_dict(), ByteTokenizer())
    return out


def test_same_seed_same_text_other_seed_other_text(hf_dir):
    model, tok, _ = load_model(hf_dir)
    ids = tok.encode("def main():")
    a = sample(model, ids, 24, temperature=1.0, top_k=0, seed=1)
    b = sample(model, ids, 24, temperature=1.0, top_k=0, seed=1)
    c = sample(model, ids, 24, temperature=1.0, top_k=0, seed=2)
    assert a == b and len(a) == 24
    assert a != c
    # top-k=1 is greedy whatever the seed and temperature
    g = sample(model, ids, 24, temperature=0.0, seed=0)
    assert sample(model, ids, 24, temperature=1.5, top_k=1, seed=9) == g
    # top-k keeps the draws inside the k most likely tokens at each step
    k = sample(model, ids, 8, temperature=1.0, top_k=3, seed=4)
    ctx = list(ids)
    for t in k:
        with torch.no_grad():
            top3 = torch.topk(model(torch.tensor([ctx]))[0, -1], 3).indices.tolist()
        assert t in top3
        ctx.append(t)


def test_greedy_equals_transformers_generate(hf_dir):
    transformers = pytest.importorskip("transformers")
    model, tok, _ = load_model(hf_dir)
    ids = tok.encode("import os\n")
    ours = sample(model, ids, 16, temperature=0.0)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = theirs.generate(
        torch.tensor([ids]),
        max_new_tokens=16,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
    )
    assert out[0, len(ids) :].tolist() == ours


def test_cli_deterministic_and_bad_input(hf_dir, capsys):
    from dilocox.cli import main

    args = ["generate", hf_dir, "--prompt", "x = ", "--max-new-tokens", "12", "--seed", "3", "--temperature", "1.0"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first and first.startswith("x = ")
    assert main(["generate", hf_dir, "--prompt", "x", "--temperature", "-1"]) == 2
    assert "--temperature" in capsys.readouterr().err
