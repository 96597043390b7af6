"""IJB-B / IJB-C 1:1 template verification: meta files, features, template pooling, scores.

The layout of the public release, with ``<name>`` ``ijbb`` or ``ijbc``::

    <root>/meta/<name>_face_tid_mid.txt        image file, template id, media id
    <root>/meta/<name>_template_pair_label.txt  template 1, template 2, 1 = same person
    <root>/meta/<name>_name_5pts_score.txt     image file, 5 landmarks as x y pairs, score
    <root>/loose_crop/<image file>

Fields are separated by spaces (or tabs). The protocol: each image is aligned on its five
landmarks (:mod:`recognition.data.alignment`) and embedded as model(image) + model(mirror),
optionally times its detector score; a media's (a video's frames, or one still) image
features are averaged, a template's media features summed and L2-normalised; a pair's score
is the cosine of its two templates. The result is TAR at FAR 1e-6 ... 1e-1, AUC and the ROC.

An image that cannot be decoded is left out and counted; a template with no readable image
(or none listed at all) has no feature: its pairs score -1, below every threshold, so a
genuine one counts as a false reject. Both counts are in the results and the log.

The image features and the template pooling here serve the 1:N mode too
(:mod:`recognition.evaluation.ijb_search`), and one features file both modes.
"""

from __future__ import annotations

import codecs
import hashlib
import logging
import os
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from recognition.checkpoint import load_backbone
from recognition.data.alignment import align_face, template_points
from recognition.data.pairs import parse_count
from recognition.data.transforms import load_rgb, to_input_tensor
from recognition.evaluation.embeddings import DEFAULT_EXTRACTION, Extraction, open_npz
from recognition.evaluation.plots import plot_roc
from recognition.evaluation.run import write_json
from recognition.evaluation.verification import (
    DEFAULT_FAR_TARGETS,
    far_key,
    tar_at_far_sorted,
    to_json_dict,
)

log = logging.getLogger(__name__)

IJB_NAMES = ("ijbb", "ijbc")
NO_FEATURE_SCORE = -1.0
"""The score of a pair whose template has no feature: the lowest cosine, never accepted."""
ROC_POINTS = 200
"""Points of the ROC kept in the JSON (log-spaced FARs)."""


# ------------------------------------------------------------------------------ meta files


@dataclass(frozen=True)
class IJBProtocol:
    """The meta files of one IJB set, checked.

    ``images[i]`` is a file under ``<root>/loose_crop/`` (each listed once, in order of
    first appearance in face_tid_mid); ``faces`` are the rows of face_tid_mid, with
    ``face_image[k]`` the index into ``images`` of row k. ``landmarks`` (I, 5, 2) and
    ``detector_scores`` (I,) belong to ``images``.
    """

    name: str
    root: Path
    images: list[str]
    landmarks: np.ndarray  # (I, 5, 2) float32
    detector_scores: np.ndarray  # (I,) float32
    face_image: np.ndarray  # (F,) int64 into images
    face_template: np.ndarray  # (F,) int64 template id
    face_media: np.ndarray  # (F,) int64 media id
    pairs: np.ndarray  # (P, 2) int64 template ids
    issame: np.ndarray  # (P,) bool

    @property
    def image_root(self) -> Path:
        return self.root / "loose_crop"


def meta_files(root: str | os.PathLike, name: str) -> dict[str, Path]:
    """The three meta file paths of ``name`` under ``root``: keys faces, pairs, landmarks."""
    if name not in IJB_NAMES:
        raise ValueError(f"--ijb-name: expected one of {', '.join(IJB_NAMES)}, got {name!r}")
    meta = Path(root) / "meta"
    return {
        "faces": meta / f"{name}_face_tid_mid.txt",
        "pairs": meta / f"{name}_template_pair_label.txt",
        "landmarks": meta / f"{name}_name_5pts_score.txt",
    }


