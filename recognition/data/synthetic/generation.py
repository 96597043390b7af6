"""Generating the synthetic data set: every identity drawn and its images rendered and written
as JPEGs (in worker processes), the pairs file, and the markers that tell a complete set of
a given spec from an interrupted one or a folder that is not ours."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from recognition.config.synthetic import SyntheticSpec
from recognition.data.synthetic.drawing import (
    TEMPLATE_OVERSAMPLING,
    render_template,
    sample_identity,
)
from recognition.data.synthetic.layout import (
    COMPLETE_MARKER,
    GENERATING_MARKER,
    PAIRS_FILE,
    TRAIN_DIR,
    TRAIN_STREAM,
    VAL_DIR,
    VAL_STREAM,
    train_identity_name,
    val_identity_name,
)
from recognition.data.synthetic.pairs import make_pairs, write_lfw_pairs
from recognition.data.synthetic.rendering import (
    JPEG_QUALITY_RANGE,
    NOISE_FIELD_MARGIN,
    render_image,
)

# The package's name, as before it was split into modules: the log lines keep naming it.
logger = logging.getLogger("recognition.data.synthetic")


def _generate_identity(
    root: str, split: str, index: int, num_images: int, size: int, seed: int
) -> None:
    """Draw identity `index` of `split` ("train" or "val") and write its `num_images` JPEGs."""
    stream = TRAIN_STREAM if split == TRAIN_DIR else VAL_STREAM
    params = sample_identity(np.random.default_rng([seed, stream, index]))
    template = render_template(params, size * TEMPLATE_OVERSAMPLING).convert("RGBa")
    noise_rng = np.random.default_rng([seed, stream, index, 0])
    # Each image crops its noise from this field at a random offset: shifted crops of one
    # field are as good as fresh noise for a nuisance, and much cheaper than drawing it.
    margin = NOISE_FIELD_MARGIN
    noise = noise_rng.standard_normal((size + margin, size + margin, 3), dtype=np.float32)
    if split == TRAIN_DIR:
        name = train_identity_name(index)
        folder = Path(root) / TRAIN_DIR / name
        file_names = [f"{n}.jpg" for n in range(num_images)]
    else:
        name = val_identity_name(index)
        folder = Path(root) / VAL_DIR / name
        file_names = [f"{name}_{n + 1:04d}.jpg" for n in range(num_images)]
    folder.mkdir(parents=True, exist_ok=True)
    for n, file_name in enumerate(file_names):
        rng = np.random.default_rng([seed, stream, index, n + 1])
        image = render_image(template, noise, rng, size)
        quality = int(rng.integers(JPEG_QUALITY_RANGE[0], JPEG_QUALITY_RANGE[1] + 1))
        image.save(folder / file_name, format="JPEG", quality=quality)


def _generate_identity_star(args: tuple) -> None:
    """`_generate_identity(*args)`, for `ProcessPoolExecutor.map`."""
    _generate_identity(*args)


def _read_marker(root: Path) -> dict | None:
    """The parsed `.complete` marker of `root`, or None when missing or unreadable."""
    try:
        return json.loads((root / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return None


def _default_num_workers() -> int:
    """Worker processes for generation: the CPUs this process may run on, at most 8."""
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        available = os.cpu_count() or 1
    return max(1, min(8, available))


def generate_synthetic_dataset(
    root: Path, spec: SyntheticSpec, num_workers: int | None = None
) -> None:
    """Write the data set of `spec` under `root` (see the package docstring for the layout).

    Writes `.generating` first and `.complete` (the spec as JSON) last, so that an interrupted
    run is recognised. `num_workers` processes draw identities in parallel (None: one per
    available CPU, at most 8; 1: in this process). The files do not depend on `num_workers`.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / GENERATING_MARKER).write_text(json.dumps(spec.to_json()) + "\n")
    if num_workers is None:
        num_workers = _default_num_workers()
    jobs = [
        (str(root), TRAIN_DIR, i, spec.images_per_identity, spec.image_size, spec.seed)
        for i in range(spec.num_identities)
    ] + [
        (str(root), VAL_DIR, i, spec.val_images_per_identity, spec.image_size, spec.seed)
        for i in range(spec.num_val_identities)
    ]
    if num_workers <= 1:
        for job in jobs:
            _generate_identity(*job)
    else:
        with ProcessPoolExecutor(max_workers=num_workers) as pool:
            # chunksize amortises the inter-process round trips over several identities.
            list(pool.map(_generate_identity_star, jobs, chunksize=8))
    write_lfw_pairs(root / VAL_DIR / PAIRS_FILE, make_pairs(spec))
    (root / COMPLETE_MARKER).write_text(json.dumps(spec.to_json(), indent=2) + "\n")
    (root / GENERATING_MARKER).unlink()


def ensure_synthetic_dataset(
    root: Path, spec: SyntheticSpec | None = None, num_workers: int | None = None
) -> Path:
    """Make sure `root` holds the complete synthetic data set of `spec`, and return `root`.

    Does nothing when `root/.complete` records the same spec. Generates the data set when
    `root` is missing or empty, regenerates it when it is one this module started (an
    interrupted generation, or a complete one made with another spec or generator version),
    and raises a ValueError rather than touch a non-empty `root` that it did not write.
    `spec` defaults to `SyntheticSpec()`; `num_workers` is passed to
    `generate_synthetic_dataset`.
    """
    root = Path(root)
    spec = SyntheticSpec() if spec is None else spec
    if root.exists() and not root.is_dir():
        raise ValueError(f"synthetic data root {root} exists and is not a directory")
    marker = _read_marker(root)
    if marker == spec.to_json():
        return root
    ours = marker is not None or (root / GENERATING_MARKER).exists()
    if root.exists() and any(root.iterdir()) and not ours:
        raise ValueError(
            f"{root} is not empty and holds no synthetic data set ({COMPLETE_MARKER} is "
            "missing); refusing to write into it. Choose an empty or new directory for the "
            "synthetic data set."
        )
    if ours:
        reason = "an interrupted generation" if marker is None else "a different spec"
        logger.info("Regenerating synthetic data set in %s (found %s)", root, reason)
        # Remove only what this module writes: the marker proves that these are ours.
        (root / COMPLETE_MARKER).unlink(missing_ok=True)
        for name in (TRAIN_DIR, VAL_DIR):
            shutil.rmtree(root / name, ignore_errors=True)
    logger.info(
        "Generating synthetic data set in %s (%d train identities x %d images, "
        "%d val identities x %d images, %dx%d)",
        root,
        spec.num_identities,
        spec.images_per_identity,
        spec.num_val_identities,
        spec.val_images_per_identity,
        spec.image_size,
        spec.image_size,
    )
    start = time.perf_counter()
    generate_synthetic_dataset(root, spec, num_workers=num_workers)
    logger.debug("Generated %s in %.1f s", root, time.perf_counter() - start)
    return root
