"""`train.init_backbone`: the backbone a fresh run starts from, checked strictly.

The file is read by `recognition.checkpoint.backbone_files.load_backbone_file` (a backbone
export, a training checkpoint directory, and whatever kinds it tells apart), which returns
the model config it was made with, its input size and an fp32 state dict. Every key and
shape of the run's backbone must be in the file and the file must hold nothing else; the
one exception is a file whose model config says `trunk_only` (a classification network's
trunk, e.g. ImageNet weights): its keys must all fit, and the layers it lacks (the
embedding) start from their random weights. Whatever does not fit stops the run in one line
naming the file, before anything of the run is written.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recognition.checkpoint.backbone_files import load_backbone_file
from recognition.checkpoint.foreign import TRUNK_ONLY
from recognition.config import ConfigError, ExperimentConfig
from recognition.config.values import image_size_pair
from recognition.models import backbone_from_config

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InitBackbone:
    """A backbone file read and checked against the run: what `load_init_backbone` loads."""

    path: Path
    trunk_only: bool
    """The file holds a classification network's trunk: the embedding layers start fresh."""
    state: dict[str, torch.Tensor]  # fp32, on the CPU


def read_init_backbone(path: str | Path, cfg: ExperimentConfig) -> InitBackbone:
    """The backbone file `path`, read once and checked against the run `cfg` describes
    (the backbone built on the meta device only); ConfigError (one line naming `path`) when
    it cannot start the run: missing, unreadable, another embedding size or image size, or a
    key or shape that does not fit."""
    with torch.device("meta"):
        backbone = backbone_from_config(cfg.model, cfg.data.image_hw)
    return _read_and_check(Path(path), backbone, cfg)


def check_init_backbone(path: str | Path, cfg: ExperimentConfig) -> None:
    """Raise ConfigError as `read_init_backbone` does; keep nothing."""
    read_init_backbone(path, cfg)


def load_init_backbone(
    backbone: nn.Module, cfg: ExperimentConfig, init: InitBackbone | None = None
) -> None:
    """Load train.init_backbone into `backbone` (the bare module, before it is cast for the
    precision level and wrapped): `init`, the file as `read_init_backbone` read it, or (None)
    the file read and checked now."""
    assert cfg.train.init_backbone is not None
    path = Path(cfg.train.init_backbone)
    if init is None:
        init = _read_and_check(path, backbone, cfg)
    device = next(backbone.parameters()).device
    with torch.no_grad():
        missing, _ = backbone.load_state_dict(
            {k: v.to(device) for k, v in init.state.items()}, strict=not init.trunk_only
        )
    if missing:
        layers = sorted({key.rsplit(".", 1)[0] for key in missing})
        log.info(
            "train.init_backbone: %s holds the trunk only; %s start from random weights",
            path,
            ", ".join(layers),
        )
    log.info("train.init_backbone: loaded %d tensors from %s", len(init.state), path)


def _read_and_check(path: Path, backbone: nn.Module, cfg: ExperimentConfig) -> InitBackbone:
    """The file `path` read and checked against `backbone` and `cfg`, or ConfigError."""
    where = f"train.init_backbone: {path}"
    if not path.exists():
        raise ConfigError(f"{where}: no such file or directory")
    try:
        model_cfg, image_size, state = load_backbone_file(path)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    trunk_only = bool(model_cfg.get(TRUNK_ONLY, False))
    if not trunk_only:  # a trunk has no embedding, and takes any image size
        _check_model(where, model_cfg, image_size, cfg)
    check_state_fits(where, backbone.state_dict(), state, trunk_only=trunk_only)
    return InitBackbone(path, trunk_only, state)


def _check_model(
    where: str, model_cfg: dict[str, Any], image_size: Any, cfg: ExperimentConfig
) -> None:
    size = model_cfg.get("embedding_size")
    if size is not None and int(size) != cfg.model.embedding_size:
        raise ConfigError(
            f"{where}: the backbone makes {size}-d embeddings, the config asks for "
            f"model.embedding_size={cfg.model.embedding_size}"
        )
    if image_size is not None and image_size_pair(image_size) != cfg.data.image_hw:
        h, w = image_size_pair(image_size)
        raise ConfigError(
            f"{where}: the backbone was trained on {h}x{w} images, the config has "
            f"data.image_size={cfg.data.image_size} (its crops must match the file's)"
        )


def check_state_fits(
    where: str,
    expected: dict[str, torch.Tensor],
    given: dict[str, torch.Tensor],
    *,
    trunk_only: bool = False,
) -> None:
    """ConfigError naming the first key of `given` that `expected` (the run's backbone)
    lacks, the first key it misses (unless `trunk_only`), or the first shape that differs."""
    extra = [key for key in given if key not in expected]
    if extra:
        raise ConfigError(f"{where}: holds {extra[0]!r}, which the run's backbone does not have")
    missing = [key for key in expected if key not in given]
    if missing and not trunk_only:
        raise ConfigError(f"{where}: lacks {missing[0]!r} of the run's backbone")
    for key, value in given.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise ConfigError(
                f"{where}: {key!r} has shape {tuple(value.shape)}, the run's backbone "
                f"{tuple(expected[key].shape)} (model.backbone / model.width differ)"
            )
