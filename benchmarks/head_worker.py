"""One rank of one case of benchmarks/head.py, in a fresh process: its measurements.

`run_rank` builds the case's step (`head_methods.build_step`) after a step of the same
method on a tiny problem (the baseline then holds the kernels' code pages and the
runtime's first-use buffers), measures the peak memory and the bytes sent over one step,
times --steps steps, then a plain matmul of the head's size (`plain_matmul_tflops`). The
module docstring of benchmarks/head.py says how each is measured.
"""

from __future__ import annotations

import datetime
import gc
import math
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial

import torch
import torch.distributed as dist

from benchmarks.head_methods import Case, Step, build_step
from benchmarks.memory import proc_status_kib, reset_peak_rss, set_mmap_threshold
from recognition.distributed import ALL_GATHER_NAME, REDUCE_SCATTER_NAME


def run_rank(case: Case, rank: int, rendezvous: str) -> dict:
    """One rank of one case, in a fresh process: returns its measurements."""
    torch.set_num_threads(case.threads)
    device, counter = _join(case, rank, rendezvous)
    sync = partial(_sync, device, case.world_size > 1)
    # Memory is measured with every CPU allocation above 64 KiB served by mmap, so that a
    # freed tensor leaves the RSS at once; time is measured afterwards with a 32 MiB threshold
    # (glibc's default once warmed up), where allocations are recycled as usual.
    precise_rss = device.type == "cpu" and set_mmap_threshold(64 * 1024)
    base = _baseline(case, rank, device, sync)
    captured = case.captured and device.type == "cuda"
    if captured:  # its step's memory is taken at the capture and held by the graph's pool
        torch.cuda.reset_peak_memory_stats(device)
    step, num_rows = build_step(case, rank, device)
    capture_peak = torch.cuda.max_memory_allocated(device) - base if captured else 0
    for _ in range(case.warmup):
        step()
    sync()

    # ---- memory and communication: one step
    peak, peak_method = _peak_of_one_step(step, device, base, precise_rss, counter, sync)
    if captured:  # a replay allocates nothing: the peak of its eager steps and capture
        peak, peak_method = max(peak, capture_peak), peak_method + " over the capture"
    bytes_sent = counter.bytes_sent if counter else 0.0
    calls = counter.calls if counter else 0

    # ---- time: median of --steps steps
    if precise_rss:
        set_mmap_threshold(32 * 1024 * 1024)
        step()  # let the allocator settle into the new threshold
    times = []
    for _ in range(case.steps):
        sync()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)

    # ---- the plain matmul of the head's size, once the head's memory is free
    del step
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    sync()
    matmul_tflops = plain_matmul_tflops(
        device, case.autocast, case.batch_size, case.embedding_size, num_rows
    )
    result = {
        "rank": rank,
        "step_s": statistics.median(times),
        "peak_bytes": peak,
        "floor_bytes": 3 * num_rows * case.embedding_size * 4,
        "num_rows": num_rows,
        "bytes_sent_per_step": bytes_sent,
        "collectives_per_step": calls,
        "peak_method": peak_method,
        "matmul_tflops": matmul_tflops,
    }
    sync()
    if case.world_size > 1:
        dist.destroy_process_group()
    return result


def _join(case: Case, rank: int, rendezvous: str) -> tuple[torch.device, CommCounter | None]:
    """This rank's device, and with several ranks the process group joined and a counter of
    the bytes the rank sends."""
    device = torch.device(case.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    if case.world_size == 1:
        return device, None
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=case.world_size,
        timeout=datetime.timedelta(seconds=1800),
    )
    return device, CommCounter(case.world_size, rank)


def _sync(device: torch.device, distributed: bool) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if distributed:
        dist.barrier()


def _baseline(case: Case, rank: int, device: torch.device, sync: Callable[[], None]) -> int:
    """Bytes in use before the case allocates anything (the device's, or the RSS)."""
    # A step of the same method on a tiny problem first: the kernels' code pages and the
    # runtime's first-use buffers (a couple of hundred MiB of RSS on CPU) then belong to the
    # baseline, not to the case.
    tiny = Case(**{**asdict(case), "num_classes": 64 * case.world_size})
    tiny_step, _ = build_step(tiny, rank, device)
    tiny_step()
    del tiny_step
    sync()
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return proc_status_kib("VmRSS") * 1024


def _peak_of_one_step(
    step: Step,
    device: torch.device,
    base: int,
    precise_rss: bool,
    counter: CommCounter | None,
    sync: Callable[[], None],
) -> tuple[int, str]:
    """The peak memory of one step above `base` and how it was read (`counter` counts that
    step's bytes sent)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        peak_method = "torch.cuda.max_memory_allocated"
    elif reset_peak_rss():
        peak_method = "VmHWM after clear_refs" + (", mmap threshold 64 KiB" if precise_rss else "")
    else:
        peak_method = "ru_maxrss (whole process)"
    if counter is not None:
        counter.reset()
    step()
    sync()
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) - base, peak_method
    if peak_method.startswith("VmHWM"):
        return proc_status_kib("VmHWM") * 1024 - base, peak_method
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base, peak_method


class CommCounter:
    """Counts the bytes this rank sends through torch.distributed (ring-algorithm model)."""

    def __init__(self, world_size: int, rank: int) -> None:
        self.world_size, self.rank, self.bytes_sent, self.calls = world_size, rank, 0.0, 0
        w = world_size

        def nbytes(tensor) -> int:
            return tensor.numel() * tensor.element_size()

        def wrap(name, sent):
            original = getattr(dist, name)

            def counted(*args, **kwargs):
                self.bytes_sent += sent(*args, **kwargs)
                self.calls += 1
                return original(*args, **kwargs)

            setattr(dist, name, counted)

        wrap(ALL_GATHER_NAME, lambda out, inp, *a, **k: (w - 1) * nbytes(inp))
        wrap(REDUCE_SCATTER_NAME, lambda out, inp, *a, **k: (w - 1) / w * nbytes(inp))
        wrap("all_reduce", lambda t, *a, **k: 2 * (w - 1) / w * nbytes(t))

        def gather_sent(tensor, gather_list=None, dst=0, *a, **k):
            return 0 if rank == dst else nbytes(tensor)

        def scatter_sent(tensor, scatter_list=None, src=0, *a, **k):
            if rank != src:
                return 0
            return sum(nbytes(t) for i, t in enumerate(scatter_list) if i != src)

        wrap("gather", gather_sent)
        wrap("scatter", scatter_sent)

    def reset(self) -> None:
        self.bytes_sent, self.calls = 0.0, 0


def plain_matmul_tflops(device, dtype_name: str | None, rows: int, dim: int, cols: int) -> float:
    """Achieved TFLOP/s of (rows, dim) @ (dim, cols) in `dtype_name` (float32 if None): the
    head's logits matmul without the head. Columns beyond an output block of 1 GiB (256 MiB
    on CPU) are not allocated: one block of columns is timed and its rate returned."""
    dtype = getattr(torch, dtype_name) if dtype_name else torch.float32
    element = torch.empty((), dtype=dtype).element_size()
    budget = (1 << 30) if device.type == "cuda" else (1 << 28)
    cols = max(1, min(cols, budget // (rows * element)))
    a = torch.randn(rows, dim, device=device, dtype=dtype)
    b = torch.randn(cols, dim, device=device, dtype=dtype).t()  # as F.linear reads the rows
    out = a @ b
    best = math.inf
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.matmul(a, b, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * rows * dim * cols / best / 1e12
