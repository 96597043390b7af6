"""The sections of benchmarks/gpu_check.py, each run in a process of its own.

Every section measures with the project's benchmarks and entry points - `pytest`,
benchmarks/head.py (`run_case`, `largest_class_count`), benchmarks/train_throughput.py
(`measure_model`, `measure_end_to_end`), benchmarks/train_scaling.py (`run_one`),
`train.py` - and records rows as it goes (`SectionRun.add`): what was measured, the result
in words, the target where the issue sets one and whether it is met, and the numbers.
The rows are written to the section's JSON file after each one, so that the runner keeps
them if the section is killed at its time limit. A measurement that needs more time than
the section has left is skipped with a row that says so; one that fails gets a row with
its error, and the section goes on.

--smoke (no CUDA device): the same code at tiny sizes on the CPU; rows that need CUDA are
skipped with why.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, exit_after_last_line, log_tail, run_command
from benchmarks.gpu_section_run import GIB, MARGIN_S, SectionRun, first_line, fmt
from benchmarks.gpu_throughput import section_throughput


def run(name: str, result_path: Path, limit_s: float, info: dict, smoke: bool) -> int:
    """Run section `name` with `limit_s` seconds (the runner kills it then)."""
    section = SectionRun(name, smoke, info, time.monotonic() + limit_s - MARGIN_S, result_path)
    section.flush()
    with tempfile.TemporaryDirectory(prefix=f"gpu_check_{name}_") as scratch:
        section.scratch = Path(scratch)
        SECTIONS[name](section)
    return 0


# ---------------------------------------------------------------- 1. the suite's CUDA tests

_VERBOSE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_SUMMARY = re.compile(r"^(FAILED|ERROR) (\S+::\S+)(?: - (.*))?$")
_BLOCK = re.compile(r"^_{3,} (?:ERROR at \w+ of )?(\S+) _{3,}$")  # a failure's report
_DETAIL_LINES = 6


def parse_pytest(output: str) -> list[dict[str, Any]]:
    """Each test of `pytest -v -rfE` output, in order: {"test", "outcome", "reason",
    "details"} (the reason of a failure from the short summary; the details, its report's
    first `E` lines: an assertion's values, which the summary's one line leaves out). Tests
    still running when it was cut off are not in it."""
    tests: dict[str, dict[str, Any]] = {}
    details: dict[str, list[str]] = {}
    block = None
    for line in output.splitlines():
        if match := _VERBOSE.match(line):
            tests.setdefault(
                match[1], {"test": match[1], "outcome": match[2], "reason": "", "details": []}
            )
        elif (match := _SUMMARY.match(line)) and match[2] in tests:
            tests[match[2]]["reason"] = match[3] or ""
        elif match := _BLOCK.match(line):
            block = details.setdefault(match[1], [])
        elif block is not None and line.startswith("E ") and line[1:].strip():
            block.append(line[1:].strip())
    for test in tests.values():  # a report is headed by the id's last part
        name = test["test"].rsplit("::", 1)[-1]
        test["details"] = details.get(name, [])[:_DETAIL_LINES]
    return list(tests.values())


# Run first, in case the time runs out: steady state without syncs, the compiled head.
FIRST_TEST_FILES = ("tests/test_host_sync.py", "tests/test_head_triton_cuda.py")


def test_files() -> list[str]:
    """Every test file, FIRST_TEST_FILES first (pytest runs them in the order given)."""
    files = sorted(f"tests/{p.name}" for p in (REPO_ROOT / "tests").glob("test_*.py"))
    first = [f for f in FIRST_TEST_FILES if f in files]
    return first + [f for f in files if f not in first]


def pytest_env() -> dict[str, str]:
    """The environment the CUDA tests run in: conftest.py makes `auto` the GPU inside them;
    the interpreter setting is conftest's own."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["RECOGNITION_AUTO_DEVICE"] = "cuda"
    # Wide enough for the short summary's reasons: pytest drops a failure's message when
    # the test id alone fills the terminal's width, 80 columns without a terminal.
    env["COLUMNS"] = "400"
    return env


