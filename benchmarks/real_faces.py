"""Recipes on a real face folder, side by side: held-out verification accuracy and minutes.

    python -m benchmarks.real_faces --root $HOME/data/lfw-devtrain     # the shipped CPU recipes
    python -m benchmarks.real_faces --root $HOME/data/lfw-devtrain --seeds 0 1 2 \\
        --recipe folder_cpu config=folder_cpu --recipe default config=default \\
        --json benchmarks/results/real_faces_cpu.json \\
        --markdown benchmarks/results/real_faces_cpu.md
    python -m benchmarks.real_faces --root $HOME/data/lfw-devtrain --split dev \\
        --recipe r64 config=default data.image_size=64

Each recipe is `--recipe NAME [config=CONFIG] [key=value ...]` (the config defaults to
`folder_cpu`); each runs once per seed as `python train.py --config CONFIG data.root=ROOT
seed=S key=value ...` in a process of its own, one after the other (a run is given the whole
machine: its minutes are the recipe's cost), and is scored by the held-out verification
accuracy its final evaluation writes (`eval/holdout/accuracy` in metrics.jsonl).

**Splits.** `--split test` (the default) trains on the folder as it is: `eval.holdout` keeps
its people out of training and the run verifies on them, the number a user of the folder
sees. `--split dev` is for choosing a recipe without looking at those people: the folder is
linked (symbolic links, no copy) without the people `--split test` holds out, and the run
holds out `--dev-holdout` of the rest instead, so recipes are compared on people the final
figures are not measured on. The folder's images are read, never written.

A run already measured in the same `--work` folder (its `<recipe>-s<seed>.json` there) is
not run again, so an interrupted comparison continues where it stopped.

Writes a JSON file (every run: recipe, config, overrides, seed, accuracy, AUC, steps,
minutes) and a Markdown table (per recipe: mean and standard deviation over the seeds, and
each seed's accuracy). Real data stays out of the repository: only these numbers are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, log_tail, run_command
from benchmarks.table import machine, print_table, write_json, write_text

TARGET = "holdout"
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


def parse_recipes(tokens: list[list[str]], default_config: str) -> list[dict[str, Any]]:
    """`--recipe NAME [config=C] [key=value ...]` groups as {name, config, overrides}."""
    recipes = []
    for group in tokens:
        name, rest = group[0], group[1:]
        config, overrides = default_config, []
        for token in rest:
            if "=" not in token:
                raise SystemExit(f"--recipe {name}: {token!r} is not key=value or config=C")
            if token.startswith("config="):
                config = token.removeprefix("config=")
            else:
                overrides.append(token)
        recipes.append({"name": name, "config": config, "overrides": overrides})
    return recipes


def identity_counts(root: Path) -> tuple[list[str], list[int]]:
    """The folder's identities (sorted, as the index orders them) and their image counts."""
    names, counts = [], []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.is_dir() and not entry.name.startswith("."):
            files = [f for f in os.listdir(entry.path) if f.lower().endswith(IMAGE_SUFFIXES)]
            if files:
                names.append(entry.name)
                counts.append(len(files))
    return names, counts


def make_dev_folder(root: Path, out: Path, share: float) -> tuple[Path, int]:
    """`root` linked into `out` without the people `eval.holdout=share` holds out of it.

    Returns the linked folder and how many people were left out."""
    import numpy as np

    from recognition.data.holdout import choose_holdout

    names, counts = identity_counts(root)
    split = choose_holdout(names, np.asarray(counts), share)
    left_out = {names[i] for i in split.held_out.tolist()}
    dev = out / f"{root.name}-dev"
    if not dev.is_dir():
        tmp = out / f".{root.name}-dev.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        for name in names:
            if name not in left_out and not (tmp / name).exists():
                (tmp / name).symlink_to((root / name).resolve(), target_is_directory=True)
        tmp.replace(dev)
    return dev, len(left_out)


def final_metrics(run_dir: Path) -> dict[str, Any]:
    """The held-out accuracy and AUC of the run's final evaluation (its eval.json), and its
    last step."""
    result = json.loads((run_dir / "eval.json").read_text())[TARGET]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "accuracy": result["accuracy"],
        "auc": result.get("auc"),
        "steps": max(r["step"] for r in records),
    }


