"""A compact, cached index of an image folder with millions of classes and files.

    root/<identity>/<image>        labels by sorted identity folder name

The index holds five numpy arrays and no Python string per file or class:

    class_blob, class_offsets   the identity folder names, UTF-8, back to back; name c is
                                class_blob[class_offsets[c]:class_offsets[c + 1]]
    file_blob, file_offsets     the file names (inside their identity folder), the same way
    labels                      (N,) int32, sorted: the files of class c are the contiguous
                                range class_starts[c]:class_starts[c + 1]

so 10 million files cost about 10 M x (name length + 12) bytes, in a few large buffers that a
forked DataLoader worker reads without writing: reading a Python list of strings from a
worker bumps every string's reference count and copies the page it lives on into the worker
(copy-on-write), which grows every worker to the size of the list over an epoch.

**The cache.** `open_index` writes the index into one file (a JSON header, then the arrays,
each 64-byte aligned) and memory-maps it: the pages are shared by every process on the
machine through the page cache, ranks included. The file lives in the image folder itself
(`root/.recognition-index-<options>.bin`, hidden, so never taken for an identity) or in
`cache_dir`. It is written to a temporary file and renamed into place, so a reader never sees
half a file.

**When the cache is stale.** The header stores a fingerprint: a SHA-256 over the options
(class list, empty-folder policy, extensions) and every identity folder's name and
modification time (st_mtime_ns). Adding, removing or renaming an identity folder changes the
list of names; adding, removing or renaming a file inside an identity folder changes that
folder's mtime. Checking costs one listing of the root and one `stat` per identity folder
(threads), not a listing of every folder. Limits: a file whose *content* is replaced in place
(same name) does not change the index and is not detected (it needs no new index either);
changes inside nested sub-folders of an identity folder are not seen (those files are not
indexed); a change made within the file system's timestamp granularity of the build, or on a
file system that does not update directory mtimes, can go unnoticed; `refresh=True` (config
`data.rebuild_index`) forces a rebuild.

**Several ranks.** Rank 0 checks, rebuilds if needed and writes the cache while the others
wait at a barrier; then every rank memory-maps the same file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".pgm", ".ppm", ".bmp", ".webp")

INDEX_MAGIC = b"RECIDX01"
INDEX_VERSION = 1
_ALIGN = 64
# Folders per thread-pool task: enough to amortise the task overhead, few enough that the
# threads stay balanced when folder sizes differ.
_FOLDERS_PER_TASK = 256

EmptyPolicy = Literal["error", "skip"]


class IndexFileError(ValueError):
    """A cache file that cannot be read (bad magic, truncated, unknown version)."""


def is_image_file(name: str) -> bool:
    """Whether the file name `name` has one of IMAGE_EXTENSIONS, in any letter case."""
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def _encode(name: str) -> bytes:
    # surrogateescape: file names that are not valid UTF-8 survive the round trip, as
    # os.fsencode / os.fsdecode do.
    return name.encode("utf-8", "surrogateescape")


def _decode(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def _default_threads() -> int:
    # Listing is system calls and (on network file systems) latency, not Python work:
    # more threads than cores pay off there and cost little on a local disk.
    return min(32, 4 * (os.cpu_count() or 1))


@dataclass
class FolderIndex:
    """The files of an image folder as compact arrays (see the module docstring)."""

    root: Path
    class_blob: np.ndarray
    class_offsets: np.ndarray
    file_blob: np.ndarray
    file_offsets: np.ndarray
    labels: np.ndarray
    class_starts: np.ndarray
    fingerprint: str
    source: Path | None = None
    """The cache file the arrays are mapped from, or None for an index in memory."""

    @property
    def num_classes(self) -> int:
        return len(self.class_offsets) - 1

    def __len__(self) -> int:
        return len(self.labels)

    def class_name(self, label: int) -> str:
        """The identity folder name of class `label`."""
        lo, hi = self.class_offsets[label], self.class_offsets[label + 1]
        return _decode(self.class_blob[lo:hi].tobytes())

    def file_name(self, index: int) -> str:
        """The file name of sample `index` inside its identity folder."""
        lo, hi = self.file_offsets[index], self.file_offsets[index + 1]
        return _decode(self.file_blob[lo:hi].tobytes())

    def relative_path(self, index: int) -> str:
        """`<identity>/<file>` of sample `index`, relative to the root."""
        return f"{self.class_name(int(self.labels[index]))}/{self.file_name(index)}"

    def iter_class_names(self) -> Iterator[str]:
        """Every class name in label order, one at a time (no list of all of them)."""
        for label in range(self.num_classes):
            yield self.class_name(label)

    def nbytes(self) -> int:
        """Bytes held by the arrays."""
        return sum(
            a.nbytes
            for a in (
                self.class_blob,
                self.class_offsets,
                self.file_blob,
                self.file_offsets,
                self.labels,
                self.class_starts,
            )
        )

    def __reduce__(self) -> tuple:
        # A mapped index travels to spawned workers as its file name, not its contents: the
        # worker maps the same pages.
        if self.source is not None:
            return (load_index, (self.source, self.root))
        return (
            FolderIndex,
            (
                self.root,
                self.class_blob,
                self.class_offsets,
                self.file_blob,
                self.file_offsets,
                self.labels,
                self.class_starts,
                self.fingerprint,
                None,
            ),
        )


# ---------------------------------------------------------------------- scanning


def _list_class_folders(root: Path) -> list[str]:
    """Sorted names of the non-hidden sub-folders of `root` (symlinks to folders included)."""
    with os.scandir(root) as entries:
        return sorted(e.name for e in entries if not e.name.startswith(".") and e.is_dir())


def _stat_mtimes(root: Path, names: Sequence[str], threads: int) -> list[int]:
    """st_mtime_ns of root/<name> for every name, in parallel."""

    def chunk(start: int) -> list[int]:
        return [
            os.stat(os.path.join(root, n)).st_mtime_ns
            for n in names[start : start + _FOLDERS_PER_TASK * 4]
        ]

    starts = range(0, len(names), _FOLDERS_PER_TASK * 4)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return [m for part in pool.map(chunk, starts) for m in part]


def _options_key(class_names: Sequence[str] | None, on_empty: EmptyPolicy) -> str:
    """A hash of what, besides the folder contents, decides the index."""
    h = hashlib.sha256()
    h.update(f"v{INDEX_VERSION}|{on_empty}|{','.join(IMAGE_EXTENSIONS)}|".encode())
    if class_names is None:
        h.update(b"sorted")
    else:
        for name in class_names:
            h.update(_encode(name) + b"\0")
    return h.hexdigest()


def _fingerprint(options_key: str, names: Sequence[str], mtimes: Sequence[int]) -> str:
    h = hashlib.sha256(options_key.encode())
    for name, mtime in zip(names, mtimes, strict=True):
        h.update(_encode(name) + b"\0" + str(mtime).encode() + b"\n")
    return h.hexdigest()


def _resolve_classes(root: Path, class_names: Sequence[str] | None) -> list[str]:
    """The class folder names in label order, checked against the folders that exist."""
    if not root.exists():
        raise FileNotFoundError(f"image folder {root} does not exist")
    if not root.is_dir():
        raise NotADirectoryError(f"image folder {root} is not a directory")
    found = _list_class_folders(root)
    if class_names is None:
        classes = found
    else:
        classes = list(class_names)
        if len(set(classes)) != len(classes):
            raise ValueError(f"class_names for {root} holds a name twice")
        missing = sorted(set(classes) - set(found))
        if missing:
            raise FileNotFoundError(
                f"{root}: {len(missing)} identity folders named in class_names are "
                f"missing, e.g. {missing[0]!r}"
            )
    if not classes:
        raise ValueError(f"{root}: no identity folders (expected {root}/<identity>/<image>)")
    broken = [name for name in classes if "\n" in name or "\r" in name]
    if broken:
        raise ValueError(
            f"{root}: identity folder {broken[0]!r} has a line break in its name "
            f"({len(broken)} such folder(s)); rename it: classes.txt lists one name per line"
        )
    return classes


def current_fingerprint(
    root: str | os.PathLike,
    *,
    class_names: Sequence[str] | None = None,
    on_empty: EmptyPolicy = "error",
    threads: int | None = None,
) -> str:
    """The fingerprint an index of `root` built now would carry (see the module docstring)."""
    root = Path(root)
    classes = _resolve_classes(root, class_names)
    mtimes = _stat_mtimes(root, classes, threads or _default_threads())
    return _fingerprint(_options_key(class_names, on_empty), classes, mtimes)


def _scan_chunk(root: Path, names: Sequence[str]) -> tuple[list[int], np.ndarray, bytes, int]:
    """List the identity folders `names`: (mtimes, image counts, joined names, non-images).

    The names come back as one bytes object with a NUL after each name, so the caller never
    holds a Python string per file.
    """
    mtimes: list[int] = []
    counts = np.zeros(len(names), dtype=np.int64)
    parts: list[bytes] = []
    num_other = 0
    for position, name in enumerate(names):
        folder = os.path.join(root, name)
        # The mtime is taken before the listing: a file added during the scan then makes
        # the fingerprint stale (a rebuild next time) rather than silently missing.
        mtimes.append(os.stat(folder).st_mtime_ns)
        with os.scandir(folder) as entries:
            files = []
            for entry in entries:
                if entry.name.startswith("."):
                    continue
                if is_image_file(entry.name) and entry.is_file():
                    files.append(entry.name)
                elif not entry.is_dir():
                    num_other += 1
        files.sort()
        counts[position] = len(files)
        if files:
            parts.append(_encode("\0".join(files)) + b"\0")
    return mtimes, counts, b"".join(parts), num_other


def scan_folder(
    root: str | os.PathLike,
    *,
    class_names: Sequence[str] | None = None,
    on_empty: EmptyPolicy = "error",
    threads: int | None = None,
) -> FolderIndex:
    """List `root/<identity>/<image>` into an in-memory FolderIndex, folders in parallel.

    Classes are the sorted non-hidden sub-folders of `root`, or `class_names` in that order
    (each must exist; others are left out). Files: those with an image extension (any case),
    sorted by name; hidden files, sub-folders and other files are ignored (counted in the
    log). An identity folder without images is an error naming it (`on_empty="error"`) or is
    dropped from the classes (`"skip"`, logged). Raises FileNotFoundError / ValueError.
    """
    root = Path(root)
    classes = _resolve_classes(root, class_names)
    threads = threads or _default_threads()
    starts = range(0, len(classes), _FOLDERS_PER_TASK)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        chunks = list(
            pool.map(lambda s: _scan_chunk(root, classes[s : s + _FOLDERS_PER_TASK]), starts)
        )
    mtimes = [m for c in chunks for m in c[0]]
    counts = np.concatenate([c[1] for c in chunks]) if chunks else np.zeros(0, np.int64)
    joined = b"".join(c[2] for c in chunks)
    num_other = sum(c[3] for c in chunks)
    fingerprint = _fingerprint(_options_key(class_names, on_empty), classes, mtimes)

    empty = np.flatnonzero(counts == 0)
    if len(empty):
        first = root / classes[int(empty[0])]
        if on_empty == "error":
            raise ValueError(
                f"{first}: identity folder holds no images (looked for "
                f"{', '.join(IMAGE_EXTENSIONS)}); {len(empty)} such folder(s) in {root}. "
                "Remove them or set data.on_empty_class=skip"
            )
        log.warning(
            "%s: skipping %d identity folder(s) without images, e.g. %s",
            root,
            len(empty),
            first,
        )
        keep = counts > 0
        classes = [name for name, k in zip(classes, keep, strict=True) if k]
        counts = counts[keep]
        if not classes:
            raise ValueError(f"{root}: no identity folder holds an image")
    if num_other:
        log.info("%s: ignored %d files without an image extension", root, num_other)

    # Every name is followed by a NUL (never part of a file name). Name k starts after the
    # k-th NUL; with the NULs removed from the blob, that start moves k bytes to the left.
    separated = np.frombuffer(joined, dtype=np.uint8)
    nuls = np.flatnonzero(separated == 0)
    file_blob = np.delete(separated, nuls)
    file_offsets = np.zeros(len(nuls) + 1, dtype=np.int64)
    file_offsets[1:] = nuls + 1 - np.arange(1, len(nuls) + 1)

    encoded = [_encode(n) for n in classes]
    class_blob = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()
    class_offsets = np.zeros(len(classes) + 1, dtype=np.int64)
    class_offsets[1:] = np.cumsum([len(e) for e in encoded])
    class_starts = np.zeros(len(classes) + 1, dtype=np.int64)
    class_starts[1:] = np.cumsum(counts)
    labels = np.repeat(np.arange(len(classes), dtype=np.int32), counts)
    return FolderIndex(
        root,
        class_blob,
        class_offsets,
        file_blob,
        file_offsets,
        labels,
        class_starts,
        fingerprint,
    )


# ---------------------------------------------------------------------- the cache file

_SECTIONS = ("class_blob", "class_offsets", "file_blob", "file_offsets", "labels", "class_starts")


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def write_index(index: FolderIndex, path: str | os.PathLike) -> None:
    """Write `index` to `path` atomically: a temporary file in the same folder, then a rename."""
    path = Path(path)
    arrays = {name: np.ascontiguousarray(getattr(index, name)) for name in _SECTIONS}
    sections: dict[str, Any] = {}
    offset = 0
    for name, array in arrays.items():
        sections[name] = {"offset": offset, "dtype": array.dtype.str, "count": int(array.size)}
        offset = _aligned(offset + array.nbytes)
    header = json.dumps(
        {
            "version": INDEX_VERSION,
            "fingerprint": index.fingerprint,
            "root": str(Path(index.root).resolve()),
            "num_classes": index.num_classes,
            "num_files": len(index),
            "sections": sections,
        }
    ).encode()
    data_start = _aligned(len(INDEX_MAGIC) + 8 + len(header))
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(INDEX_MAGIC + len(header).to_bytes(8, "little") + header)
            for name, array in arrays.items():
                f.seek(data_start + sections[name]["offset"])
                f.write(array.tobytes())
            f.truncate(data_start + offset)
            # On disk before the rename: a crash then leaves the old file or the whole new one.
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_index_header(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON header of the cache file `path`; ValueError naming it when it is not one."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(len(INDEX_MAGIC) + 8)
        if len(head) < len(INDEX_MAGIC) + 8 or head[: len(INDEX_MAGIC)] != INDEX_MAGIC:
            raise IndexFileError(f"{path}: not an image-folder index (bad magic)")
        length = int.from_bytes(head[len(INDEX_MAGIC) :], "little")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except ValueError as error:
        raise IndexFileError(f"{path}: corrupt index header ({error})") from error
    if not isinstance(header, dict) or header.get("version") != INDEX_VERSION:
        raise IndexFileError(f"{path}: index version {header.get('version')!r} is not supported")
    header["_data_start"] = _aligned(len(INDEX_MAGIC) + 8 + length)
    return header


def load_index(path: str | os.PathLike, root: str | os.PathLike | None = None) -> FolderIndex:
    """Memory-map the cache file `path` (read-only). `root` defaults to the one it records."""
    path = Path(path)
    header = read_index_header(path)
    size = path.stat().st_size
    start = header["_data_start"]
    arrays = {}
    for name in _SECTIONS:
        spec = header["sections"][name]
        dtype = np.dtype(spec["dtype"])
        end = start + spec["offset"] + spec["count"] * dtype.itemsize
        if end > size:
            raise IndexFileError(
                f"{path}: truncated index ({size} bytes, section {name} ends at {end})"
            )
        if spec["count"] == 0:
            arrays[name] = np.zeros(0, dtype=dtype)
        else:
            arrays[name] = np.memmap(
                path, dtype=dtype, mode="r", offset=start + spec["offset"], shape=(spec["count"],)
            )
    return FolderIndex(
        Path(root) if root is not None else Path(header["root"]),
        fingerprint=header["fingerprint"],
        source=path,
        **arrays,
    )


def cache_path(
    root: str | os.PathLike,
    cache_dir: str | os.PathLike | None,
    class_names: Sequence[str] | None = None,
    on_empty: EmptyPolicy = "error",
) -> Path:
    """Where the index of `root` with these options is cached."""
    key = _options_key(class_names, on_empty)[:12]
    root = Path(root)
    if cache_dir is None:
        return root / f".recognition-index-{key}.bin"
    where = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]
    return Path(cache_dir) / f"{root.resolve().name}-{where}-{key}.bin"


def open_index(
    root: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    class_names: Sequence[str] | None = None,
    on_empty: EmptyPolicy = "error",
    refresh: bool = False,
    rank_is_main: bool = True,
    barrier: Callable[[], None] = lambda: None,
    threads: int | None = None,
) -> FolderIndex:
    """The index of `root`, from its cache when current, else scanned and cached.

    Collective when `barrier` is a process-group barrier: the main rank checks the cache
    (`current_fingerprint`), rebuilds and writes it when stale, missing, unreadable or when
    `refresh`; every other rank waits, then maps the file. If the cache cannot be written
    (read-only data and no `cache_dir`), each rank scans for itself and a warning says so.
    """
    root = Path(root)
    path = cache_path(root, cache_dir, class_names, on_empty)
    index: FolderIndex | None = None
    if rank_is_main:
        index = _check_or_build(root, path, class_names, on_empty, refresh, threads)
    barrier()
    if rank_is_main:
        assert index is not None
        return index
    try:
        return load_index(path, root)
    except (OSError, ValueError):
        return scan_folder(root, class_names=class_names, on_empty=on_empty, threads=threads)


def _check_or_build(
    root: Path,
    path: Path,
    class_names: Sequence[str] | None,
    on_empty: EmptyPolicy,
    refresh: bool,
    threads: int | None,
) -> FolderIndex:
    start = time.perf_counter()
    if path.exists() and not refresh:
        try:
            cached = load_index(path, root)
        except (OSError, ValueError) as error:
            log.warning("rebuilding the index of %s: %s", root, error)
        else:
            now = current_fingerprint(
                root, class_names=class_names, on_empty=on_empty, threads=threads
            )
            if cached.fingerprint == now:
                log.info(
                    "index of %s from %s (%d files, %d classes; checked in %.1f s)",
                    root,
                    path,
                    len(cached),
                    cached.num_classes,
                    time.perf_counter() - start,
                )
                return cached
            log.info("the folders of %s changed since %s was built: rebuilding", root, path)
    index = scan_folder(root, class_names=class_names, on_empty=on_empty, threads=threads)
    log.info(
        "indexed %s: %d files, %d classes in %.1f s",
        root,
        len(index),
        index.num_classes,
        time.perf_counter() - start,
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_index(index, path)
    except OSError as error:
        log.warning(
            "cannot write the index cache %s (%s); set data.cache_dir to a writable folder "
            "to keep the index between runs",
            path,
            error,
        )
        return index
    # Map the file just written: the pages are then shared with the other ranks and the
    # DataLoader workers, and the in-memory copy is freed.
    return load_index(path, root)
