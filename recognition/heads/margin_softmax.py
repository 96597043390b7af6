"""The margin-softmax classification head over a class matrix sharded across ranks.

One training step on each of the W ranks of the head's process group:

    local embeddings (B, D)   --all-gather (autograd)-->   embeddings (N = B*W, D), labels (N,)
    normalise the embeddings (float32)
    target cosine, then s*psi(cos), only for the rows whose label lies in this rank's shard
    (AdaFace: psi of each row's cosine and embedding norm, see margins.py)
    cosine logits s*cos (C_local, N) of the other classes, a block of classes at a time: the
    raw class rows times the embeddings, each row scaled by s/|row| (no normalised copy)
    local row statistics: max and sum of exp(logit - max) over all of them, float32
    global statistics: all-reduce MAX of the max, SUM of the rescaled sum-exp, SUM of target
    loss_i = log(sum-exp_i) + max_i - target_i, averaged over the N rows of the global batch

The loss is the same scalar on every rank. No rank ever holds logits for classes it does not
own, and what crosses the network per step is O(N x D) (the embeddings, their gradient and
three length-N statistics), never O(N x C).

Gradient convention (what the backbone receives). The loss L is the mean over the global
batch. Backward leaves each rank's class-row gradient local (it is exactly dL/dW_r), sums
the partial gradients that every rank computed for the gathered embeddings and hands each
rank the rows it produced (a reduce-scatter) - that sum is dL/d(local embeddings) - and then
MULTIPLIES it by W. The backbone is replicated under DistributedDataParallel, which averages
its gradients over the W ranks: (1/W) * sum_r J_r^T (W dL/de_r) = sum_r J_r^T dL/de_r, the
gradient of the single-process model on the whole global batch. So: use DDP (or any average
of the backbone gradients over ranks), do not rescale the loss, and expect the gradient that
reaches `local_embeddings` on its own to be W times dL/d(local_embeddings). With W = 1 the
factor is 1 and nothing changes. (insightface's partial FC uses the same convention.)

Memory and speed. One custom autograd function computes the statistics and their gradient
in blocks of classes. `chunk_size=None` keeps exp(logit - max) of the whole shard,
(C_local, N), for backward, which then costs two matmuls and no recomputation: memory
O(N x C_local), the fastest (blocks of BLOCK_SIZE classes bound the temporaries). With a
`chunk_size`, the forward is an online softmax over chunks of that many classes (a running
max, a running sum-exp rescaled whenever the max grows) and backward recomputes each chunk's
logits: one matmul more, and beyond the weight and its gradient, peak memory O(N x
chunk_size + N x D + chunk_size x D), never O(N x C_local). In both, class rows are
normalised block by block and the only weight-sized tensor the head creates is the weight's
gradient. None is not replaced by a chunk size chosen automatically: set one when the
logits of a shard would not fit (a few thousand classes per chunk costs little speed).

Partial FC (`sample_rate` < 1; heads/partial_fc.py): in training, each rank keeps the
classes of its shard that appear in the global batch plus a random sample of its other
classes, and the softmax runs over the kept classes of every rank; evaluation (`.eval()` or
no grad) uses every class. Kernels (`kernel`; heads/tuning/kernel.py): "torch" is
local_stats.py, "triton" the Triton kernels of heads/kernels/ (through triton_stats.py),
"auto" the faster of the two, measured on a GPU. Input checks (heads/input_checks.py) read
nothing on the host without partial FC: bad labels are asserted on the device.

Precision. Inputs and the weight may be half precision, and so may the logits matmul (under
autocast, the autocast dtype; otherwise the wider of the two input dtypes); embeddings are
gathered and normalised in float32, and the target cosine, margin, softmax statistics, their
collectives and the loss are float32, or float64 when the embeddings or the weight are.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from recognition import distributed
from recognition.heads.input_checks import InputChecks, check_arguments
from recognition.heads.kept_rows import KeptRows
from recognition.heads.local_stats import l2_normalize
from recognition.heads.margins import Margin
from recognition.heads.optimizer_handover import OptimizerHandOver
from recognition.heads.partial_fc import MAX_CLASSES, RowSampler
from recognition.heads.smoothing import smoothed_loss, smoothing_terms
from recognition.heads.triton_stats import FusedSGD
from recognition.heads.tuning.kernel import KernelSelector, ShardShape, StatsInputs
from recognition.heads.tuning.measure import TuningCache
from recognition.sharded import mark_like, set_row_placement

logger = logging.getLogger(__name__)

# Standard deviation of the class rows at initialisation (insightface's partial FC).
WEIGHT_INIT_STD = 0.01
# Rows of the class matrix per initialisation block: every block is drawn from its own seeded
# generator, so the matrix does not depend on how it is split over ranks.
INIT_BLOCK_ROWS = 1 << 16


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


@torch.no_grad()
def init_rows(weight: Tensor, class_start: int, num_classes: int, seed: int) -> None:
    """Draw the rows [class_start, class_start + len(weight)) of a (num_classes, D) class
    matrix into `weight`, so that the whole matrix does not depend on the split.

    The matrix is drawn in blocks of INIT_BLOCK_ROWS rows, N(0, WEIGHT_INIT_STD), each block
    from a generator seeded by (seed, block) on the weight's device type: a rank draws only
    the blocks its shard overlaps. A run on 8 ranks, on 1, or resumed on 4 starts from the
    same matrix (per device type: CPU and CUDA generators differ).
    """
    first, stop = class_start, class_start + weight.shape[0]
    device = weight.device
    for block_start in range(first - first % INIT_BLOCK_ROWS, stop, INIT_BLOCK_ROWS):
        block_rows = min(INIT_BLOCK_ROWS, num_classes - block_start)
        generator = torch.Generator(device=device)
        generator.manual_seed((seed * 1_000_003 + block_start // INIT_BLOCK_ROWS) % 2**63)
        block = torch.randn(block_rows, weight.shape[1], generator=generator, device=device)
        lo, hi = max(first, block_start), min(stop, block_start + block_rows)
        weight[lo - first : hi - first] = (
            block[lo - block_start : hi - block_start] * WEIGHT_INIT_STD
        )


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `factor` (see the convention)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, tensor: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None


class _SumOverRanks(torch.autograd.Function):
    """All-reduce SUM whose backward is the identity.

    Every rank goes on to compute the same loss from the same sum, so the loss is ONE function
    of every rank's addend: d loss / d addend_r = d loss / d sum, which each rank already
    holds. (Summing the gradient over ranks too would count the one loss W times.)
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, tensor: Tensor, group: ProcessGroup | None
    ) -> Tensor:
        summed = tensor.clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
        return summed

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def fold_target(
    nontarget_max: Tensor, nontarget_sumexp: Tensor, target_logit: Tensor, owned: Tensor
) -> tuple[Tensor, Tensor]:
    """This rank's max and sum-exp (N,) over its classes, the target column folded back in
    where it owns the label: max over both, sum-exp rescaled to that max. The max is a
    constant for autograd: log(sum exp(z - c)) + c does not depend on c."""
    local_max = torch.maximum(nontarget_max, torch.where(owned, target_logit.detach(), -math.inf))
    local_sumexp = nontarget_sumexp * torch.exp(nontarget_max - local_max)
    # exp of -inf (not of the masked value) on unowned rows: no inf * 0 in backward.
    return local_max, local_sumexp + torch.exp(
        torch.where(owned, target_logit - local_max, -math.inf)
    )


