"""Process-group setup and the few collectives the rest of the code needs.

Every function here also works without an initialised process group: it then behaves as
a world of one process, so single-process runs, tests and notebooks need no setup.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job.

    rank / world_size are global over all nodes; local_rank is the index on this node and
    picks the GPU. `device` is the device this process computes on.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """Resolve a config device name ("auto", "cpu", "cuda") to this process's device.

    "auto" is CUDA when a GPU is visible, else the CPU; the environment variable
    RECOGNITION_AUTO_DEVICE (cpu or cuda), when set, decides instead. The test suite sets it
    to cpu, so that a test meant for the CPU reference stays on the CPU on a GPU machine too,
    and its own processes (torchrun, spawn) inherit that.
    """
    if name == "auto":
        name = os.environ.get("RECOGNITION_AUTO_DEVICE", "").strip().lower()
        if name not in ("cpu", "cuda"):
            name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("train.device: 'cuda' asked for but no CUDA device is available")
        return torch.device("cuda", local_rank)
    if name == "cpu":
        return torch.device("cpu")
    raise ValueError(f"train.device: unknown device {name!r} (use auto, cpu or cuda)")


def init_distributed(
    device: str = "auto", backend: str | None = None, timeout_s: float = 1800.0
) -> DistInfo:
    """Read torchrun's environment and join the process group if there is more than one rank.

    Takes the config's device name ("auto", "cpu", "cuda"), the backend (None or "auto": NCCL
    on GPU, gloo on CPU) and the collective timeout in seconds. Returns this process's
    DistInfo; on GPU the process is bound to GPU `local_rank` of its node first.

    Without torchrun (no WORLD_SIZE in the environment) this returns a world of one and
    initialises nothing. A process group that already exists (a test that set one up) is
    used as it is.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is outside [0, WORLD_SIZE={world_size}) in the environment")
    torch_device = pick_device(device, local_rank)
    if torch_device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} GPU(s): "
                "start at most one process per GPU (torchrun --nproc_per_node)"
            )
        torch.cuda.set_device(torch_device)
    if world_size > 1 and not dist.is_initialized():
        if backend in (None, "auto"):
            backend = "nccl" if torch_device.type == "cuda" else "gloo"
        if backend == "nccl" and torch_device.type != "cuda":
            raise ValueError("train.dist_backend: nccl moves CUDA tensors only; use gloo on CPU")
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend=backend,
            timeout=timeout,
            # Binds the NCCL communicator to this GPU eagerly (no guessing from the rank).
            device_id=torch_device if torch_device.type == "cuda" else None,
            store=_torchelastic_store(timeout),
            rank=rank,
            world_size=world_size,
        )
    elif dist.is_initialized():
        world_size, rank = dist.get_world_size(), dist.get_rank()
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=torch_device)


def _torchelastic_store(timeout: datetime.timedelta) -> dist.Store | None:
    """The rendezvous store for a worker that torchrun started, one key space per restart.

    torchrun's agent hosts one TCP store for all its restarts (TORCHELASTIC_USE_AGENT_STORE)
    and env:// connects to it without a per-restart prefix, so after `--max-restarts` kicks
    in, the new workers can read the addresses the dead ones published and fail to connect
    (seen with gloo on this torch; pytorch issue 135712 is the same for NCCL). The prefix
    `attempt_<TORCHELASTIC_RESTART_COUNT>` gives every restart fresh keys. None (let env://
    do it) when torchrun does not share its store or did not start this process.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"recognition/attempt_{attempt}/", store)


def shutdown() -> None:
    """Leave the process group, if one exists: the end of a run that went well.

    A run that failed in a collective must not call this: a group whose peer is gone may
    block or abort while it is torn down.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Size of `group` (the default group when None), 1 when no process group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def rank(group: dist.ProcessGroup | None = None) -> int:
    """Rank in `group` (the default group when None), 0 when no process group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def all_reduce_mean(value: float | torch.Tensor, group: dist.ProcessGroup | None = None) -> float:
    """Mean of a scalar over the ranks of `group`: what every logged loss goes through."""
    tensor = torch.as_tensor(value, dtype=torch.float64).detach().clone()
    if world_size(group) > 1:
        tensor = tensor.to(_collective_device(group))
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        tensor /= world_size(group)
    return float(tensor.item())


def all_reduce_sum(value: float | torch.Tensor, group: dist.ProcessGroup | None = None) -> float:
    """Sum of a scalar over the ranks of `group` (samples/s, counts)."""
    tensor = torch.as_tensor(value, dtype=torch.float64).detach().clone()
    if world_size(group) > 1:
        tensor = tensor.to(_collective_device(group))
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return float(tensor.item())


def all_reduce_max(value: float | torch.Tensor, group: dist.ProcessGroup | None = None) -> float:
    """Largest value of a scalar over the ranks of `group` (peak memory of the fullest rank)."""
    return _all_reduce_scalar(value, dist.ReduceOp.MAX, group)


def all_reduce_min(value: float | torch.Tensor, group: dist.ProcessGroup | None = None) -> float:
    """Smallest value of a scalar over the ranks of `group`."""
    return _all_reduce_scalar(value, dist.ReduceOp.MIN, group)


def _all_reduce_scalar(
    value: float | torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None
) -> float:
    tensor = torch.as_tensor(value, dtype=torch.float64).detach().clone()
    if world_size(group) > 1:
        tensor = tensor.to(_collective_device(group))
        dist.all_reduce(tensor, op=op, group=group)
    return float(tensor.item())


def barrier(group: dist.ProcessGroup | None = None) -> None:
    if world_size(group) > 1:
        dist.barrier(group=group)


def broadcast_object(obj: object, src: int = 0, group: dist.ProcessGroup | None = None) -> object:
    """`obj` as rank `src` holds it, on every rank (a small picklable object)."""
    if world_size(group) == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, group=group, device=_collective_device(group))
    return holder[0]


def all_reduce_tensor_sum(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The element-wise sum of `tensor` over the ranks of `group` (a new tensor on its device).

    Runs on the backend's device (CUDA for NCCL, CPU for gloo) and returns on `tensor`'s; with
    a world of one it returns `tensor` itself.
    """
    if world_size(group) == 1:
        return tensor
    summed = tensor.to(_collective_device(group), copy=True)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
    return summed.to(tensor.device)


