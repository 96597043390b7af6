"""Evaluate a backbone on verification targets and report: what train() and evaluate.py call."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from recognition.checkpoint import load_backbone_file
from recognition.config import EvalTarget
from recognition.data.pairs import Pairs, load_pairs, resolve_images
from recognition.evaluation.embeddings import (
    PathDataset,
    extract_embeddings,
    index_paths,
    save_embeddings,
    verify_pairs,
)
from recognition.evaluation.plots import plot_roc
from recognition.evaluation.verification import format_table, to_json_dict
from recognition.models import build_backbone

log = logging.getLogger(__name__)


def load_backbone(path: str | os.PathLike, device: torch.device) -> tuple[nn.Module, int]:
    """Rebuild a backbone from a backbone export or a training checkpoint.

    Returns the model in eval mode on `device` and the input size it was trained at.
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
    return target.name or Path(target.pairs).resolve().parent.name


def load_target(target: EvalTarget) -> tuple[Pairs, Path]:
    """Read a target's pairs and check that every image exists; returns (pairs, image root)."""
    pairs = load_pairs(target.pairs)
    root = Path(target.images) if target.images else Path(target.pairs).parent
    return resolve_images(pairs, root), root


def embed_pairs(
    backbone: nn.Module,
    pairs: Pairs,
    root: Path,
    image_size: int,
    *,
    batch_size: int,
    flip: bool,
    device: torch.device,
    num_workers: int = 0,
    progress: bool = True,
) -> tuple[np.ndarray, list[str]]:
    """Embeddings (N, D) of every image the pairs name, and those paths (relative to root)."""
    paths = pairs.images()
    dataset = PathDataset(paths, size=image_size, root=root)
    embeddings = extract_embeddings(
        backbone,
        dataset,
        batch_size=batch_size,
        flip=flip,
        device=device,
        num_workers=num_workers,
        progress=progress,
    )
    return embeddings, paths


def evaluate_targets(
    backbone: nn.Module,
    targets: Sequence[EvalTarget],
    image_size: int,
    *,
    batch_size: int = 128,
    flip: bool = True,
    device: torch.device | None = None,
    progress: bool = True,
    num_workers: int = 0,
    export_path: Path | None = None,
) -> dict[str, dict]:
    """Verification results {target name: metrics} of `backbone` on each target."""
    device = device or torch.device("cpu")
    results: dict[str, dict] = {}
    for target in targets:
        name = target_name(target)
        pairs, root = load_target(target)
        embeddings, paths = embed_pairs(
            backbone,
            pairs,
            root,
            image_size,
            batch_size=batch_size,
            flip=flip,
            device=device,
            num_workers=num_workers,
            progress=progress,
        )
        if export_path is not None:
            save_embeddings(export_path, embeddings, paths)
            log.info("wrote %d embeddings to %s", len(paths), export_path)
        results[name] = verify_pairs(embeddings, index_paths(paths), pairs)
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
        tmp = json_path.with_name(json_path.name + ".tmp")
        tmp.write_text(json.dumps(payload, indent=2) + "\n")
        tmp.replace(json_path)
        log.info("wrote %s", json_path)
    if roc_path is not None:
        plot_roc(results, roc_path)
        log.info("wrote %s", roc_path)
    return table
