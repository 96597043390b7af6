"""Training in parts: `build` makes the run's parts, `resume` restores them, `loop` steps
with hooks around each step (`hooks`), `step` is one optimizer step, `state` the run's own
checkpoint parts. `train(cfg)` is the whole run. (`recognition.training.build` is the
module; its `build()` is imported from there.)"""

from recognition.precision import StepResult
from recognition.training.build import Run, TrainingError
from recognition.training.loop import run_loop, train
from recognition.training.step import global_grad_norm, train_step

__all__ = [
    "Run",
    "StepResult",
    "TrainingError",
    "global_grad_norm",
    "run_loop",
    "train",
    "train_step",
]
