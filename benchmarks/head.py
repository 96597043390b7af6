"""Benchmark of the margin-softmax head: time per step, peak memory per rank, communication.

    python -m benchmarks.head                       # the default CPU grid, up to 1M classes
    python -m benchmarks.head --classes 10000 --steps 2 --json head.json
    python -m benchmarks.head --device cuda --autocast bfloat16 --world-size 1 --no-single \
        --methods sharded --kernel triton --fused-update --batch-size 1024 \
        --embedding-size 512 --classes 1000000 10000000 --max-classes-search

For each number of classes C of the grid (global batch N, embedding size D), one training
step of the head - forward, backward, SGD step (momentum 0.9) - is timed for:

    naive            one process holds the full (C, D) matrix: F.linear + margin + F.cross_entropy
    gather-to-one    W processes each compute their (N, C/W) logit slice; rank 0 gathers the
                     slices, takes F.cross_entropy over the full (N, C) logits and scatters
                     the logit gradients back (the common model-parallel pattern)
    sharded          ShardedMarginSoftmax on W processes, whole shard at once (chunk_size None)
    sharded-chunked  the same with --chunk-size classes per chunk
    sharded / sharded-chunked at W = 1: the module on one process (same resources as naive)

Every case runs in fresh processes (one per rank), so no allocation of one case lingers in
the next (this module launches them and reads their results; the methods' steps are in
benchmarks/head_methods.py, a rank's measurements in benchmarks/head_worker.py). Per rank
it reports:

- time per step: median over --steps steps; for W ranks the slowest rank's median (a step
  ends when every rank is done);
- peak memory, measured over one separate step after the warm-up: on CPU, the peak resident
  set size minus the RSS before the case allocated anything (Linux: the kernel's peak,
  VmHWM, is reset through /proc/self/clear_refs just before the step). During that step
  glibc serves every allocation above 64 KiB with mmap (mallopt M_MMAP_THRESHOLD), so a
  freed tensor leaves the RSS at once and the RSS tracks live memory; the timed steps then
  run with the threshold at 32 MiB, where allocations are recycled as usual. Before the
  baseline, one step of the same method on a tiny problem loads the kernels' code pages and
  the runtime's first-use buffers. On CUDA: torch.cuda.max_memory_allocated() minus the
  allocation before the case;
- floor: weight + gradient + momentum of the classes the rank holds, 3 x C_rank x D x 4 bytes;
  extra = peak - floor: what the head's computation costs on top;
- bytes sent per step by the rank, counted from the tensors handed to torch.distributed under
  ring algorithms: all-gather (W-1) x input, reduce-scatter (W-1)/W x input, all-reduce
  2 (W-1)/W x tensor, gather/scatter the slices that leave the rank.

`--kernel torch|triton` picks the sharded head's implementation (`head.kernel`; triton needs
CUDA, or runs in Triton's interpreter on CPU for a tiny smoke size), `--fused-update` makes
its backward apply the SGD step (`head.fused_update`, triton only). 'useful
TFLOP/s' is 6 N D C_rank / step time (the forward and backward matmuls a step needs, whatever is
recomputed) and '% mm' is that against a plain matmul of the same size as the head's, timed
in the same process right after the steps: embeddings (N, D) times class rows (D, C_rank) in
the matmul dtype (the autocast dtype, else float32), after the head's memory is freed; for
more columns than a block of output of 1 GiB (256 MiB on CPU) holds, one such block of columns
is timed and its rate taken. `--max-classes-search` then looks for the largest class count
per rank that one step of the first sharded method fits in (doubling, then bisection to 1 %,
each try a fresh process).

Ratios are against `naive` measured in the same run. Weight decay is 0: torch's SGD adds it
into a new weight-sized tensor at every step, the same for every method, which would hide
the head's own memory. Threads per process: --threads (1 by default; with W = 2 the sharded
cases use two cores where naive uses one - the W = 1 rows compare like with like).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.common import REPO_ROOT
from benchmarks.head_methods import METHODS, Case


def run_case(case: Case, timeout_s: float) -> dict:
    """Launch the case's ranks as fresh processes and merge what they report."""
    env = dict(os.environ, OMP_NUM_THREADS=str(case.threads))
    if case.kernel == "triton" and case.device == "cpu":
        env["TRITON_INTERPRET"] = "1"  # a smoke run only: the interpreter is very slow
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = str(Path(tmp) / "rendezvous")
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.head",
                    "--worker",
                    json.dumps(asdict(case)),
                    "--rank",
                    str(rank),
                    "--rendezvous",
                    rendezvous,
                ],
                cwd=REPO_ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for rank in range(case.world_size)
        ]
        ranks, errors = [], []
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for other in procs:
                    other.kill()
                return {**asdict(case), "error": f"timed out after {timeout_s:.0f} s"}
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if proc.returncode != 0 or not lines:
                errors.append(
                    err.strip().splitlines()[-1] if err.strip() else f"exit {proc.returncode}"
                )
            else:
                ranks.append(json.loads(lines[-1]))
        if errors:
            for other in procs:
                other.kill()
            return {**asdict(case), "error": "; ".join(errors)}
    return merge_ranks(case, ranks)


