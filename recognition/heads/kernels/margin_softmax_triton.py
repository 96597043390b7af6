"""Triton kernels for the local part of the sharded margin softmax: the one place the rest of
the code imports them from.

What they compute is what `LocalClassStats` in local_stats.py computes (that module
stays the reference): over the classes of this rank that take part (all of them, or the
partial-FC rows `row_index`), the max and sum-exp of the non-target logits s * <w_j, e_i> /
|w_j| of every row i of the global batch, and in backward the gradients of the sum-exp with
respect to the normalised embeddings and to the raw class rows. The target cosine, the
margin and the collectives stay in margin_softmax.py.

One module per pass, over two shared ones:

    tiles.py           KernelTiles, TileConfig, the tables, SGDUpdate
    host.py            launch settings, splits, chunks of rounded rows, BackwardInputs
    blocks.py          device code the kernels share: the K-loop, logits, the rows' epilogue
    forward.py         class_stats: max and sum-exp per row; inverse_norms
    gemm_backward.py   the backward: the logits' gradient by chunks, cuBLAS products

Import this module only when the kernels are needed: `triton.jit` reads TRITON_INTERPRET at
import time.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from recognition.heads.kernels import gemm_backward
from recognition.heads.kernels.forward import KeptLogits, class_stats, inverse_norms
from recognition.heads.kernels.host import BackwardInputs, RowSource
from recognition.heads.kernels.tiles import (
    FINISH_TILES,
    INTERPRET,
    INTERPRETER_TILES,
    OPERAND_KINDS,
    FinishTiles,
    KernelTiles,
    SGDUpdate,
    TileConfig,
    default_tiles,
    gpu_tiles,
    input_precision,
    padded_dim,
)

__all__ = [
    "FINISH_TILES", "INTERPRET", "INTERPRETER_TILES", "OPERAND_KINDS", "FinishTiles", "KeptLogits",
    "KernelTiles", "RowSource",
    "SGDUpdate", "TileConfig", "class_stats", "class_stats_backward", "default_tiles",
    "gpu_tiles", "input_precision", "inverse_norms", "padded_dim",
]  # fmt: skip


def class_stats_backward(
    norm_embeddings: Tensor,
    weight: Tensor,
    row_index: Tensor | None,
    inv_norm: Tensor,
    target_pos: Tensor,
    row_max: Tensor,
    grad_sumexp: Tensor,
    scale: float,
    matmul_dtype: torch.dtype,
    tiles: TileConfig,
    *,
    want_weight: bool = True,
    target_grad: Tensor | None = None,
    sgd: SGDUpdate | None = None,
    norm_limit: float = math.inf,
    rows: RowSource | None = None,
    kept: KeptLogits | None = None,
    kept_rows: tuple[Tensor | None, Tensor] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Gradients of sum(grad_sumexp * sum-exp) from `class_stats`'s inputs (gemm_backward.py).

    Returns (d / d norm_embeddings (N, D) fp32, d / d weight (C_local, D) in the weight's
    dtype, zero outside the taking-part rows, or None when `want_weight` is False or `sgd`
    is given). With `sgd`, each row's gradient - plus the target rows' share `target_grad`,
    (N, D) fp32: row i's share of its target row's gradient, 0 where `target_pos` is -1 - is
    applied to `weight` in place as that SGD step, and no gradient is returned for the
    weight.
    `norm_limit` = 1 / eps: rows whose inverse norm reaches it keep their radial part.
    `rows`: where the rounded rows come from, as the forward had them (default: rounded a
    chunk at a time). `kept`: what `class_stats(keep=True)` returned, which the backward
    reads (and overwrites: a second backward of the same forward is not possible) instead of
    recomputing the logits. `kept_rows`, with `sgd`: the head's copy of its rows in the
    matmul dtype (C_local, D) or None, and their inverse norms (C_local,), which the update
    keeps current for the rows it steps.
    """
    inputs = BackwardInputs(
        norm_embeddings, weight, row_index, inv_norm, target_pos, row_max, grad_sumexp, scale,
        matmul_dtype, want_weight, target_grad, sgd, norm_limit, rows, kept, kept_rows,
    )  # fmt: skip
    return gemm_backward.backward(inputs, tiles)
