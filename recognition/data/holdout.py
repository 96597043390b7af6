"""Identities held out of training to verify on (`eval.holdout`): which, their pairs, and
the training source without them.

**Which.** Of the identities with two images or more, those whose names hash lowest
(SHA-256 of the name): `max(20, ceil(share x identities))`, but no more than those eligible
nor half of all identities; fewer than 20 that way and nothing is held out (a verification
of a few people measures nothing). The choice depends on the class names and image counts
alone: the same on every rank, at any world size, after a resume, whatever `seed`.

**Pairs.** The held-out identities are dealt into identity-disjoint folds (as LFW View 2):
10, or fewer so that each holds at least 10 people (2 folds at 20 people: with 2 people a
fold, its accuracy would swing with who is in it, and so would the threshold the other
folds choose); each fold draws the same number of same-identity and different-identity pairs (at
most 300 of each), from a generator of fixed seed. Images are numbered 1.. in the source's
order within their identity.

**Files.** `write_holdout` writes, into `<run>/holdout/`, each image the pairs use as
`<name>/<name>_<n:04d>.<ext>` (the encoded bytes as stored: a file of a folder, a record of a
pack), `identities.txt` (the held-out class names, one a line) and `pairs.txt` (LFW View 2,
written last); the folder is made beside and renamed into place, so it is whole or absent.

**Training.** `TrainingSubset` is the source without the held-out samples, its labels
renumbered 0..C'-1 in the original order, so the head has no rows for held-out classes.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from recognition.data.pairs import DiffPair, SamePair, write_pairs
from recognition.data.source import TrainSource

MIN_HELD_OUT = 20
"""Fewer identities than this and nothing is held out."""
MAX_FOLDS = 10
MIN_PEOPLE_PER_FOLD = 10
MAX_PAIRS_PER_FOLD = 300
PAIRS_SEED = 20_261_126
HOLDOUT_DIR = "holdout"
PAIRS_FILE = "pairs.txt"
IDENTITIES_FILE = "identities.txt"

Folds = list[tuple[list[SamePair], list[DiffPair]]]


@dataclass(frozen=True)
class HoldoutSplit:
    """The held-out classes of a source (ascending labels), and why none when empty."""

    held_out: np.ndarray  # (H,) int64, ascending
    num_classes: int
    reason: str = ""
    """Why nothing is held out (empty `held_out`), for the line that says so."""

    @property
    def active(self) -> bool:
        return len(self.held_out) > 0


def choose_holdout(names: Iterable[str], counts: np.ndarray, share: float) -> HoldoutSplit:
    """The identities to hold out for `eval.holdout` = `share` (see the module docstring):
    `names` are the class names in label order (streamed: never held as one list), `counts`
    their (C,) image counts."""
    counts = np.asarray(counts)
    num_classes = len(counts)
    if share <= 0:
        return HoldoutSplit(np.zeros(0, np.int64), num_classes, "eval.holdout=0")
    eligible = np.flatnonzero(counts >= 2)
    wanted = max(MIN_HELD_OUT, math.ceil(round(share * num_classes, 6)))  # 0.05 x 100 is 5
    count = min(wanted, len(eligible), num_classes // 2)
    if count < MIN_HELD_OUT:
        reason = (
            f"{len(eligible)} of the {num_classes} identities have two images or more; holding "
            f"out {MIN_HELD_OUT} (and training on at least as many) needs {MIN_HELD_OUT} such "
            f"and {2 * MIN_HELD_OUT} identities in all"
        )
        return HoldoutSplit(np.zeros(0, np.int64), num_classes, reason)
    keys = np.fromiter((name_key(name) for name in names), dtype=np.uint64, count=num_classes)
    # Ties (a 64-bit collision) fall to the lower label.
    order = np.lexsort((eligible, keys[eligible]))
    return HoldoutSplit(np.sort(eligible[order[:count]]).astype(np.int64), num_classes)


def name_key(name: str) -> int:
    """The order identities are held out in: the first 8 bytes of the name's SHA-256."""
    digest = hashlib.sha256(name.encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big")


def make_holdout_pairs(names: Sequence[str], counts: Sequence[int]) -> tuple[list[str], Folds]:
    """The held-out identities' names in the pairs file (`names` made safe: `safe_names`)
    and their folds of (same, different) pairs, image numbers 1-based; `names` and `counts`
    are the held-out classes' names and image counts, in label order."""
    pair_names = safe_names(names)
    order = sorted(range(len(names)), key=lambda i: (name_key(names[i]), pair_names[i]))
    num_folds = max(2, min(MAX_FOLDS, len(names) // MIN_PEOPLE_PER_FOLD))
    folds_members = [sorted(order[f::num_folds]) for f in range(num_folds)]
    sizes = [[int(counts[i]) for i in members] for members in folds_members]
    per_fold = min(MAX_PAIRS_PER_FOLD, *(_max_pairs(s) for s in sizes))
    rng = np.random.default_rng(PAIRS_SEED)
    folds: Folds = []
    for members, fold_sizes in zip(folds_members, sizes, strict=True):
        fold_names = [pair_names[i] for i in members]
        folds.append(_draw_fold(rng, fold_names, np.asarray(fold_sizes), per_fold))
    return pair_names, folds


def _max_pairs(sizes: list[int]) -> int:
    """The fewer of the distinct same- and different-identity pairs identities of `sizes`
    images can form."""
    same = sum(n * (n - 1) // 2 for n in sizes)
    total = sum(sizes)
    different = (total * total - sum(n * n for n in sizes)) // 2
    return min(same, different)


def _draw_fold(
    rng: np.random.Generator, names: list[str], sizes: np.ndarray, per_fold: int
) -> tuple[list[SamePair], list[DiffPair]]:
    """`per_fold` distinct pairs of each kind among one fold's identities, uniform over the
    pairs of that kind; sorted, then shuffled by `rng` (sets have no reproducible order)."""
    same: set[SamePair] = set()
    different: set[DiffPair] = set()
    same_weights = sizes * (sizes - 1) / 2.0
    image_weights = sizes / sizes.sum()
    while len(same) < per_fold:
        who = int(rng.choice(len(names), p=same_weights / same_weights.sum()))
        n1, n2 = sorted(int(n) + 1 for n in rng.choice(int(sizes[who]), 2, replace=False))
        same.add((names[who], n1, n2))
    while len(different) < per_fold:
        a, b = (int(i) for i in rng.choice(len(names), 2, p=image_weights))
        if a == b:
            continue
        if a > b:
            a, b = b, a
        n1, n2 = (int(rng.integers(1, sizes[i] + 1)) for i in (a, b))
        different.add((names[a], n1, names[b], n2))
    same_list, different_list = sorted(same), sorted(different)
    return (
        [same_list[i] for i in rng.permutation(len(same_list))],
        [different_list[i] for i in rng.permutation(len(different_list))],
    )


def safe_names(names: Sequence[str]) -> list[str]:
    """`names` as pairs-file names (no whitespace or path separators, unique): unsafe
    characters become '_', and a name still taken gets `~<k>` added."""
    out: list[str] = []
    taken: set[str] = set()
    for name in names:
        safe = re.sub(r"[\s/\\]", "_", name)
        if safe in ("", ".", ".."):
            safe = f"_{safe}"
        candidate, k = safe, 1
        while candidate in taken:
            k += 1
            candidate = f"{safe}~{k}"
        taken.add(candidate)
        out.append(candidate)
    return out


def write_holdout(
    folder: Path,
    source: TrainSource,
    split: HoldoutSplit,
    pair_names: Sequence[str],
    folds: Folds,
) -> int:
    """Write the held-out images the pairs use, identities.txt and pairs.txt into `folder`
    (made beside it, then renamed into place). Returns the number of images written."""
    held = [int(c) for c in split.held_out]
    label_of = dict(zip(pair_names, held, strict=True))
    used: set[tuple[str, int]] = set()
    for same, different in folds:
        used.update((name, n) for name, n1, n2 in same for n in (n1, n2))
        for name1, n1, name2, n2 in different:
            used.update(((name1, n1), (name2, n2)))
    partial = folder.with_name(f".{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        for name, number in sorted(used):
            index = int(source.members(label_of[name])[number - 1])
            _write_image(partial / name, f"{name}_{number:04d}", source, index)
        names = "".join(f"{source.class_name(c)}\n" for c in held)
        (partial / IDENTITIES_FILE).write_text(names, encoding="utf-8", errors="surrogateescape")
        write_pairs(partial / PAIRS_FILE, folds)
        os.replace(partial, folder)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return len(used)


def _write_image(folder: Path, stem: str, source: TrainSource, index: int) -> None:
    """The sample's encoded bytes as `folder/stem.<ext>` by their format; a format the
    evaluation does not read by extension is decoded and written as PNG."""
    folder.mkdir(exist_ok=True)
    data = source.encoded(index)
    ext = _image_extension(data)
    if ext is None:
        image: Image.Image = source.decode(index)
        image.save(folder / f"{stem}.png")
        return
    (folder / f"{stem}{ext}").write_bytes(data)


def _image_extension(data: bytes) -> str | None:
    if data[:3] == b"\xff\xd8\xff":
        return ".jpg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return ".png"
    if data[:2] == b"BM":
        return ".bmp"
    return None


class TrainingSubset(TrainSource):
    """`base` without the samples of `split.held_out`, labels renumbered 0..C'-1 in the
    base's order (class c keeps its name; its label drops by the held-out labels below it)."""

    def __init__(self, base: TrainSource, split: HoldoutSplit) -> None:
        super().__init__(base.root, base.image_size, on_bad_image=base.on_bad_image)
        self.base = base
        keep_class = np.ones(base.num_classes, dtype=bool)
        keep_class[split.held_out] = False
        self.kept_classes = np.flatnonzero(keep_class)  # (C',) new label -> base label
        new_label = np.cumsum(keep_class) - 1  # base label -> new label (where kept)
        base_labels = np.asarray(base.labels)
        self.indices = np.flatnonzero(keep_class[base_labels])  # (N',) -> base index
        self.labels = new_label[base_labels[self.indices]].astype(np.int64)

    @property
    def num_classes(self) -> int:
        return len(self.kept_classes)

    def class_name(self, label: int) -> str:
        return self.base.class_name(int(self.kept_classes[label]))

    def describe(self, index: int) -> str:
        return self.base.describe(int(self.indices[index]))

    def decode(self, index: int) -> Image.Image:
        return self.base.decode(int(self.indices[index]))

    def encoded(self, index: int) -> bytes:
        return self.base.encoded(int(self.indices[index]))
