"""The rules a configuration must satisfy, one checker per concern, each raising ``ConfigError``.

``ConfigError`` and the shared vocabulary live here: ``QUANT_KINDS`` (the one list of quantization kinds every
module imports), the allowed values of every choice field, and ``check_outer_schedule`` (the DiLoCo sync-schedule
rules, also called by the outer loop on sections that never went through validation). The ``check_*`` functions
each look at the sections they name; ``dilocox.config.root.validate`` calls them in a fixed order, so the first rule
broken is the one reported. Every message names the field, its value and the constraint, e.g. ``model.n_heads=6 is
not divisible by parallel.tensor=4``.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import os
from dataclasses import fields
from typing import Any
from urllib.parse import urlsplit

from dilocox.config.sections import (
    AdaptiveConfig,
    CompressConfig,
    DataConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    OuterConfig,
    ParallelConfig,
    SwarmConfig,
    TrainConfig,
)
from dilocox.trackers import WANDB_MISSING


class ConfigError(ValueError):
    """A configuration value is malformed or impossible. The message names the field."""


QUANT_KINDS = ("none", "fp16", "int8", "int4")  # compress.quant; the one list every module imports

QSUFFIX = ("", "-int8", "-int4")  # swarm.activations: each basis alone or with its quantizer
_CHOICES = {
    "model.arch": ("gpt2", "opt", "qwen"),
    "model.norm": ("layernorm", "rmsnorm"),
    "model.activation": ("gelu", "relu", "swiglu"),
    "model.pos_emb": ("learned", "rope"),
    "model.attn_backend": ("sdpa", "flash_attn", "te"),
    "model.linear_backend": ("torch", "fp8", "fp8_all"),
    "model.loss_backend": ("vocab_parallel", "torch"),
    "parallel.schedule": ("gpipe", "1f1b", "reference"),
    "data.source": ("stdlib", "prose", "docs", "text", "memmap", "hf"),
    "data.tokenizer": ("byte", "bpe"),
    "data.sampler": ("random", "epoch"),  # == dilocox.data.sampler.MODES (tests/test_data_sampling.py)
    "optim.schedule": ("cosine", "constant", "linear", "wsd", "wsd-sqrt"),
    "optim.name": ("adamw", "muon", "sgd"),
    "outer.method": ("none", "allreduce", "diloco", "cocktailsgd"),
    "outer.overlap": ("none", "delayed", "eager"),
    "outer.state_device": ("host", "device"),
    "outer.elastic.collectives": ("auto", "gloo", "authenticated"),
    "outer.streaming.pattern": ("sequential", "strided"),
    "outer.streaming.merge": ("mix", "replay"),
    "compress.quant": QUANT_KINDS,
    "compress.collective": ("auto", "allgather", "reduce_scatter"),
    "train.device": ("auto", "cpu", "cuda"),
    "train.dtype": ("auto", "fp32", "bf16"),
    "train.recompute": ("none", "full", "selective"),  # == dilocox.model.recompute.MODES (tests/test_recompute.py)
    "checkpoint.resume_finished": ("error", "skip"),
    "swarm.sync": ("swarm", "diloco"),
    "swarm.routing": ("iwrr", "random", "fixed"),
    # == dilocox.swarm.activations.CODECS (a test keeps them equal; config does not import the swarm package)
    "swarm.activations": ("none", "fp16", "int8", "int4", *(f"{b}{q}" for b in ("subspace", "colk") for q in QSUFFIX)),
}

_POSITIVE = (  # checked in this order; None (an unset optional) passes
    "model.n_layers",
    "model.n_heads",
    "model.n_kv_heads",
    "model.d_model",
    "model.d_ff",
    "model.vocab_size",
    "model.max_seq_len",
    "parallel.replicas",
    "parallel.data",
    "parallel.pipeline",
    "parallel.tensor",
    "parallel.microbatches",
    "train.steps",
    "train.batch_size",
    "train.seq_len",
    "outer.sync_every",
    "compress.group_size",
    "outer.streaming.fragments",
    "compress.lowrank.rank",
    "compress.adaptive.window",
    "log.every",
    "train.max_tokens",
    "parallel.timeout_s",
    "outer.timeout_s",
    "outer.warn_after_s",
    "train.stop_timeout_s",
    "data.max_bytes",
    "data.bpe_train_bytes",
    "log.profile_steps",
)

_NON_NEGATIVE = ("train.eval_batches", "checkpoint.every", "checkpoint.keep", "log.profile_start")

_RANGES = (  # (field, holds, the allowed range); a NaN fails every one (the loader already refuses non-finite floats)
    ("model.dropout", lambda v: 0 <= v < 1, "must be in [0, 1), e.g. 0.1 (0 = off)"),
    ("model.init_std", lambda v: v > 0, "must be > 0 (the initial weights' std), e.g. 0.02"),
    ("model.norm_eps", lambda v: v > 0, "must be > 0, e.g. 1e-5"),
    ("optim.betas", lambda v: all(0 <= b < 1 for b in v), "must each be in [0, 1), e.g. [0.9, 0.95]"),
    ("optim.eps", lambda v: v > 0, "must be > 0, e.g. 1e-8"),
    ("optim.weight_decay", lambda v: v >= 0, "must be >= 0 (0 = off), e.g. 0.1"),
    ("optim.grad_clip", lambda v: v >= 0, "must be >= 0 (0 = off), e.g. 1.0"),
    (
        "optim.decay_fraction",
        lambda v: 0 < v <= 1,
        "must be in (0, 1]: the share of the steps after the warm-up that decay",
    ),
)


def _fail(name: str, value: Any, constraint: str) -> None:
    raise ConfigError(f"{name}={value!r} {constraint}")


def _get(cfg: Any, dotted: str) -> Any:
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _positive(cfg: Any, *names: str) -> None:
    for name in names:
        v = _get(cfg, name)
        if v is not None and not v > 0:  # (NaN too)
            _fail(name, v, "must be > 0")


def check_outer_schedule(
    sync_every: int, fragments: int, tau: int, overlap: str = "none", adaptive: bool = False
) -> None:
    """The sync-schedule rules of the DiLoCo family (ALGORITHMS §2-§4, §7), raising ConfigError.

    One definition for ``validate`` (fails at load time) and the outer loop / sync schedule
    (which tests and benchmarks build from config sections that never went through validate)."""
    if sync_every % fragments:
        _fail("outer.streaming.fragments", fragments, f"must divide outer.sync_every={sync_every}")
    if not 0 <= tau < max(sync_every // fragments, 1):
        _fail("outer.streaming.tau", tau, f"must be in [0, sync_every/fragments={sync_every // fragments})")
    if tau > 0 and overlap != "none":
        _fail(
            "outer.streaming.tau",
            tau,
            f"cannot be combined with outer.overlap={overlap!r} (the one-outer-step overlap "
            "already hides the all-reduce behind a whole phase); set tau: 0 or overlap: none",
        )
    if adaptive and fragments > 1:
        _fail(
            "compress.adaptive.enabled",
            True,
            f"is not supported with outer.streaming.fragments={fragments} "
            "(one controller sets one H for the whole shard); use fragments: 1 or disable adaptive",
        )


# --------------------------------------------------------------------------- per-concern checks


def check_field_values(cfg: Any) -> None:
    """Each field on its own: supported backends, choice fields, positive, non-negative and ranged numbers.

    ``cfg`` is the root config (fields are looked up by their dotted names)."""
    if cfg.model.linear_backend == "te":
        _fail(
            "model.linear_backend",
            "te",
            "is not supported: Transformer Engine's linear layers bring their own "
            "tensor-parallel layout, which this version's TP layers do not use; use model.linear_backend=fp8 for "
            "float8 GEMMs, or torch",
        )
    if cfg.model.fused_qkv and cfg.model.linear_backend != "torch":
        _fail("model.fused_qkv", True, f"needs model.linear_backend=torch (an {cfg.model.linear_backend} linear "
              "scales each weight by itself); set model.fused_qkv=false or model.linear_backend=torch")  # fmt: skip
    for name, choices in _CHOICES.items():
        v, tok = _get(cfg, name), name == "data.tokenizer"
        if v not in choices and not (tok and isinstance(v, str) and v.startswith("hf:")):
            close = difflib.get_close_matches(str(v), choices, n=1)
            hf = " or hf:PATH (a model's tokenizer.json or its directory)" if tok else ""
            _fail(name, v, f"is not one of {list(choices)}{hf}" + (f"; did you mean {close[0]!r}?" if close else ""))
    _positive(cfg, *_POSITIVE)
    for name in _NON_NEGATIVE:
        if _get(cfg, name) < 0:
            _fail(name, _get(cfg, name), "must be >= 0")
    for name, holds, rule in _RANGES:
        if not holds(_get(cfg, name)):
            _fail(name, _get(cfg, name), rule)


def check_trackers(log: LogConfig) -> None:
    if log.wandb and importlib.util.find_spec("wandb") is None:  # before any rank starts, not at the first log
        raise ConfigError(WANDB_MISSING)
    if not log.wandb_project.strip():
        _fail("log.wandb_project", log.wandb_project, "must be a non-empty W&B project name")


def check_model_layout(m: ModelConfig, p: ParallelConfig) -> None:
    """The model's shape against itself and against the tensor and pipeline split."""
    for field, value, why in m.head_problems():
        _fail(field, value, why)
    t = p.tensor
    for name, n, why in (
        ("model.n_heads", m.n_heads, " (each tensor-parallel rank must own whole attention heads)"),
        ("model.n_kv_heads", m.kv_heads, " (each tensor-parallel rank must own whole key/value heads)"),
        ("model.d_ff", m.ffn_dim, ""),
        ("model.vocab_size", m.vocab_size, " (vocab-parallel embedding and cross-entropy); pad the vocabulary"),
    ):
        if n % t:
            _fail(name, n, f"is not divisible by parallel.tensor={t}{why}")
    if m.n_layers % p.pipeline:
        _fail("model.n_layers", m.n_layers, f"is not divisible by parallel.pipeline={p.pipeline} (each stage owns "
              "the same number of layers)")  # fmt: skip
    if m.tie_embeddings and p.pipeline > 1:
        _fail("model.tie_embeddings", True, f"is not supported with parallel.pipeline={p.pipeline} > 1 (embedding "
              "and head live on different stages)")  # fmt: skip
    if m.loss_backend == "torch" and t > 1:
        _fail("model.loss_backend", "torch", f"needs parallel.tensor=1 (the logits are split over the {t} tensor-"
              "parallel ranks); use model.loss_backend=vocab_parallel")  # fmt: skip
    if m.init_from is not None and not str(m.init_from).strip():
        _fail("model.init_from", m.init_from, "is empty; give a Hugging Face model directory (or hub name), or null")
    check_subspace(m)


