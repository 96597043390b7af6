"""Device code the head's Triton kernels share: the K-loop of raw dot products between
embeddings and class rows, the logits and their gradient from it, and the epilogue that
turns a tile of class-row gradients into stored gradients or an SGD step.

Compiler rules kept although the interpreter does not enforce them: every block size is a
power of two, every `tl.dot` operand dimension is at least 16, and there is no Python
control flow on tensor values (only on constexprs and scalar arguments).

Under TRITON_INTERPRET=1 (CPU tensors) the interpreter multiplies bfloat16 operands as
their raw 16-bit patterns, so there (`UPCAST`) half operands are rounded to their dtype
and then multiplied as float32: the same products (a product of two bf16 or fp16 numbers is
exact in fp32), accumulated in fp32 as on the GPU. The interpreter also rounds fp32 to
bf16 by truncation rather than to nearest (the class rows, rounded in the kernel); tests
state tolerances that cover both.

Import this module only when the kernels are needed: `triton.jit` reads TRITON_INTERPRET at
import time.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def _class_block(
    ROW_INDEX, INV_NORM, first, num_classes, HAS_INDEX: tl.constexpr, BLOCK_C: tl.constexpr
):
    """The tile of BLOCK_C classes from position `first`: positions, their mask, their rows
    of the weight (int64, through ROW_INDEX with partial FC; 0 outside) and their inverse
    norms."""
    offs_c = first + tl.arange(0, BLOCK_C)
    c_mask = offs_c < num_classes
    if HAS_INDEX:  # partial FC: position -> row of the weight
        rows = tl.load(ROW_INDEX + offs_c, mask=c_mask, other=0).to(tl.int64)
    else:
        rows = offs_c.to(tl.int64)
    inv_norm = tl.load(INV_NORM + offs_c, mask=c_mask, other=0.0)
    return offs_c, c_mask, rows, inv_norm


@triton.jit
def _raw_dots(
    W, E, rows, c_mask, offs_n, n_mask, dim, stride_wc, stride_en,
    BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D_PAD: tl.constexpr,
    MM_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """<e_i, w_j> (BLOCK_N, BLOCK_C) of embeddings and raw class rows, summed in fp32 over
    the dimension BLOCK_D at a time: only (BLOCK_N + BLOCK_C) x BLOCK_D operands per step."""
    acc = tl.zeros((BLOCK_N, BLOCK_C), dtype=tl.float32)
    e_ptrs = E + offs_n[:, None] * stride_en
    w_ptrs = W + rows[None, :] * stride_wc
    for d_start in range(0, D_PAD, BLOCK_D):
        offs_d = d_start + tl.arange(0, BLOCK_D)
        d_mask = offs_d < dim
        e = tl.load(e_ptrs + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        w_t = tl.load(w_ptrs + offs_d[:, None], mask=c_mask[None, :] & d_mask[:, None], other=0.0)
        acc = _dot(e, w_t, acc, MM_DTYPE, INPUT_PRECISION, UPCAST)
    return acc


@triton.jit
def _row_block(TARGET, num_rows, BLOCK_N: tl.constexpr):
    """This program's block of rows of the global batch (axis 0 of the grid): their
    positions, mask and target positions (-1 where not owned, and in the padding)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < num_rows
    return offs_n, n_mask, tl.load(TARGET + offs_n, mask=n_mask, other=-1)


