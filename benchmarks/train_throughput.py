"""Training throughput of one device: model only, and end to end on real data, compile on/off.

    python -m benchmarks.train_throughput --device cuda                   # IResNet-50 and -100
    python -m benchmarks.train_throughput --device cuda --data /data/faces_jpeg /data/ms1m
    python -m benchmarks.train_throughput --device cuda --data /data/ms1m --decode gpu \\
        --gpu-decode-workers 4 --no-compile                    # GPU decode only, 4 workers
    python -m benchmarks.train_throughput --device cpu --backbones iresnet18 --batch-size 16 \\
        --image-size 64 --classes 1000 --steps 4 --no-compile        # a smoke run on a laptop

Two kinds of rows, each for every backbone and for compile off and on (`train.compile`;
--no-compile and --compile-only keep one):

- **model only**: the project's training step (`recognition.training.train_step`: the
  backbone, the config's sharded margin-softmax head, Precision, SGD) on random images that
  already lie on the device, channels-last. Images/s is the batch over the median step time of
  --steps steady-state steps (after --warmup steps, which hold the compilation); TFLOP/s is
  the FLOPs of one step, counted by `torch.utils.flop_counter` on the eager model (not
  those inside Triton kernels: the head's, where head.kernel chose them), over that
  time, and `% mm` its share of a plain matmul of the precision's dtype (8192^3 on a GPU,
  smaller on a CPU) timed in the same run. `mem MiB` is `max_memory_allocated` on a GPU
  (model only and end to end) and the peak RSS of the end-to-end run on a CPU.
- **end to end** (one per --data folder and --decode): `train.py` itself, in a fresh
  process, on that data set (an image folder or a RecordIO folder; `data.format=auto`), the
  median `samples_per_sec` of its logged windows after the first
  (`benchmarks.train_scaling.run_one`), and `x model` against the model-only row of the same
  backbone and compile setting. `data.decode=cpu`: the --workers loader workers decode;
  `data.decode=gpu`: the --gpu-decode-workers workers read bytes and the GPU decodes
  (nvJPEG). --decode defaults to both on a GPU and to cpu on a CPU device (gpu needs CUDA).

Everything the step needs is built by the project's own functions from --config (default
ms1m_arcface: IResNet-50, ArcFace, 93,431 classes, bf16 O1) with the overrides given after
`--`. The table is printed and, with --json, written with every measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.train_scaling import run_one  # noqa: E402
from recognition.config import ExperimentConfig, load_config  # noqa: E402
from recognition.heads import build_head  # noqa: E402
from recognition.models import backbone_from_config  # noqa: E402
from recognition.optim import build_optimizer, param_groups  # noqa: E402
from recognition.precision import Precision  # noqa: E402
from recognition.training import train_step  # noqa: E402
from recognition.training.build import compile_model  # noqa: E402
from recognition.training.graphed import GraphedStep  # noqa: E402


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(device: torch.device, dtype: torch.dtype, repeats: int = 10) -> float:
    """TFLOP/s of one square matmul of `dtype` on `device` (median of `repeats`)."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for _ in range(repeats + 2):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times[2:]) / 1e12


def matmul_dtype(cfg: ExperimentConfig, device: torch.device) -> torch.dtype:
    """The dtype of the step's matmuls: the precision's half type, float32 under O0 or on a
    CPU (where this benchmark's reference matmul runs in float32)."""
    if cfg.precision.level == "O0" or device.type == "cpu":
        return torch.float32
    return {"fp16": torch.float16, "bf16": torch.bfloat16}[cfg.precision.dtype]


def memory_format(device: torch.device) -> torch.memory_format:
    """Channels-last on a GPU; NCHW on a CPU, where oneDNN gets the narrow backbones' strided
    1x1 weight gradients wrong in channels-last (recognition.models.cpu_layout)."""
    return torch.channels_last if device.type == "cuda" else torch.contiguous_format


