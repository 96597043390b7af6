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

Partial FC (`sample_rate` < 1). In training, each rank keeps the classes of its shard that
appear in the global batch (the positives) plus a random sample of its other classes, in
all max(num_positive, num_sample) classes with num_sample = round(sample_rate * C_local)
(at least 1), as insightface's partial FC does; the softmax runs over the kept classes of
every rank. The sample is a pure function of (seed, sampling_step, global class id) - a
31-bit integer hash ranks the classes, positives first - so it is reproducible, the same on
CPU and GPU, and means the same on every rank; `sampling_step` counts sampled forwards.
Unsampled rows get a zero gradient, and `attach_optimizer` makes the optimizer leave them
alone altogether: no momentum, no weight decay, no update of their optimizer state (see its
docstring). Evaluation (`.eval()` or no grad) uses every class. Partial FC synchronises with
the host every step, where the rest of the training step does not: the positives
(`torch.unique`), the number of classes kept (a top-k of a data-dependent size) and the rows
the optimizer steps (`nonzero`) have sizes only the data decide.

Host synchronisation. Without partial FC a training forward reads no tensor value on the
host: the labels' range is asserted on the device (`torch._assert_async`; on the CPU it
raises at once and names the label; on a GPU a bad label stops the process at its next
synchronisation with a device-side assertion, whose message names num_classes where the
torch build passes messages to the kernel), and with several ranks the ranks' input
statuses are all-gathered and asserted the same way.

Kernels (`kernel`). "torch" is the code in this module. "triton" runs the local statistics
and their gradient in the Triton kernels of heads/kernels/ (class tiles, online softmax; the
backward writes the logits' gradient a chunk of classes at a time, at most 128 MiB, for
cuBLAS's products; `chunk_size` is not used), on CUDA tensors, or on CPU tensors
under TRITON_INTERPRET=1; float64 statistics fall back to torch with one log line. Only the
Triton path can apply a fused SGD step in backward (`attach_fused_update`). "auto" decides by
measurement: at its first forward on a CUDA device (kernels compiled, float32 statistics) it
times a few forward-and-backward steps of both paths on that forward's own tensors - N, D,
the rank's classes, the partial-FC sample, the matmul dtype, the chunk size - without
touching the weight, takes the maximum of each time over the ranks (so that every rank
chooses alike) and keeps the faster, logging one line with both times; the times are
cached per device name, versions and shapes (heads/tuning.py; `tuning_cache`), so a later
run at the same shapes starts without measuring. Elsewhere (the CPU, the interpreter,
float64) auto is torch, with one log line. The Triton path's tiles are timed too
(heads/kernels/tile_tuning.py).

Precision. Inputs and the weight may be half precision, and so may the logits matmul (under
autocast, the autocast dtype; otherwise the wider of the two input dtypes); embeddings are
gathered and normalised in float32, and the target cosine, margin, softmax statistics, their
collectives and the loss are float32, or float64 when the embeddings or the weight are.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed import ProcessGroup

from recognition import distributed
from recognition.heads import tuning
from recognition.heads.local_stats import (
    BLOCK_SIZE,
    LocalClassStats,
    l2_normalize,
)
from recognition.heads.margins import Margin
from recognition.heads.triton_stats import FusedSGD, TritonClassStats
from recognition.sharded import mark_like, set_row_placement
from recognition.tensor_memory import upper_bound

logger = logging.getLogger(__name__)

KERNELS = ("auto", "triton", "torch")

INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)

# Standard deviation of the class rows at initialisation (insightface's partial FC).
WEIGHT_INIT_STD = 0.01
# Rows of the class matrix per initialisation block: every block is drawn from its own seeded
# generator, so the matrix does not depend on how it is split over ranks.
INIT_BLOCK_ROWS = 1 << 16

# Partial FC ranks classes by a 31-bit hash: products of two 31-bit numbers fit in int64.
HASH_BITS = 31
HASH_MASK = (1 << HASH_BITS) - 1
# Odd multipliers below 2**31 (a multiplication by an odd number is a bijection mod 2**31).
HASH_MULTIPLIERS = (0x5BD1E995, 0x1B873593, 0x27D4EB2F)
MAX_CLASSES = 1 << HASH_BITS


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


