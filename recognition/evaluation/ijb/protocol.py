"""IJB-B / IJB-C 1:1 meta files: which images, templates, media, pairs and landmarks.

The layout of the public release, with ``<name>`` ``ijbb`` or ``ijbc``::

    <root>/meta/<name>_face_tid_mid.txt        image file, template id, media id
    <root>/meta/<name>_template_pair_label.txt  template 1, template 2, 1 = same person
    <root>/meta/<name>_name_5pts_score.txt     image file, 5 landmarks as x y pairs, score
    <root>/loose_crop/<image file>

Fields are separated by spaces (or tabs). Every line is checked as it is read: an error
names the file and the line. The 1:N lists (:mod:`recognition.evaluation.ijb.search_protocol`)
are read with the same helpers.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recognition.data.pairs import parse_count

IJB_NAMES = ("ijbb", "ijbc")


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


def meta_folder(root: str | os.PathLike, name: str) -> Path:
    """``<root>/meta``, where the meta files of ``name`` (one of :data:`IJB_NAMES`) lie."""
    if name not in IJB_NAMES:
        raise ValueError(f"--ijb-name: expected one of {', '.join(IJB_NAMES)}, got {name!r}")
    return Path(root) / "meta"


def meta_files(root: str | os.PathLike, name: str) -> dict[str, Path]:
    """The three meta file paths of ``name`` under ``root``: keys faces, pairs, landmarks."""
    meta = meta_folder(root, name)
    return {
        "faces": meta / f"{name}_face_tid_mid.txt",
        "pairs": meta / f"{name}_template_pair_label.txt",
        "landmarks": meta / f"{name}_name_5pts_score.txt",
    }


def require_meta_file(path: Path) -> None:
    """Raise FileNotFoundError naming ``path`` unless it is a file."""
    if not path.is_file():
        raise FileNotFoundError(f"IJB meta file not found: {path}")


def numbered_lines(path: Path) -> Iterator[tuple[int, str]]:
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


def _rows(path: Path, num_fields: int, what: str) -> Iterator[tuple[int, list[str]]]:
    """(line number, fields) of each non-blank line of ``path``, each with ``num_fields``."""
    require_meta_file(path)
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
