"""Fine-tuning (docs/finetune.md): train.init_backbone, head.init=centroids,
optim.backbone_lr_scale, model.freeze_bn, train.head_only_steps, on the tiny image folder."""

from __future__ import annotations

import copy as copy_module
import dataclasses
import json
import math
from pathlib import Path

import helpers
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from recognition import checkpoint as ckpt
from recognition.config import ConfigError, load_config
from recognition.data.build import build_train_dataset
from recognition.distributed import DistInfo
from recognition.heads import build_head
from recognition.models import backbone_from_config
from recognition.optim import build_optimizer, build_scheduler, param_groups
from recognition.training import train
from recognition.training.finetune.centroids import init_centroids
from recognition.training.finetune.freeze import freeze_batch_norm
from recognition.training.finetune.init_backbone import check_init_backbone, load_init_backbone

DROPPED = 4  # a class whose images the centroid test hides: its row must stay random


def tiny_config(image_folder: Path, out: Path, *extra: str):
    return helpers.tiny_config(image_folder, out, "train.epochs=2", *extra)


def export(path: Path, image_folder: Path, *extra: str, image_size: int = 32) -> Path:
    """A backbone export of the tiny config's backbone (`extra` changes it), random weights
    (seeded) with BatchNorm statistics that are not the fresh ones."""
    cfg = tiny_config(image_folder, path.parent / "unused", *extra)
    torch.manual_seed(7)
    backbone = backbone_from_config(cfg.model, (image_size, image_size))
    for name, buffer in backbone.named_buffers():
        if name.endswith("running_var"):
            buffer.uniform_(0.5, 2.0)
        elif name.endswith("running_mean"):
            buffer.normal_(0.0, 0.1)
    ckpt.export_backbone(path, backbone, dataclasses.asdict(cfg.model), image_size)
    return path


@pytest.fixture(scope="module")
def pretrained(image_folder, tmp_path_factory) -> Path:
    return export(tmp_path_factory.mktemp("pretrained") / "backbone.pt", image_folder)


def losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def weights(path: Path) -> dict[str, torch.Tensor]:
    return ckpt.load_backbone_file(path)[2]


def is_batch_norm(state: dict[str, torch.Tensor], key: str) -> bool:
    # The tiny IResNet's BatchNorm layers: bn*, the stem's bn1, downsample.1, features.
    module = key.rsplit(".", 1)[0]
    return f"{module}.running_var" in state


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "change, message",
    [
        ("missing", "lacks 'layer1.0.bn1.weight'"),
        ("extra", "holds 'stray.weight', which the run's backbone does not have"),
        ("width", "has shape"),
        ("embedding", "makes 32-d embeddings, the config asks for model.embedding_size=16"),
        ("image size", "trained on 48x48 images, the config has data.image_size=32"),
    ],
)
def test_a_backbone_that_does_not_fit_is_refused_in_one_line(
    image_folder, pretrained, tmp_path, change, message
):
    path = tmp_path / "other.pt"
    if change in ("missing", "extra"):
        data = torch.load(pretrained, weights_only=True)
        if change == "missing":
            del data["state_dict"]["layer1.0.bn1.weight"]
        else:
            data["state_dict"]["stray.weight"] = torch.zeros(3)
        torch.save(data, path)
    elif change == "width":
        export(path, image_folder, "model.width=0.25")
    elif change == "embedding":
        export(path, image_folder, "model.embedding_size=32")
    else:
        export(path, image_folder, image_size=48)
    cfg = tiny_config(image_folder, tmp_path / "run", f"train.init_backbone={path}")
    with pytest.raises(ConfigError) as caught:
        check_init_backbone(path, cfg)
    text = str(caught.value)
    assert message in text and str(path) in text and "\n" not in text
    # The run stops the same way before writing anything.
    with pytest.raises(ConfigError, match="train.init_backbone"):
        train(cfg)
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_config_refuses_centroids_without_a_backbone_file(image_folder, tmp_path):
    with pytest.raises(ConfigError, match="head.init=centroids.*train.init_backbone"):
        tiny_config(image_folder, tmp_path, "head.init=centroids")
    with pytest.raises(ConfigError, match="train.init_backbone: .*no such file"):
        check_init_backbone(tmp_path / "absent.pt", tiny_config(image_folder, tmp_path))


