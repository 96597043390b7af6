"""`build(cfg, dist_info)`: the run's parts, each made by the module that owns it.

Data (`recognition.data.build`), backbone (`recognition.models`), head
(`recognition.heads`), precision (`recognition.precision`), optimizer and schedule
(`recognition.optim`), and the run's progress; `Run` holds them for the loop, the hooks
and the checkpoints (`Run.checkpoint_parts`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Sampler

from recognition import distributed
from recognition.config import ExperimentConfig, config_to_dict, save_config
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
from recognition.evaluation.run import check_training_targets
from recognition.heads import ShardedMarginSoftmax, build_head
from recognition.models import backbone_from_config
from recognition.optim import OptimizerState, build_optimizer, build_scheduler, param_groups
from recognition.precision import Precision
from recognition.training.state import Progress, RngState

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite losses, a run directory that would be overwritten)."""


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
    """The bare backbone (what checkpoints and exports hold)."""
    model: nn.Module
    """What the step calls: the backbone, wrapped in DDP with several ranks, compiled with
    train.compile."""
    head: ShardedMarginSoftmax
    precision: Precision
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    progress: Progress
    steps_per_epoch: int
    last_step: int
    classes_sha256: str
    memory_format: torch.memory_format = torch.preserve_format
    rng: RngState = field(default_factory=RngState)

    @property
    def run_dir(self) -> Path:
        return self.cfg.run_dir

    @property
    def batches_per_epoch(self) -> int:
        """This rank's batches in one epoch that make whole optimizer steps."""
        return self.steps_per_epoch * self.cfg.train.accumulate_steps

    @property
    def end_of_epoch(self) -> bool:
        return self.progress.batches_done >= self.batches_per_epoch

    def checkpoint_parts(self) -> dict[str, Any]:
        """The parts a checkpoint saves (every rank passes its own; see recognition.checkpoint)."""
        return {
            "backbone": self.backbone,
            "head": self.head,
            "precision": self.precision,
            "optimizer": OptimizerState(self.optimizer),
            "scheduler": self.scheduler,
            "progress": self.progress,
            "meta": {
                "config": config_to_dict(self.cfg),
                "num_classes": self.head.num_classes,
                "classes_sha256": self.classes_sha256,
            },
            f"rng/{self.dist_info.rank}": self.rng,
        }


def global_batch(cfg: ExperimentConfig, world_size: int) -> int:
    """Samples per optimizer step over all ranks."""
    return cfg.train.batch_size * cfg.train.accumulate_steps * world_size