def section_tests(run: SectionRun) -> None:
    log = run.scratch / "pytest.log"
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-v", "-rfE", "-p",
               "no:cacheprovider", *test_files()]  # fmt: skip
    env = pytest_env()
    start = time.monotonic()
    code, timed_out = run_command(command, log, run.time_left() - 2, env)
    results = parse_pytest(log.read_text(errors="replace"))
    run.notes.update(wall_s=round(time.monotonic() - start, 1), exit=code, timed_out=timed_out)
    for test in results:
        outcome = test["outcome"].lower()
        passed = outcome in ("passed", "xfail")
        status = "skipped" if outcome == "skipped" else "ok" if passed else "failed"
        result = outcome + (f": {test['reason']}" if test["reason"] else "")
        if not passed and test["details"][1:]:  # the lines after the summary's
            result += " / " + " / ".join(test["details"][1:])
        run.add(test["test"].removeprefix("tests/"), result, target="passes",
                met=None if status == "skipped" else passed, status=status,
                details=test["details"])  # fmt: skip
    if timed_out:
        run.fail("(the rest)", "pytest ran out of time; the tests after these did not run")
    elif not results:
        run.fail("pytest -m cuda", f"no test ran (exit {code}): {' / '.join(log_tail(log, 3))}")
    elif code not in (0, None) and all(t["outcome"] != "FAILED" for t in results):
        run.fail("pytest -m cuda", f"exit {code}: {' / '.join(log_tail(log, 3))}")


# ---------------------------------------------------------------- 2. the head


@dataclass(frozen=True)
class HeadPlan:
    classes: tuple[int, ...]
    batch: int
    dim: int
    chunk: int
    steps: int
    autocast: str | None


def head_plan(run: SectionRun) -> HeadPlan:
    if run.smoke:
        return HeadPlan((512,), 32, 32, 128, 1, "bfloat16" if run.gpu else None)
    return HeadPlan((1_000_000, 10_000_000), 1024, 512, 65_536, 5, "bfloat16")


# Kept back for each head case still to come: a case's time grows with its class count
# (drawing the rows, the steps, the matmul it is compared with). Measured on an H200: 10.4
# to 16.5 s a case at 10M classes, the process's start and the first tuning included.
CASE_RESERVE_S = 4.0
CASE_RESERVE_PER_MILLION_S = 1.2
# Kept back for the rows after the cases: the phase rows start with 45 s left (they took 13 s
# on the H200) and leave the search of the largest class count the rest (35 s there).
TAIL_RESERVE_S = 45.0
MIN_CASE_S = 10.0


def case_reserve(num_classes: int) -> float:
    """Seconds kept back for a head case of `num_classes` still to come."""
    return CASE_RESERVE_S + CASE_RESERVE_PER_MILLION_S * num_classes / 1e6


def case_budget(left_s: float, later_cases_s: float, tail_s: float) -> float | None:
    """A head case's seconds, `left_s` left in the section: what the cases after it
    (`later_cases_s` kept back for them) and the rows after the cases (`tail_s`) do not need,
    or, where that is under MIN_CASE_S, what the rows after the cases do not need: the cases
    run most valuable first, so a later case gives up its time before this one does (the
    H200's check skipped every 1M case to keep 10M cases' time it never needed). None: too
    little for any case."""
    budget = left_s - later_cases_s - tail_s
    if budget < MIN_CASE_S:
        budget = left_s - tail_s
    return budget if budget >= MIN_CASE_S else None


