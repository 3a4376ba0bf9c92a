"""The configuration sections: one dataclass per YAML section (``model:``, ``parallel:``, ``data:``, ...).

Plain data with a default for every field, so that a YAML file only states what differs; the
comment after each field is its documentation (``dilocox.config.reference`` turns the comments into
docs/CONFIG.md). The derived sizes a section implies (``ModelConfig.num_params``, ``kv_heads``,
``ParallelConfig.world_size``) live here too. The root ``Config`` that holds one of each is in
``dilocox.config.root``; the rules the values must satisfy are in ``dilocox.config.checks``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    arch: str = "gpt2"  # gpt2 | opt | qwen (qwen also covers llama-style blocks)
    n_layers: int = 4  # transformer blocks (split over parallel.pipeline stages)
    n_heads: int = 4  # attention heads (d_model / n_heads per head; a multiple of parallel.tensor)
    n_kv_heads: int | None = None  # None = n_heads (no GQA)
    d_model: int = 128  # the residual stream's width
    d_ff: int | None = None  # None = 4 * d_model
    vocab_size: int = 256  # embedding rows; must cover the tokenizer (256 for data.tokenizer=byte)
    max_seq_len: int = 256  # longest sequence (learned position table; RoPE: the bound train.seq_len is checked at)
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_eps: float = 1e-5  # epsilon of layernorm / rmsnorm
    activation: str = "gelu"  # gelu | relu | swiglu
    pos_emb: str = "learned"  # learned | rope
    rope_theta: float = 10000.0  # pos_emb=rope: RoPE's base (Qwen2: 1e6)
    bias: bool = True  # biases in linear layers (GPT-2/OPT: true; Qwen: false)
    qkv_bias: bool | None = None  # None = same as bias (Qwen1.5: true with bias false)
    tie_embeddings: bool = False  # the output head shares the token embedding's weight (GPT-2, Qwen2-0.5B: true)
    dropout: float = 0.0  # embedding, residual, attention dropout; seed: train.seed + 100 x stage (+ TP rank: attn)
    init_std: float = 0.02  # std of the normal init of weights (residual output projections: / sqrt(2 n_layers))
    attn_backend: str = "sdpa"  # sdpa | flash_attn | te
    linear_backend: str = "torch"  # torch | fp8 (forward GEMM) | fp8_all (and both backward GEMMs); te is rejected
    loss_backend: str = "vocab_parallel"  # vocab_parallel | torch (F.cross_entropy, parallel.tensor=1 only)
    fused_qkv: bool = False  # q, k, v as one GEMM (weights concatenated per call: a copy held for the backward in fp32,
    # none under bf16 autocast); the same parameters, results equal to rounding
    init_from: str | None = None  # a Hugging Face model dir (or hub name) to start from; see `dilocox import`
    subspace_rank: int = 0  # k > 0: every write into the residual stream lies in one fixed k-dim subspace and the
    # embedding is a fixed part + a trained part in it, so a pipeline boundary can send k values per token instead of
    # d_model (swarm.activations=subspace*; dilocox/model/subspace.py). 0 = the plain model
    subspace_layers: int | None = None  # only the first N layers write into the subspace (null: all); the layers
    # after the last pipeline boundary need not (a 2-stage SWARM: n_layers / 2)

    def in_subspace(self, layer: int) -> bool:
        """Whether layer ``layer`` writes into the residual stream through the subspace (model/subspace.py)."""
        n = self.n_layers if self.subspace_layers is None else self.subspace_layers
        return bool(self.subspace_rank) and layer < n

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_dim(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def head_problems(self) -> list[tuple[str, object, str]]:
        """(field, value, why) of each rule of the model's own fields broken: head shapes, RoPE's base, an arch
        label left with another family's blocks (config validation, and a model built in code)."""
        gpt2_blocks = (self.norm, self.activation, self.pos_emb) == ("layernorm", "gelu", "learned")
        rules = (
            (self.d_model % self.n_heads, "model.d_model", self.d_model, f"is not divisible by model.n_heads="
             f"{self.n_heads}"),
            (self.n_heads % self.kv_heads, "model.n_kv_heads", self.n_kv_heads, f"must divide model.n_heads="
             f"{self.n_heads} (GQA groups)"),
            (self.pos_emb == "rope" and self.head_dim % 2, "model.d_model", self.d_model, "gives an odd head_dim; "
             "RoPE needs an even head_dim"),
            (not self.rope_theta > 0, "model.rope_theta", self.rope_theta, "must be > 0 (RoPE's base; a base <= 0 "
             "makes the rotation table NaN), e.g. 10000.0 or Qwen1.5's 1000000.0"),
            (self.arch == "qwen" and gpt2_blocks, "model.arch", self.arch, "but model.norm/activation/pos_emb are "
             "the GPT-2 defaults; set norm: rmsnorm, activation: swiglu, pos_emb: rope, bias: false, qkv_bias: true "
             "(see configs/model/qwen-tiny.yaml)"),
        )  # fmt: skip
        return [r[1:] for r in rules if r[0]]

    def num_params(self, include_embedding: bool = True) -> int:
        """Exact parameter count of the model this config builds (used by plan and MFU)."""
        d, f, L, V = self.d_model, self.ffn_dim, self.n_layers, self.vocab_size
        hd, kv = self.head_dim, self.kv_heads
        qkv_out = d + 2 * kv * hd
        qkv_b = self.qkv_bias if self.qkv_bias is not None else self.bias
        n_in = 2 if self.activation == "swiglu" else 1
        norm_p = d if self.norm == "rmsnorm" else 2 * d

        def layer(r: int) -> int:  # r: outputs of the residual out-projections (k in the subspace, else d)
            attn = d * qkv_out + (qkv_out if qkv_b else 0) + d * r + (r if self.bias else 0)
            mlp = n_in * d * f + f * r + ((n_in * f + r) if self.bias else 0)
            return attn + mlp + 2 * norm_p

        r = self.subspace_rank or d  # the trained embedding's width
        total = sum(layer(self.subspace_rank if self.in_subspace(i) else d) for i in range(L)) + norm_p
        if include_embedding:
            total += V * r  # token embedding (its trained part, with the constraint)
            if self.pos_emb == "learned":
                total += self.max_seq_len * r
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
    microbatches: int = 1  # a step's train.batch_size is split into this many microbatches (the pipeline's fill)
    timeout_s: float = 600.0  # bound on every collective inside a replica (process groups' timeout); a stuck rank
    # ends the run

    @property
    def world_size(self) -> int:
        return self.replicas * self.data * self.pipeline * self.tensor


