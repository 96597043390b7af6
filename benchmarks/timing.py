"""The skeleton of the CPU benchmarks timed over thread counts (``ijb``, ``ijb_search``).

Their shared flags (``--dim --threads --repeats``, ``--json --seed``), the line that says how
many CPUs the run may use, each run's wall and CPU time, the runs repeated per thread count,
and the JSON file of the results with the machine's description.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.table import machine, write_json


def add_thread_args(parser: argparse.ArgumentParser, repeats: int, repeats_help: str) -> None:
    """``--dim`` (512), ``--threads`` (1 2) and ``--repeats`` (``repeats``)."""
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=repeats, help=repeats_help)


def add_output_args(parser: argparse.ArgumentParser) -> None:
    """``--json`` (the results file) and ``--seed`` (of the random problem, 0)."""
    parser.add_argument("--json", type=Path, help="write the measurements here")
    parser.add_argument("--seed", type=int, default=0)


def cpus() -> str:
    """How many CPUs this machine has and how many this process may use."""
    return f"{os.cpu_count()} CPUs visible, {len(os.sched_getaffinity(0))} usable"


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float, float]:
    """(result, wall seconds, CPU seconds of this process) of fn(*args, **kwargs)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - wall, time.process_time() - cpu


def over_threads(
    run_once: Callable[[int], tuple[Any, list[float]]], threads: Sequence[int], repeats: int
) -> list[tuple[int, list[list[float]], Any]]:
    """``run_once(num_threads)`` -> (result, times), ``repeats`` times per thread count.

    Returns, per thread count: (the count, the times of each run, the last run's result).
    """
    measured = []
    for num_threads in threads:
        runs, result = [], None
        for _ in range(repeats):
            result, times = run_once(num_threads)
            runs.append(times)
        measured.append((num_threads, runs, result))
    return measured


def save_results(path: Path | None, payload: dict[str, Any]) -> None:
    """With ``path``, write the machine's description and ``payload`` there as JSON."""
    if path is not None:
        write_json(path, {**machine(), **payload})
        print(f"wrote {path}")
