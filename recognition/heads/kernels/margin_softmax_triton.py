"""Triton kernels for the local part of the sharded margin softmax, and their host wrappers.

What they compute is what `LocalClassStats` in local_stats.py computes (that module
stays the reference): over the classes of this rank that take part (all of them, or the
partial-FC rows `row_index`), the max and sum-exp of the non-target logits s * <w_j, e_i> /
|w_j| of every row i of the global batch, and in backward the gradients of the sum-exp with
respect to the normalised embeddings and to the raw class rows. The target cosine, the
margin and the collectives stay in margin_softmax.py.

Forward (`class_stats`): a grid of (row blocks, class splits). Each program walks its split
of the classes BLOCK_C at a time; for each tile, the logits (BLOCK_N, BLOCK_C) are summed
over the embedding dimension BLOCK_D at a time (`_raw_dots`: a K-loop with fp32
accumulation, operands in the matmul dtype - fp32, bf16 or fp16 - the embeddings rounded to
it once on the host, as the torch path rounds them, the raw class rows in the kernel), each
class scaled by s / |w| from inverse norms computed once per step (no normalised copy of the
shard), the row's target and the padding masked to -inf, then an online max / sum-exp in
fp32. Each split writes its partial statistics (splits, N); a second small step (`_combine`)
folds the splits together, so that one row of statistics never serialises the whole shard
onto one program.

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

Tiles (`gpu_tiles`, by operand kind and D padded to a power of two; `TileConfig` checks
them when made). The backward's full-width fp32 accumulators, BLOCK_N x D_PAD and D_PAD x
BLOCK_C, take most of the 255 registers a thread may have, so their tiles narrow as D
grows; the forward's tile does not depend on D. Chosen from what ptxas reports when the
kernels are compiled ahead of time for sm_90 (H100) by `python -m
benchmarks.head_kernel_resources` (every launch the wrappers make: with and without the row
index, atomic and deterministic, plain and fused with or without momentum, Nesterov and the
target rows' share; fp32 weights, N = 1024): largest dynamic shared memory in bytes / most
registers per thread over those variants, with triton 3.8. No variant spills with triton
3.8 or with 3.6 (torch 2.11; its ptxas allots a few registers more or fewer), and the
H100 allows 232,448 bytes per block. Operands in bf16 or fp16 (the same figures), in tf32,
and in fp32 without TF32 (tl.dot on the CUDA cores):

    D     kernel           tiles CxNxD, warps, stages      bf16/fp16         tf32
    any   forward          128x128x32 w8 s3                65,536 / 222      98,304 / 210
    128   grad_embeddings  64x128x32 w8 s2                 65,536 / 222      65,536 / 227
    128   grad_weight      64x64x64 w8 s2, epilogue 2      40,960 / 203      65,536 / 227
    256   grad_embeddings  64x64x64 w8 s2                  65,536 / 230      81,920 / 227
    256   grad_weight      64x64x32 w8 s2, epilogue 4      40,960 / 239      81,920 / 255
    512   grad_embeddings  32x64x64 w8 s2                 131,072 / 255     131,072 / 255
    512   grad_weight      32x64x64 w8 s2, epilogue 4      69,632 / 234     139,264 / 255
    1024  grad_embeddings  16x32x64 w8 s2                  65,536 / 255      67,584 / 255
    1024  grad_weight      16x32x64 w8 s2, epilogue 4      66,560 / 169
                           16x16x64 w8 s2, epilogue 4 (tf32)                 66,560 / 176

    fp32: forward 64x64x16 w4 s2 (8,192 / 168); grad_embeddings 16x32x32 w8 s2 (D <= 512:
    at most 34,816 / 204), 16x16x32 at D = 1024 (4,096 / 188); grad_weight 16x32x32 w8 s2,
    epilogue 4 (D <= 512: at most 67,584 / 127), 16x16x16 w8 s1 at D = 1024 (66,560 / 179).

Wider tiles spill (e.g. at D = 512: grad_embeddings 64x64 and grad_weight 64x64, 16 to 340
bytes), and so did the first version of these kernels, which held whole D_PAD-wide operand
tiles: at D = 512, bf16, 64x64 tiles, 2 stages, the backward kernels needed 262,912 and
270,592 bytes of shared memory (past the H100's limit: they could not launch) and spilled
1,384 to 3,480 bytes. These tiles are chosen for what fits, and bound what is tried: on a
GPU, tile_tuning.py times them and their neighbours of no larger footprint at the run's
shapes and keeps the fastest (`default_tiles` stays the table's).
tests/test_head_kernel_compile.py checks D = 512 with bf16 operands in CI.

Compiler rules kept although the interpreter does not enforce them: every block size is a
power of two, every `tl.dot` operand dimension is at least 16, and there is no Python
control flow on tensor values (only on constexprs and scalar arguments).

Under TRITON_INTERPRET=1 (CPU tensors) the interpreter multiplies bfloat16 operands as
their raw 16-bit patterns, so there (`INTERPRET`) half operands are rounded to their dtype
and then multiplied as float32: the same products (a product of two bf16 or fp16 numbers is
exact in fp32), accumulated in fp32 as on the GPU. The interpreter also rounds fp32 to
bf16 by truncation rather than to nearest (the class rows, rounded in the kernel); tests
state tolerances that cover both. On the CPU the tiles are the interpreter's: large, the
whole dimension in one step.

Import this module only when the kernels are needed: `triton.jit` reads TRITON_INTERPRET at
import time.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from recognition.compat import interpreter_scalars_as_indices

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if INTERPRET:
    interpreter_scalars_as_indices()  # Triton 3.6's interpreter under NumPy >= 2.4

TORCH_TO_TRITON = {
    torch.float32: tl.float32,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
}


@dataclass(frozen=True)
class KernelTiles:
    """Block sizes and launch settings of one kernel.

    block_c classes by block_n rows of logits per tile, summed over the embedding dimension
    block_d at a time (clamped to the padded dimension); num_warps and num_stages as
    Triton takes them. Block sizes are powers of two, at least 16 (tl.dot's smallest tile).
    """

    block_c: int
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int

    def check(self, name: str) -> None:
        """Raise ValueError naming `name`.field when a value breaks the compiler's rules."""
        for field in ("block_c", "block_n", "block_d"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"{name}.{field}: must be a power of two >= 16, got {value!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"{name}.num_warps: must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"{name}.num_stages: must be an integer >= 1, got {self.num_stages!r}")


@dataclass(frozen=True)
class TileConfig:
    """The tiles of the three kernels; checked when made (a bad value raises ValueError)."""

    forward: KernelTiles
    grad_embeddings: KernelTiles
    grad_weight: KernelTiles
    # Programs the forward and the embedding-gradient kernel aim for (row blocks x splits):
    # a few per SM on a GPU; few on the interpreter, which runs programs one after another.
    target_programs: int = 0
    # Pieces of the weight-gradient kernel's epilogue (1, 2 or 4; fewer where a piece would
    # be narrower than 16; see that kernel).
    epilogue_splits: int = 1

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        for name in ("forward", "grad_embeddings", "grad_weight"):
            tiles = getattr(self, name)
            if not isinstance(tiles, KernelTiles):
                raise ValueError(f"TileConfig.{name}: must be a KernelTiles, got {tiles!r}")
            tiles.check(f"TileConfig.{name}")
        if self.epilogue_splits not in (1, 2, 4):
            raise ValueError(
                f"TileConfig.epilogue_splits: must be 1, 2 or 4, got {self.epilogue_splits!r}"
            )
        if not isinstance(self.target_programs, int) or self.target_programs < 0:
            raise ValueError(
                f"TileConfig.target_programs: must be an integer >= 0, got {self.target_programs!r}"
            )


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


# The interpreter pays per program and per operation, not per element: large tiles, the
# whole (padded) dimension in one step, few programs.
INTERPRETER_TILES = TileConfig(
    forward=KernelTiles(block_c=128, block_n=32, block_d=1024, num_warps=1, num_stages=1),
    grad_embeddings=KernelTiles(block_c=128, block_n=32, block_d=1024, num_warps=1, num_stages=1),
    grad_weight=KernelTiles(block_c=128, block_n=32, block_d=1024, num_warps=1, num_stages=1),
    target_programs=4,
)


# GPU tiles by operand kind and padded embedding dimension (see the module docstring for
# what ptxas reports for them on sm_90). The backward keeps a full-width fp32 accumulator per
# program - (rows, D) for the embedding gradient, (D, classes) for the weight gradient - so
# its tiles narrow as D grows; the forward sums over D in BLOCK_D steps and does not depend
# on it. "half": bf16 or fp16 operands, "tf32": fp32 operands on the tensor cores (twice the
# bytes per operand tile), "fp32": without TF32, tl.dot on the CUDA cores, which needs far
# more registers.
_TENSOR_CORE_FORWARD = KernelTiles(block_c=128, block_n=128, block_d=32, num_warps=8, num_stages=3)
_HALF_BACKWARD = {  # D_PAD: (grad_embeddings, grad_weight, epilogue_splits)
    128: (KernelTiles(64, 128, 32, 8, 2), KernelTiles(64, 64, 64, 8, 2), 2),
    256: (KernelTiles(64, 64, 64, 8, 2), KernelTiles(64, 64, 32, 8, 2), 4),
    512: (KernelTiles(32, 64, 64, 8, 2), KernelTiles(32, 64, 64, 8, 2), 4),
    1024: (KernelTiles(16, 32, 64, 8, 2), KernelTiles(16, 32, 64, 8, 2), 4),
}
_GPU_TILES = {
    "half": (_TENSOR_CORE_FORWARD, _HALF_BACKWARD),
    "tf32": (
        _TENSOR_CORE_FORWARD,
        {**_HALF_BACKWARD, 1024: (*_HALF_BACKWARD[1024][:1], KernelTiles(16, 16, 64, 8, 2), 4)},
    ),
    "fp32": (
        KernelTiles(block_c=64, block_n=64, block_d=16, num_warps=4, num_stages=2),
        {
            128: (KernelTiles(16, 32, 32, 8, 2), KernelTiles(16, 32, 32, 8, 2), 4),
            256: (KernelTiles(16, 32, 32, 8, 2), KernelTiles(16, 32, 32, 8, 2), 4),
            512: (KernelTiles(16, 32, 32, 8, 2), KernelTiles(16, 32, 32, 8, 2), 4),
            1024: (KernelTiles(16, 16, 32, 8, 2), KernelTiles(16, 16, 16, 8, 1), 4),
        },
    ),
}
OPERAND_KINDS = tuple(_GPU_TILES)


@functools.lru_cache(maxsize=64)
def gpu_tiles(dim: int, num_sms: int, operands: str = "half") -> TileConfig:
    """Tiles for embeddings of `dim` on a GPU with `num_sms` SMs, for `operands` "half" (bf16
    or fp16), "tf32" or "fp32" (fp32 without TF32). Embeddings wider than 1024 get the tiles
    of 1024, with which the backward spills registers on sm_90 (its accumulators are
    full-width)."""
    if operands not in _GPU_TILES:
        raise ValueError(f"gpu_tiles: operands must be one of {OPERAND_KINDS}, got {operands!r}")
    forward, backward = _GPU_TILES[operands]
    grad_embeddings, grad_weight, splits = backward[min(max(padded_dim(dim), 128), 1024)]
    return TileConfig(
        forward=forward,
        grad_embeddings=grad_embeddings,
        grad_weight=grad_weight,
        target_programs=4 * num_sms,
        epilogue_splits=splits,
    )


def default_tiles(device: torch.device, dim: int, matmul_dtype: torch.dtype) -> TileConfig:
    """Tiles for embeddings of `dim` on `device`: the interpreter's on the CPU."""
    if device.type != "cuda":
        return INTERPRETER_TILES
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    if matmul_dtype != torch.float32:
        operands = "half"
    else:
        operands = "tf32" if _input_precision(matmul_dtype, device) == "tf32" else "fp32"
    return gpu_tiles(dim, num_sms, operands)


def _input_precision(matmul_dtype: torch.dtype, device: torch.device) -> str:
    """tl.dot's input precision: as torch's own fp32 matmuls in the reference path, TF32 only
    when allowed (and only on a GPU)."""
    if matmul_dtype == torch.float32 and device.type == "cuda":
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    return "ieee"


def padded_dim(dim: int) -> int:
    """The embedding dimension padded to a power of two (at least 16): the width of the
    backward's accumulators."""
    return max(16, triton.next_power_of_2(dim))


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
def _logits(raw, inv_norm, offs_c, c_mask, target, scale):
    """s * cos (BLOCK_N, BLOCK_C) from raw dot products; each row's target and the padded
    classes are -inf."""
    # Padded classes through a per-class bias rather than a second (BLOCK_N, BLOCK_C) mask.
    bias = tl.where(c_mask, 0.0, float("-inf"))
    logits = raw * (scale * inv_norm)[None, :] + bias[None, :]
    return tl.where(target[:, None] == offs_c[None, :], float("-inf"), logits)


@triton.jit
def _forward_kernel(
    W, ROW_INDEX, E, INV_NORM, TARGET, PART_MAX, PART_SUM,
    num_classes, num_rows, dim, stride_wc, stride_en, scale, tiles_per_split,
    HAS_INDEX: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, D_PAD: tl.constexpr, MM_DTYPE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid_s = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < num_rows
    target = tl.load(TARGET + offs_n, mask=n_mask, other=-1)
    row_max = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for t in range(0, tiles_per_split):
        offs_c, c_mask, rows, inv_norm = _class_block(
            ROW_INDEX, INV_NORM, (pid_s * tiles_per_split + t) * BLOCK_C, num_classes,
            HAS_INDEX, BLOCK_C,
        )  # fmt: skip
        raw = _raw_dots(
            W, E, rows, c_mask, offs_n, n_mask, dim, stride_wc, stride_en,
            BLOCK_C, BLOCK_N, BLOCK_D, D_PAD, MM_DTYPE, INPUT_PRECISION, UPCAST,
        )  # fmt: skip
        logits = _logits(raw, inv_norm, offs_c, c_mask, target, scale)
        new_max = tl.maximum(row_max, tl.max(logits, axis=1))
        # A row whose entries so far are all masked has max -inf: shift by 0, not by -inf.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        row_sum = row_sum * tl.exp(row_max - shift) + tl.sum(tl.exp(logits - shift[:, None]), 1)
        row_max = new_max
    out = pid_s * num_rows + offs_n
    tl.store(PART_MAX + out, row_max, mask=n_mask)
    tl.store(PART_SUM + out, row_sum, mask=n_mask)


@triton.jit
def _grad_dots(raw, inv_norm, offs_c, c_mask, target, shift, grad_scale, scale):
    """d loss / d <e_i, w_j> (BLOCK_N, BLOCK_C): exp(logit - max) * g * s / |w_j|."""
    logits = _logits(raw, inv_norm, offs_c, c_mask, target, scale)
    return tl.exp(logits - shift[:, None]) * grad_scale[:, None] * inv_norm[None, :]


@triton.jit
def _grad_embeddings_kernel(
    W, ROW_INDEX, E, INV_NORM, TARGET, SHIFT, GRAD_SCALE, GRAD_E,
    num_classes, num_rows, dim, stride_wc, stride_en, scale, tiles_per_split,
    HAS_INDEX: tl.constexpr, ATOMIC: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D_PAD: tl.constexpr,
    MM_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid_s = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < num_rows
    target = tl.load(TARGET + offs_n, mask=n_mask, other=-1)
    shift = tl.load(SHIFT + offs_n, mask=n_mask, other=0.0)
    grad_scale = tl.load(GRAD_SCALE + offs_n, mask=n_mask, other=0.0)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < dim
    acc = tl.zeros((BLOCK_N, D_PAD), dtype=tl.float32)
    for t in range(0, tiles_per_split):
        offs_c, c_mask, rows, inv_norm = _class_block(
            ROW_INDEX, INV_NORM, (pid_s * tiles_per_split + t) * BLOCK_C, num_classes,
            HAS_INDEX, BLOCK_C,
        )  # fmt: skip
        raw = _raw_dots(
            W, E, rows, c_mask, offs_n, n_mask, dim, stride_wc, stride_en,
            BLOCK_C, BLOCK_N, BLOCK_D, D_PAD, MM_DTYPE, INPUT_PRECISION, UPCAST,
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
def _halves(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The top and bottom halves (ROWS // 2, COLS) of x (ROWS, COLS)."""
    return tl.split(tl.permute(tl.reshape(x, (2, ROWS // 2, COLS)), (1, 2, 0)))


@triton.jit
def _finish_rows(
    acc_t, d_start, coefficient, W, GRAD_W, EXTRA, BUF, rows, c_mask, slot, dim,
    stride_wc, stride_gc, lr, momentum, weight_decay,
    FUSED: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr, WIDTH: tl.constexpr,
):  # fmt: skip
    """Columns [d_start, d_start + WIDTH) of the tile's rows, transposed (WIDTH, BLOCK_C):
    the gradient acc_t (g / |w|) less its radial part, plus the target rows' share, stored
    or applied as the SGD step."""
    offs_d = d_start + tl.arange(0, WIDTH)
    mask = c_mask[None, :] & (offs_d < dim)[:, None]
    w_ptrs = W + rows[None, :] * stride_wc + offs_d[:, None]
    w32 = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
    grad_w = acc_t - w32 * coefficient[None, :]
    if HAS_EXTRA:  # the target rows' share (computed by torch), one slot per distinct row
        extra_ptrs = EXTRA + slot.to(tl.int64)[None, :] * dim + offs_d[:, None]
        grad_w += tl.load(extra_ptrs, mask=mask & (slot[None, :] >= 0), other=0.0)
    if FUSED:
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
        tl.store(w_ptrs, (w32 - lr * step).to(W.dtype.element_ty), mask=mask)
    else:
        g_ptrs = GRAD_W + rows[None, :] * stride_gc + offs_d[:, None]
        tl.store(g_ptrs, grad_w.to(GRAD_W.dtype.element_ty), mask=mask)


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


# ---------------------------------------------------------------- host wrappers


def _launch_settings(
    norm_embeddings: Tensor, matmul_dtype: torch.dtype, tiles: KernelTiles
) -> dict:
    """The constexprs and launch options of one kernel for these embeddings."""
    if matmul_dtype not in TORCH_TO_TRITON:
        raise ValueError(f"triton head kernel: matmul dtype {matmul_dtype} is not supported")
    d_pad = padded_dim(norm_embeddings.shape[1])
    return {
        "MM_DTYPE": TORCH_TO_TRITON[matmul_dtype],
        "INPUT_PRECISION": _input_precision(matmul_dtype, norm_embeddings.device),
        "UPCAST": INTERPRET and matmul_dtype != torch.float32,
        "BLOCK_C": tiles.block_c,
        "BLOCK_N": tiles.block_n,
        "BLOCK_D": min(tiles.block_d, d_pad),
        "D_PAD": d_pad,
        "num_warps": tiles.num_warps,
        "num_stages": tiles.num_stages,
    }


def _splits(num_tiles: int, num_row_blocks: int, target_programs: int) -> tuple[int, int]:
    """(number of class splits, class tiles per split) for the row-block x split grids."""
    wanted = max(1, target_programs // max(num_row_blocks, 1))
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
    settings = _launch_settings(norm_embeddings, matmul_dtype, tiles.forward)
    # Rounded once here, as the torch path rounds them, rather than in every tile.
    mm_embeddings = norm_embeddings.to(matmul_dtype)
    row_blocks = triton.cdiv(num_rows, tiles.forward.block_n)
    num_tiles = triton.cdiv(num_classes, tiles.forward.block_c)
    num_splits, per_split = _splits(num_tiles, row_blocks, tiles.target_programs)
    part_max = norm_embeddings.new_empty((num_splits, num_rows), dtype=torch.float32)
    part_sum = torch.empty_like(part_max)
    _forward_kernel[(row_blocks, num_splits)](
        weight, row_index if row_index is not None else inv_norm, mm_embeddings, inv_norm,
        target_pos.to(torch.int32), part_max, part_sum,
        num_classes, num_rows, weight.shape[1], weight.stride(0), mm_embeddings.stride(0),
        float(scale), per_split, HAS_INDEX=row_index is not None, **settings,
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
    mm_embeddings = norm_embeddings.to(matmul_dtype)
    target_pos = target_pos.to(torch.int32)
    shift = torch.where(torch.isfinite(row_max), row_max, 0.0).float().contiguous()
    grad_scale = (grad_sumexp.float() * scale).contiguous()  # d sum-exp / d cos = s exp(.)
    index_arg = row_index if row_index is not None else inv_norm

    # The embedding gradient first: a fused update below overwrites the weight.
    settings = _launch_settings(norm_embeddings, matmul_dtype, tiles.grad_embeddings)
    row_blocks = triton.cdiv(num_rows, tiles.grad_embeddings.block_n)
    num_tiles = triton.cdiv(num_classes, tiles.grad_embeddings.block_c)
    num_splits, per_split = _splits(num_tiles, row_blocks, tiles.target_programs)
    atomic = not torch.are_deterministic_algorithms_enabled()
    shape = (num_rows, dim) if atomic else (num_splits, num_rows, dim)
    grad_e = norm_embeddings.new_zeros(shape, dtype=torch.float32)
    _grad_embeddings_kernel[(row_blocks, num_splits)](
        weight, index_arg, mm_embeddings, inv_norm, target_pos, shift, grad_scale, grad_e,
        num_classes, num_rows, dim, weight.stride(0), mm_embeddings.stride(0), float(scale),
        per_split, HAS_INDEX=row_index is not None, ATOMIC=atomic, **settings,
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
    settings = _launch_settings(norm_embeddings, matmul_dtype, tiles.grad_weight)
    _grad_weight_kernel[(triton.cdiv(num_classes, tiles.grad_weight.block_c),)](
        weight, index_arg, mm_embeddings, inv_norm, target_pos, shift, grad_scale,
        grad_w if grad_w is not None else weight, extra, extra_slot,
        buf if buf is not None else inv_norm,
        num_classes, num_rows, dim, weight.stride(0), mm_embeddings.stride(0),
        grad_w.stride(0) if grad_w is not None else 0, float(scale), float(norm_limit),
        float(sgd.lr) if sgd else 0.0, float(sgd.momentum) if sgd else 0.0,
        float(sgd.weight_decay) if sgd else 0.0,
        HAS_INDEX=row_index is not None, FUSED=sgd is not None, HAS_EXTRA=has_extra,
        HAS_MOMENTUM=buf is not None, NESTEROV=bool(sgd and sgd.nesterov),
        EPILOGUE_SPLITS=min(tiles.epilogue_splits, settings["D_PAD"] // 16), **settings,
    )  # fmt: skip
    return grad_e, grad_w
