"""The pipelined backbone (model.pipeline_stages > 1): units and stages, the balanced cut,
and one pipelined step against the unpipelined model on the same micro-batches.

Exactness. One step of P stages x D data-parallel replicas, with m micro-batches per
replica's batch and the head sharded over the last stage's D ranks, must give the loss,
the backbone gradients (by their unsplit names) and the class-matrix gradient of the
whole backbone run in one process on the same micro-batches with gradient accumulation:
micro-batch i of the step is the concatenation of every replica's micro-batch i, each
replica's part through the backbone on its own (BatchNorm sees one replica's micro-batch,
as on the replica's rank), the head unsharded. Float64, 1e-10 relative.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import free_port
from torch.utils.flop_counter import FlopCounterMode

from recognition.config import ConfigError, HeadConfig, ModelConfig, OptimConfig, load_config
from recognition.distributed import DistInfo
from recognition.heads import ShardedMarginSoftmax, build_head
from recognition.heads.margins import build_margin
from recognition.models import backbone_from_config
from recognition.optim import OptimizerState, build_optimizer, param_groups
from recognition.pipeline import (
    PipelineError,
    build_stage_backbone,
    make_layout,
    plan_stages,
    stage_io,
    unit_costs,
    wrap_stage,
)
from recognition.precision import Precision
from recognition.training.pipeline_step import PipelineStep

IMAGE_HW = (16, 16)
SEED = 5
NUM_CLASSES = 11
EMBEDDING = 16
BATCH = 8  # per replica
RTOL = 1e-10


def tiny_model(stages: int = 1, backbone: str = "iresnet18", **extra) -> ModelConfig:
    return ModelConfig(
        backbone=backbone, width=0.125, embedding_size=EMBEDDING, pipeline_stages=stages, **extra
    )


# ---- units and stages --------------------------------------------------------------------


def test_the_unit_chain_is_the_backbone():
    torch.manual_seed(0)
    model = backbone_from_config(tiny_model(), IMAGE_HW).double().train()
    x = torch.randn(4, 3, *IMAGE_HW, dtype=torch.float64)
    # Independent of forward_unit: the layers in their published order.
    reference = model.features(
        model.fc(model.dropout(torch.flatten(model.bn2(model.forward_features(x)), 1)))
    )
    torch.testing.assert_close(model(x), reference, rtol=0, atol=0)
    assert model.units()[0] == "stem" and model.units()[-1] == "embedding"
    assert len(model.units()) == 2 + 8  # iresnet18: 2 + 2 + 2 + 2 blocks

    reid = backbone_from_config(
        ModelConfig(backbone="resnet50_reid", embedding_size=EMBEDDING, width=1.0), (32, 16)
    ).eval()
    x = torch.randn(2, 3, 32, 16)
    pooled = reid.forward_features(x).mean(dim=(2, 3))
    torch.testing.assert_close(reid(x), reid.fc(reid.bnneck(pooled)), rtol=0, atol=0)
    assert len(reid.units()) == 2 + 16


@pytest.mark.parametrize("backbone", ["iresnet18", "resnet50_reid"])
def test_stages_keep_their_names_and_compose_to_the_backbone(backbone):
    cfg = (
        tiny_model(3, backbone)
        if backbone == "iresnet18"
        else ModelConfig(backbone=backbone, embedding_size=EMBEDDING, width=1.0, pipeline_stages=3)
    )
    hw = IMAGE_HW if backbone == "iresnet18" else (32, 16)
    torch.manual_seed(SEED)
    whole = backbone_from_config(cfg, hw).eval()
    stages = []
    for stage_index in range(3):
        layout = _layout(3, stage_index)
        stage, plan = build_stage_backbone(cfg, hw, layout, SEED)
        ranges = plan.ranges
        stages.append(stage.eval())
    # Every parameter and buffer in exactly one stage, under its name in the whole model.
    names = [set(stage.state_dict()) for stage in stages]
    assert set.union(*names) == set(whole.state_dict())
    assert sum(len(n) for n in names) == len(whole.state_dict())
    whole_state = whole.state_dict()
    for stage in stages:
        for name, value in stage.state_dict().items():
            assert torch.equal(value, whole_state[name]), name  # drawn from the same seed
    x = torch.randn(2, 3, *hw)
    y = x
    for stage in stages:
        y = stage(y)
    torch.testing.assert_close(y, whole(x), rtol=0, atol=0)
    assert [r[0] for r in ranges] == sorted(r[0] for r in ranges) and ranges[0][0] == 0


def _layout(num_stages: int, stage: int):
    from recognition.pipeline import PipelineLayout

    return PipelineLayout(
        num_stages=num_stages, stage=stage, dp_size=1, dp_rank=0, pp_group=None, dp_group=None
    )


def test_unit_costs_add_up_to_the_backbone_flops():
    units, costs = unit_costs(tiny_model(), IMAGE_HW)
    model = backbone_from_config(tiny_model(), IMAGE_HW).eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.zeros(1, 3, *IMAGE_HW))
    assert sum(costs) == counter.get_total_flops() > 0
    assert len(units) == len(costs) and all(c >= 0 for c in costs)


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_balanced_cut_is_the_best_contiguous_cut(num_stages):
    generator = torch.Generator().manual_seed(num_stages)
    costs = (torch.rand(9, generator=generator) * 100).round().tolist()
    units = [f"u{i}" for i in range(9)]
    ranges = plan_stages(units, costs, num_stages)
    assert ranges[0][0] == 0 and ranges[-1][1] == 9
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    got = max(sum(costs[a:b]) for a, b in ranges)
    # Brute force over every set of cut positions.
    best = min(
        max(sum(costs[a:b]) for a, b in itertools.pairwise((0, *cuts, 9)))
        for cuts in itertools.combinations(range(1, 9), num_stages - 1)
    )
    assert got == best


def test_explicit_split_and_its_errors():
    units = ["stem", "layer1.0", "layer2.0", "layer3.0", "embedding"]
    costs = [1] * 5
    assert plan_stages(units, costs, 3, ["layer2.0", "layer3.0"]) == [(0, 2), (2, 3), (3, 5)]
    with pytest.raises(PipelineError, match="model.pipeline_split: 'layer9.0' is not a unit"):
        plan_stages(units, costs, 2, ["layer9.0"])
    with pytest.raises(PipelineError, match="forward order"):
        plan_stages(units, costs, 3, ["layer3.0", "layer2.0"])
    with pytest.raises(PipelineError, match="forward order"):
        plan_stages(units, costs, 2, ["stem"])
    with pytest.raises(PipelineError, match="only 5 units"):
        plan_stages(units, costs, 6)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.micro_batch_size=3"], "model.micro_batch_size=3 does not divide train.batch_size"),
        (["train.batch_size=6"], "model.micro_batch_size: null splits train.batch_size=6"),
        (
            ["model.micro_batch_size=128"],
            "model.pipeline_schedule=1f1b needs at least model.pipeline_stages=2",
        ),
        (["train.accumulate_steps=2"], "train.accumulate_steps=2"),
        (["train.compile=true"], "train.compile=true"),
        (["model.pipeline_split=[layer2.0,layer3.0]"], "model.pipeline_split: 2 names for 2"),
    ],
)
def test_pipeline_config_errors_name_the_keys(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_config("default", ["model.pipeline_stages=2", *overrides])


def test_pipeline_config_defaults():
    cfg = load_config("default", ["model.pipeline_stages=2"])
    assert cfg.micro_batches == 4  # 2 x stages
    cfg = load_config("default", ["model.pipeline_stages=2", "model.micro_batch_size=16"])
    assert cfg.micro_batches == 8
    assert load_config("default").micro_batches == 1


def test_a_stage_optimizer_state_loads_across_layouts():
    """State saved by the whole model's optimizer loads into two stage optimizers by the
    whole model's parameter indices, and what those save loads back into the whole one."""
    torch.manual_seed(0)
    whole = backbone_from_config(tiny_model(), IMAGE_HW)
    optimizer = build_optimizer(param_groups([whole], 5e-4), OptimConfig(lr=0.1))
    for param in whole.parameters():
        param.grad = torch.randn_like(param)
    optimizer.step()
    saved = OptimizerState(optimizer).state_dict()
    names = [n for n, p in whole.named_parameters() if p.requires_grad]
    decay = [n for n in names if dict(whole.named_parameters())[n].ndim > 1]
    order = {n: i for i, n in enumerate(decay + [n for n in names if n not in decay])}
    rebuilt = {}
    for stage_index in range(2):
        stage, _ = build_stage_backbone(tiny_model(2), IMAGE_HW, _layout(2, stage_index), SEED)
        stage_opt = build_optimizer(param_groups([stage], 5e-4), OptimConfig(lr=0.1))
        stage_names = [n for g in param_groups_named(stage) for n in g]
        ids = [order[n] for n in stage_names]
        part = OptimizerState(stage_opt, ids)
        part.load_state_dict(
            {"state": {i: saved["state"][i] for i in ids}, "param_groups": saved["param_groups"]}
        )
        params = [p for g in stage_opt.param_groups for p in g["params"]]
        for name, param in zip(stage_names, params, strict=True):
            want = saved["state"][order[name]]["momentum_buffer"]
            assert torch.equal(stage_opt.state[param]["momentum_buffer"], want), name
        rebuilt.update(part.state_dict()["state"])
    fresh = build_optimizer(param_groups([whole], 5e-4), OptimConfig(lr=0.1))
    OptimizerState(fresh).load_state_dict({"state": rebuilt, "param_groups": saved["param_groups"]})
    for index, param in enumerate(p for g in fresh.param_groups for p in g["params"]):
        assert torch.equal(
            fresh.state[param]["momentum_buffer"], saved["state"][index]["momentum_buffer"]
        )


