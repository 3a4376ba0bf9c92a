"""Configuration: dataclasses validated on load, YAML files, ``--a.b=value`` overrides.

Every field has a default so that a YAML file only states what differs. A config file may
``include:`` other YAML files (paths relative to the including file); later keys win.
Validation happens at load time and names the field, the value and the constraint, e.g.::

    ConfigError: model.n_heads=6 is not divisible by parallel.tensor=4
                 (each tensor-parallel rank must own whole attention heads)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import sys
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import yaml

from dilocox.trackers import WANDB_MISSING


class ConfigError(ValueError):
    """A configuration value is malformed or impossible. The message names the field."""


# --------------------------------------------------------------------------- sections


@dataclass
class ModelConfig:
    arch: str = "gpt2"  # gpt2 | opt | qwen (qwen also covers llama-style blocks)
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # None = n_heads (no GQA)
    d_model: int = 128
    d_ff: int | None = None  # None = 4 * d_model
    vocab_size: int = 256
    max_seq_len: int = 256
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_eps: float = 1e-5
    activation: str = "gelu"  # gelu | relu | swiglu
    pos_emb: str = "learned"  # learned | rope
    rope_theta: float = 10000.0
    bias: bool = True  # biases in linear layers (GPT-2/OPT: true; Qwen: false)
    qkv_bias: bool | None = None  # None = same as bias (Qwen1.5: true with bias false)
    tie_embeddings: bool = False
    dropout: float = 0.0
    init_std: float = 0.02
    attn_backend: str = "sdpa"  # sdpa | flash_attn | te
    linear_backend: str = "torch"  # torch | fp8 (te is rejected: not implemented for the TP layers)
    init_from: str | None = None  # a Hugging Face model dir (or hub name) to start from; see `dilocox import`

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_dim(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def num_params(self, include_embedding: bool = True) -> int:
        """Exact parameter count of the model this config builds (used by plan and MFU)."""
        d, f, L, V = self.d_model, self.ffn_dim, self.n_layers, self.vocab_size
        hd, kv = self.head_dim, self.kv_heads
        qkv_out = d + 2 * kv * hd
        qkv_b = self.qkv_bias if self.qkv_bias is not None else self.bias
        attn = d * qkv_out + (qkv_out if qkv_b else 0) + d * d + (d if self.bias else 0)
        n_in = 2 if self.activation == "swiglu" else 1
        mlp = n_in * d * f + f * d + ((n_in * f + d) if self.bias else 0)
        norm_p = d if self.norm == "rmsnorm" else 2 * d
        per_layer = attn + mlp + 2 * norm_p
        total = L * per_layer + norm_p
        if include_embedding:
            total += V * d  # token embedding
            if self.pos_emb == "learned":
                total += self.max_seq_len * d
            if not self.tie_embeddings:
                total += V * d  # lm head
        return total


@dataclass
class ParallelConfig:
    replicas: int = 1  # R: DiLoCo workers ("clusters"), joined by slow links
    data: int = 1  # D: inner data parallel ranks inside a replica (fast links)
    pipeline: int = 1  # P: pipeline stages
    tensor: int = 1  # T: tensor-parallel ranks
    schedule: str = "1f1b"  # gpipe | 1f1b | reference (the small hand-written oracle)
    microbatches: int = 1
    timeout_s: float = 600.0  # bound on every collective inside a replica (process groups' timeout); a stuck rank
    # ends the run

    @property
    def world_size(self) -> int:
        return self.replicas * self.data * self.pipeline * self.tensor


@dataclass
class DataConfig:
    source: str = "stdlib"  # stdlib | text | memmap | hf
    path: str | None = None  # text: file/dir/glob; memmap: prepared dir; hf: dataset name or local files
    hf_split: str = "train"
    hf_text_field: str = "text"
    tokenizer: str = "byte"  # byte | bpe
    bpe_vocab_size: int = 4096
    cache_dir: str = ".cache/dilocox"  # tokenizers and prepared token files
    val_fraction: float = 0.02
    max_bytes: int | None = 8_000_000  # cap on the raw corpus read (None = all)


@dataclass
class OptimConfig:
    """Inner optimizer (AdamW) and its schedule."""

    lr: float = 4e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    schedule: str = "cosine"  # cosine | constant | linear
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # global-norm clipping across TP and PP ranks; 0 = off
    name: str = "adamw"  # adamw | sgd (sgd only for equivalence tests)


@dataclass
class StreamingConfig:
    fragments: int = 1  # K; 1 = plain (non-streaming) DiLoCo
    tau: int = 0  # overlap in inner steps
    alpha: float = 0.5  # mixing of local and global fragment params
    pattern: str = "sequential"  # sequential | strided


@dataclass
class ElasticSection:
    """Elastic replicas (docs/ELASTIC.md): each replica is its own torchrun job; the outer groups are formed per
    outer step by a torchft lighthouse quorum of the replicas alive then."""

    enabled: bool = False  # true: this job is ONE replica (parallel.replicas must be 1) of an elastic run
    lighthouse: str | None = None  # http://host:port of the torchft lighthouse (`dilocox lighthouse`); null: the
    # TORCHFT_LIGHTHOUSE environment variable
    replica_rank: int = 0  # this replica's identity in [0, max_replicas): its data shard; keep it across restarts
    min_replicas: int = 1  # fewest replicas an outer step may be averaged over; below it the survivors wait
    # (quorum_timeout_s, logged) for a join, then stop with a clear message
    initial_replicas: int | None = None  # replicas the first outer step waits for (bounded); null: min_replicas
    max_replicas: int = 8  # upper bound on replica_rank (data shards, contributor count buffer)
    timeout_s: float = 60.0  # bound on one outer all-reduce / commit / state transfer
    quorum_timeout_s: float = 120.0  # bound on forming a quorum and on the wait below min_replicas
    max_attempts: int = 3  # retries of one outer step whose all-reduce failed (a replica died in flight)
    heartbeat_ms: int = 100  # how often the replica heartbeats the lighthouse


@dataclass
class OuterConfig:
    """The outer loop (DiLoCo family). method=none means a single replica, no outer loop."""

    method: str = "none"  # none | allreduce | diloco | cocktailsgd
    sync_every: int = 100  # H inner steps per outer step
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    overlap: str = "none"  # none | delayed | eager
    state_device: str = "host"  # host | device (where the fp32 outer params + momentum live)
    blocking: bool = False  # true: wait for the outer all-reduce on the critical path
    shard_over_data: bool = True  # parallel.data = D > 1: each DP rank syncs 1/D of the shard's tensors over the
    # slow link and broadcasts them to the others (slow-link bytes and outer state / D); false: every DP rank syncs
    # all (D x the bytes)
    streaming: StreamingConfig = field(default_factory=StreamingConfig)
    timeout_s: float = 600.0  # bound on every wait across replicas (outer all-reduce, world-wide agreements); then
    # every rank exits non-zero
    warn_after_s: float = 30.0  # log "waiting N s for the outer all-reduce with replica(s) ..." every this many
    # seconds while a wait lasts
    elastic: ElasticSection = field(default_factory=ElasticSection)


@dataclass
class LowRankConfig:
    enabled: bool = False
    rank: int = 16
    min_compression: float = 1.0  # only factor a matrix when (n+m)*r*2 < n*m / min_compression


@dataclass
class AdaptiveConfig:
    enabled: bool = False
    energy_eps: float = 0.05
    window: int = 5
    rank_min: int = 2
    rank_max: int = 64
    h_min: int = 10
    h_max: int = 1000


@dataclass
class CompressConfig:
    quant: str = "none"  # none | fp16 | int8 | int4
    group_size: int = 128
    collective: str = "auto"  # auto | allgather | reduce_scatter
    error_feedback: bool = True
    lowrank: LowRankConfig = field(default_factory=LowRankConfig)
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    # CocktailSGD (ALGORITHMS §8)
    random_fraction: float = 0.1
    topk_fraction: float = 0.08


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 8  # sequences per replica per step (split into microbatches)
    seq_len: int = 128
    seed: int = 1234
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 autocast on GPU, fp32 on CPU) | fp32 | bf16
    eval_every: int = 50
    eval_batches: int = 4
    max_tokens: int | None = None  # stop once this many tokens per replica were trained
    stop_timeout_s: float = 60.0  # after SIGINT/SIGTERM, `dilocox train --nproc N` kills the ranks that have not
    # saved and exited by then


@dataclass
class CheckpointConfig:
    dir: str | None = None  # None = <run_dir>/checkpoints
    every: int = 0  # 0 = only at the end
    keep: int = 2
    resume: str = "auto"  # auto (latest in dir if any) | none (fresh start; refused if the dir already holds
    # checkpoints) | <path to a step dir>
    fallback: bool = True  # resume=auto: a damaged shard (size/hash mismatch) falls back to the previous complete
    # checkpoint; false: stop
    check_space: bool = True  # at start-up refuse a checkpoint dir without room for one checkpoint, warn below keep+1
    resume_finished: str = "error"  # resumed checkpoint at/past train.steps: error (exit 2) | skip (exit 0); no writes


@dataclass
class LogConfig:
    run_dir: str = "runs/default"
    every: int = 10
    jsonl: bool = True
    tensorboard: bool = True  # when the tensorboard package is installed
    progress: bool = True  # progress bar on a TTY
    wandb: bool = False  # also log to Weights & Biases (rank 0, config attached; WANDB_MODE=offline: no network)
    wandb_project: str = "dilocox"  # W&B project; the W&B run is named after log.run_dir and writes to RUN_DIR/wandb


@dataclass
class SwarmConfig:
    """SWARM / DiLoCo-SWARM (issue 11; `dilocox/swarm/`): several peer processes serve each pipeline stage."""

    peers_per_stage: tuple = (2, 2)  # m_j peers serving stage j; its length is the number of stages
    sync: str = "swarm"  # swarm: the stage's grads all-reduced every step, then one AdamW step | diloco: AdamW per
    # peer, every outer.sync_every steps the stage's peers take the outer step (outer.lr, momentum, nesterov)
    routing: str = "iwrr"  # iwrr (weighted round-robin on measured time) | random | fixed (sender k -> peer k mod m)
    microbatch_size: int = 2  # sequences per microbatch; must divide train.batch_size (per stage-0 peer and step)
    max_inflight: int = 2  # microbatches a stage-0 peer keeps in flight at once
    activations: str = "none"  # none | fp16 | int8: codec of activations and their grads between stages
    rpc_timeout_s: float = 30.0  # bound on one hop (its downstream work, and the peer's wait for its previous
    # stage sync, included); then the peer is banned and the microbatch re-sent
    ban_s: float = 10.0  # how long a peer that failed or timed out stays banned before it is tried again
    step_timeout_s: float = 120.0  # bound on waiting for upstream end-of-step markers and for the previous sync
    startup_timeout_s: float = 120.0  # bound on waiting for every peer's address at start-up
    sync_timeout_s: float = 60.0  # bound on one stage sync (torchft quorum + all-reduce)
    host: str = "127.0.0.1"  # address each peer binds and advertises
    rebalance_period_s: float = 0.0  # every T s the launcher moves a peer of the least-loaded stage to the most-loaded
    # one (SWARM App. D; the paper's T = 300); 0 = off. sync=diloco: the peer moves after an outer step and serves its
    # new stage from that stage's next outer step on (needs outer.overlap=none). A peer moved into stage 0
    # draws its own batch per step
    rebalance_min_gain: float = 0.1  # a move is made only if it lowers the predicted max stage load by this fraction


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    compress: CompressConfig = field(default_factory=CompressConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)

    def __post_init__(self) -> None:
        validate(self)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- validation

QUANT_KINDS = ("none", "fp16", "int8", "int4")  # compress.quant; the one list every module imports

_CHOICES = {
    "model.arch": ("gpt2", "opt", "qwen"),
    "model.norm": ("layernorm", "rmsnorm"),
    "model.activation": ("gelu", "relu", "swiglu"),
    "model.pos_emb": ("learned", "rope"),
    "model.attn_backend": ("sdpa", "flash_attn", "te"),
    "model.linear_backend": ("torch", "fp8"),
    "parallel.schedule": ("gpipe", "1f1b", "reference"),
    "data.source": ("stdlib", "text", "memmap", "hf"),
    "data.tokenizer": ("byte", "bpe"),
    "optim.schedule": ("cosine", "constant", "linear"),
    "optim.name": ("adamw", "sgd"),
    "outer.method": ("none", "allreduce", "diloco", "cocktailsgd"),
    "outer.overlap": ("none", "delayed", "eager"),
    "outer.state_device": ("host", "device"),
    "outer.streaming.pattern": ("sequential", "strided"),
    "compress.quant": QUANT_KINDS,
    "compress.collective": ("auto", "allgather", "reduce_scatter"),
    "train.device": ("auto", "cpu", "cuda"),
    "train.dtype": ("auto", "fp32", "bf16"),
    "checkpoint.resume_finished": ("error", "skip"),
    "swarm.sync": ("swarm", "diloco"),
    "swarm.routing": ("iwrr", "random", "fixed"),
    "swarm.activations": ("none", "fp16", "int8"),
}


def _fail(name: str, value: Any, constraint: str) -> None:
    raise ConfigError(f"{name}={value!r} {constraint}")


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


def _positive(cfg: Config, *names: str) -> None:
    for name in names:
        v = _get(cfg, name)
        if v is not None and v <= 0:
            _fail(name, v, "must be > 0")


def _get(cfg: Any, dotted: str) -> Any:
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _validate_trackers(cfg: Config) -> None:
    if cfg.log.wandb and importlib.util.find_spec("wandb") is None:  # before any rank starts, not at the first log
        raise ConfigError(WANDB_MISSING)
    if not cfg.log.wandb_project.strip():
        _fail("log.wandb_project", cfg.log.wandb_project, "must be a non-empty W&B project name")


def validate(cfg: Config) -> None:
    """Check every cross-field constraint; raise ConfigError naming field, value and rule."""
    if cfg.model.linear_backend == "te":
        _fail(
            "model.linear_backend",
            "te",
            "is not supported: Transformer Engine's linear layers bring their own "
            "tensor-parallel layout, which this version's TP layers do not use; use model.linear_backend=fp8 for "
            "float8 GEMMs, or torch",
        )
    for name, choices in _CHOICES.items():
        v = _get(cfg, name)
        if v not in choices:
            _fail(name, v, f"is not one of {list(choices)}")
    _positive(
        cfg,
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
    )
    for name in ("train.eval_batches", "checkpoint.every", "checkpoint.keep"):
        if _get(cfg, name) < 0:
            _fail(name, _get(cfg, name), "must be >= 0")
    _validate_trackers(cfg)
    m, p = cfg.model, cfg.parallel
    if m.d_model % m.n_heads:
        _fail("model.d_model", m.d_model, f"is not divisible by model.n_heads={m.n_heads}")
    if m.n_heads % m.kv_heads:
        _fail("model.n_kv_heads", m.n_kv_heads, f"must divide model.n_heads={m.n_heads} (GQA groups)")
    if m.pos_emb == "rope" and m.head_dim % 2:
        _fail("model.d_model", m.d_model, "gives an odd head_dim; RoPE needs an even head_dim")
    t = p.tensor
    if m.n_heads % t:
        _fail(
            "model.n_heads",
            m.n_heads,
            f"is not divisible by parallel.tensor={t} (each tensor-parallel rank must own whole attention heads)",
        )
    if m.kv_heads % t:
        _fail(
            "model.n_kv_heads",
            m.kv_heads,
            f"is not divisible by parallel.tensor={t} (each tensor-parallel rank must own whole key/value heads)",
        )
    if m.ffn_dim % t:
        _fail("model.d_ff", m.ffn_dim, f"is not divisible by parallel.tensor={t}")
    if m.vocab_size % t:
        _fail(
            "model.vocab_size",
            m.vocab_size,
            f"is not divisible by parallel.tensor={t} (vocab-parallel embedding and cross-entropy); pad the vocabulary",
        )
    if m.n_layers % p.pipeline:
        _fail(
            "model.n_layers",
            m.n_layers,
            f"is not divisible by parallel.pipeline={p.pipeline} (each stage owns the same number of layers)",
        )
    if m.tie_embeddings and p.pipeline > 1:
        _fail(
            "model.tie_embeddings",
            True,
            f"is not supported with parallel.pipeline={p.pipeline} > 1 (embedding and head live on different stages)",
        )
    if m.init_from is not None and not str(m.init_from).strip():
        _fail("model.init_from", m.init_from, "is empty; give a Hugging Face model directory (or hub name), or null")
    if p.microbatches < p.pipeline and p.schedule != "reference":
        _fail(
            "parallel.microbatches",
            p.microbatches,
            f"must be >= parallel.pipeline={p.pipeline} so that every stage has work in the pipeline",
        )
    if cfg.train.batch_size % (p.microbatches * p.data):
        _fail(
            "train.batch_size",
            cfg.train.batch_size,
            f"must be divisible by parallel.microbatches*parallel.data={p.microbatches * p.data}",
        )
    if cfg.train.seq_len > m.max_seq_len:
        _fail("train.seq_len", cfg.train.seq_len, f"exceeds model.max_seq_len={m.max_seq_len}")
    if cfg.data.tokenizer == "byte" and cfg.data.source != "memmap" and m.vocab_size < 256:
        _fail("model.vocab_size", m.vocab_size, "is smaller than 256, the byte tokenizer's vocabulary")
    if cfg.data.tokenizer == "bpe" and cfg.data.bpe_vocab_size > m.vocab_size:
        _fail("data.bpe_vocab_size", cfg.data.bpe_vocab_size, f"exceeds model.vocab_size={m.vocab_size}")
    if not 0.0 < cfg.data.val_fraction < 0.5:
        _fail("data.val_fraction", cfg.data.val_fraction, "must be in (0, 0.5)")
    if cfg.data.source in ("text", "memmap") and not cfg.data.path:
        _fail("data.path", cfg.data.path, f"must be set when data.source={cfg.data.source!r}")
    o = cfg.outer
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
            o.sync_every, s.fragments, s.tau, o.overlap if diloco else "none", diloco and cfg.compress.adaptive.enabled
        )
    if s.fragments > 1 and m.n_layers // p.pipeline < s.fragments:
        _fail("outer.streaming.fragments", s.fragments, f"exceeds the {m.n_layers // p.pipeline} layers of a stage")
    if not 0.0 <= s.alpha <= 1.0:
        _fail("outer.streaming.alpha", s.alpha, "must be in [0, 1]")
    if not 0.0 <= o.momentum < 1.0:
        _fail("outer.momentum", o.momentum, "must be in [0, 1)")
    if o.lr <= 0:
        _fail("outer.lr", o.lr, "must be > 0")
    a = cfg.compress.adaptive
    if a.rank_min > a.rank_max:
        _fail("compress.adaptive.rank_min", a.rank_min, f"exceeds compress.adaptive.rank_max={a.rank_max}")
    if a.h_min > a.h_max:
        _fail("compress.adaptive.h_min", a.h_min, f"exceeds compress.adaptive.h_max={a.h_max}")
    if not 0.0 < a.energy_eps < 1.0:
        _fail("compress.adaptive.energy_eps", a.energy_eps, "must be in (0, 1)")
    for name in ("compress.random_fraction", "compress.topk_fraction"):
        v = _get(cfg, name)
        if not 0.0 < v <= 1.0:
            _fail(name, v, "must be in (0, 1]")
    if cfg.optim.lr <= 0 or not math.isfinite(cfg.optim.lr):
        _fail("optim.lr", cfg.optim.lr, "must be a finite number > 0")
    if not 0.0 <= cfg.optim.min_lr_ratio <= 1.0:
        _fail(
            "optim.min_lr_ratio",
            cfg.optim.min_lr_ratio,
            "must be in [0, 1] (the final lr is lr * min_lr_ratio; below 0 the schedule turns negative)",
        )
    if cfg.optim.warmup_steps < 0:
        _fail("optim.warmup_steps", cfg.optim.warmup_steps, "must be >= 0")
    if cfg.train.eval_every < 0:
        _fail("train.eval_every", cfg.train.eval_every, "must be >= 0 (0 = never)")
    if cfg.outer.elastic.enabled:
        _validate_elastic(cfg)
    _validate_swarm(cfg)


def _validate_elastic(cfg: Config) -> None:
    """outer.elastic.enabled: this job is one replica of an elastic DiLoCo run (docs/ELASTIC.md)."""
    e, o, p = cfg.outer.elastic, cfg.outer, cfg.parallel
    if p.replicas != 1:
        _fail(
            "parallel.replicas",
            p.replicas,
            "must be 1 with outer.elastic.enabled: each replica is its own job (dilocox launch --elastic N starts N)",
        )
    if o.method != "diloco":
        _fail("outer.method", o.method, "must be diloco with outer.elastic.enabled (the DiLoCo family's outer step)")
    if o.streaming.fragments != 1 or o.streaming.tau != 0:
        _fail(
            "outer.streaming.fragments",
            o.streaming.fragments,
            "must be 1 (and outer.streaming.tau 0) with outer.elastic.enabled: streaming fragments are not elastic yet",
        )
    if cfg.compress.adaptive.enabled:
        _fail(
            "compress.adaptive.enabled",
            True,
            "is not supported with outer.elastic.enabled yet (H and rank are agreed over a fixed group); use a fixed "
            "compress.lowrank.rank and outer.sync_every",
        )
    if p.data > 1 and o.shard_over_data:
        _fail(
            "outer.shard_over_data",
            True,
            "is not supported with outer.elastic.enabled yet; set outer.shard_over_data=false",
        )
    lh = e.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not lh or not str(lh).startswith(("http://", "https://")):
        _fail(
            "outer.elastic.lighthouse",
            e.lighthouse,
            "must be the torchft lighthouse address http://host:port (start one with `dilocox lighthouse`), or set "
            "TORCHFT_LIGHTHOUSE",
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
    for name in ("timeout_s", "quorum_timeout_s"):
        if getattr(e, name) <= 0:
            _fail(f"outer.elastic.{name}", getattr(e, name), "must be > 0 seconds")
    if e.max_attempts < 1:
        _fail("outer.elastic.max_attempts", e.max_attempts, "must be >= 1")
    if e.heartbeat_ms < 1:
        _fail("outer.elastic.heartbeat_ms", e.heartbeat_ms, "must be >= 1 (milliseconds)")


def _validate_swarm(cfg: Config) -> None:
    """The swarm section (used only by `dilocox.swarm`; checked always so a typo fails early)."""
    s = cfg.swarm
    pps = s.peers_per_stage
    if isinstance(pps, str):
        try:
            pps = yaml.safe_load(pps)
        except yaml.YAMLError:
            pass
    if isinstance(pps, int) and not isinstance(pps, bool):
        pps = [pps]
    if (
        not isinstance(pps, (list, tuple))
        or not pps
        or not all(isinstance(m, int) and not isinstance(m, bool) and m >= 1 for m in pps)
    ):
        _fail("swarm.peers_per_stage", s.peers_per_stage, "must be a list of integers >= 1, one per stage, e.g. [2, 2]")
    s.peers_per_stage = tuple(pps)
    if s.microbatch_size < 1:
        _fail("swarm.microbatch_size", s.microbatch_size, "must be >= 1")
    if s.max_inflight < 1:
        _fail("swarm.max_inflight", s.max_inflight, "must be >= 1")
    for name in ("rpc_timeout_s", "ban_s", "step_timeout_s", "startup_timeout_s", "sync_timeout_s"):
        if getattr(s, name) <= 0:
            _fail(f"swarm.{name}", getattr(s, name), "must be > 0 seconds")
    if not (0 <= s.rebalance_period_s < math.inf):
        _fail("swarm.rebalance_period_s", s.rebalance_period_s, "must be >= 0 seconds (0 = no rebalancing), e.g. 300")
    if not 0 <= s.rebalance_min_gain < 1:
        _fail("swarm.rebalance_min_gain", s.rebalance_min_gain, "must be in [0, 1), e.g. 0.1")
    if s.rebalance_period_s > 0 and s.sync == "diloco" and cfg.outer.overlap != "none":
        _fail(
            "swarm.rebalance_period_s",
            s.rebalance_period_s,
            f"with swarm.sync=diloco needs outer.overlap=none (a peer moves at an outer step boundary; with "
            f"overlap={cfg.outer.overlap!r} its last pseudo-gradient is still in flight then): set "
            "outer.overlap=none or swarm.rebalance_period_s=0",
        )


def validate_swarm_layout(cfg: Config) -> None:
    """Checks of the swarm section against the model and batch, for a SWARM run only (`dilocox swarm`, its peers):
    a non-SWARM run does not care about the swarm defaults."""
    s, pps = cfg.swarm, cfg.swarm.peers_per_stage
    if len(pps) > cfg.model.n_layers:
        _fail("swarm.peers_per_stage", list(pps), f"has more stages than model.n_layers={cfg.model.n_layers}")
    if len(pps) > 1 and cfg.model.tie_embeddings:
        _fail("model.tie_embeddings", True, "must be false with more than one swarm stage (len(swarm.peers_per_stage))")
    if cfg.train.batch_size % s.microbatch_size:
        _fail("swarm.microbatch_size", s.microbatch_size, f"must divide train.batch_size={cfg.train.batch_size}")


# --------------------------------------------------------------------------- loading


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(name: str, value: Any, tp: Any) -> Any:
    """Convert a YAML/CLI value to the annotated type, or raise ConfigError."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(name, value, inner[0])
    if origin is tuple:
        if isinstance(value, str):
            value = yaml.safe_load(value)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{name}={value!r} must be a list of {len(args)} numbers")
        return tuple(_coerce(f"{name}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{name}={value!r} must be a boolean (true/false)")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{name}={value!r} must be an integer, not a boolean")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{name}={value!r} must be an integer")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{name}={value!r} must be a number, not a boolean")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{name}={value!r} must be a number")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{name}={value!r} must be a string")
    return value


