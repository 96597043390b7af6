"""The `optim` section: the optimizer, its learning-rate schedule and gradient clipping."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from recognition.config.values import ConfigError


@dataclass
class OptimConfig:
    """The `optim` section: the optimizer and the learning-rate schedule."""

    name: Literal["sgd", "adamw", "adam"] = "sgd"
    """sgd (with momentum), adamw (decoupled weight decay) or adam (weight decay as an L2
    term added to the gradient, as the strong re-id baseline trains)."""
    lr: float = 0.1
    """Peak learning rate, reached at the end of warmup."""
    momentum: float = 0.9
    """SGD's momentum."""
    weight_decay: float = 5e-4
    """Not applied to BatchNorm / PReLU weights and biases (parameters with ndim <= 1)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam's and AdamW's [beta1, beta2]."""
    warmup_epochs: float = 0.5
    """Epochs (may be fractional) of linear warmup from 0 to `lr`."""
    schedule: Literal["poly", "cosine", "constant", "step"] = "cosine"
    """After warmup: poly or cosine decay to min_lr at the end, constant, or step (the lr
    multiplied by `gamma` at each of `milestones`)."""
    poly_power: float = 2.0
    """schedule=poly: the exponent of the decay."""
    min_lr: float = 0.0
    """The lr that poly and cosine end at."""
    milestones: list[float] = field(default_factory=list)
    """schedule=step: epochs (increasing, before train.epochs) from which the lr is multiplied
    by `gamma` once more, e.g. [12, 20, 24]; the steps are counted as epoch x steps per epoch,
    rounded."""
    gamma: float = 0.1
    """schedule=step: the factor applied at each milestone, in (0, 1]."""
    grad_clip: float | None = 5.0
    """Max global gradient norm; null disables clipping."""
    backbone_lr_scale: float = 1.0
    """The backbone's learning rate as a fraction of the head's (optim.lr and its schedule
    apply to both): below 1 a loaded backbone (train.init_backbone) moves more slowly than the
    new head; 0 keeps its weights where they are."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError("optim.lr: must be positive")
        if self.weight_decay < 0:
            raise ConfigError("optim.weight_decay: must be 0 or more")
        if len(self.betas) != 2:
            raise ConfigError("optim.betas: must hold two numbers")
        if self.warmup_epochs < 0:
            raise ConfigError("optim.warmup_epochs: must be 0 or more")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError("optim.min_lr: must lie in [0, optim.lr]")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ConfigError("optim.grad_clip: must be positive (or null to disable)")
        if not 0.0 <= self.backbone_lr_scale <= 1e3:
            raise ConfigError(
                f"optim.backbone_lr_scale: {self.backbone_lr_scale} is outside [0, 1000]"
            )
        if self.milestones and self.schedule != "step":
            raise ConfigError(
                f"optim.milestones: only used with optim.schedule=step (it is {self.schedule})"
            )
        if any(e <= 0 for e in self.milestones) or any(
            b <= a for a, b in zip(self.milestones, self.milestones[1:], strict=False)
        ):
            raise ConfigError(
                f"optim.milestones: must be positive and increasing epochs, got {self.milestones}"
            )
        if not 0.0 < self.gamma <= 1.0:
            raise ConfigError(f"optim.gamma: must lie in (0, 1], got {self.gamma}")