def global_loss(
    local_max: Tensor,
    local_sumexp: Tensor,
    target_logit: Tensor,
    group: ProcessGroup | None,
    smoothing: tuple[Tensor, float, int] | None = None,
) -> tuple[Tensor, Tensor]:
    """Each row's loss (N,) and whether its target logit is the row's largest, from the
    ranks' statistics: all-reduce MAX of the max, then SUM of the sum-exp rescaled to the
    global max and of the target logit (zero on ranks that do not own the label).

    `smoothing`: label smoothing's (local sum of logits (N,), eps, number of classes); the
    sums are all-reduced with the others and the loss is smoothing.py's."""
    if distributed.world_size(group) > 1:
        global_max = local_max.detach().clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        rescaled_sumexp = local_sumexp * torch.exp(local_max - global_max)
        addends = [rescaled_sumexp, target_logit]
        if smoothing is not None:
            addends.append(smoothing[0])
        summed = _SumOverRanks.apply(torch.stack(addends), group).unbind(0)
        global_sumexp, global_target = summed[:2]
        global_logit_sum = summed[2] if smoothing is not None else None
    else:
        global_max, global_sumexp, global_target = local_max, local_sumexp, target_logit
        global_logit_sum = smoothing[0] if smoothing is not None else None
    correct = global_target >= global_max
    if smoothing is not None:
        _, eps, num_classes = smoothing
        log_sumexp = torch.log(global_sumexp) + global_max
        return smoothed_loss(log_sumexp, global_target, global_logit_sum, eps, num_classes), correct
    # log softmax of the target: -(target - log sum exp(logits)).
    return torch.log(global_sumexp) + global_max - global_target, correct


