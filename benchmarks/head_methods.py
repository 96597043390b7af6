"""The methods benchmarks/head.py times, one builder each, and the `Case` that picks one.

`build_step(case, rank, device)` returns one training step of the case's head on this
rank (forward, backward, SGD with momentum 0.9, on this rank's part of a fixed random
batch) and the class rows the rank holds: `naive` (one process, the full matrix, F.linear
and F.cross_entropy), `gather-to-one` (logit slices gathered to rank 0, the loss there,
the gradients scattered back) and `sharded` / `sharded-chunked` (ShardedMarginSoftmax).
torch is imported inside the builders: the driver, which only launches the ranks and
reads their results, never imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from recognition.heads.margins import ArcFace

# (method, whether it runs on --world-size ranks or on one process)
METHODS = {
    "naive": False,
    "gather-to-one": True,
    "sharded": True,
    "sharded-chunked": True,
}

Step = Callable[[], None]


@dataclass
class Case:
    method: str
    world_size: int
    num_classes: int
    batch_size: int  # global batch N
    embedding_size: int
    chunk_size: int | None
    steps: int
    warmup: int
    threads: int
    device: str
    autocast: str | None
    kernel: str = "torch"
    fused_update: bool = False
    captured: bool = False  # the step captured in a CUDA graph and replayed (sharded, GPU)


def build_step(case: Case, rank: int, device: torch.device) -> tuple[Step, int]:
    """One training step of `case` on rank `rank` (a function of no argument), and the
    number of class rows the rank holds."""
    builders = {
        "naive": _naive,
        "gather-to-one": _gather_to_one,
        "sharded": _sharded,
        "sharded-chunked": _sharded,
    }
    if case.method not in builders:
        raise ValueError(f"unknown method {case.method!r}")
    return builders[case.method](case, rank, _LocalBatch.draw(case, rank, device))


# ---------------------------------------------------------------- what the methods share


@dataclass
class _LocalBatch:
    """This rank's rows of the global batch (the same batch whatever the rank count):
    embeddings (N/W, D) that take a gradient, and labels (N/W,), on `device`."""

    device: torch.device
    embeddings: torch.Tensor
    labels: torch.Tensor

    @classmethod
    def draw(cls, case: Case, rank: int, device: torch.device) -> _LocalBatch:
        import torch

        local_batch = case.batch_size // case.world_size
        generator = torch.Generator().manual_seed(1234)
        global_embeddings = torch.randn(case.batch_size, case.embedding_size, generator=generator)
        global_labels = torch.randint(0, case.num_classes, (case.batch_size,), generator=generator)
        rows = slice(rank * local_batch, (rank + 1) * local_batch)
        local_embeddings = global_embeddings[rows].to(device).requires_grad_(True)
        return cls(device, local_embeddings, global_labels[rows].to(device))


def _margin() -> ArcFace:
    from recognition.heads.margins import ArcFace

    return ArcFace(s=64.0, m=0.5)


def _autocast(case: Case, device: torch.device) -> Any:
    import torch

    if case.autocast is None:
        return torch.autocast(device.type, enabled=False)
    # Captured: no cache of cast weights, as torch asks of a CUDA graph capture.
    return torch.autocast(
        device.type, dtype=getattr(torch, case.autocast), cache_enabled=not case.captured
    )


def _sgd(params: Any) -> torch.optim.SGD:
    import torch

    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _training_step(
    optimizer: torch.optim.Optimizer, local_embeddings: torch.Tensor, forward_backward: Step
) -> Step:
    """A step: the gradients cleared, `forward_backward()`, the optimizer's step."""

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        local_embeddings.grad = None
        forward_backward()
        optimizer.step()

    return step


# ---------------------------------------------------------------- the methods


def _sharded(case: Case, rank: int, local: _LocalBatch) -> tuple[Step, int]:
    """ShardedMarginSoftmax on this rank: the whole shard at once (`sharded`) or
    --chunk-size classes at a time (`sharded-chunked`)."""
    from recognition.heads import ShardedMarginSoftmax

    chunk = case.chunk_size if case.method == "sharded-chunked" else None
    # Made and drawn on the device: 10M classes drawn on one CPU thread and copied over
    # would take about a minute per case (and the largest-class search, every try).
    head = ShardedMarginSoftmax(
        case.num_classes, case.embedding_size, _margin(), chunk_size=chunk, kernel=case.kernel,
        device=local.device,
    )  # fmt: skip
    optimizer = _sgd(head.parameters())
    if case.fused_update:  # the backward steps the rows; optimizer.step() skips them
        head.attach_fused_update(optimizer)

    def forward_backward() -> None:
        with _autocast(case, local.device):
            loss = head(local.embeddings, local.labels)
        loss.backward()

    step = _training_step(optimizer, local.embeddings, forward_backward)
    return (_captured(step, local.device) if case.captured else step), head.num_local


