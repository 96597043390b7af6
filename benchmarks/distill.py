"""Distillation on real faces, CPU-sized: a MobileFaceNet student with and without an
IResNet teacher trained here, side by side on the same held-out people (docs/distillation.md).

    python -m benchmarks.distill --data ~/data/lfw-devtrain          # about 45 min on 2 cores
    python -m benchmarks.distill --data ~/data/lfw-devtrain \\
        --json benchmarks/results/distill_cpu.json                       # also a .md beside it
    python -m benchmarks.distill --data ~/data/lfw-devtrain --max-identities 200 \\
        --teacher-epochs 1 --epochs 1 --seeds 0 --image-size 32          # a smoke run, minutes

1. The teacher: `python train.py` on the folder (`--teacher-backbone`, `--teacher-width`,
   `--teacher-epochs`), holding `--holdout` of the people out (`eval.holdout`: chosen from the
   names alone, so every run below holds out the same people) and verifying on them.
   `--teacher PATH` takes a teacher file instead (any that train.teacher takes).
2. For each seed, two students of the same recipe (`mbf` at `--width`, `--epochs`): alone,
   and with `train.teacher` (its embeddings cached before step 1, `--distill-weight`). With
   `--variants alongside`, a run per seed with `train.teacher_cache=false` (the teacher run
   at every step), for the cost of not caching.
3. Each run's held-out verification accuracy (10 folds of the pairs of the held-out people,
   eval.json) and its wall time (the whole `python train.py`: the index, the teacher's pass,
   training, the evaluation). The table gives every run, then each variant's mean and
   standard deviation over the seeds, the accuracy difference and the cost ratio.

The student, the teacher and the held-out people are the same for every seed; the seed
changes the student's initialisation and its sample order (and the projection's start).
The defaults are CPU-sized with what real faces favoured for the CPU recipe
(docs/real-faces.md: 48x48, CosFace s 30 m 0.1 as the built-in run, 512-d embeddings, weight
decay 5e-3, 16 epochs): the teacher IResNet-50 at width 1/4 (2.1M parameters), the student
`mbf` at width 1/4 (0.14M).

A run already finished in the same `--work` folder with the same settings (its `bench.json`)
is not run again, so an interrupted comparison continues where it stopped, and
`--variants` splits one comparison over processes that share `--work` (for example the
students alone in one, the teacher and the distilled students in another; then one call
with every variant gathers the table).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import train_run
from benchmarks.table import machine, print_table, write_results

HOLDOUT_TARGET = "holdout"


VARIANTS = {"alone": "student alone", "distilled": "distilled", "alongside": "distilled, alongside"}


def common_overrides(args: argparse.Namespace, data: Path) -> list[str]:
    """What every run shares: the data, its size, the held-out share, the batch."""
    return [
        f"data.root={data}",
        "data.synthetic.enabled=false",
        f"data.image_size={args.image_size}",
        f"data.num_workers={args.workers}",
        f"eval.holdout={args.holdout}",
        f"model.embedding_size={args.embedding_size}",
        f"train.batch_size={args.batch_size}",
        "train.progress=false",
        f"train.log_every={args.log_every}",
        f"optim.weight_decay={args.weight_decay}",
    ]


def student_overrides(args: argparse.Namespace, seed: int) -> list[str]:
    return [
        "model.backbone=mbf",
        f"model.width={args.width}",
        f"train.epochs={args.epochs}",
        f"seed={seed}",
    ]


def held_out(run_dir: Path) -> dict[str, Any]:
    """The run's verification of its held-out people (eval.json)."""
    result = json.loads((run_dir / "eval.json").read_text())[HOLDOUT_TARGET]
    return {k: result[k] for k in ("num_pairs", "accuracy", "accuracy_std", "auc")}


def teacher_pass_s(run_dir: Path) -> float | None:
    """Seconds the run spent caching the teacher's embeddings (its log line), if it did."""
    for line in (run_dir / "train.log").read_text().splitlines():
        if "train.teacher: embeddings written in" in line:
            return float(line.rsplit(" in ", 1)[1].split()[0])
    return None


