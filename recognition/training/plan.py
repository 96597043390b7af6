"""Plan a run before it starts: each rank's memory and a bound of its step time, on a CPU.

`plan_run(cfg, num_classes, world_size)` builds this config's parts as rank r of W
(`build_model`, the function training builds them with: backbone, head shard, Precision
with its fp32 masters and loss scaler, optimizer) on fake tensors (`FakeTensorMode`:
shapes and dtypes, no memory) with a fake process group (collectives return at once), and
runs one training step on a fake batch (forward, backward, the optimizer, accumulation,
the pipeline stage). `TensorMemory` counts the bytes every op would allocate, as the CUDA
caching allocator would (512-byte blocks), and the peak over the step is what
`torch.cuda.max_memory_allocated` would report for it. The optimizer's state is made
before the step (`init_state`), so the peak is the one of every later step.

Every rank whose shard of the classes (or pipeline stage) differs is planned: without a
pipeline, rank 0 (the largest shard) and the last rank when the classes do not divide.

Pipelines (`model.pipeline_stages` = P > 1, W = P x replicas): one rank per stage (the
first replica's; the last stage's holds the largest shard of the head, which is sharded
over that stage's replicas) and the last rank when the shards differ. Each is built as
training builds it (`build_model`: its stage, the head on the last stage, torch's
`PipelineStage` and GPipe or 1F1B schedule) and its step runs the real schedule: the
point-to-point sends and receives return at once on the fake group, the receive buffers
are fake tensors allocated as on the GPU, so the micro-batches' activations a stage holds
(GPipe: all m of them; 1F1B: at most as many as stages) are the schedule's own. What
training learns from the other stages through collectives, the stage's micro-batch input
and output (`pipeline.stage_io`), the plan finds on its rank (`pipeline.local_stage_io`:
the units before the stage run on fake tensors under the run's precision). The mesh and
the cut of the backbone are made before the fake tensors.

What the plan leaves out: memory that kernels take behind the dispatcher (cuDNN
workspaces), the CUDA context (outside the allocator), allocator fragmentation (hence the
headroom kept free), `train.compile` (planned eager). Data-dependent sizes (the rows of
the batch whose label a rank owns, partial FC's positives and the rows its optimizer
steps) are planned at their largest. DDP's gradient buckets (a flat copy of the
backbone's or stage's gradients) are allocated as DDP does. Not planned yet (refused with
the reason): the Triton head. The step-time bound of a pipeline's rank is that of its own
stage's work, without the schedule's bubble.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from recognition.config import ExperimentConfig
from recognition.distributed import DistInfo
from recognition.heads import shard_range
from recognition.optim import init_state
from recognition.pipeline import PipelineLayout, StagePlan, make_layout, stage_plan
from recognition.tensor_memory import CUDA_BLOCK_BYTES, TensorMemory, upper_bound
from recognition.training.build import ModelParts, build_model
from recognition.training.roofline import StepCost

log = logging.getLogger(__name__)

GIB = 1 << 30
# Share of the GPU's memory a plan leaves free: the CUDA context and library workspaces
# (outside the allocator's count) and the caching allocator's fragmentation.
HEADROOM = 0.10


class PlanError(RuntimeError):
    """A plan that cannot be made (a process group already running, an unplannable option)."""


@dataclass
class RankPlan:
    """One rank's planned memory (bytes, at the step's peak) and work."""

    rank: int
    stage: int | None
    num_local_classes: int
    parameters: int
    """The backbone's (or stage's) parameters and buffers, in the model's dtype."""
    class_rows: int
    """The head's shard of the class matrix."""
    fp32_masters: int
    """fp32 master copies (precision O2)."""
    optimizer_state: int
    gradients: int
    """At the peak: parameters' and masters' gradients and DDP's buckets."""
    activations: int
    """At the peak, everything else: the batch, activations kept for backward, logits,
    temporaries."""
    peak: int
    phase: str
    """Where the peak falls: forward, backward or update (clipping and the optimizer)."""
    flops_backbone: int
    flops_head: int
    bound_s: dict[str, float] = field(default_factory=dict)
    """Roofline lower bound of the step time per device (`roofline.DEVICES`)."""


