"""Evaluate a backbone and report: verification targets (pairs files, .bin), re-id ranking,
embedding export, and the periodic evaluation that train() runs; what evaluate.py calls."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from recognition import checkpoint as ckpt
from recognition import distributed
from recognition.checkpoint import load_backbone_file
from recognition.config import EvalTarget, ExperimentConfig
from recognition.data.insightface_bin import BinDataset, load_bin
from recognition.data.market1501 import list_folder, parse_name
from recognition.data.pairs import IMAGE_EXTENSIONS, Pairs, load_pairs, resolve_images
from recognition.distributed import DistInfo
from recognition.evaluation.embeddings import (
    PathDataset,
    extract_embeddings,
    index_paths,
    save_embeddings,
    verify_pairs,
)
from recognition.evaluation.plots import plot_roc
from recognition.evaluation.reid import format_reid_table, rank_gallery
from recognition.evaluation.verification import (
    evaluate_verification,
    format_table,
    to_json_dict,
)
from recognition.logging import MetricsWriter
from recognition.models import build_backbone

log = logging.getLogger(__name__)


def load_backbone(
    path: str | os.PathLike, device: torch.device
) -> tuple[nn.Module, int | tuple[int, int]]:
    """Rebuild a backbone from a backbone export or a training checkpoint.

    Returns the model in eval mode on `device` and the input size it was trained at (a
    square side or (H, W)).
    """
    model_cfg, image_size, state = load_backbone_file(Path(path))
    backbone = build_backbone(
        model_cfg["backbone"],
        embedding_size=model_cfg["embedding_size"],
        width=model_cfg.get("width", 1.0),
        dropout=model_cfg.get("dropout", 0.0),
        image_size=image_size,
    )
    try:
        backbone.load_state_dict(state)
    except RuntimeError as exc:
        raise ValueError(f"checkpoint {path}: weights do not fit the backbone: {exc}") from exc
    return backbone.float().eval().to(device), image_size


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


def evaluate_config_targets(
    cfg: ExperimentConfig,
    model: nn.Module,
    device: torch.device,
    *,
    progress: bool,
    xnorm: bool = False,
) -> dict[str, dict]:
    """`evaluate_targets` on ``cfg.eval.targets`` with the config's evaluation settings.

    `model`: a float32 backbone in eval mode (during training, a copy of the backbone, which
    may be held in half precision and must keep its own mode). Returns {target: metrics}.
    """
    return evaluate_targets(
        model,
        cfg.eval.targets,
        cfg.eval.image_size or cfg.data.image_size,
        batch_size=cfg.eval.batch_size,
        flip=cfg.eval.flip,
        device=device,
        progress=progress,
        xnorm=xnorm,
    )


def check_targets(targets: Sequence[EvalTarget]) -> None:
    """Fail now, not hours into training, when a target's files are missing or malformed.

    Reads every pairs file and checks its images exist; checks every ``.bin`` file exists
    (it is read in full only when evaluated). Raises FileNotFoundError / ValueError naming
    the file and line.
    """
    for target in targets:
        if target.bin is not None:
            if not Path(target.bin).is_file():
                raise FileNotFoundError(f"eval target {target.label}: {target.bin} not found")
        else:
            load_target(target)


def check_training_targets(cfg: ExperimentConfig, dist_info: DistInfo) -> None:
    """Collective: rank 0 checks the targets training will evaluate; every rank raises on error.

    Raises ValueError ``"eval.targets: ..."`` naming the missing or malformed file.
    """
    if not cfg.eval.targets or not (cfg.eval.every_steps or cfg.eval.at_end):
        return
    error = None
    if dist_info.is_main:
        try:
            check_targets(cfg.eval.targets)
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
    *,
    batch_size: int = 128,
    flip: bool = True,
    device: torch.device | None = None,
    progress: bool = True,
    num_workers: int = 0,
    xnorm: bool = False,
) -> tuple[dict, np.ndarray, list[str]]:
    """Verification of `backbone` on one target (a pairs file or a .bin).

    Returns (metrics, embeddings (N, D), their paths): for pairs the image paths relative to
    the image root, for a .bin ``"<file name>/<index>"``. With ``xnorm`` the metrics hold
    ``xnorm``, the mean norm of the raw embeddings of the (unflipped) images.
    """
    device = device or torch.device("cpu")
    common = {
        "batch_size": batch_size,
        "flip": flip,
        "device": device,
        "num_workers": num_workers,
        "progress": progress,
        "return_norms": True,
    }
    if target.bin is not None:
        bin_pairs = load_bin(target.bin)
        dataset = BinDataset(bin_pairs, size=image_size, crop=target.crop)
        embeddings, norms = extract_embeddings(backbone, dataset, **common)
        paths = [f"{Path(target.bin).name}/{i}" for i in range(len(dataset))]
        results = verify_consecutive(embeddings, bin_pairs.issame)
    else:
        pairs, root = load_target(target)
        paths = pairs.images()
        dataset = PathDataset(paths, size=image_size, root=root, crop=target.crop)
        embeddings, norms = extract_embeddings(backbone, dataset, **common)
        results = verify_pairs(embeddings, index_paths(paths), pairs)
    if xnorm:
        results["xnorm"] = float(np.mean(norms, dtype=np.float64))
    return results, embeddings, paths


def evaluate_targets(
    backbone: nn.Module,
    targets: Sequence[EvalTarget],
    image_size: int | tuple[int, int],
    *,
    batch_size: int = 128,
    flip: bool = True,
    device: torch.device | None = None,
    progress: bool = True,
    num_workers: int = 0,
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
            backbone,
            target,
            image_size,
            batch_size=batch_size,
            flip=flip,
            device=device,
            progress=progress,
            num_workers=num_workers,
            xnorm=xnorm,
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
    table = format_table(results)
    print(table, flush=True)
    if json_path is not None:
        if flat_json and len(results) == 1:
            payload = to_json_dict(next(iter(results.values())))
        else:
            payload = {name: to_json_dict(r) for name, r in results.items()}
        json_path.parent.mkdir(parents=True, exist_ok=True)
        write_json(json_path, payload)
        log.info("wrote %s", json_path)
    if roc_path is not None:
        plot_roc(results, roc_path)
        log.info("wrote %s", roc_path)
    return table


def write_json(path: Path, payload: object) -> None:
    """Write ``payload`` as indented JSON, atomically (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)


