"""The side effects of training steps, as hooks the loop calls around each step.

A hook overrides any of `before_train`, `before_epoch`, `before_step`, `after_step`,
`after_epoch`, `after_train`; the loop calls every hook in list order (see `default_hooks`
for the order and why), then those a run adds: `train.hooks` (`config_hooks`) and
`train(cfg, hooks=[...])`. Collective hooks (logging, evaluation, checkpoints, the epoch's
bad-image count) run on every rank at the same steps.

A step's `StepResult` holds device tensors. Hooks read them on the host only at logging
intervals (`log_due`: every `train.log_every` steps and the last), so that the steps in
between launch no host synchronisation: the log window keeps the results until then, the
non-finite guard counts on the device.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import resource
import time
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from recognition import checkpoint as ckpt
from recognition import distributed
from recognition.config import EvalTarget, ExperimentConfig
from recognition.config.eval import LOWER_IS_BETTER
from recognition.distributed import DistInfo
from recognition.evaluation.protocols import protocol_for, scalars
from recognition.evaluation.report import write_json
from recognition.evaluation.targets import evaluate_config_targets, run_targets
from recognition.logging import MetricsWriter
from recognition.optim import scheduled_lr
from recognition.precision import StepResult
from recognition.registry import load_code
from recognition.training.build import Run, TrainingError

log = logging.getLogger(__name__)


class Hook:
    """Does nothing at every point of the loop; subclasses override what they need."""

    def before_train(self, run: Run) -> None:
        pass

    def before_epoch(self, run: Run) -> None:
        pass

    def before_step(self, run: Run) -> None:
        pass

    def after_step(self, run: Run, result: StepResult) -> None:
        """After every step, skipped or not (`run.progress.step` counts both). `result`
        holds device tensors: read them only where `log_due(run)`."""

    def after_epoch(self, run: Run) -> None:
        pass

    def after_train(self, run: Run) -> None:
        pass


def default_hooks(run: Run, metrics: MetricsWriter) -> list[Hook]:
    """The hooks of a training run, in the order they act after a step.

    The log window first (the window in which a run stops for non-finite losses is logged,
    its skipped steps included), then the non-finite guard (it stops the run before an
    evaluation or a checkpoint of that step), periodic evaluation and checkpoints (a
    checkpoint saved after the evaluation that ran at the same step), the progress bar last.
    """
    return [
        FirstStepTimer(),
        LogWindow(metrics),
        NonFiniteGuard(),
        PeriodicEvaluation(run.cfg, run.dist_info, metrics, run.eval_targets),
        Checkpointer(),
        BadImageReport(),
        ProgressBar(),
    ]


def config_hooks(cfg: ExperimentConfig) -> list[Hook]:
    """The hooks `train.hooks` names ("package.module:Class"), each made with no argument.
    Raises TrainingError naming the entry whose code is not there or is not a Hook."""
    hooks = []
    for i, code in enumerate(cfg.train.hooks):
        try:
            made = load_code(code, f"train.hooks[{i}]")()
        except ImportError as exc:
            raise TrainingError(str(exc)) from None
        if not isinstance(made, Hook):
            raise TrainingError(
                f"train.hooks[{i}]: {code} made a {type(made).__name__}, not a "
                "recognition.training.hooks.Hook"
            )
        hooks.append(made)
    return hooks


class FirstStepTimer(Hook):
    """Logs how long the first step took once: with train.compile, mostly compilation."""

    def before_train(self, run: Run) -> None:
        self.start: float | None = time.perf_counter()

    def after_step(self, run: Run, result: StepResult) -> None:
        if self.start is None:
            return
        what = "compiling the backbone" if run.cfg.train.compile else "the first step"
        log.info("%s took %.1f s", what, time.perf_counter() - self.start)
        self.start = None


def log_due(run: Run) -> bool:
    """Whether the step just taken is a logging step (every `train.log_every`, and the last,
    or the one a stop ends the run at): the only steps after which hooks read the step's
    tensors on the host."""
    step = run.progress.step
    last = step == run.last_step or run.stop_reason is not None
    return step % run.cfg.train.log_every == 0 or last


class NonFiniteGuard(Hook):
    """Keeps each step's finite flag on the device; at each logging step reads them and
    stops the run once `train.max_nonfinite_steps` non-finite losses in a row were seen.

    The skipped steps changed nothing (their updates were masked on the device), so the run
    may go on for up to `train.log_every` - 1 steps past the limit before it stops.
    """

    def before_train(self, run: Run) -> None:
        self.in_a_row = 0  # non-finite losses in a row up to the last read
        self.flags: list[torch.Tensor] = []  # the steps' finite flags since the last read
        self.first_step = run.progress.step + 1  # of those steps

    def after_step(self, run: Run, result: StepResult) -> None:
        if result.finite is not None:
            self.flags.append(result.finite)
        if not log_due(run):
            return
        finite = torch.stack(self.flags).tolist() if self.flags else []  # the one read
        first, step = self.first_step, run.progress.step
        self.flags, self.first_step = [], step + 1
        longest = self.in_a_row
        for ok in finite:
            self.in_a_row = 0 if ok else self.in_a_row + 1
            longest = max(longest, self.in_a_row)
        num_nonfinite = finite.count(False)
        if num_nonfinite:
            log.warning(
                "steps %d-%d: %d non-finite losses, their updates skipped (%d in a row now)",
                first,
                step,
                num_nonfinite,
                self.in_a_row,
            )
        if longest >= run.cfg.train.max_nonfinite_steps:
            raise TrainingError(nonfinite_message(run, longest))


def nonfinite_message(run: Run, in_a_row: int) -> str:
    """Why the run stops after `in_a_row` non-finite losses, what to change (only what is not
    already so), and which checkpoint a resume would continue from."""
    cfg = run.cfg
    advice = [f"lower optim.lr (now {cfg.optim.lr:g})"]
    if cfg.optim.grad_clip is None:
        advice.append("set optim.grad_clip (e.g. 5)")
    if cfg.precision.level in ("O2", "O3") or cfg.precision.dtype == "fp16":
        advice.append("use precision.level=O1 with precision.dtype=bf16, or O0")
    latest = ckpt.latest_checkpoint(run.run_dir)
    where = (
        f"The last checkpoint, {latest}, is intact (train.resume=true continues from it)."
        if latest is not None
        else "No checkpoint was written before it (train.checkpoint_every sets how often)."
    )
    return (
        f"stopping: {in_a_row} non-finite losses in a row by step {run.progress.step} "
        f"(train.max_nonfinite_steps); {', '.join(advice)}. {where}"
    )


class LogWindow(Hook):
    """Every `train.log_every` steps (and at the last): the window's numbers, reduced over
    ranks (collective), to metrics.jsonl, TensorBoard and the log.

    The steps' results (device tensors) are kept until then and read in one transfer, so
    the steps in between need no host synchronisation. The loss, accuracy and gradient norm
    are means over the window's steps whose loss was finite; `skipped_steps` counts the
    steps whose update was skipped (a non-finite loss or gradient, an fp16 overflow).
    """

    def __init__(self, metrics: MetricsWriter) -> None:
        self.metrics = metrics
        self.reset()

    def reset(self) -> None:
        self.results: list[StepResult] = []
        self.samples = 0
        self.start = time.perf_counter()

    def before_train(self, run: Run) -> None:
        cfg = run.cfg
        log.info(
            "training %s for %d steps (%d epochs x %d steps), precision %s/%s",
            cfg.model.backbone,
            run.last_step,
            cfg.train.epochs,
            run.steps_per_epoch,
            cfg.precision.level,
            cfg.precision.dtype,
        )
        self.reset()

    def after_step(self, run: Run, result: StepResult) -> None:
        self.results.append(result)
        # This rank's share of the step's samples (a pipeline's stages share theirs).
        self.samples += run.progress.global_batch / run.dist_info.world_size
        if not log_due(run):
            return
        step = run.progress.step
        values = self.flush(run.dist_info)
        values.update(epoch=run.progress.epoch, lr=scheduled_lr(run.optimizer))
        self.metrics.log(step, values)
        log.info(
            "step %d/%d epoch %d loss %.4f lr %.4g %.1f samples/s",
            step,
            run.last_step,
            run.progress.epoch,
            values["loss"],
            values["lr"],
            values["samples_per_sec"],
        )

    def flush(self, dist_info: DistInfo) -> dict[str, Any]:
        """The window's scalars, reduced over ranks (collective), then a fresh window."""
        window = _read_results(self.results)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        peak_memory = peak_memory_mb(dist_info.device)
        finite = window["finite"] > 0
        losses = window["loss"][finite]
        accuracies = window["accuracy"][finite & np.isfinite(window["accuracy"])]
        grad_norms = window["grad_norm"][finite & np.isfinite(window["grad_norm"])]
        values = {
            # The loss and the accuracy are already identical on every rank (the head reduces
            # over the global batch); the mean keeps the contract should a head ever differ.
            "loss": distributed.all_reduce_mean(_mean(losses)),
            "accuracy": distributed.all_reduce_mean(_mean(accuracies)),
            "samples_per_sec": distributed.all_reduce_sum(self.samples / elapsed),
            # Already global: the norm is taken over every rank's gradients.
            "grad_norm": _mean(grad_norms),
            "skipped_steps": int((window["stepped"] == 0).sum()),
            "loss_scale": float(window["scale"][-1]) if len(window["scale"]) else 1.0,
            # The fullest and the emptiest rank: an uneven class split or a leak shows here.
            "peak_memory_mb_max": distributed.all_reduce_max(peak_memory),
            "peak_memory_mb_min": distributed.all_reduce_min(peak_memory),
        }
        distill = window["distill_loss"][finite & np.isfinite(window["distill_loss"])]
        if len(distill):  # a distilled run (already the mean over ranks)
            values["distill_loss"] = _mean(distill)
        self.reset()
        return values


