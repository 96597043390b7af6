"""A process's random streams (torch, Python, NumPy, CUDA) as checkpoint data.

The state is made of tensors, lists and numbers only, so that it is saved as a checkpoint
entry and read back with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """This process's torch, Python, NumPy (and CUDA) RNG states, as weights_only-loadable data.

    CUDA: the stream of this process's own device only (`torch.cuda.current_device()`, the
    rank's `local_rank` once distributed setup has set it), not every visible device's: a
    rank draws on its own device alone, and a run resumed with its ranks placed otherwise
    (8 ranks on one node, then on two nodes of 4 GPUs) sees another number of devices.
    """
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": _numpy_state_to_plain(np.random.get_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state()` returned (its CUDA stream to this process's device)."""
    torch.set_rng_state(state["torch"])
    random.setstate(_to_tuple(state["python"]))
    np.random.set_state(_numpy_state_from_plain(state["numpy"]))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], torch.cuda.current_device())


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
