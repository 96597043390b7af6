"""The Triton head kernels' tiles and launch settings: `KernelTiles`, `TileConfig`, the
tables they come from, and `SGDUpdate`, the step a fused weight update applies.

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
GPU, heads/tuning/tiles.py times them and their neighbours of no larger footprint at the run's
shapes and keeps the fastest (`default_tiles` stays the table's).
tests/test_head_kernel_compile.py checks D = 512 with bf16 operands in CI.

On the CPU the tiles are the interpreter's (blocks.py says how it multiplies): large, the
whole dimension in one step.

The backward (`TileConfig.backward`) is "gemm" by default: the gradient of the logits is
written a chunk of classes at a time and cuBLAS takes the two gradient products
(gemm_backward.py); its only Triton kernel runs on the forward's tiles. "fused" is the
two-kernel backward that recomputes every tile and never writes an N x C tensor
(fused_backward.py), on the grad_embeddings and grad_weight tiles above.

Import this module only when the kernels are needed: `triton.jit` reads TRITON_INTERPRET at
import time.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

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


BACKWARDS = ("gemm", "fused")


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
    # The backward: "gemm" (gemm_backward.py) or "fused" (fused_backward.py).
    backward: str = "gemm"

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
        if self.backward not in BACKWARDS:
            raise ValueError(
                f"TileConfig.backward: must be one of {BACKWARDS}, got {self.backward!r}"
            )


@dataclass
class SGDUpdate:
    """The SGD step that the backward applies to the taking-part rows (fused update).

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


# The backward `default_tiles` names: "gemm"; benchmarks and tests set "fused" to compare
# (`use_backward`).
_BACKWARD = ["gemm"]


def use_backward(name: str) -> None:
    """Make `default_tiles` name backward `name` ("gemm" or "fused") in this process."""
    if name not in BACKWARDS:
        raise ValueError(f"use_backward: {name!r} is not one of {BACKWARDS}")
    _BACKWARD[0] = name


def default_tiles(device: torch.device, dim: int, matmul_dtype: torch.dtype) -> TileConfig:
    """Tiles for embeddings of `dim` on `device`: the interpreter's on the CPU; with the
    backward `use_backward` named."""
    if device.type != "cuda":
        table = INTERPRETER_TILES
    else:
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        if matmul_dtype != torch.float32:
            operands = "half"
        else:
            operands = "tf32" if input_precision(matmul_dtype, device) == "tf32" else "fp32"
        table = gpu_tiles(dim, num_sms, operands)
    return table if table.backward == _BACKWARD[0] else replace(table, backward=_BACKWARD[0])


def input_precision(matmul_dtype: torch.dtype, device: torch.device) -> str:
    """tl.dot's input precision: as torch's own fp32 matmuls in the reference path, TF32 only
    when allowed (and only on a GPU)."""
    if matmul_dtype == torch.float32 and device.type == "cuda":
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    return "ieee"


def padded_dim(dim: int) -> int:
    """The embedding dimension padded to a power of two (at least 16): the width of the
    backward's accumulators."""
    return max(16, triton.next_power_of_2(dim))
