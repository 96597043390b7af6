"""`train.teacher`: the backbone a distilled run learns from, read once and checked before
any work, and built frozen (docs/distillation.md).

Any file `recognition.checkpoint.backbone_files` reads (a backbone export, a training
checkpoint directory, an arcface_torch IResNet / MobileFaceNet / ViT state dict) or an ONNX
model (run by onnxruntime, on the CPU unless its CUDA provider is installed). What does not
make a teacher stops the run in one line naming train.teacher and the file: a missing or
unreadable file, weights that fit no backbone, a classification trunk (a torchvision
ResNet-50: it has no trained embedding).

The file's SHA-256 (of every file, for a checkpoint directory) is the teacher's identity: a
run records it, and a resumed run refuses another file (`recognition.training.teacher_cache`).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recognition.checkpoint.backbone_files import load_backbone_file
from recognition.checkpoint.foreign import TRUNK_ONLY
from recognition.config import ConfigError
from recognition.config.values import image_size_pair
from recognition.evaluation.onnx_model import (
    DYNAMIC_SIZE_DEFAULT,
    OnnxBackbone,
    OnnxInput,
    is_onnx_file,
)
from recognition.models import build_backbone
from recognition.training.finetune.init_backbone import check_state_fits


@dataclass(frozen=True)
class TeacherFile:
    """A teacher file as `read_teacher` read it."""

    path: Path
    sha256: str
    """Of the file's bytes (a checkpoint directory: of its files, by name); "" when not
    computed (the planner's outline)."""
    model_cfg: dict[str, Any] | None
    """The backbone's model config dict; None for an ONNX model."""
    image_hw: tuple[int, int]
    """The input size the teacher takes (an ONNX graph's, or 112x112 where it leaves it free)."""
    embedding_size: int
    state: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    """fp32 weights on the CPU; None for an ONNX model and in an outline."""

    @property
    def is_onnx(self) -> bool:
        return self.model_cfg is None


def read_teacher(path: str | Path, *, with_weights: bool = True) -> TeacherFile:
    """The teacher file `path` read and checked (see the module docstring): ConfigError in
    one line naming train.teacher and the file when it does not make a teacher.
    `with_weights=False` keeps neither the weights nor computes the SHA-256 (what the run
    planner needs: the model, its input and embedding sizes)."""
    path = Path(path)
    where = f"train.teacher: {path}"
    if not path.exists():
        raise ConfigError(f"{where}: no such file or directory")
    digest = file_digest(path) if with_weights else ""
    if is_onnx_file(path):
        try:
            model = OnnxBackbone(path, torch.device("cpu"), OnnxInput())
            image_hw = model.image_size or DYNAMIC_SIZE_DEFAULT
            size = int(model(torch.zeros(1, 3, *image_hw)).shape[1])
        except (ValueError, OSError, RuntimeError) as exc:
            raise ConfigError(f"{where}: {_one_line(exc)}") from None
        return TeacherFile(path, digest, None, image_hw, size)
    try:
        model_cfg, image_size, state = load_backbone_file(path)
    except (ValueError, OSError, KeyError) as exc:
        raise ConfigError(f"{where}: {_one_line(exc)}") from None
    if model_cfg.get(TRUNK_ONLY):
        raise ConfigError(
            f"{where}: a classification network's trunk (ImageNet weights) has no trained "
            "embedding to distil from; use a face or re-id backbone"
        )
    image_hw = image_size_pair(image_size)
    try:
        with torch.device("meta"):
            expected = _build(model_cfg, image_hw).state_dict()
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"{where}: {_one_line(exc)}") from None
    check_state_fits(where, expected, state)
    size = int(model_cfg["embedding_size"])
    return TeacherFile(path, digest, model_cfg, image_hw, size, state if with_weights else None)


@functools.lru_cache(maxsize=4)
def _outline(path: str, mtime_ns: int, size: int) -> TeacherFile:
    return read_teacher(path, with_weights=False)


def teacher_outline(path: str | Path) -> TeacherFile:
    """`read_teacher(path, with_weights=False)`, read once per file version (the planner
    plans many configs of one run)."""
    try:
        stat = Path(path).stat()
    except OSError:
        return read_teacher(path, with_weights=False)  # raises, naming the file
    return _outline(str(path), stat.st_mtime_ns, stat.st_size)


def build_teacher(teacher: TeacherFile, device: torch.device) -> nn.Module:
    """The teacher as a module on `device`: fp32, in eval mode, without gradients; without
    weights (as built) for an outline. Draws nothing from the run's random streams: a
    student distilled with seed s starts from the weights it has alone with seed s."""
    if teacher.is_onnx:
        return OnnxBackbone(teacher.path, device, OnnxInput())
    assert teacher.model_cfg is not None
    with torch.random.fork_rng(devices=[]):  # the initial weights it draws are overwritten
        module = _build(teacher.model_cfg, teacher.image_hw)
    if teacher.state is not None:
        module.load_state_dict(teacher.state, strict=True)
    module = module.to(device) if device.type != "cpu" else module
    return module.eval().requires_grad_(False)


def _build(model_cfg: dict[str, Any], image_hw: tuple[int, int]) -> nn.Module:
    return build_backbone(
        model_cfg["backbone"],
        embedding_size=int(model_cfg["embedding_size"]),
        width=model_cfg.get("width", 1.0),
        dropout=model_cfg.get("dropout", 0.0),
        image_size=image_hw,
    )


def file_digest(path: Path) -> str:
    """SHA-256 of the file `path`, or of every file under the directory `path` (each one's
    relative name and bytes, in name order)."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
