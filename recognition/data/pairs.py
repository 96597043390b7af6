"""LFW-style verification protocol files: reading, checking against an image folder, writing.

Two layouts share one grammar (fields separated by tabs or spaces, blank lines ignored):

View 2 ``pairs.txt``::

    10	300                  <- number of folds, pairs of EACH kind per fold
    Abel_Pacheco	1	4    <- fold 1: 300 same-identity lines "name n1 n2"
    ...
    Abdel_Madi_Shabneh	1	Dean_Barker	1   <- then 300 lines "name1 n1 name2 n2"
    ...                      <- then fold 2, and so on

``pairsDevTrain.txt`` / ``pairsDevTest.txt``: the header is a single count N, followed by
N same-identity lines then N different-identity lines; the whole file is one fold.

Image ``n`` of ``name`` is the file ``<name>/<name>_<n:04d>.<ext>`` under the image root.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Tried, in this order, when an image is not found with the extension the pairs were read
# with: LFW ships .jpg, but re-encoded copies of it and synthetic sets often use others.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".pgm", ".bmp")

SamePair = tuple[str, int, int]  # (name, n1, n2)
DiffPair = tuple[str, int, str, int]  # (name1, n1, name2, n2)


@dataclass(frozen=True)
class Pairs:
    """The pairs of a protocol file, in file order.

    ``left[i]`` and ``right[i]`` are image paths relative to the image root, ``issame[i]``
    says whether they show one identity, ``fold[i]`` (0-based) is the fold the file puts
    pair i in. ``source`` and ``line_numbers`` (1-based) locate each pair in its file so
    that later errors (a missing image, a missing embedding) can name the line.
    """

    left: list[str]
    right: list[str]
    issame: np.ndarray  # (P,) bool
    fold: np.ndarray  # (P,) int64, in [0, num_folds)
    num_folds: int
    source: str = "<pairs>"
    line_numbers: np.ndarray | None = None  # (P,) int64

    def __post_init__(self) -> None:
        num_pairs = len(self.left)
        lengths = {
            "right": len(self.right),
            "issame": len(self.issame),
            "fold": len(self.fold),
        }
        if self.line_numbers is not None:
            lengths["line_numbers"] = len(self.line_numbers)
        for name, length in lengths.items():
            if length != num_pairs:
                raise ValueError(f"Pairs: {name} has {length} entries but left has {num_pairs}")

    def __len__(self) -> int:
        return len(self.left)

    def images(self) -> list[str]:
        """Every image the pairs use, once each, in order of first appearance."""
        pairs = zip(self.left, self.right, strict=True)
        return list(dict.fromkeys(path for pair in pairs for path in pair))

    def location(self, i: int) -> str:
        """``file:line`` of pair i (just the file when line numbers are unknown)."""
        if self.line_numbers is None:
            return self.source
        return f"{self.source}:{int(self.line_numbers[i])}"


PAIR_FIELDS = {"same": "3 fields 'name n1 n2'", "different": "4 fields 'name1 n1 name2 n2'"}


def read_text_lines(path: Path) -> list[str]:
    """The lines of the UTF-8 text file `path` (a byte-order mark, as some editors write,
    is dropped); a ValueError naming the file and line when it is not UTF-8."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig").splitlines()
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ValueError(
            f"{path}:{line}: not UTF-8 text (byte {data[exc.start]:#04x}); save the file as UTF-8"
        ) from None


def image_path(name: str, number: int, ext: str = "jpg") -> str:
    """The LFW relative path of image ``number`` of identity ``name``."""
    return f"{name}/{name}_{number:04d}.{ext.lstrip('.')}"


def load_pairs(path: str | os.PathLike, ext: str = "jpg") -> Pairs:
    """Read a View 2 ``pairs.txt`` or a ``pairsDevTrain/DevTest.txt`` file.

    Takes the file and the image extension the paths get (``"jpg"``; see
    :func:`resolve_images` for files stored with another one). Returns the pairs in file
    order, each with its fold. Raises FileNotFoundError for a missing file and ValueError
    ``"FILE:LINE: ..."`` for an empty file, a missing or malformed header, a line with the
    wrong number of fields or a non-integer image number, and a pair count that disagrees
    with the header.
    """
    path = Path(path)
    ext = _check_ext(ext)
    if not path.is_file():
        raise FileNotFoundError(f"pairs file not found: {path}")
    # Keep the file's own line numbers: blank lines are skipped, not renumbered.
    numbered = [
        (i + 1, line.split()) for i, line in enumerate(read_text_lines(path)) if line.strip()
    ]
    if not numbered:
        raise ValueError(
            f"{path}: empty pairs file; expected a header line such as '10<TAB>300' "
            "(View 2: folds, pairs of each kind per fold) or '1100' (pairsDevTrain.txt) "
            "followed by the pairs"
        )

    header_line, header = numbered[0]
    num_folds, per_fold = _parse_header(header, path, header_line)
    body = numbered[1:]
    expected = num_folds * 2 * per_fold

    left: list[str] = []
    right: list[str] = []
    issame: list[bool] = []
    fold: list[int] = []
    line_numbers: list[int] = []
    for k, (line_no, fields) in enumerate(body[:expected]):
        fold_idx, pos = divmod(k, 2 * per_fold)
        is_same = pos < per_fold
        where = f"{path}:{line_no}"
        if len(fields) != (3 if is_same else 4):
            raise ValueError(
                f"{where}: expected {_pair_position(pos, fold_idx, per_fold)}, got "
                f"{len(fields)}: {' '.join(fields)!r} (the header on line {header_line} gives "
                f"{per_fold} same then {per_fold} different pairs per fold)"
            )
        if is_same:  # name n1 n2: both images of one identity
            fields = [fields[0], fields[1], fields[0], fields[2]]
        a, b = (
            image_path(_check_name(name, where), parse_count(number, where), ext)
            for name, number in (fields[0:2], fields[2:4])
        )
        left.append(a)
        right.append(b)
        issame.append(is_same)
        fold.append(fold_idx)
        line_numbers.append(line_no)

    _check_pair_count(body, path, header_line, header, num_folds, per_fold)
    return Pairs(
        left=left,
        right=right,
        issame=np.asarray(issame, dtype=bool),
        fold=np.asarray(fold, dtype=np.int64),
        num_folds=num_folds,
        source=str(path),
        line_numbers=np.asarray(line_numbers, dtype=np.int64),
    )