def check_subspace(m: ModelConfig) -> None:
    """``model.subspace_rank`` (dilocox/model/subspace.py) and the settings the constraint cannot hold with."""
    k = m.subspace_rank
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < m.d_model:
        _fail("model.subspace_rank", k, f"must be an int in [0, model.d_model={m.d_model}) (0: no constraint)")
    n = m.subspace_layers
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= m.n_layers):
        _fail("model.subspace_layers", n, f"must be null (all layers) or an int in [1, model.n_layers={m.n_layers}]")
    if k == 0:
        return
    for bad, name, value, rule in (
        (m.dropout > 0, "model.dropout", m.dropout, "must be 0 (a dropout mask leaves the subspace)"),
        (m.tie_embeddings, "model.tie_embeddings", True, "must be false (the head reads the dense embedding)"),
        (m.init_from, "model.init_from", m.init_from, "must be null (a dense checkpoint is not in a subspace)"),
    ):
        if bad:
            _fail(name, value, f"{rule} with model.subspace_rank={k}; set one of them to its default")


def check_batching(p: ParallelConfig, train: TrainConfig, m: ModelConfig) -> None:
    """Microbatches, the batch split over microbatches and data-parallel ranks, the sequence length."""
    if p.microbatches < p.pipeline and p.schedule != "reference":
        _fail(
            "parallel.microbatches",
            p.microbatches,
            f"must be >= parallel.pipeline={p.pipeline} so that every stage has work in the pipeline",
        )
    if train.batch_size % (p.microbatches * p.data):
        _fail(
            "train.batch_size",
            train.batch_size,
            f"must be divisible by parallel.microbatches*parallel.data={p.microbatches * p.data}",
        )
    if train.seq_len > m.max_seq_len:
        _fail("train.seq_len", train.seq_len, f"exceeds model.max_seq_len={m.max_seq_len}")


