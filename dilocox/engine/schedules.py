"""Pipeline schedules: torch.distributed.pipelining GPipe / 1F1B, and a hand-written oracle.

All schedules run one pipeline stage per rank over the ``pp`` process group and share one
contract: ``run(microbatch_inputs, microbatch_labels) -> list of per-microbatch losses`` (on the
last stage; an empty list elsewhere). Every microbatch's loss is divided by the number of
microbatches ``M`` *before* backward, so the gradients accumulated into ``.grad`` are those of
the mean loss over the microbatches, and grads that were already in ``.grad`` are kept
(plain accumulation, as with ``loss.backward()``).

- ``reference``: GPipe written out over ``dist.send``/``dist.recv`` (Megatron ``schedules.py``
  style): all forwards, then all backwards, in microbatch order. Small enough to check by eye;
  the tests use it as the oracle for the other two.
- ``gpipe`` / ``1f1b``: ``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B``. Notes on what
  they needed (public API only; run and tested on torch 2.13; for older releases such as
  2.11 the notes come from reading their source, which checks each stage's outputs against
  the static examples' shape, dtype and stride):

  * ``scale_grads``: by default the schedule divides *every* ``.grad`` of the stage by ``M``
    after the last backward (it assumes a mean-reduced ``loss_fn``). That would also shrink
    grads accumulated before the step, and would differ from the reference schedule, so we
    pass ``scale_grads=False`` and divide the loss by ``M`` inside ``loss_fn`` instead.
  * Shapes are given statically (``input_args``/``output_args`` as meta tensors): no runtime
    shape inference, which would otherwise run an extra forward (and in 2.13 an extra
    backward) of the stage, including its tensor-parallel collectives, on the first step.
    Static shapes fix the microbatch size, so a schedule is built per microbatch size.
    The float example tensors must have ``requires_grad=True``: torch 2.13 derives the
    gradient metadata from them and silently allocates *no* gradient buffer for an output
    whose example does not require grad (stage 0 then fails in backward with ``None`` grads).
  * ``step(..., return_outputs=False)`` where supported, so the last stage does not keep and
    concatenate the whole batch's (vocab-sharded) logits.
  * TP collectives inside a stage are fine on gloo: they run on the ``tp`` group while the
    pipeline's point-to-point traffic runs on the ``pp`` group.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

SCHEDULES = ("gpipe", "1f1b", "reference")


class StageLinks:
    """Blocking point-to-point transfers between this stage and its pipeline neighbours."""

    def __init__(
        self,
        group,
        prev_rank: int | None,
        next_rank: int | None,
        act_shape: tuple[int, ...],
        act_dtype: torch.dtype,
        device: torch.device,
    ):
        self.group, self.prev_rank, self.next_rank = group, prev_rank, next_rank
        self.act_shape, self.act_dtype, self.device = act_shape, act_dtype, device

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.act_shape, dtype=self.act_dtype, device=self.device)

    def recv_forward(self) -> torch.Tensor:
        x = self._buffer()
        dist.recv(x, src=self.prev_rank, group=self.group)
        return x

    def send_forward(self, y: torch.Tensor) -> None:
        dist.send(y.detach().contiguous(), dst=self.next_rank, group=self.group)

    def recv_backward(self) -> torch.Tensor:
        g = self._buffer()
        dist.recv(g, src=self.next_rank, group=self.group)
        return g

    def send_backward(self, g: torch.Tensor) -> None:
        dist.send(g.contiguous(), dst=self.prev_rank, group=self.group)


def _check_activation(y: torch.Tensor, links: StageLinks, stage: int) -> None:
    if tuple(y.shape) != links.act_shape or y.dtype != links.act_dtype:
        raise RuntimeError(
            f"stage {stage} produced an activation of shape {tuple(y.shape)} dtype {y.dtype}; "
            f"the pipeline sends {links.act_shape} {links.act_dtype} between stages"
        )


def reference_gpipe(
    stage_fn: nn.Module,
    loss_fn: LossFn,
    inputs: list[torch.Tensor],
    labels: list[torch.Tensor],
    links: StageLinks,
    is_first: bool,
    is_last: bool,
    stage: int = 0,
    backward: bool = True,
) -> list[torch.Tensor]:
    """GPipe by hand: forward every microbatch, then backward every microbatch.

    ``inputs``: token microbatches (used on the first stage only); ``labels``: label microbatches
    (used on the last stage only). Returns the detached per-microbatch losses (already divided
    by M) on the last stage, ``[]`` elsewhere. ``backward=False`` is the forward-only pass used
    for evaluation (call it under ``torch.no_grad()``).
    """
    M = len(inputs)
    stage_inputs: list[torch.Tensor | None] = []
    stage_outputs: list[torch.Tensor] = []  # activations sent on, or the losses on the last stage

    # ---- all forwards
    for i in range(M):
        if is_first:
            x = inputs[i]
        else:
            x = links.recv_forward()
            x.requires_grad_(backward)
        y = stage_fn(x)
        if is_last:
            y = loss_fn(y, labels[i]) / M
        else:
            _check_activation(y, links, stage)
            links.send_forward(y)
        stage_inputs.append(None if is_first else x)
        stage_outputs.append(y)
    if not backward:
        return [y.detach() for y in stage_outputs] if is_last else []

    # ---- all backwards (same order: the first microbatch's grads arrive first)
    for i in range(M):
        y = stage_outputs[i]
        if is_last:
            torch.autograd.backward(y)
        else:
            torch.autograd.backward(y, grad_tensors=links.recv_backward())
        x = stage_inputs[i]
        if x is not None:
            links.send_backward(x.grad if x.grad is not None else torch.zeros_like(x))
        stage_inputs[i] = None  # free this microbatch's input; its graph went with backward
    return [y.detach() for y in stage_outputs] if is_last else []


class TorchPipelineSchedule:
    """One ``PipelineStage`` + ``ScheduleGPipe``/``Schedule1F1B`` for a fixed microbatch shape."""

    def __init__(
        self,
        name: str,
        stage_fn: nn.Module,
        loss_fn: LossFn,
        stage: int,
        n_stages: int,
        n_microbatches: int,
        group,
        device: torch.device,
        input_meta: torch.Tensor,
        output_meta: torch.Tensor,
    ):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        if name not in ("gpipe", "1f1b"):
            raise ValueError(
                f"parallel.schedule={name!r} is not a torch.distributed.pipelining schedule (gpipe | 1f1b)"
            )
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        M = n_microbatches
        self.stage = PipelineStage(
            stage_fn, stage, n_stages, device, input_args=input_meta, output_args=output_meta, group=group
        )
        cls = ScheduleGPipe if name == "gpipe" else Schedule1F1B
        self.schedule = cls(self.stage, M, loss_fn=lambda out, tgt: loss_fn(out, tgt) / M, scale_grads=False)
        self._step_kwargs = {}
        if "return_outputs" in inspect.signature(self.schedule.step).parameters:
            self._step_kwargs["return_outputs"] = False

    def run(self, tokens: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
        """Forward + backward over the whole (DP-local) batch; the schedule splits it in M."""
        args = (tokens,) if self.is_first else ()
        losses: list[torch.Tensor] | None = [] if self.is_last else None
        target = labels if self.is_last else None
        self.schedule.step(*args, target=target, losses=losses, **self._step_kwargs)
        return [loss.detach() for loss in losses] if losses is not None else []
