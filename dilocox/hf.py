"""Hugging Face <-> dilocox: architecture mapping for GPT2LMHeadModel, OPTForCausalLM, Qwen2ForCausalLM.

Everything here works on FULL (unsharded, 1-process) state dicts keyed by dilocox's
layout-independent names (``layers.7.attn.q_proj.weight``); ``dilocox.reshard`` gathers one
from any checkpoint layout and ``StageModel.load_full_state_dict`` splits one over any layout.
Neither direction needs ``transformers``: ``config.json`` is written/read as JSON and the
weights go through ``safetensors`` (``transformers`` is only used by the tests, as the oracle).

Which dilocox configs have an exact HF equivalent (anything else is refused, never approximated):

======= ================= ==========================================================================
arch    HF class          required fields (besides any sizes)
======= ================= ==========================================================================
gpt2    GPT2LMHeadModel   layernorm, gelu (tanh approx = HF gelu_new), learned positions, bias: true,
                          qkv_bias true/unset, no GQA
opt     OPTForCausalLM    layernorm with eps 1e-5 (HF hard-codes it), relu, learned positions
                          (written with OPT's 2 offset rows in front), qkv_bias == bias, no GQA
qwen    Qwen2ForCausalLM  rmsnorm, swiglu, rope (default scaling), bias: false, qkv_bias: true
======= ================= ==========================================================================

Tied or untied LM head both map exactly (``tie_word_embeddings``). Import also reads base-model checkpoints
(GPT2Model, OPTModel, Qwen2Model, as the hub's gpt2 and opt-* are saved): tied, their head is the embedding.
dilocox's residual dropout has no Qwen2 counterpart (Qwen2 only has attention dropout); it only acts in training mode.
"""

from __future__ import annotations

import json
import os
import re

import torch

from dilocox.config import ConfigError, ModelConfig
from dilocox.fsutil import atomic_path, atomic_write_text

HF_CLASSES = {"gpt2": "GPT2LMHeadModel", "opt": "OPTForCausalLM", "qwen": "Qwen2ForCausalLM"}
MODEL_TYPES = {"gpt2": "gpt2", "opt": "opt", "qwen": "qwen2"}
OPT_POS_OFFSET = 2  # HF's OPTLearnedPositionalEmbedding looks up row position + 2


class ExportError(ValueError):
    """A dilocox model has no exact Hugging Face equivalent (or an HF model no dilocox one)."""


def _qkv_bias(m: ModelConfig) -> bool:
    return m.bias if m.qkv_bias is None else bool(m.qkv_bias)


def check_exportable(m: ModelConfig) -> str:
    """The HF family of ``m`` (gpt2 | opt | qwen) or ExportError naming the field with no HF equivalent."""
    if m.arch not in HF_CLASSES:
        raise ExportError(f"model.arch={m.arch!r} has no Hugging Face mapping; supported: {sorted(HF_CLASSES)}")
    want = {
        "gpt2": {"norm": "layernorm", "activation": "gelu", "pos_emb": "learned", "bias": True, "qkv_bias": True},
        "opt": {"norm": "layernorm", "activation": "relu", "pos_emb": "learned", "norm_eps": 1e-5, "qkv_bias": m.bias},
        "qwen": {"norm": "rmsnorm", "activation": "swiglu", "pos_emb": "rope", "bias": False, "qkv_bias": True},
    }[m.arch]
    for field, value in want.items():
        have = _qkv_bias(m) if field == "qkv_bias" else getattr(m, field)
        if have != value:
            raise ExportError(
                f"model.{field}={have!r} has no equivalent in {HF_CLASSES[m.arch]} (needs {value!r}); "
                f"this model cannot be exported exactly as arch {m.arch}"
            )
    if m.arch in ("gpt2", "opt") and m.kv_heads != m.n_heads:
        raise ExportError(
            f"model.n_kv_heads={m.n_kv_heads} (grouped-query attention) has no equivalent in "
            f"{HF_CLASSES[m.arch]}; only arch qwen exports GQA"
        )
    if m.d_model % m.n_heads:
        raise ExportError(f"model.d_model={m.d_model} is not a multiple of model.n_heads={m.n_heads}")
    return m.arch


