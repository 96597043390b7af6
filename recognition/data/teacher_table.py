"""The teacher's embeddings of every training image, on disk: what a distilled run's loader
hands out beside each image (train.teacher, docs/distillation.md).

Whether a table can stand for the teacher at all is `cached_views`: the teacher must see
exactly the image the student sees, so a table holds one embedding per *view* an image can
take, and that is possible only while the views are few and known in advance. Today the
one random choice is the flip (`draw_flip`): without it an image has one view, with it two
(as is and mirrored), and the table holds both. Any augmentation drawn from a continuous
range (crops, colour) has no finite set of views: then no table, and the teacher runs
beside the student on the very images of the step.

On disk (a folder, `teacher/` of the run directory): the rows of W parts, written in
parallel by the W ranks that computed them: part r holds the samples r, r + W, r + 2W, ...
as a (rows, views, D) float16 array in `.npy` format, so sample i is row i // W of part
i % W. The embeddings are L2-normalised (float16 keeps a unit vector's components to
about 3e-4, far below what separates two identities). The parts are memory-mapped: the
loader's workers share the pages, and a table of millions of images costs no memory.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from recognition.config import DataConfig
from recognition.data.source import TrainSource
from recognition.data.transforms import to_input_tensor

TABLE_DTYPE = np.float16


def cached_views(data_cfg: DataConfig) -> tuple[bool, ...] | None:
    """The views of a training image its teacher embedding can be cached for, as the flips
    they are (False: as is, True: mirrored), or None when the teacher's input depends on a
    draw no table can hold (the teacher then runs alongside the student).

    The one place that decides it: an augmentation whose draws are finitely many adds its
    views here; one drawn from a continuous range (data.augment beyond the flip: crops,
    colour, blur ...) returns None.
    """
    augment = data_cfg.augment
    if not augment.only_flips:
        return None
    return (False, True) if augment.flip > 0 else (False,)


def view_of(views: tuple[bool, ...], flip: bool) -> int:
    """The position in `views` of the view an image took (its flip)."""
    return views.index(flip)


def part_path(folder: Path, rank: int, world_size: int) -> Path:
    """The file of part `rank` of `world_size`."""
    return folder / f"embeddings-{rank:05d}-of-{world_size:05d}.npy"


def part_rows(num_samples: int, rank: int, world_size: int) -> np.ndarray:
    """The sample indices part `rank` of `world_size` holds, in row order."""
    return np.arange(rank, num_samples, world_size)


class TeacherTable:
    """The parts of a table (see the module docstring), memory-mapped, read by sample.

    `flips` is the table's views (`cached_views`), which `lookup` maps each sample's flip
    onto.
    """

    def __init__(self, folder: Path, num_samples: int, world_size: int, flips: tuple[bool, ...]):
        self.folder = Path(folder)
        self.num_samples = num_samples
        self.world_size = world_size
        self.flips = flips
        self._parts: list[np.ndarray] | None = None

    @property
    def parts(self) -> list[np.ndarray]:
        # Opened on first use: in each DataLoader worker, its own maps of the same pages.
        if self._parts is None:
            self._parts = [
                np.load(part_path(self.folder, r, self.world_size), mmap_mode="r")
                for r in range(self.world_size)
            ]
        return self._parts

    def __getstate__(self) -> dict:
        # Workers started by spawn get the paths, not the maps.
        return {**self.__dict__, "_parts": None}

    @property
    def dim(self) -> int:
        return int(self.parts[0].shape[-1])

    def lookup(self, index: int, flip: bool) -> torch.Tensor:
        """The teacher's embedding (D,) float16 of sample `index` as it was flipped."""
        row = self.parts[index % self.world_size][index // self.world_size]
        return torch.from_numpy(np.array(row[view_of(self.flips, flip)]))

    def lookup_batch(self, indices: torch.Tensor, flips: torch.Tensor) -> torch.Tensor:
        """The teacher's embeddings (B, D) float16 of the samples `indices` as flipped by
        `flips` (both (B,), on the CPU)."""
        return torch.stack(
            [self.lookup(int(i), bool(f)) for i, f in zip(indices, flips, strict=True)]
        )

    def check(self) -> str | None:
        """Why the parts on disk do not make a whole table (a missing part, a wrong shape),
        or None when they do."""
        for rank in range(self.world_size):
            path = part_path(self.folder, rank, self.world_size)
            if not path.is_file():
                return f"{path.name} is missing"
            try:
                part = np.load(path, mmap_mode="r")
            except (OSError, ValueError) as exc:
                return f"{path.name} is unreadable ({exc})"
            rows = len(part_rows(self.num_samples, rank, self.world_size))
            if part.ndim != 3 or part.shape[:2] != (rows, len(self.flips)):
                return f"{path.name} holds {part.shape}, not {rows} rows of {len(self.flips)} views"
            if part.dtype != TABLE_DTYPE:
                return f"{path.name} holds {part.dtype}, not {np.dtype(TABLE_DTYPE)}"
        return None


class TeacherInputs(Dataset):
    """The training images as the teacher takes them: `inputs[i]` is sample i of `source`
    decoded and resized to `image_hw` (the teacher's input size), unflipped, (3, H, W)
    float32 in [-1, 1]; an unreadable image follows the source's `on_bad_image`, so a
    skipped one is replaced by the same image the training loader takes."""

    def __init__(self, source: TrainSource, image_hw: tuple[int, int]) -> None:
        self.source = source
        self.image_hw = image_hw

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> torch.Tensor:
        image = self.source.load_with_policy(int(index), self.source.decode)
        return to_input_tensor(image, self.image_hw)
