"""Training throughput and per-rank memory on W processes: `train.py` end to end.

    python -m benchmarks.train_scaling                       # default config, W = 1, 2, 4
    python -m benchmarks.train_scaling --world-sizes 1 8 --steps 100 --config ms1m_arcface
    python -m benchmarks.train_scaling --json scaling.json -- train.batch_size=32

For each world size W the script runs the real entry point in fresh processes - `python
train.py` for W = 1 (no process group, as a user runs it) and `torchrun --standalone
--nproc_per_node W train.py` otherwise - for --steps optimizer steps in a scratch run
directory, logging every --log-every steps, without the final evaluation. From the run's
metrics.jsonl it reports:

- samples/s: the median over the logged windows of the samples per second summed over the
  ranks (what the run logs as `samples_per_sec`), the first window left out (it holds the
  DataLoader start and the first, slower steps);
- peak memory per rank, max and min over the ranks (`peak_memory_mb_max/min`: peak RSS on
  CPU, `torch.cuda.max_memory_allocated` on GPU), at the end of the run;
- the wall time of the whole command (process start, data indexing, checkpoints included).

`train.batch_size` is per process, so the global batch grows with W (W x batch per step).
torchrun gives each of its processes one intra-op thread (OMP_NUM_THREADS=1) unless the
environment sets it; a W = 1 run uses torch's default. The built-in synthetic dataset is
generated on first use (about 20 s) under data/synthetic and reused afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT


def add_run_options(parser: argparse.ArgumentParser, *, steps: int, log_every: int) -> None:
    """The options of a benchmark of `train.py` runs (`run_one`): --steps, --log-every,
    --json, and config overrides after --."""
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--log-every", type=int, default=log_every)
    parser.add_argument("--json", type=Path, help="also write the measurements here")
    parser.add_argument("overrides", nargs="*", help="config overrides (after --)")


def run_one(
    world_size: int, config: str, steps: int, log_every: int, overrides: list[str], out: Path
) -> dict[str, Any]:
    """Train `steps` steps on `world_size` processes; returns the measurements of the run."""
    args = [
        "--config",
        config,
        f"output_dir={out}",
        f"train.max_steps={steps}",
        f"train.log_every={log_every}",
        "train.progress=false",
        "eval.at_end=false",
        *overrides,
    ]
    if world_size == 1:
        command = [sys.executable, str(REPO_ROOT / "train.py"), *args]
    else:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(world_size), str(REPO_ROOT / "train.py"), *args,
        ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"W={world_size}: {' '.join(command)} failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    windows = [r["samples_per_sec"] for r in records[1:]] or [records[0]["samples_per_sec"]]
    return {
        "world_size": world_size,
        "steps": records[-1]["step"],
        "samples_per_sec_median": statistics.median(windows),
        "samples_per_sec_windows": windows,
        "peak_memory_mb_max": records[-1]["peak_memory_mb_max"],
        "peak_memory_mb_min": records[-1]["peak_memory_mb_min"],
        "final_loss": records[-1]["loss"],
        "wall_s": wall,
    }


def format_table(results: list[dict[str, Any]]) -> str:
    header = (
        f"{'W':>3} {'steps':>6} {'samples/s':>10} {'x W=1':>6} {'peak MiB max':>13} "
        f"{'min':>7} {'max/min':>8} {'wall s':>7}"
    )
    lines = [header, "-" * len(header)]
    base = results[0]["samples_per_sec_median"]
    for r in results:
        lines.append(
            f"{r['world_size']:>3} {r['steps']:>6} {r['samples_per_sec_median']:>10.1f} "
            f"{r['samples_per_sec_median'] / base:>6.2f} {r['peak_memory_mb_max']:>13.0f} "
            f"{r['peak_memory_mb_min']:>7.0f} "
            f"{r['peak_memory_mb_max'] / r['peak_memory_mb_min']:>8.3f} {r['wall_s']:>7.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--config", default="default")
    add_run_options(parser, steps=30, log_every=5)
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="train_scaling_") as scratch:
        for world_size in args.world_sizes:
            out = Path(scratch) / f"w{world_size}"
            result = run_one(
                world_size, args.config, args.steps, args.log_every, args.overrides, out
            )
            results.append(result)
            print(
                f"W={world_size}: {result['samples_per_sec_median']:.1f} samples/s, "
                f"peak {result['peak_memory_mb_max']:.0f}/{result['peak_memory_mb_min']:.0f} "
                f"MiB, {result['wall_s']:.1f} s",
                file=sys.stderr,
            )
    print(format_table(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