@dataclass
class DataConfig:
    source: str = "stdlib"  # stdlib (Python's stdlib sources) | prose (pydoc_data.topics) | docs (prose + the stdlib's
    # docstrings, 4.6x prose: long runs) | text | memmap | hf
    path: str | None = None  # text: file/dir/glob; memmap: prepared dir; hf: a hub dataset name, local data files
    # (text/json/jsonl/parquet/csv), a dataset directory written by save_to_disk, or a local copy of a hub dataset
    # (the last two load offline)
    hf_config: str | None = None  # hf: the dataset's config name (e.g. wikitext-103-raw-v1 for wikitext); None: its
    # default
    hf_split: str = "train"  # hf: the split to read
    hf_text_field: str = "text"  # hf: the column holding the text
    tokenizer: str = "byte"  # byte | bpe (trained on the corpus) | hf:PATH (a model's own tokenizer.json, or the
    # Hugging Face model directory holding it: GPT-2's, Qwen's; model.vocab_size must cover its vocabulary)
    bpe_vocab_size: int = 4096  # tokenizer=bpe: the vocabulary it trains (set model.vocab_size to at least this)
    bpe_train_bytes: int | None = 100_000_000  # the BPE trains on about this many bytes of the training documents
    # (every k-th document, k from their sizes): its memory and time stay bounded on a large corpus; None = all
    cache_dir: str = ".cache/dilocox"  # tokenizers and prepared token files
    val_fraction: float = 0.02  # share of the corpus's bytes held out for validation: its last documents (or a tail)
    max_bytes: int | None = None  # opt-in cap on the raw corpus read: its first N UTF-8 bytes (a run says when it
    # cuts, with the source's size); None = all of it
    sampler: str = "random"  # random: each replica's windows drawn uniformly from the whole training split, with
    # replacement, seeded by (train.seed, replica, step): i.i.d. data per replica, which overlaps by chance | epoch:
    # non-overlapping windows in a per-epoch shuffled order, replica r takes its own slice of each step's windows:
    # no window read twice within an epoch, by one replica or two (Megatron's sampling without replacement)