def _triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _cannot_measure(device: torch.device, stats_dtype: torch.dtype) -> str | None:
    """Why head.kernel=auto takes torch without measuring here, or None: it measures on a
    CUDA device, with the kernels compiled, for float32 statistics."""
    if device.type != "cuda":
        return f"the Triton kernels run compiled on CUDA devices only, this forward is on {device}"
    if _triton_interpreting():
        return "TRITON_INTERPRET is set: the Triton kernels would run interpreted"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if stats_dtype != torch.float32:
        return f"statistics in {stats_dtype}: the Triton kernels take float32"
    return None


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


def _class_priority(class_start: int, num_local: int, key: int, device: torch.device) -> Tensor:
    """A pseudo-random 31-bit priority (num_local,) int64 of global classes [start, start + n).

    A bijective integer hash of the global class id under `key`: xor with the key, then
    rounds of multiply-by-odd and xor-shift, all mod 2**31 (products stay below 2**62, so
    int64 never overflows). Distinct classes get distinct priorities, and a class's
    priority does not depend on which rank or device computes it.
    """
    h = torch.arange(class_start, class_start + num_local, dtype=torch.int64, device=device)
    h = h ^ (key & HASH_MASK)
    for multiplier in HASH_MULTIPLIERS:
        h = (h * multiplier) & HASH_MASK
        h = h ^ (h >> 15)
    return h


def _sampling_key(seed: int, step: int) -> int:
    """A 31-bit key from (seed, step): splitmix64's finaliser on a combination of the two."""
    z = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % (1 << 64)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return (z ^ (z >> 31)) & HASH_MASK


