"""DataLoader worker processes: they die with the main process, and their errors read as
one line.

`exit_with_parent` is a `worker_init_fn`: the worker rides out the signals that stop a run
(the main process stops it; SIGTERM still ends it when its parent, torch's DataLoader, sends
it), and on Linux it asks the kernel to kill the worker
when its parent dies (`prctl(PR_SET_PDEATHSIG, SIGKILL)`), so that workers of a main process
killed by a signal (an out-of-memory kill, `kill -9`, a scheduler's preemption) go at once
instead of lingering until torch's own watchdog notices, about a minute later. Elsewhere it
does nothing.

`stop_workers` ends a training loader's workers at once, when the training is done: left
to the garbage collector, a DataLoader with persistent workers caught in a reference cycle
takes 5 s per worker to go (see its docstring).

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
from collections.abc import Iterable, Iterator

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


def stop_workers(loader: Iterable, iterator: Iterator | None = None) -> int:
    """End the worker processes of `loader` and of `iterator` (one of its iterators) now;
    returns how many worker processes were running.

    `loader` is a DataLoader, or holds one as `.loader` (`DeviceBatches`); anything else
    has no workers. Called when the training's batches are done, before the evaluation, so
    that the workers (with their prefetched batches) neither run nor hold memory beside it.

    Why not leave it to the garbage collector: the run's loader has persistent workers and
    lives in reference cycles, and the cycle collector calls the weakref callbacks of
    everything in a cycle before any `__del__`. The callbacks of multiprocessing's queues
    stop their feeder threads, so the DataLoader iterator's `__del__` then puts the stop
    messages for its workers into queues that nobody sends any more, and waits for each
    worker its 5 s join timeout (torch's MP_STATUS_CHECK_INTERVAL) before it kills it: 41 s
    at the end of a run with 8 workers. Here the queues are alive and every worker leaves
    when asked.
    """
    import inspect

    from torch.utils.data import DataLoader

    if inspect.isgenerator(iterator):
        # A generator over a DataLoader (DeviceBatches): closing it ends the DataLoader
        # iterator it holds now, while its queues are alive (without persistent workers it
        # is the only reference to it).
        iterator.close()
    inner = loader if isinstance(loader, DataLoader) else getattr(loader, "loader", None)
    found: list = [iterator]
    if isinstance(inner, DataLoader):
        # A loader with persistent workers keeps its iterator, to reuse it.
        found.append(inner._iterator)
        inner._iterator = None
    running = 0
    for each in {id(i): i for i in found if i is not None}.values():
        workers = getattr(each, "_workers", [])
        if hasattr(each, "_shutdown_workers"):  # torch's multi-process iterator
            running += sum(w.is_alive() for w in workers)
            each._shutdown_workers()
    return running


def error_message(exc: BaseException) -> str:
    """The message of `exc`, or for one re-raised from a DataLoader worker, the message of
    the worker's original exception (its last line) without the traceback in front."""
    text = str(exc)
    if not (text.startswith("Caught ") and "Original Traceback" in text):
        return text
    last = text.rstrip().splitlines()[-1]
    name, sep, message = last.partition(": ")
    return message if sep and name.replace(".", "").isidentifier() else last
