"""DataLoader worker processes: they die with the main process, and their errors read as
one line.

`exit_with_parent` is a `worker_init_fn`: the worker rides out the signals that stop a run
(the main process stops it; SIGTERM still ends it when its parent, torch's DataLoader, sends
it), and on Linux it asks the kernel to kill the worker
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
import os
import signal
import sys
import threading

_PR_SET_PDEATHSIG = 1


# What stops a run (a scheduler's SIGTERM to every process of the job, a terminal's SIGINT
# to its process group): the main process decides when, at a step boundary
# (training/stopping.py); a worker that died of it would fail the batch in flight instead.
WORKER_IGNORES = ("SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")


def exit_with_parent(worker_id: int) -> None:
    """`worker_init_fn`: the worker rides out the signals that stop a run (the main process
    ends it), and gets SIGKILL when the process that started it dies."""
    del worker_id
    for name in WORKER_IGNORES:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    _sigterm_from_parent_only()
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: keep torch's own watchdog
        return


def _sigterm_from_parent_only() -> None:
    """SIGTERM ends the worker when its parent sends it (torch's DataLoader ends a worker
    that does not leave when asked with `terminate()`), and is ignored when it comes from
    anyone else (a scheduler signalling every process of the job, while the main process
    stops at a step boundary). Where the sender cannot be told (no sigwaitinfo), SIGTERM
    keeps its default action."""
    if not (hasattr(signal, "sigwaitinfo") and hasattr(signal, "pthread_sigmask")):
        return
    parent = os.getppid()
    # Blocked in this thread and so in every thread started after it; one of them waits for
    # it and reads who sent it.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def wait() -> None:
        while True:
            if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
                os._exit(0)

    threading.Thread(target=wait, name="sigterm-from-parent", daemon=True).start()


def error_message(exc: BaseException) -> str:
    """The message of `exc`, or for one re-raised from a DataLoader worker, the message of
    the worker's original exception (its last line) without the traceback in front."""
    text = str(exc)
    if not (text.startswith("Caught ") and "Original Traceback" in text):
        return text
    last = text.rstrip().splitlines()[-1]
    name, sep, message = last.partition(": ")
    return message if sep and name.replace(".", "").isidentifier() else last
