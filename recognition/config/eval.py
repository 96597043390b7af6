"""The `eval` section: the evaluation targets (verification pairs files or `.bin`s, IJB-B/C,
re-id sets), when to evaluate them and which metric picks the best backbone."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from recognition.config.values import ConfigError, check_counts, check_image_size
from recognition.registry import PROTOCOLS, names


@dataclass
class EvalTarget:
    """An evaluation target: one of `pairs` (an LFW-style pairs file and its image folder),
    `bin` (an insightface ``.bin``), `ijb` (an IJB-B/C release) or `reid` (a Market-1501
    layout), its kind the key that is set (recognition/registry.py's PROTOCOLS)."""

    pairs: str | None = None
    """An LFW-format pairs file (View 2 ``pairs.txt`` or ``pairsDevTest.txt``)."""
    bin: str | None = None
    """An insightface ``.bin`` (``lfw.bin``, ``cfp_fp.bin``, ``agedb_30.bin``)."""
    ijb: str | None = None
    """An IJB-B/C release folder (``meta/`` and ``loose_crop/``, e.g. IJB_release/IJBC): 1:1
    template verification, or 1:N identification with ``ijb_mode: 1n``."""
    ijb_name: Literal["ijbb", "ijbc"] | None = None
    """Which IJB set ``ijb`` holds; null: told from its folder's name (IJBB, IJBC)."""
    ijb_mode: Literal["11", "1n"] = "11"
    """IJB: 11 (1:1 verification: auc, tar@far=...) or 1n (1:N identification: rank1,
    rank5, rank10, tpir@fpir=...)."""
    reid: str | None = None
    """A Market-1501 layout's root (``query/`` and ``bounding_box_test/``): re-id ranking
    (mAP, rank1, rank5, rank10)."""
    images: str | None = None
    """Image root of ``pairs``; defaults to the folder holding the pairs file."""
    name: str | None = None
    """Label in tables and metric names; defaults to the pairs file's folder name, the
    ``.bin`` file's stem, the IJB set's name (``ijbc``, ``ijbc-1n``) or the name of the
    input folder (re-id)."""
    crop: int | None = None
    """Centre square (pixels, of the original image) cut before resizing; e.g. LFW's
    250x250 photos hold the face in their centre. Pairs and .bin only."""

    @property
    def kind(self) -> str:
        """The key of the set input (`pairs`, `bin`, `ijb`, `reid`): the target's protocol."""
        kinds = [kind for kind in PROTOCOLS if getattr(self, kind, None) is not None]
        return kinds[0] if len(kinds) == 1 else ""

    def check(self, key: str) -> None:
        """Raise ConfigError (naming `key`, e.g. `eval.targets[0]`) for a bad combination."""
        given = {kind: getattr(self, kind, None) for kind in PROTOCOLS}
        if sum(value is not None for value in given.values()) != 1:
            shown = " ".join(f"{kind}={value!r}" for kind, value in given.items())
            raise ConfigError(
                f"{key}.pairs: each target needs exactly one of {names(PROTOCOLS)} (an LFW "
                f"pairs file, an insightface .bin, an IJB release, a re-id set), got {shown}"
            )
        kind = self.kind
        if self.images is not None and kind != "pairs":
            raise ConfigError(
                f"{key}.images: belongs to a pairs file; the {kind} target holds its own images"
            )
        if self.crop is not None and kind not in ("pairs", "bin"):
            raise ConfigError(f"{key}.crop: only for pairs and bin targets, not {kind}")
        if kind != "ijb" and (self.ijb_name is not None or self.ijb_mode != "11"):
            raise ConfigError(f"{key}.ijb_name: ijb_name and ijb_mode belong to an ijb target")
        if kind == "ijb" and self.ijb_name is None and self.ijb_set() is None:
            raise ConfigError(
                f"{key}.ijb_name: the folder {Path(self.ijb or '').name!r} does not say which "
                "IJB set it is; set ijb_name: ijbb or ijbc"
            )
        if self.crop is not None and self.crop < 1:
            raise ConfigError(f"{key}.crop: must be a positive size, got {self.crop}")
        if self.name is not None and (not self.name or "/" in self.name):
            raise ConfigError(
                f"{key}.name: {self.name!r} must be non-empty and hold no '/' (it becomes part "
                "of metric names such as lfw/accuracy)"
            )

    def ijb_set(self) -> str | None:
        """`ijb_name`, else ijbb / ijbc from the `ijb` folder's name; None when neither."""
        if self.ijb_name is not None:
            return self.ijb_name
        folder = Path(self.ijb or "").name.lower().replace("-", "").replace("_", "")
        return folder if folder in ("ijbb", "ijbc") else None

    @property
    def label(self) -> str:
        """The name in tables and metric keys (``name``, else derived from the input)."""
        if self.name:
            return self.name
        if self.bin is not None:
            return Path(self.bin).stem
        if self.ijb is not None:
            mode = "-1n" if self.ijb_mode == "1n" else ""
            return f"{self.ijb_set()}{mode}"
        if self.pairs is not None:
            return Path(self.pairs).resolve().parent.name
        return Path(getattr(self, self.kind) or ".").resolve().name  # a folder: its name


HOLDOUT_NAME = "holdout"
"""The name of the held-out identities' target (`eval.holdout`), and of its folder in the run
directory."""
SYNTHETIC_VAL_NAME = "synthetic-val"
"""The name of the built-in synthetic set's own verification target (its `val/pairs.txt`)."""

EVAL_METRICS = ("accuracy", "auc", "eer", "xnorm")
"""The verification metrics `eval.best_metric` may name besides `tar@far=<FAR>`; the other
kinds' are their registry entries' `keys` (a name ending in `=` takes a rate after it)."""
LOWER_IS_BETTER = ("eer",)
"""The metrics whose lower values are better (the others: higher)."""


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
    """`<target>/<metric>` (e.g. `lfw/accuracy`, `agedb_30/tar@far=1e-4`, `lfw/eer`,
    `ijbc/tar@far=1e-4`, `market/mAP`): keep the backbone of the best periodic evaluation as
    best_backbone.pt (with best.json). Metrics of pairs and bin: accuracy, auc, eer (lower is
    better), xnorm, tar@far=<FAR>; ijb: auc, tar@far=<FAR> (1:1), rank1, rank5, rank10,
    tpir@fpir=<FPIR> (1:N); reid: mAP, rank1, rank5, rank10."""
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
        kinds = {t.label: t.kind for t in self.targets or []}
        if self.targets is None:
            labels = [SYNTHETIC_VAL_NAME, HOLDOUT_NAME]
            kinds = dict.fromkeys(labels, "pairs")
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
            parse_metric(metric, "eval.best_metric", kinds[target])
            if self.every_steps is None:
                raise ConfigError(
                    "eval.best_metric: needs eval.every_steps (the best is chosen among the "
                    "periodic evaluations)"
                )


def parse_metric(metric: str, key: str, kind: str = "pairs") -> tuple[str, float | None]:
    """(name, rate or None) of a metric of a `kind` target (a PROTOCOLS key) spelled as its
    registry entry's `keys` name it: `accuracy`, `mAP`, ... or, for a name ending in `=`,
    with a rate in (0, 1) after it (`tar@far=1e-3`: ("tar@far=", 0.001)).

    Raises ConfigError naming `key` for anything else.
    """
    known = PROTOCOLS[kind].keys
    if metric in known and not metric.endswith("="):
        return metric, None
    for prefix in (k for k in known if k.endswith("=")):
        if metric.startswith(prefix):
            try:
                rate = float(metric[len(prefix) :])
            except ValueError:
                rate = float("nan")
            if 0.0 < rate < 1.0:
                return prefix, rate
    spelled = ", ".join(k + "<rate>" if k.endswith("=") else k for k in known)
    raise ConfigError(
        f"{key}: unknown metric {metric!r} for {kind} targets; use one of {spelled} "
        "(e.g. tar@far=1e-3)"
    )
