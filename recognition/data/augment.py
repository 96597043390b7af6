"""A training sample's random augmentation (`data.augment`): drawn, then applied.

Every random choice of a sample is drawn at once on the host, from its `sample_seed` (a
function of the run's seed, the epoch and the sample index, `recognition.data.sampler`), by
`draw_augment`: a small `SampleAugment` of plain numbers. Applying it draws nothing. So the
image depends on (seed, epoch, index) only, whichever worker or rank loads it and whether
the run was resumed, and the two decode paths apply the very same parameters:

    data.decode=cpu   `apply_augment`: one image in a DataLoader worker, with
                      torchvision.transforms.v2.functional (the blur as its matrix)
    data.decode=gpu   `augment_batch` (recognition.data.augment_batch): the whole batch on
                      the device at once, the same operations written as batched tensor code

The operations, in this order, on float images in [0, 1] at the input size (after the
decode and the resize to data.image_size):

    crop        resize: a box resized to the whole input (RandomResizedCrop); in_place: the
                box kept, black around it; pad: the input shifted, black where it moved in
    flip        left-right mirror
    colour      brightness, contrast, saturation factors (ColorJitter's, in a fixed order)
    grey        the luma in all three channels
    low_res     bilinear down to a fraction of the size and up again (antialiased)
    blur        Gaussian, reflect-padded
    erase       a box set to mid-grey (0.5; 0 in the network's [-1, 1] input)

The flip is the first draw, as `draw_flip` draws it: with only the flip on (the `flip`
preset, the default) a sample is flipped exactly as before data.augment existed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import torch
from torchvision.transforms.v2 import functional as TF

from recognition.config import AugmentConfig, blur_kernel_size

ERASE_VALUE = 0.5  # mid-grey in [0, 1]: 0 in the network's input, the mean of its range

Box = tuple[int, int, int, int]  # (top, left, height, width)


@dataclass(frozen=True, slots=True)
class SampleAugment:
    """What is done to one sample; None / False: that operation is not."""

    flip: bool = False
    crop: Box | None = None
    """The box in the input's pixels; it may reach outside (pad): black there."""
    crop_in_place: bool = False
    """Keep the box where it is, black around it, instead of resizing it to the input."""
    colour: tuple[float, float, float] | None = None
    """(brightness, contrast, saturation) factors."""
    grey: bool = False
    low_res: tuple[int, int] | None = None
    """(height, width) it passes through."""
    blur: tuple[int, float] | None = None
    """(kernel side, sigma)."""
    erase: Box | None = None

    @property
    def beyond_flip(self) -> bool:
        """Whether anything but the flip is done (the pixels then go through `apply_augment`)."""
        return (
            self.crop is not None
            or self.colour is not None
            or self.grey
            or self.low_res is not None
            or self.blur is not None
            or self.erase is not None
        )


def draw_flip(sample_seed: int, probability: float = 0.5) -> bool:
    """Whether the sample of `sample_seed` is flipped left-right: the first draw of its
    `random.Random`, as in `draw_augment`."""
    return random.Random(sample_seed).random() < probability


def draw_augment(cfg: AugmentConfig, sample_seed: int, size: tuple[int, int]) -> SampleAugment:
    """The augmentation of the sample of `sample_seed` for an input of `size` = (H, W).

    One `random.Random(sample_seed)`, drawn in a fixed order (flip first); an operation that
    is off still takes its coin's draw, so switching one on leaves the others' draws alone.
    """
    rng = random.Random(sample_seed)
    height, width = size
    flip = rng.random() < cfg.flip
    if cfg.only_flips:  # the default's path: one draw, as before data.augment
        return SampleAugment(flip=flip)
    crop = None
    if rng.random() < cfg.crop:
        if cfg.crop_mode == "pad":
            pad = cfg.crop_pad
            crop = (rng.randint(-pad, pad), rng.randint(-pad, pad), height, width)
        else:
            crop = _resized_crop_box(rng, height, width, cfg.crop_scale, cfg.crop_ratio)
    colour = None
    if rng.random() < cfg.colour:
        colour = tuple(
            rng.uniform(max(0.0, 1.0 - x), 1.0 + x)
            for x in (cfg.brightness, cfg.contrast, cfg.saturation)
        )
    grey = rng.random() < cfg.grey
    low_res = None
    if rng.random() < cfg.low_res:
        fraction = rng.uniform(*cfg.low_res_scale)
        low_res = (max(1, round(height * fraction)), max(1, round(width * fraction)))
        if low_res == (height, width):
            low_res = None
    blur = None
    if rng.random() < cfg.blur:
        blur = (blur_kernel_size(cfg.blur_sigma[1]), rng.uniform(*cfg.blur_sigma))
    erase = None
    if rng.random() < cfg.erase:
        erase = _erase_box(rng, height, width, cfg.erase_scale, cfg.erase_ratio)
    return SampleAugment(
        flip=flip,
        crop=crop,
        crop_in_place=crop is not None and cfg.crop_mode == "in_place",
        colour=colour,  # type: ignore[arg-type]
        grey=grey,
        low_res=low_res,
        blur=blur,
        erase=erase,
    )


