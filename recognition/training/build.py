"""`build(cfg, dist_info)`: the run's parts, each made by the module that owns it.

Data (`recognition.data.build`), backbone (`recognition.models`), head
(`recognition.heads`), precision (`recognition.precision`), optimizer and schedule
(`recognition.optim`), and the run's progress; `Run` holds them for the loop, the hooks
and the checkpoints (`Run.checkpoint_parts`). The data can be made first (`build_data`)
and handed to `build`: the training loop checks the run's memory between the two, with
the run planner, which builds the model here (`build_model`) and is never imported here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Sampler

from recognition import distributed
from recognition.config import (
    EvalTarget,
    ExperimentConfig,
    config_to_dict,
    save_config,
)
from recognition.data.build import (
    build_loader,
    build_sampler,
    build_train_dataset,
    resolve_decode,
)
from recognition.data.sampler import EpochBatches
from recognition.data.source import TrainSource
from recognition.data.synthetic import ensure_synthetic_dataset
from recognition.distributed import DistInfo
from recognition.evaluation.targets import check_training_targets
from recognition.heads import ShardedMarginSoftmax, build_head
from recognition.heads.triplet import TrainingLoss
from recognition.models import backbone_from_config, use_neck_features
from recognition.optim import (
    OptimizerState,
    build_optimizer,
    build_scheduler,
    param_groups,
    param_names,
)
from recognition.pipeline import (
    LabelsOnly,
    PipelineLayout,
    StagePlan,
    build_stage_backbone,
    gather_backbone,
    local_stage_io,
    make_layout,
    stage_io,
)
from recognition.precision import Precision, StepResult
from recognition.training.backbone_check import check_backbone
from recognition.training.distill import Distillation
from recognition.training.errors import TrainingError
from recognition.training.finetune import start_from_file
from recognition.training.finetune.freeze import freeze_batch_norm
from recognition.training.finetune.head_only import HeadOnlyGate
from recognition.training.finetune.init_backbone import InitBackbone
from recognition.training.graphed import GraphedStep
from recognition.training.holdout import split_for_eval
from recognition.training.parts import ModelParts, compile_model, wrap_model
from recognition.training.pipeline_step import PipelineStep, build_pipeline_step
from recognition.training.state import Progress, RngState
from recognition.training.step import train_step

log = logging.getLogger(__name__)

__all__ = [
    "ModelParts",
    "Run",
    "TrainData",
    "TrainingError",
    "build",
    "build_data",
    "build_model",
    "compile_model",
    "global_batch",
]


@dataclass
class Run:
    """Everything one training run is made of, as `build` made it."""

    cfg: ExperimentConfig
    dist_info: DistInfo
    data: TrainSource
    """The training images (no augmentation); `loader` reads them through AugmentedView."""
    batches: EpochBatches
    """The run's batch order (start_at before iterating `loader`)."""
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]]
    """The batches as (images, labels): a DataLoader (data.decode=cpu), or batches decoded on
    the device (gpu, `recognition.data.gpu_decode.DeviceBatches`)."""
    backbone: nn.Module
    """The bare backbone (what checkpoints and exports hold); with a pipeline, this rank's
    stage of it."""
    model: nn.Module
    """What the step calls: the backbone, wrapped in DDP with several ranks, compiled with
    train.compile."""
    head: ShardedMarginSoftmax | None
    """This rank's class shard; None on the ranks of a pipeline's earlier stages."""
    precision: Precision
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    progress: Progress
    steps_per_epoch: int
    last_step: int
    classes_sha256: str
    num_classes: int
    memory_format: torch.memory_format = torch.preserve_format
    rng: RngState = field(default_factory=RngState)
    step: Callable[..., StepResult] = train_step
    """One optimizer step (`train_step`, or a `PipelineStep`)."""
    layout: PipelineLayout | None = None
    """The pipeline mesh (model.pipeline_stages > 1), else None."""
    param_ids: list[int] | None = None
    """The optimizer's parameters' indices in the whole model's optimizer (a stage's)."""
    stop_reason: str | None = None
    """Why the run ends before `last_step` (a signal's name, the time limit), set by the
    StopHook at the step every rank stops at; None while it goes on."""
    longest_save_s: float = 0.0
    """The longest a checkpoint of this run took to save so far (the time limit's reserve)."""
    eval_targets: list[EvalTarget] = field(default_factory=list)
    """What the run verifies on (`run_targets`: eval.targets, or the data's held-out set)."""
    distill: Distillation | None = None
    """train.teacher's parts (the projection a checkpoint saves as "distill"), else None."""

    @property
    def run_dir(self) -> Path:
        return self.cfg.run_dir

    @property
    def data_parallel_size(self) -> int:
        """Replicas that each see their own part of the batch (world / pipeline stages)."""
        return self.layout.dp_size if self.layout is not None else self.dist_info.world_size

    @property
    def batches_per_epoch(self) -> int:
        """This rank's batches in one epoch that make whole optimizer steps."""
        return self.steps_per_epoch * self.cfg.train.accumulate_steps

    @property
    def end_of_epoch(self) -> bool:
        return self.progress.batches_done >= self.batches_per_epoch

    def whole_backbone(self) -> nn.Module | None:
        """The whole backbone on rank 0 (a float copy put together from the stages when
        pipelined; collective then), for evaluation and export; None on other ranks."""
        if self.layout is None:
            return self.backbone if self.dist_info.is_main else None
        return gather_backbone(
            self.precision.fp32_state_dict(self.backbone),
            self.layout,
            self.cfg.model,
            self.cfg.data.image_hw,
            self.dist_info.device,
        )

    def checkpoint_parts(self) -> dict[str, Any]:
        """The parts a checkpoint saves (every rank passes its own; see recognition.checkpoint)."""
        parts: dict[str, Any] = {
            "backbone": self.backbone,
            "head": self.head,
            "precision": self.precision,
            "optimizer": OptimizerState(self.optimizer, self.param_ids),
            "scheduler": self.scheduler,
            "progress": self.progress,
            "meta": {
                "config": config_to_dict(self.cfg),
                "num_classes": self.num_classes,
                "classes_sha256": self.classes_sha256,
            },
            f"rng/{self.dist_info.rank}": self.rng,
        }
        if self.head is None:
            del parts["head"]
        if self.distill is not None and self.distill.trained:
            parts["distill"] = self.distill.loss
        return parts


