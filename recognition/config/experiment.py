"""The whole experiment config (`ExperimentConfig`, one field per section) and the checks
that span sections: the fused head update and the pipelined backbone against the optimizer,
the precision, the batch and the schedule."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from recognition.config.data import DataConfig
from recognition.config.eval import EvalConfig
from recognition.config.head import HeadConfig
from recognition.config.model import ModelConfig
from recognition.config.optim import OptimConfig
from recognition.config.train import PrecisionConfig, TrainConfig
from recognition.config.values import ConfigError, image_size_pair


@dataclass
class ExperimentConfig:
    """The whole run: its name, where it writes, its seed, and one field per section."""

    name: str = "experiment"
    """The run's name: the config file's stem unless set; the run directory is runs/<name>."""
    output_dir: str | None = None
    """Run directory; null means runs/<name>."""
    seed: int = 0
    """Seed of the weights' initialisation, the sample order and the augmentation."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        if self.head.fused_update:
            check_fused_update(self)
        if self.model.pipeline_stages > 1:
            check_pipeline(self)
        check_finetune(self)
        late = [e for e in self.optim.milestones if e >= self.train.epochs]
        if late:
            raise ConfigError(
                f"optim.milestones: epoch {late[0]:g} is not before train.epochs="
                f"{self.train.epochs}, so it would never apply"
            )
        if self.head.triplet_weight > 0 and self.data.sampler != "pk":
            raise ConfigError(
                "head.triplet_weight: batch-hard mining needs positives in every batch; set "
                "data.sampler=pk (P identities x data.pk_instances images)"
            )
        if self.head.triplet_weight > 0 and self.train.teacher is not None:
            raise ConfigError(
                "train.teacher: distillation with head.triplet_weight > 0 is not supported "
                "(the triplet loss takes the features before the BN neck, the distillation "
                "the projected embeddings); set one of them off"
            )
        if self.data.decode == "gpu" and self.train.device == "cpu":
            raise ConfigError(
                "data.decode: gpu decodes on a CUDA device, but train.device=cpu trains on the "
                "CPU; use data.decode=cpu (or auto)"
            )

    @property
    def micro_batches(self) -> int:
        """Pipeline micro-batches per batch (1 without a pipeline)."""
        model = self.model
        if model.pipeline_stages == 1:
            return 1
        if model.micro_batch_size is None:
            return 2 * model.pipeline_stages
        return self.train.batch_size // model.micro_batch_size

    @property
    def eval_image_hw(self) -> tuple[int, int]:
        """The evaluation input size as (H, W): eval.image_size, else data.image_size."""
        return image_size_pair(self.eval.image_size or self.data.image_size)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir if self.output_dir else Path("runs") / self.name)

    @property
    def trains_on_synthetic(self) -> bool:
        """Whether data.root lies in the built-in synthetic set's folder (data.synthetic.root)."""
        return lies_in(self.data.root, self.data.synthetic.root)

    @property
    def uses_synthetic(self) -> bool:
        """Whether the run reads the synthetic set: its data.root or an evaluation target
        lies in data.synthetic.root (with eval.targets null, training on it means its own
        val pairs). Only then is the set generated on first use."""
        root = self.data.synthetic.root
        files = [
            path
            for target in self.eval.targets or []
            for path in (getattr(target, target.kind), target.images)
            if path is not None
        ]
        return self.trains_on_synthetic or any(lies_in(path, root) for path in files)


def lies_in(path: str | Path, folder: str | Path) -> bool:
    """Whether `path` is `folder` or lies under it (both made absolute, links resolved as far
    as they exist)."""
    return Path(path).resolve().is_relative_to(Path(folder).resolve())


