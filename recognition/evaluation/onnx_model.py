"""ONNX models as evaluation backbones: an onnxruntime session behind the `nn.Module` call
that embedding extraction makes, so every evaluation (pairs, .bin, IJB, re-id, embedding
export) runs an ``.onnx`` file through the same code as a torch backbone.

The extraction hands the model images as training normalises them, (pixel - 127.5) / 127.5
on RGB. That is also the convention of insightface's published recognition models and of
this project's own ONNX export, so by default the images go into the graph unchanged;
`OnnxInput` re-normalises them for a graph that wants another mean, scale or BGR order.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from recognition.checkpoint import load_backbone

log = logging.getLogger(__name__)

# The training inputs' normalisation: pixel values in [0, 255] -> (pixel - 127.5) / 127.5.
PIXEL_MEAN = 127.5
PIXEL_STD = 127.5
# The input size taken when a graph leaves its height and width dynamic (aligned faces).
DYNAMIC_SIZE_DEFAULT = (112, 112)
# An ONNX file is a serialised ModelProto, whose first field (ir_version, number 1, a
# varint) starts with the byte 0x08; torch files start with b"PK" (zip) or 0x80 (pickle).
ONNX_FIRST_BYTE = b"\x08"


@dataclass(frozen=True)
class OnnxInput:
    """How an ONNX graph wants its images: ``(pixel - mean) / std`` per RGB channel, on
    pixel values in [0, 255], with the channels in BGR order when ``bgr``."""

    mean: tuple[float, float, float] = (PIXEL_MEAN, PIXEL_MEAN, PIXEL_MEAN)
    std: tuple[float, float, float] = (PIXEL_STD, PIXEL_STD, PIXEL_STD)
    bgr: bool = False

    @property
    def is_training_normalisation(self) -> bool:
        return self == OnnxInput()


def is_onnx_file(path: Path) -> bool:
    """Whether `path` is an ONNX model: named ``*.onnx``, or a file whose first byte is a
    ModelProto's."""
    if path.suffix.lower() == ".onnx":
        return True
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(1) == ONNX_FIRST_BYTE


def load_model(
    path: str | os.PathLike, device: torch.device, onnx_input: OnnxInput | None = None
) -> tuple[nn.Module, int | tuple[int, int]]:
    """The backbone evaluation runs and its input size: an `OnnxBackbone` for an ONNX file,
    else `load_backbone`'s model (any checkpoint or backbone file). ``onnx_input`` (None: the
    default) applies to ONNX models only; given with another file it is refused."""
    path = Path(path)
    if is_onnx_file(path):
        model = OnnxBackbone(path, device, onnx_input or OnnxInput())
        if model.image_size is not None:
            return model, model.image_size
        log.info(
            "%s: the graph's input height and width are dynamic; embedding at %dx%d "
            "(--image-size sets another)",
            path,
            *DYNAMIC_SIZE_DEFAULT,
        )
        return model, DYNAMIC_SIZE_DEFAULT
    if onnx_input is not None:
        raise ValueError(f"--onnx-mean, --onnx-std, --onnx-bgr: for ONNX models; {path} is not one")
    return load_backbone(path, device)


