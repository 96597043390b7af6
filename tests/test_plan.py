"""The run planner (recognition/training/plan/) against reality and against formulas.

Reality: the CPU allocator's peak of the same step on real tensors (torch.profiler's
memory events, `plan.check.measure_rank`), on one process and on two gloo ranks, for six
configurations (O0 and O2 bf16, chunked and unchunked head, 10k-100k classes,
accumulation 1 and 2, partial FC), and for two-stage pipelines on two gloo ranks (1F1B and
GPipe, O0 and O2 bf16, with the stage shapes the planner finds alone against those the
ranks pass each other); the plan must be within 5 % of it on every rank. As `--plan` and
`train.memory_check` plan (512-byte blocks, as the CUDA caching allocator): the allocator's
allocations each rounded up to 512 bytes, to 0.1 %, with partial FC's data-dependent sizes
live at the peak. Formulas: the persistent parts (parameters, class rows, fp32 masters,
optimizer state) in closed form, and the DDP buckets that replicated stages add. Then the
searches for the largest batch / class count against the measured peaks of real steps, the
command line, and the GPU pre-flight check with a stubbed GPU memory.
"""

from __future__ import annotations

import json
import math
import os
import random
import resource
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from recognition.config import load_config
from recognition.distributed import DistInfo
from recognition.models import backbone_from_config
from recognition.training.build import TrainingError
from recognition.training.plan import (
    RankPlan,
    check_memory,
    distinct_ranks,
    largest,
    plan_rank,
    with_batch,
)

TINY = [
    "model.width=0.125",
    "model.embedding_size=16",
    "data.image_size=32",
    "train.batch_size=8",
    "eval.targets=[]",
]

# (name, classes, overrides): every axis of the check appears on both world sizes.
ACCUMULATE_2 = "train.accumulate_steps=2"
O2 = "precision.level=O2"
CASES = [
    ("O0 whole shard", 10_000, []),
    ("O2 bf16 chunked, accumulate 2", 100_000, [O2, "head.chunk_size=4096", ACCUMULATE_2]),
    ("O0 chunked, accumulate 2", 100_000, ["head.chunk_size=2048", ACCUMULATE_2]),
    ("O2 bf16 whole shard", 50_000, [O2]),
    ("O0 partial FC 0.2", 100_000, ["head.sample_rate=0.2"]),
]  # fmt: skip
# The issue asks for 15 %; the plans are within 1 % here, and 5 % still catches a part
# left out (DDP's gradient buckets are ~13 % of the two-rank peaks below).
TOLERANCE = 0.05


def tiny(*extra: str):
    return load_config("default", [*TINY, *extra])


def assert_close(plan: RankPlan, measured: int, what: str) -> None:
    error = abs(plan.peak - measured) / measured
    assert error <= TOLERANCE, (
        f"{what}: planned {plan.peak / 2**20:.2f} MiB, measured {measured / 2**20:.2f} MiB "
        f"({100 * error:.1f} % off)"
    )


ONE_PROCESS = [CASES[i] for i in (0, 1, 2, 4)]
TWO_RANKS = [CASES[i] for i in (0, 2, 3)]


@pytest.mark.parametrize("name,classes,overrides", ONE_PROCESS, ids=[c[0] for c in ONE_PROCESS])
def test_plan_matches_the_allocator_on_one_process(name, classes, overrides):
    from recognition.training.plan.check import measure_rank

    cfg = tiny(*overrides)
    plan = plan_rank(cfg, classes, 1, 0, granularity=1)
    assert_close(plan, measure_rank(cfg, classes, DistInfo()), name)


# As `--plan` and `train.memory_check` plan: every allocation in 512-byte blocks
# (CUDA_BLOCK_BYTES). The plans match the allocator's blocks to the byte here; 0.1 % is well
# under what the rounding adds at these sizes (0.4 % to 1.5 %, checked below), so counting
# an allocation's bytes rounded down, or not rounded, fails.
BLOCKS = 512
BLOCKS_TOLERANCE = 0.001
# Partial FC keeping half of 100k classes: the optimizer steps the 50k sampled rows, which
# it copies out of the weight, its gradient and its momentum (sizes only the data decide,
# planned at their bound), and those copies are live at the step's peak (in the update).
SAMPLED_ROWS_AT_PEAK = ("O0 partial FC 0.5, peak in the update", 100_000, ["head.sample_rate=0.5"])
BLOCK_CASES = [CASES[0], SAMPLED_ROWS_AT_PEAK]


