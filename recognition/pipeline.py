"""Pipeline-parallel backbone: stages over ranks, micro-batches, composed with data
parallelism and the sharded head (`model.pipeline_stages` > 1).

Layout. The W ranks form a (W / P) x P device mesh ("dp", "pp"): rank = d * P + s runs
stage s of data-parallel replica d. A replica's P ranks (its "pp" group) pass activations
forward and their gradients back with `torch.distributed.pipelining` (`PipelineStage`, a
GPipe or 1F1B schedule); the W / P ranks holding the same stage (its "dp" group) are
replicas of it, wrapped in DistributedDataParallel over that group. The margin-softmax
head lives on the last stage's ranks only, its classes sharded over their "dp" group: the
schedule's loss function is the head, so the embeddings never leave the ranks that made
them, exactly as with P = 1.

Stages. A backbone is a chain of units (`recognition.models.units`: the stem, every
residual block, the embedding layer). The chain is cut at unit boundaries where the
stages' forward FLOPs are closest to equal (`plan_stages`; `model.pipeline_split` names the
cuts instead), and each rank keeps its stage's units of a whole backbone built from the run
seed on every rank, so the pipelined model starts from the same weights whatever P, and
its parameters keep their unsplit names (`layer3.4.conv1.weight`): a checkpoint of one
layout resumes in another, P and world size alike.

One step (`recognition.training.pipeline_step.PipelineStep`). Every rank of a replica
loads the same batch (the stages after the first read only its labels, not the images).
The batch is split into m micro-batches; the head's loss of each is divided by m, so the
gradients are those of the batch's mean loss: exactly the unpipelined backbone run on the
same micro-batches with gradient accumulation.

Batch normalisation sees micro-batches, not the batch: its statistics are those of B / m
samples (with model.sync_bn, of B / m on each of the stage's data-parallel ranks), and its
running averages take m updates per step. Small micro-batches therefore make noisier
batch statistics; that is the one way a pipelined run differs from an unpipelined one with
the same batch, and the reason an unpipelined run with train.accumulate_steps = m is its
exact reference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset
from torch.utils.flop_counter import FlopCounterMode

from recognition import distributed
from recognition.config import ModelConfig
from recognition.distributed import DistInfo
from recognition.models import backbone_from_config
from recognition.models.units import UnitChain
from recognition.precision import Precision


class PipelineError(ValueError):
    """A pipeline layout that cannot be built (it names the config key)."""


# ---------------------------------------------------------------------- layout


@dataclass(frozen=True)
class PipelineLayout:
    """Where this rank sits in the (data parallel x pipeline) mesh."""

    num_stages: int
    stage: int
    """This rank's stage, 0 .. num_stages - 1."""
    dp_size: int
    """Replicas of the pipeline (world size / num_stages)."""
    dp_rank: int
    pp_group: dist.ProcessGroup | None
    """This replica's ranks, in stage order (activations and the loss go through it)."""
    dp_group: dist.ProcessGroup | None
    """The ranks holding this stage in every replica (DDP, SyncBN and, on the last stage,
    the head's class shards)."""

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


def make_layout(num_stages: int, dist_info: DistInfo) -> PipelineLayout:
    """The (world / num_stages) x num_stages mesh of this job (collective: every rank)."""
    world = dist_info.world_size
    if num_stages < 2:
        raise PipelineError("model.pipeline_stages: a pipeline needs at least 2 stages")
    if world % num_stages:
        raise PipelineError(
            f"model.pipeline_stages={num_stages} does not divide the {world} processes; run "
            f"a multiple of {num_stages} (torchrun --nproc_per_node)"
        )
    from torch.distributed.device_mesh import init_device_mesh

    dp_size = world // num_stages
    mesh = init_device_mesh(
        dist_info.device.type, (dp_size, num_stages), mesh_dim_names=("dp", "pp")
    )
    return PipelineLayout(
        num_stages=num_stages,
        stage=dist_info.rank % num_stages,
        dp_size=dp_size,
        dp_rank=dist_info.rank // num_stages,
        pp_group=mesh["pp"].get_group(),
        dp_group=mesh["dp"].get_group(),
    )


# ---------------------------------------------------------------------- stages


