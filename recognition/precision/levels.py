"""The precision levels O0-O3, apex's, on top of `torch.amp`: what each one does.

| level | model weights        | forward                  | optimizer owns     | fp16 scaling |
|-------|----------------------|--------------------------|--------------------|--------------|
| O0    | fp32                 | fp32, no autocast        | the model params   | no           |
| O1    | fp32                 | `torch.autocast(half)`   | the model params   | GradScaler   |
| O2    | half, BatchNorm fp32 | half inputs + autocast   | fp32 master copies | GradScaler   |
| O3    | half, BatchNorm too  | half inputs, no autocast | the model params   | no (1.0)     |

"half" is fp16 or bf16; bf16 has fp32's exponent range, so it never needs a loss scaler.
Loss scaling guards fp16's narrow exponent range; O3 goes without, like apex's O3 (loss
scale 1.0): it is the unprotected baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LEVELS = ("O0", "O1", "O2", "O3")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Level:
    """One level with one half dtype, and what it does (a row of the table above).

    Build it with `Level.of(level, dtype)`.
    """

    name: str
    dtype: str
    half_dtype: torch.dtype
    compute_dtype: torch.dtype
    """The dtype the forward computes in: fp32 under O0, half otherwise."""
    casts_model: bool
    """Whether the model's weights (and its inputs) go half: O2 and O3."""
    keeps_batchnorm_fp32: bool
    """O2's exception to the casts."""
    autocasts: bool
    """Whether the forward runs under `torch.autocast`: O1 and O2."""
    keeps_masters: bool
    """Whether the optimizer steps fp32 master copies of the half weights: O2."""
    scales_loss: bool
    """Whether an fp16 loss scaler guards the gradients: O1 and O2 in fp16."""

    @classmethod
    def of(cls, level: str, dtype: str) -> Level:
        """Raises ValueError naming the config key on an unknown level or dtype."""
        if level not in LEVELS:
            raise ValueError(f"precision.level: unknown level {level!r} (use one of {LEVELS})")
        if dtype not in DTYPES:
            raise ValueError(f"precision.dtype: unknown dtype {dtype!r} (use fp16 or bf16)")
        half = DTYPES[dtype]
        return cls(
            name=level,
            dtype=dtype,
            half_dtype=half,
            compute_dtype=torch.float32 if level == "O0" else half,
            casts_model=level in ("O2", "O3"),
            keeps_batchnorm_fp32=level == "O2",
            autocasts=level in ("O1", "O2"),
            keeps_masters=level == "O2",
            scales_loss=dtype == "fp16" and level in ("O1", "O2"),
        )

    def check_device(self, device: torch.device) -> None:
        """Raise ValueError when `device` cannot run this level's half dtype."""
        if (
            self.name != "O0"
            and self.dtype == "bf16"
            and device.type == "cuda"
            and not torch.cuda.is_bf16_supported()
        ):
            raise ValueError("precision.dtype: bf16 is not supported on this GPU (use fp16)")