def measured_blocks(cfg, classes: int) -> int:
    """The CPU allocator's peak over a real step, each allocation in 512-byte blocks."""
    from recognition.training.plan.check import measure_rank

    return measure_rank(cfg, classes, DistInfo(), granularity=BLOCKS)


@pytest.mark.parametrize("name,classes,overrides", BLOCK_CASES, ids=[c[0] for c in BLOCK_CASES])
def test_plan_matches_the_allocators_blocks(name, classes, overrides):
    from recognition.tensor_memory import CUDA_BLOCK_BYTES

    assert CUDA_BLOCK_BYTES == BLOCKS
    cfg = tiny(*overrides)
    plan = plan_rank(cfg, classes, 1, 0)  # the default: --plan's and the memory check's
    measured = measured_blocks(cfg, classes)
    assert abs(plan.peak - measured) <= BLOCKS_TOLERANCE * measured, (
        f"{name}: planned {plan.peak:,} B, measured {measured:,} B in {BLOCKS}-byte blocks"
    )
    # The comparison can tell: the rounding is worth more than the tolerance here.
    in_bytes = plan_rank(cfg, classes, 1, 0, granularity=1, detailed=False).peak
    assert plan.peak - in_bytes > 3 * BLOCKS_TOLERANCE * measured, name
    if overrides == SAMPLED_ROWS_AT_PEAK[2]:
        assert plan.phase == "update"


def _on_two_ranks(rank: int, port: int, out: str, measure, cases: list) -> None:
    """A spawned rank of two over gloo: `measure(cases, info)`'s results, or the traceback
    of what failed, written to out/rank<rank>.json."""
    from tests.helpers import init_gloo_rank

    results: dict[str, object] = {}
    try:
        init_gloo_rank(rank, 2, port)
        results = measure(cases, DistInfo(rank=rank, world_size=2))
    except Exception:
        results = {"error": traceback.format_exc()}
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
        # As tests/test_head_distributed.py: gloo's teardown may abort; the file holds all.
        os._exit(0)


def _peaks(cases: list, info: DistInfo) -> dict[str, object]:
    from recognition.training.plan.check import measure_rank

    return {
        name: measure_rank(tiny(*overrides), classes, info) for name, classes, overrides in cases
    }


def test_plan_matches_the_allocator_on_two_ranks(tmp_path):
    from tests.helpers import free_port

    # Odd class counts: the ranks' shards differ by one row, so both are distinct plans.
    cases = [
        (name, classes + 1, overrides) for name, classes, overrides in CASES[0:4:2] + [CASES[3]]
    ]
    mp.spawn(_on_two_ranks, args=(free_port(), str(tmp_path), _peaks, cases), nprocs=2, join=True)
    for rank in range(2):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "error" not in measured, measured.get("error")
        for name, classes, overrides in cases:
            cfg = tiny(*overrides)
            assert distinct_ranks(cfg, 2, classes) == [0, 1]
            plan = plan_rank(cfg, classes, 2, rank, granularity=1)
            assert_close(plan, measured[name], f"{name}, rank {rank} of 2")


# ---------------------------------------------------------------------- pipelines

# Two stages on two ranks, 8 micro-batches of 2: GPipe holds the activations of all 8 on
# the first stage, 1F1B of at most 2 (a third of GPipe's peak there).
PIPELINE = ["model.pipeline_stages=2", "train.batch_size=16", "model.micro_batch_size=2"]
GPIPE = "model.pipeline_schedule=gpipe"
PIPELINE_CASES = [
    ("1F1B O0", 20_000, PIPELINE),
    ("GPipe O0", 20_000, [*PIPELINE, GPIPE]),
    ("GPipe O2 bf16", 20_000, [*PIPELINE, GPIPE, O2, "head.chunk_size=4096"]),
]


def _io_of_two_ranks(cfg, classes: int, info: DistInfo) -> dict[str, list]:
    """This rank's stage input and output as training learns them (`stage_io`, from the
    other rank) and as the planner finds them alone (`local_stage_io`)."""
    from recognition.pipeline import local_stage_io, make_layout, stage_plan
    from recognition.training.build import build_model

    layout = make_layout(2, info)
    parts = build_model(cfg, info, classes, layout, torch.preserve_format)
    micro = cfg.train.batch_size // cfg.micro_batches
    images = parts.precision.cast_inputs(torch.empty(micro, 3, *cfg.data.image_hw, device="meta"))
    plan = stage_plan(cfg.model, cfg.data.image_hw, 2)
    local = local_stage_io(
        cfg.model, cfg.data.image_hw, plan, parts.backbone, layout, images, parts.precision,
        torch.device("cpu"),
    )  # fmt: skip
    learned = (parts.step.input_meta, parts.step.output_meta)
    return {
        name: [[list(t.shape), str(t.dtype), t.requires_grad] for t in pair]
        for name, pair in (("learned", learned), ("local", local))
    }


