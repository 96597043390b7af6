"""`train.head_only_steps`: the backbone held still while the new head learns first."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class HeadOnlyGate(nn.Module):
    """What the step calls in place of `wrapped` (the backbone, wrapped in DDP and compiled
    as the run does it): while `frozen()` says so, the backbone runs in eval mode under
    no_grad, so nothing of it changes (no gradient reaches its weights, the optimizer skips
    parameters without one, the BatchNorm statistics are not updated); afterwards it is
    `wrapped` itself.

    No_grad rather than requires_grad=False: DDP records which parameters need gradients
    when it is built, and a forward without grad enabled is one its reducer expects no
    backward for, so the gate works with any DDP setting. `frozen` is asked at each forward
    (the loop's progress: a run resumed before step K goes on head-only).
    """

    def __init__(self, wrapped: nn.Module, frozen: Callable[[], bool]) -> None:
        super().__init__()
        self.wrapped = wrapped
        self._frozen = frozen

    @property
    def frozen(self) -> bool:
        """Whether the backbone is held now (a captured step is valid for one or the other)."""
        return self._frozen()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if not self._frozen():
            return self.wrapped(images)
        was_training = self.wrapped.training
        self.wrapped.eval()
        try:
            with torch.no_grad():
                return self.wrapped(images)
        finally:
            self.wrapped.train(was_training)
