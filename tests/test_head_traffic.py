"""recognition/heads/traffic.py: the bytes and FLOPs of each phase of the Triton head's step,
against the tensors each phase touches counted by hand, and the profiler ranges that mark
the phases in the head's code (what benchmarks/head_phases.py times on a GPU)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # as conftest sets it: the kernels interpreted

import pytest  # noqa: E402
import torch  # noqa: E402

from recognition.heads import ShardedMarginSoftmax  # noqa: E402
from recognition.heads.margins import ArcFace  # noqa: E402
from recognition.heads.traffic import PHASES, PREFIX, HeadShape, phase, step_traffic  # noqa: E402

# N 4, D 8, K 100 classes in chunks of 64 (two chunks), bf16 operands (2 bytes), fp32 rows.
N, D, K, CHUNKS = 4, 8, 100, 2
ROWS_FP32, ROWS_BF16 = K * D * 4, K * D * 2  # 3,200, 1,600
U = K * D * 2  # 1,600: the row product's output, in bf16 with bf16 operands
LOGITS = N * K * 2  # 800: G, or the kept exponentials, in bf16
EMBEDDINGS = CHUNKS * N * D * 2  # 128: read once per chunk
GRAD_E = CHUNKS * N * D * 4  # 256: read and written once per chunk (+=)
MOMENTUM, NORMS, FLOPS = K * D * 4, K * 4, 2 * N * K * D


def by_phase(**options) -> dict:
    phases = step_traffic(HeadShape(N, D, K, chunk=64, **options))
    assert [p.name for p in phases] == list(PHASES)
    return {p.name: (p.bytes_read, p.bytes_written, p.flops) for p in phases}


def test_kept_logits_and_fused_update_by_hand():
    # The rows' copy and inverse norms kept between fused updates: the forward reads no fp32
    # row; it writes the exponentials. Kept with one shift, the products read them as they
    # are: the embeddings scaled by the rows' factor (fp32 read, bf16 written) and grad_e
    # once more, and no pass over the logits.
    factor = N * D * 4
    assert by_phase(keep_logits=True, fused_update=True) == {
        "forward": (ROWS_BF16 + EMBEDDINGS, LOGITS, FLOPS),
        "logit gradient": (factor, N * D * 2, 0),
        "embedding product": (LOGITS + ROWS_BF16 + GRAD_E + factor, GRAD_E + factor, FLOPS),
        "row product": (LOGITS + EMBEDDINGS, U, FLOPS),
        # U, the rows and the momentum read; rows, momentum, norms and the copy written.
        "update": (U + ROWS_FP32 + MOMENTUM, ROWS_FP32 + MOMENTUM + NORMS + ROWS_BF16, 0),
    }
    # With tile shifts (fp16 operands): one shift per row and 128-class tile written, and
    # the exponentials rescaled in place.
    assert by_phase(keep_logits=True, fused_update=True, one_shift=False) == {
        "forward": (ROWS_BF16 + EMBEDDINGS, LOGITS + 1 * N * 4, FLOPS),
        "logit gradient": (LOGITS, LOGITS, 0),  # rescaled in place
        "embedding product": (LOGITS + ROWS_BF16 + GRAD_E, GRAD_E, FLOPS),
        "row product": (LOGITS + EMBEDDINGS, U, FLOPS),
        # U, the rows and the momentum read; rows, momentum, norms and the copy written.
        "update": (U + ROWS_FP32 + MOMENTUM, ROWS_FP32 + MOMENTUM + NORMS + ROWS_BF16, 0),
    }


def test_recomputed_logits_and_the_optimizers_step_by_hand():
    # Norms and rounded rows made from the fp32 rows in the forward, the rows rounded again
    # and the logits recomputed in the backward; the gradient written, then torch's step.
    assert by_phase(keep_logits=False, fused_update=False) == {
        "forward": (ROWS_BF16 + EMBEDDINGS + 2 * ROWS_FP32, NORMS + ROWS_BF16, FLOPS),
        "logit gradient": (ROWS_BF16 + EMBEDDINGS + ROWS_FP32, LOGITS + ROWS_BF16, FLOPS),
        "embedding product": (LOGITS + ROWS_BF16 + GRAD_E, GRAD_E, FLOPS),
        "row product": (LOGITS + EMBEDDINGS, U, FLOPS),
        "update": (U + 2 * ROWS_FP32 + ROWS_FP32 + MOMENTUM, 3 * ROWS_FP32, 0),
    }


def test_keeping_the_logits_saves_the_recomputation():
    # 6 N K D FLOPs a step with the logits kept, 8 N K D recomputing them; fp32 operands
    # round nothing: no copy kept, no rounding pass.
    for fused in (False, True):
        kept = step_traffic(HeadShape(1024, 512, 10**6, keep_logits=True, fused_update=fused))
        again = step_traffic(HeadShape(1024, 512, 10**6, keep_logits=False, fused_update=fused))
        assert sum(p.flops for p in kept) == 6 * 1024 * 512 * 10**6
        assert sum(p.flops for p in again) == 8 * 1024 * 512 * 10**6
    fp32 = by_phase(keep_logits=True, fused_update=True, matmul_bytes=4, u_bytes=4)
    assert fp32["forward"][0] == K * D * 4 + CHUNKS * N * D * 4
    assert fp32["update"][1] == ROWS_FP32 + MOMENTUM + NORMS
    # U in fp32 (fp16 or fp32 operands): written by the row product, read by the update.
    assert fp32["row product"][1] == K * D * 4
    assert fp32["update"][0] == K * D * 4 + ROWS_FP32 + MOMENTUM


def test_the_phases_are_marked_while_a_profiler_runs(monkeypatch):
    from recognition.heads.kernels import gemm_backward

    monkeypatch.setattr(gemm_backward, "CHUNK_LOGITS", 7 * 128)  # chunks of 128 classes
    head = ShardedMarginSoftmax(300, 24, ArcFace(s=16.0), kernel="triton", chunk_size=128)
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    head.attach_fused_update(optimizer)
    embeddings, labels = torch.randn(7, 24, requires_grad=True), torch.randint(0, 300, (7,))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        head(embeddings, labels).backward()
    counts = {e.key: e.count for e in prof.key_averages() if e.key.startswith(PREFIX)}
    # One forward range; the backward's four once per chunk of 128 classes (3 chunks).
    assert counts == {PREFIX + "forward": 1, **{PREFIX + p: 3 for p in PHASES[1:]}}

    def no_range(name):
        raise AssertionError(f"a profiler range {name!r} without a profiler")

    monkeypatch.setattr(torch.profiler, "record_function", no_range)
    with phase("forward"):
        pass
    with pytest.raises(AssertionError, match="without a profiler"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            with phase("forward"):
                pass


def test_a_phase_and_the_rest_of_the_step_count_each_kernel_once():
    """benchmarks/head_phases.py's sums over the profiler's key averages, on the kinds of
    event it returns for a step with a profiled range: the range's host event (its kernels'
    device time) and its device-side annotation (its span on the GPU), the kernels' own
    events, and the host operations that launched them (their kernels' time again). The
    forward is its 4 ms of kernels, the rest of the step the 0.5 ms kernel outside it."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from benchmarks.head_phases import per_step_ms

    def event(key, device, *, total, own, annotation=False):
        return SimpleNamespace(key=key, device_type=device, is_user_annotation=annotation,
                               device_time_total=total, self_device_time_total=own)  # fmt: skip

    cpu, cuda, steps = DeviceType.CPU, DeviceType.CUDA, 2  # microseconds over 2 steps
    events = [
        event(PREFIX + "forward", cpu, total=8000, own=0, annotation=True),
        event(PREFIX + "forward", cuda, total=8300, own=8300, annotation=True),
        event("_forward_kernel", cuda, total=8000, own=8000),
        event("cuLaunchKernel", cpu, total=8000, own=8000),
        event("_margin_kernel", cuda, total=1000, own=1000),
        event("aten::add", cpu, total=1000, own=1000),
    ]
    ms = per_step_ms(events, steps)
    assert ms["forward"] == pytest.approx(4.0)
    assert ms["rest of the step"] == pytest.approx(0.5)
    assert all(ms[name] == 0.0 for name in PHASES if name != "forward")
