"""The Triton head kernels (heads/kernels), run by Triton's interpreter on CPU tensors.

TRITON_INTERPRET=1 is set by conftest.py before anything imports torch or triton
(`triton.jit` reads it at import time), and here again for a run of this file on its own;
spawned ranks inherit it. Every case compares kernel="triton" with an
independent float64 reference (full cosine matrix, psi from acos, F.cross_entropy) and with
the torch path of the same head. Sizes stay small: the interpreter runs every program of the
grid one after another in numpy.

Tolerances: fp32 operands 1e-5 of the largest entry against float64, as the torch path's own
fp32 test (the kernels sum in another order, in fp32). bf16 operands: 2e-2 against the torch
path under the same autocast (both round the operands to bf16; the interpreter rounds fp32
to bf16 by truncation, torch to nearest, and the sums run in different orders).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import dataclasses  # noqa: E402
import logging  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import RecordedKernel  # noqa: E402
from test_head import (  # noqa: E402
    MARGIN_CASES,
    assert_close_rel,
    assert_moved_alike,
    make_batch,
    psi_arcface,
    reference_loss,
    restricted_reference,
    run_head,
    step_heads,
)

from recognition.config import ConfigError, config_from_dict  # noqa: E402
from recognition.heads import ShardedMarginSoftmax, triton_stats  # noqa: E402
from recognition.heads import margin_softmax as head_module  # noqa: E402
from recognition.heads.kernels import forward, gemm_backward  # noqa: E402
from recognition.heads.margins import ArcFace, CosFace  # noqa: E402

EMBEDDING_SIZE = 24  # not a power of two: the kernels pad D to 32
MARGINS = {case[0]: case for case in MARGIN_CASES}


def small_chunks(monkeypatch, tiles=None) -> None:
    """The heads made after this run on `tiles` (a function as default_tiles) or the
    interpreter's, the forward and the backward in chunks of one tile of classes, so that
    every test crosses chunks."""
    kernels = triton_stats.triton_kernels()
    if tiles is not None:
        monkeypatch.setattr(kernels, "default_tiles", tiles)
    monkeypatch.setattr(gemm_backward, "CHUNK_LOGITS", 1)
    monkeypatch.setattr(forward, "CHUNK_ROW_VALUES", 1)


@pytest.fixture
def chunked(monkeypatch) -> None:
    """The tests that take it run in chunks of one tile (see small_chunks)."""
    small_chunks(monkeypatch)


def triton_and_torch_heads(num_classes, margin, **kwargs):
    """Two heads with the same weight: kernel="triton" and kernel="torch"."""
    fast = ShardedMarginSoftmax(num_classes, EMBEDDING_SIZE, margin, kernel="triton", **kwargs)
    slow = ShardedMarginSoftmax(num_classes, EMBEDDING_SIZE, margin, kernel="torch", **kwargs)
    slow.load_state_dict(fast.state_dict())
    return fast, slow


def make_labels_with_duplicates(num_classes, batch_size, seed):
    embeddings, labels = make_batch(num_classes, EMBEDDING_SIZE, batch_size, seed, torch.float32)
    if batch_size > 2:
        labels[2] = labels[0]  # a class twice in the batch
    return embeddings, labels


# Shapes that are not multiples of the tiles (N = 1, 7, 33; C = 1, 129, 1000), every margin at
# one shape, two margins at the others (the interpreter is slow); the logits kept for the
# backward (chunk size None) and, at three shapes, recomputed (a chunk size).
SHAPE_CASES = [(7, 129, name, None) for name in MARGINS] + [
    (1, 1, "arcface", None),
    (33, 1000, "arcface", None),
    (33, 1000, "sphereface", 256),
    (1, 129, "cosface", None),
    (1, 1, "arcface", 7),
    (7, 129, "combined", 7),
]


@pytest.mark.parametrize(("batch_size", "num_classes", "margin_id", "chunk_size"), SHAPE_CASES)
def test_fp32_matches_float64_reference_and_torch_path(
    batch_size, num_classes, margin_id, chunk_size, chunked
):
    _, make_margin, scale, psi = MARGINS[margin_id]
    torch.manual_seed(batch_size * 1000 + num_classes)
    fast, slow = triton_and_torch_heads(num_classes, make_margin(), chunk_size=chunk_size)
    embeddings, labels = make_labels_with_duplicates(num_classes, batch_size, seed=num_classes)
    loss, grad_e, grad_w = run_head(fast, embeddings, labels)
    ref_loss, ref_grad_e, ref_grad_w, ref_accuracy = reference_loss(
        embeddings, fast.weight, labels, scale, psi
    )
    assert loss.dtype == torch.float32 and grad_w.dtype == torch.float32
    assert_close_rel(loss, ref_loss, 1e-5)
    assert_close_rel(grad_e, ref_grad_e, 1e-5)
    assert_close_rel(grad_w, ref_grad_w, 1e-5)
    assert fast.last_accuracy.item() == pytest.approx(ref_accuracy.item(), abs=1e-6)
    torch_loss, torch_grad_e, torch_grad_w = run_head(slow, embeddings, labels)
    assert_close_rel(loss, torch_loss.double(), 1e-6)
    assert_close_rel(grad_e, torch_grad_e.double(), 1e-5)
    assert_close_rel(grad_w, torch_grad_w.double(), 1e-5)


def free_then_deterministic(runs: int):
    """A CosFace head of 400 classes on 33 rows: (head, embeddings, labels, one step's loss
    and gradients, and `runs` more in deterministic mode)."""
    torch.manual_seed(3)
    head = ShardedMarginSoftmax(400, EMBEDDING_SIZE, CosFace(s=16.0), kernel="triton")
    embeddings, labels = make_labels_with_duplicates(400, 33, seed=4)
    free = run_head(head, embeddings, labels)
    torch.use_deterministic_algorithms(True)
    try:
        ordered = [run_head(head, embeddings, labels) for _ in range(runs)]
    finally:
        torch.use_deterministic_algorithms(False)
    return head, embeddings, labels, free, ordered


def test_backward_repeats_bitwise_in_deterministic_mode(chunked):
    # No atomics: the chunks are summed in order, with or without deterministic mode.
    _, _, _, free, (first,) = free_then_deterministic(runs=1)
    for a, b in zip(first, free, strict=True):
        assert torch.equal(a, b)


def gpu_shaped_tiles(*args):
    """Tiles shaped as on a GPU, small enough for EMBEDDING_SIZE: the dimension summed in two
    BLOCK_D steps (the second partly padding), several class splits; the forward keeping its
    logits on wider class tiles than the recomputation's (the backward's chunks follow its
    tiles)."""
    kernels = triton_stats.triton_kernels()
    tiles = kernels.KernelTiles(block_c=16, block_n=16, block_d=16, num_warps=4, num_stages=2)
    keeping = kernels.KernelTiles(block_c=32, block_n=16, block_d=16, num_warps=4, num_stages=2)
    return kernels.TileConfig(tiles, target_programs=6, forward_keep=keeping)


@pytest.mark.parametrize("sample_rate", [1.0, 0.3])
def test_gpu_shaped_tiles_match_torch_path_and_fused_update(sample_rate, monkeypatch):
    small_chunks(monkeypatch, gpu_shaped_tiles)
    # Chunks of at most 48 classes, three recomputation tiles: the kept logits' tiles of 32
    # must not straddle a chunk's start.
    monkeypatch.setattr(gemm_backward, "CHUNK_LOGITS", 33 * 48)
    monkeypatch.setattr(forward, "CHUNK_ROW_VALUES", EMBEDDING_SIZE * 48)
    torch.manual_seed(13)
    fast, slow = triton_and_torch_heads(129, ArcFace(s=16.0), sample_rate=sample_rate, seed=2)
    embeddings, labels = make_labels_with_duplicates(129, 33, seed=14)
    ref_loss, ref_grad_e, ref_grad_w = run_head(slow, embeddings, labels)
    loss, grad_e, grad_w = run_head(fast, embeddings, labels)
    assert_close_rel(loss, ref_loss.double(), 1e-6)
    assert_close_rel(grad_e, ref_grad_e.double(), 1e-5)
    assert_close_rel(grad_w, ref_grad_w.double(), 1e-5)
    # The fused update's epilogue: one step against torch.optim.SGD.
    settings = {"lr": 0.5, "momentum": 0.9, "weight_decay": 5e-4, "nesterov": True}
    fast_opt = torch.optim.SGD(fast.parameters(), **settings)
    slow_opt = torch.optim.SGD(slow.parameters(), **settings)
    fast.attach_fused_update(fast_opt)
    slow.attach_optimizer(slow_opt)
    initial = fast.weight.detach().clone()
    step_heads(((fast, fast_opt), (slow, slow_opt)), embeddings, labels)
    assert_moved_alike(fast, slow, initial)


def test_the_row_epilogue_steps_the_rows_alike_on_any_of_its_tiles(monkeypatch):
    # The epilogue's tiles (values a program holds, warps) are the tuner's to choose: each
    # class row is stepped on its own, so other tiles step the rows and their momentum alike
    # (bit for bit here, where the interpreter sums each row over D in one order; on a GPU
    # the sum's order follows the warps). The tiles are honoured: 2 class rows a program.
    kernels = triton_stats.triton_kernels()
    blocks = []
    recorded = RecordedKernel(
        gemm_backward._finish_kernel, lambda grid, kwargs: blocks.append(kwargs["BLOCK_C"])
    )
    monkeypatch.setattr(gemm_backward, "_finish_kernel", recorded)
    results = []
    for finish in (kernels.FINISH_TILES, kernels.FinishTiles(64, 1)):
        config = dataclasses.replace(kernels.INTERPRETER_TILES, finish=finish)
        monkeypatch.setattr(kernels, "default_tiles", lambda *args, config=config: config)
        torch.manual_seed(13)
        head = ShardedMarginSoftmax(129, EMBEDDING_SIZE, ArcFace(s=16.0), kernel="triton")
        optimizer = torch.optim.SGD(head.parameters(), lr=0.5, momentum=0.9, weight_decay=5e-4)
        head.attach_fused_update(optimizer)
        embeddings, labels = make_labels_with_duplicates(129, 33, seed=14)
        for _ in range(2):
            step_heads(((head, optimizer),), embeddings, labels)
        buffer = optimizer.state[head.weight]["momentum_buffer"]
        results.append((head.weight.detach().clone(), buffer.clone()))
    assert set(blocks) == {kernels.FINISH_TILES.values // 32, 2}  # D 24 padded to 32
    for first, second in zip(*results, strict=True):
        assert torch.equal(first, second)


def test_tile_config_rejects_what_the_compiler_would_refuse():
    kernels = triton_stats.triton_kernels()
    good = kernels.KernelTiles(block_c=32, block_n=64, block_d=64, num_warps=8, num_stages=2)
    kernels.TileConfig(good)
    bad = [
        ({"block_c": 48}, "TileConfig.forward.block_c: must be a power of two >= 16"),
        ({"block_d": 8}, "TileConfig.forward.block_d: must be a power of two >= 16"),
        ({"num_warps": 3}, "TileConfig.forward.num_warps"),
        ({"num_stages": 0}, "TileConfig.forward.num_stages"),
    ]
    for change, message in bad:
        tiles = kernels.KernelTiles(**{**good.__dict__, **change})
        with pytest.raises(ValueError, match=message):
            kernels.TileConfig(tiles)
    with pytest.raises(ValueError, match="TileConfig.target_programs"):
        kernels.TileConfig(good, target_programs=-1)
    for dim in (24, 128, 256, 512, 1024, 4096):  # every GPU default passes its own check
        for operands in kernels.OPERAND_KINDS:
            kernels.gpu_tiles(dim, 132, operands).check()
    with pytest.raises(ValueError, match="gpu_tiles: operands"):
        kernels.gpu_tiles(512, 132, "fp8")


@pytest.mark.parametrize("scale", [16.0, 80.0], ids=["one_shift", "tile_shifts"])
def test_kept_logits_and_recomputed_logits_agree(scale, chunked, monkeypatch):
    # head.chunk_size None keeps the forward's exponentials for the backward, which reads
    # them (no recomputation kernel runs); a chunk size recomputes them. The same function:
    # fp32 operands agree to 1e-6 of the largest entry. Up to scale 66 they are kept with one
    # shift for every class and the products read them as they are (no pass over them);
    # above, shifted by their tile's running max and rescaled in place by _scale_kept_kernel.
    launched = {"recomputed": 0, "kept": 0}
    for name, key in (("_grad_logits_kernel", "recomputed"), ("_scale_kept_kernel", "kept")):
        kernel = getattr(gemm_backward, name)
        counted = CountedKernel(kernel, launched, key)
        monkeypatch.setattr(gemm_backward, name, counted)
    torch.manual_seed(5)
    kept = ShardedMarginSoftmax(129, EMBEDDING_SIZE, ArcFace(s=scale), kernel="triton")
    recomputed = ShardedMarginSoftmax(
        129, EMBEDDING_SIZE, ArcFace(s=scale), kernel="triton", chunk_size=7
    )
    recomputed.load_state_dict(kept.state_dict())
    embeddings, labels = make_labels_with_duplicates(129, 7, seed=6)
    first = run_head(kept, embeddings, labels)
    passes = 0 if scale <= forward.FIXED_SHIFT_MAX_SCALE else 2  # two chunks of one tile
    assert launched == {"recomputed": 0, "kept": passes}
    second = run_head(recomputed, embeddings, labels)
    assert launched == {"recomputed": 2, "kept": passes}
    for a, b in zip(first, second, strict=True):
        assert_close_rel(a, b.double(), 1e-6)


@pytest.mark.parametrize("scale", [16.0, 80.0], ids=["one_shift", "tile_shifts"])
def test_kept_logits_stay_within_their_tensors(scale, monkeypatch):
    # The forward's last class split may run past the chunk's tiles (10 tiles in splits of
    # 3 here): those tiles store nothing. Guard values after each kept tensor must survive.
    guards = []

    def guarded(probabilities, tile_shift, block_c, fixed_shift=None):
        extended = []
        for tensor in (probabilities, tile_shift):
            if tensor is None:  # one shift: no tile shifts
                extended.append(None)
                continue
            flat = torch.full((tensor.numel() + 4096,), float("nan"), dtype=tensor.dtype)
            guards.append((flat, tensor.numel()))
            extended.append(flat[: tensor.numel()].view(tensor.shape))
        return kept_type(*extended, block_c, fixed_shift)

    kept_type = forward.KeptLogits
    monkeypatch.setattr(forward, "KeptLogits", guarded)
    torch.manual_seed(8)
    head = ShardedMarginSoftmax(1200, EMBEDDING_SIZE, ArcFace(s=scale), kernel="triton")
    embeddings, labels = make_labels_with_duplicates(1200, 7, seed=8)
    run_head(head, embeddings, labels)
    assert len(guards) == (1 if scale <= forward.FIXED_SHIFT_MAX_SCALE else 2)
    for flat, used in guards:
        assert torch.isnan(flat[used:]).all()


def extreme_logits_head(scale: float, num_classes: int = 129):
    """A CosFace head at `scale` whose rows all point near one direction, with norms from
    1e-3 to 1e3, and a batch whose row 0 points away from every class (its non-target
    logits all near -s), row 1 along them (near +s), the others at random."""
    torch.manual_seed(11)
    head = ShardedMarginSoftmax(num_classes, EMBEDDING_SIZE, CosFace(s=scale), kernel="triton")
    direction = torch.nn.functional.normalize(torch.randn(EMBEDDING_SIZE), dim=0)
    rows = direction + 0.05 * torch.randn(num_classes, EMBEDDING_SIZE)
    norms = 10 ** torch.empty(num_classes, 1).uniform_(-3, 3)
    with torch.no_grad():
        head.weight.copy_(torch.nn.functional.normalize(rows, dim=1) * norms)
    embeddings, labels = make_labels_with_duplicates(num_classes, 7, seed=12)
    embeddings[0], embeddings[1] = -3.0 * direction, 2.0 * direction
    return head, embeddings, labels


@pytest.mark.parametrize("scale", [64.0, forward.FIXED_SHIFT_MAX_SCALE])
def test_one_shift_keeps_every_logit_in_range_up_to_its_largest_scale(scale, chunked):
    # Kept with one shift c (forward.fixed_shift), exp(logit - c) / |w| must neither
    # underflow for a row whose logits are all near -s (each class then has about 1 / C of
    # its probability) nor overflow for one near +s, with 1 / |w| from 1e-3 to 1e3: fp32
    # operands against float64, bf16 ones against the torch path under autocast.
    head, embeddings, labels = extreme_logits_head(scale)
    assert forward.fixed_shift(scale, torch.float32) is not None
    loss, grad_e, grad_w = run_head(head, embeddings, labels)
    ref_loss, ref_grad_e, ref_grad_w, _ = reference_loss(
        embeddings, head.weight, labels, scale, lambda t: torch.cos(t) - 0.4
    )
    assert_close_rel(loss, ref_loss, 1e-5)
    assert_close_rel(grad_e, ref_grad_e, 1e-5)
    assert_close_rel(grad_w, ref_grad_w, 1e-5)
    # Row 0's gradient is not lost to an underflow: it is as large as the reference's.
    assert grad_e[0].norm() == pytest.approx(ref_grad_e[0].norm().item(), rel=1e-5)
    slow = ShardedMarginSoftmax(129, EMBEDDING_SIZE, CosFace(s=scale), kernel="torch")
    slow.load_state_dict(head.state_dict())
    results = []
    for one in (head, slow):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(run_head(one, embeddings, labels))
    for fast_value, torch_value in zip(*results, strict=True):
        assert torch.isfinite(fast_value).all()
        assert_close_rel(fast_value, torch_value.double(), 2e-2)


class CountedKernel:
    """A kernel whose launches are counted in `counts[key]`."""

    def __init__(self, kernel, counts, key):
        self.kernel, self.counts, self.key = kernel, counts, key

    def __getitem__(self, grid):
        self.counts[self.key] += 1
        return self.kernel[grid]


@pytest.mark.parametrize("chunk_size", [None, 64], ids=["kept", "recomputed"])
@pytest.mark.parametrize("half_weight", [False, True], ids=["autocast", "bf16_weight"])
def test_bf16_operands_match_torch_path(half_weight, chunk_size, chunked):
    torch.manual_seed(7)
    fast, slow = triton_and_torch_heads(129, CosFace(s=16.0), chunk_size=chunk_size)
    embeddings, labels = make_labels_with_duplicates(129, 33, seed=8)
    results = []
    for head in (fast, slow):
        if half_weight:  # O2/O3: bf16 weight and embeddings, matmul in bf16
            head.to(torch.bfloat16)
            results.append(run_head(head, embeddings.to(torch.bfloat16), labels))
        else:  # O1: fp32 weight and inputs, matmul in bf16 under autocast
            with torch.autocast("cpu", dtype=torch.bfloat16):
                results.append(run_head(head, embeddings, labels))
    (loss, grad_e, grad_w), (ref_loss, ref_grad_e, ref_grad_w) = results
    assert loss.dtype == torch.float32 and grad_w.dtype == fast.weight.dtype
    assert_close_rel(loss, ref_loss.double(), 2e-2)
    assert_close_rel(grad_e, ref_grad_e.double(), 2e-2)
    assert_close_rel(grad_w, ref_grad_w.double(), 2e-2)
    # Against float64 on the unrounded inputs: the loss stays within bf16's precision.
    exact = reference_loss(
        embeddings, fast.weight.float(), labels, 16.0, lambda t: torch.cos(t) - 0.4
    )[0]
    assert abs(loss.item() - exact.item()) < 0.02 * exact.item()


def test_the_row_product_leaves_in_bf16_with_bf16_operands_else_in_fp32(monkeypatch):
    # U (the rows' gradient before the radial part goes) is final per chunk: written and
    # read in bf16 with bf16 operands (half the traffic of fp32), in fp32 with fp32 ones and
    # with fp16 ones (whose range may not hold it).
    seen = []
    finish = gemm_backward._finish

    def recording(x, u, *args):
        seen.append(u.dtype)
        return finish(x, u, *args)

    monkeypatch.setattr(gemm_backward, "_finish", recording)
    embeddings, labels = make_labels_with_duplicates(129, 9, seed=3)
    for dtype, u_dtype in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                           (torch.float32, torch.float32)):  # fmt: skip
        torch.manual_seed(3)
        head = ShardedMarginSoftmax(129, EMBEDDING_SIZE, CosFace(s=16.0), kernel="triton")
        seen.clear()
        run_head(head.to(dtype), embeddings.to(dtype), labels)
        assert seen and set(seen) == {u_dtype}, dtype


def test_partial_fc_matches_restricted_reference_and_torch_path(chunked):
    torch.manual_seed(9)
    fast, slow = triton_and_torch_heads(300, ArcFace(s=16.0), sample_rate=0.3, seed=4)
    embeddings, labels = make_labels_with_duplicates(300, 7, seed=10)
    loss, grad_e, grad_w = run_head(fast, embeddings, labels)
    index = fast.sampled_index
    torch_loss, torch_grad_e, torch_grad_w = run_head(slow, embeddings, labels)
    assert torch.equal(index, slow.sampled_index) and index.numel() < 300
    ref_loss, ref_grad_e, ref_grad_w = restricted_reference(
        embeddings, fast.weight, labels, index, 16.0, lambda t: psi_arcface(t, 0.5)
    )
    assert_close_rel(loss, ref_loss, 1e-5)
    assert_close_rel(grad_e, ref_grad_e, 1e-5)
    assert_close_rel(grad_w, ref_grad_w, 1e-5)
    assert_close_rel(grad_w, torch_grad_w.double(), 1e-5)
    unsampled = torch.ones(300, dtype=torch.bool)
    unsampled[index] = False
    assert (grad_w[unsampled] == 0).all()


# ---- fused SGD update ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sample_rate", "nesterov", "momentum"),
    [(1.0, False, 0.9), (1.0, True, 0.9), (0.3, False, 0.9), (1.0, False, 0.0)],
)
def test_fused_update_matches_torch_sgd_over_steps(sample_rate, nesterov, momentum, chunked):
    torch.manual_seed(11)
    fast, slow = triton_and_torch_heads(150, ArcFace(s=16.0), sample_rate=sample_rate, seed=3)
    settings = {"momentum": momentum, "weight_decay": 5e-4, "nesterov": nesterov}
    fast_opt = torch.optim.SGD(fast.parameters(), lr=0.5, **settings)
    slow_opt = torch.optim.SGD(slow.parameters(), lr=0.5, **settings)
    fast.attach_fused_update(fast_opt)
    slow.attach_optimizer(slow_opt)
    # The LR changes between steps: the fused update must read it from the optimizer.
    fast_sched = torch.optim.lr_scheduler.StepLR(fast_opt, step_size=1, gamma=0.7)
    slow_sched = torch.optim.lr_scheduler.StepLR(slow_opt, step_size=1, gamma=0.7)
    ever_sampled = torch.zeros(150, dtype=torch.bool)
    initial = fast.weight.detach().clone()
    for step in range(4):
        embeddings, labels = make_labels_with_duplicates(150, 7, seed=20 + step)
        before = fast.weight.detach().clone()
        for head, opt, sched in ((fast, fast_opt, fast_sched), (slow, slow_opt, slow_sched)):
            opt.zero_grad(set_to_none=True)
            head(embeddings, labels).backward()
            opt.step()
            sched.step()
        assert fast.weight.grad is None  # no weight-sized gradient
        # fp32 rounding: the gradients are summed in another order (1e-5 of the largest
        # entry, as the gradient tests), and so is what the steps moved the rows by.
        moved = (fast.weight - initial).detach().double()
        assert_close_rel(moved, (slow.weight - initial).detach().double(), 1e-5)
        if momentum:
            fast_buf = fast_opt.state[fast.weight]["momentum_buffer"]
            slow_buf = slow_opt.state[slow.weight]["momentum_buffer"]
            assert_close_rel(fast_buf, slow_buf.double(), 1e-5)
        if sample_rate < 1:
            sampled = torch.zeros(150, dtype=torch.bool)
            sampled[fast.sampled_index] = True
            ever_sampled |= sampled
            assert torch.equal(fast.weight.detach()[~sampled], before[~sampled])
            if momentum:
                assert (fast_buf[~ever_sampled] == 0).all()
    assert not torch.equal(fast.weight.detach(), initial)
    if sample_rate < 1:
        assert 0 < int(ever_sampled.sum()) < 150
    # Same checkpoint format as without the fused update.
    fast_state, slow_state = fast_opt.state_dict(), slow_opt.state_dict()
    assert fast_state["param_groups"] == slow_state["param_groups"]
    assert {k: set(v) for k, v in fast_state["state"].items()} == {
        k: set(v) for k, v in slow_state["state"].items()
    }


def test_the_fused_update_reads_a_rate_held_in_a_device_tensor():
    """A captured step (train.cuda_graphs) hands the fused update its rate as a 0-dim float32
    tensor, which the kernel reads at each replay: the same rows and momentum as the float
    (the kernel takes a float rate as float32 too), step after step as the rate changes."""
    heads, optimizers = [], []
    for _ in range(2):
        torch.manual_seed(11)
        head = ShardedMarginSoftmax(150, EMBEDDING_SIZE, ArcFace(s=16.0), kernel="triton")
        optimizer = torch.optim.SGD(head.parameters(), lr=0.5, momentum=0.9, weight_decay=5e-4)
        head.attach_fused_update(optimizer)
        heads.append(head)
        optimizers.append(optimizer)
    rate = torch.zeros((), dtype=torch.float32)
    initial = heads[0].weight.detach().clone()
    for step in range(3):
        embeddings, labels = make_labels_with_duplicates(150, 7, seed=40 + step)
        lr = 0.5 * 0.7**step
        optimizers[0].param_groups[0]["lr"] = lr
        rate.fill_(lr)
        optimizers[1].param_groups[0]["lr"] = rate
        for head in heads:
            head(embeddings, labels).backward()
        assert torch.equal(heads[0].weight, heads[1].weight)
    assert not torch.equal(heads[0].weight.detach(), initial)
    buffers = [o.state[h.weight]["momentum_buffer"] for o, h in zip(optimizers, heads, strict=True)]
    assert torch.equal(buffers[0], buffers[1])


@pytest.mark.parametrize("sample_rate", [1.0, 0.5])
def test_the_fused_update_keeps_the_rounded_rows_and_norms_current(sample_rate, chunked):
    """With the fused update (and the logits kept, chunk size None) the head keeps its rows
    in the matmul dtype and their inverse norms between steps, and the update's epilogue
    writes both for the rows it steps: after each step they are what the fp32 rows give,
    and no forward made them again. A checkpoint does not hold them, and after
    load_state_dict they are made from the rows loaded."""
    torch.manual_seed(17)
    head = ShardedMarginSoftmax(
        300, EMBEDDING_SIZE, ArcFace(s=16.0), kernel="triton", sample_rate=sample_rate, seed=3
    )
    optimizer = torch.optim.SGD(head.parameters(), lr=0.5, momentum=0.9, weight_decay=5e-4)
    head.attach_fused_update(optimizer)
    kept, made = head._kept_rows, []
    for step in range(3):
        embeddings, labels = make_labels_with_duplicates(300, 7, seed=30 + step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            head(embeddings, labels).backward()
        optimizer.step()
        made.append((kept.rounded, kept.inv_norm))
        weight = head.weight.detach().double()
        # bf16 within one step of the fp32 rows (the interpreter truncates, torch rounds to
        # nearest), the inverse norms to fp32's precision.
        assert ((kept.rounded.double() - weight).abs() <= 2**-7 * weight.abs()).all(), step
        expected = 1 / torch.linalg.vector_norm(weight, dim=1)
        assert_close_rel(kept.inv_norm, expected, 1e-6)
    assert all(a is made[0][0] and b is made[0][1] for a, b in made)  # kept, never remade
    assert set(head.state_dict()) == {
        "weight",
        "_extra_state",
        *(f"margin.{k}" for k in head.margin.state_dict()),
    }
    fresh = ShardedMarginSoftmax(  # the rows as they started, the same sample
        300, EMBEDDING_SIZE, ArcFace(s=16.0), kernel="triton", sample_rate=sample_rate, seed=3
    )
    head.load_state_dict(fresh.state_dict())
    embeddings, labels = make_labels_with_duplicates(300, 7, seed=40)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # training forwards: the kept rows
        assert torch.equal(head(embeddings, labels), fresh(embeddings, labels))
    assert kept.rounded is not made[0][0]


class PausedKernel:
    """A kernel launched with `watcher` paused: the interpreter reads its arguments on the
    host (copies into numpy), which a GPU launch does not."""

    def __init__(self, kernel, watcher):
        self.kernel, self.watcher = kernel, watcher

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with self.watcher.watch(False):
                return self.kernel[grid](*args, **kwargs)

        return launch


def test_a_fused_update_step_syncs_nothing_and_a_nan_loss_moves_nothing(monkeypatch):
    """train_step with the fused update, watched by test_host_sync's SyncWatcher (every value
    read on the host, every op of a data-dependent size; the kernel launches themselves
    apart): the target rows' share is summed per row on the device (a scatter, not
    torch.unique), and the loss's finiteness gates the update on the device, so a NaN loss
    still runs backward and no row, momentum or weight moves."""
    from test_host_sync import SyncWatcher, assert_no_syncs

    from recognition.precision import Precision
    from recognition.training import train_step

    watcher = SyncWatcher()
    for module in (forward, gemm_backward):
        for name in [n for n in dir(module) if n.endswith("_kernel")]:
            monkeypatch.setattr(module, name, PausedKernel(getattr(module, name), watcher))
    torch.manual_seed(5)
    backbone = torch.nn.Linear(8, EMBEDDING_SIZE)
    head = ShardedMarginSoftmax(40, EMBEDDING_SIZE, ArcFace(s=16.0), kernel="triton")
    precision = Precision("O0", "bf16", torch.device("cpu"))
    precision.prepare(backbone, head)
    params = [*backbone.parameters(), head.weight]
    optimizer = torch.optim.SGD(params, lr=0.5, momentum=0.9, fused=True)
    head.attach_fused_update(optimizer)
    assert head.updates_in_backward
    images = torch.randn(6, 8)
    labels = torch.tensor([3, 3, 7, 11, 3, 39])  # a class three times: one summed share
    train_step(backbone, head, [(images, labels)], optimizer, precision, None)  # the state
    before = [p.detach().clone() for p in params]
    momentum = optimizer.state[head.weight]["momentum_buffer"].clone()
    with watcher.installed(), watcher.watch(True):
        nan = train_step(
            backbone, head, [(images * float("nan"), labels)], optimizer, precision, None
        )
        result = train_step(backbone, head, [(images, labels)], optimizer, precision, None)
    assert_no_syncs(watcher)
    assert not nan.finite and not nan.stepped and result.finite and result.stepped
    for old, new in zip(before[:-1], params[:-1], strict=True):  # the backbone stepped once
        assert not torch.equal(old, new)
    # The rows moved once, by the finite step: as torch.optim.SGD moves them from `before`.
    reference = ShardedMarginSoftmax(40, EMBEDDING_SIZE, ArcFace(s=16.0), kernel="torch")
    with torch.no_grad():
        reference.weight.copy_(before[-1])
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    reference_optimizer.state[reference.weight]["momentum_buffer"] = momentum
    reference(torch.nn.functional.linear(images, *before[:-1]), labels).backward()
    reference_optimizer.step()
    assert_moved_alike(head, reference, before[-1])


def test_fused_update_refuses_what_it_cannot_honour():
    head = ShardedMarginSoftmax(20, EMBEDDING_SIZE, CosFace(), kernel="triton")
    with pytest.raises(ValueError, match="SGD"):
        head.attach_fused_update(torch.optim.AdamW(head.parameters()))
    with pytest.raises(ValueError, match="dampening"):
        head.attach_fused_update(torch.optim.SGD(head.parameters(), lr=0.1, dampening=0.1))
    torch_head = ShardedMarginSoftmax(20, EMBEDDING_SIZE, CosFace(), kernel="torch")
    with pytest.raises(ValueError, match="head.kernel=triton"):
        torch_head.attach_fused_update(torch.optim.SGD(torch_head.parameters(), lr=0.1))
    # A forward that cannot use the kernel (float64) must not silently skip the update.
    head.attach_fused_update(torch.optim.SGD(head.parameters(), lr=0.1))
    head.double()
    with pytest.raises(RuntimeError, match="fused_update"):
        head(torch.randn(3, EMBEDDING_SIZE, dtype=torch.float64), torch.tensor([1, 2, 3]))


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ({"head": {"kernel": "torch"}}, "head.kernel"),
        ({"optim": {"name": "adamw"}}, "optim.name"),
        ({"optim": {"grad_clip": 5.0}}, "optim.grad_clip"),
        ({"train": {"accumulate_steps": 2}}, "train.accumulate_steps"),
        ({"precision": {"level": "O2"}}, "precision.level"),
        ({"precision": {"level": "O1", "dtype": "fp16"}}, "precision.dtype"),
    ],
)
def test_config_refuses_fused_update_with_what_it_cannot_honour(override, key):
    valid = {
        "head": {"kernel": "triton", "fused_update": True},
        "optim": {"name": "sgd", "grad_clip": None},
        "train": {"accumulate_steps": 1},
        "precision": {"level": "O1", "dtype": "bf16"},
    }
    config_from_dict(valid)  # the valid combination builds
    raw = {section: {**values, **override.get(section, {})} for section, values in valid.items()}
    with pytest.raises(ConfigError, match="head.fused_update") as error:
        config_from_dict(raw)
    assert key in str(error.value)


def test_config_rejects_unknown_kernel():
    with pytest.raises(ConfigError, match="head.kernel"):
        config_from_dict({"head": {"kernel": "cuda"}})


# ---- kernel choice -----------------------------------------------------------------------------


def test_auto_uses_torch_and_logs_once(caplog, monkeypatch):
    calls = []
    original = triton_stats.TritonClassStats.apply
    monkeypatch.setattr(
        triton_stats.TritonClassStats, "apply", lambda *a: calls.append(1) or original(*a)
    )
    head = ShardedMarginSoftmax(20, EMBEDDING_SIZE, CosFace())
    assert head.kernel == "auto"
    embeddings, labels = make_batch(20, EMBEDDING_SIZE, 4, seed=1, dtype=torch.float32)
    with caplog.at_level(logging.INFO, logger=head_module.__name__):
        head(embeddings, labels)
        head(embeddings, labels)
    assert not calls
    assert sum("head.kernel=auto" in r.getMessage() for r in caplog.records) == 1


def test_triton_falls_back_to_torch_for_float64_with_one_log_line(caplog):
    head = ShardedMarginSoftmax(20, EMBEDDING_SIZE, CosFace(), kernel="triton").double()
    embeddings, labels = make_batch(20, EMBEDDING_SIZE, 4, seed=1)
    with caplog.at_level(logging.INFO, logger=head_module.__name__):
        loss = head(embeddings, labels)
        head(embeddings, labels)
    assert loss.dtype == torch.float64
    assert sum("torch path" in r.getMessage() for r in caplog.records) == 1
    ref_loss = reference_loss(embeddings, head.weight, labels, 64.0, lambda t: torch.cos(t) - 0.4)[
        0
    ]
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-10)


def test_constructor_rejects_unknown_kernel():
    with pytest.raises(ValueError, match="head.kernel"):
        ShardedMarginSoftmax(20, EMBEDDING_SIZE, CosFace(), kernel="cuda")


# ---- world sizes 1-3 (2 and 3 under gloo) ---------------------------------------------------


def check_triton_ranks(check, rank, world_size):
    import test_head_distributed as hd

    # Each scenario with one margin (the interpreter is slow; margins are covered above):
    # duplicate labels across ranks, every label on one rank, a rank owning no label.
    cases = zip(["random", "one_shard", "rank_owns_none"], hd.MARGIN_CASES[:3], strict=True)
    for scenario_index, (scenario, margin_case) in enumerate(cases):
        weight, embeddings, labels = hd.full_problem(
            world_size, scenario, torch.float32, scenario_index
        )
        for margin_id, make_margin, scale, psi in [margin_case]:
            name = f"W={world_size} triton {scenario} {margin_id}"
            ref_loss, ref_grad_e, ref_grad_w, _ = hd.reference(
                embeddings, weight, labels, scale, psi
            )
            head = ShardedMarginSoftmax(
                hd.NUM_CLASSES, hd.EMBEDDING_SIZE, make_margin(), kernel="triton"
            )
            loss, grad_w, grad_e = hd.run_head(head, weight, embeddings, labels, rank, world_size)
            check.close(f"{name}: loss", loss, ref_loss, 1e-5)
            check.close(f"{name}: grad weight", grad_w, ref_grad_w, 1e-5)
            check.close(f"{name}: grad embeddings", grad_e, ref_grad_e, 1e-5)
    # Partial FC on every rank: the softmax over the sampled classes of all ranks.
    weight, embeddings, labels = hd.full_problem(world_size, "random", torch.float32, 11)
    head = ShardedMarginSoftmax(
        hd.NUM_CLASSES, hd.EMBEDDING_SIZE, CosFace(), sample_rate=0.3, seed=5, kernel="triton"
    )
    loss, grad_w, grad_e = hd.run_head(head, weight, embeddings, labels, rank, world_size)
    columns = hd.gather_rows((head.class_start + head.sampled_index)[:, None], world_size)[:, 0]
    ref_loss, ref_grad_e, ref_grad_w, _ = hd.reference(
        embeddings, weight, labels, 64.0, lambda t: torch.cos(t) - 0.4, columns=columns
    )
    check.close(f"W={world_size} triton partial FC: loss", loss, ref_loss, 1e-5)
    check.close(f"W={world_size} triton partial FC: grad weight", grad_w, ref_grad_w, 1e-5)
    check.close(f"W={world_size} triton partial FC: grad embeddings", grad_e, ref_grad_e, 1e-5)


def test_triton_head_on_one_rank_matches_single_process_reference():
    # World size 1 needs no process group: run in this process, sparing a spawn.
    import test_head_distributed as hd

    check = hd.Checker()
    check_triton_ranks(check, 0, 1)
    assert not check.failures, "\n".join(check.failures)


@pytest.mark.parametrize("world_size", [2, 3])
def test_triton_head_on_gloo_ranks_matches_single_process_reference(world_size, tmp_path):
    import test_head_distributed as hd

    hd.assert_checks_pass_on_ranks(world_size, tmp_path, (check_triton_ranks,))


@pytest.mark.parametrize("chunk_size", [None, 64], ids=["kept", "recomputed"])
def test_rows_are_rounded_once_a_step_or_one_chunk_at_a_time(chunk_size, monkeypatch):
    # With a chunk size the rounded rows exist a chunk at a time in the forward and in the
    # backward: the first GPU run of this path held every chunk of the forward at once (a
    # bf16 copy of the shard, 9.6 GiB more at 10M classes). Without one (the logits kept),
    # the rows are rounded once for the whole step: no second pass in the backward.
    import weakref

    from recognition.heads.kernels import host

    small_chunks(monkeypatch)
    made, most_alive = [], [0]
    original = host.chunk_rows

    def counted(*args):
        most_alive[0] = max(most_alive[0], sum(ref() is not None for ref in made))
        rows = original(*args)
        made.append(weakref.ref(rows))
        return rows

    monkeypatch.setattr(host, "chunk_rows", counted)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # rounded rows are copies
        head = ShardedMarginSoftmax(
            1000, EMBEDDING_SIZE, ArcFace(s=16.0), kernel="triton", chunk_size=chunk_size
        )
        embeddings, labels = make_labels_with_duplicates(1000, 7, seed=12)
        run_head(head, embeddings, labels)
    if chunk_size is None:
        assert len(made) == 1  # the step's rows, rounded once
    else:
        assert len(made) == 2 * 8  # chunks of one 128-class tile, forward and backward
        assert most_alive[0] <= 1  # the previous chunk, still named by the loop, at most


def test_label_smoothing_on_the_triton_path(chunked):
    """Label smoothing's term is the same on either kernel: the Triton head against the
    full-logit F.cross_entropy(label_smoothing=0.1) in float64."""
    from test_reid_losses import smoothed_reference

    torch.manual_seed(3)
    fast = ShardedMarginSoftmax(129, EMBEDDING_SIZE, CosFace(s=16.0, m=0.35), kernel="triton",
                                label_smoothing=0.1)  # fmt: skip
    embeddings, labels = make_labels_with_duplicates(129, 7, seed=3)
    loss, grad_e, grad_w = run_head(fast, embeddings, labels)
    ref_loss, ref_grad_e, ref_grad_w = smoothed_reference(
        embeddings, fast.weight, labels, 16.0, lambda t: torch.cos(t) - 0.35, 0.1
    )
    assert_close_rel(loss, ref_loss, 1e-5)
    assert_close_rel(grad_e, ref_grad_e, 1e-5)
    assert_close_rel(grad_w, ref_grad_w, 1e-5)