@dataclass
class RunPlan:
    """The plan of every distinct rank of a run."""

    config_name: str
    world_size: int
    num_classes: int
    batch_size: int
    precision: str
    ranks: list[RankPlan]
    pipeline: str | None = None
    """With a pipeline, its stages and micro-batches in words ("2 stages, 4 micro-batches
    of 32, 1f1b"); None without one."""

    @property
    def worst(self) -> RankPlan:
        """The rank with the highest peak."""
        return max(self.ranks, key=lambda r: r.peak)


# ---------------------------------------------------------------------- which ranks


def distinct_ranks(cfg: ExperimentConfig, world_size: int, num_classes: int) -> list[int]:
    """The ranks whose plans can differ: each pipeline stage (of the first replica), and on
    the head's ranks the largest and the smallest class shard."""
    stages = cfg.model.pipeline_stages
    if world_size % stages:
        raise PlanError(
            f"model.pipeline_stages={stages} does not divide the {world_size} GPUs (--gpus)"
        )
    head_ranks = world_size // stages  # the last stage's ranks, which hold the head
    ranks = list(range(stages))
    _, smallest = shard_range(num_classes, head_ranks, head_ranks - 1)
    _, largest = shard_range(num_classes, head_ranks, 0)
    if smallest != largest:
        ranks.append(world_size - 1)
    return ranks


# ---------------------------------------------------------------------- one rank


