"""The config's error and the value checks that several sections share: counts, and input
sizes given as one side or [H, W] (in a config or on a command line)."""

from __future__ import annotations

import re
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
    """`value` checked as an input size: one side (an int), [H, W] (a list; a tuple becomes a
    list so that the saved config.yaml stays plain YAML) or the text `N` / `HxW` (as the
    command lines' --image-size takes it: `HxW` becomes [H, W]).

    Raises ConfigError naming `key` for anything else or a side under MIN_IMAGE_SIDE.
    """
    given = value
    if isinstance(value, str):
        parts = value.strip().lower().split("x")
        try:
            sides = [int(p) for p in parts]
        except ValueError:
            sides = []
        if len(sides) not in (1, 2):
            raise ConfigError(f"{key}: expected N or HxW (e.g. 112 or 256x128), got {value!r}")
        value = sides[0] if len(sides) == 1 else sides
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
        raise ConfigError(f"{key}: {given!r} is too small (at least {MIN_IMAGE_SIDE} a side)")
    return sides if isinstance(value, (list, tuple)) else value


def parse_image_size(text: str, key: str) -> int | tuple[int, int]:
    """A command-line input size, `N` or `HxW` (e.g. `256x128`), as an int or (H, W): what
    the config's `check_image_size` takes, checked the same way.

    Raises ConfigError naming `key` (the option) for anything else.
    """
    size = check_image_size(str(text), key)
    return size if isinstance(size, int) else (size[0], size[1])


def parse_time_limit(value: str | float | None) -> float | str | None:
    """Seconds from "D-HH:MM:SS", "HH:MM:SS", "MM:SS" (Slurm's forms) or a number of
    seconds (YAML reads 47:30:00 as base-60 seconds: the same); "auto" stays "auto"; None is
    no limit. Raises ValueError on anything else."""
    if value is None or value == "auto":
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        text = str(value).strip()
        match = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text)
        if re.fullmatch(r"\d+(\.\d+)?", text):
            seconds = float(text)
        elif match is None:
            raise ValueError(f"{value!r} is not D-HH:MM:SS, HH:MM:SS, MM:SS, seconds or auto")
        else:
            days, hours, minutes, secs = (int(g) if g else 0 for g in match.groups())
            if minutes >= 60 or secs >= 60:
                raise ValueError(f"{value!r}: minutes and seconds must be below 60")
            seconds = float(((days * 24 + hours) * 60 + minutes) * 60 + secs)
    if not seconds > 0:
        raise ValueError(f"{value!r}: must be positive")
    return seconds