def model_parts(cfg: ExperimentConfig, device: torch.device, num_classes: int):
    """Backbone (maybe compiled), head, optimizer and Precision as `training.build` makes them
    on one process."""
    backbone = backbone_from_config(cfg.model, cfg.data.image_hw)
    backbone = backbone.to(device, memory_format=memory_format(device))
    head = build_head(cfg.head, num_classes, cfg.model.embedding_size, seed=0, device=device)
    precision = Precision(cfg.precision.level, cfg.precision.dtype, device)
    precision.prepare(backbone, head)
    optimizer = build_optimizer(
        precision.param_groups(param_groups([backbone, head], cfg.optim.weight_decay)), cfg.optim
    )
    head.attach_optimizer(optimizer, precision.optimizer_param(head.weight))
    model = backbone
    if cfg.train.compile:
        model = compile_model(backbone, cfg, device)
    return backbone, model, head, optimizer, precision


def step_flops(backbone, head, precision, batch) -> float:
    """FLOPs of one eager training step (forward and backward), as torch counts them."""
    from torch.utils.flop_counter import FlopCounterMode

    images, labels = batch
    with FlopCounterMode(display=False) as counter:
        with precision.autocast():
            loss = head(backbone(precision.cast_inputs(images)), labels)
        loss.backward()
    backbone.zero_grad(set_to_none=True)
    head.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def measure_model(
    cfg: ExperimentConfig, device: torch.device, num_classes: int, steps: int, warmup: int
) -> dict[str, Any]:
    torch.manual_seed(0)
    backbone, model, head, optimizer, precision = model_parts(cfg, device, num_classes)
    height, width = cfg.data.image_hw
    batch_size = cfg.train.batch_size
    images = torch.randn(batch_size, 3, height, width, device=device).to(
        memory_format=memory_format(device)
    )
    labels = torch.randint(0, num_classes, (batch_size,), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # train.cuda_graphs: captured after its eager steps, which the warm-up steps must cover.
    step = GraphedStep(train_step) if cfg.train.cuda_graphs else train_step
    times = []
    first_steps_s = 0.0
    first_peak = 0
    for index in range(warmup + steps):
        if index == warmup and device.type == "cuda":
            # The first steps' peak apart: cuDNN's algorithm search and head.kernel=auto's
            # timing of both paths take memory that the steps after them do not.
            first_peak = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        synchronize(device)
        start = time.perf_counter()
        step(model, head, [(images, labels)], optimizer, precision, cfg.optim.grad_clip)
        synchronize(device)
        elapsed = time.perf_counter() - start
        if index < warmup:
            first_steps_s += elapsed
        else:
            times.append(elapsed)
    step_s = statistics.median(times)
    memory = steady = None
    if device.type == "cuda":
        steady = torch.cuda.max_memory_allocated(device)
        memory, steady = max(first_peak, steady) / 2**20, steady / 2**20
    # Counted after the steps: the first step is where head.kernel=auto times its two paths
    # (on a GPU), which must happen outside the counter's dispatch mode. FLOPs inside Triton
    # kernels (the head, when auto chose them) are not seen by the counter.
    flops = step_flops(backbone, head, precision, (images, labels))
    return {
        "images_per_s": batch_size / step_s,
        "step_ms": 1000 * step_s,
        "gflop_per_image": flops / batch_size / 1e9,
        "tflops": flops / step_s / 1e12,
        "warmup_s": first_steps_s,
        "gpu_memory_mib": memory,
        "steady_memory_mib": steady,  # the peak over the timed steps, after the first ones
        "cuda_graphs": getattr(step, "captures", 0),  # graphs captured (0: eager)
    }


def measure_end_to_end(
    cfg_name: str, data: Path, overrides: list[str], steps: int, out: Path
) -> dict[str, Any]:
    result = run_one(1, cfg_name, steps, max(1, steps // 5), [f"data.root={data}", *overrides], out)
    return {
        "images_per_s": result["samples_per_sec_median"],
        "gpu_memory_mib": result["peak_memory_mb_max"],
        "wall_s": result["wall_s"],
    }


def format_table(rows: list[dict[str, Any]], matmul: float) -> str:
    header = (
        f"{'backbone':<10} {'compile':>7} {'what':<36} {'images/s':>9} {'x model':>8} "
        f"{'TFLOP/s':>8} {'% mm':>6} {'mem MiB':>8}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        tflops = row.get("tflops")
        memory = row.get("gpu_memory_mib")
        ratio = row.get("x_model")
        lines.append(
            f"{row['backbone']:<10} {'on' if row['compile'] else 'off':>7} {row['what']:<36} "
            f"{row['images_per_s']:>9.1f} {'' if ratio is None else f'{ratio:.3f}':>8} "
            f"{'' if tflops is None else f'{tflops:.3g}':>8} "
            f"{'' if tflops is None else f'{100 * tflops / matmul:.1f}':>6} "
            f"{'' if memory is None else f'{memory:.0f}':>8}"
        )
    lines.append(f"matmul rate in this run: {matmul:.3g} TFLOP/s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="ms1m_arcface")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backbones", nargs="+", default=["iresnet50", "iresnet100"])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--image-size", type=int, default=112)
    parser.add_argument("--classes", type=int, default=93431)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true", help="compile off only")
    parser.add_argument("--compile-only", action="store_true", help="compile on only")
    parser.add_argument("--data", type=Path, nargs="*", default=[], help="end-to-end data sets")
    parser.add_argument("--workers", type=int, default=8, help="loader workers, cpu decode")
    parser.add_argument("--gpu-decode-workers", type=int, default=4, help="with gpu decode")
    parser.add_argument(
        "--decode", nargs="+", choices=["cpu", "gpu"], help="end-to-end data.decode values"
    )
    parser.add_argument("--e2e-steps", type=int, default=200)
    parser.add_argument("--json", type=Path)
    parser.add_argument("overrides", nargs="*", help="config overrides (after --)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    decodes = args.decode or (["cpu", "gpu"] if device.type == "cuda" else ["cpu"])
    rows: list[dict[str, Any]] = []
    matmul = None
    settings = [False] if args.no_compile else [True] if args.compile_only else [False, True]
    for backbone in args.backbones:
        for compiled in settings:
            overrides = [
                f"model.backbone={backbone}",
                f"train.batch_size={args.batch_size}",
                f"data.image_size={args.image_size}",
                f"train.compile={str(compiled).lower()}",
                f"train.device={device.type}",
                "eval.targets=[]",
                "eval.at_end=false",
                *args.overrides,
            ]
            cfg = load_config(args.config, overrides)
            if matmul is None:
                matmul = matmul_tflops(device, matmul_dtype(cfg, device))
            model = measure_model(cfg, device, args.classes, args.steps, args.warmup)
            base = {"backbone": backbone, "compile": compiled}
            rows.append({**base, "what": "model only", **model})
            print(format_table(rows, matmul), flush=True)
            for data in args.data:
                for decode in decodes:
                    workers = args.workers if decode == "cpu" else args.gpu_decode_workers
                    with tempfile.TemporaryDirectory() as scratch:
                        e2e = measure_end_to_end(
                            args.config,
                            data,
                            [*overrides, f"data.num_workers={workers}", f"data.decode={decode}"],
                            args.e2e_steps,
                            Path(scratch) / "run",
                        )
                    e2e["x_model"] = e2e["images_per_s"] / model["images_per_s"]
                    e2e.update(decode=decode, workers=workers)
                    what = f"e2e {data.name}: {decode} decode, {workers} w"
                    rows.append({**base, "what": what, **e2e})
    print(format_table(rows, matmul))
    if args.json is not None:
        args.json.write_text(
            json.dumps({"device": str(device), "matmul_tflops": matmul, "rows": rows}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
