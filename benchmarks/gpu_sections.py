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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, log_tail, run_command

MARGIN_S = 3.0  # the runner kills the section at its limit: stop planning a bit before
GIB = 2**30


@dataclass
class SectionRun:
    """One section's run: what it knows (the machine, --smoke, its deadline, a scratch
    folder) and the rows it has measured, written to `result_path` after each one."""

    name: str
    smoke: bool
    info: dict[str, Any]
    deadline: float  # time.monotonic()
    result_path: Path
    scratch: Path = Path(".")
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def gpu(self) -> bool:
        return self.info["gpus"] > 0

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def add(self, what: str, result: str, *, target: str | None = None,
            met: bool | None = None, status: str = "ok", **data: Any) -> None:  # fmt: skip
        """Record one measurement (status ok, failed or skipped) and write the rows."""
        row = {"what": what, "result": result, "target": target, "met": met, "status": status}
        self.rows.append({**row, "data": data})
        self.flush()

    def skip(self, what: str, why: str) -> None:
        self.add(what, why, status="skipped")

    def fail(self, what: str, error: str, **data: Any) -> None:
        self.add(what, error, status="failed", **data)

    def flush(self) -> None:
        tmp = self.result_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rows": self.rows, "notes": self.notes}, indent=1, default=str))
        os.replace(tmp, self.result_path)


def run(name: str, result_path: Path, limit_s: float, info: dict, smoke: bool) -> int:
    """Run section `name` with `limit_s` seconds (the runner kills it then)."""
    section = SectionRun(name, smoke, info, time.monotonic() + limit_s - MARGIN_S, result_path)
    section.flush()
    with tempfile.TemporaryDirectory(prefix=f"gpu_check_{name}_") as scratch:
        section.scratch = Path(scratch)
        SECTIONS[name](section)
    return 0


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:300]


def _fmt(value: float | None, spec: str) -> str:
    """`value` formatted, or '-' (a loss is null when every step of a window was skipped)."""
    return "-" if value is None else format(value, spec)


# ---------------------------------------------------------------- 1. the suite's CUDA tests

_VERBOSE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_SUMMARY = re.compile(r"^(FAILED|ERROR) (\S+::\S+)(?: - (.*))?$")


def parse_pytest(output: str) -> list[dict[str, str]]:
    """Each test of `pytest -v -rfE` output, in order: {"test", "outcome", "reason"} (the
    reason of a failure from the short summary). Tests still running when it was cut off
    are not in it."""
    tests: dict[str, dict[str, str]] = {}
    for line in output.splitlines():
        if match := _VERBOSE.match(line):
            tests.setdefault(match[1], {"test": match[1], "outcome": match[2], "reason": ""})
        elif (match := _SUMMARY.match(line)) and match[2] in tests:
            tests[match[2]]["reason"] = match[3] or ""
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
        run.add(test["test"].removeprefix("tests/"), result, target="passes",
                met=None if status == "skipped" else passed, status=status)  # fmt: skip
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


CASE_RESERVE_S = 8.0  # kept back for each head case still to come
SEARCH_RESERVE_S = 30.0  # and for the search of the largest class count
HEAD_VARIANTS = (  # most valuable first: the Triton kernel, torch, the fused update
    ("triton", "sharded", False),
    ("torch", "sharded-chunked", False),
    ("triton + fused update", "sharded", True),
)


