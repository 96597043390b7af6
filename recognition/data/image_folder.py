"""Image-folder dataset: one sub-folder per identity, labels by sorted folder name."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset

from recognition.data.transforms import load_rgb, to_input_tensor

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".pgm", ".ppm", ".bmp", ".webp")


class ImageFolderDataset(Dataset):
    """`root/<identity>/<image>` files as (image, label) samples.

    image: (3, H, W) float32 in [-1, 1], resized to `image_size`; label: the index of the
    identity folder in `classes` (sorted folder names, or the given `class_names` order so
    that a resumed or evaluated run keeps its labels). With `train=True` images are flipped
    at random; the training loop instead uses `train=False` and seeded flips
    (`recognition.data.sampler.AugmentedView`) so that resumed runs see the same data.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        image_size: int | tuple[int, int],
        *,
        train: bool = False,
        class_names: Sequence[str] | None = None,
    ):
        self.root = Path(root)
        self.image_size = (image_size, image_size) if isinstance(image_size, int) else image_size
        self.train = train
        if not self.root.is_dir():
            raise FileNotFoundError(f"data.root: image folder {self.root} does not exist")
        found = sorted(e.name for e in os.scandir(self.root) if e.is_dir())
        if class_names is None:
            self.classes = found
        else:
            missing = sorted(set(class_names) - set(found))
            if missing:
                raise FileNotFoundError(
                    f"{self.root}: {len(missing)} identity folders of the run are missing, "
                    f"e.g. {missing[0]!r}"
                )
            self.classes = list(class_names)
        if not self.classes:
            raise ValueError(f"{self.root}: no identity folders (expected root/<identity>/<image>)")
        self.paths: list[str] = []
        self.labels: list[int] = []
        for label, name in enumerate(self.classes):
            folder = self.root / name
            files = sorted(
                e.name
                for e in os.scandir(folder)
                if e.is_file() and os.path.splitext(e.name)[1].lower() in IMAGE_EXTENSIONS
            )
            if not files:
                raise ValueError(f"{folder}: identity folder holds no images")
            self.paths.extend(f"{name}/{f}" for f in files)
            self.labels.extend([label] * len(files))

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = load_rgb(self.root / self.paths[index])
        tensor = to_input_tensor(image, self.image_size)
        if self.train and torch.rand(()) < 0.5:
            tensor = tensor.flip(-1)
        return tensor, self.labels[index]
