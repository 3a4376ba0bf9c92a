"""One config-driven decoder-only transformer (GPT-2, OPT, Qwen/Llama), cut into pipeline stages.

``build_stage_model(mcfg, stage, n_stages, tp_rank, tp_size, tp_group)`` builds the part of the
model that one rank owns: layers ``[stage*L/P, (stage+1)*L/P)`` with their matrices split over
the tensor-parallel group; the first stage also owns the token (+ learned position) embedding,
the last stage the final norm and the vocab-parallel LM head. ``P = T = 1`` is the whole model.

Architectures (``model.arch`` picks the defaults; every field can be overridden in YAML):

====== ========= ======== ======== ===============================================
arch   norm      MLP      position biases
====== ========= ======== ======== ===============================================
gpt2   LayerNorm GELU     learned  all linear layers
opt    LayerNorm ReLU     learned  all (real OPT offsets positions by 2; not needed)
qwen   RMSNorm   SwiGLU   RoPE     q/k/v only; grouped-query attention (n_kv_heads)
====== ========= ======== ======== ===============================================

The blocks are built from the config fields (norm, activation, pos_emb, bias, qkv_bias), not
from ``arch``, which is a label: a Qwen config sets those fields (``configs/model/*.yaml``);
``arch: qwen`` left with all GPT-2 defaults is rejected as an obvious mistake.

Layout independence: layers are named by their GLOBAL index (``layers.7.attn.q_proj.weight``
on every layout), and every parameter is initialised from a generator seeded by
``(seed, global name)`` over its full (unsharded) shape before the rank keeps its slice. So a
TP=2 x PP=2 model holds exactly the weights of the 1-process model built with the same seed,
on a GPU as on a CPU (the generator is a CPU one whatever the device), and checkpoints /
streaming fragments keyed by name work across layouts.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dilocox.config import ConfigError, ModelConfig
from dilocox.config.checks import check_subspace
from dilocox.distributed.topology import group_rank, group_world
from dilocox.model import subspace
from dilocox.model.attention import make_attention, tp_rank_dropout
from dilocox.model.fp8 import select_linear_fn, tell_if_emulated
from dilocox.model.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    full_shape,
    gather_along_dim,
    init_std_scaled,
    is_tensor_parallel,
    shard_tensor,
    vocab_parallel_cross_entropy,
)
from dilocox.model.recompute import run_block
from dilocox.seeding import text_seed

NORM_NAMES = ("ln_1", "ln_2", "norm_f")  # module names of norms (weights init to 1)
RESIDUAL_OUT_NAMES = ("o_proj", "down_proj")  # projections into the residual stream (scaled init)


# --------------------------------------------------------------------------- building blocks


class SubspaceExpand(nn.Module):
    """``y -> y U^T``: k coefficients to the d-dim residual stream (``model.subspace_rank``; model/subspace.py).
    ``U`` is no buffer: a function of the shape, cached per device and dtype, so no build path (meta device,
    ``to_empty``, a checkpoint load) can leave it unset."""

    def __init__(self, d: int, k: int):
        super().__init__()
        self.d, self.k = d, k

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return F.linear(y, subspace.basis(self.d, self.k, y.device, y.dtype))

    def extra_repr(self) -> str:
        return f"d={self.d}, k={self.k}"


def residual_width(mcfg: ModelConfig, constrained: bool = True) -> int:
    """Outputs of a residual out-projection (or the trained embedding): d_model, or k under the subspace
    constraint (``constrained``: this layer is one of the first ``model.subspace_layers``)."""
    return mcfg.subspace_rank if mcfg.subspace_rank and constrained else mcfg.d_model


def make_expand(mcfg: ModelConfig, constrained: bool = True) -> nn.Module:
    k = mcfg.subspace_rank if constrained else 0
    return SubspaceExpand(mcfg.d_model, k) if k else nn.Identity()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def make_norm(mcfg: ModelConfig, device=None) -> nn.Module:
    if mcfg.norm == "rmsnorm":
        return RMSNorm(mcfg.d_model, mcfg.norm_eps, device=device)
    return nn.LayerNorm(mcfg.d_model, eps=mcfg.norm_eps, device=device)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[S, 1, hd]`` of rotary embeddings (rotate-half layout, as Llama/Qwen)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, S, H, hd]`` by position (computed in fp32)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention; heads split over TP ranks (q/k/v column-, o row-parallel)."""

    def __init__(self, mcfg: ModelConfig, tp_group, tp_size: int, linear_fn, device=None, constrained=True):
        super().__init__()
        d, hd = mcfg.d_model, mcfg.head_dim
        self.group, self.head_dim = tp_group, hd
        self.n_heads, self.n_kv_heads = mcfg.n_heads // tp_size, mcfg.kv_heads // tp_size
        qkv_bias = mcfg.bias if mcfg.qkv_bias is None else mcfg.qkv_bias
        col = dict(group=tp_group, tp_size=tp_size, linear_fn=linear_fn, device=device, copy_input=False)
        self.q_proj = ColumnParallelLinear(d, mcfg.n_heads * hd, qkv_bias, **col)
        self.k_proj = ColumnParallelLinear(d, mcfg.kv_heads * hd, qkv_bias, **col)
        self.v_proj = ColumnParallelLinear(d, mcfg.kv_heads * hd, qkv_bias, **col)
        self.o_proj = RowParallelLinear(
            mcfg.n_heads * hd,
            residual_width(mcfg, constrained),
            mcfg.bias,
            tp_group,
            tp_size,
            linear_fn=linear_fn,
            device=device,
        )
        self.o_expand = make_expand(mcfg, constrained)
        self.kernel = make_attention(mcfg.attn_backend, self.n_heads, self.n_kv_heads, hd, mcfg.dropout)
        # model.fused_qkv: one GEMM over the three weights concatenated per call (Megatron's fused QKV; the parameters,
        # checkpoints, HF names and TP shards stay q/k/v). Plain linears only: an fp8 linear scales per weight
        self.fused_qkv = mcfg.fused_qkv and linear_fn is F.linear
        # attention dropout on TP-split heads: masks of this rank's own (attention.tp_rank_dropout), run eagerly
        self.dropout_rank = group_rank(tp_group) if mcfg.dropout and tp_size > 1 else None
        self.eager_tp_dropout = torch.compiler.disable(tp_rank_dropout) if self.dropout_rank is not None else None

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if not self.fused_qkv:
            return tuple(p(x) for p in projs)  # (the reference of the fused path)
        w = torch.cat([p.weight for p in projs])
        b = torch.cat([p.bias for p in projs]) if self.q_proj.bias is not None else None
        return F.linear(x, w, b).split([p.weight.shape[0] for p in projs], dim=-1)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, s, _ = x.shape
        x = copy_to_tp(x, self.group)  # one backward all-reduce for q, k and v together
        q, k, v = self.qkv(x)
        q = q.view(b, s, self.n_heads, self.head_dim)
        k = k.view(b, s, self.n_kv_heads, self.head_dim)
        v = v.view(b, s, self.n_kv_heads, self.head_dim)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.dropout_rank is not None and self.training:
            y = self.eager_tp_dropout(self.kernel, self.dropout_rank, q, k, v)
        else:
            y = self.kernel(q, k, v)
        y = y.reshape(b, s, self.n_heads * self.head_dim)
        return self.o_expand(self.o_proj(y))