def hf_config(m: ModelConfig, eot_id: int = 0) -> dict:
    """``config.json`` of the HF model equivalent to ``m`` (checks with :func:`check_exportable`)."""
    fam = check_exportable(m)
    common = {
        "architectures": [HF_CLASSES[fam]],
        "model_type": MODEL_TYPES[fam],
        "vocab_size": m.vocab_size,
        "tie_word_embeddings": bool(m.tie_embeddings),
        "dtype": "float32",
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "pad_token_id": None,
        "use_cache": True,
    }
    if fam == "gpt2":
        return {
            **common,
            "n_embd": m.d_model,
            "n_layer": m.n_layers,
            "n_head": m.n_heads,
            "n_inner": m.ffn_dim,
            "n_positions": m.max_seq_len,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": m.norm_eps,
            "resid_pdrop": m.dropout,
            "embd_pdrop": m.dropout,
            "attn_pdrop": m.dropout,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "initializer_range": m.init_std,
        }
    if fam == "opt":
        return {
            **common,
            "hidden_size": m.d_model,
            "num_hidden_layers": m.n_layers,
            "num_attention_heads": m.n_heads,
            "ffn_dim": m.ffn_dim,
            "max_position_embeddings": m.max_seq_len,
            "activation_function": "relu",
            "do_layer_norm_before": True,
            "word_embed_proj_dim": m.d_model,
            "enable_bias": bool(m.bias),
            "layer_norm_elementwise_affine": True,
            "dropout": m.dropout,
            "attention_dropout": m.dropout,
            "activation_dropout": 0.0,
            "layerdrop": 0.0,
            "init_std": m.init_std,
        }
    return {
        **common,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.kv_heads,
        "intermediate_size": m.ffn_dim,
        "max_position_embeddings": m.max_seq_len,
        "hidden_act": "silu",
        "rms_norm_eps": m.norm_eps,
        "use_sliding_window": False,
        "sliding_window": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(m.rope_theta)},
        "attention_dropout": m.dropout,
        "initializer_range": m.init_std,
    }


def _hf_refuse(src: str, what: str):
    raise ExportError(f"{src}: {what} has no dilocox equivalent")


def _hf_need(cfg: dict, src: str, key, ok, what=None) -> None:
    """Refuse ``cfg[key]`` when it is set (not None) and ``ok`` rejects it."""
    if key in cfg and cfg[key] is not None and not ok(cfg[key]):
        _hf_refuse(src, what or f"{key}={cfg[key]!r}")


def _gpt2_fields(cfg: dict, src: str, tie: bool) -> dict:
    """``model.*`` of an HF GPT-2 config (:func:`model_fields_from_hf`)."""
    _hf_need(cfg, src, "activation_function", lambda v: v in ("gelu_new", "gelu_pytorch_tanh"))
    _hf_need(cfg, src, "scale_attn_weights", lambda v: v is True)
    _hf_need(cfg, src, "scale_attn_by_inverse_layer_idx", lambda v: v is False)
    _hf_need(cfg, src, "reorder_and_upcast_attn", lambda v: v is False)
    d = cfg.get("n_embd", 768)
    return {
        "arch": "gpt2",
        "n_layers": cfg.get("n_layer", 12),
        "n_heads": cfg.get("n_head", 12),
        "n_kv_heads": None,
        "d_model": d,
        "d_ff": cfg.get("n_inner") or 4 * d,
        "vocab_size": cfg.get("vocab_size", 50257),
        "max_seq_len": cfg.get("n_positions", 1024),
        "norm": "layernorm",
        "norm_eps": cfg.get("layer_norm_epsilon", 1e-5),
        "activation": "gelu",
        "pos_emb": "learned",
        "bias": True,
        "qkv_bias": True,
        "tie_embeddings": tie,
        "dropout": 0.0,
    }


