"""What several benchmarks share: the repository's root, and a command run in a process
group of its own under a time limit, its output in a log file (`run_command`, `log_tail`)."""

from __future__ import annotations

import os
import signal
import subprocess
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


def log_tail(log_path: Path, lines: int = 25) -> list[str]:
    """The last `lines` non-blank lines of `log_path` (none if it cannot be read)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]
