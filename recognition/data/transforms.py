"""Decoding and the input transform shared by training and evaluation.

An image file becomes the network's input in four steps, each a small function here:

    load_rgb(path)        decode any mode (grey, 16-bit, palette, RGBA, CMYK) to 8-bit RGB
    resize(tensor, size)  bilinear, antialiased, to (H, W)
    hflip(tensor)         mirror left-right (training augmentation)
    normalise(tensor)     uint8 [0, 255] -> float32 [-1, 1], the range of the published models

`to_input_tensor` runs the resize and the normalisation on a decoded image; the flip is left
to the training data set, which draws it at random. Training's CPU loader stops at the
resize (`to_pixels`): its workers ship uint8 batches, a quarter of float32's bytes, and the
training process normalises them on the device (`network_input`), to the same values.
"""

from __future__ import annotations

import io
import os

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torchvision.transforms.v2 import functional as TF

# Modes holding more than 8 bits per sample: 16-bit PNG / TIFF ("I;16*") and PGM with a
# maxval above 255, which PIL opens as 32-bit "I" scaled to the 16-bit range.
_SIXTEEN_BIT_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N")


def to_rgb(image: Image.Image) -> Image.Image:
    """`image` of any PIL mode as an 8-bit RGB image of the same size.

    Grey and bilevel images are replicated over the three channels; 16-bit and 32-bit
    integer images are scaled from 0..65535 to 0..255 (a plain `convert("RGB")` would clip
    them to white); float images are taken as 0..1 when they stay within it, else 0..255.
    Alpha is dropped, not composited: that is what torchvision's ImageFolder and OpenCV's
    imread do, so embeddings of the same files match those of models trained with them.
    """
    mode = image.mode
    if mode == "RGB":
        return image
    if mode in _SIXTEEN_BIT_MODES or mode == "F":
        array = np.asarray(image, dtype=np.float64)
        if mode == "F":
            scale = 255.0 if array.size and float(array.max()) <= 1.0 else 1.0
        else:
            scale = 255.0 / 65535.0
        grey = np.clip(np.rint(array * scale), 0, 255).astype(np.uint8)
        return Image.fromarray(grey, "L").convert("RGB")
    if mode == "P" and "transparency" in image.info:
        # Through RGBA, as PIL asks for palettes with transparency (a warning otherwise).
        image = image.convert("RGBA")
    return image.convert("RGB")


def decode_rgb(data: bytes, name: str) -> Image.Image:
    """Decode the encoded image `data` (JPEG, PNG, ...) as 8-bit RGB, like `load_rgb`.

    `name` says where the bytes came from (a file, a record of a .rec file) in the ValueError
    raised for empty, corrupt, truncated or unknown data.
    """
    if not data:
        raise ValueError(f"{name}: cannot decode image (empty)")
    return _decode(io.BytesIO(data), name)


def load_rgb(path: str | os.PathLike) -> Image.Image:
    """Decode the image file at `path` as 8-bit RGB (see `to_rgb` for the mode handling).

    Raises FileNotFoundError when `path` does not exist, and ValueError naming `path` when it
    is empty, corrupt, truncated or not an image: PIL's own errors do not say which file
    they came from. Truncated files are always an error (PIL's LOAD_TRUNCATED_IMAGES is left
    as it is, off by default), so that a damaged data set is noticed rather than trained on.
    """
    return _decode(path, path)


def read_encoded(path: str | os.PathLike) -> bytes:
    """The bytes of the image file at `path`, undecoded (for decoding on the GPU).

    Errors as `load_rgb`: FileNotFoundError when `path` does not exist, ValueError naming
    `path` when it cannot be read (a folder, no permission, an I/O error).
    """
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise
    except OSError as error:
        raise ValueError(f"{path}: cannot read image ({error.strerror or error})") from error


def _decode(source: str | os.PathLike | io.BytesIO, name: str | os.PathLike) -> Image.Image:
    try:
        with Image.open(source) as image:
            # load() forces the full decode inside the `with`: a truncated file fails here,
            # not later in a DataLoader worker with no file name attached.
            image.load()
            return to_rgb(image)
    except FileNotFoundError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise ValueError(f"{name}: cannot decode image ({error})") from error
    except Image.DecompressionBombError as error:
        raise ValueError(f"{name}: image too large to decode safely ({error})") from error


def center_crop(image: Image.Image, side: int) -> Image.Image:
    """The centred ``side`` x ``side`` square of ``image`` (clipped to the image)."""
    width, height = image.size
    side_w, side_h = min(side, width), min(side, height)
    left, top = (width - side_w) // 2, (height - side_h) // 2
    return image.crop((left, top, left + side_w, top + side_h))


def resize(tensor: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """(C, h, w) image tensor resized to (C, H, W) with `size` = (H, W); unchanged if equal.

    Bilinear with antialiasing, so that downscaling a large photo does not alias.
    """
    if tuple(tensor.shape[-2:]) == tuple(size):
        return tensor
    return TF.resize(
        tensor, list(size), interpolation=TF.InterpolationMode.BILINEAR, antialias=True
    )


def hflip(tensor: torch.Tensor) -> torch.Tensor:
    """(C, H, W) image tensor mirrored left-right."""
    return TF.horizontal_flip(tensor)


def normalise(tensor: torch.Tensor) -> torch.Tensor:
    """uint8 image tensor in [0, 255] as float32 in [-1, 1]: (x / 255 - 0.5) / 0.5."""
    scaled = TF.to_dtype(tensor, torch.float32, scale=True)  # [0, 1]
    # With Python scalars, not TF.normalize: its mean and std become tensors copied from
    # the host, which on a GPU (data.decode=gpu) makes the host wait for the device.
    return scaled.sub_(0.5).div_(0.5)


def network_input(batch: torch.Tensor) -> torch.Tensor:
    """A batch of images as the network takes them: uint8 pixels (what training's CPU
    workers ship) normalised by `normalise`, on their device; a float batch (already
    normalised, or augmented in float on the workers) unchanged. Element by element, so
    the values are those `normalise` gives each image alone."""
    return normalise(batch) if batch.dtype == torch.uint8 else batch


def to_pixels(image: Image.Image, size: tuple[int, int]) -> torch.Tensor:
    """Decoded RGB `image` resized to `size` = (H, W): (3, H, W) uint8."""
    return resize(TF.pil_to_tensor(to_rgb(image)), size)


def to_input_tensor(image: Image.Image, size: tuple[int, int]) -> torch.Tensor:
    """Decoded RGB `image` as the network's input: (3, H, W) float32 in [-1, 1], `size` = (H, W).

    Resizing happens on the uint8 tensor, before normalisation, as in training.
    """
    return normalise(to_pixels(image, size))
