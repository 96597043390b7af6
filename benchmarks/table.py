"""Fixed-width text tables for the benchmarks' console output."""

from __future__ import annotations

from collections.abc import Sequence


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
