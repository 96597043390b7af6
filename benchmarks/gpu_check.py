"""One command for everything a GPU must show, each part under its own time limit.

    python -m benchmarks.gpu_check                       # on a GPU machine: at most 9 minutes
    python -m benchmarks.gpu_check --json out.json       # write elsewhere
    python -m benchmarks.gpu_check --only head training  # some sections (the others: skipped)
    python -m benchmarks.gpu_check --smoke               # on a CPU: tiny sizes, about a minute

Sections, in the order they run (benchmarks/gpu_sections.py measures them, and
benchmarks/gpu_throughput.py the throughput; the slowest rows, the throughput section's
cold compiles, last):

1. tests       the suite's CUDA tests (`pytest -m cuda`: helpers.needs_cuda), `auto` meaning
               the GPU inside them, the steady-state steps under
               `torch.cuda.set_sync_debug_mode("error")` (tests/test_host_sync.py), the
               compiled Triton head against float64 and torch (tests/triton_on_cuda.py);
2. head        the sharded head at 1M and 10M classes, N 1024, D 512, bf16: torch, triton
               and triton with the fused update, ms per step, % of a same-size matmul, peak
               memory (benchmarks/head.py), the largest class count the fused update fits,
               and the tiles the kernels chose by timing;
3. training    `python train.py` of the default config at 112 px on the GPU, to its
               verification accuracy (and the kernel head.kernel=auto chose), and the
               seconds from its last line to its process's end;
4. multi_gpu   with 2 GPUs: a DDP run with SyncBN and a 2-stage pipeline run
               (benchmarks/train_scaling.py's run_one); skipped, and said so, on one;
5. throughput  IResNet-50, 112 px, batch 256, bf16, channels-last: model-only images/s eager,
               its memory plan, the aten operations of its step counted on the CPU
               (benchmarks/step_ops.py), the data.augment=face batch on the device
               (augment_batch) against the model's step, the step captured
               (train.cuda_graphs), compiled (whole, by blocks, captured, from a warm
               cache, reduce-overhead; each in a process of its own), end to end from a
               JPEG folder it generates with data.decode gpu and cpu, and MobileFaceNet
               mbf's, ViT vit_b's and O2's eager steps last (benchmarks/gpu_throughput.py).

Each section runs as `python -m benchmarks.gpu_check --section NAME` in a process group of
its own, killed at its time limit, so that a hang or a crashed CUDA context in one cannot
take the others down; the check goes on past a failure. A section writes its rows to a JSON
file after each measurement, so what it measured before a timeout or a crash is kept.

Time: the whole check gets --budget seconds (540: 9 minutes, a GPU loan's 10-minute command
limit less a margin). Each section has its own limit (SECTIONS); a section gets what is left
of the budget less the limits of the sections still to come, so that the time an earlier
section did not use is carried forward (the last section gets all that is left), and a
section left less than MIN_SECTION_S is skipped, with why. Inside, a section measures its
cheap rows before the slow ones and gives each the time it has left; the throughput
section, whose cold compiles are the slowest rows of all, runs last. On one H100 the limits
(tests 130 s, head 150 s, training 100 s, throughput 160 s) add up to the budget; two GPUs
add the multi-GPU section (90 s), and each section then starts from its share.

It writes `benchmarks/results/gpu-<device>.json` (--json elsewhere; a --smoke run
`gpu-<device>-smoke.json`) and a Markdown table beside it (`.md`), and prints the table.
Each row carries its wall time (`wall_s`); the machine's line carries the host's speed
(`host_dispatch_us`) and the commit. Before writing, it compares its rows with the report it
replaces (--baseline another): a row `vs last` per regression (benchmarks/gpu_compare.py).
Without a CUDA device it runs only with --smoke: the sections that need CUDA or 2 GPUs say
`skipped` and why; the others run at tiny sizes on the CPU (tests/test_gpu_check.py runs it
that way, so that it cannot rot between GPU loans).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import gpu_compare
from benchmarks.common import REPO_ROOT, log_tail, run_command
from benchmarks.table import write_json, write_text

RESULTS = REPO_ROOT / "benchmarks" / "results"

BUDGET_S = 540.0
SMOKE_BUDGET_S = 240.0
MIN_SECTION_S = 20.0  # a section with less than this left is skipped


@dataclass(frozen=True)
class Section:
    name: str
    title: str
    limit_s: float  # on a GPU
    smoke_limit_s: float
    gpus: int  # CUDA devices it needs: 0 runs on a CPU under --smoke


# The throughput section last: its slowest rows (cold compiles) are in it, and the last
# section gets all the time the others left.
SECTIONS = (
    Section("tests", "the suite's CUDA tests", 130.0, 60.0, 1),
    Section("head", "margin-softmax head", 150.0, 90.0, 0),
    Section("training", "default run at 112 px", 100.0, 60.0, 0),
    Section("multi_gpu", "2 GPUs: SyncBN, pipeline", 90.0, 60.0, 2),
    Section("throughput", "IResNet-50 images/s", 160.0, 90.0, 0),
)
NAMES = tuple(s.name for s in SECTIONS)


# ---------------------------------------------------------------- the machine


PROBE = """
import json, os, platform, statistics, time, torch
info = {"torch": torch.__version__, "python": platform.python_version(),
        "cuda": torch.version.cuda, "gpus": torch.cuda.device_count(), "cpus": os.cpu_count()}
