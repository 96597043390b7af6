"""Fine-tuned and pretrained weights averaged, on real faces (after `benchmarks.finetune --root`).

    python -m benchmarks.finetune_interpolate --work WORK --variants init_backbone \\
        centroids_scale_0.1 --alphas 0.25 0.5 0.75 1 --json results.json

Averaging a fine-tuned network's weights with the ones it started from (theta = (1 - alpha)
pretrained + alpha fine-tuned, every floating tensor of the backbone, BatchNorm's running
statistics included) is known to keep much of what pretraining knew while keeping what
fine-tuning added (WiSE-FT, Wortsman et al., CVPR 2022). The fine-tuning comparison on
real faces (`benchmarks/finetune_real.py`) found settings that win in one domain and not in
the other; this asks whether the average wins in both. It reads the backbones that
comparison left under WORK (`seed<S>/pretrain/backbone.pt` and
`seed<S>/<domain>/<variant>/backbone.pt`), writes each average beside nothing (a temporary
file), and verifies it with `evaluate.py` on the domain's test pairs (WORK/data/test-<domain>).
No training: about 15 s per evaluation on one CPU core at 64 px.

The table: per domain and alpha, the accuracy (mean over seeds) and its gain over the
backbone not fine-tuned and over plain `train.init_backbone` (the comparison's own rows,
from its `seed<S>/<domain>/init_backbone` run and the pretraining's evaluation).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import verify_pairs
from benchmarks.finetune_data import DOMAINS
from benchmarks.table import machine, write_results


def interpolate(pretrained: dict, finetuned: dict, alpha: float) -> dict:
    """`finetuned` (a backbone.pt payload) with every floating tensor of its state dict
    replaced by (1 - alpha) pretrained + alpha fine-tuned; integer buffers (BatchNorm's batch
    counters) are the fine-tuned ones."""
    before, after = pretrained["state_dict"], finetuned["state_dict"]
    if set(before) != set(after):
        raise SystemExit("the pretrained and fine-tuned backbones hold different tensors")
    mixed = {
        key: torch.lerp(before[key], value, alpha) if value.is_floating_point() else value
        for key, value in after.items()
    }
    return {**finetuned, "state_dict": mixed}


def baselines(work: Path, seed: int, domain: str) -> dict[str, float]:
    """The comparison's accuracy of the backbone not fine-tuned and of plain init_backbone."""
    pretrain = json.loads((work / f"seed{seed}" / "pretrain" / "result.json").read_text())
    plain = json.loads(
        (work / f"seed{seed}" / domain / "init_backbone" / "result.json").read_text()
    )
    return {
        "no fine-tuning": pretrain["eval"][domain]["accuracy"],
        "init_backbone": plain["eval"]["test"]["accuracy"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        mixed_path, out = Path(scratch) / "backbone.pt", Path(scratch) / "eval.json"
        for seed in args.seeds:
            pretrained = torch.load(
                args.work / f"seed{seed}" / "pretrain" / "backbone.pt", weights_only=False
            )
            for domain in DOMAINS:
                base = baselines(args.work, seed, domain)
                for variant in args.variants:
                    finetuned = torch.load(
                        args.work / f"seed{seed}" / domain / variant / "backbone.pt",
                        weights_only=False,
                    )
                    for alpha in args.alphas:
                        torch.save(interpolate(pretrained, finetuned, alpha), mixed_path)
                        test = args.work / "data" / f"test-{domain}"
                        accuracy = verify_pairs(mixed_path, test, out, 1800, "--workers", "0")
                        runs.append({"seed": seed, "domain": domain, "variant": variant,
                                     "alpha": alpha, "accuracy": accuracy, **base})  # fmt: skip
                        print(f"seed {seed} {domain:7s} {variant:30s} alpha {alpha:.2f} "
                              f"{100 * accuracy:.2f}", file=sys.stderr)  # fmt: skip
    return {"machine": machine(), "work": str(args.work), "seeds": args.seeds, "runs": runs}


def markdown(result: dict[str, Any]) -> str:
    """Mean over seeds per (variant, alpha), both domains side by side, with the gains."""
    lines = [
        f"Weights averaged: (1 - alpha) pretrained + alpha fine-tuned, seeds {result['seeds']}; "
        "accuracy % (mean over seeds) and gains in points (mean of the per-seed differences).",
        "",
        "| variant | alpha | " + " | ".join(
            f"{d} % | vs no fine-tuning | vs init_backbone" for d in DOMAINS) + " |",
        "|---" * (2 + 3 * len(DOMAINS)) + "|",
    ]  # fmt: skip
    keys = list(dict.fromkeys((r["variant"], r["alpha"]) for r in result["runs"]))
    for variant, alpha in keys:
        cells = [variant, f"{alpha:g}"]
        for domain in DOMAINS:
            key = (variant, alpha, domain)
            rows = [r for r in result["runs"] if (r["variant"], r["alpha"], r["domain"]) == key]
            cells.append(f"{100 * statistics.fmean(r['accuracy'] for r in rows):.1f}")
            for ref in ("no fine-tuning", "init_backbone"):
                gain = statistics.fmean(r["accuracy"] - r[ref] for r in rows)
                cells.append(f"{100 * gain:+.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True,
                        help="the --work folder of `benchmarks.finetune --root`")  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--variants", nargs="+", default=["init_backbone", "centroids_scale_0.1"],
                        help="run folders under seed<S>/<domain>/")  # fmt: skip
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    missing = [p for p in [args.work / f"seed{s}" / "pretrain" / "backbone.pt" for s in args.seeds]
               if not p.is_file()]  # fmt: skip
    if missing:
        raise SystemExit(f"--work: {missing[0]}: no such file (run benchmarks.finetune --root)")
    result = run(args)
    table = markdown(result)
    print(table)
    if args.json is not None:
        write_results(args.json, result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
