"""The forward kernel: max and sum-exp of the non-target logits of every row over the
classes taking part (`class_stats`), the inverse norms of their rows, and, when asked, the
logits' exponentials for the backward (`KeptLogits`).

The classes go a chunk at a time (`chunk_classes`: at most CHUNK_ROW_VALUES values of rows,
65,536 classes at D = 512): the chunk's rows - gathered through the partial-FC index, if
any - are rounded to the matmul dtype beforehand (`host.RowSource`: a chunk at a time, or
once for the step, or the head's kept copy). So the kernel reads its operands as the
matrix units take them: on a Hopper GPU a tile then goes from shared memory straight to an
asynchronous wgmma, one of them in flight while the next loads, where rows rounded in the
kernel go through registers (a load, a conversion, a store back to shared memory and a
fence) and each wgmma is waited for at once (what Triton 3.8 makes of the two for sm_90:
python -m benchmarks.head_kernel_resources compiles them). Measured on an H200 at 1M
classes (N 1024, D 512, bf16, tuned tiles): 2.9 ms on rounded chunks (about 370 TFLOP/s)
against 4.0 to 5.2 ms on raw rows (benchmarks/results/head_profile-*-nvidia-h200.md).

Over a chunk: a grid of (row blocks, class splits). Each program walks its split of the
classes BLOCK_C at a time; for each tile, the logits (BLOCK_N, BLOCK_C) are summed over the
embedding dimension BLOCK_D at a time (`_raw_dots`: a K-loop with fp32 accumulation,
operands in the matmul dtype - fp32, bf16 or fp16 - the embeddings rounded to it once on
the host, as the torch path rounds them), each class scaled by s / |w| from inverse norms
computed once per step (no normalised copy of the shard), the row's target and the padding
masked to -inf, then an online max / sum-exp in fp32. Each split of each chunk writes its
partial statistics (N,); a small last step (`_combine`) folds them together, so that one
row of statistics never serialises the whole shard onto one program.

With `keep` (head.chunk_size None) each tile also stores its exponentials in the matmul
dtype for the backward, which then reads them instead of recomputing the logits
(`KeptLogits`): with bf16 and fp32 operands exp(logit - c) / |w| for one shift c of the
whole step (`fixed_shift`, from the scale: every value in range), which the backward's
products take as they are; with fp16 operands exp(logit - shift), shift being its
program's running max once the tile is in, and the shift (N,) per tile, fp32, which the
backward rescales to the final max (exp(shift - max) <= 1) in a pass over them. The tile
goes out through a tensor descriptor of the chunk's columns (`kept_buffer` pads the rows to
the 16-byte stride it needs): on sm_90 a TMA store from shared memory, which leaves the
registers to the product, so the keeping forward runs on the forward's tiles
(`TileConfig.forward_keep`; tiles.py has ptxas's figures); stored through a tensor of 64-bit
addresses it needed 222 registers at half the rows.

Import this module only when the kernels are needed: `triton.jit` reads TRITON_INTERPRET at
import time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from recognition.heads.kernels import host
from recognition.heads.kernels.blocks import _logits, _row_block, _tile_dots
from recognition.heads.kernels.host import RowSource, launch, launch_settings, splits
from recognition.heads.kernels.tiles import TileConfig

# Values of the rounded class rows per chunk: 64 MiB in bf16 (65,536 classes at D = 512). A
# module constant rather than an argument, so that tests can make chunks small.
CHUNK_ROW_VALUES = 1 << 25


@triton.jit
def _forward_kernel(
    W, E, INV_NORM, TARGET, PART_MAX, PART_SUM, KEPT, TILE_SHIFT,
    num_classes, num_rows, dim, stride_wc, stride_en, scale, tiles_per_split, fixed_shift,
    KEEP: tl.constexpr, FIXED: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, D_PAD: tl.constexpr, MM_DTYPE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid_s = tl.program_id(1)
    offs_n, n_mask, target = _row_block(TARGET, num_rows, BLOCK_N)
    row_max = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for t in range(0, tiles_per_split):
        tile = pid_s * tiles_per_split + t
        offs_c, c_mask, rows, inv_norm, raw = _tile_dots(
            W, INV_NORM, E, INV_NORM, tile * BLOCK_C, num_classes,
            offs_n, n_mask, dim, stride_wc, stride_en, False, BLOCK_C, BLOCK_N, BLOCK_D,
            D_PAD, MM_DTYPE, INPUT_PRECISION, UPCAST,
        )  # fmt: skip
        logits = _logits(raw, inv_norm, offs_c, c_mask, target, scale)
        if FIXED:  # one shift for every tile (KeptLogits): summed as they come, no rescaling
            exps = tl.exp(logits - fixed_shift)  # 0 at the target and the padding
            row_sum += tl.sum(exps, 1)
            row_max = tl.maximum(row_max, tl.max(logits, axis=1))
            # With the class's 1 / |w| already in: the backward's products read them as is.
            KEPT.store([tl.program_id(0) * BLOCK_N, tile * BLOCK_C],
                       (exps * inv_norm[None, :]).to(MM_DTYPE))  # fmt: skip
        else:
            new_max = tl.maximum(row_max, tl.max(logits, axis=1))
            # A row whose entries so far are all masked has max -inf: shift by 0, not -inf.
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            probabilities = tl.exp(logits - shift[:, None])  # 0 at the target and the padding
            row_sum = row_sum * tl.exp(row_max - shift) + tl.sum(probabilities, 1)
            row_max = new_max
            if KEEP:  # for the backward: exp(logit - shift) in the matmul dtype, and the shift
                # Through the tensor descriptor of the chunk's columns (a TMA store from
                # shared memory on sm_90): rows and classes past its shape are not written,
                # and its coordinates are not offsets (no 32-bit overflow at 1,024 rows x 10M
                # classes).
                KEPT.store([tl.program_id(0) * BLOCK_N, tile * BLOCK_C],
                           probabilities.to(MM_DTYPE))  # fmt: skip
                # The last split may run past the chunk's tiles: those store nothing.
                in_chunk = n_mask & (tile * BLOCK_C < num_classes)
                tl.store(TILE_SHIFT + tile.to(tl.int64) * num_rows + offs_n, shift, mask=in_chunk)
    if FIXED:  # the sum relative to the row's max, as _combine takes it (0 with no class)
        found = tl.where(row_max == float("-inf"), fixed_shift, row_max)
        row_sum = row_sum * tl.exp(fixed_shift - found)
    out = pid_s * num_rows + offs_n
    tl.store(PART_MAX + out, row_max, mask=n_mask)
    tl.store(PART_SUM + out, row_sum, mask=n_mask)


def kept_buffer(num_rows: int, num_classes: int, dtype: torch.dtype, device) -> Tensor:
    """The (N, K) tensor the forward keeps the exponentials in: a view of (N, K padded) whose
    row stride is a multiple of 16 bytes, as a tensor descriptor's must be."""
    per_16_bytes = max(1, 16 // dtype.itemsize)
    padded = triton.cdiv(max(num_classes, 1), per_16_bytes) * per_16_bytes
    return torch.empty((num_rows, padded), dtype=dtype, device=device)[:, :num_classes]


def inverse_norms(weight: Tensor, row_index: Tensor | None, eps: float) -> Tensor:
    """1 / max(|w_j|, eps) (K,) in fp32 of the taking-part rows: one pass per step."""
    rows = weight if row_index is None else weight.index_select(0, row_index)
    return 1.0 / torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32).clamp_min(eps)