def param_groups_named(module):
    decay, no_decay = [], []
    for name, param in module.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim <= 1 else decay).append(name)
    return [decay, no_decay]


def test_accumulating_updates_the_rows_of_every_forward_before_any_backward():
    """GPipe order (F0 F1 B0 B1): partial FC must update the rows sampled by both."""
    torch.manual_seed(3)
    head = ShardedMarginSoftmax(60, 8, build_margin("cosface"), sample_rate=0.1).double()
    optimizer = torch.optim.SGD(head.parameters(), lr=0.5, momentum=0.9)
    head.attach_optimizer(optimizer)
    before = head.weight.detach().clone()
    sampled = torch.zeros(60, dtype=torch.bool)
    with head.accumulating():
        losses = []
        for micro in range(2):
            embeddings = torch.randn(3, 8, dtype=torch.float64)
            labels = torch.tensor([micro, 10 + micro, 20 + micro])
            losses.append(head(embeddings, labels))
            sampled[head.sampled_index] = True
        for loss in losses:
            loss.backward()
    optimizer.step()
    moved = (head.weight.detach() != before).any(dim=1)
    assert torch.equal(moved, sampled)
    assert 6 <= int(sampled.sum()) < 60


# ---- one pipelined step against the unpipelined model (spawned gloo ranks) -------------