def build(cfg: ExperimentConfig, dist_info: DistInfo, *, resuming: bool) -> Run:
    """Make the run's parts on this rank (collective: ranks wait for rank 0's data setup).

    Writes config.yaml (and, unless `resuming`, classes.txt: a resumed run's classes are
    checked against its checkpoint first) into the run directory on rank 0.
    """
    data, sampler, decode = _build_data(cfg, dist_info)
    steps_per_epoch = len(sampler) // cfg.train.batch_size // cfg.train.accumulate_steps
    if steps_per_epoch < 1:
        raise TrainingError(
            f"train.batch_size: {cfg.train.batch_size} x train.accumulate_steps "
            f"{cfg.train.accumulate_steps} x {dist_info.world_size} processes is more than "
            f"the {len(data)} training images of {cfg.data.root}"
        )
    log.info(
        "%d images of %d identities from %s; %d steps per epoch of %d images",
        len(data),
        data.num_classes,
        cfg.data.root,
        steps_per_epoch,
        global_batch(cfg, dist_info.world_size),
    )
    if dist_info.is_main:
        save_config(cfg, cfg.run_dir / "config.yaml")
        if not resuming:
            data.write_classes(cfg.run_dir / "classes.txt")

    # One batch sequence for the whole run (EpochBatches): the workers load across epochs.
    batches = EpochBatches(
        sampler, cfg.train.batch_size, steps_per_epoch * cfg.train.accumulate_steps
    )
    memory_format = torch.channels_last if cfg.data.channels_last else torch.preserve_format
    loader = build_loader(
        cfg.data,
        data,
        batches,
        decode=decode,
        device=dist_info.device,
        memory_format=memory_format,
        # Its own generator: creating the iterator must not draw from the global RNG, or a
        # run resumed mid-epoch would see different dropout / sampling draws.
        generator=torch.Generator().manual_seed(cfg.seed + dist_info.rank),
    )
    backbone, head = _build_model(cfg, dist_info, data.num_classes, memory_format)
    precision = Precision(
        cfg.precision.level,
        cfg.precision.dtype,
        dist_info.device,
        # Ranks see different head gradients: the fp16 overflow check must be global.
        process_group=dist.group.WORLD if dist_info.is_distributed else None,
    )
    precision.prepare(backbone, head)
    # The backbone is replicated: DDP broadcasts rank 0's weights now and averages the
    # gradients in backward. The head is not wrapped: its shard is this rank's alone.
    model: nn.Module = backbone
    if dist_info.is_distributed:
        device = dist_info.device
        model = DistributedDataParallel(
            backbone, device_ids=[device.index] if device.type == "cuda" else None
        )
    if cfg.train.compile:
        # Compiled over the DDP wrapper, so that DDP's optimizer splits the graph at its
        # gradient buckets and all-reduces overlap the backward pass.
        model = torch.compile(model, mode=cfg.train.compile_mode, backend=cfg.train.compile_backend)
    groups = param_groups([backbone, head], cfg.optim.weight_decay)
    optimizer = build_optimizer(precision.param_groups(groups), cfg.optim)
    # Partial FC: the optimizer must only move the class rows sampled for the step (under
    # O2 it steps the fp32 master of the head's weight, not the half weight itself).
    if cfg.head.fused_update:  # the Triton backward steps the rows; weight.grad stays None
        head.attach_fused_update(optimizer)
    else:
        head.attach_optimizer(optimizer, precision.optimizer_param(head.weight))

    total_steps = cfg.train.epochs * steps_per_epoch
    warmup_steps = round(cfg.optim.warmup_epochs * steps_per_epoch)
    scheduler = build_scheduler(optimizer, total_steps, warmup_steps, cfg.optim)
    progress = Progress(
        per_batch=cfg.train.batch_size * dist_info.world_size,
        global_batch=global_batch(cfg, dist_info.world_size),
        world_size=dist_info.world_size,
    )
    return Run(
        cfg=cfg,
        dist_info=dist_info,
        data=data,
        batches=batches,
        loader=loader,
        backbone=backbone,
        model=model,
        head=head,
        precision=precision,
        optimizer=optimizer,
        scheduler=scheduler,
        progress=progress,
        steps_per_epoch=steps_per_epoch,
        last_step=min(total_steps, cfg.train.max_steps or total_steps),
        classes_sha256=data.classes_fingerprint(),
        memory_format=memory_format,
    )


def _build_data(
    cfg: ExperimentConfig, dist_info: DistInfo
) -> tuple[TrainSource, Sampler, Literal["cpu", "gpu"]]:
    """The training source, its sampler, and where its images are decoded (data.decode)."""
    if cfg.data.synthetic.enabled:
        if dist_info.is_main:
            ensure_synthetic_dataset(Path(cfg.data.synthetic.root), cfg.data.synthetic.spec())
        distributed.barrier()
    # Evaluation targets are checked now, not found missing hours into the run.
    check_training_targets(cfg, dist_info)
    data = build_train_dataset(
        cfg.data, rank_is_main=dist_info.is_main, barrier=distributed.barrier
    )
    # data.sampler=random is DistributedSampler's order: one permutation per epoch (the same
    # on every rank), rank r taking every W-th sample, the tail that does not divide by W
    # dropped; pk is P identities x K images per batch, whole groups per rank. Incomplete
    # last batches are dropped too, so every rank runs the same number of steps.
    sampler = build_sampler(
        cfg.data,
        data.labels,
        batch_size=cfg.train.batch_size,
        num_replicas=dist_info.world_size,
        rank=dist_info.rank,
        seed=cfg.seed,
    )
    # Before anything is written: data.decode=gpu without a CUDA device stops here.
    return data, sampler, resolve_decode(cfg.data, dist_info.device, data)


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
    backbone = backbone.to(device, memory_format=memory_format)
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