# ---------------------------------------------------------------------- backbone_lr_scale


@pytest.mark.parametrize("scale", [0.25, 0.0])
def test_backbone_lr_scale_gives_the_groups_their_rates(scale):
    backbone = nn.Sequential(nn.Linear(4, 4), nn.PReLU(4))
    head = nn.Linear(4, 3, bias=False)
    cfg = load_config("default", [f"optim.backbone_lr_scale={scale}", "optim.lr=0.2"]).optim
    groups = param_groups([backbone, head], 5e-4, [cfg.backbone_lr_scale, 1.0])
    optimizer = build_optimizer(groups, cfg)
    scheduler = build_scheduler(optimizer, total_steps=10, warmup_steps=0, cfg=cfg)
    lr_of = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
    assert lr_of[id(head.weight)] == pytest.approx(0.2)
    for p in backbone.parameters():
        assert lr_of[id(p)] == pytest.approx(0.2 * scale)
    before = [p.detach().clone() for p in backbone.parameters()]
    x = torch.randn(8, 4)
    for _ in range(3):
        optimizer.zero_grad()
        head(backbone(x)).square().mean().backward()
        optimizer.step()
        scheduler.step()
    # The schedule (cosine) scales every group alike: the ratio holds after it moved.
    rates = {group["lr"] for group in optimizer.param_groups}
    head_lr = max(rates)
    assert head_lr < 0.2 and all(r == pytest.approx(head_lr * scale) or r == head_lr for r in rates)
    moved = [not torch.equal(a, p) for a, p in zip(before, backbone.parameters(), strict=True)]
    assert all(moved) if scale > 0 else not any(moved)


# ---------------------------------------------------------------------- head.init=centroids


class WithoutClass(torch.utils.data.Dataset):
    """`source` without the images of class `dropped` (its label stays, with no image)."""

    def __init__(self, source, dropped: int) -> None:
        self.source = source
        self.keep = np.flatnonzero(np.asarray(source.labels) != dropped)
        self.labels = np.asarray(source.labels)[self.keep]

    def __len__(self) -> int:
        return len(self.keep)

    def __getitem__(self, index: int):
        return self.source[int(self.keep[index])]


def reference_centroids(cfg, source) -> tuple[dict[int, torch.Tensor], dict[str, float]]:
    """Per class: the normalised mean of its images' normalised float64 embeddings, one
    image at a time (a plain loop, in float64); and the pair statistics of those embeddings
    (`helpers.plain_pair_statistics`)."""
    backbone = backbone_from_config(cfg.model, cfg.data.image_hw)
    load_init_backbone(backbone, cfg)
    backbone = backbone.double().eval()
    sums: dict[int, torch.Tensor] = {}
    embeddings, labels = [], []
    with torch.no_grad():
        for index in range(len(source)):
            image, label = source[index]
            embedding = backbone(image[None].double())[0]
            sums[label] = sums.get(label, 0) + embedding / embedding.norm()
            embeddings.append(embedding.numpy())
            labels.append(label)
    pairs = helpers.plain_pair_statistics(np.stack(embeddings), labels)
    return {label: total / total.norm() for label, total in sums.items()}, pairs


def _centroid_rank(rank: int, world_size: int, port: int, cfg, reference_path: str) -> None:
    if world_size > 1:
        helpers.init_gloo_rank(rank, world_size, port)
    try:
        check_centroids(rank, world_size, cfg, reference_path)
    finally:
        if world_size > 1:
            torch.distributed.destroy_process_group()


def check_centroids(rank: int, world_size: int, cfg, reference_path: str) -> None:
    """This rank's rows after `init_centroids` against the reference (and the dropped
    class's row against its random one)."""
    source = WithoutClass(build_train_dataset(cfg.data), DROPPED)
    backbone = backbone_from_config(cfg.model, cfg.data.image_hw)
    load_init_backbone(backbone, cfg)
    head = build_head(cfg.head, 12, cfg.model.embedding_size, seed=cfg.seed, device="cpu")
    random_rows = head.weight.detach().clone()
    # Batches of 5: classes of 6 images straddle batches.
    info = DistInfo(rank, rank, world_size, torch.device("cpu"))
    separation = init_centroids(backbone, head, source, info, batch_size=5, progress=False)
    reference, pairs = torch.load(reference_path, weights_only=True)
    # Over every rank's images, the same on each (each rank embedded its own classes').
    assert dataclasses.asdict(separation) == pytest.approx(pairs, rel=1e-5, abs=1e-6)
    for row in range(head.num_local):
        label = head.class_start + row
        got = head.weight[row].detach().double()
        if label == DROPPED:
            assert torch.equal(head.weight[row], random_rows[row]), label
        else:
            torch.testing.assert_close(got, reference[label], rtol=1e-5, atol=1e-7)