def global_batch(cfg: ExperimentConfig, world_size: int) -> int:
    """Samples per optimizer step over all ranks."""
    return cfg.train.batch_size * cfg.train.accumulate_steps * world_size


@dataclass
class TrainData:
    """The run's data, made before its model (`build_data`; `build` takes it)."""

    source: TrainSource
    sampler: Sampler
    decode: Literal["cpu", "gpu"]
    """Where the images are decoded (data.decode resolved)."""
    layout: PipelineLayout | None
    """The pipeline mesh (model.pipeline_stages > 1), whose replicas split the data."""
    steps_per_epoch: int
    eval_targets: list[EvalTarget]
    """What the run verifies on (`run_targets`)."""

    @property
    def num_classes(self) -> int:
        return self.source.num_classes


def build_data(cfg: ExperimentConfig, dist_info: DistInfo) -> TrainData:
    """Check what the backbone cannot train, make the pipeline's mesh, the training data
    and its sampler on this rank (collective: ranks wait for rank 0's data setup). Writes
    nothing into the run directory."""
    check_backbone(cfg, dist_info)  # and its cut into stages, before the pipeline's mesh
    layout = make_layout(cfg.model.pipeline_stages, dist_info) if _pipelined(cfg) else None
    num_replicas = layout.dp_size if layout is not None else dist_info.world_size
    data, sampler, decode, targets = _build_data(cfg, dist_info, layout)
    steps_per_epoch = len(sampler) // cfg.train.batch_size // cfg.train.accumulate_steps
    if steps_per_epoch < 1:
        raise TrainingError(
            f"train.batch_size: {cfg.train.batch_size} x train.accumulate_steps "
            f"{cfg.train.accumulate_steps} x {num_replicas} data-parallel processes is more "
            f"than the {len(data)} training images of {cfg.data.root}"
        )
    log.info(
        "%d images of %d identities from %s; %d steps per epoch of %d images",
        len(data),
        data.num_classes,
        cfg.data.root,
        steps_per_epoch,
        global_batch(cfg, num_replicas),
    )
    return TrainData(data, sampler, decode, layout, steps_per_epoch, targets)


