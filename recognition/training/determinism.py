"""`train.deterministic`: reproducible kernels for the length of a run."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

# cuBLAS needs a fixed workspace to be deterministic; set before its first use (torch reads
# it when it creates a cuBLAS handle).
CUBLAS_WORKSPACE = ":4096:8"


@contextlib.contextmanager
def deterministic_mode(enabled: bool) -> Iterator[None]:
    """Within the block, with `enabled`: deterministic algorithms (an op that has none raises),
    cuDNN deterministic without autotuning, and the cuBLAS workspace variable; the previous
    settings are restored on exit. Without `enabled` nothing changes."""
    if not enabled:
        yield
        return
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        algorithms, warn_only, cudnn_deterministic, cudnn_benchmark, workspace = saved
        torch.use_deterministic_algorithms(algorithms, warn_only=warn_only)
        torch.backends.cudnn.deterministic = cudnn_deterministic
        torch.backends.cudnn.benchmark = cudnn_benchmark
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace
