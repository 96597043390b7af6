"""Backbones from other tools: arcface_torch IResNet and torchvision ResNet-50 state dicts,
told by their content, and the way out (`recognition.export --arcface-torch`)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

import evaluate
from recognition import checkpoint as ckpt
from recognition.config import ModelConfig
from recognition.export import main as export_main
from recognition.models import build_backbone

MODEL = {"backbone": "iresnet18", "embedding_size": 8, "width": 0.125, "dropout": 0.0}


def tiny_iresnet() -> torch.nn.Module:
    """iresnet18 at width 0.125 for 32x32 inputs, with non-trivial BatchNorm statistics."""
    torch.manual_seed(0)
    model = build_backbone("iresnet18", embedding_size=8, width=0.125, image_size=32)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d | torch.nn.BatchNorm1d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
                module.bias.uniform_(-0.2, 0.2)
    return model.eval()


@pytest.fixture(scope="module")
def torchvision_file(tmp_path_factory) -> Path:
    """A torchvision ResNet-50 state dict (ImageNet layout: fc 1000 x 2048), random weights."""
    torch.manual_seed(1)
    model = torchvision.models.resnet50(weights=None)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.1, 0.1)
                module.running_var.uniform_(0.5, 2.0)
    path = tmp_path_factory.mktemp("tv") / "resnet50.pth"
    torch.save(model.state_dict(), path)
    return path


def image_folder(root: Path, size: tuple[int, int] = (32, 32)) -> Path:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    for name in ("a.png", "b.png", "c.png"):
        pixels = rng.integers(0, 255, size=(*size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / name)
    return root


def embed_folder(checkpoint: Path, root: Path, out: Path) -> np.ndarray:
    argv = ["--checkpoint", str(checkpoint), "--images", str(root), "--workers", "0"]
    assert evaluate.main(argv + ["--export-embeddings", str(out)]) == 0
    with np.load(out) as f:
        return f["embeddings"]


def test_arcface_torch_state_dict_gives_the_backbone_output_exactly(tmp_path):
    model = tiny_iresnet()
    # arcface_torch writes torch.save(backbone.module.state_dict(), "model.pt").
    torch.save(model.state_dict(), tmp_path / "model.pt")
    model_cfg, image_size, state = ckpt.load_backbone_file(tmp_path / "model.pt")
    assert model_cfg == dataclasses.asdict(
        ModelConfig(backbone="iresnet18", embedding_size=8, width=0.125)
    )
    assert image_size == 32  # told from fc's inputs: 8 channels x 2 x 2
    assert list(state) == list(model.state_dict())
    loaded, _ = ckpt.load_backbone(tmp_path / "model.pt", torch.device("cpu"))
    images = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(images), model(images))

    # evaluate.py on it gives the embeddings of the project's own export of the same model.
    ckpt.export_backbone(tmp_path / "backbone.pt", model, MODEL, 32)
    root = image_folder(tmp_path / "faces")
    ours = embed_folder(tmp_path / "backbone.pt", root, tmp_path / "ours.npz")
    theirs = embed_folder(tmp_path / "model.pt", root, tmp_path / "theirs.npz")
    np.testing.assert_array_equal(theirs, ours)


def test_fp16_and_data_parallel_state_dicts_load_as_fp32(tmp_path):
    model = tiny_iresnet()
    half = {
        f"module.{k}": v.half() if v.is_floating_point() else v
        for k, v in model.state_dict().items()
    }
    torch.save(half, tmp_path / "backbone.pth")
    _, _, state = ckpt.load_backbone_file(tmp_path / "backbone.pth")
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    # Reference: the same model with its weights rounded through fp16, run in fp32.
    reference = tiny_iresnet()
    with torch.no_grad():
        for value in reference.state_dict().values():
            if value.is_floating_point():
                value.copy_(value.half().float())
    loaded, _ = ckpt.load_backbone(tmp_path / "backbone.pth", torch.device("cpu"))
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(images), reference(images))


def _missing(state):
    del state["layer2.0.bn1.weight"]


def _extra(state):
    state["head.weight"] = torch.zeros(3, 8)


def _shape(state):
    state["layer2.0.conv1.weight"] = torch.zeros(16, 8, 1, 1)


def _embedding(state):
    for key in ("features.weight", "features.bias", "features.running_mean"):
        state[key] = state[key][:4]


def _depth(state):
    for key in [k for k in state if k.startswith("layer3.1.")]:
        del state[key]


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (_missing, "missing key layer2.0.bn1.weight"),
        (_extra, "unexpected key head.weight"),
        (_shape, "layer2.0.conv1.weight has shape (16, 8, 1, 1), expected (16, 8, 3, 3)"),
        (_embedding, "features.weight has shape (4,), expected (8,)"),
        (_depth, "blocks per stage are (2, 2, 1, 2)"),
    ],
)
def test_misfit_state_dict_is_refused_naming_it(tmp_path, capsys, damage, named):
    state = tiny_iresnet().state_dict()
    damage(state)
    torch.save(state, tmp_path / "backbone.pth")
    out = tmp_path / "emb.npz"
    root = image_folder(tmp_path / "faces")
    argv = ["--checkpoint", str(tmp_path / "backbone.pth"), "--images", str(root)]
    assert evaluate.main(argv + ["--export-embeddings", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err and "backbone.pth" in err, err
    assert not out.exists()


def test_whole_pickled_module_and_other_content_are_refused(tmp_path, capsys):
    torch.save(tiny_iresnet(), tmp_path / "whole.pth")
    torch.save({"epoch": 3, "state_dict_backbone": {}}, tmp_path / "other.pth")
    torch.save({"conv1.weight": torch.zeros(8, 3, 3, 3)}, tmp_path / "stem.pth")
    expected = {
        "whole.pth": "torch.save(model.state_dict()",
        "other.pth": "entry 'epoch' is a int, not a tensor",
        "stem.pth": "none of layer1.0.prelu.weight, conv_sep.layers.0.weight, patch_embed",
    }
    for name, named in expected.items():
        argv = ["--checkpoint", str(tmp_path / name), "--bin", str(tmp_path / "x.bin")]
        assert evaluate.main(argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and named in err and name in err, err


def test_torchvision_resnet50_loads_as_the_reid_trunk(torchvision_file, caplog):
    model_cfg, image_size, state = ckpt.load_backbone_file(torchvision_file)
    assert model_cfg["trunk_only"] is True
    del model_cfg["trunk_only"]
    assert model_cfg == dataclasses.asdict(
        ModelConfig(backbone="resnet50_reid", embedding_size=2048, width=1.0)
    )
    assert image_size == (256, 128)
    source = torch.load(torchvision_file, weights_only=True)
    trunk = [k for k in source if not k.startswith("fc.")]
    assert state.keys() == {f"base.{k}" for k in trunk}
    assert all(torch.equal(state[f"base.{k}"], source[k]) for k in trunk)

    with caplog.at_level(logging.INFO):
        loaded, _ = ckpt.load_backbone(torchvision_file, torch.device("cpu"))
    neck_lines = [r for r in caplog.records if "neck starts fresh" in r.getMessage()]
    assert len(neck_lines) == 1
    # Reference: torchvision's own model with the re-id baseline's last stride 1, pooled.
    reference = torchvision.models.resnet50(weights=None)
    reference.load_state_dict(source)
    reference.layer4[0].conv2.stride = (1, 1)
    reference.layer4[0].downsample[0].stride = (1, 1)
    reference.fc = torch.nn.Identity()
    images = torch.randn(2, 3, 64, 32)
    with torch.no_grad():
        expected = reference.eval()(images)  # (2, 2048) pooled features
        got = loaded(images)
    # The fresh BN neck in eval mode: x / sqrt(1 + eps), the identity up to scale.
    torch.testing.assert_close(got, expected / (1 + 1e-5) ** 0.5, atol=1e-5, rtol=1e-5)


def test_torchvision_misfit_is_refused_naming_it(torchvision_file, tmp_path):
    state = torch.load(torchvision_file, weights_only=True)
    state["layer2.0.conv1.weight"] = state["layer2.0.conv1.weight"][:64]
    torch.save(state, tmp_path / "r50.pth")
    with pytest.raises(ValueError, match=r"r50.pth: not a torchvision ResNet-50 state dict: "):
        ckpt.load_backbone_file(tmp_path / "r50.pth")
    with pytest.raises(ValueError, match=r"layer2.0.conv1.weight has shape \(64, 256, 1, 1\)"):
        ckpt.load_backbone_file(tmp_path / "r50.pth")


def test_arcface_torch_export_round_trip(tmp_path, torchvision_file, capsys):
    model = tiny_iresnet()
    ckpt.export_backbone(tmp_path / "backbone.pt", model, MODEL, 32)
    out = tmp_path / "arcface" / "backbone.pth"
    assert (
        export_main(["--checkpoint", str(tmp_path / "backbone.pt"), "--arcface-torch", str(out)])
        == 0
    )
    # What arcface_torch's get_model(...).load_state_dict takes: a plain fp32 state dict
    # with the IResNet's own keys.
    written = torch.load(out, weights_only=True)
    assert list(written) == list(model.state_dict())
    assert all(v.dtype == torch.float32 for v in written.values() if v.is_floating_point())
    assert not list(out.parent.glob(".*tmp*"))
    model_cfg, image_size, _ = ckpt.load_backbone_file(out)
    assert model_cfg == dataclasses.asdict(ModelConfig(**MODEL)) and image_size == 32
    loaded, _ = ckpt.load_backbone(out, torch.device("cpu"))
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(images), model(images))

    refused = tmp_path / "reid.pth"
    argv = ["--checkpoint", str(torchvision_file), "--arcface-torch", str(refused)]
    assert export_main(argv) == 1
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "arcface_torch's models are IResNets, MobileFaceNets and ViTs" in err
    )
    assert not refused.exists()
