"""Batches made ahead in a thread of their own (`data.decode_ahead`, with `data.decode=gpu`).

`made_ahead(batches, depth, device)` yields what the iterator `batches` yields, in the same
order, while a background thread makes the next ones, up to `depth` ahead: the training
thread takes a batch that is already decoded instead of decoding it between two steps.

On a CUDA device the thread works on a CUDA stream of its own: the decoding's kernels run
beside the step's, each batch carries an event recorded after its last kernel, and the
consumer's stream waits for that event on the device (`Stream.wait_event`: no host wait);
`record_stream` tells the caching allocator that the batch is used on the consumer's stream,
so its memory is not reused while the step still reads it. On a CPU the thread just runs
ahead.

Nothing random is drawn in the thread (the augmentation's parameters come from each
sample's seed), so the batches are the same, bit for bit, at any depth. An exception in the
thread (a bad image under on_bad_image=error) is raised in the consumer when it reaches the
batch that failed. Closing the generator (the loop's `stop_workers`) stops the thread after
the batch it is making, closes `batches` there (ending the DataLoader iterator it holds) and
waits for it, so no thread is left behind.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator

import torch

_END = object()
_POLL_S = 0.1


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def made_ahead(
    batches: Iterator[tuple[torch.Tensor, ...]], depth: int, device: torch.device
) -> Iterator[tuple[torch.Tensor, ...]]:
    """`batches`' items in order, each made in a background thread up to `depth` ahead (on a
    CUDA stream of its own on a CUDA device). `depth` 0: `batches` itself, in this thread."""
    if depth < 1:
        yield from batches
        return
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    thread = threading.Thread(
        target=_produce, args=(batches, slots, stop, side), name="decode-ahead", daemon=True
    )
    thread.start()
    try:
        while True:
            item = slots.get()
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.error
            batch, event = item
            if event is not None:
                current = torch.cuda.current_stream(device)
                current.wait_event(event)
                for tensor in batch:
                    tensor.record_stream(current)
            yield batch
    finally:
        stop.set()
        while thread.is_alive():  # a put blocked on a full queue must see the stop
            with contextlib.suppress(queue.Empty):
                slots.get(timeout=_POLL_S)
        thread.join()


def _produce(
    batches: Iterator[tuple[torch.Tensor, ...]],
    slots: queue.Queue,
    stop: threading.Event,
    side: torch.cuda.Stream | None,
) -> None:
    try:
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for batch in batches:
                event = None
                if side is not None:
                    event = torch.cuda.Event()
                    event.record(side)
                if not _put(slots, (batch, event), stop):
                    return
        _put(slots, _END, stop)
    except BaseException as error:  # noqa: BLE001  # raised again in the consumer
        _put(slots, _Failure(error), stop)
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()  # a generator over a DataLoader: its iterator ends here, now


def _put(slots: queue.Queue, item: object, stop: threading.Event) -> bool:
    """Put `item` once there is room; False when the consumer stopped first."""
    while not stop.is_set():
        with contextlib.suppress(queue.Full):
            slots.put(item, timeout=_POLL_S)
            return True
    return False