def _resized_crop_box(
    rng: random.Random, height: int, width: int, scale: list[float], ratio: list[float]
) -> Box:
    """RandomResizedCrop's box: 10 tries of an area share from `scale` and a width / height
    from `ratio` (log-uniform) that fits, else the centred box of the clamped ratio."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif aspect > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _erase_box(
    rng: random.Random, height: int, width: int, scale: list[float], ratio: list[float]
) -> Box | None:
    """RandomErasing's box: 10 tries of an area share from `scale` and a height / width from
    `ratio` (log-uniform) strictly inside the input; None when none fits."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        h = round(math.sqrt(target * aspect))
        w = round(math.sqrt(target / aspect))
        if 0 < h < height and 0 < w < width:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    return None


def blur_matrix(size: int, kernel: int, sigma: float) -> torch.Tensor:
    """(size, size) float32: the Gaussian blur of `kernel` taps and `sigma` pixels along an axis
    of `size` pixels, reflected at the borders (torchvision's gaussian_blur, as a matrix)."""
    half = kernel // 2
    offsets = np.arange(-half, half + 1)
    taps = np.exp(-0.5 * (offsets / sigma) ** 2)
    taps /= taps.sum()
    rows = np.arange(size).reshape(-1, 1)
    cols = np.abs(rows + offsets)  # reflected below 0 ...
    cols = np.where(cols >= size, 2 * (size - 1) - cols, cols)  # ... and past the end
    # numpy, not torch: a few microseconds for what a dozen small torch calls take 100 for.
    flat = np.bincount(
        (rows * size + cols).ravel(), np.broadcast_to(taps, cols.shape).ravel(), size * size
    )
    return torch.from_numpy(flat.reshape(size, size).astype(np.float32))


def apply_augment(image: torch.Tensor, params: SampleAugment) -> torch.Tensor:
    """(3, H, W) float `image` in [0, 1] augmented by `params` (same shape, in [0, 1]), with
    torchvision.transforms.v2.functional (the blur: `blur_matrix`): the CPU path, and the
    reference `augment_batch` is tested against."""
    height, width = image.shape[-2:]
    if params.crop is not None:
        top, left, h, w = params.crop
        if params.crop_in_place:
            kept = torch.zeros_like(image)
            kept[..., top : top + h, left : left + w] = image[..., top : top + h, left : left + w]
            image = kept
        else:
            # Out of the input (pad), crop fills with zeros; the resize is skipped at equal size.
            image = TF.resized_crop(image, top, left, h, w, [height, width], antialias=True)
    if params.flip:
        image = TF.horizontal_flip(image)
    if params.colour is not None:
        brightness, contrast, saturation = params.colour
        image = TF.adjust_brightness(image, brightness)
        image = TF.adjust_contrast(image, contrast)
        image = TF.adjust_saturation(image, saturation)
    if params.grey:
        image = TF.rgb_to_grayscale(image, num_output_channels=3)
    if params.low_res is not None:
        small = TF.resize(image, list(params.low_res), antialias=True)
        image = TF.resize(small, [height, width], antialias=True)
    if params.blur is not None:
        # TF.gaussian_blur's result (test_augment.py), as two small matrix products: its
        # convolution costs a CPU worker about ten times as much at these sizes.
        kernel, sigma = params.blur
        image = blur_matrix(height, kernel, sigma) @ image @ blur_matrix(width, kernel, sigma).T
    if params.erase is not None:
        top, left, h, w = params.erase
        image = TF.erase(image, top, left, h, w, torch.tensor(ERASE_VALUE))
    return image