@dataclass
class OptimConfig:
    """Inner optimizer (AdamW) and its schedule."""

    lr: float = 4e-4  # the peak: reached at the end of the warm-up
    min_lr_ratio: float = 0.1  # the floor, lr * min_lr_ratio: reached at the last step (train.steps - 1)
    warmup_steps: int = 20  # linear from lr / warmup_steps at step 0 to lr at step warmup_steps - 1
    schedule: str = "cosine"  # cosine | constant | linear: the decay from the warm-up's end to the floor | wsd |
    # wsd-sqrt: warmup-stable-decay, lr held until the last decay_fraction of the steps after the warm-up, then a
    # linear (wsd) or 1 - sqrt (wsd-sqrt; Hägele et al. 2024) cool-down to the floor
    decay_fraction: float = 0.2  # wsd / wsd-sqrt: the share of the steps after the warm-up that cool down
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW's (beta1, beta2) of the inner optimizer
    eps: float = 1e-8  # AdamW's epsilon
    weight_decay: float = 0.1  # decoupled weight decay of the tensors of >= 2 dims (biases and norms: none)
    grad_clip: float = 1.0  # global-norm clipping across TP and PP ranks; 0 = off
    name: str = "adamw"  # adamw | muon (torch.optim.Muon on the blocks' hidden matrices, AdamW on the rest) | sgd
    # (sgd only for equivalence tests)
    muon_momentum: float = 0.95  # optim.name=muon: Muon's momentum (Nesterov)


@dataclass
class StreamingConfig:
    fragments: int = 1  # K; 1 = plain (non-streaming) DiLoCo
    tau: int = 0  # overlap in inner steps
    alpha: float = 0.5  # mixing of local and global fragment params
    pattern: str = "sequential"  # sequential | strided
    merge: str = "mix"  # mix | replay (the mix from the launch's params + the tau steps since; ALGORITHMS §4b)


@dataclass
class ElasticSection:
    """Elastic replicas (docs/ELASTIC.md): each replica is its own torchrun job; the outer groups are formed per
    outer step by a torchft lighthouse quorum of the replicas alive then."""

    enabled: bool = False  # true: this job is ONE replica (parallel.replicas must be 1) of an elastic run
    lighthouse: str | None = None  # http://host:port of the torchft lighthouse (`dilocox lighthouse`); null: the
    # TORCHFT_LIGHTHOUSE environment variable. A primary and its standbys: http://a:29510,http://b:29510 (the first
    # that listens is used; docs/ELASTIC.md "A standby lighthouse")
    replica_rank: int = 0  # this replica's identity in [0, max_replicas): its data stream; keep it across restarts
    min_replicas: int = 1  # fewest replicas an outer step may be averaged over; below it the survivors wait
    # (quorum_timeout_s, logged) for a join, then stop with a clear message
    initial_replicas: int | None = None  # replicas the first outer step waits for (bounded); null: min_replicas
    max_replicas: int = 8  # upper bound on replica_rank (data streams, contributor count buffer)
    timeout_s: float = 60.0  # bound on one outer all-reduce / commit / state transfer
    quorum_timeout_s: float = 120.0  # bound on forming a quorum and on the wait below min_replicas
    max_attempts: int = 3  # retries of one outer step whose all-reduce failed (a replica died in flight)
    heartbeat_ms: int = 100  # how often the replica heartbeats the lighthouse
    lighthouse_auth: bool | None = None  # null (the default): security.authenticate. true: the lighthouse(s) run with
    # `dilocox lighthouse --secret-file` (a guard in front of torchft's server), the replica proves the run secret on
    # every connection to them and refuses a plain lighthouse; its store and manager are guarded too (needs
    # security.authenticate). false: a plain lighthouse, nothing of the replica guarded (a closed network only)
    collectives: str = "auto"  # the replicas' outer collectives: gloo (torchft's gloo pairs: unauthenticated, in
    # the clear: a private network across sites) | authenticated (dilocox's mesh: the run secret's handshake on every
    # pair connection, each message MACed, or encrypted with security.encrypt; needs lighthouse_auth; elastic/mesh.py)
    # | auto (authenticated where lighthouse_auth is on, as under `dilocox launch --elastic`; else gloo)
    standby: bool = False  # a warm standby (issue 45): build the model, data and optimizer, then wait (bounded by
    # standby_timeout_s) until `dilocox launch --elastic --standby-replicas S` writes activate.json into log.run_dir,
    # naming the replica_rank of a replica that died; then join the live run as it (its data stream) at once
    standby_timeout_s: float = 3600.0  # bound on a standby's wait; past it the job exits 0 (it was not needed)


