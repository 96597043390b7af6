"""The GPU check's results against the last committed ones: a row per regression.

`benchmarks/gpu_check.py` reads the committed `benchmarks/results/gpu-<device>.json` before
it writes its own over it, and `compare(baseline, report)` lists what got worse, row by row
(the same section and measurement in both): a rate or a share that fell, a time or a peak
that grew, beyond the tolerance of its kind (`METRICS`); a count that grew at all; a test
that passed and now does not; a row that was measured and now is not (failed, skipped, or
gone with its section). Each is a row of the table, status `regressed`, under the section
`vs last`; one row `ok` says when nothing regressed. When the two machines differ (the GPU,
torch, Triton, the CPU count, or the host's speed: `host_dispatch_us`, a tiny CPU operation's
cost, which bounds a step the host enqueues), a row says so first: a host twice as slow
makes every host-bound row (compiled, end to end, compile time) look like a regression.

The compiled IResNet-50 step fell from 6,384 to 4,219 images/s (first steps 47.3 -> 70.8 s)
between two H200 runs, with eager unchanged: this is the check that says it at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# data key -> (what it is called, higher is better, relative tolerance). A count has none.
METRICS: dict[str, tuple[str, bool, float]] = {
    "images_per_s": ("images/s", True, 0.05),
    "x_model": ("x model only", True, 0.03),
    "percent_of_matmul": ("% of mm", True, 0.05),
    "ms_per_step": ("ms/step", False, 0.05),
    "peak_bytes": ("peak bytes", False, 0.05),
    "gpu_memory_mib": ("GPU MiB", False, 0.05),
    "warmup_s": ("first steps s", False, 0.25),
    "largest_classes": ("classes", True, 0.05),
    "accuracy": ("accuracy", True, 0.01),
    "samples_per_sec": ("samples/s", True, 0.10),
    "wall_s": ("s", False, 0.25),
    "exit_s": ("s to exit", False, 1.0),
    "ops_per_step": ("aten ops/step", False, 0.0),
}
MACHINE_KEYS = ("device", "gpus", "torch", "triton", "cuda", "cpus")
HOST_TOLERANCE = 0.15  # host_dispatch_us apart by more than this: the hosts differ


def load_baseline(path: Path) -> dict[str, Any] | None:
    """The report at `path`, or None when there is none (or it cannot be read)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def compare(baseline: dict[str, Any], report: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows (what, result, target, status) for what regressed from `baseline` to `report`."""
    rows = machine_rows(baseline.get("machine", {}), report["machine"])
    regressions = []
    for section, old_section in baseline.get("sections", {}).items():
        new_section = report["sections"].get(section, {})
        new_rows = {row["what"]: row for row in new_section.get("rows", [])}
        for old in old_section.get("rows", []):
            if old.get("status", "ok") != "ok":
                continue  # nothing was measured then
            new = new_rows.get(old["what"])
            where = f"{section} / {old['what']}"
            if new is None or new.get("status", "ok") != "ok":
                why = "not in this run" if new is None else f"{new['status']}: {new['result']}"
                if new is None and new_section.get("status") not in (None, "ok"):
                    why = f"its section {new_section['status']}"
                    why += f": {new_section.get('error') or new_section.get('why')}"
                regressions.append(_row(where, f"measured before, now {why}", "still measured"))
                continue
            if old.get("met") is True and new.get("met") is False:
                result = f"{old['result']} -> {new['result']}"
                regressions.append(_row(where, result, old.get("target") or "met"))
                continue
            regressions.extend(_metric_rows(where, old.get("data", {}), new.get("data", {})))
    rows.extend(regressions)
    if not regressions:
        rows.append({"what": "every row measured before", "result": "none regressed",
                     "target": None, "met": None, "status": "ok"})  # fmt: skip
    return rows


def machine_rows(old: dict[str, Any], new: dict[str, Any]) -> list[dict[str, Any]]:
    """One row naming how the machines differ, when they do (none when they do not)."""
    differences = [f"{key} {old.get(key)} -> {new.get(key)}" for key in MACHINE_KEYS
                   if key in old and old.get(key) != new.get(key)]  # fmt: skip
    old_host, new_host = old.get("host_dispatch_us"), new.get("host_dispatch_us")
    if old_host and new_host and abs(new_host / old_host - 1) > HOST_TOLERANCE:
        differences.append(
            f"host {old_host:.1f} -> {new_host:.1f} us a CPU op (x{new_host / old_host:.2f}: "
            "host-bound rows move with it)"
        )
    if not differences:
        return []
    return [{"what": "the machine", "result": "; ".join(differences), "target": None,
             "met": None, "status": "ok"}]  # fmt: skip


def _metric_rows(where: str, old: dict, new: dict) -> list[dict[str, Any]]:
    rows = []
    for key, (name, higher, tolerance) in METRICS.items():
        before, after = old.get(key), new.get(key)
        if not _number(before) or not _number(after) or before == 0:
            continue
        ratio = after / before
        worse = ratio < 1 - tolerance if higher else ratio > 1 + tolerance
        if worse:
            result = f"{name} {_show(before)} -> {_show(after)} (x{ratio:.3f})"
            rows.append(_row(where, result, f"within {100 * tolerance:.0f} %"))
    return rows


def _row(what: str, result: str, target: str) -> dict[str, Any]:
    return {"what": what, "result": result, "target": target, "met": False,
            "status": "regressed"}  # fmt: skip


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _show(value: float) -> str:
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"