def _captured(step: Step, device: torch.device, warmup: int = 3) -> Step:
    """`step` captured in a CUDA graph after `warmup` steps on a side stream (the optimizer's
    state made, the head's tiles chosen), and its replay returned: a step whose host work
    is one launch, so that the time says what the host's launches cost the eager step. Its
    inputs are fixed and its rate constant, so nothing needs copying in."""
    import torch

    if device.type != "cuda":
        raise ValueError("a captured head step needs a CUDA device")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _naive(case: Case, rank: int, local: _LocalBatch) -> tuple[Step, int]:
    """One process holds the full (C, D) matrix: F.linear, the margin, F.cross_entropy."""
    import torch
    import torch.nn.functional as F

    margin = _margin()
    weight = torch.nn.Parameter(
        torch.randn(case.num_classes, case.embedding_size, device=local.device) * 0.01
    )
    optimizer = _sgd([weight])

    def forward_backward() -> None:
        with _autocast(case, local.device):
            cos = F.linear(F.normalize(local.embeddings), F.normalize(weight)).float()
            target = margin(cos.gather(1, local.labels[:, None]))
            logits = cos.scatter(1, local.labels[:, None], target) * margin.scale
            loss = F.cross_entropy(logits, local.labels)
        loss.backward()

    return _training_step(optimizer, local.embeddings, forward_backward), case.num_classes


def _gather_to_one(case: Case, rank: int, local: _LocalBatch) -> tuple[Step, int]:
    """Each rank its (N, C/W) logit slice; rank 0 gathers the slices, takes
    F.cross_entropy over the full (N, C) logits and scatters the logit gradients back."""
    import torch
    import torch.nn.functional as F

    from recognition import distributed
    from recognition.heads import shard_range

    if case.num_classes % case.world_size:
        raise ValueError("gather-to-one: --classes must be divisible by --world-size")
    margin = _margin()
    start, num_local = shard_range(case.num_classes, case.world_size, rank)
    weight = torch.nn.Parameter(
        torch.randn(num_local, case.embedding_size, device=local.device) * 0.01
    )
    optimizer = _sgd([weight])

    def forward_backward() -> None:
        embeddings = distributed.all_gather_autograd(local.embeddings)  # (N, D)
        labels = distributed.all_gather_tensor(local.labels)  # (N,)
        with _autocast(case, local.device):
            cos = F.linear(F.normalize(embeddings), F.normalize(weight)).float()  # (N, C/W)
            local_target = labels - start
            owned = (local_target >= 0) & (local_target < num_local)
            index = torch.where(owned, local_target, 0)[:, None]
            target = torch.where(owned[:, None], margin(cos.gather(1, index)), cos.gather(1, index))
            logits = cos.scatter(1, index, target) * margin.scale  # (N, C/W)
        slice_ = logits.detach().contiguous()
        logits.backward(_logit_grads(slice_, labels, rank, case.world_size))

    return _training_step(optimizer, local.embeddings, forward_backward), num_local


def _logit_grads(
    slice_: torch.Tensor, labels: torch.Tensor, rank: int, world_size: int
) -> torch.Tensor:
    """The gradient of the loss for this rank's logit slice (N, C/W): the slices gathered
    to rank 0, F.cross_entropy over the full (N, C) logits there, its gradient scattered
    back by slices."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    grad_slice = torch.empty_like(slice_)
    if rank != 0:
        dist.gather(slice_, dst=0)
        dist.scatter(grad_slice, src=0)
        return grad_slice
    slices = [torch.empty_like(slice_) for _ in range(world_size)]
    dist.gather(slice_, slices, dst=0)
    full = torch.cat(slices, dim=1).requires_grad_(True)  # (N, C) on rank 0
    F.cross_entropy(full, labels).backward()
    grads = [g.contiguous() for g in full.grad.split(slice_.shape[1], dim=1)]
    del full, slices
    dist.scatter(grad_slice, grads, src=0)
    return grad_slice
