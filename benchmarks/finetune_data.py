"""The data of the real-face fine-tuning comparison (`python -m benchmarks.finetune --root
FOLDER`): a real image folder split three ways by its people, and the shifted domain.

**Test people**: those `eval.holdout=0.05` holds out of FOLDER (`recognition.data.holdout`:
the people with two images or more whose names hash lowest), their pairs and the images
the pairs use written by `write_holdout`; verification only. **Fine-tuning people**: every
other person of the rest with two images or more (in the same name-hash order), two images
each (the first two by file name). **Pretraining people**: everyone else, with all their
images. The split depends on the names and image counts alone: the same for every seed.

The pretraining and fine-tuning folders are symlinks into FOLDER; the test images (written
by `write_holdout`) and every shifted image are files under the work folder, which is kept
outside the repository.

**Shifted domain**: the fine-tuning images and the test people's images in grey-scale and/or
blurred (`SHIFTS`), re-encoded as JPEG under the work folder; the pretraining images are
never shifted.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageFilter

from recognition.data.holdout import (
    IDENTITIES_FILE,
    PAIRS_FILE,
    choose_holdout,
    make_holdout_pairs,
    name_key,
    write_holdout,
)
from recognition.data.image_folder import ImageFolderDataset

HOLDOUT_SHARE = 0.05
"""The test people: those `eval.holdout` at its default holds out."""
FINETUNE_IMAGES = 2
BLUR_RADIUS = 1.5
"""Gaussian blur radius in pixels of a 112x112 crop (about 0.9 px at 64x64)."""
SHIFTS = {
    "grey": ("grey",),
    "blur": ("blur",),
    "grey+blur": ("grey", "blur"),
}
JPEG_QUALITY = 95
DOMAINS = ("same", "shifted")


@dataclass(frozen=True)
class SplitSizes:
    """How many people and images each part of the split holds."""

    test_people: int
    test_images: int
    test_pairs: int
    finetune_people: int
    finetune_images: int
    pretrain_people: int
    pretrain_images: int


@dataclass(frozen=True)
class RealData:
    """The folders of one split: `pretrain` (a folder of symlinks), and for each domain the
    fine-tuning folder and the test pairs file (its images beside it)."""

    pretrain: Path
    finetune: dict[str, Path]
    pairs: dict[str, Path]
    sizes: SplitSizes


def prepare(root: Path, data_dir: Path, shift: str) -> RealData:
    """Split `root`'s people and write the folders under `data_dir` (reused when a previous
    call wrote them for the same `root` and `shift`: `split.json` records both)."""
    marker = data_dir / "split.json"
    wanted = {"root": str(root.resolve()), "shift": shift}
    folders = RealData(
        pretrain=data_dir / "pretrain",
        finetune={d: data_dir / f"finetune-{d}" for d in DOMAINS},
        pairs={d: data_dir / f"test-{d}" / PAIRS_FILE for d in DOMAINS},
        sizes=SplitSizes(0, 0, 0, 0, 0, 0, 0),
    )
    if marker.is_file():
        recorded = json.loads(marker.read_text())
        if {k: recorded.get(k) for k in wanted} != wanted:
            raise SystemExit(
                f"--work: {data_dir} holds the split of {recorded.get('root')} with shift "
                f"{recorded.get('shift')}; use another --work folder"
            )
        sizes = SplitSizes(**recorded["sizes"])
        return RealData(folders.pretrain, folders.finetune, folders.pairs, sizes)
    shutil.rmtree(data_dir, ignore_errors=True)
    data_dir.mkdir(parents=True)
    sizes = _write_split(root, folders)
    _shift_folder(folders.finetune["same"], folders.finetune["shifted"], SHIFTS[shift])
    _shift_folder(folders.pairs["same"].parent, folders.pairs["shifted"].parent, SHIFTS[shift])
    marker.write_text(json.dumps({**wanted, "sizes": asdict(sizes)}, indent=2) + "\n")
    return RealData(folders.pretrain, folders.finetune, folders.pairs, sizes)


def _write_split(root: Path, folders: RealData) -> SplitSizes:
    source = ImageFolderDataset(root, 112)
    counts = np.bincount(np.asarray(source.labels), minlength=source.num_classes)
    split = choose_holdout(source.iter_class_names(), counts, HOLDOUT_SHARE)
    if not split.active:
        raise SystemExit(f"--root: {root}: no test people to hold out: {split.reason}")
    held = [int(c) for c in split.held_out]
    pair_names, folds = make_holdout_pairs(
        [source.class_name(c) for c in held], [int(counts[c]) for c in held]
    )
    test_images = write_holdout(folders.pairs["same"].parent, source, split, pair_names, folds)
    held_set = set(held)
    rest = [c for c in range(source.num_classes) if c not in held_set and counts[c] >= 2]
    rest.sort(key=lambda c: name_key(source.class_name(c)))
    finetune = set(rest[::2])
    folders.pretrain.mkdir()
    folders.finetune["same"].mkdir()
    pretrain_people = pretrain_images = 0
    for label in range(source.num_classes):
        name = source.class_name(label)
        if label in finetune:
            person = folders.finetune["same"] / name
            person.mkdir()
            for index in source.members(label)[:FINETUNE_IMAGES]:
                path = root / source.paths[int(index)]
                os.symlink(path.resolve(), person / path.name)
        elif label not in held_set:
            os.symlink((root / name).resolve(), folders.pretrain / name)
            pretrain_people += 1
            pretrain_images += int(counts[label])
    return SplitSizes(
        test_people=len(held),
        test_images=test_images,
        test_pairs=sum(len(same) + len(diff) for same, diff in folds),
        finetune_people=len(finetune),
        finetune_images=FINETUNE_IMAGES * len(finetune),
        pretrain_people=pretrain_people,
        pretrain_images=pretrain_images,
    )


def shift_image(image: Image.Image, steps: tuple[str, ...]) -> Image.Image:
    """`image` (RGB) in grey-scale (kept as three equal channels) and/or blurred."""
    for step in steps:
        if step == "grey":
            image = image.convert("L").convert("RGB")
        elif step == "blur":
            image = image.filter(ImageFilter.GaussianBlur(BLUR_RADIUS))
    return image


def _shift_folder(source: Path, target: Path, steps: tuple[str, ...]) -> None:
    """Every image under `source` (following symlinks) shifted into the same relative path
    under `target`; the text files (pairs, identities) copied."""
    for path in sorted(source.rglob("*")):
        out = target / path.relative_to(source)
        if path.is_dir():
            out.mkdir(parents=True, exist_ok=True)
        elif path.name in (PAIRS_FILE, IDENTITIES_FILE):
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, out)
        elif not path.name.startswith("."):
            out.parent.mkdir(parents=True, exist_ok=True)
            with Image.open(path) as image:
                shifted = shift_image(image.convert("RGB"), steps)
            shifted.save(out.with_suffix(".jpg"), quality=JPEG_QUALITY)