def _build(cls: type, data: dict, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in known:
            close = [k for k in known if k.startswith(str(key)[:3])]
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"unknown config key {prefix}{key!r} "
                f"(known keys of {prefix.rstrip('.') or 'the top level'}: {sorted(known)}){hint}"
            )
        tp = hints[key]
        if is_dataclass(tp):
            kwargs[key] = _build(tp, value or {}, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(f"{prefix}{key}", value, tp)
    if cls is Config:
        obj = cls.__new__(cls)
        for f in fields(cls):
            setattr(obj, f.name, kwargs.get(f.name, f.default_factory()))  # type: ignore[misc]
        return obj
    return cls(**kwargs)


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _read_yaml(path: str, seen: tuple[str, ...] = ()) -> dict:
    path = os.path.abspath(path)
    if path in seen:
        raise ConfigError(f"include cycle: {' -> '.join(seen + (path,))}")
    if not os.path.exists(path):
        raise ConfigError(f"config file {path!r} does not exist")
    if os.path.isdir(path):
        ymls = sorted(f for f in os.listdir(path) if f.endswith((".yaml", ".yml")))
        raise ConfigError(
            f"config {path!r} is a directory; give a YAML file"
            + (f", e.g. {os.path.join(path, ymls[0])}" if ymls else "")
        )
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"malformed YAML in {path}: {' '.join(str(e).split())}") from None
    if data is None:  # empty or only comments
        print(f"warning: config file {path} is empty; using the defaults (docs/CONFIG.md)", file=sys.stderr)
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    includes = data.pop("include", []) or []
    if isinstance(includes, str):
        includes = [includes]
    merged: dict = {}
    for inc in includes:
        merged = _deep_merge(merged, _read_yaml(os.path.join(os.path.dirname(path), inc), seen + (path,)))
    return _deep_merge(merged, data)


