"""The host's work per training step, counted: aten operations one step dispatches, on a CPU.

    python -m benchmarks.step_ops                         # the GPU check's IResNet-50 step
    python -m benchmarks.step_ops --backbone iresnet18 --json ops.json -- precision.level=O0

A step that the host enqueues one operation at a time is bound by the host when its
kernels are short: on an H200 the GPU check's IResNet-50 step (batch 256, 112 px, O1 bf16)
took 52.3 ms to enqueue for 54.5 ms of kernels. Every aten operation costs the host a
dispatch (and most a kernel launch on a GPU), so their number per step is what this counts,
on a CPU, where it does not depend on the GPU or on the batch: the project's step
(`recognition.training.train_step`, as `benchmarks/train_throughput.py`'s model-only row
runs it: the backbone, the config's head, Precision, SGD) under a
`TorchDispatchMode` that counts each operation, after two steps (the optimizer's state made).
The count is the same at any batch and image size (the shapes change, not the operations),
so it runs at batch 4 and 32 px. The backbone runs eager: a compiled one runs eagerly under
a dispatch mode, so the count is the eager step's.

It prints the total, the operations by phase (forward, backward, the optimizer's step) and
the most frequent ones; --json writes them. `benchmarks/gpu_check.py` reports the total as a
row (the issue's target: at most 900).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.train_throughput import model_parts  # noqa: E402
from recognition.config import ExperimentConfig, load_config  # noqa: E402
from recognition.training import train_step  # noqa: E402
from recognition.training.graphed import GraphedStep  # noqa: E402

# The GPU check's throughput step (benchmarks/gpu_throughput.throughput_plan), at a size a
# CPU counts in seconds.
GPU_CHECK_STEP = ("model.backbone=iresnet50", "precision.level=O1", "precision.dtype=bf16")
COUNT_SIZE = ("train.batch_size=4", "data.image_size=32")
TARGET = 900


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched while it is on, by (phase, name)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.ops: collections.Counter[tuple[str, str]] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[(self.phase, func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class HostOnly:
    """A graph for counting the host's work of a captured step (train.cuda_graphs): the
    capture runs the step as it is (its Python state made), a replay runs nothing here. On
    a GPU a replay launches the captured kernels, which the host does not dispatch."""

    @staticmethod
    def runs_on(device: torch.device) -> bool:
        return True

    def capture(self):
        return contextlib.nullcontext()

    def replay(self) -> None:
        pass


def count_step(
    cfg: ExperimentConfig, num_classes: int = 512, captured: bool = False
) -> dict[str, Any]:
    """The aten operations of one training step of `cfg` on the CPU (after two steps): the
    total, by phase, and the 12 most frequent (name, count). `captured`: of a replayed step
    of train.cuda_graphs (`HostOnly`: what the host dispatches besides the replay), after
    the eager steps and the capture; its one phase is "replay"."""
    torch.manual_seed(0)
    device = torch.device("cpu")
    backbone, model, head, optimizer, precision = model_parts(cfg, device, num_classes)
    height, width = cfg.data.image_hw
    batch = [(torch.randn(cfg.train.batch_size, 3, height, width),
              torch.randint(0, num_classes, (cfg.train.batch_size,)))]  # fmt: skip
    step: Any = train_step
    if captured:
        step = GraphedStep(train_step, warmup=1, graph=HostOnly)
    for _ in range(2):  # captured: one eager step, the capture
        step(model, head, batch, optimizer, precision, cfg.optim.grad_clip)
    counter = OpCounter()
    if captured:
        counter.phase = "replay"
        replays = step.replays
        with counter:
            step(model, head, batch, optimizer, precision, cfg.optim.grad_clip)
        assert step.replays == replays + 1 and step.captures == 1, "not a replayed step"
        return _counted(counter, backbone, head)

    def in_phase(name: str, method):
        def counted(*args, **kwargs):
            counter.phase = name
            try:
                return method(*args, **kwargs)
            finally:
                counter.phase = "other"

        return counted

    # The phases by Precision's calls: backward(loss) and step(optimizer).
    precision.backward = in_phase("backward", precision.backward)  # type: ignore[method-assign]
    precision.step = in_phase("step", precision.step)  # type: ignore[method-assign]
    with counter:
        train_step(model, head, batch, optimizer, precision, cfg.optim.grad_clip)
    return _counted(counter, backbone, head)


def _counted(counter: OpCounter, backbone, head) -> dict[str, Any]:
    phases: collections.Counter[str] = collections.Counter()
    names: collections.Counter[str] = collections.Counter()
    for (phase, name), count in counter.ops.items():
        phases["forward" if phase == "other" else phase] += count
        names[name] += count
    return {
        "ops_per_step": sum(counter.ops.values()),
        "by_phase": dict(phases),
        "most_frequent": names.most_common(12),
        "parameters": sum(1 for _ in backbone.parameters()) + sum(1 for _ in head.parameters()),
    }


def gpu_check_config(*overrides: str) -> ExperimentConfig:
    """The GPU check's step at the counting size, on the CPU, with `overrides` last."""
    base = [*GPU_CHECK_STEP, *COUNT_SIZE, "train.device=cpu", "train.compile=false",
            "eval.targets=[]", "eval.at_end=false"]  # fmt: skip
    return load_config("ms1m_arcface", [*base, *overrides])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbone", default="iresnet50")
    parser.add_argument("--classes", type=int, default=512)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--captured", action="store_true",
                        help="a replayed step of train.cuda_graphs: the host's part")  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="config overrides (after --)")
    args = parser.parse_args(argv)
    cfg = gpu_check_config(f"model.backbone={args.backbone}", *args.overrides)
    result = count_step(cfg, args.classes, captured=args.captured)
    what = ", captured (train.cuda_graphs)" if args.captured else ""
    print(f"{args.backbone}, {cfg.precision.level} {cfg.precision.dtype}{what}: "
          f"{result['ops_per_step']:,} aten operations per step (target <= {TARGET}), "
          f"{result['parameters']} parameters")  # fmt: skip
    print("  by phase: " + ", ".join(f"{k} {v:,}" for k, v in result["by_phase"].items()))
    for name, count in result["most_frequent"]:
        print(f"  {name:<32} {count:>6,}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
