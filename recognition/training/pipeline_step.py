"""One optimizer step of a pipelined backbone (`model.pipeline_stages` > 1).

`PipelineStep` is called as `train_step` is, so the loop runs it unchanged. The stages and
the mesh come from `recognition.pipeline`; the schedule is torch's (GPipe or 1F1B). The
batch is split into m micro-batches; the head's loss of each is divided by m, so the
gradients are those of the batch's mean loss, exactly those of the unpipelined backbone run
on the same micro-batches with gradient accumulation (the schedule's own gradient scaling
is off: it would not reach the head, which is not part of a stage). The step then agrees
over the pipeline on the loss (it exists on the last stage only), skips a non-finite one on
every rank, and clips by the norm over every stage and the whole head. Like `train_step`
it reads nothing on the host: the agreement is an all-reduce whose result stays on the
device, and the skip is the masked update of `Precision.step`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from recognition import distributed
from recognition.pipeline import PipelineLayout, send_contiguous, stage_io, wrap_stage
from recognition.precision import Precision, StepResult
from recognition.training.step import global_grad_norm

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
# (stage, layout, first stage's micro-batch as a meta tensor, precision, device) ->
# the stage's (input, output) meta tensors: `pipeline.stage_io`'s signature.
StageIO = Callable[
    [nn.Module, PipelineLayout, Tensor, Precision, torch.device], tuple[Tensor, Tensor]
]


class PipelineStep:
    """One optimizer step of a pipelined backbone; called as `train_step` is.

    Args:
        stage: this rank's stage module (wrapped in DDP over the "dp" group when there are
            several replicas).
        layout: the mesh (see `make_layout`).
        head: the class-sharded head on the last stage's ranks, None elsewhere.
        num_micro: micro-batches per batch.
        schedule: "gpipe" or "1f1b".
        input_meta / output_meta: the stage's micro-batch input and output (`stage_io`).
        precision: the run's precision level (autocast, loss scaling, step).
        device: this rank's device.
    """

    def __init__(
        self,
        stage: nn.Module,
        layout: PipelineLayout,
        head: nn.Module | None,
        *,
        num_micro: int,
        schedule: str,
        input_meta: Tensor,
        output_meta: Tensor,
        precision: Precision,
        device: torch.device,
    ) -> None:
        self.layout = layout
        self.head = head
        self.input_meta, self.output_meta = input_meta, output_meta
        self.num_micro = num_micro
        self.precision = precision
        self.device = device
        self.pipeline_stage = PipelineStage(
            stage,
            layout.stage,
            layout.num_stages,
            device,
            input_args=input_meta,
            output_args=output_meta,
            group=layout.pp_group,
        )
        # Every rank gives a loss function (a rank without one would run no backward); only
        # the last stage calls it. scale_grads=False: the loss is divided by m instead, so
        # the head's gradient (not a stage parameter) is scaled too.
        self.schedule = SCHEDULES[schedule](
            self.pipeline_stage, num_micro, loss_fn=self._loss, scale_grads=False
        )
        if not layout.is_last:
            # The loss scaler starts at its first scale(); these ranks scale no loss (their
            # gradients arrive scaled from the last stage) but unscale in step(): start it.
            precision.scale_loss(torch.zeros((), device=device))
        self._losses: list[Tensor] = []
        self._accuracies: list[Tensor] = []

    def _loss(self, embeddings: Tensor, labels: Tensor) -> Tensor:
        assert self.head is not None
        loss = self.head(embeddings, labels)
        self._losses.append(loss.detach())
        accuracy = getattr(self.head, "last_accuracy", None)
        if accuracy is not None:
            self._accuracies.append(accuracy.detach())
        return self.precision.scale_loss(loss / self.num_micro)

    def __call__(
        self,
        model: nn.Module,
        head: nn.Module | None,
        micro_batches: Sequence[tuple[Tensor, Tensor]],
        optimizer: torch.optim.Optimizer,
        precision: Precision,
        max_grad_norm: float | None,
    ) -> StepResult:
        """Run the schedule over the batch (`micro_batches` holds one: the pipeline makes
        its own micro-batches) and step; the result is the same on every rank."""
        ((images, labels),) = micro_batches
        layout = self.layout
        precision.zero_grad(optimizer)
        self._losses, self._accuracies = [], []
        accumulating = (
            self.head.accumulating() if self.head is not None else contextlib.nullcontext()
        )
        with precision.autocast(), accumulating:
            if layout.is_first:
                self.schedule.step(precision.cast_inputs(images), return_outputs=False)
            elif layout.is_last:
                self.schedule.step(target=labels, return_outputs=False)
            else:
                self.schedule.step(return_outputs=False)
        loss, accuracy, finite = self._agree()
        sharded = [self.head] if self.head is not None else []
        result = precision.step(
            optimizer,
            max_grad_norm,
            grad_norm_fn=lambda params: global_grad_norm(params, sharded, layout.pp_group),
            finite=finite,
        )
        return dataclasses.replace(result, loss=loss, finite=finite, accuracy=accuracy)

    def _agree(self) -> tuple[Tensor, Tensor | None, Tensor]:
        """The batch's mean loss and accuracy and whether every loss was finite, on every
        rank of the pipeline (the last stage has them; the others contribute zeros), as
        device tensors: the loss NaN when one was not finite, the accuracy None when the
        head reports none."""
        stats = torch.zeros(3, dtype=torch.float64, device=self.device)
        if self.layout.is_last:
            losses = torch.stack(self._losses).double()
            finite = torch.isfinite(losses)
            stats[0] = torch.where(finite, losses, 0.0).sum()
            if self._accuracies:
                stats[1] = torch.stack(self._accuracies).double().sum()
            stats[2] = (~finite).sum()
        stats = distributed.all_reduce_tensor_sum(stats, self.layout.pp_group)
        finite = stats[2] == 0
        loss = torch.where(finite, stats[0] / self.num_micro, math.nan)
        has_accuracy = self.head is None or bool(self._accuracies)  # a list, not a tensor
        accuracy = stats[1] / self.num_micro if has_accuracy else None
        return loss, accuracy, finite


def build_pipeline_step(
    stage: nn.Module,
    layout: PipelineLayout,
    head: nn.Module | None,
    precision: Precision,
    *,
    device: torch.device,
    image_hw: tuple[int, int],
    micro_batch_size: int,
    schedule: str,
    num_micro: int,
    memory_format: torch.memory_format = torch.preserve_format,
    find_io: StageIO = stage_io,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
) -> tuple[nn.Module, PipelineStep]:
    """The stage as the schedule runs it (in DDP over its replicas) and the step.

    Collective over the pipeline (the stages' micro-batch shapes are passed along by
    `find_io`). Call after `precision.prepare` of the stage and the head, on the device.
    The run planner replaces `find_io` (with `pipeline.local_stage_io`, which asks no
    other rank) and `wrap`, the data-parallel wrapper of a stage with several replicas
    (None: `wrap_stage`, DDP).
    """
    send_contiguous(stage, layout, memory_format)
    images = torch.empty(micro_batch_size, 3, *image_hw, device="meta")
    images = precision.cast_inputs(images).contiguous(memory_format=_images_format(memory_format))
    input_meta, output_meta = find_io(stage, layout, images, precision, device)
    if wrap is None:
        model = wrap_stage(stage, layout, device)
    else:
        model = wrap(stage) if layout.dp_size > 1 else stage
    step = PipelineStep(
        model,
        layout,
        head,
        num_micro=num_micro,
        schedule=schedule,
        input_meta=input_meta,
        output_meta=output_meta,
        precision=precision,
        device=device,
    )
    return model, step


def _images_format(memory_format: torch.memory_format) -> torch.memory_format:
    """The memory format the loop gives the images in (preserve: as loaded, contiguous)."""
    return torch.contiguous_format if memory_format == torch.preserve_format else memory_format
