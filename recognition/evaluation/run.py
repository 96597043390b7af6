"""Evaluate a backbone and report: verification targets (pairs files, .bin), embedding
export; what evaluate.py and the training's evaluation hook call (re-id is in `reid`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from recognition import distributed
from recognition.config import EvalTarget, ExperimentConfig
from recognition.config.eval import HOLDOUT_NAME, SYNTHETIC_VAL_NAME
from recognition.data.holdout import HOLDOUT_DIR
from recognition.data.holdout import PAIRS_FILE as HOLDOUT_PAIRS
from recognition.data.insightface_bin import BinDataset, load_bin
from recognition.data.pairs import IMAGE_EXTENSIONS, Pairs, load_pairs, resolve_images
from recognition.data.synthetic.layout import PAIRS_FILE, VAL_DIR
from recognition.distributed import DistInfo
from recognition.evaluation.embeddings import (
    DEFAULT_EXTRACTION,
    Extraction,
    PathDataset,
    index_paths,
    save_embeddings,
    verify_pairs,
)
from recognition.evaluation.plots import plot_roc
from recognition.evaluation.report import print_report
from recognition.evaluation.report import write_json as write_json  # also imported from here
from recognition.evaluation.verification import (
    evaluate_verification,
    format_table,
    to_json_dict,
)
from recognition.preflight import awaits_generation, check_target

log = logging.getLogger(__name__)


def target_name(target: EvalTarget) -> str:
    """The target's label in tables and metric keys (see :attr:`EvalTarget.label`)."""
    return target.label


def load_target(target: EvalTarget) -> tuple[Pairs, Path]:
    """Read a target's pairs and check that every image exists; returns (pairs, image root)."""
    if target.pairs is None:
        raise ValueError(f"target {target.label}: not a pairs target")
    pairs = load_pairs(target.pairs)
    root = Path(target.images) if target.images else Path(target.pairs).parent
    return resolve_images(pairs, root), root


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


def verify_consecutive(
    embeddings: np.ndarray, issame: np.ndarray, num_folds: int = 10
) -> dict[str, object]:
    """Verification metrics of pairs (2i, 2i+1) of ``embeddings`` (2N, D), as a .bin orders them.

    The N pairs are split in order into ``num_folds`` contiguous folds (insightface's
    unshuffled 10-fold protocol). Returns :func:`evaluate_verification`'s dict.
    """
    unit = np.asarray(embeddings, dtype=np.float64)
    unit = unit / np.maximum(np.linalg.norm(unit, axis=1, keepdims=True), 1e-12)
    scores = np.einsum("pd,pd->p", unit[0::2], unit[1::2])  # (N,)
    return evaluate_verification(scores, issame, num_folds=num_folds)


def evaluate_target(
    backbone: nn.Module,
    target: EvalTarget,
    image_size: int | tuple[int, int],
    extraction: Extraction = DEFAULT_EXTRACTION,
    *,
    xnorm: bool = False,
) -> tuple[dict, np.ndarray, list[str]]:
    """Verification of `backbone` on one target (a pairs file or a .bin).

    Returns (metrics, embeddings (N, D), their paths): for pairs the image paths relative to
    the image root, for a .bin ``"<file name>/<index>"``. With ``xnorm`` the metrics hold
    ``xnorm``, the mean norm of the raw embeddings of the (unflipped) images.
    """
    if target.bin is not None:
        bin_pairs = load_bin(target.bin)
        dataset = BinDataset(bin_pairs, size=image_size, crop=target.crop)
        embeddings, norms = extraction(backbone, dataset, return_norms=True)
        paths = [f"{Path(target.bin).name}/{i}" for i in range(len(dataset))]
        results = verify_consecutive(embeddings, bin_pairs.issame)
    else:
        pairs, root = load_target(target)
        paths = pairs.images()
        dataset = PathDataset(paths, size=image_size, root=root, crop=target.crop)
        embeddings, norms = extraction(backbone, dataset, return_norms=True)
        results = verify_pairs(embeddings, index_paths(paths), pairs)
    if xnorm:
        results["xnorm"] = float(np.mean(norms, dtype=np.float64))
    return results, embeddings, paths


def evaluate_targets(
    backbone: nn.Module,
    targets: Sequence[EvalTarget],
    image_size: int | tuple[int, int],
    extraction: Extraction = DEFAULT_EXTRACTION,
    *,
    export_path: Path | None = None,
    xnorm: bool = False,
) -> dict[str, dict]:
    """Verification results {target name: metrics} of `backbone` on each target.

    With ``export_path`` the embeddings are written there (one target), or to
    ``<stem>.<target name>.npz`` next to it for each of several targets.
    """
    results: dict[str, dict] = {}
    for target in targets:
        name = target_name(target)
        results[name], embeddings, paths = evaluate_target(
            backbone, target, image_size, extraction, xnorm=xnorm
        )
        if export_path is not None:
            out = export_path
            if len(targets) > 1:
                out = export_path.with_name(f"{export_path.stem}.{name}{export_path.suffix}")
            save_embeddings(out, embeddings, paths)
            log.info("wrote %d embeddings to %s", len(paths), out)
    return results


def report(
    results: dict[str, dict],
    *,
    json_path: Path | None = None,
    roc_path: Path | None = None,
    flat_json: bool = False,
) -> str:
    """Print the table; write JSON (keyed by target, or flat for one target) and the ROC plot."""
    if flat_json and len(results) == 1:
        payload = to_json_dict(next(iter(results.values())))
    else:
        payload = {name: to_json_dict(r) for name, r in results.items()}
    table = print_report(format_table(results), payload, json_path)
    if roc_path is not None:
        plot_roc(results, roc_path)
        log.info("wrote %s", roc_path)
    return table


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


# ---------------------------------------------------------------------- during training


def metric_values(name: str, result: Mapping) -> dict[str, float]:
    """Scalars of one target's result as ``eval/<name>/<metric>`` (unmeasurable ones left out).

    Metrics: accuracy, auc, eer, xnorm (when present) and ``tar@far=<FAR>`` for each FAR.
    """
    values = {f"eval/{name}/{k}": float(result[k]) for k in ("accuracy", "auc", "eer")}
    if result.get("xnorm") is not None:
        values[f"eval/{name}/xnorm"] = float(result["xnorm"])
    for far, tar in result.get("tar_at_far", {}).items():
        if tar is not None:
            values[f"eval/{name}/tar@far={far}"] = float(tar)
    return values
