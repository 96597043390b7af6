"""The torch path of the head's local statistics: softmax statistics of one rank's classes.

`LocalClassStats` (an autograd function) computes, for normalised embeddings against the raw
class rows of this rank, the max and sum-exp of the non-target logits and the target cosine,
a block of classes at a time, keeping exp(logits) for backward or recomputing them (see its
docstring and `recognition.heads.margin_softmax`, which applies the margin and the
collectives). The Triton kernels (`heads/kernels/`) compute the same and share the helpers
here that both need (the normalisation's derivative, the target rows' gradient).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

# F.normalize's default eps; raised to the dtype's smallest normal number in float16, where
# 1e-12 rounds to zero and a zero row would divide 0 by 0.
NORM_EPS = 1e-12

# Classes per block when chunk_size is None: the logits are all kept, but the work (and its
# temporaries, and the cache footprint) goes a block at a time.
BLOCK_SIZE = 8192


def l2_normalize(rows: Tensor) -> Tensor:
    """Rows scaled to unit L2 norm; an all-zero row stays zero (no NaN)."""
    eps = max(NORM_EPS, torch.finfo(rows.dtype).tiny)
    return F.normalize(rows, p=2.0, dim=1, eps=eps)


def l2_normalize_backward(rows: Tensor, grad_normalized: Tensor) -> Tensor:
    """Gradient w.r.t. `rows` of `l2_normalize(rows)` given the gradient of its output."""
    with torch.enable_grad():
        rows = rows.detach().requires_grad_(True)
        (grad_rows,) = torch.autograd.grad(l2_normalize(rows), rows, grad_normalized)
    return grad_rows


class ClassStatsFunction(torch.autograd.Function):
    """What the two paths' autograd functions share: outputs (max, sum-exp, target cosine),
    the max not differentiable (it only shifts exp() into range), and a backward that hands
    the other two gradients to the subclass's `gradients(ctx, grad_sumexp, grad_target_cos)`,
    which the forward names as `ctx.gradients`."""

    @staticmethod
    def outputs(
        ctx: torch.autograd.function.FunctionCtx, row_max: Tensor, sumexp: Tensor, cos: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        ctx.mark_non_differentiable(row_max)
        return row_max, sumexp, cos

    @staticmethod
    @once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx,
        grad_max: Tensor,
        grad_sumexp: Tensor,
        grad_target_cos: Tensor,
    ) -> tuple[Tensor | None, ...]:
        del grad_max  # a constant shift of the logits
        return ctx.gradients(ctx, grad_sumexp, grad_target_cos)


class LocalClassStats(ClassStatsFunction):
    """Softmax statistics of the non-target logits of this rank's classes, and the target cosine.

    Inputs: normalised embeddings (N, D) in the statistics dtype (float32 or float64); the raw
    class rows `weight` (C_local, D); `row_index` (K,) sorted, the rows taking part (partial FC),
    or None for all of them; `target_row` (N,), each row's target as a row of `weight`, -1
    where another rank owns the label (an owned target always takes part); the scale s;
    `block_size`, the classes handled at a time; `keep_logits`; the matmul dtype.

    Returns (max, sum-exp, target cosine), each (N,) in the statistics dtype: the max and the
    sum of exp(s*cos - max) over the taking-part classes other than the row's target (max
    -inf and sum-exp 0 for a row with no such class), and the target's cosine (0 where not
    owned), computed in the statistics dtype. The caller applies the margin to that cosine and
    folds the target logit into the statistics with plain autograd.

    The work runs `block_size` classes at a time, on transposed blocks (c, N) so that a block
    is contiguous. Class rows are never normalised into a copy: a block's logits are
    (rows @ embeddings^T) scaled row by row by s / |row|, and backward applies the
    normalisation's derivative per block. With `keep_logits` (chunk_size None) the forward
    keeps exp(logit - max) of every class, (K, N), for backward: memory O(N x K), nothing
    recomputed. Without, forward runs an online softmax (a running max, a running sum-exp
    rescaled whenever the max grows) and backward recomputes each block: memory O(N x c).
    Either way the only weight-sized tensor created is the weight's gradient, which this one
    function writes whole (the target rows' share added in place).
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        norm_embeddings: Tensor,
        weight: Tensor,
        row_index: Tensor | None,
        target_row: Tensor,
        scale: float,
        block_size: int,
        keep_logits: bool,
        matmul_dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor, Tensor]:
        # Every cast below is explicit: autocast would cast differently here (under autocast)
        # and in the recomputation of backward (outside it).
        with torch.autocast(norm_embeddings.device.type, enabled=False):
            target_rows, target_cos, target_pos = target_terms(
                norm_embeddings, weight, row_index, target_row
            )

            mm_embeddings = norm_embeddings.to(matmul_dtype)
            num_rows = norm_embeddings.shape[0]
            num_taking_part = weight.shape[0] if row_index is None else row_index.shape[0]
            row_max = norm_embeddings.new_full((num_rows,), -math.inf)
            row_sumexp = norm_embeddings.new_zeros((num_rows,))
            kept = norm_embeddings.new_empty((num_taking_part, num_rows)) if keep_logits else None
            for start in range(0, num_taking_part, block_size):
                stop = min(start + block_size, num_taking_part)
                rows = block_rows(weight, row_index, start, stop)
                out = None if kept is None else kept[start:stop]
                logits_t = block_logits(rows, mm_embeddings, target_pos, start, scale, out)
                new_max = torch.maximum(row_max, logits_t.amax(dim=0))
                if kept is None:
                    shift = finite_or_zero(new_max)
                    # exp(-inf - finite) = 0 clears the empty sum of the first block.
                    row_sumexp = row_sumexp * torch.exp(row_max - shift)
                    row_sumexp = row_sumexp + logits_t.sub_(shift).exp_().sum(dim=0)
                row_max = new_max
            if kept is not None:
                row_sumexp = kept.sub_(finite_or_zero(row_max)).exp_().sum(dim=0)
        ctx.save_for_backward(
            norm_embeddings, weight, row_index, target_row, target_rows, target_pos, row_max, kept
        )
        ctx.scale, ctx.block_size, ctx.matmul_dtype = scale, block_size, matmul_dtype
        ctx.gradients = LocalClassStats.gradients
        return ClassStatsFunction.outputs(ctx, row_max, row_sumexp, target_cos)

    @staticmethod
    def gradients(
        ctx: torch.autograd.function.FunctionCtx, grad_sumexp: Tensor, grad_target_cos: Tensor
    ) -> tuple[Tensor | None, ...]:
        (norm_embeddings, weight, row_index, target_row, target_rows, target_pos, row_max, kept) = (
            ctx.saved_tensors
        )
        stats_dtype, matmul_dtype = norm_embeddings.dtype, ctx.matmul_dtype
        shift = finite_or_zero(row_max)
        mm_embeddings = norm_embeddings.to(matmul_dtype)
        want_weight = ctx.needs_input_grad[1]
        num_taking_part = weight.shape[0] if row_index is None else row_index.shape[0]
        # d sum-exp_i / d logit_ji = exp(logit_ji - max_i); d logit_ji / d cos_ji = s.
        grad_scale = grad_sumexp * ctx.scale  # (N,)
        # Summed over blocks, so accumulated in the statistics dtype even for half matmuls.
        grad_embeddings = torch.zeros_like(norm_embeddings)
        grad_weight = None
        if want_weight:  # rows that do not take part get a zero gradient
            grad_weight = (
                torch.empty_like(weight) if row_index is None else torch.zeros_like(weight)
            )
        for start in range(0, num_taking_part, ctx.block_size):
            stop = min(start + ctx.block_size, num_taking_part)
            rows = block_rows(weight, row_index, start, stop)  # (c, D)
            if kept is None:
                logits_t = block_logits(rows, mm_embeddings, target_pos, start, ctx.scale)
                grad_cos_t = logits_t.sub_(shift).exp_().mul_(grad_scale)  # (c, N)
            else:  # masked target entries hold exp(-inf) = 0: no gradient through them
                grad_cos_t = kept[start:stop] * grad_scale
            # cos_ji = <rows_j, e_i> / |rows_j|: fold 1/|rows_j| into the gradient first.
            inv_norm = 1.0 / row_norms(rows, stats_dtype).clamp_min(norm_eps(rows.dtype))
            grad_raw_t = grad_cos_t.mul_(inv_norm[:, None]).to(matmul_dtype)  # (c, N)
            grad_embeddings += (grad_raw_t.T @ rows.to(matmul_dtype)).to(stats_dtype)
            if want_weight:
                grad_rows = (grad_raw_t @ mm_embeddings).to(stats_dtype)  # (c, D)
                grad_rows = remove_radial_part(grad_rows, rows, inv_norm)
                if row_index is None:
                    grad_weight[start:stop] = grad_rows
                else:
                    grad_weight.index_copy_(0, row_index[start:stop], grad_rows.to(weight.dtype))

        # The target cosine: cos_i = <e_i, normalize(w_t(i))>, computed in the stats dtype.
        grad_target, grad_rows = target_share(
            grad_target_cos, norm_embeddings, weight, target_row, want_weight
        )
        grad_embeddings += grad_target * target_rows
        if want_weight:
            add_target_rows_(grad_weight, target_row, grad_rows)
        return grad_embeddings, grad_weight, None, None, None, None, None, None