@triton.jit
def _tile_dots(
    W, ROW_INDEX, E, INV_NORM, first, num_classes, offs_n, n_mask, dim, stride_wc, stride_en,
    HAS_INDEX: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    D_PAD: tl.constexpr, MM_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """The tile of BLOCK_C classes from position `first` (`_class_block`) and its raw dot
    products with the rows `offs_n` (`_raw_dots`, (BLOCK_N, BLOCK_C))."""
    offs_c, c_mask, rows, inv_norm = _class_block(
        ROW_INDEX, INV_NORM, first, num_classes, HAS_INDEX, BLOCK_C
    )
    raw = _raw_dots(
        W, E, rows, c_mask, offs_n, n_mask, dim, stride_wc, stride_en,
        BLOCK_C, BLOCK_N, BLOCK_D, D_PAD, MM_DTYPE, INPUT_PRECISION, UPCAST,
    )  # fmt: skip
    return offs_c, c_mask, rows, inv_norm, raw


@triton.jit
def _logits(raw, inv_norm, offs_c, c_mask, target, scale):
    """s * cos (BLOCK_N, BLOCK_C) from raw dot products; each row's target and the padded
    classes are -inf."""
    # Padded classes through a per-class bias rather than a second (BLOCK_N, BLOCK_C) mask.
    bias = tl.where(c_mask, 0.0, float("-inf"))
    logits = raw * (scale * inv_norm)[None, :] + bias[None, :]
    return tl.where(target[:, None] == offs_c[None, :], float("-inf"), logits)


@triton.jit
def _grad_dots(raw, inv_norm, offs_c, c_mask, target, shift, grad_scale, scale):
    """d loss / d <e_i, w_j> (BLOCK_N, BLOCK_C): exp(logit - max) * g * s / |w_j|."""
    logits = _logits(raw, inv_norm, offs_c, c_mask, target, scale)
    return tl.exp(logits - shift[:, None]) * grad_scale[:, None] * inv_norm[None, :]


@triton.jit
def _finish_rows(
    acc_t, coefficient, W, GRAD_W, EXTRA, BUF, GATE, rows, c_mask, slot, dim,
    stride_wc, stride_gc, lr, momentum, weight_decay,
    FUSED: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr, HAS_GATE: tl.constexpr, LR_IN_MEMORY: tl.constexpr,
    D_PAD: tl.constexpr,
):  # fmt: skip
    """The tile's rows, transposed (D_PAD, BLOCK_C): the gradient acc_t (g / |w|) less its
    radial part, plus the target rows' share, stored or applied as the SGD step (where the
    gate, if any, is not 0). `lr` is the rate, or with LR_IN_MEMORY where it is (a float32
    on the device: a captured step's, which a replay does not pass anew). Returns the rows
    as they are now, fp32 (D_PAD, BLOCK_C)."""
    offs_d = tl.arange(0, D_PAD)
    mask = c_mask[None, :] & (offs_d < dim)[:, None]
    w_ptrs = W + rows[None, :] * stride_wc + offs_d[:, None]
    w32 = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
    grad_w = acc_t - w32 * coefficient[None, :]
    if HAS_EXTRA:  # the target rows' share (computed by torch), one slot per target row
        extra_ptrs = EXTRA + slot.to(tl.int64)[None, :] * dim + offs_d[:, None]
        grad_w += tl.load(extra_ptrs, mask=mask & (slot[None, :] >= 0), other=0.0)
    if FUSED:
        if HAS_GATE:  # a non-finite loss (train_step's gate): nothing is stored
            mask = mask & (tl.load(GATE) != 0)
        # torch.optim.SGD (dampening 0): d = g + wd * w; buf = momentum * buf + d (buf is
        # zero before the first step, which makes the first buf = d, as torch sets it);
        # d = d + momentum * buf (Nesterov) or buf; w = w - lr * d.
        step = grad_w + weight_decay * w32
        if HAS_MOMENTUM:
            buf_ptrs = BUF + rows[None, :] * dim + offs_d[:, None]
            buf = momentum * tl.load(buf_ptrs, mask=mask, other=0.0) + step
            tl.store(buf_ptrs, buf, mask=mask)
            if NESTEROV:
                step = step + momentum * buf
            else:
                step = buf
        if LR_IN_MEMORY:
            rate = tl.load(lr)
        else:
            rate = lr
        stepped = (w32 - rate * step).to(W.dtype.element_ty)
        tl.store(w_ptrs, stepped, mask=mask)
        w32 = tl.where(mask, stepped.to(tl.float32), w32)
    else:
        g_ptrs = GRAD_W + rows[None, :] * stride_gc + offs_d[:, None]
        tl.store(g_ptrs, grad_w.to(GRAD_W.dtype.element_ty), mask=mask)
    return w32