def _pair_position(pos: int, fold_idx: int, per_fold: int) -> str:
    """What line ``pos`` of fold ``fold_idx`` must hold, for an error message."""
    if pos < per_fold:
        return f"{PAIR_FIELDS['same']} for same-identity pair {pos + 1} of fold {fold_idx + 1}"
    return (
        f"{PAIR_FIELDS['different']} for different-identity pair {pos - per_fold + 1} of "
        f"fold {fold_idx + 1}"
    )


def _check_pair_count(
    body: Sequence[tuple[int, list[str]]],
    path: Path,
    header_line: int,
    header: list[str],
    num_folds: int,
    per_fold: int,
) -> None:
    """Raise a ValueError when ``body`` (the pair lines, numbered) holds fewer lines than
    the header promises (naming the header) or more (naming the first extra line)."""
    expected = num_folds * 2 * per_fold
    if len(body) < expected:
        raise ValueError(
            f"{path}:{header_line}: the header {' '.join(header)!r} promises {num_folds} "
            f"fold(s) x ({per_fold} same + {per_fold} different) = {expected} pair lines, "
            f"but the file has {len(body)}"
        )
    if len(body) > expected:
        raise ValueError(
            f"{path}:{body[expected][0]}: extra line after the {expected} pair lines that the "
            f"header {' '.join(header)!r} on line {header_line} promises "
            f"({len(body) - expected} extra in all)"
        )


