"""Backbones: images in, embeddings (B, embedding_size) out.

`BACKBONES` (recognition/registry.py) maps the config's `model.backbone` name to a
constructor that takes the keyword-only arguments `embedding_size`, `width`, `dropout` and
`image_size`: IResNet 18-200, MobileFaceNet (mbf, mbf_large) and the ViTs (vit_t ... vit_h)
in arcface_torch's layouts, and torchvision's ResNet-50 for re-id.
"""

from __future__ import annotations

from torch import nn

from recognition.config import ModelConfig
from recognition.models.iresnet import (
    IRESNET_LAYERS,
    IResNet,
    iresnet,
    iresnet18,
    iresnet34,
    iresnet50,
    iresnet100,
    iresnet200,
)
from recognition.models.mobilefacenet import MBF_LAYOUTS, MobileFaceNet, mobilefacenet
from recognition.models.resnet import ReIDResNet50, resnet50_reid
from recognition.models.vit import VIT_SIZES, VisionTransformer, vit
from recognition.registry import BACKBONES, load


def build_backbone(name: str, **kwargs: object) -> nn.Module:
    """Build the backbone called `name` (a key of BACKBONES) with keyword arguments `kwargs`.

    Returns the module; raises ValueError naming `model.backbone` for an unknown name.
    """
    if name not in BACKBONES:
        raise ValueError(
            f"model.backbone: unknown backbone {name!r} (choose from {', '.join(BACKBONES)})"
        )
    return load(BACKBONES, name, "model.backbone")(**kwargs)


def check_input_size(
    backbone: nn.Module, image_size: int | tuple[int, int] | None, key: str
) -> None:
    """Refuse an `image_size` that a backbone built for one input size cannot take (an
    IResNet: its fc layer is sized for the map of its own input size), naming `key` (the
    flag or config key that asked for it); None or a backbone of any size passes."""
    fixed = getattr(backbone, "image_size", None)
    if image_size is None or fixed is None:
        return
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    if (height, width) != tuple(fixed):
        raise ValueError(
            f"{key} {height}x{width}: this checkpoint's backbone takes {fixed[0]}x{fixed[1]} "
            f"images only (its layers are sized for them); leave {key} out"
        )


def use_neck_features(backbone: nn.Module) -> bool:
    """Make `backbone` return (features before its BN neck, embeddings) in training mode,
    for the triplet loss, where it has a BN neck (resnet50_reid's BatchNorm1d after the
    pooling, IResNet's after the fc); returns whether it has."""
    if not isinstance(backbone, ReIDResNet50 | IResNet):
        return False
    backbone.neck_features = True
    return True


def backbone_from_config(cfg: ModelConfig, image_size: tuple[int, int]) -> nn.Module:
    """The backbone `model.*` describes, for inputs of `image_size` (H, W)."""
    return build_backbone(
        cfg.backbone,
        embedding_size=cfg.embedding_size,
        width=cfg.width,
        dropout=cfg.dropout,
        image_size=image_size,
    )


__all__ = [
    "BACKBONES",
    "IRESNET_LAYERS",
    "IResNet",
    "MBF_LAYOUTS",
    "MobileFaceNet",
    "ReIDResNet50",
    "VIT_SIZES",
    "VisionTransformer",
    "backbone_from_config",
    "build_backbone",
    "check_input_size",
    "iresnet",
    "iresnet18",
    "iresnet34",
    "iresnet50",
    "iresnet100",
    "iresnet200",
    "mobilefacenet",
    "resnet50_reid",
    "use_neck_features",
    "vit",
]
