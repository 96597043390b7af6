"""The `train` and `precision` sections: how the run steps, stops, checkpoints and
compiles, and its AMP level."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from recognition.config.values import ConfigError, check_counts


@dataclass
class TrainConfig:
    batch_size: int = 128
    """Per process."""
    epochs: int = 20
    max_steps: int | None = None
    """Stop after this many optimizer steps; the schedule still spans `epochs`."""
    accumulate_steps: int = 1
    """Micro-batches per optimizer step; the loss is divided by this."""
    resume: bool | str = False
    """false: start (refusing to overwrite a run directory holding checkpoints); true: the
    latest checkpoint of the run directory; auto: the latest if there is one, else start (for
    torchrun --max-restarts); a path: that checkpoint directory."""
    device: str = "auto"
    dist_backend: str = "auto"
    """Process-group backend with several processes: auto (NCCL on GPU, gloo on CPU), nccl
    or gloo."""
    timeout_s: float = 1800.0
    """Seconds a collective waits for the other ranks before it fails: how long a job whose
    rank hung takes to stop. It must exceed the longest gap between two collectives (a
    checkpoint save, the first batch of a slow data loader)."""
    log_every: int = 10
    checkpoint_every: int | None = None
    """Optimizer steps between checkpoints; null: at the end of every epoch."""
    keep_checkpoints: int = 2
    max_nonfinite_steps: int = 5
    """Stop the run after this many non-finite losses in a row."""
    memory_check: bool = True
    """On GPUs: before building the model, plan the run (docs/planning.md) and
    refuse it when the planned peak does not fit the GPU's memory; false skips the check."""
    progress: bool = True
    compile: bool = False
    """torch.compile the backbone (the head stays eager: its collectives and custom autograd
    functions gain nothing). The first step compiles (logged once); docs/training.md says
    when it pays off."""
    compile_mode: Literal[
        "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"
    ] = "default"
    """torch.compile's mode with train.compile."""
    compile_backend: str = "inductor"
    """torch.compile's backend: inductor (the one that makes kernels), or aot_eager / eager to
    tell a compiler problem from a model problem (they trace but do not speed up)."""
    deterministic: bool = False
    """Reproducible kernels: torch.use_deterministic_algorithms, cuDNN deterministic and not
    benchmarking, CUBLAS_WORKSPACE_CONFIG=:4096:8. Costs GPU speed (cuDNN cannot pick its
    fastest convolutions; some backward ops take slower deterministic paths, and an op with
    no deterministic version stops the run naming it). On CPU it changes nothing measurable."""

    def __post_init__(self) -> None:
        counts = ("batch_size", "epochs", "max_steps", "accumulate_steps", "log_every")
        counts += ("checkpoint_every", "keep_checkpoints", "max_nonfinite_steps")
        check_counts("train", self, counts, nullable=("max_steps", "checkpoint_every"))
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"train.device: {self.device!r} is not auto, cpu or cuda")
        if self.dist_backend not in ("auto", "nccl", "gloo"):
            raise ConfigError(
                f"train.dist_backend: {self.dist_backend!r} is not auto, nccl or gloo"
            )
        if self.dist_backend == "nccl" and self.device == "cpu":
            raise ConfigError("train.dist_backend: nccl needs train.device=cuda (or auto)")
        if not self.timeout_s > 0:
            raise ConfigError(f"train.timeout_s: must be positive, got {self.timeout_s}")
        if isinstance(self.resume, str) and not self.resume:
            raise ConfigError("train.resume: empty path (use true, false, auto or a path)")


@dataclass
class PrecisionConfig:
    level: Literal["O0", "O1", "O2", "O3"] = "O0"
    dtype: Literal["fp16", "bf16"] = "bf16"
    """The half type of O1-O3; O0 ignores it."""
