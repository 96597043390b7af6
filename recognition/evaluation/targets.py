"""The targets a training run evaluates (`run_targets`: eval.targets, or the data's own
held-out identities), checked (`check_training_targets`) and evaluated with the config's
settings (`evaluate_config_targets`, through their protocols): what the training's
evaluation hook, `train()`'s last evaluation and `evaluate.py` on a finished run call."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from recognition import distributed
from recognition.config import EvalTarget, ExperimentConfig
from recognition.config.eval import HOLDOUT_NAME, SYNTHETIC_VAL_NAME
from recognition.data.holdout import HOLDOUT_DIR
from recognition.data.holdout import PAIRS_FILE as HOLDOUT_PAIRS
from recognition.data.synthetic.layout import PAIRS_FILE, VAL_DIR
from recognition.distributed import DistInfo
from recognition.evaluation.embeddings import Extraction
from recognition.evaluation.protocols import evaluate_targets
from recognition.preflight import awaits_generation, check_target

log = logging.getLogger(__name__)


def run_targets(cfg: ExperimentConfig, *, holdout: bool | None = None) -> list[EvalTarget]:
    """The targets a run of `cfg` verifies on: `eval.targets`; with none named (null), the
    data's own held-out identities: the synthetic set's val pairs when it trains on that set,
    else the pairs of the identities `eval.holdout` kept out of training, in the run
    directory. `holdout`: whether the run holds identities out (training knows); None: when
    the run directory holds their pairs (evaluating a finished run)."""
    if cfg.eval.targets is not None:
        return list(cfg.eval.targets)
    if cfg.trains_on_synthetic:
        pairs = Path(cfg.data.synthetic.root) / VAL_DIR / PAIRS_FILE
        return [EvalTarget(name=SYNTHETIC_VAL_NAME, pairs=str(pairs))]
    pairs = cfg.run_dir / HOLDOUT_DIR / HOLDOUT_PAIRS
    if holdout is None:
        holdout = cfg.eval.holdout > 0 and pairs.is_file()
    return [EvalTarget(name=HOLDOUT_NAME, pairs=str(pairs))] if holdout else []


def evaluate_config_targets(
    cfg: ExperimentConfig,
    model: nn.Module,
    device: torch.device,
    *,
    progress: bool,
    xnorm: bool = False,
    targets: Sequence[EvalTarget] | None = None,
) -> dict[str, dict]:
    """`evaluate_targets` on `targets` (default: `run_targets(cfg)`) with the config's
    evaluation settings.

    `model`: a float32 backbone in eval mode (during training, a copy of the backbone, which
    may be held in half precision and must keep its own mode). Returns {target: metrics}.
    """
    extraction = Extraction(cfg.eval.batch_size, cfg.eval.flip, device, progress=progress)
    targets = run_targets(cfg) if targets is None else targets
    return evaluate_targets(model, targets, cfg.eval_image_hw, extraction, xnorm=xnorm)


def check_targets(targets: Sequence[EvalTarget]) -> None:
    """Fail now, not hours into training, when a target's files are missing or malformed.

    Reads every pairs file and checks its images exist; checks every ``.bin`` file exists
    (it is read in full only when evaluated). Raises FileNotFoundError / ValueError naming
    the file and line.
    """
    for target in targets:
        check_target(target)


def check_training_targets(cfg: ExperimentConfig, dist_info: DistInfo) -> None:
    """Collective: rank 0 checks the targets in the synthetic set, once it is generated; every
    rank raises on error. The other targets' files were checked before any work
    (`recognition.preflight`), and the held-out identities' pairs are the run's own.

    Raises ValueError ``"eval.targets: ..."`` naming the missing or malformed file.
    """
    targets = [t for t in run_targets(cfg) if awaits_generation(cfg, t)]
    if not targets or not (cfg.eval.every_steps or cfg.eval.at_end):
        return
    error = None
    if dist_info.is_main:
        try:
            check_targets(targets)
        except (ValueError, FileNotFoundError) as exc:
            error = f"eval.targets: {exc}"
    # Broadcast, so that every rank stops when rank 0 finds a target missing.
    error = distributed.broadcast_object(error)
    if error is not None:
        raise ValueError(error)