def resolve_images(
    pairs: Pairs, root: str | os.PathLike, extensions: Sequence[str] = IMAGE_EXTENSIONS
) -> Pairs:
    """Check that every image of ``pairs`` exists under ``root``.

    An image missing with the extension the pairs were read with is looked for with each of
    ``extensions`` (lower and upper case). Returns a copy of ``pairs`` whose paths carry the
    extension actually found. Raises FileNotFoundError naming the pairs file, the line and
    the missing path (and how many other images are missing).
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(
            f"image folder not found: {root} (needed for the pairs in {pairs.source})"
        )
    found: dict[str, str | None] = {}

    def find(rel: str) -> str | None:
        if rel not in found:
            found[rel] = None
            stem = posixpath.splitext(rel)[0]
            candidates = [rel] + [stem + e for x in extensions for e in (x, x.upper())]
            for candidate in candidates:
                if (root / candidate).is_file():
                    found[rel] = candidate
                    break
        return found[rel]

    missing: list[tuple[int, str]] = []  # (pair index, path)
    for i, (a, b) in enumerate(zip(pairs.left, pairs.right, strict=True)):
        for rel in (a, b):
            if find(rel) is None:
                missing.append((i, rel))
    if missing:
        i, rel = missing[0]
        num_missing = len({rel for _, rel in missing})
        more = f"; {num_missing - 1} more images are missing" if num_missing > 1 else ""
        tried = ", ".join(extensions)
        raise FileNotFoundError(
            f"{pairs.location(i)}: image {rel!r} not found under {root} (also tried the "
            f"extensions {tried}){more}"
        )
    return dataclasses.replace(
        pairs,
        left=[found[p] for p in pairs.left],
        right=[found[p] for p in pairs.right],
    )


def write_pairs(
    path: str | os.PathLike,
    folds: Sequence[tuple[Sequence[SamePair], Sequence[DiffPair]]],
    *,
    dev_format: bool = False,
) -> None:
    """Write a protocol file that :func:`load_pairs` reads back: :func:`pairs_text` of
    ``folds``, the file replaced atomically. Raises ValueError as ``pairs_text`` does."""
    text = pairs_text(folds, dev_format=dev_format)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write next to the target and rename, so a crash never leaves half a pairs file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def pairs_text(
    folds: Sequence[tuple[Sequence[SamePair], Sequence[DiffPair]]], *, dev_format: bool = False
) -> str:
    """The text of a protocol file of ``folds`` (what :func:`write_pairs` writes).

    ``folds[f]`` is ``(same, different)``: the same-identity pairs ``(name, n1, n2)`` and
    the different-identity pairs ``(name1, n1, name2, n2)`` of fold f. Every fold must hold
    the same number of each kind (the header has one count). The View 2 header
    ``FOLDS<TAB>PER_FOLD``, or with ``dev_format=True`` (one fold only) the single count of
    ``pairsDevTrain.txt``. Raises ValueError naming the offending ``folds[f]...`` entry.
    """
    num_folds = len(folds)
    if num_folds == 0:
        raise ValueError("write_pairs: folds is empty; need at least one fold")
    if dev_format and num_folds != 1:
        raise ValueError(f"write_pairs: dev_format holds one fold, got {num_folds}")
    for f, fold_pairs in enumerate(folds):
        if len(fold_pairs) != 2:
            raise ValueError(f"write_pairs: folds[{f}] must be a (same, different) tuple")
    per_fold = len(folds[0][0])
    if per_fold == 0:
        raise ValueError("write_pairs: folds[0] has no same pairs; a fold needs at least one")
    for f, (same, different) in enumerate(folds):
        for kind, kind_pairs in (("same", same), ("different", different)):
            if len(kind_pairs) != per_fold:
                raise ValueError(
                    f"write_pairs: folds[{f}] has {len(kind_pairs)} {kind} pairs but folds[0] "
                    f"has {per_fold} same pairs; every fold needs the same number of each kind"
                )

    lines = [f"{per_fold}" if dev_format else f"{num_folds}\t{per_fold}"]
    for f, (same, different) in enumerate(folds):
        for j, pair in enumerate(same):
            where = f"write_pairs: folds[{f}] same pair {j}"
            if len(pair) != 3:
                raise ValueError(f"{where}: expected (name, n1, n2), got {pair!r}")
            name, n1, n2 = pair
            lines.append(
                f"{_check_name(name, where)}\t{_check_number(n1, where)}\t"
                f"{_check_number(n2, where)}"
            )
        for j, pair in enumerate(different):
            where = f"write_pairs: folds[{f}] different pair {j}"
            if len(pair) != 4:
                raise ValueError(f"{where}: expected (name1, n1, name2, n2), got {pair!r}")
            name1, n1, name2, n2 = pair
            lines.append(
                f"{_check_name(name1, where)}\t{_check_number(n1, where)}\t"
                f"{_check_name(name2, where)}\t{_check_number(n2, where)}"
            )
    return "\n".join(lines) + "\n"


def _parse_header(header: list[str], path: Path, line_no: int) -> tuple[int, int]:
    """(num_folds, pairs of each kind per fold) from the header's fields."""
    where = f"{path}:{line_no}"
    if len(header) not in (1, 2):
        looks_like_pair = len(header) in (3, 4)
        hint = " (this looks like a pair: the header line is missing)" if looks_like_pair else ""
        raise ValueError(
            f"{where}: expected a header 'FOLDS PAIRS_PER_FOLD' (e.g. '10 300') or a single "
            f"count (e.g. '1100'), got {' '.join(header)!r}{hint}"
        )
    try:
        values = [int(v) for v in header]
    except ValueError:
        raise ValueError(
            f"{where}: the header must hold integers ('10 300' or '1100'), got {' '.join(header)!r}"
        ) from None
    if any(v < 1 for v in values):
        raise ValueError(f"{where}: header counts must be >= 1, got {' '.join(header)!r}")
    if len(values) == 1:
        return 1, values[0]
    return values[0], values[1]


def parse_count(text: str, where: str, field: str = "image number") -> int:
    """`text` as an integer >= 0; a ValueError naming `where` and `field` otherwise."""
    try:
        number = int(text)
    except ValueError:
        raise ValueError(f"{where}: {field} must be an integer, got {text!r}") from None
    if number < 0:
        raise ValueError(f"{where}: {field} must be >= 0, got {number}")
    return number


def _check_number(number: object, where: str) -> int:
    # bool is an int subclass; True as an image number is certainly a bug upstream.
    if isinstance(number, bool) or not isinstance(number, int | np.integer) or number < 0:
        raise ValueError(f"{where}: image number must be an integer >= 0, got {number!r}")
    return int(number)


def _check_name(name: object, where: str) -> str:
    # A name becomes both a folder and a file prefix: whitespace would break the file
    # format and a path separator would point outside the identity's folder.
    if (
        not isinstance(name, str)
        or not name
        or any(c.isspace() for c in name)
        or "/" in name
        or "\\" in name
        or name in (".", "..")
    ):
        raise ValueError(
            f"{where}: identity name must be a non-empty string without whitespace or path "
            f"separators, got {name!r}"
        )
    return name


def _check_ext(ext: str) -> str:
    stripped = ext.lstrip(".")
    if not stripped or any(c.isspace() or c in "/\\" for c in stripped):
        raise ValueError(f"ext: expected an extension such as 'jpg', got {ext!r}")
    return stripped
