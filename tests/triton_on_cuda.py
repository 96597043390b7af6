"""The head's Triton kernels compiled and run on a CUDA device, against independent references.

    python tests/triton_on_cuda.py                      # what tests/test_head_triton_cuda.py runs
    TRITON_INTERPRET=1 python tests/triton_on_cuda.py --device cpu   # the same, interpreted

tests/test_head_triton.py checks the kernels in Triton's interpreter, which neither compiles
them nor runs them at a GPU's tiles, grids and rounding. This script does, in a process of
its own (the suite sets TRITON_INTERPRET=1, which triton reads once, at import). Each check
prints one line; the first failure raises. The checks run in chunks of one tile of classes
(so that they cross chunks), at the GPU's tiles (several class splits, a partial last tile,
D = 512):

- fp32 operands (TF32 off): loss and gradients against a float64 reference;
- bf16 operands under autocast (O1): against the torch path under the same autocast;
- partial FC: against the torch path with the same sample;
- the fused SGD update over 3 steps against torch.optim.SGD (momentum, Nesterov, decay);
- the deterministic reduction: two backwards equal bit for bit;
- CUDA only: steady-state steps of a triton head, plain and with the fused update, make no
  host synchronisation (`torch.cuda.set_sync_debug_mode("error")`); head.kernel=auto
  measures both paths, logs its choice, caches it, and a second head reads the cache; the
  tiles are timed at a shape large enough to be tuned (two candidates, to keep the compile
  time short) and the tuned kernels match the torch path.

With --device cpu (under TRITON_INTERPRET=1) the sizes shrink and the CUDA-only checks are
left out: how the script itself is checked without a GPU.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the deterministic check
TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(TESTS.parent), str(TESTS)]

import torch  # noqa: E402
from test_head import assert_close_rel, make_batch, psi_arcface, reference_loss  # noqa: E402

from recognition.heads import ShardedMarginSoftmax  # noqa: E402
from recognition.heads import margin_softmax as head_module  # noqa: E402
from recognition.heads.margins import ArcFace  # noqa: E402
from recognition.heads.tuning.measure import TuningCache  # noqa: E402


class Sizes:
    def __init__(self, device: torch.device) -> None:
        gpu = device.type == "cuda"
        self.rows = 256 if gpu else 16  # N
        self.dim = 512 if gpu else 40  # D, padded to 64 on the CPU
        # A prime: a partial last tile. Below tile_tuning.MIN_TUNED_WORK, so these checks
        # run at the table's tiles (the ones ptxas was asked about) and compile fast.
        self.classes = 7919 if gpu else 131


def heads(sizes: Sizes, device: torch.device, **kwargs) -> tuple:
    """kernel="triton" and kernel="torch" heads with the same rows."""
    fast = ShardedMarginSoftmax(
        sizes.classes, sizes.dim, ArcFace(s=32.0), kernel="triton", **kwargs
    )
    slow = ShardedMarginSoftmax(sizes.classes, sizes.dim, ArcFace(s=32.0), kernel="torch", **kwargs)
    slow.load_state_dict(fast.state_dict())
    return fast.to(device), slow.to(device)


def step(head, embeddings, labels) -> tuple:
    """Loss, embedding gradient, weight gradient of one forward and backward, in float64."""
    embeddings = embeddings.detach().clone().requires_grad_(True)
    head.zero_grad(set_to_none=True)
    loss = head(embeddings, labels)
    loss.backward()
    grad_w = head.weight.grad
    return (
        loss.detach().double(),
        embeddings.grad.double(),
        None if grad_w is None else grad_w.double(),
    )


def batch(sizes: Sizes, device: torch.device, seed: int) -> tuple:
    embeddings, labels = make_batch(sizes.classes, sizes.dim, sizes.rows, seed, torch.float32)
    labels[1] = labels[0]  # a class twice in the batch
    return embeddings.to(device), labels.to(device)


def check_fp32(sizes: Sizes, device: torch.device) -> str:
    fast, _ = heads(sizes, device)
    embeddings, labels = batch(sizes, device, seed=1)
    loss, grad_e, grad_w = step(fast, embeddings, labels)
    ref = reference_loss(embeddings, fast.weight, labels, 32.0, lambda t: psi_arcface(t, 0.5))
    for got, want in zip((loss, grad_e, grad_w), ref[:3], strict=True):
        assert_close_rel(got, want, 1e-4)
    return f"fp32 operands match float64: loss {loss.item():.6f}"


def check_bf16(sizes: Sizes, device: torch.device) -> str:
    fast, slow = heads(sizes, device)
    embeddings, labels = batch(sizes, device, seed=2)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        got, want = step(fast, embeddings, labels), step(slow, embeddings, labels)
    for a, b in zip(got, want, strict=True):
        assert_close_rel(a, b, 2e-2)
    return f"bf16 operands match the torch path: loss {got[0].item():.4f} / {want[0].item():.4f}"


def check_partial_fc(sizes: Sizes, device: torch.device) -> str:
    fast, slow = heads(sizes, device, sample_rate=0.3, seed=4)
    embeddings, labels = batch(sizes, device, seed=3)
    got, want = step(fast, embeddings, labels), step(slow, embeddings, labels)
    assert torch.equal(fast.sampled_index, slow.sampled_index)
    for a, b in zip(got, want, strict=True):
        assert_close_rel(a, b, 1e-4)
    return f"partial FC matches the torch path ({fast.sampled_index.numel()} classes sampled)"


def check_fused_update(sizes: Sizes, device: torch.device) -> str:
    fast, slow = heads(sizes, device)
    settings = {"lr": 0.5, "momentum": 0.9, "weight_decay": 5e-4, "nesterov": True}
    fast_opt = torch.optim.SGD(fast.parameters(), **settings)
    slow_opt = torch.optim.SGD(slow.parameters(), **settings)
    fast.attach_fused_update(fast_opt)
    initial = fast.weight.detach().clone()
    for seed in range(3):
        embeddings, labels = batch(sizes, device, seed=10 + seed)
        for head, opt in ((fast, fast_opt), (slow, slow_opt)):
            opt.zero_grad(set_to_none=True)
            head(embeddings, labels).backward()
            opt.step()
    assert fast.weight.grad is None
    moved = (fast.weight - initial).detach().double()
    assert moved.abs().max() > 0
    assert_close_rel(moved, (slow.weight - initial).detach().double(), 1e-4)
    return "the fused update matches torch.optim.SGD over 3 steps (momentum, Nesterov, decay)"


def check_deterministic(sizes: Sizes, device: torch.device) -> str:
    fast, _ = heads(sizes, device)
    embeddings, labels = batch(sizes, device, seed=5)
    torch.use_deterministic_algorithms(True)
    try:
        first, second = step(fast, embeddings, labels), step(fast, embeddings, labels)
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    return "deterministic mode: two backwards equal bit for bit"


def check_no_host_sync(sizes: Sizes, device: torch.device) -> str:
    said = []
    for fused_update in (False, True):
        fast, _ = heads(sizes, device)
        optimizer = torch.optim.SGD(fast.parameters(), lr=0.1, momentum=0.9, fused=True)
        if fused_update:  # the target rows' share summed on the device, the gate read there
            fast.attach_fused_update(optimizer)
        embeddings, labels = batch(sizes, device, seed=6)

        def train_step(fast=fast, optimizer=optimizer, embeddings=embeddings, labels=labels):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fast(embeddings, labels)
            fast.gate_update(torch.isfinite(loss))
            loss.backward()
            optimizer.step()

        for _ in range(2):  # compiles, makes the optimizer's state
            train_step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                train_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        said.append("with the fused update" if fused_update else "plain")
    return f"steady-state triton steps make no host synchronisation ({', '.join(said)})"


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def check_auto(sizes: Sizes, device: torch.device) -> str:
    """At the default run's head shapes (N 128, D 128, 1,000 classes, fp32)."""
    lines = Lines()
    logging.getLogger(head_module.__name__).addHandler(lines)
    logging.getLogger(head_module.__name__).setLevel(logging.INFO)
    embeddings, labels = make_batch(1000, 128, 128, seed=7, dtype=torch.float32)
    embeddings, labels = embeddings.to(device), labels.to(device)
    with tempfile.TemporaryDirectory() as folder:
        first = ShardedMarginSoftmax(1000, 128, ArcFace(), tuning_cache=folder).to(device)
        reference = ShardedMarginSoftmax(1000, 128, ArcFace(), kernel="torch").to(device)
        reference.load_state_dict(first.state_dict())
        got, want = step(first, embeddings, labels), step(reference, embeddings, labels)
        for a, b in zip(got, want, strict=True):
            assert_close_rel(a, b, 1e-4)
        chosen = [line for line in lines.lines if line.startswith("head.kernel=auto: ")]
        assert len(chosen) == 1 and "measured" in chosen[0], lines.lines
        assert TuningCache(folder).entries("kernel"), "nothing cached"
        second = ShardedMarginSoftmax(1000, 128, ArcFace(), tuning_cache=folder).to(device)
        step(second, embeddings, labels)
        assert f"from {Path(folder) / 'head-kernel.json'}" in lines.lines[-1], lines.lines[-1]
    return chosen[0]


