"""Casting for a level: the model's weights and buffers, the forward's inputs, autocast.

Choices made here and why:
- O2 keeps only BatchNorm (every `_BatchNorm`: 1d/2d/3d, SyncBatchNorm) in fp32, as apex's
  `keep_batchnorm_fp32` does. BN's running variance and its batch statistics are what lose
  most in half; `batch_norm` accepts a half input with fp32 weights on CPU and CUDA and returns
  the input's dtype, so no cast is needed around it. PReLU goes half like every other layer:
  autocast runs `prelu` in half anyway, and its fp32 master keeps the precise slope.
- A module may name buffers that keep their dtype at every level in a `keep_dtype_buffers`
  attribute (a tuple of names): running statistics moved by small steps, which half
  precision would round away (AdaFace's running norm statistics, heads/margins.py).
- O2 also turns autocast on. With half weights it changes nothing for convs and matmuls, but
  it makes mixed-dtype ops legal (an fp32 tensor the code creates meeting a half activation in
  a matmul) and runs the ops autocast lists as fp32 (softmax, log-softmax, losses, norms) in
  fp32, as O1 does. O3 leaves autocast off: it is the pure-half speed baseline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from recognition.precision.levels import Level


def cast_module(module: nn.Module, level: Level) -> None:
    """Cast `module` in place for `level`: half weights under O2 (BatchNorm kept fp32) and
    O3; O0 and O1 leave it untouched."""
    if level.casts_model:
        _cast_floating(module, level.half_dtype, keep_batchnorm=level.keeps_batchnorm_fp32)


def cast_inputs(x: Tensor, level: Level) -> Tensor:
    """`x` in the half dtype under O2/O3 (floating tensors only); unchanged otherwise."""
    if level.casts_model and x.is_floating_point():
        return x.to(level.half_dtype)
    return x


def autocast(
    level: Level, device: torch.device, cache: bool = True
) -> contextlib.AbstractContextManager:
    """The context the forward pass runs in: autocast for O1/O2 (`cache`: its cache of cast
    weights, one cast per weight and forward), a no-op for O0/O3."""
    if level.autocasts:
        return torch.autocast(device.type, dtype=level.half_dtype, cache_enabled=cache)
    return contextlib.nullcontext()


def _cast_floating(module: nn.Module, dtype: torch.dtype, keep_batchnorm: bool) -> None:
    """Cast the floating parameters and buffers of `module` to `dtype`, in place.

    `param.data` is replaced rather than the Parameter, so references held elsewhere (tied
    weights, hooks) stay valid. With `keep_batchnorm`, BatchNorm layers keep fp32. Buffers a
    module names in `keep_dtype_buffers` keep their dtype.
    """
    for submodule in module.modules():
        if keep_batchnorm and isinstance(submodule, _BatchNorm):
            continue
        kept = set(getattr(submodule, "keep_dtype_buffers", ()))
        tensors: Iterable[Tensor] = list(submodule.parameters(recurse=False)) + [
            buffer for name, buffer in submodule.named_buffers(recurse=False) if name not in kept
        ]
        for tensor in tensors:
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(dtype)
