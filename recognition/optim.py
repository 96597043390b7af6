"""Optimizer parameter groups and the learning-rate schedule (warmup, then poly, cosine,
constant or step)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from recognition.compat import release
from recognition.config import OptimConfig
from recognition.sharded import mark_like


def param_groups(
    modules: Iterable[nn.Module], weight_decay: float, lr_scales: Sequence[float] | None = None
) -> list[dict]:
    """Split parameters into a decayed group and a group without weight decay.

    Weight decay on BatchNorm scales, PReLU slopes and biases (every parameter with
    ndim <= 1) only fights the normalisation and hurts accuracy, so those go undecayed.
    The margin head's class matrix (2-D) is decayed like any weight.

    `lr_scales` (one per module, e.g. optim.backbone_lr_scale for the backbone and 1 for the
    head): where they differ, each of the two groups is cut where the scale changes, and a
    group carries its "lr_scale" (`build_optimizer` multiplies optim.lr by it; the schedule
    then scales every group alike). The parameters keep the order `param_names` gives, so a
    checkpoint's optimizer state keyed by index fits whatever the scales.
    """
    modules = list(modules)
    named = [(str(i), module) for i, module in enumerate(modules)]
    decay, no_decay = _split_decay(named)
    scales = list(lr_scales) if lr_scales is not None else [1.0] * len(modules)
    if len(scales) != len(modules):
        raise ValueError(f"param_groups: {len(scales)} lr scales for {len(modules)} modules")
    if len(set(scales)) <= 1:
        groups = [{"params": [p for _, p in decay], "weight_decay": weight_decay}]
        if no_decay:
            groups.append({"params": [p for _, p in no_decay], "weight_decay": 0.0})
        return groups

    def scale_of(item: tuple[str, nn.Parameter]) -> float:
        # Names are "<module index>.<parameter name>": the index gives the module's scale.
        return scales[int(item[0].split(".", 1)[0])]

    groups = []
    for params, decay_value in ((decay, weight_decay), (no_decay, 0.0)):
        for scale, run in itertools.groupby(params, key=scale_of):
            groups.append(
                {"params": [p for _, p in run], "weight_decay": decay_value, "lr_scale": scale}
            )
    return groups


def param_names(named_modules: Iterable[tuple[str, nn.Module]]) -> list[str]:
    """ "<prefix>.<parameter name>" of every parameter `param_groups` would give the optimizer,
    in the optimizer's order, for modules given with a prefix each ("backbone", "head")."""
    decay, no_decay = _split_decay(list(named_modules))
    return [name for name, _ in decay + no_decay]


def _split_decay(
    named_modules: list[tuple[str, nn.Module]],
) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    decay: list[tuple[str, nn.Parameter]] = []
    no_decay: list[tuple[str, nn.Parameter]] = []
    seen: set[int] = set()
    for prefix, module in named_modules:
        for name, param in module.named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            (no_decay if param.ndim <= 1 else decay).append((f"{prefix}.{name}", param))
    return decay, no_decay


def build_optimizer(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    """SGD with momentum, AdamW or Adam over prepared parameter groups, fused where sound.

    Fused (one multi-tensor kernel per device and dtype) because only a fused optimizer can
    skip a step on the device: `Precision.step` hands it the step's inf/NaN flag as
    `found_inf`, so a training step needs no host synchronisation. On the CPU fused SGD gives
    the same bits as torch's default SGD; fused AdamW (and both on a GPU, against the default
    multi-tensor code) may round the last bit differently. See `fused_is_sound` for where
    the default implementation is used instead.
    """
    fused = fused_is_sound([p for group in groups for p in group["params"]])
    # A group's own lr (its fraction of optim.lr): LambdaLR keeps each group's as its base.
    groups = [
        {**group, "lr": cfg.lr * group["lr_scale"]} if "lr_scale" in group else group
        for group in groups
    ]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, fused=fused)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), fused=fused)
    if cfg.name == "adam":  # the groups' weight_decay is an L2 term in the gradient
        return torch.optim.Adam(groups, lr=cfg.lr, betas=tuple(cfg.betas), fused=fused)
    raise ValueError(f"optim.name: unknown optimizer {cfg.name!r}")


def scheduled_lr(optimizer: torch.optim.Optimizer) -> float:
    """optim.lr as the schedule has it now: the lr of a group at its full rate (the head's),
    or a scaled group's lr divided by its "lr_scale" (`param_groups`)."""
    for group in optimizer.param_groups:
        scale = group.get("lr_scale", 1.0)
        if scale > 0:
            return group["lr"] / scale
    return 0.0


# The first torch release whose CPU fused SGD was checked right on half parameters: on 2.11
# its momentum of bf16 / fp16 tensors of 32 elements or more is garbage (|buffer - grad| up
# to 1e26 after a step from a zero buffer, against 0 on 2.14; fp32 is right on both).
CPU_HALF_FUSED_FROM = (2, 14)


