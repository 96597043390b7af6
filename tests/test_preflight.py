"""Inputs checked before any work: a missing data.root, eval target, train.resume path or
train.init_backbone, or an output_dir that cannot be made, each one line, all at once, with
nothing generated, indexed or built."""

from __future__ import annotations

from pathlib import Path

import pytest

import train
from recognition.config import load_config
from recognition.preflight import InputError, input_problems


def test_a_missing_data_root_stops_before_anything_is_made(tmp_path, monkeypatch, capsys):
    """The default config with data.root=/nonexistent: one line, no synthetic data, and
    training never entered (nothing indexed, no model built)."""
    import recognition.training as training

    monkeypatch.chdir(tmp_path)  # data.synthetic.root is data/synthetic, relative

    def entered(cfg, **kwargs):
        raise AssertionError("train() was called for a run whose data.root is missing")

    monkeypatch.setattr(training, "train", entered)
    missing = tmp_path / "nonexistent"
    assert train.main([f"data.root={missing}", f"output_dir={tmp_path / 'run'}"]) == 1
    err = capsys.readouterr().err
    assert err == f"error: data.root: {missing} does not exist\n"
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()


def test_a_moved_synthetic_set_names_the_data_root_that_reads_it(tmp_path, monkeypatch):
    """data.synthetic.root elsewhere, data.root left at the built-in set's place: the line
    says where the set's images go and the override that reads them; nothing generated."""
    monkeypatch.chdir(tmp_path)
    moved = tmp_path / "elsewhere"
    cfg = load_config("default", [f"data.synthetic.root={moved}", f"output_dir={tmp_path / 'r'}"])
    assert input_problems(cfg) == [
        "data.root: data/synthetic/train does not exist (data.synthetic.root puts the built-in "
        f"set's images in {moved / 'train'}: data.root={moved / 'train'})"
    ]
    assert not moved.exists()
    # Where data.root follows it, the set is generated on first use: nothing to report.
    cfg = load_config("default", [f"data.synthetic.root={moved}", f"data.root={moved / 'train'}",
                                  f"output_dir={tmp_path / 'r'}"])  # fmt: skip
    assert input_problems(cfg) == []


def test_every_problem_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    taken = tmp_path / "taken"
    taken.write_text("")
    args = [
        f"data.root={tmp_path / 'faces'}",
        f"output_dir={taken / 'run'}",
        f"train.resume={tmp_path / 'old_run'}",
        f"eval.targets=[{{name: lfw, pairs: {tmp_path / 'lfw' / 'pairs.txt'}}}]",
    ]
    assert train.main(args) == 1
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(":")[1].strip() for line in lines] == [
        "data.root",
        "eval.targets",
        "output_dir",
        "train.resume",
    ]
    assert all(line.startswith("error: ") for line in lines) and "pairs.txt" in lines[1]


def test_init_backbone_is_checked_unless_the_run_resumes(tmp_path):
    """A missing train.init_backbone is one line; a folder (a training checkpoint) is a
    backbone file too; a resumed run never reads it, so it is not checked then."""
    missing = tmp_path / "backbone.pt"
    cfg = load_config(
        "default", [f"output_dir={tmp_path / 'run'}", f"train.init_backbone={missing}"]
    )
    assert input_problems(cfg) == [
        f"train.init_backbone: {missing} does not exist (a backbone file or a training "
        "checkpoint directory)"
    ]
    (tmp_path / "step_00000010").mkdir()
    folder = load_config("default", [f"train.init_backbone={tmp_path / 'step_00000010'}"])
    assert input_problems(folder) == []
    for resume in ("true", "auto"):
        again = load_config("default", [f"train.init_backbone={missing}", f"train.resume={resume}"])
        assert input_problems(again) == []


def test_train_checks_before_building(tmp_path, monkeypatch):
    """train() itself (a caller without train.py) stops on every problem before build."""
    from recognition.training import loop

    def built(*args, **kwargs):
        raise AssertionError("the run was built")

    monkeypatch.setattr(loop, "build_run", built)
    cfg = load_config("default", [f"data.root={tmp_path / 'x'}", f"output_dir={tmp_path / 'r'}"])
    with pytest.raises(InputError, match=f"data.root: {tmp_path / 'x'} does not exist"):
        loop.train(cfg)


def test_the_synthetic_set_is_for_the_runs_that_read_it(tmp_path):
    assert load_config("default").uses_synthetic
    assert not load_config("default", [f"data.root={tmp_path}"]).uses_synthetic
    val = Path("data/synthetic/val/pairs.txt")
    assert load_config(
        "default", [f"data.root={tmp_path}", f"eval.targets=[{{pairs: {val}}}]"]
    ).uses_synthetic
