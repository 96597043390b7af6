"""The entry points on bad input: a clear message naming key / file / line, a non-zero exit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import folder_overrides
from PIL import Image

import evaluate
import train


def make_folder(root: Path, num_ids: int = 4, num_images: int = 4, size: int = 32) -> Path:
    rng = np.random.default_rng(1)
    for c in range(num_ids):
        (root / f"p{c}").mkdir(parents=True)
        for n in range(num_images):
            pixels = rng.integers(0, 255, size=(size, size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"p{c}" / f"{n}.jpg")
    return root


def tiny_args(data: Path, out: Path) -> list[str]:
    return [
        *folder_overrides(data, out),
        "model.width=0.125",
        "model.embedding_size=8",
        "train.batch_size=4",
        "train.epochs=1",
        "train.progress=false",
        "eval.targets=[]",
    ]


def test_unknown_config_key(capsys):
    assert train.main(["--config", "default", "optim.lrr=0.1"]) == 2
    assert "optim.lrr" in capsys.readouterr().err


def test_unknown_config_name(capsys):
    assert train.main(["--config", "nonexistent"]) == 2
    assert "nonexistent" in capsys.readouterr().err


def test_corrupt_jpeg_is_named_and_the_run_stops(tmp_path, capsys):
    data = make_folder(tmp_path / "data")
    bad = data / "p2" / "1.jpg"
    bad.write_bytes(bad.read_bytes()[:200])  # truncated
    assert train.main(tiny_args(data, tmp_path / "run")) == 1
    assert str(bad) in capsys.readouterr().err


def test_empty_identity_folder_is_named(tmp_path, capsys):
    data = make_folder(tmp_path / "data")
    (data / "zz_empty").mkdir()
    assert train.main(tiny_args(data, tmp_path / "run")) == 1
    assert "zz_empty" in capsys.readouterr().err


def test_missing_data_root(tmp_path, capsys):
    assert train.main(tiny_args(tmp_path / "nothing", tmp_path / "run")) == 1
    assert "nothing" in capsys.readouterr().err


def test_train_then_evaluate_with_pairs_json_and_export(tmp_path, capsys):
    data = make_folder(tmp_path / "data")
    assert train.main(tiny_args(data, tmp_path / "run")) == 0
    # LFW layout for the pairs: <name>/<name>_<n:04d>.jpg
    lfw = tmp_path / "lfw"
    for c in range(4):
        (lfw / f"n{c}").mkdir(parents=True)
        for n in range(1, 4):
            Image.open(data / f"p{c}" / f"{n - 1}.jpg").save(lfw / f"n{c}" / f"n{c}_{n:04d}.jpg")
    same = [f"n{c}\t1\t{n}" for c in range(4) for n in (2, 3)]
    diff = [f"n{c}\t1\tn{(c + 1) % 4}\t2" for c in range(4)] + [
        f"n{c}\t3\tn{(c + 2) % 4}\t3" for c in range(4)
    ]
    (lfw / "pairs.txt").write_text(
        "2\t4\n" + "\n".join(same[:4] + diff[:4] + same[4:] + diff[4:]) + "\n"
    )
    out = tmp_path / "eval.json"
    emb = tmp_path / "emb.npz"
    argv = [
        "--checkpoint",
        str(tmp_path / "run" / "backbone.pt"),
        "--pairs",
        str(lfw / "pairs.txt"),
        "--json",
        str(out),
        "--export-embeddings",
        str(emb),
        "--roc",
        str(tmp_path / "roc.png"),
        "--workers",
        "0",
    ]
    assert evaluate.main(argv) == 0
    result = json.loads(out.read_text())
    for key in ("num_pairs", "accuracy", "accuracy_std", "threshold", "auc", "eer", "tar_at_far"):
        assert key in result
    assert result["num_pairs"] == 16
    assert result["tar_at_far"]["1e-1"] is None  # 8 impostors < 1 / 0.1
    assert (tmp_path / "roc.png").stat().st_size > 0
    with np.load(emb) as f:
        assert f["embeddings"].shape == (12, 8) and f["embeddings"].dtype == np.float32
        assert sorted(f["paths"].tolist())[0] == "n0/n0_0001.jpg"
    # The same numbers from the exported embeddings, with no model.
    out2 = tmp_path / "eval2.json"
    assert (
        evaluate.main(
            ["--embeddings", str(emb), "--pairs", str(lfw / "pairs.txt"), "--json", str(out2)]
        )
        == 0
    )
    again = json.loads(out2.read_text())
    assert again["accuracy"] == pytest.approx(result["accuracy"])
    assert again["auc"] == pytest.approx(result["auc"], abs=1e-6)

    # A malformed line and a missing image are named with file and line.
    bad = tmp_path / "bad_pairs.txt"
    lines = (lfw / "pairs.txt").read_text().splitlines()
    bad.write_text("\n".join(lines[:3] + ["n0\tone\t2"] + lines[4:]) + "\n")
    assert evaluate.main(["--embeddings", str(emb), "--pairs", str(bad)]) == 1
    assert "bad_pairs.txt:4" in capsys.readouterr().err
    (lfw / "n1" / "n1_0003.jpg").unlink()
    assert evaluate.main(argv) == 1
    err = capsys.readouterr().err
    assert "pairs.txt:" in err and "n1/n1_0003.jpg" in err


def test_torch_below_the_minimum_is_one_line_at_start_up(monkeypatch, capsys):
    import train
    from recognition import compat

    assert compat.torch_version_error("2.11.0+cu130") is None
    assert compat.torch_version_error("2.14.1") is None
    assert compat.torch_version_error("3.0") is None
    message = compat.torch_version_error("2.10.1+cpu")
    assert "torch 2.10.1+cpu is installed" in message and ">= 2.11" in message
    assert compat.torch_version_error("1.13.1") is not None

    monkeypatch.setattr(compat.metadata, "version", lambda name: "2.9.0")
    assert train.main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "torch 2.9.0 is installed" in err


# ---- flags checked before work, and the config for one's own faces (issue 39) ----------


@pytest.fixture
def trains(monkeypatch):
    """train.py's `train()` replaced by a recorder: the configs it would have trained."""
    import recognition.training

    runs = []
    monkeypatch.setattr(recognition.training, "train", lambda cfg, **_: runs.append(cfg))
    return runs


