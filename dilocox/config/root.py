"""The root ``Config`` (one field per section) and its validation.

``Config`` validates itself when constructed; ``validate`` runs every check of
``dilocox.config.checks`` in a fixed order (the first rule broken is the one reported) and is also
called by the loader after a YAML file and its overrides are merged. ``validate_swarm_layout`` holds
the checks that only a SWARM run needs (its stages against the model and batch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dilocox.config.checks import (
    _fail,
    check_batching,
    check_compress,
    check_data,
    check_elastic,
    check_field_values,
    check_lighthouse_auth,
    check_model_layout,
    check_muon_layout,
    check_optim,
    check_outer,
    check_security,
    check_sparse_method,
    check_swarm,
    check_swarm_activations,
    check_trackers,
    check_train,
)
from dilocox.config.combos import check_combos, check_swarm_outer
from dilocox.config.sections import (
    CheckpointConfig,
    CompressConfig,
    DataConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    OuterConfig,
    ParallelConfig,
    SecurityConfig,
    SwarmConfig,
    TrainConfig,
)


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
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        validate(self)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def validate(cfg: Config) -> None:
    """Check every cross-field constraint; raise ConfigError naming field, value and rule.

    Order: each field's own value, trackers, the model against the parallel layout, batching,
    data, the outer loop, compression, the inner optimizer, the eval schedule, the elastic
    section (when enabled), the swarm section, the attention kernel against the device and dtype,
    security, then the combinations that would silently ignore a key (``combos.check_combos``)."""
    check_field_values(cfg)
    check_trackers(cfg.log)
    check_model_layout(cfg.model, cfg.parallel)
    check_batching(cfg.parallel, cfg.train, cfg.model)
    check_data(cfg.data, cfg.model)
    check_outer(cfg.outer, cfg.parallel, cfg.model, cfg.compress.adaptive)
    check_compress(cfg.compress)
    check_sparse_method(cfg.outer, cfg.compress)
    check_optim(cfg.optim)
    check_muon_layout(cfg.optim, cfg.parallel)
    check_train(cfg.train)
    if cfg.outer.elastic.standby and not cfg.outer.elastic.enabled:
        _fail("outer.elastic.standby", True, "needs outer.elastic.enabled=true (a standby is a replica of an elastic "
              "run: `dilocox launch --elastic N CONFIG --standby-replicas S` starts it)")  # fmt: skip
    if cfg.outer.elastic.enabled:
        check_elastic(cfg.outer, cfg.parallel)
        check_lighthouse_auth(cfg.outer, cfg.security)
    check_swarm(cfg.swarm, cfg.outer)
    check_swarm_activations(cfg.swarm, cfg.model)
    check_attn_backend(cfg)
    check_security(cfg.security)
    check_combos(cfg)  # keys a combination would silently ignore (combos.py)


def check_attn_backend(cfg: Config) -> None:
    """model.attn_backend=flash_attn runs on fp16/bf16 CUDA tensors only (model/attention.py): on a CPU or in fp32
    every rank would fail at its first forward, after the run had started."""
    t = cfg.train
    if cfg.model.attn_backend == "flash_attn" and (t.device == "cpu" or t.dtype == "fp32"):
        key, value = ("train.device", t.device) if t.device == "cpu" else ("train.dtype", t.dtype)
        _fail(
            "model.attn_backend",
            "flash_attn",
            f"needs fp16/bf16 CUDA tensors, not {key}={value!r}; set model.attn_backend=sdpa, or train.device=cuda "
            "(or auto on a GPU) with train.dtype=bf16 (or auto)",
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
    if cfg.outer.norm_check:
        _fail("outer.norm_check", cfg.outer.norm_check, "is not supported by SWARM's stage sync yet; set it to 0")
    check_swarm_outer(cfg)
