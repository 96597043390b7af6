"""Fine-tuning on CPU, side by side at equal steps: from scratch against the ways of starting
from a pretrained backbone (docs/finetune.md).

    python -m benchmarks.finetune                         # about 10 minutes on 2 shared cores
    python -m benchmarks.finetune --json benchmarks/results/finetune_cpu.json

1. Pretrain: `python train.py` on the built-in synthetic set (the default config: 1,000
   identities x 16 images, IResNet-18 at width 1/8, 48x48), `--pretrain-steps` steps.
2. A second synthetic set of other identities under a domain shift: another seed (other
   faces), every image (training and held-out) blurred and colour-cast by this script after
   it is generated, and few images per identity (`--identities` x `--images`).
3. Fine-tune on it for `--epochs` epochs, the same steps, schedule and seed for every variant:
   from scratch; train.init_backbone; + head.init=centroids; + train.head_only_steps (one
   epoch); + model.freeze_bn; + optim.backbone_lr_scale=0.1 (each row adding one setting:
   the last is configs/finetune.yaml's recipe). The held-out identities' verification
   accuracy (5 folds of 300 pairs) is measured after 25, 50, 75 and 100 % of the steps; the
   pretrained backbone before any fine-tuning is evaluated on the same pairs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageFilter

from benchmarks import finetune_real
from benchmarks.common import train_run, verify_pairs
from benchmarks.table import machine, print_table, write_json

# The shift: a blur of this radius (pixels of the 112-pixel rendering) and these per-channel
# gains (R, G, B), on top of the generator's own per-image nuisances.
BLUR_RADIUS = 1.5
COLOUR_GAINS = (1.2, 1.0, 0.75)
SHIFTED_SEED = 1
FRACTIONS = (0.25, 0.5, 0.75, 1.0)
TARGET = "shifted"


def variants(pretrained: Path, head_only_steps: int) -> list[tuple[str, list[str]]]:
    """(name, overrides) of each fine-tuning run: each row adds one setting to the row
    above it (the last is configs/finetune.yaml's recipe)."""
    start = [f"train.init_backbone={pretrained}"]
    centroids = [*start, "head.init=centroids"]
    head_only = [*centroids, f"train.head_only_steps={head_only_steps}"]
    frozen = [*head_only, "model.freeze_bn=true"]
    return [
        ("from scratch", []),
        ("init_backbone", start),
        ("+ centroids", centroids),
        ("+ head_only_steps", head_only),
        ("+ freeze_bn", frozen),
        ("+ backbone_lr_scale 0.1", [*frozen, "optim.backbone_lr_scale=0.1"]),
    ]


def shift_domain(root: Path) -> int:
    """Blur and colour-cast every image under `root` in place; returns how many."""
    paths = sorted(p for p in root.rglob("*") if p.suffix.lower() in (".jpg", ".png"))
    gains = np.asarray(COLOUR_GAINS, dtype=np.float32)
    for path in paths:
        with Image.open(path) as image:
            blurred = image.convert("RGB").filter(ImageFilter.GaussianBlur(BLUR_RADIUS))
        cast = np.clip(np.asarray(blurred, dtype=np.float32) * gains, 0, 255).astype(np.uint8)
        Image.fromarray(cast).save(path, quality=90)
    return len(paths)


def make_shifted_set(root: Path, identities: int, images: int) -> None:
    from recognition.config.synthetic import SyntheticSpec
    from recognition.data.synthetic.generation import generate_synthetic_dataset

    spec = SyntheticSpec(
        num_identities=identities,
        images_per_identity=images,
        num_val_identities=100,
        val_images_per_identity=6,
        num_folds=5,
        pairs_per_fold=150,
        seed=SHIFTED_SEED,
    )
    generate_synthetic_dataset(root, spec)
    shift_domain(root)


def accuracies(run_dir: Path) -> dict[int, float]:
    """Held-out accuracy by step, from the run's periodic evaluations."""
    key = f"eval/{TARGET}/accuracy"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in records if key in r}


