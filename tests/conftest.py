"""Shared test setup.

One intra-op thread per test process: the suite's tensors are tiny, so threads only add
spin-waiting, and on a shared 2-core machine two spinning OpenMP threads can slow a test
by 10x or more. Multi-process tests spawn their own processes, one thread each.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
