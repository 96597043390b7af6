"""Small fixtures shared by the training tests: a tiny image folder and the overrides and
config that point at it, and what multi-process tests need (a free port, a gloo rank, the
torchrun command and its environment)."""

from __future__ import annotations

import datetime
import os
import socket
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image


def make_image_folder(root: Path) -> Path:
    """12 identities x 6 images of 32x32: each identity a bright square at its own place."""
    rng = np.random.default_rng(0)
    for c in range(12):
        folder = root / f"id{c:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        for n in range(6):
            image = rng.integers(0, 60, size=(32, 32, 3), dtype=np.uint8)
            y, x = 4 + (c % 4) * 7, 4 + (c // 4) * 9
            image[y : y + 6, x : x + 6] = 200 + n
            Image.fromarray(image).save(folder / f"{n}.jpg", quality=95)
    return root


def needs_cuda(test):
    """A CUDA test: marked `cuda` (`python -m pytest -m cuda` selects them all, as
    benchmarks/gpu_check.py does), skipped without a CUDA device, and run with
    RECOGNITION_AUTO_DEVICE=cuda (conftest.py), so that what it leaves to `auto` is the GPU."""
    import pytest
    import torch

    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return pytest.mark.cuda(skip(test))


def folder_overrides(root: Path, out: Path) -> list[str]:
    """Train on the image folder `root` at 32x32 in this process, writing to `out`."""
    return [
        f"output_dir={out}",
        f"data.root={root}",
        "data.synthetic.enabled=false",
        "data.image_size=32",
        "data.num_workers=0",
    ]


def tiny_run_overrides(root: Path, out: Path, *extra: str) -> list[str]:
    """`folder_overrides` with a 1/8-width backbone and 16-d embeddings, logging every step,
    no progress bar and no evaluation targets; `extra` comes last and wins."""
    return [
        *folder_overrides(root, out),
        "model.width=0.125",
        "model.embedding_size=16",
        "train.log_every=1",
        "train.progress=false",
        "eval.targets=[]",
        *extra,
    ]


def init_gloo_rank(rank: int, world_size: int, port: int, timeout_s: float = 120.0) -> None:
    """Join a CPU (gloo) process group as `rank` of `world_size` on localhost:`port`, with the
    torchrun environment that `train()` reads, and one intra-op thread."""
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))


def tiny_config(root: Path, out: Path, *extra: str):
    """The default config on `tiny_run_overrides` with a 1/8-width IResNet-18 and batches of 8
    (9 steps per epoch of the tiny folder); `extra` comes last and wins."""
    from recognition.config import load_config

    return load_config(
        "default",
        tiny_run_overrides(root, out, "model.backbone=iresnet18", "train.batch_size=8", *extra),
    )


REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    """This environment for a child process (one thread, the repository importable), without
    the torchrun variables of a test that runs under one."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def torchrun(*args: str) -> list[str]:
    """The torchrun command line with `args`, on this interpreter."""
    return [sys.executable, "-m", "torch.distributed.run", *args]


def start_rank(rank: int, world_size: int, port: int, args: list[str], cwd: Path):
    """`train.py args` as rank `rank` of `world_size` started by hand, as a scheduler would
    (no torchrun agent), meeting on localhost:`port`; its stderr piped, stdout dropped."""
    import subprocess

    env = dict(child_env(), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *args],
        cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def wait_until(found, processes: list, timeout: float, what: str):
    """Poll `found()` until it returns something other than None (returned), while every
    process of `processes` runs; kill them all and fail naming `what` otherwise."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = found()
        if result is not None:
            return result
        if any(p.poll() is not None for p in processes):
            break
        time.sleep(0.05)
    for p in processes:
        p.kill()
    raise AssertionError(f"{what} after {timeout} s")


def plain_pair_statistics(embeddings, labels) -> dict[str, float]:
    """Mean and population std of the cosines of every same-label and every different-label
    pair i < j of `embeddings` (N, D), normalised here; a plain float64 loop over the pairs."""
    x = np.asarray(embeddings, dtype=np.float64)
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    labels = np.asarray(labels)
    same: list[float] = []
    different: list[float] = []
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            (same if labels[i] == labels[j] else different).append(float(x[i] @ x[j]))
    return {
        "same_mean": float(np.mean(same)),
        "same_std": float(np.std(same)),
        "different_mean": float(np.mean(different)),
        "different_std": float(np.std(different)),
        "num_same_pairs": len(same),
        "num_different_pairs": len(different),
    }


aten = torch.ops.aten

# Operations that read a value on the host or whose output size is data-dependent: a sync
# on a GPU (tests/test_host_sync.py), refused while a CUDA graph captures (tests/graph_tape.py).
SYNCING_OPS = {
    aten._local_scalar_dense,  # .item(), bool(), float(), int(), and torch's own uses
    aten.is_nonzero,
    aten.equal,
    aten.nonzero,
    aten.nonzero_static,
    aten.argwhere,
    aten.masked_select,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
}
# Indexing that takes a boolean mask: the number of True entries sizes the result.
MASK_INDEXING_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
# Tensor methods that read values without going through the dispatcher.
SYNCING_METHODS = ("tolist", "numpy", "__array__")


def has_mask(indices) -> bool:
    """Whether an index operation's `indices` hold a boolean mask."""
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
        for i in (indices or [])
    )


class RecordedKernel:
    """Stands in for a @triton.jit kernel: each launch `kernel[grid](*args, **kwargs)` calls
    `record(grid, kwargs)` and then launches the kernel itself."""

    def __init__(self, kernel, record) -> None:
        self.kernel, self.record = kernel, record

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.record(grid, kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch
