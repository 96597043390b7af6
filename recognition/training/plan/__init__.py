"""The run planner: each rank's memory and a bound of its step time, on a CPU, before a run.

`rank` plans a rank's training step (`plan_rank`) and a run's distinct ranks (`plan_run`);
`fake` is what that step runs under (fake tensors, a fake process group, DDP's buckets,
the breakdown of the peak); `search` finds the largest batch and class count that fit;
`memory_check` refuses a GPU run whose plan does not fit. The planner sits above
`recognition.training.build` (it builds the run's parts with `build_model`), which never
imports it: the training loop calls the memory check. `python train.py --plan` prints a
plan (`recognition.training.plan.report`); `recognition.training.plan.check` measures the
same step on real tensors.
"""

from recognition.training.plan.fake import PlanError
from recognition.training.plan.memory_check import (
    GIB,
    HEADROOM,
    check_memory,
    format_bytes,
    usable_bytes,
)
from recognition.training.plan.rank import RankPlan, RunPlan, distinct_ranks, plan_rank, plan_run
from recognition.training.plan.search import largest, largest_batch, largest_classes, with_batch

__all__ = [
    "GIB",
    "HEADROOM",
    "PlanError",
    "RankPlan",
    "RunPlan",
    "check_memory",
    "distinct_ranks",
    "format_bytes",
    "largest",
    "largest_batch",
    "largest_classes",
    "plan_rank",
    "plan_run",
    "usable_bytes",
    "with_batch",
]