def plan_rank(
    cfg: ExperimentConfig,
    num_classes: int,
    world_size: int,
    rank: int,
    *,
    granularity: int = CUDA_BLOCK_BYTES,
    detailed: bool = True,
) -> RankPlan:
    """Plan rank `rank` of `world_size` for `num_classes` classes (see the module docstring).

    `granularity` rounds each allocation (512: as the CUDA caching allocator; 1: bytes, as
    the CPU's). `detailed=False` plans the peak alone (no breakdown, no FLOPs): what the
    searches for the largest batch and class count need.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with _fake_process_group(rank, world_size):
        dist_info = DistInfo(rank=rank, local_rank=0, world_size=world_size)
        breakdown = _Breakdown(granularity)
        memory = TensorMemory(granularity=granularity, on_peak=breakdown if detailed else None)
        _register_inplace_metas()
        # A shape environment: sizes that depend on data (a boolean mask's rows) become
        # symbols, counted at their largest. allow_fallback_kernels=False: an op without a
        # fake kernel stops the plan rather than run for real on real copies of its inputs
        # (the memory the plan must not take).
        fake_mode = FakeTensorMode(shape_env=ShapeEnv(), allow_fallback_kernels=False)
        layout, stages = _pipeline(cfg, dist_info)
        with fake_mode, memory, _scaler_updates_as_on_gpu():
            parts = _build(cfg, dist_info, num_classes, layout, stages)
            breakdown.watch(parts)
            micro_batches = _fake_batch(cfg, layout)
            init_state(parts.optimizer)
            memory.reset_peak()
            breakdown.start_step()
            with _counters(detailed) as (cost, flops):
                parts.run_step(micro_batches, cfg.optim.grad_clip)
    stage = rank % cfg.model.pipeline_stages if cfg.model.pipeline_stages > 1 else None
    head_flops = _module_flops(flops, "ShardedMarginSoftmax") if flops is not None else 0
    at_peak = breakdown.at_peak
    other = sum(at_peak.get(k, 0) for k in _STATE)
    return RankPlan(
        rank=rank,
        stage=stage,
        num_local_classes=parts.head.num_local if parts.head is not None else 0,
        parameters=at_peak.get("parameters", 0),
        class_rows=at_peak.get("class_rows", 0),
        fp32_masters=at_peak.get("fp32_masters", 0),
        optimizer_state=at_peak.get("optimizer_state", 0),
        gradients=at_peak.get("gradients", 0),
        activations=memory.peak - other if detailed else 0,
        peak=memory.peak,
        phase=breakdown.phase_at_peak,
        flops_backbone=(cost.flops - head_flops) if cost is not None else 0,
        flops_head=head_flops,
        bound_s=dict(cost.bound_s) if cost is not None else {},
    )


# Fused optimizer steps that torch has no fake kernel for (2.11 to 2.14: SGD's). They
# update their tensors in place and return nothing, so on fake tensors they do nothing.
_INPLACE_STEPS = ("_fused_sgd_", "_fused_sgd_.tensor_lr", "_fused_adamw_.tensor_lr")
_meta_library: list[torch.library.Library] = []


def _register_inplace_metas() -> None:
    if _meta_library:
        return
    library = torch.library.Library("aten", "IMPL")
    for name in _INPLACE_STEPS:
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "Meta"):
            library.impl(name, _do_nothing, "Meta")
    _meta_library.append(library)


def _do_nothing(*args: object, **kwargs: object) -> None:
    return None


@contextlib.contextmanager
def _fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """The default process group as a fake one of `world_size` ranks, this being `rank`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise PlanError(
            "the run planner makes its own (fake) process group: run it in a process that "
            "has none (python train.py --plan, not under torchrun)"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _scaler_updates_as_on_gpu() -> Iterator[None]:
    """torch's sharded fp16 loss scaler updates its scale on a GPU with one kernel and on
    the CPU in Python that reads the overflow flag on the host, which a fake tensor has
    not: while planning (fake CPU tensors standing for a GPU run's) it takes the kernel."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    def update_with_kernel(scaler: ShardedGradScaler, found_inf: torch.Tensor) -> None:
        torch._amp_update_scale_(
            scaler._scale,  # type: ignore[arg-type]
            scaler._growth_tracker,  # type: ignore[arg-type]
            found_inf,
            scaler._growth_factor,
            scaler._backoff_factor,
            scaler._growth_interval,
        )

    original = ShardedGradScaler._amp_update_scale_cpu_
    ShardedGradScaler._amp_update_scale_cpu_ = update_with_kernel  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardedGradScaler._amp_update_scale_cpu_ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _counters(detailed: bool) -> Iterator[tuple[StepCost | None, FlopCounterMode | None]]:
    if not detailed:
        yield None, None
        return
    with FlopCounterMode(display=False) as flops, StepCost() as cost:
        yield cost, flops


def _module_flops(counter: FlopCounterMode, module_name: str) -> int:
    """FLOPs counted inside the modules of class `module_name` (forward and backward)."""
    counts = counter.get_flop_counts()
    return int(sum(sum(ops.values()) for name, ops in counts.items() if name == module_name))


def _pipeline(
    cfg: ExperimentConfig, dist_info: DistInfo
) -> tuple[PipelineLayout | None, StagePlan | None]:
    """The pipeline's mesh and the cut of its backbone (model.pipeline_stages > 1; else
    None, None), made before the fake tensors: the mesh reads its ranks on the host, and
    the meta device builds no backbone under FakeTensorMode."""
    stages = cfg.model.pipeline_stages
    if stages == 1:
        return None, None
    layout = make_layout(stages, dist_info)
    return layout, stage_plan(cfg.model, cfg.data.image_hw, stages)


def _build(
    cfg: ExperimentConfig,
    dist_info: DistInfo,
    num_classes: int,
    layout: PipelineLayout | None,
    stages: StagePlan | None,
) -> ModelParts:
    """The rank's parts as training builds them, data-parallel wrappers made by
    `_DataParallelMemory` (DDP itself cannot wrap fake tensors), a pipeline stage's
    micro-batch shapes found on this rank (`pipeline.local_stage_io`: the other stages,
    which training asks, are not there)."""
    if cfg.head.kernel == "triton" or cfg.head.fused_update:
        raise PlanError(
            "head.kernel=triton: the Triton kernels cannot run on fake tensors; plan with "
            "head.kernel=torch and a head.chunk_size (the kernel's memory is at most that "
            "of the chunked torch path)"
        )
    if cfg.head.kernel == "auto":
        # The torch path, which auto takes wherever it does not measure: the plan's fake CPU
        # tensors would make the head log that choice, which is not the run's, into the
        # run's log. On a GPU where auto takes Triton, the plan counts at most its memory.
        cfg = dataclasses.replace(cfg, head=dataclasses.replace(cfg.head, kernel="torch"))
    # Parameters in the contiguous format: a channels-last copy has the same bytes, and
    # Module.to cannot convert fake parameters. The batch keeps the run's format.
    return build_model(
        cfg, dist_info, num_classes, layout, torch.preserve_format, wrap=_wrap, local_plan=stages
    )


def _wrap(cfg: ExperimentConfig, dist_info: DistInfo, module: nn.Module) -> nn.Module:
    return _DataParallelMemory(module) if dist_info.is_distributed else module


class _DataParallelMemory(nn.Module):
    """What DistributedDataParallel adds to a replica's memory, for the plan: its gradient
    buckets, one flat tensor per dtype holding a copy of every gradient (DDP's default,
    gradient_as_bucket_view=False), made when it wraps the module. Calls the module."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        numel: dict[torch.dtype, int] = {}
        for param in module.parameters():
            if param.requires_grad:
                numel[param.dtype] = numel.get(param.dtype, 0) + param.numel()
        self.buckets = [torch.empty(n, dtype=dtype) for dtype, n in numel.items()]

    def forward(self, *args: object, **kwargs: object) -> object:
        return self.module(*args, **kwargs)


