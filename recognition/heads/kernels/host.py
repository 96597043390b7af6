"""Host-side pieces the kernels' wrappers share: launches, launch settings, class splits and
chunks, where the rounded rows come from (`RowSource`), and `BackwardInputs`, what the
backward takes.

Import this module only when the kernels are needed: it imports triton.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import triton
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from recognition.heads.kernels.tiles import (
    INTERPRET,
    TORCH_TO_TRITON,
    KernelTiles,
    SGDUpdate,
    input_precision,
    padded_dim,
)


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)`, except on the run planner's fake tensors: they have
    no memory to run on, and a launch allocates none (the planner counts what the host
    allocates around it)."""
    if any(isinstance(arg, Tensor) and is_fake(arg) for arg in args):
        return
    kernel[grid](*args, **kwargs)


def launch_settings(norm_embeddings: Tensor, matmul_dtype: torch.dtype, tiles: KernelTiles) -> dict:
    """The constexprs and launch options of one kernel for these embeddings."""
    if matmul_dtype not in TORCH_TO_TRITON:
        raise ValueError(f"triton head kernel: matmul dtype {matmul_dtype} is not supported")
    d_pad = padded_dim(norm_embeddings.shape[1])
    return {
        "MM_DTYPE": TORCH_TO_TRITON[matmul_dtype],
        "INPUT_PRECISION": input_precision(matmul_dtype, norm_embeddings.device),
        "UPCAST": INTERPRET and matmul_dtype != torch.float32,
        "BLOCK_C": tiles.block_c,
        "BLOCK_N": tiles.block_n,
        "BLOCK_D": min(tiles.block_d, d_pad),
        "D_PAD": d_pad,
        "num_warps": tiles.num_warps,
        "num_stages": tiles.num_stages,
    }


