"""The margin-softmax classification head, laid out for a class matrix sharded over ranks.

One forward step, in the order the sharded version will run it:

    local embeddings (B, D)   --all-gather-->   embeddings (N = B*W, D), labels (N,)
    normalise embeddings and this rank's class rows W_r (C_local, D)
    target logit s*psi(cos) only for the rows whose label lies in this rank's shard
    cosine logits s*cos (N, C_local), whole or chunk by chunk, the target column replaced
    local row statistics: max and sum of exp(logit - max), in float32
    global statistics: all-reduce MAX of the max, SUM of the rescaled sum-exp, SUM of target
    loss_i = log(sum-exp_i) + max_i - target_i, averaged over the N rows

This file is the single-process step: the world size must be 1 and the "all-reduce" lines
are identities, marked where the collectives go. The class split (`shard_range`), the
ownership test and the statistics are already the sharded ones.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

from recognition import distributed
from recognition.heads.margins import Margin

# F.normalize's default eps; raised to the dtype's smallest normal number in float16, where
# 1e-12 rounds to zero and a zero row would divide 0 by 0.
NORM_EPS = 1e-12

INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)

# Standard deviation of the class rows at initialisation (insightface's partial FC).
WEIGHT_INIT_STD = 0.01


def shard_range(num_classes: int, world_size: int, rank: int) -> tuple[int, int]:
    """The classes rank `rank` of `world_size` owns: returns (first class, number of classes).

    Classes are split into contiguous blocks in rank order; the first num_classes % world_size
    ranks take one class more than the others, so shard sizes differ by at most one. A rank
    past num_classes gets an empty block (count 0) starting at num_classes.
    """
    if num_classes < 0:
        raise ValueError(f"num_classes: must be >= 0, got {num_classes}")
    if world_size < 1:
        raise ValueError(f"world_size: must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: must lie in [0, {world_size}), got {rank}")
    base, remainder = divmod(num_classes, world_size)
    count = base + (1 if rank < remainder else 0)
    start = rank * base + min(rank, remainder)
    return start, count


def _l2_normalize(rows: Tensor) -> Tensor:
    """Rows scaled to unit L2 norm; an all-zero row stays zero (no NaN)."""
    eps = max(NORM_EPS, torch.finfo(rows.dtype).tiny)
    return F.normalize(rows, p=2.0, dim=1, eps=eps)


def _chunk_logits(
    norm_embeddings: Tensor,
    norm_weight: Tensor,
    target_logit: Tensor,
    target_index: Tensor,
    scale: float,
    start: int,
    stop: int,
) -> tuple[Tensor, Tensor]:
    """Logits of local classes [start, stop) with each row's target column replaced.

    Returns the logits (N, stop - start) in target_logit's dtype (float32 or float64) and the
    mask (N, stop - start) of the replaced target entries.
    """
    cos = norm_embeddings @ norm_weight[start:stop].T  # (N, c), in the matmul dtype
    logits = cos.to(target_logit.dtype) * scale
    columns = torch.arange(start, stop, device=logits.device)
    # target_index is -1 on rows whose label another rank owns: such rows match no column.
    is_target = columns[None, :] == target_index[:, None]  # (N, c)
    return torch.where(is_target, target_logit[:, None], logits), is_target


def _softmax_stats(
    norm_embeddings: Tensor,
    norm_weight: Tensor,
    target_logit: Tensor,
    target_index: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Row max and sum of exp(logit - max) over all local classes at once (plain autograd).

    Takes embeddings (N, D) and class rows (C_local, D) in the matmul dtype, the target logits
    (N,) and target columns (N,) (-1 where not owned). Returns (max, sum-exp), both (N,) in
    target_logit's dtype; only sum-exp carries a gradient. Memory O(N x C_local).
    """
    logits, _ = _chunk_logits(
        norm_embeddings, norm_weight, target_logit, target_index, scale, 0, norm_weight.shape[0]
    )
    # The max only keeps exp() in range: log(sum exp(z - c)) + c is the same for any constant
    # c, so holding it constant (detached) leaves the loss and its gradient exact.
    row_max = logits.detach().amax(dim=1)
    row_sumexp = torch.exp(logits - row_max[:, None]).sum(dim=1)
    return row_max, row_sumexp


