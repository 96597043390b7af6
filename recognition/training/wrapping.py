"""The backbone's wrappers for training: DistributedDataParallel over the ranks, and
torch.compile (train.compile) over it."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from recognition.config import ExperimentConfig
from recognition.distributed import DistInfo
from recognition.models.cpu_layout import cpu_compile_options


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
        # Compiled over the DDP wrapper, so that DDP's optimizer splits the graph at its
        # gradient buckets and all-reduces overlap the backward pass.
        model = compile_model(model, cfg, dist_info.device)
    return model


def compile_model(model: nn.Module, cfg: ExperimentConfig, device: torch.device) -> nn.Module:
    """`model` under torch.compile with train.compile_mode and train.compile_backend, for
    training on `device`."""
    backend, mode = cfg.train.compile_backend, cfg.train.compile_mode
    if backend == "inductor" and device.type == "cpu":
        # No layout optimisation on a CPU: it would make the convolutions channels-last and
        # reach oneDNN's broken weight gradient (recognition.models.cpu_layout).
        return torch.compile(model, backend=backend, options=cpu_compile_options(mode))
    return torch.compile(model, mode=mode, backend=backend)
