"""The `train` and `precision` sections: how the run steps, stops, checkpoints and
compiles, and its AMP level."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from recognition.config.values import ConfigError, check_counts, parse_time_limit
from recognition.registry import code_problem

# The signals a run can catch to stop (not SIGKILL or SIGSTOP, which no process can).
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")


@dataclass
class TrainConfig:
    """The `train` section: batches, length, resuming, devices, logging and checkpoints."""

    batch_size: int = 128
    """Per process."""
    epochs: int = 8
    """Passes over the training data; the schedule spans them."""
    max_steps: int | None = None
    """Stop after this many optimizer steps; the schedule still spans `epochs`."""
    accumulate_steps: int = 1
    """Micro-batches per optimizer step; the loss is divided by this."""
    resume: bool | str = False
    """false: start (refusing to overwrite a run directory holding checkpoints); true: the
    latest checkpoint of the run directory; auto: the latest if there is one, else start (for
    torchrun --max-restarts); a path: that checkpoint directory."""
    init_backbone: str | None = None
    """A backbone file to start from (fine-tuning, docs/finetune.md): a backbone export
    (backbone.pt), a training checkpoint directory, an arcface_torch IResNet state dict
    (backbone.pth, model.pt) or a torchvision ResNet-50 one (its trunk; the embedding starts
    fresh). Loaded before step 1 of a fresh run, strictly (every key and shape must fit
    model.* and data.image_size); a resumed run takes its weights from its checkpoint
    instead. null: the backbone starts from random weights."""
    teacher: str | None = None
    """A backbone file to distil from (docs/distillation.md): anything train.init_backbone
    takes (a backbone export, a training checkpoint directory, an arcface_torch state dict)
    or an .onnx model. Its embeddings are the targets of a second loss on the student's
    (feature distillation: 1 - cosine, through a learned projection when the embedding
    sizes differ); it never trains. It takes its own input size (the images are decoded or
    resized to it). null: no teacher."""
    distill_weight: float = 10.0
    """Weight of the distillation loss (1 - cosine, between 0 and 2) added to the margin
    loss, with train.teacher."""
    teacher_cache: bool = True
    """With train.teacher: compute the teacher's embedding of every training image once,
    before step 1, into the run directory (teacher/), when the teacher's input does not
    depend on a random draw (data.augment none, or the flip alone: both orientations are
    stored); a resumed run reuses them. false, or another augmentation: run the teacher
    alongside the student at every step."""
    head_only_steps: int = 0
    """Train the head alone for this many optimizer steps (the backbone runs in eval mode
    without gradients, its weights and statistics unchanged), then everything; counted
    from the run's first step, so a run resumed before step K goes on head-only."""
    device: str = "auto"
    """auto (the GPU of the process's local rank when there is one, else the CPU), cpu or
    cuda."""
    dist_backend: str = "auto"
    """Process-group backend with several processes: auto (NCCL on GPU, gloo on CPU), nccl
    or gloo."""
    timeout_s: float = 1800.0
    """Seconds a collective waits for the other ranks before it fails: how long a job whose
    rank hung takes to stop. It must exceed the longest gap between two collectives (a
    checkpoint save, the first batch of a slow data loader)."""
    log_every: int = 25
    """Optimizer steps between log lines (and metrics.jsonl records)."""
    checkpoint_every: int | None = None
    """Optimizer steps between checkpoints; null: at the end of every epoch."""
    keep_checkpoints: int = 2
    """Checkpoints kept in the run directory; older ones are removed."""
    max_nonfinite_steps: int = 5
    """Stop the run after this many non-finite losses in a row."""
    memory_check: bool = True
    """On GPUs: before building the model, plan the run (docs/planning.md) and
    refuse it when the planned peak does not fit the GPU's memory; false skips the check."""
    progress: bool = True
    """A progress bar (tqdm) on rank 0."""
    compile: bool = False
    """torch.compile the backbone (the head stays eager: its collectives and custom autograd
    functions gain nothing). The first step compiles (logged once); docs/training.md says
    when it pays off."""
    compile_mode: Literal[
        "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"
    ] = "default"
    """torch.compile's mode with train.compile."""
    compile_scope: Literal["model", "blocks"] = "model"
    """What train.compile compiles. model: the whole backbone as one graph (under DDP, over
    the wrapper, which splits it at the gradient buckets). blocks: each of the backbone's
    blocks (residual, bottleneck or depthwise) in place, one compilation per kind of block,
    reused by every block like it (regional compilation: IResNet-50's 24 blocks make 8), the
    stem and the embedding eager; a backbone without blocks (ViT) is compiled whole."""
    compile_backend: str = "inductor"
    """torch.compile's backend: inductor (the one that makes kernels), or aot_eager / eager to
    tell a compiler problem from a model problem (they trace but do not speed up)."""
    cuda_graphs: bool = False
    """On one GPU: capture the training step in a CUDA graph after 3 eager steps and replay
    it, so that the host no longer enqueues its kernels one by one (docs/training.md).
    Where it cannot apply (several processes, partial FC, an optimizer without a fused
    kernel, a pipeline, a CPU) the run says why and steps eagerly. Off by default until a
    GPU check has timed it."""
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1", "SIGINT"])
    """Signals that stop the run after the step in flight, with a checkpoint of it, and exit
    with status 75 (training/stopping.py; torchrun forwards SIGTERM and SIGINT to the ranks);
    [] leaves every signal its default action."""
    time_limit: str | float | None = None
    """Stop with a checkpoint before this much time has passed since the run started,
    leaving time for the save: D-HH:MM:SS, HH:MM:SS, MM:SS or seconds; auto: the Slurm job's
    end (SLURM_JOB_END_TIME, or squeue); null: no limit."""
    requeue: bool = False
    """After a stop, rank 0 requeues the Slurm job (scontrol requeue; an array job's own
    task), which then resumes with train.resume=auto."""
    hooks: list[str] = field(default_factory=list)
    """Hooks of your own, each "package.module:Class" (a `recognition.training.hooks.Hook`
    subclass, made with no argument), called after the built-in ones at every point of the
    loop (docs/extending.md); `train(cfg, hooks=[...])` adds instances from Python."""
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
        if self.head_only_steps < 0:
            raise ConfigError(
                f"train.head_only_steps: must be 0 or more, got {self.head_only_steps}"
            )
        if self.init_backbone is not None and not self.init_backbone:
            raise ConfigError("train.init_backbone: empty path (use a file, a directory or null)")
        if self.teacher is not None and not self.teacher:
            raise ConfigError("train.teacher: empty path (use a file, a directory or null)")
        if not self.distill_weight >= 0:
            raise ConfigError(f"train.distill_weight: must be 0 or more, got {self.distill_weight}")
        if isinstance(self.resume, str) and not self.resume:
            raise ConfigError("train.resume: empty path (use true, false, auto or a path)")
        for name in self.stop_signals:
            if name not in STOP_SIGNALS:
                raise ConfigError(
                    f"train.stop_signals: {name!r} is not one of {', '.join(STOP_SIGNALS)}"
                )
        try:
            parse_time_limit(self.time_limit)
        except ValueError as exc:
            raise ConfigError(f"train.time_limit: {exc}") from None
        if self.cuda_graphs and self.compile and self.compile_mode == "reduce-overhead":
            raise ConfigError(
                "train.cuda_graphs: not with train.compile_mode=reduce-overhead, which "
                "captures CUDA graphs of its own; choose one"
            )
        for i, code in enumerate(self.hooks):
            if (problem := code_problem(code)) is not None:
                raise ConfigError(f"train.hooks[{i}]: {problem}")


@dataclass
class PrecisionConfig:
    """The `precision` section: the mixed-precision level and its half type."""

    level: Literal["O0", "O1", "O2", "O3"] = "O0"
    """O0 fp32; O1 autocast; O2 half weights with fp32 masters; O3 pure half
    (docs/training.md)."""
    dtype: Literal["fp16", "bf16"] = "bf16"
    """The half type of O1-O3; O0 ignores it."""
