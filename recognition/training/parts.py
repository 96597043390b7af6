"""`ModelParts`: what one rank steps, as `build.build_model` makes it for training and the
run planner (`recognition.training.plan`) makes it on fake tensors; below both, so that
neither imports the other for it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from recognition.heads import ShardedMarginSoftmax
from recognition.precision import Precision, StepResult


@dataclass
class ModelParts:
    """What one rank steps: its backbone (or pipeline stage), the module the step calls,
    its head shard, the precision, the optimizer and the step function."""

    backbone: nn.Module
    model: nn.Module
    head: ShardedMarginSoftmax | None
    precision: Precision
    optimizer: torch.optim.Optimizer
    step: Callable[..., StepResult]
    param_ids: list[int] | None

    def run_step(self, micro_batches: list, grad_clip: float | None) -> StepResult:
        """One training step of these parts on `micro_batches`."""
        return self.step(
            self.model, self.head, micro_batches, self.optimizer, self.precision, grad_clip
        )
