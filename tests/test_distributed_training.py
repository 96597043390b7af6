"""train() on several processes (gloo, CPU): exactness against one process, resharding
resume, torchrun on one and two "nodes", a rank killed mid-run.

Exactness. W ranks with a local batch B must step like one process with a batch of W*B:
the same global batch each step (DistributedSampler's order), the same initial model (rank
0's backbone broadcast by DDP, a class matrix drawn independently of the split), the
gradient of the global mean loss (the head's gradient convention and DDP's average), and
clipping by the norm over all ranks. The backbone here has no batch statistics (torch's
SyncBatchNorm does not run on CPU), so the only differences are float32 summation orders.

Every run here has a global batch of 6 (1 x 6, 2 x 3, 3 x 2, 3 ranks x 2 micro-batches of 1)
on 72 images (12 steps per epoch), so the checkpoints of any of them resume on any world
size with the same samples and learning rates, and the losses after the resume must be
those of the run that went on.
The 1-process reference runs in the test process; the multi-rank runs in spawned gloo
groups (one per world size: spawning is the slow part).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import (
    REPO,
    child_env,
    folder_overrides,
    free_port,
    init_gloo_rank,
    start_rank,
    tiny_run_overrides,
    torchrun,
    wait_until,
)
from torch import nn

import recognition.training.backbone_check as backbone_check
import recognition.training.build as training_build
from recognition import checkpoint as ckpt
from recognition import distributed
from recognition.config import ConfigError, OptimConfig, load_config
from recognition.heads import ShardedMarginSoftmax, build_margin
from recognition.optim import build_optimizer, param_groups
from recognition.precision import Precision
from recognition.training import TrainingError, global_grad_norm, train
from recognition.training.state import load_training_state, training_state

NUM_STEPS = 6
RESUME_STEP = 3
GLOBAL_BATCH = 6
# Float32 runs whose reductions add in different orders: a few ulps a step, grown by 6 steps.
RTOL, ATOL = 2e-5, 2e-6


def tiny_overrides(image_folder: Path, out: Path, world_size: int, *extra: str) -> list[str]:
    return [
        *folder_overrides(image_folder, out),
        "model.embedding_size=16",
        f"train.batch_size={GLOBAL_BATCH // world_size}",
        "train.epochs=2",
        f"train.max_steps={NUM_STEPS}",
        f"train.checkpoint_every={RESUME_STEP}",
        "train.keep_checkpoints=5",
        "train.log_every=1",
        "train.progress=false",
        "train.timeout_s=60",
        "optim.warmup_epochs=0.1",
        # Strong enough that the first steps clip: the global norm is part of what is tested.
        "optim.grad_clip=1.0",
        "eval.targets=[]",
        *extra,
    ]


class NoBatchStatistics(nn.Module):
    """A backbone whose output for a sample does not depend on the rest of the batch."""

    def __init__(self, embedding_size: int, **_: object) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2, padding=1),
            nn.PReLU(8),
            nn.Conv2d(8, 8, 3, stride=2, padding=1),
            nn.PReLU(8),
            nn.Flatten(),
            nn.Linear(8 * 8 * 8, embedding_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)


def build_tiny_backbone(model_cfg, image_size) -> nn.Module:
    return NoBatchStatistics(model_cfg.embedding_size)


def run(overrides: list[str]) -> Path:
    return train(load_config("default", overrides))


def losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    """Backbone (from the export) and the whole class matrix (from the last checkpoint)."""
    params = {
        f"backbone/{k}": v for k, v in ckpt.load_backbone_file(run_dir / "backbone.pt")[2].items()
    }
    last = ckpt.checkpoint_path(run_dir, NUM_STEPS)
    params["head/weight"] = ckpt.read_checkpoint(last, ["head/weight"])["head/weight"]
    return params


# ---- spawned ranks -----------------------------------------------------------------------


def build_o2_parts() -> tuple:
    """A tiny backbone, a 10-class head (shards of 4, 3, 3 rows on 3 ranks), SGD, O2 bf16."""
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Flatten(), nn.Linear(12, 4), nn.BatchNorm1d(4))
    head = ShardedMarginSoftmax(10, 4, build_margin("cosface"))
    precision = Precision("O2", "bf16", torch.device("cpu"))
    precision.prepare(backbone, head)
    groups = precision.param_groups(param_groups([backbone, head], 5e-4))
    return backbone, head, build_optimizer(groups, OptimConfig(lr=0.1)), precision


def one_step(backbone, head, optimizer, precision) -> None:
    images = torch.randn(6, 3, 2, 2, generator=torch.Generator().manual_seed(1))
    labels = torch.arange(6) + 2
    with precision.autocast():
        loss = head(backbone(precision.cast_inputs(images)), labels)
    precision.backward(loss)
    precision.step(optimizer)


def check_resharded_state(saved: Path, resaved: Path) -> list[str]:
    """Load a 1-rank O2 checkpoint on this rank; its rows must be this shard's, exactly."""
    parts = build_o2_parts()
    backbone, head, _, precision = parts
    load_training_state(saved, *parts)
    whole = ckpt.read_checkpoint(saved)
    rows = slice(head.class_start, head.class_start + head.num_local)
    failures = []
    if not torch.equal(head.weight, whole["head/weight"][rows]):
        failures.append("head/weight")
    master = next(m for _, p, m in precision.masters() if p is head.weight)
    if not torch.equal(master, whole["precision/masters/1.weight"][rows]):
        failures.append("head master")
    momentum = [
        v for k, v in whole.items() if k.startswith("optimizer/state/") and v.shape == (10, 4)
    ]
    state = ckpt.flatten_state(training_state(*parts))
    local = [
        v
        for k, v in state.items()
        if k.startswith("optimizer/state/") and v.shape == (head.num_local, 4)
    ]
    if len(momentum) != 1 or len(local) != 1 or not torch.equal(local[0], momentum[0][rows]):
        failures.append("head momentum")
    for name, value in backbone.state_dict().items():
        if not torch.equal(value, whole[f"backbone/{name}"]):
            failures.append(f"backbone/{name}")
    ckpt.save_checkpoint(resaved, 1, state, keep=1)
    return failures


