"""The run's own state as checkpoint parts: progress, RNG, and the model-side parts.

Every part is a `torch.distributed.checkpoint.stateful.Stateful` (`state_dict()` /
`load_state_dict()`); `recognition.checkpoint` saves and loads a dict of them. The
model-side parts are the modules' and objects' own: the backbone and the head (modules;
the head marks its rows), `Precision`, the optimizer (`optim.OptimizerState`), the scheduler.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from recognition import checkpoint as ckpt
from recognition.heads import ShardedMarginSoftmax
from recognition.optim import OptimizerState
from recognition.precision import Precision


@dataclass
class Progress:
    """Where the run is: optimizer steps, epoch, and this rank's batches of the epoch.

    A checkpoint keeps the epoch's samples consumed over all ranks (`samples_done`), a
    position that means the same on any number of ranks, with the global batch and world
    size of the run that saved it; `load_state_dict` restores step and epoch and keeps the
    rest in `saved` for the resume to turn into this run's position.
    """

    step: int = 0
    epoch: int = 0
    batches_done: int = 0
    per_batch: int = 0
    """Samples of one batch over all ranks (train.batch_size x world size)."""
    global_batch: int = 0
    """Samples per optimizer step over all ranks."""
    world_size: int = 1
    saved: dict[str, int] = field(default_factory=dict)

    def state_dict(self) -> dict[str, int]:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "samples_done": self.batches_done * self.per_batch,
            "global_batch": self.global_batch,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self.saved = {
            name: int(state[name]) for name in ("samples_done", "global_batch", "world_size")
        }


class RngState:
    """This process's torch, Python, NumPy (and CUDA) random streams as a checkpoint part."""

    def state_dict(self) -> dict[str, Any]:
        return ckpt.rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ckpt.set_rng_state(state)


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def training_state(
    backbone: nn.Module,
    head: ShardedMarginSoftmax,
    optimizer: torch.optim.Optimizer,
    precision: Precision,
) -> dict[str, Any]:
    """The model side of a checkpoint: {"backbone", "head", "precision", "optimizer"} parts.

    `backbone` is the bare module (not its DDP wrapper). Add the run's own parts (progress,
    scheduler, meta, RNG) to the returned dict before saving.
    """
    return {
        "backbone": backbone,
        "head": head,
        "precision": precision,
        "optimizer": OptimizerState(optimizer),
    }


def load_training_state(
    path: Path,
    backbone: nn.Module,
    head: ShardedMarginSoftmax,
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    objects: tuple[str, ...] | list[str] = (),
) -> dict[str, Any]:
    """Restore what `training_state` saved into the live parts, on this world size.

    Collective. `objects` names further entries to read whole (a name missing from the
    checkpoint comes back as None). Returns {name: object} for them. Checkpoints written
    before the format carried a version (version 1) load too.
    """
    entries = ckpt.checkpoint_entries(path)
    stored = entries.get("head/weight")
    if stored is None or not hasattr(stored, "size"):
        raise ValueError(f"checkpoint {path}: no head/weight entry (not a training checkpoint)")
    if tuple(stored.size) != (head.num_classes, head.embedding_size):
        raise ValueError(
            f"checkpoint {path}: its class matrix is {tuple(stored.size)}, this run's head is "
            f"({head.num_classes}, {head.embedding_size}): different data.root or "
            "model.embedding_size"
        )
    parts = training_state(backbone, head, optimizer, precision)
    if ckpt.checkpoint_version(path, entries) == 1:
        parts["head"] = _HeadWithoutExtraState(head, ckpt.read_checkpoint(path, ["progress"]))
    combined: dict[str, Any] = {**parts, **{name: None for name in objects if name in entries}}
    ckpt.load_checkpoint(path, combined)
    return {name: combined.get(name) for name in objects}


class _HeadWithoutExtraState:
    """The head of a version-1 checkpoint, which kept the partial FC sampling step in its
    "progress" entry (`head_sampling_step`) rather than with the head."""

    def __init__(self, head: ShardedMarginSoftmax, progress: dict[str, Any]) -> None:
        self.head = head
        self.sampling_step = int((progress.get("progress") or {}).get("head_sampling_step", 0))

    def state_dict(self) -> dict[str, Any]:
        state = self.head.state_dict()
        state.pop("_extra_state", None)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.head.load_state_dict({**state, "_extra_state": {"sampling_step": self.sampling_step}})
