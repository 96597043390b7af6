"""ONNX export: onnxruntime on the CPU gives PyTorch's embeddings, at any batch size."""

from __future__ import annotations

import numpy as np

# requirements.txt installs onnx, onnxscript and onnxruntime: a missing one is an install
# error and fails here, rather than a skipped test that CI would count as passing.
import onnx  # noqa: F401
import onnxruntime as ort
import onnxscript  # noqa: F401
import torch

from recognition import checkpoint as ckpt
from recognition.export import main
from recognition.models import build_backbone


def test_onnx_export_matches_pytorch(tmp_path, capsys):
    torch.manual_seed(0)
    model_cfg = {"backbone": "iresnet18", "embedding_size": 16, "width": 0.125, "dropout": 0.0}
    model = build_backbone("iresnet18", embedding_size=16, width=0.125, dropout=0.0, image_size=32)
    # Non-trivial BatchNorm statistics, so that eval-mode BN is really exercised.
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d | torch.nn.BatchNorm1d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    ckpt.export_backbone(tmp_path / "backbone.pt", model, model_cfg, 32)
    out = tmp_path / "model.onnx"
    assert main(["--checkpoint", str(tmp_path / "backbone.pt"), "--onnx", str(out)]) == 0

    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["images"]
    model.eval()
    for batch in (1, 7):  # dynamic batch: sizes other than the export's example of 2
        images = torch.randn(batch, 3, 32, 32)
        (got,) = session.run(["embeddings"], {"images": images.numpy()})
        with torch.no_grad():
            expected = model(images).numpy()
        assert got.shape == (batch, 16)
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
        unit = got / np.linalg.norm(got, axis=1, keepdims=True)
        ref = expected / np.linalg.norm(expected, axis=1, keepdims=True)
        np.testing.assert_allclose(unit, ref, atol=1e-4, rtol=0)
    assert not list(tmp_path.glob(".*.tmp"))


def test_onnx_export_at_height_width(tmp_path):
    torch.manual_seed(0)
    model_cfg = {"backbone": "iresnet18", "embedding_size": 8, "width": 0.125, "dropout": 0.0}
    model = build_backbone("iresnet18", embedding_size=8, width=0.125, image_size=(32, 16))
    ckpt.export_backbone(tmp_path / "backbone.pt", model, model_cfg, (32, 16))
    out = tmp_path / "model.onnx"
    assert main(["--checkpoint", str(tmp_path / "backbone.pt"), "--onnx", str(out)]) == 0
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape[1:] == [3, 32, 16]
    images = torch.randn(3, 3, 32, 16)
    (got,) = session.run(["embeddings"], {"images": images.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(got, model.eval()(images).numpy(), atol=1e-4, rtol=0)


def test_missing_checkpoint_is_named(tmp_path, capsys):
    assert (
        main(["--checkpoint", str(tmp_path / "nope.pt"), "--onnx", str(tmp_path / "m.onnx")]) == 1
    )
    assert "nope.pt" in capsys.readouterr().err
    assert not (tmp_path / "m.onnx").exists()


def test_every_flag_problem_is_said_before_the_checkpoint_is_read(tmp_path, capsys):
    # The same N|HxW as train.py's data.image_size and evaluate.py's --image-size; the flags
    # that belong to --onnx; an output that is a folder. The checkpoint is never opened.
    argv = ["--checkpoint", str(tmp_path / "never-read.pt"), "--arcface-torch", str(tmp_path)]
    assert main([*argv, "--image-size", "big", "--opset", "17", "--no-check"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(": ")[1] for line in lines] == [
        "--image-size",
        "--image-size",
        "--opset",
        "--no-check",
        "--arcface-torch",
    ], lines
    assert "never-read.pt" not in "".join(lines)


def test_an_input_size_the_iresnet_cannot_take_is_named(tmp_path, capsys):
    model = build_backbone("iresnet18", embedding_size=8, width=0.125, image_size=32)
    model_cfg = {"backbone": "iresnet18", "embedding_size": 8, "width": 0.125, "dropout": 0.0}
    ckpt.export_backbone(tmp_path / "backbone.pt", model, model_cfg, 32)
    out = tmp_path / "m.onnx"
    argv = ["--checkpoint", str(tmp_path / "backbone.pt"), "--onnx", str(out)]
    assert main([*argv, "--image-size", "48x48"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --image-size 48x48: this checkpoint's backbone takes 32x32")
    assert not out.exists()
