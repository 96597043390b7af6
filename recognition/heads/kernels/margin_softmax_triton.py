"""Triton kernels for the local part of the sharded margin softmax, and their host wrappers.

What they compute is what `_LocalClassStats` in margin_softmax.py computes (that module
stays the reference): over the classes of this rank that take part (all of them, or the
partial-FC rows `row_index`), the max and sum-exp of the non-target logits s * <w_j, e_i> /
|w_j| of every row i of the global batch, and in backward the gradients of the sum-exp with
respect to the normalised embeddings and to the raw class rows. The target cosine, the
margin and the collectives stay in margin_softmax.py.

Forward (`class_stats`): a grid of (row blocks, class splits). Each program loads its block
of BLOCK_N embeddings once and walks its split of the classes BLOCK_C at a time: one
`tl.dot` of the raw class rows (cast to the matmul dtype: fp32, bf16 or fp16) with the
embeddings, fp32 accumulation, each class row scaled by s / |w| from inverse norms computed
once per step (no normalised copy of the shard), the row's target and the padding masked to
-inf, then an online max / sum-exp in fp32. Each split writes its partial statistics
(splits, N); a second small step (`_combine`) folds the splits together, so that one row of
statistics never serialises the whole shard onto one program.

Backward, flash-attention style: nothing of size N x C was saved; each kernel recomputes
its tiles' logits from the saved row max. Two kernels, so that neither needs a
cross-program reduction of a class-sized tensor:

- `_grad_embeddings_kernel`, grid (row blocks, class splits): the embedding gradient of a
  block of rows, summed over the split's classes in registers. The splits are then reduced
  either by `tl.atomic_add` into one (N, D) fp32 tensor (the default: fast, the order of the
  additions, and so the last bits, vary from run to run) or, when
  `torch.are_deterministic_algorithms_enabled()`, written to a (splits, N, D) buffer that
  torch sums in a fixed order (bitwise reproducible, splits x N x D x 4 bytes more memory).
- `_grad_weight_kernel`, grid (class tiles,): the gradient of a tile of class rows, summed
  over every row block in registers, the normalisation's radial part removed as
  `_remove_radial_part` does, written to the weight gradient (the taking-part rows), or,
  with a fused SGD update, applied to the rows at once (weight decay, momentum, Nesterov,
  lr as torch.optim.SGD does, dampening 0) so that no weight-sized gradient ever exists.

Compiler rules kept although the interpreter does not enforce them: every block size is a
power of two, every `tl.dot` operand dimension is at least 16, and there is no Python
control flow on tensor values (only on constexprs and scalar arguments).

Under TRITON_INTERPRET=1 (CPU tensors) the interpreter multiplies bfloat16 operands as
their raw 16-bit patterns, so there (`INTERPRET`) half operands are rounded to their dtype
and then multiplied as float32: the same products (a product of two bf16 or fp16 numbers is
exact in fp32), accumulated in fp32 as on the GPU. The interpreter also rounds fp32 to
bf16 by truncation rather than to nearest; tests state tolerances that cover both.

Import this module only when the kernels are needed: `triton.jit` reads TRITON_INTERPRET at
import time.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

TORCH_TO_TRITON = {
    torch.float32: tl.float32,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
}
SUPPORTED_MATMUL_DTYPES = tuple(TORCH_TO_TRITON)


@dataclass(frozen=True)
class TileConfig:
    """Block sizes and launch settings; every block a power of two, at least 16."""

    block_c: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    # Programs the forward and the embedding-gradient kernel aim for (row blocks x splits):
    # a few per SM on a GPU; few on the interpreter, which runs programs one after another.
    target_programs: int = 0

    def check(self) -> None:
        for name in ("block_c", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"TileConfig.{name}: must be a power of two >= 16, got {value}")


@dataclass
class SGDUpdate:
    """The SGD step that the weight-gradient kernel applies to each tile (fused update).

    lr, momentum, weight_decay and nesterov as torch.optim.SGD takes them (dampening 0);
    `momentum_buffer` (C_local, D) float32 is updated in place (None when momentum is 0).
    """

    lr: float
    momentum: float
    weight_decay: float
    nesterov: bool
    momentum_buffer: Tensor | None


def default_tiles(device: torch.device) -> TileConfig:
    """Block sizes for `device`: small on the CPU interpreter, larger on a GPU.

    The GPU values are a starting point, not yet measured (see README, head kernel).
    """
    if device.type != "cuda":
        # Large tiles: the interpreter pays per program and per operation, not per element.
        return TileConfig(block_c=128, block_n=32, num_warps=1, num_stages=1, target_programs=4)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    return TileConfig(
        block_c=64, block_n=64, num_warps=8, num_stages=2, target_programs=4 * num_sms
    )


# ---------------------------------------------------------------- device code


@triton.jit
def _dot(a, b, acc, MM_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b with both operands rounded to MM_DTYPE, fp32 accumulation."""
    a = a.to(MM_DTYPE)
    b = b.to(MM_DTYPE)
    if UPCAST:  # the interpreter's dot would multiply bf16 bit patterns (module docstring)
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION, out_dtype=tl.float32)


