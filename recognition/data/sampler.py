"""The training sample order: resumable mid-epoch, with augmentation tied to the sample.

`ResumableSampler` yields the order of `torch.utils.data.DistributedSampler` (a permutation
seeded by seed + epoch, this rank's slice, drop_last) as `(index, sample_seed)` pairs and
can start at any position of the epoch. `AugmentedView` draws a sample's random
augmentation from its `sample_seed`, not from the DataLoader worker's RNG, so an image is
flipped the same way whichever worker loads it and whether or not the run was resumed:
N steps + resume + N steps sees exactly the data of 2N steps straight.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler


class ResumableSampler(Sampler[tuple[int, int]]):
    def __init__(self, num_samples: int, *, num_replicas: int = 1, rank: int = 0, seed: int = 0):
        if num_samples < num_replicas:
            raise ValueError(
                f"dataset has {num_samples} samples, fewer than the {num_replicas} processes"
            )
        # DistributedSampler only needs len() of its dataset: a range stands in for it.
        self._order = DistributedSampler(
            range(num_samples),
            num_replicas=num_replicas,
            rank=rank,
            shuffle=True,
            seed=seed,
            drop_last=True,
        )
        self.seed = seed
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch's permutation and skip its first `start` samples (of this rank)."""
        self._order.set_epoch(epoch)
        self.epoch = epoch
        self.start = start

    def __len__(self) -> int:
        return len(self._order) - self.start

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for position, index in enumerate(self._order):
            if position < self.start:
                continue
            yield index, sample_seed(self.seed, self.epoch, index)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed that depends on (seed, epoch, index) only."""
    return random.Random(f"{seed}/{epoch}/{index}").getrandbits(63)


class AugmentedView(Dataset):
    """Wraps a dataset of (CHW image, label) and applies seeded random augmentation.

    Indexed with the `(index, sample_seed)` pairs of `ResumableSampler`.
    """

    def __init__(self, base: Dataset, *, flip: bool):
        self.base = base
        self.flip = flip

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int]:
        index, seed = key
        image, label = self.base[index]
        rng = random.Random(seed)
        if self.flip and rng.random() < 0.5:
            image = image.flip(-1)
        return image, label