REID_FOLDERS = ("query", "bounding_box_test")
"""Market-1501's probe and gallery folders under the data set root."""


def reid_from_embeddings(embeddings: np.ndarray, paths: Sequence[str], source: str) -> dict:
    """CMC / mAP from embeddings whose paths are ``query/<name>`` and ``bounding_box_test/<name>``.

    Ids and cameras come from the Market-1501 file names. ``source`` names the embeddings in
    errors. Returns :func:`recognition.evaluation.reid.rank_gallery`'s dict.
    """
    rows: dict[str, list[int]] = {folder: [] for folder in REID_FOLDERS}
    for i, path in enumerate(paths):
        folder = Path(path).parts[0] if Path(path).parts else ""
        if folder in rows:
            rows[folder].append(i)
    for folder, indices in rows.items():
        if not indices:
            raise ValueError(
                f"{source}: no embedding of a {folder}/ image (re-id needs paths "
                f"{REID_FOLDERS[0]}/<name> and {REID_FOLDERS[1]}/<name>)"
            )
    parsed = {f: np.array([parse_name(paths[i]) for i in rows[f]]) for f in REID_FOLDERS}
    query, gallery = (np.asarray(rows[f]) for f in REID_FOLDERS)
    return rank_gallery(
        embeddings[query],
        parsed["query"][:, 0],
        parsed["query"][:, 1],
        embeddings[gallery],
        parsed["bounding_box_test"][:, 0],
        parsed["bounding_box_test"][:, 1],
    )


def evaluate_reid(
    backbone: nn.Module,
    root: Path,
    image_size: int | tuple[int, int],
    *,
    batch_size: int = 128,
    flip: bool = True,
    device: torch.device | None = None,
    progress: bool = True,
    num_workers: int = 0,
    export_path: Path | None = None,
) -> dict:
    """Re-id ranking of `backbone` on a Market-1501-style ``root`` (query/ and gallery folders).

    Returns :func:`recognition.evaluation.reid.rank_gallery`'s dict; with ``export_path``
    writes the embeddings with paths ``query/<name>``, ``bounding_box_test/<name>``.
    """
    paths: list[str] = []
    for folder in REID_FOLDERS:
        listing = list_folder(root / folder)
        paths += [f"{folder}/{name}" for name in listing.paths]
    embeddings = extract_embeddings(
        backbone,
        PathDataset(paths, size=image_size, root=root),
        batch_size=batch_size,
        flip=flip,
        device=device or torch.device("cpu"),
        num_workers=num_workers,
        progress=progress,
    )
    if export_path is not None:
        save_embeddings(export_path, embeddings, paths)
        log.info("wrote %d embeddings to %s", len(paths), export_path)
    return reid_from_embeddings(embeddings, paths, str(root))


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
    *,
    batch_size: int = 128,
    flip: bool = True,
    device: torch.device | None = None,
    progress: bool = True,
    num_workers: int = 0,
    crop: int | None = None,
) -> int:
    """Embed every image under ``root`` and write ``out`` (.npz: embeddings, relative paths).

    Returns the number of images.
    """
    paths = list_images(root)
    embeddings = extract_embeddings(
        backbone,
        PathDataset(paths, size=image_size, root=root, crop=crop),
        batch_size=batch_size,
        flip=flip,
        device=device or torch.device("cpu"),
        num_workers=num_workers,
        progress=progress,
    )
    save_embeddings(out, embeddings, paths)
    log.info("wrote %d embeddings to %s", len(paths), out)
    return len(paths)