def _rank_main(
    rank: int, world_size: int, port: int, jobs: list[list[str]], out: str, state_check: bool
) -> None:
    init_gloo_rank(rank, world_size, port, timeout_s=60)
    training_build.backbone_from_config = build_tiny_backbone
    backbone_check.backbone_from_config = build_tiny_backbone  # looked at before the build
    for overrides in jobs:
        if "model.sync_bn=true" in overrides:
            # torch's SyncBatchNorm refuses CPU tensors: the run must say so before training.
            try:
                run(overrides)
            except TrainingError as exc:
                Path(out, f"sync_bn.{rank}.txt").write_text(str(exc))
            continue
        run(overrides)
    if state_check:
        failures = check_resharded_state(Path(out, "o2_1rank"), Path(out, "o2_3ranks"))
        Path(out, f"state_check.{rank}.json").write_text(json.dumps(failures))
    # The scalar reductions the logged metrics go through, with different values per rank.
    reduced = [
        distributed.all_reduce_mean(float(rank)),
        distributed.all_reduce_sum(float(rank + 1)),
        distributed.all_reduce_max(float(rank * 10)),
        distributed.all_reduce_min(float(rank * 10 + 5)),
    ]
    # The clipping norm: a replicated tensor counted once, a sharded one summed over ranks.
    replicated = torch.zeros(3, requires_grad=True)
    replicated.grad = torch.tensor([1.0, 2.0, 2.0])
    head = ShardedMarginSoftmax(2 * world_size, 1, build_margin("cosface"))  # 2 rows per rank
    head.weight.grad = torch.full((2, 1), float(rank + 1))
    reduced.append(float(global_grad_norm([replicated, head.weight], [head])))
    Path(out, f"reduced.{rank}.json").write_text(json.dumps(reduced))
    dist.barrier()
    dist.destroy_process_group()
    # Skip the interpreter's teardown, which intermittently aborts inside gloo (see
    # tests/test_head_distributed.py); the results are already written.
    os._exit(0)


def spawn(world_size: int, jobs: list[list[str]], out: Path, state_check: bool = False) -> None:
    args = (world_size, free_port(), jobs, str(out), state_check)
    mp.spawn(_rank_main, args=args, nprocs=world_size)


def test_ranks_match_one_process_and_resume_on_other_world_sizes(
    image_folder, tmp_path, monkeypatch
):
    monkeypatch.setattr(training_build, "backbone_from_config", build_tiny_backbone)
    monkeypatch.setattr(backbone_check, "backbone_from_config", build_tiny_backbone)
    ref = run(tiny_overrides(image_folder, tmp_path / "w1", 1))

    w2 = tmp_path / "w2"
    sync_bn = tiny_overrides(image_folder, tmp_path / "sync_bn", 2, "model.sync_bn=true")
    spawn(2, [tiny_overrides(image_folder, w2, 2), sync_bn], tmp_path)
    ref_ckpt = ckpt.checkpoint_path(ref, RESUME_STEP)
    w2_ckpt = ckpt.checkpoint_path(w2, RESUME_STEP)
    w3, w2_to_3, w1_to_3 = tmp_path / "w3", tmp_path / "w2to3", tmp_path / "w1to3"
    w3_accum = tmp_path / "w3accum"
    # A one-process O2 checkpoint with momentum, to be re-split over 3 ranks below.
    o2_parts = build_o2_parts()
    one_step(*o2_parts)
    saved = ckpt.save_checkpoint(tmp_path / "o2", 1, training_state(*o2_parts), keep=1)
    saved.rename(tmp_path / "o2_1rank")
    spawn(
        3,
        [
            tiny_overrides(image_folder, w3, 3),
            # 2 micro-batches of 1 per rank (DDP all-reduces after the second only).
            tiny_overrides(
                image_folder, w3_accum, 3, "train.batch_size=1", "train.accumulate_steps=2"
            ),
            tiny_overrides(image_folder, w2_to_3, 3, f"train.resume={w2_ckpt}"),
            tiny_overrides(image_folder, w1_to_3, 3, f"train.resume={ref_ckpt}"),
        ],
        tmp_path,
        state_check=True,
    )
    w2_to_1 = run(tiny_overrides(image_folder, tmp_path / "w2to1", 1, f"train.resume={w2_ckpt}"))

    # The runs clipped (so the global norm mattered) and trained.
    ref_records = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    assert ref_records[0]["grad_norm"] > 1.0
    expected = losses(ref)
    assert sorted(expected) == list(range(1, NUM_STEPS + 1))

    # W ranks with batch 6 / W == one process with batch 6: losses and final parameters.
    for run_dir in (w2, w3, w3_accum):
        got = losses(run_dir)
        assert sorted(got) == sorted(expected), run_dir.name
        for step in expected:
            assert got[step] == pytest.approx(expected[step], rel=RTOL), (run_dir.name, step)
        ref_params, params = final_params(ref), final_params(run_dir)
        assert sorted(params) == sorted(ref_params)
        for key in ref_params:
            torch.testing.assert_close(params[key], ref_params[key], rtol=RTOL, atol=ATOL)
    # The class matrix really moved (a test of parameters that never change proves nothing).
    initial = ckpt.read_checkpoint(ref_ckpt, ["head/weight"])["head/weight"]
    assert not torch.allclose(final_params(ref)["head/weight"], initial, atol=1e-4)

    # Resumed on another world size at step 3: steps 4..6 are those of the run that went on.
    for resumed, straight in ((w2_to_1, w2), (w2_to_3, w2), (w1_to_3, ref)):
        got, want = losses(resumed), losses(straight)
        assert sorted(got) == list(range(RESUME_STEP + 1, NUM_STEPS + 1)), resumed.name
        for step in got:
            assert got[step] == pytest.approx(want[step], rel=RTOL), (resumed.name, step)
        head = final_params(resumed)["head/weight"]
        torch.testing.assert_close(
            head, final_params(straight)["head/weight"], rtol=RTOL, atol=ATOL
        )

    # Only rank 0 wrote metrics and TensorBoard events; other ranks' logs hold no INFO lines.
    assert len(list((w2 / "tb").glob("events.out.tfevents.*"))) == 1
    assert "INFO" not in (w2 / "train.rank1.log").read_text()
    assert not (w2 / "train.rank0.log").exists()

    # O2 masters, class rows and their momentum, re-split from 1 rank over 3 and written back
    # by 3 ranks: each rank held exactly its rows, and the 3-rank checkpoint is the same.
    for rank in range(3):
        assert json.loads((tmp_path / f"state_check.{rank}.json").read_text()) == [], rank
    before = ckpt.read_checkpoint(tmp_path / "o2_1rank")
    after = ckpt.read_checkpoint(ckpt.checkpoint_path(tmp_path / "o2_3ranks", 1))
    assert len(list(ckpt.checkpoint_path(tmp_path / "o2_3ranks", 1).glob("*.distcp"))) == 3
    for name, value in before.items():
        if torch.is_tensor(value):
            assert torch.equal(after[name], value), name

    # model.sync_bn on CPU ranks: a clear error on every rank, before any training.
    for rank in range(2):
        assert "SyncBatchNorm runs on GPUs only" in (tmp_path / f"sync_bn.{rank}.txt").read_text()

    # The logging reductions: mean, sum, max, min over ranks 0..2, and the global grad norm.
    reduced = json.loads((tmp_path / "reduced.1.json").read_text())
    shard_square = sum(2 * (r + 1) ** 2 for r in range(3))  # each rank's 2 elements
    assert reduced == pytest.approx([1.0, 6.0, 20.0, 5.0, (9 + shard_square) ** 0.5])