def _fake_batch(
    cfg: ExperimentConfig, layout: PipelineLayout | None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step's micro-batches as the loop hands them over: float images (B, 3, H, W) in
    the run's memory format (an empty image batch on a pipeline's later stages, which read
    the labels alone), and int64 labels."""
    batch = cfg.train.batch_size
    memory_format = torch.channels_last if cfg.data.channels_last else torch.contiguous_format
    images = (
        (batch, 3, *cfg.data.image_hw) if layout is None or layout.is_first else (batch, 0, 0, 0)
    )
    return [
        (
            torch.empty(images).contiguous(memory_format=memory_format),
            torch.zeros(batch, dtype=torch.int64),
        )
        for _ in range(cfg.train.accumulate_steps)
    ]


# Categories of the breakdown besides activations (what they are, at the peak).
_STATE = ("parameters", "class_rows", "fp32_masters", "optimizer_state", "gradients")


class _Breakdown:
    """Called at each new peak: what the live bytes are made of there, and the phase."""

    def __init__(self, granularity: int) -> None:
        self.granularity = granularity
        self.parts: ModelParts | None = None
        self.at_peak: dict[str, int] = {}
        self.phase = "build"
        self.phase_at_peak = "build"
        self._static: dict[str, int] = {}
        self._grad_holders: list[torch.Tensor] = []
        self._buckets: list[torch.Tensor] = []

    def watch(self, parts: ModelParts) -> None:
        """Follow `parts` (call once they are built)."""
        self.parts = parts
        head_weight = [] if parts.head is None else [parts.head.weight]
        backbone = [*parts.backbone.parameters(), *parts.backbone.buffers()]
        params = [*parts.backbone.parameters(), *head_weight]
        stepped = [parts.precision.optimizer_param(p) for p in params]
        masters = [m for m, p in zip(stepped, params, strict=True) if m is not p]  # O2
        self._static = {
            "parameters": self._bytes(backbone),
            "class_rows": self._bytes(head_weight),
            "fp32_masters": self._bytes(masters),
        }
        self._grad_holders = [*parts.backbone.parameters(), *head_weight, *masters]
        self._buckets = [
            bucket
            for module in parts.model.modules()
            if isinstance(module, _DataParallelMemory)
            for bucket in module.buckets
        ]
        step = parts.precision.step

        def marked_step(*args: object, **kwargs: object) -> object:
            self.phase = "update"
            return step(*args, **kwargs)

        # The planner's own Precision: its step marks the update phase.
        parts.precision.step = marked_step  # type: ignore[method-assign]

    def start_step(self) -> None:
        """The step starts: until a new peak, the peak is the state before it."""
        self.phase = "forward"
        self()

    def __call__(self) -> None:
        if self.parts is None:
            return
        phase = self.phase
        if phase != "update" and torch._C._current_graph_task_id() != -1:
            phase = "backward"
        state = [
            t
            for values in self.parts.optimizer.state.values()
            for t in values.values()
            if isinstance(t, torch.Tensor)
        ]
        grads = [p.grad for p in self._grad_holders if p.grad is not None]
        self.at_peak = {
            **self._static,
            "optimizer_state": self._bytes(state),
            "gradients": self._bytes(grads + self._buckets),
        }
        self.phase_at_peak = phase

    def _bytes(self, tensors: list[torch.Tensor]) -> int:
        seen: dict[int, int] = {}
        for t in tensors:
            storage = t.untyped_storage()
            seen[id(storage)] = upper_bound(storage.nbytes())
        step = self.granularity
        return sum(-(-n // step) * step for n in seen.values())


# ---------------------------------------------------------------------- a whole run


def plan_run(
    cfg: ExperimentConfig,
    num_classes: int,
    world_size: int,
    *,
    granularity: int = CUDA_BLOCK_BYTES,
) -> RunPlan:
    """Plan every distinct rank (`distinct_ranks`) of `cfg` on `world_size` GPUs."""
    ranks = [
        plan_rank(cfg, num_classes, world_size, rank, granularity=granularity)
        for rank in distinct_ranks(cfg, world_size, num_classes)
    ]
    return RunPlan(
        config_name=cfg.name,
        world_size=world_size,
        num_classes=num_classes,
        batch_size=cfg.train.batch_size,
        precision=_precision_name(cfg),
        ranks=ranks,
        pipeline=_pipeline_name(cfg),
    )


def _pipeline_name(cfg: ExperimentConfig) -> str | None:
    model, micro = cfg.model, cfg.micro_batches
    if model.pipeline_stages == 1:
        return None
    return (
        f"{model.pipeline_stages} stages, {micro} micro-batches of "
        f"{cfg.train.batch_size // micro}, {model.pipeline_schedule}"
    )


def _precision_name(cfg: ExperimentConfig) -> str:
    level = cfg.precision.level
    return level if level == "O0" else f"{level} {cfg.precision.dtype}"


def usable_bytes(gpu_memory_gib: float) -> int:
    """What a plan's peak may reach on a GPU of `gpu_memory_gib` GiB (HEADROOM kept free)."""
    return int(gpu_memory_gib * GIB * (1 - HEADROOM))


