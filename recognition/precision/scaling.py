"""The fp16 loss scaler of levels O1 and O2.

fp16 loss scaling goes through GradScaler's `unscale_` and `update` only (neither syncs on
a GPU); the update is the optimizer's own, masked on the device (`recognition.precision.update`),
instead of `GradScaler.step`, which reads found-inf on the host unless the optimizer is fused.
With several ranks whose optimizers see different gradients (a sharded head) the scaler is
torch's ShardedGradScaler, which combines the ranks' inf/NaN checks over a process group:
every rank skips the same steps and keeps the same loss scale.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from recognition.precision.levels import Level


def check_scaler_settings(init_scale: float, growth_interval: int) -> None:
    if not init_scale > 0:
        raise ValueError(f"precision init_scale must be > 0, got {init_scale}")
    if growth_interval < 1:
        raise ValueError(f"precision growth_interval must be >= 1, got {growth_interval}")


def make_scaler(
    level: Level,
    device: torch.device,
    init_scale: float,
    growth_interval: int,
    process_group: ProcessGroup | None,
) -> torch.amp.GradScaler | None:
    """The loss scaler `level` needs on `device` (None when it needs none)."""
    if not level.scales_loss:
        return None
    if process_group is not None:
        # A GradScaler that all-reduces its found-inf flags (it needs no FSDP model).
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(
            device.type,
            init_scale=init_scale,
            growth_interval=growth_interval,
            process_group=process_group,
        )
    return torch.amp.GradScaler(device.type, init_scale=init_scale, growth_interval=growth_interval)


def updated_scale(scaler: torch.amp.GradScaler) -> Tensor:
    """Update the scale after a step (backing it off when the step found inf/NaN) and return
    it as a 0-dim float32 tensor, without reading it on the host."""
    scaler.update()
    # get_scale() would read the scale on the host; this is the tensor itself, cloned since
    # the scaler updates it in place.
    return scaler._get_scale_async().clone()
