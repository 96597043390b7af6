"""Starting a fresh run from a backbone file (docs/finetune.md): the loaded weights, then,
with head.init=centroids, the class rows from the data under them, and a warning when the
run holds the backbone near its start although its features separate the new classes
poorly."""

from __future__ import annotations

import logging
import math

from torch import nn

from recognition.config import ExperimentConfig
from recognition.data.source import TrainSource
from recognition.distributed import DistInfo
from recognition.heads import ShardedMarginSoftmax
from recognition.training.finetune.centroids import init_centroids
from recognition.training.finetune.init_backbone import InitBackbone, load_init_backbone
from recognition.training.finetune.separation import Separation

log = logging.getLogger(__name__)

POOR_SEPARATION = 1.6
"""d' of the new images' pair cosines under the loaded backbone below which the warning
speaks (docs/finetune.md: calibrated on real faces, same domain against shifted)."""
SMALL_LR_SCALE = 0.1
"""An optim.backbone_lr_scale below this holds the backbone near its start."""
LONG_HEAD_ONLY = 0.25
"""train.head_only_steps of at least this share of the run's steps hold it too."""


def start_from_file(
    cfg: ExperimentConfig,
    dist_info: DistInfo,
    source: TrainSource,
    init: InitBackbone | None,
    total_steps: int,
    backbone: nn.Module,
    head: ShardedMarginSoftmax,
) -> None:
    """Load train.init_backbone (`init`: the file as read before the data, or None to read
    it now) into `backbone` and, with head.init=centroids, set `head`'s
    rows (both still fp32 and unwrapped: before the precision level casts them and DDP
    broadcasts rank 0's backbone, which every rank loaded alike). `total_steps`: the
    run's optimizer steps (for what a long train.head_only_steps is)."""
    load_init_backbone(backbone, cfg, init)
    if cfg.head.init != "centroids":
        return
    separation = init_centroids(
        backbone,
        head,
        source,
        dist_info,
        batch_size=cfg.train.batch_size,
        num_workers=cfg.data.num_workers,
        progress=cfg.train.progress,
    )
    if not dist_info.is_main:
        return
    log.info(
        "head.init=centroids: the pretrained features separate the new classes with d' %.2f "
        "(pair cosines: same identity %.3f +- %.3f over %d pairs, different %.3f +- %.3f)",
        separation.d_prime,
        separation.same_mean,
        separation.same_std,
        separation.num_same_pairs,
        separation.different_mean,
        separation.different_std,
    )
    message = poor_separation_warning(separation, held_near_start(cfg, total_steps))
    if message:
        log.warning(message)


def held_near_start(cfg: ExperimentConfig, total_steps: int) -> list[str]:
    """The settings of `cfg` that keep a loaded backbone near its start."""
    held = []
    if cfg.model.freeze_bn:
        held.append("model.freeze_bn=true")
    if cfg.optim.backbone_lr_scale < SMALL_LR_SCALE:
        held.append(f"optim.backbone_lr_scale={cfg.optim.backbone_lr_scale:g}")
    if cfg.train.head_only_steps >= LONG_HEAD_ONLY * total_steps:
        held.append(f"train.head_only_steps={cfg.train.head_only_steps} of {total_steps}")
    return held


def poor_separation_warning(separation: Separation, held: list[str]) -> str | None:
    """The one-line warning when `held` settings keep the backbone near its start and its
    features separate the new classes poorly (d' below POOR_SEPARATION); None otherwise
    (and without same-identity pairs, where d' says nothing)."""
    d_prime = separation.d_prime
    if not held or math.isnan(d_prime) or d_prime >= POOR_SEPARATION:
        return None
    return (
        f"head.init=centroids: the pretrained features separate the new classes poorly "
        f"(d' {d_prime:.2f} < {POOR_SEPARATION}) and {', '.join(held)} keep the backbone "
        "near its start: the new faces likely differ from the pretraining ones; let it move "
        f"(model.freeze_bn=false, optim.backbone_lr_scale >= {SMALL_LR_SCALE:g}, a short "
        "train.head_only_steps; docs/finetune.md)"
    )
