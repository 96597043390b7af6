"""The training step launches no host synchronisation in the steady state.

A sync is whatever makes the host wait for the device: reading a tensor's value (`.item()`,
`bool()`, `float()`, `int()`, `.tolist()`, `.numpy()`), an op whose output size depends on
the data (`nonzero`, `unique`, `masked_select`, boolean-mask indexing), a copy to the CPU,
or `torch.cuda.synchronize()`. On the CPU nothing waits, so `SyncWatcher` records those
points instead: a TorchDispatchMode sees every aten op, including those that `.item()` and
friends turn into (`_local_scalar_dense`), wherever they are called from (torch's own
optimizer and clipping code, autograd's backward), and the reads that bypass the dispatcher
(`tolist`, `numpy`) are patched. On a GPU `torch.cuda.set_sync_debug_mode("error")` makes
every synchronising CUDA call raise.

`train()` runs as usual, with `run_loop` wrapped: the watch covers the loop's steps after the
first (steady state) and the hooks' `before_step` / `after_step`, and is paused while a
batch is read from the loader (CPU work on CPU data) and where reading is allowed: the
hooks at logging steps (`log_due`), and before and after the epochs and the run.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import (
    MASK_INDEXING_OPS,
    SYNCING_METHODS,
    SYNCING_OPS,
    child_env,
    free_port,
    has_mask,
    init_gloo_rank,
    needs_cuda,
    tiny_config,
    tiny_run_overrides,
)
from torch.utils._python_dispatch import TorchDispatchMode

import recognition.training.loop as loop
from recognition.config import load_config
from recognition.optim import fused_is_sound
from recognition.training import train
from recognition.training.hooks import Hook, log_due

aten = torch.ops.aten


class SyncWatcher(TorchDispatchMode):
    """Records every host synchronisation point reached while `watching` is True.

    On CUDA devices (`cuda=True`) it also turns `torch.cuda.set_sync_debug_mode` to
    "error" while watching, so that a sync the CPU cannot show raises there.
    """

    def __init__(self, cuda: bool = False) -> None:
        super().__init__()
        self.cuda = cuda
        self._watching = False
        self.syncs: list[str] = []
        self.thread = threading.get_ident()  # the training thread: the one that installs it

    def record(self, what: str) -> None:
        # Only the training thread's: the patched methods are global, and another thread
        # (data.decode_ahead's decoding thread) may wait without stalling the step.
        if self.watching and threading.get_ident() == self.thread:
            stack = "".join(traceback.format_stack(limit=12)[:-2])
            self.syncs.append(f"{what}\n{stack}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in SYNCING_OPS:
            self.record(str(func))
        elif func.overloadpacket in MASK_INDEXING_OPS and has_mask(args[1]):
            # x[mask] and x[mask] = y find the mask's True entries (nonzero) inside the op,
            # below this mode; on a GPU that count is read on the host.
            self.record(f"{func} with a boolean mask")
        elif func.overloadpacket in (aten._to_copy, aten.copy_):
            source = args[1] if func.overloadpacket is aten.copy_ else args[0]
            target = args[0].device if func.overloadpacket is aten.copy_ else kwargs.get("device")
            if source.device.type != "cpu" and target is not None and target.type == "cpu":
                self.record(f"{func} to the CPU")
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def watch(self, on: bool) -> Iterator[None]:
        """Watch (or pause) inside the block; restores the previous state after it."""
        before = self.watching
        self._set(on)
        try:
            yield
        finally:
            self._set(before)

    @property
    def watching(self) -> bool:
        return self._watching

    @watching.setter
    def watching(self, on: bool) -> None:
        self._watching = on
        if self.cuda:
            torch.cuda.set_sync_debug_mode("error" if on else "default")

    def _set(self, on: bool) -> None:
        self.watching = on

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The dispatch mode and the patched methods, for the duration of the block."""
        self.thread = threading.get_ident()
        originals = {name: getattr(torch.Tensor, name) for name in SYNCING_METHODS}
        synchronize = torch.cuda.synchronize

        def patched(name: str):
            def method(tensor, *args, **kwargs):
                self.record(f"Tensor.{name}")
                with self.watch(False):  # what it calls is part of the one read
                    return originals[name](tensor, *args, **kwargs)

            return method

        def cuda_synchronize(*args, **kwargs):
            self.record("torch.cuda.synchronize")
            return synchronize(*args, **kwargs)

        for name in SYNCING_METHODS:
            setattr(torch.Tensor, name, patched(name))
        torch.cuda.synchronize = cuda_synchronize
        try:
            with self:
                yield
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
            torch.cuda.synchronize = synchronize
            self._set(False)