class MLP(nn.Module):
    """``down(act(up(x)))`` or SwiGLU ``down(silu(gate(x)) * up(x))``; d_ff split over TP."""

    def __init__(self, mcfg: ModelConfig, tp_group, tp_size: int, linear_fn, device=None, constrained=True):
        super().__init__()
        d, f, bias = mcfg.d_model, mcfg.ffn_dim, mcfg.bias
        self.group, self.activation = tp_group, mcfg.activation
        col = dict(group=tp_group, tp_size=tp_size, linear_fn=linear_fn, device=device, copy_input=False)
        if self.activation == "swiglu":
            self.gate_proj = ColumnParallelLinear(d, f, bias, **col)
        self.up_proj = ColumnParallelLinear(d, f, bias, **col)
        self.down_proj = RowParallelLinear(
            f, residual_width(mcfg, constrained), bias, tp_group, tp_size, linear_fn=linear_fn, device=device
        )
        self.down_expand = make_expand(mcfg, constrained)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.group)
        if self.activation == "swiglu":
            h = F.silu(self.gate_proj(x)) * self.up_proj(x)
        elif self.activation == "gelu":
            h = F.gelu(self.up_proj(x), approximate="tanh")
        else:
            h = F.relu(self.up_proj(x))
        return self.down_expand(self.down_proj(h))


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, mcfg: ModelConfig, tp_group, tp_size: int, linear_fn, device=None, constrained=True):
        super().__init__()
        self.ln_1 = make_norm(mcfg, device)
        self.attn = Attention(mcfg, tp_group, tp_size, linear_fn, device, constrained)
        self.ln_2 = make_norm(mcfg, device)
        self.mlp = MLP(mcfg, tp_group, tp_size, linear_fn, device, constrained)
        self.drop = nn.Dropout(mcfg.dropout)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x), rope))
        return x + self.drop(self.mlp(self.ln_2(x)))


