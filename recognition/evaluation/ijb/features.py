"""IJB image features: each image aligned on its landmarks and embedded, and their cache file.

A feature is model(aligned image) + model(mirror), optionally times the image's detector
score at pooling (:mod:`recognition.evaluation.ijb.templates`). An image that cannot be
decoded is left out and counted. The features of a release are written to (or read from) one
``.npz`` file that records what made them, so that 1:1 and 1:N, and a second run with other
scoring options, embed no image again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from recognition.data.alignment import align_face, template_points
from recognition.data.transforms import load_rgb, to_input_tensor
from recognition.evaluation.embeddings import DEFAULT_EXTRACTION, Extraction, open_npz, write_npz
from recognition.evaluation.ijb.protocol import IJBProtocol
from recognition.evaluation.onnx_model import OnnxInput, load_model

log = logging.getLogger(__name__)


class AlignedFaces(Dataset):
    """The protocol's images, each aligned on its landmarks: (3, S, S) float32 in [-1, 1].

    An image that cannot be decoded comes out as NaN pixels, which make its embedding row
    NaN (a backbone in eval mode treats every sample alone); :func:`image_features` counts
    those rows as unreadable.
    """

    def __init__(self, root: Path, images: Sequence[str], landmarks: np.ndarray, size: int) -> None:
        self.root = Path(root)
        self.images = list(images)
        self.landmarks = landmarks
        self.size = size
        template_points(size)  # rejects sizes the alignment cannot make, now

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> torch.Tensor:
        try:
            image = load_rgb(self.root / self.images[index])
        except ValueError as exc:
            log.warning("%s", exc)
            return torch.full((3, self.size, self.size), float("nan"))
        aligned = align_face(image, self.landmarks[index], self.size)
        return to_input_tensor(aligned, (self.size, self.size))


def image_features(
    backbone: nn.Module,
    protocol: IJBProtocol,
    image_size: int | Sequence[int],
    extraction: Extraction = DEFAULT_EXTRACTION,
) -> tuple[np.ndarray, np.ndarray]:
    """Raw features (I, D) float32 of the protocol's images and a readable mask (I,).

    A feature is backbone(aligned) + backbone(mirror) (just the first without ``flip``),
    not normalised: its norm weighs the image in the media average, as in the protocol.
    Rows of images that could not be decoded are zero and their mask False.
    """
    if not isinstance(image_size, int):
        template_points(image_size)
        image_size = int(image_size[0])
    dataset = AlignedFaces(protocol.image_root, protocol.images, protocol.landmarks, image_size)
    features = extraction(backbone, dataset, normalize=False)
    readable = np.isfinite(features).all(axis=1)
    features[~readable] = 0.0
    return features, readable


def save_features(
    path: str | os.PathLike,
    features: np.ndarray,
    readable: np.ndarray,
    images: Sequence[str],
    settings: Mapping[str, str],
) -> None:
    """Write image ``features`` (I, D), ``readable`` (I,), ``images`` and ``settings`` (.npz).

    ``settings`` ({key: text}) records what made the features (checkpoint, input size,
    flip) so that a later run with other settings is refused. Atomic: a temporary file in
    the same folder, then a rename.
    """
    write_npz(
        Path(path),
        features=np.asarray(features, np.float32),
        readable=np.asarray(readable, bool),
        images=np.asarray(images, dtype=str),
        **{f"setting_{k}": np.asarray(str(v)) for k, v in settings.items()},
    )


def load_features(
    path: str | os.PathLike, images: Sequence[str], settings: Mapping[str, str]
) -> tuple[np.ndarray, np.ndarray]:
    """(features (I, D), readable (I,)) from a file of :func:`save_features`.

    Raises ValueError naming ``path`` when it is unreadable or damaged, holds other images
    than ``images`` (another set), or was made with other ``settings`` (naming the
    setting; for ``model``, the checkpoints of both).
    """
    path = Path(path)
    with open_npz(path, "features file") as data:
        missing = [k for k in ("features", "readable", "images") if k not in data.files]
        if missing:
            raise ValueError(f"{path}: missing key(s) {missing}; not an IJB features file")
        try:
            stored = {
                key: data[f"setting_{key}"].item() if f"setting_{key}" in data.files else None
                for key in [*settings, "checkpoint"]
            }
            features, readable = data["features"], data["readable"]
            stored_images = data["images"]
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
            # A damaged member (its CRC fails) or one that needs pickle.
            raise ValueError(f"{path}: cannot read its arrays: {exc}") from None
    for key, value in settings.items():
        if stored[key] == str(value):
            continue
        if key == "model":
            raise ValueError(
                f"{path}: features made by another model (checkpoint "
                f"{stored['checkpoint']}) than this run's; remove the file or name another "
                "--save-features"
            )
        raise ValueError(
            f"{path}: features made with {key} = {stored[key]!r}, this run has {value!r}; "
            "remove the file or name another --save-features"
        )
    if stored_images.shape != (len(images),) or not np.array_equal(stored_images, images):
        raise ValueError(
            f"{path}: features of {stored_images.size} other images than this protocol's "
            f"{len(images)}; remove the file or name another --save-features"
        )
    if (
        features.ndim != 2
        or features.shape[0] != len(images)
        or readable.shape != (len(images),)
        or features.dtype.kind != "f"
    ):
        raise ValueError(f"{path}: arrays do not match its {len(images)} images")
    return features.astype(np.float32, copy=False), readable.astype(bool, copy=False)


def model_digest(model: nn.Module) -> str:
    """SHA-256 of ``model``'s state (names, dtypes, shapes, bytes): the same weights give the
    same digest whichever file or device they came from."""
    digest = hashlib.sha256()
    for key, value in model.state_dict().items():
        tensor = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{key}:{tensor.dtype}:{tuple(value.shape)};".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _size_text(image_size: int | Sequence[int]) -> str:
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    return f"{height}x{width}"


def cached_features(features_path: str | os.PathLike | None) -> bool:
    """Whether ``features_path`` names a features file to read (no model then runs).

    Raises ValueError when it names something that is not a file (a folder), before hours
    of extraction would end in a failed write.
    """
    if features_path is None:
        return False
    path = Path(features_path)
    if path.exists() and not path.is_file():
        raise ValueError(f"--save-features: {path} exists and is not a file")
    return path.is_file()


def protocol_features(
    protocol: IJBProtocol,
    *,
    checkpoint: str | os.PathLike | None = None,
    backbone: nn.Module | None = None,
    features_path: str | os.PathLike | None = None,
    image_size: int | Sequence[int] | None = None,
    extraction: Extraction = DEFAULT_EXTRACTION,
    onnx_input: OnnxInput | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Image features (I, D) and readable mask (I,) of ``protocol``: from ``features_path``
    when it is a file, else by the backbone of ``checkpoint`` (any file `load_model` reads:
    an ONNX model fed as ``onnx_input`` says), or by ``backbone`` itself, written to
    ``features_path`` when given. Both
    modes call it, so one file serves 1:1 and 1:N.

    The file records the release, flip, input size and a digest of the model's weights; a
    run that knows one of them (the model and size only with ``checkpoint``) refuses a file
    made otherwise. ``image_size`` defaults to the checkpoint's. Unreadable images are
    logged.
    """
    cached = cached_features(features_path)
    settings = {"release": protocol.name, "flip": str(extraction.flip)}
    if backbone is not None:
        settings["model"] = model_digest(backbone)
    elif checkpoint is not None:
        device = torch.device("cpu") if cached else (extraction.device or torch.device("cpu"))
        backbone, trained_size = load_model(checkpoint, device, onnx_input)
        image_size = image_size or trained_size
        settings["model"] = model_digest(backbone)
    if image_size is not None:
        settings["image_size"] = _size_text(image_size)
    if cached:
        features, readable = load_features(features_path, protocol.images, settings)
        log.info("read the features of %d images from %s", len(features), features_path)
    else:
        if backbone is None:
            raise ValueError("--ijb: needs --checkpoint (or an existing --save-features file)")
        features, readable = image_features(backbone, protocol, image_size, extraction)
        if features_path is not None:
            if checkpoint is not None:
                settings["checkpoint"] = str(Path(checkpoint).resolve())
            save_features(features_path, features, readable, protocol.images, settings)
            log.info("wrote the features of %d images to %s", len(features), features_path)
    num_unreadable = int((~readable).sum())
    if num_unreadable:
        bad = [protocol.images[i] for i in np.flatnonzero(~readable)[:5]]
        log.warning(
            "%d images could not be decoded and were left out (first: %s)",
            num_unreadable,
            ", ".join(bad),
        )
    return features, readable
