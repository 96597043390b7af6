"""Bytes held by tensors, counted as the ops that make them run: `TensorMemory`.

A `TorchDispatchMode` that sees every tensor an op returns while it is active, counts the
bytes of each storage it has not seen before until that storage is freed, and keeps the
peak. It counts the same way over real tensors and over fake ones (`FakeTensorMode`, whose
storages have a size and no memory), so a step run on fake tensors is counted as the same
step on real ones would be, without the memory.

What it counts is what a device's caching allocator would be asked for, op by op
(`torch.cuda.max_memory_allocated` counts the same blocks, each rounded up to 512 bytes:
`granularity`). Not counted: tensors made before the mode was entered, and memory a kernel
takes behind the dispatcher (cuDNN workspaces, a library's own scratch buffers).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# The CUDA caching allocator hands out blocks in multiples of 512 bytes.
CUDA_BLOCK_BYTES = 512


class TensorMemory(TorchDispatchMode):
    """Live bytes of the storages ops create while active, and their peak.

    `granularity` rounds each storage up to a multiple of it (512 to count as the CUDA
    caching allocator does; 1 counts bytes). `on_peak` is called, with no argument, each
    time the live bytes reach a new peak (to take a breakdown there).
    """

    def __init__(self, *, granularity: int = 1, on_peak: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.granularity = granularity
        self.on_peak = on_peak
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # id of a live storage -> its counted bytes
        self._refs: dict[int, weakref.ref] = {}
        self._pending: dict[int, torch.SymInt] = {}  # sizes counted at the next op

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now (as torch.cuda.reset_peak_memory_stats)."""
        self._settle()
        self.peak = self.live

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self._settle()
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._count(leaf)
        return out

    def _count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        size = storage.nbytes()
        if isinstance(size, torch.SymInt) and key not in self._sizes:
            # A size that depends on data: its bound is often known only once the code
            # that made it has checked it (torch._check), so it counts from the next op.
            self._sizes[key] = 0
            self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
            self._pending[key] = size
            return
        nbytes = self._rounded(upper_bound(size))
        known = self._sizes.get(key)
        if known is not None and self._refs[key]() is storage:
            if known != nbytes:  # resized in place (resize_, an out= argument)
                self._sizes[key] = nbytes
                self._add(nbytes - known)
            return
        if nbytes == 0:
            return
        self._sizes[key] = nbytes
        # The storage's Python object lives as long as its memory (torch keeps the one
        # object for a storage), so its finalisation is the free.
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
        self._add(nbytes)

    def _settle(self) -> None:
        """Count the data-dependent sizes made by the ops before, at their bounds now."""
        pending, self._pending = self._pending, {}
        for key, size in pending.items():
            if key in self._sizes:
                nbytes = self._rounded(upper_bound(size))
                self._sizes[key] = nbytes
                self._add(nbytes)

    def _free(self, key: int) -> None:
        self._pending.pop(key, None)
        nbytes = self._sizes.pop(key, 0)
        self._refs.pop(key, None)
        self.live -= nbytes

    def _add(self, nbytes: int) -> None:
        self.live += nbytes
        if self.live > self.peak:
            self.peak = self.live
            if self.on_peak is not None:
                self.on_peak()

    def _rounded(self, nbytes: int) -> int:
        step = self.granularity
        return -(-nbytes // step) * step


def upper_bound(value: int | torch.SymInt) -> int:
    """`value`, or the largest it can be when it depends on data (an unbacked size of a fake
    tensor, such as the rows a boolean mask selects: at most all of them)."""
    if isinstance(value, torch.SymInt):
        node = value.node
        upper = node.shape_env.bound_sympy(node.expr).upper
        if not upper.is_finite:
            raise ValueError(f"a size that depends on data has no known bound ({node.expr})")
        return int(upper)
    return int(value)
