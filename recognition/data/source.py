"""What every training source shares: labels as an array, lazy class names, bad images.

A training source (image folder, RecordIO pack, Market-1501 crops) is a `TrainSource`:

    len(source), source[i] -> ((3, H, W) float32 in [-1, 1], label)
    source.pixels(i)        ((3, H, W) uint8, label): the same image before normalisation
    source.encoded(i)       the sample's encoded bytes (file or record), for `data.decode=gpu`
    source.labels           (N,) int array, for identity-balanced sampling
    source.num_classes
    source.class_name(c)    one name at a time; `write_classes` streams them all to a file
    source.classes_fingerprint()  SHA-256 of the class names in label order

Class names are never held as one Python list: at two million classes such a list costs
hundreds of megabytes per process, and a checkpoint that pickled it would carry it too.

**Bad images** (`on_bad_image`): with `"error"` the first unreadable image stops the run with
a ValueError naming the file. With `"skip"` the sample is replaced by the next readable image
of the same identity (in index order, wrapping around), so the label and the batch size stay
as they were and the choice is the same on every run; the substitution is counted in a
counter shared by the DataLoader workers, the first `MAX_LOGGED_BAD_IMAGES` paths are
logged, and `take_bad_image_count()` reports (and resets) the total, which the training loop
logs at the end of every epoch. An identity none of whose images is readable is an error.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Literal, TypeVar

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from recognition.config import image_size_pair
from recognition.data.transforms import hflip, normalise, to_pixels

log = logging.getLogger(__name__)

BadImagePolicy = Literal["error", "skip"]
MAX_LOGGED_BAD_IMAGES = 5

T = TypeVar("T")


class TrainSource(Dataset):
    """Base of the training sources (see the module docstring).

    The constructor takes the data's `root`, the input `image_size` (a side or (H, W)), whether
    to flip at random (`train`) and the bad-image policy. Subclasses set `labels` and
    implement `num_classes`, `class_name`, `describe(index)` (the file or record, for
    messages), `decode(index)` (a PIL RGB image, or a ValueError naming the file) and
    `encoded(index)` (the encoded bytes that `decode` decodes).
    """

    labels: np.ndarray

    def __init__(
        self,
        root: str | os.PathLike,
        image_size: int | Sequence[int],
        *,
        train: bool = False,
        on_bad_image: BadImagePolicy = "error",
    ) -> None:
        self.root = Path(root)
        self.image_size = image_size_pair(image_size)
        self.train = train
        if on_bad_image not in ("error", "skip"):
            raise ValueError(f"on_bad_image must be error or skip, got {on_bad_image!r}")
        self.on_bad_image = on_bad_image
        # Shared memory, inherited by forked DataLoader workers: their substitutions add up
        # in the main process.
        self._bad_images = multiprocessing.get_context().Value("q", 0, lock=True)
        self._members: tuple[np.ndarray, np.ndarray] | None = None

    # ------------------------------------------------------------------ to implement
    @property
    def num_classes(self) -> int:
        raise NotImplementedError

    def class_name(self, label: int) -> str:
        raise NotImplementedError

    def describe(self, index: int) -> str:
        raise NotImplementedError

    def decode(self, index: int) -> Image.Image:
        raise NotImplementedError

    def encoded(self, index: int) -> bytes:
        raise NotImplementedError

    # ------------------------------------------------------------------ samples
    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        """Sample `index` as ((3, H, W) float32 image in [-1, 1], label)."""
        pixels, label = self.pixels(index)
        tensor = normalise(pixels)
        if self.train and torch.rand(()) < 0.5:
            tensor = hflip(tensor)
        return tensor, label

    def pixels(self, index: int) -> tuple[torch.Tensor, int]:
        """Sample `index` decoded and resized, not normalised: ((3, H, W) uint8, label)."""
        index = int(index)
        label = int(self.labels[index])
        image = self.load_with_policy(index, self.decode)
        return to_pixels(image, self.image_size), label

    def load_with_policy(self, index: int, load: Callable[[int], T]) -> T:
        """`load(index)` (`decode`, or another reader of the sample) under `on_bad_image`.

        A ValueError from `load` is raised again with the skip hint ("error"), or the sample
        is replaced by `load` of the next readable image of its identity ("skip").
        """
        try:
            return load(index)
        except ValueError as error:
            if self.on_bad_image == "error":
                raise _with_skip_hint(error) from None
            return self._substitute(index, int(self.labels[index]), error, load)

    def _substitute(self, index: int, label: int, error: ValueError, load: Callable[[int], T]) -> T:
        with self._bad_images.get_lock():
            self._bad_images.value += 1
            count = self._bad_images.value
        if count <= MAX_LOGGED_BAD_IMAGES:
            log.warning("skipping unreadable image (%s); using another of its identity", error)
        members = self.members(label)  # ascending, and holding `index`
        position = int(np.searchsorted(members, index))
        for step in range(1, len(members)):
            other = int(members[(position + step) % len(members)])
            try:
                return load(other)
            except ValueError:
                continue
        raise ValueError(
            f"identity {self.class_name(label)!r} (label {label}): none of its "
            f"{len(members)} images is readable, e.g. {self.describe(index)}"
        )

    def _member_table(self) -> tuple[np.ndarray | None, np.ndarray]:
        if self._members is None:
            labels = np.asarray(self.labels)
            if len(labels) < 2 or bool(np.all(labels[1:] >= labels[:-1])):
                order = None
                sorted_labels = labels
            else:
                order = np.argsort(labels, kind="stable")
                sorted_labels = labels[order]
            starts = np.searchsorted(sorted_labels, np.arange(self.num_classes + 1))
            self._members = (order, starts)  # type: ignore[assignment]
        return self._members  # type: ignore[return-value]

    def members(self, label: int) -> np.ndarray:
        """Indices of the samples of class `label`, ascending."""
        order, starts = self._member_table()
        lo, hi = int(starts[label]), int(starts[label + 1])
        if order is None:
            return np.arange(lo, hi)
        return np.sort(order[lo:hi])

    def take_bad_image_count(self) -> int:
        """Bad images substituted since the last call (by this process and its workers)."""
        with self._bad_images.get_lock():
            count = int(self._bad_images.value)
            self._bad_images.value = 0
        return count

    # ------------------------------------------------------------------ class names
    def iter_class_names(self) -> Iterator[str]:
        for label in range(self.num_classes):
            yield self.class_name(label)

    def write_classes(self, path: str | os.PathLike) -> None:
        """Write the class names, one per line in label order, atomically (tmp + rename)."""
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w", encoding="utf-8", errors="surrogateescape") as f:
            batch: list[str] = []
            for name in self.iter_class_names():
                batch.append(name)
                if len(batch) == 65536:
                    f.write("\n".join(batch) + "\n")
                    batch = []
            if batch:
                f.write("\n".join(batch) + "\n")
        os.replace(tmp, path)

    def classes_fingerprint(self) -> str:
        """SHA-256 of the class names in label order (each name followed by a newline)."""
        h = hashlib.sha256()
        for name in self.iter_class_names():
            h.update(name.encode("utf-8", "surrogateescape") + b"\n")
        return h.hexdigest()


def _with_skip_hint(error: ValueError) -> ValueError:
    """`error` (of its own type) with the policy that would have trained on in its message."""
    message = f"{error} (data.on_bad_image=skip trains on with another image of the identity)"
    try:
        return type(error)(message)
    except TypeError:  # a type with another constructor: keep it as it is
        return error
