"""Backbone files: writing the backbone export, and telling and reading every kind of file
a backbone is loaded from (for evaluation, exports and `train.init_backbone`).

Kinds read here, each by a reader that returns (model config dict, input image size,
backbone state dict):
- a training checkpoint (a DCP directory): the backbone's entries and the run's config,
  with the O2 fp32 masters in place of half weights;
- a backbone export (one torch file, `export_backbone`): {"format": BACKBONE_FORMAT,
  "model", "image_size", "state_dict"}, fp32;
- a state dict from another tool: an arcface_torch IResNet or a torchvision ResNet-50
  (`recognition.checkpoint.foreign`; a ResNet-50's model config dict holds
  `"trunk_only": True` and its state dict only the trunk's `base.*` keys).
`load_backbone` rebuilds the model from what a reader returns.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recognition.checkpoint.files import atomic_save, fp32_cpu_state, load_file
from recognition.checkpoint.foreign import TRUNK_ONLY, read_foreign
from recognition.checkpoint.store import read_part
from recognition.models import build_backbone
from recognition.precision import master_weights

log = logging.getLogger(__name__)

BACKBONE_FORMAT = "recognition-backbone-v1"

# (model config dict, input image size: a side or (H, W), state dict)
BackboneFile = tuple[dict[str, Any], int | tuple[int, int], dict[str, torch.Tensor]]


def export_backbone(
    path: Path,
    backbone: torch.nn.Module,
    model_cfg: dict[str, Any],
    image_size: int | Sequence[int],
) -> None:
    """Write the backbone alone (fp32 weights and how to rebuild it) for evaluation.

    `image_size` (one side, or (H, W)) is stored as an int or a [H, W] list.
    """
    state = fp32_cpu_state(backbone)
    atomic_save(
        {
            "format": BACKBONE_FORMAT,
            "model": model_cfg,
            "image_size": image_size if isinstance(image_size, int) else list(image_size),
            "state_dict": state,
        },
        path,
    )


def load_backbone_file(path: Path) -> BackboneFile:
    """Read a backbone export or a foreign state dict (a file; see the module's docstring)
    or a training checkpoint (a DCP directory).

    Returns (model config dict, input image size, backbone state dict); the size is an int
    (a square side, as every export before [H, W] sizes holds) or (H, W). From a training
    checkpoint the weights are fp32: the O2 masters where the run kept any (the backbone is
    the first module the training prepares).
    """
    if path.is_dir():
        return _from_training_checkpoint(path)
    return _from_file(path)


def load_backbone(
    path: str | os.PathLike, device: torch.device
) -> tuple[nn.Module, int | tuple[int, int]]:
    """Rebuild a backbone from any file `load_backbone_file` reads.

    Returns the model in eval mode on `device` and the input size it was trained at (a
    square side or (H, W)). A trunk-only file (a torchvision ResNet-50) gets a fresh BN
    neck: in eval mode the identity, so the embeddings are the pooled 2048 trunk features.
    """
    model_cfg, image_size, state = load_backbone_file(Path(path))
    backbone = build_backbone(
        model_cfg["backbone"],
        embedding_size=model_cfg["embedding_size"],
        width=model_cfg.get("width", 1.0),
        dropout=model_cfg.get("dropout", 0.0),
        image_size=image_size,
    )
    trunk_only = bool(model_cfg.get(TRUNK_ONLY, False))
    try:
        # A trunk-only file's reader checked every trunk key; the rest start as built.
        missing, _ = backbone.load_state_dict(state, strict=not trunk_only)
    except RuntimeError as exc:
        raise ValueError(f"checkpoint {path}: weights do not fit the backbone: {exc}") from exc
    if trunk_only:
        log.info(
            "checkpoint %s: a ResNet-50 trunk only; the BN neck starts fresh (%s), so the "
            "embeddings are the pooled trunk features",
            path,
            ", ".join(sorted({k.rsplit(".", 1)[0] for k in missing})),
        )
    return backbone.float().eval().to(device), image_size


# ---------------------------------------------------------------------- one reader a kind


def _from_training_checkpoint(path: Path) -> BackboneFile:
    meta = read_part(path, "meta")
    if not isinstance(meta, dict) or "config" not in meta:
        raise ValueError(f"checkpoint {path}: no meta entry with the run's config")
    state = read_part(path, "backbone")
    state = state if isinstance(state, dict) else {}
    precision_state = read_part(path, "precision")
    if isinstance(precision_state, dict):
        state.update(master_weights(precision_state, 0))
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    cfg = meta["config"]
    return cfg["model"], _stored_image_size(cfg["data"]["image_size"], path), state


def _from_file(path: Path) -> BackboneFile:
    """A single file, told by what it holds: a backbone export, else a foreign state dict."""
    data = load_file(path)
    if isinstance(data, dict) and data.get("format") == BACKBONE_FORMAT:
        return data["model"], _stored_image_size(data["image_size"], path), data["state_dict"]
    return read_foreign(path, data)


def _stored_image_size(value: Any, path: Path) -> int | tuple[int, int]:
    """An image size read from a checkpoint: an int stays an int, [H, W] becomes (H, W)."""
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return int(value[0]), int(value[1])
    if isinstance(value, (list, tuple)):
        raise ValueError(f"checkpoint {path}: image_size {value!r} is neither a side nor [H, W]")
    return int(value)
