"""The training engine of one replica: inner data parallel x pipeline x tensor parallel.

``PipelineEngine.forward_backward(tokens, labels)`` takes the replica's batch for one step
(every rank of the replica gets the same full batch), keeps this rank's inner-DP slice
(``topo.dp_rank`` of ``D = parallel.data``), splits it into ``parallel.microbatches``
microbatches and runs the pipeline schedule. Afterwards ``.grad`` holds the gradient of the
mean loss over the replica's whole batch (averaged over the ``dp`` group when D > 1), and the
returned loss is that mean, identical on every rank of the replica.

With one stage (P = 1) there is nothing to pipeline: the engine is plain microbatched gradient
accumulation. Activations cross stage boundaries as ``[mb, S, d_model]`` tensors in the
*boundary dtype*: the autocast dtype when autocast is on (bf16 on GPU, half the bytes), else
the parameters' dtype (fp32 on CPU). A received activation is cast back to the parameters'
dtype so that the residual stream inside a stage keeps its precision; the last stage hands
fp32 logits to the loss.

Loss semantics: the mean over microbatches of each microbatch's mean token loss, which is
the mean token loss of the batch (all microbatches have the same number of tokens; labels
equal to the ignore index would weight microbatches unevenly, the data pipeline emits none).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from dilocox.config import ConfigError, ModelConfig, ParallelConfig
from dilocox.distributed.topology import Topology
from dilocox.engine.schedules import SCHEDULES, StageLinks, TorchPipelineSchedule, reference_gpipe

_BUCKET_NUMEL = 1 << 24  # elements per inner-DP gradient all-reduce


class StageRunner(nn.Module):
    """The stage as the schedules see it: autocast inside, boundary dtype on the way out."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        autocast_dtype: torch.dtype | None,
        boundary_dtype: torch.dtype,
        param_dtype: torch.dtype,
    ):
        super().__init__()
        self.model = model
        self.device_type = device.type
        self.autocast_dtype = autocast_dtype
        self.boundary_dtype, self.param_dtype = boundary_dtype, param_dtype

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.model.is_first:
            x = x.to(self.param_dtype)  # differentiable: the grad goes back in the boundary dtype
        with self._autocast():
            y = self.model(x)
        # Fixed dtype and layout: older torch (2.11) checks each stage's outputs against the
        # static example's shape, dtype and stride, including the last stage's logits.
        return (y.float() if self.model.is_last else y.to(self.boundary_dtype)).contiguous()


def _check_stage_model(model: nn.Module, topo: Topology) -> None:
    """The stage model is the one this rank's coordinates call for: its stage of ``topo.P`` stages and its TP slice.
    Only first/last was compared: a model cut for another number of stages (stage 0 of 4 and stage 3 of 4 on a
    2-stage grid) or a middle stage swapped with another trained a model with layers missing, without a word."""
    want = {"stage": topo.stage, "n_stages": topo.P, "tp_rank": topo.tp_rank, "tp_size": topo.T}
    got = {k: getattr(model, k, v) for k, v in want.items()}  # (a duck-typed stage without them: not checked)
    got.update(is_first=model.is_first, is_last=model.is_last)
    want.update(is_first=topo.is_first_stage, is_last=topo.is_last_stage)
    if got != want:
        bad = ", ".join(f"{k}={got[k]} (this rank: {want[k]})" for k in want if got[k] != want[k])
        raise ValueError(
            f"the stage model does not match this rank's place in the grid: {bad}; build it with "
            f"build_stage_model(..., stage=topo.stage, n_stages={topo.P}, tp_rank=topo.tp_rank, tp_size={topo.T}, "
            "tp_group=topo.group('tp'))"
        )