def splits(num_tiles: int, num_row_blocks: int, target_programs: int) -> tuple[int, int]:
    """(number of class splits, class tiles per split) for the row-block x split grids."""
    wanted = max(1, target_programs // max(num_row_blocks, 1))
    num_splits = max(1, min(num_tiles, wanted))
    per_split = triton.cdiv(num_tiles, num_splits)
    return triton.cdiv(num_tiles, per_split), per_split


def chunk_classes(num_classes: int, block_c: int, limit: int) -> int:
    """Classes per chunk: at most `limit`, a multiple of `block_c` (at least one tile), and
    no more than the classes there are, rounded up to a tile."""
    per_chunk = max(block_c, limit // block_c * block_c)
    return min(per_chunk, triton.cdiv(max(num_classes, 1), block_c) * block_c)


def chunk_rows(
    weight: Tensor, row_index: Tensor | None, first: int, end: int, dtype: torch.dtype
) -> Tensor:
    """The rows of taking-part positions [first, end) in `dtype`, dense (K_c, D): a view of
    the weight where nothing changes, else a copy."""
    rows = weight[first:end] if row_index is None else weight[row_index[first:end]]
    return rows.to(dtype).contiguous()


@dataclass
class RowSource:
    """Where the kernels read the taking-part rows from, in the matmul dtype `dtype`:
    `rounded`, rows rounded beforehand - of every class of the shard, (C_local, D), read
    through `row_index` (`by_row`), or of the taking-part positions, (K, D) - or, when
    None, the weight's rows rounded a chunk at a time (`chunk_rows`)."""

    weight: Tensor
    row_index: Tensor | None
    dtype: torch.dtype
    rounded: Tensor | None = None
    by_row: bool = False

    def chunk(self, first: int, end: int) -> Tensor:
        """The rows of taking-part positions [first, end), dense (K_c, D) in `dtype`."""
        if self.rounded is None:
            return chunk_rows(self.weight, self.row_index, first, end, self.dtype)
        if self.by_row and self.row_index is not None:
            return self.rounded.index_select(0, self.row_index[first:end])
        return self.rounded[first:end]


@dataclass
class BackwardInputs:
    """What the backward of `forward.class_stats` takes (margin_softmax_triton's
    `class_stats_backward` says what each is), and what it derives from it."""

    norm_embeddings: Tensor
    weight: Tensor
    row_index: Tensor | None
    inv_norm: Tensor
    target_pos: Tensor
    row_max: Tensor
    grad_sumexp: Tensor
    scale: float
    matmul_dtype: torch.dtype
    want_weight: bool = True
    target_grad: Tensor | None = None
    sgd: SGDUpdate | None = None
    norm_limit: float = math.inf
    rows: RowSource | None = None
    kept: Any = None  # forward.KeptLogits
    kept_rows: tuple[Tensor | None, Tensor] | None = None

    def __post_init__(self) -> None:
        if self.rows is None:
            self.rows = RowSource(self.weight, self.row_index, self.matmul_dtype)
        self.eps = 1.0 / self.norm_limit  # 0 for an infinite limit
        self.num_rows, self.dim = self.norm_embeddings.shape
        self.num_classes = self.inv_norm.shape[0]
        self.mm_embeddings = self.norm_embeddings.to(self.matmul_dtype)
        self.target_pos = self.target_pos.to(torch.int32)
        row_max = self.row_max
        self.shift = torch.where(torch.isfinite(row_max), row_max, 0.0).float().contiguous()
        # d sum-exp / d cos = s exp(.)
        self.grad_scale = (self.grad_sumexp.float() * self.scale).contiguous()
        # Pointer arguments a kernel does not read in a variant still need a tensor.
        self.index_arg = self.row_index if self.row_index is not None else self.inv_norm
        buffer = self.sgd.momentum_buffer if self.sgd is not None else None
        self.buffer_arg = buffer if buffer is not None else self.inv_norm
        self.extra, self.extra_slot = self._target_share()
        step_ok = self.sgd.step_ok if self.sgd is not None else None
        # int32 on the device: the kernel reads it (no host sync).
        self.gate = step_ok.to(torch.int32).reshape(1) if step_ok is not None else None

    @property
    def want_rows(self) -> bool:
        """Whether the backward writes the rows' gradient or steps them."""
        return self.want_weight or self.sgd is not None

    def new_grad_weight(self) -> Tensor | None:
        """The weight's gradient to write (zero outside the taking-part rows), or None when
        none is returned (not wanted, or a fused update steps the rows)."""
        if not self.want_rows or self.sgd is not None:
            return None
        if self.row_index is None:
            return torch.empty_like(self.weight)
        return torch.zeros_like(self.weight)

    def _target_share(self) -> tuple[Tensor | None, Tensor | None]:
        """For a fused update: the target rows' gradient summed per target row, (N, D) fp32,
        each sum in the slot of one of the batch's rows that have it as their target, and per
        taking-part position that slot, or -1 (the epilogue adds it before the step); else
        None. Static shapes on the device (a scatter, not torch.unique): no host sync."""
        if self.sgd is None or self.target_grad is None:
            return None, None
        device = self.weight.device
        owned = self.target_pos >= 0
        # Rows whose label another rank owns share a spare position past the classes (their
        # gradient is zero).
        where = torch.where(owned, self.target_pos.long(), self.num_classes)  # (N,)
        batch_rows = torch.arange(self.num_rows, dtype=torch.int32, device=device)
        slot = torch.full((self.num_classes + 1,), -1, dtype=torch.int32, device=device)
        slot.scatter_reduce_(0, where, batch_rows, "amax")  # the last row with that target
        extra = torch.zeros_like(self.target_grad, dtype=torch.float32)
        extra.index_add_(0, slot[where], self.target_grad.float())
        return extra, slot[: self.num_classes]

    def update_args(self, grad_w: Tensor | None) -> tuple:
        """The epilogue's arguments: the gradient to write (or the weight), the target share
        and its slots, the momentum buffer, the gate (placeholders where unread)."""
        extra = self.extra if self.extra is not None else self.inv_norm
        slot = self.extra_slot if self.extra_slot is not None else self.target_pos
        gate = self.gate if self.gate is not None else self.target_pos
        return (grad_w if grad_w is not None else self.weight, extra, slot, self.buffer_arg, gate)

    def kept_rows_args(self) -> tuple[Tensor, Tensor]:
        """Where a fused update writes what the next step reads of the rows it steps: their
        copy in the matmul dtype (C_local, D) and their inverse norms (C_local,)
        (placeholders where not kept)."""
        rounded, inv_norm = self.kept_rows if self.kept_rows is not None else (None, None)
        return (rounded if rounded is not None else self.inv_norm,
                inv_norm if inv_norm is not None else self.inv_norm)  # fmt: skip

    def update_scalars(self) -> tuple[float | Tensor, float, float]:
        """lr, momentum, weight decay of the fused update (zeros without one); lr a float, or
        the 0-dim float32 device tensor that holds it (a captured step's: LR_IN_MEMORY)."""
        sgd = self.sgd
        if sgd is None:
            return 0.0, 0.0, 0.0
        lr = sgd.lr if isinstance(sgd.lr, Tensor) else float(sgd.lr)
        return lr, float(sgd.momentum), float(sgd.weight_decay)

    def update_flags(self) -> dict[str, bool]:
        """The epilogue's constexprs."""
        sgd = self.sgd
        kept = self.kept_rows if sgd is not None else None
        return {
            "HAS_INDEX": self.row_index is not None,
            "FUSED": sgd is not None,
            "HAS_EXTRA": self.extra is not None,
            "HAS_MOMENTUM": sgd is not None and sgd.momentum_buffer is not None,
            "NESTEROV": bool(sgd and sgd.nesterov),
            "HAS_GATE": self.gate is not None,
            "LR_IN_MEMORY": sgd is not None and isinstance(sgd.lr, Tensor),
            "KEEP_NORMS": kept is not None,
            "KEEP_ROWS": kept is not None and kept[0] is not None,
        }