def build(
    cfg: ExperimentConfig,
    dist_info: DistInfo,
    *,
    resuming: bool,
    data: TrainData | None = None,
    init: InitBackbone | None = None,
    distill: Distillation | None = None,
) -> Run:
    """Make the run's parts on this rank (collective: ranks wait for rank 0's data setup).

    `data`: what `build_data` made for this run; None makes it now. `init`:
    train.init_backbone as `read_init_backbone` read it; None reads it when the run starts
    from it. `distill`: train.teacher's parts (`teacher_cache.prepare_distillation`). Writes
    config.yaml (and, unless `resuming`, classes.txt: a resumed run's classes are checked
    against its checkpoint first) into the run directory on rank 0.
    """
    if data is None:
        data = build_data(cfg, dist_info)
    source, layout, steps_per_epoch = data.source, data.layout, data.steps_per_epoch
    num_replicas = layout.dp_size if layout is not None else dist_info.world_size
    if dist_info.is_main:
        save_config(cfg, cfg.run_dir / "config.yaml")
        if not resuming:
            source.write_classes(cfg.run_dir / "classes.txt")

    # One batch sequence for the whole run (EpochBatches): the workers load across epochs.
    batches = EpochBatches(
        data.sampler, cfg.train.batch_size, steps_per_epoch * cfg.train.accumulate_steps
    )
    memory_format = torch.channels_last if cfg.data.channels_last else torch.preserve_format
    loader = _build_loader(
        cfg, dist_info, source, batches, layout, data.decode, memory_format, distill
    )
    total_steps = cfg.train.epochs * steps_per_epoch
    # A resumed run's weights and rows come from its checkpoint: nothing to start from.
    start = None
    if cfg.train.init_backbone is not None and not resuming:
        last = min(total_steps, cfg.train.max_steps or total_steps)
        start = partial(start_from_file, cfg, dist_info, source, init, last)
    elif cfg.train.init_backbone is not None:
        log.info("train.init_backbone: not loaded, the run resumes from its checkpoint")
    parts = build_model(
        cfg, dist_info, source.num_classes, layout, memory_format, start=start, distill=distill
    )
    optimizer = parts.optimizer
    warmup_steps = round(cfg.optim.warmup_epochs * steps_per_epoch)
    scheduler = build_scheduler(optimizer, total_steps, warmup_steps, cfg.optim, steps_per_epoch)
    progress = Progress(
        per_batch=cfg.train.batch_size * num_replicas,
        global_batch=global_batch(cfg, num_replicas),
        world_size=dist_info.world_size,
    )
    model, head_only = parts.model, cfg.train.head_only_steps
    if head_only > 0:
        model = HeadOnlyGate(model, lambda: progress.step < head_only)
    return Run(
        cfg=cfg,
        dist_info=dist_info,
        data=source,
        batches=batches,
        loader=loader,
        backbone=parts.backbone,
        model=model,
        head=parts.head,
        precision=parts.precision,
        optimizer=optimizer,
        scheduler=scheduler,
        progress=progress,
        steps_per_epoch=steps_per_epoch,
        last_step=min(total_steps, cfg.train.max_steps or total_steps),
        classes_sha256=source.classes_fingerprint(),
        num_classes=source.num_classes,
        memory_format=memory_format,
        step=parts.step,
        layout=layout,
        param_ids=parts.param_ids,
        eval_targets=data.eval_targets,
        distill=distill,
    )