def _pipeline_peaks_and_io(cases: list, info: DistInfo) -> dict[str, object]:
    from recognition.training.plan.check import measure_rank

    results: dict[str, object] = {}
    for name, classes, overrides in cases:
        cfg = tiny(*overrides)
        results[name] = {
            "peak": measure_rank(cfg, classes, info),
            **_io_of_two_ranks(cfg, classes, info),
        }
    # O3: half weights without autocast, where the cut's dtype comes from the weights.
    results["O3"] = _io_of_two_ranks(tiny(*PIPELINE, "precision.level=O3"), 1000, info)
    return results


def test_pipelined_plan_matches_the_allocator_on_two_ranks(tmp_path):
    """Each stage of a real two-stage pipeline over gloo (torch's schedules, point-to-point
    sends) against its plan, and the stage shapes the planner finds alone against those
    the ranks pass each other."""
    from tests.helpers import free_port

    cases = PIPELINE_CASES
    args = (free_port(), str(tmp_path), _pipeline_peaks_and_io, cases)
    mp.spawn(_on_two_ranks, args=args, nprocs=2, join=True)
    planned: dict[tuple[str, int], int] = {}
    for rank in range(2):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "error" not in measured, measured.get("error")
        for name, classes, overrides in cases:
            cfg = tiny(*overrides)
            assert measured[name]["local"] == measured[name]["learned"], (name, rank)
            plan = plan_rank(cfg, classes, 2, rank, granularity=1)
            assert plan.stage == rank and (plan.num_local_classes > 0) == (rank == 1)
            assert_close(plan, measured[name]["peak"], f"{name}, stage {rank} of 2")
            planned[name, rank] = plan.peak
    # The activation cut: stage 0 sends (2, 16, 8, 8) maps, in bf16 under O2 and O3.
    last = json.loads((tmp_path / "rank1.json").read_text())
    assert last["GPipe O2 bf16"]["learned"][0] == [[2, 16, 8, 8], "torch.bfloat16", True]
    for rank in range(2):
        o3 = json.loads((tmp_path / f"rank{rank}.json").read_text())["O3"]
        assert o3["local"] == o3["learned"] and o3["learned"][1][1] == "torch.bfloat16"
    # GPipe holds all 8 micro-batches' activations on the first stage, 1F1B at most 2.
    assert planned["GPipe O0", 0] > 2.5 * planned["1F1B O0", 0]


def test_stage_replicas_add_ddp_buckets():
    """Two replicas of each stage (W = 4, P = 2): the first stage's plan grows by DDP's
    gradient buckets, one copy of the stage's trainable parameters, and by nothing else."""
    from recognition.pipeline import stage_plan

    cfg = tiny(*PIPELINE, O2)
    alone, replicated = (plan_rank(cfg, 20_000, world, 0, granularity=1) for world in (2, 4))
    with torch.device("meta"):
        stage = backbone_from_config(cfg.model, cfg.data.image_hw)
    stage.keep_units(*stage_plan(cfg.model, cfg.data.image_hw, 2).ranges[0])
    half = [p for m in stage.modules() if not isinstance(m, nn.modules.batchnorm._BatchNorm)
            for p in m.parameters(recurse=False) if p.requires_grad]  # fmt: skip
    bn = [p for p in stage.parameters() if p.requires_grad and all(p is not h for h in half)]
    buckets = _bytes(half, torch.bfloat16) + _bytes(bn, torch.float32)  # O2: BatchNorm fp32
    assert buckets > 0
    assert replicated.peak - alone.peak == buckets
    assert replicated.parameters == alone.parameters