def numbered_lines(path: Path):
    """(number, line) of each line of the UTF-8 text file ``path`` (a byte-order mark
    dropped), streamed; a ValueError naming ``path`` and the line that is not UTF-8.

    Each line is decoded alone: a text-mode file decodes blocks of 8 KiB ahead of the
    lines it yields, so its error would name a line near the block's start instead."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if number == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"{path}:{number}: not UTF-8 text (byte {raw[exc.start]:#04x}); save the "
                    "meta file as UTF-8"
                ) from None


def _rows(path: Path, num_fields: int, what: str):
    """(line number, fields) of each non-blank line of ``path``, each with ``num_fields``."""
    if not path.is_file():
        raise FileNotFoundError(f"IJB meta file not found: {path}")
    empty = True
    for number, line in numbered_lines(path):
        fields = line.split()
        if not fields:
            continue
        empty = False
        if len(fields) != num_fields:
            raise ValueError(
                f"{path}:{number}: expected {num_fields} fields ({what}), got "
                f"{len(fields)}: {line.strip()!r}"
            )
        yield number, fields
    if empty:
        raise ValueError(f"{path}: no lines; expected {what}")


def _image_name(value: str, where: str) -> str:
    # Names come from a downloaded file: keep them inside loose_crop/.
    parts = value.replace("\\", "/").split("/")
    if value.startswith("/") or ".." in parts:
        raise ValueError(f"{where}: image file {value!r} must be a path inside loose_crop/")
    return value


def read_faces(path: Path) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """face_tid_mid: (image names, template ids (F,), media ids (F,), line numbers (F,))."""
    names, templates, media, lines = [], [], [], []
    for number, (image, template, medium) in _rows(path, 3, "image file, template id, media id"):
        where = f"{path}:{number}"
        names.append(_image_name(image, where))
        templates.append(parse_count(template, where, "template id"))
        media.append(parse_count(medium, where, "media id"))
        lines.append(number)
    return names, np.array(templates, np.int64), np.array(media, np.int64), np.array(lines)


def read_pairs(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """template_pair_label: (template id pairs (P, 2) int64, issame (P,) bool)."""
    pairs, labels = [], []
    for number, (first, second, label) in _rows(path, 3, "template 1, template 2, label 0/1"):
        where = f"{path}:{number}"
        pairs.append(
            (parse_count(first, where, "template 1"), parse_count(second, where, "template 2"))
        )
        if label not in ("0", "1"):
            raise ValueError(f"{where}: label must be 0 or 1, got {label!r}")
        labels.append(label == "1")
    return np.array(pairs, np.int64).reshape(-1, 2), np.array(labels, bool)


def read_landmarks(path: Path) -> dict[str, tuple[np.ndarray, float, int]]:
    """name_5pts_score: {image name: (landmarks (5, 2) float32, detector score, line)}."""
    entries: dict[str, tuple[np.ndarray, float, int]] = {}
    what = "image file, 10 landmark coordinates x1 y1 ... x5 y5, detector score"
    for number, fields in _rows(path, 12, what):
        where = f"{path}:{number}"
        name = _image_name(fields[0], where)
        try:
            values = np.array([float(v) for v in fields[1:]], dtype=np.float64)
        except ValueError:
            bad = next(v for v in fields[1:] if not _is_float(v))
            raise ValueError(f"{where}: landmarks and score must be numbers, got {bad!r}") from None
        if not np.isfinite(values).all():
            raise ValueError(f"{where}: landmarks and score must be finite numbers")
        if values[-1] < 0:
            raise ValueError(f"{where}: detector score must be >= 0, got {fields[-1]}")
        if np.ptp(values[:10].reshape(5, 2), axis=0).max() <= 0:
            # No similarity maps five identical points onto the template.
            raise ValueError(f"{where}: the five landmarks coincide")
        if name in entries:
            raise ValueError(f"{where}: image {name!r} already listed on line {entries[name][2]}")
        entries[name] = (values[:10].reshape(5, 2).astype(np.float32), float(values[-1]), number)
    return entries


def _is_float(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def load_protocol(
    root: str | os.PathLike, name: str, check_images: bool = True, pairs: bool = True
) -> IJBProtocol:
    """Read and cross-check the three meta files of ``name`` under ``root``.

    Every face_tid_mid image needs a landmark line; with ``check_images`` every image must
    exist under ``<root>/loose_crop/``. Without ``pairs`` the pairs file is not read (the
    1:N mode needs only the images): ``pairs`` and ``issame`` are then empty. Raises
    FileNotFoundError naming a missing meta file or image (and the face_tid_mid line
    listing it), ValueError naming file:line of a malformed line.
    """
    root = Path(root)
    files = meta_files(root, name)
    names, templates, media, lines = read_faces(files["faces"])
    if pairs:
        pair_ids, issame = read_pairs(files["pairs"])
    else:
        pair_ids, issame = np.empty((0, 2), np.int64), np.empty(0, bool)
    points = read_landmarks(files["landmarks"])

    # An image listed on several face_tid_mid lines is embedded once.
    index: dict[str, int] = {}
    face_image = np.array([index.setdefault(n, len(index)) for n in names], dtype=np.int64)
    images = list(index)
    first_line = {}
    for n, line in zip(names, lines, strict=True):
        first_line.setdefault(n, int(line))
    landmarks = np.empty((len(images), 5, 2), np.float32)
    scores = np.empty(len(images), np.float32)
    for i, image in enumerate(images):
        if image not in points:
            raise ValueError(
                f"{files['faces']}:{first_line[image]}: image {image!r} has no line in "
                f"{files['landmarks']}"
            )
        landmarks[i], scores[i], _ = points[image]
    if check_images:
        _check_images(root / "loose_crop", images, files["faces"], first_line)
    return IJBProtocol(
        name=name,
        root=root,
        images=images,
        landmarks=landmarks,
        detector_scores=scores,
        face_image=face_image,
        face_template=templates,
        face_media=media,
        pairs=pair_ids,
        issame=issame,
    )


def _check_images(folder: Path, images: Sequence[str], source: Path, line: Mapping) -> None:
    if not folder.is_dir():
        raise FileNotFoundError(f"IJB image folder not found: {folder}")
    # One directory listing instead of a stat per image: IJB-C lists ~470k files.
    present = set(os.listdir(folder))
    for image in images:
        if image in present or ("/" in image and (folder / image).is_file()):
            continue
        raise FileNotFoundError(f"{source}:{line[image]}: image not found: {folder / image}")


# ------------------------------------------------------------------------------ features


class AlignedFaces(Dataset):
    """The protocol's images, each aligned on its landmarks: (3, S, S) float32 in [-1, 1].

    An image that cannot be decoded comes out as NaN pixels, which make its embedding row
    NaN (a backbone in eval mode treats every sample alone); :func:`image_features` counts
    those rows as unreadable.
    """

    def __init__(self, root: Path, images: Sequence[str], landmarks: np.ndarray, size: int) -> None:
        self.root = Path(root)
        self.images = list(images)
        self.landmarks = landmarks
        self.size = size
        template_points(size)  # rejects sizes the alignment cannot make, now

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> torch.Tensor:
        try:
            image = load_rgb(self.root / self.images[index])
        except ValueError as exc:
            log.warning("%s", exc)
            return torch.full((3, self.size, self.size), float("nan"))
        aligned = align_face(image, self.landmarks[index], self.size)
        return to_input_tensor(aligned, (self.size, self.size))


def image_features(
    backbone: nn.Module,
    protocol: IJBProtocol,
    image_size: int | Sequence[int],
    extraction: Extraction = DEFAULT_EXTRACTION,
) -> tuple[np.ndarray, np.ndarray]:
    """Raw features (I, D) float32 of the protocol's images and a readable mask (I,).

    A feature is backbone(aligned) + backbone(mirror) (just the first without ``flip``),
    not normalised: its norm weighs the image in the media average, as in the protocol.
    Rows of images that could not be decoded are zero and their mask False.
    """
    if not isinstance(image_size, int):
        template_points(image_size)
        image_size = int(image_size[0])
    dataset = AlignedFaces(protocol.image_root, protocol.images, protocol.landmarks, image_size)
    features = extraction(backbone, dataset, normalize=False)
    readable = np.isfinite(features).all(axis=1)
    features[~readable] = 0.0
    return features, readable


def save_features(
    path: str | os.PathLike,
    features: np.ndarray,
    readable: np.ndarray,
    images: Sequence[str],
    settings: Mapping[str, str],
) -> None:
    """Write image ``features`` (I, D), ``readable`` (I,), ``images`` and ``settings`` (.npz).

    ``settings`` ({key: text}) records what made the features (checkpoint, input size,
    flip) so that a later run with other settings is refused. Atomic: a temporary file in
    the same folder, then a rename.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(
                f,
                features=np.asarray(features, np.float32),
                readable=np.asarray(readable, bool),
                images=np.asarray(images, dtype=str),
                **{f"setting_{k}": np.asarray(str(v)) for k, v in settings.items()},
            )
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_features(
    path: str | os.PathLike, images: Sequence[str], settings: Mapping[str, str]
) -> tuple[np.ndarray, np.ndarray]:
    """(features (I, D), readable (I,)) from a file of :func:`save_features`.

    Raises ValueError naming ``path`` when it is unreadable or damaged, holds other images
    than ``images`` (another set), or was made with other ``settings`` (naming the
    setting; for ``model``, the checkpoints of both).
    """
    path = Path(path)
    with open_npz(path, "features file") as data:
        missing = [k for k in ("features", "readable", "images") if k not in data.files]
        if missing:
            raise ValueError(f"{path}: missing key(s) {missing}; not an IJB features file")
        try:
            stored = {
                key: data[f"setting_{key}"].item() if f"setting_{key}" in data.files else None
                for key in [*settings, "checkpoint"]
            }
            features, readable = data["features"], data["readable"]
            stored_images = data["images"]
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
            # A damaged member (its CRC fails) or one that needs pickle.
            raise ValueError(f"{path}: cannot read its arrays: {exc}") from None
    for key, value in settings.items():
        if stored[key] == str(value):
            continue
        if key == "model":
            raise ValueError(
                f"{path}: features made by another model (checkpoint "
                f"{stored['checkpoint']}) than this run's; remove the file or name another "
                "--save-features"
            )
        raise ValueError(
            f"{path}: features made with {key} = {stored[key]!r}, this run has {value!r}; "
            "remove the file or name another --save-features"
        )
    if stored_images.shape != (len(images),) or not np.array_equal(stored_images, images):
        raise ValueError(
            f"{path}: features of {stored_images.size} other images than this protocol's "
            f"{len(images)}; remove the file or name another --save-features"
        )
    if (
        features.ndim != 2
        or features.shape[0] != len(images)
        or readable.shape != (len(images),)
        or features.dtype.kind != "f"
    ):
        raise ValueError(f"{path}: arrays do not match its {len(images)} images")
    return features.astype(np.float32, copy=False), readable.astype(bool, copy=False)


