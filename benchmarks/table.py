"""The benchmarks' output: fixed-width text tables for the console, JSON results files."""

from __future__ import annotations

import datetime
import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def print_table(columns: Sequence[tuple[str, int]], rows: Sequence[Sequence[object]]) -> None:
    """Print a header, a rule and `rows` (cells already formatted, or anything str() takes).

    Each column is (title, width): a positive width right-aligns the cells (numbers), a
    negative one left-aligns them (names). A row may hold fewer cells than there are
    columns (an error message in place of the measurements): the last cell then runs on.
    """

    def line(cells: Sequence[object]) -> str:
        parts = []
        for (_, width), cell in zip(columns, cells, strict=False):
            text = str(cell)
            parts.append(text.ljust(-width) if width < 0 else text.rjust(width))
        return " ".join(parts).rstrip()

    header = line([title for title, _ in columns])
    print(header)
    print("-" * len(header))
    for row in rows:
        print(line(row))


def machine() -> dict[str, Any]:
    """When and where a benchmark ran: date, processor, usable CPUs."""
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(),
        "cpus_usable": len(os.sched_getaffinity(0)),
    }


def write_json(path: Path, payload: Any) -> None:
    """Write `payload` as indented JSON to `path` atomically (a temporary file, renamed)."""
    write_text(path, json.dumps(payload, indent=2) + "\n")


def write_results(path: Path, payload: Any, markdown: str) -> None:
    """`payload` as JSON to `path` and its table as Markdown beside it (`path` with .md)."""
    write_json(path, payload)
    write_text(path.with_suffix(".md"), markdown)


def write_text(path: Path, text: str) -> None:
    """Write `text` to `path` atomically (a temporary file, renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