def saved_reference(image_folder: Path, pretrained: Path, tmp_path: Path):
    """The config of the centroid checks and the file of their reference rows."""
    cfg = tiny_config(image_folder, tmp_path / "run", f"train.init_backbone={pretrained}")
    source = WithoutClass(build_train_dataset(cfg.data), DROPPED)
    reference, pairs = reference_centroids(cfg, source)
    assert sorted(reference) == [c for c in range(12) if c != DROPPED]
    path = tmp_path / "reference.pt"
    torch.save((reference, pairs), path)
    return cfg, path


# World size 2 is checked with the two-rank run below (one spawn for both).
@pytest.mark.parametrize("world_size", [1, 3])
def test_centroids_are_the_class_means_on_any_number_of_ranks(
    image_folder, pretrained, tmp_path, world_size
):
    cfg, path = saved_reference(image_folder, pretrained, tmp_path)
    if world_size == 1:  # no process group: in this process
        _centroid_rank(0, 1, 0, cfg, str(path))
        return
    mp.spawn(
        _centroid_rank,
        args=(world_size, helpers.free_port(), cfg, str(path)),
        nprocs=world_size,
        join=True,
    )


# ---------------------------------------------------------------------- frozen BatchNorm


def test_frozen_batch_norm_changes_nothing_of_it_and_stays_finite_under_fp16(
    image_folder, pretrained, tmp_path
):
    # O1 fp16 (autocast and the loss scaler, as on a GPU); the loaded statistics are not the
    # fresh ones, so a layer that went back to batch statistics would change them.
    run = train(
        tiny_config(
            image_folder,
            tmp_path / "run",
            f"train.init_backbone={pretrained}",
            "model.freeze_bn=true",
            "precision.level=O1",
            "precision.dtype=fp16",
            "train.epochs=3",
            "train.max_steps=20",
        )
    )
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 20 and all(math.isfinite(r["loss"]) for r in records)
    # The first steps find the fp16 loss scale (2^16 halved while the scaled gradients
    # overflow, those steps skipped); then every step trains, with finite gradients.
    assert all(r["skipped_steps"] == 0 and math.isfinite(r["grad_norm"]) for r in records[10:])
    before, after = weights(pretrained), weights(run / "backbone.pt")
    assert all(torch.isfinite(v).all() for v in after.values() if v.is_floating_point())
    frozen = [k for k in before if is_batch_norm(before, k)]
    assert len(frozen) > 20
    for key in frozen:
        assert torch.equal(after[key], before[key]), key
    others = [k for k in before if k not in frozen]
    assert all(not torch.equal(after[k], before[k]) for k in others if k.endswith("conv1.weight"))


def test_frozen_batch_norm_stays_in_eval_mode_after_train_calls():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.BatchNorm1d(64))
    assert freeze_batch_norm(model) == 2
    for copy in (model, copy_module.deepcopy(model)):
        copy.train()
        assert copy.training and copy[0].training
        assert not copy[1].training and not copy[3].training
        assert not any(p.requires_grad for p in copy[1].parameters())
    assert param_groups([model], 5e-4)[0]["params"] == [model[0].weight]


# ---------------------------------------------------------------------- head-only steps, resume


