"""What several benchmarks share: the repository's root, a command run in a process group
of its own under a time limit, its output in a log file (`run_command`, `log_tail`), and
the seconds a `train.py` process took to end after its last line (`exit_after_last_line`),
a backbone's verification accuracy on a folder's pairs (`verify_pairs`)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def run_command(
    command: list[str], log_path: Path, timeout_s: float, env: dict[str, str] | None = None
) -> tuple[int | None, bool]:
    """Run `command` from the repository root in a process group of its own, its output into
    `log_path`; kill the whole group after `timeout_s`. Returns (exit code or None, timed out)."""
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            return process.wait(timeout=max(timeout_s, 0.1)), False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the section and whatever it started
            process.wait()
            return None, True


def verify_pairs(checkpoint: Path, folder: Path, out: Path, timeout_s: float, *extra: str) -> float:
    """Verification accuracy of `checkpoint` on `folder`'s pairs.txt (its images under it) by
    `evaluate.py`, its JSON to `out` and its log beside it; `extra` flags added (e.g.
    "--workers", "0"). Raises RuntimeError with the log's tail when it fails."""
    command = [sys.executable, str(REPO_ROOT / "evaluate.py"), "--checkpoint", str(checkpoint),
               "--pairs", str(folder / "pairs.txt"), "--images", str(folder), "--json", str(out),
               *extra]  # fmt: skip
    code, timed_out = run_command(command, out.with_suffix(".log"), timeout_s)
    if code != 0 or timed_out:
        raise RuntimeError("\n".join(log_tail(out.with_suffix(".log"))))
    return float(json.loads(out.read_text())["accuracy"])


def log_tail(log_path: Path, lines: int = 25) -> list[str]:
    """The last `lines` non-blank lines of `log_path` (none if it cannot be read)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]


_EXIT_LINE = re.compile(r"exiting with status \d+, ([0-9.]+) s after train\.py started")


def exit_after_last_line(output: str, wall_s: float) -> float | None:
    """Seconds from train.py's last line (`exiting with status S, T s after train.py
    started`) to the end of its process, which ran `wall_s`: the interpreter's start and
    teardown (a loader whose workers outlive the run shows here); None without the line."""
    found = _EXIT_LINE.findall(output)
    return None if not found else max(0.0, wall_s - float(found[-1]))


def train_run(out: Path, overrides: list[str], timeout_s: float | None) -> float:
    """`python train.py` with `overrides` into `out` (its log beside it, `out`.log); the wall
    seconds it took. Raises RuntimeError with the log's tail when it fails or times out."""
    log = out.parent / f"{out.name}.log"
    command = [sys.executable, str(REPO_ROOT / "train.py"), f"output_dir={out}", *overrides]
    start = time.perf_counter()
    code, timed_out = run_command(command, log, timeout_s)
    if code != 0 or timed_out:
        tail = "\n".join(log_tail(log))
        raise RuntimeError(f"{' '.join(command)} failed ({code}, timed out {timed_out}):\n{tail}")
    return time.perf_counter() - start
