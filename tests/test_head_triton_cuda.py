"""The head's Triton kernels compiled and run on a CUDA device (tests/triton_on_cuda.py).

That script runs in a process of its own: this suite interprets the kernels
(TRITON_INTERPRET=1, set by conftest.py), and triton reads that once, at import. On a CPU the
same script runs interpreted at small sizes, so that it cannot rot between GPU loans.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import REPO, child_env, needs_cuda

SCRIPT = Path(__file__).resolve().parent / "triton_on_cuda.py"
CPU_CHECKS = ["check_fp32", "check_bf16", "check_partial_fc", "check_fused_update",
              "check_deterministic"]  # fmt: skip


def run_script(device: str, interpret: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in child_env().items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--device", device],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


def test_the_gpu_script_runs_interpreted_on_the_cpu():
    done = run_script("cpu", interpret=True)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert [line.split(":")[0] for line in done.stdout.splitlines()] == CPU_CHECKS


@needs_cuda
def test_triton_head_compiled_on_cuda_matches_references():
    done = run_script("cuda", interpret=False)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert len(done.stdout.splitlines()) == len(CPU_CHECKS) + 3