def merge_ranks(case: Case, ranks: list[dict]) -> dict:
    """The case's result from its ranks' measurements (`head_worker.run_rank`): a step
    takes as long as its slowest rank; memory per rank, the largest and the smallest."""
    peaks = [r["peak_bytes"] for r in ranks]
    widest = max(ranks, key=lambda r: r["num_rows"])  # the rank whose size 'useful' counts
    extras = [r["peak_bytes"] - r["floor_bytes"] for r in ranks]
    return {
        **asdict(case),
        "step_s": max(r["step_s"] for r in ranks),
        "peak_bytes_max": max(peaks),
        "peak_bytes_min": min(peaks),
        "peak_max_over_min": max(peaks) / max(min(peaks), 1),
        "extra_bytes_max": max(extras),
        "floor_bytes_max": max(r["floor_bytes"] for r in ranks),
        "classes_per_rank_max": max(r["num_rows"] for r in ranks),
        "bytes_sent_per_step_max": max(r["bytes_sent_per_step"] for r in ranks),
        "collectives_per_step": ranks[0]["collectives_per_step"],
        "peak_method": ranks[0]["peak_method"],
        "matmul_tflops": widest["matmul_tflops"],
        "ranks": ranks,
    }


def useful_tflops(case: Case, result: dict) -> float:
    """6 N D C_rank / step time: the matmul work a step needs, recomputation not counted."""
    num_rows = result["classes_per_rank_max"]
    return 6 * case.batch_size * case.embedding_size * num_rows / result["step_s"] / 1e12


def largest_class_count(
    case: Case,
    timeout_s: float,
    start: int,
    tolerance: float = 0.01,
    deadline: float | None = None,
    memory_bytes: int | None = None,
) -> tuple[int, list[dict]]:
    """The largest classes per rank for which one step of `case` runs, to `tolerance` of
    it; every try in fresh processes. Without `memory_bytes`: doubling from `start`, then
    bisection. With it (the device's memory), a first try that fits at `start` predicts the
    boundary - the step's peak grows with the classes, in proportion where the class rows
    and their optimizer state fill the memory - and the search tries just below the
    prediction and one `tolerance` step to the side the answer says: where the prediction
    holds, 3 tries in all; where it does not, doubling and bisection from what they found.
    With a `deadline` (time.monotonic()), the search stops when no time is left for a try:
    the count found so far is returned, and the tries say where it stopped. Returns (count,
    tries)."""
    tries: list[dict] = []
    peaks: dict[int, int] = {}

    def fits(num_local: int) -> bool | None:  # None: out of time, nothing learnt
        limit = timeout_s if deadline is None else min(timeout_s, deadline - time.monotonic())
        if limit < 1:
            return None
        trial = Case(**{**asdict(case), "num_classes": num_local * case.world_size,
                        "steps": 1, "warmup": 0})  # fmt: skip
        result = run_case(trial, limit)
        if limit < timeout_s and result.get("error", "").startswith("timed out"):
            return None  # cut short by the deadline, not too large
        tries.append({"classes_per_rank": num_local, "error": result.get("error")})
        outcome = result.get("error") or "fits"
        print(f"  {num_local:,} classes per rank: {outcome}", file=sys.stderr)
        if "error" in result:
            return False
        peaks[num_local] = result.get("peak_bytes_max") or 0
        return True

    low, high = 0, start
    ok = fits(start)  # True while the search grows (doubling); None: out of time
    if ok and memory_bytes and peaks[start] > 0:
        # Proportional, so a little high (the peak's fixed part, the CUDA context's memory):
        # the guess is half a tolerance below the prediction.
        guess = max(start, int(start * memory_bytes / peaks[start] * (1 - tolerance / 2)))
        fits_guess = fits(guess) if guess > start else True
        low, high, ok = start, guess, None if fits_guess is None else False
        if fits_guess:  # one step up: the bracket is then one tolerance wide
            low, high = guess, guess + max(1, int(guess * tolerance))
            ok = fits(high)  # fits too: the prediction was low, growing on from there
        elif fits_guess is not None:  # one step down, as wide
            below = guess - int(guess * tolerance / (1 + tolerance))
            if below > start:
                fits_below = fits(below)
                if fits_below is None:
                    ok = None
                elif fits_below:
                    low = below
                else:
                    high = below
    while ok:
        low, high = high, high * 2
        ok = fits(high)
    while ok is not None and high - low > max(1, int(low * tolerance)):
        middle = (low + high) // 2
        ok = fits(middle)
        if ok is not None:
            low, high = (middle, high) if ok else (low, middle)
    return low, tries