def check_data(d: DataConfig, m: ModelConfig) -> None:
    """The data source and tokenizer, against the model's vocabulary."""
    if d.tokenizer == "byte" and d.source != "memmap" and m.vocab_size < 256:
        _fail("model.vocab_size", m.vocab_size, "is smaller than 256, the byte tokenizer's vocabulary")
    if d.tokenizer == "bpe" and d.bpe_vocab_size > m.vocab_size:
        _fail("model.vocab_size", m.vocab_size, f"< data.bpe_vocab_size={d.bpe_vocab_size}: set it to that or more")
    if not 0.0 < d.val_fraction < 0.5:
        _fail("data.val_fraction", d.val_fraction, "must be in (0, 0.5)")
    if d.source in ("text", "memmap") and not d.path:
        _fail("data.path", d.path, f"must be set when data.source={d.source!r}")
    if not str(d.cache_dir).strip():  # (it wrote prepared/ and tokenizers/ into the working directory)
        _fail("data.cache_dir", d.cache_dir, "is empty; give a directory, e.g. .cache/dilocox (the default)")


def check_outer(o: OuterConfig, p: ParallelConfig, m: ModelConfig, adaptive: AdaptiveConfig) -> None:
    """The outer loop: a method for several replicas, the sync schedule, streaming, outer optimizer."""
    if o.method == "none" and p.replicas > 1:
        _fail(
            "outer.method",
            o.method,
            f"must name an outer method when parallel.replicas={p.replicas} > 1 (e.g. diloco, allreduce)",
        )
    s = o.streaming
    if s.fragments > 1 or o.method == "diloco":  # checked again by the outer loop; here so that they fail at load time
        diloco = o.method == "diloco"
        check_outer_schedule(
            o.sync_every, s.fragments, s.tau, o.overlap if diloco else "none", diloco and adaptive.enabled
        )
    if s.fragments > 1 and m.n_layers // p.pipeline < s.fragments:
        _fail("outer.streaming.fragments", s.fragments, f"exceeds the {m.n_layers // p.pipeline} layers of a stage")
    if not 0.0 <= s.alpha <= 1.0:
        _fail("outer.streaming.alpha", s.alpha, "must be in [0, 1]")
    if not 0.0 <= o.momentum < 1.0:
        _fail("outer.momentum", o.momentum, "must be in [0, 1)")
    if not o.lr > 0:
        _fail("outer.lr", o.lr, "must be > 0")
    if not (0.0 <= o.lookahead <= 4.0):
        _fail("outer.lookahead", o.lookahead, "must be in [0, 4] (1 = start each phase at the predicted outer step)")
    if o.lookahead > 0 and (o.method != "diloco" or o.overlap != "delayed"):
        _fail(
            "outer.lookahead",
            o.lookahead,
            f"needs outer.method=diloco with outer.overlap=delayed (it predicts the step the in-flight average makes; "
            f"here method={o.method!r}, overlap={o.overlap!r}); set outer.lookahead=0 or overlap=delayed",
        )
    if o.lookahead > 0 and o.elastic.enabled:
        _fail("outer.lookahead", o.lookahead, "is not supported with outer.elastic.enabled yet; set outer.lookahead=0")
    if o.lr_schedule not in ("constant", "inner"):
        _fail("outer.lr_schedule", o.lr_schedule, "must be constant or inner")
    if o.lr_schedule == "inner" and (o.method not in ("diloco", "none") or o.lookahead):
        why = (
            "outer.lookahead (it predicts the step at the constant lr)" if o.lookahead else f"outer.method={o.method!r}"
        )
        _fail("outer.lr_schedule", o.lr_schedule, f"needs the DiLoCo family's outer optimizer, not {why}")
    if o.optimizer not in ("sgd", "muon"):
        _fail("outer.optimizer", o.optimizer, "must be one of ['sgd', 'muon']")
    if o.optimizer != "sgd":
        why = (
            f"parallel.tensor={p.tensor} (Muon orthogonalizes whole matrices; a TP shard is a slice of one)"
            if p.tensor > 1
            else f"outer.lookahead={o.lookahead} (it predicts the step from the SGD momentum v)"
            if o.lookahead
            else f"outer.method={o.method!r} (only the DiLoCo family has an outer optimizer)"
            if o.method not in ("diloco", "none")
            else None
        )
        if why:
            _fail("outer.optimizer", o.optimizer, f"is not supported with {why} yet; use outer.optimizer=sgd")
    if o.norm_check and not o.norm_check > 1.0:
        _fail("outer.norm_check", o.norm_check, "must be 0 (off) or above 1 (a ratio to the median norm), e.g. 4")
    if o.norm_check and o.overlap == "eager":
        _fail(
            "outer.norm_check",
            o.norm_check,
            "does not combine with outer.overlap=eager (a replica left out has already applied its own pseudo-gradient "
            "locally); use overlap none or delayed, or set it to 0",
        )