def parse_overrides(args: list[str]) -> dict:
    """``["--train.steps=10", "--model.arch", "qwen"]`` -> nested dict (values parsed as YAML)."""
    out: dict = {}
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or a == "--":
            raise ConfigError(f"override {a!r} must look like --section.key=value")
        body = a[2:]
        if "=" in body:
            key, raw = body.split("=", 1)
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {a!r} has no value; write --{body}=VALUE")
            key, raw = body, args[i + 1]
            i += 1
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
        i += 1
    return out


def from_dict(data: dict) -> Config:
    cfg = _build(Config, data, "")
    validate(cfg)
    return cfg


def load_config(path: str | None = None, overrides: list[str] | dict | None = None) -> Config:
    """Load a YAML config (with includes), apply overrides, validate."""
    data = _read_yaml(path) if path else {}
    if overrides:
        ov = parse_overrides(overrides) if isinstance(overrides, list) else overrides
        data = _deep_merge(data, ov)
    return from_dict(data)


def to_yaml(cfg: Config) -> str:
    def conv(x: Any) -> Any:
        if isinstance(x, tuple):
            return list(x)
        if isinstance(x, dict):
            return {k: conv(v) for k, v in x.items()}
        return x

    return yaml.safe_dump(conv(cfg.to_dict()), sort_keys=False)


