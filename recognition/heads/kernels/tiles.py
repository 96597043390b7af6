"""The Triton head kernels' tiles and launch settings: `KernelTiles`, `TileConfig`, the
tables they come from, and `SGDUpdate`, the step a fused weight update applies.

Tiles (`gpu_tiles`, by operand kind; `TileConfig` checks them when made). One Triton kernel
reads the class rows against the embeddings: the forward (forward.py), whose tiles the
backward's gradient-of-logits kernel (gemm_backward.py) runs on too; the two gradient
products are cuBLAS's. Its tile does not depend on D (it sums over D in BLOCK_D steps).
Chosen from what ptxas reports when the kernels are compiled ahead of time for sm_90 (H100)
by `python -m benchmarks.head_kernel_resources` (every launch the wrappers make; fp32
weights, N = 1024): largest dynamic shared memory in bytes / most registers per thread,
with triton 3.8; the H100 allows 232,448 bytes per block. Operands in bf16 or fp16 (the
same figures), in tf32, and in fp32 without TF32 (tl.dot on the CUDA cores):

    kernel         tiles CxNxD, warps, stages      bf16/fp16         tf32
    forward        128x128x32 w8 s3                49,152 / 173      98,304 / 202
    forward, keep  128x128x32 w8 s3                81,920 / 199      163,840 / 205
    fp32: forward 64x64x16 w4 s2 (8,192 / 165), keeping its logits (24,576 / 168)

The forward that keeps its logits for the backward stores a (rows, classes) tile of them
per step of its class loop, through a tensor descriptor (forward.py): on sm_90 a TMA store
from shared memory, which costs shared memory and few registers, so it runs on the
forward's tiles (and fits every larger tile the tuner tries, `ROUNDED_FORWARD`: 254
registers at most, no spill, at most 212,992 bytes). Before sm_90 (A100, sm_80) the store
goes through registers: at 128x128 it spills (255 registers, 272 bytes of spill stores);
there it keeps 128 classes x 64 rows (206 registers). Stored through a tensor of
addresses (the kernel before the descriptor), the keeping forward took 222 registers on
sm_90 at 128x64 and spilled at 128x128.

These tiles are chosen for what fits, and bound what is tried: on a GPU, heads/tuning/tiles.py
times them and larger ones ptxas showed to fit at the run's shapes and keeps the fastest
(`default_tiles` stays the table's). tests/test_head_kernel_compile.py checks D = 512 with
bf16 operands in CI.

On the CPU the tiles are the interpreter's (blocks.py says how it multiplies): large, the
whole dimension in one step.

Import this module only when the kernels are needed: `triton.jit` reads TRITON_INTERPRET at
import time.
"""

from __future__ import annotations

import functools
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


def _check_num_warps(name: str, num_warps: object) -> None:
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"{name}.num_warps: must be 1, 2, 4, 8 or 16, got {num_warps!r}")


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
        _check_num_warps(name, self.num_warps)
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"{name}.num_stages: must be an integer >= 1, got {self.num_stages!r}")


