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
backbone's or stage's gradients) are allocated as DDP does. The Triton head's host code
runs on the fake tensors as on a GPU's, its kernel launches left out (they allocate
nothing). The step-time bound of a pipeline's rank is that of its own stage's work, without
the schedule's bubble.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from recognition.config import ExperimentConfig
from recognition.heads import shard_range
from recognition.tensor_memory import CUDA_BLOCK_BYTES
from recognition.training.plan.centroid_pass import plan_centroid_pass
from recognition.training.plan.fake import PlanError, fake_step
from recognition.training.plan.teacher_pass import plan_teacher_pass


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
    centroid_pass: int = 0
    """Peak of head.init=centroids's pass over the data before step 1 (0 without it);
    `peak` is the larger of the two."""
    teacher_pass: int = 0
    """Peak of the pass that caches train.teacher's embeddings before step 1 (0 without
    it); `peak` is the largest of the three."""


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
    step = fake_step(cfg, num_classes, world_size, rank, granularity=granularity, detailed=detailed)
    parts, at_peak, cost = step.parts, step.at_peak, step.cost
    stage = rank % cfg.model.pipeline_stages if cfg.model.pipeline_stages > 1 else None
    head_flops = step.flops_in("ShardedMarginSoftmax")
    centroids = plan_centroid_pass(cfg, num_classes, world_size, rank, granularity=granularity)
    teacher = plan_teacher_pass(cfg, granularity=granularity)
    peak, phase = step.peak, step.phase_at_peak
    if centroids > peak:
        peak, phase = centroids, "centroid pass"
    if teacher > peak:
        peak, phase = teacher, "teacher pass"
    return RankPlan(
        rank=rank,
        stage=stage,
        num_local_classes=parts.head.num_local if parts.head is not None else 0,
        parameters=at_peak.get("parameters", 0),
        class_rows=at_peak.get("class_rows", 0),
        fp32_masters=at_peak.get("fp32_masters", 0),
        optimizer_state=at_peak.get("optimizer_state", 0),
        gradients=at_peak.get("gradients", 0),
        activations=step.peak - step.state_at_peak if detailed else 0,
        peak=peak,
        phase=phase,
        flops_backbone=(cost.flops - head_flops) if cost is not None else 0,
        flops_head=head_flops,
        bound_s=dict(cost.bound_s) if cost is not None else {},
        centroid_pass=centroids,
        teacher_pass=teacher,
    )


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