@dataclass
class OuterConfig:
    """The outer loop (DiLoCo family). method=none means a single replica, no outer loop."""

    method: str = "none"  # none | allreduce | diloco | cocktailsgd
    sync_every: int = 100  # H inner steps per outer step
    lr: float = 0.7  # with more replicas, raise it together with optim.lr (4 replicas of the tiny model: inner
    # 4x, outer 1.0 at width 64; inner 2x, outer 1.4 at width 128, where 1.7 blows up; docs/BENCHMARKS.md 4h)
    momentum: float = 0.9  # the outer SGD's momentum (DiLoCo: 0.9)
    nesterov: bool = True  # Nesterov momentum for the outer SGD (DiLoCo's outer optimizer)
    optimizer: str = "sgd"  # the outer optimizer (a torch.optim.Optimizer over the shard's θ, dilocox/optim.py):
    # sgd (the papers' outer Nesterov: lr, momentum, nesterov above) | muon (torch.optim.Muon on the blocks' hidden
    # matrices with lr and momentum above, sgd on the rest; TP = 1, no look-ahead; a live join and a resume on
    # another layout carry its state)
    overlap: str = "none"  # none | delayed | eager
    lr_schedule: str = "constant"  # constant | inner: the outer lr (every group of outer.optimizer) times the inner
    # schedule's lr_at(step) / optim.lr at each outer step: warm-up and decay follow the inner ones (issue 41's lever)
    lookahead: float = 0.0  # overlap=delayed: each inner phase starts from θ − lookahead·lr·v, the step the
    # in-flight average will make as predicted by the outer momentum v (0 = off; 1 = the full prediction); the
    # pseudo-gradient is taken from that start, so only the start point moves (outer/diloco.py docstring)
    state_device: str = "host"  # host | device (where the fp32 outer params + momentum live)
    comm_stream: bool = False  # CUDA: the comm thread's kernels (codec, copies) on a stream of its own, ordered after
    # the launch by an event (torchft's Streaming DiLoCo also runs its all-reduces on a stream of their own): its host
    # waits wait for its own work only, not for the training kernels queued by then (distributed/comm.py; the
    # codec's working set is cached apart). Refused with train.device=cpu; train.device=auto on a host without a GPU
    # runs without it. Off until a GPU row measures it (tools/gpu_check.sh stream; docs/BENCHMARKS.md 13c)
    blocking: bool = False  # true: wait for the outer all-reduce on the critical path
    shard_over_data: bool = True  # parallel.data = D > 1: each DP rank syncs 1/D of the shard's tensors over the
    # slow link and broadcasts them to the others (slow-link bytes and outer state / D); false: every DP rank syncs
    # all (D x the bytes). The DiLoCo family only: allreduce and cocktailsgd average every step's gradients from
    # every DP rank either way
    streaming: StreamingConfig = field(default_factory=StreamingConfig)
    timeout_s: float = 600.0  # bound on every wait across replicas (outer all-reduce, world-wide agreements); then
    # every rank exits non-zero
    warn_after_s: float = 30.0  # log "waiting N s for the outer all-reduce with replica(s) ..." every this many
    # seconds while a wait lasts
    norm_check: float = 0.0  # > 1: a replica whose pseudo-gradient norm (per shard) is not finite or above this x the
    # median of the replicas' norms is left out of that outer step's mean, logged (0 = off; needs >= 3 replicas to
    # ever reject; one float per replica more per sync; fixed or elastic replicas, overlap none|delayed: not eager
    # or SWARM; docs/SECURITY.md)
    elastic: ElasticSection = field(default_factory=ElasticSection)


@dataclass
class LowRankConfig:
    enabled: bool = False  # PowerSGD low rank of the pseudo-gradient's matrices (DiLoCoX; compress/lowrank.py)
    rank: int = 16  # r: the rank (the start rank when compress.adaptive is on)
    min_compression: float = 1.0  # only factor a matrix when (n+m)*r*2 < n*m / min_compression