def check_compress(c: CompressConfig) -> None:
    """The adaptive controller's ranges and CocktailSGD's fractions."""
    a = c.adaptive
    if a.rank_min > a.rank_max:
        _fail("compress.adaptive.rank_min", a.rank_min, f"exceeds compress.adaptive.rank_max={a.rank_max}")
    if a.h_min > a.h_max:
        _fail("compress.adaptive.h_min", a.h_min, f"exceeds compress.adaptive.h_max={a.h_max}")
    if not 0.0 < a.energy_eps < 1.0:
        _fail("compress.adaptive.energy_eps", a.energy_eps, "must be in (0, 1)")
    for name in ("rank_min", "h_min"):
        if getattr(a, name) < 1:
            _fail(f"compress.adaptive.{name}", getattr(a, name), "must be >= 1")
    if not 0.0 < c.lowrank.min_compression < math.inf:
        _fail("compress.lowrank.min_compression", c.lowrank.min_compression, "must be a finite number > 0, e.g. 1")
    if c.quant == "int4" and c.group_size % 2:
        _fail("compress.group_size", c.group_size, "must be even with compress.quant=int4 (two values a byte)")
    for name in ("random_fraction", "topk_fraction"):
        v = getattr(c, name)
        if not 0.0 < v <= 1.0:
            _fail(f"compress.{name}", v, "must be in (0, 1]")
    check_codecs(c)


