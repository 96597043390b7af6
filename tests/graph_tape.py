"""A CPU stand-in for a CUDA graph, for testing `recognition.training.graphed` without a GPU.

`TapeGraph.capture()` runs the step once under a dispatch mode that records every aten
operation with its arguments; `replay()` runs the recorded operations again, with the same
arguments (the same tensors, the same Python numbers), and writes each result into the
tensor the capture made, as a replayed CUDA graph writes into the memory it captured. So
the replay asks of the step what a CUDA graph asks:
- no Python runs: a value kept in a Python float at capture (a learning rate the schedule
  changes) stays what it was then; a tensor the caller replaced is not read;
- the capture changes nothing it did not make (a CUDA capture runs no kernel): what the
  step wrote into the weights, the optimizer's state or the batch statistics is put back;
- nothing is read on the host: an operation that would be (`.item()`, `bool(tensor)`) or
  whose output size depends on values (`nonzero`, `unique`) raises during the capture, as
  a capturing CUDA stream refuses it.
The head's Triton kernels (run by Triton's interpreter on a CPU) are not aten operations:
their launches (`recognition.heads.kernels.host.launch`, as the kernel modules call it) are
recorded beside them and launched again on replay, with the same arguments; what a launch
may write into memory the capture did not make (any such tensor argument) is put back too.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch
from helpers import MASK_INDEXING_OPS, SYNCING_OPS, has_mask
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves


class _Recorder(TorchDispatchMode):
    """Records each operation and, before an operation writes into a tensor made before the
    capture, a copy of it (`saved`), which the capture puts back at its end."""

    def __init__(self, records: list, saved: dict) -> None:
        super().__init__()
        self.records = records
        self.saved = saved
        self.made: set[int] = set()  # storages the capture made

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in SYNCING_OPS or (packet in MASK_INDEXING_OPS and has_mask(args[1])):
            # What a capturing CUDA stream refuses: a host read, or an output whose size
            # only the data gives.
            raise RuntimeError(f"{func} reads the device on the host while capturing")
        for tensor in _written(func, args, kwargs):
            key = _where(tensor)
            if key[0] not in self.made and key not in self.saved:
                self.saved[key] = (tensor, tensor.clone())
        out = func(*args, **kwargs)
        # New memory only: a view or an in-place result covers memory its input had.
        given = {_where(t)[0] for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self.made.update(
            key
            for t in tree_leaves(out)
            if isinstance(t, torch.Tensor)
            if (key := _where(t)[0]) not in given
        )
        self.records.append((func, args, kwargs, out))
        return out


def _written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors `func` writes into (its schema's mutable arguments)."""
    written = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        written += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return written


def _where(tensor: torch.Tensor) -> tuple:
    """(storage address, offset, shape, strides): the memory a tensor covers."""
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
            tuple(tensor.shape), tensor.stride())  # fmt: skip


# The modules that launch the head's Triton kernels, each through its own `launch` name.
LAUNCHING_MODULES = ("recognition.heads.kernels.forward", "recognition.heads.kernels.gemm_backward")


@contextlib.contextmanager
def _launches_recorded(recorder: _Recorder) -> Iterator[None]:
    """While capturing, each kernel launch runs (outside the dispatch mode: the interpreter's
    own tensor work is not the step's) and is recorded; the tensors it is handed that the
    capture did not make are saved first, since it may write into any of them."""
    modules = [importlib.import_module(name) for name in LAUNCHING_MODULES]
    originals = [module.launch for module in modules]

    def recorded(original):
        def launch(kernel, grid, *args, **kwargs):
            for tensor in _launch_tensors(args, kwargs):
                key = _where(tensor)
                if key[0] not in recorder.made and key not in recorder.saved:
                    recorder.saved[key] = (tensor, tensor.clone())
            with _disable_current_modes():
                original(kernel, grid, *args, **kwargs)
            recorder.records.append((original, (kernel, grid, *args), kwargs, None))

        return launch

    for module, original in zip(modules, originals, strict=True):
        module.launch = recorded(original)
    try:
        yield
    finally:
        for module, original in zip(modules, originals, strict=True):
            module.launch = original


def _launch_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a launch is handed, a tensor descriptor's by its base."""
    found = []
    for value in (*args, *kwargs.values()):
        value = getattr(value, "base", value)
        if isinstance(value, torch.Tensor):
            found.append(value)
    return found


class TapeGraph:
    """See the module docstring: `capture()` (a context) and `replay()`."""

    def __init__(self) -> None:
        self.records: list = []

    @staticmethod
    def runs_on(device: torch.device) -> bool:
        return device.type == "cpu"

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        # A CUDA capture runs no kernel: what the step wrote into memory it did not make
        # (weights, optimizer state, statistics) is put back, and the first replay does it.
        saved: dict = {}
        try:
            with _Recorder(self.records, saved) as recorder, _launches_recorded(recorder):
                yield
        finally:
            with torch.no_grad():  # the earliest copy last: where two overlap, it wins
                for tensor, copy in reversed(saved.values()):
                    tensor.copy_(copy)

    def replay(self) -> None:
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            for func, args, kwargs, out in self.records:
                fresh = func(*args, **kwargs)
                if out is None:  # a kernel launch: it wrote into its arguments
                    continue
                for kept, new in zip(tree_leaves(out), tree_leaves(fresh), strict=True):
                    if not isinstance(kept, torch.Tensor) or new is kept:
                        continue  # an in-place operation wrote into the captured tensor
                    if _same_memory(kept, new):
                        continue  # a view of captured memory, already written
                    kept.copy_(new)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
