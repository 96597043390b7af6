"""What the run's backbone cannot train, refused before anything is built (`build`)."""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from recognition.config import ConfigError, ExperimentConfig
from recognition.distributed import DistInfo
from recognition.models import backbone_from_config
from recognition.models.cpu_layout import channels_last_refusal
from recognition.pipeline import check_stages


def check_backbone(cfg: ExperimentConfig, dist_info: DistInfo) -> None:
    """Refuse, before anything is built, what the backbone cannot train (it is made on the
    meta device to be looked at): channels-last on a CPU where oneDNN gets its gradient
    wrong, batches of one sample for BatchNorm, and a cut into pipeline stages that
    model.pipeline_split cannot make (before the mesh: it stops every rank alike)."""
    with torch.device("meta"):
        backbone = backbone_from_config(cfg.model, cfg.data.image_hw)
    what = f"{cfg.model.backbone} at model.width={cfg.model.width:g}"
    if cfg.data.channels_last and dist_info.device.type == "cpu":
        if (refusal := channels_last_refusal(backbone, what)) is not None:
            raise ConfigError(refusal)
    # SyncBatchNorm pools the ranks' samples; a pipeline's micro-batches are checked with
    # the config (recognition.config.check_pipeline).
    pooled = (cfg.model.sync_bn and dist_info.is_distributed) or cfg.model.pipeline_stages > 1
    has_batch_norm = any(isinstance(m, _BatchNorm) for m in backbone.modules())
    if cfg.train.batch_size < 2 and has_batch_norm and not pooled:
        raise ConfigError(
            f"train.batch_size=1: {what} has BatchNorm layers, which cannot train on one "
            "sample per process; use at least 2 (train.accumulate_steps adds batches up)"
        )
    if cfg.model.pipeline_stages > 1:
        check_stages(cfg.model, cfg.data.image_hw, cfg.model.pipeline_stages)
