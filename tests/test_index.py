"""The compact image-folder index: contents, the cache file, staleness, worker memory."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from recognition.data import index as index_module
from recognition.data.image_folder import ImageFolderDataset
from recognition.data.index import (
    FolderIndex,
    IndexFileError,
    cache_path,
    load_index,
    open_index,
    scan_folder,
    write_index,
)

EXTENSIONS = {".jpg", ".jpeg", ".png", ".pgm", ".ppm", ".bmp", ".webp"}


def make_tree(root: Path, seed: int = 0) -> None:
    """A messy tree: odd names, mixed-case extensions, clutter that must be left out."""
    rng = np.random.default_rng(seed)
    names = [f"id{n:03d}" for n in rng.permutation(40)] + ["Zoë", "émile", "a b", "10", "9"]
    for name in names:
        folder = root / name
        folder.mkdir(parents=True)
        for n in range(int(rng.integers(1, 7))):
            ext = [".jpg", ".JPG", ".png", ".Jpeg", ".webp"][int(rng.integers(5))]
            (folder / f"{int(rng.integers(10**6))}_{n}{ext}").write_bytes(b"")
        (folder / "notes.txt").write_text("not an image")
        (folder / ".hidden.jpg").write_bytes(b"")
        (folder / "sub.jpg").mkdir()  # a folder with an image-like name
        (folder / "sub.jpg" / "deep.jpg").write_bytes(b"")
    (root / ".cache").mkdir()
    (root / ".cache" / "x.jpg").write_bytes(b"")
    (root / "README.jpg").write_bytes(b"")  # a file at the root is not an identity


def walk_reference(root: Path) -> tuple[list[str], list[str], list[int]]:
    """(classes, relative paths, labels) from a plain os.walk, independently of the index."""
    top, dirs, _ = next(os.walk(root))
    classes = sorted(d for d in dirs if not d.startswith("."))
    paths, labels = [], []
    for label, name in enumerate(classes):
        _, _, files = next(os.walk(os.path.join(top, name)))
        for file in sorted(files):
            if not file.startswith(".") and os.path.splitext(file)[1].lower() in EXTENSIONS:
                paths.append(f"{name}/{file}")
                labels.append(label)
    return classes, paths, labels


def as_lists(index: FolderIndex) -> tuple[list[str], list[str], list[int]]:
    classes = [index.class_name(c) for c in range(index.num_classes)]
    return classes, [index.relative_path(i) for i in range(len(index))], index.labels.tolist()


def test_index_matches_a_sorted_os_walk(tmp_path: Path):
    make_tree(tmp_path / "faces")
    expected = walk_reference(tmp_path / "faces")
    index = scan_folder(tmp_path / "faces", threads=3)
    assert as_lists(index) == expected
    assert index.labels.dtype == np.int32
    # class_starts delimits each class's contiguous range of files.
    for label in range(index.num_classes):
        lo, hi = index.class_starts[label], index.class_starts[label + 1]
        assert (index.labels[lo:hi] == label).all() and hi > lo
    # Through the cache file: the same contents, memory-mapped.
    loaded = open_index(tmp_path / "faces")
    assert isinstance(loaded.labels, np.memmap)
    assert as_lists(loaded) == expected
    assert list(cache_path(tmp_path / "faces", None).parent.glob("*.tmp")) == []


def test_cache_is_reused_then_rebuilt_when_the_tree_changes(tmp_path: Path, monkeypatch):
    root = tmp_path / "faces"
    make_tree(root)
    scans = []
    import recognition.data.index as index_module

    real_scan = index_module.scan_folder

    def counting_scan(*args, **kwargs):
        scans.append(1)
        return real_scan(*args, **kwargs)

    monkeypatch.setattr(index_module, "scan_folder", counting_scan)
    first = open_index(root)
    assert len(scans) == 1
    second = open_index(root)
    assert len(scans) == 1 and second.fingerprint == first.fingerprint

    # Directory mtimes have a granularity: wait it out so that the change is visible.
    time.sleep(0.02)
    (root / "id005" / "new.jpg").write_bytes(b"")
    third = open_index(root)
    assert len(scans) == 2
    assert "id005/new.jpg" in as_lists(third)[1]
    assert as_lists(third) == walk_reference(root)

    time.sleep(0.02)
    (root / "id005" / "new.jpg").unlink()
    (root / "zz_new_identity").mkdir()
    (root / "zz_new_identity" / "1.png").write_bytes(b"")
    fourth = open_index(root)
    assert len(scans) == 3 and as_lists(fourth) == walk_reference(root)
    open_index(root, refresh=True)
    assert len(scans) == 4


def test_corrupt_or_truncated_cache_is_rebuilt(tmp_path: Path, caplog):
    root = tmp_path / "faces"
    make_tree(root)
    path = cache_path(root, tmp_path / "cache")
    open_index(root, cache_dir=tmp_path / "cache")
    assert path.is_file() and not any(root.glob(".recognition-index*"))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(IndexFileError, match="truncated"):
        load_index(path)
    index = open_index(root, cache_dir=tmp_path / "cache")
    assert as_lists(index) == walk_reference(root)
    assert "truncated" in caplog.text
    path.write_bytes(b"garbage" * 20)
    with pytest.raises(IndexFileError, match="bad magic"):
        load_index(path)
    assert as_lists(open_index(root, cache_dir=tmp_path / "cache")) == walk_reference(root)


def test_empty_identity_folders_follow_the_policy(tmp_path: Path):
    root = tmp_path / "faces"
    make_tree(root)
    (root / "id007_empty").mkdir()
    (root / "id007_empty" / "notes.txt").write_text("no image")
    with pytest.raises(ValueError, match="id007_empty: identity folder holds no images"):
        scan_folder(root)
    index = scan_folder(root, on_empty="skip")
    classes, paths, labels = as_lists(index)
    assert "id007_empty" not in classes
    reference = walk_reference(root)
    # The reference keeps the empty folder's label slot; dropping it shifts later labels.
    assert paths == reference[1] and classes == [c for c in reference[0] if c != "id007_empty"]
    assert labels == sorted(labels) and set(labels) == set(range(len(classes)))


def test_read_only_data_without_cache_dir_still_works(tmp_path: Path, caplog, monkeypatch):
    root = tmp_path / "faces"
    make_tree(root)

    # A read-only data folder, simulated at the write itself: chmod does not bind root, which
    # CI may run as.
    def refuse(index, path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(index_module, "write_index", refuse)
    index = open_index(root)
    assert as_lists(index) == walk_reference(root) and index.source is None
    assert "cannot write the index cache" in caplog.text
    assert not list(root.glob(".recognition-index-*"))


# ---------------------------------------------------------------------- worker memory


def digits(values: np.ndarray, width: int) -> np.ndarray:
    """(len(values), width) uint8 ASCII decimal digits of `values`, zero-padded."""
    powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    return ((values[:, None] // powers) % 10 + ord("0")).astype(np.uint8)


def synthetic_index(num_classes: int, per_class: int) -> FolderIndex:
    """An index of num_classes x per_class entries, `n<class>/<class>_<k>.jpg`.

    Built with array arithmetic and no Python string per entry: a million freed strings
    would leave holes in this process's heap that a forked worker fills (copying those
    pages), which would blur the measurement below.
    """
    classes = np.arange(num_classes, dtype=np.int64)
    class_blob = np.hstack([np.full((num_classes, 1), ord("n"), np.uint8), digits(classes, 7)])
    entries = np.arange(num_classes * per_class, dtype=np.int64)
    suffix = np.frombuffer(b".jpg", dtype=np.uint8)
    file_blob = np.hstack(
        [
            digits(entries // per_class, 7),
            np.full((len(entries), 1), ord("_"), np.uint8),
            digits(entries % per_class, 2),
            np.broadcast_to(suffix, (len(entries), 4)),
        ]
    )
    return FolderIndex(
        Path("/nonexistent"),
        class_blob.ravel(),
        np.arange(num_classes + 1, dtype=np.int64) * class_blob.shape[1],
        file_blob.ravel(),
        np.arange(len(entries) + 1, dtype=np.int64) * file_blob.shape[1],
        np.repeat(classes.astype(np.int32), per_class),
        np.arange(num_classes + 1, dtype=np.int64) * per_class,
        "",
    )


def private_dirty_kib() -> int:
    """Private_Dirty (KiB) of this process's anonymous memory: the heap pages it has written,
    copy-on-write copies of its parent's pages included.

    File-backed mappings are left out: a page of a freshly written (or tmpfs) file counts as
    dirty while the file system has not written it back, whoever maps it, which says nothing
    about copying.
    """
    total = 0
    anonymous = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and ":" not in fields[0]:  # a mapping's header line
            path = fields[5] if len(fields) > 5 else ""
            anonymous = path == "" or (path.startswith("[") and path != "[vdso]")
        elif anonymous and fields[0] == "Private_Dirty:":
            total += int(fields[1])
    return total


class TouchAll(Dataset):
    """Item 0: the worker's Private_Dirty; item k > 0: reads chunk k-1 of `paths`, then it."""

    def __init__(self, paths, chunks: int):
        self.paths = paths  # None: the same items without reading any path (the floor)
        self.chunk = -(-len(paths or ()) // chunks)
        self.chunks = chunks

    def __len__(self) -> int:
        return self.chunks + 1

    def __getitem__(self, k: int) -> int:
        if k > 0 and self.paths is not None:
            total = 0
            for i in range((k - 1) * self.chunk, min(k * self.chunk, len(self.paths))):
                total += len(self.paths[i])
            assert total > 0
        return private_dirty_kib()


def worker_growth_mib(paths) -> float:
    loader = DataLoader(TouchAll(paths, 8), batch_size=None, num_workers=1)
    readings = [int(x) for x in loader]
    return (readings[-1] - readings[0]) / 1024


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_workers_share_a_million_entry_index_instead_of_copying_it(tmp_path: Path):
    if torch.multiprocessing.get_start_method() != "fork":
        pytest.skip("copy-on-write growth is a fork matter")
    index = synthetic_index(100_000, 10)
    assert len(index) == 1_000_000
    write_index(index, tmp_path / "index.bin")
    mapped = load_index(tmp_path / "index.bin")
    dataset = ImageFolderDataset(tmp_path, 16, index=mapped)
    assert dataset.paths[123_456] == "n0012345/0012345_06.jpg"

    # The worker's own growth over the same items without reading a path (its imports,
    # allocator arenas, pickling): machine-dependent, so measured and subtracted.
    floor = worker_growth_mib(None)
    index_growth = worker_growth_mib(dataset.paths) - floor
    # Control, measured second (freed objects would leave holes in the parent's heap that a
    # worker then fills, copying those pages): the same paths as a Python list, the old
    # index. Touching each string in a worker writes its reference count, copying every
    # page of the list into the worker.
    as_list = [f"n{c:07d}/{c:07d}_{k:02d}.jpg" for c in range(100_000) for k in range(10)]
    list_growth = worker_growth_mib(as_list) - floor
    print(
        f"worker Private_Dirty growth over the floor ({floor:.1f} MiB): "
        f"list {list_growth:.1f} MiB, index {index_growth:.1f} MiB"
    )
    assert list_growth > 40  # the measurement sees copy-on-write when it happens
    assert index_growth < 10  # temporaries of the lookups; the list costs ~80
