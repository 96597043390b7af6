"""The Triton path of the head's local statistics: `TritonClassStats`, the autograd function
that computes what `local_stats.LocalClassStats` computes on the fused kernels of
`heads/kernels/margin_softmax_triton.py`, and `FusedSGD`, which hands torch.optim.SGD's
step to the weight-gradient kernel (head.fused_update). `recognition.heads.margin_softmax`
chooses between the two paths and applies the margin and the collectives.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn

from recognition.heads.kept_rows import KeptRows
from recognition.heads.local_stats import (
    ClassStatsFunction,
    add_target_rows_,
    norm_eps,
    target_share,
    target_terms,
)
from recognition.heads.traffic import phase


def triton_kernels() -> ModuleType:
    """heads/kernels/margin_softmax_triton, imported on first use (it reads TRITON_INTERPRET)."""
    return importlib.import_module("recognition.heads.kernels.margin_softmax_triton")


class FusedSGD:
    """What the Triton backward needs to apply torch.optim.SGD's step to the head's rows.

    Reads lr, momentum, weight decay and Nesterov from the optimizer's parameter group at
    every step (so the LR schedule applies), and keeps the momentum buffer in the
    optimizer's own state (`optimizer.state[weight]["momentum_buffer"]`, float32), so that
    checkpoints hold what they hold without the fused update.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, param: nn.Parameter) -> None:
        self.optimizer = optimizer
        self.param = param
        self.group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
        # The next update's gate (`gate`), read once.
        self.step_ok: Tensor | None = None

    def gate(self, step_ok: Tensor) -> None:
        """Make the next update store nothing where `step_ok` (a 0-dim bool tensor on the
        device) is False: the rows and their momentum stay as they were, and nothing is
        read on the host."""
        self.step_ok = step_ok

    @property
    def kind(self) -> str:
        """The variant of the update the kernel applies: sgd, momentum or nesterov."""
        if self.group["momentum"] == 0:
            return "sgd"
        return "nesterov" if self.group["nesterov"] else "momentum"

    def update(self, kernels: ModuleType) -> Any:
        group = self.group
        buffer = None
        if group["momentum"] != 0:
            state = self.optimizer.state[self.param]
            buffer = state.get("momentum_buffer")
            if buffer is None:  # zero before the first step: the first buffer is the step
                buffer = torch.zeros_like(self.param, dtype=torch.float32)
                state["momentum_buffer"] = buffer
            if buffer.dtype != torch.float32 or not buffer.is_contiguous():
                raise ValueError("head.fused_update: the momentum buffer must be dense float32")
        step_ok, self.step_ok = self.step_ok, None
        return kernels.SGDUpdate(
            # A tensor while a CUDA graph captures the step (recognition.training.graphed):
            # the kernel then reads the rate from the device at each replay.
            lr=group["lr"] if isinstance(group["lr"], Tensor) else float(group["lr"]),
            momentum=float(group["momentum"]),
            weight_decay=float(group["weight_decay"]),
            nesterov=bool(group["nesterov"]),
            momentum_buffer=buffer,
            step_ok=step_ok,
        )


def fused_sgd(
    kernel: str, optimizer: torch.optim.Optimizer, weight: nn.Parameter, param: Tensor | None
) -> FusedSGD:
    """The hand-over of `optimizer`'s SGD step for `weight` to the Triton backward
    (`ShardedMarginSoftmax.attach_fused_update` says what it does); ValueError naming what
    it cannot honour: another kernel or optimizer, an O2 master, dampening, a half weight."""
    if kernel != "triton":
        raise ValueError(f"head.fused_update: needs head.kernel=triton, the head has {kernel!r}")
    if not isinstance(optimizer, torch.optim.SGD):
        raise ValueError(
            f"head.fused_update: applies SGD only, the optimizer is {type(optimizer).__name__}"
        )
    target = weight if param is None else param
    if target is not weight:
        raise ValueError("head.fused_update: the optimizer must step the weight itself")
    groups = [g for g in optimizer.param_groups if any(p is target for p in g["params"])]
    if not groups:
        raise ValueError("attach_fused_update: the optimizer does not hold the head's weight")
    group = groups[0]
    if group.get("dampening", 0) != 0 or group.get("maximize", False):
        raise ValueError("head.fused_update: SGD with dampening or maximize is not supported")
    if weight.dtype != torch.float32:
        raise ValueError(f"head.fused_update: the weight must be float32, it is {weight.dtype}")
    return FusedSGD(optimizer, weight)