def _opt_fields(cfg: dict, src: str, tie: bool) -> dict:
    """``model.*`` of an HF OPT config (:func:`model_fields_from_hf`)."""
    _hf_need(cfg, src, "do_layer_norm_before", lambda v: v is True, "do_layer_norm_before=false (post-LN, OPT-350m)")
    _hf_need(cfg, src, "activation_function", lambda v: v == "relu")
    _hf_need(cfg, src, "layer_norm_elementwise_affine", lambda v: v is True)
    d = cfg.get("hidden_size", 768)
    _hf_need(
        cfg, src, "word_embed_proj_dim", lambda v: v == d, "word_embed_proj_dim != hidden_size (projected embeddings)"
    )
    bias = bool(cfg.get("enable_bias", True))
    return {
        "arch": "opt",
        "n_layers": cfg.get("num_hidden_layers", 12),
        "n_heads": cfg.get("num_attention_heads", 12),
        "n_kv_heads": None,
        "d_model": d,
        "d_ff": cfg.get("ffn_dim", 3072),
        "vocab_size": cfg.get("vocab_size", 50272),
        "max_seq_len": cfg.get("max_position_embeddings", 2048),
        "norm": "layernorm",
        "norm_eps": 1e-5,
        "activation": "relu",
        "pos_emb": "learned",
        "bias": bias,
        "qkv_bias": bias,
        "tie_embeddings": tie,
        "dropout": 0.0,
    }