def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` says a collective failed: a peer rank died, hung, or its link broke.

    NCCL and the store raise `torch.distributed.DistError`; gloo raises a plain RuntimeError
    whose text names the cause, which is all there is to recognise it by.
    """
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(mark in text for mark in _GLOO_FAILURES)


_GLOO_FAILURES = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",
    "gloo/transport",
)


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    # NCCL only moves CUDA tensors; gloo only CPU ones.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------- tensor collectives
# The model-parallel head moves tensors, not scalars. These run on the device of the tensors
# they are given (CUDA with NCCL, CPU with gloo), and with a world of one they return their
# input (or a view of it) without touching torch.distributed.
#
# torch 2.14 named the single-tensor collectives `all_gather_single` / `reduce_scatter_single`
# and deprecated `all_gather_into_tensor` / `reduce_scatter_tensor`, the only names earlier
# releases have: take the new name where it exists, the old one otherwise (looked up at
# each call, so that a benchmark's wrapper around either name sees the traffic).
ALL_GATHER_NAME = (
    "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
)
REDUCE_SCATTER_NAME = (
    "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
)


def all_gather_tensor(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenation along dim 0 of `tensor` from every rank of `group`, in rank order.

    Every rank must pass the same shape (B, ...); returns (B * world size, ...). No autograd:
    use `all_gather_autograd` for tensors that need a gradient.
    """
    num_ranks = world_size(group)
    if num_ranks == 1:
        return tensor
    tensor = tensor.contiguous()
    gathered = tensor.new_empty((num_ranks * tensor.shape[0], *tensor.shape[1:]))
    getattr(dist, ALL_GATHER_NAME)(gathered, tensor, group=group)
    return gathered


def reduce_scatter_sum(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Block `rank` of the sum over ranks of `tensor`: the adjoint of `all_gather_tensor`.

    Takes (B * world size, ...) on every rank and returns (B, ...): rows [rank * B, (rank + 1)
    * B) of the element-wise sum of every rank's tensor.
    """
    num_ranks = world_size(group)
    if num_ranks == 1:
        return tensor
    if tensor.shape[0] % num_ranks != 0:
        raise ValueError(
            f"reduce_scatter_sum: dim 0 ({tensor.shape[0]}) is not divisible by the world "
            f"size ({num_ranks})"
        )
    tensor = tensor.contiguous()
    block = tensor.new_empty((tensor.shape[0] // num_ranks, *tensor.shape[1:]))
    getattr(dist, REDUCE_SCATTER_NAME)(block, tensor, op=dist.ReduceOp.SUM, group=group)
    return block


class _AllGatherAutograd(torch.autograd.Function):
    """all_gather_tensor whose backward reduce-scatters (sums) the gradient back."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        tensor: torch.Tensor,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.group = group
        return all_gather_tensor(tensor, group)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_gathered: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        # Every rank computed a different function of the gathered rows (its own class
        # shard), so a row's total gradient is the sum of all ranks' partial gradients.
        return reduce_scatter_sum(grad_gathered, ctx.group), None


def all_gather_autograd(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """`all_gather_tensor` with a gradient: (B, ...) -> (B * world size, ...), rank order.

    Backward is the exact adjoint: the gradients that every rank computed for the gathered
    tensor are summed over ranks and each rank receives the block of rows it contributed
    (a reduce-scatter). Every rank must pass the same shape.
    """
    if world_size(group) == 1:
        return tensor
    return _AllGatherAutograd.apply(tensor, group)
