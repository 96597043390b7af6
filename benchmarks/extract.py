"""Throughput of embedding extraction (images/s), by default for the default config's backbone.

    python -m benchmarks.extract                         # default backbone, CPU
    python -m benchmarks.extract --backbone iresnet50 --width 1 --image-size 112 --images 256
    python -m benchmarks.extract --json extract.json     # also write every measurement

Two measurements per setting:

    model      the backbone alone on tensors already in memory (forward of B images, or of
               2B with flip: image and mirror in one batch), median over --repeats passes
    pipeline   `recognition.evaluation.embeddings.extract_embeddings` end to end over a
               folder of JPEGs: decode, resize, normalise (DataLoader with --workers
               processes), forward, flip sum, L2 normalisation; best of --repeats passes

The backbone has random weights (speed does not depend on their values). The JPEGs are
written once to a temporary folder, at --source-size pixels (like the synthetic data set),
and resized to the input size while loading.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from benchmarks.table import write_json
from recognition.config import load_config
from recognition.data.source import image_size_pair
from recognition.evaluation.embeddings import PathDataset, extract_embeddings
from recognition.models import build_backbone


def time_model(model: torch.nn.Module, x: torch.Tensor, flip: bool, repeats: int) -> float:
    """Images/s of the model's forward (batch x, with its mirror when flip), median of repeats."""
    batch = torch.cat([x, torch.flip(x, dims=[3])]) if flip else x
    times = []
    with torch.no_grad():
        model(batch)  # warm-up: first-call allocations and kernel selection
        for _ in range(repeats):
            start = time.perf_counter()
            model(batch)
            times.append(time.perf_counter() - start)
    return len(x) / statistics.median(times)


def time_pipeline(
    model: torch.nn.Module,
    dataset: PathDataset,
    batch_size: int,
    flip: bool,
    workers: int,
    repeats: int,
) -> float:
    """Images/s of extract_embeddings over the whole dataset, best of repeats."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        extract_embeddings(
            model, dataset, batch_size=batch_size, flip=flip, num_workers=workers, progress=False
        )
        best = min(best, time.perf_counter() - start)
    return len(dataset) / best


def write_images(folder: Path, num: int, size: int) -> list[str]:
    rng = np.random.default_rng(0)
    names = []
    for i in range(num):
        # Smooth random images: noise alone would make JPEG decoding unrealistically slow.
        small = rng.integers(0, 255, size=(8, 8, 3), dtype=np.uint8)
        image = Image.fromarray(small).resize((size, size), Image.Resampling.BILINEAR)
        name = f"{i:05d}.jpg"
        image.save(folder / name, quality=90)
        names.append(name)
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="default", help="config whose model to time")
    parser.add_argument("--backbone", help="override model.backbone")
    parser.add_argument("--width", type=float, help="override model.width")
    parser.add_argument("--image-size", type=int, help="override data.image_size")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--images", type=int, default=512, help="JPEGs for the pipeline")
    parser.add_argument("--source-size", type=int, default=112, help="side of the JPEGs")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the results here")
    return parser.parse_args(argv)


def row(what: str, batch: int, flip: bool, workers: int | None, rate: float) -> dict:
    return {"what": what, "batch": batch, "flip": flip, "workers": workers, "images_per_sec": rate}


def model_rows(model: torch.nn.Module, args: argparse.Namespace, size: int) -> list[dict]:
    """The model alone, for each batch size, without and with flip."""
    input_height, input_width = image_size_pair(size)
    rows = []
    for batch_size in args.batch_sizes:
        x = torch.randn(batch_size, 3, input_height, input_width)
        for flip in (False, True):
            rate = time_model(model, x, flip, args.repeats)
            rows.append(row("model", batch_size, flip, None, rate))
    return rows


def pipeline_rows(model: torch.nn.Module, args: argparse.Namespace, size: int) -> list[dict]:
    """extract_embeddings over written JPEGs, for each worker count, without and with flip."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        names = write_images(Path(tmp), args.images, args.source_size)
        dataset = PathDataset(names, size=size, root=tmp)
        for workers in args.workers:
            for flip in (False, True):
                batch_size = max(args.batch_sizes)
                rate = time_pipeline(model, dataset, batch_size, flip, workers, args.repeats)
                rows.append(row("pipeline", batch_size, flip, workers, rate))
    return rows


def print_rows(rows: list[dict]) -> None:
    header = f"{'what':<9} {'batch':>5} {'flip':>5} {'workers':>7} {'images/s':>9} {'ms/image':>9}"
    print(header)
    print("-" * len(header))
    for r in rows:
        workers = "-" if r["workers"] is None else str(r["workers"])
        print(
            f"{r['what']:<9} {r['batch']:>5} {'on' if r['flip'] else 'off':>5} {workers:>7} "
            f"{r['images_per_sec']:>9.1f} {1000 / r['images_per_sec']:>9.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    backbone_name = args.backbone or cfg.model.backbone
    width = args.width if args.width is not None else cfg.model.width
    size = args.image_size or cfg.data.image_size
    input_height, input_width = image_size_pair(size)
    torch.manual_seed(0)
    model = build_backbone(
        backbone_name,
        embedding_size=cfg.model.embedding_size,
        width=width,
        dropout=0.0,
        image_size=size,
    ).eval()
    num_params = sum(p.numel() for p in model.parameters())
    print(
        f"{backbone_name} width {width:g}, {input_height}x{input_width} input, embedding "
        f"{cfg.model.embedding_size}, {num_params / 1e6:.2f}M parameters; CPU, "
        f"{args.threads} thread(s), torch {torch.__version__}"
    )

    rows = model_rows(model, args, size) + pipeline_rows(model, args, size)
    print_rows(rows)
    if args.json is not None:
        payload = {
            "backbone": backbone_name,
            "width": width,
            "image_size": size,
            "embedding_size": cfg.model.embedding_size,
            "parameters": num_params,
            "threads": args.threads,
            "torch": torch.__version__,
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "results": rows,
        }
        write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
