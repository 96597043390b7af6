"""Fine-tuning on real faces, side by side (`python -m benchmarks.finetune --root FOLDER`).

1. Split FOLDER's people (`benchmarks.finetune_data`): test people (those `eval.holdout=0.05`
   holds out; verification only), fine-tuning people (2 images each), pretraining people.
   Two domains: `same` (the images as they are) and `shifted` (the fine-tuning and the test
   images in grey-scale and/or blurred, `--shift`).
2. Per seed, pretrain once on the pretraining people: the default config (IResNet-18 at
   width 1/8, CosFace) at `--image-size` (64) for `--pretrain-epochs`; the same run for every
   variant. Its backbone verified on each domain's test pairs is the "no fine-tuning" row.
3. Every variant fine-tunes from it on each domain's fine-tuning people with the same
   steps, schedule (lr `--lr`, cosine, no warm-up) and seed, and is verified on that
   domain's test pairs (eval.targets with the pairs file, eval.holdout=0).

A run whose directory under `--work` already holds its result for the same command line is
not run again (`--work` keeps a comparison that was cut short, and lets a few variants be
added to it). The JSON holds every run; the Markdown table the mean over seeds and, for each
variant, its gain over "no fine-tuning" and over plain `train.init_backbone` seed by seed
(min..max over seeds).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, log_tail, run_command
from benchmarks.finetune_data import DOMAINS, SHIFTS, RealData, prepare
from benchmarks.table import machine, print_table, write_json, write_results

NO_FINETUNING = "no fine-tuning"
PLAIN_INIT = "init_backbone"
TEST = "test"
SEPARATION = re.compile(
    r"separate the new classes with d' (\S+) \(pair cosines: same identity (\S+) \+- (\S+) "
    r"over \d+ pairs, different (\S+) \+- (\S+)\)"
)
"""The centroid pass's log line (recognition/training/finetune/__init__.py)."""
WARNING = "separate the new classes poorly"


def variants(pretrained: Path, head_only_steps: int) -> dict[str, list[str]]:
    """Each fine-tuning variant's name and overrides (scratch starts from random weights;
    every other from the pretrained backbone)."""
    init = [f"train.init_backbone={pretrained}"]
    cent = [*init, "head.init=centroids"]
    head_only = f"train.head_only_steps={head_only_steps}"
    frozen = "model.freeze_bn=true"
    teacher = f"train.teacher={pretrained}"

    def scale(s: float) -> str:
        return f"optim.backbone_lr_scale={s}"

    return {
        "scratch": [],
        PLAIN_INIT: init,
        "centroids": cent,
        "centroids, head_only": [*cent, head_only],
        "centroids, head_only, freeze_bn, scale 0.1": [*cent, head_only, frozen, scale(0.1)],
        "centroids, freeze_bn": [*cent, frozen],
        "centroids, freeze_bn, scale 0.3": [*cent, frozen, scale(0.3)],
        "centroids, scale 0.1": [*cent, scale(0.1)],
        "centroids, scale 0.3": [*cent, scale(0.3)],
        "centroids, head_only, scale 0.3": [*cent, head_only, scale(0.3)],
        "init_backbone, scale 0.3": [*init, scale(0.3)],
        # The pretrained backbone also as the teacher (train.teacher): the new classes are
        # learned while the embeddings are held near the pretrained ones.
        "init_backbone, teacher": [*init, teacher],
        "centroids, scale 0.1, teacher": [*cent, scale(0.1), teacher],
    }


def train(out: Path, overrides: list[str], timeout_s: float) -> dict[str, Any]:
    """`python train.py` with `overrides` into `out` (or its result from a previous call with
    the same overrides; a run of them cut short resumes from its last checkpoint, a run of
    other overrides is removed first): {"eval": eval.json, "wall_s", "separation",
    "warned": the centroid pass's statistics and warning, see `separation`}."""
    done, started = out / "result.json", out / "overrides.json"
    log = out.parent / f"{out.name}.log"
    if done.is_file() and json.loads(done.read_text()).get("overrides") == overrides:
        return {**json.loads(done.read_text()), **separation(log)}
    if started.is_file() and json.loads(started.read_text()) != overrides:
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(started, overrides)
    command = [sys.executable, str(REPO_ROOT / "train.py"), f"output_dir={out}",
               "train.resume=auto", *overrides]  # fmt: skip
    start = time.perf_counter()
    code, timed_out = run_command(command, log, timeout_s)
    if code != 0 or timed_out:
        tail = "\n".join(log_tail(log))
        raise RuntimeError(f"{' '.join(command)} failed ({code}, timed out {timed_out}):\n{tail}")
    result = {
        "overrides": overrides,
        "eval": json.loads((out / "eval.json").read_text()),
        "wall_s": time.perf_counter() - start,
    }
    write_json(done, result)
    return {**result, **separation(log)}


