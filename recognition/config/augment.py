"""The `data.augment` section: the training images' random augmentation, as a named preset
(`none`, `flip`, `face`, `reid`) whose settings single keys override.

`data.augment=face` on a command line (or `augment: face` in a file) is short for
`data.augment.preset=face`. A key left null takes the preset's value when the config loads,
so the resolved config (`--show-config`, a run's config.yaml) names every setting the run
used: a run resumed under a later version whose preset changed keeps its own values.
docs/data.md gives each preset's values and the reasons for them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from recognition.config.values import ConfigError

PRESET_NAMES = ("none", "flip", "face", "reid")

# Every setting off; the ranges of an operation that is off are torchvision's defaults
# (RandomResizedCrop, GaussianBlur, RandomErasing) or its common use (ColorJitter 0.4).
_OFF: dict[str, Any] = {
    "flip": 0.0,
    "crop": 0.0,
    "crop_mode": "resize",
    "crop_scale": [0.08, 1.0],
    "crop_ratio": [0.75, 1.3333333333333333],
    "crop_pad": 10,
    "colour": 0.0,
    "brightness": 0.4,
    "contrast": 0.4,
    "saturation": 0.4,
    "grey": 0.0,
    "low_res": 0.0,
    "low_res_scale": [0.5, 1.0],
    "blur": 0.0,
    "blur_sigma": [0.1, 2.0],
    "erase": 0.0,
    "erase_scale": [0.02, 0.33],
    "erase_ratio": [0.3, 3.3],
}

PRESETS: dict[str, dict[str, Any]] = {
    "none": dict(_OFF),
    "flip": {**_OFF, "flip": 0.5},
    # Faces (aligned crops): AdaFace's three augmentations at its probabilities (crop kept
    # in place on a black canvas, photometric, low resolution; 0.2 each), arcface_torch's
    # grey-scale (0.1) and a mild blur. docs/data.md has the reasons.
    "face": {
        **_OFF,
        "flip": 0.5,
        "crop": 0.2,
        "crop_mode": "in_place",
        "crop_scale": [0.2, 1.0],
        "colour": 0.2,
        "brightness": 0.5,
        "contrast": 0.5,
        "saturation": 0.5,
        "grey": 0.1,
        "low_res": 0.2,
        "low_res_scale": [0.2, 1.0],
        "blur": 0.1,
        "blur_sigma": [0.5, 1.5],
    },
    # Person re-id: the strong baseline (Luo et al. 2019, "Bag of Tricks"): flip, pad 10
    # and crop back to size, random erasing 0.5 over 2-40 % of the image.
    "reid": {
        **_OFF,
        "flip": 0.5,
        "crop": 1.0,
        "crop_mode": "pad",
        "crop_pad": 10,
        "erase": 0.5,
        "erase_scale": [0.02, 0.4],
    },
}

_PROBABILITIES = ("flip", "crop", "colour", "grey", "low_res", "blur", "erase")
# (range key, the bound its min must exceed, the bound its max may reach or None)
_RANGES = (
    ("crop_scale", 0.0, 1.0),
    ("crop_ratio", 0.0, None),
    ("low_res_scale", 0.0, 1.0),
    ("blur_sigma", 0.0, None),
    ("erase_scale", 0.0, 1.0),
    ("erase_ratio", 0.0, None),
)
KEY = "data.augment"


@dataclass
class AugmentConfig:
    """The training images' random augmentation (docs/data.md): a preset, and single
    settings over it; `data.augment=NAME` is short for data.augment.preset=NAME. Every draw
    is a function of (seed, epoch, sample index)."""

    preset: Literal["none", "flip", "face", "reid"] = "flip"
    """The named settings that a key left null takes (docs/data.md lists their values).
    `none`: no augmentation; `flip`: a horizontal flip of half the images (the default, as
    before data.augment); `face`: flip, crop, colour, grey-scale, low resolution and blur,
    each on a few of the images (AdaFace, arcface_torch); `reid`: flip, pad-and-crop and
    random erasing (the re-id strong baseline)."""
    flip: float | None = None
    """Probability of a left-right mirror; null: the preset's."""
    crop: float | None = None
    """Probability of a crop (crop_mode); null: the preset's."""
    crop_mode: Literal["resize", "in_place", "pad"] | None = None
    """resize: a box of crop_scale of the area and crop_ratio (width / height) resized to the
    whole input (torchvision's RandomResizedCrop); in_place: the same box kept where it is,
    black around it (AdaFace's crop); pad: the input shifted by up to crop_pad pixels each
    way, black where it moved in (pad then random crop, as re-id does). null: the preset's."""
    crop_scale: list[float] | None = None
    """[min, max] share of the input's area a resize or in_place box covers, in (0, 1];
    null: the preset's."""
    crop_ratio: list[float] | None = None
    """[min, max] width / height of a resize or in_place box (drawn log-uniform); null:
    the preset's."""
    crop_pad: int | None = None
    """Largest shift in pixels of crop_mode=pad, each axis; null: the preset's."""
    colour: float | None = None
    """Probability of a colour jitter: brightness, then contrast, then saturation, each by
    a factor drawn from [1 - x, 1 + x]; null: the preset's."""
    brightness: float | None = None
    """Brightness jitter x in [0, 1] (factor in [1 - x, 1 + x]); null: the preset's."""
    contrast: float | None = None
    """Contrast jitter x in [0, 1] (factor in [1 - x, 1 + x]); null: the preset's."""
    saturation: float | None = None
    """Saturation jitter x in [0, 1] (factor in [1 - x, 1 + x]); null: the preset's."""
    grey: float | None = None
    """Probability of grey-scale (the luma, in all three channels); null: the preset's."""
    low_res: float | None = None
    """Probability of low resolution: down-sampled to a side fraction drawn from
    low_res_scale, then up to the input size again (bilinear); null: the preset's."""
    low_res_scale: list[float] | None = None
    """[min, max] side fraction of low_res, in (0, 1]; null: the preset's."""
    blur: float | None = None
    """Probability of a Gaussian blur of a sigma drawn from blur_sigma; null: the
    preset's."""
    blur_sigma: list[float] | None = None
    """[min, max] sigma of blur in pixels (the kernel spans 3 sigma of the max each side);
    null: the preset's."""
    erase: float | None = None
    """Probability of random erasing: a box of erase_scale of the area and erase_ratio
    (height / width) set to mid-grey (0, the data's mean under the [-1, 1] input scale);
    null: the preset's."""
    erase_scale: list[float] | None = None
    """[min, max] share of the input's area an erased box covers, in (0, 1]; null: the
    preset's."""
    erase_ratio: list[float] | None = None
    """[min, max] height / width of an erased box (drawn log-uniform); null: the preset's."""

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:  # config files are checked on load; code may not be
            raise ConfigError(
                f"{KEY}.preset: {self.preset!r} is not one of {', '.join(PRESET_NAMES)}"
            )
        for name, value in PRESETS[self.preset].items():
            if getattr(self, name) is None:
                setattr(self, name, list(value) if isinstance(value, list) else value)
        self._check()

    def _check(self) -> None:
        for name in _PROBABILITIES:
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(
                    f"{KEY}.{name}: {getattr(self, name)} is a probability, it must lie in [0, 1]"
                )
        for name in ("brightness", "contrast", "saturation"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(
                    f"{KEY}.{name}: {getattr(self, name)} must lie in [0, 1] (the factor is "
                    "drawn from [1 - x, 1 + x])"
                )
        if self.crop_pad < 0:
            raise ConfigError(f"{KEY}.crop_pad: {self.crop_pad} pixels must be 0 or more")
        for name, low, high in _RANGES:
            check_range(f"{KEY}.{name}", getattr(self, name), low, high)

    @property
    def only_flips(self) -> bool:
        """Whether nothing but the flip can happen (the cheap path of today's default)."""
        return all(getattr(self, name) == 0.0 for name in _PROBABILITIES if name != "flip")

    def settings(self) -> dict[str, Any]:
        """The resolved settings, without the preset's name."""
        values = dataclasses.asdict(self)
        values.pop("preset")
        return values


def check_range(key: str, value: list[float], low: float, high: float | None) -> None:
    """Raise a ConfigError naming `key` unless `value` is [min, max] with low < min <= max
    (<= high when there is one)."""
    bound = f"(0, {high:g}]" if high is not None else "(0, inf)"
    if len(value) != 2:
        raise ConfigError(f"{key}: expected [min, max], got {value!r}")
    lo, hi = value
    if lo > hi:
        raise ConfigError(f"{key}: [{lo:g}, {hi:g}] is upside down (min above max)")
    if not (lo > low and (high is None or hi <= high)):
        raise ConfigError(f"{key}: [{lo:g}, {hi:g}] must lie in {bound}")


def blur_kernel_size(sigma: float) -> int:
    """The odd side of the Gaussian kernel of `sigma` pixels: 3 sigma each side of the centre
    (what is left beyond holds under 0.3 % of the weight)."""
    return 2 * math.ceil(3.0 * sigma) + 1