def check_codecs(c: CompressConfig) -> None:
    """The codec sections of ``compress`` (a section with ``enabled`` and ``problems()``: sparse, sign, ...): at most
    one enabled; it replaces the default compressor (quant, low-rank, adaptive off), keeps error feedback and
    all-gathers its payloads; its own fields as its ``problems()`` says."""
    on = [f.name for f in fields(c) if hasattr(getattr(c, f.name), "problems") and getattr(c, f.name).enabled]
    if len(on) > 1:
        _fail(f"compress.{on[1]}.enabled", True, f"and compress.{on[0]}.enabled are both on: enable one codec")
    for name in on:
        for key, value, why in getattr(c, name).problems():
            _fail(f"compress.{name}.{key}", value, why)
        if not c.error_feedback:
            _fail("compress.error_feedback", False, f"must be true with compress.{name} (its error buffer is the rule)")
        if c.collective not in ("auto", "allgather") and not (name == "sparse" and c.collective == "reduce_scatter"):
            _fail("compress.collective", c.collective, f"must be auto or allgather with compress.{name} (all-gather)")
        if c.quant != "none" or c.lowrank.enabled or c.adaptive.enabled:
            _fail(
                f"compress.{name}.enabled",
                True,
                "replaces the other outer compression: set compress.quant=none, compress.lowrank.enabled=false and "
                "compress.adaptive.enabled=false",
            )


