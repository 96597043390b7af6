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
    """Resolve a config device name ("auto", "cpu", "cuda") to this process's device."""
    if name == "auto":
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

    Without torchrun (no WORLD_SIZE in the environment) this returns a world of one and
    initialises nothing. The backend defaults to NCCL on GPU and gloo on CPU.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch_device = pick_device(device, local_rank)
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
    if world_size > 1 and not dist.is_initialized():
        backend = backend or ("nccl" if torch_device.type == "cuda" else "gloo")
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=torch_device if torch_device.type == "cuda" else None,
        )
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=torch_device)


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


def barrier(group: dist.ProcessGroup | None = None) -> None:
    if world_size(group) > 1:
        dist.barrier(group=group)


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    # NCCL only moves CUDA tensors; gloo only CPU ones.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------- tensor collectives
# The model-parallel head moves tensors, not scalars. These run on the device of the tensors
# they are given (CUDA with NCCL, CPU with gloo), and with a world of one they return their
# input (or a view of it) without touching torch.distributed.


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
    dist.all_gather_single(gathered, tensor, group=group)
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
    dist.reduce_scatter_single(block, tensor, op=dist.ReduceOp.SUM, group=group)
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
