"""Partial FC: which of a rank's classes take part in a training step, and how the optimizer
then steps only those rows.

Each rank keeps the classes of its shard that appear in the global batch (the positives)
plus a random sample of its other classes, in all max(num_positive, num_sample) classes
(insightface's partial FC). The sample is a pure function of (seed, sampling_step, global
class id) - a 31-bit integer hash ranks the classes, positives first - so it is
reproducible, the same on CPU and GPU, and means the same on every rank; `sampling_step`
counts sampled forwards and is part of a checkpoint.

Unsampled rows get a zero gradient, and `RowSampler.attach_optimizer` makes the optimizer
leave them alone altogether: no momentum, no weight decay, no update of their optimizer
state.

Nothing is read on the host where the sample holds every positive the batch can have
(num_sample >= the global batch's rows, or the rank's classes): then it keeps num_sample
classes whatever the labels, the positives are raised above the others by a scatter, and
the optimizer steps the forward's sorted rows. Otherwise partial FC synchronises with the
host every step, where the rest of the training step does not: the positives
(`torch.unique`) and the number of classes kept (a top-k of a data-dependent size) have
sizes only the data decide; so do the rows the optimizer steps (`nonzero`) when several
forwards (micro-batches) make one step, the union of their samples.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from recognition.tensor_memory import upper_bound

# Classes are ranked by a 31-bit hash: products of two 31-bit numbers fit in int64.
HASH_BITS = 31
HASH_MASK = (1 << HASH_BITS) - 1
# Odd multipliers below 2**31 (a multiplication by an odd number is a bijection mod 2**31).
HASH_MULTIPLIERS = (0x5BD1E995, 0x1B873593, 0x27D4EB2F)
MAX_CLASSES = 1 << HASH_BITS


def class_priority(class_start: int, num_local: int, key: int, device: torch.device) -> Tensor:
    """A pseudo-random 31-bit priority (num_local,) int64 of global classes [start, start + n).

    A bijective integer hash of the global class id under `key`: xor with the key, then
    rounds of multiply-by-odd and xor-shift, all mod 2**31 (products stay below 2**62, so
    int64 never overflows). Distinct classes get distinct priorities, and a class's
    priority does not depend on which rank or device computes it.
    """
    h = torch.arange(class_start, class_start + num_local, dtype=torch.int64, device=device)
    h = h ^ (key & HASH_MASK)
    for multiplier in HASH_MULTIPLIERS:
        h = (h * multiplier) & HASH_MASK
        h = h ^ (h >> 15)
    return h


def sampling_key(seed: int, step: int) -> int:
    """A 31-bit key from (seed, step): splitmix64's finaliser on a combination of the two."""
    z = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % (1 << 64)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return (z ^ (z >> 31)) & HASH_MASK


