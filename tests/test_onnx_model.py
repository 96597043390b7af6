"""ONNX models in evaluate.py: onnxruntime gives the torch path's embeddings (cosine 1e-5) in
every evaluation, for the project's own export and for graphs as other tools write them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_evaluate_modes import lfw_and_bin, market
from test_ijb import LOOSE, SIZE
from test_ijb_search import make_release, write_meta
from torch import nn

import evaluate
from recognition import checkpoint as ckpt
from recognition.evaluation.embeddings import PathDataset, extract_embeddings
from recognition.export import main as export_main
from recognition.models import build_backbone

MODEL = {"backbone": "iresnet18", "embedding_size": 8, "width": 0.125, "dropout": 0.0}


class Tiny(nn.Module):
    """A small face model of another tool: conv, BN, PReLU, fc; (B, 3, 32, 32) -> (B, 6)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=4, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.PReLU(4)
        self.fc = nn.Linear(4 * 8 * 8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.act(self.bn(self.conv(x))).flatten(1))


def tiny() -> Tiny:
    torch.manual_seed(2)
    model = Tiny().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    return model


def legacy_export(
    model: nn.Module, path: Path, *, dynamic_batch: bool = True, size: tuple[int, int] = (32, 32)
) -> Path:
    """The graph as insightface's tools write it (torch's TorchScript exporter, which is
    also faster than the project's): input `input.1`, opset 11."""
    torch.onnx.export(
        model,
        (torch.randn(1, 3, *size),),
        str(path),
        input_names=["input.1"],
        output_names=["output"],
        dynamic_axes={"input.1": {0: "None"}} if dynamic_batch else None,
        opset_version=11,
        dynamo=False,
    )
    return path


@pytest.fixture(scope="module")
def own(tmp_path_factory) -> tuple[Path, Path]:
    """(backbone.pt, its ONNX export by `python -m recognition.export --onnx`), 32x32."""
    torch.manual_seed(0)
    model = build_backbone("iresnet18", embedding_size=8, width=0.125, image_size=SIZE)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d | nn.BatchNorm1d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    folder = tmp_path_factory.mktemp("own")
    ckpt.export_backbone(folder / "backbone.pt", model, MODEL, SIZE)
    argv = ["--checkpoint", str(folder / "backbone.pt"), "--onnx", str(folder / "model.onnx")]
    assert export_main([*argv, "--no-check"]) == 0
    return folder / "backbone.pt", folder / "model.onnx"


