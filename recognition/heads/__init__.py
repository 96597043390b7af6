"""Classification heads: margins (ArcFace, CosFace, ...) and the margin-softmax loss."""

from __future__ import annotations

import torch
import torch.distributed as dist

from recognition.config import HeadConfig
from recognition.heads.margin_softmax import ShardedMarginSoftmax, shard_range
from recognition.heads.margins import build_margin


def build_head(
    cfg: HeadConfig,
    num_classes: int,
    embedding_size: int,
    *,
    seed: int,
    device: torch.device | str | None = None,
    group: dist.ProcessGroup | None = None,
) -> ShardedMarginSoftmax:
    """This rank's shard of the margin-softmax head as `head.*` says, made on `device`, its
    classes split over the ranks of `group` (all of them when None)."""
    margin = build_margin(
        cfg.margin,
        scale=cfg.scale,
        m=cfg.m,
        m1=cfg.m1,
        m2=cfg.m2,
        m3=cfg.m3,
        h=cfg.h,
        t_alpha=cfg.t_alpha,
    )
    return ShardedMarginSoftmax(
        num_classes,
        embedding_size,
        margin,
        sample_rate=cfg.sample_rate,
        chunk_size=cfg.chunk_size,
        group=group,
        seed=seed,
        device=device,
        kernel=cfg.kernel,
        tuning_cache=cfg.tuning_cache,
        label_smoothing=cfg.label_smoothing,
    )


__all__ = ["ShardedMarginSoftmax", "build_head", "build_margin", "shard_range"]
