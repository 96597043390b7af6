"""The head's checks of its arguments and of each forward's inputs, and their messages.

Without partial FC a training forward reads no tensor value on the host: the labels' range
is asserted on the device (`torch._assert_async`; on the CPU it raises at once and names the
label; on a GPU a bad label stops the process at its next synchronisation with a device-side
assertion, whose message names num_classes where the torch build passes messages to the
kernel), and with several ranks the ranks' input statuses are all-gathered and asserted the
same way, so that a rank with bad input never leaves the others waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from recognition import distributed

INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def check_arguments(
    num_classes: int,
    embedding_size: int,
    sample_rate: float,
    chunk_size: int | None,
    num_ranks: int,
    max_classes: int,
    label_smoothing: float = 0.0,
) -> None:
    """Raise ValueError naming the config key when the head cannot be made so."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"head.label_smoothing: {label_smoothing} is outside [0, 1)")
    if label_smoothing > 0 and sample_rate < 1.0:
        raise ValueError(
            "head.label_smoothing: not with partial FC (head.sample_rate < 1), whose softmax "
            "runs over classes sampled anew at every step"
        )
    if num_classes < 1:
        raise ValueError(f"num_classes: must be >= 1, got {num_classes}")
    if num_classes > max_classes:
        raise ValueError(f"num_classes: at most {max_classes} supported, got {num_classes}")
    if embedding_size < 1:
        raise ValueError(f"model.embedding_size: must be >= 1, got {embedding_size}")
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"head.sample_rate: {sample_rate} is outside (0, 1]")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"head.chunk_size: must be at least 1 (or None), got {chunk_size}")
    if num_classes < num_ranks:
        raise ValueError(
            f"num_classes: {num_classes} classes cannot be split over {num_ranks} ranks"
        )


@dataclass(frozen=True)
class InputChecks:
    """What a forward's inputs must fit: the head's sizes and its ranks."""

    num_classes: int
    embedding_size: int
    world_size: int
    rank: int
    group: ProcessGroup | None

    def check(self, local_embeddings: Tensor, local_labels: Tensor) -> None:
        """Raise ValueError on every rank when any rank's inputs are bad, without a host read.

        Shapes and dtypes are known on the host. Whether the labels lie in [0, num_classes)
        is not: it is asserted on the device (`torch._assert_async`), which on the CPU raises
        at once (caught here, and the message names the label) and on a GPU stops the
        process at its next synchronisation with a device-side assertion. With several
        ranks the ranks' statuses are all-gathered (on the device) and asserted alike, so
        that no rank is left waiting in a collective.
        """
        error = self.input_error(local_embeddings, local_labels)
        labels_ok = None if error is not None else self._labels_in_range(local_labels)
        if self.world_size == 1:
            if error is not None:
                raise ValueError(error)
            self._assert(labels_ok, lambda: self._label_error(local_labels))
            return
        # Every rank must learn of any rank's bad input: a rank that raised alone would leave
        # the others waiting in the next collective until the timeout. torch.full, not
        # torch.tensor: a copy from the host would synchronise.
        device = local_embeddings.device
        batch_size = local_embeddings.shape[0] if local_embeddings.ndim > 0 else 0
        if labels_ok is None:  # this rank's inputs are wrong in shape or type
            bad = torch.ones((), dtype=torch.int64, device=device)
        else:
            bad = (~labels_ok.to(device)).to(torch.int64)
        status = torch.stack([torch.full((), batch_size, dtype=torch.int64, device=device), bad])
        statuses = distributed.all_gather_tensor(status, self.group).view(-1, 2)  # (W, 2)
        if error is not None:
            raise ValueError(f"rank {self.rank}: {error}")
        assert labels_ok is not None

        def describe() -> str:  # on the CPU, once the assertion failed: the host may read
            if not bool(labels_ok):
                return f"rank {self.rank}: {self._label_error(local_labels)}"
            return _ranks_error(statuses.tolist())

        all_ok = (statuses[:, 1] == 0).all() & (statuses[:, 0] == batch_size).all()
        self._assert(all_ok, describe)

    def _labels_in_range(self, local_labels: Tensor) -> Tensor:
        """0-dim bool tensor: every label lies in [0, num_classes)."""
        return ((local_labels >= 0) & (local_labels < self.num_classes)).all()

    def _assert(self, ok: Tensor, describe: Callable[[], str]) -> None:
        """Assert `ok` (0-dim bool) on its device. On the CPU the assertion acts at once and
        raises ValueError(describe()); on a GPU it acts asynchronously (a device-side
        assertion at the next synchronisation; torch builds that pass the message to the
        kernel print the one below)."""
        message = (
            f"ShardedMarginSoftmax: a label outside [0, {self.num_classes}) (head has "
            f"num_classes={self.num_classes}), or ranks with different batch sizes"
        )
        try:
            torch._assert_async(ok, message)
        except RuntimeError:  # the CPU checks at once: say which label, which rank
            raise ValueError(describe()) from None

    def _label_error(self, local_labels: Tensor) -> str:
        bad = int(local_labels[(local_labels < 0) | (local_labels >= self.num_classes)][0])
        return (
            f"local_labels: label {bad} is outside [0, {self.num_classes}) "
            f"(head has num_classes={self.num_classes})"
        )

    def input_error(self, local_embeddings: Tensor, local_labels: Tensor) -> str | None:
        """What is wrong with this rank's inputs that the host knows (shapes, dtypes), or
        None; the labels' range is checked on the device (`check`)."""
        if local_embeddings.ndim != 2 or local_embeddings.shape[1] != self.embedding_size:
            return (
                f"local_embeddings: expected shape (batch, {self.embedding_size}), "
                f"got {tuple(local_embeddings.shape)}"
            )
        if not local_embeddings.is_floating_point():
            return f"local_embeddings: expected floats, got {local_embeddings.dtype}"
        if local_embeddings.shape[0] == 0:
            return "local_embeddings: the batch is empty"
        if local_labels.shape != local_embeddings.shape[:1]:
            return (
                f"local_labels: expected shape ({local_embeddings.shape[0]},) to match the "
                f"embeddings, got {tuple(local_labels.shape)}"
            )
        if local_labels.dtype not in INTEGER_DTYPES:
            return f"local_labels: expected integer labels, got {local_labels.dtype}"
        return None


def _ranks_error(statuses: list[list[int]]) -> str:
    failed = [rank for rank, (_, bad) in enumerate(statuses) if bad]
    if failed:
        return (
            f"ShardedMarginSoftmax: rank(s) {failed} passed invalid inputs (their own "
            "error says which)"
        )
    sizes = [size for size, _ in statuses]
    return (
        f"local_embeddings: every rank must pass the same batch size, got {sizes} "
        f"on ranks 0..{len(sizes) - 1}"
    )
