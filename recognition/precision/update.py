"""The optimizer update, skipped on the device when a step is not finite, and what a step
reports (`StepResult`).

`Precision.step()` skips the update at every level when the gradient norm (or the loss, when
the caller passes its finiteness) is not finite, so NaNs never reach the weights; with a
scaler the scale also halves. The skip is decided on the device, without a host read: a fused
optimizer (`torch.optim.SGD`/`AdamW` with `fused=True`, as `recognition.optim` builds them)
is handed the flag as its `found_inf` and leaves every parameter and every state tensor
(momentum, Adam's moments and step count) as it was; fused SGD gets zero momentum buffers
before its first step, since on a skipped first step it would keep uninitialised ones. The
caller sees the flag in `StepResult.stepped`, a device tensor. Another optimizer is stepped
or not by a host read of the flag: one sync per step.

The optimizer steps at its rates rounded to float32 (`float32_rates`): what a captured step
(`recognition.training.graphed`) reads from the float32 device tensors that hold them, so
that eager and captured steps are the same function bit for bit. (torch's fused CUDA kernels
take a float rate as a double, a tensor one as float32: 0.1 and 0.1f move some weights by
their last bit differently. On a CPU both are rounded to float32 anyway.)
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did, as 0-dim tensors on the step's device.

    Nothing here has been read on the host: a training step launches no synchronisation,
    and whoever needs a value (the log window, at its interval) reads it then. `Precision.step()`
    fills the first three; the training step (`recognition.training.step`) adds the loss,
    whether it was finite and the accuracy of its micro-batches.

    stepped: bool; False when the loss or the gradients held inf/NaN and the update was
        skipped (no weight and no optimizer state changed).
    grad_norm: total L2 norm of the unscaled gradients before clipping (inf/NaN when they
        held inf/NaN); float32 or float64.
    scale: float32, the loss scale after this step's update (1.0 when no scaler is used).
    loss: mean loss over the step's micro-batches (not divided by their number); None when
        the caller knows no loss.
    finite: bool; False when a micro-batch's loss was NaN or inf (the step was then skipped);
        None when the caller knows no loss.
    accuracy: share of the global batch whose target logit was the largest (mean over
        micro-batches); None when the head reports none.
    distill_loss: a distilled run's distillation loss (unweighted, the mean over the global
        batch and the micro-batches); None otherwise.
    """

    stepped: Tensor
    grad_norm: Tensor
    scale: Tensor
    loss: Tensor | None = None
    finite: Tensor | None = None
    accuracy: Tensor | None = None
    distill_loss: Tensor | None = None