def with_batch(cfg: ExperimentConfig, batch_size: int) -> ExperimentConfig:
    """`cfg` with train.batch_size set (validated, as an override would be)."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=batch_size))


def largest(
    peak_at: Callable[[int], int], start: int, limit: int, *, tolerance: float = 0.0
) -> int:
    """The largest integer x >= 1 with peak_at(x) <= limit (0 if even 1 does not fit), to
    within `tolerance` (relative; 0: exactly).

    `peak_at` must grow with x and be convex: a batch or a class count, of which every
    live tensor's size is an affine function, so the peak is the largest of affine
    functions. The line through the two plans nearest the limit predicts the answer; a
    line through two points both below its prediction runs under a convex function beyond
    them, so a prediction that fits is the answer. Otherwise each prediction is planned
    with its neighbour one step (the tolerance) beyond it, and bisection takes over where
    the line would leave the bracket.
    """
    peaks: dict[int, int] = {}

    def fits(x: int) -> bool:
        if x not in peaks:
            peaks[x] = peak_at(x)
        return peaks[x] <= limit

    low, high = 0, None  # low fits (0: none known to), high does not (None: none known)
    for x in dict.fromkeys((max(1, start), max(1, start // 2))):  # the second is cheaper
        if fits(x):
            low = max(low, x)
        else:
            high = x if high is None else min(high, x)
    while high is None or high - low > _step(high, tolerance):
        if high == 1:
            return 0
        guess, extrapolated = _secant(peaks, limit)
        if guess is None or guess <= low or (high is not None and guess >= high):
            guess, extrapolated = (2 * low if high is None else (low + high) // 2), False
        guess = max(guess, 1)
        if fits(guess):
            low = guess
            if extrapolated:
                return low
            beyond = guess + _step(guess, tolerance)
            if high is None or beyond < high:
                if fits(beyond):
                    low = beyond
                else:
                    high = beyond
        else:
            high = guess
            below = max(low, guess - _step(guess, tolerance))
            if below > low:
                if fits(below):
                    low = below
                else:
                    high = below
    return low


def _step(x: int, tolerance: float) -> int:
    return max(1, math.floor(tolerance * x))


def _secant(peaks: dict[int, int], limit: int) -> tuple[int | None, bool]:
    """Where the line through the two planned points nearest the limit reaches it, and
    whether both points lie below that (an extrapolation)."""
    points = sorted(peaks.items(), key=lambda item: abs(item[1] - limit))[:2]
    if len(points) < 2:
        return None, False
    (x0, p0), (x1, p1) = points
    if p1 == p0 or x1 == x0:
        return None, False
    slope = (p1 - p0) / (x1 - x0)
    if slope <= 0:
        return None, False
    guess = int(x0 + (limit - p0) / slope)
    return guess, max(x0, x1) < guess and max(p0, p1) <= limit


# ---------------------------------------------------------------------- before a GPU run


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
    from recognition import distributed
    from recognition.training.build import TrainingError

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
    from recognition.training.plan_report import largest_batch

    plan = plan_run(cfg, num_classes, world_size)
    peak = plan.worst.peak
    return peak, (largest_batch(cfg, plan, limit) if peak > limit else None)
