"""benchmarks/gpu_check.py: the section runner (time limits, process groups, partial rows),
the budget, the report, the pytest parser, and the whole script at --smoke on this CPU (so
that it cannot rot between GPU loans; about a minute on 2 cores)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import REPO, child_env

from benchmarks import gpu_check, gpu_sections

# ---- running a section --------------------------------------------------------------------


def fake_section(tmp_path: Path, body: str) -> list[str]:
    """A section process: writes one row to result.json, then runs `body` (no torch)."""
    script = tmp_path / "section.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json, os, subprocess, sys, time
            row = {{"what": "first", "result": "1 ms", "status": "ok"}}
            open({str(tmp_path / "result.json")!r}, "w").write(json.dumps({{"rows": [row]}}))
            print("measured the first row", flush=True)
            """
        )
        + textwrap.dedent(body)
    )
    return [sys.executable, str(script)]


def run_fake(tmp_path: Path, body: str, timeout_s: float) -> dict:
    command = fake_section(tmp_path, body)
    return gpu_check.run_section(
        command, tmp_path / "result.json", tmp_path / "section.log", timeout_s
    )


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie is dead, waiting for a parent to reap it


def test_a_section_that_hangs_is_killed_with_its_children_and_keeps_its_rows(tmp_path):
    body = f"""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open({str(tmp_path / "child.pid")!r}, "w").write(str(child.pid))
    time.sleep(60)
    """
    start = time.monotonic()
    result = run_fake(tmp_path, body, timeout_s=2.0)
    assert time.monotonic() - start < 15
    assert result["status"] == "timed out" and "2 s" in result["error"]
    assert [row["what"] for row in result["rows"]] == ["first"]
    child = int((tmp_path / "child.pid").read_text())
    for _ in range(50):  # the kill is immediate; reaping may take a moment
        if not alive(child):
            break
        time.sleep(0.1)
    assert not alive(child)


def test_a_section_that_crashes_fails_with_its_last_line_and_keeps_its_rows(tmp_path):
    result = run_fake(tmp_path, 'print("CUDA error: an illegal memory access"); sys.exit(3)', 30)
    assert result["status"] == "failed"
    assert result["error"] == "exit 3: CUDA error: an illegal memory access"
    assert result["rows"][0]["what"] == "first"
    assert result["log_tail"][-2:] == [
        "measured the first row",
        "CUDA error: an illegal memory access",
    ]


def test_a_section_with_a_failed_row_fails_and_one_without_is_ok(tmp_path):
    body = f"""
    rows = [row, {{"what": "second", "result": "OOM", "status": "failed"}}]
    open({str(tmp_path / "result.json")!r}, "w").write(json.dumps({{"rows": rows}}))
    """
    assert run_fake(tmp_path, body, 30)["status"] == "failed"
    assert run_fake(tmp_path, "", 30)["status"] == "ok"


# ---- the budget and what runs --------------------------------------------------------------


def test_section_limits_leave_time_for_the_sections_after():
    assert gpu_check.section_timeout(150, 540, 3) == 150
    assert gpu_check.section_timeout(150, 100, 2) == 100 - 2 * gpu_check.FLOOR_S
    assert gpu_check.section_timeout(150, 20, 3) == 0
    # On one GPU (no multi-GPU section) the limits add up to the 9-minute budget.
    one_gpu = [s.limit_s for s in gpu_check.SECTIONS if s.gpus <= 1]
    assert sum(one_gpu) <= gpu_check.BUDGET_S <= 540


def test_the_head_benchmark_draws_the_class_rows_on_its_device(monkeypatch):
    """On a GPU the rows are drawn there: 10M rows drawn by one CPU thread and copied over
    would take about a minute per case, and every try of the largest-class search. The
    meta device stands in for the GPU (the spy records where the rows are drawn)."""
    import torch

    import recognition.heads
    from benchmarks import head_methods as head

    drawn_on = []

    class Spy(recognition.heads.ShardedMarginSoftmax):
        def reset_parameters(self) -> None:
            drawn_on.append(self.weight.device)
            if self.weight.device.type == "cpu":
                super().reset_parameters()

    monkeypatch.setattr(recognition.heads, "ShardedMarginSoftmax", Spy)
    case = head.Case("sharded", 1, 1000, 8, 16, None, 1, 0, 1, "meta", None)
    head.build_step(case, 0, torch.device("meta"))
    assert drawn_on == [torch.device("meta")]


def test_the_budget_counts_the_probe_of_the_machine(monkeypatch, tmp_path):
    """The whole check fits the budget: the probe (a process that starts CUDA) is in it."""
    from types import SimpleNamespace

    clock = [1000.0]
    info = {"gpus": 0, "device": "cpu", "torch": "t", "triton": None, "cuda": None}

    def probe() -> dict:
        clock[0] += 30.0
        return info

    limits = {}

    def run_section(command, result_path, log_path, timeout_s, env=None):
        limits[command[command.index("--section") + 1]] = timeout_s
        return {"status": "ok", "rows": [], "notes": {}, "why": None, "error": None, "wall_s": 1}

    monkeypatch.setattr(gpu_check, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(gpu_check, "probe", probe)
    monkeypatch.setattr(gpu_check, "run_section", run_section)
    argv = ["--smoke", "--budget", "100", "--only", "head", "--json", str(tmp_path / "r.json")]
    assert gpu_check.main(argv) == 0
    assert limits == {"head": 70.0}


def test_sections_say_why_they_do_not_run():
    by_name = {s.name: s for s in gpu_check.SECTIONS}
    cpu, one, two = ({"gpus": n} for n in (0, 1, 2))
    assert gpu_check.skip_reason(by_name["tests"], cpu, True, None) == (
        "needs a CUDA device, this machine has 0"
    )
    assert gpu_check.skip_reason(by_name["multi_gpu"], one, False, None) == (
        "needs 2 CUDA devices, this machine has 1"
    )
    assert gpu_check.skip_reason(by_name["multi_gpu"], two, False, None) is None
    assert gpu_check.skip_reason(by_name["head"], cpu, True, None) is None
    assert gpu_check.skip_reason(by_name["head"], two, False, ["training"]) == (
        "not asked for (--only)"
    )


def test_without_cuda_it_asks_for_smoke(monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "probe", lambda: {"gpus": 0, "device": "cpu"})
    assert gpu_check.main([]) == 2
    assert "--smoke" in capsys.readouterr().err


def test_the_output_is_named_after_the_device(tmp_path):
    info = {"device": "NVIDIA H100 80GB HBM3"}
    path, md = gpu_check.output_paths(None, info, smoke=False)
    assert path == gpu_check.RESULTS / "gpu-nvidia-h100-80gb-hbm3.json" and md.suffix == ".md"
    assert gpu_check.output_paths(None, info, smoke=True)[0].name.endswith("-smoke.json")
    assert gpu_check.output_paths(tmp_path / "x.json", info, False)[0] == tmp_path / "x.json"


def test_the_table_has_a_row_per_measurement_and_says_why_a_section_is_missing():
    rows = [
        {"what": "triton, 1,000,000 classes", "result": "61 % of mm", "target": ">= 50 % of mm",
         "met": True, "status": "ok"},
        {"what": "torch, 1,000,000 classes", "result": "a|b", "target": None, "met": None,
         "status": "ok"},
        {"what": "largest", "result": "15,000,000", "target": ">= 16,000,000", "met": False,
         "status": "ok"},
    ]  # fmt: skip
    sections = {name: gpu_check.skipped(f"why {name}") for name in gpu_check.NAMES}
    sections["head"] = {"status": "ok", "rows": rows, "error": None}
    sections["training"] = {"status": "timed out", "rows": [], "error": "killed at 100 s"}
    info = {"device": "NVIDIA H100", "gpus": 1, "torch": "2.11", "triton": "3.6", "cuda": "12.8"}
    report = {"machine": info, "smoke": False, "started": "now", "wall_s": 500, "budget_s": 540}
    table = gpu_check.markdown({**report, "sections": sections}).splitlines()
    body = [line for line in table if line.startswith("| ") and not line.startswith("| section")]
    assert body == [
        "| tests | - | why tests | | skipped |",
        "| head | triton, 1,000,000 classes | 61 % of mm | >= 50 % of mm | met |",
        "| head | torch, 1,000,000 classes | a\\|b |  | ok |",
        "| head | largest | 15,000,000 | >= 16,000,000 | missed |",
        "| throughput | - | why throughput | | skipped |",
        "| multi_gpu | - | why multi_gpu | | skipped |",
        "| training | (section) | killed at 100 s | | timed out |",
    ]


PYTEST_OUTPUT = """\
tests/test_engine.py::test_training_on_cuda_follows_the_cpu_run PASSED            [ 14%]
tests/test_host_sync.py::test_steady_state_steps_do_not_sync_on_cuda[O1-bf16-clip-sgd] FAILED [ 28%]
tests/test_gpu_decode.py::test_nvjpeg_batches_match_the_cpu_path_within_tolerance SKIPPED [ 42%]
tests/test_head_triton_cuda.py::test_triton_head_compiled_on_cuda_matches_references
=========================== short test summary info ============================
FAILED tests/test_host_sync.py::test_steady_state_steps_do_not_sync_on_cuda[O1-bf16-clip-sgd] - RuntimeError: called a synchronizing CUDA operation
"""  # noqa: E501


def test_pytest_output_gives_each_finished_test_its_outcome_and_reason():
    assert gpu_sections.parse_pytest(PYTEST_OUTPUT) == [
        {"test": "tests/test_engine.py::test_training_on_cuda_follows_the_cpu_run",
         "outcome": "PASSED", "reason": ""},
        {"test": "tests/test_host_sync.py::test_steady_state_steps_do_not_sync_on_cuda"
                 "[O1-bf16-clip-sgd]",
         "outcome": "FAILED", "reason": "RuntimeError: called a synchronizing CUDA operation"},
        {"test": "tests/test_gpu_decode.py::"
                 "test_nvjpeg_batches_match_the_cpu_path_within_tolerance",
         "outcome": "SKIPPED", "reason": ""},
    ]  # fmt: skip


# ---- the whole script on this CPU --------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "smoke.json"
    env = dict(child_env(), CUDA_VISIBLE_DEVICES="")  # the CPU, on a GPU machine too
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--smoke", "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return done, out


def rows_of(report: dict, section: str) -> dict[str, dict]:
    return {row["what"]: row for row in report["sections"][section]["rows"]}


def test_smoke_runs_every_section_or_says_why_not(smoke):
    done, out = smoke
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert list(report["sections"]) == list(gpu_check.NAMES)
    assert report["smoke"] and report["machine"]["gpus"] == 0
    statuses = {name: s["status"] for name, s in report["sections"].items()}
    assert statuses == {"tests": "skipped", "head": "ok", "throughput": "ok",
                        "multi_gpu": "skipped", "training": "ok"}  # fmt: skip
    assert "needs a CUDA device" in report["sections"]["tests"]["why"]
    assert "needs 2 CUDA devices" in report["sections"]["multi_gpu"]["why"]
    table = out.with_suffix(".md").read_text()
    assert table in done.stdout
    for name in gpu_check.NAMES:
        assert f"| {name} |" in table


def test_smoke_measures_the_head_the_throughput_and_a_training_run(smoke):
    report = json.loads(smoke[1].read_text())
    head = rows_of(report, "head")
    for label in ("triton", "torch", "triton + fused update", "triton, fused backward"):
        row = head[f"{label}, 512 classes"]
        assert row["status"] == "ok" and row["data"]["ms_per_step"] > 0, row
        assert row["data"]["case"]["kernel"] == ("torch" if label == "torch" else "triton")
        assert row["data"]["case"]["backward"] == ("fused" if "backward" in label else "gemm")
    assert head["largest class count, fused update"]["status"] == "skipped"
    throughput = rows_of(report, "throughput")
    model_rate = throughput["model only, eager"]["data"]["images_per_s"]
    cpu = throughput["end to end, data.decode=cpu"]["data"]
    assert model_rate > 0 and cpu["images_per_s"] > 0
    assert cpu["x_model"] == pytest.approx(cpu["images_per_s"] / model_rate)
    assert throughput["end to end, data.decode=gpu"]["status"] == "skipped"
    memory_plan = throughput["memory plan of the eager step"]
    assert memory_plan["status"] == "skipped" and "on a GPU only" in memory_plan["result"]
    # At least the backbone's fp32 parameters and their gradients (1/8-width IResNet-18).
    assert memory_plan["data"]["planned_bytes"] > 2 * 4 * 100_000
    [run, auto] = report["sections"]["training"]["rows"]
    # 40 pairs: the accuracy is a whole number of pairs, and the run logged its 4 steps.
    assert run["data"]["steps"] == 4 and (40 * run["data"]["accuracy"]) % 1 == 0
    assert auto["result"].startswith("torch (")


def planned_run(tmp_path: Path) -> tuple[gpu_sections.SectionRun, gpu_sections.ThroughputPlan]:
    """A section run on a (stated) GPU machine, and the smoke's tiny throughput config."""
    info = {"gpus": 1, "device": "GPU", "cpus": 2, "memory_bytes": 80 * 2**30}
    run = gpu_sections.SectionRun("throughput", False, info, time.monotonic() + 60,
                                  tmp_path / "rows.json")  # fmt: skip
    smoke = gpu_sections.SectionRun("throughput", True, {"gpus": 0}, 0.0, tmp_path / "x.json")
    return run, gpu_sections.throughput_plan(smoke)


@pytest.mark.parametrize("measured_over_planned, met", [(1.04, True), (0.93, True), (1.15, False)])
def test_the_memory_plan_row_holds_the_measured_peak_to_10_percent(
    tmp_path, measured_over_planned, met
):
    from recognition.config import load_config
    from recognition.training.plan import plan_run

    run, plan = planned_run(tmp_path)
    base = [*plan.overrides, "train.device=cuda", "eval.targets=[]", "eval.at_end=false"]
    cfg = load_config(plan.config, [*base, "train.compile=false", "head.kernel=torch"])
    planned = plan_run(cfg, plan.identities, 1).worst.peak
    measured_mib = measured_over_planned * planned / 2**20
    gpu_sections._plan_row(run, plan, base, {"steady_memory_mib": measured_mib})
    [row] = run.rows
    assert row["what"] == "memory plan of the eager step" and row["status"] == "ok"
    assert row["target"] == "within 10 %" and row["met"] is met
    assert row["data"]["ratio"] == pytest.approx(measured_over_planned)
    assert f"x{measured_over_planned:.3f}" in row["result"]
    assert json.loads(run.result_path.read_text())["rows"][0]["met"] is met


def test_a_plan_that_fails_is_a_failed_row_and_the_section_goes_on(tmp_path):
    run, plan = planned_run(tmp_path)
    gpu_sections._plan_row(run, plan, ["model.backbone=no_such_net"], {"steady_memory_mib": 1})
    [row] = run.rows
    assert row["status"] == "failed" and "no_such_net" in row["result"], row


def test_a_failed_test_keeps_its_reason_however_long_its_id(tmp_path):
    # Without a terminal pytest's width is 80 columns, and it drops a failure's message from
    # the short summary when the id fills that: the first GPU check's rows said "failed"
    # and nothing more. Run as the tests section runs pytest.
    name = "test_" + "a_name_as_long_as_the_suites_longest_ones_" * 2
    (tmp_path / "test_long.py").write_text(f"def {name}():\n    assert 1 + 1 == 3\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider",
         str(tmp_path / "test_long.py")],
        capture_output=True, text=True, env=gpu_sections.pytest_env(), cwd=tmp_path,
    )  # fmt: skip
    [test] = gpu_sections.parse_pytest(done.stdout)
    assert test["outcome"] == "FAILED"
    assert test["reason"] == "assert (1 + 1) == 3"
