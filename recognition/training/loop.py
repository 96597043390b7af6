"""`train(cfg)`: set up, build (the memory check of a GPU run before the model), resume,
run the loop, export and evaluate; or, stopped early by a signal or the time limit
(training/stopping.py), checkpoint the step it stopped at and raise RunStopped.

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

import copy
import dataclasses
import gc
import itertools
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from recognition import checkpoint as ckpt
from recognition import distributed
from recognition.config import ExperimentConfig
from recognition.config.values import parse_time_limit
from recognition.data.transforms import network_input
from recognition.data.workers import stop_workers
from recognition.distributed import DistInfo
from recognition.logging import MetricsWriter, setup_logging
from recognition.preflight import InputError, input_problems
from recognition.training.build import Run, TrainingError, build, build_data
from recognition.training.determinism import deterministic_mode
from recognition.training.finetune.init_backbone import read_init_backbone
from recognition.training.hooks import Hook, config_hooks, default_hooks
from recognition.training.resume import resume, resume_path
from recognition.training.state import seed_everything
from recognition.training.stopping import (
    RunStopped,
    SignalCatcher,
    StopHook,
    requeue_slurm_job,
)
from recognition.training.teacher import read_teacher
from recognition.training.teacher_cache import prepare_distillation

log = logging.getLogger(__name__)


def train(
    cfg: ExperimentConfig, *, inputs_checked: bool = False, hooks: Sequence[Hook] = ()
) -> Path:
    """Train as `cfg` says, on this process or as one rank of a torchrun job.

    Returns the run directory. Every rank must call it with the same config.
    `inputs_checked`: the caller (train.py) has found no problem with `input_problems(cfg)`
    on every rank; otherwise rank 0 looks at the inputs before any work. `hooks`: hooks of
    the caller's, called after the built-in ones and those of `train.hooks`.
    """
    with deterministic_mode(cfg.train.deterministic):
        return _train(cfg, inputs_checked, hooks)


def _train(cfg: ExperimentConfig, inputs_checked: bool, extra_hooks: Sequence[Hook]) -> Path:
    # A group made by a caller (a test) is the caller's to tear down; ours is ours.
    owns_group = not (dist.is_available() and dist.is_initialized())
    dist_info = distributed.init_distributed(
        cfg.train.device, cfg.train.dist_backend, cfg.train.timeout_s
    )
    setup_logging(None, dist_info)  # the console alone until the run directory is usable
    check_run_dir(cfg.run_dir)
    setup_logging(cfg.run_dir, dist_info)
    checkpoint = resume_path(cfg, cfg.run_dir)
    if not inputs_checked:
        # Before any work: nothing generated, indexed or built for a run whose inputs are
        # missing.
        check_inputs(cfg, dist_info)
    # Per-rank seeds: ranks draw different dropout masks. The backbone's initial weights are
    # rank 0's (DDP broadcasts them) and the head draws its class matrix by blocks.
    seed_everything(cfg.seed + dist_info.rank)
    log.info(
        "run directory %s, device %s, world size %d%s",
        cfg.run_dir,
        dist_info.device,
        dist_info.world_size,
        f" ({dist.get_backend()}, timeout {cfg.train.timeout_s:g} s)"
        if dist_info.is_distributed
        else "",
    )
    run = build_run(cfg, dist_info, resuming=checkpoint is not None)
    if checkpoint is not None:
        resume(run, checkpoint)
    metrics = MetricsWriter(cfg.run_dir, dist_info, start_step=run.progress.step)
    catcher = SignalCatcher(cfg.train.stop_signals)
    stop = StopHook(catcher, parse_time_limit(cfg.train.time_limit))
    stopped: RunStopped | None = None
    try:
        with catcher.installed():
            hooks = [stop, *default_hooks(run, metrics), *config_hooks(cfg), *extra_hooks]
            run_loop(run, hooks)
            stopped = stopped_run(run) if run.stop_reason is not None else None
    finally:
        metrics.close()
    if stopped is None:
        _finish(run)
    if owns_group:
        # The run's DDP reducer holds the process group too. Freed after the group is left,
        # it would be the group's last owner and destroy it holding the GIL, while gloo's
        # worker threads may need the GIL to free the last tensors they hold: torch 2.11
        # hung there at the end of a run now and then. Freed first, the group is destroyed
        # by destroy_process_group, which lets go of the GIL.
        del run
        gc.collect()
        distributed.shutdown()
    if stopped is not None:
        raise stopped
    return cfg.run_dir


def stopped_run(run: Run) -> RunStopped:
    """After a stop (its checkpoint saved): the line that says so, logged, and with
    `train.requeue` on a Slurm job rank 0's requeue (the checkpoint is whole: its save ends
    when every rank is done); returns the RunStopped to raise once the run is torn down."""
    step = run.progress.step
    message = (
        f"stopped by {run.stop_reason} at step {step}; checkpoint "
        f"{ckpt.checkpoint_path(run.run_dir, step)}; resume with train.resume=auto"
    )
    if run.cfg.train.requeue and run.dist_info.is_main:
        message += f"; {requeue_slurm_job()}"
    log.info("%s", message)
    return RunStopped(message, step, run.stop_reason or "")


def build_run(cfg: ExperimentConfig, dist_info: DistInfo, *, resuming: bool) -> Run:
    """`build`, with the memory check of a GPU run (train.memory_check) between the data,
    which gives the class count, and the model: a run whose plan does not fit stops on
    every rank before anything of its size is allocated or written (collective)."""
    init = teacher = None
    if cfg.train.init_backbone is not None and not resuming:
        # Before the data and the model: a file that does not fit stops the run at once. Read
        # once: the model built later loads these weights.
        init = read_init_backbone(cfg.train.init_backbone, cfg)
    if cfg.train.teacher is not None:
        teacher = read_teacher(cfg.train.teacher)
    data = build_data(cfg, dist_info)
    if cfg.train.memory_check and dist_info.device.type == "cuda":
        # Imported here: only a GPU run plans, and the planner (fake tensors) costs an import.
        from recognition.training.plan import check_memory

        check_memory(cfg, dist_info, data.num_classes)
    distill = None
    if teacher is not None:  # its embeddings cached (or it is built) before the student
        memory_format = torch.channels_last if cfg.data.channels_last else torch.preserve_format
        distill = prepare_distillation(
            cfg, dist_info, data.source, teacher, resuming=resuming, memory_format=memory_format
        )
    return build(cfg, dist_info, resuming=resuming, data=data, init=init, distill=distill)


def check_inputs(cfg: ExperimentConfig, dist_info: DistInfo) -> None:
    """Collective: rank 0 looks at the run's inputs (`recognition.preflight`); every rank
    raises an InputError (a ValueError) holding one line per problem when there is any."""
    problems = input_problems(cfg) if dist_info.is_main else []
    problems = distributed.broadcast_object(problems)
    if problems:
        raise InputError("\n".join(problems))


def check_run_dir(run_dir: Path) -> None:
    """Make the run directory and check it takes files, or stop naming output_dir and why."""
    if run_dir.exists() and not run_dir.is_dir():
        raise TrainingError(f"output_dir: {run_dir} is a file; the run directory must be a folder")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise TrainingError(
            f"output_dir: cannot write the run directory {run_dir}: "
            f"{exc.strerror or exc}{f' ({exc.filename})' if exc.filename else ''}"
        ) from None


def run_loop(run: Run, hooks: list[Hook], step_fn: Callable | None = None) -> None:
    """Step until `run.last_step`, or the step a stop ends the run at (`run.stop_reason`,
    set by the StopHook), calling `hooks` around every step and epoch.

    `step_fn` (default `run.step`: `train_step`, or the pipeline's step) takes (model,
    head, micro-batches, optimizer, precision, max grad norm) and returns a `StepResult`;
    another step can take its place. Every step advances the scheduler and
    `run.progress.step`, a skipped one too (its loss or gradients were not finite and its
    update was masked on the device), as a skipped fp16 step does under torch's GradScaler:
    the host does not know which steps were skipped until the log window reads them, and the
    non-finite guard counts them there. Nothing here reads a tensor value.
    """
    step_fn = run.step if step_fn is None else step_fn
    progress = run.progress
    for hook in hooks:
        hook.before_train(run)
    # One iterator for the whole run: the loader's workers keep loading across epochs.
    run.batches.start_at(progress.epoch, progress.batches_done)
    batches = iter(run.loader)
    try:
        _steps(run, hooks, step_fn, batches)
    finally:
        # The batches are done: the workers go now, not with the run's last reference (see
        # stop_workers), and not while the evaluation runs.
        if stopped := stop_workers(run.loader, batches):
            log.info("stopped %d loader workers", stopped)
    for hook in hooks:
        hook.after_train(run)


def _steps(run: Run, hooks: list[Hook], step_fn: Callable, batches: Iterator) -> None:
    """The loop of `run_loop`: epochs of steps until the last step or a stop."""
    cfg, progress = run.cfg, run.progress
    device, memory_format = run.dist_info.device, run.memory_format
    while progress.step < run.last_step and run.stop_reason is None:
        for hook in hooks:
            hook.before_epoch(run)
        while progress.step < run.last_step and not run.end_of_epoch and not run.stop_reason:
            for hook in hooks:
                hook.before_step(run)
            # (images, labels), and a distilled run's cached teacher embeddings. The CPU
            # workers ship uint8 pixels: normalised here, on the device, in one pass.
            micro_batches = [
                (
                    network_input(x.to(device, non_blocking=True, memory_format=memory_format)),
                    *(t.to(device, non_blocking=True) for t in rest),
                )
                for x, *rest in itertools.islice(batches, cfg.train.accumulate_steps)
            ]
            result = step_fn(
                run.model,
                run.head,
                micro_batches,
                run.optimizer,
                run.precision,
                cfg.optim.grad_clip,
            )
            progress.batches_done += len(micro_batches)
            run.scheduler.step()
            progress.step += 1
            for hook in hooks:
                hook.after_step(run, result)
        # Collective hooks here: every rank leaves the epoch's loop at the same step (a stop
        # too: every rank stops at the same step).
        for hook in hooks:
            hook.after_epoch(run)
        if run.end_of_epoch:
            progress.epoch, progress.batches_done = progress.epoch + 1, 0


def _finish(run: Run) -> None:
    """Rank 0 exports the backbone and evaluates the run's targets once every rank is done."""
    cfg = run.cfg
    backbone = run.whole_backbone()  # collective with a pipeline (the stages' parts)
    # The others leave once every rank is done (the last checkpoint is complete), so a long
    # evaluation cannot run into the collective timeout.
    distributed.barrier()
    if not run.dist_info.is_main:
        return
    assert backbone is not None
    path = cfg.run_dir / "backbone.pt"
    ckpt.export_backbone(path, backbone, dataclasses.asdict(cfg.model), cfg.data.image_size)
    log.info("wrote %s", path)
    if cfg.eval.at_end and run.eval_targets:
        from recognition.evaluation.protocols import protocol_for, report
        from recognition.evaluation.targets import evaluate_config_targets

        model = copy.deepcopy(backbone).float().eval()
        results = evaluate_config_targets(
            cfg, model, run.dist_info.device, progress=cfg.train.progress, targets=run.eval_targets
        )
        protocols = [protocol_for(target) for target in run.eval_targets]
        report(
            protocols,
            results,
            json_path=cfg.run_dir / "eval.json",
            roc_path=cfg.run_dir / "roc.png",
        )
