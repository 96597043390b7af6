"""One rank's training step on fake tensors, for the run planner (`plan.rank`).

`fake_step` builds the rank's parts as training builds them (`build_model`) under
`FakeTensorMode` (shapes and dtypes, no memory) with a fake process group (collectives
return at once), DistributedDataParallel's gradient buckets standing in for DDP
(`_DataParallelMemory`), and runs one step on a fake batch while `TensorMemory` counts the
bytes every op would allocate; `_Breakdown` says what the live bytes are made of at each
new peak, and in which phase of the step it falls.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from recognition.config import ExperimentConfig
from recognition.distributed import DistInfo
from recognition.optim import init_state
from recognition.pipeline import PipelineLayout, StagePlan, make_layout, stage_plan
from recognition.tensor_memory import TensorMemory, upper_bound
from recognition.training.build import build_model
from recognition.training.distill import Distillation
from recognition.training.parts import ModelParts
from recognition.training.plan.roofline import StepCost
from recognition.training.plan.teacher_pass import fake_targets, planned_distillation
from recognition.training.teacher import teacher_outline


class PlanError(RuntimeError):
    """A plan that cannot be made (a process group already running, an unplannable option)."""


@dataclass
class FakeStep:
    """One rank's parts and its step on fake tensors: the peak, and what it was made of."""

    parts: ModelParts
    peak: int
    """Bytes live at the step's peak (the state made before the step included)."""
    at_peak: dict[str, int]
    """Bytes at the peak by category (`STATE`); what is left of the peak is activations.
    Empty when the step was not `detailed`."""
    phase_at_peak: str
    """forward, backward or update (clipping and the optimizer)."""
    cost: StepCost | None
    flops: FlopCounterMode | None

    @property
    def state_at_peak(self) -> int:
        """Bytes at the peak that are not activations (parameters, class rows, masters,
        optimizer state, gradients)."""
        return sum(self.at_peak.get(k, 0) for k in STATE)

    def flops_in(self, module_name: str) -> int:
        """FLOPs counted inside the modules of class `module_name` (forward and backward);
        0 when the step was not `detailed`."""
        if self.flops is None:
            return 0
        counts = self.flops.get_flop_counts()
        return int(sum(sum(ops.values()) for name, ops in counts.items() if name == module_name))


def fake_step(
    cfg: ExperimentConfig,
    num_classes: int,
    world_size: int,
    rank: int,
    *,
    granularity: int,
    detailed: bool,
) -> FakeStep:
    """Build rank `rank` of `world_size` for `num_classes` classes on fake tensors and run
    one training step (`plan.rank.plan_rank` says what is counted). `granularity` rounds
    each allocation; `detailed=False` counts the peak alone (no breakdown, no FLOPs)."""
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
        # The teacher's file is read on the host, before the fake tensors.
        outline = teacher_outline(cfg.train.teacher) if cfg.train.teacher else None
        with fake_mode, memory, _scaler_updates_as_on_gpu():
            distill = planned_distillation(cfg, outline)
            parts = _build(cfg, dist_info, num_classes, layout, stages, distill)
            breakdown.watch(parts)
            micro_batches = _fake_batch(cfg, layout, fake_targets(cfg, distill))
            init_state(parts.optimizer)
            memory.reset_peak()
            breakdown.start_step()
            with _counters(detailed) as (cost, flops):
                parts.run_step(micro_batches, cfg.optim.grad_clip)
    return FakeStep(parts, memory.peak, breakdown.at_peak, breakdown.phase_at_peak, cost, flops)


# Fused optimizer steps that torch has no fake kernel for (2.11 to 2.14: SGD's). They
# update their tensors in place and return nothing, so on fake tensors they do nothing.
_INPLACE_STEPS = (
    "_fused_sgd_",
    "_fused_sgd_.tensor_lr",
    "_fused_adamw_.tensor_lr",
    "_fused_adam_.tensor_lr",
)
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
    distill: Distillation | None,
) -> ModelParts:
    """The rank's parts as training builds them (with train.teacher's, `distill`: see
    `plan.teacher_pass`), data-parallel wrappers made by
    `_DataParallelMemory` (DDP itself cannot wrap fake tensors), a pipeline stage's
    micro-batch shapes found on this rank (`pipeline.local_stage_io`: the other stages,
    which training asks, are not there)."""
    # head.kernel=triton: its host code runs on the fake tensors as on a GPU's, allocating
    # what it would there (kept logits, rounded rows, the chunks' buffers); its kernels'
    # launches, which allocate nothing, are left out (heads/kernels/host.launch).
    if cfg.head.kernel == "auto":
        # The torch path, which auto takes wherever it does not measure: the plan's fake CPU
        # tensors would make the head log that choice, which is not the run's, into the
        # run's log. On a GPU where auto takes Triton, the plan counts at most its memory.
        cfg = dataclasses.replace(cfg, head=dataclasses.replace(cfg.head, kernel="torch"))
    if cfg.train.cuda_graphs:
        # The eager step: a captured one holds the same step's memory in its graph's pool,
        # and its first call would log its choice (off: not on a GPU) into the run's log.
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, cuda_graphs=False))
    # Parameters in the contiguous format: a channels-last copy has the same bytes, and
    # Module.to cannot convert fake parameters. The batch keeps the run's format.
    return build_model(
        cfg,
        dist_info,
        num_classes,
        layout,
        torch.preserve_format,
        wrap=_wrap,
        local_plan=stages,
        distill=distill,
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
    cfg: ExperimentConfig, layout: PipelineLayout | None, targets: list[torch.Tensor]
) -> list[tuple[torch.Tensor, ...]]:
    """The step's micro-batches as the loop hands them over: float images (B, 3, H, W) in
    the run's memory format (an empty image batch on a pipeline's later stages, which read
    the labels alone), int64 labels, and `targets` (a distilled run's cached teacher
    embeddings, `teacher_pass.fake_targets`)."""
    batch = cfg.train.batch_size
    memory_format = torch.channels_last if cfg.data.channels_last else torch.contiguous_format
    images = (
        (batch, 3, *cfg.data.image_hw) if layout is None or layout.is_first else (batch, 0, 0, 0)
    )
    return [
        (
            torch.empty(images).contiguous(memory_format=memory_format),
            torch.zeros(batch, dtype=torch.int64),
            *targets,
        )
        for _ in range(cfg.train.accumulate_steps)
    ]


# Categories of the breakdown besides activations (what they are, at the peak).
STATE = ("parameters", "class_rows", "fp32_masters", "optimizer_state", "gradients")


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