def fused_is_sound(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused optimizers compute right on `params` with this torch: always on
    CUDA and for float32 / float64; for half-precision parameters on the CPU (precision O3 on
    a CPU) only from CPU_HALF_FUSED_FROM on. Elsewhere the default implementation is used,
    and Precision.step reads its skip flag on the host (one synchronisation per step)."""
    # Fake tensors (the run planner's) run no kernel: they stand for a GPU run's tensors.
    half_on_cpu = any(
        p.device.type == "cpu" and p.dtype in (torch.float16, torch.bfloat16) and not is_fake(p)
        for p in params
    )
    return not half_on_cpu or release(torch.__version__)[:2] >= CPU_HALF_FUSED_FROM


class OptimizerState:
    """An optimizer as a `Stateful` part of a checkpoint.

    `state_dict()` is the optimizer's own (state by parameter index, param_groups), with
    the state tensors of a row-sharded parameter (the head's momentum) marked as its rows,
    and the lazily created state made first (`init_state`), so that a checkpoint's state
    can be loaded in place into an optimizer that has not stepped yet.

    `param_ids` gives, for each parameter the optimizer holds (in its order), its index in
    the optimizer of the whole model: a pipeline stage's optimizer holds a part of the
    parameters, and stores their state under those indices, so that a checkpoint of one
    layout of stages loads into another. None: the optimizer holds the whole model.
    Loading takes each group's hyperparameters from the checkpoint and its parameters from
    the live optimizer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, param_ids: list[int] | None = None):
        self.optimizer = optimizer
        self.param_ids = param_ids

    def _ids(self, params: list[torch.Tensor]) -> list[int]:
        if self.param_ids is None:
            return list(range(len(params)))
        if len(self.param_ids) != len(params):
            raise ValueError(
                f"OptimizerState: {len(self.param_ids)} parameter ids for an optimizer of "
                f"{len(params)} parameters"
            )
        return self.param_ids

    def state_dict(self) -> dict[str, Any]:
        init_state(self.optimizer)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        ids = self._ids(params)
        packed = self.optimizer.state_dict()
        state = {
            ids[index]: {
                name: mark_like(value, params[index]) if torch.is_tensor(value) else value
                for name, value in values.items()
            }
            for index, values in packed["state"].items()
        }
        groups = [
            {**group, "params": [ids[i] for i in group["params"]]}
            for group in packed["param_groups"]
        ]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        local = {global_id: index for index, global_id in enumerate(self._ids(params))}
        saved = {int(index): values for index, values in state.get("state", {}).items()}
        unknown = sorted(set(saved) - set(local))
        if unknown:
            raise ValueError(
                f"optimizer state for parameter {unknown[-1]}, the optimizer has "
                f"{len(params)}: a different model"
            )
        live_groups = self.optimizer.state_dict()["param_groups"]
        saved_groups = state["param_groups"]
        if len(saved_groups) != len(live_groups):
            raise ValueError(
                f"optimizer: {len(saved_groups)} parameter groups saved, the optimizer has "
                f"{len(live_groups)}: a different model"
            )
        groups = [
            {**saved_group, "params": live["params"]}
            for saved_group, live in zip(saved_groups, live_groups, strict=True)
        ]
        packed = {local[global_id]: values for global_id, values in saved.items()}
        self.optimizer.load_state_dict({"state": packed, "param_groups": groups})


@torch.no_grad()
def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's per-parameter state now rather than at its first step.

    One step at learning rate 0 on zero gradients, then every state tensor zeroed: for SGD
    (no dampening), AdamW and Adam, zeroed state is exactly the state of an optimizer that
    has not stepped (a zero momentum buffer, zero moments, step count 0), so the next real
    step is the same. Parameters that already have state are left alone.
    """
    params = [
        p
        for group in optimizer.param_groups
        for p in group["params"]
        if p.requires_grad and not optimizer.state.get(p)
    ]
    if not params:
        return
    grads = [p.grad for p in params]
    lrs = [group["lr"] for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
    for p in params:
        for value in optimizer.state[p].values():
            if torch.is_tensor(value):
                value.zero_()


def lr_factor(
    step: int,
    total_steps: int,
    warmup_steps: int,
    cfg: OptimConfig,
    milestone_steps: Sequence[int] = (),
) -> float:
    """Multiplier of the peak lr after `step` optimizer steps.

    Linear warmup from ~0 to the peak over `warmup_steps`, then poly / cosine decay from
    the peak to `min_lr` at `total_steps`, constant, or step: gamma to the power of the
    number of `milestone_steps` reached (a warmup step gets both factors).
    """
    if cfg.schedule == "step":
        passed = sum(1 for milestone in milestone_steps if step >= milestone)
        warm = (step + 1) / warmup_steps if warmup_steps > 0 and step < warmup_steps else 1.0
        return warm * cfg.gamma**passed
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
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    warmup_steps: int,
    cfg: OptimConfig,
    steps_per_epoch: int | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR stepped once per optimizer step (not per micro-batch, not per epoch).

    `steps_per_epoch` turns schedule=step's milestones (epochs) into steps; it is needed
    for that schedule only.
    """
    milestone_steps: list[int] = []
    if cfg.schedule == "step" and cfg.milestones:
        if steps_per_epoch is None:
            raise ValueError("optim.schedule=step: build_scheduler needs steps_per_epoch")
        milestone_steps = [round(epoch * steps_per_epoch) for epoch in cfg.milestones]
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(step, total_steps, warmup_steps, cfg, milestone_steps),
    )
