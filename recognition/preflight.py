"""The run's inputs checked before any work (no data generated, no folder indexed, no model
built, not even torch imported): `data.root`, every evaluation target's files,
`output_dir`, a `train.resume` path, `train.init_backbone` and `train.teacher`. Every
problem is one line, and all are reported at once; `train.py` calls `input_problems` first
thing (and tells `train()` so); `train()` itself calls it (`check_inputs`) for callers that
skip `train.py`.

Only what files and folders can tell is checked here; what needs the data read (an index,
a checkpoint's contents) is checked where it is read, as early as it can be.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from recognition.config import DataConfig, EvalTarget, ExperimentConfig
from recognition.config.experiment import lies_in
from recognition.data.formats import resolve_format
from recognition.registry import PROTOCOLS, load


class InputError(ValueError):
    """The run's inputs are missing or malformed: one line per problem."""


def input_problems(cfg: ExperimentConfig) -> list[str]:
    """What is missing or malformed among the run's inputs, one line each ([] when none)."""
    problems = []
    # What the synthetic set's generation will make is not there yet, and not a problem.
    pending = cfg.data.synthetic.root if cfg.data.synthetic.enabled else None
    if pending is None or not lies_in(cfg.data.root, pending):
        try:
            resolve_format(cfg.data)
        except OSError as exc:
            problems.append(str(exc) + _synthetic_hint(cfg))
    if cfg.eval.at_end or cfg.eval.every_steps:
        for target in cfg.eval.targets or []:
            if awaits_generation(cfg, target):
                continue
            try:
                check_target(target)
            except (OSError, ValueError) as exc:
                problems.append(f"eval.targets: {exc}")
    if (problem := _output_dir_problem(cfg.run_dir)) is not None:
        problems.append(problem)
    resume = cfg.train.resume
    if isinstance(resume, str) and resume != "auto" and not Path(resume).exists():
        problems.append(f"train.resume: {resume} does not exist (a checkpoint or run directory)")
    # A resumed run takes its backbone from the checkpoint and never reads this file (with
    # train.resume=auto and no checkpoint yet, the run checks it before building anything).
    init = cfg.train.init_backbone
    if init is not None and resume is False and not Path(init).exists():
        problems.append(
            f"train.init_backbone: {init} does not exist (a backbone file or a training "
            "checkpoint directory)"
        )
    teacher = cfg.train.teacher
    if teacher is not None and not Path(teacher).exists():
        problems.append(
            f"train.teacher: {teacher} does not exist (a backbone file, a training checkpoint "
            "directory or an .onnx model)"
        )
    for i, code in enumerate(cfg.train.hooks):
        module = code.partition(":")[0]
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package is not there either
            found = False
        if not found:
            problems.append(f"train.hooks[{i}]: no module {module!r} (for {code})")
    return problems


def _synthetic_hint(cfg: ExperimentConfig) -> str:
    """For a data.root left at the built-in set's place while data.synthetic.root moved it:
    where the set is generated now, and the override that reads it there."""
    default_root = DataConfig.root  # the field's default
    moved = Path(cfg.data.synthetic.root) / "train"
    if cfg.data.root != default_root or lies_in(default_root, cfg.data.synthetic.root):
        return ""
    return f" (data.synthetic.root puts the built-in set's images in {moved}: data.root={moved})"


def awaits_generation(cfg: ExperimentConfig, target: EvalTarget) -> bool:
    """Whether a file of `target` lies in the synthetic set that the run generates on first
    use: not checked here, but once the set is made (`check_training_targets`)."""
    if not cfg.data.synthetic.enabled:
        return False
    files = [p for p in (*target_files(target), target.images) if p is not None]
    return any(lies_in(p, cfg.data.synthetic.root) for p in files)


def target_files(target: EvalTarget) -> list[str]:
    """The input of `target` (its pairs file, .bin or folder), as a list."""
    return [getattr(target, target.kind)]


def check_target(target: EvalTarget) -> None:
    """Raise FileNotFoundError / ValueError (naming the file and line) when a target's inputs
    are missing or malformed (its protocol's `check`: a `.bin` missing, a pairs file missing
    or malformed or naming a missing image, an IJB or re-id folder missing ...)."""
    load(PROTOCOLS, target.kind, "eval.targets")(target).check()


def _output_dir_problem(run_dir: Path) -> str | None:
    """Why the run directory could not be made or written, by the first folder of it that
    exists; None when it can."""
    if run_dir.exists() and not run_dir.is_dir():
        return f"output_dir: {run_dir} is a file; the run directory must be a folder"
    existing = run_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"output_dir: {existing} is a file, so {run_dir} cannot be made"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"output_dir: cannot write the run directory {run_dir}: {existing} is not writable"
    return None


# The keys that make the built-in run's model something else than its CPU toy.
MODEL_KEYS = ("model.", "data.image_size")


def toy_on_own_data(cfg: ExperimentConfig, overrides: list[str]) -> bool:
    """Whether `cfg` (the built-in config with `overrides`) trains the built-in CPU toy model
    on data of one's own: data.root outside the synthetic set, and neither the model nor the
    input size overridden."""
    keys = [item.partition("=")[0].strip() for item in overrides]
    return not cfg.trains_on_synthetic and not any(k.startswith(MODEL_KEYS) for k in keys)