class TritonClassStats(ClassStatsFunction):
    """`LocalClassStats` (same inputs and outputs) on the fused Triton kernels.

    Statistics in float32 only. The target cosine is computed as in `LocalClassStats`; the
    non-target statistics and their gradient come from the kernels, launched with `tiles`
    (a TileConfig, from `KernelSelector.triton_tiles`). With `fused` (a `FusedSGD`),
    backward applies the SGD step to the taking-part rows of `weight` in place - the
    kernel's share and the target rows' share together - and returns no gradient for the
    weight; `kept_rows` (a `KeptRows`, with `fused` only) then holds the rows' inverse norms
    and rounded copy between steps, which the update keeps current.

    `keep` (head.chunk_size None): the forward keeps the exponentials of the logits in the
    matmul dtype, N x K (2 bytes each in bf16), and the rows rounded to the matmul dtype for
    the backward, which then reads them rather than recomputing the logits and rounding the
    rows again: 6 N K D matmul FLOPs a step instead of 8. Otherwise it keeps neither: memory
    O(N x chunk) as the torch path with a chunk size.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        norm_embeddings: Tensor,
        weight: Tensor,
        row_index: Tensor | None,
        target_row: Tensor,
        scale: float,
        matmul_dtype: torch.dtype,
        fused: FusedSGD | None,
        tiles: Any,
        keep: bool,
        kept_rows: KeptRows | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        kernels = triton_kernels()
        with torch.autocast(norm_embeddings.device.type, enabled=False):
            norm_embeddings = norm_embeddings.contiguous()
            target_rows, target_cos, target_pos = target_terms(
                norm_embeddings, weight, row_index, target_row
            )
            with phase("forward"):
                rows, inv_norm, held = class_rows(
                    kernels, weight, row_index, matmul_dtype, keep, kept_rows if fused else None
                )
                row_max, row_sumexp, kept = kernels.class_stats(
                    norm_embeddings, weight, row_index, inv_norm, target_pos, scale,
                    matmul_dtype, tiles, rows=rows, keep=keep,
                )  # fmt: skip
        ctx.save_for_backward(
            norm_embeddings, weight, row_index, target_row, target_rows, target_pos, inv_norm,
            row_max,
        )  # fmt: skip
        ctx.scale, ctx.matmul_dtype, ctx.tiles, ctx.fused = scale, matmul_dtype, tiles, fused
        ctx.rows, ctx.kept, ctx.held = rows, kept, held
        ctx.gradients = TritonClassStats.gradients
        return ClassStatsFunction.outputs(ctx, row_max, row_sumexp, target_cos)

    @staticmethod
    def gradients(
        ctx: torch.autograd.function.FunctionCtx, grad_sumexp: Tensor, grad_target_cos: Tensor
    ) -> tuple[Tensor | None, ...]:
        kernels = triton_kernels()
        (norm_embeddings, weight, row_index, target_row, target_rows, target_pos, inv_norm,
         row_max) = ctx.saved_tensors  # fmt: skip
        fused: FusedSGD | None = ctx.fused
        want_weight = ctx.needs_input_grad[1] or fused is not None
        # The target cosine's share, as LocalClassStats computes it; before the kernels,
        # since a fused update overwrites the weight. With a fused update the kernel's
        # epilogue adds it to each target row (summed on the device: no host sync).
        grad_target, target_grad_rows = target_share(
            grad_target_cos, norm_embeddings, weight, target_row, want_weight
        )
        grad_embeddings, grad_weight = kernels.class_stats_backward(
            norm_embeddings, weight, row_index, inv_norm, target_pos, row_max, grad_sumexp,
            ctx.scale, ctx.matmul_dtype, ctx.tiles, want_weight=want_weight,
            target_grad=target_grad_rows if fused is not None else None,
            sgd=fused.update(kernels) if fused is not None else None,
            norm_limit=1.0 / norm_eps(weight.dtype), rows=ctx.rows, kept=ctx.kept,
            kept_rows=ctx.held,
        )  # fmt: skip
        # Freed with the backward, not the graph. The kept logits are now their gradient: a
        # second backward of this forward (retain_graph) recomputes them.
        ctx.rows = ctx.kept = ctx.held = None
        grad_embeddings += grad_target * target_rows
        if grad_weight is not None:
            add_target_rows_(grad_weight, target_row, target_grad_rows)
        return grad_embeddings, grad_weight, None, None, None, None, None, None, None, None


def class_rows(
    kernels: ModuleType,
    weight: Tensor,
    row_index: Tensor | None,
    matmul_dtype: torch.dtype,
    keep: bool,
    kept_rows: KeptRows | None,
) -> tuple[Any, Tensor, tuple[Tensor | None, Tensor] | None]:
    """Where a forward reads the taking-part rows from (a `RowSource`), their inverse norms
    (K,), and what a fused update keeps current ((rounded copy or None, inverse norms) of
    every row, or None).

    With `kept_rows` (the fused update), the rows' copy (when `keep`) and inverse norms kept
    between steps; else made now: the taking-part rows rounded once for the forward and the
    backward (when `keep` and rounding or gathering is needed; otherwise a chunk at a time),
    and their inverse norms, one pass over the rows.
    """
    eps = norm_eps(weight.dtype)
    if kept_rows is not None:
        rounded, all_inv_norm = kept_rows.current(weight, matmul_dtype, keep, eps)
        inv_norm = all_inv_norm if row_index is None else all_inv_norm[row_index]
        source = kernels.RowSource(
            weight, row_index, matmul_dtype, rounded if rounded is not None else weight, True
        )
        if not keep:  # rounded a chunk at a time
            source = kernels.RowSource(weight, row_index, matmul_dtype)
        return source, inv_norm, (rounded, all_inv_norm)
    inv_norm = kernels.inverse_norms(weight, row_index, eps)
    rounded = None
    if keep and (row_index is not None or weight.dtype != matmul_dtype):
        rounded = kernels.RowSource(weight, row_index, matmul_dtype).chunk(0, inv_norm.shape[0])
    return kernels.RowSource(weight, row_index, matmul_dtype, rounded), inv_norm, None
