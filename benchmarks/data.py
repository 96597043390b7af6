"""Benchmark of the data side: indexing a huge image folder, and loader throughput.

    python -m benchmarks.data --tree /tmp/bench_tree          # 100k folders x 10 files
    python -m benchmarks.data --tree /tmp/t --classes 1000 --files-per-class 10 --json d.json
    python -m benchmarks.data --skip-index                    # the loader and augment parts
    python -m benchmarks.data --skip-index --skip-loader --json results/augment_cpu.json

**Index** (a generated tree of `--classes` identity folders x `--files-per-class` empty
`.jpg` files, made once and reused): each method runs in a fresh process, which reports the
wall time and its resident memory after the import of its libraries (`baseline`), holding
the result (`after`) and at its peak (VmHWM); `held` = after - baseline is what keeping the
index costs that process (and, copied page by page, each DataLoader worker of it).

    warm-up            one listing of the tree, not reported: fills the kernel's dentry and
                       inode caches, so every method below lists from memory alike
    torchvision        torchvision.datasets.ImageFolder(root) (os.walk + Python lists)
    index build        recognition's parallel scan + writing the cache file (open_index,
                       refresh), then memory-mapping it
    index cached       second start: fingerprint check (a stat per identity folder) + mmap

**Loader**: images/s of a DataLoader (batch 128, 112x112 output, flips) over an image folder
of real JPEGs (the built-in synthetic faces, `--loader-images` of them) and over the same
images packed into .rec/.idx, with 0 worker processes (the main process reads: the rate
of one worker) and with 1 and 2 workers, for both kinds of worker (`data.decode`):

    decode (cpu)       the workers decode, resize and flip (AugmentedView): uint8 batches,
                       which the training step normalises on its device
    decode (cpu), float32 as before
                       the same, normalised to float32 on the workers, as they shipped before
                       (4x the bytes through shared memory); MB per batch says how much
    bytes only (gpu)   the workers read the encoded bytes (EncodedView + collate_encoded);
                       the GPU decodes them later, which this loader-only figure leaves out

One warm-up pass first (page cache), then the median of `--repeats` passes.

**Augment**: what `data.augment` costs a loader worker, per preset (none, flip, face, reid),
over the same image folder at --augment-size (112, the JPEGs' size; 48 is the default
config's), in rounds that take the presets in turn (so that a busy spell of a shared machine
hits them alike), each figure the median over the rounds:

    worker (cpu)       images/s of the DataLoader in the main process (0 workers: the rate
                       of one worker) that decodes, resizes, augments (AugmentedView) and
                       normalises; and its ratio to the `flip` preset's (today's default)
    augment alone      microseconds per image of AugmentedView over images decoded
                       beforehand (in memory): the draw and the transforms, nothing else;
                       per preset, and per operation (each alone on every image)
    batched (device)   microseconds per image of `augment_batch` (data.decode=gpu's code)
                       over a batch of --batch-size on the CPU, and on CUDA when there is one
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO_ROOT
from benchmarks.memory import proc_status_kib


def make_tree(root: Path, classes: int, per_class: int) -> None:
    """`classes` folders x `per_class` empty .jpg files under `root` (kept if complete)."""
    marker = root / ".complete"
    if marker.exists() and marker.read_text() == f"{classes} {per_class}":
        return
    if root.exists():
        shutil.rmtree(root)
    start = time.perf_counter()
    root.mkdir(parents=True)
    for c in range(classes):
        folder = root / f"m.{c:07d}"
        folder.mkdir()
        for n in range(per_class):
            # os.open/close: the cheapest way to make an empty file from Python.
            os.close(os.open(folder / f"{n:03d}.jpg", os.O_CREAT | os.O_WRONLY, 0o644))
    marker.write_text(f"{classes} {per_class}")
    print(f"generated {classes * per_class:,} files in {time.perf_counter() - start:.0f} s")


# ---------------------------------------------------------------------- index: one method


def measure(method: str, tree: str, cache_dir: str) -> dict:
    """Run one index method in this (fresh) process; returns its numbers."""
    import numpy  # noqa: F401  (imports count in the baseline, not in the index)
    import torch  # noqa: F401
    import torchvision.datasets

    from recognition.data.index import open_index, scan_folder

    baseline = proc_status_kib("VmRSS") or 0
    start = time.perf_counter()
    size = 0
    if method == "warm-up":
        held = scan_folder(tree)
        count = len(held)
    elif method == "torchvision":
        held = torchvision.datasets.ImageFolder(tree)
        count = len(held.samples)
    elif method == "index build":
        held = open_index(tree, cache_dir=cache_dir, refresh=True)
        count, size = len(held), held.nbytes()
    elif method == "index cached":
        held = open_index(tree, cache_dir=cache_dir)
        count, size = len(held), held.nbytes()
    else:
        raise ValueError(method)
    elapsed = time.perf_counter() - start
    after = proc_status_kib("VmRSS") or 0
    return {
        "method": method,
        "files": count,
        "seconds": elapsed,
        "baseline_mib": baseline / 1024,
        "held_mib": (after - baseline) / 1024,
        "peak_mib": ((proc_status_kib("VmHWM") or 0) - baseline) / 1024,
        "index_bytes_mib": size / 2**20,
    }


def run_index(tree: Path, cache_dir: Path) -> list[dict]:
    rows = []
    for method in ("warm-up", "torchvision", "index build", "index cached"):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.data",
                "--measure",
                method,
                str(tree),
                str(cache_dir),
            ],
            cwd=REPO_ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        row = json.loads(out.strip().splitlines()[-1])
        if method != "warm-up":
            rows.append(row)
    return rows


# ---------------------------------------------------------------------- loader


def run_loader(work: Path, num_images: int, repeats: int, batch_size: int) -> list[dict]:
    import torch
    from torch.utils.data import DataLoader

    from recognition.config import AugmentConfig
    from recognition.data import pack
    from recognition.data.gpu_decode import EncodedView, collate_encoded
    from recognition.data.image_folder import ImageFolderDataset
    from recognition.data.recordio import RecordIODataset
    from recognition.data.sampler import AugmentedView, ResumableSampler
    from recognition.data.synthetic import SyntheticSpec, ensure_synthetic_dataset

    per = 16
    spec = SyntheticSpec.training_set(max(1, num_images // per), per)
    ensure_synthetic_dataset(work / "synthetic", spec)
    folder = work / "synthetic" / "train"
    if not (work / "rec" / "train.rec").exists():
        pack.main([str(folder), str(work / "rec")])
    sources = {
        "image folder": ImageFolderDataset(folder, 112),
        "recordio": RecordIODataset(work / "rec", 112),
    }
    rows = []
    torch.set_num_threads(1)
    flip = AugmentConfig(preset="flip")
    for name, source in sources.items():
        mean_kib = os.path.getsize(work / "rec" / "train.rec") / len(source) / 1024
        # The CPU workers' batches as they were before they shipped uint8: float32 in [-1, 1].
        as_float = AugmentedView(source, flip)
        as_float.ships_pixels = False
        kinds = {
            "decode (cpu)": (AugmentedView(source, flip), None),
            "decode (cpu), float32 as before": (as_float, None),
            "bytes only (gpu)": (EncodedView(source, flip), collate_encoded),
        }
        for kind, (view, collate) in kinds.items():
            for workers in (0, 1, 2):
                sampler = ResumableSampler(len(source), seed=0)
                loader = DataLoader(
                    view,
                    batch_size=batch_size,
                    sampler=sampler,
                    drop_last=True,
                    num_workers=workers,
                    persistent_workers=workers > 0,
                    collate_fn=collate,
                )
                rates, batch_bytes = [], None
                for epoch in range(repeats + 1):
                    sampler.set_epoch(epoch)
                    start = time.perf_counter()
                    count = 0
                    for batch in loader:
                        # (images, labels) from the decoding workers, an EncodedBatch from the
                        # others (its bytes vary with the images: not reported)
                        if isinstance(batch, list):
                            count += len(batch[1])
                            batch_bytes = batch[0].numel() * batch[0].element_size()
                        else:
                            count += len(batch)
                    if epoch > 0:  # the first pass warms the page cache and starts the workers
                        rates.append(count / (time.perf_counter() - start))
                rows.append(
                    {
                        "source": name,
                        "workers_do": kind,
                        "workers": workers,
                        "images_per_sec": statistics.median(rates),
                        "images": count,
                        "mean_image_kib": mean_kib,
                        "batch_bytes": batch_bytes,
                    }
                )
                del loader
    return rows


# ---------------------------------------------------------------------- augment

AUGMENT_PRESETS = ("none", "flip", "face", "reid")
# Each operation alone, on every image, with the face preset's ranges (pad: the reid one's).
AUGMENT_OPERATIONS = {
    "crop, resize": {"crop": 1.0, "crop_scale": [0.2, 1.0]},
    "crop, in_place": {"crop": 1.0, "crop_mode": "in_place", "crop_scale": [0.2, 1.0]},
    "crop, pad": {"crop": 1.0, "crop_mode": "pad"},
    "colour": {"colour": 1.0, "brightness": 0.5, "contrast": 0.5, "saturation": 0.5},
    "grey": {"grey": 1.0},
    "low_res": {"low_res": 1.0, "low_res_scale": [0.2, 1.0]},
    "blur": {"blur": 1.0, "blur_sigma": [0.5, 1.5]},
    "erase": {"erase": 1.0, "erase_scale": [0.02, 0.4]},
}


class _InMemory:
    """The first `count` samples of `source`, decoded once (augment alone, no decode)."""

    def __init__(self, source, count: int) -> None:
        self.samples = [source[i] for i in range(min(count, len(source)))]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        return self.samples[index]


def run_augment(
    work: Path, num_images: int, repeats: int, batch_size: int, size: int = 112
) -> list[dict]:
    import torch

    from recognition.config import AugmentConfig
    from recognition.data.image_folder import ImageFolderDataset
    from recognition.data.synthetic import SyntheticSpec, ensure_synthetic_dataset

    per = 16
    spec = SyntheticSpec.training_set(max(1, num_images // per), per)
    folder = ensure_synthetic_dataset(work / "synthetic", spec) / "train"
    source = ImageFolderDataset(folder, size)  # the 112 px JPEGs, resized to `size`
    memory = _InMemory(source, 512)
    torch.set_num_threads(1)
    presets = {name: AugmentConfig(preset=name) for name in AUGMENT_PRESETS}
    operations = {
        name: AugmentConfig(preset="none", **settings)
        for name, settings in AUGMENT_OPERATIONS.items()
    }
    batch = torch.stack([memory[i][0] for i in range(min(batch_size, len(memory)))])
    timings: dict[tuple[str, str], list[float]] = {}
    for round_ in range(repeats + 1):  # round 0 warms up (page cache, first calls)
        measured: dict[tuple[str, str], float] = {}
        for name, cfg in presets.items():
            measured[(name, "worker")] = _worker_rate(source, cfg, batch_size, round_)
            measured[(name, "alone")] = _alone_us(memory, cfg, round_)
            for kind, us in _batched_us(batch, cfg, round_).items():
                measured[(name, kind)] = us
        for name, cfg in operations.items():
            measured[(name, "alone")] = _alone_us(memory, cfg, round_)
        if round_ > 0:
            for key, value in measured.items():
                timings.setdefault(key, []).append(value)
    rows = _augment_rows(timings, len(source) // batch_size * batch_size, repeats)
    return [{**row, "size": size} for row in rows]


def _worker_rate(source, cfg, batch_size: int, epoch: int) -> float:
    """Images/s of a DataLoader in this process (a worker's rate): decode and augment."""
    from torch.utils.data import DataLoader

    from recognition.data.sampler import AugmentedView, ResumableSampler

    sampler = ResumableSampler(len(source), seed=0)
    sampler.set_epoch(epoch)
    loader = DataLoader(AugmentedView(source, cfg), batch_size=batch_size, sampler=sampler,
                        drop_last=True)  # fmt: skip
    start = time.perf_counter()
    count = sum(len(labels) for _, labels in loader)
    return count / (time.perf_counter() - start)


def _alone_us(memory, cfg, epoch: int) -> float:
    """Microseconds per image of AugmentedView over decoded images: the augmentation alone."""
    from recognition.data.sampler import AugmentedView

    view = AugmentedView(memory, cfg)
    start = time.perf_counter()
    for i in range(len(memory)):
        view[(i, 1000 * epoch + i)]
    return (time.perf_counter() - start) / len(memory) * 1e6


def _batched_us(batch, cfg, epoch: int) -> dict[str, float]:
    """Microseconds per image of augment_batch over `batch`, on the CPU and on CUDA."""
    import torch

    from recognition.data.augment import draw_augment
    from recognition.data.augment_batch import augment_batch

    size = tuple(batch.shape[-2:])
    params = [draw_augment(cfg, 7 * epoch + i, size) for i in range(len(batch))]
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    result = {}
    for device in devices:
        images = batch.to(device).mul(0.5).add(0.5)
        _sync(device)
        start = time.perf_counter()
        augment_batch(images, params)
        _sync(device)
        result[device.type] = (time.perf_counter() - start) / len(batch) * 1e6
    return result


def _augment_rows(timings: dict, images: int, repeats: int) -> list[dict]:
    """One row per preset (medians, the ratio to flip's worker rate), then per operation."""
    flip_rate = statistics.median(timings[("flip", "worker")])
    rows = []
    for name in AUGMENT_PRESETS:
        rate = statistics.median(timings[(name, "worker")])
        cuda = timings.get((name, "cuda"))
        rows.append(
            {
                "preset": name,
                "worker_images_per_sec": rate,
                "x_flip": rate / flip_rate,
                "augment_alone_us": statistics.median(timings[(name, "alone")]),
                "batched_cpu_us": statistics.median(timings[(name, "cpu")]),
                "batched_cuda_us": statistics.median(cuda) if cuda else None,
                "images": images,
                "rounds": repeats,
            }
        )
    for name in AUGMENT_OPERATIONS:
        us = statistics.median(timings[(name, "alone")])
        rows.append({"operation": name, "augment_alone_us": us, "rounds": repeats})
    return rows


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def print_augment(rows: list[dict], batch_size: int) -> None:
    print(f"\nAugmentation, {rows[0]['size']} px, {rows[0]['images']} images per pass, medians of "
          f"{rows[0]['rounds']} rounds")  # fmt: skip
    print("| data.augment | worker images/s | x flip | augment alone (us/image) | batched, "
          f"CPU (us/image, batch {batch_size}) | batched, CUDA (us/image) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    presets = [r for r in rows if "preset" in r]
    for r in presets:
        cuda = "-" if r["batched_cuda_us"] is None else f"{r['batched_cuda_us']:.2f}"
        print(
            f"| {r['preset']} | {r['worker_images_per_sec']:.0f} | {r['x_flip']:.2f} "
            f"| {r['augment_alone_us']:.0f} | {r['batched_cpu_us']:.0f} | {cuda} |"
        )
    print("\nEach operation on every image, alone (the conversion to [0, 1] and back included)")
    print("| operation | us/image |")
    print("|---|---|")
    for r in rows:
        if "operation" in r:
            print(f"| {r['operation']} | {r['augment_alone_us']:.0f} |")


# ---------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", type=Path, default=Path(tempfile.gettempdir()) / "bench_tree")
    parser.add_argument("--classes", type=int, default=100_000)
    parser.add_argument("--files-per-class", type=int, default=10)
    parser.add_argument("--keep-tree", action="store_true", help="do not delete the tree")
    parser.add_argument("--skip-index", action="store_true")
    parser.add_argument("--skip-loader", action="store_true")
    parser.add_argument("--skip-augment", action="store_true")
    parser.add_argument("--augment-size", type=int, default=112, help="input side, augment part")
    parser.add_argument("--loader-images", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--json", type=Path, help="also write every measurement here")
    parser.add_argument("--measure", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return

    results: dict = {}
    if not args.skip_index:
        make_tree(args.tree, args.classes, args.files_per_class)
        cache_dir = Path(tempfile.mkdtemp(prefix="bench_index_cache"))
        try:
            rows = run_index(args.tree, cache_dir)
        finally:
            shutil.rmtree(cache_dir)
            if not args.keep_tree:
                shutil.rmtree(args.tree)
        results["index"] = rows
        print(f"\nIndex of {args.classes:,} identity folders x {args.files_per_class} files")
        print("| method | files | time (s) | RSS held (MiB) | RSS peak (MiB) | arrays (MiB) |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            arrays = f"{r['index_bytes_mib']:.1f}" if r["index_bytes_mib"] else "-"
            print(
                f"| {r['method']} | {r['files']:,} | {r['seconds']:.2f} | {r['held_mib']:.1f} "
                f"| {r['peak_mib']:.1f} | {arrays} |"
            )
    if not args.skip_loader:
        work = Path(tempfile.mkdtemp(prefix="bench_loader"))
        try:
            rows = run_loader(work, args.loader_images, args.repeats, args.batch_size)
        finally:
            shutil.rmtree(work)
        results["loader"] = rows
        print(f"\nLoader, 112x112, batch {args.batch_size}, {rows[0]['images']} images per pass")
        print("| source | workers do | worker processes | images/s | images/s per worker "
              "| MB per batch |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for r in rows:
            per_worker = r["images_per_sec"] / max(1, r["workers"])
            size = f"{r['batch_bytes'] / 1e6:.2f}" if r["batch_bytes"] else "-"
            print(
                f"| {r['source']} | {r['workers_do']} | {r['workers']} "
                f"| {r['images_per_sec']:.0f} | {per_worker:.0f} | {size} |"
            )
        print(f"(mean encoded image: {rows[0]['mean_image_kib']:.1f} KiB)")
    if not args.skip_augment:
        work = Path(tempfile.mkdtemp(prefix="bench_augment"))
        try:
            rows = run_augment(
                work, args.loader_images, args.repeats, args.batch_size, args.augment_size
            )
        finally:
            shutil.rmtree(work)
        results["augment"] = rows
        print_augment(rows, args.batch_size)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