@dataclass
class SparseConfig:
    """Chunked top-k of the pseudo-gradient with error feedback and low-bit values (SparseLoCo; compress/sparse.py)."""

    enabled: bool = False  # replaces compress.quant / lowrank for the outer sync (they must stay off)
    density: float = 0.015625  # fraction kept per chunk (1/64: 64 of 4096)
    chunk: int = 4096  # top-k is taken within chunks of this many consecutive elements of a tensor
    bits: int = 2  # 2 | 4 | 8: bits per kept value (one bf16 scale per chunk)
    indices: str = "rice"  # rice | fixed: the kept indices of a chunk as Rice-coded gaps in a fixed-size block (9
    # bits an index at 1/128 of 4096 against 12; lossless, so training is bit-identical; compress/rice.py) or as
    # ceil(log2 chunk)-bit integers (the format of the tables in docs/BENCHMARKS.md dated before 2026-11-30)
    ef_decay: float = 0.95  # beta of the error buffer e = beta e + delta (SparseLoCo's replacement for outer momentum)
    owner_keep: int = 1  # compress.collective=reduce_scatter: each chunk's owner sends owner_keep x k entries of the
    # mean (of the up to R x k the replicas picked; the rest waits in its residual). 1: ~2 payloads sent per sync
    # whatever R, 2: ~3 (BENCHMARKS 4h: at 4 replicas of width 128, 1 costs +14.5 % loss against the all-gather,
    # 2 costs +5.5 %; at 8 replicas of width 64, +0.8 % and +0.4 %)

    def problems(self) -> list[tuple[str, object, str]]:
        """(field, value, what is wrong) of a codec section (config/checks.py ``check_codecs``)."""
        return [
            p
            for p in (
                ("density", self.density, "must be in (0, 1]") if not 0.0 < self.density <= 1.0 else None,
                ("chunk", self.chunk, "must be >= 2") if self.chunk < 2 else None,
                ("bits", self.bits, "must be 2, 4 or 8") if self.bits not in (2, 4, 8) else None,
                ("indices", self.indices, "must be rice or fixed") if self.indices not in ("rice", "fixed") else None,
                ("ef_decay", self.ef_decay, "must be in [0, 1]") if not 0.0 <= self.ef_decay <= 1.0 else None,
                ("owner_keep", self.owner_keep, "must be an integer >= 1") if self.owner_keep < 1 else None,
            )
            if p is not None
        ]


@dataclass
class SignConfig:
    """Scaled sign of the pseudo-gradient with error feedback: 1 bit per value + one fp32 scale (the block's mean
    |value|) per block (EF-signSGD; compress/sign.py)."""

    enabled: bool = False  # replaces compress.quant / lowrank for the outer sync (they must stay off)
    block: int = 256  # values per scale (a multiple of 8; a block never spans two tensors)

    def problems(self) -> list[tuple[str, object, str]]:
        """(field, value, what is wrong) of a codec section (config/checks.py ``check_codecs``)."""
        ok = self.block >= 8 and self.block % 8 == 0
        return [] if ok else [("block", self.block, "must be a multiple of 8 (8 sign bits per byte), e.g. 256")]


@dataclass
class AdaptiveConfig:
    enabled: bool = False  # DiLoCoX's adaptive H and (with compress.lowrank) rank after every outer step (adaptive.py)
    energy_eps: float = 0.05  # the rank keeps 1 - energy_eps of the averaged pseudo-gradient's energy
    window: int = 5  # the next rank is the mean of the last `window` effective ranks
    rank_min: int = 2  # bounds of the rank
    rank_max: int = 64  # (the rank stays in [rank_min, rank_max])
    h_min: int = 10  # bounds of H (outer.sync_every), chosen so the sync's time fits under H steps
    h_max: int = 1000  # (H stays in [h_min, h_max])


