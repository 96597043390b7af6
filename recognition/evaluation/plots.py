"""ROC plots of verification results.

Drawn on a bare Agg canvas (matplotlib.figure.Figure + FigureCanvasAgg) rather than through
pyplot, so plotting neither needs a display nor changes the process-wide backend.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

RocCurve = tuple[np.ndarray, np.ndarray, Mapping[str, float | None]]  # (fpr, tpr, tar_at_far)


def plot_roc(
    results: Mapping[str, RocCurve | Mapping],
    path: str | os.PathLike,
    title: str = "ROC",
) -> None:
    """Draw one ROC curve per entry on a log FAR axis, with its TAR@FAR points marked.

    Each value of ``results`` is ``(fpr, tpr, tar_at_far)`` or an
    :func:`~recognition.evaluation.verification.evaluate_verification` dict (its ``"_roc"``
    and ``"tar_at_far"`` are used). FAR = 0 has no place on a log axis, so the curve starts
    at the smallest non-zero FAR. Writes an image (format from the suffix, e.g. ``.png``).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not results:
        raise ValueError("results: nothing to plot")
    figure = Figure(figsize=(6.4, 4.8), dpi=100)
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    smallest_far = 1.0
    for name, value in results.items():
        fpr, tpr, tars = _curve(name, value)
        positive = fpr > 0
        if positive.any():
            smallest_far = min(smallest_far, float(fpr[positive].min()))
        (line,) = ax.plot(fpr[positive], tpr[positive], label=str(name), linewidth=1.5)
        points = [(float(k), v) for k, v in tars.items() if v is not None]
        if points:
            fars, rates = zip(*points, strict=True)
            ax.plot(fars, rates, "o", color=line.get_color(), markersize=4)
            for far, rate in points:
                ax.annotate(
                    f"{100 * rate:.1f}",
                    (far, rate),
                    textcoords="offset points",
                    xytext=(3, -10),
                    fontsize=7,
                    color=line.get_color(),
                )
            smallest_far = min(smallest_far, min(fars))
    ax.set_xscale("log")
    ax.set_xlim(min(smallest_far, 1e-1) / 2, 1.0)
    ax.set_ylim(0.0, 1.01)
    ax.set_xlabel("false accept rate (FAR)")
    ax.set_ylabel("true accept rate (TAR)")
    ax.set_title(title)
    ax.grid(True, which="both", linewidth=0.3)
    ax.legend(loc="lower right")
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)


def _curve(name: str, value: RocCurve | Mapping) -> RocCurve:
    if isinstance(value, Mapping):
        if "_roc" not in value:
            raise ValueError(f"results[{name!r}]: a results dict needs its '_roc' (fpr, tpr)")
        fpr, tpr = value["_roc"]
        tars = value.get("tar_at_far", {})
    else:
        fpr, tpr, tars = value
    fpr = np.asarray(fpr, dtype=np.float64)
    tpr = np.asarray(tpr, dtype=np.float64)
    if fpr.shape != tpr.shape or fpr.ndim != 1:
        raise ValueError(
            f"results[{name!r}]: fpr {fpr.shape} and tpr {tpr.shape} must be equal 1-D arrays"
        )
    return fpr, tpr, tars
