"""Megatron-style tensor parallelism: four autograd mappings and the layers built on them.

A tensor-parallel (TP) group of T ranks shares one copy of the activations ("replicated
region") and splits the big matrices between them ("parallel region"):

- ``copy_to_tp``      identity forward, all-reduce backward   (enter the parallel region)
- ``reduce_from_tp``  all-reduce forward, identity backward   (leave it by summing partials)
- ``gather_from_tp``  all-gather the last dim forward, keep own slice backward
- ``scatter_to_tp``   keep own slice forward, all-gather backward

``ColumnParallelLinear`` splits the output features (weight ``[out/T, in]``),
``RowParallelLinear`` splits the input features (weight ``[out, in/T]``) and sums the partial
products; an MLP is column -> activation -> row with one all-reduce forward and one backward.
``VocabParallelEmbedding`` and ``vocab_parallel_cross_entropy`` split the vocabulary so that
neither the embedding table nor the logits are ever materialised whole on one rank.

Every function takes the TP process group explicitly; ``group=None`` means one rank, and then
everything is plain torch. Sharded parameters carry ``param.tensor_parallel = True`` and
``param.partition_dim``; replicated ones (norms, row-parallel biases) carry neither, which is
how ``clip_grad_norm_`` counts each parameter exactly once.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dilocox.distributed.topology import group_rank, group_world

LinearFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce into a fresh tensor (never in place on a tensor autograd may have saved)."""
    if group is None:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, op=op, group=group)
    return x


def gather_along_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate the shards of all ranks of ``group`` along ``dim`` (no autograd)."""
    if group is None:
        return x
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(group_world(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def shard_tensor(full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """This rank's contiguous slice of ``full`` along ``dim`` (``size`` equal parts)."""
    if full.shape[dim] % size:
        raise ValueError(f"cannot split dimension {dim} of size {full.shape[dim]} into {size} tensor-parallel shards")
    return full.chunk(size, dim=dim)[rank]


# --------------------------------------------------------------------------- mappings


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_along_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        g = ctx.group
        return shard_tensor(grad, -1, group_rank(g), group_world(g)).contiguous(), None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return shard_tensor(x, -1, group_rank(group), group_world(group)).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return gather_along_dim(grad, -1, ctx.group), None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _GatherFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _ScatterToTP.apply(x, group)


# --------------------------------------------------------------------------- layers


def mark_tensor_parallel(p: nn.Parameter, partition_dim: int, tp_size: int) -> nn.Parameter:
    """Tag a sharded parameter: ``tensor_parallel``, ``partition_dim`` and its ``full_shape``."""
    p.tensor_parallel = True  # type: ignore[attr-defined]
    p.partition_dim = partition_dim  # type: ignore[attr-defined]
    full = list(p.shape)
    full[partition_dim] *= tp_size
    p.full_shape = tuple(full)  # type: ignore[attr-defined]
    return p


def is_tensor_parallel(p: torch.Tensor) -> bool:
    return bool(getattr(p, "tensor_parallel", False))


def full_shape(p: torch.Tensor) -> tuple[int, ...]:
    """Shape of the unsharded parameter (its own shape when replicated)."""
    return tuple(getattr(p, "full_shape", p.shape))


class _TensorParallelModule(nn.Module):
    """Re-tags the sharded parameters after ``.to()`` / ``to_empty()`` (which may replace them)."""

    def _mark(self) -> None:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._mark()
        return out


def _check_divisible(name: str, n: int, tp_size: int) -> int:
    if n % tp_size:
        raise ValueError(f"{name}={n} is not divisible by the tensor-parallel size {tp_size}")
    return n // tp_size