@dataclass
class CompressConfig:
    quant: str = "none"  # none | fp16 | int8 | int4
    group_size: int = 128  # int4 / int8: values per bf16 scale
    collective: str = "auto"  # auto | allgather | reduce_scatter. quant: auto all-gathers up to 4 replicas. With
    # compress.sparse auto is the all-gather ((R-1) payloads sent per sync); reduce_scatter has each chunk's owner
    # average, re-sparsify and all-gather the mean (~2 payloads whatever R: 1,001x fewer bytes than all-reduce at
    # R = 8 where the all-gather is 273x, for +0.8..1.2 % loss; +14.5 % at R = 4, width 128: BENCHMARKS 4h;
    # compress/sparse_rs.py). Other codecs: all-gather
    error_feedback: bool = True  # keep what a lossy codec did not send and add it to the next sync's input
    lowrank: LowRankConfig = field(default_factory=LowRankConfig)
    sparse: SparseConfig = field(default_factory=SparseConfig)
    sign: SignConfig = field(default_factory=SignConfig)
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    # CocktailSGD (ALGORITHMS §8)
    random_fraction: float = 0.1  # cocktailsgd: the shared random subset of each tensor's entries
    topk_fraction: float = 0.08  # cocktailsgd: the top-k by magnitude kept of that subset


