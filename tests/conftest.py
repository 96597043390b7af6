"""Shared test setup.

Devices are chosen, not found: RECOGNITION_AUTO_DEVICE=cpu (below) makes `train.device=auto`
and `--device auto` mean the CPU, in this process and the ones it starts, so tests that
compare with a CPU reference (bit-exact resume, float64 sums) run there on a GPU machine as
well. Tests about CUDA ask for `cuda` explicitly and skip without it; they are marked
`cuda` (helpers.needs_cuda), and for them `auto` means the GPU.

TRITON_INTERPRET=1 (below) for the head's Triton kernels (tests/test_head_triton.py).

One intra-op thread per test process: the suite's tensors are tiny, so threads only add
spin-waiting, and on a shared 2-core machine two spinning OpenMP threads can slow a test
by 10x or more. Multi-process tests spawn their own processes, one thread each.
"""

from __future__ import annotations

import os

# Triton kernels can only run interpreted on this CPU suite, and `triton.jit` (Triton's own
# tl.zeros, tl.sum ... included) reads TRITON_INTERPRET when triton is first imported - which
# any test may cause (torch.compile imports it) - so it is set before anything imports torch.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["RECOGNITION_AUTO_DEVICE"] = "cpu"

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _auto_device_of_cuda_tests(request, monkeypatch):
    """A CUDA test (helpers.needs_cuda) leaves `auto` to mean the GPU, in its processes too."""
    if request.node.get_closest_marker("cuda") is not None:
        monkeypatch.setenv("RECOGNITION_AUTO_DEVICE", "cuda")


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory):
    """The tiny training image folder of tests/helpers.py (12 identities x 6 images), made
    once per session; tests read it and never change it."""
    from helpers import make_image_folder

    return make_image_folder(tmp_path_factory.mktemp("faces"))