def evaluate_pretrained(backbone: Path, shifted: Path, out: Path) -> float:
    return verify_pairs(backbone, shifted / "val", out, 600)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    pretrain_data = work / "pretrain_data"
    t0 = time.perf_counter()
    pretrain_s = train_run(
        work / "pretrain",
        [
            f"data.root={pretrain_data / 'train'}",
            f"data.synthetic.root={pretrain_data}",
            f"train.max_steps={args.pretrain_steps}",
            f"eval.targets=[{{name: synthetic-val, pairs: {pretrain_data / 'val' / 'pairs.txt'}}}]",
            "train.progress=false",
        ],
        args.timeout,
    )
    pretrained = work / "pretrain" / "backbone.pt"
    in_domain = json.loads((work / "pretrain" / "eval.json").read_text())
    shifted = work / "shifted"
    make_shifted_set(shifted, args.identities, args.images)
    before = evaluate_pretrained(pretrained, shifted, work / "pretrained_on_shifted.json")
    steps_per_epoch = args.identities * args.images // args.batch_size
    steps = steps_per_epoch * args.epochs
    every = steps // 4
    common = [
        "data.synthetic.enabled=false",
        f"data.root={shifted / 'train'}",
        f"train.batch_size={args.batch_size}",
        f"train.epochs={args.epochs}",
        f"eval.targets=[{{name: {TARGET}, pairs: {shifted / 'val' / 'pairs.txt'}}}]",
        f"eval.every_steps={every}",
        "eval.at_end=false",
        "train.progress=false",
    ]
    rows = []
    for name, overrides in variants(pretrained, steps_per_epoch):
        out = work / name.replace(" ", "_").replace(",", "").replace("+", "plus")
        wall = train_run(out, [*common, *overrides], args.timeout)
        by_step = accuracies(out)
        # After 25, 50, 75 and 100 % of the steps: evaluations 1 to 4.
        measured = {f"{round(100 * f)}%": by_step.get(every * round(4 * f)) for f in FRACTIONS}
        rows.append({"variant": name, "overrides": overrides, "accuracy": measured, "wall_s": wall})
        print(json.dumps(rows[-1]), file=sys.stderr)
    return {
        "machine": machine(),
        "settings": {
            "pretrain_steps": args.pretrain_steps,
            "identities": args.identities,
            "images_per_identity": args.images,
            "batch_size": args.batch_size,
            "epochs": args.epochs,
            "steps": steps,
            "head_only_steps": steps_per_epoch,
            "blur_radius": BLUR_RADIUS,
            "colour_gains": COLOUR_GAINS,
            "shifted_seed": SHIFTED_SEED,
        },
        "pretrain": {"wall_s": pretrain_s, "in_domain_accuracy": in_domain},
        "pretrained_on_shifted_accuracy": before,
        "runs": rows,
        "total_s": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pretrain-steps", type=int, default=400)
    parser.add_argument("--identities", type=int, default=480)
    parser.add_argument("--images", type=int, default=3, help="training images per identity")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds per training run (900; --root: 7200)"
    )
    parser.add_argument("--work", type=Path, default=None, help="keep the runs here")
    parser.add_argument("--json", type=Path, default=None)
    finetune_real.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.root is not None:
        args.timeout = args.timeout or 7200.0
        return finetune_real.main(args)
    args.timeout = args.timeout or 900.0
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
        result = run(args, args.work)
    else:
        with tempfile.TemporaryDirectory(prefix="finetune_") as scratch:
            result = run(args, Path(scratch))
    in_domain = result["pretrain"]["in_domain_accuracy"]["synthetic-val"]["accuracy"]
    print(
        f"pretrained {result['settings']['pretrain_steps']} steps: held-out accuracy "
        f"{in_domain:.4f} on its own domain, {result['pretrained_on_shifted_accuracy']:.4f} on "
        "the shifted pairs before fine-tuning"
    )
    steps = result["settings"]["steps"]

    def cell(value: float | None) -> str:
        return "-" if value is None or math.isnan(value) else f"{value:.4f}"

    every = steps // 4
    columns = [(f"{round(100 * f)}% ({every * round(4 * f)})", 11) for f in FRACTIONS]
    print_table(
        [("variant", -26), *columns, ("wall s", 7)],
        [
            (r["variant"], *[cell(v) for v in r["accuracy"].values()], f"{r['wall_s']:.0f}")
            for r in result["runs"]
        ],
    )
    if args.json is not None:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
