"""Evaluation during training: eval records at the right steps, the best backbone kept."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import free_port, init_gloo_rank, tiny_run_overrides
from PIL import Image

from recognition import checkpoint as ckpt
from recognition.checkpoint import load_backbone
from recognition.config import ConfigError, config_from_dict, load_config
from recognition.evaluation.embeddings import Extraction
from recognition.evaluation.protocols import evaluate_targets
from recognition.training import train


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    """A training folder (12 ids x 6 images) and LFW-layout pairs over 6 other identities."""
    root = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)

    def image(c: int, n: int) -> Image.Image:
        pixels = rng.integers(0, 60, size=(32, 32, 3), dtype=np.uint8)
        y, x = 4 + (c % 4) * 7, 4 + (c // 4 % 3) * 9
        pixels[y : y + 6, x : x + 6] = 200 + n
        return Image.fromarray(pixels)

    for c in range(12):
        (root / "train" / f"id{c:02d}").mkdir(parents=True)
        for n in range(6):
            image(c, n).save(root / "train" / f"id{c:02d}" / f"{n}.jpg", quality=95)
    val = root / "val"
    for c in range(6):
        (val / f"v{c}").mkdir(parents=True)
        for n in range(1, 4):
            image(c, n).save(val / f"v{c}" / f"v{c}_{n:04d}.jpg", quality=95)
    lines = ["2\t6"]
    for fold in range(2):
        lines += [f"v{c}\t1\t{2 + fold}" for c in range(6)]
        lines += [f"v{c}\t{1 + fold}\tv{(c + 1 + fold) % 6}\t3" for c in range(6)]
    (val / "pairs.txt").write_text("\n".join(lines) + "\n")
    return root / "train", val / "pairs.txt"


def config(train_root: Path, out: Path, *extra: str):
    return load_config("default", config_overrides(train_root, out, *extra))


def config_overrides(train_root: Path, out: Path, *extra: str) -> list[str]:
    return tiny_run_overrides(
        train_root,
        out,
        "train.batch_size=8",
        "train.epochs=2",
        "train.max_steps=6",
        "eval.at_end=false",
        *extra,
    )


def test_periodic_eval_logs_and_keeps_the_best(data, tmp_path):
    train_root, pairs = data
    evaluated = config(
        train_root,
        tmp_path / "eval",
        f"eval.targets=[{{name: val, pairs: {pairs}}}]",
        "eval.every_steps=2",
        # XNorm moves every step (the AUC of this easy set is 1.0 throughout).
        "eval.best_metric=val/xnorm",
        "train.checkpoint_every=1",
        "train.keep_checkpoints=10",
    )
    run_dir = train(evaluated)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in records if "eval/val/accuracy" in r}
    assert sorted(evals) == [2, 4, 6]
    for r in evals.values():
        assert {"eval/val/auc", "eval/val/eer", "eval/val/xnorm", "eval/val/tar@far=1e-1"} <= set(r)
        assert "eval/val/tar@far=1e-2" not in r  # 12 impostors cannot measure FAR 1e-2
    # Training records are untouched: every step once, with its loss.
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 7))

    norms = [evals[s]["eval/val/xnorm"] for s in (2, 4, 6)]
    assert len(set(norms)) == 3
    best = json.loads((run_dir / "best.json").read_text())
    assert best["metric"] == "val/xnorm"
    assert best["step"] == (2, 4, 6)[int(np.argmax(norms))]  # the first of equal maxima
    assert best["value"] == pytest.approx(max(norms), abs=1e-12)

    # best_backbone.pt holds exactly the weights of that step's checkpoint ...
    _, _, best_state = ckpt.load_backbone_file(run_dir / "best_backbone.pt")
    _, _, step_state = ckpt.load_backbone_file(ckpt.checkpoint_path(run_dir, best["step"]))
    assert best_state.keys() == step_state.keys()
    for key in best_state:
        torch.testing.assert_close(best_state[key], step_state[key], rtol=0, atol=0)
    # ... and evaluating it again gives the recorded value.
    model, size = load_backbone(run_dir / "best_backbone.pt", torch.device("cpu"))
    again = evaluate_targets(
        model, evaluated.eval.targets, size, Extraction(progress=False), xnorm=True
    )
    assert again["val"]["xnorm"] == pytest.approx(best["value"], abs=1e-12)

    # Evaluating does not change training: the same losses as a run without it.
    plain = train(config(train_root, tmp_path / "plain"))
    plain_losses = [
        json.loads(x)["loss"] for x in (plain / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["loss"] for r in records if "loss" in r] == plain_losses


def test_the_loader_workers_are_gone_before_the_final_evaluation(data, tmp_path, monkeypatch):
    """The training's loader workers stop when its batches are done, not when the garbage
    collector frees the run after the evaluation (5 s a worker, persistent workers in a
    reference cycle: recognition.data.workers.stop_workers)."""
    import multiprocessing

    from recognition.evaluation import targets as evaluation

    train_root, pairs = data
    before = {child.pid for child in multiprocessing.active_children()}
    alive: list[list[int]] = []
    real = evaluation.evaluate_config_targets

    def spy(*args, **kwargs):
        alive.append([c.pid for c in multiprocessing.active_children() if c.pid not in before])
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluation, "evaluate_config_targets", spy)
    run_dir = train(
        config(
            train_root,
            tmp_path / "run",
            f"eval.targets=[{{name: val, pairs: {pairs}}}]",
            "eval.at_end=true",
            "train.max_steps=2",
            "data.num_workers=2",
            "data.persistent_workers=true",
        )
    )
    assert alive == [[]]  # the final evaluation ran, with no worker of this run alive
    assert "stopped 2 loader workers" in (run_dir / "train.log").read_text()
    assert (run_dir / "eval.json").is_file()


def test_best_metric_is_validated():
    targets = [{"name": "lfw", "pairs": "lfw/pairs.txt"}, {"bin": "x/agedb_30.bin"}]
    ok = config_from_dict(
        {"eval": {"targets": targets, "every_steps": 5, "best_metric": "agedb_30/tar@far=1e-4"}}
    )
    assert ok.eval.targets[1].label == "agedb_30"
    for best, match in [
        ("cfp/accuracy", "names target 'cfp'"),
        ("lfw/acc", "unknown metric 'acc'"),
        ("lfw/tar@far=2", "unknown metric"),
    ]:
        with pytest.raises(ConfigError, match=match):
            config_from_dict({"eval": {"targets": targets, "every_steps": 5, "best_metric": best}})
    with pytest.raises(ConfigError, match="needs eval.every_steps"):
        config_from_dict({"eval": {"targets": targets, "best_metric": "lfw/eer"}})
    with pytest.raises(ConfigError, match=r"eval\.targets\[1\]\.pairs"):
        config_from_dict({"eval": {"targets": [targets[0], {"pairs": "a", "bin": "b"}]}})
    with pytest.raises(ConfigError, match="two targets are called 'lfw'"):
        config_from_dict({"eval": {"targets": [targets[0], targets[0]]}})


def test_the_metrics_of_ijb_and_reid_targets_are_checked_when_the_config_loads(tmp_path):
    targets = [{"ijb": "IJB_release/IJBC", "ijb_mode": "1n"}, {"reid": "data/Market"}]
    for good in ("ijbc-1n/rank1", "ijbc-1n/tpir@fpir=1e-2", "Market/mAP", "Market/rank5"):
        eval_cfg = {"targets": targets, "every_steps": 5, "best_metric": good}
        assert config_from_dict({"eval": eval_cfg}).eval.best_metric == good
    for bad, match in [
        ("Market/accuracy", "unknown metric 'accuracy' for reid targets"),
        ("ijbc-1n/eer", "unknown metric 'eer' for ijb targets"),
    ]:
        with pytest.raises(ConfigError, match=match):
            config_from_dict({"eval": {"targets": targets, "every_steps": 5, "best_metric": bad}})
    for target, key in [
        ({"ijb": "somewhere/release"}, "ijb_name"),  # the folder does not say which set
        ({"reid": "m", "crop": 10}, "crop"),
        ({"bin": "a.bin", "ijb_mode": "1n"}, "ijb_name"),
    ]:
        with pytest.raises(ConfigError, match=rf"eval\.targets\[0\]\.{key}"):
            config_from_dict({"eval": {"targets": [target]}})
    # Their inputs are checked before any work, like a pairs file's.
    from recognition.preflight import input_problems

    cfg = config_from_dict(
        {"output_dir": str(tmp_path / "run"), "data": {"root": str(tmp_path)}, "eval": {"targets": [
            {"ijb": str(tmp_path / "IJBC")}, {"reid": str(tmp_path / "market")}]}}
    )  # fmt: skip
    problems = input_problems(cfg)
    assert f"IJB meta folder not found: {tmp_path / 'IJBC'}" in problems[0]
    assert f"{tmp_path / 'market' / 'query'} not found" in problems[1]


@pytest.mark.parametrize(
    "metric, values, best_step",
    [("accuracy", [0.5, 0.7, 0.6, 0.7], 2), ("eer", [0.3, 0.1, 0.2, 0.1], 2)],
)
def test_only_an_improvement_replaces_the_best(tmp_path, metric, values, best_step):
    from recognition.distributed import DistInfo
    from recognition.training.hooks import PeriodicEvaluation

    cfg = config_from_dict(
        {
            "output_dir": str(tmp_path),
            "model": {"backbone": "iresnet18", "width": 0.125, "embedding_size": 8},
            "eval": {
                "targets": [{"name": "lfw", "pairs": "p.txt"}],
                "every_steps": 1,
                "best_metric": f"lfw/{metric}",
            },
        }
    )
    dist_info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    evaluator = PeriodicEvaluation(cfg, dist_info, metrics=None)
    for step, value in enumerate(values, start=1):
        model = torch.nn.Linear(2, 2)
        torch.nn.init.constant_(model.weight, float(step))
        evaluator._keep_best(step, {f"eval/lfw/{metric}": value}, model)
    best = json.loads((tmp_path / "best.json").read_text())
    assert best == {"step": best_step, "metric": f"lfw/{metric}", "value": values[best_step - 1]}
    state = ckpt.load_backbone_file(tmp_path / "best_backbone.pt")[2]
    assert torch.all(state["weight"] == best_step)
    # A resumed run starts from the saved best: a worse value does not replace it.
    again = PeriodicEvaluation(cfg, dist_info, metrics=None)
    again._keep_best(9, {f"eval/lfw/{metric}": 0.4 if metric == "eer" else 0.1}, model)
    assert json.loads((tmp_path / "best.json").read_text())["step"] == best_step


def _rank_main(rank: int, port: int, jobs: list[list[str]], out: str) -> None:
    import os

    import torch.distributed as dist

    init_gloo_rank(rank, 2, port, timeout_s=60)
    outcomes = []
    for overrides in jobs:
        try:
            train(load_config("default", overrides))
            outcomes.append("ok")
        except ValueError as exc:
            outcomes.append(f"ValueError: {exc}")
    Path(out, f"rank{rank}.json").write_text(json.dumps(outcomes))
    dist.barrier()
    dist.destroy_process_group()
    # Skip the interpreter's teardown, which intermittently aborts inside gloo.
    os._exit(0)


def test_two_ranks_wait_for_rank0_and_share_its_errors(data, tmp_path):
    import torch.multiprocessing as mp

    train_root, pairs = data
    # Images that exist (so the check at the start passes) but cannot be decoded.
    broken = tmp_path / "broken"
    for image in pairs.parent.glob("*/*.jpg"):
        (broken / image.parent.name).mkdir(parents=True, exist_ok=True)
        (broken / image.parent.name / image.name).write_bytes(b"")
    (broken / "pairs.txt").write_text(pairs.read_text())
    # Images that are not there at all: every rank stops before training.
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "pairs.txt").write_text(pairs.read_text())
    port = free_port()

    def job(out: Path, target: Path) -> list[str]:
        return config_overrides(train_root, out) + [
            f"eval.targets=[{{name: val, pairs: {target}}}]",
            "eval.every_steps=3",
            "eval.best_metric=val/accuracy",
            "train.batch_size=4",
            "train.timeout_s=60",
        ]

    jobs = [
        job(tmp_path / "good", pairs),
        job(tmp_path / "bad", broken / "pairs.txt"),
        job(tmp_path / "missing_run", missing / "pairs.txt"),
        # Two pipeline stages: rank 0 evaluates the whole backbone put together from both.
        job(tmp_path / "pipelined", pairs)
        + ["model.pipeline_stages=2", "model.micro_batch_size=2", "train.checkpoint_every=3"],
    ]
    mp.spawn(_rank_main, args=(port, jobs, str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        good, bad, absent, pipelined = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert good == "ok" and pipelined == "ok"
        # Every rank stops with rank 0's message (not a collective timeout).
        assert bad.startswith("ValueError: evaluation at step 3 failed") and "v0_0001" in bad
        assert absent.startswith("ValueError: eval.targets: ") and "v0_0001" in absent
    assert not (tmp_path / "missing_run" / "checkpoints").exists()
    records = [
        json.loads(x) for x in (tmp_path / "good" / "metrics.jsonl").read_text().split("\n") if x
    ]
    assert [r["step"] for r in records if "eval/val/accuracy" in r] == [3, 6]
    assert json.loads((tmp_path / "good" / "best.json").read_text())["step"] in (3, 6)
    assert (tmp_path / "good" / "best_backbone.pt").is_file()

    run_dir = tmp_path / "pipelined"
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().split("\n") if x]
    assert [r["step"] for r in records if "eval/val/accuracy" in r] == [3, 6]
    best = json.loads((run_dir / "best.json").read_text())
    _, _, best_state = ckpt.load_backbone_file(run_dir / "best_backbone.pt")
    _, _, step_state = ckpt.load_backbone_file(ckpt.checkpoint_path(run_dir, best["step"]))
    assert best_state.keys() == step_state.keys()
    for key in best_state:
        torch.testing.assert_close(best_state[key], step_state[key], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["pairs", "bin"])
def test_missing_target_stops_before_the_first_step(data, tmp_path, kind):
    train_root, _ = data
    missing = tmp_path / f"nowhere.{'txt' if kind == 'pairs' else 'bin'}"
    cfg = config(
        train_root,
        tmp_path / "run",
        f"eval.targets=[{{name: gone, {kind}: {missing}}}]",
        "eval.every_steps=1000",
    )
    with pytest.raises(ValueError, match=rf"eval.targets: .*{missing.name}"):
        train(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_ijb_and_reid_run_periodically_and_pick_the_best(data, tmp_path):
    # Every kind of target is a protocol behind one interface: IJB 1:1 and re-id ranking
    # evaluate during training like a pairs file, and either may choose the best backbone.
    from test_evaluate_modes import market
    from test_ijb import write_ijb

    import evaluate

    train_root, _ = data
    reid_root, ijb_root = market(tmp_path / "market"), tmp_path / "IJBC"
    write_ijb(ijb_root, "ijbc", num_ids=3, templates_per_id=2)
    targets = f"eval.targets=[{{reid: {reid_root}}}, {{ijb: {ijb_root}}}]"
    cfg = config(
        train_root,
        tmp_path / "run",
        targets,
        "eval.every_steps=2",
        "eval.best_metric=ijbc/auc",
        "eval.at_end=true",
        "eval.flip=false",
    )
    run_dir = train(cfg)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in records if "eval/market/mAP" in r}
    assert sorted(evals) == [2, 4, 6]
    for r in evals.values():
        assert {"eval/market/rank1", "eval/ijbc/auc", "eval/ijbc/tar@far=1e-1"} <= set(r)
    aucs = [evals[s]["eval/ijbc/auc"] for s in (2, 4, 6)]
    best = json.loads((run_dir / "best.json").read_text())
    assert best["metric"] == "ijbc/auc" and best["step"] == (2, 4, 6)[int(np.argmax(aucs))]
    # The end's evaluation holds both kinds; evaluate.py gives the kept backbone's numbers.
    assert sorted(json.loads((run_dir / "eval.json").read_text())) == ["ijbc", "market"]
    out = tmp_path / "best.json"
    argv = ["--checkpoint", str(run_dir / "best_backbone.pt"), "--ijb", str(ijb_root)]
    argv += ["--ijb-name", "ijbc", "--no-flip", "--workers", "0", "--json", str(out)]
    assert evaluate.main(argv) == 0
    assert json.loads(out.read_text())["auc"] == pytest.approx(best["value"], abs=1e-9)
    argv = ["--checkpoint", str(run_dir / "best_backbone.pt"), "--reid", str(reid_root)]
    assert evaluate.main([*argv, "--no-flip", "--workers", "0", "--json", str(out)]) == 0
    best_step = evals[best["step"]]
    assert json.loads(out.read_text())["mAP"] == pytest.approx(best_step["eval/market/mAP"])
