"""The backward: the gradient of the logits is written a chunk of classes at a time, and
cuBLAS takes the two gradient products.

For each chunk of K_c taking-part classes (`host.chunk_classes`: at most 2^26 logits,
128 MiB of bf16 at N = 1024, and the forward's bound on the rows), whose rows are rounded
to the matmul dtype once (`host.chunk_rows`, as the forward rounds them):

1. `_grad_logits_kernel`, grid (row blocks, class tiles), on the forward's tiles: each
   program recomputes its tile's raw dot products <e_i, w_j> (the forward's K-loop, the
   same fp32 accumulation of matmul-dtype operands), and writes d loss / d <e_i, w_j> =
   exp(logit - max) g_i s / |w_j| (0 at the row's target and padding) in the matmul dtype:
   G, (N, K_c).
2. grad_e += G @ W_c and U = G^T @ E: two matmuls of the matmul dtype accumulated and
   returned in fp32 (`torch.mm(..., out_dtype=torch.float32)` on a GPU), W_c the chunk's
   rounded rows and E the normalised embeddings rounded likewise.
3. `_finish_kernel`, grid (row blocks of the chunk,): U holds g / |w| of each row; the
   radial part is removed (<w, U> from the row and U themselves), the target rows' share
   added for a fused update, and the result stored as the weight's gradient or applied as
   the SGD step (`blocks._finish_rows`).

A step then costs 4 N C_local D matmul FLOPs (forward, the recomputation in 1., and the two
products), each at a matmul's full tile size. What it
adds is memory traffic, per chunk: G written once and read twice, the chunk's rows rounded
once, U written and read once - about 1.4 GB per 65,536 classes at N 1024, D 512, a few
tenths of a millisecond on an H100 - and memory: G, U and the rounded rows of one chunk
(128 + 128 + 64 MiB there).

Measured on an H200 at 1M classes (N 1024, D 512, bf16; benchmarks/results/
head_profile-backwards-nvidia-h200.md): a step of 20.2 ms (20.0 with the fused update), the
backward's parts 3.1 ms for the gradient-of-logits kernel, 4.7 ms for cuBLAS's products,
2.9 ms for the epilogue with the update; at 10M classes with the fused update, 146 ms. The
two-kernel fused backward it replaced, which recomputed every tile and never wrote an N x C
tensor, took 53.0 ms (50.7 with the update) and 482 ms in the same runs: its full-width
fp32 accumulators (D = 512) left 32x64 tiles at 255 registers, about 105 TFLOP/s, for 5
N C_local D FLOPs. It was removed.

The chunks run in order, each one's rows updated (fused update) only after its own
products, so that every product reads the rows as they were at the forward. Without
atomics, the backward is deterministic as it stands.

Import this module only when the kernels are needed: `triton.jit` reads TRITON_INTERPRET at
import time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from recognition.heads.kernels import forward
from recognition.heads.kernels.blocks import (
    _class_block,
    _finish_rows,
    _grad_dots,
    _row_block,
    _tile_dots,
)
from recognition.heads.kernels.host import (
    BackwardInputs,
    chunk_classes,
    chunk_rows,
    launch_settings,
)
from recognition.heads.kernels.tiles import TileConfig, padded_dim

# Logits per chunk: G holds at most this many values of the matmul dtype (128 MiB in bf16;
# the rows' chunk of forward.CHUNK_ROW_VALUES bounds it too). A module constant rather than
# an argument, so that tests can make chunks small.
CHUNK_LOGITS = 1 << 26
# Values of each (rows, D) tile the epilogue holds per program: 8,192 is 32 per thread at 8
# warps for each of its few live tiles (U, the rows, the momentum, the result).
FINISH_VALUES = 8192
FINISH_WARPS = 8


def mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b with a's dtype as the operands' (fp32, bf16 or fp16), accumulated and returned
    in fp32: cuBLAS's mixed-precision product on a GPU; on the CPU the operands upcast, whose
    products are exact in fp32 (the same function). fp32 operands follow torch's TF32
    setting, as the torch path's matmuls do."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


@triton.jit
def _grad_logits_kernel(
    W, E, INV_NORM, TARGET, SHIFT, GRAD_SCALE, G,
    num_classes, num_rows, dim, stride_wc, stride_en, stride_gn, scale,
    BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D_PAD: tl.constexpr,
    MM_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    # Row blocks vary fastest, so the programs that read one tile of class rows run together
    # and the rows come from the L2 cache after the first.
    offs_n, n_mask, target = _row_block(TARGET, num_rows, BLOCK_N)
    shift = tl.load(SHIFT + offs_n, mask=n_mask, other=0.0)
    grad_scale = tl.load(GRAD_SCALE + offs_n, mask=n_mask, other=0.0)
    offs_c, c_mask, rows, inv_norm, raw = _tile_dots(
        W, INV_NORM, E, INV_NORM, tl.program_id(1) * BLOCK_C, num_classes, offs_n, n_mask, dim,
        stride_wc, stride_en, False, BLOCK_C, BLOCK_N, BLOCK_D, D_PAD, MM_DTYPE,
        INPUT_PRECISION, UPCAST,
    )  # fmt: skip
    grad = _grad_dots(raw, inv_norm, offs_c, c_mask, target, shift, grad_scale, scale)
    g_ptrs = G + offs_n[:, None] * stride_gn + offs_c[None, :]
    tl.store(g_ptrs, grad.to(G.dtype.element_ty), mask=n_mask[:, None] & c_mask[None, :])


@triton.jit
def _finish_kernel(
    U, W, ROW_INDEX, INV_NORM, GRAD_W, EXTRA, EXTRA_SLOT, BUF, GATE,
    first, end, dim, stride_wc, stride_gc, norm_limit, lr, momentum, weight_decay,
    HAS_INDEX: tl.constexpr, FUSED: tl.constexpr, HAS_EXTRA: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, HAS_GATE: tl.constexpr,
    BLOCK_C: tl.constexpr, D_PAD: tl.constexpr,
):  # fmt: skip
    offs_c, c_mask, rows, inv_norm = _class_block(
        ROW_INDEX, INV_NORM, first + tl.program_id(0) * BLOCK_C, end, HAS_INDEX, BLOCK_C
    )
    offs_d = tl.arange(0, D_PAD)
    mask = c_mask[None, :] & (offs_d < dim)[:, None]
    # Transposed, (D_PAD, BLOCK_C): the class rows' gradient tile as _finish_rows takes it.
    u_t = tl.load(U + (offs_c - first)[None, :] * dim + offs_d[:, None], mask=mask, other=0.0)
    w_t = tl.load(W + rows[None, :] * stride_wc + offs_d[:, None], mask=mask, other=0.0)
    dots = tl.sum(u_t * w_t.to(tl.float32), axis=0)  # <w, U>
    # g - w <w, g> / |w|^2 (U holds g / |w|); rows shorter than the eps keep g as it is.
    coefficient = tl.where(inv_norm < norm_limit, dots * inv_norm * inv_norm, 0.0)
    slot = tl.full((BLOCK_C,), -1, tl.int32)
    if HAS_EXTRA:
        slot = tl.load(EXTRA_SLOT + offs_c, mask=c_mask, other=-1)
    _finish_rows(
        u_t, coefficient, W, GRAD_W, EXTRA, BUF, GATE, rows, c_mask, slot, dim, stride_wc,
        stride_gc, lr, momentum, weight_decay, FUSED, HAS_EXTRA, HAS_MOMENTUM, NESTEROV,
        HAS_GATE, D_PAD,
    )  # fmt: skip


def backward(inputs: BackwardInputs, tiles: TileConfig) -> tuple[Tensor, Tensor | None]:
    """`margin_softmax_triton.class_stats_backward` by chunks (see the module docstring); the
    recomputation runs on `tiles.forward`."""
    x = inputs
    weight, num_rows, dim, num_classes = x.weight, x.num_rows, x.dim, x.num_classes
    grad_w = x.new_grad_weight()
    settings = launch_settings(x.norm_embeddings, x.matmul_dtype, tiles.forward)
    block_c = tiles.forward.block_c
    limit = min(CHUNK_LOGITS // max(num_rows, 1), forward.CHUNK_ROW_VALUES // max(dim, 1))
    chunk = chunk_classes(num_classes, block_c, limit)
    d_pad = padded_dim(dim)
    finish_block = max(1, FINISH_VALUES // d_pad)
    grad_e = x.norm_embeddings.new_zeros((num_rows, dim), dtype=torch.float32)
    g = x.norm_embeddings.new_empty((num_rows, chunk), dtype=x.matmul_dtype)  # (N, K_c)
    for first in range(0, num_classes, chunk):
        end = min(first + chunk, num_classes)
        rows = chunk_rows(weight, x.row_index, first, end, x.matmul_dtype)  # (K_c, D)
        g_chunk = g[:, : end - first]
        grid = (triton.cdiv(num_rows, tiles.forward.block_n), triton.cdiv(end - first, block_c))
        _grad_logits_kernel[grid](
            rows, x.mm_embeddings, x.inv_norm[first:end], x.target_pos - first, x.shift,
            x.grad_scale, g, end - first, num_rows, dim, rows.stride(0),
            x.mm_embeddings.stride(0), g.stride(0), float(x.scale), **settings,
        )  # fmt: skip
        grad_e += mm_fp32(g_chunk, rows)  # (N, D)
        if not x.want_rows:
            continue
        u = mm_fp32(g_chunk.t(), x.mm_embeddings)  # (K_c, D): g / |w| of the chunk's rows
        _finish_kernel[(triton.cdiv(end - first, finish_block),)](
            u, weight, x.index_arg, x.inv_norm, *x.update_args(grad_w), first, end, dim,
            weight.stride(0), grad_w.stride(0) if grad_w is not None else 0,
            float(x.norm_limit), *x.update_scalars(), **x.update_flags(),
            BLOCK_C=finish_block, D_PAD=d_pad, num_warps=FINISH_WARPS, num_stages=1,
        )  # fmt: skip
    return grad_e, grad_w
