"""The `eval` section: the verification targets (pairs files or `.bin`s), when to evaluate
them and which metric picks the best backbone."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from recognition.config.values import ConfigError, check_counts, check_image_size


@dataclass
class EvalTarget:
    """A verification set: an LFW-style pairs file (and its image folder) or an insightface
    ``.bin``. Exactly one of ``pairs`` and ``bin`` is set."""

    pairs: str | None = None
    """An LFW-format pairs file (View 2 ``pairs.txt`` or ``pairsDevTest.txt``)."""
    bin: str | None = None
    """An insightface ``.bin`` (``lfw.bin``, ``cfp_fp.bin``, ``agedb_30.bin``)."""
    images: str | None = None
    """Image root of ``pairs``; defaults to the folder holding the pairs file."""
    name: str | None = None
    """Label in tables and metric names; defaults to the pairs file's folder name, or the
    ``.bin`` file's stem."""
    crop: int | None = None
    """Centre square (pixels, of the original image) cut before resizing; e.g. LFW's
    250x250 photos hold the face in their centre."""

    def check(self, key: str) -> None:
        """Raise ConfigError (naming `key`, e.g. `eval.targets[0]`) for a bad combination."""
        if (self.pairs is None) == (self.bin is None):
            raise ConfigError(
                f"{key}.pairs: each target needs exactly one of `pairs` (an LFW pairs file) or "
                f"`bin` (an insightface .bin), got pairs={self.pairs!r} bin={self.bin!r}"
            )
        if self.bin is not None and self.images is not None:
            raise ConfigError(
                f"{key}.images: belongs to a pairs file; the .bin {self.bin} holds its own images"
            )
        if self.crop is not None and self.crop < 1:
            raise ConfigError(f"{key}.crop: must be a positive size, got {self.crop}")
        if self.name is not None and (not self.name or "/" in self.name):
            raise ConfigError(
                f"{key}.name: {self.name!r} must be non-empty and hold no '/' (it becomes part "
                "of metric names such as lfw/accuracy)"
            )

    @property
    def label(self) -> str:
        """The name in tables and metric keys (``name``, else derived from the file)."""
        if self.name:
            return self.name
        if self.bin is not None:
            return Path(self.bin).stem
        return Path(self.pairs or ".").resolve().parent.name


HOLDOUT_NAME = "holdout"
"""The name of the held-out identities' target (`eval.holdout`), and of its folder in the run
directory."""
SYNTHETIC_VAL_NAME = "synthetic-val"
"""The name of the built-in synthetic set's own verification target (its `val/pairs.txt`)."""

EVAL_METRICS = ("accuracy", "auc", "eer", "xnorm")
"""Metrics `eval.best_metric` may name besides `tar@far=<FAR>`; only `eer` is better lower."""


@dataclass
class EvalConfig:
    """The `eval` section: what the run verifies on, when, and with which settings."""

    targets: list[EvalTarget] | None = None
    """The verification sets (each a `pairs` file or a `bin`). null: the data's own held-out
    identities: the synthetic set's val/pairs.txt when training on it, else `eval.holdout`'s
    share of an image folder or RecordIO pack. []: no verification."""
    holdout: float = 0.05
    """With eval.targets null, on an image folder or RecordIO pack: the share of identities
    (at least 20, of those with two images or more) held out of training, whose pairs the
    run verifies on (run directory holdout/); 0 turns it off (docs/evaluation.md)."""
    at_end: bool = True
    """Evaluate every target once training ends and print the table."""
    every_steps: int | None = None
    """Also evaluate every target every this many optimizer steps (rank 0 evaluates while
    the other ranks wait at a barrier: an evaluation must take less than train.timeout_s);
    results go to metrics.jsonl and TensorBoard as eval/<target>/<metric>. null: never."""
    best_metric: str | None = None
    """`<target>/<metric>` (e.g. `lfw/accuracy`, `agedb_30/tar@far=1e-4`, `lfw/eer`): keep
    the backbone of the best periodic evaluation as best_backbone.pt (with best.json).
    Metrics: accuracy, auc, eer (lower is better), xnorm, tar@far=<FAR>."""
    batch_size: int = 128
    """Images per evaluation batch."""
    flip: bool = True
    """Sum the embeddings of each image and its mirror image."""
    image_size: int | list[int] | str | None = None
    """Input size for evaluation, one side, [H, W] or "HxW"; null: the training size
    (data.image_size)."""

    def __post_init__(self) -> None:
        for i, target in enumerate(self.targets or []):
            target.check(f"eval.targets[{i}]")
        if not 0.0 <= self.holdout <= 0.5:
            raise ConfigError(
                f"eval.holdout: a share of the identities from 0 (off) to 0.5, got {self.holdout}"
            )
        # Without targets the run's own: the synthetic set's, or the held-out identities.
        labels = [t.label for t in self.targets or []]
        if self.targets is None:
            labels = [SYNTHETIC_VAL_NAME, HOLDOUT_NAME]
        duplicates = sorted({x for x in labels if labels.count(x) > 1})
        if duplicates:
            raise ConfigError(
                f"eval.targets: two targets are called {duplicates[0]!r}; give them distinct "
                "`name`s"
            )
        check_counts("eval", self, ("every_steps", "batch_size"), nullable=("every_steps",))
        if self.image_size is not None:
            self.image_size = check_image_size(self.image_size, "eval.image_size")
        if self.best_metric is not None:
            target, _, metric = self.best_metric.partition("/")
            if target not in labels:
                raise ConfigError(
                    f"eval.best_metric: {self.best_metric!r} names target {target!r}, but the "
                    f"targets are {labels or 'none'} (expected <target>/<metric>"
                    + ("; without targets, set eval.best_metric=null)" if not labels else ")")
                )
            parse_metric(metric, "eval.best_metric")
            if self.every_steps is None:
                raise ConfigError(
                    "eval.best_metric: needs eval.every_steps (the best is chosen among the "
                    "periodic evaluations)"
                )


def parse_metric(metric: str, key: str) -> tuple[str, float | None]:
    """(name, FAR or None) of a metric spelled `accuracy`, `eer`, ... or `tar@far=1e-3`.

    Raises ConfigError naming `key` for anything else.
    """
    if metric in EVAL_METRICS:
        return metric, None
    prefix = "tar@far="
    if metric.startswith(prefix):
        try:
            far = float(metric[len(prefix) :])
        except ValueError:
            far = float("nan")
        if 0.0 < far < 1.0:
            return "tar_at_far", far
    raise ConfigError(
        f"{key}: unknown metric {metric!r}; use one of {', '.join(EVAL_METRICS)} or "
        "tar@far=<FAR> (e.g. tar@far=1e-3)"
    )
