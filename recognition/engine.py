"""The training loop: `train(cfg)` reads top to bottom; `train_step()` is one optimizer step.

Sections of `train`: setup, data, model and head, precision and optimizer, schedule,
resume, the loop (forward/backward, step, log, checkpoint), final export and evaluation.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from recognition import checkpoint as ckpt
from recognition import distributed
from recognition.config import ExperimentConfig, config_to_dict, save_config
from recognition.data.image_folder import ImageFolderDataset
from recognition.data.sampler import AugmentedView, ResumableSampler
from recognition.data.synthetic import SyntheticSpec, ensure_synthetic_dataset
from recognition.distributed import DistInfo
from recognition.heads import ShardedMarginSoftmax, build_margin
from recognition.logging import MetricsWriter, setup_logging
from recognition.models import build_backbone
from recognition.optim import build_optimizer, build_scheduler, param_groups
from recognition.precision import Precision

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite losses, a run directory that would be overwritten)."""


@dataclass
class StepResult:
    loss: float
    """Mean loss over the step's micro-batches (not divided by their number)."""
    finite: bool
    """False when a micro-batch's loss was NaN or inf: nothing was applied."""
    stepped: bool
    """False when the optimizer step was skipped (non-finite loss or fp16 overflow)."""
    grad_norm: float
    scale: float


def train_step(
    backbone: nn.Module,
    head: ShardedMarginSoftmax,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    max_grad_norm: float | None,
) -> StepResult:
    """One optimizer step over `micro_batches` (gradient accumulation when more than one).

    Each micro-batch's loss is divided by their number before backward, so the gradient is
    that of the mean loss over all of them. A non-finite loss skips the whole step: the
    accumulated gradients are dropped and no parameter or optimizer state changes.
    """
    num_micro = len(micro_batches)
    precision.zero_grad(optimizer)
    losses = []
    for images, labels in micro_batches:
        with precision.autocast():
            embeddings = backbone(precision.cast_inputs(images))  # (B, D)
            loss = head(embeddings, labels)  # same scalar on every rank
        if not torch.isfinite(loss):
            precision.zero_grad(optimizer)
            return StepResult(
                float(loss.detach()),
                finite=False,
                stepped=False,
                grad_norm=float("nan"),
                scale=_scale(precision),
            )
        precision.backward(loss / num_micro)
        losses.append(loss.detach().float())
    result = precision.step(optimizer, max_grad_norm)
    mean_loss = float(torch.stack(losses).mean())
    return StepResult(
        mean_loss,
        finite=True,
        stepped=result.stepped,
        grad_norm=float(result.grad_norm),
        scale=float(result.scale),
    )


