"""BatchNorm layers whose batch counters one operation advances for the whole backbone.

In training, torch's BatchNorm adds 1 to its `num_batches_tracked` buffer at every forward:
one more operation dispatched (and one more kernel launched on a GPU) per layer and step,
79 of the ~1,300 that IResNet-50's step dispatches (`benchmarks/step_ops.py`). With a
momentum set, as every backbone here has, the counter is bookkeeping only: the running
statistics move by `momentum` whatever it holds. The layers below leave it alone in their
forward, and the backbone that holds them (`recognition.models.units.UnitChain`) advances
the counters of all its training layers with one `torch._foreach_add_` per forward, so the
counters, the running statistics and the output are what torch's layers give, value for
value. With `momentum=None` (a cumulative average, which reads the counter) a layer counts
itself, as torch's does.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn


class _CountedByOwner:
    """The forward of a `_BatchNorm` subclass that leaves `num_batches_tracked` to its owner."""

    training: bool
    track_running_stats: bool
    momentum: float | None

    def counted_by_owner(self) -> bool:
        """Whether this forward leaves the counter to the owner: training with running
        statistics and a momentum set."""
        return self.training and self.track_running_stats and self.momentum is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.counted_by_owner():
            return super().forward(x)  # type: ignore[misc]
        self._check_input_dim(x)  # type: ignore[attr-defined]
        # What torch's forward computes in this case, without the counter's add_.
        return F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias,  # type: ignore[attr-defined]
            True, self.momentum, self.eps,  # type: ignore[attr-defined, arg-type]
        )  # fmt: skip


class BatchNorm1d(_CountedByOwner, nn.BatchNorm1d):
    """`nn.BatchNorm1d` whose batch counter its owner advances (see the module's docstring)."""


class BatchNorm2d(_CountedByOwner, nn.BatchNorm2d):
    """`nn.BatchNorm2d` whose batch counter its owner advances (see the module's docstring)."""


def counted_layers(module: nn.Module) -> tuple[nn.Module, ...]:
    """The layers of `module` whose counters `advance_batch_counts` advances."""
    return tuple(layer for layer in module.modules() if isinstance(layer, _CountedByOwner))


def advance_batch_counts(layers: Iterable[nn.Module]) -> None:
    """Add 1 to the batch counter of each of `layers` that its forward leaves to its owner
    now (a frozen or evaluating layer is skipped): one operation for all of them."""
    counters = [layer.num_batches_tracked for layer in layers if layer.counted_by_owner()]  # type: ignore[attr-defined]
    if counters:
        torch._foreach_add_(counters, 1)
