"""How optimizers step the head's class rows: `attach_optimizer` (partial FC: only the rows
sampled since the last step) and `attach_fused_update` (the Triton backward applies SGD to
the rows itself), and what a step reads of them (`optimizer_param`, `squared_grad_norm`).

`OptimizerHandOver` is a base class of `ShardedMarginSoftmax`, which owns what it reads: the
weight, the shard's sizes, its `RowSampler`, its kernel setting and process group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from recognition import distributed
from recognition.heads.triton_stats import FusedSGD, fused_sgd

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from recognition.heads.partial_fc import RowSampler


class OptimizerHandOver:
    """The class rows' side of the optimizer, for the head (see the module docstring)."""

    weight: nn.Parameter
    num_sample: int
    num_local: int
    kernel: str
    group: ProcessGroup | None
    _sampler: RowSampler
    # The tensor the optimizer steps for `weight` (the weight, or its O2 master); in a list,
    # since a Parameter set as an attribute of the module would become one of its own.
    _optimizer_param: list[Tensor]
    _fused: FusedSGD | None

    @property
    def optimizer_param(self) -> Tensor:
        """The tensor the optimizer steps for `weight`: the weight, or (precision O2) its fp32
        master, as `attach_optimizer` was told."""
        return self._optimizer_param[0]

    @property
    def updates_in_backward(self) -> bool:
        """True once `attach_fused_update` made the backward step the class rows: a step
        must then gate that update with its loss's finiteness (`gate_update`) before
        backward, since no later mask reaches them."""
        return self._fused is not None

    def gate_update(self, step_ok: Tensor) -> None:
        """With a fused update: the next backward steps the class rows only where `step_ok`
        (a 0-dim bool tensor on the device, e.g. the loss is finite) is True, without
        reading it on the host; else nothing changes (no rows, no momentum). Without a fused
        update, nothing to gate."""
        if self._fused is not None:
            self._fused.gate(step_ok)

    def squared_grad_norm(self) -> Tensor:
        """Sum of squares of the class rows' gradients over every rank of the group.

        Collective. Of the tensor the optimizer steps (`optimizer_param`), accumulated in
        float64: the head's share of a global gradient norm, the same on every rank (each
        rank's rows are different, so their squares add up over ranks).
        """
        grad = self.optimizer_param.grad
        if grad is None:
            local = torch.zeros((), dtype=torch.float64, device=self.weight.device)
        else:
            wide = grad.dtype if grad.dtype in (torch.float32, torch.float64) else torch.float32
            local = torch.linalg.vector_norm(grad, dtype=wide).double().square()
        return distributed.all_reduce_tensor_sum(local, self.group)

    def attach_optimizer(
        self, optimizer: torch.optim.Optimizer, param: nn.Parameter | None = None
    ) -> None:
        """Make `optimizer` update only the class rows sampled since its last step.

        For partial FC (sample_rate < 1); with sample_rate = 1 this does nothing. Call it once,
        after building the optimizer. `param` is the tensor the optimizer steps for
        `self.weight`: the weight itself (the default) or, when the optimizer holds an fp32
        master copy instead (precision O2), that master.

        How: hooks around `optimizer.step()` (`partial_fc.RowSampler.attach_optimizer`): the
        optimizer steps the sampled rows of the parameter, its gradient and its state
        (momentum, weight decay and all); unsampled rows and their state are untouched, bit
        for bit, and state created on the first step is zero for rows not yet sampled (a
        momentum buffer starting at zero is what SGD's first step amounts to). Per-parameter
        scalars (Adam's step count) count every optimizer step. Extra memory during the
        step: the sampled rows of the weight, its gradient and its state (about 3 x
        sample_rate x the weight for SGD).
        """
        target = self.weight if param is None else param
        self._optimizer_param = [target]
        if self.num_sample == self.num_local:
            return
        if not any(p is target for group in optimizer.param_groups for p in group["params"]):
            raise ValueError(
                "attach_optimizer: the optimizer does not hold the head's weight; under "
                "precision O2 pass its fp32 master as `param`"
            )
        if target.shape != self.weight.shape:
            raise ValueError(
                f"attach_optimizer: param has shape {tuple(target.shape)}, the weight "
                f"{tuple(self.weight.shape)}"
            )
        self._sampler.attach_optimizer(optimizer, target)

    def attach_fused_update(
        self, optimizer: torch.optim.Optimizer, param: nn.Parameter | None = None
    ) -> None:
        """Apply `optimizer`'s SGD step to the class rows inside the Triton backward.

        Call once, after building the optimizer and instead of `attach_optimizer`. Needs
        kernel="triton", a torch.optim.SGD (dampening 0, not maximize) holding the head's
        float32 weight. From then on every training backward updates the rows that took
        part in the forward (all of them, or the partial-FC sample) as that SGD would -
        weight decay, momentum, Nesterov, lr read from the weight's parameter group at each
        step, so the LR scheduler applies - and leaves `weight.grad` None, so
        `optimizer.step()` skips the weight (and nothing weight-sized holds a gradient).
        The momentum buffer is the optimizer's own state entry, so checkpoints do not
        change. Not for gradient accumulation (each backward steps), gradient clipping that
        includes the head, or fp16 loss scaling (the gradient would be scaled): the config
        refuses those combinations. `param` must be the weight itself (no O2 master).
        """
        if getattr(self, "label_smoothing", 0.0) > 0:
            raise ValueError(
                "head.fused_update: not with head.label_smoothing (its gradient reaches the "
                "rows after the Triton backward has stepped them)"
            )
        self._fused = fused_sgd(self.kernel, optimizer, self.weight, param)