def train(cfg: ExperimentConfig) -> Path:
    """Train as `cfg` says; returns the run directory."""
    # ------------------------------------------------------------------ setup
    dist_info = distributed.init_distributed(cfg.train.device)
    run_dir = cfg.run_dir
    resume_path = _resume_path(cfg, run_dir)
    setup_logging(run_dir, dist_info)
    _seed_everything(cfg.seed + dist_info.rank)
    device = dist_info.device
    log.info("run directory %s, device %s, world size %d", run_dir, device, dist_info.world_size)

    # ------------------------------------------------------------------ data
    if cfg.data.synthetic.enabled:
        if dist_info.is_main:
            ensure_synthetic_dataset(Path(cfg.data.synthetic.root), _synthetic_spec(cfg))
        distributed.barrier()
    base = ImageFolderDataset(cfg.data.root, cfg.data.image_size, train=False)
    dataset = AugmentedView(base, flip=cfg.data.flip)
    sampler = ResumableSampler(
        len(base), num_replicas=dist_info.world_size, rank=dist_info.rank, seed=cfg.seed
    )
    loader = DataLoader(
        dataset,
        batch_size=cfg.train.batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=cfg.data.num_workers,
        pin_memory=device.type == "cuda",
        persistent_workers=False,
        # Its own generator: creating an epoch's iterator must not draw from the global RNG,
        # or a run resumed mid-epoch would see different dropout / sampling draws.
        generator=torch.Generator().manual_seed(cfg.seed + dist_info.rank),
    )
    num_classes = base.num_classes
    batches_per_epoch = len(sampler) // cfg.train.batch_size
    steps_per_epoch = batches_per_epoch // cfg.train.accumulate_steps
    if steps_per_epoch < 1:
        raise TrainingError(
            f"train.batch_size: {cfg.train.batch_size} x train.accumulate_steps "
            f"{cfg.train.accumulate_steps} x {dist_info.world_size} processes is more than "
            f"the {len(base)} training images of {cfg.data.root}"
        )
    log.info(
        "%d images of %d identities from %s; %d steps per epoch",
        len(base),
        num_classes,
        cfg.data.root,
        steps_per_epoch,
    )
    if dist_info.is_main:
        save_config(cfg, run_dir / "config.yaml")
        (run_dir / "classes.txt").write_text("\n".join(base.classes) + "\n")

    # ------------------------------------------------------------------ model and head
    backbone = build_backbone(
        cfg.model.backbone,
        embedding_size=cfg.model.embedding_size,
        width=cfg.model.width,
        dropout=cfg.model.dropout,
        image_size=cfg.data.image_size,
    ).to(device)
    margin = build_margin(
        cfg.head.margin,
        scale=cfg.head.scale,
        m=cfg.head.m,
        m1=cfg.head.m1,
        m2=cfg.head.m2,
        m3=cfg.head.m3,
    )
    head = ShardedMarginSoftmax(
        num_classes,
        cfg.model.embedding_size,
        margin,
        sample_rate=cfg.head.sample_rate,
        chunk_size=cfg.head.chunk_size,
        seed=cfg.seed,
    ).to(device)

    # ------------------------------------------------------------------ precision and optimizer
    precision = Precision(cfg.precision.level, cfg.precision.dtype, device)
    precision.prepare(backbone, head)
    groups = param_groups([backbone, head], cfg.optim.weight_decay)
    optimizer = build_optimizer(precision.param_groups(groups), cfg.optim)
    # Partial FC: the optimizer must only move the class rows sampled for the step (under
    # O2 it steps the fp32 master of the head's weight, not the half weight itself).
    head_master = next((m for _, p, m in precision.masters() if p is head.weight), None)
    head.attach_optimizer(optimizer, head_master)

    # ------------------------------------------------------------------ schedule
    total_steps = cfg.train.epochs * steps_per_epoch
    warmup_steps = round(cfg.optim.warmup_epochs * steps_per_epoch)
    scheduler = build_scheduler(optimizer, total_steps, warmup_steps, cfg.optim)
    last_step = min(total_steps, cfg.train.max_steps or total_steps)

    # ------------------------------------------------------------------ resume
    step, epoch, batches_done = 0, 0, 0
    if resume_path is not None:
        state = ckpt.load_file(resume_path)
        backbone.load_state_dict(state["backbone"])
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        precision.load_state_dict(state["precision"])
        scheduler.load_state_dict(state["scheduler"])
        ckpt.set_rng_state(state["rng"])
        head.sampling_step = state["head_sampling_step"]
        step, epoch, batches_done = state["step"], state["epoch"], state["batches_done"]
        log.info(
            "resumed from %s at step %d (epoch %d, batch %d)",
            resume_path,
            step,
            epoch,
            batches_done,
        )

    def save(step: int, epoch: int, batches_done: int) -> None:
        if not dist_info.is_main:
            return
        state = {
            "config": config_to_dict(cfg),
            "step": step,
            "epoch": epoch,
            "batches_done": batches_done,
            "backbone": backbone.state_dict(),
            "head": head.state_dict(),
            "optimizer": optimizer.state_dict(),
            "precision": precision.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": ckpt.rng_state(),
            "head_sampling_step": head.sampling_step,
            "classes": list(base.classes),
        }
        ckpt.save_checkpoint(run_dir, step, state, keep=cfg.train.keep_checkpoints)

    # ------------------------------------------------------------------ the loop
    metrics = MetricsWriter(run_dir, dist_info)
    window = _Window()
    nonfinite_in_a_row = 0
    samples_per_step = cfg.train.batch_size * cfg.train.accumulate_steps
    log.info(
        "training %s for %d steps (%d epochs x %d steps), precision %s/%s",
        cfg.model.backbone,
        last_step,
        cfg.train.epochs,
        steps_per_epoch,
        cfg.precision.level,
        cfg.precision.dtype,
    )
    try:
        while step < last_step:
            sampler.set_epoch(epoch, start=batches_done * cfg.train.batch_size)
            bar = tqdm(
                total=steps_per_epoch,
                initial=batches_done // cfg.train.accumulate_steps,
                desc=f"epoch {epoch}",
                disable=not (cfg.train.progress and dist_info.is_main),
                leave=False,
                dynamic_ncols=True,
            )
            for micro_batches in _grouped(loader, cfg.train.accumulate_steps):
                micro_batches = [
                    (x.to(device, non_blocking=True), y.to(device, non_blocking=True))
                    for x, y in micro_batches
                ]
                result = train_step(
                    backbone, head, micro_batches, optimizer, precision, cfg.optim.grad_clip
                )
                batches_done += len(micro_batches)
                bar.update(1)
                if not result.finite:
                    nonfinite_in_a_row += 1
                    log.warning(
                        "step %d: non-finite loss %s, step skipped (%d in a row)",
                        step,
                        result.loss,
                        nonfinite_in_a_row,
                    )
                    if nonfinite_in_a_row >= cfg.train.max_nonfinite_steps:
                        raise TrainingError(
                            f"stopping: {nonfinite_in_a_row} non-finite losses in a row at step "
                            f"{step} (train.max_nonfinite_steps); lower optim.lr, enable "
                            "optim.grad_clip or use precision.level=O0/O1. The last checkpoint "
                            f"in {run_dir / 'checkpoints'} is intact."
                        )
                    continue
                nonfinite_in_a_row = 0
                scheduler.step()
                step += 1
                window.add(result, samples_per_step)
                if step % cfg.train.log_every == 0 or step == last_step:
                    values = window.flush(dist_info)
                    values.update(epoch=epoch, lr=optimizer.param_groups[0]["lr"])
                    metrics.log(step, values)
                    bar.set_postfix(loss=f"{values['loss']:.3f}")
                    log.info(
                        "step %d/%d epoch %d loss %.4f lr %.4g %.1f samples/s",
                        step,
                        last_step,
                        epoch,
                        values["loss"],
                        values["lr"],
                        values["samples_per_sec"],
                    )
                end_of_epoch = batches_done >= steps_per_epoch * cfg.train.accumulate_steps
                every = cfg.train.checkpoint_every
                if (every and step % every == 0) or step == last_step:
                    save(step, epoch, batches_done)
                elif end_of_epoch and every is None:
                    save(step, epoch + 1, 0)
                if step >= last_step or end_of_epoch:
                    break
            bar.close()
            if batches_done >= steps_per_epoch * cfg.train.accumulate_steps:
                epoch, batches_done = epoch + 1, 0
    finally:
        metrics.close()

    # ------------------------------------------------------------------ export and evaluation
    if dist_info.is_main:
        ckpt.export_backbone(
            run_dir / "backbone.pt", backbone, dataclasses.asdict(cfg.model), cfg.data.image_size
        )
        log.info("wrote %s", run_dir / "backbone.pt")
        if cfg.eval.at_end and cfg.eval.targets:
            from recognition.evaluation.run import evaluate_targets, report

            eval_backbone = _float_copy(backbone)
            results = evaluate_targets(
                eval_backbone,
                cfg.eval.targets,
                cfg.data.image_size,
                batch_size=cfg.eval.batch_size,
                flip=cfg.eval.flip,
                device=device,
                progress=cfg.train.progress,
            )
            report(results, json_path=run_dir / "eval.json", roc_path=run_dir / "roc.png")
    distributed.barrier()
    return run_dir