def check_tuned_tiles(sizes: Sizes, device: torch.device) -> str:
    """A shape above MIN_TUNED_WORK (N 512, D 512, 32,768 classes, bf16 under autocast)."""
    tile_tuning = importlib.import_module("recognition.heads.tuning.tiles")
    tile_tuning.MAX_CANDIDATES = 2  # the table's tiles and one other
    big = Sizes(device)
    big.rows, big.classes = 512, 32768
    assert big.rows * big.classes * big.dim >= tile_tuning.MIN_TUNED_WORK
    with tempfile.TemporaryDirectory() as folder:
        fast, slow = heads(big, device, tuning_cache=folder)
        embeddings, labels = batch(big, device, seed=8)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got, want = step(fast, embeddings, labels), step(slow, embeddings, labels)
        entries = TuningCache(folder).entries("tiles")
        # With the fused update the row epilogue is timed too, and its tiles step the rows.
        fused, _ = heads(big, device, tuning_cache=folder)
        optimizer = torch.optim.SGD(fused.parameters(), lr=0.1, momentum=0.9)
        fused.attach_fused_update(optimizer)
        initial = fused.weight.detach().clone()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            fused(embeddings, labels).backward()
        optimizer.step()
        with_update = TuningCache(folder).entries("tiles")
    for a, b in zip(got, want, strict=True):
        assert_close_rel(a, b, 2e-2)
    assert [e["key"]["kernel"] for e in entries] == ["forward_keep"]  # chunk size None
    assert sorted(e["key"]["kernel"] for e in with_update) == ["finish", "forward_keep"]
    assert torch.isfinite(fused.weight).all() and not torch.equal(fused.weight, initial)
    kernels = tile_tuning._kernels()
    said = ", ".join(
        f"{e['key']['kernel']} " + tile_tuning.describe(
            (kernels.FinishTiles if e["key"]["kernel"] == "finish" else kernels.KernelTiles)(
                **e["tiles"]
            )
        )
        for e in with_update
    )  # fmt: skip
    return f"tuned tiles match the torch path: {said}"


def small_chunks() -> None:
    """The forward and the backward in chunks of one class tile (128 classes), so that the
    checks cross chunks."""
    from recognition.heads.kernels import forward, gemm_backward

    gemm_backward.CHUNK_LOGITS = 1
    forward.CHUNK_ROW_VALUES = 1


CHECKS = [check_fp32, check_bf16, check_partial_fc, check_fused_update, check_deterministic]
CUDA_CHECKS = [check_no_host_sync, check_auto, check_tuned_tiles]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if (device.type == "cpu") != interpreting:
        parser.error("--device cpu runs under TRITON_INTERPRET=1, cuda without it")
    sizes = Sizes(device)
    torch.manual_seed(0)
    small_chunks()
    for check in CHECKS:
        print(f"{check.__name__}: {check(sizes, device)}", flush=True)
    for check in CUDA_CHECKS if device.type == "cuda" else []:
        print(f"{check.__name__}: {check(sizes, device)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