def separation(log: Path) -> dict[str, Any]:
    """The centroid pass's statistics in a run's log (None without one) and whether the
    poor-separation warning fired."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    found = SEPARATION.search(text)
    keys = ("d_prime", "same_mean", "same_std", "different_mean", "different_std")
    stats = dict(zip(keys, map(float, found.groups()), strict=True)) if found else None
    return {"separation": stats, "warned": WARNING in text}


def targets(pairs: dict[str, Path]) -> str:
    """The eval.targets override verifying on each named pairs file."""
    items = ", ".join(f"{{name: {name}, pairs: {path}}}" for name, path in pairs.items())
    return f"eval.targets=[{items}]"


def run_seed(
    args: argparse.Namespace, data: RealData, seed: int, names: list[str]
) -> dict[str, Any]:
    """The pretraining and the variants `names` (all when empty) in every domain for one
    seed."""
    work = args.work / f"seed{seed}"
    base = [f"seed={seed}", f"data.image_size={args.image_size}", "eval.holdout=0",
            "train.progress=false"]  # fmt: skip
    pretrain = train(
        work / "pretrain",
        [*base, f"data.root={data.pretrain}", f"train.epochs={args.pretrain_epochs}",
         targets(data.pairs)],
        args.timeout,
    )  # fmt: skip
    print(f"seed {seed}: pretrained in {pretrain['wall_s']:.0f} s", file=sys.stderr)
    steps_per_epoch = data.sizes.finetune_images // args.batch_size
    common = [
        *base,
        f"train.batch_size={args.batch_size}",
        f"train.epochs={args.epochs}",
        f"optim.lr={args.lr}",
        "optim.warmup_epochs=0",
        *args.finetune_overrides,
    ]
    chosen = variants(work / "pretrain" / "backbone.pt", steps_per_epoch)
    unknown = [v for v in names if v not in chosen]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown[0]!r}; known: {', '.join(chosen)}")
    runs: dict[str, dict[str, Any]] = {}
    for domain in DOMAINS:
        runs[domain] = {NO_FINETUNING: {"accuracy": pretrain["eval"][domain]["accuracy"]}}
        for name in names or chosen:
            overrides = [*common, *chosen[name], f"data.root={data.finetune[domain]}",
                         targets({TEST: data.pairs[domain]})]  # fmt: skip
            out = work / domain / re.sub(r"[^a-z0-9.]+", "_", name.lower())
            result = train(out, overrides, args.timeout)
            runs[domain][name] = {
                "accuracy": result["eval"][TEST]["accuracy"],
                "wall_s": result["wall_s"],
                "separation": result["separation"],
                "warned": result["warned"],
                "overrides": chosen[name],
            }
            print(f"seed {seed} {domain:7s} {name:45s} "
                  f"{runs[domain][name]['accuracy']:.4f}", file=sys.stderr)  # fmt: skip
    return {"pretrain_wall_s": pretrain["wall_s"], "runs": runs}


def summarise(per_seed: dict[int, dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """For each domain and variant: the accuracy by seed (the seeds it ran on), its mean and
    spread, and its gains over no fine-tuning and over plain init_backbone, seed by seed."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for domain in DOMAINS:
        runs = {seed: r["runs"][domain] for seed, r in per_seed.items()}
        names = list(dict.fromkeys(name for by_name in runs.values() for name in by_name))
        out[domain] = {}
        for name in names:
            acc = {s: r[name]["accuracy"] for s, r in runs.items() if name in r}
            row: dict[str, Any] = {
                "accuracy": acc,
                "mean": statistics.fmean(acc.values()),
                "std": statistics.stdev(acc.values()) if len(acc) > 1 else None,
            }
            for ref in (NO_FINETUNING, PLAIN_INIT):
                gains = [a - runs[s][ref]["accuracy"] for s, a in acc.items() if ref in runs[s]]
                if ref != name and gains:
                    row[f"gain_over_{ref}"] = {
                        "mean": statistics.fmean(gains), "min": min(gains), "max": max(gains)
                    }  # fmt: skip
            out[domain][name] = row
    return out