def check_sparse_method(o: OuterConfig, c: CompressConfig) -> None:
    on = [f.name for f in fields(c) if hasattr(getattr(c, f.name), "problems") and getattr(c, f.name).enabled]
    if on and o.method == "cocktailsgd":
        _fail(
            f"compress.{on[0]}.enabled",
            True,
            "compresses the outer sync of another method, not outer.method='cocktailsgd' (it has its own top-k)",
        )
    for key in {"allreduce": ("adaptive",), "cocktailsgd": ("lowrank", "adaptive", "collective")}.get(o.method, ()):
        on = c.collective == "reduce_scatter" if key == "collective" else getattr(c, key).enabled
        if on:  # (accepted before and silently ignored: the run differed from the config in a way no log said)
            field = "compress.collective" if key == "collective" else f"compress.{key}.enabled"
            why = "its own random mask, top-k and compress.quant" if key != "adaptive" else "no adaptive controller"
            _fail(field, c.collective if key == "collective" else True,
                  f"has no effect with outer.method={o.method!r} ({why}); remove it")  # fmt: skip
    if c.sparse.enabled and o.method != "diloco":
        _fail(
            "compress.sparse.enabled",
            True,
            f"compresses the outer pseudo-gradients of outer.method=diloco, not outer.method={o.method!r} "
            "(cocktailsgd has its own top-k; allreduce is per-step gradients)",
        )


def check_optim(o: OptimConfig) -> None:
    """The inner optimizer's learning-rate schedule."""
    if o.lr <= 0 or not math.isfinite(o.lr):
        _fail("optim.lr", o.lr, "must be a finite number > 0")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        _fail(
            "optim.min_lr_ratio",
            o.min_lr_ratio,
            "must be in [0, 1] (the final lr is lr * min_lr_ratio; below 0 the schedule turns negative)",
        )
    if o.warmup_steps < 0:
        _fail("optim.warmup_steps", o.warmup_steps, "must be >= 0")
    if o.name == "muon" and not 0.0 <= o.muon_momentum < 1.0:
        _fail("optim.muon_momentum", o.muon_momentum, "must be in [0, 1)")


def check_muon_layout(o: OptimConfig, p: ParallelConfig) -> None:
    if o.name == "muon" and p.tensor > 1:
        _fail(
            "optim.name",
            "muon",
            f"is not supported with parallel.tensor={p.tensor} yet (Muon orthogonalizes whole matrices; a TP shard "
            "is a slice of one): use parallel.tensor=1 or optim.name=adamw",
        )


def check_security(sec: Any) -> None:
    if sec.encrypt and not sec.authenticate:
        _fail("security.encrypt", True, "needs security.authenticate=true (the key comes from the handshake)")
    from dilocox.net.secure import MAX_HANDSHAKE_S  # (the bound every accept loop enforces: secure.set_handshake_s)

    h = sec.handshake_s
    if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0 < h <= MAX_HANDSHAKE_S:
        _fail(
            "security.handshake_s",
            h,
            f"must be seconds in (0, {MAX_HANDSHAKE_S:g}]: the default 2 on a LAN, e.g. "
            "--security.handshake_s=5 on a lossy WAN link",
        )


