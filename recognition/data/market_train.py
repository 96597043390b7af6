"""The training crops of a person re-id data set as a training source.

    market1501   root/bounding_box_train/0002_c1s1_000451_03.jpg ...   Market-1501, DukeMTMC-reID
    msmt17       root/list_train.txt + list_val.txt over train/          MSMT17
    cuhk03       root/cuhk03_new_protocol_config_<boxes>.mat's train_idx  CUHK03 (new protocol)

(`recognition.data.reid_sets` reads each layout.) The person ids found become labels
0..C-1 in increasing id order, so class name c is the zero-padded person id. Market-1501's
crops are taken in sorted file-name order, which groups them by person, leaving out junk
(`-1`) and distractor (`0000`) crops, neither of which is in its published training split;
the others' in their lists' order.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image

from recognition.data.market1501 import PersonImages
from recognition.data.reid_sets import market_train, reid_train_set
from recognition.data.source import BadImagePolicy, TrainSource
from recognition.data.transforms import load_rgb, read_encoded


class PersonCropsDataset(TrainSource):
    """The crops `images` (a folder and paths under it, with person and camera ids) with
    labels from their person ids.

    image: (3, H, W) float32 in [-1, 1] at `image_size` (an int or (H, W); re-id uses
    (256, 128)). `root` is the data set's root (for messages and the run's records).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        image_size: int | tuple[int, int],
        images: PersonImages,
        *,
        train: bool = False,
        on_bad_image: BadImagePolicy = "error",
    ) -> None:
        super().__init__(root, image_size, train=train, on_bad_image=on_bad_image)
        self.folder = images.folder
        self.paths = list(images.paths)
        self.person_ids, labels = np.unique(images.person_ids, return_inverse=True)
        self.labels = labels.astype(np.int32)
        self.camera_ids = images.camera_ids

    @property
    def num_classes(self) -> int:
        return len(self.person_ids)

    def class_name(self, label: int) -> str:
        return f"{int(self.person_ids[label]):04d}"

    def describe(self, index: int) -> str:
        return str(self.folder / self.paths[index])

    def decode(self, index: int) -> Image.Image:
        return load_rgb(self.folder / self.paths[index])

    def encoded(self, index: int) -> bytes:
        return read_encoded(self.folder / self.paths[index])


class Market1501TrainDataset(PersonCropsDataset):
    """The crops of `root/bounding_box_train` with labels from their person ids.

    Raises FileNotFoundError / ValueError naming the folder or file.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        image_size: int | tuple[int, int],
        *,
        train: bool = False,
        on_bad_image: BadImagePolicy = "error",
    ) -> None:
        images = market_train(Path(root))
        super().__init__(root, image_size, images, train=train, on_bad_image=on_bad_image)


def msmt17_train_dataset(
    root: str | os.PathLike,
    image_size: int | tuple[int, int],
    *,
    on_bad_image: BadImagePolicy = "error",
) -> PersonCropsDataset:
    """MSMT17's training crops (data.format=msmt17: list_train.txt with list_val.txt)."""
    images = reid_train_set(root, "msmt17")
    return PersonCropsDataset(root, image_size, images, on_bad_image=on_bad_image)


def cuhk03_train_dataset(
    root: str | os.PathLike,
    image_size: int | tuple[int, int],
    *,
    on_bad_image: BadImagePolicy = "error",
    cuhk03_boxes: str = "labeled",
) -> PersonCropsDataset:
    """CUHK03's training crops of the new protocol's split (data.format=cuhk03), of the
    `cuhk03_boxes` (labeled or detected)."""
    images = reid_train_set(root, "cuhk03", cuhk03_boxes=cuhk03_boxes)
    return PersonCropsDataset(root, image_size, images, on_bad_image=on_bad_image)
