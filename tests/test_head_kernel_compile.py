"""The head's Triton kernels compiled ahead of time for an H100 (sm_90), without a GPU.

benchmarks/head_kernel_resources.py compiles the launches that the host wrappers of
heads/kernels/ make, with Triton's own compiler and the ptxas it
ships, and reads what ptxas reports. Here: D = 512, fp32 weights, bf16 operands (the
head benchmark's settings) at the default tiles. Every kernel must fit the H100's shared
memory per block (232,448 bytes; more fails to launch with OutOfResources) and spill no
registers. The interpreter tests (test_head_triton.py) cannot see either.

It runs in a subprocess: this suite interprets the kernels (TRITON_INTERPRET=1, set by
conftest.py before triton is imported), and a process does one or the other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.head_kernel_resources import H100_SHARED_BYTES
from recognition.heads.tuning.tiles import FINISH_CANDIDATES

REPO_ROOT = Path(__file__).resolve().parent.parent

# Every launch the wrappers make: the backward's row epilogue with and without the
# partial-FC row index, plain or with the fused update (momentum, Nesterov, the target rows'
# share, the training step's gate, the rows' inverse norms and rounded copy kept current,
# the rate read from the device as a captured step hands it);
# the forward, keeping its logits (with one shift: bf16 operands) or not, the gradient of the
# logits recomputed, read each chunk's rows rounded (and gathered) beforehand: one variant
# each. With fp16 operands the forward keeps its logits with tile shifts, which a pass over
# them rescales (`scale_kept`): those two compiled too.
UPDATES = ["", " fused has_extra has_gate keep_norms",
           " fused has_momentum has_extra has_gate keep_norms keep_rows",
           " fused has_momentum nesterov has_extra has_gate keep_norms keep_rows",
           " fused has_momentum has_extra has_gate lr_in_memory keep_norms keep_rows",
           " fused has_momentum has_extra keep_norms"]  # fmt: skip
VARIANTS = [f"finish{index}{update}" for index in ("", " has_index") for update in UPDATES]
VARIANTS += ["forward bfloat16 rows", "grad_logits", "forward keep fixed bfloat16 rows"]
FP16_VARIANTS = ["forward keep float16 rows", "scale_kept"]


def test_default_tiles_compile_for_h100_within_its_limits(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    results = []
    # With bf16, the row epilogue also at every tile the tuner times (heads/tuning/tiles.py),
    # in its variants that hold the most: those must not spill either.
    runs = (("bfloat16", ["--finish-candidates"]), ("float16", ["--variants", *FP16_VARIANTS]))
    for dtype, only in runs:
        report = tmp_path / f"resources-{dtype}.json"
        command = [
            sys.executable, "-m", "benchmarks.head_kernel_resources", "--dims", "512",
            "--matmul-dtypes", dtype, "--json", str(report), *only,
        ]  # fmt: skip
        done = subprocess.run(
            command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
        )
        assert report.exists(), f"no report:\n{done.stdout}\n{done.stderr}"
        assert done.returncode == 0, done.stdout
        results += json.loads(report.read_text())
    # Each variant once at its default tiles; the two heaviest epilogues at each other tile
    # the tuner tries.
    heaviest = [v for v in VARIANTS if "nesterov" in v and "keep_rows" in v]
    assert len(heaviest) == 2
    expected = VARIANTS + FP16_VARIANTS + heaviest * (len(FINISH_CANDIDATES))
    assert sorted(r["variant"] for r in results) == sorted(expected)
    tiles = {r["tiles"] for r in results if r["variant"] in heaviest}
    assert len(tiles) == 1 + len(FINISH_CANDIDATES)
    for r in results:
        where = f"{r['variant']} ({r['tiles']}): {r}"
        assert r["shared_bytes"] <= H100_SHARED_BYTES, where
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, where
        assert 0 < r["registers"] <= 255, where
