"""One optimizer step: `train_step()`, and the global gradient norm it clips by.

`train_step` is the step the loop calls; a test drives it alone. Another step function with
the same signature and result (a compiled or a pipelined one) can replace it in
`recognition.training.loop` without touching the loop.

The step launches no host synchronisation: it reads no tensor value on the host and
branches on none. A non-finite loss or gradient norm is handled on the device (the
optimizer's update is masked, see `recognition.precision`), and the `StepResult` holds
device tensors that the log window reads at its interval. What still synchronises, and why:
partial FC (`head.sample_rate` < 1) whose sample is smaller than a batch's positives can be,
or that several micro-batches share (the sampled classes' count is data-dependent; see
`recognition.heads.partial_fc`).
`head.fused_update` steps the head's rows inside backward: the loss's finiteness gates that
update on the device (`gate_update`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from recognition import distributed
from recognition.heads.triplet import TrainingLoss
from recognition.precision import Precision, StepResult, grad_norms, stacked_float64


class ShardedPart(Protocol):
    """A part whose optimizer tensor holds different rows on every rank (the head)."""

    optimizer_param: torch.Tensor

    def squared_grad_norm(self) -> torch.Tensor: ...


class DistillTerm(Protocol):
    """A distilled run's part of the loss (`recognition.training.distill.DistillTerm`)."""

    weight: float

    def __call__(
        self, projected: torch.Tensor, images: torch.Tensor, brought: list[torch.Tensor]
    ) -> torch.Tensor: ...


def train_step(
    backbone: nn.Module,
    head: nn.Module,
    micro_batches: Sequence[tuple[torch.Tensor, ...]],
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    max_grad_norm: float | None,
    *,
    training_loss: TrainingLoss | None = None,
    distill: DistillTerm | None = None,
) -> StepResult:
    """One optimizer step over `micro_batches` (gradient accumulation when more than one).

    `backbone` may be wrapped in DistributedDataParallel (and compiled); its gradients are
    then all-reduced once, in the last micro-batch's backward. `head` is the class-sharded
    margin softmax: its share of the gradient norm is summed over ranks
    (`global_grad_norm`), so that every rank clips by the same global norm.
    `training_loss` (head.id_weight, head.triplet_weight) weighs the head's loss and adds
    the triplet loss of the backbone's features: the features before its BN neck when the
    backbone returns (features, embeddings) in training (`neck_features`), else the
    embeddings. None: the head's loss alone.

    Each micro-batch's loss is divided by their number before backward, so the gradient is
    that of the mean loss over all of them. A non-finite loss skips the whole step on the
    device: every micro-batch still runs backward, and the update is masked so that no
    parameter or optimizer state changes (`Precision.step`). The loss is the same on every
    rank (the head reduces over the global batch), so ranks skip alike. Returns device
    tensors (`StepResult`); nothing is read on the host.

    `distill` (a distilled run, `recognition.training.distill`): `backbone` returns the
    embeddings and their projection, a micro-batch may hold more than (images, labels)
    (the teacher's cached embeddings), and the weighted distillation loss is added to the
    head's (`_loss`).
    """
    num_micro = len(micro_batches)
    # The head-only gate (train.head_only_steps) holds the model; a compiled model keeps its
    # DDP wrapper inside (torch.compile's OptimizedModule).
    syncing = getattr(backbone, "wrapped", backbone)
    is_ddp = isinstance(getattr(syncing, "_orig_mod", syncing), DistributedDataParallel)
    # head.fused_update steps the class rows inside backward, where the optimizer's mask
    # cannot reach: the loss's finiteness gates that update on the device.
    gates_head_update = getattr(head, "updates_in_backward", False)
    precision.zero_grad(optimizer)
    losses, accuracies, distill_losses = [], [], []
    for index, (images, labels, *brought) in enumerate(micro_batches):
        # DDP would all-reduce after every backward; the sum is only needed after the last.
        defer_sync = is_ddp and index < num_micro - 1
        with syncing.no_sync() if defer_sync else contextlib.nullcontext():  # type: ignore[operator]
            with precision.autocast():
                loss, reported, distill_loss = _loss(
                    backbone, head, images, labels, brought, precision, training_loss, distill
                )
            if gates_head_update:
                # `reported` is the same on every rank: every rank gates alike.
                head.gate_update(torch.isfinite(reported))
            precision.backward(loss / num_micro)
        # Kept in the loss's own dtype (float32, or float64 in a float64 run).
        losses.append(reported.detach())
        if distill_loss is not None:
            distill_losses.append(distill_loss)
        if getattr(head, "last_accuracy", None) is not None:
            accuracies.append(head.last_accuracy.float())

    stacked = torch.stack(losses)
    finite = torch.isfinite(stacked).all()
    sharded = [head] if hasattr(head, "squared_grad_norm") else []
    result = precision.step(
        optimizer,
        max_grad_norm,
        grad_norm_fn=lambda params: global_grad_norm(params, sharded),
        finite=finite,
    )
    return dataclasses.replace(
        result,
        loss=stacked.mean(),
        finite=finite,
        accuracy=torch.stack(accuracies).mean() if accuracies else None,
        distill_loss=torch.stack(distill_losses).mean() if distill_losses else None,
    )


