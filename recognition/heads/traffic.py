"""What one training step of the Triton head moves through the GPU's memory, phase by phase:
`step_traffic`, a model of the bytes each phase reads and writes and the matmul FLOPs it does,
from the shapes and the options, as heads/kernels/ implements them.

Bytes are compulsory traffic: each tensor a phase touches counted once per pass over it (a
tile read by several programs is counted once, as if the L2 cache held it between them; a
chunk's rows read again for every chunk of the embeddings are counted per chunk). Small
vectors of N or K values (statistics, shifts, gate) are left out below a chunk of classes.
The phases, in step order:

    forward             the rows rounded to the matmul dtype and their inverse norms, when
                        not kept; the forward kernel over every class (the rows and the
                        embeddings read, the logits' exponentials written when kept, and
                        their tile shifts without one shift)
    logit gradient      G (N, K): kept with one shift, nothing of it (the embeddings scaled
                        by each row's factor instead, N x D); kept with tile shifts, the
                        exponentials rescaled in place; else the logits recomputed from the
                        rows (rounded again) and G written
    embedding product   grad_e += G @ W, a chunk at a time (grad_e read and written per chunk;
                        once more for the rows' factor with one shift)
    row product         U = G^T @ E (K, D), in bf16 with bf16 operands, else fp32
    update              the epilogue: U and the rows read, the radial part removed; with the
                        fused update the momentum read and written, the rows written, and
                        what is kept of them (inverse norms, the rounded copy); without it the
                        gradient written, then the optimizer's step (rows, gradient,
                        momentum read; rows, momentum written)

`python -m benchmarks.head_phases` measures each phase's milliseconds on a GPU beside this
model's bytes (the kernels mark their phases with `phase`, a profiler range that costs
nothing when no profiler runs); the GPU check's head section has a row per phase.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

PHASES = ("forward", "logit gradient", "embedding product", "row product", "update")
PREFIX = "head: "  # the profiler ranges' names: "head: forward", ...


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """A profiler range "head: <name>" around the block while a profiler runs; nothing
    otherwise (not even the range's few microseconds)."""
    if not torch._C._autograd._profiler_enabled():
        yield
        return
    with torch.profiler.record_function(PREFIX + name):
        yield


@dataclass(frozen=True)
class Phase:
    """One phase of a step: bytes read and written in HBM, matmul FLOPs."""

    name: str
    bytes_read: int
    bytes_written: int
    flops: int

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written


@dataclass(frozen=True)
class HeadShape:
    """The step's shapes and options: N rows of the global batch, embedding size D, K classes
    taking part on the rank (all of them, or the partial-FC sample), bytes per value of the
    matmul operands and of the weight, whether the logits are kept (head.chunk_size None),
    whether the backward applies the update (head.fused_update), with momentum, the classes
    per chunk of the backward, and the bytes per value of U."""

    num_rows: int
    dim: int
    num_classes: int
    matmul_bytes: int = 2
    weight_bytes: int = 4
    keep_logits: bool = True
    fused_update: bool = False
    momentum: bool = True
    chunk: int = 65536
    u_bytes: int = 2
    """Bytes per value of U, the row product's output: 2 with bf16 operands, 4 with fp16 or
    fp32 ones."""
    one_shift: bool = True
    """Kept logits with one shift for every class (`forward.fixed_shift`: bf16 and fp32
    operands up to scale 66), which the products read as they are; else with tile shifts
    (fp16 operands), rescaled in a pass over them."""


def step_traffic(shape: HeadShape) -> list[Phase]:
    """Each phase of one step (`PHASES`, in order) for `shape`: see the module docstring."""
    s = shape
    n, d, k, mb, wb = s.num_rows, s.dim, s.num_classes, s.matmul_bytes, s.weight_bytes
    chunks = max(1, -(-k // max(s.chunk, 1)))
    rows_weight, rows_mm = k * d * wb, k * d * mb
    rounds = wb != mb  # the rows are converted to the matmul dtype
    logits = n * k * mb
    # What is kept between fused updates: the inverse norms always, the rounded copy with the
    # logits kept (heads/kept_rows.py); else both made in the forward from the fp32 rows.
    norms_kept = s.fused_update
    copy_kept = s.fused_update and s.keep_logits and rounds
    forward_read = rows_mm + chunks * n * d * mb
    forward_written = 0
    if not norms_kept:
        forward_read += rows_weight
        forward_written += k * 4
    if rounds and not copy_kept:
        forward_read += rows_weight
        forward_written += rows_mm
    one_shift = s.keep_logits and s.one_shift
    if s.keep_logits:
        forward_written += logits + (0 if one_shift else (-(-k // 128)) * n * 4)
    phases = [Phase("forward", forward_read, forward_written, 2 * n * k * d)]
    if one_shift:
        phases.append(Phase("logit gradient", n * d * 4, n * d * mb, 0))
    elif s.keep_logits:
        phases.append(Phase("logit gradient", logits, logits, 0))
    else:
        recompute_read = rows_mm + chunks * n * d * mb + (rows_weight if rounds else 0)
        recompute_written = logits + (rows_mm if rounds else 0)
        phases.append(Phase("logit gradient", recompute_read, recompute_written, 2 * n * k * d))
    accumulate = (chunks + (1 if one_shift else 0)) * n * d * 4
    phases.append(Phase("embedding product", logits + rows_mm + accumulate, accumulate,
                        2 * n * k * d))  # fmt: skip
    u = k * d * s.u_bytes
    phases.append(Phase("row product", logits + chunks * n * d * mb, u, 2 * n * k * d))
    momentum = k * d * 4 if s.momentum else 0
    update_read = u + rows_weight  # U and the rows
    if s.fused_update:
        update_read += momentum
        update_written = rows_weight + momentum + k * 4 + (rows_mm if copy_kept else 0)
    else:  # the gradient written, then torch's step over rows, gradient and momentum
        update_read += rows_weight + k * d * wb + momentum
        update_written = k * d * wb + rows_weight + momentum
    phases.append(Phase("update", update_read, update_written, 0))
    return phases
