"""Each phase of a training step of the Triton head: milliseconds on a GPU beside the bytes and
matmul FLOPs that the traffic model gives (recognition/heads/traffic.py), and the bandwidth
and matmul rate they make.

    python -m benchmarks.head_phases                          # 1M classes, N 1024, D 512, bf16
    python -m benchmarks.head_phases --classes 10000000 --chunk-size 65536 --json phases.json
    python -m benchmarks.head_phases --device cpu --classes 512 --batch-size 32 \
        --embedding-size 32                                   # the model alone, no timing

One process, one GPU: the sharded head at W = 1 (benchmarks/head_methods.py's step, the
fused update unless --no-fused-update, the logits kept unless --chunk-size), --warmup steps,
then --steps steps under torch.profiler. A phase's time is the device time of the kernels
launched inside its profiler range ("head: forward", ... marked by the head's code:
`traffic.phase`), per step; "rest of the step" is the step's other device time (the
margin, the collectives' stand-ins, the optimizer's step without the fused update). On a
CPU nothing is timed (the kernels would run in Triton's interpreter): the rows hold the
model's bytes alone, which is what the GPU check's smoke run shows.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from benchmarks.head_methods import Case, build_step
from benchmarks.table import write_json
from recognition.heads import traffic


def model_phases(case: Case) -> list[traffic.Phase]:
    """The traffic model's phases of `case`'s step (bf16 operands under autocast, fp32 rows)."""
    matmul_bytes = 4 if case.autocast is None else 2
    shape = traffic.HeadShape(
        case.batch_size, case.embedding_size, case.num_classes, matmul_bytes, 4,
        keep_logits=case.method == "sharded", fused_update=case.fused_update,
        chunk=min(case.chunk_size or 65536, 65536),
        u_bytes=2 if case.autocast == "bfloat16" else 4,
        one_shift=case.autocast != "float16",  # ArcFace at s 64 (head_methods._margin)
    )  # fmt: skip
    return traffic.step_traffic(shape)


def measure_phases(case: Case) -> dict[str, float]:
    """Device milliseconds per step of each phase of `case` (and "rest of the step"), on a
    CUDA device."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(case.device)
    step, _ = build_step(case, 0, device)
    for _ in range(case.warmup):
        step()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(case.steps):
            step()
        torch.cuda.synchronize(device)
    return per_step_ms(prof.key_averages(), case.steps)


def per_step_ms(events, steps: int) -> dict[str, float]:
    """Device milliseconds per step of each phase and of the rest of the step, from the
    profiler's key averages `events` over `steps` steps.

    A kernel's time is in two events: the kernel's own (a device event) and the host event
    that launched it (a host event's device time is its kernels'); and a phase's
    record_function range is a host event (the kernels launched inside it) and, where the
    profiler records one, a device-side annotation of the same name (its span on the GPU).
    So a phase is its host range's device time, and the step is the device events' time, the
    annotations left out: each kernel once. (Every event summed, as the GPU check's runs on
    an H200 did, counts each kernel twice in the step and made the rest of it 19-26 ms.)"""
    from torch.autograd import DeviceType

    ms = {name: 0.0 for name in traffic.PHASES}
    kernels = 0.0
    for event in events:
        on_device = event.device_type != DeviceType.CPU
        if event.key.startswith(traffic.PREFIX):
            if not on_device:
                ms[event.key.removeprefix(traffic.PREFIX)] += event.device_time_total / 1e3
        elif on_device and not event.is_user_annotation:
            kernels += event.self_device_time_total / 1e3
    per_step = {name: value / steps for name, value in ms.items()}
    per_step["rest of the step"] = kernels / steps - sum(per_step.values())
    return per_step


