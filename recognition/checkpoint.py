"""Checkpoints: atomic save, resume, and the single-file backbone export.

A training checkpoint is one file `checkpoints/step_<N>.pt` holding the backbone, the
head, the optimizer, the precision state (loss scale, O2 master weights), the scheduler,
the position in the data (epoch, step, batches done in the epoch) and the RNG states.
Files are written to a temporary name in the same directory, flushed to disk and renamed,
so a run killed during a save keeps its previous checkpoint loadable.

Loading uses `torch.load(weights_only=True)`: a checkpoint is data, never code.
"""

from __future__ import annotations

import logging
import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

CHECKPOINT_RE = re.compile(r"^step_(\d+)\.pt$")
BACKBONE_FORMAT = "recognition-backbone-v1"


def atomic_save(obj: Any, path: Path) -> None:
    """torch.save to a temporary file beside `path`, fsync, then rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    # Make the rename itself durable.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_file(path: Path) -> dict[str, Any]:
    """Load a checkpoint file as plain tensors and containers, with a clear error."""
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path}: no such file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for truncated / foreign files
        raise ValueError(f"checkpoint {path}: cannot be read ({exc})") from exc


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": _numpy_state_to_plain(np.random.get_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_to_tuple(state["python"]))
    np.random.set_state(_numpy_state_from_plain(state["numpy"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}.pt"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints of a run, oldest first."""
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := CHECKPOINT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write `state` as the checkpoint of `step` and delete all but the `keep` newest."""
    path = checkpoint_path(run_dir, step)
    atomic_save(state, path)
    for old in list_checkpoints(run_dir)[:-keep]:
        old.unlink(missing_ok=True)
    log.info("saved checkpoint %s", path)
    return path


def export_backbone(
    path: Path, backbone: torch.nn.Module, model_cfg: dict[str, Any], image_size: int
) -> None:
    """Write the backbone alone (fp32 weights and how to rebuild it) for evaluation."""
    state = {
        k: v.detach().float().cpu() if v.is_floating_point() else v.cpu()
        for k, v in backbone.state_dict().items()
    }
    atomic_save(
        {
            "format": BACKBONE_FORMAT,
            "model": model_cfg,
            "image_size": image_size,
            "state_dict": state,
        },
        path,
    )


def load_backbone_file(path: Path) -> tuple[dict[str, Any], int, dict[str, torch.Tensor]]:
    """Read a backbone export or a full training checkpoint.

    Returns (model config dict, input image size, backbone state dict).
    """
    data = load_file(path)
    if data.get("format") == BACKBONE_FORMAT:
        return data["model"], int(data["image_size"]), data["state_dict"]
    if "backbone" in data and "config" in data:
        cfg = data["config"]
        return cfg["model"], int(cfg["data"]["image_size"]), data["backbone"]
    raise ValueError(f"checkpoint {path}: neither a training checkpoint nor a backbone export")


def _numpy_state_to_plain(state: tuple) -> list:
    name, keys, pos, has_gauss, cached = state
    return [name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, cached]


def _numpy_state_from_plain(state: list) -> tuple:
    name, keys, pos, has_gauss, cached = state
    return (name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached))


def _to_tuple(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_to_tuple(v) for v in value)
    return value