def _combine(part_max: Tensor, part_sum: Tensor) -> tuple[Tensor, Tensor]:
    """Fold per-split statistics (splits, N) into the row max and sum-exp (N,)."""
    row_max = part_max.amax(dim=0)
    shift = torch.where(torch.isfinite(row_max), row_max, 0.0)
    return row_max, (part_sum * torch.exp(part_max - shift)).sum(dim=0)


# A fixed shift keeps every kept value in range up to this scale (`fixed_shift`).
FIXED_SHIFT_MAX_SCALE = 66.0


def fixed_shift(scale: float, matmul_dtype: torch.dtype) -> float | None:
    """The one shift c of the kept exponentials exp(logit - c) for every class (see
    `KeptLogits`), or None where none keeps them in range (fp16 operands, or a scale above
    FIXED_SHIFT_MAX_SCALE): then each tile is shifted by its running max.

    A non-target logit is s cos, in [-s, s], so exp(logit - c) lies in [exp(-s - c),
    exp(s - c)]. c = min(s, 72 - s) keeps the bottom at or above exp(-72) (bf16 and fp32 go
    down to exp(-87) before their subnormals, which leaves 1 / |w| down to exp(-15) room) and
    the top at exp(2 s - 72) <= exp(60) (times 1 / |w| <= 1 / eps = 1e12, exp(27.6), under
    fp32's and bf16's exp(88.7); a sum over 10^8 classes of values below exp(60) stays in
    fp32 too). The backward's row factor exp(c - max) <= exp(c + s) <= exp(72) as well."""
    if matmul_dtype == torch.float16 or scale > FIXED_SHIFT_MAX_SCALE:
        return None
    return float(min(scale, 72.0 - scale))