def target_share(
    grad_target_cos: Tensor,
    norm_embeddings: Tensor,
    weight: Tensor,
    target_row: Tensor,
    want_weight: bool,
) -> tuple[Tensor, Tensor | None]:
    """The target cosine's part of the backward: d loss / d cos (N, 1), 0 where another rank
    owns the label, and (when `want_weight`) its gradient with respect to each row's raw
    target row (N, D) in the statistics dtype, else None."""
    owned = target_row >= 0
    grad_target = torch.where(owned, grad_target_cos, 0.0)[:, None]  # (N, 1)
    if not want_weight:
        return grad_target, None
    raw_rows = weight[target_row.clamp(min=0)].to(norm_embeddings.dtype)
    return grad_target, l2_normalize_backward(raw_rows, grad_target * norm_embeddings)


def add_target_rows_(grad_weight: Tensor, target_row: Tensor, grad_rows: Tensor) -> None:
    """grad_weight[target_row[i]] += grad_rows[i] for the owned rows (target_row >= 0).

    Without a boolean mask, whose count a GPU would read on the host: an unowned row adds
    zeros to some row (row i mod C_local, so that they do not all queue on one row's
    atomics), which changes nothing.
    """
    owned = target_row >= 0
    spread = torch.arange(target_row.shape[0], device=target_row.device) % grad_weight.shape[0]
    rows = torch.where(owned[:, None], grad_rows, 0.0).to(grad_weight.dtype)
    grad_weight.index_add_(0, torch.where(owned, target_row, spread), rows)


def norm_eps(dtype: torch.dtype) -> float:
    return max(NORM_EPS, torch.finfo(dtype).tiny)


def row_norms(rows: Tensor, dtype: torch.dtype) -> Tensor:
    """L2 norm (c,) of each row, accumulated in `dtype`."""
    return torch.linalg.vector_norm(rows, dim=1, dtype=dtype)


def remove_radial_part(grad_rows: Tensor, rows: Tensor, inv_norm: Tensor) -> Tensor:
    """The derivative of normalisation, given grad_rows = (d loss / d normalised row) / |row|.

    d loss / d row = (g - y <y, g>) / |row| with y = row / |row|; `grad_rows` already holds
    g / |row|, so this subtracts row <row, grad_rows> / |row|^2 in place. A row shorter than
    the eps (F.normalize divides it by the eps instead of its norm) keeps grad_rows as is.
    """
    norms_known = inv_norm < 1.0 / norm_eps(rows.dtype)
    rows = rows.to(grad_rows.dtype)
    # Row-wise dot products and the update without a (c, D) temporary.
    dots = torch.bmm(rows[:, None, :], grad_rows[:, :, None]).view(-1)  # (c,)
    coefficient = torch.where(norms_known, dots * inv_norm**2, 0.0)
    return grad_rows.addcmul_(rows, coefficient[:, None], value=-1.0)


