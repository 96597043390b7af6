"""configs/market1501_bot.yaml, the strong re-id baseline's recipe: its settings, a run of it
end to end on a tiny Market-1501 tree (a tiny backbone, a few steps) ranked with
re-ranking, and its plan against the allocator."""

from __future__ import annotations

import json
import math

import numpy as np
from test_data_build import jpeg, make_market

import evaluate
from recognition.config import load_config
from recognition.distributed import DistInfo
from recognition.training import train

TINY = [
    "data.image_size=[32, 16]",
    "data.num_workers=0",
    # A tiny IResNet: its BatchNorm1d after the fc is a BN neck too, so the triplet loss
    # sees the fc's output and the margin head the BN's, as with resnet50_reid.
    "model.backbone=iresnet18",
    "model.width=0.125",
    "model.embedding_size=16",
    "train.batch_size=8",  # 2 identities x 4 crops
    "precision.level=O0",
]


def test_the_config_holds_the_recipe():
    cfg = load_config("market1501_bot")
    assert (cfg.model.backbone, cfg.model.embedding_size) == ("resnet50_reid", 2048)
    assert cfg.data.image_size == [256, 128] and cfg.data.augment.preset == "reid"
    assert (cfg.data.sampler, cfg.data.pk_instances, cfg.train.batch_size) == ("pk", 4, 64)
    head = cfg.head
    assert (head.label_smoothing, head.id_weight, head.triplet_weight) == (0.1, 1.0, 1.0)
    assert head.triplet_margin == 0.3 and head.sample_rate == 1.0
    optim = cfg.optim
    assert (optim.name, optim.lr, optim.weight_decay) == ("adam", 3.5e-4, 5e-4)
    assert (optim.warmup_epochs, optim.schedule, optim.milestones) == (10, "step", [40, 70])
    assert optim.grad_clip is None and cfg.train.epochs == 120


def test_the_recipe_trains_end_to_end_and_ranks_with_reranking(tmp_path):
    root = make_market(tmp_path / "market", persons=6, per=4)
    for folder, pids, cams in (("query", (2, 5), (1, 2)), ("bounding_box_test", (2, 5, 8), (3, 4))):
        (root / folder).mkdir()
        for n, pid in enumerate(pids):
            for cam in cams:
                name = f"{pid:04d}_c{cam}s1_{n:06d}_00.jpg"
                (root / folder / name).write_bytes(jpeg(31 * pid + cam, size=32))
    overrides = [f"output_dir={tmp_path / 'run'}", f"data.root={root}", *TINY]
    run_dir = train(load_config("market1501_bot", [*overrides, "train.max_steps=3"]))
    log = (run_dir / "train.log").read_text()
    assert "the triplet loss on the features before the BN neck" in log
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) >= 1 and all(math.isfinite(x) for x in losses)
    out = tmp_path / "reid.json"
    argv = ["--checkpoint", str(run_dir / "backbone.pt"), "--reid", str(root), "--workers", "0"]
    assert evaluate.main([*argv, "--rerank", "--rerank-k1", "4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["num_query"] == 4 and result["num_gallery"] == 6
    assert result["rerank"] == {"k1": 4, "k2": 6, "lambda": 0.3}
    assert 0 < result["mINP"] <= 1 and np.isfinite(result["mAP"])


def test_its_plan_matches_the_allocator():
    """The planner's peak of the recipe's step (label smoothing, the triplet loss on the BN
    neck's input, Adam) against the CPU allocator's peak of the same step, within 5 %."""
    from recognition.training.plan import plan_rank
    from recognition.training.plan.check import measure_rank

    cfg = load_config("market1501_bot", [*TINY, "data.root=/nonexistent", "eval.targets=[]"])
    plan = plan_rank(cfg, 751, 1, 0, granularity=1)
    measured = measure_rank(cfg, 751, DistInfo())
    assert abs(plan.peak - measured) / measured <= 0.05, (plan.peak, measured)
