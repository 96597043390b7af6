"""Decoding and the input transform shared by training and evaluation."""

from __future__ import annotations

import os

import torch
from PIL import Image, UnidentifiedImageError
from torchvision.transforms.v2 import functional as TF


def load_rgb(path: str | os.PathLike) -> Image.Image:
    """Decode an image file of any mode (grey, palette, RGBA, CMYK) as RGB.

    Raises ValueError naming the file when it is corrupt, truncated or not an image:
    PIL's own errors do not say which file they came from.
    """
    try:
        with Image.open(path) as image:
            # convert() forces the full decode, so a truncated file fails here.
            return image.convert("RGB")
    except FileNotFoundError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise ValueError(f"{path}: cannot decode image ({exc})") from exc


def to_input_tensor(image: Image.Image, size: tuple[int, int]) -> torch.Tensor:
    """(3, H, W) float32 in [-1, 1]: resized (bilinear, antialiased) to `size` = (H, W)."""
    tensor = TF.pil_to_tensor(image)  # (3, h, w) uint8
    if tuple(tensor.shape[-2:]) != tuple(size):
        tensor = TF.resize(tensor, list(size), antialias=True)
    return tensor.float().div_(127.5).sub_(1.0)
