"""Resuming: which checkpoint, restoring the parts, where in the epoch, the same classes."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from recognition import checkpoint as ckpt
from recognition import distributed
from recognition.config import ExperimentConfig
from recognition.training.build import Run, TrainingError, global_batch
from recognition.training.state import _HeadWithoutExtraState, seed_everything

log = logging.getLogger(__name__)


def resume_path(cfg: ExperimentConfig, run_dir: Path) -> Path | None:
    """Which checkpoint to resume from, refusing to overwrite an earlier run by accident.

    Rank 0 decides and tells the others (collective), so that every rank loads the same
    checkpoint even if a file system shows them different listings; an error is raised on
    every rank.
    """
    decision: tuple[str | None, str | None] = (None, None)  # (path, error)
    if distributed.rank() == 0:
        try:
            path = _pick_checkpoint(cfg.train.resume, run_dir)
            decision = (str(path) if path is not None else None, None)
        except TrainingError as exc:
            decision = (None, str(exc))
    path_text, error = distributed.broadcast_object(decision)  # type: ignore[misc]
    if error is not None:
        raise TrainingError(error)
    return Path(path_text) if path_text is not None else None


def resume(run: Run, path: Path) -> None:
    """Restore every part of `run` from the checkpoint at `path` (collective).

    The classes must be those of the checkpoint; the position in the epoch is carried over
    as samples of the epoch, so it holds on another number of ranks; the RNG streams are
    restored when the world size is the same, else every rank starts a fresh one.
    """
    cfg, dist_info = run.cfg, run.dist_info
    saved = ckpt.read_checkpoint(path, ["progress", "meta"])
    _check_same_classes(saved.get("meta"), run, path)
    if dist_info.is_main and not (run.run_dir / "classes.txt").exists():
        run.data.write_classes(run.run_dir / "classes.txt")
    parts = run.checkpoint_parts()
    del parts["meta"]
    rng_key = f"rng/{dist_info.rank}"
    same_world = saved["progress"]["world_size"] == dist_info.world_size
    if not same_world:
        del parts[rng_key]
    if ckpt.checkpoint_version(path) == 1 and run.head is not None:
        parts["head"] = _HeadWithoutExtraState(run.head, saved)
    loaded = ckpt.load_checkpoint(path, parts, optional=(rng_key,))
    if rng_key not in loaded:
        # Other ranks, other random streams: each rank starts a fresh one of its own.
        seed_everything(cfg.seed + dist_info.rank + 100_003 * run.progress.step)
    run.progress.batches_done = _resume_position(run.progress.saved, run, path)
    log.info(
        "resumed from %s at step %d (epoch %d, batch %d), saved by %d rank(s)",
        path,
        run.progress.step,
        run.progress.epoch,
        run.progress.batches_done,
        run.progress.saved["world_size"],
    )


def _resume_position(saved: dict[str, int], run: Run, path: Path) -> int:
    """This rank's batches done in the epoch, from a checkpoint saved on any number of ranks.

    The checkpoint counts the epoch's samples consumed over all ranks; with W' ranks of
    batch B' the run goes on from sample samples_done / (B' * W') of each rank's slice of the
    same permutation, i.e. with exactly the samples the saved run had not seen yet, as long
    as the global batch is unchanged. Otherwise it rounds down to a whole batch and warns.
    """
    cfg, world_size = run.cfg, run.data_parallel_size
    per_batch = cfg.train.batch_size * world_size
    samples_done = saved["samples_done"]
    if saved["global_batch"] != global_batch(cfg, world_size) or samples_done % per_batch:
        log.warning(
            "%s was saved with a global batch of %d, this run has %d (train.batch_size x "
            "train.accumulate_steps x data-parallel ranks): the learning-rate schedule and "
            "the epoch's remaining samples will not continue exactly",
            path,
            saved["global_batch"],
            global_batch(cfg, world_size),
        )
    return samples_done // per_batch


def _check_same_classes(meta: dict[str, Any] | None, run: Run, path: Path) -> None:
    """Refuse to resume a checkpoint whose classes (names in label order) differ from ours.

    Checkpoints store the number of classes and the SHA-256 of their names (older ones the
    names themselves); the names are in the run directory's classes.txt.
    """
    if not isinstance(meta, dict):
        return
    num_classes = run.num_classes
    saved = meta.get("classes_sha256")
    if saved is None and isinstance(meta.get("classes"), list):
        digest = hashlib.sha256()
        for name in meta["classes"]:
            digest.update(str(name).encode("utf-8", "surrogateescape") + b"\n")
        saved = digest.hexdigest()
    if meta.get("num_classes") not in (None, num_classes) or (
        saved is not None and saved != run.classes_sha256
    ):
        raise TrainingError(
            f"{path} was trained on {meta.get('num_classes')} classes whose names differ from "
            f"the {num_classes} of data.root now: the labels would not mean the same. The "
            f"checkpoint's class names are in {run.run_dir / 'classes.txt'} as it was written; "
            "train on the same data or start a new run"
        )


def _newest_readable(run_dir: Path) -> Path:
    """The newest checkpoint of `run_dir` whose files are whole; damaged newer ones are
    skipped with a warning (a restart must not fail forever on one bad checkpoint)."""
    found = ckpt.list_checkpoints(run_dir)
    problems = []
    for path in reversed(found):
        problem = ckpt.verify_checkpoint(path)
        if problem is None:
            if problems:
                log.warning("resuming from %s, the newest whole checkpoint", path)
            return path
        log.warning("checkpoint %s is damaged (%s): skipping it", path, problem)
        problems.append(f"{path.name}: {problem}")
    raise TrainingError(
        f"train.resume: every checkpoint in {run_dir / 'checkpoints'} is damaged ("
        + "; ".join(problems)
        + "); move them aside to start over"
    )


def _pick_checkpoint(resume: bool | str, run_dir: Path) -> Path | None:
    latest = ckpt.latest_checkpoint(run_dir)
    if resume is False:
        if latest is not None:
            raise TrainingError(
                f"{run_dir} already holds a run ({latest.name}); resume it with "
                f"train.resume=true (or auto), start elsewhere with output_dir=..., or remove "
                f"{run_dir}"
            )
        return None
    if resume is True or resume == "auto":
        if latest is None and resume is True:
            raise TrainingError(
                f"train.resume: no checkpoint in {run_dir / 'checkpoints'} to resume from"
            )
        return _newest_readable(run_dir) if latest is not None else None
    path = Path(resume)
    if ckpt.is_checkpoint(path):
        if (problem := ckpt.verify_checkpoint(path)) is not None:
            raise TrainingError(f"train.resume: {path} is damaged: {problem}")
        return path
    if path.is_dir() and ckpt.latest_checkpoint(path) is not None:
        return _newest_readable(path)  # a run directory: its latest whole checkpoint
    raise TrainingError(
        f"train.resume: {path} is neither a checkpoint directory (holding .metadata) nor a "
        "run directory with checkpoints"
    )