@triton.jit
def _tile_logits(
    w, e_t, inv_norm, offs_c, c_mask, target, scale,
    BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
    MM_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """s * cos (BLOCK_C, BLOCK_N) of raw rows w (BLOCK_C, D_PAD) and embeddings e_t (D_PAD,
    BLOCK_N); the rows' targets and padded classes are -inf."""
    acc = tl.zeros((BLOCK_C, BLOCK_N), dtype=tl.float32)
    acc = _dot(w, e_t, acc, MM_DTYPE, INPUT_PRECISION, UPCAST)
    logits = acc * (scale * inv_norm)[:, None]
    masked = (offs_c[:, None] == target[None, :]) | (c_mask[:, None] == 0)
    return tl.where(masked, float("-inf"), logits)


@triton.jit
def _load_rows(W, ROW_INDEX, offs_c, c_mask, offs_d, d_mask, stride_wc, HAS_INDEX: tl.constexpr):
    """Raw class rows (BLOCK_C, D_PAD) of taking-part positions offs_c (0 outside)."""
    if HAS_INDEX:
        rows = tl.load(ROW_INDEX + offs_c, mask=c_mask, other=0)
    else:
        rows = offs_c
    ptrs = W + rows.to(tl.int64)[:, None] * stride_wc + offs_d[None, :]
    return tl.load(ptrs, mask=c_mask[:, None] & d_mask[None, :], other=0.0), rows


@triton.jit
def _row_block(E, TARGET, num_rows, dim, stride_en, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr):
    """This program's rows: offsets and mask, the padded dimension's offsets and mask, the
    embeddings transposed (D_PAD, BLOCK_N), loaded once for every class tile, and targets."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < num_rows
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < dim
    e_t = tl.load(
        E + offs_n[None, :] * stride_en + offs_d[:, None],
        mask=n_mask[None, :] & d_mask[:, None],
        other=0.0,
    )
    target = tl.load(TARGET + offs_n, mask=n_mask, other=-1)
    return offs_n, n_mask, offs_d, d_mask, e_t, target


@triton.jit
def _forward_kernel(
    W, ROW_INDEX, E, INV_NORM, TARGET, PART_MAX, PART_SUM,
    num_classes, num_rows, dim, stride_wc, stride_en, scale, tiles_per_split,
    HAS_INDEX: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr, MM_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    pid_s = tl.program_id(1)
    offs_n, n_mask, offs_d, d_mask, e_t, target = _row_block(
        E, TARGET, num_rows, dim, stride_en, BLOCK_N, D_PAD
    )
    row_max = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for t in range(0, tiles_per_split):
        offs_c = (pid_s * tiles_per_split + t) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_mask = offs_c < num_classes
        w, rows = _load_rows(W, ROW_INDEX, offs_c, c_mask, offs_d, d_mask, stride_wc, HAS_INDEX)
        inv_norm = tl.load(INV_NORM + offs_c, mask=c_mask, other=0.0)
        logits = _tile_logits(
            w, e_t, inv_norm, offs_c, c_mask, target, scale,
            BLOCK_C, BLOCK_N, MM_DTYPE, INPUT_PRECISION, UPCAST,
        )  # fmt: skip
        new_max = tl.maximum(row_max, tl.max(logits, axis=0))
        # A row whose entries so far are all masked has max -inf: shift by 0, not by -inf.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        row_sum = row_sum * tl.exp(row_max - shift) + tl.sum(tl.exp(logits - shift[None, :]), 0)
        row_max = new_max
    out = pid_s * num_rows + offs_n
    tl.store(PART_MAX + out, row_max, mask=n_mask)
    tl.store(PART_SUM + out, row_sum, mask=n_mask)


@triton.jit
def _grad_logits(
    w, e_t, inv_norm, offs_c, c_mask, target, shift, grad_scale, scale,
    BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
    MM_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """d loss / d <w_j, e_i> (BLOCK_C, BLOCK_N): exp(logit - max) * g * s / |w_j|."""
    logits = _tile_logits(
        w, e_t, inv_norm, offs_c, c_mask, target, scale,
        BLOCK_C, BLOCK_N, MM_DTYPE, INPUT_PRECISION, UPCAST,
    )  # fmt: skip
    return tl.exp(logits - shift[None, :]) * grad_scale[None, :] * inv_norm[:, None]


@triton.jit
def _grad_embeddings_kernel(
    W, ROW_INDEX, E, INV_NORM, TARGET, SHIFT, GRAD_SCALE, GRAD_E,
    num_classes, num_rows, dim, stride_wc, stride_en, scale, tiles_per_split,
    HAS_INDEX: tl.constexpr, ATOMIC: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, MM_DTYPE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid_s = tl.program_id(1)
    offs_n, n_mask, offs_d, d_mask, e_t, target = _row_block(
        E, TARGET, num_rows, dim, stride_en, BLOCK_N, D_PAD
    )
    shift = tl.load(SHIFT + offs_n, mask=n_mask, other=0.0)
    grad_scale = tl.load(GRAD_SCALE + offs_n, mask=n_mask, other=0.0)
    acc = tl.zeros((BLOCK_N, D_PAD), dtype=tl.float32)
    for t in range(0, tiles_per_split):
        offs_c = (pid_s * tiles_per_split + t) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_mask = offs_c < num_classes
        w, rows = _load_rows(W, ROW_INDEX, offs_c, c_mask, offs_d, d_mask, stride_wc, HAS_INDEX)
        inv_norm = tl.load(INV_NORM + offs_c, mask=c_mask, other=0.0)
        grad = _grad_logits(
            w, e_t, inv_norm, offs_c, c_mask, target, shift, grad_scale, scale,
            BLOCK_C, BLOCK_N, MM_DTYPE, INPUT_PRECISION, UPCAST,
        )  # fmt: skip
        acc = _dot(tl.trans(grad), w, acc, MM_DTYPE, INPUT_PRECISION, UPCAST)
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
    BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, MM_DTYPE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid_c = tl.program_id(0)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < num_classes
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < dim
    w, rows = _load_rows(W, ROW_INDEX, offs_c, c_mask, offs_d, d_mask, stride_wc, HAS_INDEX)
    inv_norm = tl.load(INV_NORM + offs_c, mask=c_mask, other=0.0)
    acc = tl.zeros((BLOCK_C, D_PAD), dtype=tl.float32)
    for n_start in range(0, num_rows, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < num_rows
        e = tl.load(
            E + offs_n[:, None] * stride_en + offs_d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # (BLOCK_N, D_PAD)
        target = tl.load(TARGET + offs_n, mask=n_mask, other=-1)
        shift = tl.load(SHIFT + offs_n, mask=n_mask, other=0.0)
        grad_scale = tl.load(GRAD_SCALE + offs_n, mask=n_mask, other=0.0)
        grad = _grad_logits(
            w, tl.trans(e), inv_norm, offs_c, c_mask, target, shift, grad_scale, scale,
            BLOCK_C, BLOCK_N, MM_DTYPE, INPUT_PRECISION, UPCAST,
        )  # fmt: skip
        acc = _dot(grad, e, acc, MM_DTYPE, INPUT_PRECISION, UPCAST)
    # Remove the radial part: g - w <w, g> / |w|^2 (acc already holds g / |w|); rows shorter
    # than the eps (normalised by the eps, not by their norm) keep g as it is.
    w32 = w.to(tl.float32)
    dots = tl.sum(w32 * acc, axis=1)
    coefficient = tl.where(inv_norm < norm_limit, dots * inv_norm * inv_norm, 0.0)
    grad_w = acc - w32 * coefficient[:, None]
    mask = c_mask[:, None] & d_mask[None, :]
    if HAS_EXTRA:  # the target rows' share (computed by torch), one slot per distinct row
        slot = tl.load(EXTRA_SLOT + offs_c, mask=c_mask, other=-1)
        extra = tl.load(
            EXTRA + slot.to(tl.int64)[:, None] * dim + offs_d[None, :],
            mask=mask & (slot[:, None] >= 0),
            other=0.0,
        )
        grad_w = grad_w + extra
    row_offsets = rows.to(tl.int64)[:, None]
    if FUSED:
        # torch.optim.SGD (dampening 0): d = g + wd * w; buf = momentum * buf + d (buf is
        # zero before the first step, which makes the first buf = d, as torch sets it);
        # d = d + momentum * buf (Nesterov) or buf; w = w - lr * d.
        step = grad_w + weight_decay * w32
        if HAS_MOMENTUM:
            buf_ptrs = BUF + row_offsets * dim + offs_d[None, :]
            buf = momentum * tl.load(buf_ptrs, mask=mask, other=0.0) + step
            tl.store(buf_ptrs, buf, mask=mask)
            if NESTEROV:
                step = step + momentum * buf
            else:
                step = buf
        new_w = w32 - lr * step
        w_ptrs = W + row_offsets * stride_wc + offs_d[None, :]
        tl.store(w_ptrs, new_w.to(W.dtype.element_ty), mask=mask)
    else:
        g_ptrs = GRAD_W + row_offsets * stride_gc + offs_d[None, :]
        tl.store(g_ptrs, grad_w.to(GRAD_W.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- host wrappers


def _launch_settings(norm_embeddings: Tensor, matmul_dtype: torch.dtype, tiles: TileConfig) -> dict:
    if matmul_dtype not in TORCH_TO_TRITON:
        raise ValueError(f"triton head kernel: matmul dtype {matmul_dtype} is not supported")
    if matmul_dtype == torch.float32 and norm_embeddings.is_cuda:
        # As torch's own fp32 matmuls in the reference path: TF32 only when allowed.
        precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    else:
        precision = "ieee"
    return {
        "MM_DTYPE": TORCH_TO_TRITON[matmul_dtype],
        "INPUT_PRECISION": precision,
        "UPCAST": INTERPRET and matmul_dtype != torch.float32,
        "BLOCK_C": tiles.block_c,
        "BLOCK_N": tiles.block_n,
        "D_PAD": max(16, triton.next_power_of_2(norm_embeddings.shape[1])),
    }


def _splits(num_tiles: int, num_row_blocks: int, tiles: TileConfig) -> tuple[int, int]:
    """(number of class splits, class tiles per split) for the row-block x split grids."""
    wanted = max(1, tiles.target_programs // max(num_row_blocks, 1))
    num_splits = max(1, min(num_tiles, wanted))
    per_split = triton.cdiv(num_tiles, num_splits)
    return triton.cdiv(num_tiles, per_split), per_split


def inverse_norms(weight: Tensor, row_index: Tensor | None, eps: float) -> Tensor:
    """1 / max(|w_j|, eps) (K,) in fp32 of the taking-part rows: one pass per step."""
    rows = weight if row_index is None else weight.index_select(0, row_index)
    return 1.0 / torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32).clamp_min(eps)


def _combine(part_max: Tensor, part_sum: Tensor) -> tuple[Tensor, Tensor]:
    """Fold per-split statistics (splits, N) into the row max and sum-exp (N,)."""
    row_max = part_max.amax(dim=0)
    shift = torch.where(torch.isfinite(row_max), row_max, 0.0)
    return row_max, (part_sum * torch.exp(part_max - shift)).sum(dim=0)


def class_stats(
    norm_embeddings: Tensor,
    weight: Tensor,
    row_index: Tensor | None,
    inv_norm: Tensor,
    target_pos: Tensor,
    scale: float,
    matmul_dtype: torch.dtype,
    tiles: TileConfig,
) -> tuple[Tensor, Tensor]:
    """Max and sum-exp (N,) fp32 of the non-target logits over the taking-part classes.

    `norm_embeddings` (N, D) fp32 normalised; `weight` (C_local, D) raw rows; `row_index` (K,)
    the taking-part rows or None for all; `inv_norm` (K,) from `inverse_norms`;
    `target_pos` (N,) each row's target as a taking-part position, -1 where not owned.
    A row with no non-target class gets max -inf and sum 0.
    """
    num_rows = norm_embeddings.shape[0]
    num_classes = inv_norm.shape[0]
    if weight.stride(1) != 1 or not norm_embeddings.is_contiguous():
        raise ValueError("triton head kernel: the weight's rows and the embeddings must be dense")
    settings = _launch_settings(norm_embeddings, matmul_dtype, tiles)
    row_blocks = triton.cdiv(num_rows, tiles.block_n)
    num_splits, per_split = _splits(triton.cdiv(num_classes, tiles.block_c), row_blocks, tiles)
    part_max = norm_embeddings.new_empty((num_splits, num_rows), dtype=torch.float32)
    part_sum = torch.empty_like(part_max)
    _forward_kernel[(row_blocks, num_splits)](
        weight, row_index if row_index is not None else inv_norm, norm_embeddings, inv_norm,
        target_pos.to(torch.int32), part_max, part_sum,
        num_classes, num_rows, weight.shape[1], weight.stride(0), norm_embeddings.stride(0),
        float(scale), per_split, HAS_INDEX=row_index is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **settings,
    )  # fmt: skip
    return _combine(part_max, part_sum)


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
    target_grad: tuple[Tensor, Tensor] | None = None,
    sgd: SGDUpdate | None = None,
    norm_limit: float = math.inf,
) -> tuple[Tensor, Tensor | None]:
    """Gradients of sum(grad_sumexp * sum-exp) from `class_stats`'s inputs.

    Returns (d / d norm_embeddings (N, D) fp32, d / d weight (C_local, D) in the weight's
    dtype, zero outside the taking-part rows, or None when `want_weight` is False or `sgd`
    is given). With `sgd`, each tile's gradient - plus the target rows' share
    `target_grad` = (distinct weight rows (U,), their gradient (U, D) fp32) - is applied to
    `weight` in place as that SGD step, and no gradient is returned for the weight.
    `norm_limit` = 1 / eps: rows whose inverse norm reaches it keep their radial part.
    The embedding gradient is reduced with atomics, or deterministically when
    torch.are_deterministic_algorithms_enabled().
    """
    num_rows, dim = norm_embeddings.shape
    num_classes = inv_norm.shape[0]
    settings = _launch_settings(norm_embeddings, matmul_dtype, tiles)
    launch = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    target_pos = target_pos.to(torch.int32)
    shift = torch.where(torch.isfinite(row_max), row_max, 0.0).float().contiguous()
    grad_scale = (grad_sumexp.float() * scale).contiguous()  # d sum-exp / d cos = s exp(.)
    index_arg = row_index if row_index is not None else inv_norm
    num_tiles = triton.cdiv(num_classes, tiles.block_c)
    row_blocks = triton.cdiv(num_rows, tiles.block_n)

    # The embedding gradient first: a fused update below overwrites the weight.
    num_splits, per_split = _splits(num_tiles, row_blocks, tiles)
    atomic = not torch.are_deterministic_algorithms_enabled()
    shape = (num_rows, dim) if atomic else (num_splits, num_rows, dim)
    grad_e = norm_embeddings.new_zeros(shape, dtype=torch.float32)
    _grad_embeddings_kernel[(row_blocks, num_splits)](
        weight, index_arg, norm_embeddings, inv_norm, target_pos, shift, grad_scale, grad_e,
        num_classes, num_rows, dim, weight.stride(0), norm_embeddings.stride(0), float(scale),
        per_split, HAS_INDEX=row_index is not None, ATOMIC=atomic, **launch, **settings,
    )  # fmt: skip
    if not atomic:
        grad_e = grad_e.sum(dim=0)

    if not want_weight and sgd is None:
        return grad_e, None
    grad_w = None
    if sgd is None:
        grad_w = torch.empty_like(weight) if row_index is None else torch.zeros_like(weight)
    extra, extra_slot = inv_norm, target_pos  # placeholders, unread without HAS_EXTRA
    if sgd is not None and target_grad is not None and target_grad[0].numel() > 0:
        rows, extra = target_grad
        positions = rows if row_index is None else torch.searchsorted(row_index, rows)
        extra_slot = torch.full((num_classes,), -1, dtype=torch.int32, device=weight.device)
        extra_slot[positions] = torch.arange(rows.numel(), dtype=torch.int32, device=rows.device)
        extra = extra.float().contiguous()
    has_extra = extra is not inv_norm
    buf = sgd.momentum_buffer if sgd is not None and sgd.momentum_buffer is not None else None
    _grad_weight_kernel[(num_tiles,)](
        weight, index_arg, norm_embeddings, inv_norm, target_pos, shift, grad_scale,
        grad_w if grad_w is not None else weight, extra, extra_slot,
        buf if buf is not None else inv_norm,
        num_classes, num_rows, dim, weight.stride(0), norm_embeddings.stride(0),
        grad_w.stride(0) if grad_w is not None else 0, float(scale), float(norm_limit),
        float(sgd.lr) if sgd else 0.0, float(sgd.momentum) if sgd else 0.0,
        float(sgd.weight_decay) if sgd else 0.0,
        HAS_INDEX=row_index is not None, FUSED=sgd is not None, HAS_EXTRA=has_extra,
        HAS_MOMENTUM=buf is not None, NESTEROV=bool(sgd and sgd.nesterov), **launch, **settings,
    )  # fmt: skip
    return grad_e, grad_w
