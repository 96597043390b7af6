"""Starting a fresh run from a backbone file (docs/finetune.md): the loaded weights, then,
with head.init=centroids, the class rows from the data under them."""

from __future__ import annotations

from torch import nn

from recognition.config import ExperimentConfig
from recognition.data.source import TrainSource
from recognition.distributed import DistInfo
from recognition.heads import ShardedMarginSoftmax
from recognition.training.finetune.centroids import init_centroids
from recognition.training.finetune.init_backbone import InitBackbone, load_init_backbone


def start_from_file(
    cfg: ExperimentConfig,
    dist_info: DistInfo,
    source: TrainSource,
    init: InitBackbone | None,
    backbone: nn.Module,
    head: ShardedMarginSoftmax,
) -> None:
    """Load train.init_backbone (`init`: the file as read before the data, or None to read
    it now) into `backbone` and, with head.init=centroids, set `head`'s
    rows (both still fp32 and unwrapped: before the precision level casts them and DDP
    broadcasts rank 0's backbone, which every rank loaded alike)."""
    load_init_backbone(backbone, cfg, init)
    if cfg.head.init == "centroids":
        init_centroids(
            backbone,
            head,
            source,
            dist_info,
            batch_size=cfg.train.batch_size,
            num_workers=cfg.data.num_workers,
            progress=cfg.train.progress,
        )
