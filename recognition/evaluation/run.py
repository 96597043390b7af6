"""The targets a training run evaluates, and the evaluation of them (through their
protocols, `recognition.evaluation.protocols`): what the training's evaluation hook and
`train()`'s last evaluation call; also an image folder's embeddings (evaluate.py
--export-embeddings without targets)."""

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
from recognition.data.pairs import IMAGE_EXTENSIONS
from recognition.data.synthetic.layout import PAIRS_FILE, VAL_DIR
from recognition.distributed import DistInfo
from recognition.evaluation.embeddings import (
    DEFAULT_EXTRACTION,
    Extraction,
    PathDataset,
    save_embeddings,
)
from recognition.evaluation.protocols import evaluate_protocols, protocol_for
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


def evaluate_targets(
    backbone: nn.Module,
    targets: Sequence[EvalTarget],
    image_size: int | tuple[int, int],
    extraction: Extraction = DEFAULT_EXTRACTION,
    *,
    export_path: Path | None = None,
    xnorm: bool = False,
) -> dict[str, dict]:
    """Results {target name: metrics} of `backbone` on each target, through its protocol
    (`recognition.evaluation.protocols.evaluate_protocols`, which says how `export_path`
    is used)."""
    protocols = [protocol_for(target) for target in targets]
    return evaluate_protocols(
        backbone, protocols, image_size, extraction, export_path=export_path, xnorm=xnorm
    )


def list_images(root: Path) -> list[str]:
    """Every image file under ``root`` (recursively), relative to it, sorted; POSIX separators."""
    if not root.is_dir():
        raise FileNotFoundError(f"image folder not found: {root}")
    suffixes = {e.lower() for e in IMAGE_EXTENSIONS}
    paths = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p.suffix.lower() in suffixes
    )
    if not paths:
        raise ValueError(f"{root}: no images ({', '.join(IMAGE_EXTENSIONS)}) found")
    return paths


def export_folder(
    backbone: nn.Module,
    root: Path,
    out: Path,
    image_size: int | tuple[int, int],
    extraction: Extraction = DEFAULT_EXTRACTION,
    *,
    crop: int | None = None,
) -> int:
    """Embed every image under ``root`` and write ``out`` (.npz: embeddings, relative paths).

    Returns the number of images.
    """
    paths = list_images(root)
    embeddings = extraction(backbone, PathDataset(paths, size=image_size, root=root, crop=crop))
    save_embeddings(out, embeddings, paths)
    log.info("wrote %d embeddings to %s", len(paths), out)
    return len(paths)
