"""A distilled run's teacher before step 1: its embeddings cached in the run directory, or
the teacher built to run alongside (train.teacher, docs/distillation.md).

`<run>/teacher/teacher.json` records which teacher the run learns from (the file's path and
SHA-256) and, when the embeddings are cached, what the table holds (views, input and
embedding sizes, the training samples' count and fingerprints, the parts it was written in).
Rank 0 decides, every rank follows (collective):

- a resumed run whose record names another teacher file (its SHA-256 differs) is refused
  in one line: its steps so far learned from the recorded one; one without a record too;
- a table whose record matches this run (same teacher, data, views, sizes) and whose parts
  are whole is reused: a resumed run computes nothing;
- otherwise the table is computed, each rank its part (the samples r, r + W, ...; one
  teacher forward per image and view, batched, without gradients, under the run's
  autocast), written beside the others, the record last; a fresh run's stale table (another
  teacher or data) is replaced, with a log line that says why.

Without a table (train.teacher_cache=false, or an augmentation `cached_views` cannot
cache) the record names the teacher alone, and the teacher is built to run at every step.
Every rank reads every part: multi-node runs need the run directory on a shared file
system, as checkpoints do.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset
from tqdm import tqdm

from recognition import distributed
from recognition.config import ExperimentConfig
from recognition.data.source import TrainSource
from recognition.data.teacher_table import (
    TABLE_DTYPE,
    TeacherInputs,
    TeacherTable,
    cached_views,
    part_path,
    part_rows,
)
from recognition.data.workers import exit_with_parent
from recognition.distributed import DistInfo
from recognition.precision import Precision
from recognition.training.distill import Distillation, make_distillation
from recognition.training.errors import TrainingError
from recognition.training.teacher import TeacherFile, build_teacher

log = logging.getLogger(__name__)

TEACHER_DIR = "teacher"
RECORD_FILE = "teacher.json"
RECORD_FORMAT = "recognition-teacher-v1"


def prepare_distillation(
    cfg: ExperimentConfig,
    dist_info: DistInfo,
    source: TrainSource,
    teacher_file: TeacherFile,
    *,
    resuming: bool,
    memory_format: torch.memory_format = torch.preserve_format,
) -> Distillation:
    """The run's `Distillation`, its table reused or computed, or its teacher built to run
    alongside (see the module docstring; collective)."""
    folder = cfg.run_dir / TEACHER_DIR
    views = cached_views(cfg.data) if cfg.train.teacher_cache else None
    wanted = None if views is None else cache_description(source, teacher_file, views)
    decision: tuple[str, str, int] = ("", "", 0)  # (action, message, parts)
    if dist_info.is_main:
        decision = _decide(folder, teacher_file, wanted, views, dist_info.world_size, resuming)
    action, message, parts = distributed.broadcast_object(decision)  # type: ignore[misc]
    if action == "refuse":
        raise TrainingError(message)
    if message:
        log.info("%s", message)
    table = None
    if views is not None:
        table = TeacherTable(folder, len(source), parts, views)
        if action == "compute":
            _compute_table(cfg, dist_info, source, teacher_file, table, wanted)
    elif dist_info.is_main and action == "record":
        _write_record(folder, teacher_file, None)
    return make_distillation(
        teacher_file, cfg.model.embedding_size, cfg.train.distill_weight, table,
        dist_info.device, memory_format, seed=cfg.seed,
    )  # fmt: skip


def cache_description(
    source: TrainSource, teacher_file: TeacherFile, views: tuple[bool, ...]
) -> dict[str, Any]:
    """What a table made for this run holds (the record's "cache", less its parts)."""
    labels = np.ascontiguousarray(np.asarray(source.labels), dtype=np.int64)
    return {
        "views": ["mirrored" if flip else "as is" for flip in views],
        "image_size": list(teacher_file.image_hw),
        "embedding_size": teacher_file.embedding_size,
        "samples": len(source),
        "labels_sha256": hashlib.sha256(labels.tobytes()).hexdigest(),
        "classes_sha256": source.classes_fingerprint(),
        "dtype": np.dtype(TABLE_DTYPE).name,
    }


def read_record(folder: Path) -> dict[str, Any] | None:
    """The record in `folder`, or None when there is none (or it is unreadable)."""
    try:
        record = json.loads((folder / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("format") == RECORD_FORMAT else None


def _decide(
    folder: Path,
    teacher: TeacherFile,
    wanted: dict[str, Any] | None,
    views: tuple[bool, ...] | None,
    world_size: int,
    resuming: bool,
) -> tuple[str, str, int]:
    """(action: refuse / record / reuse / compute, the line to log or raise, the table's
    parts) on rank 0."""
    record = read_record(folder)
    recorded = (record or {}).get("teacher", {})
    same_teacher = record is not None and recorded.get("sha256") == teacher.sha256
    if resuming and not same_teacher:
        return "refuse", _refusal(folder, teacher, record), 0
    if wanted is None or views is None:
        why = "train.teacher_cache=false or an augmentation no table can hold"
        return "record", f"train.teacher: the teacher runs alongside the student ({why})", 0
    cached = (record or {}).get("cache") or {}
    parts = int(cached.get("parts", 0) or 0)
    fits = same_teacher and {k: v for k, v in cached.items() if k != "parts"} == wanted
    if fits and parts > 0 and TeacherTable(folder, wanted["samples"], parts, views).check() is None:
        samples = wanted["samples"]
        return (
            "reuse",
            f"train.teacher: reusing the teacher's embeddings of {samples} images in {folder}",
            parts,
        )
    why = ""
    if record is not None and not same_teacher and recorded.get("path") == str(teacher.path):
        why = f" ({teacher.path} changed since they were made)"
    elif record is not None and not same_teacher:
        why = f" (they were made from another teacher file, {recorded.get('path')})"
    elif record is not None and cached:
        why = " (the data, views or sizes changed, or a part is missing)"
    message = f"train.teacher: computing the teacher's embeddings again{why}" if why else ""
    return "compute", message, world_size


def _refusal(folder: Path, teacher: TeacherFile, record: dict[str, Any] | None) -> str:
    """Why a resumed run cannot go on with `teacher`: no record, or another teacher's."""
    if record is None:
        return (
            f"train.teacher: the run in {folder.parent} has no record of a teacher "
            f"({folder / RECORD_FILE}): it was not distilled; start a new run"
        )
    recorded = record.get("teacher", {})
    then, now = str(recorded.get("sha256"))[:12], teacher.sha256[:12]
    if recorded.get("path") == str(teacher.path):
        what = (
            f"{teacher.path} changed since the run started (SHA-256 {then}... then, {now}... now)"
        )
    else:
        what = (
            f"{teacher.path} (SHA-256 {now}...) is not the teacher this run learned from "
            f"({recorded.get('path')}, SHA-256 {then}...)"
        )
    return f"train.teacher: {what}; resume with the run's teacher file, or start a new run"


def _compute_table(
    cfg: ExperimentConfig,
    dist_info: DistInfo,
    source: TrainSource,
    teacher_file: TeacherFile,
    table: TeacherTable,
    wanted: dict[str, Any] | None,
) -> None:
    """Compute this rank's part of `table`, then rank 0 writes the record (collective)."""
    folder = table.folder
    if dist_info.is_main:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    distributed.barrier()
    start = time.perf_counter()
    views = " and ".join(wanted["views"]) if wanted else ""
    log.info(
        "train.teacher: embedding %d images (%s) at %dx%d with %s into %s",
        len(source), views, *teacher_file.image_hw, teacher_file.path, folder,
    )  # fmt: skip
    teacher = build_teacher(teacher_file, dist_info.device)
    precision = Precision(cfg.precision.level, cfg.precision.dtype, dist_info.device)
    write_part(
        teacher, teacher_file, source, table, dist_info.rank, precision,
        batch_size=cfg.train.batch_size, num_workers=cfg.data.num_workers,
        progress=cfg.train.progress and dist_info.is_main,
    )  # fmt: skip
    del teacher
    distributed.barrier()
    if dist_info.is_main:
        _write_record(folder, teacher_file, {**(wanted or {}), "parts": table.world_size})
    distributed.barrier()
    log.info("train.teacher: embeddings written in %.1f s", time.perf_counter() - start)


@torch.no_grad()
def write_part(
    teacher: nn.Module,
    teacher_file: TeacherFile,
    source: TrainSource,
    table: TeacherTable,
    rank: int,
    precision: Precision,
    *,
    batch_size: int,
    num_workers: int = 0,
    progress: bool = False,
) -> None:
    """Embed part `rank` of `table`'s samples with `teacher` at its input size (every view:
    the image as is, and mirrored where the table holds it), L2-normalised, into the part's
    file (written beside it, then renamed)."""
    device = precision.device
    indices = part_rows(table.num_samples, rank, table.world_size)
    path = part_path(table.folder, rank, table.world_size)
    tmp = path.with_name(f".{path.name}.tmp")
    shape = (len(indices), len(table.flips), teacher_file.embedding_size)
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=TABLE_DTYPE, shape=shape)
    loader = DataLoader(
        Subset(TeacherInputs(source, teacher_file.image_hw), indices.tolist()),
        batch_size=batch_size,
        num_workers=num_workers,
        worker_init_fn=exit_with_parent if num_workers else None,
        pin_memory=device.type == "cuda",
        # Its own generator: the pass draws nothing from the run's random streams.
        generator=torch.Generator(),
    )
    row = 0
    for images in tqdm(loader, desc="train.teacher", unit="batch", disable=not progress):
        images = images.to(device, non_blocking=True)
        for view, flip in enumerate(table.flips):
            with precision.autocast():
                embeddings = teacher(images.flip(-1) if flip else images)  # (B, D)
            out[row : row + len(images), view] = F.normalize(embeddings.float(), dim=1).cpu()
        row += len(images)
    out.flush()
    del out
    os.replace(tmp, path)


def _write_record(folder: Path, teacher: TeacherFile, cache: dict[str, Any] | None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "format": RECORD_FORMAT,
        "teacher": {"path": str(teacher.path), "sha256": teacher.sha256},
        "cache": cache,
    }
    tmp = folder / f".{RECORD_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, folder / RECORD_FILE)