@dataclass
class TrainConfig:
    steps: int = 200  # optimizer steps of the run (the schedule's length)
    batch_size: int = 8  # sequences per replica per step (split into microbatches)
    seq_len: int = 128  # tokens per sequence
    seed: int = 1234  # the model's init, the data order and the dropout masks
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 autocast on GPU, fp32 on CPU) | fp32 | bf16
    compile: bool = False  # torch.compile: at P = T = 1 forward + loss as one graph, else each transformer block
    # (as torchtitan); parameter names unchanged; pays a compile at start-up. docs/BENCHMARKS.md "GPU", 13c
    recompute: str = "none"  # activation recomputation: none | full (each block keeps its input only and runs its
    # forward again in the backward) | selective (keeps GEMM and attention outputs, recomputes the rest); same results
    eval_every: int = 50  # validation loss every N steps (and at the end)
    eval_batches: int = 4  # 0: no validation (final_val_loss is null in metrics.jsonl and rank_*.json)
    max_tokens: int | None = None  # stop once this many tokens per replica were trained
    stop_timeout_s: float = 60.0  # after SIGINT/SIGTERM, `dilocox train --nproc N` kills the ranks that have not
    # saved and exited by then

    @property
    def last_step(self) -> int:
        """The step the run ends at: ``steps``, or the first step at which ``max_tokens`` per replica are reached."""
        if not self.max_tokens:
            return self.steps
        return min(self.steps, -(-self.max_tokens // (self.batch_size * self.seq_len)))


@dataclass
class CheckpointConfig:
    dir: str | None = None  # None = <run_dir>/checkpoints
    every: int = 100  # save every E steps and at the end (a kill -9 loses at most E steps; a rerun resumes); 0 = only
    # at the end. With several replicas the save waits for the first outer sync at or after each multiple (the save
    # agrees over every rank of every replica: nothing crosses them between syncs). SWARM: 0 = no checkpoints; E > 0 =
    # every E steps and at the end, into OUT/checkpoints (docs/SWARM.md)
    keep: int = 2  # the newest K complete checkpoints are kept, older ones deleted (K+1 on disk during a save); 0 = all
    resume: str = "auto"  # auto (latest in dir if any) | none (fresh start; refused if the dir already holds
    # checkpoints) | <path to a step dir>
    fallback: bool = True  # resume=auto: a damaged shard (size/hash mismatch) falls back to the previous complete
    # checkpoint; false: stop
    check_space: bool = True  # at start-up refuse a checkpoint dir without room for one checkpoint, warn below keep+1
    # (keep+2 with checkpoint.continuation's save at a DiLoCo-family run's end)
    resume_finished: str = "skip"  # resumed checkpoint at/past train.steps: skip (prints "already finished: see
    # RUN_DIR", exit 0) | error (exit 2); neither writes anything
    continuation: bool = True  # DiLoCo family: the end of a run (outer.finish) sets every parameter to θ; its state
    # from before that is saved too, in <checkpoint.dir>/continue/, and a resume with more train.steps goes on from it,
    # exactly as one longer run would (same schedule); false: no such save, an extension goes on from θ


@dataclass
class LogConfig:
    run_dir: str = "runs/default"  # config, metrics.jsonl, checkpoints/, the run lock (one run per directory)
    every: int = 10  # a log line every N steps, when the records of the steps since (one per step) are read off
    # the device and written to metrics.jsonl: no host sync in between
    jsonl: bool = True  # RUN_DIR/metrics.jsonl (one JSON record per step, written every log.every steps)
    tensorboard: bool = True  # when the tensorboard package is installed
    progress: bool = True  # progress bar on a TTY
    wandb: bool = False  # also log to Weights & Biases (rank 0, config attached; WANDB_MODE=offline: no network)
    wandb_project: str = "dilocox"  # W&B project; the W&B run is named after log.run_dir and writes to RUN_DIR/wandb
    profile_start: int = 0  # > 0: a torch.profiler trace of steps profile_start .. + profile_steps - 1 per rank, in
    # RUN_DIR/profile/ (Chrome trace + the ops by self time; dilocox/profiling.py); 0 = off
    profile_steps: int = 3  # how many steps log.profile_start traces (>= 1)


@dataclass
class SwarmConfig:
    """SWARM / DiLoCo-SWARM (issue 11; `dilocox/swarm/`): several peer processes serve each pipeline stage."""

    peers_per_stage: tuple = (2, 2)  # m_j peers serving stage j; its length is the number of stages
    sync: str = "swarm"  # swarm: the stage's grads all-reduced every step, then one AdamW step | diloco: AdamW per
    # peer, every outer.sync_every steps the stage's peers take the outer step (outer.lr, momentum, nesterov)
    routing: str = "iwrr"  # iwrr (weighted round-robin on measured time) | random | fixed (sender k -> peer k mod m)
    microbatch_size: int = 2  # sequences per microbatch; must divide train.batch_size (per stage-0 peer and step)
    max_inflight: int = 2  # microbatches a stage-0 peer keeps in flight at once
    activations: str = "none"  # codec of activations and their grads between stages: none | fp16 | int8 | int4 |
    # subspace[-int8|-int4] (k values per token; needs model.subspace_rank = k) | colk[-int8|-int4] (the
    # activation_cols fraction of columns with the largest norm); dilocox/swarm/activations.py, docs/SWARM.md
    activation_block: int = 2048  # values per scale of the int8/int4 value codes (Dettmers et al. use 2048)
    activation_cols: float = 0.125  # colk: fraction of the d_model columns kept per microbatch
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

    def __post_init__(self) -> None:
        # the field's own spelling, normalised where it is built (YAML, `--swarm.peers_per_stage=[2,2]`, a bare
        # int): a tuple of ints; anything else is left as given for check_swarm to name (validation never
        # changes the config)
        self.peers_per_stage = _peers_tuple(self.peers_per_stage)


def _peers_tuple(pps):
    if isinstance(pps, str):
        import yaml  # the config's own parser; imported here so the sections stay plain data

        try:
            pps = yaml.safe_load(pps)
        except yaml.YAMLError:
            return pps
    if isinstance(pps, int) and not isinstance(pps, bool):
        pps = [pps]
    if isinstance(pps, (list, tuple)) and all(isinstance(m, int) and not isinstance(m, bool) for m in pps):
        return tuple(pps)
    return pps


@dataclass
class SecurityConfig:
    """Who may talk to the run's own TCP services (docs/SECURITY.md): the SWARM peers' tensor RPC and the state
    transfer to a joining elastic replica or SWARM peer."""

    authenticate: bool = True  # every SWARM RPC connection and every elastic state transfer proves the run secret
    # both ways, every message is MACed; false: anyone who reaches a port is served (a closed lab network only)
    secret_file: str = ""  # the run secret (hex, mode 0600); "" = <out dir>/secret, written by `dilocox swarm` and
    # `dilocox launch --elastic` (RUN/secret) when absent. Give every host of a multi-host run the same file (never
    # put the secret on a command line)
    guard_services: bool = True  # with authenticate: a SWARM job's address store and stage lighthouses listen on
    # loopback behind a guard that wants the run secret; its peers reach them through a local relay that proves it
    # (false: plain, as a `dilocox swarm store` / `dilocox lighthouse` started without --secret-file)
    encrypt: bool = False  # also encrypt every message of those connections (ChaCha20-Poly1305, key from the
    # handshake); needs authenticate. Costs CPU per byte: docs/BENCHMARKS.md (`dilocox bench rpc`). The gloo outer
    # all-reduce is not covered (docs/SECURITY.md)
    handshake_s: float = 2.0  # every server of the run ends its handshake with a connection within this (seconds,
    # at most 30): a silent stranger holds one of its address's 4 slots that long. Raise it (e.g. 5) on a lossy WAN
    # where a handshake's few round trips may need retransmits; `dilocox lighthouse`/`swarm store`: --handshake-s