def unit_costs(model_cfg: ModelConfig, image_hw: tuple[int, int]) -> tuple[list[str], list[int]]:
    """The backbone's units and the forward FLOPs of each for one image.

    Counted on the meta device (no memory, no compute) with torch's FLOP counter, which
    counts convolutions and matmuls: the work that sets a stage's time.
    """
    _, units, costs = _meta_unit_costs(model_cfg, image_hw)
    return units, costs


def _meta_unit_costs(
    model_cfg: ModelConfig, image_hw: tuple[int, int]
) -> tuple[UnitChain, list[str], list[int]]:
    """`unit_costs`, with the meta-device backbone they were counted on."""
    with torch.device("meta"):
        backbone = backbone_from_config(model_cfg, image_hw)
    if not isinstance(backbone, UnitChain):
        raise PipelineError(
            f"model.backbone: {model_cfg.backbone} is not a chain of units and cannot be "
            "cut into pipeline stages"
        )
    backbone.eval()  # BatchNorm1d refuses a batch of one in training mode
    x = torch.zeros(1, 3, *image_hw, device="meta")
    costs = []
    with torch.no_grad():
        for unit in backbone.units():
            with FlopCounterMode(display=False) as counter:
                x = backbone.forward_unit(unit, x)
            costs.append(int(counter.get_total_flops()))
    return backbone, list(backbone.units()), costs


