"""What `train.compile=true` costs and gains on a CPU: `python train.py` eager and compiled.

    python -m benchmarks.compile_cpu                          # default config, 100 steps, 2 rounds
    python -m benchmarks.compile_cpu --steps 200 --rounds 3 --json compile_cpu.json

Each round runs the real entry point five times, one after another (so that the machine's
other load falls on all of them alike): eager; for each train.compile_scope (the whole
backbone as one graph, `model`, and its blocks one by one, `blocks`), compiled with an empty
Inductor cache (a fresh TORCHINDUCTOR_CACHE_DIR: what the first run on a machine pays) and
compiled again with that cache warm (what a resumed or repeated run pays). Config overrides
after `--` (`-- model.backbone=iresnet50`: a backbone with repeated blocks). From each
run's metrics.jsonl and train.log it reports the compile time (logged by the run), the
median samples/s over the logged windows after the first (which holds the compile), the
loss at step 40 and at the end (compile must not change what is learnt: the issue's check
is the loss at step 40 within 5 % of eager's), and the wall time of the whole command.
Medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.table import print_table
from benchmarks.train_scaling import add_run_options, run_one

MODES = {
    "eager": [],
    "whole, cold cache": ["train.compile_scope=model"],
    "whole, warm cache": ["train.compile_scope=model"],
    "blocks, cold cache": ["train.compile_scope=blocks"],
    "blocks, warm cache": ["train.compile_scope=blocks"],
}


def measure(mode: str, steps: int, log_every: int, overrides: list[str], out: Path) -> dict:
    """One run of `mode`; its measurements."""
    compiled = [f"train.compile={mode != 'eager'}", *MODES[mode]]
    result = run_one(1, "default", steps, log_every, [*compiled, *overrides], out)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    at_40 = [r["loss"] for r in records if r["step"] == 40]
    found = re.search(r"compiling the backbone took ([0-9.]+) s", (out / "train.log").read_text())
    return {
        "mode": mode,
        "compile_s": float(found.group(1)) if found else None,
        "samples_per_sec": result["samples_per_sec_median"],
        "loss_at_40": at_40[0] if at_40 else None,
        "final_loss": result["final_loss"],
        "wall_s": result["wall_s"],
    }


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode, the median of every measurement over the rounds."""
    rows = []
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        row: dict[str, Any] = {"mode": mode, "rounds": len(mine)}
        for key in ("compile_s", "samples_per_sec", "loss_at_40", "final_loss", "wall_s"):
            values = [r[key] for r in mine if r[key] is not None]
            row[key] = statistics.median(values) if values else None
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_options(parser, steps=100, log_every=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="compile_cpu_") as scratch:
        for round_index in range(args.rounds):
            for mode in MODES:
                # Empty for each cold run, then warm for the run after it (one per scope).
                cache = Path(scratch) / f"inductor{round_index}-{mode.split(',')[0]}"
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
                out = Path(scratch) / f"{round_index}-{mode.replace(' ', '_')}"
                runs.append(measure(mode, args.steps, args.log_every, args.overrides, out))
                print(json.dumps(runs[-1]), file=sys.stderr)
    rows = summarise(runs)
    eager = rows[0]["samples_per_sec"]

    def number(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    print_table(
        [("mode", -22), ("compile s", 10), ("samples/s", 10), ("x eager", 8),
         ("loss @40", 9), ("final loss", 11), ("wall s", 7)],
        [
            (r["mode"], number(r["compile_s"], ".1f"), number(r["samples_per_sec"], ".0f"),
             number(r["samples_per_sec"] / eager, ".2f"), number(r["loss_at_40"], ".3f"),
             number(r["final_loss"], ".3f"), number(r["wall_s"], ".1f"))
            for r in rows
        ],
    )  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": runs, "summary": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
