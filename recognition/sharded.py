"""Row-sharded tensors: one rank's contiguous rows of a global tensor.

The head's class matrix is split by rows over the ranks (`recognition.heads`); so are the
tensors that follow it (its O2 fp32 master, its momentum). The module that owns a sharded
parameter records where its rows lie with `set_row_placement`; the modules that make
tensors standing for that parameter (Precision's master, the optimizer's state) copy the
placement with `mark_like`, without knowing whose rows they are. A tensor carrying a
placement is stored by `recognition.checkpoint` as this rank's chunk of the global tensor
(the fields of `torch.distributed.checkpoint`'s `CheckpointableTensor` protocol), so a
checkpoint holds one (num_rows, ...) tensor and resumes on any number of ranks.
"""

from __future__ import annotations

from torch import Tensor

_PLACEMENT = "_row_placement"


def set_row_placement(param: Tensor, start: int, num_rows: int) -> None:
    """Record that `param` (R, ...) holds rows [start, start + R) of a (num_rows, ...) tensor."""
    if param.ndim < 1 or not 0 <= start <= start + param.shape[0] <= num_rows:
        raise ValueError(
            f"set_row_placement: rows [{start}, {start + (param.shape[0] if param.ndim else 0)}) "
            f"do not fit in {num_rows} rows"
        )
    setattr(param, _PLACEMENT, (start, num_rows))


def row_placement(tensor: Tensor) -> tuple[int, int] | None:
    """(first row, global number of rows) recorded on `tensor`, or None (not sharded)."""
    return getattr(tensor, _PLACEMENT, None)


def rows_of(tensor: Tensor, start: int, num_rows: int) -> Tensor:
    """`tensor` (R, ...) marked as rows [start, start + R) of a (num_rows, ...) global tensor.

    Returns a view sharing `tensor`'s storage (a checkpoint loads into it in place) that
    carries the fields of DCP's `CheckpointableTensor` protocol; `tensor` itself is left
    unmarked.
    """
    if tensor.ndim < 1 or not 0 <= start <= start + tensor.shape[0] <= num_rows:
        raise ValueError(
            f"rows_of: rows [{start}, {start + tensor.shape[0] if tensor.ndim else '?'}) do not "
            f"fit in {num_rows} rows"
        )
    view = tensor.detach()  # a new tensor object, the same storage
    zeros = (0,) * (tensor.ndim - 1)
    view.global_shape = (num_rows, *tensor.shape[1:])  # type: ignore[attr-defined]
    view.global_offsets = ((start, *zeros),)  # type: ignore[attr-defined]
    view.local_offsets = ((0, *zeros),)  # type: ignore[attr-defined]
    view.local_sizes = (tuple(tensor.shape),)  # type: ignore[attr-defined]
    return view


def mark_like(tensor: Tensor, param: Tensor) -> Tensor:
    """`tensor` as a checkpoint should store it: rows of a global tensor when `param` is
    sharded and `tensor` has its shape (its master, its momentum), else a detached view."""
    placement = row_placement(param)
    if placement is None or tensor.shape != param.shape:
        return tensor.detach()
    return rows_of(tensor, *placement)


def copy_placement(tensor: Tensor, param: Tensor) -> None:
    """Give `tensor` (a copy standing for `param`, e.g. its fp32 master) `param`'s placement."""
    placement = row_placement(param)
    if placement is not None:
        set_row_placement(tensor, *placement)