def run_recipe(
    recipe: dict[str, Any], seed: int, data_root: Path, work: Path, extra: list[str],
    timeout_s: float,
) -> dict[str, Any]:  # fmt: skip
    out = work / f"{recipe['name']}-s{seed}"
    done = work / f"{out.name}.json"
    if done.is_file():  # measured by an earlier call with the same work folder
        return json.loads(done.read_text())
    command = [
        sys.executable, str(REPO_ROOT / "train.py"), "--config", recipe["config"],
        f"data.root={data_root}", f"output_dir={out}", f"seed={seed}", *extra,
        *recipe["overrides"],
    ]  # fmt: skip
    log_path = work / f"{out.name}.log"
    start, cpu_start = time.perf_counter(), _children_cpu_s()
    code, timed_out = run_command(command, log_path, timeout_s)
    minutes = (time.perf_counter() - start) / 60
    # CPU time of the run and its loader workers: on a machine shared with other work, the
    # wall minutes overstate the recipe's cost; CPU minutes / cores bound it from below.
    cpu_minutes = (_children_cpu_s() - cpu_start) / 60
    row = {
        **recipe, "seed": seed, "minutes": round(minutes, 2),
        "cpu_minutes": round(cpu_minutes, 2), "run_dir": str(out),
    }  # fmt: skip
    if code != 0 or timed_out:
        row["error"] = f"exit {code}, timed out {timed_out}: " + " | ".join(log_tail(log_path, 3))
        return row
    row = {**row, **final_metrics(out)}
    write_json(done, row)
    return row


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per recipe (in the order first run): mean / std of accuracy and minutes over seeds."""
    summary: dict[str, dict[str, Any]] = {}
    for run in runs:
        entry = summary.setdefault(run["name"], {"name": run["name"], "runs": []})
        entry["runs"].append(run)
    rows = []
    for entry in summary.values():
        good = [r for r in entry["runs"] if "accuracy" in r]
        accuracies = [r["accuracy"] for r in good]
        rows.append({
            "name": entry["name"],
            "config": entry["runs"][0]["config"],
            "overrides": entry["runs"][0]["overrides"],
            "seeds": [r["seed"] for r in good],
            "accuracies": accuracies,
            "mean": statistics.fmean(accuracies) if accuracies else None,
            "std": statistics.stdev(accuracies) if len(accuracies) > 1 else None,
            "minutes": statistics.fmean([r["minutes"] for r in good]) if good else None,
            "cpu_minutes": _mean([r.get("cpu_minutes") for r in good]),
            "failed": len(entry["runs"]) - len(good),
        })  # fmt: skip
    return rows


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def markdown(rows: list[dict[str, Any]], header: dict[str, Any]) -> str:
    lines = [
        f"Held-out verification on {header['root']} (split {header['split']}, "
        f"{header['machine']['cpus_usable']} CPUs, {header['machine']['date']}):",
        "",
        "| recipe | config + overrides | seeds | accuracy % (mean ± std) | each seed | minutes "
        "| CPU minutes |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        recipe = " ".join([row["config"], *row["overrides"]])
        spread = "" if row["std"] is None else f" ± {100 * row['std']:.2f}"
        each = ", ".join(_pct(a) for a in row["accuracies"])
        minutes = "-" if row["minutes"] is None else f"{row['minutes']:.1f}"
        cpu = "-" if row["cpu_minutes"] is None else f"{row['cpu_minutes']:.1f}"
        lines.append(
            f"| {row['name']} | `{recipe}` | {len(row['seeds'])} | {_pct(row['mean'])}{spread} "
            f"| {each} | {minutes} | {cpu} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.real_faces", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--root", type=Path, required=True, help="a real face folder")
    parser.add_argument(
        "--recipe", nargs="+", action="append", metavar="NAME [config=C] [key=value]",
        help="a recipe to run (repeatable); default: the folder_cpu and default configs",
    )  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--split", choices=("test", "dev"), default="test")
    parser.add_argument(
        "--dev-holdout", type=float, default=0.1,
        help="with --split dev: the share of the remaining people held out (default 0.1)",
    )  # fmt: skip
    parser.add_argument("--work", type=Path, default=Path("runs/real_faces"))
    parser.add_argument("--timeout-min", type=float, default=60.0, help="per run")
    parser.add_argument("--json", type=Path, help="write every run and the summary here")
    parser.add_argument("--markdown", type=Path, help="write the summary table here")
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        parser.error(f"--root {args.root}: not a folder")
    tokens = args.recipe or [["folder_cpu", "config=folder_cpu"], ["default", "config=default"]]
    recipes = parse_recipes(tokens, "folder_cpu")
    args.work.mkdir(parents=True, exist_ok=True)
    data_root, extra = args.root.resolve(), []
    if args.split == "dev":
        data_root, left_out = make_dev_folder(args.root.resolve(), args.work.resolve(), 0.05)
        extra = [f"eval.holdout={args.dev_holdout}"]
        print(f"dev split: {left_out} test people left out, {args.dev_holdout} of the rest out")
    runs = []
    for recipe in recipes:
        for seed in args.seeds:
            run = run_recipe(recipe, seed, data_root, args.work, extra, args.timeout_min * 60)
            runs.append(run)
            status = run.get("error") or f"accuracy {_pct(run['accuracy'])} %"
            print(
                f"{recipe['name']} seed {seed}: {status}, {run['minutes']:.1f} min "
                f"({run.get('cpu_minutes') or 0:.1f} CPU min)", flush=True,
            )  # fmt: skip
    rows = summarise(runs)
    header = {"root": str(args.root), "split": args.split, "machine": machine()}
    print_table(
        [("recipe", -16), ("seeds", 5), ("accuracy %", 11), ("std", 6), ("minutes", 8),
         ("CPU min", 8)],
        [
            (r["name"], len(r["seeds"]), _pct(r["mean"]),
             "-" if r["std"] is None else f"{100 * r['std']:.2f}",
             "-" if r["minutes"] is None else f"{r['minutes']:.1f}",
             "-" if r["cpu_minutes"] is None else f"{r['cpu_minutes']:.1f}")
            for r in rows
        ],
    )  # fmt: skip
    if args.json:
        write_json(args.json, {**header, "summary": rows, "runs": runs})
    if args.markdown:
        write_text(args.markdown, markdown(rows, header))
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
