"""Apex-style precision levels O0-O3 on top of `torch.amp`.

`Precision` (in `precision`) applies one level to a run's modules and optimizer; its pieces
are modules of their own:
- `levels`: the levels O0-O3 with fp16 or bf16, and what each one does (the table);
- `casting`: the model's weights and buffers cast in place, the inputs, autocast;
- `masters`: the prepared parameters and the O2 fp32 master weights, their state;
- `scaling`: the fp16 loss scaler (GradScaler, or ShardedGradScaler over ranks);
- `update`: the optimizer update skipped on the device (the fused optimizers' `found_inf`
  hand-over), the gradient norm that decides it (`grad_norms`: one multi-tensor norm per
  device and dtype), and `StepResult`.
"""

from recognition.precision.levels import DTYPES, LEVELS, Level
from recognition.precision.masters import master_weights
from recognition.precision.precision import Precision
from recognition.precision.update import StepResult, grad_norms, stacked_float64

__all__ = [
    "DTYPES",
    "LEVELS",
    "Level",
    "Precision",
    "StepResult",
    "grad_norms",
    "master_weights",
    "stacked_float64",
]