# --------------------------------------------------------------------------- the stage model


def _check_layout(mcfg: ModelConfig, stage: int, n_stages: int, tp_rank: int, tp_size: int, tp_group) -> None:
    def bad(name, value, rule):
        raise ConfigError(f"{name}={value!r} {rule}")

    for field, value, why in mcfg.head_problems():  # config validation's rules, for a ModelConfig built in code
        bad(field, value, why)
    if not 0 <= stage < n_stages:
        bad("stage", stage, f"must be in [0, {n_stages})")
    if mcfg.n_layers % n_stages:
        bad("model.n_layers", mcfg.n_layers, f"is not divisible by parallel.pipeline={n_stages}")
    for name, n in (
        ("model.n_heads", mcfg.n_heads),
        ("model.n_kv_heads", mcfg.kv_heads),
        ("model.d_ff", mcfg.ffn_dim),
        ("model.vocab_size", mcfg.vocab_size),
    ):
        if n % tp_size:
            bad(name, n, f"is not divisible by parallel.tensor={tp_size}")
    if mcfg.tie_embeddings and n_stages > 1:
        bad("model.tie_embeddings", True, f"is not supported with parallel.pipeline={n_stages} > 1")
    check_subspace(mcfg)
    if mcfg.loss_backend not in ("vocab_parallel", "torch"):
        bad("model.loss_backend", mcfg.loss_backend, "is not one of ['vocab_parallel', 'torch']")
    if mcfg.loss_backend == "torch" and tp_size > 1:
        bad("model.loss_backend", "torch", f"needs parallel.tensor=1, not {tp_size}; use vocab_parallel")
    if group_world(tp_group) != tp_size:
        bad("tp_size", tp_size, f"does not match the size {group_world(tp_group)} of the tensor-parallel group passed")
    if tp_group is not None and group_rank(tp_group) != tp_rank:
        bad("tp_rank", tp_rank, f"is not this process's rank {group_rank(tp_group)} in the tensor-parallel group")


