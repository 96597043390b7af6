"""`eval.holdout` in a run: hold identities of the training data out (`recognition.data.
holdout` chooses them), write their pairs into the run directory, or check the ones a
resumed run wrote, and train on the rest."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from recognition import distributed
from recognition.config import EvalTarget, ExperimentConfig
from recognition.data.formats import resolve_format
from recognition.data.holdout import (
    HOLDOUT_DIR,
    PAIRS_FILE,
    HoldoutSplit,
    TrainingSubset,
    choose_holdout,
    make_holdout_pairs,
    write_holdout,
)
from recognition.data.pairs import pairs_text
from recognition.data.source import TrainSource
from recognition.distributed import DistInfo
from recognition.evaluation.targets import run_targets
from recognition.training.errors import TrainingError

log = logging.getLogger(__name__)

HOLDOUT_FORMATS = ("folder", "recordio")
"""The data formats identities are held out of (Market-1501 has its own query/gallery)."""


def holdout_wanted(cfg: ExperimentConfig, data_format: str) -> bool:
    """Whether `cfg` asks for held-out identities: no eval.targets named (null), not the
    synthetic set (which has its own), an image folder or pack, eval.holdout > 0."""
    return (
        cfg.eval.targets is None
        and not cfg.trains_on_synthetic
        and data_format in HOLDOUT_FORMATS
        and cfg.eval.holdout > 0
    )


def split_for_eval(
    cfg: ExperimentConfig, dist_info: DistInfo, source: TrainSource
) -> tuple[TrainSource, list[EvalTarget]]:
    """What the run trains on (`source` less the identities eval.holdout keeps out, when it
    asks for them: `hold_out`) and the targets it verifies on (`run_targets`): collective."""
    held_out = False
    if holdout_wanted(cfg, resolve_format(cfg.data)):
        source, held_out = hold_out(cfg, dist_info, source)
    return source, run_targets(cfg, holdout=held_out)


def holdout_split(source: TrainSource, share: float) -> HoldoutSplit:
    """The held-out classes of `source` for eval.holdout = `share` (from its class names and
    image counts alone: the same on every rank, at any world size)."""
    counts = np.bincount(np.asarray(source.labels), minlength=source.num_classes)
    return choose_holdout(source.iter_class_names(), counts, share)


def hold_out(
    cfg: ExperimentConfig, dist_info: DistInfo, source: TrainSource
) -> tuple[TrainSource, bool]:
    """`source` less its held-out identities, and whether any are held out (collective).

    Every rank computes the split; rank 0 writes `<run>/holdout/` (or, when it is there
    already, a resumed run's, checks that its pairs are the ones the data gives now) and
    says in one line what is held out; an error there is raised on every rank.
    """
    split = holdout_split(source, cfg.eval.holdout)
    if not split.active:
        if dist_info.is_main:
            log.warning("eval.holdout: nothing held out to verify on: %s", split.reason)
        return source, False
    error = None
    if dist_info.is_main:
        try:
            _write_or_check(cfg.run_dir / HOLDOUT_DIR, source, split)
        except (OSError, ValueError, TrainingError) as exc:
            error = str(exc)
    error = distributed.broadcast_object(error)  # also the barrier: the files are there
    if error is not None:
        raise TrainingError(error)
    return TrainingSubset(source, split), True


def _write_or_check(folder: Path, source: TrainSource, split: HoldoutSplit) -> None:
    counts = np.bincount(np.asarray(source.labels), minlength=source.num_classes)
    held = [int(c) for c in split.held_out]
    pair_names, folds = make_holdout_pairs(
        [source.class_name(c) for c in held], [int(counts[c]) for c in held]
    )
    pairs = folder / PAIRS_FILE
    num_pairs = 2 * len(folds) * len(folds[0][0])
    if folder.exists():
        text = pairs.read_text(encoding="utf-8") if pairs.is_file() else None
        if text != pairs_text(folds):
            raise TrainingError(
                f"eval.holdout: {pairs} is not the held-out pairs that data.root "
                f"{source.root} gives now (the data changed since this run started?); train "
                "into another output_dir, or move the folder away to hold out anew"
            )
        action = "reusing"
    else:
        write_holdout(folder, source, split, pair_names, folds)
        action = "wrote"
    log.info(
        "eval.holdout: %d of %d identities held out of training (%d images); %s %d pairs "
        "in %d folds in %s: the run verifies on them (target holdout)",
        len(held),
        split.num_classes,
        int(counts[held].sum()),
        action,
        num_pairs,
        len(folds),
        pairs,
    )