def markdown(result: dict[str, Any]) -> str:
    """The summary as Markdown: the settings, one row per variant with both domains side by
    side (mean ± std over its seeds; gains: mean (min..max) of the per-seed differences), and
    the centroid pass's d' per domain."""
    summary, settings = result["summary"], result["settings"]

    def cell(row: dict[str, Any]) -> str:
        spread = f" ± {100 * row['std']:.1f}" if row["std"] is not None else ""
        return f"{100 * row['mean']:.1f}{spread}"

    def gain(row: dict[str, Any], ref: str) -> str:
        g = row.get(f"gain_over_{ref}")
        if g is None:
            return ""
        if len(row["accuracy"]) == 1:
            return f"{100 * g['mean']:+.1f}"
        return f"{100 * g['mean']:+.1f} ({100 * g['min']:+.1f}..{100 * g['max']:+.1f})"

    split = settings["split"]
    lines = [
        f"Real faces ({settings['root']}): pretrained on {split['pretrain_people']} people "
        f"({split['pretrain_images']} images), fine-tuned on {split['finetune_people']} other "
        f"people x 2 images, verified on {split['test_pairs']} pairs of "
        f"{split['test_people']} test people; shifted domain: {settings['shift']}; "
        f"{settings['image_size']} px, {settings['steps']} fine-tuning steps (batch "
        f"{settings['batch_size']}, lr {settings['lr']}, cosine), seeds {settings['seeds']}. "
        "Accuracy %: mean ± std over seeds; gains in points: mean (min..max) of the per-seed "
        "differences.",
        "",
        "| variant | seeds | " + " | ".join(
            f"{d}: accuracy % | vs no fine-tuning | vs init_backbone" for d in DOMAINS) + " |",
        "|---" * (2 + 3 * len(DOMAINS)) + "|",
    ]  # fmt: skip
    for name in summary[DOMAINS[0]]:
        cells = [str(len(summary[DOMAINS[0]][name]["accuracy"]))]
        for domain in DOMAINS:
            row = summary[domain][name]
            cells += [cell(row), gain(row, NO_FINETUNING), gain(row, PLAIN_INIT)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| domain | d' by seed (centroid pass) | the warning fired in |", "|---|---|---|"]
    for domain in DOMAINS:
        d_primes, warned = [], []
        for per in result["seeds"].values():
            runs = per["runs"][domain]
            stats = [r["separation"] for r in runs.values() if r.get("separation")]
            d_primes.append(f"{stats[0]['d_prime']:.2f}" if stats else "-")
            warned += [name for name, r in runs.items() if r.get("warned")]
        fired = ", ".join(dict.fromkeys(warned)) or "none"
        lines.append(f"| {domain} | {', '.join(d_primes)} | {fired} |")
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    """Run the comparison on `args.root` (see the module docstring); print and write it."""
    if not args.root.is_dir():
        raise SystemExit(f"--root: {args.root}: no such folder")
    if args.work is None:
        raise SystemExit("--root: needs --work FOLDER (outside the repository) for its runs")
    if args.work.resolve().is_relative_to(REPO_ROOT):
        raise SystemExit(f"--work: {args.work} is inside the repository; the images go there")
    t0 = time.perf_counter()
    data = prepare(args.root, args.work / "data", args.shift)
    once = list(args.once or ())
    per_seed = {
        seed: run_seed(args, data, seed, [*(args.variants or ()), *(once if i == 0 else ())])
        for i, seed in enumerate(args.seeds)
    }
    result = {
        "machine": machine(),
        "settings": {
            "root": str(args.root),
            "shift": args.shift,
            "split": vars(data.sizes),
            "seeds": list(args.seeds),
            "image_size": args.image_size,
            "pretrain_epochs": args.pretrain_epochs,
            "batch_size": args.batch_size,
            "epochs": args.epochs,
            "lr": args.lr,
            "finetune_overrides": args.finetune_overrides,
            "steps": data.sizes.finetune_images // args.batch_size * args.epochs,
        },
        "seeds": per_seed,
        "summary": summarise(per_seed),
        "total_s": time.perf_counter() - t0,
    }
    table = markdown(result)
    print(table)
    rows = [(name, *(f"{100 * result['summary'][d][name]['mean']:.1f}" for d in DOMAINS))
            for name in result["summary"][DOMAINS[0]]]  # fmt: skip
    print_table([("variant", -45), *((d, 8) for d in DOMAINS)], rows)
    if args.json is not None:
        write_results(args.json, result, table)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The real-folder mode's options (`--root` selects it)."""
    parser.add_argument(
        "--root", type=Path, default=None, help="a real image folder: compare on its people"
    )
    parser.add_argument("--shift", choices=sorted(SHIFTS), default="grey+blur")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--pretrain-epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.1, help="fine-tuning learning rate")
    parser.add_argument("--variants", nargs="+", default=None, help="run only these")
    parser.add_argument(
        "--finetune-overrides",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="added to every fine-tuning run (e.g. data.augment=face)",
    )
    parser.add_argument("--once", nargs="+", default=None, help="these too, on the first seed only")