class MaskedUpdate:
    """Steps optimizers where a 0-dim bool flag says so, on the device where they allow it."""

    def __init__(self) -> None:
        # Fused optimizers ready to skip steps on the device (see _skips_on_device).
        self._device_skipping: dict[int, bool] = {}

    def apply(self, optimizer: torch.optim.Optimizer, ok: Tensor) -> None:
        """`optimizer.step()` where `ok` (a 0-dim bool tensor) is True; where it is False no
        parameter and no optimizer state changes."""
        if self._skips_on_device(optimizer):
            # Fused kernels take GradScaler's two attributes: with found_inf = 1 they return
            # before touching anything, and fused Adam(W) takes its step count back. No
            # grad_scale: the gradients are already unscaled.
            optimizer.found_inf = (~ok).to(torch.float32)  # type: ignore[attr-defined]
            optimizer.grad_scale = None  # type: ignore[attr-defined]
            try:
                with float32_rates(optimizer):
                    optimizer.step()
            finally:
                del optimizer.found_inf, optimizer.grad_scale  # type: ignore[attr-defined]
        elif bool(ok):  # an optimizer that cannot skip on the device: one host read
            with float32_rates(optimizer):
                optimizer.step()

    def _skips_on_device(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether `optimizer` can be handed a skip flag (a fused torch optimizer), making
        the state that a skipped first step would otherwise leave undefined (once)."""
        key = id(optimizer)
        if key not in self._device_skipping:
            ready = getattr(optimizer, "_step_supports_amp_scaling", False)
            if ready and isinstance(optimizer, torch.optim.SGD):
                ready = _zero_momentum_buffers(optimizer)
            self._device_skipping[key] = ready
        return self._device_skipping[key]


def float32_value(value: float) -> float:
    """`value` rounded to the nearest float32 (as a tensor's fill rounds it), as a float."""
    return struct.unpack("f", struct.pack("f", value))[0]


@contextlib.contextmanager
def float32_rates(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Within the block, each group's float lr is its float32 value (see the module
    docstring); the floats the schedule set (and checkpoints hold) come back after it. A
    group whose lr is a tensor (a captured step's) is left as it is."""
    kept = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        if isinstance(group["lr"], float):
            group["lr"] = float32_value(group["lr"])
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, kept, strict=True):
            group["lr"] = lr


@torch.no_grad()
def _zero_momentum_buffers(optimizer: torch.optim.SGD) -> bool:
    """Give every parameter of a fused SGD a zero momentum buffer where it has none yet.

    Fused SGD makes its buffers on its first step with `torch.empty_like` and fills them in
    the kernel, which `found_inf` skips: a skipped first step would leave uninitialised
    memory as momentum. A zero buffer is what the first step's buffer amounts to (the next
    step sets it to 0 * momentum + grad = grad, bit for bit) when dampening is 0; with
    dampening it is not, and False says the optimizer must be stepped from the host.
    (`recognition.optim.init_state` makes every optimizer's state this way for checkpoints,
    by a step at lr 0 on zero gradients; this needs no gradient-sized tensors.)
    """
    groups = [g for g in optimizer.param_groups if g["momentum"] != 0]
    if any(g["dampening"] != 0 for g in groups):
        return False
    for group in groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(param)
    return True


_WIDE = (torch.float32, torch.float64)


def total_grad_norm(params: list[Tensor], device: torch.device) -> Tensor:
    """L2 norm over all `.grad`s, accumulated in at least fp32 so half grads cannot overflow
    it: a 0-dim tensor (zero on `device` when no parameter has a gradient)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    if all(g.dtype == grads[0].dtype for g in grads) and grads[0].dtype in _WIDE:
        return torch.nn.utils.get_total_norm(grads)
    return torch.linalg.vector_norm(stacked_float64(grad_norms(grads), device))


def grad_norms(grads: list[Tensor]) -> list[Tensor]:
    """The L2 norm of each tensor of `grads`, in their order, as 0-dim tensors on its device:
    float64 for a float64 tensor (a reference run), float32 for anything narrower or fp32.

    One `torch._foreach_norm` per device and dtype rather than a norm per tensor: the
    step's host work and kernel launches do not grow with the number of parameters (a
    multi-tensor kernel on CUDA; on a CPU the same per-tensor norms, bit for bit).
    """
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, grad in enumerate(grads):
        groups.setdefault((grad.device, grad.dtype), []).append(index)
    norms: list[Tensor] = list(grads)  # every entry replaced below
    for (_, dtype), indices in groups.items():
        wide = dtype if dtype in _WIDE else torch.float32
        found = torch._foreach_norm([grads[i] for i in indices], 2, dtype=wide)
        for index, norm in zip(indices, found, strict=True):
            norms[index] = norm
    return norms


def stacked_float64(norms: list[Tensor], device: torch.device) -> Tensor:
    """`norms` (0-dim tensors) as one float64 vector on `device`, in their order: one stack
    and one cast when they share a device and a dtype (the usual case), not one per norm."""
    if all(n.device == device and n.dtype == norms[0].dtype for n in norms):
        return torch.stack(norms).to(torch.float64)
    return torch.stack([n.to(device, torch.float64) for n in norms])