HEAD_VARIANTS = (  # most valuable first (a section short of time skips the last): the
    # fused update (the training step's head, the one with targets at 1M and 10M), the Triton
    # kernel, torch (the speed-ups' reference), the fused update recomputing its logits in
    # chunks (head.chunk_size: whether keeping them pays at each class count) and the fused
    # update's step captured in a CUDA graph (train.cuda_graphs' way: what the host's
    # launches, about 6 per chunk, cost it)
    ("triton + fused update", "sharded", True),
    ("triton", "sharded", False),
    ("torch", "sharded-chunked", False),
    ("triton + fused update, recomputed", "sharded-chunked", True),
    ("triton + fused update, captured", "sharded", True),
)


def section_head(run: SectionRun) -> None:
    from benchmarks import head

    plan = head_plan(run)
    device = "cuda" if run.gpu else "cpu"
    torch_ms: dict[int, float] = {}
    cases = [(c, v) for c in plan.classes for v in HEAD_VARIANTS]
    for index, (num_classes, (label, method, fused)) in enumerate(cases):
        kernel = "torch" if label == "torch" else "triton"
        captured = label.endswith("captured")
        case = head.Case(method, 1, num_classes, plan.batch, plan.dim, plan.chunk, plan.steps,
                         1, 1, device, plan.autocast, kernel, fused, captured)  # fmt: skip
        what = f"{label}, {num_classes:,} classes"
        if captured and not run.gpu:
            run.skip(what, "on a GPU only (CUDA graphs)")
            continue
        # What is left, less a share kept for the cases after this one and for the phase rows
        # and the search (the first Triton case also times the kernels' tiles, once).
        later = sum(case_reserve(c) for c, _ in cases[index + 1 :])
        budget = case_budget(run.time_left(), later, 0 if run.smoke else TAIL_RESERVE_S)
        if budget is None:
            run.skip(what, "no time left in the section")
            continue
        result = head.run_case(case, budget)
        if "error" in result:
            run.fail(what, first_line(result["error"]))
            continue
        _head_row(run, head, case, result, label, torch_ms)
    from benchmarks import head_phases  # a row per phase of the step: ms and modelled bytes

    head_phases.section_rows(run, plan.classes[0], plan.batch, plan.dim, plan.autocast)
    if run.smoke:
        run.skip("largest class count, fused update", "on a GPU only (a CPU swaps, not fails)")
    else:
        _largest_head(run, head, plan)
    _tile_rows(run)


def _head_row(run: SectionRun, head, case, result: dict, label: str, torch_ms: dict) -> None:
    useful = head.useful_tflops(case, result)
    percent = 100 * useful / result["matmul_tflops"]
    ms = 1e3 * result["step_s"]
    text = (
        f"{ms:,.1f} ms/step, {percent:.0f} % of mm ({useful:,.1f} of "
        f"{result['matmul_tflops']:,.1f} TFLOP/s), peak {result['peak_bytes_max'] / GIB:,.2f} GiB"
    )
    if label == "torch":  # the Triton rows measured before it get their speed-up
        torch_ms[case.num_classes] = ms
        for row in run.rows:
            if row["data"].get("case", {}).get("num_classes") == case.num_classes:
                row["result"] += f", x{ms / row['data']['ms_per_step']:.2f} the torch path's speed"
                row["data"]["x_torch"] = ms / row["data"]["ms_per_step"]
    elif case.num_classes in torch_ms:
        text += f", x{torch_ms[case.num_classes] / ms:.2f} the torch path's speed"
    target = None if label == "torch" or run.smoke else ">= 50 % of mm"
    run.add(f"{label}, {case.num_classes:,} classes", text, target=target,
            met=None if target is None else percent >= 50, ms_per_step=ms,
            x_torch=torch_ms[case.num_classes] / ms if label != "torch" and case.num_classes
            in torch_ms else None,
            percent_of_matmul=percent, useful_tflops=useful,
            matmul_tflops=result["matmul_tflops"], peak_bytes=result["peak_bytes_max"],
            case={k: v for k, v in vars(case).items()})  # fmt: skip