# The host's speed at what bounds a step it enqueues: microseconds of one tiny CPU operation
# (dispatch and Python, no arithmetic to speak of), the median of 5 rounds of 2,000.
x = torch.zeros(4)
rounds = []
for _ in range(5):
    start = time.perf_counter()
    for _ in range(2000):
        torch.add(x, 1.0)
    rounds.append((time.perf_counter() - start) / 2000 * 1e6)
info["host_dispatch_us"] = round(statistics.median(rounds), 3)
try:
    import triton
    info["triton"] = triton.__version__
except ImportError:
    info["triton"] = None
if info["gpus"]:
    props = torch.cuda.get_device_properties(0)
    info.update(device=props.name, memory_bytes=props.total_memory,
                sms=props.multi_processor_count, capability=f"{props.major}.{props.minor}")
else:
    info.update(device="cpu", memory_bytes=None, sms=None, capability=None)
print(json.dumps(info))
"""


def probe() -> dict[str, Any]:
    """The machine, asked in a process of its own (this one never makes a CUDA context,
    which would hold memory through every section)."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


# ---------------------------------------------------------------- running a section


def run_section(
    command: list[str], result_path: Path, log_path: Path, timeout_s: float,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One section's process under its time limit: its rows (those written before a
    timeout or a crash included), and a status: ok, failed (a non-zero exit, or a row
    that failed) or timed out."""
    start = time.monotonic()
    code, timed_out = run_command(command, log_path, timeout_s, env)
    wall = time.monotonic() - start
    try:
        written = json.loads(result_path.read_text())
    except (OSError, ValueError):
        written = {}
    rows = written.get("rows", [])
    result: dict[str, Any] = {"limit_s": round(timeout_s, 1), "wall_s": round(wall, 1)}
    result.update(rows=rows, notes=written.get("notes", {}), why=None, error=None)
    if timed_out:
        result["status"] = "timed out"
        result["error"] = f"killed at its time limit, {timeout_s:.0f} s"
    elif code != 0:
        tail = log_tail(log_path)
        result["status"] = "failed"
        result["error"] = f"exit {code}: {tail[-1] if tail else 'no output'}"
    else:
        failed = any(row.get("status") == "failed" for row in rows)
        result["status"] = "failed" if failed else "ok"
    if result["status"] != "ok":
        result["log_tail"] = log_tail(log_path)
    return result


def skip_reason(section: Section, info: dict[str, Any], smoke: bool, only: list[str] | None):
    """Why `section` does not run on this machine, or None."""
    if only is not None and section.name not in only:
        return "not asked for (--only)"
    if section.gpus > info["gpus"]:
        have = info["gpus"]
        needed = "a CUDA device" if section.gpus == 1 else f"{section.gpus} CUDA devices"
        return f"needs {needed}, this machine has {have}"
    return None


def section_timeout(limit_s: float, left_s: float, later_limits: list[float]) -> float:
    """A section's time: what is left of the budget less the limits of the sections still
    to come, so that what an earlier section did not use is carried forward to this one
    (the last gets all that is left). When what is left is less than this limit and the
    later ones together, it gets its share of it in proportion to the limits."""
    reserved = sum(later_limits)
    if left_s >= limit_s + reserved:
        return left_s - reserved
    return max(0.0, left_s * limit_s / (limit_s + reserved))


def run_all(
    args: argparse.Namespace, info: dict[str, Any], scratch: Path, start: float | None = None
) -> dict[str, Any]:
    """Every section in order, each skipped, or run under its limit; returns them by name.
    The budget counts from `start` (time.monotonic(); None: now)."""
    budget = args.budget or (SMOKE_BUDGET_S if args.smoke else BUDGET_S)
    deadline = (time.monotonic() if start is None else start) + budget
    reasons = {s.name: skip_reason(s, info, args.smoke, args.only) for s in SECTIONS}
    results: dict[str, Any] = {}
    for index, section in enumerate(SECTIONS):
        if reasons[section.name] is not None:
            results[section.name] = skipped(reasons[section.name])
            continue
        later = [_limit(s, args.smoke) for s in SECTIONS[index + 1 :] if reasons[s.name] is None]
        timeout = section_timeout(_limit(section, args.smoke), deadline - time.monotonic(), later)
        if timeout < MIN_SECTION_S:
            results[section.name] = skipped(f"the {budget:.0f} s budget is spent")
            continue
        print(f"[{section.name}] {section.title}: up to {timeout:.0f} s ...", file=sys.stderr)
        result_path = scratch / f"{section.name}.json"
        command = [sys.executable, "-m", "benchmarks.gpu_check", "--section", section.name,
                   "--result", str(result_path), "--limit", f"{timeout:.1f}",
                   "--info", json.dumps(info)] + (["--smoke"] if args.smoke else [])  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        result = run_section(command, result_path, scratch / f"{section.name}.log", timeout, env)
        results[section.name] = result
        print(
            f"[{section.name}] {result['status']} in {result['wall_s']:.0f} s, "
            f"{len(result['rows'])} rows" + (f": {result['error']}" if result["error"] else ""),
            file=sys.stderr,
        )
    return results


def _limit(section: Section, smoke: bool) -> float:
    return section.smoke_limit_s if smoke else section.limit_s


def skipped(why: str) -> dict[str, Any]:
    return {"status": "skipped", "why": why, "rows": [], "notes": {}, "error": None}


# ---------------------------------------------------------------- the report


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown table: one row per measurement, one per section without any."""
    info = report["machine"]
    title = f"GPU check on {info['device']}"
    if info["gpus"]:
        title += f" ({info['gpus']} GPU{'s' if info['gpus'] > 1 else ''})"
    lines = [
        f"## {title}{' (smoke)' if report['smoke'] else ''}",
        "",
        f"torch {info['torch']}, triton {info['triton']}, CUDA {info['cuda']}; "
        f"{report['started']}, {report['wall_s']:.0f} s of a {report['budget_s']:.0f} s budget"
        + (f"; commit {report['commit']}" if report.get("commit") else "")
        + (f"; vs last: {report['comparison']['against']}" if report.get("comparison") else "")
        + ".",
        "",
        "| section | measurement | result | target | status |",
        "|---|---|---|---|---|",
    ]
    sections = [(name, report["sections"][name]) for name in NAMES]
    if report.get("comparison") is not None:
        sections.append(("vs last", report["comparison"]))
    for name, section in sections:
        for row in section["rows"]:
            status = row.get("status", "ok")
            if status == "ok" and row.get("met") is not None:
                status = "met" if row["met"] else "missed"
            cells = [name, row["what"], row["result"], row.get("target") or "", status]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        if section.get("status") == "skipped":
            lines.append(f"| {name} | - | {_cell(section['why'])} | | skipped |")
        elif section.get("status", "ok") != "ok" and section["error"]:
            lines.append(
                f"| {name} | (section) | {_cell(section['error'])} | | {section['status']} |"
            )
    return "\n".join(lines) + "\n"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def output_paths(json_arg: Path | None, info: dict[str, Any], smoke: bool) -> tuple[Path, Path]:
    path = json_arg or RESULTS / f"gpu-{slug(info['device'])}{'-smoke' if smoke else ''}.json"
    return path, path.with_suffix(".md")


