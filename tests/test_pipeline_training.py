"""train() with a pipelined backbone (two gloo ranks, P = 2) against P = 1, and resumes
from one layout to the other.

The P = 1 reference takes the same micro-batches as gradient accumulation: a pipelined
batch of 8 in 2 micro-batches of 4 is an unpipelined batch of 4 with
train.accumulate_steps=2 (the same 8 samples per step, in the same order, BatchNorm over 4
at a time, the loss of each divided by 2). Both sample the same data and draw the same
initial backbone and class matrix, so the loss curves agree to float32 rounding, and a
checkpoint of either resumes in the other on the curve of the run that went on.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import REPO, child_env, free_port, init_gloo_rank, tiny_run_overrides, torchrun

from recognition import checkpoint as ckpt
from recognition.config import load_config
from recognition.training import train

NUM_STEPS = 6
RESUME_STEP = 3
RTOL = 2e-5  # float32 in different reduction orders over 6 steps


def overrides(image_folder: Path, out: Path, stages: int, *extra: str) -> list[str]:
    # Stages split a batch of 8 into micro-batches of 4; one stage accumulates 2 of 4.
    batch = (
        ["train.batch_size=8"] if stages > 1 else ["train.batch_size=4", "train.accumulate_steps=2"]
    )
    return tiny_run_overrides(
        image_folder,
        out,
        f"model.pipeline_stages={stages}",
        "model.micro_batch_size=4",
        *batch,
        "train.epochs=2",
        f"train.max_steps={NUM_STEPS}",
        f"train.checkpoint_every={RESUME_STEP}",
        "train.keep_checkpoints=5",
        "train.timeout_s=120",
        "optim.grad_clip=2.0",
        "optim.warmup_epochs=0.1",
        *extra,
    )


def run(args: list[str]) -> Path:
    return train(load_config("default", args))


def records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}


def _rank_main(rank: int, port: int, jobs: list[list[str]]) -> None:
    init_gloo_rank(rank, 2, port)
    for job in jobs:
        run(job)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def test_two_stages_train_like_one_with_accumulation_and_resume_across_layouts(
    image_folder, tmp_path
):
    p1, p2 = tmp_path / "p1", tmp_path / "p2"
    p1_o2, p2_o2 = tmp_path / "p1_o2", tmp_path / "p2_o2"
    p2_fp16, p2_o3, p2_cl = tmp_path / "p2_fp16", tmp_path / "p2_o3", tmp_path / "p2_cl"
    o2 = ("precision.level=O2", "precision.dtype=bf16")
    run(overrides(image_folder, p1, 1))
    run(overrides(image_folder, p1_o2, 1, *o2))
    # Channels-last on a CPU needs 16 channels at the strided 1x1 convolutions (oneDNN issue
    # 6035, recognition/models/cpu_layout.py): the 1/4-width backbone.
    wide = "model.width=0.25"
    p1_wide = run(overrides(image_folder, tmp_path / "p1_wide", 1, wide))
    p1_to_p2 = tmp_path / "p1_to_p2"
    jobs = [
        overrides(image_folder, p2, 2),
        overrides(image_folder, p2_o2, 2, *o2, "model.pipeline_schedule=gpipe"),
        overrides(image_folder, p2_fp16, 2, "precision.level=O1", "precision.dtype=fp16"),
        overrides(image_folder, p2_o3, 2, "precision.level=O3", "precision.dtype=bf16"),
        overrides(image_folder, p2_cl, 2, wide, "data.channels_last=true"),
        overrides(
            image_folder,
            p1_to_p2,
            2,
            f"train.resume={ckpt.checkpoint_path(p1, RESUME_STEP)}",
        ),
    ]
    mp.spawn(_rank_main, args=(free_port(), jobs), nprocs=2)
    p2_to_p1 = run(
        overrides(
            image_folder,
            tmp_path / "p2_to_p1",
            1,
            f"train.resume={ckpt.checkpoint_path(p2, RESUME_STEP)}",
        )
    )

    want = losses(p1)
    assert sorted(want) == list(range(1, NUM_STEPS + 1))
    assert records(p1)[0]["grad_norm"] > 2.0  # the first steps clip: the norm is tested
    got, ref = losses(p2), losses(p1)
    assert sorted(got) == sorted(ref)
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=RTOL), step
    # The pipelined run's grad norm is over both stages and the whole head.
    for mine, theirs in zip(records(p2), records(p1), strict=True):
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=RTOL)
    # O2 / bf16: the first step agrees closely (the gradient of the bf16 activation at the
    # cut adds its two branches in another order); later steps drift apart as bf16 rounding
    # of the weights amplifies that (a few percent by step 3 here), so they are only
    # checked to train.
    first, first_ref = records(p2_o2)[0], records(p1_o2)[0]
    assert first["loss"] == pytest.approx(first_ref["loss"], rel=1e-5)
    assert first["grad_norm"] == pytest.approx(first_ref["grad_norm"], rel=1e-4)
    o2 = losses(p2_o2)
    assert sorted(o2) == list(range(1, NUM_STEPS + 1)) and all(map(math.isfinite, o2.values()))
    assert o2[NUM_STEPS] < o2[1]
    # fp16 with loss scaling: finite and scaled (the scaler's inf check is over both ranks).
    fp16 = records(p2_fp16)
    assert all(math.isfinite(r["loss"]) for r in fp16)
    assert fp16[0]["loss_scale"] >= 1.0
    # Channels-last: the maps cross between stages contiguous and compute channels-last
    # again. Other convolution kernels round otherwise: the first step agrees to float32
    # rounding, later ones drift (0.2 % by step 4 here, as this short run is chaotic).
    channels_last = records(p2_cl)
    assert channels_last[0]["loss"] == pytest.approx(losses(p1_wide)[1], rel=1e-5)
    assert channels_last[0]["grad_norm"] == pytest.approx(
        records(p1_wide)[0]["grad_norm"], rel=1e-4
    )
    assert len(channels_last) == NUM_STEPS and channels_last[-1]["loss"] < channels_last[0]["loss"]
    # O3 (pure bf16, BatchNorm too): the stages pass bf16 activations and train.
    assert all(math.isfinite(r["loss"]) for r in records(p2_o3)) and len(records(p2_o3)) == 6

    # Resumed in the other layout at step 3: steps 4..6 are those of the run that went on.
    for resumed, straight in ((p2_to_p1, p2), (p1_to_p2, p1)):
        got, ref = losses(resumed), losses(straight)
        assert sorted(got) == list(range(RESUME_STEP + 1, NUM_STEPS + 1)), resumed.name
        for step in got:
            assert got[step] == pytest.approx(ref[step], rel=RTOL), (resumed.name, step)

    # The checkpoint holds the backbone under its unsplit names, once; the export of the
    # pipelined run is the whole backbone, equal to the checkpoint's.
    last = ckpt.latest_checkpoint(p2)
    model_cfg, _, exported = ckpt.load_backbone_file(p2 / "backbone.pt")
    saved = ckpt.load_backbone_file(last)[2]
    reference = ckpt.load_backbone_file(ckpt.latest_checkpoint(p1))[2]
    assert saved.keys() == exported.keys() == reference.keys()
    for key in saved:
        assert torch.equal(saved[key], exported[key]), key
    assert model_cfg["pipeline_stages"] == 2
    entries = ckpt.checkpoint_entries(last)
    assert tuple(entries["head/weight"].size) == (12, 16)
    log = (p2 / "train.log").read_text()
    assert "pipeline: 2 stages x 1 data-parallel replicas, 2 micro-batches of 4 (1f1b)" in log


def test_torchrun_two_stages_trains_evaluates_and_exports(image_folder, tmp_path):
    """The command line: torchrun, two processes, two stages, evaluation at the end."""
    import subprocess

    out = tmp_path / "run"
    # An LFW-layout copy of 6 identities and a pairs file over it: 2 folds of 3 + 3 pairs.
    val = tmp_path / "val"
    for c in range(6):
        (val / f"id{c:02d}").mkdir(parents=True)
        for n in range(4):
            image = (image_folder / f"id{c:02d}" / f"{n}.jpg").read_bytes()
            (val / f"id{c:02d}" / f"id{c:02d}_{n + 1:04d}.jpg").write_bytes(image)
    lines = ["2\t3"]
    for fold in range(2):
        lines += [f"id{c:02d}\t{fold + 1}\t{fold + 3}" for c in range(3)]
        lines += [f"id{c:02d}\t{fold + 1}\tid{c + 3:02d}\t{fold + 2}" for c in range(3)]
    pairs = val / "pairs.txt"
    pairs.write_text("\n".join(lines) + "\n")
    args = tiny_run_overrides(
        image_folder, out, "model.pipeline_stages=2", "train.batch_size=8", "train.max_steps=4",
        f"eval.targets=[{{name: tiny, pairs: {pairs}}}]",
    )  # fmt: skip
    command = torchrun(
        "--nproc_per_node", "2", "--master_port", str(free_port()), str(REPO / "train.py"), *args
    )  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=child_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in records(out)] == [1, 2, 3, 4]
    assert "pipeline: 2 stages" in (out / "train.log").read_text()
    result = json.loads((out / "eval.json").read_text())
    assert result["tiny"]["num_pairs"] == 12
    model_cfg, _, exported = ckpt.load_backbone_file(out / "backbone.pt")
    assert (
        model_cfg["pipeline_stages"] == 2 and "fc.weight" in exported and "conv1.weight" in exported
    )