_RESULT_FIELDS = ("loss", "finite", "accuracy", "grad_norm", "stepped", "scale", "distill_loss")


def _read_results(results: list[StepResult]) -> dict[str, np.ndarray]:
    """The fields of `results` as float64 arrays (one entry per step), read from the device
    in one transfer. A missing loss, accuracy or distillation loss reads as NaN, a missing
    `finite` as whether the loss is finite."""
    if not results:
        return {name: np.zeros(0) for name in _RESULT_FIELDS}
    nan = torch.full((), math.nan, dtype=torch.float64, device=results[0].stepped.device)

    def value(result: StepResult, name: str) -> torch.Tensor:
        found = getattr(result, name)
        if found is not None:
            return found
        loss = result.loss if result.loss is not None else nan
        return torch.isfinite(loss) if name == "finite" else nan

    # One stack per field (torch.stack promotes dtypes), then one for the table.
    table = torch.stack(
        [torch.stack([value(r, name) for r in results]).double() for name in _RESULT_FIELDS]
    )
    return dict(zip(_RESULT_FIELDS, table.cpu().numpy(), strict=True))  # the one sync


def _mean(values: np.ndarray) -> float:
    return float(np.mean(values)) if len(values) else float("nan")


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process so far in MiB: CUDA memory allocated on GPU, RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Checkpointer(Hook):
    """Saves the run's parts every `train.checkpoint_every` steps (null: at the end of each
    epoch), at the last step and at the step a stop ends the run at (collective: every rank
    writes its own class rows); times each save (`run.longest_save_s`)."""

    def after_step(self, run: Run, result: StepResult) -> None:
        # A step skipped for a non-finite loss changed no weight: what is saved is intact.
        step, every = run.progress.step, run.cfg.train.checkpoint_every
        stopping = run.stop_reason is not None
        if (every and step % every == 0) or step == run.last_step:
            self.save(run)
        elif run.end_of_epoch and (every is None or stopping):
            # Saved as the start of the next epoch, so a resume does not redo this one's end.
            progress = run.progress
            epoch, batches_done = progress.epoch, progress.batches_done
            progress.epoch, progress.batches_done = epoch + 1, 0
            try:
                self.save(run)
            finally:
                progress.epoch, progress.batches_done = epoch, batches_done
        elif stopping:
            self.save(run)

    @staticmethod
    def save(run: Run) -> None:
        start = time.perf_counter()
        ckpt.save_checkpoint(
            run.run_dir,
            run.progress.step,
            run.checkpoint_parts(),
            keep=run.cfg.train.keep_checkpoints,
        )
        run.longest_save_s = max(run.longest_save_s, time.perf_counter() - start)