def param_layer_id(name: str) -> int | None:
    """Global layer index of a parameter name (``...layers.<i>....``); None outside the layers."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


class StageModel(nn.Module):
    """The layers of one pipeline stage on one TP rank (see the module docstring)."""

    def __init__(
        self,
        mcfg: ModelConfig,
        stage: int = 0,
        n_stages: int = 1,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group=None,
        device="cpu",
    ):
        super().__init__()
        _check_layout(mcfg, stage, n_stages, tp_rank, tp_size, tp_group)
        self.mcfg, self.stage, self.n_stages = mcfg, stage, n_stages
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.recompute = "none"  # train.recompute: none | full | selective (model/recompute.py), set by the trainer
        per = mcfg.n_layers // n_stages
        self.layer_ids = list(range(stage * per, (stage + 1) * per))
        linear_fn = select_linear_fn(mcfg.linear_backend)
        d, V = mcfg.d_model, mcfg.vocab_size
        if self.is_first:
            w = residual_width(mcfg)  # under the subspace constraint: the trained part, k wide (model/subspace.py)
            self.embed = VocabParallelEmbedding(V, w, tp_group, tp_rank, tp_size, device=device)
            if mcfg.pos_emb == "learned":
                self.pos_embed = nn.Embedding(mcfg.max_seq_len, w, device=device)
            self.embed_expand = make_expand(mcfg)
            self.drop = nn.Dropout(mcfg.dropout)
        self.layers = nn.ModuleDict(
            {str(i): Block(mcfg, tp_group, tp_size, linear_fn, device, mcfg.in_subspace(i)) for i in self.layer_ids}
        )
        if self.is_last:
            self.norm_f = make_norm(mcfg, device)
            self.head = ColumnParallelLinear(
                d, V, False, tp_group, tp_size, device=device
            )  # head stays in high precision
            if mcfg.tie_embeddings:
                self.head.weight = self.embed.weight
        if mcfg.linear_backend.startswith("fp8"):  # where it will emulate the fp8 GEMMs: said once (fp8.py)
            tell_if_emulated(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids ``[B, S]`` (first stage) or hidden ``[B, S, d]`` -> hidden, or logits shard ``[B, S, V/T]``
        (last)."""
        if self.is_first:
            if x.dim() != 2 or x.dtype not in (torch.int64, torch.int32):
                raise ValueError(
                    f"the first stage takes token ids [batch, seq] (int64), got {x.dtype} {tuple(x.shape)}"
                )
            h = self.embed(x)
            if hasattr(self, "pos_embed"):
                if x.shape[1] > self.mcfg.max_seq_len:
                    raise ValueError(f"sequence length {x.shape[1]} exceeds model.max_seq_len={self.mcfg.max_seq_len}")
                h = h + self.pos_embed(torch.arange(x.shape[1], device=x.device))
            if self.mcfg.subspace_rank:  # x0(tokens) + U (B[token] + C[pos])
                h = self.embed_expand(h) + subspace.stream_base(self.mcfg, x, h.device, h.dtype)
            h = self.drop(h)
        else:
            if x.dim() != 3 or x.shape[-1] != self.mcfg.d_model:
                raise ValueError(
                    f"stage {self.stage} takes hidden states [batch, seq, {self.mcfg.d_model}], got {tuple(x.shape)}"
                )
            h = x
        rope = None
        if self.mcfg.pos_emb == "rope":
            rope = rope_cos_sin(h.shape[1], self.mcfg.head_dim, self.mcfg.rope_theta, h.device)
        for block in self.layers.values():
            h = run_block(block, self.recompute, h, rope)
        if self.is_last:
            return self.head(self.norm_f(h))
        return h

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        if self.is_last and self.mcfg.tie_embeddings:  # to_empty() replaces params and unties them
            self.head.weight = self.embed.weight
        return out

    def loss(self, logits_shard: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy of the vocab-parallel logits (collective over the TP group); with
        ``model.loss_backend=torch`` (T = 1) torch's ``F.cross_entropy`` in fp32, which a compiled graph fuses."""
        if self.mcfg.loss_backend != "torch":
            return vocab_parallel_cross_entropy(logits_shard, labels, self.tp_group)
        if logits_shard.shape[:-1] != labels.shape:
            raise ValueError(f"logits {tuple(logits_shard.shape)} and labels {tuple(labels.shape)} disagree on tokens")
        flat, labels = logits_shard.float().flatten(0, -2), labels.flatten()
        total = F.cross_entropy(flat, labels, ignore_index=-100, reduction="sum")
        return total / (labels != -100).sum().clamp(min=1)  # (as the vocab-parallel one: 0 when every label is ignored)

    def param_layer_id(self, name: str) -> int | None:
        return param_layer_id(name)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """GPT-2 init, independent of the layout and of the device (module docstring): N(0, init_std) weights,
        residual output projections scaled by 1/sqrt(2 n_layers), zero biases, unit norms."""
        std = self.mcfg.init_std
        for name, p in self.named_parameters():
            parts = name.split(".")
            if any(n in parts for n in NORM_NAMES):
                p.fill_(1.0 if parts[-1] == "weight" else 0.0)
            elif parts[-1] == "bias":
                p.zero_()
            else:
                s = init_std_scaled(std, self.mcfg.n_layers) if any(n in parts for n in RESIDUAL_OUT_NAMES) else std
                # drawn on the CPU whatever p's device: one seed gives the same weights on a GPU as on a CPU
                g = torch.Generator().manual_seed(text_seed(f"{seed}/{name}"))
                full = torch.empty(full_shape(p), dtype=torch.float32).normal_(0.0, s, generator=g)
                if is_tensor_parallel(p):
                    full = shard_tensor(full, p.partition_dim, self.tp_rank, self.tp_size)
                p.copy_(full)

    def _params_by_name(self) -> dict[str, torch.Tensor]:
        return dict(self.named_parameters(remove_duplicate=False))

    def shard_full_state_dict(self, full_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's slice of a full (1-process) state dict, ready for ``load_state_dict``."""
        params = self._params_by_name()
        out = {}
        for name, local in self.state_dict().items():
            if name not in full_sd:
                raise KeyError(f"{name!r} is missing from the full state dict")
            t = full_sd[name]
            p = params.get(name)
            if p is not None and tuple(t.shape) != full_shape(p):
                raise ValueError(f"{name}: full shape {tuple(t.shape)} != expected {full_shape(p)}")
            if p is not None and is_tensor_parallel(p):
                t = shard_tensor(t, p.partition_dim, self.tp_rank, self.tp_size)
            out[name] = t.to(local.dtype).clone()
        return out

    def load_full_state_dict(self, full_sd: dict[str, torch.Tensor]) -> None:
        self.load_state_dict(self.shard_full_state_dict(full_sd))

    @torch.no_grad()
    def gather_full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full-shape tensors of this stage (all-gathers TP shards; collective over the TP group)."""
        params = self._params_by_name()
        out = {}
        for name, t in self.state_dict().items():
            p = params.get(name)
            if p is not None and is_tensor_parallel(p):
                t = gather_along_dim(t, p.partition_dim, self.tp_group)
            out[name] = t.detach().clone()
        return out


def build_stage_model(
    mcfg: ModelConfig,
    stage: int = 0,
    n_stages: int = 1,
    tp_rank: int = 0,
    tp_size: int = 1,
    tp_group=None,
    seed: int = 0,
    device="cpu",
) -> StageModel:
    """Build and initialise one stage on one TP rank (device='meta': built, not initialised;
    call ``model.to_empty(device=...)`` then ``model.init_weights(seed)``)."""
    model = StageModel(mcfg, stage, n_stages, tp_rank, tp_size, tp_group, device)
    if torch.device(device).type != "meta":
        model.init_weights(seed)
    return model


def build_model(mcfg: ModelConfig, seed: int = 0, device="cpu") -> StageModel:
    """The whole model in one process (1 stage, no tensor parallelism)."""
    return build_stage_model(mcfg, 0, 1, 0, 1, None, seed, device)


def model_flops_per_token(mcfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, forward + backward: ``6 N + 12 L d S`` (PaLM appendix B; as
    nanoGPT's estimate_mfu). N is every parameter except the embedding lookups (token and
    position tables cost no FLOPs), with the LM head counted even when tied (it is a V x d GEMM)."""
    n = mcfg.num_params(include_embedding=False) + mcfg.vocab_size * mcfg.d_model
    return 6.0 * n + 12.0 * mcfg.n_layers * mcfg.d_model * seq_len