@dataclass
class KeptLogits:
    """What the forward keeps for the backward when asked (`class_stats(keep=True)`), (N, K)
    in the matmul dtype, in one of two forms:

    - `fixed_shift` c (bf16 and fp32 operands, `fixed_shift`): exp(logit - c) / |w_j|, one
      shift for every class. The gradient of the logits is then kept * r_i with a factor per
      row alone, r_i = g_i s exp(c - max_i), so the backward's products read the kept values
      as they are (the factor goes on the embeddings' side) and no pass over them runs.
      `tile_shift` is None.
    - else (fp16 operands, whose range is too narrow for one shift): exp(logit - shift_t),
      shifted by the running max of their program's split when tile t was reached, and
      those shifts, `tile_shift` (tiles, N) fp32 (tile t covers positions [t * block_c,
      (t + 1) * block_c)). The backward rescales them to the final max in place: exp(logit
      - max) = kept * exp(shift_t - max), each factor <= 1."""

    probabilities: Tensor
    tile_shift: Tensor | None
    block_c: int
    fixed_shift: float | None = None


def class_stats(
    norm_embeddings: Tensor,
    weight: Tensor,
    row_index: Tensor | None,
    inv_norm: Tensor,
    target_pos: Tensor,
    scale: float,
    matmul_dtype: torch.dtype,
    tiles: TileConfig,
    *,
    rows: RowSource | None = None,
    keep: bool = False,
) -> tuple[Tensor, Tensor, KeptLogits | None]:
    """Max and sum-exp (N,) fp32 of the non-target logits over the taking-part classes, and
    with `keep` the logits' exponentials for the backward (`KeptLogits`; else None).

    `norm_embeddings` (N, D) fp32 normalised; `weight` (C_local, D) raw rows; `row_index` (K,)
    the taking-part rows or None for all; `inv_norm` (K,) from `inverse_norms`;
    `target_pos` (N,) each row's target as a taking-part position, -1 where not owned;
    `rows` where the rounded rows come from (default: rounded a chunk at a time).
    A row with no non-target class gets max -inf and sum 0.
    """
    num_rows, dim = norm_embeddings.shape
    num_classes = inv_norm.shape[0]
    if weight.stride(1) != 1 or not norm_embeddings.is_contiguous():
        raise ValueError("triton head kernel: the weight's rows and the embeddings must be dense")
    rows = rows if rows is not None else RowSource(weight, row_index, matmul_dtype)
    kernel_tiles = tiles.forward_keep if keep else tiles.forward
    settings = launch_settings(norm_embeddings, matmul_dtype, kernel_tiles)
    block_c = kernel_tiles.block_c
    # Rounded once here, as the torch path rounds them, rather than in every tile.
    mm_embeddings = norm_embeddings.to(matmul_dtype)
    target_pos = target_pos.to(torch.int32)
    row_blocks = triton.cdiv(num_rows, kernel_tiles.block_n)
    kept = None
    shift = fixed_shift(scale, matmul_dtype) if keep else None
    if keep:
        tile_shift = None
        if shift is None:
            tile_shift = norm_embeddings.new_empty((triton.cdiv(num_classes, block_c), num_rows))
        kept = KeptLogits(
            kept_buffer(num_rows, num_classes, matmul_dtype, norm_embeddings.device),
            tile_shift, block_c, shift,
        )  # fmt: skip
    chunk = host.chunk_classes(num_classes, block_c, CHUNK_ROW_VALUES // max(dim, 1))
    parts = []
    for first in range(0, num_classes, chunk):
        end = min(first + chunk, num_classes)
        # One chunk's rounded rows at a time (a list held every chunk at once, a bf16 copy
        # of the whole shard: 9.6 GiB more at 10M classes, measured on an H200).
        chunk_rows = rows.chunk(first, end)  # (K_c, D)
        num_tiles = triton.cdiv(end - first, block_c)
        num_splits, per_split = splits(num_tiles, row_blocks, tiles.target_programs)
        part_max = norm_embeddings.new_empty((num_splits, num_rows), dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
        # Placeholders where nothing is kept (the kernel does not read them then).
        kept_args = (part_max, part_max)
        if kept is not None:  # the chunk's columns and tiles (a chunk is whole tiles)
            columns = TensorDescriptor.from_tensor(
                kept.probabilities[:, first:end], [kernel_tiles.block_n, block_c]
            )
            shifts = part_max if kept.tile_shift is None else kept.tile_shift[first // block_c :]
            kept_args = (columns, shifts)
        # Positions within the chunk: a target elsewhere matches none of its classes.
        launch(_forward_kernel, (row_blocks, num_splits),
            chunk_rows, mm_embeddings, inv_norm[first:end], target_pos - first, part_max,
            part_sum, *kept_args, end - first, num_rows, dim, chunk_rows.stride(0),
            mm_embeddings.stride(0), float(scale), per_split, 0.0 if shift is None else shift,
            KEEP=kept is not None, FIXED=shift is not None, **settings,
        )  # fmt: skip
        del chunk_rows
        parts.append((part_max, part_sum))
    if not parts:  # no class takes part: as for a row whose classes are all masked
        row_max = norm_embeddings.new_full((num_rows,), float("-inf"), dtype=torch.float32)
        return row_max, torch.zeros_like(row_max), kept
    row_max, row_sumexp = _combine(
        torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    )
    return row_max, row_sumexp, kept
