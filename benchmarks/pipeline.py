"""Pipeline-parallel backbone: time per training step against the micro-batch size.

    python -m benchmarks.pipeline --device cuda --stages 2            # two or more GPUs
    python -m benchmarks.pipeline --device cpu --stages 2 --batch 16 \\
        --iresnet-width 0.25 --reid-size 128x64 --json p.json --plot p.png   # 2 CPU cores

The single-machine model-parallel experiment, with the project's own pipeline
(`recognition.pipeline`: units cut at balanced FLOPs, `torch.distributed.pipelining`, the
sharded margin-softmax head as the loss) and for each backbone (the re-id ResNet-50 and
IResNet-50 by default):

- **one device**: the whole model's training step (`recognition.training.train_step`) on one
  process, with every thread the stages share (on CPU, P x --threads-per-stage, and again
  with one stage's threads: on a loaded machine more threads can be slower);
- **P stages, no micro-batches**: model parallelism without a pipeline, one micro-batch (the
  whole batch) through GPipe: only one stage works at a time;
- **pipelined**: every micro-batch size from 2 to half the batch that divides it, GPipe and
  1F1B (1F1B where there are at least P micro-batches). Size 1 is left out: the embedding
  layers' BatchNorm1d refuses a batch of one in training.

Each case runs in fresh processes (one per stage; gloo with P processes of
--threads-per-stage threads each on CPU, NCCL and one GPU per stage on CUDA) and reports:
the median of --steps step times after --warmup (the slowest rank's); per-rank peak memory
of a step over what the rank held before building the case (CUDA: max_memory_allocated;
CPU: VmHWM reset through /proc/self/clear_refs, glibc told to mmap large blocks so that the
RSS follows live memory; see benchmarks/head.py); each rank's busy time (its stage's forward
and backward of one micro-batch timed alone, times the number of micro-batches) and so its
idle share of the step, beside the schedule's bubble fraction (P - 1) / (m + P - 1).

--json writes every measurement; --plot draws time per step against the micro-batch size,
one line per schedule, the one-device and unpipelined times as horizontal lines.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import table  # noqa: E402
from benchmarks.memory import proc_status_kib, reset_peak_rss, set_mmap_threshold  # noqa: E402
from recognition.config import (  # noqa: E402
    HeadConfig,
    ModelConfig,
    OptimConfig,
    parse_image_size,
)
from recognition.optim import build_optimizer  # noqa: E402


@dataclass(frozen=True)
class Case:
    backbone: str
    image_hw: tuple[int, int]
    width: float
    batch: int
    stages: int
    micro: int
    """Samples per micro-batch (the batch: no pipelining); 0 for the one-device case."""
    schedule: str
    device: str
    threads: int
    """Intra-op threads of each process (CPU)."""
    num_classes: int
    embedding_size: int
    precision: str
    warmup: int
    steps: int

    @property
    def num_micro(self) -> int:
        return self.batch // self.micro if self.micro else 1

    @property
    def kind(self) -> str:
        if self.micro == 0:
            return f"one device, {self.threads} thr" if self.device == "cpu" else "one device"
        return "P stages, no micro-batches" if self.micro == self.batch else "pipelined"


def model_config(case: Case, stages: int) -> ModelConfig:
    return ModelConfig(
        backbone=case.backbone,
        width=case.width,
        embedding_size=case.embedding_size,
        pipeline_stages=stages,
    )


# ---------------------------------------------------------------------- one rank


def _memory_now(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return (proc_status_kib("VmRSS") or 0) * 1024


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_rss()


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return (proc_status_kib("VmHWM") or 0) * 1024


def _sync(device: torch.device, group: bool) -> None:
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if group:
        dist.barrier()


def _timed(fn, device: torch.device, repeats: int, group: bool) -> float:
    times = []
    for _ in range(repeats):
        _sync(device, group)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _precision(case: Case, device: torch.device):
    from recognition.precision import Precision

    level, _, dtype = case.precision.partition("/")
    return Precision(level, dtype or "bf16", device)


def _measure(case: Case, device: torch.device, step, base: int, group: bool) -> tuple[float, int]:
    """(median step time, peak memory of a step over `base`) after the warm-up steps."""
    for _ in range(case.warmup):
        step()
    _sync(device, group)
    _reset_peak(device)
    step()
    peak = _peak(device) - base
    return _timed(step, device, case.steps, group=group), peak


def _batch(case: Case, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.randn(case.batch, 3, *case.image_hw, device=device)
    labels = torch.randint(0, case.num_classes, (case.batch,), device=device)
    return images.to(memory_format=_fmt(device)), labels


def _optimizer(precision, parts: list[torch.nn.Module]) -> torch.optim.Optimizer:
    from recognition.optim import param_groups

    groups = precision.param_groups(param_groups(parts, 5e-4))
    return build_optimizer(groups, OptimConfig(lr=0.01))


def _one_device(case: Case, device: torch.device) -> dict[str, Any]:
    """The whole model on one process: train_step over the whole batch."""
    from recognition.heads import build_head
    from recognition.models import backbone_from_config
    from recognition.training import train_step

    torch.manual_seed(0)
    base = _memory_now(device)
    backbone = backbone_from_config(model_config(case, 1), case.image_hw)
    backbone = backbone.to(device, memory_format=_fmt(device))
    head_cfg = HeadConfig(margin="arcface", scale=None, m=None)
    head = build_head(head_cfg, case.num_classes, case.embedding_size, seed=0, device=device)
    precision = _precision(case, device)
    precision.prepare(backbone, head)
    optimizer = _optimizer(precision, [backbone, head])
    images, labels = _batch(case, device)

    def step() -> None:
        train_step(backbone, head, [(images, labels)], optimizer, precision, None)

    step_s, peak = _measure(case, device, step, base, group=False)
    return {"step_s": step_s, "peak_bytes": [peak], "busy_s": [step_s]}


def _fmt(device: torch.device) -> torch.memory_format:
    return torch.channels_last if device.type == "cuda" else torch.contiguous_format


def _pipelined(case: Case, rank: int, world: int, device: torch.device) -> dict[str, Any]:
    import torch.distributed as dist

    from recognition.distributed import DistInfo
    from recognition.heads import build_head
    from recognition.pipeline import build_stage_backbone, make_layout
    from recognition.training.pipeline_step import build_pipeline_step

    layout = make_layout(case.stages, DistInfo(rank=rank, world_size=world, device=device))
    base = _memory_now(device)
    stage, plan = build_stage_backbone(model_config(case, case.stages), case.image_hw, layout, 0)
    stage = stage.to(device, memory_format=_fmt(device))
    head = None
    if layout.is_last:
        head = build_head(
            HeadConfig(margin="arcface", scale=None, m=None), case.num_classes,
            case.embedding_size, seed=0, device=device,
            group=layout.dp_group,
        )  # fmt: skip
    precision = _precision(case, device)
    precision.prepare(*([stage] if head is None else [stage, head]))
    model, step_fn = build_pipeline_step(
        stage, layout, head, precision, device=device, image_hw=case.image_hw,
        micro_batch_size=case.micro, schedule=case.schedule, num_micro=case.num_micro,
        memory_format=_fmt(device),
    )  # fmt: skip
    optimizer = _optimizer(precision, [stage] if head is None else [stage, head])
    images, labels = _batch(case, device)

    def step() -> None:
        step_fn(model, head, [(images, labels)], optimizer, precision, None)

    step_s, peak = _measure(case, device, step, base, group=True)

    # Busy time: this stage's forward and backward of one micro-batch alone, m times.
    input_meta, output_meta = step_fn.input_meta, step_fn.output_meta
    x = torch.randn(input_meta.shape, dtype=input_meta.dtype, device=device)
    x.requires_grad_(not layout.is_first)
    grad = torch.randn(output_meta.shape, dtype=output_meta.dtype, device=device)
    micro_labels = labels[: case.micro]

    def alone() -> None:
        with precision.autocast():
            out = stage(x)
            if head is not None:
                head(out, micro_labels).backward()
            else:
                out.backward(grad)

    busy = _timed(alone, device, max(2, case.steps), group=False) * case.num_micro
    optimizer.zero_grad(set_to_none=True)
    result = {"step_s": step_s, "peak_bytes": peak, "busy_s": busy}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result)
    return {
        "step_s": max(r["step_s"] for r in gathered),
        "peak_bytes": [r["peak_bytes"] for r in gathered],
        "busy_s": [r["busy_s"] for r in gathered],
        "ranges": plan.ranges,
    }


def worker(rank: int, case: Case, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(case.threads)
    device = torch.device(case.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    precise_rss = device.type == "cpu" and set_mmap_threshold(64 * 1024)
    if case.micro == 0:
        result = _one_device(case, device)
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            rank=rank,
            world_size=case.stages,
            timeout=datetime.timedelta(seconds=1800),
        )
        result = _pipelined(case, rank, case.stages, device)
        dist.barrier()
        dist.destroy_process_group()
    result["precise_rss"] = precise_rss
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    # Skip the interpreter's teardown, which intermittently aborts inside gloo (as the
    # spawned tests do); the result is written.
    sys.stdout.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(case: Case) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        nprocs = 1 if case.micro == 0 else case.stages
        try:
            mp.spawn(worker, args=(case, _free_port(), out), nprocs=nprocs)
            result = json.loads(Path(out).read_text())
        except Exception as exc:  # noqa: BLE001 (reported in the table, the sweep goes on)
            result = {"error": str(exc).strip().splitlines()[-1]}
    record = {**asdict(case), "kind": case.kind, "num_micro": case.num_micro, **result}
    if "busy_s" in result:
        record["idle"] = [max(0.0, 1 - b / result["step_s"]) for b in result["busy_s"]]
        p, m = case.stages, case.num_micro
        record["bubble"] = (p - 1) / (m + p - 1) if case.micro else 0.0
    return record


# ---------------------------------------------------------------------- the sweep


def cases_for(args: argparse.Namespace, backbone: str) -> list[Case]:
    is_reid = backbone == "resnet50_reid"
    common = dict(
        backbone=backbone,
        image_hw=args.reid_size if is_reid else args.iresnet_size,
        width=1.0 if is_reid else args.iresnet_width,
        batch=args.batch,
        stages=args.stages,
        device=args.device,
        num_classes=args.classes,
        embedding_size=args.embedding_size,
        precision=args.precision,
        warmup=args.warmup,
        steps=args.steps,
    )
    tps = args.threads_per_stage
    # One device with the threads of all stages; on a CPU also with one stage's threads (on
    # a loaded machine more threads can be slower, and the table should show it).
    cases = [Case(micro=0, schedule="-", threads=tps * args.stages, **common)]
    if args.device == "cpu" and args.stages > 1:
        cases.append(Case(micro=0, schedule="-", threads=tps, **common))
    cases.append(Case(micro=args.batch, schedule="gpipe", threads=tps, **common))
    micro = 2
    while micro < args.batch:
        if args.batch % micro == 0:
            for schedule in args.schedules:
                if schedule == "1f1b" and args.batch // micro < args.stages:
                    continue
                cases.append(Case(micro=micro, schedule=schedule, threads=tps, **common))
        micro *= 2
    return cases


COLUMNS = [
    ("backbone", -14), ("what", -27), ("sched", -6), ("micro", 5), ("m", 3), ("ms/step", 9),
    ("img/s", 7), ("vs naive", 8), ("peak MiB per rank", -22), ("bubble", 6),
    ("idle/rank", -14),
]  # fmt: skip


def print_table(records: list[dict]) -> None:
    naive = {r["backbone"]: r.get("step_s") for r in records if r["kind"].startswith("P stages")}
    rows = []
    for r in records:
        what = [r["backbone"], r["kind"], r["schedule"], r["micro"] or r["batch"]]
        if "error" in r:
            rows.append([*what, f"error: {r['error']}"])
            continue
        reference = naive.get(r["backbone"])
        rows.append(
            [
                *what,
                r["num_micro"],
                f"{1000 * r['step_s']:.1f}",
                f"{r['batch'] / r['step_s']:.1f}",
                f"{reference / r['step_s']:.2f}x" if reference else "-",
                " / ".join(f"{p / 2**20:.0f}" for p in r["peak_bytes"]),
                f"{100 * r.get('bubble', 0):.0f}%",
                " / ".join(f"{100 * i:.0f}%" for i in r.get("idle", [])),
            ]
        )
    table.print_table(COLUMNS, rows)


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backbones = list(dict.fromkeys(r["backbone"] for r in records))
    fig, axes = plt.subplots(1, len(backbones), figsize=(6 * len(backbones), 4.2), squeeze=False)
    for ax, backbone in zip(axes[0], backbones, strict=True):
        mine = [r for r in records if r["backbone"] == backbone and "error" not in r]
        for schedule in ("gpipe", "1f1b"):
            # The unpipelined case is GPipe with one micro-batch: the curve's right end.
            points = sorted(
                (r["micro"], 1000 * r["step_s"])
                for r in mine
                if r["schedule"] == schedule and r["micro"] > 0
            )
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=f"pipelined, {schedule}")
        colors = iter(["tab:green", "tab:red", "tab:purple"])
        for r in mine:
            if r["kind"] != "pipelined":
                one = r["kind"].startswith("one device")
                ax.axhline(
                    1000 * r["step_s"],
                    linestyle="--" if one else ":",
                    color=next(colors) if one else "black",
                    label=r["kind"],
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batch size (samples)")
        ax.set_ylabel("time per training step (ms)")
        first = mine[0] if mine else {}
        ax.set_title(
            f"{backbone}, {first.get('stages')} stages, batch {first.get('batch')}, "
            f"{first.get('device')}"
        )
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--backbones", nargs="+", default=["resnet50_reid", "iresnet50"])
    parser.add_argument("--batch", type=int, default=None, help="default 128 on CUDA, 16 on CPU")
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    parser.add_argument("--iresnet-width", type=float, default=1.0)
    parser.add_argument("--iresnet-size", default="112", help="N or HxW (default 112)")
    parser.add_argument("--reid-size", default="256x128", help="N or HxW (default 256x128)")
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--embedding-size", type=int, default=512)
    parser.add_argument(
        "--precision", default=None, help="LEVEL/DTYPE; default O1/bf16 on CUDA, O0 on CPU"
    )
    parser.add_argument("--threads-per-stage", type=int, default=None, help="CPU: cores / stages")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.stages:
        parser.error(
            f"--stages {args.stages} needs as many GPUs, {torch.cuda.device_count()} visible"
        )
    args.batch = args.batch or (128 if args.device == "cuda" else 16)
    args.precision = args.precision or ("O1/bf16" if args.device == "cuda" else "O0")
    args.threads_per_stage = args.threads_per_stage or max(1, (os.cpu_count() or 1) // args.stages)
    args.iresnet_size = _hw(args.iresnet_size)
    args.reid_size = _hw(args.reid_size)
    records = []
    for backbone in args.backbones:
        for case in cases_for(args, backbone):
            record = run_case(case)
            records.append(record)
            status = record.get("error") or f"{1000 * record['step_s']:.1f} ms"
            print(
                f"# {backbone} {case.kind} {case.schedule} micro {case.micro}: {status}", flush=True
            )
    print()
    print_table(records)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"args": _jsonable(vars(args)), "results": records}, indent=2) + "\n"
        )
    if args.plot is not None:
        plot(records, args.plot)
    return 0


def _hw(text: str) -> tuple[int, int]:
    size = parse_image_size(text, "--size")
    return (size, size) if isinstance(size, int) else tuple(size)


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in values.items()}


if __name__ == "__main__":
    sys.exit(main())