def plan_stages(
    units: Sequence[str],
    costs: Sequence[float],
    num_stages: int,
    split: Sequence[str] | None = None,
) -> list[tuple[int, int]]:
    """[first, stop) unit ranges of the stages: cut before the units named in `split`, or
    where the largest stage cost is smallest (contiguous, every stage at least one unit)."""
    num_units = len(units)
    if num_stages > num_units:
        raise PipelineError(
            f"model.pipeline_stages={num_stages}: the backbone has only {num_units} units"
        )
    if split is not None:
        starts = []
        for name in split:
            if name not in units:
                raise PipelineError(
                    f"model.pipeline_split: {name!r} is not a unit of the backbone (its units: "
                    f"{units[0]}, {units[1]}, ..., {units[-1]})"
                )
            starts.append(units.index(name))
        if starts != sorted(starts) or len(set(starts)) != len(starts) or starts[0] == 0:
            raise PipelineError(
                "model.pipeline_split: the units must be in forward order, distinct, and "
                f"after the first unit ({units[0]}), got {list(split)}"
            )
        bounds = [0, *starts, num_units]
        return [(bounds[i], bounds[i + 1]) for i in range(num_stages)]
    # best[k][i]: the smallest possible largest stage cost of units [0, i) in k stages.
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    best = [[math.inf] * (num_units + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (num_units + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, num_units + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    ranges, stop = [], num_units
    for k in range(num_stages, 0, -1):
        first = cut[k][stop]
        ranges.append((first, stop))
        stop = first
    return ranges[::-1]


def check_stages(model_cfg: ModelConfig, image_hw: tuple[int, int], num_stages: int) -> None:
    """Raise PipelineError, naming the key, when the backbone cannot be cut into
    `num_stages` stages as `model.pipeline_split` says (nothing built: the meta device)."""
    _, units, costs = _meta_unit_costs(model_cfg, image_hw)
    plan_stages(units, costs, num_stages, model_cfg.pipeline_split)


@dataclass(frozen=True)
class StagePlan:
    """How a backbone is cut: its units, their forward FLOPs, every stage's unit range, and
    the whole backbone on the meta device (its parameter names and shapes, no storage)."""

    units: list[str]
    costs: list[int]
    ranges: list[tuple[int, int]]
    whole: nn.Module

    def describe(self) -> str:
        """One line: each stage's first and last unit and its share of the forward FLOPs."""
        total = max(1, sum(self.costs))
        return "; ".join(
            f"stage {s}: {self.units[a]}..{self.units[b - 1]} "
            f"({100 * sum(self.costs[a:b]) / total:.0f} % of FLOPs)"
            for s, (a, b) in enumerate(self.ranges)
        )


def stage_plan(model_cfg: ModelConfig, image_hw: tuple[int, int], num_stages: int) -> StagePlan:
    """How the backbone is cut into `num_stages` stages (`plan_stages`, as
    `model.pipeline_split` says), counted on the meta device."""
    whole, units, costs = _meta_unit_costs(model_cfg, image_hw)
    ranges = plan_stages(units, costs, num_stages, model_cfg.pipeline_split)
    return StagePlan(units, costs, ranges, whole)


def build_stage_backbone(
    model_cfg: ModelConfig,
    image_hw: tuple[int, int],
    layout: PipelineLayout,
    seed: int,
    plan: StagePlan | None = None,
) -> tuple[UnitChain, StagePlan]:
    """This rank's stage: the whole backbone drawn from `seed`, its other units removed.

    Returns the stage (on the CPU) and the plan of every stage. `plan`: the cut, when it
    was made already (`stage_plan`; the run planner makes it before its fake tensors,
    under which the meta device cannot build a backbone); None makes it here.
    """
    if plan is None:
        plan = stage_plan(model_cfg, image_hw, layout.num_stages)
    # The same generator state on every rank: the stages are cut from one backbone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        backbone = backbone_from_config(model_cfg, image_hw)
    assert isinstance(backbone, UnitChain)
    backbone.keep_units(*plan.ranges[layout.stage])
    return backbone, plan


def send_contiguous(
    stage: nn.Module, layout: PipelineLayout, memory_format: torch.memory_format
) -> None:
    """Make `stage` pass contiguous activations between ranks and compute in `memory_format`.

    Point-to-point sends take contiguous tensors only, so a channels-last map is made
    contiguous before it leaves a stage and channels-last again where it arrives (one copy
    of the activation each way, against a stage's convolutions). Forward hooks: the
    module's parameters keep their names.
    """
    if memory_format == torch.channels_last and not layout.is_first:
        stage.register_forward_pre_hook(
            lambda module, args: (args[0].contiguous(memory_format=memory_format), *args[1:])
        )
    if not layout.is_last:
        stage.register_forward_hook(lambda module, args, output: output.contiguous())


ShapeDtype = tuple[tuple[int, ...], torch.dtype]


def stage_io(
    stage: nn.Module,
    layout: PipelineLayout,
    input_meta: Tensor | None,
    precision: Precision,
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """(input, output) of this rank's stage for one micro-batch, as meta tensors.

    Collective over the pipeline group. Each stage in turn runs a zero micro-batch of the
    previous stage's output in eval mode under the run's precision (so the dtypes are the
    ones autocast or a half model give, and no BatchNorm statistic moves) and passes its
    output's shape and dtype on. `input_meta` is the first stage's input, in the images'
    memory format (some torch releases check the strides); later stages get theirs from
    the previous one. Given to `PipelineStage`, these spare it torch's own
    shape inference, which would run the stages in training mode.
    """
    shape_dtype: ShapeDtype | None = None
    if layout.is_first:
        assert input_meta is not None
        shape_dtype = (tuple(input_meta.shape), input_meta.dtype)
    mine_in = mine_out = None
    for s in range(layout.num_stages):
        if layout.stage == s:
            mine_in = shape_dtype
            assert mine_in is not None
            mine_out = shape_dtype = _run_zeros(stage, mine_in, precision, device)
        source = dist.get_global_rank(layout.pp_group, s)
        shape_dtype = distributed.broadcast_object(shape_dtype, src=source, group=layout.pp_group)
    assert mine_in is not None and mine_out is not None
    return _io_meta(layout, input_meta, mine_in, mine_out)


def _run_zeros(
    module: nn.Module, shape_dtype: ShapeDtype, precision: Precision, device: torch.device
) -> ShapeDtype:
    """The shape and dtype of `module`'s output for a zero input of `shape_dtype`, run in
    eval mode (no BatchNorm statistic moves) under the run's precision."""
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad(), precision.autocast():
            output = module(torch.zeros(shape_dtype[0], dtype=shape_dtype[1], device=device))
    finally:
        module.train(was_training)
    return tuple(output.shape), output.dtype


def _io_meta(
    layout: PipelineLayout, input_meta: Tensor | None, mine_in: ShapeDtype, mine_out: ShapeDtype
) -> tuple[Tensor, Tensor]:
    """The (input, output) meta tensors `PipelineStage` is given, from their shapes and
    dtypes."""
    # requires_grad marks what carries a gradient back: every activation between stages,
    # not the images. The first stage keeps `input_meta` as given: its strides (the images'
    # memory format) are checked against the micro-batches by some torch releases.
    if layout.is_first:
        assert input_meta is not None
        stage_input = input_meta.detach()
    else:
        stage_input = torch.empty(mine_in[0], dtype=mine_in[1], device="meta").requires_grad_()
    return (
        stage_input,
        torch.empty(mine_out[0], dtype=mine_out[1], device="meta").requires_grad_(),
    )


def local_stage_io(
    model_cfg: ModelConfig,
    image_hw: tuple[int, int],
    plan: StagePlan,
    stage: nn.Module,
    layout: PipelineLayout,
    input_meta: Tensor,
    precision: Precision,
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """What `stage_io` returns on this rank, found without collectives: the units before
    this rank's stage (of a whole backbone, cast as `precision` casts the stages, by a
    Precision of the same level of its own) run the zero micro-batch `input_meta` in eval
    mode under the run's precision, as the earlier stages would, and their output goes
    through `stage` as in `stage_io`.

    The run planner's: the ranks that pass the shapes on are not there to ask. It builds
    the backbone before the stage on `device` and runs it, which costs nothing on fake
    tensors.
    """
    first, _ = plan.ranges[layout.stage]
    mine_in: ShapeDtype = (tuple(input_meta.shape), input_meta.dtype)
    if first > 0:
        with torch.device(device):
            before = backbone_from_config(model_cfg, image_hw)
        assert isinstance(before, UnitChain)
        before.keep_units(0, first)
        Precision(precision.level, precision.dtype, device).prepare(before)
        mine_in = _run_zeros(before, mine_in, precision, device)
    mine_out = _run_zeros(stage, mine_in, precision, device)
    return _io_meta(layout, input_meta, mine_in, mine_out)


class LabelsOnly(Dataset):
    """The labels of a training source, with an empty image: what the stages after the
    first load (the first stage reads the images; the last needs only the labels)."""

    def __init__(self, labels: Sequence[int]) -> None:
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key: tuple[int, int]) -> tuple[Tensor, int]:
        index, _ = key
        # An empty image of 3 dimensions: the batch is an empty 4-d tensor, which the loop
        # moves to the device in any memory format (channels-last needs 4 dimensions).
        return torch.zeros(0, 0, 0), int(self.labels[index])


# ---------------------------------------------------------------------- the whole backbone


def gather_backbone(
    stage_state: dict[str, Tensor],
    layout: PipelineLayout,
    model_cfg: ModelConfig,
    image_hw: tuple[int, int],
    device: torch.device,
) -> nn.Module | None:
    """The whole backbone (fp32) on rank 0, put together from the stages' state dicts of
    the first replica; None on every other rank. Collective over every rank (for evaluation
    and the export); `stage_state` is this rank's stage's state dict under its unsplit
    names."""
    state = None
    if layout.dp_rank == 0:
        state = {k: v.detach().cpu() for k, v in stage_state.items()}
    gathered: list[Any] = [None] * distributed.world_size() if distributed.rank() == 0 else None
    dist.gather_object(state, gathered, dst=0)
    if gathered is None:
        return None
    whole = backbone_from_config(model_cfg, image_hw)
    merged: dict[str, Tensor] = {}
    for part in gathered:
        if part is not None:
            merged.update(part)
    whole.load_state_dict(merged)
    return whole.float().to(device)


def wrap_stage(stage: nn.Module, layout: PipelineLayout, device: torch.device) -> nn.Module:
    """`stage` wrapped in DDP over its data-parallel group when there are several replicas."""
    if layout.dp_size == 1:
        return stage
    return DistributedDataParallel(
        stage,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=layout.dp_group,
    )


__all__: list[str] = [
    "LabelsOnly",
    "PipelineError",
    "PipelineLayout",
    "build_stage_backbone",
    "StagePlan",
    "gather_backbone",
    "local_stage_io",
    "make_layout",
    "plan_stages",
    "send_contiguous",
    "stage_io",
    "stage_plan",
    "unit_costs",
    "wrap_stage",
]
