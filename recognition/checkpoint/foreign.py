"""Backbone state dicts written by other tools, told by what they hold, not by their name.

These kinds are read (each into the project's model config dict, input size and fp32 state
dict, as every backbone file reader returns):
- an IResNet as arcface_torch saves it (`model.pt`, or the published `backbone.pth`): a
  plain state dict whose keys are exactly those of `recognition.models.IResNet`. The depth
  comes from the blocks per stage, the width from the stem's channels, the embedding size
  from `fc`, the input size from the fc's inputs (7 x 7 x 512 -> 112 x 112 faces);
- a MobileFaceNet or a ViT as arcface_torch saves them (`mbf`, `mbf_large`, `vit_t` ...
  `vit_h`; `recognition.checkpoint.foreign_layouts`): the name from the blocks (MobileFaceNet)
  or the width and depth (ViT), the input size from GDC's kernel or the number of tokens;
- a torchvision ResNet-50 (its ImageNet weights as torchvision saves them), the trunk of
  the re-id `resnet50_reid`: its keys go under `base.`, its ImageNet `fc` is dropped, and the
  model config dict says `"trunk_only": True`: the BN neck (and the optional fc) start fresh.

Anything else is refused in one line naming the first key or shape that does not fit. The
way out, `arcface_torch_state`, writes what arcface_torch's `get_model(name)` loads.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recognition.checkpoint.files import fp32_cpu_state
from recognition.checkpoint.foreign_layouts import (
    MBF_MARK,
    VIT_MARK,
    mobilefacenet_file,
    vit_file,
)
from recognition.config import ModelConfig
from recognition.models import (
    IRESNET_LAYERS,
    IResNet,
    MobileFaceNet,
    VisionTransformer,
    iresnet,
    resnet50_reid,
)
from recognition.models.iresnet import STAGE_CHANNELS, STEM_CHANNELS, scaled_channels
from recognition.models.resnet import (
    REID_IMAGE_SIZE,
    TRUNK_CHANNELS,
    TRUNK_PREFIX,
    torchvision_trunk,
)

# (model config dict, input image size: a side or (H, W), state dict); as backbone_files.
BackboneFile = tuple[dict[str, Any], int | tuple[int, int], dict[str, torch.Tensor]]

# Keys that only one of the layouts has: IResNet's blocks hold a PReLU, torchvision's
# ResNet-50 bottlenecks a third convolution (MobileFaceNet's and the ViT's: foreign_layouts).
IRESNET_MARK = "layer1.0.prelu.weight"
RESNET50_MARK = "layer1.0.conv3.weight"
# nn.DataParallel's prefix, which a state dict saved without `.module` carries on every key.
DATA_PARALLEL_PREFIX = "module."
BLOCK_KEY = re.compile(r"^layer([1-4])\.(\d+)\.")
# A flag the reader adds to the model config dict: the file holds the trunk's weights only.
TRUNK_ONLY = "trunk_only"


def is_state_dict(data: Any) -> bool:
    """Whether `data` (a loaded torch file) is a plain {name: tensor} dict."""
    return (
        isinstance(data, dict)
        and bool(data)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in data.items())
    )


def read_foreign(path: Path, data: Any) -> BackboneFile:
    """(model config dict, image size, fp32 state dict in the project's key names) of the
    torch file `path` whose loaded content is `data`: an arcface_torch IResNet or a
    torchvision ResNet-50 state dict. Raises ValueError naming the file and the first key or
    shape that fits neither."""
    if not is_state_dict(data):
        raise ValueError(f"checkpoint {path}: {_not_a_state_dict(data)}")
    state: dict[str, torch.Tensor] = data
    if all(k.startswith(DATA_PARALLEL_PREFIX) for k in state):
        state = {k[len(DATA_PARALLEL_PREFIX) :]: v for k, v in state.items()}
    if RESNET50_MARK in state:
        return _torchvision_resnet50(path, state)
    if IRESNET_MARK in state:
        return _arcface_iresnet(path, state)
    if MBF_MARK in state or VIT_MARK in state:
        read = mobilefacenet_file if MBF_MARK in state else vit_file
        model_cfg, size, expected, what = read(path, state)
        return model_cfg, size, fitted(path, state, expected, what)
    raise ValueError(
        f"checkpoint {path}: not a backbone export, an arcface_torch (IResNet, MobileFaceNet, "
        f"ViT) or a torchvision ResNet-50 state dict: it has none of {IRESNET_MARK}, "
        f"{MBF_MARK}, {VIT_MARK}, {RESNET50_MARK} (its first key: {next(iter(state))})"
    )


def arcface_torch_state(backbone: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of `backbone` (an IResNet, a MobileFaceNet or a ViT) as arcface_torch's
    `get_model(name)` loads it: the same keys (the layouts are the same), every tensor on the
    CPU, floats in fp32. Raises ValueError for any other backbone."""
    if not isinstance(backbone, IResNet | MobileFaceNet | VisionTransformer):
        raise ValueError(
            f"--arcface-torch: arcface_torch's models are IResNets, MobileFaceNets and ViTs; "
            f"this checkpoint's backbone is a {type(backbone).__name__}"
        )
    return fp32_cpu_state(backbone)


# ---------------------------------------------------------------------- one reader a layout


def _arcface_iresnet(path: Path, state: dict[str, torch.Tensor]) -> BackboneFile:
    for key in ("conv1.weight", "fc.weight"):
        if key not in state:
            raise ValueError(f"checkpoint {path}: not an IResNet state dict: missing key {key}")
    width = state["conv1.weight"].shape[0] / STEM_CHANNELS
    name = _iresnet_depth(path, state)
    embedding_size, fc_inputs = state["fc.weight"].shape
    channels = scaled_channels(STAGE_CHANNELS[-1], width)
    # The fc takes the last map flattened: channels x (side / 16)^2 for a square input.
    map_side = math.isqrt(fc_inputs // channels)
    if fc_inputs != channels * map_side * map_side or map_side < 1:
        raise ValueError(
            f"checkpoint {path}: not an IResNet state dict: fc.weight has shape "
            f"{tuple(state['fc.weight'].shape)}, whose inputs are not {channels} channels x a "
            "square map (the input size is told from them)"
        )
    side = 16 * map_side
    model_cfg = dataclasses.asdict(
        ModelConfig(backbone=name, embedding_size=embedding_size, width=width)
    )
    with torch.device("meta"):
        expected = iresnet(name, embedding_size=embedding_size, width=width, image_size=side)
    what = f"{name}, width {width:g}, {side}x{side} inputs, embedding {embedding_size}"
    return model_cfg, side, fitted(path, state, expected.state_dict(), f"an IResNet ({what})")


def _iresnet_depth(path: Path, state: dict[str, torch.Tensor]) -> str:
    """The IRESNET_LAYERS name whose blocks per stage the keys of `state` show."""
    blocks = [0, 0, 0, 0]
    for key in state:
        if match := BLOCK_KEY.match(key):
            stage, block = int(match.group(1)) - 1, int(match.group(2))
            blocks[stage] = max(blocks[stage], block + 1)
    for name, layers in IRESNET_LAYERS.items():
        if tuple(blocks) == layers:
            return name
    known = ", ".join(f"{name} {layers}" for name, layers in IRESNET_LAYERS.items())
    raise ValueError(
        f"checkpoint {path}: not an IResNet state dict of a known depth: its blocks per stage "
        f"are {tuple(blocks)} (known: {known})"
    )


def _torchvision_resnet50(path: Path, state: dict[str, torch.Tensor]) -> BackboneFile:
    model_cfg = dataclasses.asdict(
        ModelConfig(backbone="resnet50_reid", embedding_size=TRUNK_CHANNELS, width=1.0)
    )
    model_cfg[TRUNK_ONLY] = True
    with torch.device("meta"):
        model = resnet50_reid(embedding_size=TRUNK_CHANNELS)
    expected = {
        k[len(TRUNK_PREFIX) :]: v
        for k, v in model.state_dict().items()
        if k.startswith(TRUNK_PREFIX)
    }
    trunk = fitted(path, torchvision_trunk(state), expected, "a torchvision ResNet-50")
    return model_cfg, REID_IMAGE_SIZE, {TRUNK_PREFIX + k: v for k, v in trunk.items()}


def fitted(
    path: Path, state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str
) -> dict[str, torch.Tensor]:
    """`state` in `expected`'s key order, floats in fp32, when it has exactly `expected`'s
    keys and shapes; else a ValueError naming the first missing key, wrong shape or extra key.

    A missing BatchNorm `num_batches_tracked` (files of older torch versions) is filled
    with 0: it counts steps and changes no output."""
    fitted: dict[str, torch.Tensor] = {}
    misfit = None
    for key, reference in expected.items():
        value = state.get(key)
        if value is None and key.endswith(".num_batches_tracked"):
            value = torch.zeros((), dtype=reference.dtype, device="cpu")
        if value is None:
            misfit = f"missing key {key}"
        elif value.shape != reference.shape:
            misfit = f"{key} has shape {tuple(value.shape)}, expected {tuple(reference.shape)}"
        if misfit is not None:
            break
        fitted[key] = value.float() if value.is_floating_point() else value
    if misfit is None:
        misfit = next((f"unexpected key {key}" for key in state if key not in expected), None)
    if misfit is not None:
        raise ValueError(f"checkpoint {path}: not {what} state dict: {misfit}")
    return fitted


def _not_a_state_dict(data: Any) -> str:
    """Why the loaded `data` is not a {name: tensor} dict, naming the first entry that is not."""
    if not isinstance(data, dict):
        return f"neither a backbone export nor a state dict (it holds a {type(data).__name__})"
    if not data:
        return "an empty dict, not a backbone"
    for key, value in data.items():
        if not isinstance(value, torch.Tensor):
            return (
                f"neither a backbone export nor a state dict: entry {key!r} is a "
                f"{type(value).__name__}, not a tensor"
            )
    return "neither a backbone export nor a state dict: its keys are not all strings"