def test_a_fine_tuned_run_resumes_with_the_same_numbers_and_head_only_steps_hold(
    image_folder, pretrained, tmp_path
):
    common = (
        f"train.init_backbone={pretrained}",
        "head.init=centroids",
        "train.head_only_steps=4",
        "optim.backbone_lr_scale=0.5",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=10",
    )
    straight = train(tiny_config(image_folder, tmp_path / "straight", "train.max_steps=7", *common))
    split = tmp_path / "split"
    # Resumed at step 2, before the 4 head-only steps end: it must go on head-only.
    train(tiny_config(image_folder, split, "train.max_steps=2", *common))
    train(tiny_config(image_folder, split, "train.max_steps=7", "train.resume=true", *common))
    a, b = losses(straight), losses(split)
    assert sorted(b) == list(range(1, 8))
    for step in range(1, 8):
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step
    loaded = weights(pretrained)
    for run in (straight, split):
        at_4 = weights(ckpt.checkpoint_path(run, 4))
        at_6 = weights(ckpt.checkpoint_path(run, 6))
        # Bit for bit through the head-only steps (weights and BatchNorm statistics alike),
        # then the backbone trains.
        assert all(torch.equal(at_4[k], loaded[k]) for k in loaded)
        assert not torch.equal(at_6["conv1.weight"], loaded["conv1.weight"])
    rows = [
        ckpt.read_part(ckpt.checkpoint_path(run, 6), "head")["weight"] for run in (straight, split)
    ]
    torch.testing.assert_close(rows[1], rows[0], rtol=1e-5, atol=1e-7)


def _two_rank_run(
    rank: int, world_size: int, port: int, cfg, reference_path: str, overrides: list[str]
) -> None:
    helpers.init_gloo_rank(rank, world_size, port)
    check_centroids(rank, world_size, cfg, reference_path)
    train(load_config("default", overrides))  # leaves the group (made here) to this process
    torch.distributed.destroy_process_group()


def test_centroids_head_only_steps_frozen_batch_norm_on_two_ranks_resumed_on_one(
    image_folder, pretrained, tmp_path
):
    cfg, reference = saved_reference(image_folder, pretrained, tmp_path)
    out = tmp_path / "run2"
    overrides = helpers.tiny_run_overrides(
        image_folder,
        out,
        "model.backbone=iresnet18",
        "train.batch_size=4",
        f"train.init_backbone={pretrained}",
        "head.init=centroids",
        "model.freeze_bn=true",
        "train.head_only_steps=2",
        "train.max_steps=3",
        "train.checkpoint_every=1",
        "train.keep_checkpoints=5",
    )
    port = helpers.free_port()
    mp.spawn(_two_rank_run, args=(2, port, cfg, str(reference), overrides), nprocs=2, join=True)
    loaded = weights(pretrained)
    at_2, at_3 = weights(ckpt.checkpoint_path(out, 2)), weights(ckpt.checkpoint_path(out, 3))
    assert all(torch.equal(at_2[k], loaded[k]) for k in loaded)
    assert not torch.equal(at_3["conv1.weight"], loaded["conv1.weight"])
    assert all(torch.equal(at_3[k], loaded[k]) for k in loaded if is_batch_norm(loaded, k))
    # The fine-tuned run resumes on one process (the global batch of 8 kept): its weights come
    # from the checkpoint (the file is not read again), and it goes on training.
    resumed = [*overrides, "train.batch_size=8", "train.max_steps=5", "train.resume=true"]
    train(load_config("default", [*resumed, f"train.init_backbone={tmp_path / 'gone.pt'}"]))
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records][-2:] == [4, 5] and math.isfinite(records[-1]["loss"])


# ---------------------------------------------------------------------- the plan


def test_the_plan_counts_the_centroid_pass_as_it_runs(image_folder, pretrained, tmp_path):
    from recognition.heads.margin_softmax import shard_range
    from recognition.tensor_memory import TensorMemory
    from recognition.training.plan import plan_run
    from recognition.training.plan.centroid_pass import plan_centroid_pass
    from recognition.training.plan.report import format_plan

    cfg = tiny_config(
        image_folder, tmp_path / "run", f"train.init_backbone={pretrained}", "head.init=centroids"
    )
    planned = plan_centroid_pass(cfg, 12, 2, 0, granularity=1)
    # Measured: the real pass of rank 0 of 2 (its 6 classes), everything made inside the count.
    source = build_train_dataset(cfg.data)
    memory = TensorMemory(granularity=1)
    with memory:
        backbone = backbone_from_config(cfg.model, cfg.data.image_hw)
        head = build_head(cfg.head, 12, cfg.model.embedding_size, seed=0, device="cpu")
        head.class_start, head.num_local = shard_range(12, 2, 0)
        head.weight = nn.Parameter(head.weight[: head.num_local].detach().clone())
        info = DistInfo(0, 0, 1, torch.device("cpu"))
        init_centroids(backbone, head, source, info, batch_size=8, progress=False)
    # 0.2 % apart here (labels and the small per-batch tensors are not planned).
    assert abs(planned - memory.peak) / memory.peak < 0.02, (planned, memory.peak)
    plan = plan_run(cfg, 12, 1, granularity=1)
    assert plan.ranks[0].centroid_pass > 0
    assert "head.init=centroids pass" in format_plan(plan)
    random_rows = dataclasses.replace(cfg, head=dataclasses.replace(cfg.head, init="random"))
    assert plan_centroid_pass(random_rows, 12, 1, 0, granularity=1) == 0


