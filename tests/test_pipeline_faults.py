"""Faults of a pipelined run, as a user meets them on the command line: layouts that cannot
be cut, a damaged checkpoint resumed on another stage count, a rank killed mid-step. Each:
a non-zero exit, the project's message once (whatever the number of ranks), no traceback of
ours (torchrun's agent prints its own ChildFailedError summary), checkpoints intact."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, child_env, free_port, start_rank, tiny_run_overrides, torchrun
from test_cli_faults import one_error_line
from test_distributed_training import wait_for_checkpoint

import train
from recognition import checkpoint as ckpt


def pipeline_args(image_folder: Path, out: Path, *extra: str) -> list[str]:
    """Two stages of the 1/8-width IResNet-18, micro-batches of 2, checkpoints every 3 steps."""
    return tiny_run_overrides(
        image_folder, out, "train.batch_size=4", "model.pipeline_stages=2",
        "model.micro_batch_size=2", "train.checkpoint_every=3", "train.timeout_s=30", *extra,
    )  # fmt: skip


def our_lines(stderr: str) -> str:
    """`stderr` of a torchrun job without torchrun's own failure summary (its traceback of
    ChildFailedError and the report after it), which is the launcher's, not ours."""
    summary = stderr.find("Traceback (most recent call last):")
    if summary >= 0:
        assert (
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
            in (stderr[summary:])
        ), stderr[-3000:]
        tail = stderr[summary:]
        assert tail.count("Traceback") == 1, stderr[-3000:]  # the launcher's, and only it
        stderr = stderr[:summary]
    return stderr


def run_torchrun(num: int, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    command = torchrun(
        "--nproc_per_node", str(num), "--master_port", str(free_port()),
        str(REPO / "train.py"), *args,
    )  # fmt: skip
    return subprocess.run(
        command, cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=240
    )


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["model.pipeline_stages=12", "model.pipeline_schedule=gpipe"], "only 10 units"),
        (["model.pipeline_split=[layer9.0]"], "'layer9.0' is not a unit of the backbone"),
        (["model.pipeline_split=[layer3.0,layer2.0]"], "must be in forward order"),
        ([], "model.pipeline_stages=2 does not divide the 1 processes"),
    ],
)
def test_layouts_that_cannot_be_cut_stop_in_one_line(
    image_folder, tmp_path, capsys, extra, expected
):
    out = tmp_path / "run"
    args = pipeline_args(image_folder, out, "train.batch_size=24", *extra)
    if "model.pipeline_split=[layer3.0,layer2.0]" in extra:
        args.append("model.pipeline_stages=3")
    assert train.main(args) == 1
    line = one_error_line(capsys.readouterr().err)
    assert expected in line
    assert not (out / "classes.txt").exists() and not (out / "checkpoints").exists()


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["model.micro_batch_size=3"], "model.micro_batch_size=3 does not divide"),
        (["model.micro_batch_size=1"], "micro-batches of 1 sample"),
        (["model.micro_batch_size=null"], "micro-batches of 1 sample"),  # 4 / (2 x 2)
        (["model.micro_batch_size=4"], "1f1b needs at least model.pipeline_stages=2"),
    ],
)
def test_micro_batches_that_cannot_train_are_config_errors(
    image_folder, tmp_path, capsys, extra, expected
):
    assert train.main(pipeline_args(image_folder, tmp_path / "run", *extra)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("config error: model.") and expected in line


def test_a_world_size_the_stages_do_not_divide_is_said_once(image_folder, tmp_path):
    out = tmp_path / "run"
    done = run_torchrun(3, pipeline_args(image_folder, out), tmp_path)
    assert done.returncode != 0
    line = one_error_line(our_lines(done.stderr))
    assert "model.pipeline_stages=2 does not divide the 3 processes" in line
    # Every rank's log keeps it.
    assert "does not divide" in (out / "train.log").read_text()
    assert "does not divide" in (out / "train.rank2.log").read_text()


def test_damaged_checkpoint_resumed_on_another_stage_count(image_folder, tmp_path):
    out = tmp_path / "run"
    done = run_torchrun(2, pipeline_args(image_folder, out, "train.max_steps=6"), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    newest = ckpt.latest_checkpoint(out)
    assert newest.name == "step_00000006"
    shard = newest / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    kept = {p.name: p.read_bytes() for p in (out / "checkpoints").rglob("*") if p.is_file()}

    # Named explicitly, on one process without stages: refused, naming the file.
    args = tiny_run_overrides(
        image_folder, out, "train.batch_size=4", f"train.resume={newest}", "train.max_steps=9"
    )
    one = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args], cwd=tmp_path, env=child_env(),
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert one.returncode == 1
    line = one_error_line(one.stderr)
    assert f"train.resume: {newest} is damaged" in line and "__1_0.distcp is truncated" in line
    # On three stages (gpipe: 2 micro-batches), the same refusal once, from rank 0.
    three = pipeline_args(
        image_folder, out, "model.pipeline_stages=3", "model.pipeline_schedule=gpipe",
        f"train.resume={newest}", "train.max_steps=9",
    )  # fmt: skip
    done = run_torchrun(3, three, tmp_path)
    assert done.returncode != 0
    assert "__1_0.distcp is truncated" in one_error_line(our_lines(done.stderr))
    after = {p.name: p.read_bytes() for p in (out / "checkpoints").rglob("*") if p.is_file()}
    assert after == kept  # nothing written over, nothing removed

    # train.resume=auto skips it and continues from step 3 on three stages.
    auto = [a for a in three if not a.startswith("train.resume=")] + ["train.resume=auto"]
    done = run_torchrun(3, auto, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    log = (out / "train.log").read_text()
    assert "is damaged" in log and "resumed from" in log and "step_00000003 at step 3" in log
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 10))


def test_a_rank_killed_during_a_pipelined_step(image_folder, tmp_path):
    out = tmp_path / "run"
    timeout_s = 20
    args = pipeline_args(
        image_folder, out, "train.epochs=40", f"train.timeout_s={timeout_s}", "train.resume=auto"
    )
    port = free_port()

    def start(rank: int) -> subprocess.Popen:
        return start_rank(rank, 2, port, args, tmp_path)

    ranks = [start(0), start(1)]
    wait_for_checkpoint(out, ranks, timeout=90)
    time.sleep(0.5)  # well inside the steps after it
    for rank_to_kill, survivor in ((0, 1), (1, 0)):
        if rank_to_kill == 1:  # the second round: a new job, the last stage killed
            ranks = [start(0), start(1)]
            deadline = time.monotonic() + 90
            while "resumed from" not in (out / "train.log").read_text():
                assert time.monotonic() < deadline and all(p.poll() is None for p in ranks)
                time.sleep(0.1)
            time.sleep(1.0)
        kept = {
            p: p.read_bytes()
            for p in (out / "checkpoints").glob("step_*/*")  # complete ones, not .tmp-*
        }
        killed_at = time.monotonic()
        ranks[rank_to_kill].send_signal(signal.SIGKILL)
        stderr = ranks[survivor].communicate(timeout=timeout_s + 60)[1]
        ranks[rank_to_kill].wait()
        assert time.monotonic() - killed_at < timeout_s + 30
        assert ranks[survivor].returncode == 1, stderr[-3000:]
        line = one_error_line(stderr)
        assert f"rank {survivor}: stopping, a collective operation failed" in line
        # The checkpoints that were complete are still there and read back whole.
        for path, data in kept.items():
            if path.exists():
                assert path.read_bytes() == data
        latest = ckpt.latest_checkpoint(out)
        assert latest is not None and ckpt.read_checkpoint(latest, ["progress"])