def check_train(train: TrainConfig) -> None:
    if train.eval_every < 0:
        _fail("train.eval_every", train.eval_every, "must be >= 0 (0 = never)")
    if not -(1 << 63) <= train.seed < (1 << 64) - (1 << 32):  # (torch.manual_seed's range, less room for the
        _fail("train.seed", train.seed, "must be in [-2**63, 2**64 - 2**32), e.g. 1234")  # 100 x stage added)


def check_elastic(o: OuterConfig, p: ParallelConfig) -> None:
    """outer.elastic.enabled: this job is one replica of an elastic DiLoCo run (docs/ELASTIC.md)."""
    e = o.elastic
    if p.replicas != 1:
        _fail(
            "parallel.replicas",
            p.replicas,
            "must be 1 with outer.elastic.enabled: each replica is its own job (dilocox launch --elastic N starts N)",
        )
    if o.method != "diloco":
        _fail("outer.method", o.method, "must be diloco with outer.elastic.enabled (the DiLoCo family's outer step)")
    if o.streaming.fragments > 1 and o.overlap != "none":
        _fail(
            "outer.streaming.fragments",
            o.streaming.fragments,
            f"must be 1 with outer.elastic.enabled and outer.overlap={o.overlap!r} (a joiner cannot get the other "
            "fragments' averages in flight); use outer.overlap=none (Streaming DiLoCo's own overlap is "
            "outer.streaming.tau) or one fragment",
        )
    lh = e.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not lh or not all(_http_host_port(a) for a in str(lh).split(",")):
        _fail(
            "outer.elastic.lighthouse",
            e.lighthouse,
            "must be the torchft lighthouse address http://host:port (start one with `dilocox lighthouse`), or set "
            "TORCHFT_LIGHTHOUSE; standbys follow after commas: http://host:port,http://standby:port",
        )
    if e.max_replicas < 1:
        _fail("outer.elastic.max_replicas", e.max_replicas, "must be >= 1")
    if not 0 <= e.replica_rank < e.max_replicas:
        _fail(
            "outer.elastic.replica_rank", e.replica_rank, f"must be in [0, outer.elastic.max_replicas={e.max_replicas})"
        )
    if not 1 <= e.min_replicas <= e.max_replicas:
        _fail("outer.elastic.min_replicas", e.min_replicas, f"must be in [1, max_replicas={e.max_replicas}]")
    if e.initial_replicas is not None and not e.min_replicas <= e.initial_replicas <= e.max_replicas:
        _fail(
            "outer.elastic.initial_replicas",
            e.initial_replicas,
            f"must be null or in [min_replicas={e.min_replicas}, max_replicas={e.max_replicas}]",
        )
    for name in ("timeout_s", "quorum_timeout_s", "standby_timeout_s"):
        if not getattr(e, name) > 0:
            _fail(f"outer.elastic.{name}", getattr(e, name), "must be > 0 seconds")
    if e.max_attempts < 1:
        _fail("outer.elastic.max_attempts", e.max_attempts, "must be >= 1")
    if e.heartbeat_ms < 1:
        _fail("outer.elastic.heartbeat_ms", e.heartbeat_ms, "must be >= 1 (milliseconds)")


def _http_host_port(addr: str) -> bool:
    """Is ``addr`` http(s)://host:port (a port out of range or not a number: no)?"""
    u = urlsplit(addr.strip())
    try:
        return u.scheme in ("http", "https") and bool(u.hostname) and u.port is not None
    except ValueError:
        return False


