"""benchmarks/distill.py's bookkeeping: runs reused only when their settings match, and the
summary's gain and cost taken seed by seed (its training runs are measured, not tested)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import distill


def test_a_finished_run_is_reused_only_with_the_same_settings(tmp_path: Path, monkeypatch):
    calls = []

    def fake_run(out: Path, overrides: list[str], timeout_s: float) -> float:
        calls.append(list(overrides))
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval.json").write_text(json.dumps({}))
        return 10.0 * len(calls)

    monkeypatch.setattr(distill, "train_run", fake_run)
    out = tmp_path / "run"
    assert distill.train_once(out, ["seed=0"], 60) == 10.0
    assert distill.train_once(out, ["seed=0"], 60) == 10.0  # reused: its recorded time
    assert distill.train_once(out, ["seed=1"], 60) == 20.0  # other settings: run again
    (out / "eval.json").unlink()
    assert distill.train_once(out, ["seed=1"], 60) == 30.0  # unfinished: run again
    assert len(calls) == 3


def test_the_summary_pairs_each_distilled_seed_with_the_same_seed_alone():
    rows = [
        {"variant": "student alone", "seed": 0, "accuracy": 0.70, "wall_s": 100.0},
        {"variant": "student alone", "seed": 1, "accuracy": 0.80, "wall_s": 200.0},
        {"variant": "distilled", "seed": 1, "accuracy": 0.82, "wall_s": 220.0},
        {"variant": "distilled", "seed": 0, "accuracy": 0.75, "wall_s": 120.0},
    ]
    summary = distill.summarise(rows)
    gain = summary["distilled"]["accuracy_gain_points"]
    assert gain["mean"] == pytest.approx(3.5) and gain["min"] == pytest.approx(2.0)
    assert summary["distilled"]["cost_ratio"]["mean"] == pytest.approx((1.2 + 1.1) / 2)
    assert "accuracy_gain_points" not in summary["student alone"]
