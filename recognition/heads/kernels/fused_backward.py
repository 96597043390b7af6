"""The fused backward (`TileConfig.backward = "fused"`): two kernels that recompute every
tile's logits and never write a tensor of N x C.

Backward, flash-attention style: nothing of size N x C was saved; each kernel recomputes
its tiles' logits (the same K-loop) from the saved row max. Two kernels, so that neither
needs a cross-program reduction of a class-sized tensor:

- `_grad_embeddings_kernel`, grid (row blocks, class splits): the embedding gradient of a
  block of rows, (BLOCK_N, D_PAD) summed in registers over the split's classes. The splits
  are then reduced either by `tl.atomic_add` into one (N, D) fp32 tensor (the default: fast,
  the order of the additions, and so the last bits, vary from run to run) or, when
  `torch.are_deterministic_algorithms_enabled()`, written to a (splits, N, D) buffer that
  torch sums in a fixed order (bitwise reproducible, splits x N x D x 4 bytes more memory).
- `_grad_weight_kernel`, grid (class tiles,): the gradient of a tile of class rows,
  (D_PAD, BLOCK_C) summed in registers over every row block (transposed, so that the long
  side fills the matmul's M however narrow the tile), the normalisation's radial part
  removed as `local_stats.remove_radial_part` does (with <w, g> summed from the tile's dot
  products, so without the whole rows), written to the weight gradient (the taking-part
  rows), or, with a fused SGD update, applied to the rows at once (weight decay, momentum,
  Nesterov, lr as torch.optim.SGD does, dampening 0) so that no weight-sized gradient ever
  exists. Its epilogue goes in `epilogue_splits` pieces of the dimension (see the kernel).

Why not one backward pass: one program can hold only one of the two gradients in
registers, so a single pass would reduce the other across programs. The weight gradient
over row blocks means N / BLOCK_N partial weight-sized tensors (or atomics on one, and no
fused update); the embedding gradient over class tiles means (C_local / BLOCK_C) x N x D
fp32 atomic additions - at C_local = 1M, N = 1024, D = 512 and the 32-class tiles the
weight gradient's accumulator allows, 1.6e10 of them, 66 GB of atomic traffic - where the
second kernel only recomputes the logits, 2 N C_local D = 1.1 TFLOP (about 1.4 ms at the
issue's measured 762 TFLOP/s), and the deterministic mode needs the two kernels anyway. So
a step costs 5 N C_local D matmuls (forward 1, each backward kernel 2) where the floor
without recomputation is 3 (which would keep N x C_local logits).

Measured on an H200 at 1M classes (N 1024, D 512, bf16, tuned tiles): the two kernels take
19.7 and 20.9 ms, about 105 TFLOP/s each, where a step's three useful matmuls take 5 ms at
the plain matmul's rate (benchmarks/results/head_profile-nvidia-h200.md): the narrow tiles
that their full-width accumulators leave keep the tensor cores underfed. gemm_backward.py
is the default.

Import this module only when the kernels are needed: `triton.jit` reads TRITON_INTERPRET at
import time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from recognition.heads.kernels.blocks import (
    _class_block,
    _dot,
    _finish_rows,
    _grad_dots,
    _halves,
    _raw_dots,
    _row_block,
    _tile_dots,
)
from recognition.heads.kernels.host import BackwardInputs, launch_settings, splits
from recognition.heads.kernels.tiles import TileConfig


@triton.jit
def _grad_embeddings_kernel(
    W, ROW_INDEX, E, INV_NORM, TARGET, SHIFT, GRAD_SCALE, GRAD_E,
    num_classes, num_rows, dim, stride_wc, stride_en, scale, tiles_per_split,
    HAS_INDEX: tl.constexpr, ATOMIC: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D_PAD: tl.constexpr,
    MM_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid_s = tl.program_id(1)
    offs_n, n_mask, target = _row_block(TARGET, num_rows, BLOCK_N)
    shift = tl.load(SHIFT + offs_n, mask=n_mask, other=0.0)
    grad_scale = tl.load(GRAD_SCALE + offs_n, mask=n_mask, other=0.0)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < dim
    acc = tl.zeros((BLOCK_N, D_PAD), dtype=tl.float32)
    for t in range(0, tiles_per_split):
        offs_c, c_mask, rows, inv_norm, raw = _tile_dots(
            W, ROW_INDEX, E, INV_NORM, (pid_s * tiles_per_split + t) * BLOCK_C, num_classes,
            offs_n, n_mask, dim, stride_wc, stride_en, HAS_INDEX, BLOCK_C, BLOCK_N, BLOCK_D,
            D_PAD, MM_DTYPE, INPUT_PRECISION, UPCAST,
        )  # fmt: skip
        grad = _grad_dots(raw, inv_norm, offs_c, c_mask, target, shift, grad_scale, scale)
        w = tl.load(
            W + rows[:, None] * stride_wc + offs_d[None, :],
            mask=c_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # (BLOCK_C, D_PAD)
        acc = _dot(grad, w, acc, MM_DTYPE, INPUT_PRECISION, UPCAST)
    mask = n_mask[:, None] & d_mask[None, :]
    if ATOMIC:
        tl.atomic_add(GRAD_E + offs_n[:, None] * dim + offs_d[None, :], acc, mask=mask)
    else:  # this split's slice of the (splits, N, D) buffer
        base = GRAD_E + pid_s.to(tl.int64) * num_rows * dim
        tl.store(base + offs_n[:, None] * dim + offs_d[None, :], acc, mask=mask)


@triton.jit
def _grad_weight_kernel(
    W, ROW_INDEX, E, INV_NORM, TARGET, SHIFT, GRAD_SCALE, GRAD_W, EXTRA, EXTRA_SLOT, BUF,
    num_classes, num_rows, dim, stride_wc, stride_en, stride_gc, scale, norm_limit,
    lr, momentum, weight_decay,
    HAS_INDEX: tl.constexpr, FUSED: tl.constexpr, HAS_EXTRA: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D_PAD: tl.constexpr,
    EPILOGUE_SPLITS: tl.constexpr, MM_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    offs_c, c_mask, rows, inv_norm = _class_block(
        ROW_INDEX, INV_NORM, tl.program_id(0) * BLOCK_C, num_classes, HAS_INDEX, BLOCK_C
    )
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < dim
    # Transposed, (D_PAD, BLOCK_C): the long side is the matmul's M, which a narrow class
    # tile could not fill.
    acc_t = tl.zeros((D_PAD, BLOCK_C), dtype=tl.float32)  # g / |w| of the tile's rows
    dots = tl.zeros((BLOCK_C,), dtype=tl.float32)  # <w, acc>
    for n_start in range(0, num_rows, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < num_rows
        target = tl.load(TARGET + offs_n, mask=n_mask, other=-1)
        shift = tl.load(SHIFT + offs_n, mask=n_mask, other=0.0)
        grad_scale = tl.load(GRAD_SCALE + offs_n, mask=n_mask, other=0.0)
        raw = _raw_dots(
            W, E, rows, c_mask, offs_n, n_mask, dim, stride_wc, stride_en,
            BLOCK_C, BLOCK_N, BLOCK_D, D_PAD, MM_DTYPE, INPUT_PRECISION, UPCAST,
        )  # fmt: skip
        grad = _grad_dots(raw, inv_norm, offs_c, c_mask, target, shift, grad_scale, scale)
        e_t = tl.load(
            E + offs_n[None, :] * stride_en + offs_d[:, None],
            mask=n_mask[None, :] & d_mask[:, None],
            other=0.0,
        )  # (D_PAD, BLOCK_N)
        acc_t = _dot(e_t, grad, acc_t, MM_DTYPE, INPUT_PRECISION, UPCAST)
        # <w, acc> = sum_i grad_i <w, e_i>: from the dot products at hand, so that the
        # radial part below needs no reduction against the whole rows.
        dots += tl.sum(grad * raw, axis=0)
    # Remove the radial part: g - w <w, g> / |w|^2 (acc already holds g / |w|); rows shorter
    # than the eps (normalised by the eps, not by their norm) keep g as it is.
    coefficient = tl.where(inv_norm < norm_limit, dots * inv_norm * inv_norm, 0.0)
    slot = tl.full((BLOCK_C,), -1, tl.int32)
    if HAS_EXTRA:
        slot = tl.load(EXTRA_SLOT + offs_c, mask=c_mask, other=-1)
    # The epilogue loads the rows (and the momentum, the target share) and stores what it
    # makes: the compiler keeps every full-width tile of it in registers at once, since a
    # store may alias a later load. In pieces of the dimension, only a piece of each is live.
    args = (
        coefficient, W, GRAD_W, EXTRA, BUF, rows, c_mask, slot, dim, stride_wc, stride_gc,
        lr, momentum, weight_decay, FUSED, HAS_EXTRA, HAS_MOMENTUM, NESTEROV,
    )  # fmt: skip
    if EPILOGUE_SPLITS == 1:
        _finish_rows(acc_t, 0, *args, D_PAD)
    else:
        HALF: tl.constexpr = D_PAD // 2
        top, bottom = _halves(acc_t, D_PAD, BLOCK_C)
        if EPILOGUE_SPLITS == 2:
            _finish_rows(top, 0, *args, HALF)
            _finish_rows(bottom, HALF, *args, HALF)
        else:
            QUARTER: tl.constexpr = D_PAD // 4
            first, second = _halves(top, HALF, BLOCK_C)
            _finish_rows(first, 0, *args, QUARTER)
            _finish_rows(second, QUARTER, *args, QUARTER)
            third, fourth = _halves(bottom, HALF, BLOCK_C)
            _finish_rows(third, HALF, *args, QUARTER)
            _finish_rows(fourth, HALF + QUARTER, *args, QUARTER)


def backward(inputs: BackwardInputs, tiles: TileConfig) -> tuple[Tensor, Tensor | None]:
    """`margin_softmax_triton.class_stats_backward` on the two kernels, at `tiles`'
    grad_embeddings and grad_weight tiles. The embedding gradient is reduced with atomics,
    or deterministically when torch.are_deterministic_algorithms_enabled()."""
    x = inputs
    weight, num_rows, dim, num_classes = x.weight, x.num_rows, x.dim, x.num_classes

    # The embedding gradient first: a fused update below overwrites the weight.
    settings = launch_settings(x.norm_embeddings, x.matmul_dtype, tiles.grad_embeddings)
    row_blocks = triton.cdiv(num_rows, tiles.grad_embeddings.block_n)
    num_tiles = triton.cdiv(num_classes, tiles.grad_embeddings.block_c)
    num_splits, per_split = splits(num_tiles, row_blocks, tiles.target_programs)
    atomic = not torch.are_deterministic_algorithms_enabled()
    shape = (num_rows, dim) if atomic else (num_splits, num_rows, dim)
    grad_e = x.norm_embeddings.new_zeros(shape, dtype=torch.float32)
    _grad_embeddings_kernel[(row_blocks, num_splits)](
        weight, x.index_arg, x.mm_embeddings, x.inv_norm, x.target_pos, x.shift, x.grad_scale,
        grad_e, num_classes, num_rows, dim, weight.stride(0), x.mm_embeddings.stride(0),
        float(x.scale), per_split, HAS_INDEX=x.row_index is not None, ATOMIC=atomic, **settings,
    )  # fmt: skip
    if not atomic:
        grad_e = grad_e.sum(dim=0)
    if not x.want_rows:
        return grad_e, None

    grad_w = x.new_grad_weight()
    settings = launch_settings(x.norm_embeddings, x.matmul_dtype, tiles.grad_weight)
    _grad_weight_kernel[(triton.cdiv(num_classes, tiles.grad_weight.block_c),)](
        weight, x.index_arg, x.mm_embeddings, x.inv_norm, x.target_pos, x.shift, x.grad_scale,
        *x.update_args(grad_w), num_classes, num_rows, dim, weight.stride(0),
        x.mm_embeddings.stride(0), grad_w.stride(0) if grad_w is not None else 0,
        float(x.scale), float(x.norm_limit), *x.update_scalars(), **x.update_flags(),
        EPILOGUE_SPLITS=min(tiles.epilogue_splits, settings["D_PAD"] // 16), **settings,
    )  # fmt: skip
    return grad_e, grad_w
