"""The config's error and the value checks that several sections share: counts, and input
sizes given as one side or [H, W] (in a config or on a command line)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or conflicts with another key."""


MIN_IMAGE_SIDE = 16


def check_counts(
    section: str, config: Any, names: Sequence[str], nullable: Sequence[str] = ()
) -> None:
    """Raise a ConfigError naming `section.<name>` for the first of the fields `names` of
    `config` below 1; the `nullable` ones may also be null."""
    for name in names:
        value = getattr(config, name)
        if value is not None and value < 1:
            or_null = " (or null)" if name in nullable else ""
            raise ConfigError(f"{section}.{name}: must be at least 1{or_null}")


def image_size_pair(image_size: int | Sequence[int]) -> tuple[int, int]:
    """`image_size` (an int, or (H, W)) as a (H, W) tuple of positive ints."""
    if isinstance(image_size, int):
        size: tuple = (image_size, image_size)
    elif isinstance(image_size, Sequence):
        size = tuple(image_size)
    else:
        size = ()
    if len(size) != 2 or not all(isinstance(v, int) and v > 0 for v in size):
        raise ValueError(f"image_size must be a positive int or (H, W), got {image_size!r}")
    return size  # type: ignore[return-value]


def check_image_size(value: Any, key: str) -> int | list[int]:
    """`value` checked as an input size: one side (an int) or [H, W] (a list, a tuple
    becomes a list so that the saved config.yaml stays plain YAML).

    Raises ConfigError naming `key` for anything else or a side under MIN_IMAGE_SIDE.
    """
    if isinstance(value, (list, tuple)):
        sides = list(value)
        if len(sides) != 2 or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in sides
        ):
            raise ConfigError(
                f"{key}: expected one side or [height, width] (two integers), got {value!r}"
            )
    elif isinstance(value, int) and not isinstance(value, bool):
        sides = [value]
    else:
        raise ConfigError(f"{key}: expected one side or [height, width], got {value!r}")
    if min(sides) < MIN_IMAGE_SIDE:
        raise ConfigError(f"{key}: {value!r} is too small (at least {MIN_IMAGE_SIDE} a side)")
    return sides if isinstance(value, (list, tuple)) else value


def parse_image_size(text: str, key: str) -> int | tuple[int, int]:
    """A command-line input size, `N` or `HxW` (e.g. `256x128`), as an int or (H, W).

    Raises ConfigError naming `key` (the option) for anything else.
    """
    parts = text.lower().split("x")
    try:
        sides = [int(p) for p in parts]
    except ValueError:
        sides = []
    if len(sides) not in (1, 2):
        raise ConfigError(f"{key}: expected N or HxW (e.g. 112 or 256x128), got {text!r}")
    size = check_image_size(sides[0] if len(sides) == 1 else sides, key)
    return size if isinstance(size, int) else (size[0], size[1])