def _largest_head(run: SectionRun, head, plan: HeadPlan) -> None:
    """The largest class count one GPU steps with the fused update (weight and momentum,
    8 bytes per class and dimension), to 2 %: a try at 85 % of the GPU's memory, whose
    measured peak predicts the boundary, then tries beside the prediction (3 in all where
    it holds; the H200's search took 8 tries, 90 s, by doubling and bisection), until the
    section's time runs out."""
    what = "largest class count, triton + fused update"
    if run.time_left() < 20:
        run.skip(what, "no time left in the section")
        return
    # The logits recomputed in chunks: kept, they would take N x C of the memory searched.
    case = head.Case("sharded-chunked", 1, 0, plan.batch, plan.dim, plan.chunk, 1, 0, 1, "cuda",
                     plan.autocast, "triton", True)  # fmt: skip
    start = int(0.85 * run.info["memory_bytes"] / (8 * plan.dim))
    deadline = time.monotonic() + run.time_left() - 8
    largest, tries = head.largest_class_count(
        case, 60.0, start, 0.02, deadline, memory_bytes=run.info["memory_bytes"]
    )
    failed = [t["classes_per_rank"] for t in tries if t["error"]]
    above = min((c for c in failed if c > largest), default=None)
    text = f"{largest:,} classes (D {plan.dim}, N {plan.batch}, {len(tries)} tries)"
    if above is None or above - largest > max(1, int(0.02 * largest)):
        text += ", search cut short by the time limit" + (f" (< {above:,})" if above else "")
    run.add(what, text, target=">= 16,000,000", met=largest >= 16_000_000,
            largest_classes=largest, tries=tries)  # fmt: skip


def _tile_rows(run: SectionRun) -> None:
    """The tiles the Triton kernels chose by timing on this GPU (the tuning cache)."""
    if not run.gpu:
        run.skip("tiles chosen by timing", "on a GPU only (the interpreter is not tuned)")
        return
    from recognition.heads.tuning.measure import TuningCache

    entries = [e for e in TuningCache().entries("tiles")
               if e["key"].get("device") == run.info["device"]]  # fmt: skip
    run.notes["tiles"] = entries
    for entry in entries:
        key, timings = entry["key"], entry["timings"]
        best = next(t for t in timings if t["tiles"] == entry["tiles"])
        table = timings[0]  # the table's tiles are the first candidate
        text = (
            f"{_tiles(entry['tiles'])}: {best['ms']:.3f} ms; the table's {_tiles(table['tiles'])}"
        )
        text += f": {table['ms']:.3f} ms" if table["ms"] is not None else ": did not run"
        what = f"tiles of {key['kernel']} (D {key['dim']}, N {key['rows']}, {key['operands']}"
        what += ", the fused update)" if key["kernel"] == "finish" else ")"
        run.add(what, text, chosen=entry["tiles"], timings=timings)


def _tiles(tiles: dict) -> str:
    """A kernel's tiles as heads/tuning/tiles.describe writes them (from the cache's dict)."""
    if "values" in tiles:  # the row epilogue's
        return f"{tiles['values']} values w{tiles['num_warps']}"
    return (f"{tiles['block_c']}x{tiles['block_n']}x{tiles['block_d']} w{tiles['num_warps']} "
            f"s{tiles['num_stages']}")  # fmt: skip


# ---------------------------------------------------------------- 4. two GPUs


def section_multi_gpu(run: SectionRun) -> None:
    from benchmarks.train_scaling import run_one

    common = ["data.image_size=112", "train.device=cuda"]
    runs = (("DDP with SyncBN, 2 GPUs", ["model.sync_bn=true"]),
            ("2-stage pipeline, 2 GPUs", ["model.pipeline_stages=2"]))  # fmt: skip
    for index, (what, extra) in enumerate(runs):
        if run.time_left() < 25:
            run.skip(what, "no time left in the section")
            continue
        try:
            result = run_one(2, "default", 100, 20, common + extra, run.scratch / f"run{index}")
        except RuntimeError as exc:
            run.fail(what, first_line(str(exc).splitlines()[-1] if str(exc) else "failed"))
            continue
        text = (f"{result['samples_per_sec_median']:,.0f} samples/s, loss "
                f"{fmt(result['final_loss'], '.3f')} at step {result['steps']}, peak "
                f"{result['peak_memory_mb_max']:,.0f} / {result['peak_memory_mb_min']:,.0f} MiB "
                f"per rank, {result['wall_s']:.0f} s")  # fmt: skip
        run.add(what, text, **result)