def check_lighthouse_auth(o: OuterConfig, sec: Any) -> None:
    if o.elastic.lighthouse_auth is None:  # (null: secure by default, as the run is: issue 42)
        o.elastic.lighthouse_auth = bool(sec.authenticate)
    if o.elastic.lighthouse_auth and not sec.authenticate:
        _fail(
            "outer.elastic.lighthouse_auth",
            True,
            "needs security.authenticate=true (the replicas prove the run secret to the lighthouse's guard)",
        )
    if o.elastic.collectives == "authenticated" and not o.elastic.lighthouse_auth:
        _fail(
            "outer.elastic.collectives",
            "authenticated",
            "needs outer.elastic.lighthouse_auth=true (the run secret, and the quorum's store behind its guard)",
        )


def check_swarm_activations(s: SwarmConfig, m: ModelConfig) -> None:
    """The activation codec against the model (issue 24): a subspace codec needs the constrained model."""
    b = s.activation_block
    if not isinstance(b, int) or isinstance(b, bool) or b < 1 or ("int4" in s.activations and b % 2):
        _fail("swarm.activation_block", b, "must be a positive int (even with an int4 codec), e.g. 2048 or 64")
    if not 0 < s.activation_cols <= 1:
        _fail("swarm.activation_cols", s.activation_cols, "must be in (0, 1]: the fraction of columns colk keeps")
    if s.activations.startswith("subspace") and not m.subspace_rank:
        _fail(
            "swarm.activations",
            s.activations,
            "needs a model whose residual stream lies in a subspace: set model.subspace_rank (e.g. 8 or 16), or "
            "pick a codec that does not (int8, int4, colk-int8)",
        )
    n_stages = len(s.peers_per_stage) if isinstance(s.peers_per_stage, (list, tuple)) else 1
    need = m.n_layers - m.n_layers // max(1, n_stages)  # the layers before the last stage boundary
    if s.activations.startswith("subspace") and m.subspace_layers is not None and m.subspace_layers < need:
        _fail(
            "model.subspace_layers",
            m.subspace_layers,
            f"must be >= {need} with swarm.activations={s.activations} and {n_stages} stages (every layer before "
            "the last stage boundary writes into the subspace, or a boundary is not exact); raise it or set null",
        )


def check_swarm(s: SwarmConfig, o: OuterConfig) -> None:
    """The swarm section (used only by `dilocox.swarm`; checked always so a typo fails early). ``SwarmConfig``
    itself turns ``peers_per_stage`` into a tuple of ints where it can (a YAML string or a bare int)."""
    pps = s.peers_per_stage
    if (
        not isinstance(pps, tuple)
        or not pps
        or not all(isinstance(m, int) and not isinstance(m, bool) and m >= 1 for m in pps)
    ):
        _fail("swarm.peers_per_stage", s.peers_per_stage, "must be a list of integers >= 1, one per stage, e.g. [2, 2]")
    if s.microbatch_size < 1:
        _fail("swarm.microbatch_size", s.microbatch_size, "must be >= 1")
    if s.max_inflight < 1:
        _fail("swarm.max_inflight", s.max_inflight, "must be >= 1")
    for name in ("rpc_timeout_s", "ban_s", "step_timeout_s", "startup_timeout_s", "sync_timeout_s"):
        if not getattr(s, name) > 0:
            _fail(f"swarm.{name}", getattr(s, name), "must be > 0 seconds")
    if not (0 <= s.rebalance_period_s < math.inf):
        _fail("swarm.rebalance_period_s", s.rebalance_period_s, "must be >= 0 seconds (0 = no rebalancing), e.g. 300")
    if not 0 <= s.rebalance_min_gain < 1:
        _fail("swarm.rebalance_min_gain", s.rebalance_min_gain, "must be in [0, 1), e.g. 0.1")
    if s.rebalance_period_s > 0 and s.sync == "diloco" and o.overlap != "none":
        _fail(
            "swarm.rebalance_period_s",
            s.rebalance_period_s,
            f"with swarm.sync=diloco needs outer.overlap=none (a peer moves at an outer step boundary; with "
            f"overlap={o.overlap!r} its last pseudo-gradient is still in flight then): set "
            "outer.overlap=none or swarm.rebalance_period_s=0",
        )