def faces(root: Path, size: int = 32) -> Path:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    for name in ("a.png", "b.png", "c.png", "d.png", "e.png"):
        pixels = rng.integers(0, 255, size=(size, size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / name)
    return root


def embed(checkpoint: Path, root: Path, out: Path, *flags: str) -> np.ndarray:
    argv = ["--checkpoint", str(checkpoint), "--images", str(root), "--workers", "0", *flags]
    assert evaluate.main([*argv, "--export-embeddings", str(out)]) == 0
    with np.load(out) as f:
        return f["embeddings"]


def assert_same_directions(got: np.ndarray, expected: np.ndarray) -> None:
    """Row-wise cosine 1 to 1e-5 (both sides L2-normalised here, in float64)."""
    assert got.shape == expected.shape
    got, expected = got.astype(np.float64), expected.astype(np.float64)
    cosine = (
        (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    )
    np.testing.assert_allclose(cosine, 1.0, atol=1e-5, rtol=0)


def test_own_export_evaluates_like_the_checkpoint(own, tmp_path):
    checkpoint, onnx_file = own
    # Every verification the project has: pairs and .bin in one run, and the folder export.
    pairs, bin_file = lfw_and_bin(tmp_path / "lfw")
    results = {}
    for name, model in (("torch", checkpoint), ("onnx", onnx_file)):
        argv = ["--checkpoint", str(model), "--pairs", str(pairs), "--bin", str(bin_file)]
        out, emb = tmp_path / f"{name}.json", tmp_path / f"{name}.npz"
        argv += ["--workers", "0", "--json", str(out), "--export-embeddings", str(emb)]
        assert evaluate.main(argv) == 0
        results[name] = json.loads(out.read_text())
        for target in ("lfw", "set"):
            with np.load(emb.with_name(f"{name}.{target}.npz")) as f:
                results[f"{name}/{target}"] = f["embeddings"]
    for target in ("lfw", "set"):
        assert_same_directions(results[f"onnx/{target}"], results[f"torch/{target}"])
    assert results["onnx"].keys() == results["torch"].keys()
    for target, metrics in results["torch"].items():
        assert results["onnx"][target]["accuracy"] == metrics["accuracy"]

    root = faces(tmp_path / "faces")
    ours = embed(checkpoint, root, tmp_path / "a.npz")
    assert_same_directions(embed(onnx_file, root, tmp_path / "b.npz"), ours)


def test_reid_through_an_onnx_graph_of_height_width(tmp_path):
    torch.manual_seed(0)
    model = build_backbone("iresnet18", embedding_size=8, width=0.125, image_size=(32, 16))
    ckpt.export_backbone(tmp_path / "reid.pt", model, MODEL, (32, 16))
    onnx_file = legacy_export(model.eval(), tmp_path / "reid.onnx", size=(32, 16))
    root = market(tmp_path / "market")
    embeddings = {}
    for name, path in (("torch", tmp_path / "reid.pt"), ("onnx", onnx_file)):
        argv = ["--checkpoint", str(path), "--reid", str(root), "--workers", "0"]
        out = tmp_path / f"{name}.npz"
        assert evaluate.main([*argv, "--export-embeddings", str(out)]) == 0
        with np.load(out) as f:
            embeddings[name] = f["embeddings"]
    assert_same_directions(embeddings["onnx"], embeddings["torch"])


def test_ijb_through_onnx_gives_the_checkpoints_numbers(own, tmp_path):
    checkpoint, onnx_file = own
    root = tmp_path / "IJBC"
    rng = np.random.default_rng(4)
    release = make_release(rng, "ijbc", 6, (1, 3))
    write_meta(root, "ijbc", release)  # every image's landmarks in the crop's middle
    for name in release.images():
        pixels = rng.integers(0, 255, size=(LOOSE, LOOSE, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / "loose_crop" / name)
    results = {}
    for name, path in (("torch", checkpoint), ("onnx", onnx_file)):
        for mode in ("11", "1n"):
            out = tmp_path / f"{name}{mode}.json"
            argv = ["--ijb", str(root), "--ijb-name", "ijbc", "--ijb-mode", mode]
            argv += ["--checkpoint", str(path), "--workers", "0", "--json", str(out)]
            argv += ["--save-features", str(tmp_path / f"{name}.npz")]
            assert evaluate.main(argv) == 0
            results[name + mode] = json.loads(out.read_text())
    with np.load(tmp_path / "torch.npz") as a, np.load(tmp_path / "onnx.npz") as b:
        assert_same_directions(b["features"], a["features"])
    assert results["onnx11"]["auc"] == pytest.approx(results["torch11"]["auc"], abs=1e-6)
    assert results["onnx1n"]["cmc"] == results["torch1n"]["cmc"]


@pytest.mark.parametrize("dynamic_batch", [True, False])
def test_graph_named_input_1_equals_the_torch_model(tmp_path, dynamic_batch):
    model = tiny()
    onnx_file = legacy_export(model, tmp_path / "tiny.onnx", dynamic_batch=dynamic_batch)
    root = faces(tmp_path / "faces")
    paths = sorted(p.name for p in root.iterdir())
    # The torch path: the project's extraction on the torch model itself.
    expected = extract_embeddings(model, PathDataset(paths, (32, 32), root), progress=False)
    got = embed(onnx_file, root, tmp_path / "e.npz", "--batch-size", "2")
    assert_same_directions(got, expected)


def test_other_normalisation_and_bgr_by_flags(tmp_path):
    model = tiny()
    onnx_file = legacy_export(model, tmp_path / "bgr.onnx", dynamic_batch=True)
    root = faces(tmp_path / "faces")
    mean, std = np.array([123.0, 116.0, 103.0]), np.array([58.0, 57.0, 57.5])
    got = embed(onnx_file, root, tmp_path / "e.npz", "--onnx-mean", "123,116,103",
                "--onnx-std", "58,57,57.5", "--onnx-bgr")  # fmt: skip
    # Independent: the pixels normalised per channel in float64, channels reversed to BGR,
    # the model on the image plus its mirror.
    for row, name in zip(got, sorted(p.name for p in root.iterdir()), strict=True):
        pixels = np.asarray(Image.open(root / name).convert("RGB"), dtype=np.float64)
        x = torch.from_numpy(((pixels - mean) / std)[:, :, ::-1].copy()).permute(2, 0, 1)[None]
        with torch.no_grad():
            e = (model(x.float()) + model(x.float().flip(3)))[0].double().numpy()
        assert_same_directions(row[None], e[None])


class TwoInputs(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a + b).flatten(1)


@pytest.mark.parametrize(
    ("model", "example", "named"),
    [
        (TwoInputs(), (torch.randn(1, 3, 32, 32),) * 2, "has 2 inputs ('a', 'b')"),
        (nn.Linear(12, 4), (torch.randn(2, 12),), "of shape [2, 12]; expected float images"),
        (nn.Conv2d(1, 2, 3), (torch.randn(1, 1, 32, 32),), "of shape [1, 1, 32, 32]"),
    ],
)
def test_graph_that_is_not_a_backbone_is_refused(tmp_path, capsys, model, example, named):
    path = tmp_path / "odd.onnx"
    names = ["a", "b"] if len(example) == 2 else ["x"]
    torch.onnx.export(model, example, str(path), input_names=names, dynamo=False)
    root = faces(tmp_path / "faces")
    out = tmp_path / "e.npz"
    argv = ["--checkpoint", str(path), "--images", str(root), "--export-embeddings", str(out)]
    assert evaluate.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "odd.onnx" in err and named in err, err
    assert not out.exists()


def test_missing_onnx_file_and_flags_without_onnx_are_refused(own, tmp_path, capsys):
    checkpoint, _ = own
    root = faces(tmp_path / "faces")
    base = ["--images", str(root), "--export-embeddings", str(tmp_path / "e.npz")]
    assert evaluate.main(["--checkpoint", str(tmp_path / "gone.onnx"), *base]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gone.onnx: no such file" in err, err
    assert evaluate.main(["--checkpoint", str(checkpoint), "--onnx-bgr", *base]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "for ONNX models" in err and "backbone.pt" in err, err
    assert not (tmp_path / "e.npz").exists()