def head_flops(case: Case) -> float:
    """Matmul FLOPs of one step of the head: forward 2NCD, backward 4NCD (+2NCD recomputed)."""
    passes = 8 if case.method == "sharded-chunked" else 6
    return passes * case.batch_size * case.num_classes * case.embedding_size


def _mib(value: float) -> str:
    return f"{value / 2**20:,.0f}"


def _bytes(value: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def print_table(results: list[dict]) -> None:
    header = (
        f"{'classes':>9} {'method':<16} {'W':>2} {'ms/step':>9} {'x naive':>7} {'GFLOP/s':>8} "
        f"{'useful TFLOP/s':>14} {'mm TFLOP/s':>10} {'% mm':>5} "
        f"{'peak MiB':>9} {'floor':>7} {'extra':>7} {'x naive':>8} {'max/min':>7} "
        f"{'sent/step':>10}"
    )
    print(header)
    print("-" * len(header))
    naive = {r["num_classes"]: r for r in results if r["method"] == "naive" and "error" not in r}
    for r in results:
        name = f"{r['num_classes']:>9,} {r['method']:<16} {r['world_size']:>2}"
        if "error" in r:
            print(f"{name} ERROR: {r['error']}")
            continue
        base = naive.get(r["num_classes"])
        time_ratio = f"{r['step_s'] / base['step_s']:.2f}" if base else "-"
        extra_ratio = (
            f"{r['extra_bytes_max'] / base['extra_bytes_max']:.3f}"
            if base and base["extra_bytes_max"] > 0
            else "-"
        )
        print(
            f"{name} {r['step_s'] * 1e3:>9,.1f} {time_ratio:>7} {r['gflops']:>8.1f} "
            f"{r['useful_tflops']:>14.3f} {r['matmul_tflops']:>10.3f} "
            f"{r['percent_of_matmul']:>5.1f} "
            f"{_mib(r['peak_bytes_max']):>9} {_mib(r['floor_bytes_max']):>7} "
            f"{_mib(r['extra_bytes_max']):>7} {extra_ratio:>8} {r['peak_max_over_min']:>7.2f} "
            f"{_bytes(r['bytes_sent_per_step_max']):>10}"
        )
    print(
        "\n'mm TFLOP/s': a plain matmul of the head's size, (N, D) x (D, C_rank) in the matmul "
        "dtype, timed in the same process after the steps; '% mm' = useful TFLOP/s against it. "
        "'peak' is per rank (the largest rank), above the "
        "process's memory before the case; 'floor' = weight + gradient + momentum of the rank's "
        "classes; 'extra' = peak - floor; 'x naive' of extra compares with naive's extra; "
        "'max/min' = largest / smallest rank peak; 'sent/step' = bytes the busiest rank sends; "
        "'GFLOP/s' = the head's matmul FLOPs per step (6NCD, 8NCD chunked: the recomputation "
        "counts) over the step time, all ranks together."
    )


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.worker is not None:
        from benchmarks.head_worker import run_rank  # torch: in the ranks' processes only

        case = Case(**json.loads(args.worker))
        print(json.dumps(run_rank(case, args.rank, args.rendezvous)), flush=True)
        return 0
    if args.fused_update and args.kernel != "triton":
        parser.error("--fused-update needs --kernel triton")
    if args.batch_size % args.world_size:
        parser.error(
            f"--batch-size {args.batch_size} must be divisible by --world-size {args.world_size}"
        )
    cases = _cases(args)
    results = [_measure(case, args.timeout) for case in cases]
    print(
        f"head benchmark: global batch {args.batch_size}, embedding {args.embedding_size}, "
        f"chunk {args.chunk_size}, {args.threads} thread(s) per process, device {args.device}, "
        f"{args.steps} timed steps after {args.warmup} warm-up\n"
    )
    print_table(results)
    sharded = [c for c in cases if c.method.startswith("sharded")]
    search = _search(sharded, args.timeout) if args.max_classes_search and sharded else None
    if args.json is not None:
        payload = {
            "settings": vars(args) | {"json": str(args.json)},
            "results": results,
            "max_classes_search": search,
        }
        args.json.write_text(json.dumps(payload, indent=2, default=str))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--batch-size", type=int, default=128, help="global batch N")
    parser.add_argument("--embedding-size", type=int, default=128)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=8192)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--no-single", action="store_true", help="skip the sharded W=1 rows")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--autocast", default=None, choices=["bfloat16", "float16"])
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per case")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--kernel", default="torch", choices=["torch", "triton"], help="the sharded head's kernel"
    )
    parser.add_argument(
        "--fused-update", action="store_true", help="the backward applies SGD (triton only)"
    )
    parser.add_argument(
        "--max-classes-search", action="store_true", help="search the largest classes that fit"
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rendezvous", default=None, help=argparse.SUPPRESS)
    return parser


def _cases(args: argparse.Namespace) -> list[Case]:
    """The grid: each class count x each method, the sharded ones also at W = 1."""
    cases = []
    for num_classes in args.classes:
        for method in args.methods:
            sizes = [args.world_size] if METHODS[method] else [1]
            if method.startswith("sharded") and not args.no_single and args.world_size > 1:
                sizes = [1, args.world_size]
            for world_size in sizes:
                cases.append(
                    Case(method, world_size, num_classes, args.batch_size, args.embedding_size,
                         args.chunk_size, args.steps, args.warmup, args.threads, args.device,
                         args.autocast, args.kernel, args.fused_update)
                )  # fmt: skip
    return cases


def _measure(case: Case, timeout_s: float) -> dict:
    """`run_case`, with the rates derived from its step time."""
    print(f"running {case.method} W={case.world_size} C={case.num_classes:,} ...", file=sys.stderr)
    result = run_case(case, timeout_s)
    if "error" not in result:
        result["gflops"] = head_flops(case) / result["step_s"] / 1e9
        result["useful_tflops"] = useful_tflops(case, result)
        result["percent_of_matmul"] = 100 * result["useful_tflops"] / result["matmul_tflops"]
    return result


def _search(sharded: list[Case], timeout_s: float) -> dict:
    """The largest class count per rank that the last sharded case fits (printed)."""
    case = sharded[-1]
    print(f"searching the largest class count for {case.method} W={case.world_size} ...",
          file=sys.stderr)  # fmt: skip
    start = max(c.num_classes for c in sharded) // case.world_size
    largest, tries = largest_class_count(case, timeout_s, start)
    print(
        f"\nlargest class count that fits: {largest:,} classes per rank ({case.method}, "
        f"kernel {case.kernel}{', fused update' if case.fused_update else ''}, "
        f"N {case.batch_size}, D {case.embedding_size})"
    )
    return {"method": case.method, "world_size": case.world_size,
            "largest_classes_per_rank": largest, "tries": tries}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