# ---- torchrun and failures ---------------------------------------------------------------


def cli_overrides(image_folder: Path, out: Path, *extra: str) -> list[str]:
    """The real CLI and backbone (an IResNet-18 at 1/8 width) on the tiny folder."""
    return tiny_run_overrides(
        image_folder, out, "train.batch_size=4", "train.epochs=1", "train.timeout_s=30", *extra
    )


def test_torchrun_two_processes(image_folder, tmp_path):
    out = tmp_path / "run"
    command = torchrun(
        "--nproc_per_node", "2", "--master_port", str(free_port()), str(REPO / "train.py"),
        *cli_overrides(image_folder, out),
    )  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=child_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 10))  # 72 / (2 x 4) = 9 steps
    assert all(np.isfinite(r["loss"]) for r in records)
    assert all(r["peak_memory_mb_max"] >= r["peak_memory_mb_min"] > 0 for r in records)
    assert len(list((out / "tb").glob("events.out.tfevents.*"))) == 1
    assert "INFO" not in (out / "train.rank1.log").read_text()
    assert "world size 2" in (out / "train.log").read_text()
    assert ckpt.latest_checkpoint(out).name == "step_00000009"
    assert len(list(ckpt.latest_checkpoint(out).glob("__*_0.distcp"))) == 2
    # The checkpoint's backbone is rank 0's, BatchNorm running statistics included, as is the
    # export (rank 1's statistics differ: each rank updates them from its own batch).
    model_cfg, _, exported = ckpt.load_backbone_file(out / "backbone.pt")
    assert model_cfg["backbone"] == "iresnet18"
    saved = ckpt.load_backbone_file(ckpt.latest_checkpoint(out))[2]
    assert saved.keys() == exported.keys()
    for key in saved:
        assert torch.equal(saved[key], exported[key]), key


def test_two_nodes_with_c10d_rendezvous(image_folder, tmp_path):
    out = tmp_path / "run"
    endpoint = f"127.0.0.1:{free_port()}"
    log_paths = [tmp_path / f"node{k}.log" for k in range(2)]
    logs = [path.open("w") for path in log_paths]
    nodes = [
        subprocess.Popen(
            torchrun(
                "--nnodes",
                "2",
                "--nproc_per_node",
                "1",
                "--rdzv_backend",
                "c10d",
                "--rdzv_endpoint",
                endpoint,
                "--rdzv_id",
                "two-nodes",
                str(REPO / "train.py"),
                *cli_overrides(image_folder, out),
            ),
            cwd=tmp_path,
            env=child_env(),
            # To files, not pipes: a node blocked on a full pipe that nobody reads yet would
            # stall the other in its next collective.
            stdout=logs[k],
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        for k in range(2)
    ]
    for node, log in zip(nodes, logs, strict=True):
        node.wait(timeout=120)
        log.close()
    outputs = [path.read_text() for path in log_paths]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 10))
    assert "world size 2" in (out / "train.log").read_text()


def wait_for_checkpoint(run_dir: Path, processes: list[subprocess.Popen], timeout: float) -> Path:
    return wait_until(
        lambda: ckpt.latest_checkpoint(run_dir), processes, timeout, f"no checkpoint in {run_dir}"
    )


def test_killed_rank_stops_the_others_and_the_checkpoint_resumes(image_folder, tmp_path):
    """Ranks started by hand (as a scheduler would, without torchrun's agent)."""
    out = tmp_path / "run"
    timeout_s = 20
    args = cli_overrides(
        image_folder, out, "train.epochs=40", "train.checkpoint_every=3",
        f"train.timeout_s={timeout_s}", "train.resume=auto",
    )  # fmt: skip
    port = free_port()

    def start(rank: int) -> subprocess.Popen:
        return start_rank(rank, 2, port, args, tmp_path)

    ranks = [start(0), start(1)]
    wait_for_checkpoint(out, ranks, timeout=60)
    killed_at = time.monotonic()
    ranks[1].send_signal(signal.SIGKILL)
    stderr = ranks[0].communicate(timeout=timeout_s + 30)[1]
    assert time.monotonic() - killed_at < timeout_s + 10
    ranks[1].wait()
    assert ranks[0].returncode == 1, stderr[-3000:]
    assert stderr.count("rank 0: stopping, a collective operation failed") == 1, stderr[-3000:]
    assert "train.timeout_s=20" in stderr
    assert "rank 0: stopping, a collective operation failed" in (out / "train.log").read_text()

    # The newest complete checkpoint loads, and a restart (resume=auto) continues from it.
    latest = ckpt.latest_checkpoint(out)
    saved_step = ckpt.read_checkpoint(latest, ["progress"])["progress"]["step"]
    assert saved_step % 3 == 0 and saved_step > 0
    command = torchrun(
        "--nproc_per_node", "2", "--master_port", str(free_port()), str(REPO / "train.py"),
        *args, f"train.max_steps={saved_step + 2}",
    )  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=child_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {latest} at step {saved_step}" in (out / "train.log").read_text()
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, saved_step + 3))  # each step once, the lost ones redone


