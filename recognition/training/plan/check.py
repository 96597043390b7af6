"""The plan against reality: the CPU allocator's peak of the same step on real tensors.

`measure_rank` builds the rank's parts as training does (`build_model`, real DDP over the
process group that exists) on the CPU, runs real steps on random batches, and returns the
peak of the bytes the CPU allocator held during the last step, read from torch.profiler's
memory events (every allocation and free of the CPU allocator while profiling, in order).
That count knows nothing of dispatch: it sees what the allocator was asked for, the
kernels' own buffers included. The test and `benchmarks/plan.py` compare it with
`plan_rank(..., granularity=1)`; with `granularity=512` each allocation counts as the CUDA
caching allocator's blocks would (its bytes rounded up to a multiple of 512), which is
what `plan_rank`'s default (`train.py --plan`, `train.memory_check`) plans.
"""

from __future__ import annotations

import dataclasses
import gc
import math

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from recognition.config import ExperimentConfig
from recognition.distributed import DistInfo
from recognition.pipeline import make_layout
from recognition.training.build import build_model


def measure_rank(
    cfg: ExperimentConfig,
    num_classes: int,
    dist_info: DistInfo,
    *,
    steps: int = 2,
    granularity: int = 1,
) -> int:
    """Bytes: the CPU allocator's peak over the last of `steps` training steps of this rank
    (collective when a process group exists), counting everything allocated since the
    parts were built, each allocation rounded up to a multiple of `granularity`."""
    torch.manual_seed(cfg.seed + dist_info.rank)
    # The eager step, as the plan counts it (plan/fake.py).
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, cuda_graphs=False))
    # What earlier work left in reference cycles is freed now, not by a collection in the
    # middle of the profile: freeing a block allocated under an earlier profile would count
    # against this one's bytes.
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        layout = None
        if cfg.model.pipeline_stages > 1:
            layout = make_layout(cfg.model.pipeline_stages, dist_info)
        memory_format = torch.channels_last if cfg.data.channels_last else torch.preserve_format
        parts = build_model(cfg, dist_info, num_classes, layout, memory_format)
        first = layout is None or layout.is_first
        batch = cfg.train.batch_size
        shape = (batch, 3, *cfg.data.image_hw) if first else (batch, 0, 0, 0)
        for step in range(steps):
            micro_batches = [
                (
                    torch.randn(shape).contiguous(memory_format=_images_format(memory_format)),
                    torch.randint(0, num_classes, (batch,)),
                )
                for _ in range(cfg.train.accumulate_steps)
            ]
            with record_function(f"plan_check_step_{step}"):
                parts.run_step(micro_batches, cfg.optim.grad_clip)
            del micro_batches
    return peak_of(prof, f"plan_check_step_{steps - 1}", granularity)


def _images_format(memory_format: torch.memory_format) -> torch.memory_format:
    return torch.contiguous_format if memory_format == torch.preserve_format else memory_format


def peak_of(prof: profile, marker: str, granularity: int = 1) -> int:
    """The allocator's peak (bytes live) between the start and end of the `marker` range
    (a `record_function` of a profile with profile_memory=True), counting everything
    allocated since the profile started, each allocation (and its free) rounded up to a
    multiple of `granularity`.

    Leaves out the copies `aten::flatten_dense_tensors` makes for a coalesced broadcast
    (DDP's initial one) whose free the profiler did not see: gloo drops the last reference
    on its own thread, which the profiler does not watch, so such a copy would stay counted
    for good in some runs and not in others.
    """
    tree = prof.profiler.kineto_results.experimental_event_tree()
    span = None
    memory: list[tuple[int, int, int, bool]] = []  # (time, address, bytes, a broadcast copy)

    def walk(nodes: list, in_flatten: bool) -> None:
        nonlocal span
        for node in nodes:
            if node.name == marker:
                span = node
            if node.name == "[memory]":
                fields = node.extra_fields
                nbytes = _blocks(fields.alloc_size, granularity)
                memory.append((node.start_time_ns, fields.ptr, nbytes, in_flatten))
            walk(node.children, in_flatten or node.name == "aten::flatten_dense_tensors")

    walk(tree, False)
    assert span is not None, marker
    memory.sort(key=lambda m: m[0])
    unfreed_copies = _unfreed_copies(memory)
    live, peak = 0, None
    for index, (time, _, nbytes, _) in enumerate(memory):
        if time > span.end_time_ns:
            break
        if time >= span.start_time_ns and peak is None:
            peak = live
        if index not in unfreed_copies:
            live += nbytes
        if peak is not None:
            peak = max(peak, live)
    return live if peak is None else peak


def _blocks(nbytes: int, granularity: int) -> int:
    """`nbytes` (negative: a free) in whole blocks of `granularity` bytes."""
    return int(math.copysign(math.ceil(abs(nbytes) / granularity) * granularity, nbytes))


def _unfreed_copies(memory: list[tuple[int, int, int, bool]]) -> set[int]:
    """Indices of the broadcast copies in `memory` (in time order) never seen freed."""
    live: dict[int, int] = {}  # address -> index of its allocation
    unfreed = set()
    for index, (_, address, nbytes, _) in enumerate(memory):
        if nbytes > 0:
            if address in live and memory[live[address]][3]:  # reused: freed unseen
                unfreed.add(live[address])
            live[address] = index
        else:
            live.pop(address, None)
    unfreed.update(i for i in live.values() if memory[i][3])
    return unfreed