class _ChunkedSoftmaxStats(torch.autograd.Function):
    """`_softmax_stats` computed `chunk_size` classes at a time, in memory O(N x chunk_size).

    Forward keeps a running max and rescales the running sum-exp whenever the max grows
    (the online softmax). Backward recomputes each chunk's logits instead of storing them:
    d sum-exp_i / d z_ij = exp(z_ij - max_i), routed to the target logit for the target
    column and to the cosine (times s) for every other one.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        norm_embeddings: Tensor,
        norm_weight: Tensor,
        target_logit: Tensor,
        target_index: Tensor,
        scale: float,
        chunk_size: int,
    ) -> tuple[Tensor, Tensor]:
        num_rows, num_local = norm_embeddings.shape[0], norm_weight.shape[0]
        row_max = target_logit.new_full((num_rows,), -math.inf)
        row_sumexp = target_logit.new_zeros((num_rows,))
        for start in range(0, num_local, chunk_size):
            stop = min(start + chunk_size, num_local)
            logits, _ = _chunk_logits(
                norm_embeddings, norm_weight, target_logit, target_index, scale, start, stop
            )
            new_max = torch.maximum(row_max, logits.amax(dim=1))
            # exp(-inf - finite) = 0 clears the empty sum of the first chunk.
            row_sumexp = row_sumexp * torch.exp(row_max - new_max)
            row_sumexp = row_sumexp + torch.exp(logits - new_max[:, None]).sum(dim=1)
            row_max = new_max
        ctx.save_for_backward(norm_embeddings, norm_weight, target_logit, target_index, row_max)
        ctx.scale = scale
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(row_max)
        return row_max, row_sumexp

    @staticmethod
    @once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_max: Tensor, grad_sumexp: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, None, None, None]:
        del grad_max  # the max is a constant shift (see _softmax_stats)
        norm_embeddings, norm_weight, target_logit, target_index, row_max = ctx.saved_tensors
        num_local = norm_weight.shape[0]
        # Summed over chunks, so accumulated in float32 even when the matmuls run in half.
        grad_embeddings = torch.zeros_like(norm_embeddings, dtype=target_logit.dtype)
        grad_weight = torch.empty_like(norm_weight)
        grad_target = torch.zeros_like(target_logit)
        for start in range(0, num_local, ctx.chunk_size):
            stop = min(start + ctx.chunk_size, num_local)
            logits, is_target = _chunk_logits(
                norm_embeddings, norm_weight, target_logit, target_index, ctx.scale, start, stop
            )
            grad_logits = torch.exp(logits - row_max[:, None]) * grad_sumexp[:, None]  # (N, c)
            grad_target += torch.where(is_target, grad_logits, 0.0).sum(dim=1)
            grad_cos = (torch.where(is_target, 0.0, grad_logits) * ctx.scale).to(norm_weight.dtype)
            grad_embeddings += grad_cos @ norm_weight[start:stop]
            grad_weight[start:stop] = grad_cos.T @ norm_embeddings
        return grad_embeddings.to(norm_embeddings.dtype), grad_weight, grad_target, None, None, None


class ShardedMarginSoftmax(nn.Module):
    """Cross-entropy over cosine logits with a margin on the target class: the training head.

    Holds this rank's block of class rows, `weight` (num_local, embedding_size), for classes
    [class_start, class_start + num_local) of `num_classes` (see `shard_range`), initialised
    N(0, 0.01). Embeddings and class rows are L2-normalised inside, so logits are s * cos.

    `margin` supplies psi and s (see margins.py). `chunk_size` computes the logits that many
    classes at a time and recomputes them in backward (memory O(batch x chunk_size) instead
    of O(batch x num_local)); None computes the whole shard at once. `sample_rate` < 1 (partial
    FC class sampling) and a process group of more than one rank are not implemented yet and
    raise NotImplementedError.

    Precision: the inputs and the weight may be half precision, and so may the logits matmul
    (under autocast, the autocast dtype; otherwise the wider of the two input dtypes); the
    target cosine, margin, softmax statistics and loss are float32, or float64 when the
    embeddings or the weight are float64.

    After each forward, `last_accuracy` holds a detached 0-dim tensor: the share of rows whose
    margin-adjusted target logit is the largest logit of the row (insightface's training
    accuracy), for logging. It is None before the first forward.
    """

    def __init__(
        self,
        num_classes: int,
        embedding_size: int,
        margin: Margin,
        *,
        sample_rate: float = 1.0,
        chunk_size: int | None = None,
        group: ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"num_classes: must be >= 1, got {num_classes}")
        if embedding_size < 1:
            raise ValueError(f"model.embedding_size: must be >= 1, got {embedding_size}")
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"head.sample_rate: {sample_rate} is outside (0, 1]")
        if sample_rate != 1.0:
            raise NotImplementedError(
                f"head.sample_rate={sample_rate}: partial FC class sampling is not implemented "
                "yet; use head.sample_rate=1.0"
            )
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"head.chunk_size: must be at least 1 (or None), got {chunk_size}")
        num_ranks = distributed.world_size(group)
        if num_ranks > 1:
            raise NotImplementedError(
                f"ShardedMarginSoftmax: world size {num_ranks}; the sharded (multi-process) head "
                "is not implemented yet, run on one process"
            )
        if num_classes < num_ranks:
            raise ValueError(
                f"num_classes: {num_classes} classes cannot be split over {num_ranks} ranks"
            )
        self.num_classes = num_classes
        self.embedding_size = embedding_size
        self.margin = margin
        self.sample_rate = sample_rate
        self.chunk_size = chunk_size
        self.group = group
        self.class_start, self.num_local = shard_range(
            num_classes, num_ranks, distributed.rank(group)
        )
        self.weight = nn.Parameter(torch.empty(self.num_local, embedding_size))
        nn.init.normal_(self.weight, mean=0.0, std=WEIGHT_INIT_STD)
        self.last_accuracy: Tensor | None = None

    def extra_repr(self) -> str:
        return (
            f"num_classes={self.num_classes}, embedding_size={self.embedding_size}, "
            f"class_start={self.class_start}, num_local={self.num_local}, "
            f"chunk_size={self.chunk_size}"
        )

    def forward(self, local_embeddings: Tensor, local_labels: Tensor) -> Tensor:
        """Mean margin cross-entropy of this rank's batch (after gathering: of the global one).

        Takes embeddings (B, embedding_size), any float dtype, unnormalised, and integer
        labels (B,) in [0, num_classes). Returns a 0-dim float32 loss (float64 when the inputs
        are float64). Sets `last_accuracy`.
        """
        self._check_inputs(local_embeddings, local_labels)
        local_labels = local_labels.to(local_embeddings.device)

        # ---- gather: (B, D) -> (N, D), N = B * W. W = 1 here; the sharded head all-gathers
        # embeddings (with autograd) and labels over the group.
        embeddings, labels = local_embeddings, local_labels

        input_dtype = torch.promote_types(embeddings.dtype, self.weight.dtype)
        compute_dtype = torch.promote_types(input_dtype, torch.float32)
        device_type = embeddings.device.type
        if torch.is_autocast_enabled(device_type):
            matmul_dtype = torch.get_autocast_dtype(device_type)
        else:
            matmul_dtype = input_dtype

        # The embeddings are small (N x D): normalise them in float32 for accuracy. The class
        # rows are as large as the weight itself: normalise them in the weight's own dtype.
        norm_embeddings = _l2_normalize(embeddings.to(compute_dtype))  # (N, D)
        norm_weight = _l2_normalize(self.weight)  # (C_local, D)

        # ---- target logit, only on the rows whose label this rank owns.
        local_target = labels - self.class_start
        owned = (local_target >= 0) & (local_target < self.num_local)  # (N,)
        target_index = torch.where(owned, local_target, -1)
        target_rows = norm_weight[torch.where(owned, local_target, 0)].to(compute_dtype)
        target_cos = (norm_embeddings * target_rows).sum(dim=1)  # (N,)
        target_logit = self.margin.scale * self.margin(target_cos).to(compute_dtype)
        target_logit = torch.where(owned, target_logit, 0.0)

        # ---- local statistics over this rank's classes, float32.
        mm_embeddings = norm_embeddings.to(matmul_dtype)
        mm_weight = norm_weight.to(matmul_dtype)
        if self.chunk_size is None:
            local_max, local_sumexp = _softmax_stats(
                mm_embeddings, mm_weight, target_logit, target_index, self.margin.scale
            )
        else:
            local_max, local_sumexp = _ChunkedSoftmaxStats.apply(
                mm_embeddings, mm_weight, target_logit, target_index,
                self.margin.scale, self.chunk_size,
            )  # fmt: skip

        # ---- global statistics. W = 1 here; the sharded head all-reduces MAX of local_max,
        # then SUM of local_sumexp * exp(local_max - global_max), and SUM of target_logit
        # (zero on the ranks that do not own the label).
        global_max = local_max
        global_sumexp = local_sumexp * torch.exp(local_max - global_max)
        global_target = target_logit

        # log softmax of the target: -(target - log sum exp(logits)).
        loss = torch.log(global_sumexp) + global_max - global_target  # (N,)
        self.last_accuracy = (global_target >= global_max).to(compute_dtype).mean().detach()
        return loss.mean()

    def _check_inputs(self, local_embeddings: Tensor, local_labels: Tensor) -> None:
        if local_embeddings.ndim != 2 or local_embeddings.shape[1] != self.embedding_size:
            raise ValueError(
                f"local_embeddings: expected shape (batch, {self.embedding_size}), "
                f"got {tuple(local_embeddings.shape)}"
            )
        if not local_embeddings.is_floating_point():
            raise ValueError(f"local_embeddings: expected floats, got {local_embeddings.dtype}")
        if local_embeddings.shape[0] == 0:
            raise ValueError("local_embeddings: the batch is empty")
        if local_labels.shape != local_embeddings.shape[:1]:
            raise ValueError(
                f"local_labels: expected shape ({local_embeddings.shape[0]},) to match the "
                f"embeddings, got {tuple(local_labels.shape)}"
            )
        if local_labels.dtype not in INTEGER_DTYPES:
            raise ValueError(f"local_labels: expected integer labels, got {local_labels.dtype}")
        # One host sync per step; a silent out-of-range label would train the wrong class.
        out_of_range = (local_labels < 0) | (local_labels >= self.num_classes)
        if bool(out_of_range.any()):
            bad = int(local_labels[out_of_range][0])
            raise ValueError(
                f"local_labels: label {bad} is outside [0, {self.num_classes}) "
                f"(head has num_classes={self.num_classes})"
            )
