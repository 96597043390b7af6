"""`python train.py --plan`: the plan of a run as a table, and whether it fits.

Prints the plan of every distinct rank (`recognition.training.plan`), a roofline bound of
the step time per GPU model beside the project's measured figures, and one line: fits or
not in the given memory, the largest `train.batch_size` and the largest class count that
fit (`plan.search`: a few more plans of the rank with the highest peak).
"""

from __future__ import annotations

import sys
from pathlib import Path

from recognition.config import ExperimentConfig
from recognition.training.plan import (
    HEADROOM,
    PlanError,
    RunPlan,
    format_bytes,
    largest_batch,
    largest_classes,
    plan_run,
    usable_bytes,
)
from recognition.training.plan.roofline import DEVICES

# The project's own latest measurements (the GPU check, benchmarks/results/gpu-nvidia-h200.*),
# printed beside the bound so that a reader sees how far real steps are from it.
MEASURED_ON = "an H200 (2026-11-27)"
MEASURED = (
    "the Triton head with its fused update alone at 1M classes, N 1024, D 512: 16.5-17.9 ms "
    "per step",
    "IResNet-50 model-only, batch 256, bf16, channels-last: 4,794 images/s eager, 6,358 compiled",
)


def dataset_classes(cfg: ExperimentConfig) -> int:
    """The class count of the config's training data, without loading or generating it.

    The built-in synthetic set not generated yet: its spec's identities. Otherwise the
    data set's index (an image folder's cached index is built first if missing), less the
    identities eval.holdout keeps out of training (the head has no rows for them).
    Raises OSError naming data.root when the data is not on this machine.
    """
    synthetic = cfg.data.synthetic
    root = Path(cfg.data.root)
    if synthetic.enabled and root == Path(synthetic.root) / "train" and not root.exists():
        return synthetic.num_identities
    from recognition.data.build import build_train_dataset, resolve_format
    from recognition.training.holdout import holdout_split, holdout_wanted

    source = build_train_dataset(cfg.data)
    if not holdout_wanted(cfg, resolve_format(cfg.data)):
        return source.num_classes
    return source.num_classes - len(holdout_split(source, cfg.eval.holdout).held_out)


def run_plan_command(
    cfg: ExperimentConfig, *, gpus: int, gpu_memory_gib: float, num_classes: int | None
) -> int:
    """Plan `cfg` on `gpus` GPUs of `gpu_memory_gib` GiB, print the report; the exit status
    (0: printed, whether it fits or not; 1: it cannot be planned, one line on stderr)."""
    try:
        if num_classes is None:
            num_classes = dataset_classes(cfg)
        plan = plan_run(cfg, num_classes, gpus)
        print(format_plan(plan))
        print(verdict(cfg, plan, gpu_memory_gib))
    except OSError as exc:
        print(
            f"error: {exc} (pass --classes N when the data is not on this machine)", file=sys.stderr
        )
        return 1
    except (PlanError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def format_plan(plan: RunPlan) -> str:
    """The table: one column per distinct rank, then the step-time bounds."""
    heads = [
        f"rank {r.rank}" + (f" (stage {r.stage})" if r.stage is not None else "")
        for r in plan.ranks
    ]
    rows: list[tuple[str, list[str]]] = [
        ("classes on the rank", [f"{r.num_local_classes:,}" for r in plan.ranks]),
        ("parameters", [format_bytes(r.parameters) for r in plan.ranks]),
        ("class rows", [format_bytes(r.class_rows) for r in plan.ranks]),
        ("fp32 masters", [format_bytes(r.fp32_masters) for r in plan.ranks]),
        ("optimizer state", [format_bytes(r.optimizer_state) for r in plan.ranks]),
        ("gradients at peak", [format_bytes(r.gradients) for r in plan.ranks]),
        ("activations at peak", [format_bytes(r.activations) for r in plan.ranks]),
        ("peak", [f"{format_bytes(r.peak)} ({r.phase})" for r in plan.ranks]),
    ]
    if any(r.centroid_pass for r in plan.ranks):
        rows.append(
            ("head.init=centroids pass", [format_bytes(r.centroid_pass) for r in plan.ranks])
        )
    if any(r.teacher_pass for r in plan.ranks):
        rows.append(("train.teacher pass", [format_bytes(r.teacher_pass) for r in plan.ranks]))
    rows += [
        ("step FLOPs, backbone", [_flops(r.flops_backbone) for r in plan.ranks]),
        ("step FLOPs, head", [_flops(r.flops_head) for r in plan.ranks]),
    ]
    bf16 = plan.precision.endswith("bf16")
    for name, device in DEVICES.items():
        cells = [
            "no bf16" if bf16 and device.bf16 is None else _seconds(r.bound_s[name])
            for r in plan.ranks
        ]
        rows.append((f"step time >= ({name})", cells))
    width = max(len(label) for label, _ in rows)
    col = max(16, *(len(h) for h in heads), *(len(c) for _, cells in rows for c in cells))
    per = "GPU" if plan.pipeline is None else f"replica ({plan.pipeline})"
    lines = [
        f"plan: {plan.config_name}, {plan.world_size} GPU{'s' * (plan.world_size != 1)}, "
        f"{plan.num_classes:,} classes, "
        f"batch {plan.batch_size} per {per}, {plan.precision}",
        " " * width + "".join(h.rjust(col + 2) for h in heads),
    ]
    lines += [
        label.ljust(width) + "".join(c.rjust(col + 2) for c in cells) for label, cells in rows
    ]
    lines.append(
        "step time >=: a roofline lower bound (each op at the GPU's peak dense rate or full "
        "memory bandwidth; no communication, no launch gaps), not a prediction"
    )
    lines.append(f"measured by this project on {MEASURED_ON}: " + "; ".join(MEASURED))
    return "\n".join(lines)


def verdict(cfg: ExperimentConfig, plan: RunPlan, gpu_memory_gib: float) -> str:
    """One line: fits or not, and the largest batch and class count that fit."""
    limit = usable_bytes(gpu_memory_gib)
    worst = plan.worst
    batch = largest_batch(cfg, plan, limit)
    classes = largest_classes(cfg, plan, limit)
    fits = worst.peak <= limit
    head = "fits" if fits else "does NOT fit"
    return (
        f"{head}: peak {format_bytes(worst.peak)} (rank {worst.rank}) of "
        f"{format_bytes(limit)} usable "
        f"({gpu_memory_gib:g} GiB less {HEADROOM:.0%} headroom); largest train.batch_size "
        f"that fits: {batch or 'none'}; largest class count that fits: "
        f"{f'about {_three_digits(classes):,}' if classes else 'none'}"
    )


def _three_digits(count: int) -> int:
    """`count` rounded down to three significant digits (the search is within 1 %)."""
    scale = 10 ** max(0, len(str(count)) - 3)
    return count // scale * scale


def _flops(count: int) -> str:
    if count >= 1e12:
        return f"{count / 1e12:.2f} TFLOP"
    return f"{count / 1e9:.2f} GFLOP"


def _seconds(seconds: float) -> str:
    return f"{1e3 * seconds:.1f} ms" if seconds >= 1e-3 else f"{1e6 * seconds:.0f} us"


__all__ = ["dataset_classes", "format_plan", "run_plan_command", "verdict"]
