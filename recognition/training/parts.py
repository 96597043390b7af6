"""What one rank steps: its parts (`ModelParts`, as `build.build_model` makes them for
training and the run planner, `recognition.training.plan`, on fake tensors), the backbone
among them wrapped for training (`wrap_model`: DistributedDataParallel over the ranks, and
torch.compile over it with train.compile)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from recognition.config import ExperimentConfig
from recognition.distributed import DistInfo
from recognition.heads import ShardedMarginSoftmax
from recognition.models.cpu_layout import cpu_compile_options
from recognition.models.units import UnitChain
from recognition.precision import Precision, StepResult

log = logging.getLogger(__name__)


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


def wrap_model(cfg: ExperimentConfig, dist_info: DistInfo, backbone: nn.Module) -> nn.Module:
    """`backbone` as the step runs it: under DDP with several ranks, compiled with train.compile."""
    # The backbone is replicated: DDP broadcasts rank 0's weights now and averages the
    # gradients in backward. The head is not wrapped: its shard is this rank's alone.
    model: nn.Module = backbone
    if dist_info.is_distributed:
        device = dist_info.device
        model = DistributedDataParallel(
            backbone, device_ids=[device.index] if device.type == "cuda" else None
        )
    if cfg.train.compile:
        # Whole, compiled over the DDP wrapper, so that DDP's optimizer splits the graph at
        # its gradient buckets and all-reduces overlap the backward pass; by blocks, in place.
        model = compile_model(model, cfg, dist_info.device)
    return model


GRAPHS_PER_KIND = 4
"""Graphs a run may make of one kind of block: training, evaluation and held head-only steps
(eval mode, no grad), and one to spare."""


def _allow_graphs_per_kind(blocks: list[nn.Module]) -> None:
    """Raise Dynamo's recompile limit to GRAPHS_PER_KIND graphs per kind of block in `blocks`.
    The limit (8) counts per code object, and every block of a class shares its forward's:
    IResNet-50's 8 kinds filled it in training alone, so its evaluation ran eagerly, and after
    train.head_only_steps (other guards: eval mode, no grad) its training would have too,
    silently (Dynamo falls back to eager at the limit)."""
    kinds = {
        (type(block), tuple((name, tuple(p.shape)) for name, p in block.named_parameters()))
        for block in blocks
    }
    config = torch._dynamo.config
    needed = GRAPHS_PER_KIND * len(kinds)
    if config.recompile_limit < needed:
        log.info(
            "train.compile_scope=blocks: %d kinds of block; Dynamo's recompile limit raised "
            "from %d to %d (one limit counts the graphs of every block of a class)",
            len(kinds), config.recompile_limit, needed,
        )  # fmt: skip
        config.recompile_limit = needed
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, needed)


def compile_model(model: nn.Module, cfg: ExperimentConfig, device: torch.device) -> nn.Module:
    """`model` under torch.compile with train.compile_mode and train.compile_backend, for
    training on `device`: its backbone's blocks compiled in place (train.compile_scope
    blocks, where it has blocks), or the whole of it."""
    backend, mode = cfg.train.compile_backend, cfg.train.compile_mode
    options: dict[str, Any] = {"backend": backend, "mode": mode}
    if backend == "inductor" and device.type == "cpu":
        # No layout optimisation on a CPU: it would make the convolutions channels-last and
        # reach oneDNN's broken weight gradient (recognition.models.cpu_layout).
        options = {"backend": backend, "options": cpu_compile_options(mode)}
    if cfg.train.compile_scope == "blocks":
        chain = next((m for m in model.modules() if isinstance(m, UnitChain)), None)
        blocks = chain.blocks() if chain is not None else []
        if blocks:
            # In place (the parameters keep their names): Dynamo compiles a block's forward
            # once per kind of block and reuses it for the blocks whose guards it passes.
            # Static shapes: a kind of block after the first has other sizes, which would
            # otherwise make Dynamo compile it with symbolic sizes that the convolutions'
            # lowering then specialises back (IResNet-50 on a CPU: 54 s cold, 42 s static).
            for block in blocks:
                block.compile(**options, dynamic=False)
            _allow_graphs_per_kind(blocks)
            return model
        log.info("train.compile_scope=blocks: %s has no blocks; compiled whole", cfg.model.backbone)
    return torch.compile(model, **options)
