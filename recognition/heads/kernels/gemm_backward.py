"""The backward: the gradient of the logits is formed a chunk of classes at a time, and
cuBLAS takes the two gradient products.

For each chunk of K_c taking-part classes (`host.chunk_classes`: at most 2^26 logits,
128 MiB of bf16 at N = 1024, and the forward's bound on the rows), whose rows are rounded
to the matmul dtype as the forward had them (`host.RowSource`):

1. G, (N, K_c) in the matmul dtype: d loss / d <e_i, w_j> = exp(logit - max) g_i s / |w_j|
   (0 at the row's target and padding). When the forward kept its exponentials
   (`forward.KeptLogits`, head.chunk_size None) with one shift c (bf16 and fp32 operands),
   they are G up to a factor per row: kept = exp(logit - c) / |w|, G = diag(r) kept with
   r = g s exp(c - max) (`_row_factor`), and nothing runs here; r goes on the embeddings'
   side of the products below. Kept with tile shifts (fp16), `_scale_kept_kernel` turns the
   chunk's columns of them into G in place, one pass over memory (kept * exp(shift_t - max)
   g s / |w|). Otherwise `_grad_logits_kernel`, grid (row blocks, class tiles), on the
   forward's tiles, recomputes each tile's raw dot products <e_i, w_j> (the forward's
   K-loop, the same fp32 accumulation of matmul-dtype operands) and writes G to a chunk's
   buffer.
2. grad_e += G @ W_c and U = G^T @ E: two matmuls of the matmul dtype accumulated in fp32,
   W_c the chunk's rounded rows and E the normalised embeddings rounded likewise (with one
   shift: grad_e += kept @ W_c, scaled by r once at the end, and U = kept^T @ (diag(r) E),
   the scaled embeddings rounded once for the step). grad_e,
   summed over the chunks, is returned in fp32 (`torch.mm(..., out_dtype=torch.float32)`
   on a GPU); U, final per chunk, in bf16 with bf16 operands (`row_product`): half the
   bytes of the row product's output and of the epilogue's read, and the rounding the
   torch path makes too (under autocast the gradient of the normalised rows leaves its
   matmul in bf16 before normalize's backward runs in fp32). With fp16 operands U stays
   fp32: it holds g / |w|, which fp16's range (65,504) may not, under a loss scale.
3. `_finish_kernel`, grid (row blocks of the chunk,): U holds g / |w| of each row; the
   radial part is removed (<w, U> from the row and U themselves), the target rows' share
   added for a fused update, and the result stored as the weight's gradient or applied as
   the SGD step (`blocks._finish_rows`), under the training step's gate. With the head's
   kept rows (`kept_rows.KeptRows`, fused update) the epilogue also writes the stepped
   rows' inverse norms and their copy in the matmul dtype, what the next forward reads.

A step then costs three products of N x C_local x D multiply-adds (the forward and the two
products, 6 N C_local D FLOPs) with the logits kept, four (8 N C_local D) when they are
recomputed, each at a matmul's full tile size. What it adds is
memory traffic (`heads/traffic.py` counts it per phase), per chunk: G written once (or the
kept exponentials, read and written with tile shifts, not at all with one shift) and read
twice, U written and read once (bf16 or fp32), the chunk's
rows rounded unless kept - and memory: U and, recomputing, G and the rounded rows of one
chunk (64 + 128 + 64 MiB at N 1024, D 512, bf16), or, keeping, the exponentials of every class.

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
from torch._subclasses.fake_tensor import is_fake

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
    launch,
    launch_settings,
)
from recognition.heads.kernels.tiles import FinishTiles, TileConfig, padded_dim
from recognition.heads.traffic import phase

# Logits per chunk: G holds at most this many values of the matmul dtype (128 MiB in bf16;
# the rows' chunk of forward.CHUNK_ROW_VALUES bounds it too). A module constant rather than
# an argument, so that tests can make chunks small.
CHUNK_LOGITS = 1 << 26
# Values of the kept logits per program of the pass that turns them into their gradient
# (tile shifts), and its warps. (The row epilogue's are `TileConfig.finish`.)
SCALE_VALUES = 4096
SCALE_WARPS = 8


def mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b with a's dtype as the operands' (fp32, bf16 or fp16), accumulated and returned
    in fp32: cuBLAS's mixed-precision product on a GPU; on the CPU the operands upcast, whose
    products are exact in fp32 (the same function). fp32 operands follow torch's TF32
    setting, as the torch path's matmuls do."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda or is_fake(a):  # the run planner's fake tensors stand for a GPU's
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def mm_rounded(a: Tensor, b: Tensor) -> Tensor:
    """a @ b accumulated in fp32 and returned in a's dtype, rounded once: cuBLAS's product
    on a GPU, torch's CPU gemm (fp32 accumulation for bf16) on the CPU - the same
    allocations on both, which the run planner counts."""
    return a @ b


def row_product(g_chunk: Tensor, mm_embeddings: Tensor) -> Tensor:
    """U = G^T E (K_c, D): in bf16 for bf16 operands (fp32's range), in fp32 otherwise (fp16's
    range may not hold g / |w|)."""
    if g_chunk.dtype == torch.bfloat16:
        return mm_rounded(g_chunk.t(), mm_embeddings)
    return mm_fp32(g_chunk.t(), mm_embeddings)


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
    # int64 offsets: N x K passes 2^31 elements (1,024 rows x 10M classes)
    g_ptrs = G + offs_n.to(tl.int64)[:, None] * stride_gn + offs_c[None, :]
    tl.store(g_ptrs, grad.to(G.dtype.element_ty), mask=n_mask[:, None] & c_mask[None, :])


@triton.jit
def _scale_kept_kernel(
    KEPT, TILE_SHIFT, INV_NORM, SHIFT, GRAD_SCALE, num_classes, num_rows, stride_kn,
    BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # The forward's exp(logit - shift_t) of tile t, turned in place into d loss / d <e, w> =
    # exp(logit - max) g s / |w| = kept * exp(shift_t - max) g s / |w|: a pass over memory.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < num_rows
    tile = tl.program_id(1)
    offs_c = tile * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < num_classes
    shift = tl.load(SHIFT + offs_n, mask=n_mask, other=0.0)
    grad_scale = tl.load(GRAD_SCALE + offs_n, mask=n_mask, other=0.0)
    tile_shift = tl.load(TILE_SHIFT + tile.to(tl.int64) * num_rows + offs_n, mask=n_mask, other=0.0)
    inv_norm = tl.load(INV_NORM + offs_c, mask=c_mask, other=0.0)
    factor = tl.exp(tile_shift - shift) * grad_scale  # <= |g s|: the tile's max <= the max
    ptrs = KEPT + offs_n.to(tl.int64)[:, None] * stride_kn + offs_c[None, :]  # int64: N x K
    mask = n_mask[:, None] & c_mask[None, :]
    kept = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    grad = kept * factor[:, None] * inv_norm[None, :]
    tl.store(ptrs, grad.to(KEPT.dtype.element_ty), mask=mask)


@triton.jit
def _finish_kernel(
    U, W, ROW_INDEX, INV_NORM, GRAD_W, EXTRA, EXTRA_SLOT, BUF, GATE, ROUNDED, NORM_OUT,
    first, end, dim, stride_wc, stride_gc, norm_limit, eps, lr, momentum, weight_decay,
    HAS_INDEX: tl.constexpr, FUSED: tl.constexpr, HAS_EXTRA: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, HAS_GATE: tl.constexpr,
    LR_IN_MEMORY: tl.constexpr, KEEP_NORMS: tl.constexpr, KEEP_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    D_PAD: tl.constexpr,
):  # fmt: skip
    offs_c, c_mask, rows, inv_norm = _class_block(
        ROW_INDEX, INV_NORM, first + tl.program_id(0) * BLOCK_C, end, HAS_INDEX, BLOCK_C
    )
    offs_d = tl.arange(0, D_PAD)
    mask = c_mask[None, :] & (offs_d < dim)[:, None]
    # Transposed, (D_PAD, BLOCK_C): the class rows' gradient tile as _finish_rows takes it.
    u_ptrs = U + (offs_c - first)[None, :] * dim + offs_d[:, None]
    u_t = tl.load(u_ptrs, mask=mask, other=0.0).to(tl.float32)
    w_t = tl.load(W + rows[None, :] * stride_wc + offs_d[:, None], mask=mask, other=0.0)
    dots = tl.sum(u_t * w_t.to(tl.float32), axis=0)  # <w, U>
    # g - w <w, g> / |w|^2 (U holds g / |w|); rows shorter than the eps keep g as it is.
    coefficient = tl.where(inv_norm < norm_limit, dots * inv_norm * inv_norm, 0.0)
    slot = tl.full((BLOCK_C,), -1, tl.int32)
    if HAS_EXTRA:
        slot = tl.load(EXTRA_SLOT + offs_c, mask=c_mask, other=-1)
    w32 = _finish_rows(
        u_t, coefficient, W, GRAD_W, EXTRA, BUF, GATE, rows, c_mask, slot, dim, stride_wc,
        stride_gc, lr, momentum, weight_decay, FUSED, HAS_EXTRA, HAS_MOMENTUM, NESTEROV,
        HAS_GATE, LR_IN_MEMORY, D_PAD,
    )  # fmt: skip
    # What the next step reads of the rows just stepped (fused update): their inverse norms
    # and their copy in the matmul dtype, so that no pass over the fp32 rows makes them.
    stepped = c_mask
    if HAS_GATE:  # closed: the rows did not move, nor does what is kept of them
        stepped = stepped & (tl.load(GATE) != 0)
    if KEEP_NORMS:
        norms = tl.sqrt(tl.sum(w32 * w32, axis=0))
        tl.store(NORM_OUT + rows, 1.0 / tl.maximum(norms, eps), mask=stepped)
    if KEEP_ROWS:
        r_ptrs = ROUNDED + rows[None, :] * dim + offs_d[:, None]
        tl.store(r_ptrs, w32.to(ROUNDED.dtype.element_ty), mask=mask & stepped[None, :])


def backward(inputs: BackwardInputs, tiles: TileConfig) -> tuple[Tensor, Tensor | None]:
    """`margin_softmax_triton.class_stats_backward` by chunks (see the module docstring); the
    recomputation runs on `tiles.forward`."""
    x = inputs
    num_rows, dim, num_classes = x.num_rows, x.dim, x.num_classes
    grad_w = x.new_grad_weight()
    settings = launch_settings(x.norm_embeddings, x.matmul_dtype, tiles.forward)
    # Chunks of whole tiles: the recomputation's, or the forward's that kept the logits (its
    # tile shifts go by its tiles).
    block_c = x.kept.block_c if x.kept is not None else tiles.forward.block_c
    limit = min(CHUNK_LOGITS // max(num_rows, 1), forward.CHUNK_ROW_VALUES // max(dim, 1))
    chunk = chunk_classes(num_classes, block_c, limit)
    grad_e = x.norm_embeddings.new_zeros((num_rows, dim), dtype=torch.float32)
    g = None
    if x.kept is None:  # the gradient of the logits, recomputed a chunk at a time
        g = x.norm_embeddings.new_empty((num_rows, chunk), dtype=x.matmul_dtype)  # (N, K_c)
    # Kept with one shift (forward.KeptLogits): G = diag(r) kept, so the products read the
    # kept values as they are, r on the embeddings' side: grad_e = diag(r) (kept @ W) and
    # U = kept^T @ (diag(r) E).
    row_factor = _row_factor(x) if x.kept is not None and x.kept.fixed_shift is not None else None
    u_embeddings = x.mm_embeddings
    if row_factor is not None:
        with phase("logit gradient"):
            u_embeddings = (x.norm_embeddings * row_factor[:, None]).to(x.matmul_dtype)
    for first in range(0, num_classes, chunk):
        end = min(first + chunk, num_classes)
        with phase("logit gradient"):
            rows = x.rows.chunk(first, end)  # (K_c, D), rounded
            if row_factor is not None:
                g_chunk = x.kept.probabilities[:, first:end]  # G up to its row factor
            elif g is None:
                g_chunk = _scale_kept(x, first, end)
            else:
                g_chunk = _recompute(x, rows, g, first, end, settings)
        with phase("embedding product"):
            grad_e += mm_fp32(g_chunk, rows)  # (N, D)
        del rows
        if x.want_rows:
            with phase("row product"):
                u = row_product(g_chunk, u_embeddings)  # (K_c, D): g / |w| of its rows
            with phase("update"):
                _finish(x, u, grad_w, first, end, tiles.finish)
    if row_factor is not None:
        with phase("embedding product"):
            grad_e *= row_factor[:, None]
    return grad_e, grad_w


def _row_factor(x: BackwardInputs) -> Tensor:
    """r (N,) fp32: the gradient of the logits is kept * r for values kept with one shift c,
    exp(logit - c) / |w|: r = g s exp(c - max), 0 for a row with no class (nothing kept)."""
    factor = x.grad_scale * torch.exp(x.kept.fixed_shift - x.shift)
    return torch.where(torch.isfinite(x.row_max), factor, 0.0)


def _recompute(
    x: BackwardInputs, rows: Tensor, g: Tensor, first: int, end: int, settings: dict
) -> Tensor:
    """The chunk's gradient of the logits, recomputed from its rounded rows into `g`
    (`_grad_logits_kernel`): (N, K_c) in the matmul dtype, a view of `g`."""
    num_rows, block_c = x.num_rows, settings["BLOCK_C"]
    grid = (triton.cdiv(num_rows, settings["BLOCK_N"]), triton.cdiv(end - first, block_c))
    launch(_grad_logits_kernel, grid,
        rows, x.mm_embeddings, x.inv_norm[first:end], x.target_pos - first, x.shift,
        x.grad_scale, g, end - first, num_rows, x.dim, rows.stride(0), x.mm_embeddings.stride(0),
        g.stride(0), float(x.scale), **settings,
    )  # fmt: skip
    return g[:, : end - first]


def _scale_kept(x: BackwardInputs, first: int, end: int) -> Tensor:
    """The chunk's columns of the kept exponentials, turned into the gradient of the logits
    in place (`_scale_kept_kernel`): (N, K_c) in the matmul dtype."""
    kept = x.kept
    g_chunk = kept.probabilities[:, first:end]
    # A pass over memory: tiles of SCALE_VALUES values, the forward's classes wide (the
    # tile shifts are per forward tile).
    block_n = max(16, SCALE_VALUES // kept.block_c)
    grid = (triton.cdiv(x.num_rows, block_n), triton.cdiv(end - first, kept.block_c))
    launch(_scale_kept_kernel, grid,
        g_chunk, kept.tile_shift[first // kept.block_c :], x.inv_norm[first:end], x.shift,
        x.grad_scale, end - first, x.num_rows, g_chunk.stride(0), BLOCK_C=kept.block_c,
        BLOCK_N=block_n, num_warps=SCALE_WARPS, num_stages=1,
    )  # fmt: skip
    return g_chunk


def _finish(
    x: BackwardInputs, u: Tensor, grad_w: Tensor | None, first: int, end: int, tiles: FinishTiles
) -> None:
    """`_finish_kernel` over the chunk's rows on `tiles`: their gradient stored or their SGD
    step, and (fused update) what the next step reads of them."""
    d_pad = padded_dim(x.dim)
    finish_block = tiles.block_c(d_pad)
    launch(_finish_kernel, (triton.cdiv(end - first, finish_block),),
        u, x.weight, x.index_arg, x.inv_norm, *x.update_args(grad_w), *x.kept_rows_args(),
        first, end, x.dim, x.weight.stride(0), grad_w.stride(0) if grad_w is not None else 0,
        float(x.norm_limit), float(x.eps), *x.update_scalars(), **x.update_flags(),
        BLOCK_C=finish_block, D_PAD=d_pad, num_warps=tiles.num_warps, num_stages=1,
    )  # fmt: skip