def test_torchrun_restarts_a_failed_worker_and_resumes(image_folder, tmp_path):
    out = tmp_path / "run"
    args = cli_overrides(
        image_folder, out, "train.epochs=4", "train.checkpoint_every=3", "train.resume=auto"
    )
    agent = subprocess.Popen(
        torchrun(
            # Restarted workers must not read the dead ones' addresses from torchrun's store
            # (see distributed._torchelastic_store).
            "--standalone", "--nproc_per_node", "2", "--max-restarts", "1",
            str(REPO / "train.py"), *args,
        ),
        cwd=tmp_path, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    wait_for_checkpoint(out, [agent], timeout=60)
    worker = next(pid for pid in children(agent.pid) if environ(pid).get("RANK") == "1")
    os.kill(worker, signal.SIGKILL)
    stderr = agent.communicate(timeout=120)[1]
    assert agent.returncode == 0, stderr[-3000:]
    log = (out / "train.log").read_text()
    assert "resumed from" in log
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 37))  # 4 epochs x 9 steps, each once
    assert ckpt.latest_checkpoint(out).name == "step_00000036"


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()]


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    pairs = (item.decode(errors="replace").partition("=") for item in raw if item)
    return {key: value for key, _, value in pairs}


def test_distributed_config_keys_are_checked():
    cfg = load_config("default", ["train.dist_backend=gloo", "train.timeout_s=30"])
    assert (cfg.train.dist_backend, cfg.train.timeout_s, cfg.model.sync_bn) == ("gloo", 30.0, False)
    assert load_config("default", ["train.resume=auto"]).train.resume == "auto"
    with pytest.raises(ConfigError, match="train.dist_backend: 'mpi'"):
        load_config("default", ["train.dist_backend=mpi"])
    with pytest.raises(ConfigError, match="train.timeout_s"):
        load_config("default", ["train.timeout_s=0"])
    with pytest.raises(ConfigError, match="nccl needs train.device=cuda"):
        load_config("default", ["train.dist_backend=nccl", "train.device=cpu"])
    with pytest.raises(ConfigError, match="model.sync_bn"):
        load_config("default", ["model.sync_bn=3"])


def test_auto_device_is_what_the_suite_asks_for(monkeypatch):
    from recognition.distributed import pick_device

    assert os.environ["RECOGNITION_AUTO_DEVICE"] == "cpu"  # tests/conftest.py
    assert pick_device("auto") == torch.device("cpu")
    monkeypatch.setenv("RECOGNITION_AUTO_DEVICE", "")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert pick_device("auto").type == expected


def _shutdown_worker(rank: int, world_size: int, port: int, overrides: list, out: str) -> None:
    """A rank whose train() makes (and so leaves) the process group itself, as under
    torchrun; records how many DDP models are alive when it leaves the group."""
    import gc

    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    leave = distributed.shutdown

    def shutdown() -> None:
        alive = sum(issubclass(type(o), DistributedDataParallel) for o in gc.get_objects())
        Path(out, f"rank{rank}.json").write_text(json.dumps({"ddp_alive": alive}))
        leave()

    distributed.shutdown = shutdown
    train(load_config("default", overrides))


def test_a_run_frees_its_ddp_model_before_it_leaves_the_process_group(image_folder, tmp_path):
    # DDP's reducer holds the process group. Freed after destroy_process_group, it is the
    # group's last owner and destroys it holding the GIL, while gloo's worker threads may
    # need the GIL to free the last tensors they hold: torch 2.11 hung there at the end of
    # a run now and then (seen on the GPU machines' image, Python 3.12 + torch 2.11).
    overrides = tiny_overrides(image_folder, tmp_path / "run", 2)
    mp.spawn(_shutdown_worker, args=(2, free_port(), overrides, str(tmp_path)), nprocs=2)
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"ddp_alive": 0}