def replica_batch(replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + replica)
    images = torch.randn(BATCH, 3, *IMAGE_HW, dtype=torch.float64, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (BATCH,), generator=generator)
    labels[0] = labels[1]  # a duplicate label within a micro-batch
    return images, labels


def pipelined_grads(case: dict, rank: int, world: int) -> dict:
    """One pipelined step; this rank's loss, grad norm and gradients by name."""
    num_stages, micro = case["stages"], case["micro"]
    cfg = tiny_model(num_stages)
    layout = make_layout(num_stages, DistInfo(rank=rank, world_size=world))
    stage, _ = build_stage_backbone(cfg, IMAGE_HW, layout, SEED)
    stage = stage.double()
    head = None
    if layout.is_last:
        head_cfg = HeadConfig(margin=case["margin"], scale=16.0, m=None)
        head = build_head(
            head_cfg, NUM_CLASSES, EMBEDDING, seed=SEED, group=layout.dp_group
        ).double()
    precision = Precision("O0", "bf16", torch.device("cpu"))
    precision.prepare(*([stage] if head is None else [stage, head]))
    model = wrap_stage(stage, layout, torch.device("cpu"))
    images = torch.empty(micro, 3, *IMAGE_HW, dtype=torch.float64, device="meta")
    input_meta, output_meta = stage_io(stage, layout, images, precision, torch.device("cpu"))
    step = PipelineStep(
        model,
        layout,
        head,
        num_micro=BATCH // micro,
        schedule=case["schedule"],
        input_meta=input_meta,
        output_meta=output_meta,
        precision=precision,
        device=torch.device("cpu"),
    )
    parts = [stage] if head is None else [stage, head]
    # lr 0: the step leaves the weights and the gradients in place to be compared.
    optimizer = torch.optim.SGD(param_groups(parts, 0.0), lr=0.0)
    result = step(model, head, [replica_batch(layout.dp_rank)], optimizer, precision, None)
    grads = {f"backbone/{n}": p.grad for n, p in stage.named_parameters() if p.grad is not None}
    if head is not None:
        grads[f"head/{head.class_start}"] = head.weight.grad
    return {"loss": float(result.loss), "grad_norm": float(result.grad_norm), "grads": grads}


