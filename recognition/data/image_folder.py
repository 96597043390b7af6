"""Image-folder dataset: one sub-folder per identity, labels by sorted folder name.

    root/<identity>/<image>.jpg     (.jpg .jpeg .png .pgm .ppm .bmp .webp, any case)

The file list is a `recognition.data.index.FolderIndex`: compact arrays, built by a parallel
scan and, through `open_index`, cached next to the data and memory-mapped, so that tens of
millions of files cost no Python object per file in the trainer or its DataLoader workers.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import overload

import numpy as np
from PIL import Image

from recognition.data.index import (
    IMAGE_EXTENSIONS,
    EmptyPolicy,
    FolderIndex,
    is_image_file,
    scan_folder,
)
from recognition.data.source import BadImagePolicy, TrainSource
from recognition.data.transforms import load_rgb, read_encoded

__all__ = ["IMAGE_EXTENSIONS", "ImageFolderDataset", "is_image_file"]

# Kept for code that imported it from here.


class _LazyStrings(Sequence[str]):
    """A read-only sequence whose items are made on access (class names, relative paths)."""

    def __init__(self, length: int, item: object) -> None:
        self._length = length
        self._item = item

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self._item(j) for j in range(*i.indices(self._length))]  # type: ignore[operator]
        if i < 0:
            i += self._length
        if not 0 <= i < self._length:
            raise IndexError(i)
        return self._item(i)  # type: ignore[operator]


class ImageFolderDataset(TrainSource):
    """`root/<identity>/<image>` files as (image, label) samples.

    image: (3, H, W) float32 in [-1, 1], decoded from any mode and resized to `image_size`
    (an int for square images, or (H, W)); label: the index of the identity folder in
    `classes`. `classes` are the sorted sub-folder names of `root` (hidden ones, starting
    with ".", are skipped), or `class_names` when given, so that a resumed or evaluated run
    keeps the labels of the run that made the checkpoint: then every name must have its
    folder, and folders not named are left out. Files inside an identity folder are taken in
    sorted order; sub-folders and files of other types are ignored.

    `classes` and `paths` (relative `<identity>/<file>`) are lazy sequences over the index;
    `labels` is the index's (N,) int32 array. `index` passes a FolderIndex built elsewhere
    (`open_index`, cached); otherwise the folder is scanned now (not cached).
    `on_empty_class` decides what an identity folder without images does (error or skip);
    `on_bad_image` what an unreadable image does (see `recognition.data.source`).

    With `train=True` each image is flipped left-right with probability 0.5 (drawn from
    torch's RNG, which DataLoader seeds per worker). The training loop instead uses
    `train=False` and applies its own seeded flips (`recognition.data.sampler.AugmentedView`).

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
        index: FolderIndex | None = None,
        on_empty_class: EmptyPolicy = "error",
        on_bad_image: BadImagePolicy = "error",
    ) -> None:
        super().__init__(root, image_size, train=train, on_bad_image=on_bad_image)
        if index is None:
            index = scan_folder(self.root, class_names=class_names, on_empty=on_empty_class)
        self.index = index
        self.labels = index.labels
        self.classes: Sequence[str] = _LazyStrings(index.num_classes, index.class_name)
        self.paths: Sequence[str] = _LazyStrings(len(index), index.relative_path)

    @property
    def num_classes(self) -> int:
        """Number of identities (the head's number of classes)."""
        return self.index.num_classes

    def class_name(self, label: int) -> str:
        return self.index.class_name(label)

    def classes_fingerprint(self) -> str:
        """SHA-256 of the class names, each followed by a newline (as the base class), from the
        index's name buffer in one pass instead of name by name."""
        index = self.index
        lines = np.insert(
            np.asarray(index.class_blob), np.asarray(index.class_offsets[1:]), ord("\n")
        )
        return hashlib.sha256(lines.tobytes()).hexdigest()

    def describe(self, index: int) -> str:
        return str(self.root / self.index.relative_path(index))

    def decode(self, index: int) -> Image.Image:
        return load_rgb(self.root / self.index.relative_path(index))

    def encoded(self, index: int) -> bytes:
        return read_encoded(self.root / self.index.relative_path(index))
