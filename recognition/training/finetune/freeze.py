"""`freeze_batch_norm`: a backbone's BatchNorm layers held as they are (model.freeze_bn)."""

from __future__ import annotations

import types

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def _stay_in_eval(module: nn.Module, mode: bool = True) -> nn.Module:
    # Module.train calls each child's own train(): this one ignores the mode asked for, so
    # the loop's and the evaluation hooks' model.train() cannot turn the statistics on again.
    return nn.Module.train(module, False)


def freeze_batch_norm(module: nn.Module) -> int:
    """Freeze every BatchNorm layer of `module` in place; returns how many.

    Each layer is put in eval mode for good (it normalises with its running statistics and
    never updates them, whatever `train()` is called later, on it or on a parent), and its
    affine weight and bias stop requiring gradients, so the optimizer (which takes only
    parameters that require them) neither steps nor decays them and DDP does not reduce
    them. Call before the optimizer is built and the module wrapped in DDP.
    """
    count = 0
    for layer in module.modules():
        if not isinstance(layer, _BatchNorm):
            continue
        for param in layer.parameters(recurse=False):
            param.requires_grad_(False)
        # An instance attribute: it deep-copies with the module (the evaluation's copies).
        layer.train = types.MethodType(_stay_in_eval, layer)  # type: ignore[method-assign]
        layer.train(False)
        count += 1
    return count