def test_a_trunk_only_file_loads_what_it_has_and_the_embedding_starts_fresh(
    image_folder, pretrained, tmp_path, caplog
):
    # As a classification network's trunk is read (model config "trunk_only"): no embedding
    # layers, any image size.
    data = torch.load(pretrained, weights_only=True)
    trunk = {k: v for k, v in data["state_dict"].items() if not k.startswith(("fc.", "features."))}
    path = tmp_path / "trunk.pt"
    torch.save({**data, "model": {**data["model"], "trunk_only": True}, "image_size": 224,
                "state_dict": trunk}, path)  # fmt: skip
    cfg = tiny_config(image_folder, tmp_path / "run", f"train.init_backbone={path}")
    check_init_backbone(path, cfg)
    torch.manual_seed(3)
    backbone = backbone_from_config(cfg.model, cfg.data.image_hw)
    fresh = {k: v.clone() for k, v in backbone.state_dict().items()}
    with caplog.at_level("INFO"):
        load_init_backbone(backbone, cfg)
    loaded = backbone.state_dict()
    assert all(torch.equal(loaded[k], trunk[k]) for k in trunk)
    assert all(torch.equal(loaded[k], fresh[k]) for k in loaded if k not in trunk)
    assert "holds the trunk only; fc, features start from random weights" in caplog.text
    # A key of the trunk that the backbone lacks is still refused.
    torch.save({**data, "model": {**data["model"], "trunk_only": True},
                "state_dict": {**trunk, "head.weight": torch.zeros(2)}}, path)  # fmt: skip
    with pytest.raises(ConfigError, match="holds 'head.weight'"):
        check_init_backbone(path, cfg)


def test_an_arcface_torch_state_dict_starts_the_run_with_its_weights(
    image_folder, pretrained, tmp_path
):
    # arcface_torch saves `backbone.state_dict()` alone, in fp16 after mixed-precision
    # training; the project's IResNet has its layout, so the same weights must load.
    state = torch.load(pretrained, weights_only=True)["state_dict"]
    path = tmp_path / "model.pt"
    torch.save({k: v.half() if v.is_floating_point() else v for k, v in state.items()}, path)
    cfg = tiny_config(image_folder, tmp_path / "run", f"train.init_backbone={path}")
    check_init_backbone(path, cfg)
    backbone = backbone_from_config(cfg.model, cfg.data.image_hw)
    load_init_backbone(backbone, cfg)
    loaded = backbone.state_dict()
    assert loaded.keys() == state.keys()
    for key, value in state.items():
        expected = value.half().float() if value.is_floating_point() else value
        assert torch.equal(loaded[key], expected), key


def test_the_run_gives_the_backbone_its_scale_and_the_head_the_full_rate(image_folder, tmp_path):
    """The run's own optimizer (build_model), not param_groups called by hand: every backbone
    parameter at optim.lr x optim.backbone_lr_scale, the head's class rows at optim.lr. The
    test above hands param_groups the scales itself, so it holds whichever module the run
    gives the scale to."""
    from recognition.training.build import build_model

    cfg = tiny_config(image_folder, tmp_path, "optim.backbone_lr_scale=0.25", "optim.lr=0.2")
    parts = build_model(cfg, DistInfo(), 10, None, torch.preserve_format)
    lr_of = {id(p): group["lr"] for group in parts.optimizer.param_groups for p in group["params"]}
    # (IResNet's last BatchNorm keeps its scale fixed: not trained, not in the optimizer.)
    backbone = [p for p in parts.backbone.parameters() if p.requires_grad]
    assert len(backbone) > 90 and all(lr_of[id(p)] == pytest.approx(0.05) for p in backbone)
    assert lr_of[id(parts.head.weight)] == pytest.approx(0.2)