class ShardedMarginSoftmax(nn.Module):
    """Cross-entropy over cosine logits with a margin on the target class, classes sharded.

    Splits `num_classes` over the ranks of `group` (the default group when None; a world of
    one when no process group exists) as `shard_range` does, and holds this rank's block of
    class rows, `weight` (num_local, embedding_size), for classes [class_start, class_start +
    num_local), initialised N(0, 0.01). The weight and so its optimizer state exist on the
    owning rank only. Embeddings and class rows are L2-normalised inside, so logits are s*cos.

    `margin` supplies psi and s (see margins.py); it must act element-wise on the target
    cosines, or (`margin.uses_norms`, AdaFace) row by row on the cosine and the norm of the
    row's raw embedding, which the head then passes: the norms of the gathered global batch,
    so that statistics the margin keeps of them are the same on every rank. `chunk_size`
    computes the logits that many classes at a time and recomputes them in backward (memory
    O(global batch x chunk_size) instead of O(global batch x num_local)); None computes the
    whole shard at once. `sample_rate` < 1 turns on partial FC, with `seed` fixing the
    sampling (see the module docstring and `attach_optimizer`). `kernel` picks the
    implementation of the local statistics: "torch", "triton" or "auto" (see the module
    docstring); `attach_fused_update` makes the Triton backward step the class rows itself.
    `tuning_cache` is the folder of the measured choices (auto's, the Triton tiles'; None:
    `$XDG_CACHE_HOME/recognition`).

    Every rank must call forward with the same local batch size; the loss is the mean over
    the global batch, identical on every rank. See the module docstring for the gradient
    convention under DDP (the gradient reaching the embeddings is scaled by the world size).

    After each forward, `last_accuracy` holds a detached 0-dim tensor: the share of rows of
    the global batch whose margin-adjusted target logit is the largest logit of the row
    (insightface's training accuracy), for logging; `sampled_index` holds the local rows
    (sorted int64) that the last forward's softmax used, or None when it used them all.
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
    ) -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"head.kernel: {kernel!r} is not one of {', '.join(KERNELS)}")
        if kernel == "triton" and importlib.util.find_spec("triton") is None:
            raise ValueError("head.kernel: triton is not installed (use auto or torch)")
        if num_classes < 1:
            raise ValueError(f"num_classes: must be >= 1, got {num_classes}")
        if num_classes > MAX_CLASSES:
            raise ValueError(f"num_classes: at most {MAX_CLASSES} supported, got {num_classes}")
        if embedding_size < 1:
            raise ValueError(f"model.embedding_size: must be >= 1, got {embedding_size}")
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"head.sample_rate: {sample_rate} is outside (0, 1]")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"head.chunk_size: must be at least 1 (or None), got {chunk_size}")
        num_ranks = distributed.world_size(group)
        if num_classes < num_ranks:
            raise ValueError(
                f"num_classes: {num_classes} classes cannot be split over {num_ranks} ranks"
            )
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
        self.weight = nn.Parameter(torch.empty(self.num_local, embedding_size, device=device))
        # A checkpoint stores this rank's rows as rows of one (num_classes, D) matrix.
        set_row_placement(self.weight, self.class_start, num_classes)
        self.reset_parameters()
        self.last_accuracy: Tensor | None = None
        self.sampled_index: Tensor | None = None
        self.sampling_step = 0
        # Rows sampled since the optimizer's last step (bool (num_local,)), for attach_optimizer.
        self._rows_to_update: Tensor | None = None
        self._most_rows_to_update = 0  # how many rows _rows_to_update can hold at most
        self._optimizer_hooks: list[Any] = []
        # The tensor the optimizer steps for `weight` (the weight, or its O2 master); in a
        # list, since a Parameter set as an attribute would become one of the head's own.
        self._optimizer_param: list[Tensor] = [self.weight]
        self._fused: FusedSGD | None = None
        self._accumulating = False  # inside accumulating(): every forward is the same step's
        self._logged: set[str] = set()  # the one-line notices already logged
        # head.kernel=auto: "torch" or "triton" by (device type, statistics dtype), and where
        # measured choices (and the kernels' tiles) are cached.
        self._auto_kernel: dict[tuple[str, torch.dtype], str] = {}
        self.tuning_cache = tuning.TuningCache(tuning_cache)

    # ---------------------------------------------------------------- the shard

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw this rank's class rows so that the whole matrix does not depend on the split.

        The class matrix is drawn in blocks of INIT_BLOCK_ROWS rows, N(0, WEIGHT_INIT_STD),
        each block from a generator seeded by (seed, block) on the weight's device type: a
        rank draws only the blocks its shard overlaps. A run on 8 ranks, on 1, or resumed on
        4 starts from the same matrix (per device type: CPU and CUDA generators differ).
        """
        first, stop = self.class_start, self.class_start + self.num_local
        device = self.weight.device
        for block_start in range(first - first % INIT_BLOCK_ROWS, stop, INIT_BLOCK_ROWS):
            block_rows = min(INIT_BLOCK_ROWS, self.num_classes - block_start)
            generator = torch.Generator(device=device)
            generator.manual_seed((self.seed * 1_000_003 + block_start // INIT_BLOCK_ROWS) % 2**63)
            block = torch.randn(block_rows, self.embedding_size, generator=generator, device=device)
            lo, hi = max(first, block_start), min(stop, block_start + block_rows)
            self.weight[lo - first : hi - first] = (
                block[lo - block_start : hi - block_start] * WEIGHT_INIT_STD
            )

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
    def optimizer_param(self) -> Tensor:
        """The tensor the optimizer steps for `weight`: the weight, or (precision O2) its fp32
        master, as `attach_optimizer` was told."""
        return self._optimizer_param[0]

    @property
    def updates_in_backward(self) -> bool:
        """True once `attach_fused_update` made the backward step the class rows: a step
        must then know its loss finite before backward (no later mask reaches them)."""
        return self._fused is not None

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

    def extra_repr(self) -> str:
        return (
            f"num_classes={self.num_classes}, embedding_size={self.embedding_size}, "
            f"class_start={self.class_start}, num_local={self.num_local}, "
            f"world_size={self.world_size}, chunk_size={self.chunk_size}, "
            f"sample_rate={self.sample_rate}, kernel={self.kernel}"
        )

    def _log_once(self, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            logger.info(message)

    def _uses_triton(
        self,
        device: torch.device,
        stats_dtype: torch.dtype,
        measure: Callable[[], tuning.KernelChoice],
    ) -> bool:
        """Whether this forward runs the Triton kernels. For kernel="auto" the answer of
        `measure()` (called once per device type and statistics dtype, on CUDA only) or
        torch; every choice not asked for is logged once."""
        if self.kernel == "torch":
            return False
        if self.kernel == "auto":
            return self._auto_uses_triton(device, stats_dtype, measure)
        if device.type != "cuda" and not _triton_interpreting():
            raise ValueError(
                f"head.kernel=triton: the kernels run on CUDA tensors, got {device.type} "
                "(or set TRITON_INTERPRET=1 to interpret them on the CPU)"
            )
        if stats_dtype != torch.float32:
            self._log_once(
                f"head.kernel=triton: statistics in {stats_dtype} are not supported by the "
                "kernel; using the torch path"
            )
            return False
        return True

    def _auto_uses_triton(
        self,
        device: torch.device,
        stats_dtype: torch.dtype,
        measure: Callable[[], tuning.KernelChoice],
    ) -> bool:
        where = (device.type, stats_dtype)
        if where not in self._auto_kernel:
            why_not = _cannot_measure(device, stats_dtype)
            if why_not is not None:
                self._auto_kernel[where] = "torch"
                self._log_once(f"head.kernel=auto: torch ({why_not})")
            else:
                self._auto_kernel[where] = measure().kernel
        return self._auto_kernel[where] == "triton"

    def _measure_kernels(
        self,
        norm_embeddings: Tensor,
        row_index: Tensor | None,
        target_row: Tensor,
        scale: float,
        matmul_dtype: torch.dtype,
    ) -> tuning.KernelChoice:
        """head.kernel=auto: time a few training steps of the local statistics (forward and
        backward, weight untouched) on this forward's tensors with either implementation, or
        read the times from the tuning cache, agree with the other ranks and log the choice."""
        device = norm_embeddings.device
        num_rows = norm_embeddings.shape[0]
        num_taking_part = self.num_local if row_index is None else row_index.numel()
        key = {
            "device": tuning.device_name(device),
            **tuning.software_versions(),
            "rows": num_rows,
            "dim": self.embedding_size,
            "classes": self.num_local,
            "taking_part": num_taking_part,
            "weight": str(self.weight.dtype).removeprefix("torch."),
            "matmul": str(matmul_dtype).removeprefix("torch."),
            "chunk_size": self.chunk_size,
            "deterministic": torch.are_deterministic_algorithms_enabled(),
        }
        embeddings = norm_embeddings.detach().requires_grad_(True)
        weight = self.weight.detach().requires_grad_(True)  # its own .grad; the same rows

        def measure(path: str) -> float:
            def step() -> None:
                with torch.enable_grad():
                    if path == "torch":
                        keep = self.chunk_size is None
                        outputs = LocalClassStats.apply(
                            embeddings, weight, row_index, target_row, scale,
                            BLOCK_SIZE if keep else self.chunk_size, keep, matmul_dtype,
                        )  # fmt: skip
                    else:
                        tiles = self._triton_tiles(embeddings, row_index, matmul_dtype, None)
                        outputs = TritonClassStats.apply(
                            embeddings, weight, row_index, target_row, scale, matmul_dtype,
                            None, tiles,
                        )  # fmt: skip
                    # d loss / d sum-exp and d loss / d target cos: ones, as good as any.
                    torch.autograd.backward(outputs[1:], [torch.ones_like(o) for o in outputs[1:]])
                embeddings.grad = weight.grad = None

            return tuning.time_steps(step, device)

        def agree(seconds: list[float]) -> list[float]:
            if self.world_size == 1:
                return seconds
            slowest = torch.tensor(seconds, dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self.group)
            return slowest.tolist()

        choice = tuning.choose_kernel(key, measure, self.tuning_cache, agree)
        source = "measured" if choice.source == "measured" else f"from {choice.source}"
        logger.info(
            "head.kernel=auto: %s (N %d, D %d, %s classes taking part on this rank, %s "
            "matmuls, %s, slowest rank; %s)",
            choice.describe(), num_rows, self.embedding_size, f"{num_taking_part:,}",
            key["matmul"], key["device"], source,
        )  # fmt: skip
        return choice

    def _triton_tiles(
        self,
        norm_embeddings: Tensor,
        row_index: Tensor | None,
        matmul_dtype: torch.dtype,
        fused: FusedSGD | None,
    ) -> Any:
        """The kernels' TileConfig for this forward's shapes (timed on a GPU: tile_tuning)."""
        tile_tuning = importlib.import_module("recognition.heads.kernels.tile_tuning")
        shape = tile_tuning.TuneShape(
            num_rows=norm_embeddings.shape[0],
            dim=norm_embeddings.shape[1],
            num_classes=self.num_local if row_index is None else row_index.numel(),
            weight_dtype=self.weight.dtype,
            matmul_dtype=matmul_dtype,
            has_index=row_index is not None,
            update=fused.kind if fused is not None else "none",
        )
        return tile_tuning.tiles_for(norm_embeddings.device, shape, self.tuning_cache)

    def _samples_classes(self) -> bool:
        """True when a forward now uses partial FC: sample_rate < 1, training, grad enabled."""
        return self.num_sample < self.num_local and self.training and torch.is_grad_enabled()

    def forward(self, local_embeddings: Tensor, local_labels: Tensor) -> Tensor:
        """Mean margin cross-entropy of the global batch (every rank's batch, gathered).

        Takes this rank's embeddings (B, embedding_size), any float dtype, unnormalised, and
        integer labels (B,) in [0, num_classes); every rank of the group must pass the same B.
        Returns a 0-dim float32 loss (float64 when the inputs are float64), the same on every
        rank. Sets `last_accuracy` and `sampled_index`. Bad input on any rank raises
        ValueError on every rank (so that none is left waiting in a collective).
        """
        self._check_inputs(local_embeddings, local_labels)
        local_labels = local_labels.to(device=local_embeddings.device, dtype=torch.int64)

        input_dtype = torch.promote_types(local_embeddings.dtype, self.weight.dtype)
        compute_dtype = torch.promote_types(input_dtype, torch.float32)
        device_type = local_embeddings.device.type
        if torch.is_autocast_enabled(device_type):
            matmul_dtype = torch.get_autocast_dtype(device_type)
        else:
            matmul_dtype = input_dtype
        scale = self.margin.scale

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
        row_index = self._sample_rows(target_row, owned) if self._samples_classes() else None
        self.sampled_index = row_index

        # ---- local statistics over this rank's (taking-part) classes, float32.
        def measure() -> tuning.KernelChoice:  # head.kernel=auto, first forward on CUDA
            return self._measure_kernels(
                norm_embeddings, row_index, target_row, scale, matmul_dtype
            )

        if self._uses_triton(embeddings.device, compute_dtype, measure):
            if matmul_dtype == torch.float64:
                matmul_dtype = torch.float32
            fused = self._fused if torch.is_grad_enabled() and self.training else None
            tiles = self._triton_tiles(norm_embeddings, row_index, matmul_dtype, fused)
            nontarget_max, nontarget_sumexp, target_cos = TritonClassStats.apply(
                norm_embeddings, self.weight, row_index, target_row, scale, matmul_dtype, fused,
                tiles,
            )  # fmt: skip
        elif self._fused is not None and torch.is_grad_enabled() and self.training:
            raise RuntimeError(
                "head.fused_update: this forward cannot use the Triton kernel (see the log), "
                "so nothing would update the class rows"
            )
        else:
            keep_logits = self.chunk_size is None
            nontarget_max, nontarget_sumexp, target_cos = LocalClassStats.apply(
                norm_embeddings, self.weight, row_index, target_row, scale,
                BLOCK_SIZE if keep_logits else self.chunk_size, keep_logits, matmul_dtype,
            )  # fmt: skip
        if self.margin.uses_norms:
            # AdaFace: each row's margin follows its raw embedding's norm, taken over the
            # gathered global batch (so its statistics are the same on every rank), detached.
            norms = torch.linalg.vector_norm(embeddings.detach(), dim=1)  # (N,), compute dtype
            margin_logit = self.margin(target_cos, norms)
        else:
            margin_logit = self.margin(target_cos)
        target_logit = torch.where(owned, scale * margin_logit, 0.0)
        # Fold the target column back in: max over both, sum-exp rescaled to that max. The
        # max is a constant for autograd: log(sum exp(z - c)) + c does not depend on c.
        local_max = torch.maximum(
            nontarget_max, torch.where(owned, target_logit.detach(), -math.inf)
        )
        local_sumexp = nontarget_sumexp * torch.exp(nontarget_max - local_max)
        # exp of -inf (not of the masked value) on unowned rows: no inf * 0 in backward.
        local_sumexp = local_sumexp + torch.exp(
            torch.where(owned, target_logit - local_max, -math.inf)
        )

        # ---- global statistics: all-reduce MAX of the max, then SUM of the sum-exp rescaled
        # to the global max and of the target logit (zero on ranks that do not own the label).
        if self.world_size > 1:
            global_max = local_max.detach().clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=self.group)
            rescaled_sumexp = local_sumexp * torch.exp(local_max - global_max)
            summed = _SumOverRanks.apply(torch.stack([rescaled_sumexp, target_logit]), self.group)
            global_sumexp, global_target = summed.unbind(0)
        else:
            global_max, global_sumexp, global_target = local_max, local_sumexp, target_logit

        # log softmax of the target: -(target - log sum exp(logits)).
        loss = torch.log(global_sumexp) + global_max - global_target  # (N,)
        self.last_accuracy = (global_target >= global_max).to(compute_dtype).mean().detach()
        return loss.mean()

    # ---------------------------------------------------------------- partial FC

    def _sample_rows(self, target_row: Tensor, owned: Tensor) -> Tensor:
        """Local rows (K,) sorted that take part this step: positives plus random others."""
        positives = torch.unique(target_row[owned])  # sorted
        # On the run planner's fake tensors the count depends on data it has not: its
        # largest (every row of the batch a distinct positive) is planned.
        torch._check(positives.numel() <= min(target_row.numel(), self.num_local))
        num_keep = max(upper_bound(positives.numel()), self.num_sample)
        key = _sampling_key(self.seed, self.sampling_step)
        self.sampling_step += 1
        priority = _class_priority(self.class_start, self.num_local, key, target_row.device)
        priority[positives] = MAX_CLASSES  # above every hash value: positives come first
        row_index = torch.topk(priority, num_keep, sorted=False).indices.sort().values
        # A new accumulation cycle starts when the gradients were dropped (zero_grad sets them
        # to None); within one, every micro-batch's rows are updated at the step.
        sampled = torch.zeros(self.num_local, dtype=torch.bool, device=row_index.device)
        sampled[row_index] = True
        if self._rows_to_update is None or (self.weight.grad is None and not self._accumulating):
            self._rows_to_update = sampled
            self._most_rows_to_update = num_keep
        else:
            self._rows_to_update |= sampled
            self._most_rows_to_update = min(self.num_local, self._most_rows_to_update + num_keep)
        return row_index

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Forwards inside belong to one optimizer step, however their backwards interleave.

        Partial FC updates the rows sampled by every forward since the optimizer's last step.
        Outside this context a forward finding the rows' gradient dropped (zero_grad) starts
        a new step; a pipeline schedule runs several forwards before any backward (GPipe),
        so it runs them inside this context, which starts the step on entry.
        """
        self._rows_to_update = None
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def attach_optimizer(
        self, optimizer: torch.optim.Optimizer, param: nn.Parameter | None = None
    ) -> None:
        """Make `optimizer` update only the class rows sampled since its last step.

        For partial FC (sample_rate < 1); with sample_rate = 1 this does nothing. Call it once,
        after building the optimizer. `param` is the tensor the optimizer steps for
        `self.weight`: the weight itself (the default) or, when the optimizer holds an fp32
        master copy instead (precision O2), that master.

        How: hooks around `optimizer.step()`. Before it, the parameter, its gradient and every
        optimizer state tensor of the parameter's shape (SGD's momentum buffer, Adam's
        moments) are swapped for their sampled rows; the optimizer steps those (momentum, weight
        decay and all); after it, the rows are written back and the full tensors restored.
        Unsampled rows and their state are untouched, bit for bit, and state created on the
        first step is zero for rows not yet sampled (a momentum buffer starting at zero is
        what SGD's first step amounts to). Per-parameter scalars (Adam's step count) count
        every optimizer step. Extra memory during the step: the sampled rows of the weight,
        its gradient and its state (about 3 x sample_rate x the weight for SGD).
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
        swapped: dict[str, Any] = {}

        def before_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            mask = self._rows_to_update
            # A fake mask (the run planner's) has no value to read: it plans the swap.
            if mask is None or (not is_fake(mask) and bool(mask.all())):
                return
            rows = mask.nonzero().squeeze(1)
            # The planner's fake count is bounded by this (the real one always is).
            torch._check(rows.shape[0] <= self._most_rows_to_update)
            state = opt.state[target]
            full_state = {
                name: value
                for name, value in state.items()
                if torch.is_tensor(value) and value.shape == target.shape
            }
            swapped.update(rows=rows, data=target.data, grad=target.grad, state=full_state)
            target.data = target.data[rows]
            if swapped["grad"] is not None:
                target.grad = swapped["grad"][rows]
            for name, value in full_state.items():
                state[name] = value[rows]

        def after_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self._rows_to_update = None
            if not swapped:
                return
            rows, full_data = swapped["rows"], swapped["data"]
            full_data.index_copy_(0, rows, target.data)
            sampled_shape = target.shape
            target.data = full_data
            target.grad = swapped["grad"]
            state = opt.state[target]
            for name, value in list(state.items()):
                if not (torch.is_tensor(value) and value.shape == sampled_shape):
                    continue
                full = swapped["state"].get(name)
                if full is None:  # created by this step: zero for the rows never sampled
                    full = torch.zeros(full_data.shape, dtype=value.dtype, device=value.device)
                full.index_copy_(0, rows, value)
                state[name] = full
            swapped.clear()

        self._optimizer_hooks.append(optimizer.register_step_pre_hook(before_step))
        self._optimizer_hooks.append(optimizer.register_step_post_hook(after_step))

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
        if self.kernel != "triton":
            raise ValueError(
                f"head.fused_update: needs head.kernel=triton, the head has {self.kernel!r}"
            )
        if not isinstance(optimizer, torch.optim.SGD):
            raise ValueError(
                f"head.fused_update: applies SGD only, the optimizer is {type(optimizer).__name__}"
            )
        target = self.weight if param is None else param
        if target is not self.weight:
            raise ValueError("head.fused_update: the optimizer must step the weight itself")
        groups = [g for g in optimizer.param_groups if any(p is target for p in g["params"])]
        if not groups:
            raise ValueError("attach_fused_update: the optimizer does not hold the head's weight")
        group = groups[0]
        if group.get("dampening", 0) != 0 or group.get("maximize", False):
            raise ValueError("head.fused_update: SGD with dampening or maximize is not supported")
        if self.weight.dtype != torch.float32:
            raise ValueError(
                f"head.fused_update: the weight must be float32, it is {self.weight.dtype}"
            )
        self._fused = FusedSGD(optimizer, self.weight)

    # ---------------------------------------------------------------- input checks

    def _check_inputs(self, local_embeddings: Tensor, local_labels: Tensor) -> None:
        """Raise ValueError on every rank when any rank's inputs are bad, without a host read.

        Shapes and dtypes are known on the host. Whether the labels lie in [0, num_classes)
        is not: it is asserted on the device (`torch._assert_async`), which on the CPU raises
        at once (caught here, and the message names the label) and on a GPU stops the
        process at its next synchronisation with a device-side assertion. With several
        ranks the ranks' statuses are all-gathered (on the device) and asserted alike, so
        that no rank is left waiting in a collective.
        """
        error = self._input_error(local_embeddings, local_labels)
        labels_ok = None if error is not None else self._labels_in_range(local_labels)
        if self.world_size == 1:
            if error is not None:
                raise ValueError(error)
            self._assert(labels_ok, lambda: self._label_error(local_labels))
            return
        # Every rank must learn of any rank's bad input: a rank that raised alone would leave
        # the others waiting in the next collective until the timeout. torch.full, not
        # torch.tensor: a copy from the host would synchronise.
        device = local_embeddings.device
        batch_size = local_embeddings.shape[0] if local_embeddings.ndim > 0 else 0
        if labels_ok is None:  # this rank's inputs are wrong in shape or type
            bad = torch.ones((), dtype=torch.int64, device=device)
        else:
            bad = (~labels_ok.to(device)).to(torch.int64)
        status = torch.stack([torch.full((), batch_size, dtype=torch.int64, device=device), bad])
        statuses = distributed.all_gather_tensor(status, self.group).view(-1, 2)  # (W, 2)
        if error is not None:
            raise ValueError(f"rank {self.rank}: {error}")
        assert labels_ok is not None

        def describe() -> str:  # on the CPU, once the assertion failed: the host may read
            if not bool(labels_ok):
                return f"rank {self.rank}: {self._label_error(local_labels)}"
            return self._ranks_error(statuses.tolist())

        all_ok = (statuses[:, 1] == 0).all() & (statuses[:, 0] == batch_size).all()
        self._assert(all_ok, describe)

    def _labels_in_range(self, local_labels: Tensor) -> Tensor:
        """0-dim bool tensor: every label lies in [0, num_classes)."""
        return ((local_labels >= 0) & (local_labels < self.num_classes)).all()

    def _assert(self, ok: Tensor, describe: Callable[[], str]) -> None:
        """Assert `ok` (0-dim bool) on its device. On the CPU the assertion acts at once and
        raises ValueError(describe()); on a GPU it acts asynchronously (a device-side
        assertion at the next synchronisation; torch builds that pass the message to the
        kernel print the one below)."""
        message = (
            f"ShardedMarginSoftmax: a label outside [0, {self.num_classes}) (head has "
            f"num_classes={self.num_classes}), or ranks with different batch sizes"
        )
        try:
            torch._assert_async(ok, message)
        except RuntimeError:  # the CPU checks at once: say which label, which rank
            raise ValueError(describe()) from None

    def _label_error(self, local_labels: Tensor) -> str:
        bad = int(local_labels[(local_labels < 0) | (local_labels >= self.num_classes)][0])
        return (
            f"local_labels: label {bad} is outside [0, {self.num_classes}) "
            f"(head has num_classes={self.num_classes})"
        )

    @staticmethod
    def _ranks_error(statuses: list[list[int]]) -> str:
        failed = [rank for rank, (_, bad) in enumerate(statuses) if bad]
        if failed:
            return (
                f"ShardedMarginSoftmax: rank(s) {failed} passed invalid inputs (their own "
                "error says which)"
            )
        sizes = [size for size, _ in statuses]
        return (
            f"local_embeddings: every rank must pass the same batch size, got {sizes} "
            f"on ranks 0..{len(sizes) - 1}"
        )

    def _input_error(self, local_embeddings: Tensor, local_labels: Tensor) -> str | None:
        """What is wrong with this rank's inputs that the host knows (shapes, dtypes), or
        None; the labels' range is checked on the device (`_check_inputs`)."""
        if local_embeddings.ndim != 2 or local_embeddings.shape[1] != self.embedding_size:
            return (
                f"local_embeddings: expected shape (batch, {self.embedding_size}), "
                f"got {tuple(local_embeddings.shape)}"
            )
        if not local_embeddings.is_floating_point():
            return f"local_embeddings: expected floats, got {local_embeddings.dtype}"
        if local_embeddings.shape[0] == 0:
            return "local_embeddings: the batch is empty"
        if local_labels.shape != local_embeddings.shape[:1]:
            return (
                f"local_labels: expected shape ({local_embeddings.shape[0]},) to match the "
                f"embeddings, got {tuple(local_labels.shape)}"
            )
        if local_labels.dtype not in INTEGER_DTYPES:
            return f"local_labels: expected integer labels, got {local_labels.dtype}"
        return None
