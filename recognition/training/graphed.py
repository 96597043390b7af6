"""The training step captured in a CUDA graph and replayed (`train.cuda_graphs`).

Why: the eager IResNet-50 step (batch 256, 112 px, O1 bf16) dispatches about 1,200 aten
operations, and on an H200 the host took 52 of the step's 55 ms to enqueue them: the GPU
waited on Python. A CUDA graph records the step's kernels once; a replay launches all of
them at once, so the host's work per step no longer depends on the model.

`GraphedStep` wraps the step function (`train_step`, with the same signature and result).
For each kind of step (`StepKey`: the micro-batches' shapes, dtypes and strides, and
whether the model trains, is held by train.head_only_steps, clips) it runs the first
`warmup` steps eagerly - on a side stream, as CUDA graphs ask: the optimizer's state is
made, cuDNN chooses its algorithms, the head tunes its tiles, a compiled backbone compiles,
each under the settings the capture will have - and then captures the next
one into a graph over static copies of the micro-batches. The capture runs no kernel: the
graph is replayed at once for that step's batch. Every later step of that kind copies its
batches into the static copies, writes the schedule's learning rates into the device
tensors the captured optimizer reads (a float lr would be frozen into the graph at its
capture-time value), replays, and returns copies of the captured results (a replay
overwrites them; the log window keeps a step's results across later steps). A new kind of
step (head-only steps ending) is captured anew and replaces the graph.

What a replay does not do: run Python. So the step must read nothing on the host and
branch on no tensor's value (the training step does neither, `recognition.training.step`)
and every per-step value must live in a tensor. Where that does not hold, the first call
says why in one line (`refusal`) and every step runs eagerly: not on a GPU; several
processes (DDP's gradient hooks are not captured here); partial FC (each step's sample is
drawn from a step counter the host keeps, and its size may depend on the labels); an
optimizer without a fused kernel (its skipped steps are read on the host). A pipelined
backbone's step is not wrapped (its schedule sends between ranks), and the config refuses
train.compile_mode=reduce-overhead beside it, which makes graphs of its own.
head.fused_update is captured too: its kernel reads the rate from the device tensor it is
handed while the step is captured. A capture that fails anyway stops the run with the cause
and the setting that turns it off (`GraphCaptureError`).

`graph` makes the graph: `CudaGraph` (torch.cuda.CUDAGraph) by default; a test can pass
a stand-in that records aten operations on a CPU and replays them with their captured
arguments (tests/graph_tape.py), which makes the same demands of the step as a CUDA graph
does: nothing read on the host, no value left in a Python float.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from recognition.precision import Precision, StepResult

log = logging.getLogger(__name__)

WARMUP_STEPS = 3
"""Eager steps of a kind before its capture (PyTorch's CUDA graph examples warm up 3)."""


class Graph(Protocol):
    """What GraphedStep needs of a graph: whether it `runs_on` a device, a capture of what
    runs inside `capture()`, and `replay()` of it."""

    @staticmethod
    def runs_on(device: torch.device) -> bool: ...

    def capture(self) -> contextlib.AbstractContextManager: ...

    def replay(self) -> None: ...


class CudaGraph:
    """torch.cuda.CUDAGraph, captured by torch.cuda.graph (its own side stream and memory
    pool; the caching allocator's free blocks are released first)."""

    def __init__(self) -> None:
        self._graph = torch.cuda.CUDAGraph()

    @staticmethod
    def runs_on(device: torch.device) -> bool:
        return device.type == "cuda"

    def capture(self) -> contextlib.AbstractContextManager:
        # thread_local: what this thread does is captured and checked; the loader's threads
        # (pinning memory, decoding on the GPU) go on with the next batch meanwhile, which
        # the default (global) mode would refuse to them.
        return torch.cuda.graph(self._graph, capture_error_mode="thread_local")

    def replay(self) -> None:
        self._graph.replay()


class GraphCaptureError(RuntimeError):
    """The step could not be captured (something in it reads the host or is not allowed
    while a stream captures)."""


@dataclasses.dataclass(frozen=True)
class StepKey:
    """What a captured step is valid for: the micro-batches' (shape, dtype, stride) per
    tensor, and the model's mode (training, head-only), and the clipping norm."""

    tensors: tuple
    training: bool
    frozen: bool | None
    max_grad_norm: float | None


def step_key(
    backbone: nn.Module, micro_batches: Sequence[tuple[Tensor, ...]], max_grad_norm: float | None
) -> StepKey:
    tensors = tuple(
        tuple((tuple(t.shape), t.dtype, t.stride(), t.device) for t in batch)
        for batch in micro_batches
    )
    frozen = getattr(backbone, "frozen", None)  # HeadOnlyGate: the head trains alone
    return StepKey(tensors, backbone.training, frozen, max_grad_norm)


class GraphedStep:
    """`step` captured once per kind of step and replayed (see the module docstring); call
    it as the step itself."""

    def __init__(
        self,
        step: Callable[..., StepResult],
        *,
        warmup: int = WARMUP_STEPS,
        graph: type[Graph] | None = None,
    ) -> None:
        self._step = step
        self._warmup = warmup
        self._make_graph = graph if graph is not None else CudaGraph
        self._eager_only: bool | None = None  # decided at the first call (`refusal`)
        self._key: StepKey | None = None
        self._eager_steps = 0  # of the current key
        self._graph: Graph | None = None
        self._static: list[tuple[Tensor, ...]] = []
        self._result: StepResult | None = None
        self._lrs: list[Tensor] = []
        self.captures = 0
        """Graphs captured so far (a new kind of step makes another)."""
        self.replays = 0

    def __call__(
        self,
        backbone: nn.Module,
        head: nn.Module,
        micro_batches: Sequence[tuple[Tensor, ...]],
        optimizer: torch.optim.Optimizer,
        precision: Precision,
        max_grad_norm: float | None,
    ) -> StepResult:
        if self._eager_only is None:
            device = micro_batches[0][0].device
            world_size = dist.get_world_size() if dist.is_initialized() else 1
            reason = refusal(head, optimizer, device, world_size, self._make_graph)
            if reason is not None:
                log.info("train.cuda_graphs: off: %s", reason)
            self._eager_only = reason is not None
        if self._eager_only:
            return self._step(backbone, head, micro_batches, optimizer, precision, max_grad_norm)
        key = step_key(backbone, micro_batches, max_grad_norm)
        if key != self._key:  # a new kind of step: warm up again, then capture it
            self._key, self._eager_steps, self._graph = key, 0, None
            self._static, self._result, self._lrs = [], None, []
        args = (backbone, head, micro_batches, optimizer, precision, max_grad_norm)
        if self._graph is None and self._eager_steps < self._warmup:
            self._eager_steps += 1
            # As the capture will step - the rates in the device tensors it reads, autocast
            # without its cache - so that every kernel the capture launches is compiled and
            # loaded here, which a capture can do neither of: the head's fused update reading
            # its rate from memory is a Triton variant of its own, and a compiled backbone
            # guards on autocast's cache setting (a capture under another setting compiled the
            # backbone again, inside the capture: the H200's `compiled, step captured` row).
            lrs = self._rates(optimizer)
            with _side_stream(micro_batches), _tensor_lrs(optimizer, lrs), _uncached(precision):
                return self._step(*args)
        if self._graph is None:
            self._capture(args)
        return self._replay(micro_batches, optimizer)

    def _capture(self, args: tuple) -> None:
        """Capture the step of `args` (the call's) over static copies of its batches."""
        backbone, head, micro_batches, optimizer, precision, max_grad_norm = args
        # Outside the graph's memory: the step reads them and the replays refill them.
        self._static = [tuple(t.clone() for t in batch) for batch in micro_batches]
        # The last eager step's gradients go now, so that the capture (which first hands the
        # allocator's free blocks back) does not hold them beside the graph's own.
        precision.zero_grad(optimizer)
        graph = self._make_graph()
        try:
            lrs = self._rates(optimizer)
            with _tensor_lrs(optimizer, lrs), _uncached(precision), graph.capture():
                result = self._step(
                    backbone, head, self._static, optimizer, precision, max_grad_norm
                )
        except Exception as error:
            raise GraphCaptureError(
                f"train.cuda_graphs: the training step could not be captured in a CUDA graph "
                f"({type(error).__name__}: {error}); set train.cuda_graphs=false"
            ) from error
        self._graph, self._result = graph, result
        self.captures += 1
        log.info("train.cuda_graphs: captured the training step (graph %d)", self.captures)

    def _replay(
        self, micro_batches: Sequence[tuple[Tensor, ...]], optimizer: torch.optim.Optimizer
    ) -> StepResult:
        assert self._graph is not None and self._result is not None
        for static, batch in zip(self._static, micro_batches, strict=True):
            for into, tensor in zip(static, batch, strict=True):
                if into is not tensor:
                    into.copy_(tensor, non_blocking=True)
        self._rates(optimizer)
        self._graph.replay()
        self.replays += 1
        return _copied(self._result)

    def _rates(self, optimizer: torch.optim.Optimizer) -> list[Tensor]:
        """The device tensors the optimizer's groups read their rates from in the captured
        step (made at the first warm-up step of each kind), holding the schedule's rates
        now, as the eager step would read them (a fill: no host copy)."""
        if not self._lrs:
            self._lrs = [_lr_tensor(g["lr"], _device_of(g)) for g in optimizer.param_groups]
        for lr, group in zip(self._lrs, optimizer.param_groups, strict=True):
            lr.fill_(group["lr"])
        return self._lrs


def _copied(result: StepResult) -> StepResult:
    """`result` with each tensor cloned: the next replay overwrites the captured ones."""
    fields = {field.name: getattr(result, field.name) for field in dataclasses.fields(StepResult)}
    return StepResult(**{
        name: value.clone() if isinstance(value, Tensor) else value
        for name, value in fields.items()
    })  # fmt: skip


def _device_of(group: dict) -> torch.device:
    return group["params"][0].device if group["params"] else torch.device("cpu")


def _lr_tensor(lr: float | Tensor, device: torch.device) -> Tensor:
    """A 0-dim float32 tensor of `lr` on `device`: what fused SGD and AdamW read their rate
    from in a captured step (the CUDA kernels read it as float32). The eager step steps at
    the same float32 value (`recognition.precision.update.float32_rates`)."""
    return torch.full((), float(lr), dtype=torch.float32, device=device)


@contextlib.contextmanager
def _tensor_lrs(optimizer: torch.optim.Optimizer, lrs: list[Tensor]) -> Iterator[None]:
    """While the step is captured, the optimizer's groups read their lr from `lrs`, and
    those that have the setting are `capturable` (Adam's step refuses a capture otherwise;
    fused, it is already on the device). The floats (which the scheduler sets and
    checkpoints hold) and the settings come back afterwards."""
    kept = [(group["lr"], group.get("capturable")) for group in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
        if "capturable" in group:
            group["capturable"] = True
    try:
        yield
    finally:
        for group, (lr, capturable) in zip(optimizer.param_groups, kept, strict=True):
            group["lr"] = lr
            if capturable is not None:
                group["capturable"] = capturable


@contextlib.contextmanager
def _uncached(precision: Precision) -> Iterator[None]:
    """Autocast without its cache of cast weights while the step is captured, as torch asks
    of a CUDA graph capture (the same values: a weight cast at each use), and in the eager
    steps before it (the same global state: torch.compile's guards read the setting)."""
    precision.autocast_cache = False
    try:
        yield
    finally:
        precision.autocast_cache = True


@contextlib.contextmanager
def _side_stream(micro_batches: Sequence[tuple[Tensor, ...]]) -> Iterator[None]:
    """A warm-up step on a CUDA side stream, as CUDA graphs ask of the steps before a
    capture (lazily made handles and workspaces belong to that stream, not the capture's);
    nothing on a CPU."""
    device = next((t.device for batch in micro_batches for t in batch), None)
    if device is None or device.type != "cuda":
        yield
        return
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)  # the batches were made on the current stream
    with torch.cuda.stream(side):
        yield
    current.wait_stream(side)


def refusal(
    head: nn.Module,
    optimizer: Any,
    device: torch.device,
    world_size: int,
    graph: type[Graph] | None = None,
) -> str | None:
    """Why a step on `device` with `head` and `optimizer` over `world_size` processes cannot
    be captured in `graph` (CudaGraph by default): one line, or None when it can."""
    if not (graph or CudaGraph).runs_on(device):
        return "not on a GPU"
    if world_size > 1:
        return "several processes (DDP's gradient all-reduce is not captured here)"
    if getattr(head, "sample_rate", 1.0) < 1:
        return (
            "partial FC (head.sample_rate < 1: each step's sample is drawn from a step counter "
            "the host keeps)"
        )
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return "the optimizer has no fused kernel (its skipped steps are read on the host)"
    return None
