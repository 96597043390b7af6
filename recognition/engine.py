"""The training loop: `train(cfg)` reads top to bottom; `train_step()` is one optimizer step.

Sections of `train`: setup, data, model and head, precision and optimizer, schedule,
resume, the loop (forward/backward, step, log, checkpoint), final export and evaluation.

The same code runs on one process and on N (torchrun): data parallel for the backbone
(replicated, wrapped in DistributedDataParallel, which averages its gradients), model
parallel for the head (each rank owns a contiguous shard of the classes; see
`recognition.heads.margin_softmax` for why DDP's average then gives exactly the
one-process gradient). W ranks with a local batch B step like one process with a batch of
W*B, up to float rounding, as long as the backbone has no batch statistics or uses
SyncBatchNorm (`model.sync_bn`): the sample order is DistributedSampler's, the class matrix
is initialised the same whatever W, and gradient clipping uses the norm over all ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import random
import resource
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from tqdm import tqdm

from recognition import checkpoint as ckpt
from recognition import distributed
from recognition.config import ExperimentConfig, config_to_dict, save_config
from recognition.data.build import build_sampler, build_train_dataset, loader_options
from recognition.data.sampler import AugmentedView
from recognition.data.synthetic import SyntheticSpec, ensure_synthetic_dataset
from recognition.distributed import DistInfo
from recognition.evaluation.run import PeriodicEvaluation, check_training_targets
from recognition.heads import ShardedMarginSoftmax, build_margin
from recognition.heads.margin_softmax import WEIGHT_INIT_STD
from recognition.logging import MetricsWriter, setup_logging
from recognition.models import build_backbone
from recognition.optim import build_optimizer, build_scheduler, param_groups
from recognition.precision import Precision

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite losses, a run directory that would be overwritten)."""


# Rows of the class matrix per initialisation block: every block is drawn from its own seeded
# generator, so the matrix does not depend on how it is split over ranks.
INIT_BLOCK_ROWS = 1 << 16


@dataclass
class StepResult:
    loss: float
    """Mean loss over the step's micro-batches (not divided by their number)."""
    finite: bool
    """False when a micro-batch's loss was NaN or inf: nothing was applied."""
    stepped: bool
    """False when the optimizer step was skipped (non-finite loss or fp16 overflow)."""
    grad_norm: float
    """Norm of all gradients before clipping, over every rank's share of the model."""
    scale: float
    accuracy: float = float("nan")
    """Fraction of the global batch whose target logit was the largest (mean over micro-batches)."""


def train_step(
    backbone: nn.Module,
    head: ShardedMarginSoftmax,
    micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    max_grad_norm: float | None,
    sharded_params: Sequence[torch.Tensor] = (),
) -> StepResult:
    """One optimizer step over `micro_batches` (gradient accumulation when more than one).

    `backbone` may be wrapped in DistributedDataParallel; its gradients are then all-reduced
    once, in the last micro-batch's backward. `sharded_params` are the optimizer's tensors
    that differ by rank (the head's class rows, or their O2 master): their share of the
    gradient norm is summed over ranks, so that every rank clips by the same global norm.

    Each micro-batch's loss is divided by their number before backward, so the gradient is
    that of the mean loss over all of them. A non-finite loss skips the whole step: the
    accumulated gradients are dropped and no parameter or optimizer state changes. The loss
    is the same on every rank (the head reduces over the global batch), so ranks skip alike.
    """
    num_micro = len(micro_batches)
    precision.zero_grad(optimizer)
    losses, accuracies = [], []
    for index, (images, labels) in enumerate(micro_batches):
        # DDP would all-reduce after every backward; the sum is only needed after the last.
        defer_sync = isinstance(backbone, DistributedDataParallel) and index < num_micro - 1
        with backbone.no_sync() if defer_sync else contextlib.nullcontext():  # type: ignore[operator]
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
        if head.last_accuracy is not None:
            accuracies.append(head.last_accuracy.float())

    def grad_norm(params: list[torch.Tensor]) -> float:
        return distributed.global_grad_norm(params, sharded_params)

    result = precision.step(optimizer, max_grad_norm, grad_norm_fn=grad_norm)
    mean_loss = float(torch.stack(losses).mean())
    return StepResult(
        mean_loss,
        finite=True,
        stepped=result.stepped,
        grad_norm=float(result.grad_norm),
        scale=float(result.scale),
        accuracy=float(torch.stack(accuracies).mean()) if accuracies else float("nan"),
    )