class ShardedMarginSoftmax(OptimizerHandOver, nn.Module):
    """Cross-entropy over cosine logits with a margin on the target class, classes sharded.

    Splits `num_classes` over the ranks of `group` (the default group when None; a world of
    one when no process group exists) as `shard_range` does, and holds this rank's rows of
    the class matrix, `weight` (num_local, embedding_size), for classes [class_start,
    class_start + num_local), drawn by `init_rows`; they and their optimizer state exist on
    the owning rank only. Embeddings and rows are L2-normalised inside: logits are s*cos.

    `margin` supplies psi and s (margins.py), element-wise on the target cosines, or
    (`margin.uses_norms`, AdaFace) on each cosine and the norm of its raw embedding over the
    gathered global batch. `chunk_size`: the torch path's logits that many classes at a
    time, recomputed in backward (memory O(global batch x chunk_size)); None, the whole
    shard. `sample_rate` < 1: partial FC, sampled by `seed` (partial_fc.py). `kernel`:
    "torch", "triton" or "auto" (tuning/kernel.py), `tuning_cache` the folder of measured
    choices (None: `$XDG_CACHE_HOME/recognition`). `label_smoothing`: F.cross_entropy's eps
    over the margin-modified logits of all classes (smoothing.py; not with partial FC).

    Every rank must call forward with the same local batch size; the loss is the mean over
    the global batch, identical on every rank (the gradient convention under DDP is in the
    module docstring). After each forward, `last_accuracy` is a detached 0-dim tensor, the
    share of rows whose margin-adjusted target logit is the row's largest (insightface's
    training accuracy); `sampled_index` the local rows (sorted int64) the softmax used, or
    None for all of them.
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
        seed: int = 0,
        device: torch.device | str | None = None,
        kernel: str = "auto",
        tuning_cache: str | Path | None = None,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        # head.kernel: which path computes the local statistics (measured for "auto"), and
        # where measured choices (and the kernels' tiles) are cached; logged as the head's.
        self.tuning_cache = TuningCache(tuning_cache)
        self._kernels = KernelSelector(kernel, self.tuning_cache, logger)
        num_ranks = distributed.world_size(group)
        shape = (num_classes, embedding_size, sample_rate, chunk_size, num_ranks, MAX_CLASSES)
        check_arguments(*shape, label_smoothing)
        self.label_smoothing = float(label_smoothing)
        self.num_classes = num_classes
        self.embedding_size = embedding_size
        # A margin with state (AdaFace's running statistics) keeps it beside the weight.
        self.margin = margin if device is None else margin.to(device)
        self.sample_rate = sample_rate
        self.chunk_size = chunk_size
        self.group = group
        self.seed = seed
        self.kernel = kernel
        self.world_size = num_ranks
        self.rank = distributed.rank(group)
        self.class_start, self.num_local = shard_range(num_classes, num_ranks, self.rank)
        # Partial FC keeps this many classes per rank, or more when the batch has more positives.
        self.num_sample = min(self.num_local, max(1, round(sample_rate * self.num_local)))
        self._sampler = RowSampler(self.class_start, self.num_local, self.num_sample, seed)
        self._checks = InputChecks(num_classes, embedding_size, num_ranks, self.rank, group)
        self.weight = nn.Parameter(torch.empty(self.num_local, embedding_size, device=device))
        # A checkpoint stores this rank's rows as rows of one (num_classes, D) matrix.
        set_row_placement(self.weight, self.class_start, num_classes)
        self.reset_parameters()
        self.last_accuracy: Tensor | None = None
        self.sampled_index: Tensor | None = None
        self._optimizer_param: list[Tensor] = [self.weight]  # see OptimizerHandOver
        self._fused: FusedSGD | None = None
        self._kept_rows = KeptRows()  # between fused updates, outside checkpoints

    # ---------------------------------------------------------------- the shard

    def reset_parameters(self) -> None:
        """Draw this rank's class rows (`init_rows`: the same matrix however it is split)."""
        init_rows(self.weight, self.class_start, self.num_classes, self.seed)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not keep_vars:  # the weight as rows [class_start, ...) of the whole class matrix
            destination[prefix + "weight"] = mark_like(self.weight, self.weight)

    def get_extra_state(self) -> dict[str, int]:
        """What a checkpoint keeps besides the rows: the partial FC sampling counter."""
        return {"sampling_step": self.sampling_step}

    def set_extra_state(self, state: dict[str, int]) -> None:
        self.sampling_step = int(state["sampling_step"])

    @property
    def sampling_step(self) -> int:
        """Sampled forwards so far (partial FC draws each step's sample from it)."""
        return self._sampler.sampling_step

    @sampling_step.setter
    def sampling_step(self, value: int) -> None:
        self._sampler.sampling_step = value

    def extra_repr(self) -> str:
        names = ("num_classes", "embedding_size", "class_start", "num_local", "world_size",
                 "chunk_size", "sample_rate", "kernel", "label_smoothing")  # fmt: skip
        return ", ".join(f"{name}={getattr(self, name)}" for name in names)

    def _shard(self) -> ShardShape:
        return ShardShape(
            self.weight, self.num_local, self.embedding_size, self.chunk_size,
            self.world_size, self.group, self._kept_rows,
        )  # fmt: skip

    # ---------------------------------------------------------------- the loss

    def forward(self, local_embeddings: Tensor, local_labels: Tensor) -> Tensor:
        """Mean margin cross-entropy of the global batch (every rank's batch, gathered).

        Takes this rank's embeddings (B, embedding_size), any float dtype, unnormalised, and
        integer labels (B,) in [0, num_classes); every rank of the group must pass the same B.
        Returns a 0-dim float32 loss (float64 when the inputs are float64), the same on every
        rank. Sets `last_accuracy` and `sampled_index`. Bad input on any rank raises
        ValueError on every rank (so that none is left waiting in a collective).
        """
        self._checks.check(local_embeddings, local_labels)
        local_labels = local_labels.to(device=local_embeddings.device, dtype=torch.int64)
        input_dtype = torch.promote_types(local_embeddings.dtype, self.weight.dtype)
        compute_dtype = torch.promote_types(input_dtype, torch.float32)
        device_type = local_embeddings.device.type
        if torch.is_autocast_enabled(device_type):
            matmul_dtype = torch.get_autocast_dtype(device_type)
        else:
            matmul_dtype = input_dtype

        # ---- gather: (B, D) -> (N, D), N = B * W, with autograd; labels without.
        # Gathered in float32 (the embeddings are small), so the reduce-scatter of their
        # gradient sums W terms in float32 too. The gradient is scaled by W on its way back:
        # DDP's average over W ranks then gives the backbone the global-batch gradient.
        local_embeddings = local_embeddings.to(compute_dtype)
        if self.world_size > 1:
            local_embeddings = _ScaleGradient.apply(local_embeddings, float(self.world_size))
        embeddings = distributed.all_gather_autograd(local_embeddings, self.group)  # (N, D)
        labels = distributed.all_gather_tensor(local_labels, self.group)  # (N,)
        norm_embeddings = l2_normalize(embeddings)  # (N, D), compute dtype

        # ---- which rows' labels this rank owns, and (partial FC) which classes take part.
        local_target = labels - self.class_start
        owned = (local_target >= 0) & (local_target < self.num_local)  # (N,)
        target_row = torch.where(owned, local_target, -1)  # row of self.weight, or -1
        row_index = None
        if self._samples_classes():
            row_index = self._sampler.sample(target_row, owned, self.weight.grad is None)
        self.sampled_index = row_index

        # ---- local statistics over this rank's (taking-part) classes, then the margin.
        scale = self.margin.scale
        training = torch.is_grad_enabled() and self.training
        inputs = StatsInputs(norm_embeddings, row_index, target_row, scale, matmul_dtype)
        nontarget_max, nontarget_sumexp, target_cos = self._kernels.local_stats(
            self._shard(), inputs, compute_dtype, self._fused if training else None
        )
        if self.margin.uses_norms:
            # AdaFace: each row's margin follows its raw embedding's norm, taken over the
            # gathered global batch (so its statistics are the same on every rank), detached.
            norms = torch.linalg.vector_norm(embeddings.detach(), dim=1)  # (N,), compute dtype
            margin_logit = self.margin(target_cos, norms)
        else:
            margin_logit = self.margin(target_cos)
        target_logit = torch.where(owned, scale * margin_logit, 0.0)
        local_max, local_sumexp = fold_target(nontarget_max, nontarget_sumexp, target_logit, owned)
        smoothing = smoothing_terms(  # label smoothing's sum of every logit; None without
            self.label_smoothing, self.num_classes, norm_embeddings, self.weight, target_cos,
            target_logit, owned, scale)  # fmt: skip

        # ---- global statistics over every rank's classes: the loss, the same on every rank.
        loss, correct = global_loss(local_max, local_sumexp, target_logit, self.group, smoothing)
        self.last_accuracy = correct.to(compute_dtype).mean().detach()
        return loss.mean()

    # ---------------------------------------------------------------- partial FC

    def _samples_classes(self) -> bool:
        """True when a forward now uses partial FC: sample_rate < 1, training, grad enabled."""
        return self.num_sample < self.num_local and self.training and torch.is_grad_enabled()

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Forwards inside belong to one optimizer step, however their backwards interleave.

        Partial FC updates the rows sampled by every forward since the optimizer's last step.
        Outside this context a forward finding the rows' gradient dropped (zero_grad) starts
        a new step; a pipeline schedule runs several forwards before any backward (GPipe),
        so it runs them inside this context, which starts the step on entry.
        """
        with self._sampler.accumulating():
            yield
