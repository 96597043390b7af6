"""What every section of benchmarks/gpu_check.py records into: `SectionRun` (its machine,
deadline and rows, written after each one) and two formatting helpers."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    # When the row being measured began: the section's start, then each row's end.
    mark: float = field(default_factory=time.monotonic)

    @property
    def gpu(self) -> bool:
        return self.info["gpus"] > 0

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def add(self, what: str, result: str, *, target: str | None = None,
            met: bool | None = None, status: str = "ok", **data: Any) -> None:  # fmt: skip
        """Record one measurement (status ok, failed or skipped) and write the rows. Its
        wall_s is the time since the row before it (or the section's start): what the
        measurement took, its setup included."""
        now = time.monotonic()
        row = {"what": what, "result": result, "target": target, "met": met, "status": status}
        self.rows.append({**row, "wall_s": round(now - self.mark, 1), "data": data})
        self.mark = now
        self.flush()

    def skip(self, what: str, why: str) -> None:
        self.add(what, why, status="skipped")

    def fail(self, what: str, error: str, **data: Any) -> None:
        self.add(what, error, status="failed", **data)

    def flush(self) -> None:
        tmp = self.result_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rows": self.rows, "notes": self.notes}, indent=1, default=str))
        os.replace(tmp, self.result_path)


def first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:300]


def fmt(value: float | None, spec: str) -> str:
    """`value` formatted, or '-' (a loss is null when every step of a window was skipped)."""
    return "-" if value is None else format(value, spec)
