"""The run planner against the CPU allocator: planned and measured peak of a step, per rank.

    python -m benchmarks.plan                       # the default grid (2-3 min on 2 cores)
    python -m benchmarks.plan --json plan.json      # also write every measurement
    python -m benchmarks.plan --cases 0 3           # a few cases of the grid

For each case (world size, precision, head chunking, classes, accumulation, pipeline
stages and schedule) and each rank: the plan (`recognition.training.plan.plan_rank`, fake
tensors, bytes as the CPU allocator counts them: granularity 1) and the measurement
(`plan.check.measure_rank`: the same parts built on real tensors, real DDP and pipelines
over gloo for several ranks, the peak of the CPU allocator over the second of two steps,
from torch.profiler's memory events). The plans run in this process (which holds no
process group: the planner makes a fake one), the measurements in fresh processes, one
per rank. Also the plan's wall time per case.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch.multiprocessing as mp

from benchmarks.table import print_table

BASE = [
    "model.backbone=iresnet18",
    "model.width=0.25",
    "model.embedding_size=128",
    "data.image_size=112",
    "train.batch_size=16",
    "eval.targets=[]",
]
O2 = "precision.level=O2"
PIPE = "model.pipeline_stages=2"
GPIPE = "model.pipeline_schedule=gpipe"
# (world size, classes, overrides): 10k to 1M classes, O0 / O1 / O2 bf16, whole shard and
# chunked, accumulation 1 and 2, partial FC, one and two ranks (odd class counts: the
# shards differ).
CASES = [
    (1, 10_000, []),
    (1, 200_000, ["precision.level=O1"]),
    (1, 1_000_000, [O2, "head.chunk_size=16384", "train.accumulate_steps=2"]),
    (1, 1_000_000, ["head.chunk_size=65536"]),
    (2, 200_001, []),
    (2, 300_001, [O2]),
    (2, 1_000_001, [O2, "head.chunk_size=16384", "train.accumulate_steps=2"]),
    (2, 100_001, ["head.chunk_size=8192", "train.accumulate_steps=2"]),
    (1, 1_000_000, [O2, "head.sample_rate=0.2", "head.chunk_size=16384"]),
    (2, 300_001, ["head.sample_rate=0.1", "train.accumulate_steps=2"]),
    # Two pipeline stages (W = 2 x replicas): 8 micro-batches of 2 under 1F1B and GPipe,
    # 4 of 4 under GPipe O2 bf16, and two replicas of each stage (DDP over a stage's
    # replicas, the head sharded over the last stage's).
    (2, 200_000, [PIPE, "model.micro_batch_size=2"]),
    (2, 200_000, [PIPE, "model.micro_batch_size=2", GPIPE]),
    (2, 300_000, [PIPE, "model.micro_batch_size=4", GPIPE, O2]),
    (4, 1_000_001, [PIPE, "model.micro_batch_size=4", O2, "head.chunk_size=16384"]),
]


def describe(overrides: list[str]) -> str:
    level = next((o.split("=")[1] for o in overrides if o.startswith("precision.level")), "O0")
    chunk = next((o.split("=")[1] for o in overrides if o.startswith("head.chunk_size")), None)
    accumulate = next(
        (o.split("=")[1] for o in overrides if o.startswith("train.accumulate_steps")), "1"
    )
    rate = next((o.split("=")[1] for o in overrides if o.startswith("head.sample_rate")), None)
    precision = level if level == "O0" else f"{level} bf16"
    sampled = f", partial FC {rate}" if rate else ""
    piped = ""
    if PIPE in overrides:
        micro = next(o.split("=")[1] for o in overrides if o.startswith("model.micro_batch_size"))
        piped = f", P 2 {'gpipe' if GPIPE in overrides else '1f1b'} micro {micro}"
    return f"{precision}, chunk {chunk or 'none'}, accumulate {accumulate}{sampled}{piped}"


def _measure(rank: int, world: int, port: int, out: str, classes: int, overrides: list) -> None:
    from recognition.config import load_config
    from recognition.distributed import DistInfo
    from recognition.training.plan.check import measure_rank

    result: dict[str, object] = {}
    try:
        if world > 1:
            from tests.helpers import init_gloo_rank

            init_gloo_rank(rank, world, port, timeout_s=1800)
        else:
            import torch

            torch.set_num_threads(1)
        cfg = load_config("default", [*BASE, *overrides])
        started = time.perf_counter()
        result["measured"] = measure_rank(cfg, classes, DistInfo(rank=rank, world_size=world))
        result["measure_s"] = time.perf_counter() - started
    except Exception:
        result["error"] = traceback.format_exc()
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        os._exit(0)  # gloo's teardown may abort (tests/test_head_distributed.py)


def run_case(index: int, world: int, classes: int, overrides: list[str], scratch: Path) -> list:
    from recognition.config import load_config
    from recognition.training.plan import plan_rank
    from tests.helpers import free_port

    out = scratch / f"case{index}"
    out.mkdir(parents=True, exist_ok=True)
    mp.spawn(_measure, args=(world, free_port(), str(out), classes, overrides), nprocs=world)
    cfg = load_config("default", [*BASE, *overrides])
    records = []
    for rank in range(world):
        measured = json.loads((out / f"rank{rank}.json").read_text())
        started = time.perf_counter()
        plan = plan_rank(cfg, classes, world, rank, granularity=1)
        record = {
            "case": index,
            "world_size": world,
            "rank": rank,
            "classes": classes,
            "config": describe(overrides),
            "overrides": overrides,
            "planned": plan.peak,
            "plan_s": time.perf_counter() - started,
            "phase": plan.phase,
            **measured,
        }
        if "measured" in measured:
            record["error_pct"] = 100 * (plan.peak - measured["measured"]) / measured["measured"]
        records.append(record)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, nargs="*", help="indices into the grid (default all)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/benchmarks-plan"))
    args = parser.parse_args(argv)
    chosen = args.cases if args.cases else range(len(CASES))
    records = []
    for index in chosen:
        world, classes, overrides = CASES[index]
        records += run_case(index, world, classes, overrides, args.scratch)
        print(f"# case {index} done", flush=True)
    rows = [
        (
            r["world_size"],
            r["rank"],
            f"{r['classes']:,}",
            r["config"],
            f"{r['planned'] / 2**20:,.1f}",
            f"{r['measured'] / 2**20:,.1f}" if "measured" in r else "error",
            f"{r['error_pct']:+.2f}" if "error_pct" in r else "",
            r["phase"],
            f"{r['plan_s']:.1f}",
        )
        for r in records
    ]
    columns = [("W", 2), ("rank", 4), ("classes", 10), ("config", -48), ("planned MiB", 11),
               ("measured MiB", 12), ("error %", 7), ("peak in", -8), ("plan s", 6)]  # fmt: skip
    print_table(columns, rows)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"date": datetime.datetime.now().isoformat(), "base": BASE, "cases": records},
                indent=1,
            )
        )
    return 0 if all("measured" in r for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
