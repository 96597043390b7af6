"""Image-folder dataset: one sub-folder per identity, labels by sorted folder name.

    root/<identity>/<image>.jpg     (.jpg .jpeg .png .pgm .ppm .bmp .webp, any case)

The index is two plain lists (relative paths and labels) built by listing the folders once.
That is fine up to a few hundred thousand classes; a compact, cached index for millions of
classes is a separate concern.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset

from recognition.data.transforms import hflip, load_rgb, to_input_tensor

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".pgm", ".ppm", ".bmp", ".webp")


def is_image_file(name: str) -> bool:
    """Whether the file name `name` has one of IMAGE_EXTENSIONS, in any letter case."""
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def _image_size_pair(image_size: int | Sequence[int]) -> tuple[int, int]:
    """`image_size` (an int, or (H, W)) as a (H, W) tuple of positive ints."""
    if isinstance(image_size, int):
        size: tuple = (image_size, image_size)
    elif isinstance(image_size, Sequence):
        size = tuple(image_size)
    else:
        size = ()
    if len(size) != 2 or not all(isinstance(v, int) and v > 0 for v in size):
        raise ValueError(f"image_size must be a positive int or (H, W), got {image_size!r}")
    return size  # type: ignore[return-value]


class ImageFolderDataset(Dataset):
    """`root/<identity>/<image>` files as (image, label) samples.

    image: (3, H, W) float32 in [-1, 1], decoded from any mode and resized to `image_size`
    (an int for square images, or (H, W)); label: the index of the identity folder in
    `classes`. `classes` is the sorted list of sub-folder names of `root` (hidden ones,
    starting with ".", are skipped), or `class_names` when given, so that a resumed or
    evaluated run keeps the labels of the run that made the checkpoint: then every name must
    have its folder, and folders not named are left out. Files inside an identity folder are
    taken in sorted order; sub-folders and files of other types are ignored.

    With `train=True` each image is flipped left-right with probability 0.5 (drawn from
    torch's RNG, which DataLoader seeds per worker). The training loop may instead use
    `train=False` and apply its own seeded flips (`recognition.data.sampler.AugmentedView`).

    Raises FileNotFoundError for a missing `root` or named class folder, ValueError for a
    root without class folders or a class folder without images (naming it); reading a
    corrupt image raises ValueError naming the file.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        image_size: int | tuple[int, int],
        *,
        train: bool = False,
        class_names: Sequence[str] | None = None,
    ) -> None:
        self.root = Path(root)
        self.image_size = _image_size_pair(image_size)
        self.train = train
        if not self.root.exists():
            raise FileNotFoundError(f"image folder {self.root} does not exist")
        if not self.root.is_dir():
            raise NotADirectoryError(f"image folder {self.root} is not a directory")
        found = sorted(
            entry.name
            for entry in os.scandir(self.root)
            if entry.is_dir() and not entry.name.startswith(".")
        )
        if class_names is None:
            self.classes: list[str] = found
        else:
            self.classes = list(class_names)
            if len(set(self.classes)) != len(self.classes):
                raise ValueError(f"class_names for {self.root} holds a name twice")
            missing = sorted(set(self.classes) - set(found))
            if missing:
                raise FileNotFoundError(
                    f"{self.root}: {len(missing)} identity folders named in class_names are "
                    f"missing, e.g. {missing[0]!r}"
                )
        if not self.classes:
            raise ValueError(
                f"{self.root}: no identity folders (expected {self.root}/<identity>/<image>)"
            )

        # Relative paths keep the index small and the data set movable.
        self.paths: list[str] = []
        self.labels: list[int] = []
        for label, name in enumerate(self.classes):
            folder = self.root / name
            files = sorted(
                entry.name
                for entry in os.scandir(folder)
                if entry.is_file() and is_image_file(entry.name)
            )
            if not files:
                raise ValueError(
                    f"{folder}: identity folder holds no images "
                    f"(looked for {', '.join(IMAGE_EXTENSIONS)})"
                )
            self.paths.extend(f"{name}/{file_name}" for file_name in files)
            self.labels.extend([label] * len(files))

    @property
    def num_classes(self) -> int:
        """Number of identities (the head's number of classes)."""
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        """Sample `index` as ((3, H, W) float32 image in [-1, 1], label)."""
        image = to_input_tensor(load_rgb(self.root / self.paths[index]), self.image_size)
        if self.train and torch.rand(()) < 0.5:
            image = hflip(image)
        return image, self.labels[index]