class ColumnParallelLinear(_TensorParallelModule):
    """``y = x W^T + b`` with W split by output rows: each rank computes ``out/T`` features.

    Input is replicated (enters through ``copy_to_tp``; pass ``copy_input=False`` when the
    caller already did, e.g. once for q, k and v); output stays sharded on the last dim unless
    ``gather_output``. Parameters are left uninitialised (see ``transformer.init_weights``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group=None,
        tp_size: int = 1,
        gather_output: bool = False,
        linear_fn: LinearFn = F.linear,
        copy_input: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.group, self.gather_output, self.linear_fn = group, gather_output, linear_fn
        self.copy_input = copy_input
        self.in_features, self.out_features = in_features, out_features
        self.tp_size = tp_size
        out_local = _check_divisible("out_features", out_features, tp_size)
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(out_local, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(out_local, **kw)) if bias else None
        self._mark()

    def _mark(self) -> None:
        mark_tensor_parallel(self.weight, 0, self.tp_size)
        if self.bias is not None:
            mark_tensor_parallel(self.bias, 0, self.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_tp(x, self.group)
        y = self.linear_fn(x, self.weight, self.bias)
        return gather_from_tp(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features} (local {self.weight.shape[0]}), "
            f"bias={self.bias is not None}"
        )


class RowParallelLinear(_TensorParallelModule):
    """``y = x W^T + b`` with W split by input columns; partial products are all-reduced.

    Input is sharded on the last dim (``input_is_parallel``, the output of a column-parallel
    layer) or replicated (then scattered). The bias is replicated and added after the reduce.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group=None,
        tp_size: int = 1,
        input_is_parallel: bool = True,
        linear_fn: LinearFn = F.linear,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.group, self.input_is_parallel, self.linear_fn = group, input_is_parallel, linear_fn
        self.in_features, self.out_features = in_features, out_features
        self.tp_size = tp_size
        in_local = _check_divisible("in_features", in_features, tp_size)
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(out_features, in_local, **kw))
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None  # replicated
        self._mark()

    def _mark(self) -> None:
        mark_tensor_parallel(self.weight, 1, self.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        y = reduce_from_tp(self.linear_fn(x, self.weight, None), self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features} (local {self.weight.shape[1]}), out={self.out_features}, "
            f"bias={self.bias is not None}"
        )


def _check_ids(ids: torch.Tensor, vocab: int, what: str) -> None:
    """Ids in [0, vocab), as one process's F.embedding / cross-entropy demand: sharded, an id no rank owns would be a
    zero embedding or a zero target logit with a plausible loss. ``_assert_async``: no host sync (on a GPU a failure
    is a device-side assert, as F.embedding's own)."""
    torch._assert_async(((ids >= 0) & (ids < vocab)).all(), f"a {what} is outside [0, model.vocab_size={vocab})")