def rows(case: Case, ms: dict[str, float] | None) -> list[dict]:
    """One row per phase: the model's bytes and FLOPs, the measured ms (None: not timed),
    and what they make (GB/s, TFLOP/s)."""
    out = []
    for phase in model_phases(case):
        row = {"phase": phase.name, **asdict(phase), "ms": None, "gb_per_s": None,
               "tflops": None}  # fmt: skip
        if ms is not None and ms.get(phase.name):
            seconds = ms[phase.name] / 1e3
            row.update(ms=ms[phase.name], gb_per_s=phase.bytes / seconds / 1e9,
                       tflops=phase.flops / seconds / 1e12)  # fmt: skip
        out.append(row)
    if ms is not None:
        out.append({"phase": "rest of the step", "ms": ms["rest of the step"]})
    return out


def _bytes(value: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def describe(row: dict) -> str:
    """A phase's row in words: '2.05 GB read, 1.02 GB written, 1.07 TFLOP; 3.10 ms, 992
    GB/s, 346 TFLOP/s' (the time and rates only where measured)."""
    if "bytes_read" not in row:
        return f"{row['ms']:.2f} ms"
    text = f"{_bytes(row['bytes_read'])} read, {_bytes(row['bytes_written'])} written"
    text += f", {row['flops'] / 1e12:.3g} TFLOP" if row["flops"] else ""
    if row["ms"] is None:
        return text + " (the model; time on a GPU only)"
    text += f"; {row['ms']:.2f} ms, {row['gb_per_s']:,.0f} GB/s"
    return text + (f", {row['tflops']:,.0f} TFLOP/s" if row["flops"] else "")


def section_rows(run, num_classes: int, batch: int, dim: int, autocast: str | None) -> None:
    """The GPU check's head section (benchmarks/gpu_sections.py, `run` its SectionRun): a row
    per phase of the step with the fused update and the logits kept at `num_classes`,
    measured in a process of its own on a GPU; under --smoke the model's rows alone."""
    from benchmarks.common import log_tail, run_command

    what = f"phase of triton + fused update, {num_classes:,} classes: "
    if run.gpu:
        if run.time_left() < 45:
            run.skip(what + "each", "no time left in the section")
            return
        out = run.scratch / "phases.json"
        command = [sys.executable, "-m", "benchmarks.head_phases", "--classes", str(num_classes),
                   "--batch-size", str(batch), "--embedding-size", str(dim), "--autocast",
                   autocast or "none", "--json", str(out)]  # fmt: skip
        log = run.scratch / "phases.log"
        # At most 2 minutes, and 30 s left for the section's search after it.
        code, timed_out = run_command(command, log, min(120.0, run.time_left() - 30))
        if code != 0 or not out.exists():
            why = "timed out" if timed_out else f"exit {code}: {' '.join(log_tail(log, 1))}"
            run.fail(what + "each", why)
            return
        result = json.loads(out.read_text())
    else:
        case = Case("sharded", 1, num_classes, batch, dim, None, 1, 0, 1, "cpu", autocast,
                    "triton", True)  # fmt: skip
        result = {"case": asdict(case), "rows": rows(case, None)}
    for row in result["rows"]:
        run.add(what + row["phase"], describe(row), **row)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--classes", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--embedding-size", type=int, default=512)
    parser.add_argument("--chunk-size", type=int, default=None, help="recompute the logits")
    parser.add_argument("--no-fused-update", action="store_true")
    parser.add_argument("--autocast", default="bfloat16", help="'none' for float32")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    case = Case(
        "sharded-chunked" if args.chunk_size else "sharded", 1, args.classes, args.batch_size,
        args.embedding_size, args.chunk_size, args.steps, args.warmup, 1, args.device,
        None if args.autocast == "none" else args.autocast, "triton", not args.no_fused_update,
    )  # fmt: skip
    result = {"case": asdict(case), "rows": rows(case, None if args.device == "cpu" else
                                               measure_phases(case))}  # fmt: skip
    for row in result["rows"]:
        print(f"{row['phase']:>18}: {describe(row)}")
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
