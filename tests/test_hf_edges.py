"""Hugging Face edges: base-model checkpoints (no ``transformer.`` / ``model.`` prefix, no lm_head), the exported
byte tokenizer on text containing U+0100, and ``dilocox generate`` stopping at end-of-document / refusing bad flags."""

import json

import pytest
import torch

from dilocox import hf
from dilocox.config import ModelConfig
from dilocox.data.tokenizer import ByteTokenizer
from dilocox.model.transformer import build_model


def _randomize(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_((1.0 if "norm" in n or "ln" in n else 0.0) + 0.2 * torch.randn(p.shape, generator=g))


def _dilocox(mcfg, full):
    m = build_model(mcfg, device="meta")
    m.to_empty(device="cpu")
    m.load_full_state_dict(full)
    return m.eval()


def _base_model(name):
    t = pytest.importorskip("transformers")
    if name == "gpt2":
        return t.GPT2Model(t.GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=4, n_positions=64))
    if name == "opt":
        cfg = t.OPTConfig(
            vocab_size=300,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
        )
        return t.OPTModel(cfg)
    cfg = t.Qwen2Config(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=name == "qwen2",
    )
    return t.Qwen2Model(cfg)


@pytest.mark.parametrize("name", ["gpt2", "opt", "qwen2"])
def test_base_model_checkpoint_imports_like_transformers(tmp_path, name):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    base = _base_model(name)
    _randomize(base)
    d = str(tmp_path / name)
    base.save_pretrained(d)
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    x = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(x).logits
    fields = hf.model_fields_from_hf(hf.read_hf_config(d))
    assert fields["tie_embeddings"]  # a base GPT-2 / OPT (and this Qwen2) is tied: lm_head = the embedding
    mcfg = ModelConfig(**fields)
    generate_path = _dilocox(mcfg, hf.from_hf_state_dict(mcfg, hf.load_hf_tensors(d), src=d))
    init_from_path = _dilocox(mcfg, hf.load_hf_full_state_dict(d, mcfg))
    with torch.no_grad():
        for model in (generate_path, init_from_path):
            assert (model(x) - want).abs().max().item() < 1e-5


def test_untied_base_checkpoint_without_lm_head_is_refused(tmp_path):
    pytest.importorskip("transformers")
    base = _base_model("qwen2-untied")
    d = str(tmp_path / "q")
    base.save_pretrained(d)
    mcfg = ModelConfig(**hf.model_fields_from_hf(hf.read_hf_config(d)))
    assert not mcfg.tie_embeddings
    with pytest.raises(hf.ExportError, match="lm_head.weight"):
        hf.from_hf_state_dict(mcfg, hf.load_hf_tensors(d), src=d)


def _export_byte_model(d, head_row0=None):
    m = ModelConfig(arch="qwen", n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, d_ff=64, vocab_size=256,
                    max_seq_len=64, norm="rmsnorm", activation="swiglu", pos_emb="rope", bias=False, qkv_bias=True,
                    tie_embeddings=False, init_std=0.2)  # fmt: skip
    full = build_model(m, seed=3).gather_full_state_dict()
    if head_row0 is not None:
        full["head.weight"][0] = full["head.weight"][head_row0] * 1.2
    hf.save_hf_dir(d, m, full, ByteTokenizer())
    return m, full


def test_exported_byte_tokenizer_encodes_u0100_as_bytes(tmp_path):
    transformers = pytest.importorskip("transformers")
    d = str(tmp_path / "hf")
    _export_byte_model(d)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    for text in ("xĀy", "Ā", "héllo Āā € \x00 end"):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == ByteTokenizer().encode(text)
        assert tok.decode(ids) == text
    with open(f"{d}/config.json") as f:
        assert json.load(f)["eos_token_id"] == 0  # HF generate still stops at byte 0


def test_generate_stops_at_end_of_document_like_transformers(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from dilocox.cli import main
    from dilocox.generate import load_model, sample

    d = str(tmp_path / "hf")
    prompt, n = "def f(x):", 20
    _export_byte_model(d)
    model, tok, _ = load_model(d)
    free = sample(model, tok.encode(prompt), 6, temperature=0.0)
    # the head row of id 0 becomes a scaled copy of a token greedy decoding picks a few steps in
    _export_byte_model(d, head_row0=next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i]))
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode(prompt)])
    out = ref.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    theirs = out[0, ids.shape[1] :].tolist()
    assert theirs[-1] == 0 and 0 not in theirs[:-1] and 1 < len(theirs) < n  # HF stopped at eos_token_id 0
    assert main(["generate", d, "--prompt", prompt, "--temperature", "0", "--max-new-tokens", str(n)]) == 0
    assert capsys.readouterr().out == prompt + tok.decode(theirs) + "\n"
    assert main(["generate", d, "--prompt", prompt, "--temperature", "0", "--max-new-tokens", str(n), "--no-stop"]) == 0
    model, tok, _ = load_model(d)
    assert capsys.readouterr().out == prompt + tok.decode(sample(model, tok.encode(prompt), n, 0.0)) + "\n"
    assert sample(model, tok.encode(prompt), n, 0.0, stop_id=0) == theirs


def test_hf_tokenizer_end_of_document_from_candidates(tmp_path):
    from tokenizers import Tokenizer, models

    from dilocox.generate import _HFTokenizer

    tok = Tokenizer(models.WordLevel(vocab={"<pad>": 0, "a": 1, "</s>": 2}, unk_token="<pad>"))
    tok.save(str(tmp_path / "tokenizer.json"))
    assert _HFTokenizer(str(tmp_path / "tokenizer.json")).eot_id == 2


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--device", "cuda"], ["--device cpu", "CUDA"]),
        (["--max-new-tokens", "-5"], ["--max-new-tokens"]),
        (["--max-new-tokens", "0"], ["--max-new-tokens"]),
        (["--temperature", "nan"], ["--temperature"]),
        (["--temperature", "inf"], ["--temperature"]),
    ],
)
def test_generate_bad_flags_are_one_line_errors(tmp_path, capsys, monkeypatch, flags, names):
    from dilocox.cli import main

    d = str(tmp_path / "hf")
    _export_byte_model(d)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["generate", d, "--prompt", "x", *flags]) == 2
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert cap.out == "" and len(err.splitlines()) == 1 and err.startswith("generate: ")
    for name in names:
        assert name in err


def test_qwen2_config_without_the_tie_key_is_untied_as_transformers_reads_it(tmp_path):
    """Bug: a qwen2 config.json without ``tie_word_embeddings`` was imported tied (the key's default of GPT-2 and
    OPT), so the checkpoint's own ``lm_head.weight`` was dropped for the embedding; transformers' Qwen2Config
    defaults to untied, and its logits are the reference."""
    t = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = t.Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    base = t.Qwen2ForCausalLM(cfg)
    _randomize(base)
    d = str(tmp_path / "q")
    base.save_pretrained(d)
    with open(f"{d}/config.json") as f:
        conf = json.load(f)
    conf.pop("tie_word_embeddings", None)
    with open(f"{d}/config.json", "w") as f:
        json.dump(conf, f)
    ref = t.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    x = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    mcfg = ModelConfig(**hf.model_fields_from_hf(hf.read_hf_config(d)))
    assert not mcfg.tie_embeddings
    ours = _dilocox(mcfg, hf.from_hf_state_dict(mcfg, hf.load_hf_tensors(d), src=d))
    with torch.no_grad():
        assert (ours(x) - ref(x).logits).abs().max().item() < 1e-5