@dataclass(frozen=True)
class FinishTiles:
    """The backward's row epilogue (`gemm_backward._finish_kernel`): each program holds
    (rows, D) tiles of `values` values - values / padded D class rows, at least one - on
    `num_warps` warps. Its work is memory traffic (the rows, their momentum, U), no K-loop."""

    values: int
    num_warps: int

    def check(self, name: str) -> None:
        """Raise ValueError naming `name`.field when a value breaks the compiler's rules."""
        if not isinstance(self.values, int) or self.values < 16 or self.values & (self.values - 1):
            raise ValueError(f"{name}.values: must be a power of two >= 16, got {self.values!r}")
        _check_num_warps(name, self.num_warps)

    def block_c(self, d_pad: int) -> int:
        """Class rows per program at padded dimension `d_pad`."""
        return max(1, self.values // d_pad)


# 32 values per thread of each of the epilogue's few live tiles (U, the rows, the momentum,
# the result) at 8 warps: 16 class rows of D 512 a program.
FINISH_TILES = FinishTiles(values=8192, num_warps=8)


@dataclass(frozen=True)
class TileConfig:
    """The forward kernel's tiles (the gradient-of-logits kernel runs on them too), its
    tiles when it keeps the logits for the backward (`forward_keep`: the store of a logits
    tile takes registers; None: `forward`'s), the programs its grid aims for, and the
    backward's row epilogue's (`finish`); checked when made (a bad value raises
    ValueError)."""

    forward: KernelTiles
    # Programs the forward aims for (row blocks x splits): a few per SM on a GPU; few on
    # the interpreter, which runs programs one after another.
    target_programs: int = 0
    forward_keep: KernelTiles | None = None
    finish: FinishTiles = FINISH_TILES

    def __post_init__(self) -> None:
        if self.forward_keep is None:
            object.__setattr__(self, "forward_keep", self.forward)
        self.check()

    def check(self) -> None:
        for name in ("forward", "forward_keep"):
            tiles = getattr(self, name)
            if not isinstance(tiles, KernelTiles):
                raise ValueError(f"TileConfig.{name}: must be a KernelTiles, got {tiles!r}")
            tiles.check(f"TileConfig.{name}")
        if not isinstance(self.finish, FinishTiles):
            raise ValueError(f"TileConfig.finish: must be a FinishTiles, got {self.finish!r}")
        self.finish.check("TileConfig.finish")
        if not isinstance(self.target_programs, int) or self.target_programs < 0:
            raise ValueError(
                f"TileConfig.target_programs: must be an integer >= 0, got {self.target_programs!r}"
            )


@dataclass
class SGDUpdate:
    """The SGD step that the backward applies to the taking-part rows (fused update).

    lr, momentum, weight_decay and nesterov as torch.optim.SGD takes them (dampening 0; lr
    a float or a 0-dim float32 tensor on the device);
    `momentum_buffer` (C_local, D) float32 is updated in place (None when momentum is 0);
    `step_ok`, a 0-dim bool tensor on the device or None: where it is False, nothing is
    stored (the rows and their momentum stay as they were).
    """

    lr: float | Tensor
    momentum: float
    weight_decay: float
    nesterov: bool
    momentum_buffer: Tensor | None
    step_ok: Tensor | None = None


# The interpreter pays per program and per operation, not per element: large tiles, the
# whole (padded) dimension in one step, few programs.
INTERPRETER_TILES = TileConfig(
    forward=KernelTiles(block_c=128, block_n=32, block_d=1024, num_warps=1, num_stages=1),
    target_programs=4,
)


# GPU tiles by operand kind, (forward, forward keeping its logits before sm_90) (see the
# module docstring for what ptxas reports for them). "half": bf16 or fp16 operands, "tf32":
# fp32 operands on the tensor cores, "fp32": without TF32, tl.dot on the CUDA cores, which
# needs far more registers.
_TENSOR_CORE_FORWARD = (
    KernelTiles(block_c=128, block_n=128, block_d=32, num_warps=8, num_stages=3),
    KernelTiles(block_c=128, block_n=64, block_d=32, num_warps=8, num_stages=3),
)
_FP32_FORWARD = KernelTiles(block_c=64, block_n=64, block_d=16, num_warps=4, num_stages=2)
_GPU_TILES = {
    "half": _TENSOR_CORE_FORWARD,
    "tf32": _TENSOR_CORE_FORWARD,
    "fp32": (_FP32_FORWARD, _FP32_FORWARD),
}
OPERAND_KINDS = tuple(_GPU_TILES)
TMA_CAPABILITY = (9, 0)
"""From sm_90 (Hopper) a tensor descriptor's store is a TMA store from shared memory."""


@functools.lru_cache(maxsize=64)
def gpu_tiles(dim: int, num_sms: int, operands: str = "half", tma: bool = True) -> TileConfig:
    """Tiles for embeddings of `dim` on a GPU with `num_sms` SMs, for `operands` "half" (bf16
    or fp16), "tf32" or "fp32" (fp32 without TF32); `tma`: the GPU stores through tensor
    descriptors from shared memory (sm_90 and later), where the forward keeping its logits
    fits the forward's tiles. The forward sums over D in BLOCK_D steps, so its tiles do not
    depend on `dim`."""
    if operands not in _GPU_TILES:
        raise ValueError(f"gpu_tiles: operands must be one of {OPERAND_KINDS}, got {operands!r}")
    forward, forward_keep = _GPU_TILES[operands]
    return TileConfig(
        forward, target_programs=4 * num_sms, forward_keep=forward if tma else forward_keep
    )


def default_tiles(device: torch.device, dim: int, matmul_dtype: torch.dtype) -> TileConfig:
    """Tiles for embeddings of `dim` on `device`: the interpreter's on the CPU."""
    if device.type != "cuda":
        return INTERPRETER_TILES
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    if matmul_dtype != torch.float32:
        operands = "half"
    else:
        operands = "tf32" if input_precision(matmul_dtype, device) == "tf32" else "fp32"
    tma = torch.cuda.get_device_capability(device) >= TMA_CAPABILITY
    return gpu_tiles(dim, num_sms, operands, tma)


def input_precision(matmul_dtype: torch.dtype, device: torch.device) -> str:
    """tl.dot's input precision: as torch's own fp32 matmuls in the reference path, TF32 only
    when allowed (and only on a GPU)."""
    if matmul_dtype == torch.float32 and device.type == "cuda":
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    return "ieee"


def padded_dim(dim: int) -> int:
    """The embedding dimension padded to a power of two (at least 16): the width of the
    update epilogue's tiles."""
    return max(16, triton.next_power_of_2(dim))