Wrapper = Callable[[ExperimentConfig, DistInfo, nn.Module], nn.Module]


def build_model(
    cfg: ExperimentConfig,
    dist_info: DistInfo,
    num_classes: int,
    layout: PipelineLayout | None,
    memory_format: torch.memory_format,
    *,
    wrap: Wrapper | None = None,
    local_plan: StagePlan | None = None,
    start: Callable[[nn.Module, ShardedMarginSoftmax], None] | None = None,
    distill: Distillation | None = None,
) -> ModelParts:
    """This rank's model, head shard, precision and optimizer for `num_classes` classes.

    What `build` makes besides the data and the schedule, and what the run planner
    (`recognition.training.plan`) makes under fake tensors. `wrap` wraps the backbone, or
    a pipeline stage with several replicas, for data parallelism (given the config, the
    rank and the module); None: DistributedDataParallel (and torch.compile), as training
    does. `local_plan` (pipelines): the cut of the backbone made beforehand
    (`pipeline.stage_plan`), the stage's micro-batch shapes then found on this rank
    (`pipeline.local_stage_io`) rather than from the other stages; what the run planner
    gives, whose other ranks are not there to ask. None: as training does. `start` sets
    the fp32 backbone's and head's weights before they are cast and wrapped (fine-tuning:
    `recognition.training.finetune`); None keeps the random ones. `distill` (train.teacher):
    the model is `distill.Student` (with the projection), the step adds its loss.
    """
    precision = Precision(
        cfg.precision.level,
        cfg.precision.dtype,
        dist_info.device,
        # Ranks see different head gradients: the fp16 overflow check must be global.
        process_group=dist.group.WORLD if dist_info.is_distributed else None,
    )
    if layout is None:
        backbone, head = _build_model(cfg, dist_info, num_classes, memory_format)
        if start is not None:
            start(backbone, head)
        precision.prepare(backbone, head)
        student = backbone if distill is None else distill.student(backbone, precision)
        model = (wrap_model if wrap is None else wrap)(cfg, dist_info, student)
        training_loss = TrainingLoss.from_weights(
            cfg.head.id_weight, cfg.head.triplet_weight, cfg.head.triplet_margin
        )
        # head.id_weight / head.triplet_weight, and a distilled run's term.
        extra: dict[str, Any] = {}
        if training_loss is not None:
            extra["training_loss"] = training_loss
        if distill is not None:
            extra["distill"] = distill.step_term()
        step: Callable[..., StepResult] = partial(train_step, **extra) if extra else train_step
        if cfg.train.cuda_graphs:  # captured and replayed where it can be (its first call says)
            step = GraphedStep(step)
        param_ids = None
    else:
        backbone, head, model, step, param_ids = _build_pipeline(
            cfg, dist_info, layout, num_classes, memory_format, precision, wrap, local_plan
        )
    parts = [backbone] if head is None else [backbone, head]
    parts += distill.trained if distill is not None else []  # the projection, at the head's
    # The backbone at its fraction of the head's learning rate (optim.backbone_lr_scale).
    scales = [cfg.optim.backbone_lr_scale, 1.0, 1.0][: len(parts)]
    groups = param_groups(parts, cfg.optim.weight_decay, scales)
    optimizer = build_optimizer(precision.param_groups(groups), cfg.optim)
    # Partial FC: the optimizer must only move the class rows sampled for the step (under
    # O2 it steps the fp32 master of the head's weight, not the half weight itself).
    if head is not None and cfg.head.fused_update:  # the Triton backward steps the rows
        head.attach_fused_update(optimizer)
    elif head is not None:
        head.attach_optimizer(optimizer, precision.optimizer_param(head.weight))
    return ModelParts(backbone, model, head, precision, optimizer, step, param_ids)


def _pipelined(cfg: ExperimentConfig) -> bool:
    return cfg.model.pipeline_stages > 1


