"""Memory of one benchmark process on Linux: its resident set and the kernel's peak of it.

Shared by the benchmarks that report a step's peak memory on the CPU (see
benchmarks/head.py for how the peak is isolated: VmHWM reset through clear_refs, glibc
told to mmap large blocks so that freed tensors leave the RSS).
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path


def proc_status_kib(field: str) -> int | None:
    """A `/proc/self/status` field in KiB (VmRSS, VmHWM), None where there is none."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS; False if impossible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def set_mmap_threshold(num_bytes: int) -> bool:
    """glibc mallopt(M_MMAP_THRESHOLD): allocations above `num_bytes` use mmap; False if absent."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, num_bytes))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False