def commit() -> str | None:
    """The checked-out commit (short hash, `+` when the tree has changes), or None where
    there is no git repository (a copied tree)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a CPU in a minute")
    parser.add_argument("--only", nargs="+", choices=NAMES, default=None, help="these sections")
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole check")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="compare with this report (default: the one --json replaces)",
    )
    parser.add_argument("--section", choices=NAMES, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--limit", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--info", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.section is not None:
        from benchmarks import gpu_sections

        return gpu_sections.run(args.section, args.result, args.limit, json.loads(args.info),
                                args.smoke)  # fmt: skip

    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    start = time.monotonic()
    info = probe()
    if not info["gpus"] and not args.smoke:
        print("error: no CUDA device here; on a CPU run `python -m benchmarks.gpu_check "
              "--smoke`, which checks the script at tiny sizes", file=sys.stderr)  # fmt: skip
        return 2
    json_path, md_path = output_paths(args.json, info, args.smoke)
    # Read before this run writes over it: the last committed results of this device.
    baseline_path = args.baseline or json_path
    baseline = gpu_compare.load_baseline(baseline_path)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as scratch:
        # From the check's start: the probe (a CUDA start, seconds) is part of the budget.
        sections = run_all(args, info, Path(scratch), start)
    report = {
        "machine": info,
        "smoke": args.smoke,
        "started": started,
        "commit": commit(),
        "budget_s": args.budget or (SMOKE_BUDGET_S if args.smoke else BUDGET_S),
        "wall_s": round(time.monotonic() - start, 1),
        "sections": sections,
        "comparison": None,
    }
    if baseline is not None:
        against = f"{baseline_path.name}" + (
            f" (commit {baseline['commit']})" if baseline.get("commit") else ""
        )
        rows = gpu_compare.compare(baseline, report)
        report["comparison"] = {"against": against, "rows": rows}
        regressed = sum(row["status"] == "regressed" for row in rows)
        print(f"[vs last] {regressed} regressions against {against}", file=sys.stderr)
    table = markdown(report)
    write_json(json_path, report)
    write_text(md_path, table)
    print(table)
    print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    # Non-zero when a section that ran failed or ran out of time (a skipped one is not).
    return int(any(s["status"] in ("failed", "timed out") for s in sections.values()))


if __name__ == "__main__":
    sys.exit(main())