def _build_loader(
    cfg: ExperimentConfig,
    dist_info: DistInfo,
    data: TrainSource,
    batches: EpochBatches,
    layout: PipelineLayout | None,
    decode: Literal["cpu", "gpu"],
    memory_format: torch.memory_format,
    distill: Distillation | None,
) -> Iterable[tuple[torch.Tensor, ...]]:
    targets = distill.table if distill is not None else None  # cached teacher embeddings
    # Its own generator: creating the iterator must not draw from the global RNG, or a run
    # resumed mid-epoch would see different dropout / sampling draws.
    generator = torch.Generator().manual_seed(cfg.seed + dist_info.rank)
    if layout is not None and not layout.is_first:
        # Later stages need the labels alone, and those need no worker to decode anything.
        return DataLoader(
            LabelsOnly(data.labels), batch_sampler=batches, generator=generator, num_workers=0
        )
    return build_loader(
        cfg.data,
        data,
        batches,
        decode=decode,
        device=dist_info.device,
        memory_format=memory_format,
        generator=generator,
        targets=targets,
    )


def _build_data(
    cfg: ExperimentConfig, dist_info: DistInfo, layout: PipelineLayout | None
) -> tuple[TrainSource, Sampler, Literal["cpu", "gpu"], list[EvalTarget]]:
    """The training source (less the identities eval.holdout keeps out), its sampler, where
    its images are decoded (data.decode), and the targets the run verifies on."""
    if cfg.data.synthetic.enabled and cfg.uses_synthetic:  # generated only for a run using it
        if dist_info.is_main:
            ensure_synthetic_dataset(Path(cfg.data.synthetic.root), cfg.data.synthetic.spec())
        distributed.barrier()
    # Evaluation targets are checked now, not found missing hours into the run.
    check_training_targets(cfg, dist_info)
    data = build_train_dataset(
        cfg.data, rank_is_main=dist_info.is_main, barrier=distributed.barrier
    )
    data, targets = split_for_eval(cfg, dist_info, data)
    # data.sampler=random is DistributedSampler's order: one permutation per epoch (the same
    # on every rank), rank r taking every W-th sample, the tail that does not divide by W
    # dropped; pk is P identities x K images per batch, whole groups per rank. Incomplete
    # last batches are dropped too, so every rank runs the same number of steps. With a
    # pipeline the replicas split the data: a replica's stages all see its batches.
    sampler = build_sampler(
        cfg.data,
        data.labels,
        batch_size=cfg.train.batch_size,
        num_replicas=layout.dp_size if layout is not None else dist_info.world_size,
        rank=layout.dp_rank if layout is not None else dist_info.rank,
        seed=cfg.seed,
    )
    # Before anything is written: data.decode=gpu without a CUDA device stops here, on
    # every rank. The later stages of a pipeline read labels only (LabelsOnly): they need
    # no decoder, nor the probe of one that auto makes.
    if layout is not None and not layout.is_first and cfg.data.decode != "gpu":
        return data, sampler, "cpu", targets
    return data, sampler, resolve_decode(cfg.data, dist_info.device, data), targets


def _to_device(
    module: nn.Module, device: torch.device, memory_format: torch.memory_format
) -> nn.Module:
    # Nothing to move for a CPU module in its own format; Module.to would still make every
    # parameter anew, which it cannot do to the planner's fake tensors.
    if device.type == "cpu" and memory_format == torch.preserve_format:
        return module
    return module.to(device, memory_format=memory_format)