def reference_grads(case: dict, num_replicas: int, single: dist.ProcessGroup) -> dict:
    micro = case["micro"]
    cfg = tiny_model()
    torch.manual_seed(SEED)
    whole = backbone_from_config(cfg, IMAGE_HW).double()
    head = build_head(
        HeadConfig(margin=case["margin"], scale=16.0, m=None),
        NUM_CLASSES,
        EMBEDDING,
        seed=SEED,
        group=single,
    ).double()
    batches = [replica_batch(r) for r in range(num_replicas)]
    num_micro = BATCH // micro
    losses = []
    for i in range(num_micro):
        part = slice(i * micro, (i + 1) * micro)
        embeddings = torch.cat([whole(images[part]) for images, _ in batches])
        labels = torch.cat([labels[part] for _, labels in batches])
        loss = head(embeddings, labels)
        (loss / num_micro).backward()
        losses.append(float(loss.detach()))
    grads = {f"backbone/{n}": p.grad for n, p in whole.named_parameters() if p.grad is not None}
    grads["head"] = head.weight.grad
    norm = torch.sqrt(sum(g.double().square().sum() for g in grads.values()))
    return {"loss": sum(losses) / num_micro, "grad_norm": float(norm), "grads": grads}


def _rank_main(rank: int, world: int, port: int, cases: list[dict], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    singles = [dist.new_group([r]) for r in range(world)]
    report = {}
    for case in cases:
        mine = pipelined_grads(case, rank, world)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if rank != 0:
            continue
        ref = reference_grads(case, world // case["stages"], singles[0])
        # A gradient that is zero in exact arithmetic (the shift of a BatchNorm whose output
        # only feeds another BatchNorm) is rounding noise on both sides: errors are relative
        # to the tensor's largest element or to 1e-6 of the largest gradient anywhere.
        floor = 1e-6 * max(float(g.abs().max()) for g in ref["grads"].values())
        errors = {}
        head_rows: dict[int, list] = {}
        seen = set()
        for replica_rank, got in enumerate(gathered):
            errors[f"loss/{replica_rank}"] = abs(got["loss"] - ref["loss"]) / abs(ref["loss"])
            errors[f"norm/{replica_rank}"] = (
                abs(got["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"]
            )
            for name, grad in got["grads"].items():
                if name.startswith("head/"):
                    head_rows.setdefault(int(name[5:]), []).append(grad)
                    continue
                seen.add(name)
                want = ref["grads"][name]
                errors[f"{name}/{replica_rank}"] = float(
                    (grad - want).abs().max() / want.abs().max().clamp_min(floor)
                )
        head = torch.cat([head_rows[start][0] for start in sorted(head_rows)])
        errors["head"] = float(
            (head - ref["grads"]["head"]).abs().max() / ref["grads"]["head"].abs().max()
        )
        missing = sorted(set(ref["grads"]) - seen - {"head"})
        report[case["name"]] = {
            "max_error": max(errors.values()),
            "worst": max(errors, key=errors.get),
            "missing": missing,
            "head_shards": len(head_rows),
            "loss": ref["loss"],
        }
    if rank == 0:
        Path(out, f"world{world}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


CASES = {
    2: [
        {"name": "P2 gpipe", "stages": 2, "micro": 2, "schedule": "gpipe", "margin": "arcface"},
        {"name": "P2 1f1b", "stages": 2, "micro": 2, "schedule": "1f1b", "margin": "cosface"},
    ],
    3: [
        {"name": "P3 gpipe", "stages": 3, "micro": 4, "schedule": "gpipe", "margin": "arcface"},
        {"name": "P3 1f1b", "stages": 3, "micro": 2, "schedule": "1f1b", "margin": "combined"},
    ],
    4: [
        # AdaFace: the statistics of the norms move with each micro-batch's forward (GPipe runs
        # them all before any backward), over both replicas' embeddings (the head's group).
        {"name": "P2xDP2 gpipe", "stages": 2, "micro": 2, "schedule": "gpipe", "margin": "adaface"},
        {"name": "P2xDP2 1f1b", "stages": 2, "micro": 4, "schedule": "1f1b", "margin": "cosface"},
    ],
}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_pipelined_step_equals_the_unpipelined_model_with_accumulation(world, tmp_path):
    mp.spawn(_rank_main, args=(world, free_port(), CASES[world], str(tmp_path)), nprocs=world)
    report = json.loads((tmp_path / f"world{world}.json").read_text())
    assert sorted(report) == sorted(c["name"] for c in CASES[world])
    for name, result in report.items():
        assert result["missing"] == [], name
        assert result["max_error"] < RTOL, (name, result["worst"], result["max_error"])
        stages = next(c["stages"] for c in CASES[world] if c["name"] == name)
        assert result["head_shards"] == world // stages, name
        assert result["loss"] > 0
