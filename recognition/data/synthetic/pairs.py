"""The verification pairs over the synthetic set's held-out identities, fold by fold, and
their LFW View-2 `pairs.txt`."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from recognition.config.synthetic import SyntheticSpec
from recognition.data.pairs import write_pairs
from recognition.data.synthetic.layout import PAIRS_STREAM, val_identity_name


def make_pairs(
    spec: SyntheticSpec,
) -> list[tuple[list[tuple[str, int, int]], list[tuple[str, int, str, int]]]]:
    """The verification pairs of `spec`'s held-out identities, fold by fold.

    Returns one (same, different) tuple per fold: `same` holds (name, n1, n2) and `different`
    holds (name1, n1, name2, n2), with image numbers 1-based as in LFW. Folds use disjoint
    sets of identities (as LFW View 2 does), and no pair repeats within a fold.
    """
    rng = np.random.default_rng([spec.seed, PAIRS_STREAM])
    order = rng.permutation(spec.num_val_identities)
    num_images = spec.val_images_per_identity
    folds = []
    for fold_ids in np.array_split(order, spec.num_folds):
        fold_ids = sorted(int(i) for i in fold_ids)
        same: set[tuple[str, int, int]] = set()
        different: set[tuple[str, int, str, int]] = set()
        # Rejection sampling; __post_init__ checked that enough distinct pairs exist, and the
        # defaults use a small fraction of them, so this ends quickly.
        while len(same) < spec.pairs_per_fold:
            identity = int(rng.choice(fold_ids))
            n1, n2 = sorted(int(n) for n in rng.choice(num_images, size=2, replace=False) + 1)
            same.add((val_identity_name(identity), n1, n2))
        while len(different) < spec.pairs_per_fold:
            a, b = sorted(int(i) for i in rng.choice(fold_ids, size=2, replace=False))
            n1, n2 = (int(n) for n in rng.integers(1, num_images + 1, size=2))
            different.add((val_identity_name(a), n1, val_identity_name(b), n2))
        # Sets have no reproducible order across runs of differing hash seeds for str tuples,
        # so sort, then shuffle with the seeded generator.
        same_list = sorted(same)
        different_list = sorted(different)
        same_list = [same_list[i] for i in rng.permutation(len(same_list))]
        different_list = [different_list[i] for i in rng.permutation(len(different_list))]
        folds.append((same_list, different_list))
    return folds


def write_lfw_pairs(
    path: Path,
    folds: list[tuple[list[tuple[str, int, int]], list[tuple[str, int, str, int]]]],
) -> None:
    """Write `folds` (as returned by `make_pairs`) to `path` in LFW View-2 `pairs.txt` format.

    The first line is `num_folds<TAB>pairs_per_fold`; each fold then lists its same-identity
    lines `name<TAB>n1<TAB>n2` followed by its different-identity lines
    `name1<TAB>n1<TAB>name2<TAB>n2`.
    """
    write_pairs(path, folds)