def report_reid(results: dict[str, dict], *, json_path: Path | None = None) -> str:
    """Print the re-id table; write JSON (flat for one target, else keyed by target)."""
    table = format_reid_table(results)
    print(table, flush=True)
    if json_path is not None:
        payload = next(iter(results.values())) if len(results) == 1 else results
        write_json(json_path, to_json_dict(payload))
        log.info("wrote %s", json_path)
    return table


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


class PeriodicEvaluation:
    """Verification every ``eval.every_steps`` optimizer steps, and the best backbone kept.

    Call :meth:`due` every step and :meth:`run` (on every rank: it is collective) when it is
    true. Rank 0 evaluates a float copy of the backbone on ``eval.targets`` while the other
    ranks wait for its answer, so one evaluation must take less than ``train.timeout_s``.
    The scalars go to metrics.jsonl (one record ``{"step", "epoch", "eval/<target>/..."}``)
    and TensorBoard. When ``eval.best_metric`` improved, rank 0 writes ``best_backbone.pt``
    (a backbone export) and then ``best.json`` (``step``, ``metric``, ``value``), each
    atomically; an existing best.json (a resumed run) is the value to beat.
    """

    def __init__(self, cfg: ExperimentConfig, dist_info: DistInfo, metrics: MetricsWriter):
        self.cfg = cfg
        self.dist_info = dist_info
        self.metrics = metrics
        self.run_dir = cfg.run_dir
        self.best_value: float | None = None
        best_metric = cfg.eval.best_metric
        self.lower_is_better = best_metric is not None and best_metric.endswith("/eer")
        best_file = self.run_dir / "best.json"
        if dist_info.is_main and best_metric is not None and best_file.is_file():
            try:
                saved = json.loads(best_file.read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"{best_file}: not valid JSON ({exc})") from exc
            if saved.get("metric") == best_metric:
                self.best_value = float(saved["value"])

    def due(self, step: int) -> bool:
        every = self.cfg.eval.every_steps
        return bool(every and self.cfg.eval.targets and step % every == 0)

    def run(self, step: int, epoch: int, backbone: nn.Module) -> dict[str, dict] | None:
        """Evaluate (rank 0) and wait for it (every rank). Returns rank 0's results, else None.

        An error on rank 0 (a missing image) is raised on every rank, not left to the timeout.
        """
        results, error = None, None
        if self.dist_info.is_main:
            try:
                results = self._evaluate(step, epoch, backbone)
            except (ValueError, FileNotFoundError) as exc:
                error = f"evaluation at step {step} failed: {exc}"
        # The broadcast doubles as the barrier the other ranks wait at.
        error = distributed.broadcast_object(error)
        if error is not None:
            raise ValueError(error)
        return results

    def _evaluate(self, step: int, epoch: int, backbone: nn.Module) -> dict[str, dict]:
        cfg = self.cfg
        device = self.dist_info.device
        model = copy.deepcopy(backbone).float().eval()
        # Evaluation must not move the training's random streams (a DataLoader draws a seed
        # from the global generator), or a run with evaluation would train differently.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            results = evaluate_config_targets(cfg, model, device, progress=False, xnorm=True)
        values: dict[str, float] = {}
        for name, result in results.items():
            values.update(metric_values(name, result))
        self.metrics.log(step, {"epoch": epoch, **values}, prefix=None)
        log.info(
            "step %d eval: %s",
            step,
            ", ".join(f"{n} accuracy {100 * r['accuracy']:.2f}%" for n, r in results.items()),
        )
        if cfg.eval.best_metric is not None:
            self._keep_best(step, values, model)
        return results

    def _keep_best(self, step: int, values: dict[str, float], model: nn.Module) -> None:
        metric = self.cfg.eval.best_metric
        assert metric is not None
        value = values.get(f"eval/{metric}")
        if value is None:
            log.warning("step %d: eval.best_metric %s could not be measured", step, metric)
            return
        best = self.best_value
        if best is not None and (value >= best if self.lower_is_better else value <= best):
            return
        self.best_value = value
        ckpt.export_backbone(
            self.run_dir / "best_backbone.pt",
            model,
            dataclasses.asdict(self.cfg.model),
            self.cfg.data.image_size,
        )
        write_json(self.run_dir / "best.json", {"step": step, "metric": metric, "value": value})
        log.info("step %d: new best %s = %.6g, wrote best_backbone.pt", step, metric, value)