def test_plan_flags_without_plan_are_refused_with_every_problem(trains, capsys):
    argv = ["--gpus", "4", "--classes", "10", "--gpu-memory", "40", "head.margin=foo"]
    assert train.main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    named = sorted(line.split(": ")[1] for line in lines)  # "error: --gpus: only with --plan"
    assert named == ["--classes", "--gpu-memory", "--gpus", "head.margin"], lines
    assert trains == []


def test_show_config_with_plan_is_refused(trains, capsys):
    assert train.main(["--show-config", "--plan"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--show-config and --plan" in err


@pytest.mark.parametrize("flag", ["--gpus", "--classes", "--gpu-memory"])
def test_plan_counts_must_be_positive(flag, trains, capsys):
    assert train.main(["--plan", flag, "0"]) == 2
    assert f"{flag}: must be positive" in capsys.readouterr().err


def test_own_faces_on_a_gpu_name_the_config_to_use(tmp_path, monkeypatch, trains, capsys):
    import torch

    faces = make_folder(tmp_path / "faces")
    monkeypatch.delenv("RECOGNITION_AUTO_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    run = tmp_path / "run"
    assert train.main([f"data.root={faces}", f"output_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"python train.py --config folder data.root={faces}" in err
    assert trains == [] and not run.exists()
    # Asked for by name, or with a model of one's own, the built-in config trains as told.
    assert train.main(["--config", "default", f"data.root={faces}", f"output_dir={run}"]) == 0
    assert train.main([f"data.root={faces}", "model.width=0.5", f"output_dir={run}"]) == 0
    # On a CPU the built-in toy is the model to train.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert train.main([f"data.root={faces}", f"output_dir={run}"]) == 0
    assert len(trains) == 3 and trains[1].model.width == 0.5


def test_the_plan_flags_help_says_their_defaults():
    text = " ".join(train._parser().format_help().split())
    assert "the world size (default: 8)" in text and "GiB of memory per GPU (default: 80)" in text