class PausedLoader:
    """The run's loader, read with the watch paused (decoding is CPU work on CPU data)."""

    def __init__(self, loader: Any, watcher: SyncWatcher) -> None:
        self.loader, self.watcher = loader, watcher

    def __iter__(self) -> Iterator:
        with self.watcher.watch(False):
            iterator = iter(self.loader)
        while True:
            with self.watcher.watch(False):
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
            yield batch


class Watched(Hook):
    """`hook`, watched in the steady state's before_step / after_step, paused elsewhere and
    after logging steps."""

    def __init__(self, hook: Hook, watcher: SyncWatcher) -> None:
        self.hook, self.watcher = hook, watcher

    def before_train(self, run):
        with self.watcher.watch(False):
            self.hook.before_train(run)

    def before_epoch(self, run):
        with self.watcher.watch(False):
            self.hook.before_epoch(run)

    def before_step(self, run):
        self.hook.before_step(run)

    def after_step(self, run, result):
        with self.watcher.watch(self.watcher.watching and not log_due(run)):
            self.hook.after_step(run, result)

    def after_epoch(self, run):
        with self.watcher.watch(False):
            self.hook.after_epoch(run)

    def after_train(self, run):
        with self.watcher.watch(False):
            self.hook.after_train(run)


def watch_steady_state(monkeypatch, watcher: SyncWatcher) -> None:
    """Make `train()` run its loop under `watcher`, from the second step on."""
    real_run_loop = loop.run_loop

    def run_loop(run, hooks, step_fn=None):
        step_fn = run.step if step_fn is None else step_fn

        def watched_step(*args):
            # From the second step on, the watch stays on through the rest of the loop (the
            # scheduler, the hooks) until a pause. The first step is not steady: optimizers
            # make their state, DDP its buckets.
            watcher.watching = run.progress.step >= 1
            return step_fn(*args)

        run.loader = PausedLoader(run.loader, watcher)
        with watcher.installed():
            real_run_loop(run, [Watched(h, watcher) for h in hooks], watched_step)

    monkeypatch.setattr(loop, "run_loop", run_loop)


def assert_no_syncs(watcher: SyncWatcher) -> None:
    assert not watcher.syncs, f"{len(watcher.syncs)} host syncs, the first:\n{watcher.syncs[0]}"


def config(image_folder: Path, out: Path, *extra: str):
    # 9 steps per epoch: 7 steps log at 3, 6 and 7, the steps between are watched.
    return tiny_config(image_folder, out, "train.max_steps=7", "train.log_every=3", *extra)


