"""What every evaluation prints and writes: its console table and its JSON file.

The tables of verification, re-id and IJB share one layout (:func:`text_table`); their
results go to JSON atomically (:func:`write_json`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)


def text_table(rows: Sequence[Sequence[str]]) -> str:
    """``rows`` (a header first) as aligned columns two spaces apart, a rule under the header.

    The first column (names) is left-aligned, the others (numbers) right-aligned so that
    their decimal points line up; trailing blanks are dropped.
    """
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]

    def render(row: Sequence[str]) -> str:
        cells = [row[0].ljust(widths[0])]
        cells += [v.rjust(w) for v, w in zip(row[1:], widths[1:], strict=True)]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([render(rows[0]), rule] + [render(row) for row in rows[1:]])


def write_json(path: Path, payload: object) -> None:
    """Write ``payload`` as indented JSON, atomically (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)


def print_report(table: str, payload: object, json_path: Path | None = None) -> str:
    """Print ``table``; with ``json_path``, write ``payload`` there as JSON. Returns ``table``."""
    print(table, flush=True)
    if json_path is not None:
        write_json(json_path, payload)
        log.info("wrote %s", json_path)
    return table