def _loss(
    backbone: nn.Module,
    head: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    brought: list[torch.Tensor],
    precision: Precision,
    training_loss: TrainingLoss | None,
    distill: DistillTerm | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(the loss to backpropagate, the loss to report, the distillation loss or None) of
    one micro-batch.

    The head's loss, weighed and joined by the triplet loss when `training_loss` says so
    (the features before a BN neck when the backbone returns (features, embeddings)).

    Distilled, the loss backpropagated is the head's plus the weighted distillation loss of
    this rank's samples (DDP's gradient average then makes it the mean over the global
    batch); the one reported takes that term's mean over ranks (detached: one all-reduce
    of a scalar), so that it is the same on every rank, as the head's is, and a
    non-finite term on any rank skips the step on all.
    """
    output = backbone(precision.cast_inputs(images))
    if distill is not None:
        # A distilled backbone returns its embeddings and their projection (B, D_s), (B, D_t);
        # a teacher is refused with the triplet loss (config), so no neck features come too.
        embeddings, projected = output
        features = embeddings
    else:
        features, embeddings = output if isinstance(output, tuple) else (output, output)
    head_loss = head(embeddings, labels)  # (B, D) in: the same scalar on every rank
    if training_loss is not None:
        head_loss = training_loss(head_loss, features, labels)
    if distill is None:
        return head_loss, head_loss, None
    term = distill(projected, images, brought)
    world = distributed.world_size()
    global_term = distributed.all_reduce_tensor_sum(term.detach()) / world
    loss = head_loss + distill.weight * term
    return loss, head_loss.detach() + distill.weight * global_term, global_term


def global_grad_norm(
    params: Iterable[torch.Tensor],
    sharded: Sequence[ShardedPart] = (),
    stage_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """L2 norm of the gradients of `params` over the whole model, whichever rank holds them.

    `params` are the tensors an optimizer steps. Those that a part of `sharded` steps hold
    different rows on every rank: the part sums their squares over its ranks
    (`squared_grad_norm`, collective). The others are replicated and already equal on every
    rank (DDP averaged them) and count once. So every rank gets the same norm: clipping by a
    local norm would scale each rank's replica differently and the replicas would drift
    apart. With a pipelined backbone each rank holds one stage and the head only the last
    stage's ranks: `stage_group` (the pipeline's ranks, one per stage) sums those parts,
    collective over it. inf/NaN anywhere gives inf/NaN on every rank. Squares are summed in
    float32 at least (float64 for float64 gradients) so half gradients cannot overflow.
    Returns a 0-dim float64 tensor, not read on the host (zero when no parameter has a
    gradient).
    """
    sharded_ids = {id(part.optimizer_param) for part in sharded}
    replicated = [p.grad for p in params if p.grad is not None and id(p) not in sharded_ids]
    # Where the gradients are: a copy of the head's share to another device would sync.
    if replicated:
        device = replicated[0].device
    else:
        device = sharded[0].optimizer_param.device if sharded else torch.device("cpu")
    total = _squared_norm(replicated, device)
    for part in sharded:
        total = total + part.squared_grad_norm().to(device, torch.float64)
    if stage_group is not None:
        total = distributed.all_reduce_tensor_sum(total, stage_group)
    return total.sqrt()


def _squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of every element of `grads`: a float64 scalar on `device`."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    return stacked_float64(grad_norms(grads), device).square().sum()