def test_plan_of_a_pipeline_prints_each_stage(capsys):
    """The command line on a pipelined config (4 GPUs: 2 stages x 2 replicas, an odd class
    count): a column per stage and one for the last rank's smaller shard; the verdict's
    batch is a multiple of the 4 micro-batches, fits on every rank, and the next does not."""
    import train

    overrides = [*TINY, "model.pipeline_stages=2", "head.chunk_size=4096", "train.batch_size=16"]
    args = ["--plan", "--gpus", "4", "--gpu-memory", "0.0075", "--classes", "20001", *overrides]
    assert train.main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "batch 16 per replica (2 stages, 4 micro-batches of 4, 1f1b)" in lines[0]
    assert lines[1].split() == ["rank", "0", "(stage", "0)", "rank", "1", "(stage", "1)",
                                "rank", "3", "(stage", "1)"]  # fmt: skip
    classes = next(line for line in lines if line.startswith("classes on the rank")).split()[-3:]
    assert classes == ["0", "10,001", "10,000"]
    verdict = lines[-1]
    assert verdict.startswith(("fits", "does NOT fit")), verdict
    batch = int(verdict.split("largest train.batch_size that fits: ")[1].split(";")[0])
    assert batch % 4 == 0 and batch >= 8
    cfg, limit = load_config("default", overrides), int(0.0075 * 2**30 * 0.9)
    for size, fits in ((batch, True), (batch + 4, False)):
        peaks = [plan_rank(with_batch(cfg, size), 20_001, 4, r, detailed=False).peak
                 for r in (0, 1, 3)]  # fmt: skip
        assert (max(peaks) <= limit) == fits, (size, peaks)


# ---------------------------------------------------------------------- formulas


def _bytes(tensors, dtype=None) -> int:
    return sum(t.numel() * (dtype.itemsize if dtype else t.element_size()) for t in tensors)