def section_head(run: SectionRun) -> None:
    from benchmarks import head

    plan = head_plan(run)
    device = "cuda" if run.gpu else "cpu"
    torch_ms: dict[int, float] = {}
    cases = [(c, v) for c in plan.classes for v in HEAD_VARIANTS]
    for index, (num_classes, (label, method, fused)) in enumerate(cases):
        kernel = "torch" if label == "torch" else "triton"
        case = head.Case(method, 1, num_classes, plan.batch, plan.dim, plan.chunk, plan.steps,
                         1, 1, device, plan.autocast, kernel, fused)  # fmt: skip
        what = f"{label}, {num_classes:,} classes"
        # What is left, less a share kept for the cases and the search after this one (the
        # first Triton case also times the kernels' tiles: tens of seconds, once).
        later = len(cases) - index - 1
        budget = run.time_left() - CASE_RESERVE_S * later - (0 if run.smoke else SEARCH_RESERVE_S)
        if budget < 10:
            run.skip(what, "no time left in the section")
            continue
        result = head.run_case(case, budget)
        if "error" in result:
            run.fail(what, _first_line(result["error"]))
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
    8 bytes per class and dimension): from 85 % of the GPU's memory, doubling then
    bisection to 2 %, until the section's time runs out."""
    what = "largest class count, triton + fused update"
    if run.time_left() < 20:
        run.skip(what, "no time left in the section")
        return
    # The logits recomputed in chunks: kept, they would take N x C of the memory searched.
    case = head.Case("sharded-chunked", 1, 0, plan.batch, plan.dim, plan.chunk, 1, 0, 1, "cuda",
                     plan.autocast, "triton", True)  # fmt: skip
    start = int(0.85 * run.info["memory_bytes"] / (8 * plan.dim))
    deadline = time.monotonic() + run.time_left() - 8
    largest, tries = head.largest_class_count(case, 60.0, start, 0.02, deadline)
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
    from recognition.heads import tuning

    entries = [e for e in tuning.TuningCache().entries("tiles")
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
        update = key.get("update", "none")
        what = f"tiles of {key['kernel']} (D {key['dim']}, N {key['rows']}, {key['operands']}"
        what += f", {update} update)" if update != "none" else ")"
        run.add(what, text, chosen=entry["tiles"], timings=timings)


def _tiles(tiles: dict) -> str:
    return (f"{tiles['block_c']}x{tiles['block_n']}x{tiles['block_d']} w{tiles['num_warps']} "
            f"s{tiles['num_stages']}")  # fmt: skip


# ---------------------------------------------------------------- 3. throughput


@dataclass(frozen=True)
class ThroughputPlan:
    config: str
    overrides: tuple[str, ...]
    identities: int
    per_identity: int
    image_size: int
    steps: int
    warmup: int
    e2e_steps: int


def throughput_plan(run: SectionRun) -> ThroughputPlan:
    if run.smoke:
        tiny = ("model.backbone=iresnet18", "model.width=0.125", "model.embedding_size=16",
                "train.batch_size=8", "data.image_size=32",
                "data.synthetic.enabled=false")  # fmt: skip
        return ThroughputPlan("default", tiny, 8, 4, 32, 3, 1, 4)
    full = ("model.backbone=iresnet50", "train.batch_size=256", "data.image_size=112",
            "data.channels_last=true", "precision.level=O1", "precision.dtype=bf16")  # fmt: skip
    return ThroughputPlan("ms1m_arcface", full, 512, 16, 112, 20, 5, 60)


def section_throughput(run: SectionRun) -> None:
    import torch

    from benchmarks import train_throughput
    from recognition.config import load_config
    from recognition.data.synthetic import SyntheticSpec, ensure_synthetic_dataset

    plan = throughput_plan(run)
    device = torch.device("cuda" if run.gpu else "cpu")
    spec = SyntheticSpec.training_set(plan.identities, plan.per_identity, plan.image_size)
    folder = ensure_synthetic_dataset(run.scratch / "jpegs", spec) / "train"
    base = [*plan.overrides, f"train.device={device.type}", "eval.targets=[]", "eval.at_end=false"]

    def config(compiled: bool):
        return load_config(plan.config, [*base, f"train.compile={str(compiled).lower()}"])

    cfg = config(False)
    matmul = train_throughput.matmul_tflops(device, train_throughput.matmul_dtype(cfg, device))
    run.notes["matmul_tflops"] = matmul
    model = train_throughput.measure_model(cfg, device, plan.identities, plan.steps, plan.warmup)
    _model_row(run, "model only, eager", model, matmul)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the end-to-end runs are processes of their own
    for decode in ("cpu", "gpu"):
        _end_to_end(run, plan, folder, base, decode, model["images_per_s"], train_throughput)
    _augment_row(run, cfg, device, model["images_per_s"])
    what = "model only, compiled"
    if run.smoke:
        run.skip(what, "on a GPU only (inductor takes minutes on a CPU)")
    elif run.time_left() < 60:
        run.skip(what, "no time left in the section (compiling takes about a minute)")
    else:
        compiled = train_throughput.measure_model(
            config(True), device, plan.identities, plan.steps, plan.warmup
        )
        _model_row(run, what, compiled, matmul)
    # Last: the plan takes seconds of CPU (IResNet-50 at batch 256: about 5 s).
    if run.time_left() < 15:
        run.skip("memory plan of the eager step", "no time left in the section")
    else:
        _plan_row(run, plan, base, model)


def _model_row(run: SectionRun, what: str, model: dict, matmul: float) -> None:
    percent = 100 * model["tflops"] / matmul
    text = f"{model['images_per_s']:,.0f} images/s, {model['tflops']:.1f} TFLOP/s "
    text += f"({percent:.0f} % of mm), first steps {model['warmup_s']:.1f} s"
    if model["gpu_memory_mib"] is not None:
        text += f", {model['gpu_memory_mib'] / 1024:.1f} GiB"
    target = None if run.smoke else ">= 5,000 images/s"
    run.add(what, text, target=target,
            met=None if target is None else model["images_per_s"] >= 5000,
            percent_of_matmul=percent, **model)  # fmt: skip


def _plan_row(run: SectionRun, plan: ThroughputPlan, base: list[str], model: dict) -> None:
    """The run planner (`train.py --plan`: fake tensors, no GPU) against the eager step just
    measured: its planned peak and torch.cuda.max_memory_allocated over the timed steps
    (the first steps apart: cuDNN's algorithm search and head.kernel=auto's timing). The
    plan counts what the caching allocator hands out, not cuDNN's workspaces taken
    through it, so the measurement may exceed it by those."""
    from recognition.config import load_config
    from recognition.training.plan import plan_run

    what = "memory plan of the eager step"
    try:
        # The torch head: the planner does not plan the Triton kernels (at these 512
        # classes the two paths' memory differs by the logits, a fraction of a MiB).
        cfg = load_config(plan.config, [*base, "train.compile=false", "head.kernel=torch"])
        planned = plan_run(cfg, plan.identities, 1).worst.peak
    except Exception as exc:  # noqa: BLE001 - a row, and the section goes on
        run.fail(what, _first_line(f"{type(exc).__name__}: {exc}"))
        return
    measured = model.get("steady_memory_mib")
    if measured is None:
        run.add(what, f"planned {planned / GIB:.2f} GiB; measured on a GPU only",
                status="skipped", planned_bytes=planned)  # fmt: skip
        return
    ratio = measured * 2**20 / planned
    text = f"planned {planned / GIB:.2f} GiB, measured {measured / 1024:.2f} GiB, x{ratio:.3f}"
    target = None if run.smoke else "within 10 %"
    run.add(what, text, target=target, met=None if target is None else abs(ratio - 1) <= 0.10,
            planned_bytes=planned, measured_bytes=int(measured * 2**20), ratio=ratio)  # fmt: skip


def _end_to_end(run: SectionRun, plan, folder: Path, base: list[str], decode: str,
                model_rate: float, train_throughput) -> None:  # fmt: skip
    what = f"end to end, data.decode={decode}"
    if decode == "gpu" and not run.gpu:
        run.skip(what, "needs a CUDA device (nvJPEG)")
        return
    if run.time_left() < (20 if run.smoke else 45):
        run.skip(what, "no time left in the section")
        return
    workers = 0 if run.smoke else min(8, run.info["cpus"] or 1) if decode == "cpu" else 4
    overrides = [*base, "train.compile=false", f"data.num_workers={workers}",
                 f"data.decode={decode}"]  # fmt: skip
    try:
        e2e = train_throughput.measure_end_to_end(
            plan.config, folder, overrides, plan.e2e_steps, run.scratch / f"e2e-{decode}"
        )
    except RuntimeError as exc:
        run.fail(what, _first_line(str(exc).splitlines()[-1] if str(exc) else "failed"))
        return
    ratio = e2e["images_per_s"] / model_rate
    text = (f"{e2e['images_per_s']:,.0f} images/s, x{ratio:.3f} model only, {workers} workers, "
            f"{e2e['wall_s']:.0f} s")  # fmt: skip
    target = None if run.smoke else "within 5 % of model only"
    run.add(what, text, target=target, met=None if target is None else ratio >= 0.95,
            x_model=ratio, workers=workers, **e2e)  # fmt: skip


def _augment_row(run: SectionRun, cfg, device, model_rate: float) -> None:
    """data.augment=face as data.decode=gpu applies it (`augment_batch`) to a batch of the
    run's size and input size on the device: images/s and the share of a model-only step it
    adds. The draws (the loader's workers' work) are not timed; the median of 5 after 2."""
    import torch

    from recognition.config import AugmentConfig
    from recognition.data.augment import draw_augment
    from recognition.data.augment_batch import augment_batch

    what = "augment on the device, data.augment=face"
    batch, size = cfg.train.batch_size, cfg.data.image_hw
    augment = AugmentConfig(preset="face")
    images = torch.rand(batch, 3, *size, device=device)
    seconds = []
    for rep in range(7):
        params = [draw_augment(augment, rep * batch + i, size) for i in range(batch)]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        augment_batch(images, params)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    rate = batch / statistics.median(seconds[2:])
    share = model_rate / rate  # the step's time, as a fraction of the model's
    text = f"{rate:,.0f} images/s, +{100 * share:.1f} % of a model-only step (batch {batch})"
    run.add(what, text, images_per_s=rate, share_of_model_step=share, batch=batch)


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
            run.fail(what, _first_line(str(exc).splitlines()[-1] if str(exc) else "failed"))
            continue
        text = (f"{result['samples_per_sec_median']:,.0f} samples/s, loss "
                f"{_fmt(result['final_loss'], '.3f')} at step {result['steps']}, peak "
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
    text = (f"{name} accuracy {100 * accuracy:.2f} % (AUC {result['auc']:.4f}), loss "
            f"{_fmt(steps[-1]['loss'], '.3f')} after {steps[-1]['step']} steps, "
            f"{statistics.median(rates):,.0f} samples/s, {wall:.0f} s")  # fmt: skip
    target = None if run.smoke else ">= 95 % (the CPU run at 48 px: 96.6 %)"
    run.add(what, text, target=target, met=None if target is None else accuracy >= 0.95,
            accuracy=accuracy, auc=result["auc"], steps=steps[-1]["step"],
            samples_per_sec=statistics.median(rates), wall_s=wall)  # fmt: skip
    marker = "head.kernel=auto: "
    lines = (out / "train.log").read_text().splitlines()
    auto = [line.split(marker, 1)[1] for line in lines if marker in line]
    if auto:
        run.add("head.kernel=auto chose", auto[0])


SECTIONS: dict[str, Callable[[SectionRun], None]] = {
    "tests": section_tests,
    "head": section_head,
    "throughput": section_throughput,
    "multi_gpu": section_multi_gpu,
    "training": section_training,
}