# ---------------------------------------------------------------------- helpers


class _Window:
    """Accumulates step results between two log lines."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.samples = 0
        self.skipped = 0
        self.scale = 1.0
        self.start = time.perf_counter()

    def add(self, result: StepResult, samples: int) -> None:
        self.losses.append(result.loss)
        if math.isfinite(result.grad_norm):
            self.grad_norms.append(result.grad_norm)
        self.samples += samples
        self.skipped += int(not result.stepped)
        self.scale = result.scale

    def flush(self, dist_info: DistInfo) -> dict[str, Any]:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        values = {
            # The loss is already identical on every rank (the head reduces over the global
            # batch); the mean keeps the contract should a head ever differ per rank.
            "loss": distributed.all_reduce_mean(float(np.mean(self.losses))),
            "samples_per_sec": distributed.all_reduce_sum(self.samples / elapsed),
            "grad_norm": float(np.mean(self.grad_norms)) if self.grad_norms else float("nan"),
            "skipped_steps": self.skipped,
            "loss_scale": self.scale,
        }
        self.reset()
        return values


def _grouped(loader: Iterable, size: int) -> Iterator[list]:
    """Yield lists of `size` consecutive batches; a trailing incomplete group is dropped."""
    group: list = []
    for batch in loader:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []


def _scale(precision: Precision) -> float:
    scaler = getattr(precision, "scaler", None)
    return float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _float_copy(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module).float().eval()


def _synthetic_spec(cfg: ExperimentConfig) -> SyntheticSpec:
    s = cfg.data.synthetic
    return SyntheticSpec(
        num_identities=s.num_identities,
        images_per_identity=s.images_per_identity,
        num_val_identities=s.num_val_identities,
        val_images_per_identity=s.val_images_per_identity,
        num_folds=s.num_folds,
        pairs_per_fold=s.pairs_per_fold,
        image_size=s.image_size,
        seed=s.seed,
    )


def _resume_path(cfg: ExperimentConfig, run_dir: Path) -> Path | None:
    """Which checkpoint to resume from, refusing to overwrite an earlier run by accident."""
    resume = cfg.train.resume
    latest = ckpt.latest_checkpoint(run_dir)
    if resume is False:
        if latest is not None:
            raise TrainingError(
                f"{run_dir} already holds a run ({latest.name}); resume it with "
                f"train.resume=true, start elsewhere with output_dir=..., or remove {run_dir}"
            )
        return None
    if resume is True or resume == "auto":
        if latest is None and resume is True:
            raise TrainingError(
                f"train.resume: no checkpoint in {run_dir / 'checkpoints'} to resume from"
            )
        return latest
    path = Path(resume)
    if not path.is_file():
        raise TrainingError(f"train.resume: no such checkpoint {path}")
    return path