class OnnxBackbone(nn.Module):
    """An ONNX model run by onnxruntime, called like a backbone: images (B, 3, H, W)
    normalised as for training -> embeddings (B, D) float32, on the images' device.

    The graph must have one input of shape (batch, 3, height, width); its first output is
    the embedding (flattened to (B, D)). A graph of fixed batch n is fed n images at a time
    (the last run padded). Runs on CUDA where ``device`` is a GPU and onnxruntime's CUDA
    provider is installed, else on the CPU. Its buffers (a digest of the file, the input
    normalisation) stand for the weights where a model's state is compared.
    """

    def __init__(self, path: Path, device: torch.device, onnx_input: OnnxInput) -> None:
        super().__init__()
        try:
            import onnxruntime
        except ImportError:
            raise ValueError(
                f"checkpoint {path}: an ONNX model needs onnxruntime (pip install onnxruntime)"
            ) from None
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {path}: no such file")
        providers = ["CPUExecutionProvider"]
        if device.type == "cuda" and "CUDAExecutionProvider" in (
            onnxruntime.get_available_providers()
        ):
            providers.insert(0, "CUDAExecutionProvider")
        try:
            self.session = onnxruntime.InferenceSession(str(path), providers=providers)
        except Exception as exc:  # onnxruntime raises its own types for unreadable graphs
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ValueError(
                f"checkpoint {path}: not an ONNX model onnxruntime can load: {first_line}"
            ) from None
        image_input = _image_input(path, self.session.get_inputs())
        self.input_name = image_input.name
        self.output_name = self.session.get_outputs()[0].name
        self.input_dtype = np.float16 if image_input.type == "tensor(float16)" else np.float32
        batch, _, height, width = image_input.shape
        self.fixed_batch = batch if isinstance(batch, int) and batch > 0 else None
        self.image_size: tuple[int, int] | None = None
        if all(isinstance(s, int) and s > 0 for s in (height, width)):
            self.image_size = (height, width)
        self.onnx_input = onnx_input
        self.register_buffer("file_digest", _file_digest(path))
        self.register_buffer(
            "normalisation", torch.tensor([*onnx_input.mean, *onnx_input.std, onnx_input.bgr])
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        batch = self._graph_input(images)  # (B, 3, H, W), as the graph wants it
        step = self.fixed_batch or len(batch)
        outputs = []
        for start in range(0, len(batch), step):
            chunk = batch[start : start + step]
            num_images = len(chunk)
            if num_images < step:  # a fixed-batch graph: pad the last run
                padding = np.zeros((step - num_images, *chunk.shape[1:]), chunk.dtype)
                chunk = np.concatenate([chunk, padding])
            (out,) = self.session.run([self.output_name], {self.input_name: chunk})
            outputs.append(np.asarray(out, dtype=np.float32).reshape(len(chunk), -1)[:num_images])
        return torch.from_numpy(np.concatenate(outputs)).to(images.device)

    def _graph_input(self, images: torch.Tensor) -> np.ndarray:
        """`images` (normalised as for training) as the graph's input array."""
        images = images.detach().float().cpu()
        if not self.onnx_input.is_training_normalisation:
            pixels = images * PIXEL_STD + PIXEL_MEAN  # back to [0, 255], RGB
            mean = torch.tensor(self.onnx_input.mean).view(1, 3, 1, 1)
            std = torch.tensor(self.onnx_input.std).view(1, 3, 1, 1)
            images = (pixels - mean) / std
            if self.onnx_input.bgr:
                images = images.flip(1)
        return images.numpy().astype(self.input_dtype, copy=False)


def _image_input(path: Path, inputs: list) -> object:
    """The graph's one input, when it takes float images (batch, 3, height, width); else a
    ValueError naming the file and the input."""
    if len(inputs) != 1:
        names = ", ".join(repr(i.name) for i in inputs)
        raise ValueError(
            f"checkpoint {path}: the ONNX graph has {len(inputs)} inputs ({names}); a "
            "backbone takes one, the images"
        )
    (image_input,) = inputs
    shape = list(image_input.shape)
    channels = shape[1] if len(shape) == 4 else None
    is_float = image_input.type in ("tensor(float)", "tensor(float16)")
    if len(shape) != 4 or (isinstance(channels, int) and channels != 3) or not is_float:
        raise ValueError(
            f"checkpoint {path}: the ONNX input {image_input.name!r} is {image_input.type} of "
            f"shape {shape}; expected float images (batch, 3, height, width)"
        )
    return image_input


def _file_digest(path: Path) -> torch.Tensor:
    """SHA-256 of the file's bytes, as 32 uint8 values."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return torch.tensor(list(digest.digest()), dtype=torch.uint8)
