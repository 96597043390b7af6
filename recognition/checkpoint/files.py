"""Checkpoint files on disk: single files written atomically, and a run's checkpoint
directories (`checkpoints/step_<N:08d>/`), listed oldest first.

Atomic. A single file (a backbone export) is written to a temporary file beside it, fsynced
and renamed over it. A training checkpoint is written into `checkpoints/.tmp-step_<N>/`
and renamed to `step_<N>` once complete (`recognition.checkpoint.store`): a run killed
during a save leaves a `.tmp-*` directory that nothing reads (and the next save removes);
only `step_*` directories holding a `.metadata` count as checkpoints. Multi-node runs need
a file system that every node sees.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_RE = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp-"
METADATA_FILE = ".metadata"


# ---------------------------------------------------------------------- single files


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
    except (OSError, RuntimeError) as exc:  # torch's zip writer raises RuntimeError
        raise OSError(write_failure(exc, path)) from None
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


def fp32_cpu_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s state dict as a file keeps it: every tensor detached on the CPU, floats in
    fp32 (whatever precision the module trains in)."""
    return {
        k: v.detach().float().cpu() if v.is_floating_point() else v.detach().cpu()
        for k, v in module.state_dict().items()
    }


def load_file(path: Path) -> Any:
    """Load a single torch file (a backbone export, a state dict) as plain tensors and
    containers, never running code that a pickle names."""
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path}: no such file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for truncated / foreign files
        # A pickle naming a global that is not a tensor type (a class, a function such as
        # os.system). torch's message goes on to advise weights_only=False, which would run
        # whatever code the file names: not advice to relay about a file of unknown origin.
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        if "Weights only load failed" in str(exc) and found:
            named = f" ({found.group(1)})"
            raise ValueError(
                f"checkpoint {path}: refused and not loaded: it holds Python objects other than "
                f"tensors and plain containers{named}, such as a whole model saved with "
                "torch.save(model) (a pickle from elsewhere could run code when loaded); where "
                "the model's code is, re-save its weights alone: "
                "torch.save(model.state_dict(), 'backbone.pth')"
            ) from None
        raise ValueError(
            f"checkpoint {path}: not a checkpoint file this project reads (truncated, or another "
            "format)"
        ) from None


def is_disk_full(exc: BaseException) -> bool:
    text = str(exc)
    return getattr(exc, "errno", None) == errno.ENOSPC or any(
        mark in text for mark in ("No space left", "unexpected pos", "file write failed")
    )


def write_failure(exc: BaseException, path: Path) -> str:
    """A one-line message for a failed write of `path`, saying so when the disk is full."""
    if not is_disk_full(exc):
        return f"writing {path} failed: {exc}"
    try:
        free = f"{shutil.disk_usage(path.parent).free / 2**20:.0f} MiB free"
    except OSError:
        free = "free space unknown"
    return (
        f"writing {path} failed: no space left on device ({free} on its file system); "
        "what was written before is intact. Free space (or set output_dir elsewhere) and "
        "resume with train.resume=true"
    )


def fsync_dir(path: Path) -> None:
    """Make renames inside `path` durable."""
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# ---------------------------------------------------------------------- a run's checkpoints


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def is_checkpoint(path: Path) -> bool:
    """Whether `path` is a complete DCP checkpoint directory (its `.metadata` written)."""
    return (path / METADATA_FILE).is_file()


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in folder.iterdir()
        if (m := CHECKPOINT_RE.match(p.name)) and is_checkpoint(p)
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None
