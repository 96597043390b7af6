"""What both choices by timing share (`recognition.heads.tuning`): the timer of a step and
the cache that keeps a measurement between runs.

A measurement costs seconds once; its result is kept in a JSON file per kind in a cache
folder - `head.tuning_cache`, by default `$XDG_CACHE_HOME/recognition`
(`~/.cache/recognition`) - under a key that names the device, the torch and Triton versions
and the shapes, so that a later run on the same kind of GPU at the same shapes starts
without measuring.

The cache is only ever a shortcut: a file that does not parse (or was written by another
version of this format) is ignored with one warning and rewritten by the next measurement,
and a folder that cannot be written costs a warning, not the run. Files are replaced
atomically; processes writing at once may lose one another's new entries, which are then
measured again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

CACHE_VERSION = 1


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/recognition`, or `~/.cache/recognition` when that is unset."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "recognition"


def device_name(device: torch.device) -> str:
    """The name measurements are kept under: the GPU's model name, or the device type."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def software_versions() -> dict[str, str]:
    """torch's and Triton's versions (a new compiler may change every timing)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return {"torch": torch.__version__, "triton": triton_version}


class TuningCache:
    """Measured choices by key, one JSON file per kind (`head-<kind>.json`) in `folder`.

    `folder` None (or empty) is `default_cache_dir()`. Nothing touches the disk until an
    entry is read or written.
    """

    def __init__(self, folder: str | Path | None = None) -> None:
        self.folder = Path(folder).expanduser() if folder else default_cache_dir()
        self._warned: set[str] = set()

    def path(self, kind: str) -> Path:
        return self.folder / f"head-{kind}.json"

    def get(self, kind: str, key: Mapping[str, Any]) -> dict | None:
        """The entry stored under `key`, or None."""
        return self._load(kind).get(key_text(key))

    def entries(self, kind: str) -> list[dict]:
        """Every entry of `kind` (each holds its key under "key"), for reports."""
        return list(self._load(kind).values())

    def put(self, kind: str, key: Mapping[str, Any], value: Mapping[str, Any]) -> None:
        """Store `value` under `key` (a warning, not an error, when the folder is not writable)."""
        entries = self._load(kind)
        entries[key_text(key)] = {**value, "key": dict(key)}
        path = self.path(kind)
        payload = {"version": CACHE_VERSION, "entries": entries}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            self._warn(f"cannot write the tuning cache {path}: {exc}; measured again next run")

    def _load(self, kind: str) -> dict[str, dict]:
        path = self.path(kind)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            self._warn(f"cannot read the tuning cache {path}: {exc}; measuring instead")
            return {}
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
                raise ValueError(f"not a version {CACHE_VERSION} tuning cache")
            entries = data.get("entries")
            if not isinstance(entries, dict) or not all(
                isinstance(v, dict) for v in entries.values()
            ):
                raise ValueError("its entries are not a mapping of objects")
        except ValueError as exc:
            self._warn(f"ignoring the tuning cache {path} ({exc}); measuring instead")
            return {}
        return entries

    def _warn(self, message: str) -> None:
        if message not in self._warned:  # once per cache object and problem
            self._warned.add(message)
            logger.warning(message)


def key_text(key: Mapping[str, Any]) -> str:
    return json.dumps(dict(key), sort_keys=True, default=str)


def time_steps(
    step: Callable[[], object], device: torch.device, repeats: int = 3, warmup: int = 1
) -> float:
    """Median seconds of `repeats` calls of `step` after `warmup` calls (which hold any
    compilation), each waited for on a CUDA device."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