class VocabParallelEmbedding(_TensorParallelModule):
    """Token embedding with the vocabulary split in T contiguous ranges (weight ``[V/T, d]``).

    Each rank looks up the ids in its range, writes zeros for the others, and the all-reduce
    assembles the full embedding.
    """

    def __init__(
        self, vocab_size: int, dim: int, group=None, tp_rank: int = 0, tp_size: int = 1, device=None, dtype=None
    ):
        super().__init__()
        self.group, self.vocab_size, self.dim = group, vocab_size, dim
        local = _check_divisible("vocab_size", vocab_size, tp_size)
        self.vocab_start, self.vocab_end = tp_rank * local, (tp_rank + 1) * local
        self.tp_size = tp_size
        self.weight = nn.Parameter(torch.empty(local, dim, device=device, dtype=dtype))
        self._mark()

    def _mark(self) -> None:
        mark_tensor_parallel(self.weight, 0, self.tp_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.embedding(ids, self.weight)
        _check_ids(ids, self.vocab_size, "token id")  # (each rank masks the ids outside its range: one past V is 0)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size} (local [{self.vocab_start}, {self.vocab_end})), dim={self.dim}"


# --------------------------------------------------------------------------- loss


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean token cross-entropy of logits sharded on the vocabulary dim (Megatron-style).

    Three all-reduces of ``[tokens]``-sized tensors: the max (stability), the target logit
    (only the rank owning the label contributes) and the sum of exponentials.
    """

    @staticmethod
    def forward(ctx, logits, labels, group, ignore_index):
        x = logits.float()
        v_local = x.shape[-1]
        start = group_rank(group) * v_local
        x = x - _all_reduce(x.max(dim=-1).values, group, dist.ReduceOp.MAX).unsqueeze(-1)
        valid = labels != ignore_index
        _check_ids(labels.masked_fill(~valid, 0), v_local * group_world(group), "label")
        in_range = valid & (labels >= start) & (labels < start + v_local)
        local_labels = (labels - start).masked_fill(~in_range, 0)
        target = x.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range, 0.0)
        target = _all_reduce(target, group)
        exp = x.exp_()  # x is a fresh fp32 tensor (float() copy or the subtraction); reuse it
        sum_exp = _all_reduce(exp.sum(dim=-1), group)
        n_valid = valid.sum().clamp(min=1)
        loss = ((sum_exp.log() - target) * valid).sum() / n_valid
        probs = exp.div_(sum_exp.unsqueeze(-1))  # softmax, saved for backward
        ctx.save_for_backward(probs, local_labels, in_range, valid, n_valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        probs, local_labels, in_range, valid, n_valid = ctx.saved_tensors
        grad = probs  # in place: the softmax was saved for this one backward only (no clone of [tokens, V/T] fp32)
        flat = grad.view(-1, grad.shape[-1])
        rows = torch.arange(flat.shape[0], device=grad.device)
        flat[rows, local_labels.reshape(-1)] -= in_range.reshape(-1).to(grad.dtype)
        grad.mul_((valid.to(grad.dtype) * (grad_loss / n_valid)).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor, labels: torch.Tensor, group=None, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy over tokens (labels == ignore_index skipped) of vocab-sharded logits.

    ``logits_shard``: ``[..., V/T]`` this rank's contiguous vocab slice; ``labels``: ``[...]``
    global ids. With ``group=None`` this equals ``F.cross_entropy`` on the flattened tokens.
    """
    if logits_shard.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits_shard.shape)} and labels {tuple(labels.shape)} disagree on the token dims"
        )
    return _VocabParallelCrossEntropy.apply(logits_shard, labels, group, ignore_index)


# --------------------------------------------------------------------------- grad clipping


@torch.no_grad()
def grad_norm_sq(params: Iterable[torch.Tensor], tp_rank: int) -> torch.Tensor:
    """Local fp32 sum of squared grads: sharded params always, replicated ones on tp_rank 0. One fused (foreach)
    norm per device and dtype (torch.nn.utils.get_total_norm), not three kernels per parameter: on a GPU the
    per-parameter loop cost ~600 launches a step for GPT-2 small (docs/BENCHMARKS.md "GPU")."""
    grads = [p.grad for p in params if p.grad is not None and (tp_rank == 0 or is_tensor_parallel(p))]  # no_grad here
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    return torch.nn.utils.get_total_norm(grads, 2.0).float().pow(2)


@torch.no_grad()
def global_grad_norm(params: Iterable[torch.Tensor], tp_rank: int = 0, mp_group=None) -> torch.Tensor:
    """The global L2 norm of the grads over the model-parallel (TP x PP) group, each parameter counted once (see
    ``clip_grad_norm_``): a 0-dim fp32 tensor on the grads' device, no host sync."""
    params = [p for p in params if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    sq = grad_norm_sq(params, tp_rank).to(device)
    if mp_group is not None:
        dist.all_reduce(sq, group=mp_group)
    return sq.sqrt()


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, tp_rank: int = 0, mp_group=None) -> torch.Tensor:
    """Clip grads to a global L2 norm taken over the model-parallel (TP x PP) group.

    Each parameter counts once: TP-sharded params on every TP rank, replicated params only on
    ``tp_rank`` 0; the partial sums are all-reduced over ``mp_group`` (None = this process
    holds the whole model). Grads are scaled by ``min(1, max_norm / (norm + 1e-6))`` (one foreach
    multiply, torch.nn.utils.clip_grads_with_norm_); ``max_norm <= 0`` only measures. Returns the
    total norm before clipping (0-dim fp32 tensor).
    """
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params, tp_rank, mp_group)
    if max_norm > 0 and params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def init_std_scaled(std: float, n_layers: int) -> float:
    """GPT-2's std for residual output projections: ``std / sqrt(2 * n_layers)``."""
    return std / math.sqrt(2 * n_layers)