class PipelineEngine:
    """Runs forward/backward of one stage of one replica under the configured schedule."""

    def __init__(
        self,
        model: nn.Module,
        topo: Topology,
        pcfg: ParallelConfig,
        mcfg: ModelConfig,
        seq_len: int,
        device,
        autocast_dtype: torch.dtype | None = None,
    ):
        if pcfg.schedule not in SCHEDULES:
            raise ConfigError(f"parallel.schedule={pcfg.schedule!r} is not one of {list(SCHEDULES)}")
        for name, want, got in (
            ("pipeline", pcfg.pipeline, topo.P),
            ("data", pcfg.data, topo.D),
            ("tensor", pcfg.tensor, topo.T),
        ):
            if want != got:
                raise ConfigError(
                    f"parallel.{name}={want} does not match the topology's {got}; "
                    f"build the topology from the same ParallelConfig"
                )
        _check_stage_model(model, topo)
        if mcfg.pos_emb == "learned" and seq_len > mcfg.max_seq_len:  # the first stage alone would fail, at its
            # first forward, while the other stages wait for its activations until the group's timeout
            raise ConfigError(f"train.seq_len={seq_len} exceeds model.max_seq_len={mcfg.max_seq_len}")
        if pcfg.pipeline > 1 and pcfg.schedule != "reference" and pcfg.microbatches < pcfg.pipeline:
            raise ConfigError(
                f"parallel.microbatches={pcfg.microbatches} must be >= parallel.pipeline={pcfg.pipeline} "
                f"for schedule {pcfg.schedule!r}"
            )
        self.model, self.topo, self.pcfg, self.mcfg = model, topo, pcfg, mcfg
        self.seq_len = seq_len
        self.device = torch.device(device)
        self.P, self.D, self.M = pcfg.pipeline, pcfg.data, pcfg.microbatches
        param_dtype = next(model.parameters()).dtype
        self.boundary_dtype = autocast_dtype or param_dtype
        self.runner = StageRunner(model, self.device, autocast_dtype, self.boundary_dtype, param_dtype)
        self._torch_schedules: dict[int, TorchPipelineSchedule] = {}  # microbatch size -> schedule

    # ------------------------------------------------------------------ public API

    def forward_backward(self, tokens: torch.Tensor, labels: torch.Tensor) -> float:
        """Accumulate into ``.grad`` the gradient of the replica's mean loss; return that loss."""
        return float(self.forward_backward_async(tokens, labels).item())

    def forward_backward_async(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """:meth:`forward_backward` without the host sync: the loss stays a 0-dim fp64 tensor on the device (the
        trainer reads it at its log steps only; docs/BENCHMARKS.md "GPU: dilocox next to a plain loop")."""
        tokens, labels, mb = self._local_batch(tokens, labels)
        if self.P == 1:
            losses = []
            for x, y in zip(tokens.split(mb), labels.split(mb)):
                loss = self._loss_of(x, y) / self.M
                loss.backward()
                losses.append(loss.detach())
        elif self.pcfg.schedule == "reference":
            losses = reference_gpipe(
                self.runner,
                self.model.loss,
                list(tokens.split(mb)),
                list(labels.split(mb)),
                self._links(mb),
                self.topo.is_first_stage,
                self.topo.is_last_stage,
                self.topo.stage,
            )
        else:
            losses = self._torch_schedule(mb).run(tokens, labels)
        self._average_grads_over_dp()
        return self._replica_loss_tensor(losses)

    def _loss_of(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One stage that is the whole model (P = 1): the loss of a microbatch. The function
        :meth:`compile_whole` compiles (forward and cross-entropy in one graph)."""
        return self.model.loss(self.runner(x), y)

    def compile_whole(self) -> None:
        """``train.compile`` at P = T = 1: the whole forward + loss as one torch.compile graph (embedding, blocks,
        head and cross-entropy; per block, the rest stayed eager). Parameters, names and checkpoints are unchanged
        (the module is not wrapped)."""
        if self.P != 1 or self.model.tp_size != 1:
            raise ValueError("compile_whole is for one stage without tensor parallelism (P = T = 1)")
        self._loss_of = torch.compile(self._loss_of)  # instance attribute: shadows the method

    @torch.no_grad()
    def evaluate(self, tokens: torch.Tensor, labels: torch.Tensor) -> float:
        """Mean loss over the replica's batch, forward only (model in eval mode meanwhile).

        Every schedule evaluates with the hand-written forward pass: without a backward there
        is no 1F1B interleaving, only microbatches streaming through the stages.
        """
        tokens, labels, mb = self._local_batch(tokens, labels)
        was_training = self.model.training
        self.model.eval()
        try:
            if self.P == 1:
                losses = [
                    self.model.loss(self.runner(x), y) / self.M for x, y in zip(tokens.split(mb), labels.split(mb))
                ]
            else:
                losses = reference_gpipe(
                    self.runner,
                    self.model.loss,
                    list(tokens.split(mb)),
                    list(labels.split(mb)),
                    self._links(mb),
                    self.topo.is_first_stage,
                    self.topo.is_last_stage,
                    self.topo.stage,
                    backward=False,
                )
        finally:
            self.model.train(was_training)
        return self._replica_loss(losses)

    # ------------------------------------------------------------------ helpers

    def _local_batch(self, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """This rank's inner-DP slice of the replica batch, on the device, and the microbatch size."""
        if tokens.dim() != 2 or tokens.shape != labels.shape:
            raise ValueError(
                f"tokens {tuple(tokens.shape)} and labels {tuple(labels.shape)} must both be [batch, seq_len]"
            )
        B, S = tokens.shape
        if S != self.seq_len:
            raise ValueError(
                f"batch has sequence length {S} but the engine was built for seq_len={self.seq_len} (train.seq_len)"
            )
        if B % (self.D * self.M):
            raise ConfigError(
                f"batch size {B} is not divisible by parallel.data*parallel.microbatches={self.D}*{self.M}; "
                f"change train.batch_size or parallel.microbatches"
            )
        b = B // self.D
        lo = self.topo.dp_rank * b
        tokens = tokens[lo : lo + b].to(self.device, non_blocking=True)
        labels = labels[lo : lo + b].to(self.device, non_blocking=True)
        return tokens, labels, b // self.M

    def _act_shape(self, mb: int) -> tuple[int, int, int]:
        return (mb, self.seq_len, self.mcfg.d_model)

    def _links(self, mb: int) -> StageLinks:
        t = self.topo
        prev_rank = None if t.is_first_stage else t.stage_rank(t.stage - 1)
        next_rank = None if t.is_last_stage else t.stage_rank(t.stage + 1)
        return StageLinks(t.group("pp"), prev_rank, next_rank, self._act_shape(mb), self.boundary_dtype, self.device)

    def _torch_schedule(self, mb: int) -> TorchPipelineSchedule:
        if mb not in self._torch_schedules:
            # Example tensors on the meta device; float ones must say requires_grad=True, or
            # torch 2.13's static mode allocates no gradient buffer for them (see schedules.py).
            t, meta = self.topo, torch.device("meta")
            act = dict(dtype=self.boundary_dtype, device=meta, requires_grad=True)
            if t.is_first_stage:
                inp = torch.empty(mb, self.seq_len, dtype=torch.long, device=meta)
            else:
                inp = torch.empty(self._act_shape(mb), **act)
            if t.is_last_stage:
                out = torch.empty(
                    mb, self.seq_len, self.mcfg.vocab_size // t.T, dtype=torch.float32, device=meta, requires_grad=True
                )
            else:
                out = torch.empty(self._act_shape(mb), **act)
            self._torch_schedules[mb] = TorchPipelineSchedule(
                self.pcfg.schedule,
                self.runner,
                self.model.loss,
                t.stage,
                t.P,
                self.M,
                t.group("pp"),
                self.device,
                inp,
                out,
            )
        return self._torch_schedules[mb]

    @torch.no_grad()
    def _average_grads_over_dp(self) -> None:
        """Average ``.grad`` over the inner data-parallel group, in flat buckets per dtype."""
        group = self.topo.group("dp")
        if group is None:
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # every rank must contribute the same set of tensors
                p.grad = torch.zeros_like(p)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            start = 0
            while start < len(grads):
                bucket, n = [], 0
                while start < len(grads) and (not bucket or n + grads[start].numel() <= _BUCKET_NUMEL):
                    bucket.append(grads[start])
                    n += grads[start].numel()
                    start += 1
                flat = torch.cat([g.reshape(-1) for g in bucket])
                dist.all_reduce(flat, group=group)
                flat.div_(self.D)
                for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
                    g.copy_(part.view_as(g))

    def _replica_loss(self, losses: list[torch.Tensor]) -> float:
        return float(self._replica_loss_tensor(losses).item())

    def _replica_loss_tensor(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Sum of the (already 1/M-scaled) microbatch losses: last stage -> pp group -> dp mean (0-dim fp64)."""
        t = self.topo
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for loss in losses:
            total += loss.double()
        if t.group("pp") is not None:
            dist.broadcast(total, src=t.stage_rank(t.P - 1), group=t.group("pp"))
        if t.group("dp") is not None:
            dist.all_reduce(total, group=t.group("dp"))
            total /= self.D
        return total
