"""Label smoothing for the sharded margin softmax: what the smoothing term adds to the loss.

`F.cross_entropy(logits, target, label_smoothing=eps)` over C classes puts 1 - eps + eps/C
on the target and eps/C on every other class, so that for a row i with target t

    loss_i = (1 - eps) * (-log p_it) + (eps / C) * sum_j (-log p_ij)
           = logsumexp_i - (1 - eps) * z_it - (eps / C) * sum_j z_ij.

Beside the softmax's statistics the head then needs one more per row: the sum of all its
logits, over every rank's classes. The logits are the margin-modified ones (the target's
is s * psi(cos), the others s * cos), as the strong re-id baseline's CrossEntropyLabelSmooth
smooths whatever its classifier outputs. A rank's share of that sum needs no logit: the sum
of s * cos_ij over the classes j of its shard is s * <e_i, u> with u = sum_j w_j / |w_j|,
the sum of the shard's normalised class rows (D,), so the share is

    s * <e_i, u> - [rank owns t] s * cos_it + [rank owns t] z_it,

and the shares are all-reduced (SUM) with the softmax's other sums. `NormalizedRowSum`
computes u a block of rows at a time (no normalised copy of the weight) with its exact
gradient; backward writes one weight-sized gradient, which autograd adds to the softmax's.

Partial FC is refused with smoothing (the config says so): its softmax runs over classes
sampled anew at every step, and spreading eps over the sampled classes would smooth towards
a different distribution each step, while spreading it over every class would give every
row a gradient, which partial FC exists to avoid. So is head.fused_update (the Triton
backward steps the rows before this term's gradient reaches them).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from recognition.heads.local_stats import BLOCK_SIZE, norm_eps, remove_radial_part, row_norms


class NormalizedRowSum(torch.autograd.Function):
    """u = sum_j weight_j / |weight_j| (D,), in `dtype`, from the raw rows (C_local, D).

    A row of norm below the eps counts as F.normalize counts it (divided by the eps). The
    rows go `block_size` at a time, in forward and backward: besides the weight's gradient
    the function makes no weight-sized tensor.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        weight: Tensor,
        dtype: torch.dtype,
        block_size: int = BLOCK_SIZE,
    ) -> Tensor:
        total = torch.zeros(weight.shape[1], dtype=dtype, device=weight.device)
        for start in range(0, weight.shape[0], block_size):
            rows = weight[start : start + block_size]
            inv_norm = 1.0 / row_norms(rows, dtype).clamp_min(norm_eps(rows.dtype))
            total += inv_norm @ rows.to(dtype)
        ctx.save_for_backward(weight)
        ctx.dtype, ctx.block_size = dtype, block_size
        return total

    @staticmethod
    @once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_total: Tensor
    ) -> tuple[Tensor | None, None, None]:
        (weight,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        grad_weight = torch.empty_like(weight)
        for start in range(0, weight.shape[0], ctx.block_size):
            rows = weight[start : start + ctx.block_size]
            inv_norm = 1.0 / row_norms(rows, ctx.dtype).clamp_min(norm_eps(rows.dtype))
            # d <g, rows_j / |rows_j|> / d rows_j = (g - y_j <y_j, g>) / |rows_j|.
            grad_rows = grad_total[None, :] * inv_norm[:, None]  # (c, D)
            grad_rows = remove_radial_part(grad_rows, rows, inv_norm)
            grad_weight[start : start + ctx.block_size] = grad_rows.to(weight.dtype)
        return grad_weight, None, None


def local_logit_sum(
    norm_embeddings: Tensor,
    weight: Tensor,
    target_cos: Tensor,
    target_logit: Tensor,
    owned: Tensor,
    scale: float,
) -> Tensor:
    """This rank's share (N,) of each row's sum of logits: s * cos over the shard's classes,
    the target's cosine logit replaced by its margin logit `target_logit` (0 where another
    rank owns the label) where this rank owns the label. In the embeddings' dtype."""
    row_sum = NormalizedRowSum.apply(weight, norm_embeddings.dtype)  # (D,)
    cos_sum = norm_embeddings @ row_sum  # (N,)
    return scale * (cos_sum - torch.where(owned, target_cos, 0.0)) + target_logit


def smoothed_loss(
    log_sumexp: Tensor, target_logit: Tensor, logit_sum: Tensor, eps: float, num_classes: int
) -> Tensor:
    """Each row's smoothed cross-entropy (N,) from its global log-sum-exp, target logit and
    sum of logits (the module docstring's formula)."""
    return log_sumexp - (1.0 - eps) * target_logit - (eps / num_classes) * logit_sum


def smoothing_terms(
    eps: float,
    num_classes: int,
    norm_embeddings: Tensor,
    weight: Tensor,
    target_cos: Tensor,
    target_logit: Tensor,
    owned: Tensor,
    scale: float,
) -> tuple[Tensor, float, int] | None:
    """What `margin_softmax.global_loss` takes for label smoothing `eps`: (this rank's share
    of each row's sum of logits (N,), eps, num_classes); None when eps is 0."""
    if eps == 0:
        return None
    logit_sum = local_logit_sum(norm_embeddings, weight, target_cos, target_logit, owned, scale)
    return logit_sum, eps, num_classes
