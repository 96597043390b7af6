"""DataLoader worker processes: they die with the main process, and their errors read as
one line.

`exit_with_parent` is a `worker_init_fn`: on Linux it asks the kernel to kill the worker
when its parent dies (`prctl(PR_SET_PDEATHSIG, SIGKILL)`), so that workers of a main process
killed by a signal (an out-of-memory kill, `kill -9`, a scheduler's preemption) go at once
instead of lingering until torch's own watchdog notices, about a minute later. Elsewhere it
does nothing.

`error_message` turns an exception that a DataLoader re-raised from a worker back into the
worker's own message: torch puts the worker's whole traceback in front of it ("Caught
ValueError in DataLoader worker process 0. Original Traceback ..."), 60-80 lines in which
the file at fault is named only at the end.
"""

from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1


def exit_with_parent(worker_id: int) -> None:
    """`worker_init_fn`: the worker gets SIGKILL when the process that started it dies."""
    del worker_id
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: keep torch's own watchdog
        return


def error_message(exc: BaseException) -> str:
    """The message of `exc`, or for one re-raised from a DataLoader worker, the message of
    the worker's original exception (its last line) without the traceback in front."""
    text = str(exc)
    if not (text.startswith("Caught ") and "Original Traceback" in text):
        return text
    last = text.rstrip().splitlines()[-1]
    name, sep, message = last.partition(": ")
    return message if sep and name.replace(".", "").isidentifier() else last