def check_fused_update(cfg: ExperimentConfig) -> None:
    """Refuse what head.fused_update cannot honour, naming both keys."""
    conflicts = []
    if cfg.head.kernel != "triton":
        conflicts.append(
            f"head.kernel={cfg.head.kernel} (the update runs in the Triton backward: set "
            "head.kernel=triton)"
        )
    if cfg.optim.name != "sgd":
        conflicts.append(f"optim.name={cfg.optim.name} (the fused update is SGD's)")
    if cfg.optim.grad_clip is not None:
        conflicts.append(
            f"optim.grad_clip={cfg.optim.grad_clip} (the head's rows are stepped before the "
            "gradient norm is known: set optim.grad_clip=null)"
        )
    if cfg.train.accumulate_steps != 1:
        conflicts.append(
            f"train.accumulate_steps={cfg.train.accumulate_steps} (every backward steps the "
            "head's rows)"
        )
    if cfg.precision.level in ("O2", "O3"):
        conflicts.append(
            f"precision.level={cfg.precision.level} (the fused update steps a float32 weight: "
            "use O0 or O1)"
        )
    elif cfg.precision.level == "O1" and cfg.precision.dtype == "fp16":
        conflicts.append(
            "precision.dtype=fp16 with precision.level=O1 (loss scaling would scale the "
            "rows' step: use bf16)"
        )
    if conflicts:
        raise ConfigError("head.fused_update=true cannot be combined with " + "; ".join(conflicts))


def check_finetune(cfg: ExperimentConfig) -> None:
    """Refuse the fine-tuning settings (docs/finetune.md) that cannot work together."""
    if cfg.head.init == "centroids" and cfg.train.init_backbone is None:
        raise ConfigError(
            "head.init=centroids: the class rows are the mean embeddings under a loaded "
            "backbone; set train.init_backbone=PATH (or head.init=random)"
        )
    if cfg.model.pipeline_stages > 1:
        used = [
            name
            for name, on in (
                ("train.init_backbone", cfg.train.init_backbone is not None),
                ("head.init=centroids", cfg.head.init == "centroids"),
                ("model.freeze_bn=true", cfg.model.freeze_bn),
                ("train.head_only_steps", cfg.train.head_only_steps > 0),
                ("train.teacher", cfg.train.teacher is not None),
            )
            if on
        ]
        if used:
            raise ConfigError(
                f"model.pipeline_stages={cfg.model.pipeline_stages} cannot be combined with "
                f"{', '.join(used)} (fine-tuning and distillation run the whole backbone on "
                "every rank)"
            )


def check_pipeline(cfg: ExperimentConfig) -> None:
    """Refuse what a pipelined backbone (model.pipeline_stages > 1) cannot honour."""
    model, stages, batch = cfg.model, cfg.model.pipeline_stages, cfg.train.batch_size
    if model.micro_batch_size is None:
        if batch % (2 * stages):
            raise ConfigError(
                f"model.micro_batch_size: null splits train.batch_size={batch} into "
                f"{2 * stages} micro-batches (2 x model.pipeline_stages), which does not "
                "divide it; set model.micro_batch_size to a divisor of train.batch_size"
            )
    elif batch % model.micro_batch_size:
        raise ConfigError(
            f"model.micro_batch_size={model.micro_batch_size} does not divide "
            f"train.batch_size={batch}"
        )
    if batch // cfg.micro_batches < 2:
        raise ConfigError(
            f"model.micro_batch_size: micro-batches of {batch // cfg.micro_batches} sample "
            f"(train.batch_size={batch} in {cfg.micro_batches}) cannot train: BatchNorm "
            "needs at least 2 samples; set model.micro_batch_size >= 2 (or raise "
            "train.batch_size)"
        )
    if model.pipeline_schedule == "1f1b" and cfg.micro_batches < stages:
        raise ConfigError(
            f"model.pipeline_schedule=1f1b needs at least model.pipeline_stages={stages} "
            f"micro-batches, train.batch_size={batch} / model.micro_batch_size="
            f"{model.micro_batch_size} gives {cfg.micro_batches} (use gpipe, or smaller "
            "micro-batches)"
        )
    conflicts = []
    if cfg.train.accumulate_steps != 1:
        conflicts.append(
            f"train.accumulate_steps={cfg.train.accumulate_steps} (the pipeline's micro-batches "
            "already accumulate gradients: raise train.batch_size instead)"
        )
    if cfg.train.compile:
        conflicts.append("train.compile=true (the stages run eager)")
    if cfg.head.fused_update:
        conflicts.append(
            "head.fused_update=true (every micro-batch's backward would step the head)"
        )
    if cfg.head.triplet_weight > 0 or cfg.head.id_weight != 1.0:
        conflicts.append(
            "head.triplet_weight / head.id_weight (the last stage's loss is the margin "
            "softmax's alone)"
        )
    if conflicts:
        raise ConfigError(
            f"model.pipeline_stages={stages} cannot be combined with " + "; ".join(conflicts)
        )
