"""The largest train.batch_size and class count that fit a GPU, by a few more plans.

`largest` finds the boundary of a growing, convex peak (a secant, then bisection);
`largest_batch` and `largest_classes` run it over plans of the rank with the highest peak
(`plan.rank.plan_rank`, peak only). `python train.py --plan` prints both
(`recognition.training.plan.report`); the memory check names the batch
(`plan.memory_check`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from recognition.config import ExperimentConfig
from recognition.training.plan.rank import RunPlan, plan_rank


def with_batch(cfg: ExperimentConfig, batch_size: int) -> ExperimentConfig:
    """`cfg` with train.batch_size set (validated, as an override would be)."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=batch_size))


def largest(
    peak_at: Callable[[int], int], start: int, limit: int, *, tolerance: float = 0.0
) -> int:
    """The largest integer x >= 1 with peak_at(x) <= limit (0 if even 1 does not fit), to
    within `tolerance` (relative; 0: exactly).

    `peak_at` must grow with x and be convex: a batch or a class count, of which every
    live tensor's size is an affine function, so the peak is the largest of affine
    functions. The line through the two plans nearest the limit predicts the answer; a
    line through two points both below its prediction runs under a convex function beyond
    them, so a prediction that fits is the answer. Otherwise each prediction is planned
    with its neighbour one step (the tolerance) beyond it, and bisection takes over where
    the line would leave the bracket.
    """
    peaks: dict[int, int] = {}

    def fits(x: int) -> bool:
        if x not in peaks:
            peaks[x] = peak_at(x)
        return peaks[x] <= limit

    low, high = 0, None  # low fits (0: none known to), high does not (None: none known)
    for x in dict.fromkeys((max(1, start), max(1, start // 2))):  # the second is cheaper
        if fits(x):
            low = max(low, x)
        else:
            high = x if high is None else min(high, x)
    while high is None or high - low > _step(high, tolerance):
        if high == 1:
            return 0
        guess, extrapolated = _secant(peaks, limit)
        if guess is None or guess <= low or (high is not None and guess >= high):
            guess, extrapolated = (2 * low if high is None else (low + high) // 2), False
        guess = max(guess, 1)
        if fits(guess):
            low = guess
            if extrapolated:
                return low
            beyond = guess + _step(guess, tolerance)
            if high is None or beyond < high:
                if fits(beyond):
                    low = beyond
                else:
                    high = beyond
        else:
            high = guess
            below = max(low, guess - _step(guess, tolerance))
            if below > low:
                if fits(below):
                    low = below
                else:
                    high = below
    return low


def _step(x: int, tolerance: float) -> int:
    return max(1, math.floor(tolerance * x))


def _secant(peaks: dict[int, int], limit: int) -> tuple[int | None, bool]:
    """Where the line through the two planned points nearest the limit reaches it, and
    whether both points lie below that (an extrapolation)."""
    points = sorted(peaks.items(), key=lambda item: abs(item[1] - limit))[:2]
    if len(points) < 2:
        return None, False
    (x0, p0), (x1, p1) = points
    if p1 == p0 or x1 == x0:
        return None, False
    slope = (p1 - p0) / (x1 - x0)
    if slope <= 0:
        return None, False
    guess = int(x0 + (limit - p0) / slope)
    return guess, max(x0, x1) < guess and max(p0, p1) <= limit


def largest_batch(cfg: ExperimentConfig, plan: RunPlan, limit: int) -> int:
    """The largest train.batch_size that fits (with a pipeline: a multiple of its
    micro-batch size, of as many micro-batches as its schedule needs at least)."""
    unit, smallest = _batch_steps(cfg)
    # Without a pipeline the rank with the largest shard; with one every stage's first
    # replica (the last stage's holds the largest shard: the other replicas peak lower).
    stages = cfg.model.pipeline_stages
    ranks = list(range(stages)) if stages > 1 else [plan.worst.rank]

    def batch_of(x: int) -> int:
        # The search runs over x = 1, 2, ...: the smallest batch that runs, the next ...
        return unit * (x + smallest - 1)

    def peak_at(x: int) -> int:
        batch = batch_of(x)
        if batch == 1:  # BatchNorm needs two samples to train: never fits
            return limit + 1
        if batch == plan.batch_size:
            return max(r.peak for r in plan.ranks if r.rank in ranks)
        trial = with_batch(cfg, batch)
        return max(
            plan_rank(trial, plan.num_classes, plan.world_size, r, detailed=False).peak
            for r in ranks
        )

    start = max(1, plan.batch_size // unit - smallest + 1)
    found = largest(peak_at, start, limit)
    return batch_of(found) if found else 0


def largest_classes(cfg: ExperimentConfig, plan: RunPlan, limit: int) -> int:
    """The largest class count that fits (within 1 %): the rank with the largest shard
    planned anew, the stages without the head as planned (they hold no class)."""
    world, stages = plan.world_size, cfg.model.pipeline_stages
    head_rank = stages - 1  # the last stage of the first replica: the largest shard
    others = max(
        (r.peak for r in plan.ranks if r.stage is not None and r.stage != head_rank), default=0
    )

    def peak_at(num_classes: int) -> int:
        if num_classes == plan.num_classes:
            return plan.worst.peak
        return max(others, plan_rank(cfg, num_classes, world, head_rank, detailed=False).peak)

    return largest(peak_at, max(plan.num_classes, world // stages), limit, tolerance=0.01)


def _batch_steps(cfg: ExperimentConfig) -> tuple[int, int]:
    """(unit, smallest): train.batch_size is a multiple of `unit` and at least `smallest`
    of them. Without a pipeline 1 and 1; with one, its micro-batches: 2 x stages of them
    when model.micro_batch_size is null (of 2 samples at least, for BatchNorm), else
    micro-batches of that size, at least as many as stages under 1F1B."""
    model = cfg.model
    if model.pipeline_stages == 1:
        return 1, 1
    if model.micro_batch_size is None:
        return 2 * model.pipeline_stages, 2
    smallest = model.pipeline_stages if model.pipeline_schedule == "1f1b" else 1
    return model.micro_batch_size, smallest