def train_once(out: Path, overrides: list[str], timeout_s: float) -> float:
    """`train_run`, or the wall seconds of the same run already finished in `out`."""
    record = out / "bench.json"
    if record.exists():
        done = json.loads(record.read_text())
        if done.get("overrides") == overrides and (out / "eval.json").exists():
            return float(done["wall_s"])
    wall = train_run(out, overrides, timeout_s)
    record.write_text(json.dumps({"overrides": overrides, "wall_s": wall}))
    return wall


def subset(data: Path, work: Path, count: int | None) -> Path:
    """`data`, or a folder of links to its first `count` people (sorted by name)."""
    if count is None:
        return data
    folder = work / "data"
    folder.mkdir(parents=True, exist_ok=True)
    for person in sorted(p for p in data.iterdir() if p.is_dir())[:count]:
        link = folder / person.name
        if not link.exists():
            link.symlink_to(person.resolve(), target_is_directory=True)
    return folder


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    data = subset(args.data, work, args.max_identities)
    common = common_overrides(args, data)
    started = time.perf_counter()
    teacher: dict[str, Any] = {"path": str(args.teacher) if args.teacher else None}
    wanted = [v for v in args.variants if v != "alone"]
    if args.teacher is None and wanted:
        out = work / "teacher"
        teacher["wall_s"] = train_once(
            out,
            [*common, f"model.backbone={args.teacher_backbone}",
             f"model.width={args.teacher_width}", f"train.epochs={args.teacher_epochs}",
             "seed=100"],
            args.timeout,
        )  # fmt: skip
        teacher.update(path=str(out / "backbone.pt"), held_out=held_out(out))
        print(json.dumps({"teacher": teacher}), file=sys.stderr)
    distill = [f"train.teacher={teacher['path']}", f"train.distill_weight={args.distill_weight}"]
    extras = {"alone": [], "distilled": distill,
              "alongside": [*distill, "train.teacher_cache=false"]}  # fmt: skip
    variants = [(VARIANTS[v], extras[v]) for v in VARIANTS if v in args.variants]
    rows = []
    for seed in args.seeds:
        for name, extra in variants:
            out = work / f"{name.replace(' ', '_').replace(',', '')}_seed{seed}"
            wall = train_once(out, [*common, *student_overrides(args, seed), *extra], args.timeout)
            row = {"variant": name, "seed": seed, "wall_s": wall, **held_out(out)}
            row["teacher_pass_s"] = teacher_pass_s(out)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    return {
        "machine": machine(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "teacher": teacher,
        "runs": rows,
        "summary": summarise(rows),
        "total_s": time.perf_counter() - started,
    }


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each variant's mean and spread over the seeds; the distilled runs against alone."""

    def spread(values: list[float]) -> dict[str, float]:
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        return {
            "mean": statistics.fmean(values),
            "std": std,
            "min": min(values),
            "max": max(values),
        }

    by_variant: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        by_variant[name] = {
            "seeds": len(mine),
            "accuracy": spread([r["accuracy"] for r in mine]),
            "wall_s": spread([r["wall_s"] for r in mine]),
        }
    alone = by_variant.get("student alone")
    for name, entry in by_variant.items():
        if alone is None or name == "student alone":
            continue
        # Per seed (the same seed alone and distilled), then over the seeds.
        pairs = [
            (r, a) for r in rows if r["variant"] == name
            for a in rows if a["variant"] == "student alone" and a["seed"] == r["seed"]
        ]  # fmt: skip
        entry["accuracy_gain_points"] = spread(
            [100 * (r["accuracy"] - a["accuracy"]) for r, a in pairs]
        )
        entry["cost_ratio"] = spread([r["wall_s"] / a["wall_s"] for r, a in pairs])
    return by_variant


def markdown(result: dict[str, Any]) -> str:
    """The result as a Markdown table (every run, then the summary)."""
    settings, teacher = result["settings"], result["teacher"]
    scored = teacher.get("held_out")
    teacher_text = f"teacher {teacher.get('path')}"
    if scored is not None:
        teacher_text += f" (held-out accuracy {100 * scored['accuracy']:.2f} %)"
    lines = [
        "## Distillation on lfw-devtrain (CPU)",
        "",
        f"{result['machine']['date']}, {result['machine']['cpus_usable']} CPUs; student mbf at "
        f"width {settings['width']}, {settings['image_size']} px, {settings['epochs']} epochs; "
        f"{teacher_text}; distill_weight {settings['distill_weight']}; held out "
        f"{settings['holdout']} of the people.",
        "",
        "| variant | seed | held-out accuracy | pairs | wall s | teacher pass s |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        passed = "-" if r["teacher_pass_s"] is None else f"{r['teacher_pass_s']:.0f}"
        lines.append(
            f"| {r['variant']} | {r['seed']} | {100 * r['accuracy']:.2f} % | {r['num_pairs']} "
            f"| {r['wall_s']:.0f} | {passed} |"
        )
    lines += [
        "",
        "| variant | accuracy, mean ± std (min-max) | gain, points | cost ratio |",
        "|---|---|---|---|",
    ]
    for name, s in result["summary"].items():
        lines.append(f"| {name} | {_accuracy(s)} | {_gain(s)} | {_ratio(s)} |")
    return "\n".join(lines) + "\n"


def _accuracy(summary: dict[str, Any]) -> str:
    acc = summary["accuracy"]
    low, high = 100 * acc["min"], 100 * acc["max"]
    return f"{100 * acc['mean']:.2f} ± {100 * acc['std']:.2f} % ({low:.2f}-{high:.2f})"


def _gain(summary: dict[str, Any]) -> str:
    gain = summary.get("accuracy_gain_points")
    return "-" if gain is None else f"{gain['mean']:+.2f} ± {gain['std']:.2f}"


def _ratio(summary: dict[str, Any]) -> str:
    ratio = summary.get("cost_ratio")
    return "-" if ratio is None else f"x{ratio['mean']:.2f} ± {ratio['std']:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True, help="lfw-devtrain (a folder)")
    parser.add_argument("--max-identities", type=int, default=None, help="the first N people")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--image-size", type=int, default=48)
    parser.add_argument("--embedding-size", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--holdout", type=float, default=0.2)
    parser.add_argument("--width", type=float, default=0.25, help="the student's model.width")
    parser.add_argument("--epochs", type=int, default=16)
    parser.add_argument("--weight-decay", type=float, default=5e-3)
    parser.add_argument("--teacher", type=Path, default=None, help="a teacher file to use")
    parser.add_argument("--teacher-backbone", default="iresnet50")
    parser.add_argument("--teacher-width", type=float, default=0.25)
    parser.add_argument("--teacher-epochs", type=int, default=16)
    parser.add_argument("--distill-weight", type=float, default=10.0)
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=["alone", "distilled"],
        help="alone, distilled (the teacher cached), alongside (the teacher run at every step)",
    )
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--timeout", type=float, default=6 * 3600.0, help="seconds per run")
    parser.add_argument("--work", type=Path, default=None, help="keep the runs here")
    parser.add_argument("--json", type=Path, default=None, help="also a .md beside it")
    args = parser.parse_args(argv)
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
        result = run(args, args.work)
    else:
        with tempfile.TemporaryDirectory(prefix="distill_") as scratch:
            result = run(args, Path(scratch))
    table = markdown(result)
    print(table)
    print_table(
        [("variant", -22), ("seeds", 6), ("accuracy %", -30), ("gain", -14), ("cost", -14)],
        [
            (name, s["seeds"], _accuracy(s), _gain(s), _ratio(s))
            for name, s in result["summary"].items()
        ],
    )
    if args.json is not None:
        write_results(args.json, result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
