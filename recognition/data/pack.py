"""Pack an image folder into an insightface-style RecordIO pack (`train.rec` + `train.idx`).

    python -m recognition.data.pack IMAGE_FOLDER OUT_DIR [--name train] [--threads 8]

Labels are the image folder's (sorted identity folder names, see `ImageFolderDataset`).
Written as insightface lays its packs out: keys 1..N the images in label order (the file
bytes as they are, each with its label in the header), keys N+1..N+C one record per identity
holding its [start, stop) image keys, and key 0 the header-only record whose labels are
[N+1, N+1+C]. `OUT_DIR/classes.txt` lists the identity folder names in label order. The
files are written under temporary names and renamed at the end, so an interrupted pack
leaves no half pack behind.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from recognition.data.index import FolderIndex, scan_folder
from recognition.data.recordio import RecordWriter, pack_payload

log = logging.getLogger(__name__)


def pack_folder(
    index: FolderIndex,
    out_dir: str | Path,
    *,
    name: str = "train",
    threads: int = 8,
    progress: bool = False,
) -> tuple[Path, Path]:
    """Write the images of `index` as `out_dir/<name>.rec` and `.idx`; returns both paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rec_path, idx_path = out_dir / f"{name}.rec", out_dir / f"{name}.idx"
    num_images, num_classes = len(index), index.num_classes
    writer = RecordWriter(rec_path, idx_path)
    try:
        # Record 0 first, as insightface writes it: readers that scan the file sequentially
        # meet the identity ranges before anything else.
        first, end = num_images + 1, num_images + 1 + num_classes
        writer.write(0, pack_payload((float(first), float(end)), b""))

        def read(i: int) -> bytes:
            return (index.root / index.relative_path(i)).read_bytes()

        # Reading in threads (file system latency), writing in order in this thread.
        with ThreadPoolExecutor(max_workers=threads) as pool:
            chunk = 4096
            bar = tqdm(total=num_images, disable=not progress, unit="img", desc="pack")
            for start in range(0, num_images, chunk):
                stop = min(start + chunk, num_images)
                for i, data in zip(
                    range(start, stop), pool.map(read, range(start, stop)), strict=True
                ):
                    writer.write(i + 1, pack_payload(float(index.labels[i]), data, id=i + 1))
                bar.update(stop - start)
            bar.close()
        for label in range(num_classes):
            lo, hi = int(index.class_starts[label]), int(index.class_starts[label + 1])
            writer.write(first + label, pack_payload((float(lo + 1), float(hi + 1)), b""))
        writer.close()
    except BaseException:
        writer.abort()
        raise
    with open(out_dir / "classes.txt", "w", encoding="utf-8", errors="surrogateescape") as f:
        for class_name in index.iter_class_names():
            f.write(class_name + "\n")
    return rec_path, idx_path


def main(argv: list[str] | None = None) -> int:
    """Command line; returns the exit status (1 with a message on bad input)."""
    parser = argparse.ArgumentParser(
        prog="python -m recognition.data.pack", description=__doc__.split("\n")[0]
    )
    parser.add_argument("folder", type=Path, help="image folder: FOLDER/<identity>/<image>")
    parser.add_argument("out", type=Path, help="output directory for <name>.rec / <name>.idx")
    parser.add_argument("--name", default="train", help="base name of the pack (train)")
    parser.add_argument("--threads", type=int, default=8, help="file-reading threads")
    parser.add_argument(
        "--skip-empty", action="store_true", help="leave out identity folders without images"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    try:
        index = scan_folder(args.folder, on_empty="skip" if args.skip_empty else "error")
        rec, idx = pack_folder(
            index, args.out, name=args.name, threads=args.threads, progress=sys.stderr.isatty()
        )
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(
        f"packed {len(index)} images of {index.num_classes} identities into {rec} and {idx} "
        f"in {time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
