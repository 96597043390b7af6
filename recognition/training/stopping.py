"""Stopping a run early and losing nothing: a stop signal or the time limit ends the run at
a step every rank agrees on, with a checkpoint of that step.

A scheduler stops a job with a signal: Kubernetes SIGTERM (then SIGKILL after the pod's
grace period), Slurm SIGTERM on preemption and the signal of `--signal=SIG@SECONDS` before
the time limit, torchrun forwarding SIGTERM, SIGINT, SIGHUP and SIGQUIT to its workers. On
the first of `train.stop_signals` that reaches any rank (`SignalCatcher`; a handler that
only takes note, so a second signal, during the save too, interrupts nothing), or once the
time left before `train.time_limit` is no more than what stopping needs (the longest save
so far, twice, SAVE_RESERVE_S before the first; and the longest step once for each step to
the next check, and once more), the `StopHook` ends the run:

- the ranks agree on one last step: one process stops after the step in flight; several
  ranks combine their reasons (an all-reduce MAX) only at the logging steps
  (`train.log_every`), where the loss curve is reduced over the ranks and the host reads
  the steps' values anyway, so that the steps in between stay free of host
  synchronisation; they stop after that step, all alike: at most `train.log_every` steps
  after the signal, none of them lost;
- the checkpointer saves that step (atomically, like every checkpoint);
- the loop returns, `train` skips the export and the final evaluation, logs one line
  ("stopped by SIGTERM at step 1234; checkpoint ...; resume with train.resume=auto"),
  with `train.requeue` on a Slurm job has rank 0 requeue the job after the checkpoint
  (`scontrol requeue`), and raises `RunStopped`, which train.py turns into that line and
  EXIT_STOPPED.

Nothing is lost: the checkpoint holds the step's whole state (an accumulation cycle is one
step; a periodic evaluation of the step has run before it is saved), so the resumed run
gives every later step the loss of an uninterrupted one.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from recognition.distributed import all_reduce_max
from recognition.training.errors import TrainingError
from recognition.training.hooks import Hook, log_due

if TYPE_CHECKING:
    from recognition.training.build import Run
    from recognition.training.step import StepResult

log = logging.getLogger(__name__)

EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped with a checkpoint; try again (resume) later
SAVE_RESERVE_S = 120.0  # what a save is taken to need before one was timed
TIME_LIMIT_REASON = 1000  # above every signal number: the reason the all-reduce carries


class RunStopped(TrainingError):
    """The run stopped before its last step, with a checkpoint of the step it stopped at."""

    def __init__(self, message: str, step: int, reason: str) -> None:
        super().__init__(message)
        self.step, self.reason = step, reason


def now() -> float:
    """Wall-clock seconds (Unix time, as Slurm's end time): what the time limit is read on."""
    return time.time()


def slurm_end_time() -> float | None:
    """The Slurm job's end (Unix time): SLURM_JOB_END_TIME, else `squeue`'s; None outside a
    job or when neither says."""
    if os.environ.get("SLURM_JOB_END_TIME", "").isdigit():
        return float(os.environ["SLURM_JOB_END_TIME"])
    job = os.environ.get("SLURM_JOB_ID")
    if not job or shutil.which("squeue") is None:
        return None
    try:
        done = subprocess.run(
            ["squeue", "-h", "-j", job, "-o", "%e"], capture_output=True, text=True, timeout=30
        )
        end = datetime.datetime.fromisoformat(done.stdout.strip())
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return end.timestamp()


def requeue_slurm_job() -> str:
    """Requeue this Slurm job (`scontrol requeue`; an array job's own task); returns what
    happened, in words."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return "not requeued: no SLURM_JOB_ID (not a Slurm job)"
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    try:
        done = subprocess.run(
            ["scontrol", "requeue", job], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"requeueing job {job} failed: {exc}"
    if done.returncode != 0:
        return f"requeueing job {job} failed: {(done.stderr or done.stdout).strip()}"
    return f"requeued job {job}"


class SignalCatcher:
    """While installed (`installed()`), the signals named take note of themselves instead of
    their default action: `received` is the first one's name."""

    def __init__(self, names: Sequence[str]) -> None:
        self.signals = [getattr(signal, name) for name in names]
        self.received: str | None = None

    def _note(self, number: int, frame: object) -> None:
        name = signal.Signals(number).name
        if self.received is None:
            self.received = name
            log.warning("%s received: stopping after the step in flight, with a checkpoint", name)
        else:  # a handler that only takes note: a save in progress goes on
            log.warning("%s received again: already stopping", name)

    @contextmanager
    def installed(self) -> Iterator[SignalCatcher]:
        """Install the handlers (main thread only; elsewhere none), restore the old ones."""
        previous = {}
        try:
            for number in self.signals:
                try:
                    previous[number] = signal.signal(number, self._note)
                except ValueError:  # not the main thread: signals go to the main thread
                    break
            yield self
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)


class StopHook(Hook):
    """Ends the run at a step every rank agrees on (module docstring): sets
    `run.stop_reason` after the step at which the ranks' reasons are combined. First among
    the hooks, so that the checkpointer saves the step it stops at."""

    def __init__(
        self,
        catcher: SignalCatcher,
        time_limit: float | str | None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.catcher, self.clock = catcher, clock or now
        self.limit = time_limit
        self.deadline: float | None = None
        self.longest_step = 0.0
        self.step_start = 0.0

    def before_train(self, run: Run) -> None:
        now_s = self.clock()
        if self.limit == "auto":
            self.deadline = slurm_end_time()
            if self.deadline is None:
                log.warning("train.time_limit=auto: no Slurm job end time found; no limit")
        elif self.limit is not None:
            self.deadline = now_s + float(self.limit)
        self.step_start = now_s

    def before_step(self, run: Run) -> None:
        self.step_start = self.clock()

    def after_step(self, run: Run, result: StepResult) -> None:
        now_s = self.clock()
        self.longest_step = max(self.longest_step, now_s - self.step_start)
        if run.progress.step >= run.last_step:
            return  # the run ends here anyway
        several = run.dist_info.is_distributed
        # Several ranks combine their reasons where they log (every train.log_every steps),
        # where the host reads the steps' values anyway: no synchronisation of their own.
        if several and not log_due(run):
            return
        steps_to_next = run.cfg.train.log_every if several else 1
        reason = self._local_reason(run, now_s, steps_to_next)
        if several:  # collective: every rank is at this step, and agrees
            reason = int(all_reduce_max(float(reason)))
        if reason:
            run.stop_reason = _reason_name(reason)

    def _local_reason(self, run: Run, now_s: float, steps_to_next: int) -> int:
        if self.catcher.received is not None:
            return int(getattr(signal, self.catcher.received))
        if self.deadline is not None:
            save = 2 * (run.longest_save_s or SAVE_RESERVE_S / 2)
            # Until the next check, and the one step more that a stop may take.
            if now_s + save + (steps_to_next + 1) * self.longest_step >= self.deadline:
                return TIME_LIMIT_REASON
        return 0


def _reason_name(reason: int) -> str:
    if reason == TIME_LIMIT_REASON:
        return "the time limit (train.time_limit)"
    return signal.Signals(reason).name
