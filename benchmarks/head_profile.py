"""Where the head's step spends its time: the device kernels of a few steps, by total time.

    python -m benchmarks.head_profile --device cuda --classes 1000000 --kernel triton
    python -m benchmarks.head_profile --device cuda --kernel triton torch --fused-update \
        --json profile.json

One process, one GPU: the sharded head at W = 1 (benchmarks/head_methods.py's `sharded`
step, or `sharded-chunked` for the torch path with --chunk-size), warmed up, then --steps
steps under torch.profiler. For each (kernel, fused) variant it prints the step's wall time
(median of the steps, synchronised) and the kernels that took the most device time per
step, each with its share of the step and its time per call, against the floor of 3
matmuls of the head's size (2 N D C each) at the rate of a plain matmul of that size timed
in the same process (benchmarks/head_worker.py's `plain_matmul_tflops`). On a CPU the
operators' self CPU time stands in for device time.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

from benchmarks.head_methods import Case, build_step
from benchmarks.head_worker import plain_matmul_tflops
from benchmarks.table import write_json


def profile_case(case: Case, top: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(case.device)
    step, _ = build_step(case, 0, device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(case.warmup):
        step()
    sync()
    times = []
    for _ in range(case.steps):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(case.steps):
            step()
        sync()
    rows = []
    for event in prof.key_averages():
        if device.type == "cuda":
            us = getattr(event, "self_device_time_total", None)
            if us is None:
                us = event.self_cuda_time_total
        else:
            us = event.self_cpu_time_total
        if us > 0:
            rows.append({"name": event.key, "calls": event.count / case.steps,
                         "ms_per_step": us / 1e3 / case.steps})  # fmt: skip
    rows.sort(key=lambda r: -r["ms_per_step"])
    del step
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    matmul = plain_matmul_tflops(
        device, case.autocast, case.batch_size, case.embedding_size, case.num_classes
    )
    floor_ms = 3 * 2 * case.batch_size * case.embedding_size * case.num_classes / matmul / 1e9
    return {"case": vars(case), "step_ms": 1e3 * statistics.median(times), "kernels": rows[:top],
            "kernels_ms": sum(r["ms_per_step"] for r in rows), "matmul_tflops": matmul,
            "floor_ms": floor_ms}  # fmt: skip


def print_profile(result: dict) -> None:
    case = result["case"]
    title = case["kernel"]
    title += " + fused update" if case["fused_update"] else ""
    print(f"\n## {title}, {case['num_classes']:,} classes: {result['step_ms']:.1f} ms/step "
          f"(kernels {result['kernels_ms']:.1f} ms); floor {result['floor_ms']:.2f} ms: 3 "
          f"matmuls at {result['matmul_tflops']:.0f} TFLOP/s")  # fmt: skip
    print("| ms/step | % | calls | ms/call | kernel |\n|---|---|---|---|---|")
    for row in result["kernels"]:
        share = 100 * row["ms_per_step"] / max(result["step_ms"], 1e-9)
        per_call = row["ms_per_step"] / row["calls"] if row["calls"] else 0.0
        print(f"| {row['ms_per_step']:.2f} | {share:.0f} | {row['calls']:g} | {per_call:.3f} | "
              f"{row['name'][:110]} |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--classes", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--embedding-size", type=int, default=512)
    parser.add_argument("--chunk-size", type=int, default=65536, help="the torch path's chunk")
    parser.add_argument("--kernel", nargs="+", default=["triton", "torch"])
    parser.add_argument("--fused-update", action="store_true", help="also triton + fused update")
    parser.add_argument("--autocast", default="bfloat16", help="'none' for float32")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    variants = [(kernel, False) for kernel in args.kernel]
    if args.fused_update:
        variants.append(("triton", True))
    results = []
    for kernel, fused in variants:
        case = Case(
            method="sharded-chunked" if kernel == "torch" else "sharded", world_size=1,
            num_classes=args.classes, batch_size=args.batch_size,
            embedding_size=args.embedding_size, chunk_size=args.chunk_size, steps=args.steps,
            warmup=args.warmup, threads=1, device=args.device,
            autocast=None if args.autocast == "none" else args.autocast, kernel=kernel,
            fused_update=fused,
        )  # fmt: skip
        result = profile_case(case, args.top)
        print_profile(result)
        results.append(result)
        if args.json:
            write_json(args.json, {"results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