# ---------------------------------------------------------------- 5. a real training run


def training_overrides(run: SectionRun) -> list[str]:
    if not run.smoke:
        workers = min(8, run.info["cpus"] or 1)
        return ["data.image_size=112", "train.device=cuda", f"data.num_workers={workers}"]
    data = run.scratch / "synthetic"
    tiny = {"num_identities": 16, "images_per_identity": 4, "num_val_identities": 8,
            "val_images_per_identity": 4, "num_folds": 2, "pairs_per_fold": 10}  # fmt: skip
    return [
        f"data.synthetic.root={data}", f"data.root={data / 'train'}",
        *(f"data.synthetic.{k}={v}" for k, v in tiny.items()),
        f"eval.targets=[{{name: synthetic-val, pairs: {data / 'val' / 'pairs.txt'}}}]",
        "data.image_size=48", "train.max_steps=4", "train.batch_size=16", "data.num_workers=0",
        "train.log_every=2", f"train.device={'cuda' if run.gpu else 'cpu'}",
    ]  # fmt: skip


def section_training(run: SectionRun) -> None:
    out = run.scratch / "run"
    command = [sys.executable, "train.py", f"output_dir={out}", "train.progress=false",
               *training_overrides(run)]  # fmt: skip
    log = run.scratch / "train.out"
    start = time.monotonic()
    code, timed_out = run_command(command, log, run.time_left() - 1)
    wall = time.monotonic() - start
    what = "python train.py (default config, 112 px)" if not run.smoke else "python train.py"
    if timed_out or code != 0:
        error = "ran out of time" if timed_out else f"exit {code}"
        run.fail(what, f"{error}: {' / '.join(log_tail(log, 2))}", wall_s=wall)
        return
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    rates = [r["samples_per_sec"] for r in steps[1:]] or [steps[-1]["samples_per_sec"]]
    results = json.loads((out / "eval.json").read_text())
    name, result = next(iter(results.items()))
    accuracy = result["accuracy"]
    train_log = (out / "train.log").read_text(errors="replace")
    exit_s = exit_after_last_line(train_log, wall)
    text = (f"{name} accuracy {100 * accuracy:.2f} % (AUC {result['auc']:.4f}), loss "
            f"{fmt(steps[-1]['loss'], '.3f')} after {steps[-1]['step']} steps, "
            f"{statistics.median(rates):,.0f} samples/s, {wall:.0f} s")  # fmt: skip
    text += "" if exit_s is None else f" (exit {exit_s:.1f} s after its last line)"
    target = None if run.smoke else ">= 95 % (the CPU run at 48 px: 96.6 %)"
    run.add(what, text, target=target, met=None if target is None else accuracy >= 0.95,
            accuracy=accuracy, auc=result["auc"], steps=steps[-1]["step"],
            samples_per_sec=statistics.median(rates), wall_s=wall, exit_s=exit_s)  # fmt: skip
    marker = "head.kernel=auto: "
    lines = train_log.splitlines()
    auto = [line.split(marker, 1)[1] for line in lines if marker in line]
    if auto:
        run.add("head.kernel=auto chose", auto[0])


SECTIONS: dict[str, Callable[[SectionRun], None]] = {
    "tests": section_tests,
    "head": section_head,
    "training": section_training,
    "multi_gpu": section_multi_gpu,
    "throughput": section_throughput,
}