CASES = {
    "O1-bf16-clip-sgd": ("precision.level=O1", "precision.dtype=bf16", "optim.grad_clip=5"),
    "O0-noclip-adamw-accumulate": (
        "precision.level=O0",
        "optim.grad_clip=null",
        "optim.name=adamw",
        "optim.lr=0.001",
        "train.batch_size=4",
        "train.accumulate_steps=2",
    ),
    # AdaFace's running statistics move on the device too.
    "O2-bf16-clip-sgd-adaface": (
        "precision.level=O2",
        "precision.dtype=bf16",
        "optim.grad_clip=1",
        "head.margin=adaface",
    ),
    "O3-bf16-adamw": ("precision.level=O3", "precision.dtype=bf16", "optim.name=adamw"),
    "O1-fp16-scaler": ("precision.level=O1", "precision.dtype=fp16"),
    # Partial FC whose sample holds every positive of a batch (9 of 12 classes, batches of
    # 8): the positives raised by a scatter, the optimizer stepping the sampled rows.
    "O1-bf16-partial-fc": ("precision.level=O1", "precision.dtype=bf16", "head.sample_rate=0.75"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_steady_state_steps_do_not_sync_on_cpu(image_folder, tmp_path, monkeypatch, case):
    watcher = SyncWatcher()
    watch_steady_state(monkeypatch, watcher)
    run_dir = train(config(image_folder, tmp_path / "run", *CASES[case]))
    half = torch.zeros(1, dtype=torch.bfloat16, requires_grad=True)
    if case.startswith("O3") and not fused_is_sound([half]):
        # bf16 parameters on a CPU below torch 2.14: the optimizer is not fused (2.11's
        # fused SGD is wrong there), so its step reads on the host (Precision.step its skip
        # flag, torch's AdamW its step counts), and nothing else does.
        assert watcher.syncs
        assert all(
            "recognition/precision/" in sync or "torch/optim/" in sync for sync in watcher.syncs
        ), [sync for sync in watcher.syncs if "torch/optim/" not in sync]
    else:
        assert_no_syncs(watcher)
    assert (run_dir / "metrics.jsonl").read_text().count('"step"') == 3  # steps 3, 6, 7


def test_the_watcher_sees_a_sync_that_creeps_back(image_folder, tmp_path, monkeypatch):
    """A loss read on the host in every step (as the step once did) is caught."""
    import recognition.training.step as step_module

    real_step = step_module.train_step
    reads = {"step": 0}

    def step_that_reads(*args):
        result = real_step(*args)
        reads["step"] += 1
        if reads["step"] > 1:
            float(result.loss)  # noqa: B018 - the sync under test
        return result

    watcher = SyncWatcher()
    watch_steady_state(monkeypatch, watcher)
    cfg = config(image_folder, tmp_path / "run", "precision.level=O1", "precision.dtype=bf16")
    monkeypatch.setattr("recognition.training.build.train_step", step_that_reads)
    train(cfg)
    assert len(watcher.syncs) == 6  # steps 2..7
    assert "_local_scalar_dense" in watcher.syncs[0]


def test_the_watcher_sees_indexing_by_a_boolean_mask():
    """x[mask] and x[mask] = y count the mask's True entries inside the op (a host read on a
    GPU), where the dispatch mode sees only aten.index; indexing by positions reads nothing."""
    values, rows = torch.arange(6.0), torch.tensor([0, 2])
    mask = values > 2
    watcher = SyncWatcher()
    with watcher.installed(), watcher.watch(True):
        values[rows]
        values.index_add_(0, rows, torch.ones(2))
        torch.where(mask, values, 0.0)
        assert not watcher.syncs
        values[mask]
        values[mask] = 0.0
    assert [s.splitlines()[0] for s in watcher.syncs] == [
        "aten.index.Tensor with a boolean mask",
        "aten.index_put_.default with a boolean mask",
    ]


def test_the_watcher_sees_the_training_thread_alone():
    """A read in another thread (data.decode_ahead's decoding thread) does not stall the step:
    not recorded; the same read in the thread that installed the watcher is."""
    values = torch.arange(4)
    watcher = SyncWatcher()
    with watcher.installed(), watcher.watch(True):
        other = threading.Thread(target=values.tolist)
        other.start()
        other.join()
        assert not watcher.syncs
        values.tolist()
    assert [s.splitlines()[0] for s in watcher.syncs] == ["Tensor.tolist"]


def _rank_main(rank: int, port: int, args: list[str], out: str) -> None:
    init_gloo_rank(rank, 2, port)
    watcher = SyncWatcher()
    with pytest.MonkeyPatch.context() as monkeypatch:
        watch_steady_state(monkeypatch, watcher)
        train(load_config("default", args))
    Path(out, f"syncs.{rank}.txt").write_text("\n\n".join(watcher.syncs))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # see tests/test_distributed_training.py: gloo's teardown may abort


@pytest.mark.parametrize(
    "layout",
    [
        ("train.batch_size=4",),  # data parallel: DDP backbone, head sharded over 2 ranks
        ("model.pipeline_stages=2", "model.micro_batch_size=4", "train.batch_size=8"),
    ],
    ids=["ddp", "pipeline"],
)
def test_steady_state_steps_do_not_sync_on_two_ranks(image_folder, tmp_path, layout):
    args = tiny_run_overrides(
        image_folder,
        tmp_path / "run",
        "model.backbone=iresnet18",
        "model.sync_bn=false",
        "train.max_steps=7",
        "train.log_every=3",
        "train.timeout_s=120",
        "precision.level=O1",
        "precision.dtype=bf16",
        "optim.grad_clip=5",
        *layout,
    )
    mp.spawn(_rank_main, args=(free_port(), args, str(tmp_path)), nprocs=2)
    for rank in range(2):
        syncs = (tmp_path / f"syncs.{rank}.txt").read_text()
        assert not syncs, f"rank {rank}:\n{syncs[:3000]}"


# On a GPU, with the GPU decoder (data.decode=auto decodes the tiny folder's JPEGs on the
# device, in the decode-ahead thread). The Triton head's case runs in a process of its own:
# this suite interprets the kernels (conftest.py sets TRITON_INTERPRET=1, read once, at
# triton's import), and interpreted kernels read their arguments on the host.
CUDA_CASES = {
    **{
        name: CASES[name]
        for name in ("O1-bf16-clip-sgd", "O0-noclip-adamw-accumulate", "O1-bf16-partial-fc")
    },
    "O1-bf16-triton-fused-update": (
        "precision.level=O1",
        "precision.dtype=bf16",
        "optim.grad_clip=null",
        "head.kernel=triton",
        "head.fused_update=true",
    ),
}
COMPILED_KERNELS = {"O1-bf16-triton-fused-update"}

# The case in a child process, its kernels compiled: writes the syncs, one per paragraph.
CHILD = """
import sys
import pytest
sys.path[:0] = [{tests!r}]
from test_host_sync import CUDA_CASES, SyncWatcher, config, watch_steady_state
from recognition.training import train
from pathlib import Path
watcher = SyncWatcher(cuda=True)
with pytest.MonkeyPatch.context() as monkeypatch:
    watch_steady_state(monkeypatch, watcher)
    train(config(Path(sys.argv[1]), Path(sys.argv[2]), "train.device=cuda",
                 *CUDA_CASES[sys.argv[3]]))
Path(sys.argv[4]).write_text("\\n\\n".join(watcher.syncs))
"""


@needs_cuda
@pytest.mark.parametrize("case", list(CUDA_CASES))
def test_steady_state_steps_do_not_sync_on_cuda(image_folder, tmp_path, monkeypatch, case):
    """torch.cuda.set_sync_debug_mode("error") raises on any synchronising CUDA call made
    while watched; the dispatch mode records the rest (a value read, a copy to the CPU)."""
    if case in COMPILED_KERNELS:
        env = {k: v for k, v in child_env().items() if k != "TRITON_INTERPRET"}
        script = CHILD.format(tests=str(Path(__file__).resolve().parent))
        syncs = tmp_path / "syncs.txt"
        done = subprocess.run(
            [sys.executable, "-c", script, str(image_folder), str(tmp_path / "run"), case,
             str(syncs)],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert not syncs.read_text(), f"host syncs, the first:\n{syncs.read_text()[:3000]}"
        return
    watcher = SyncWatcher(cuda=True)
    watch_steady_state(monkeypatch, watcher)
    train(config(image_folder, tmp_path / "run", "train.device=cuda", *CUDA_CASES[case]))
    assert_no_syncs(watcher)
