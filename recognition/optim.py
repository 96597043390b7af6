"""Optimizer parameter groups and the learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from recognition.config import OptimConfig


def param_groups(modules: Iterable[nn.Module], weight_decay: float) -> list[dict]:
    """Split parameters into a decayed group and a group without weight decay.

    Weight decay on BatchNorm scales, PReLU slopes and biases (every parameter with
    ndim <= 1) only fights the normalisation and hurts accuracy, so those go undecayed.
    The margin head's class matrix (2-D) is decayed like any weight.
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in modules:
        for param in module.parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            (no_decay if param.ndim <= 1 else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    """SGD with momentum or AdamW over prepared parameter groups."""
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas))
    raise ValueError(f"optim.name: unknown optimizer {cfg.name!r}")


def lr_factor(step: int, total_steps: int, warmup_steps: int, cfg: OptimConfig) -> float:
    """Multiplier of the peak lr after `step` optimizer steps.

    Linear warmup from ~0 to the peak over `warmup_steps`, then poly / cosine decay from
    the peak to `min_lr` at `total_steps` (or constant).
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    floor = cfg.min_lr / cfg.lr
    if cfg.schedule == "poly":
        shape = (1.0 - progress) ** cfg.poly_power
    elif cfg.schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"optim.schedule: unknown schedule {cfg.schedule!r}")
    return floor + (1.0 - floor) * shape


def build_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int, cfg: OptimConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR stepped once per optimizer step (not per micro-batch, not per epoch)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, warmup_steps, cfg)
    )