class RowSampler:
    """The sample of one rank's classes [class_start, class_start + num_local) per step, and
    the rows sampled since the optimizer's last step (what `attach_optimizer` steps)."""

    def __init__(self, class_start: int, num_local: int, num_sample: int, seed: int) -> None:
        self.class_start, self.num_local, self.num_sample = class_start, num_local, num_sample
        self.seed = seed
        self.sampling_step = 0
        # The sorted rows of each forward since the optimizer's last step (the rows it
        # steps are their union), and whether there is one, of num_sample rows whatever the
        # labels (`fixed_count`): then the optimizer steps them as they are.
        self.step_rows: list[Tensor] | None = None
        self.step_rows_fixed = False
        self.most_rows_to_update = 0  # how many rows their union can hold at most
        self.in_accumulation = False  # inside accumulating(): every forward is the same step's

    def fixed_count(self, num_rows: int) -> bool:
        """Whether a forward over a global batch of `num_rows` rows keeps num_sample classes
        whatever its labels: the sample holds every positive the batch can have."""
        return self.num_sample >= min(num_rows, self.num_local)

    def sample(self, target_row: Tensor, owned: Tensor, gradient_dropped: bool) -> Tensor:
        """Local rows (K,) sorted that take part this step: positives plus random others.
        `gradient_dropped`: the rows' gradient is None (zero_grad), so, outside
        `accumulating`, a new optimizer step begins."""
        key = sampling_key(self.seed, self.sampling_step)
        self.sampling_step += 1
        priority = class_priority(self.class_start, self.num_local, key, target_row.device)
        fixed = self.fixed_count(target_row.numel())
        if fixed:
            # Positives above every hash value, by a scatter (rows of other ranks' labels
            # leave their slot as it is): nothing read on the host.
            raised = torch.where(owned, MAX_CLASSES, 0)
            priority.scatter_reduce_(0, target_row.clamp(min=0), raised, "amax")
            num_keep = self.num_sample
        else:
            positives = torch.unique(target_row[owned])  # sorted
            # On the run planner's fake tensors the count depends on data it has not: its
            # largest (every row of the batch a distinct positive) is planned.
            torch._check(positives.numel() <= min(target_row.numel(), self.num_local))
            num_keep = max(upper_bound(positives.numel()), self.num_sample)
            priority[positives] = MAX_CLASSES  # above every hash value: positives come first
        row_index = torch.topk(priority, num_keep, sorted=False).indices.sort().values
        # A new accumulation cycle starts when the gradients were dropped (zero_grad sets them
        # to None); within one, every micro-batch's rows are updated at the step.
        if self.step_rows is None or (gradient_dropped and not self.in_accumulation):
            self.step_rows, self.step_rows_fixed = [row_index], fixed
            self.most_rows_to_update = num_keep
        else:
            self.step_rows.append(row_index)
            self.step_rows_fixed = False
            self.most_rows_to_update = min(self.num_local, self.most_rows_to_update + num_keep)
        return row_index

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Forwards inside belong to one optimizer step (see the head's `accumulating`)."""
        self.step_rows = None
        self.in_accumulation = True
        try:
            yield
        finally:
            self.in_accumulation = False

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, target: Tensor) -> list[Any]:
        """Hooks around `optimizer.step()` that make it step only the rows of `target` (the
        weight or its master) sampled since its last step; returns the hooks' handles.

        Before the step, the parameter, its gradient and every optimizer state tensor of the
        parameter's shape (SGD's momentum buffer, Adam's moments) are swapped for their
        sampled rows; the optimizer steps those; after it, the rows are written back and the
        full tensors restored. Unsampled rows and their state are untouched, bit for bit, and
        state created on the first step is zero for rows not yet sampled.
        """
        swapped: dict[str, Any] = {}

        def before_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            rows = self._rows_to_update()
            if rows is None:
                return
            state = opt.state[target]
            full_state = {
                name: value
                for name, value in state.items()
                if torch.is_tensor(value) and value.shape == target.shape
            }
            swapped.update(rows=rows, data=target.data, grad=target.grad, state=full_state)
            target.data = target.data[rows]
            if swapped["grad"] is not None:
                target.grad = swapped["grad"][rows]
            for name, value in full_state.items():
                state[name] = value[rows]

        def after_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self.step_rows = None
            if swapped:
                _restore_rows(opt, target, swapped)
                swapped.clear()

        return [
            optimizer.register_step_pre_hook(before_step),
            optimizer.register_step_post_hook(after_step),
        ]

    def _rows_to_update(self) -> Tensor | None:
        """The sorted rows the optimizer steps (those sampled since its last step), or None
        when there is nothing to swap (no forward, or every row sampled)."""
        if self.step_rows is None:
            return None
        if self.step_rows_fixed:  # one forward's num_sample rows, as they are
            return self.step_rows[0]
        mask = torch.zeros(self.num_local, dtype=torch.bool, device=self.step_rows[0].device)
        for rows in self.step_rows:
            mask[rows] = True
        # A fake mask (the run planner's) has no value to read: it plans the swap.
        if not is_fake(mask) and bool(mask.all()):
            return None
        rows = mask.nonzero()
        # The planner's fake count is bounded by this (the real one always is), checked
        # before any other op: the planner counts a size that depends on data at its bound
        # at the next op, which would otherwise be every row of the mask.
        torch._check(rows.shape[0] <= self.most_rows_to_update)
        return rows.squeeze(1)


def _restore_rows(opt: torch.optim.Optimizer, target: Tensor, swapped: dict[str, Any]) -> None:
    """After a step of the sampled rows: write them back into the full parameter and state
    (`swapped`, as `before_step` kept them) and put the full tensors back in place."""
    rows, full_data = swapped["rows"], swapped["data"]
    full_data.index_copy_(0, rows, target.data)
    sampled_shape = target.shape
    target.data = full_data
    target.grad = swapped["grad"]
    state = opt.state[target]
    for name, value in list(state.items()):
        if not (torch.is_tensor(value) and value.shape == sampled_shape):
            continue
        full = swapped["state"].get(name)
        if full is None:  # created by this step: zero for the rows never sampled
            full = torch.zeros(full_data.shape, dtype=value.dtype, device=value.device)
        full.index_copy_(0, rows, value)
        state[name] = full
