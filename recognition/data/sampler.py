"""The training sample order: resumable mid-epoch, with augmentation tied to the sample.

`ResumableSampler` yields the order of `torch.utils.data.DistributedSampler` (a permutation
seeded by seed + epoch, this rank's slice, drop_last) as `(index, sample_seed)` pairs and
can start at any position of the epoch; `IdentityBalancedSampler` does the same for P x K
batches (P identities x K images each, as re-id training uses). `AugmentedView` draws a
sample's random augmentation (`recognition.data.augment`) from its `sample_seed`, not from
the DataLoader worker's RNG, so an image is augmented the same way whichever worker loads
it and whether or not the run was resumed: N steps + resume + N steps sees exactly the
data of 2N steps straight.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler

from recognition.config import AugmentConfig
from recognition.data.augment import apply_augment, draw_augment, draw_flip

__all__ = [
    "AugmentedView",
    "EpochBatches",
    "IdentityBalancedSampler",
    "ResumableSampler",
    "draw_flip",
    "sample_seed",
]


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
    """Wraps a dataset of (CHW image in [-1, 1], label) and applies the random augmentation
    of `augment` (`recognition.data.augment`), drawn from each sample's seed.

    With flips alone (`ships_pixels`, the default) and a base that has `pixels(index)` (a
    `TrainSource`), the image comes as (3, H, W) uint8, not normalised: the training step
    normalises the batch on the device (`recognition.data.transforms.network_input`).

    Indexed with the `(index, sample_seed)` pairs of `ResumableSampler`. With nothing but
    the flip on (the default) the image is only mirrored, as it always was: no conversion.
    With `targets` (a distilled run's table of the teacher's embeddings,
    `recognition.data.teacher_table`, kept only when the augmentation is flips alone), each
    sample also brings the teacher's embedding of the view it took: (image, label, (D,)
    float16).
    """

    def __init__(self, base: Dataset, augment: AugmentConfig, *, targets: Any = None):
        self.base = base
        self.augment = augment
        self.targets = targets
        # Flips alone (the default): the workers ship uint8 pixels, a quarter of float32's
        # bytes, which `transforms.network_input` normalises on the device. The other
        # presets augment in float on the worker (`apply_augment`), so they ship float:
        # every sample of a batch must have one dtype, and most of them are augmented.
        self.ships_pixels = augment.only_flips and hasattr(base, "pixels")

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        index, seed = key
        if self.ships_pixels:
            # The flip is exact on uint8: the training process normalises on the device.
            image, label = self.base.pixels(index)  # type: ignore[attr-defined]
        else:
            image, label = self.base[index]
        flipped = False
        if self.augment.only_flips:
            flipped = self.augment.flip > 0 and draw_flip(seed, self.augment.flip)
        else:
            params = draw_augment(self.augment, seed, tuple(image.shape[-2:]))
            if params.beyond_flip:
                pixels = apply_augment(image.mul(0.5).add_(0.5), params)  # [-1, 1] -> [0, 1]
                # Not in place: grey-scale may leave a view whose three channels share memory.
                image = (pixels - 0.5) / 0.5
            else:
                flipped = params.flip
        if flipped:
            image = image.flip(-1)
        if self.targets is None:
            return image, label
        return image, label, self.targets.lookup(index, flipped)


class IdentityBalancedSampler(Sampler[tuple[int, int]]):
    """P x K batches: every batch holds `batch_size / instances` identities x `instances` images.

    The epoch's order is drawn from (seed, epoch) alone and is the same on every rank: each
    identity's images are shuffled and cut into groups of K = `instances` (an identity with
    fewer than K images fills its one group by drawing again from its images; a trailing
    incomplete group is dropped), then the groups are shuffled. A global step takes W x P
    groups (W = `num_replicas`, P = `batch_size / K`): rank r the P groups from r x P, so
    every rank's batch holds whole groups and the ranks never share a group. Groups that do
    not fill a whole global step are dropped, so every rank runs the same number of steps.

    Like `ResumableSampler` it yields `(index, sample_seed)` and `set_epoch(epoch, start)`
    skips this rank's first `start` samples. The seed is drawn from the sample's position in
    the epoch, not its index: an image can appear twice in an epoch (the filling above).
    """

    def __init__(
        self,
        labels: np.ndarray,
        *,
        instances: int,
        batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
    ):
        if instances < 1 or batch_size % instances:
            raise ValueError(
                f"batch size {batch_size} is not a multiple of the {instances} instances "
                "per identity"
            )
        labels = np.asarray(labels)
        self.order = np.argsort(labels, kind="stable")
        num_classes = int(labels.max()) + 1 if len(labels) else 0
        self.starts = np.searchsorted(labels[self.order], np.arange(num_classes + 1))
        self.instances = instances
        self.groups_per_batch = batch_size // instances
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.epoch = 0
        self.start = 0
        present = int(np.count_nonzero(np.diff(self.starts)))
        if present < self.groups_per_batch:
            raise ValueError(
                f"{present} identities, fewer than the {self.groups_per_batch} a batch holds"
            )
        self._cached: tuple[int, np.ndarray] | None = None

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch's order and skip its first `start` samples (of this rank)."""
        self.epoch = epoch
        self.start = start

    def _groups(self, epoch: int) -> np.ndarray:
        """(G, K) sample indices of the epoch's shuffled groups (same on every rank)."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        rng = np.random.default_rng([self.seed, epoch])
        k = self.instances
        groups = []
        for label in range(len(self.starts) - 1):
            members = self.order[self.starts[label] : self.starts[label + 1]]
            if len(members) == 0:
                continue
            if len(members) < k:
                members = rng.choice(members, size=k, replace=True)
            else:
                members = rng.permutation(members)
            usable = len(members) - len(members) % k
            groups.append(members[:usable].reshape(-1, k))
        table = np.concatenate(groups)[rng.permutation(sum(len(g) for g in groups))]
        self._cached = (epoch, table)
        return table

    def _rank_positions(self) -> tuple[np.ndarray, np.ndarray]:
        """This rank's (sample indices, positions in the epoch's global order)."""
        groups = self._groups(self.epoch)
        p, w, k = self.groups_per_batch, self.num_replicas, self.instances
        steps = len(groups) // (p * w)
        group_ids = (
            np.arange(steps)[:, None] * (p * w) + self.rank * p + np.arange(p)[None, :]
        ).ravel()
        positions = (group_ids[:, None] * k + np.arange(k)[None, :]).ravel()
        return groups[group_ids].ravel(), positions

    def __len__(self) -> int:
        groups = len(self._groups(self.epoch))
        per_rank = groups // (self.groups_per_batch * self.num_replicas) * self.groups_per_batch
        return per_rank * self.instances - self.start

    def __iter__(self) -> Iterator[tuple[int, int]]:
        indices, positions = self._rank_positions()
        for index, position in zip(
            indices[self.start :].tolist(), positions[self.start :].tolist(), strict=True
        ):
            yield index, sample_seed(self.seed, self.epoch, position)


class EpochBatches(Sampler[list[tuple[int, int]]]):
    """The batches of every epoch of a run, one epoch after the other, as one sequence.

    A DataLoader's `batch_sampler` for the whole run: its workers keep loading ahead across
    epoch boundaries, instead of starting again (and the GPU waiting) at each new epoch's
    iterator. Epoch `e` is `sampler.set_epoch(e)`'s order cut into `batches_per_epoch`
    batches of `batch_size` (the rest of the epoch is dropped, as a DataLoader with
    drop_last and a trailing incomplete step would drop it). `start_at(epoch, batch)` picks
    where the sequence begins (a resumed run's position). Iteration never ends: the
    caller takes as many batches as it trains on.
    """

    def __init__(self, sampler: Sampler, batch_size: int, batches_per_epoch: int) -> None:
        if batch_size < 1 or batches_per_epoch < 1:
            raise ValueError("EpochBatches: batch_size and batches_per_epoch must be >= 1")
        self.sampler = sampler
        self.batch_size = batch_size
        self.batches_per_epoch = batches_per_epoch
        self.epoch = 0
        self.batch = 0

    def start_at(self, epoch: int, batch: int = 0) -> None:
        """Begin the next iteration at batch `batch` of epoch `epoch`."""
        self.epoch, self.batch = epoch, batch

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch, skip = self.epoch, self.batch
        while True:
            self.sampler.set_epoch(epoch, start=skip * self.batch_size)  # type: ignore[attr-defined]
            batch: list[tuple[int, int]] = []
            remaining = self.batches_per_epoch - skip
            for key in self.sampler:
                if remaining == 0:
                    break
                batch.append(key)
                if len(batch) == self.batch_size:
                    yield batch
                    batch = []
                    remaining -= 1
            epoch, skip = epoch + 1, 0
