"""arcface_torch's MobileFaceNet and ViT state dicts, told by what they hold: which model,
of which width, for which input size (`recognition.checkpoint.foreign` reads them).

- MobileFaceNet (`conv_sep.layers.0.weight`): mbf or mbf_large by the residual blocks of
  layers.1, 3, 5 and 7; the width from the stem's channels; the embedding size from GDC's
  Linear; the input size from GDC's depthwise kernel, which covers the last map (7x7 ->
  112x112, 16 pixels a cell).
- ViT (`patch_embed.proj.weight`): the name by its width D and depth (a narrower D than
  every named size of that depth: the first of them at width D / its D); the embedding size
  from feature.2; the input size from the tokens of `pos_embed`: 144 (12 x 12) are
  arcface_torch's 112x112, any other square count N = n x n is taken as 9n x 9n (the
  layout holds the number of patches, not the pixels cut off beside them).

Each reader returns the model config dict, the input size, the state dict of the model
built on the meta device (the keys and shapes the file must have) and what to call it in
a message; anything the name cannot be told from is refused in one line naming the file.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import torch

from recognition.config import ModelConfig
from recognition.models import MBF_LAYOUTS, VIT_SIZES, mobilefacenet, vit
from recognition.models.mobilefacenet import STEM_CHANNELS
from recognition.models.vit import PATCH_SIZE

MBF_MARK = "conv_sep.layers.0.weight"
VIT_MARK = "patch_embed.proj.weight"
# arcface_torch builds its ViTs for 112x112 faces: 12 x 12 patches of 9 pixels.
ARCFACE_VIT_SIDE, ARCFACE_VIT_PATCHES = 112, 12

_MBF_BLOCK = re.compile(r"^layers\.([1357])\.layers\.(\d+)\.layers\.")
_VIT_BLOCK = re.compile(r"^blocks\.(\d+)\.")

Layout = tuple[dict[str, Any], int | tuple[int, int], dict[str, torch.Tensor], str]


def mobilefacenet_file(path: Path, state: dict[str, torch.Tensor]) -> Layout:
    """(model config dict, input size, expected state dict, description) of the
    MobileFaceNet state dict `state` read from `path`; ValueError when it is not one."""
    where = f"checkpoint {path}: not a MobileFaceNet state dict"
    for key in ("layers.0.layers.0.weight", "features.layers.0.layers.0.weight"):
        if key not in state:
            raise ValueError(f"{where}: missing key {key}")
    if "features.layers.2.weight" not in state:
        raise ValueError(f"{where}: missing key features.layers.2.weight")
    counts = {1: 0, 3: 0, 5: 0, 7: 0}
    for key in state:
        if match := _MBF_BLOCK.match(key):
            stage, block = int(match.group(1)), int(match.group(2))
            counts[stage] = max(counts[stage], block + 1)
    blocks = (counts[1] or 1, counts[3], counts[5], counts[7])
    name = next((n for n, (b, _) in MBF_LAYOUTS.items() if b == blocks), None)
    if name is None:
        known = ", ".join(f"{n} {b}" for n, (b, _) in MBF_LAYOUTS.items())
        raise ValueError(f"{where} of a known size: its blocks are {blocks} (known: {known})")
    scale = MBF_LAYOUTS[name][1]
    width = state["layers.0.layers.0.weight"].shape[0] / (STEM_CHANNELS * scale)
    kernel = tuple(state["features.layers.0.layers.0.weight"].shape[2:])
    size: int | tuple[int, int] = (16 * kernel[0], 16 * kernel[1])
    size = size[0] if size[0] == size[1] else size
    embedding_size = state["features.layers.2.weight"].shape[0]
    model_cfg = _model_cfg(name, embedding_size, width)
    with torch.device("meta"):
        expected = mobilefacenet(name, embedding_size=embedding_size, width=width, image_size=size)
    what = f"a MobileFaceNet ({name}, width {width:g}, {_size_text(size)} inputs)"
    return model_cfg, size, expected.state_dict(), what


def vit_file(path: Path, state: dict[str, torch.Tensor]) -> Layout:
    """(model config dict, input size, expected state dict, description) of the ViT state
    dict `state` read from `path`; ValueError when it is not one."""
    where = f"checkpoint {path}: not a ViT state dict"
    for key in ("pos_embed", "feature.2.weight"):
        if key not in state:
            raise ValueError(f"{where}: missing key {key}")
    patch = state[VIT_MARK]
    if patch.dim() != 4 or tuple(patch.shape[1:]) != (3, PATCH_SIZE, PATCH_SIZE):
        raise ValueError(
            f"{where}: {VIT_MARK} has shape {tuple(patch.shape)}, expected (D, 3, "
            f"{PATCH_SIZE}, {PATCH_SIZE}) (arcface_torch's 9x9 patches)"
        )
    dim = patch.shape[0]
    depth = 1 + max((int(m.group(1)) for k in state if (m := _VIT_BLOCK.match(k))), default=-1)
    name, width = _vit_name(where, dim, depth)
    num_tokens = state["pos_embed"].shape[1]
    side = math.isqrt(num_tokens)
    if side * side != num_tokens:
        raise ValueError(
            f"{where}: pos_embed holds {num_tokens} tokens, not a square grid of patches "
            "(the input size is told from them)"
        )
    size = ARCFACE_VIT_SIDE if side == ARCFACE_VIT_PATCHES else PATCH_SIZE * side
    embedding_size = state["feature.2.weight"].shape[0]
    model_cfg = _model_cfg(name, embedding_size, width)
    with torch.device("meta"):
        expected = vit(name, embedding_size=embedding_size, width=width, image_size=size)
    what = f"a ViT ({name}, width {width:g}, {size}x{size} inputs)"
    return model_cfg, size, expected.state_dict(), what


def _vit_name(where: str, dim: int, depth: int) -> tuple[str, float]:
    """The VIT_SIZES name and width of a ViT of width `dim` and `depth` blocks."""
    same_depth = [(n, s) for n, s in VIT_SIZES.items() if s.depth == depth]
    for name, size in same_depth:
        if size.embed_dim == dim:
            return name, 1.0
    for name, size in same_depth:
        if dim < size.embed_dim:
            return name, dim / size.embed_dim
    known = ", ".join(f"{n} ({s.embed_dim} wide, {s.depth} blocks)" for n, s in VIT_SIZES.items())
    raise ValueError(f"{where} of a known size: {dim} wide, {depth} blocks (known: {known})")


def _model_cfg(name: str, embedding_size: int, width: float) -> dict[str, Any]:
    return dataclasses.asdict(
        ModelConfig(backbone=name, embedding_size=embedding_size, width=width)
    )


def _size_text(size: int | tuple[int, int]) -> str:
    height, width = (size, size) if isinstance(size, int) else size
    return f"{height}x{width}"