@pytest.mark.parametrize(
    "level,dtype,optimizer,world",
    [
        ("O0", "bf16", "sgd", 1),
        ("O2", "bf16", "sgd", 3),
        ("O1", "bf16", "adamw", 2),
        ("O3", "bf16", "sgd", 2),
        ("O2", "fp16", "sgd", 2),  # the sharded loss scaler, stepped as on a GPU
    ],
)
def test_persistent_memory_matches_the_closed_form(level, dtype, optimizer, world):
    classes, dim = 10_007, 16
    cfg = load_config("default", [*TINY, f"precision.level={level}", f"precision.dtype={dtype}",
                                  f"optim.name={optimizer}", "head.chunk_size=1024"])  # fmt: skip
    plan = plan_rank(cfg, classes, world, 0, granularity=1)

    with torch.device("meta"):
        backbone = backbone_from_config(cfg.model, cfg.data.image_hw)
    bn = [m for m in backbone.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    bn_params = [p for m in bn for p in m.parameters()]
    bn_ids = {id(p) for p in bn_params}
    other = [p for p in backbone.parameters() if id(p) not in bn_ids]
    buffers = list(backbone.buffers())
    floats = [b for b in buffers if b.is_floating_point()]
    counters = [b for b in buffers if not b.is_floating_point()]
    half, f32 = (torch.bfloat16 if dtype == "bf16" else torch.float16), torch.float32
    rows = math.ceil(classes / world)  # rank 0 holds the larger shard
    # The optimizer steps what trains (the embedding BatchNorm's frozen scale does not).
    trained = [p for p in backbone.parameters() if p.requires_grad]
    param_numel = sum(p.numel() for p in trained) + rows * dim

    if level in ("O0", "O1"):
        parameters = _bytes(backbone.parameters(), f32) + _bytes(floats, f32)
        class_rows, masters, stepped = rows * dim * 4, 0, param_numel * 4
    elif level == "O2":  # half weights, BatchNorm fp32; fp32 masters of the half ones
        parameters = _bytes(other, half) + _bytes(bn_params, f32) + _bytes(floats, f32)
        class_rows = rows * dim * 2
        masters = _bytes(other, f32) + rows * dim * 4
        stepped = param_numel * 4
    else:  # O3: everything half, the optimizer steps the half weights
        parameters = _bytes(backbone.parameters(), half) + _bytes(floats, half)
        class_rows, masters, stepped = rows * dim * 2, 0, param_numel * 2
    parameters += _bytes(counters)
    num_params = len(trained) + 1
    # SGD: a momentum buffer per parameter; AdamW: two moments and a float32 step count.
    state = stepped if optimizer == "sgd" else 2 * stepped + 4 * num_params

    assert plan.num_local_classes == rows
    assert plan.parameters == parameters
    assert plan.class_rows == class_rows
    assert plan.fp32_masters == masters
    assert plan.optimizer_state == state
    parts = plan.parameters + plan.class_rows + plan.fp32_masters + plan.optimizer_state
    assert parts + plan.gradients + plan.activations == plan.peak


def test_distinct_ranks():
    cfg = tiny()
    assert distinct_ranks(cfg, 8, 29_000_000) == [0]  # 3,625,000 each
    assert distinct_ranks(cfg, 8, 29_000_001) == [0, 7]
    piped = tiny("model.pipeline_stages=2", "model.micro_batch_size=4")
    assert distinct_ranks(piped, 4, 1001) == [0, 1, 3]


# ---------------------------------------------------------------------- the searches


def test_largest_matches_brute_force():
    rng = random.Random(0)
    for _ in range(400):
        base, slope = rng.randint(0, 500), rng.randint(1, 40)
        extra, knee = rng.randint(0, 30), rng.randint(1, 400)

        def peak(x: int, base=base, slope=slope, extra=extra, knee=knee) -> int:
            return base + slope * x + (extra * (x - knee) if x > knee else 0)

        limit = rng.randint(0, 30_000)
        truth = max((x for x in range(1, 40_000) if peak(x) <= limit), default=0)
        tolerance = rng.choice([0.0, 0.01])
        got = largest(peak, rng.randint(1, 600), limit, tolerance=tolerance)
        if tolerance == 0.0:
            assert got == truth
        else:
            assert got <= truth and truth - got <= max(1, math.floor(0.01 * truth)) + 1


def brute_force_batch(measured: dict[int, int], limit: int) -> int:
    """The largest batch whose measured peak fits `limit` (0: none), from the peaks of every
    batch from 2 up (a batch of 1 never trains: BatchNorm), of which the largest does not."""
    assert measured[max(measured)] > limit, "measure larger batches"
    return max((batch for batch, peak in measured.items() if peak <= limit), default=0)


def test_largest_batch_is_the_boundary_of_measured_steps():
    """`largest_batch` (what --plan and the memory check answer) against a brute force over
    real steps: the allocator's peak, in 512-byte blocks, of a step at every batch size.
    Limits just above and just below one batch's measured peak (by the tolerance the plans
    are held to): that batch fits, then it does not."""
    from recognition.training.plan import largest_batch, plan_run

    cfg, classes = tiny("head.chunk_size=4096"), 20_000
    measured = {batch: measured_blocks(with_batch(cfg, batch), classes) for batch in range(2, 8)}
    plan = plan_run(cfg, classes, 1)
    for limit in (measured[5] * (1 + BLOCKS_TOLERANCE), measured[5] * (1 - BLOCKS_TOLERANCE)):
        limit = int(limit)
        assert largest_batch(cfg, plan, limit) == brute_force_batch(measured, limit), limit


def test_largest_class_count_is_the_boundary_of_measured_steps():
    """`largest_classes` (to 1 %, as --plan prints it) against real steps: its class count's
    measured peak fits, and that of the count 1 % above it (where the search's bracket
    ends) does not."""
    from recognition.training.plan import largest_classes, plan_run

    cfg = tiny("head.chunk_size=4096")
    plan = plan_run(cfg, 20_000, 1)
    limit = measured_blocks(cfg, 30_000)
    found = largest_classes(cfg, plan, limit)
    assert measured_blocks(cfg, found) <= limit
    assert measured_blocks(cfg, found * 100 // 99) > limit, found


def test_largest_batch_is_the_boundary(capsys, tmp_path):
    """The command line's answer: its batch's real step fits and one more's does not
    (measured, in 512-byte blocks); it writes nothing, generates no data and creates no
    run directory."""
    import train

    out, synthetic = tmp_path / "run", tmp_path / "synthetic"
    args = ["--plan", "--gpus", "1", "--gpu-memory", "0.02", *TINY, "head.chunk_size=4096"]
    args += [f"output_dir={out}", f"data.synthetic.root={synthetic}"]
    args += [f"data.root={synthetic / 'train'}"]
    assert train.main(args) == 0
    text = capsys.readouterr().out
    assert "class rows" in text and "step time >= (H100 SXM)" in text
    assert text.startswith("plan: default, 1 GPU, ")  # not "1 GPUs"
    verdict = text.strip().splitlines()[-1]
    assert verdict.startswith(("fits", "does NOT fit")), verdict
    batch = int(verdict.split("largest train.batch_size that fits: ")[1].split(";")[0])
    assert not out.exists() and not synthetic.exists()

    cfg = tiny("head.chunk_size=4096")
    classes = cfg.data.synthetic.num_identities  # not generated: the spec's count
    limit = int(0.02 * 2**30 * 0.9)
    assert measured_blocks(with_batch(cfg, batch), classes) <= limit
    assert measured_blocks(with_batch(cfg, batch + 1), classes) > limit


def test_plan_without_the_data_names_the_option(capsys, tmp_path):
    import train

    args = ["--plan", f"data.root={tmp_path / 'absent'}", "data.synthetic.enabled=false"]
    assert train.main(args) == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and "--classes" in err and "Traceback" not in err


def test_a_large_plan_takes_no_memory_of_its_size():
    """4M classes x 256 (4 GiB of fp32 rows, as much momentum): the process grows by far
    less, so nothing of the plan's size was allocated (a fallback to real kernels would)."""
    cfg = tiny("model.embedding_size=256", "head.chunk_size=65536")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    plan = plan_rank(cfg, 4_000_000, 1, 0, detailed=False)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert plan.peak > 8 * 2**30
    assert grown < 2**30


# ---------------------------------------------------------------------- before a GPU run


def test_memory_check_refuses_what_does_not_fit_and_names_the_batch(tmp_path):
    import torch.distributed as dist

    cfg = tiny("head.chunk_size=4096")
    plan = plan_rank(cfg, 20_000, 1, 0, detailed=False)
    check_memory(cfg, DistInfo(), 20_000, device_memory=4 * plan.peak)  # fits: no error
    # Under a running process group (as in a torchrun job) the plan runs in a child process.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with pytest.raises(TrainingError) as info:
            check_memory(cfg, DistInfo(), 20_000, device_memory=plan.peak)  # 10 % kept free
    finally:
        dist.destroy_process_group()
    message = str(info.value)
    assert "planned peak" in message and "train.memory_check=false" in message
    batch = int(message.split("largest train.batch_size that fits is ")[1].split(" ")[0])
    assert 1 <= batch < cfg.train.batch_size
    # The boundary of real steps (the allocator's peak in 512-byte blocks), not the plan's.
    limit = int(plan.peak * 0.9)
    assert measured_blocks(with_batch(cfg, batch), 20_000) <= limit
    assert measured_blocks(with_batch(cfg, batch + 1), 20_000) > limit


def test_cpu_runs_skip_the_memory_check(tmp_path, monkeypatch):
    from recognition.training import plan as plan_module
    from recognition.training.loop import build_run as build
    from tests.helpers import make_image_folder, tiny_config

    def refuse(*args, **kwargs):
        raise AssertionError("the memory check ran on a CPU run")

    monkeypatch.setattr(plan_module, "check_memory", refuse)
    cfg = tiny_config(make_image_folder(tmp_path / "data"), tmp_path / "run")
    assert cfg.train.memory_check
    run = build(cfg, DistInfo(), resuming=False)
    assert run.head is not None


def test_memory_check_skips_what_it_cannot_plan(caplog, monkeypatch):
    # A GPU run the planner refuses trains unchecked, with a warning: the check must not
    # stop a run it cannot judge.
    from recognition.training.plan import PlanError, memory_check

    def refuse(*args, **kwargs):
        raise PlanError("not plannable")

    monkeypatch.setattr(memory_check, "plan_run", refuse)
    cfg = tiny("head.chunk_size=4096")
    with caplog.at_level("WARNING"):
        check_memory(cfg, DistInfo(), 20_000, device_memory=1)  # would not fit anything
    assert "memory check skipped: the run cannot be planned" in caplog.text


def test_memory_check_plans_a_pipeline():
    # 1F1B with micro-batches of 4 on 2 stages: the smallest batch that runs is 8, which
    # the search for a batch that fits plans (a batch of 4 would stop the schedule).
    cfg = tiny("head.chunk_size=4096", "model.pipeline_stages=2", "model.micro_batch_size=4")
    with pytest.raises(TrainingError) as info:
        check_memory(cfg, DistInfo(rank=0, world_size=2), 20_000, device_memory=1)
    assert "the largest train.batch_size that fits is none" in str(info.value)


def test_a_plan_logs_no_kernel_choice(caplog):
    # The plan steps the head on fake CPU tensors: with head.kernel=auto the head would log
    # "auto: torch (... this forward is on cpu)" into a GPU run's log, before the run's own
    # choice (the GPU check read that line as the run's). The plan takes torch silently.
    cfg = tiny("head.chunk_size=4096")
    assert cfg.head.kernel == "auto"
    with caplog.at_level("INFO"):
        plan = plan_rank(cfg, 20_000, 1, 0, detailed=False)
    assert plan.peak > 0
    assert "head.kernel" not in caplog.text