def reference_markdown() -> str:
    """The config reference (docs/CONFIG.md), generated from the dataclasses and their comments."""
    import inspect
    import re

    line_re = re.compile(r"^\s+(\w+):\s*([^=]+?)\s*=\s*(.+?)(?:\s+#\s*(.*))?$")
    more_re = re.compile(r"^\s+#\s*(.*)$")  # a field's comment goes on over the comment lines right below it
    out = [
        "# Config reference",
        "",
        "Generated by `python -m dilocox.config` from `dilocox/config.py`; do not edit by hand.",
        "Every key can be set in YAML (`section:` / `key: value`) or on the command line as `--section.key=value`.",
        "",
    ]

    def section(cls: type, prefix: str) -> None:
        rows = []
        nested = []
        src = inspect.getsource(cls).splitlines()
        for i, src_line in enumerate(src):
            m = line_re.match(src_line)
            if not m or m.group(1) not in {f.name for f in fields(cls)}:
                continue
            name, tp, default, comment = m.groups()
            while comment is not None and i + 1 < len(src) and (more := more_re.match(src[i + 1])):
                comment, i = f"{comment} {more.group(1)}", i + 1
            if default.startswith("field(default_factory="):
                nested.append((name, typing.get_type_hints(cls)[name]))
                continue
            cell = lambda x: (x or "").replace("|", "\\|")  # noqa: E731 - escape pipes in table cells
            rows.append(f"| `{prefix}{name}` | `{cell(tp)}` | `{cell(default)}` | {cell(comment)} |")
        if rows:
            raw = cls.__doc__ or ""
            doc = "" if raw.startswith(cls.__name__ + "(") else inspect.cleandoc(raw).split("\n")[0]
            out.extend(
                [
                    f"## `{prefix.rstrip('.')}`",
                    "",
                    doc,
                    "",
                    "| key | type | default | meaning |",
                    "|---|---|---|---|",
                    *rows,
                    "",
                ]
            )
        for name, sub in nested:
            section(sub, f"{prefix}{name}.")

    for f in fields(Config):
        section(typing.get_type_hints(Config)[f.name], f"{f.name}.")
    return "\n".join(out)


if __name__ == "__main__":
    print(reference_markdown())