def _build_model(
    cfg: ExperimentConfig,
    dist_info: DistInfo,
    num_classes: int,
    memory_format: torch.memory_format,
) -> tuple[nn.Module, ShardedMarginSoftmax]:
    device = dist_info.device
    backbone = backbone_from_config(cfg.model, cfg.data.image_hw)
    if cfg.model.sync_bn and dist_info.is_distributed:
        if device.type != "cuda":
            raise TrainingError(
                "model.sync_bn: torch's SyncBatchNorm runs on GPUs only; train on CPU without "
                "it (model.sync_bn=false)"
            )
        backbone = nn.SyncBatchNorm.convert_sync_batchnorm(backbone)
    if cfg.model.freeze_bn:
        log.info("model.freeze_bn: %d BatchNorm layers frozen", freeze_batch_norm(backbone))
    if cfg.head.triplet_weight > 0:
        where = "before the BN neck" if use_neck_features(backbone) else "the embeddings"
        log.info("head.triplet_weight: the triplet loss on the features %s", where)
    backbone = _to_device(backbone, device, memory_format)
    # Each rank builds only its shard of the class matrix (the head reads rank and world
    # size from the process group), drawn so that the whole matrix is the same on any
    # number of ranks.
    head = build_head(cfg.head, num_classes, cfg.model.embedding_size, seed=cfg.seed, device=device)
    log.info(
        "head: %d classes, %d on this rank (classes %d-%d)",
        num_classes,
        head.num_local,
        head.class_start,
        head.class_start + head.num_local - 1,
    )
    return backbone, head


def _build_pipeline(
    cfg: ExperimentConfig,
    dist_info: DistInfo,
    layout: PipelineLayout,
    num_classes: int,
    memory_format: torch.memory_format,
    precision: Precision,
    wrap: Wrapper | None,
    local_plan: StagePlan | None,
) -> tuple[nn.Module, ShardedMarginSoftmax | None, nn.Module, PipelineStep, list[int]]:
    """This rank's stage, the head on the last stage's ranks (sharded over their
    data-parallel group), the stage as the schedule runs it, the step, and the optimizer's
    parameter indices in the whole model's optimizer (`wrap`, `local_plan`: build_model)."""
    device, image_hw = dist_info.device, cfg.data.image_hw
    stage, plan = build_stage_backbone(cfg.model, image_hw, layout, cfg.seed, local_plan)
    if dist_info.is_main:
        log.info(
            "pipeline: %d stages x %d data-parallel replicas, %d micro-batches of %d (%s); %s",
            layout.num_stages,
            layout.dp_size,
            cfg.micro_batches,
            cfg.train.batch_size // cfg.micro_batches,
            cfg.model.pipeline_schedule,
            plan.describe(),
        )
    if cfg.model.sync_bn and layout.dp_size > 1:
        if device.type != "cuda":
            raise TrainingError(
                "model.sync_bn: torch's SyncBatchNorm runs on GPUs only; train on CPU without "
                "it (model.sync_bn=false)"
            )
        stage = nn.SyncBatchNorm.convert_sync_batchnorm(stage, process_group=layout.dp_group)
    stage = _to_device(stage, device, memory_format)
    head = None
    if layout.is_last:
        head = build_head(
            cfg.head,
            num_classes,
            cfg.model.embedding_size,
            seed=cfg.seed,
            device=device,
            group=layout.dp_group,
        )
    precision.prepare(*([stage] if head is None else [stage, head]))
    find_io = stage_io  # the stages pass their shapes on; the run planner's find their own
    if local_plan is not None:
        find_io = partial(local_stage_io, cfg.model, image_hw, plan)
    model, step = build_pipeline_step(
        stage,
        layout,
        head,
        precision,
        device=device,
        image_hw=image_hw,
        micro_batch_size=cfg.train.batch_size // cfg.micro_batches,
        schedule=cfg.model.pipeline_schedule,
        num_micro=cfg.micro_batches,
        memory_format=memory_format,
        find_io=find_io,
        wrap=None if wrap is None else partial(wrap, cfg, dist_info),
    )
    # The whole model's optimizer order, which a checkpoint's optimizer state is keyed by;
    # a bias-free Linear stands for the head there (one 2-D parameter called weight).
    head_shape = nn.Linear(1, 1, bias=False, device="meta")
    whole = param_names([("backbone", plan.whole), ("head", head_shape)])
    order = {name: index for index, name in enumerate(whole)}
    mine = [("backbone", stage)] + ([("head", head)] if head is not None else [])
    param_ids = [order[name] for name in param_names(mine)]
    return stage, head, model, step, param_ids