def _qwen2_fields(cfg: dict, src: str, tie: bool) -> dict:
    """``model.*`` of an HF Qwen2 config (:func:`model_fields_from_hf`)."""
    _hf_need(cfg, src, "hidden_act", lambda v: v == "silu")
    _hf_need(cfg, src, "use_sliding_window", lambda v: v is False, "use_sliding_window=true")
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rp.get("rope_type", rp.get("type", "default")) != "default":
        _hf_refuse(src, f"rope scaling {rp!r}")
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    d, h = cfg.get("hidden_size", 4096), cfg.get("num_attention_heads", 32)
    _hf_need(cfg, src, "head_dim", lambda v: v == d // h, "head_dim != hidden_size / num_attention_heads")
    return {
        "arch": "qwen",
        "n_layers": cfg.get("num_hidden_layers", 32),
        "n_heads": h,
        "n_kv_heads": cfg.get("num_key_value_heads") or h,
        "d_model": d,
        "d_ff": cfg.get("intermediate_size", 22016),
        "vocab_size": cfg.get("vocab_size", 151936),
        "max_seq_len": cfg.get("max_position_embeddings", 32768),
        "norm": "rmsnorm",
        "norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "activation": "swiglu",
        "pos_emb": "rope",
        "rope_theta": float(theta),
        "bias": False,
        "qkv_bias": True,
        "tie_embeddings": tie,
        "dropout": 0.0,
    }


def model_fields_from_hf(cfg: dict) -> dict:
    """dilocox ``model.*`` values equivalent to an HF ``config.json`` (ExportError for unsupported features)."""
    mt = cfg.get("model_type")
    src = f"config.json (model_type={mt!r})"
    # (absent: the default of the model type's HF config class, as transformers reads it: Qwen2Config unties)
    tie = bool(cfg.get("tie_word_embeddings", mt != "qwen2"))
    if mt == "gpt2":
        return _gpt2_fields(cfg, src, tie)
    if mt == "opt":
        return _opt_fields(cfg, src, tie)
    if mt == "qwen2":
        return _qwen2_fields(cfg, src, tie)
    raise ExportError(f"{src}: only model_type gpt2, opt and qwen2 can be imported")


# --------------------------------------------------------------------------- weight names


def _layer_map(fam: str, i: int) -> dict[str, str]:
    """dilocox layer-i name -> HF name (for the 1:1 tensors; GPT-2's fused/transposed ones apart)."""
    if fam == "gpt2":
        h = f"transformer.h.{i}."
        return {
            "ln_1.weight": h + "ln_1.weight",
            "ln_1.bias": h + "ln_1.bias",
            "ln_2.weight": h + "ln_2.weight",
            "ln_2.bias": h + "ln_2.bias",
            "attn.o_proj.bias": h + "attn.c_proj.bias",
            "mlp.up_proj.bias": h + "mlp.c_fc.bias",
            "mlp.down_proj.bias": h + "mlp.c_proj.bias",
        }
    if fam == "opt":
        h = f"model.decoder.layers.{i}."
        out = {
            "ln_1.weight": h + "self_attn_layer_norm.weight",
            "ln_1.bias": h + "self_attn_layer_norm.bias",
            "ln_2.weight": h + "final_layer_norm.weight",
            "ln_2.bias": h + "final_layer_norm.bias",
        }
        for ours, theirs in (
            ("attn.q_proj", "self_attn.q_proj"),
            ("attn.k_proj", "self_attn.k_proj"),
            ("attn.v_proj", "self_attn.v_proj"),
            ("attn.o_proj", "self_attn.out_proj"),
            ("mlp.up_proj", "fc1"),
            ("mlp.down_proj", "fc2"),
        ):
            out[ours + ".weight"], out[ours + ".bias"] = h + theirs + ".weight", h + theirs + ".bias"
        return out
    h = f"model.layers.{i}."
    out = {"ln_1.weight": h + "input_layernorm.weight", "ln_2.weight": h + "post_attention_layernorm.weight"}
    for p in ("q_proj", "k_proj", "v_proj"):
        out[f"attn.{p}.weight"], out[f"attn.{p}.bias"] = h + f"self_attn.{p}.weight", h + f"self_attn.{p}.bias"
    out["attn.o_proj.weight"] = h + "self_attn.o_proj.weight"
    for p in ("gate_proj", "up_proj", "down_proj"):
        out[f"mlp.{p}.weight"] = h + f"mlp.{p}.weight"
    return out


def _top_map(fam: str) -> dict[str, str]:
    if fam == "gpt2":
        return {
            "embed.weight": "transformer.wte.weight",
            "pos_embed.weight": "transformer.wpe.weight",
            "norm_f.weight": "transformer.ln_f.weight",
            "norm_f.bias": "transformer.ln_f.bias",
            "head.weight": "lm_head.weight",
        }
    if fam == "opt":
        return {
            "embed.weight": "model.decoder.embed_tokens.weight",
            "norm_f.weight": "model.decoder.final_layer_norm.weight",
            "norm_f.bias": "model.decoder.final_layer_norm.bias",
            "head.weight": "lm_head.weight",
        }
    return {
        "embed.weight": "model.embed_tokens.weight",
        "norm_f.weight": "model.norm.weight",
        "head.weight": "lm_head.weight",
    }


def to_hf_state_dict(m: ModelConfig, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors (fp32, contiguous, no shared storage) of a full dilocox state dict."""
    fam = check_exportable(m)
    full = {k: v.detach().to("cpu", torch.float32) for k, v in full.items()}
    out: dict[str, torch.Tensor] = {}
    top = _top_map(fam)
    for ours, theirs in top.items():
        if ours == "head.weight" and m.tie_embeddings:
            continue  # HF re-ties lm_head to the embedding
        if ours == "pos_embed.weight" and fam == "opt":
            continue
        out[theirs] = full[ours]
    if fam == "opt":
        pos = full["pos_embed.weight"]
        out["model.decoder.embed_positions.weight"] = torch.cat([pos.new_zeros(OPT_POS_OFFSET, pos.shape[1]), pos])
    for i in range(m.n_layers):
        p = f"layers.{i}."
        for ours, theirs in _layer_map(fam, i).items():
            if p + ours in full:
                out[theirs] = full[p + ours]
        if fam == "gpt2":  # Conv1D stores W^T; q, k, v fused in c_attn
            h = f"transformer.h.{i}."
            qkv = [full[p + f"attn.{n}_proj.weight"] for n in "qkv"]
            out[h + "attn.c_attn.weight"] = torch.cat(qkv, 0).t()
            out[h + "attn.c_attn.bias"] = torch.cat([full[p + f"attn.{n}_proj.bias"] for n in "qkv"])
            out[h + "attn.c_proj.weight"] = full[p + "attn.o_proj.weight"].t()
            out[h + "mlp.c_fc.weight"] = full[p + "mlp.up_proj.weight"].t()
            out[h + "mlp.c_proj.weight"] = full[p + "mlp.down_proj.weight"].t()
    return {k: v.contiguous().clone() for k, v in out.items()}


def _hf_names(fam: str, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``hf`` named as in the *ForCausalLM class: a base-model checkpoint (the hub's openai-community/gpt2,
    facebook/opt-*) lacks the ``transformer.`` (gpt2) / ``model.`` prefix; transformers adds it when loading."""
    pre, emb = {"gpt2": ("transformer.", "wte.weight"), "opt": ("model.", "decoder.embed_tokens.weight")}.get(
        fam, ("model.", "embed_tokens.weight")
    )
    if pre + emb in hf or emb not in hf:
        return hf
    return {k if k.startswith(("lm_head.", pre)) else pre + k: v for k, v in hf.items()}


def from_hf_state_dict(
    m: ModelConfig, hf: dict[str, torch.Tensor], src: str = "HF checkpoint"
) -> dict[str, torch.Tensor]:
    """Full dilocox state dict of HF tensors (inverse of :func:`to_hf_state_dict`); also of a base-model checkpoint
    (GPT2Model, OPTModel, Qwen2Model: no ``transformer.``/``model.`` prefix, no lm_head; see :func:`_hf_names`)."""
    fam = check_exportable(m)
    hf = _hf_names(fam, hf)

    def get(name):
        if name not in hf:
            raise ExportError(f"{src} has no tensor {name!r}; it is not a {HF_CLASSES[fam]} checkpoint of this shape")
        return hf[name].to(torch.float32)

    out: dict[str, torch.Tensor] = {}
    for ours, theirs in _top_map(fam).items():
        if ours == "pos_embed.weight" and fam == "opt":
            continue
        if ours == "head.weight" and theirs not in hf:
            if not m.tie_embeddings:
                raise ExportError(f"{src} has no tensor {theirs!r} and config.json has tie_word_embeddings=false: "
                                  "a base-model checkpoint without an LM head has no dilocox equivalent")  # fmt: skip
            out[ours] = get(_top_map(fam)["embed.weight"])  # tied in HF: the head is the embedding
            continue
        out[ours] = get(theirs)
    if fam == "opt":
        out["pos_embed.weight"] = get("model.decoder.embed_positions.weight")[OPT_POS_OFFSET:]
    d, hd = m.d_model, m.head_dim
    for i in range(m.n_layers):
        p = f"layers.{i}."
        for ours, theirs in _layer_map(fam, i).items():
            if (
                ours.endswith(".bias")
                and ours != "ln_1.bias"
                and ours != "ln_2.bias"
                and not (_qkv_bias(m) if ours.startswith("attn.") and ours[5] in "qkv" else m.bias)
            ):
                continue
            out[p + ours] = get(theirs)
        if fam == "gpt2":
            h = f"transformer.h.{i}."
            w, b = get(h + "attn.c_attn.weight").t(), get(h + "attn.c_attn.bias")
            sizes = [m.n_heads * hd, m.kv_heads * hd, m.kv_heads * hd]
            for n, wi, bi in zip("qkv", w.split(sizes, 0), b.split(sizes)):
                out[p + f"attn.{n}_proj.weight"], out[p + f"attn.{n}_proj.bias"] = wi, bi
            out[p + "attn.o_proj.weight"] = get(h + "attn.c_proj.weight").t()
            out[p + "mlp.up_proj.weight"] = get(h + "mlp.c_fc.weight").t()
            out[p + "mlp.down_proj.weight"] = get(h + "mlp.c_proj.weight").t()
    del d
    return {k: v.contiguous().clone() for k, v in out.items()}


# --------------------------------------------------------------------------- directories


def byte_tokenizer_json(path: str) -> None:
    """A ``tokenizers`` tokenizer.json that maps text to its UTF-8 bytes exactly like dilocox's
    ByteTokenizer (id = byte value): GPT-2's byte-level alphabet as a 256-entry BPE vocabulary
    with no merges, so every byte stays one token, and the byte-level decoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins of the bytes
    # ByteLevel's byte -> char table (GPT-2's bytes_to_unicode): printable latin-1 bytes map to
    # themselves, the other 68 bytes to chr(256 + k) in byte order.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    if set(table.values()) != set(alphabet):
        raise RuntimeError(
            "tokenizers' ByteLevel alphabet is not GPT-2's bytes_to_unicode table; cannot build the byte tokenizer"
        )
    vocab = {table[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(path)


def save_hf_dir(out_dir: str, m: ModelConfig, full: dict[str, torch.Tensor], tokenizer=None) -> None:
    """Write ``config.json``, ``model.safetensors`` and the tokenizer (``tokenizer.json`` +
    ``tokenizer_config.json``) of the dilocox model ``m`` with weights ``full`` into ``out_dir``."""
    from safetensors.torch import save_file

    eot = int(getattr(tokenizer, "eot_id", 0))
    cfg = hf_config(m, eot)
    tensors = to_hf_state_dict(m, full)
    os.makedirs(out_dir, exist_ok=True)
    with atomic_path(os.path.join(out_dir, "model.safetensors")) as tmp:
        save_file(tensors, tmp, metadata={"format": "pt", "exported_by": "dilocox"})
    atomic_write_text(os.path.join(out_dir, "config.json"), json.dumps(cfg, indent=2))
    if tokenizer is not None:
        with atomic_path(os.path.join(out_dir, "tokenizer.json")) as tok_path:
            if getattr(tokenizer, "kind", "byte") == "bpe":  # the run's BPE, or the pretrained tokenizer.json it used
                tokenizer.tok.save(tok_path)
                eos = tokenizer.tok.id_to_token(tokenizer.eot_id)
                special = {"eos_token": eos, "bos_token": eos}
            else:  # no eos/bos: transformers would match byte 0's stand-in "Ā" in raw text (U+0100 -> id 0)
                byte_tokenizer_json(tok_path)  # config.json's eos_token_id 0 still stops HF generate
                special = {}
        meta = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "add_prefix_space": False}
        meta.update(model_max_length=m.max_seq_len, dilocox_tokenizer=tokenizer.kind)
        atomic_write_text(os.path.join(out_dir, "tokenizer_config.json"), json.dumps(meta, indent=2))
    fields = {k: getattr(m, k) for k in m.__dataclass_fields__}
    atomic_write_text(os.path.join(out_dir, "dilocox_model.json"), json.dumps(fields, indent=2))


def _is_path(name: str) -> bool:
    """Whether ``name`` can only be a local path: a hub id is ``NAME`` or ``ORG/NAME`` of letters, digits, ``-_.``
    (not starting with ``.``); ``runs/typo`` is a path where ``runs`` is a directory here."""
    if name.startswith(("/", ".", "~")) or name.count("/") > 1 or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name):
        return True
    return "/" in name and os.path.isdir(name.split("/")[0])


def resolve_hf_dir(name: str) -> str:
    """A local HF model directory, or (where a network exists) a hub name fetched with huggingface_hub."""
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ExportError(f"{name} has no config.json; it is not a Hugging Face model directory")
        return path
    is_file = os.path.exists(path)
    where = f"{name} is a file, not a directory" if is_file else f"no such directory: {name}"
    where += f" (resolved to {os.path.abspath(path)})"
    if _is_path(name):  # a typo in a local path: no hub request
        what = "is a file" if is_file else "does not exist"
        raise ExportError(f"{where}: the path {what}; give a local Hugging Face model directory")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ExportError(f"{where}, and huggingface_hub is not installed to fetch {name!r} from the hub") from None
    try:
        return snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, auth, ...
        raise ExportError(
            f"{where}, and {name!r} could not be fetched from the hub as a model id "
            f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}); pass a local "
            "directory with config.json and *.safetensors"
        ) from None


def read_hf_config(hf_dir: str) -> dict:
    with open(os.path.join(hf_dir, "config.json")) as f:
        return json.load(f)


def load_hf_tensors(hf_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    if not files:
        raise ExportError(
            f"{hf_dir} has no *.safetensors weights (pytorch_model.bin is not read); "
            "convert it with transformers' save_pretrained(safe_serialization=True)"
        )
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(os.path.join(hf_dir, f)))
    return out


def check_model_matches(m: ModelConfig, hf_dir: str) -> None:
    """ConfigError naming the first ``model.*`` field that differs from the HF checkpoint's architecture."""
    want = model_fields_from_hf(read_hf_config(hf_dir))
    for k, v in want.items():
        have = getattr(m, k)
        if k == "tie_embeddings" and v and not have:
            continue  # a tied HF head is loaded as an untied copy (same function; trained separately)
        if k == "n_kv_heads":
            have, v = m.kv_heads, v or m.n_heads
        if k == "qkv_bias":
            have = _qkv_bias(m)
        if k == "d_ff":
            have = m.ffn_dim
        if k == "dropout":
            continue
        if k == "vocab_size" and have >= v:
            continue  # padded vocabulary (e.g. to a multiple of parallel.tensor): extra rows are initialised
        if k == "max_seq_len" and have <= v:
            continue  # a shorter context uses the first rows of the position table
        if k == "norm_eps" and abs(have - v) <= 1e-12:
            continue
        if have != v:
            raise ConfigError(
                f"model.{k}={have!r} but model.init_from={hf_dir} has {v!r}; set --model.{k}={v} "
                f"(`dilocox import {hf_dir}` prints the whole model section)"
            )


def load_hf_full_state_dict(hf_dir: str, m: ModelConfig, init=None) -> dict[str, torch.Tensor]:
    """Full dilocox state dict for config ``m`` from an HF directory (``m`` must match it, see
    :func:`check_model_matches`). A larger ``model.vocab_size`` keeps the rows past the HF vocabulary
    from ``init()`` (a callable giving the freshly initialised full state dict, e.g. the stage's
    ``gather_full_state_dict``; called on every TP rank alike, only when padding is needed); a shorter
    ``max_seq_len`` takes the first position rows."""
    check_model_matches(m, hf_dir)
    hf_fields = model_fields_from_hf(read_hf_config(hf_dir))
    hm = ModelConfig(**{**{k: getattr(m, k) for k in m.__dataclass_fields__}, **hf_fields})
    hm.tie_embeddings = hf_fields["tie_embeddings"]
    full = from_hf_state_dict(hm, load_hf_tensors(hf_dir), src=hf_dir)
    if "pos_embed.weight" in full:
        full["pos_embed.weight"] = full["pos_embed.weight"][: m.max_seq_len]
    if m.vocab_size > hm.vocab_size:
        if init is None:
            raise ConfigError(
                f"model.vocab_size={m.vocab_size} > {hm.vocab_size} of {hf_dir} needs initial rows for the padding"
            )
        init_sd = init()
        for k in ("embed.weight", "head.weight"):
            if k not in init_sd:  # another pipeline stage's tensor: keep the HF rows, padded with zeros
                full[k] = torch.cat([full[k], full[k].new_zeros(m.vocab_size - hm.vocab_size, full[k].shape[1])])
                continue
            pad = init_sd[k][hm.vocab_size :].to(full[k].device, full[k].dtype)  # (init: the model's device)
            full[k] = torch.cat([full[k], pad])
    return full
