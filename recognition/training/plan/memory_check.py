"""Before a GPU run: refuse one whose plan does not fit (`check_memory`, which the
training loop calls between the data and the model), and the GPU memory a plan may fill.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from recognition import distributed
from recognition.config import ExperimentConfig
from recognition.distributed import DistInfo
from recognition.training.errors import TrainingError
from recognition.training.plan.rank import plan_run
from recognition.training.plan.search import largest_batch

log = logging.getLogger(__name__)

GIB = 1 << 30
# Share of the GPU's memory a plan leaves free: the CUDA context and library workspaces
# (outside the allocator's count) and the caching allocator's fragmentation.
HEADROOM = 0.10


def usable_bytes(gpu_memory_gib: float) -> int:
    """What a plan's peak may reach on a GPU of `gpu_memory_gib` GiB (HEADROOM kept free)."""
    return int(gpu_memory_gib * GIB * (1 - HEADROOM))


def check_memory(
    cfg: ExperimentConfig,
    dist_info: DistInfo,
    num_classes: int,
    *,
    device_memory: int | None = None,
) -> None:
    """Refuse a GPU run whose plan does not fit: raise TrainingError on every rank, with one
    line (the planned peak, the GPU's memory, the largest batch that fits).

    Collective. Rank 0 plans (in a child process when a process group runs: the planner
    needs its own fake one) and tells the others. `device_memory` (bytes) stands for the
    GPU's total memory (tests); None reads it from this rank's device.
    """
    if device_memory is None:
        device_memory = torch.cuda.get_device_properties(dist_info.device).total_memory
    limit = int(device_memory * (1 - HEADROOM))
    answer: tuple[int, int | None] | str | None = None
    if dist_info.is_main:
        try:
            answer = _peak_and_batch(cfg, dist_info.world_size, num_classes, limit)
        except Exception as exc:  # noqa: BLE001 - a check that cannot plan must not stop a run
            answer = f"{type(exc).__name__}: {exc}".splitlines()[0]
    answer = distributed.broadcast_object(answer)
    if isinstance(answer, str):
        log.warning("memory check skipped: the run cannot be planned (%s)", answer)
        return
    peak, batch = answer
    if peak > limit:
        raise TrainingError(
            f"train.memory_check: the planned peak is {format_bytes(peak)} per GPU, the GPU "
            f"has {format_bytes(device_memory)} ({format_bytes(limit)} usable, {HEADROOM:.0%} "
            f"kept free); the largest train.batch_size that fits is {batch or 'none'} "
            "(python train.py --plan says more; train.memory_check=false runs anyway)"
        )
    log.info("memory check: planned peak %s of %s usable", format_bytes(peak), format_bytes(limit))


def format_bytes(num_bytes: int) -> str:
    """Bytes in GiB, MiB or KiB (whichever keeps the number at 1 or more); "-" for none."""
    if num_bytes == 0:
        return "-"
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes} B"


def _peak_and_batch(
    cfg: ExperimentConfig, world_size: int, num_classes: int, limit: int
) -> tuple[int, int | None]:
    """(worst planned peak, the largest batch that fits or None when the run fits)."""
    if dist.is_initialized():
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        with context.Pool(1) as pool:
            return pool.apply(_peak_and_batch, (cfg, world_size, num_classes, limit))
    plan = plan_run(cfg, num_classes, world_size)
    peak = plan.worst.peak
    return peak, (largest_batch(cfg, plan, limit) if peak > limit else None)