class BadImageReport(Hook):
    """At the end of each epoch: how many unreadable images were replaced (collective)."""

    def after_epoch(self, run: Run) -> None:
        num_bad = int(distributed.all_reduce_sum(float(run.data.take_bad_image_count())))
        if num_bad:
            log.warning(
                "epoch %d: %d unreadable images replaced by others of their identity "
                "(data.on_bad_image=skip; the first few are named above)",
                run.progress.epoch,
                num_bad,
            )


class ProgressBar(Hook):
    """A tqdm bar over the epoch's steps on rank 0 (`train.progress`)."""

    def __init__(self) -> None:
        self.bar: tqdm | None = None

    def before_epoch(self, run: Run) -> None:
        self.bar = tqdm(
            total=run.steps_per_epoch,
            initial=run.progress.batches_done // run.cfg.train.accumulate_steps,
            desc=f"epoch {run.progress.epoch}",
            disable=not (run.cfg.train.progress and run.dist_info.is_main),
            leave=False,
            dynamic_ncols=True,
        )

    def after_step(self, run: Run, result: StepResult) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def after_epoch(self, run: Run) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    after_train = after_epoch


class PeriodicEvaluation(Hook):
    """Evaluation every ``eval.every_steps`` optimizer steps, on each target through its
    protocol (verification, IJB, re-id: `recognition.evaluation.protocols`), and the best
    backbone kept.

    Call :meth:`due` every step and :meth:`run` (on every rank: it is collective) when it is
    true. Rank 0 evaluates a float copy of the backbone on the run's targets while the other
    ranks wait for its answer, so one evaluation must take less than ``train.timeout_s``.
    The scalars go to metrics.jsonl (one record ``{"step", "epoch", "eval/<target>/..."}``)
    and TensorBoard. When ``eval.best_metric`` improved, rank 0 writes ``best_backbone.pt``
    (a backbone export) and then ``best.json`` (``step``, ``metric``, ``value``), each
    atomically; an existing best.json (a resumed run) is the value to beat.
    """

    def __init__(
        self,
        cfg: ExperimentConfig,
        dist_info: DistInfo,
        metrics: MetricsWriter,
        targets: list[EvalTarget] | None = None,
    ):
        self.cfg = cfg
        self.targets = run_targets(cfg) if targets is None else targets
        self.dist_info = dist_info
        self.metrics = metrics
        self.run_dir = cfg.run_dir
        self.protocols = [protocol_for(target) for target in self.targets]
        self.best_value: float | None = None
        best_metric = cfg.eval.best_metric
        self.lower_is_better = (
            best_metric is not None and best_metric.rpartition("/")[2] in LOWER_IS_BETTER
        )
        best_file = self.run_dir / "best.json"
        if dist_info.is_main and best_metric is not None and best_file.is_file():
            try:
                saved = json.loads(best_file.read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"{best_file}: not valid JSON ({exc})") from exc
            if saved.get("metric") == best_metric:
                self.best_value = float(saved["value"])

    def after_step(self, run: Run, result: StepResult) -> None:
        if self.due(run.progress.step):
            # Collective: rank 0 evaluates (the run's targets), the others wait for it.
            self.run(run.progress.step, run.progress.epoch, run.whole_backbone())

    def due(self, step: int) -> bool:
        every = self.cfg.eval.every_steps
        return bool(every and self.targets and step % every == 0)

    def run(self, step: int, epoch: int, backbone: nn.Module | None) -> dict[str, dict] | None:
        """Evaluate (rank 0) and wait for it (every rank). Returns rank 0's results, else None.

        `backbone` is the whole backbone on rank 0 (the others may pass None).

        An error on rank 0 (a missing image) is raised on every rank, not left to the timeout.
        """
        results, error = None, None
        if self.dist_info.is_main:
            try:
                assert backbone is not None
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
            results = evaluate_config_targets(
                cfg, model, device, progress=False, xnorm=True, targets=self.targets
            )
        values = scalars(self.protocols, results)
        self.metrics.log(step, {"epoch": epoch, **values}, prefix=None)
        # Each target's first metric (verification: accuracy; re-id: mAP; IJB: AUC, rank-1).
        firsts = [(p.name, *next(iter(p.scalars(results[p.name]).items()))) for p in self.protocols]
        log.info("step %d eval: %s", step, ", ".join(f"{n} {m} {v:.4g}" for n, m, v in firsts))
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