def model_digest(model: nn.Module) -> str:
    """SHA-256 of ``model``'s state (names, dtypes, shapes, bytes): the same weights give the
    same digest whichever file or device they came from."""
    digest = hashlib.sha256()
    for key, value in model.state_dict().items():
        tensor = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{key}:{tensor.dtype}:{tuple(value.shape)};".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# ------------------------------------------------------------------------------ templates


def template_features(
    features: np.ndarray,
    readable: np.ndarray,
    protocol: IJBProtocol,
    score_weight: bool = False,
    more_templates: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Pool image features into templates: (template ids (T,) sorted, unit features (T, D)).

    Per face_tid_mid row: its image's feature, times the detector score with
    ``score_weight``. A media's rows (same template and media id) are averaged, a
    template's media summed and L2-normalised. Rows of unreadable images are left out; a
    template left with no row, or whose pooled feature is zero, gets a zero feature.
    Templates are every id of face_tid_mid, of the pairs and of ``more_templates`` (the
    1:N lists).
    """
    features = np.asarray(features, np.float32)
    rows = np.flatnonzero(readable[protocol.face_image])  # face rows with a feature
    image = protocol.face_image[rows]
    row_features = features[image].astype(np.float64)  # (R, D)
    if score_weight:
        row_features *= protocol.detector_scores[image, None]

    listed = [protocol.face_template, protocol.pairs.ravel()]
    if more_templates is not None:
        listed.append(np.asarray(more_templates, np.int64).ravel())
    template_ids = np.unique(np.concatenate(listed))
    # Media: one group per (template, media) pair, averaged.
    keys = np.stack([protocol.face_template[rows], protocol.face_media[rows]], axis=1)
    media_keys, media_of_row = np.unique(keys, axis=0, return_inverse=True)
    media_of_row = media_of_row.ravel()
    num_media = len(media_keys)
    media_sums = np.zeros((num_media, features.shape[1]))
    _add_rows(media_sums, media_of_row, row_features)
    media_counts = np.bincount(media_of_row, minlength=num_media)
    media_means = media_sums / np.maximum(media_counts, 1)[:, None]
    # Templates: the sum of their media.
    template_of_media = np.searchsorted(template_ids, media_keys[:, 0])
    pooled = np.zeros((len(template_ids), features.shape[1]))
    _add_rows(pooled, template_of_media, media_means)
    norms = np.linalg.norm(pooled, axis=1, keepdims=True)
    unit = np.divide(pooled, norms, out=np.zeros_like(pooled), where=norms > 0)
    return template_ids, unit.astype(np.float32)


def _add_rows(out: np.ndarray, index: np.ndarray, values: np.ndarray) -> None:
    """out[index[k]] += values[k] for every k (a sort and reduceat: np.add.at is slow)."""
    if len(index) == 0:
        return
    order = np.argsort(index, kind="stable")
    sorted_index = index[order]
    starts = np.flatnonzero(np.r_[True, sorted_index[1:] != sorted_index[:-1]])
    out[sorted_index[starts]] += np.add.reduceat(values[order], starts, axis=0)


# ------------------------------------------------------------------------------ scores


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def score_pairs(
    features: np.ndarray,
    left: np.ndarray,
    right: np.ndarray,
    *,
    chunk_size: int = 2048,
    num_threads: int | None = None,
) -> np.ndarray:
    """Dot products (P,) float32 of rows ``left[p]`` and ``right[p]`` of ``features`` (T, D).

    With unit rows these are the pairs' cosines. Vectorised in chunks of ``chunk_size``
    pairs over ``num_threads`` threads (default: the CPUs this process may use). Gathering
    the rows costs more than multiplying them, so the pairs are visited tile by tile
    (blocks of ~256 left and right templates): both blocks then stay in cache while their
    pairs are scored. Raises ValueError for an index outside [0, T).
    """
    features = np.ascontiguousarray(features, dtype=np.float32)
    left = np.asarray(left, dtype=np.int64)
    right = np.asarray(right, dtype=np.int64)
    num_templates = len(features)
    num_pairs = len(left)
    if left.shape != right.shape or left.ndim != 1:
        raise ValueError(f"pairs: left {left.shape} and right {right.shape} must be equal 1-D")
    scores = np.empty(num_pairs, np.float32)
    if num_pairs == 0:
        return scores
    for side in (left, right):
        if side.min() < 0 or side.max() >= num_templates:
            raise ValueError(f"pairs: template index outside [0, {num_templates})")

    # Tile keys below 2**15 sort as int16, which numpy sorts by radix: linear time.
    block = max(256, -(-num_templates // 181))
    num_blocks = -(-num_templates // block)
    key = (left // block) * num_blocks + right // block
    key = key.astype(np.int16 if num_blocks**2 < 2**15 else np.int64)
    order = np.argsort(key, kind="stable")
    del key

    def score_range(start: int, stop: int) -> None:
        a = np.empty((chunk_size, features.shape[1]), np.float32)
        b = np.empty_like(a)
        out = np.empty(chunk_size, np.float32)
        for s in range(start, stop, chunk_size):
            pairs = order[s : min(s + chunk_size, stop)]
            n = len(pairs)
            # mode="clip" writes into `out` directly (the default buffers a copy); the
            # indices were checked above, so nothing is clipped.
            np.take(features, left[pairs], axis=0, out=a[:n], mode="clip")
            np.take(features, right[pairs], axis=0, out=b[:n], mode="clip")
            np.einsum("pd,pd->p", a[:n], b[:n], out=out[:n])
            scores[pairs] = out[:n]

    num_threads = num_threads or default_threads()
    bounds = np.linspace(0, num_pairs, num_threads + 1).astype(np.int64)
    if num_threads == 1:
        score_range(0, num_pairs)
    else:
        # numpy releases the GIL in take and einsum, so threads share the work.
        with ThreadPoolExecutor(num_threads) as pool:
            for future in [
                pool.submit(score_range, int(a), int(b))
                for a, b in zip(bounds[:-1], bounds[1:], strict=True)
            ]:
                future.result()
    return scores


def roc_metrics(
    scores: np.ndarray,
    issame: np.ndarray,
    far_targets: Sequence[float] = DEFAULT_FAR_TARGETS,
) -> dict:
    """AUC, TAR@FAR and the ROC of scored pairs, from one sort of each class.

    Takes scores (P,) and issame (P,). Returns a dict: ``auc`` (the probability that a
    genuine pair outscores an impostor pair, ties counting half: the area under the ROC),
    ``tar_at_far`` and ``far_thresholds`` ({"1e-6": ...}; None where there are fewer than
    1/FAR impostors; the rule of
    :func:`recognition.evaluation.verification.tar_at_far`), ``roc`` ({"far": [...],
    "tar": [...]}: the ROC at ``ROC_POINTS`` log-spaced FARs, for JSON) and ``_roc``
    ((fpr, tpr): every corner of the ROC polyline, for the plot). Raises ValueError when
    a class is missing or a score is not finite.
    """
    scores = np.asarray(scores)
    issame = np.asarray(issame, dtype=bool)
    if scores.shape != issame.shape or scores.ndim != 1:
        raise ValueError(f"scores {scores.shape} and issame {issame.shape} must be equal 1-D")
    if not np.isfinite(scores).all():
        raise ValueError(f"scores: {int((~np.isfinite(scores)).sum())} are NaN or inf")
    genuine = np.sort(scores[issame])  # ascending
    impostor = np.sort(scores[~issame])
    num_genuine, num_impostor = len(genuine), len(impostor)
    if num_genuine == 0 or num_impostor == 0:
        raise ValueError(
            f"pairs: need genuine and impostor pairs, got {num_genuine} and {num_impostor}"
        )
    # Only the genuine scores (tens of thousands) are looked up among the impostors.
    below = np.searchsorted(impostor, genuine, side="left")
    at_or_below = np.searchsorted(impostor, genuine, side="right")
    wins = below.sum(dtype=np.float64) + 0.5 * (at_or_below - below).sum(dtype=np.float64)
    auc = wins / (float(num_genuine) * float(num_impostor))

    impostor_descending = impostor[::-1]
    tars, thresholds = {}, {}
    for far in far_targets:
        tar, threshold = tar_at_far_sorted(genuine, impostor_descending, far)
        tars[far_key(far)], thresholds[far_key(far)] = tar, threshold

    # The ROC polyline turns only where genuine scores sit: at each distinct genuine score g,
    # from (impostors > g, genuine > g) to (impostors >= g, genuine >= g).
    levels = np.unique(genuine)[::-1]
    corners = []
    for values, count in ((impostor, num_impostor), (genuine, num_genuine)):
        above = count - np.searchsorted(values, levels, side="right")
        at_or_above = count - np.searchsorted(values, levels, side="left")
        path = np.stack([above, at_or_above], axis=1).ravel()
        corners.append(np.concatenate([[0], path, [count]]) / count)
    fpr, tpr = corners
    fars = np.logspace(np.log10(1.0 / num_impostor), 0.0, ROC_POINTS)
    at = np.searchsorted(fpr, fars * (1 + 1e-9), side="right") - 1
    return {
        "auc": float(auc),
        "tar_at_far": tars,
        "far_thresholds": thresholds,
        "roc": {"far": fars.tolist(), "tar": tpr[at].tolist()},
        "_roc": (fpr, tpr),
    }


# ------------------------------------------------------------------------------ the run


def _size_text(image_size: int | Sequence[int]) -> str:
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    return f"{height}x{width}"


def cached_features(features_path: str | os.PathLike | None) -> bool:
    """Whether ``features_path`` names a features file to read (no model then runs).

    Raises ValueError when it names something that is not a file (a folder), before hours
    of extraction would end in a failed write.
    """
    if features_path is None:
        return False
    path = Path(features_path)
    if path.exists() and not path.is_file():
        raise ValueError(f"--save-features: {path} exists and is not a file")
    return path.is_file()


def protocol_features(
    protocol: IJBProtocol,
    *,
    checkpoint: str | os.PathLike | None = None,
    features_path: str | os.PathLike | None = None,
    image_size: int | Sequence[int] | None = None,
    extraction: Extraction = DEFAULT_EXTRACTION,
) -> tuple[np.ndarray, np.ndarray]:
    """Image features (I, D) and readable mask (I,) of ``protocol``: from ``features_path``
    when it is a file, else by the backbone of ``checkpoint`` (written to ``features_path``
    when given). Both modes call it, so one file serves 1:1 and 1:N.

    The file records the release, flip, input size and a digest of the model's weights; a
    run that knows one of them (the model and size only with ``checkpoint``) refuses a file
    made otherwise. ``image_size`` defaults to the checkpoint's. Unreadable images are
    logged.
    """
    cached = cached_features(features_path)
    settings = {"release": protocol.name, "flip": str(extraction.flip)}
    backbone = None
    if checkpoint is not None:
        device = torch.device("cpu") if cached else (extraction.device or torch.device("cpu"))
        backbone, trained_size = load_backbone(checkpoint, device)
        image_size = image_size or trained_size
        settings["model"] = model_digest(backbone)
    if image_size is not None:
        settings["image_size"] = _size_text(image_size)
    if cached:
        features, readable = load_features(features_path, protocol.images, settings)
        log.info("read the features of %d images from %s", len(features), features_path)
    else:
        if backbone is None:
            raise ValueError("--ijb: needs --checkpoint (or an existing --save-features file)")
        features, readable = image_features(backbone, protocol, image_size, extraction)
        if features_path is not None:
            settings["checkpoint"] = str(Path(checkpoint).resolve())
            save_features(features_path, features, readable, protocol.images, settings)
            log.info("wrote the features of %d images to %s", len(features), features_path)
    num_unreadable = int((~readable).sum())
    if num_unreadable:
        bad = [protocol.images[i] for i in np.flatnonzero(~readable)[:5]]
        log.warning(
            "%d images could not be decoded and were left out (first: %s)",
            num_unreadable,
            ", ".join(bad),
        )
    return features, readable


def evaluate_ijb(
    root: str | os.PathLike,
    name: str,
    *,
    checkpoint: str | os.PathLike | None = None,
    features_path: str | os.PathLike | None = None,
    image_size: int | Sequence[int] | None = None,
    score_weight: bool = False,
    batch_size: int = 128,
    flip: bool = True,
    device: torch.device | None = None,
    num_workers: int = 0,
    progress: bool = True,
    num_threads: int | None = None,
) -> dict:
    """IJB 1:1 verification of a checkpoint (or of cached image features) on ``root``.

    With ``features_path`` naming an existing file the image features come from it (no
    model runs; it must have been made with the same release, flip and, when given, the same
    checkpoint weights and input size); otherwise the backbone of ``checkpoint`` embeds every
    image (at ``image_size``, default the checkpoint's) and, with ``features_path``, they are
    saved there (:func:`protocol_features`). Returns :func:`roc_metrics`' dict plus
    ``name``, ``num_images``, ``num_unreadable_images``, ``num_templates`` (those the pairs
    use), ``num_templates_without_feature``, ``num_pairs``, ``num_genuine``,
    ``num_impostor``, ``num_pairs_without_feature``, ``score_weight`` and ``flip``.
    """
    protocol = load_protocol(root, name, check_images=not cached_features(features_path))
    extraction = Extraction(batch_size, flip, device, num_workers, progress)
    features, readable = protocol_features(
        protocol,
        checkpoint=checkpoint,
        features_path=features_path,
        image_size=image_size,
        extraction=extraction,
    )
    template_ids, unit = template_features(features, readable, protocol, score_weight)
    left, right = (np.searchsorted(template_ids, protocol.pairs[:, k]) for k in (0, 1))
    has_feature = np.linalg.norm(unit, axis=1) > 0
    scores = score_pairs(unit, left, right, num_threads=num_threads)
    pair_ok = has_feature[left] & has_feature[right]
    scores[~pair_ok] = NO_FEATURE_SCORE

    used = np.unique(protocol.pairs)
    templates_without = used[~has_feature[np.searchsorted(template_ids, used)]]
    if len(templates_without):
        log.warning(
            "%d templates have no readable image (first ids: %s); their %d pairs score %g",
            len(templates_without),
            ", ".join(str(t) for t in templates_without[:5]),
            int((~pair_ok).sum()),
            NO_FEATURE_SCORE,
        )
    results = {
        "name": name,
        "num_images": len(protocol.images),
        "num_unreadable_images": int((~readable).sum()),
        "num_templates": len(used),
        "num_templates_without_feature": len(templates_without),
        "num_pairs": len(scores),
        "num_genuine": int(protocol.issame.sum()),
        "num_impostor": int((~protocol.issame).sum()),
        "num_pairs_without_feature": int((~pair_ok).sum()),
        "score_weight": bool(score_weight),
        "flip": bool(flip),
    }
    results.update(roc_metrics(scores, protocol.issame))
    return results


def format_ijb_table(results: Mapping[str, Mapping]) -> str:
    """A console table, one row per {name: :func:`evaluate_ijb` result}: counts, AUC, TAR%."""
    far_keys = list(dict.fromkeys(k for r in results.values() for k in r["tar_at_far"]))
    header = ["target", "images", "templates", "pairs", "AUC"] + [f"TAR%@{k}" for k in far_keys]
    rows = [header]
    for name, r in results.items():
        tars = r["tar_at_far"]
        rows.append(
            [
                str(name),
                str(r["num_images"]),
                str(r["num_templates"]),
                str(r["num_pairs"]),
                f"{r['auc']:.4f}",
            ]
            + ["-" if tars[k] is None else f"{100 * tars[k]:.2f}" for k in far_keys]
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    lines = [
        "  ".join(
            [row[0].ljust(widths[0])]
            + [v.rjust(w) for v, w in zip(row[1:], widths[1:], strict=True)]
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def report_ijb(
    results: dict,
    *,
    json_path: Path | None = None,
    roc_path: Path | None = None,
) -> str:
    """Print the table of one :func:`evaluate_ijb` result; write its JSON and ROC plot."""
    name = results["name"]
    table = format_ijb_table({name: results})
    print(table, flush=True)
    if json_path is not None:
        write_json(json_path, to_json_dict(results))
        log.info("wrote %s", json_path)
    if roc_path is not None:
        plot_roc({name: results}, roc_path, title=f"{name.upper()} 1:1 verification")
        log.info("wrote %s", roc_path)
    return table