def target_terms(
    norm_embeddings: Tensor, weight: Tensor, row_index: Tensor | None, target_row: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """What both paths compute of the target class first: its normalised rows (N, D) and
    cosine (N,) in the embeddings' (statistics) dtype, 0 where another rank owns the label,
    and its position among the taking-part classes (N,), -1 there."""
    owned = target_row >= 0
    target_rows = l2_normalize(weight[target_row.clamp(min=0)].to(norm_embeddings.dtype))
    target_cos = torch.where(owned, (norm_embeddings * target_rows).sum(dim=1), 0.0)
    return target_rows, target_cos, target_positions(row_index, target_row, owned)


def target_positions(row_index: Tensor | None, target_row: Tensor, owned: Tensor) -> Tensor:
    """Each row's target as a position among the taking-part classes (N,), -1 if not owned."""
    if row_index is None:
        return target_row
    # Positives always take part, so an owned target is found in the sorted row_index.
    return torch.where(owned, torch.searchsorted(row_index, target_row.clamp(min=0)), -1)


def block_rows(weight: Tensor, row_index: Tensor | None, start: int, stop: int) -> Tensor:
    """The raw class rows of taking-part positions [start, stop): a view, or a gathered copy."""
    if row_index is None:
        return weight[start:stop]
    return weight.index_select(0, row_index[start:stop])


def block_logits(
    rows: Tensor,
    mm_embeddings: Tensor,
    target_pos: Tensor,
    start: int,
    scale: float,
    out: Tensor | None = None,
) -> Tensor:
    """s * cos (c, N) of class rows `rows` (c, D) against every embedding, targets set to -inf.

    The matmul runs in mm_embeddings' dtype on the raw rows; the result, in the dtype of the
    statistics (of `out` when given, which receives it), is scaled row by row by s / |row|.
    """
    stats_dtype = (
        out.dtype if out is not None else torch.promote_types(mm_embeddings.dtype, torch.float32)
    )
    mm_rows = rows.to(mm_embeddings.dtype)
    if out is not None and mm_rows.dtype == out.dtype:
        logits_t = torch.mm(mm_rows, mm_embeddings.T, out=out)
    elif out is not None:
        logits_t = out.copy_(mm_rows @ mm_embeddings.T)
    else:
        logits_t = (mm_rows @ mm_embeddings.T).to(stats_dtype)
    norms = row_norms(rows, logits_t.dtype).clamp_min(norm_eps(rows.dtype))
    logits_t.mul_((scale / norms)[:, None])
    mask_targets_(logits_t, target_pos, start)
    return logits_t


def mask_targets_(logits_t: Tensor, target_pos: Tensor, start: int) -> None:
    """Set each row's target entry of the block (c, N) to -inf in place, if it lies in the block.

    Works on N entries (gather, where, scatter) rather than a (c, N) mask, and never asks the
    host which rows match, so there is no device synchronisation per block.
    """
    offset = target_pos - start  # (N,)
    inside = (offset >= 0) & (offset < logits_t.shape[0])
    index = offset.clamp(0, logits_t.shape[0] - 1)[None, :]  # (1, N)
    current = logits_t.gather(0, index)
    logits_t.scatter_(0, index, torch.where(inside[None, :], -math.inf, current))


def finite_or_zero(row_max: Tensor) -> Tensor:
    # A row whose every entry so far is masked has max -inf; -inf - -inf would be NaN.
    return torch.where(torch.isfinite(row_max), row_max, 0.0)