def train(cfg: ExperimentConfig) -> Path:
    """Train as `cfg` says, on this process or as one rank of a torchrun job.

    Returns the run directory. Every rank must call it with the same config.
    """
    # ------------------------------------------------------------------ setup
    # A group made by a caller (a test) is the caller's to tear down; ours is ours.
    owns_group = not (dist.is_available() and dist.is_initialized())
    dist_info = distributed.init_distributed(
        cfg.train.device, cfg.train.dist_backend, cfg.train.timeout_s
    )
    run_dir = cfg.run_dir
    setup_logging(run_dir, dist_info)
    resume_path = _resume_path(cfg, run_dir)
    # Per-rank seeds: ranks draw different dropout masks. The backbone's initial weights are
    # rank 0's (DDP broadcasts them) and the class matrix is drawn by blocks (see below).
    _seed_everything(cfg.seed + dist_info.rank)
    device = dist_info.device
    log.info(
        "run directory %s, device %s, world size %d%s",
        run_dir,
        device,
        dist_info.world_size,
        f" ({dist.get_backend()}, timeout {cfg.train.timeout_s:g} s)"
        if dist_info.is_distributed
        else "",
    )

    # ------------------------------------------------------------------ data
    if cfg.data.synthetic.enabled:
        if dist_info.is_main:
            ensure_synthetic_dataset(Path(cfg.data.synthetic.root), _synthetic_spec(cfg))
        distributed.barrier()
    # Evaluation targets are checked now, not found missing hours into the run.
    check_training_targets(cfg, dist_info)
    base = build_train_dataset(
        cfg.data, rank_is_main=dist_info.is_main, barrier=distributed.barrier
    )
    dataset = AugmentedView(base, flip=cfg.data.flip)
    # data.sampler=random is DistributedSampler's order: one permutation per epoch (the same
    # on every rank), rank r taking every W-th sample, the tail that does not divide by W
    # dropped; pk is P identities x K images per batch, whole groups per rank. The
    # DataLoader drops an incomplete last batch too, so every rank runs the same number of
    # steps.
    sampler = build_sampler(
        cfg.data,
        base.labels,
        batch_size=cfg.train.batch_size,
        num_replicas=dist_info.world_size,
        rank=dist_info.rank,
        seed=cfg.seed,
    )
    loader = DataLoader(
        dataset,
        batch_size=cfg.train.batch_size,
        sampler=sampler,
        drop_last=True,
        # Its own generator: creating an epoch's iterator must not draw from the global RNG,
        # or a run resumed mid-epoch would see different dropout / sampling draws.
        generator=torch.Generator().manual_seed(cfg.seed + dist_info.rank),
        **loader_options(cfg.data, device),
    )
    # NHWC inputs for a backbone converted to channels-last (see data.channels_last).
    memory_format = torch.channels_last if cfg.data.channels_last else torch.preserve_format
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
        "%d images of %d identities from %s; %d steps per epoch of %d images",
        len(base),
        num_classes,
        cfg.data.root,
        steps_per_epoch,
        _global_batch(cfg, dist_info),
    )
    # The class names stay in classes.txt (streamed: two million of them are no list to
    # keep); checkpoints carry their number and fingerprint, which a resume checks.
    classes_sha256 = base.classes_fingerprint()
    if dist_info.is_main:
        save_config(cfg, run_dir / "config.yaml")
        if resume_path is None:  # a resumed run's are checked against its checkpoint first
            base.write_classes(run_dir / "classes.txt")

    # ------------------------------------------------------------------ model and head
    backbone = build_backbone(
        cfg.model.backbone,
        embedding_size=cfg.model.embedding_size,
        width=cfg.model.width,
        dropout=cfg.model.dropout,
        image_size=cfg.data.image_size,
    )
    if cfg.model.sync_bn and dist_info.is_distributed:
        if device.type != "cuda":
            raise TrainingError(
                "model.sync_bn: torch's SyncBatchNorm runs on GPUs only; train on CPU without "
                "it (model.sync_bn=false)"
            )
        backbone = nn.SyncBatchNorm.convert_sync_batchnorm(backbone)
    backbone = backbone.to(device, memory_format=memory_format)
    margin = build_margin(
        cfg.head.margin,
        scale=cfg.head.scale,
        m=cfg.head.m,
        m1=cfg.head.m1,
        m2=cfg.head.m2,
        m3=cfg.head.m3,
    )
    # Each rank builds only its shard of the class matrix (the head reads rank and world
    # size from the process group).
    head = ShardedMarginSoftmax(
        num_classes,
        cfg.model.embedding_size,
        margin,
        sample_rate=cfg.head.sample_rate,
        chunk_size=cfg.head.chunk_size,
        seed=cfg.seed,
    ).to(device)
    _init_class_rows(head, cfg.seed)
    log.info(
        "head: %d classes, %d on this rank (classes %d-%d)",
        num_classes,
        head.num_local,
        head.class_start,
        head.class_start + head.num_local - 1,
    )

    # ------------------------------------------------------------------ precision and optimizer
    precision = Precision(
        cfg.precision.level,
        cfg.precision.dtype,
        device,
        # Ranks see different head gradients: the fp16 overflow check must be global.
        process_group=dist.group.WORLD if dist_info.is_distributed else None,
    )
    precision.prepare(backbone, head)
    # The backbone is replicated: DDP broadcasts rank 0's weights now and averages the
    # gradients in backward. The head is not wrapped: its shard is this rank's alone.
    model: nn.Module = backbone
    if dist_info.is_distributed:
        model = DistributedDataParallel(
            backbone, device_ids=[device.index] if device.type == "cuda" else None
        )
    groups = param_groups([backbone, head], cfg.optim.weight_decay)
    optimizer = build_optimizer(precision.param_groups(groups), cfg.optim)
    # Partial FC: the optimizer must only move the class rows sampled for the step (under
    # O2 it steps the fp32 master of the head's weight, not the half weight itself).
    head_master = next((m for _, p, m in precision.masters() if p is head.weight), None)
    head.attach_optimizer(optimizer, head_master)
    head_param = head.weight if head_master is None else head_master

    # ------------------------------------------------------------------ schedule
    total_steps = cfg.train.epochs * steps_per_epoch
    warmup_steps = round(cfg.optim.warmup_epochs * steps_per_epoch)
    scheduler = build_scheduler(optimizer, total_steps, warmup_steps, cfg.optim)
    last_step = min(total_steps, cfg.train.max_steps or total_steps)

    # ------------------------------------------------------------------ resume
    step, epoch, batches_done = 0, 0, 0
    if resume_path is not None:
        rng_key = f"rng/{dist_info.rank}"
        loaded = ckpt.load_training_state(
            resume_path,
            backbone,
            head,
            optimizer,
            precision,
            objects=("scheduler", "progress", rng_key, "meta"),
        )
        _check_same_classes(loaded["meta"], num_classes, classes_sha256, resume_path, run_dir)
        if dist_info.is_main and not (run_dir / "classes.txt").exists():
            base.write_classes(run_dir / "classes.txt")
        scheduler.load_state_dict(loaded["scheduler"])
        progress = loaded["progress"]
        step, epoch = progress["step"], progress["epoch"]
        batches_done = _resume_position(progress, cfg, dist_info, resume_path)
        head.sampling_step = progress["head_sampling_step"]
        if progress["world_size"] == dist_info.world_size and loaded[rng_key] is not None:
            ckpt.set_rng_state(loaded[rng_key])
        else:
            # Other ranks, other random streams: each rank starts a fresh one of its own.
            _seed_everything(cfg.seed + dist_info.rank + 100_003 * step)
        log.info(
            "resumed from %s at step %d (epoch %d, batch %d), saved by %d rank(s)",
            resume_path,
            step,
            epoch,
            batches_done,
            progress["world_size"],
        )

    def save(step: int, epoch: int, batches_done: int) -> None:
        # Collective: every rank writes its own class rows; the replicated rest goes once.
        state = ckpt.training_state(backbone, head, optimizer, precision)
        state.update(
            {
                "scheduler": scheduler.state_dict(),
                "progress": {
                    "step": step,
                    "epoch": epoch,
                    # Samples of the epoch consumed over all ranks: a position that means
                    # the same on any number of ranks.
                    "samples_done": batches_done * cfg.train.batch_size * dist_info.world_size,
                    "global_batch": _global_batch(cfg, dist_info),
                    "world_size": dist_info.world_size,
                    "head_sampling_step": head.sampling_step,
                },
                "meta": {
                    "config": config_to_dict(cfg),
                    "num_classes": num_classes,
                    "classes_sha256": classes_sha256,
                },
                f"rng/{dist_info.rank}": ckpt.rng_state(),
            }
        )
        ckpt.save_checkpoint(run_dir, step, state, keep=cfg.train.keep_checkpoints)

    # ------------------------------------------------------------------ the loop
    metrics = MetricsWriter(run_dir, dist_info, start_step=step)
    evaluator = PeriodicEvaluation(cfg, dist_info, metrics)
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
                    (
                        x.to(device, non_blocking=True, memory_format=memory_format),
                        y.to(device, non_blocking=True),
                    )
                    for x, y in micro_batches
                ]
                result = train_step(
                    model,
                    head,
                    micro_batches,
                    optimizer,
                    precision,
                    cfg.optim.grad_clip,
                    sharded_params=[head_param],
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
                    # Collective: every rank reduces its numbers, rank 0 writes them.
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
                if evaluator.due(step):
                    # Collective: rank 0 evaluates (eval.targets), the others wait for it.
                    evaluator.run(step, epoch, backbone)
                end_of_epoch = batches_done >= steps_per_epoch * cfg.train.accumulate_steps
                every = cfg.train.checkpoint_every
                if (every and step % every == 0) or step == last_step:
                    save(step, epoch, batches_done)
                elif end_of_epoch and every is None:
                    save(step, epoch + 1, 0)
                if step >= last_step or end_of_epoch:
                    break
            bar.close()
            # Collective (every rank leaves the epoch's loop at the same step).
            num_bad = int(distributed.all_reduce_sum(float(base.take_bad_image_count())))
            if num_bad:
                log.warning(
                    "epoch %d: %d unreadable images replaced by others of their identity "
                    "(data.on_bad_image=skip; the first few are named above)",
                    epoch,
                    num_bad,
                )
            if batches_done >= steps_per_epoch * cfg.train.accumulate_steps:
                epoch, batches_done = epoch + 1, 0
    finally:
        metrics.close()

    # ------------------------------------------------------------------ export and evaluation
    # Only rank 0 goes on; the others leave once every rank is done (the last checkpoint is
    # complete), so a long evaluation cannot run into the collective timeout.
    distributed.barrier()
    if dist_info.is_main:
        ckpt.export_backbone(
            run_dir / "backbone.pt", backbone, dataclasses.asdict(cfg.model), cfg.data.image_size
        )
        log.info("wrote %s", run_dir / "backbone.pt")
        if cfg.eval.at_end and cfg.eval.targets:
            from recognition.evaluation.run import evaluate_config_targets, report

            results = evaluate_config_targets(
                cfg, _float_copy(backbone), device, progress=cfg.train.progress
            )
            report(results, json_path=run_dir / "eval.json", roc_path=run_dir / "roc.png")
    if owns_group:
        distributed.shutdown()
    return run_dir


# ---------------------------------------------------------------------- helpers


class _Window:
    """Accumulates step results between two log lines."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.losses: list[float] = []
        self.accuracies: list[float] = []
        self.grad_norms: list[float] = []
        self.samples = 0
        self.skipped = 0
        self.scale = 1.0
        self.start = time.perf_counter()

    def add(self, result: StepResult, samples: int) -> None:
        self.losses.append(result.loss)
        if math.isfinite(result.accuracy):
            self.accuracies.append(result.accuracy)
        if math.isfinite(result.grad_norm):
            self.grad_norms.append(result.grad_norm)
        self.samples += samples
        self.skipped += int(not result.stepped)
        self.scale = result.scale

    def flush(self, dist_info: DistInfo) -> dict[str, Any]:
        """The window's scalars, reduced over ranks (collective), then a fresh window."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        peak_memory = _peak_memory_mb(dist_info.device)
        values = {
            # The loss and the accuracy are already identical on every rank (the head reduces
            # over the global batch); the mean keeps the contract should a head ever differ.
            "loss": distributed.all_reduce_mean(float(np.mean(self.losses))),
            "accuracy": distributed.all_reduce_mean(
                float(np.mean(self.accuracies)) if self.accuracies else float("nan")
            ),
            "samples_per_sec": distributed.all_reduce_sum(self.samples / elapsed),
            # Already global: the norm is taken over every rank's gradients.
            "grad_norm": float(np.mean(self.grad_norms)) if self.grad_norms else float("nan"),
            "skipped_steps": self.skipped,
            "loss_scale": self.scale,
            # The fullest and the emptiest rank: an uneven class split or a leak shows here.
            "peak_memory_mb_max": distributed.all_reduce_max(peak_memory),
            "peak_memory_mb_min": distributed.all_reduce_min(peak_memory),
        }
        self.reset()
        return values


def _peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process so far in MiB: CUDA memory allocated on GPU, RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _global_batch(cfg: ExperimentConfig, dist_info: DistInfo) -> int:
    """Samples per optimizer step over all ranks."""
    return cfg.train.batch_size * cfg.train.accumulate_steps * dist_info.world_size


def _init_class_rows(head: ShardedMarginSoftmax, seed: int) -> None:
    """Draw this rank's class rows so that the whole matrix does not depend on the split.

    The class matrix is drawn in blocks of INIT_BLOCK_ROWS rows, N(0, WEIGHT_INIT_STD) like
    the head's own initialisation, each block from a generator seeded by (seed, block): a
    rank draws only the blocks its shard overlaps. A run on 8 ranks, on 1, or resumed on 4
    starts from the same matrix (per device type: CPU and CUDA generators differ).
    """
    weight = head.weight
    first, stop = head.class_start, head.class_start + head.num_local
    with torch.no_grad():
        for block_start in range(first - first % INIT_BLOCK_ROWS, stop, INIT_BLOCK_ROWS):
            block_rows = min(INIT_BLOCK_ROWS, head.num_classes - block_start)
            generator = torch.Generator(device=weight.device)
            generator.manual_seed((seed * 1_000_003 + block_start // INIT_BLOCK_ROWS) % 2**63)
            block = torch.randn(
                block_rows,
                head.embedding_size,
                generator=generator,
                device=weight.device,
                dtype=torch.float32,
            )
            lo, hi = max(first, block_start), min(stop, block_start + block_rows)
            weight[lo - first : hi - first] = block[lo - block_start : hi - block_start] * (
                WEIGHT_INIT_STD
            )


def _resume_position(
    progress: dict[str, Any], cfg: ExperimentConfig, dist_info: DistInfo, path: Path
) -> int:
    """This rank's batches done in the epoch, from a checkpoint saved on any number of ranks.

    The checkpoint counts the epoch's samples consumed over all ranks; with W' ranks of
    batch B' the run goes on from sample samples_done / (B' * W') of each rank's slice of the
    same permutation, i.e. with exactly the samples the saved run had not seen yet, as long
    as the global batch is unchanged. Otherwise it rounds down to a whole batch and warns.
    """
    per_batch = cfg.train.batch_size * dist_info.world_size
    samples_done = progress["samples_done"]
    if progress["global_batch"] != _global_batch(cfg, dist_info) or samples_done % per_batch:
        log.warning(
            "%s was saved with a global batch of %d, this run has %d (train.batch_size x "
            "train.accumulate_steps x ranks): the learning-rate schedule and the epoch's "
            "remaining samples will not continue exactly",
            path,
            progress["global_batch"],
            _global_batch(cfg, dist_info),
        )
    return samples_done // per_batch


def _check_same_classes(
    meta: dict[str, Any] | None,
    num_classes: int,
    classes_sha256: str,
    path: Path,
    run_dir: Path,
) -> None:
    """Refuse to resume a checkpoint whose classes (names in label order) differ from ours.

    Checkpoints store the number of classes and the SHA-256 of their names (older ones the
    names themselves); the names are in the run directory's classes.txt.
    """
    if not isinstance(meta, dict):
        return
    saved = meta.get("classes_sha256")
    if saved is None and isinstance(meta.get("classes"), list):
        digest = hashlib.sha256()
        for name in meta["classes"]:
            digest.update(str(name).encode("utf-8", "surrogateescape") + b"\n")
        saved = digest.hexdigest()
    if meta.get("num_classes") not in (None, num_classes) or (
        saved is not None and saved != classes_sha256
    ):
        raise TrainingError(
            f"{path} was trained on {meta.get('num_classes')} classes whose names differ from "
            f"the {num_classes} of data.root now: the labels would not mean the same. The "
            f"checkpoint's class names are in {run_dir / 'classes.txt'} as it was written; "
            "train on the same data or start a new run"
        )


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
    """The generator's spec from `data.synthetic` (the same fields, less enabled / root)."""
    s = cfg.data.synthetic
    return SyntheticSpec(**{f.name: getattr(s, f.name) for f in dataclasses.fields(SyntheticSpec)})


def _resume_path(cfg: ExperimentConfig, run_dir: Path) -> Path | None:
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
        return latest
    path = Path(resume)
    if ckpt.is_checkpoint(path):
        return path
    if path.is_dir() and (found := ckpt.latest_checkpoint(path)) is not None:
        return found  # a run directory: its latest checkpoint
    raise TrainingError(
        f"train.resume: {path} is neither a checkpoint directory (holding .metadata) nor a "
        "run directory with checkpoints"
    )
