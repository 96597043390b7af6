"""A stop signal or the time limit ends a run at a step every rank agrees on, with one
checkpoint of that step, and the run resumed from it gives every later step the loss of an
uninterrupted run (training/stopping.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, child_env, free_port, torchrun, wait_until
from test_distributed_training import children, environ
from test_periodic_eval import config_overrides, data  # noqa: F401  (a fixture)

from recognition import checkpoint as ckpt
from recognition.config import ConfigError, load_config
from recognition.config.values import parse_time_limit
from recognition.training import hooks, loop, stopping, train
from recognition.training.hooks import Hook
from recognition.training.stopping import RunStopped


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss as metrics.jsonl logged it (each step once: a resumed run appends)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    return {r["step"]: r["loss"] for r in records if "loss" in r}


class SignalAt(Hook):
    """Sends `signum` to this process after step `step` (the signal lands between steps)."""

    def __init__(self, step: int, signum: int = signal.SIGUSR1) -> None:
        self.step, self.signum = step, signum

    def after_step(self, run, result) -> None:
        if run.progress.step == self.step:
            os.kill(os.getpid(), self.signum)


def with_hook(monkeypatch, hook: Hook) -> None:
    real = loop.default_hooks
    monkeypatch.setattr(loop, "default_hooks", lambda run, metrics: [*real(run, metrics), hook])


CASES = {  # what the run does when the signal comes: mid-epoch, mid-accumulation, evaluating
    "mid_epoch": [],
    "accumulation": ["train.accumulate_steps=2"],
    "evaluation": ["eval.every_steps=2"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_signal_stops_at_a_checkpoint_and_the_resumed_run_is_the_uninterrupted_one(
    data,  # noqa: F811
    tmp_path,
    monkeypatch,
    case,
):
    train_root, pairs = data
    extra = [*CASES[case], "train.max_steps=8", f"eval.targets=[{{name: val, pairs: {pairs}}}]"]
    straight = losses(
        train(load_config("default", config_overrides(train_root, tmp_path / "a", *extra)))
    )
    assert sorted(straight) == list(range(1, 9))

    cfg = load_config("default", config_overrides(train_root, tmp_path / "b", *extra))
    if case == "evaluation":  # the signal comes while step 4's evaluation runs
        evaluate = hooks.PeriodicEvaluation._evaluate

        def evaluating(self, step, epoch, backbone):
            if step == 4:
                os.kill(os.getpid(), signal.SIGUSR1)
            return evaluate(self, step, epoch, backbone)

        monkeypatch.setattr(hooks.PeriodicEvaluation, "_evaluate", evaluating)
    else:
        with_hook(monkeypatch, SignalAt(3))
    with pytest.raises(RunStopped) as stopped:
        train(cfg)
    # After the step in flight when the signal came: the next one.
    expected = 5 if case == "evaluation" else 4
    assert stopped.value.step == expected and stopped.value.reason == "SIGUSR1"
    run_dir = cfg.run_dir
    newest = ckpt.latest_checkpoint(run_dir)
    assert newest == ckpt.checkpoint_path(run_dir, expected)
    assert ckpt.verify_checkpoint(newest) is None
    assert not (run_dir / "backbone.pt").exists()  # no export or final evaluation
    log = (run_dir / "train.log").read_text()
    assert f"stopped by SIGUSR1 at step {expected}; checkpoint {newest}" in log

    monkeypatch.undo()
    resumed = config_overrides(train_root, run_dir, *extra, "train.resume=auto")
    train(load_config("default", resumed))
    assert losses(run_dir) == straight  # to the bit: the resumed steps too


def test_a_second_signal_during_the_save_does_not_interrupt_it(image_folder, tmp_path, monkeypatch):
    from helpers import tiny_config

    save = ckpt.save_checkpoint
    saves = []

    def saving(run_dir, step, parts, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # mid-save
        saves.append(step)
        return save(run_dir, step, parts, **kwargs)

    monkeypatch.setattr(ckpt, "save_checkpoint", saving)
    with_hook(monkeypatch, SignalAt(2, signal.SIGINT))
    cfg = tiny_config(image_folder, tmp_path / "run", "train.max_steps=20")
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RunStopped) as stopped:
        train(cfg)
    assert stopped.value.step == 3 and stopped.value.reason == "SIGINT"
    assert saves == [3]  # one save, finished
    assert ckpt.verify_checkpoint(ckpt.checkpoint_path(cfg.run_dir, 3)) is None
    assert "SIGTERM received again: already stopping" in (cfg.run_dir / "train.log").read_text()
    # The handlers are put back once the run is over.
    assert signal.getsignal(signal.SIGTERM) == before


def test_the_time_limit_stops_before_it_with_a_checkpoint_and_requeues(
    image_folder, tmp_path, monkeypatch
):
    """A fake clock, 50 s a reading: a step takes 50 s from its start to its end and 100 s
    from one end to the next. Before any save the stop keeps 2 x 60 s for one, and two of the
    longest steps: with a limit of 1,000 s it stops once now + 120 + 100 reaches 1,000, at
    the end of step 8 (800 s; step 7 ends at 700 s)."""
    from helpers import tiny_config

    clock = iter(range(0, 10**6, 50))  # before_train, then before and after each step
    monkeypatch.setattr(stopping, "now", lambda: float(next(clock)))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol.calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    cfg = tiny_config(
        image_folder, tmp_path / "run", "train.max_steps=30", "train.time_limit=1000",
        "train.requeue=true",
    )  # fmt: skip
    with pytest.raises(RunStopped) as stopped:
        train(cfg)
    assert stopped.value.step == 8 and "time limit" in stopped.value.reason
    assert ckpt.latest_checkpoint(cfg.run_dir) == ckpt.checkpoint_path(cfg.run_dir, 8)
    assert calls.read_text() == "requeue 4242\n"
    assert "requeued job 4242" in str(stopped.value)


def test_requeue_names_an_array_jobs_own_task_and_says_when_it_cannot(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/sh\necho "$@"; echo "job is finishing" >&2; exit 1\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    for key in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(key, raising=False)
    assert stopping.requeue_slurm_job() == "not requeued: no SLURM_JOB_ID (not a Slurm job)"
    monkeypatch.setenv("SLURM_JOB_ID", "901")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "900")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "7")
    assert stopping.requeue_slurm_job() == "requeueing job 900_7 failed: job is finishing"


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("47:30:00", 171000.0), ("1-02:00:00", 93600.0), ("05:30", 330.0), ("90", 90.0),
     (171000, 171000.0), (2.5, 2.5), ("auto", "auto"), (None, None)],
)  # fmt: skip
def test_time_limits_are_read_as_slurm_writes_them(value, seconds):
    assert parse_time_limit(value) == seconds


def test_config_names_a_bad_stop_key():
    with pytest.raises(ConfigError, match=r"train\.stop_signals: 'SIGKILL' is not one of"):
        load_config("default", ["train.stop_signals=[SIGTERM, SIGKILL]"])
    with pytest.raises(ConfigError, match=r"train\.time_limit: '1:70:00': minutes"):
        load_config("default", ["train.time_limit='1:70:00'"])
    with pytest.raises(ConfigError, match=r"train\.time_limit: 'soon' is not"):
        load_config("default", ["train.time_limit=soon"])
    # YAML reads 47:30:00 as base-60 seconds: the same limit.
    assert load_config("default", ["train.time_limit=47:30:00"]).train.time_limit == 171000


def test_train_py_exits_75_with_one_line_and_workers_ride_out_the_signal(image_folder, tmp_path):
    """SIGTERM to every process of the job, as Slurm and a terminal deliver it: the
    DataLoader workers ignore it, the run stops with a checkpoint, train.py exits 75."""
    from helpers import tiny_run_overrides

    out = tmp_path / "run"
    args = tiny_run_overrides(image_folder, out, "train.batch_size=4", "train.epochs=50",
                              "data.num_workers=2")  # fmt: skip
    process = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *args], cwd=tmp_path, env=child_env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    wait_for_steps(out, 3, [process])
    assert len(children(process.pid)) >= 2  # the loader's workers
    os.killpg(process.pid, signal.SIGTERM)
    stderr = process.communicate(timeout=60)[1]
    # The literal, not EXIT_STOPPED: 75 (EX_TEMPFAIL) is what Slurm scripts and docs/training.md
    # promise, so a changed constant must fail here rather than move the test along with it.
    assert process.returncode == 75 == os.EX_TEMPFAIL, stderr[-3000:]
    [line] = [x for x in stderr.splitlines() if x.startswith("stopped by")]
    step = int(line.split(" at step ")[1].split(";")[0])
    assert f"stopped by SIGTERM at step {step}; checkpoint " in line
    assert ckpt.latest_checkpoint(out) == ckpt.checkpoint_path(out, step)
    assert "Traceback" not in stderr


def wait_for_steps(run_dir: Path, steps: int, processes: list, timeout: float = 120) -> None:
    metrics = run_dir / "metrics.jsonl"

    def logged() -> bool | None:
        return (
            True if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps else None
        )

    wait_until(logged, processes, timeout, f"{run_dir}: not {steps} steps logged")


@pytest.mark.parametrize("target", ["launcher", "one_rank"])
def test_two_ranks_stop_at_the_same_step(image_folder, tmp_path, target):
    """torchrun, 2 ranks: SIGTERM to the launcher (it forwards it), or SIGUSR1 to rank 1
    alone: both ranks checkpoint the same step and leave within seconds. (That a resumed
    run goes on as if uninterrupted is checked above, and across world sizes in
    test_distributed_training.py.)"""
    from helpers import tiny_run_overrides

    out = tmp_path / "run"
    args = tiny_run_overrides(image_folder, out, "train.batch_size=4", "train.epochs=30",
                              "train.timeout_s=30")  # fmt: skip
    agent = subprocess.Popen(
        torchrun("--nproc_per_node", "2", "--master_port", str(free_port()),
                 str(REPO / "train.py"), *args),
        cwd=tmp_path, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    wait_for_steps(out, 3, [agent])
    if target == "launcher":
        os.kill(agent.pid, signal.SIGTERM)
    else:
        rank1 = next(p for p in children(agent.pid) if environ(p).get("RANK") == "1")
        os.kill(rank1, signal.SIGUSR1)
    sent = time.monotonic()
    stderr = agent.communicate(timeout=60)[1]
    assert time.monotonic() - sent < 20, stderr[-3000:]
    name = "SIGTERM" if target == "launcher" else "SIGUSR1"
    log = (out / "train.log").read_text()
    [line] = [x for x in log.splitlines() if "stopped by" in x]
    step = int(line.split(" at step ")[1].split(";")[0])
    assert f"stopped by {name} at step {step}" in line
    newest = ckpt.latest_checkpoint(out)
    assert newest == ckpt.checkpoint_path(out, step)
    assert len(list(newest.glob("__*_0.distcp"))) == 2 and ckpt.verify_checkpoint(newest) is None
    assert sorted(losses(out)) == list(range(1, step + 1))
