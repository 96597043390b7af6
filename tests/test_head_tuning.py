"""What the head decides by timing on a GPU (heads/tuning/: kernel.py, tiles.py, measure.py),
with the timings stubbed: head.kernel=auto's choice and its log line, the cache (hit, miss
on another device or shape, a corrupt or unwritable file), and the Triton tiles' candidates
(what fits), their timing and its cache. The kernels run in Triton's interpreter on CPU
tensors (conftest.py sets TRITON_INTERPRET=1), where nothing is timed for real."""

from __future__ import annotations

import importlib
import json
import logging
import math

import pytest
import torch
from helpers import RecordedKernel
from test_head import assert_close_rel, make_batch, run_head

from recognition.heads import ShardedMarginSoftmax, build_head, triton_stats
from recognition.heads import margin_softmax as head_module
from recognition.heads.margins import CosFace
from recognition.heads.tuning import kernel as kernel_choice
from recognition.heads.tuning import measure as tuning

KEY = {"device": "NVIDIA H100 80GB HBM3", "rows": 1024, "dim": 512, "classes": 1_000_000}


def fixed_times(torch_s: float, triton_s: float):
    calls = []

    def measure(path: str) -> float:
        calls.append(path)
        return {"torch": torch_s, "triton": triton_s}[path]

    return measure, calls


# ---- head.kernel=auto: the choice ----------------------------------------------------------


@pytest.mark.parametrize(
    ("torch_s", "triton_s", "expected"),
    [(0.020, 0.010, "triton"), (0.010, 0.020, "torch"), (0.010, 0.010, "torch")],
)
def test_auto_takes_the_strictly_faster_path(torch_s, triton_s, expected):
    measure, calls = fixed_times(torch_s, triton_s)
    choice = kernel_choice.choose_kernel(KEY, measure, cache=None)
    assert choice.kernel == expected and calls == ["torch", "triton"]
    assert choice.seconds == {"torch": torch_s, "triton": triton_s}
    assert choice.source == "measured" and not choice.errors


def test_a_failing_path_loses_and_says_why():
    def measure(path):
        if path == "torch":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB\nmore")
        return 0.5

    choice = kernel_choice.choose_kernel(KEY, measure, cache=None)
    assert choice.kernel == "triton" and math.isinf(choice.seconds["torch"])
    assert choice.errors == {
        "torch": "OutOfMemoryError: CUDA out of memory. Tried to allocate 40.00 GiB"
    }
    assert "the torch path failed: OutOfMemoryError" in choice.describe()

    def nothing_runs(path):
        raise RuntimeError(f"{path} broken")

    assert kernel_choice.choose_kernel(KEY, nothing_runs, cache=None).kernel == "torch"


def test_every_rank_decides_from_the_slowest_rank():
    # Here triton is faster, but another rank's triton step is the slowest of all.
    measure, _ = fixed_times(0.010, 0.008)
    other_rank = [0.011, 0.015]
    choice = kernel_choice.choose_kernel(
        KEY,
        measure,
        cache=None,
        agree=lambda s: [max(a, b) for a, b in zip(s, other_rank, strict=True)],
    )
    assert choice.kernel == "torch" and choice.seconds == {"torch": 0.011, "triton": 0.015}


# ---- the cache ------------------------------------------------------------------------------


def test_cache_hit_and_misses_on_another_device_or_shape(tmp_path):
    cache = tuning.TuningCache(tmp_path / "cache")
    measure, calls = fixed_times(0.020, 0.010)
    assert kernel_choice.choose_kernel(KEY, measure, cache).source == "measured"
    stored = json.loads(cache.path("kernel").read_text())
    assert stored["version"] == tuning.CACHE_VERSION
    [entry] = stored["entries"].values()
    assert entry["key"] == KEY and entry["seconds"] == {"torch": 0.020, "triton": 0.010}

    # A new cache object (a new run) on the same folder: read, not measured.
    again, calls_again = fixed_times(1.0, 2.0)
    choice = kernel_choice.choose_kernel(KEY, again, tuning.TuningCache(tmp_path / "cache"))
    assert calls_again == [] and choice.kernel == "triton"
    assert choice.source == str(cache.path("kernel"))

    for changed in ({"device": "NVIDIA A100-SXM4-80GB"}, {"classes": 999_999}, {"rows": 512}):
        measure, calls = fixed_times(0.010, 0.020)
        choice = kernel_choice.choose_kernel({**KEY, **changed}, measure, cache)
        assert calls == ["torch", "triton"] and choice.kernel == "torch", changed
    assert len(json.loads(cache.path("kernel").read_text())["entries"]) == 4


def test_a_failed_measurement_is_not_cached(tmp_path):
    cache = tuning.TuningCache(tmp_path)

    def measure(path):
        if path == "triton":
            raise RuntimeError("OutOfResources")
        return 0.01

    kernel_choice.choose_kernel(KEY, measure, cache)
    assert not cache.path("kernel").exists()


@pytest.mark.parametrize(
    "content",
    ["{not json", '["a list"]', '{"version": 99, "entries": {}}', '{"version": 1, "entries": 3}'],
)
def test_a_corrupt_cache_file_is_ignored_with_a_warning_and_rewritten(tmp_path, caplog, content):
    cache = tuning.TuningCache(tmp_path)
    cache.path("kernel").write_text(content)
    measure, calls = fixed_times(0.020, 0.010)
    with caplog.at_level(logging.WARNING, logger=tuning.__name__):
        choice = kernel_choice.choose_kernel(KEY, measure, cache)
    assert choice.kernel == "triton" and calls == ["torch", "triton"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(cache.path("kernel")) in warnings[0]
    assert json.loads(cache.path("kernel").read_text())["version"] == tuning.CACHE_VERSION


def test_an_unwritable_cache_folder_costs_a_warning_not_the_run(tmp_path, caplog):
    (tmp_path / "a-file").write_text("")
    folder = tmp_path / "a-file" / "cache"  # no folder can be made there, even by root
    measure, _ = fixed_times(0.020, 0.010)
    with caplog.at_level(logging.WARNING, logger=tuning.__name__):
        choice = kernel_choice.choose_kernel(KEY, measure, tuning.TuningCache(folder))
    assert choice.kernel == "triton"
    assert any("cannot write the tuning cache" in r.getMessage() for r in caplog.records)


def test_the_cache_folder_defaults_to_xdg_and_is_a_config_key(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tuning.TuningCache().folder == tmp_path / "xdg" / "recognition"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert tuning.default_cache_dir() == tmp_path.home() / ".cache" / "recognition"
    from recognition.config import config_from_dict

    cfg = config_from_dict({"head": {"tuning_cache": str(tmp_path / "mine")}})
    head = build_head(cfg.head, 10, 8, seed=0)
    assert head.tuning_cache.folder == tmp_path / "mine"


# ---- the head with auto: measured, logged, cached -----------------------------------------


class FakeTimer:
    """Stands in for tuning.time_steps: runs each step once (so both paths really run, in
    the interpreter) and answers the given seconds, torch's first then triton's."""

    def __init__(self, torch_s: float, triton_s: float) -> None:
        self.answers = [torch_s, triton_s]
        self.calls = 0

    def __call__(self, step, device, repeats=3, warmup=1):
        step()
        self.calls += 1
        return self.answers[self.calls - 1]


@pytest.mark.parametrize(("torch_s", "triton_s"), [(0.020, 0.010), (0.010, 0.020)])
def test_auto_on_a_gpu_measures_once_logs_and_caches(
    tmp_path, monkeypatch, caplog, torch_s, triton_s
):
    # The CPU stands in for a CUDA device: auto measures here as it would there.
    monkeypatch.setattr(kernel_choice, "cannot_measure", lambda device, dtype: None)
    timer = FakeTimer(torch_s, triton_s)
    monkeypatch.setattr(tuning, "time_steps", timer)
    applied = []
    real_apply = triton_stats.TritonClassStats.apply
    monkeypatch.setattr(
        triton_stats.TritonClassStats, "apply", lambda *a: applied.append(1) or real_apply(*a)
    )
    torch.manual_seed(0)
    head = ShardedMarginSoftmax(40, 24, CosFace(s=16.0), tuning_cache=tmp_path)
    reference = ShardedMarginSoftmax(40, 24, CosFace(s=16.0), kernel="torch")
    reference.load_state_dict(head.state_dict())
    initial = head.weight.detach().clone()
    embeddings, labels = make_batch(40, 24, 8, seed=1, dtype=torch.float32)
    with caplog.at_level(logging.INFO, logger=head_module.__name__):
        loss, grad_e, grad_w = run_head(head, embeddings, labels)
        run_head(head, embeddings, labels)  # decided: not measured again
    triton_wins = triton_s < torch_s
    assert timer.calls == 2
    # The measurement ran the triton path once; the two forwards add theirs when it won.
    assert len(applied) == 1 + (2 if triton_wins else 0)
    lines = [r.getMessage() for r in caplog.records if "head.kernel=auto" in r.getMessage()]
    assert len(lines) == 1
    assert lines[0].startswith(f"head.kernel=auto: {'triton' if triton_wins else 'torch'}, ")
    assert "10.00 ms" in lines[0] and "20.00 ms" in lines[0] and "measured" in lines[0]
    # Measuring neither moved the weight nor left a gradient behind: the step is the torch one's.
    torch.testing.assert_close(head.weight.detach(), initial, rtol=0, atol=0)
    ref_loss, ref_grad_e, ref_grad_w = run_head(reference, embeddings, labels)
    assert_close_rel(loss, ref_loss.double(), 1e-6)
    assert_close_rel(grad_e, ref_grad_e.double(), 1e-5)
    assert_close_rel(grad_w, ref_grad_w.double(), 1e-5)

    # A new run at the same shapes reads the times from the cache folder.
    caplog.clear()
    timer.calls = 0
    fresh = ShardedMarginSoftmax(40, 24, CosFace(s=16.0), tuning_cache=tmp_path)
    with caplog.at_level(logging.INFO, logger=head_module.__name__):
        run_head(fresh, embeddings, labels)
    assert timer.calls == 0
    assert any(f"from {tmp_path / 'head-kernel.json'}" in r.getMessage() for r in caplog.records)


def test_auto_does_not_measure_on_the_cpu(monkeypatch, caplog):
    def never(*args, **kwargs):
        raise AssertionError("measured on the CPU")

    monkeypatch.setattr(tuning, "time_steps", never)
    head = ShardedMarginSoftmax(20, 24, CosFace())
    embeddings, labels = make_batch(20, 24, 4, seed=1, dtype=torch.float32)
    with caplog.at_level(logging.INFO, logger=head_module.__name__):
        head(embeddings, labels)
    [line] = [r.getMessage() for r in caplog.records if "head.kernel=auto" in r.getMessage()]
    assert line.startswith("head.kernel=auto: torch (the Triton kernels run compiled on CUDA")


# ---- the Triton tiles ------------------------------------------------------------------------


@pytest.fixture
def tiling(monkeypatch):
    """heads/tuning/tiles.py with an empty in-process memory."""
    tile_tuning = importlib.import_module("recognition.heads.tuning.tiles")
    monkeypatch.setattr(tile_tuning, "_TUNED", {})
    monkeypatch.setattr(tile_tuning, "_CONFIGS", {})
    return tile_tuning


def per_thread(c, n, d, warps):
    """The forward's footprint written out by hand: the logits tile and the D loop's
    operands, in fp32 values per thread."""
    return (n * c + (n + c) * d) / (32 * warps)


def test_candidates_fit_where_the_table_fits(tiling):
    kernels = triton_stats.triton_kernels()
    for d_pad in (128, 512, 1024):
        for operands in kernels.OPERAND_KINDS:
            base = kernels.gpu_tiles(d_pad, 132, operands).forward
            options = tiling.candidates(d_pad, base)
            assert options[0] == base and len(set(options)) == len(options)
            assert 2 <= len(options) <= tiling.MAX_CANDIDATES, (d_pad, operands)
            bound = per_thread(base.block_c, base.block_n, min(base.block_d, d_pad),
                               base.num_warps)  # fmt: skip
            for tiles in options:
                tiles.check("candidate")
                assert tiles.block_d <= d_pad
                value = per_thread(tiles.block_c, tiles.block_n, min(tiles.block_d, d_pad),
                                   tiles.num_warps)  # fmt: skip
                assert value <= bound and tiling.footprint(d_pad, tiles) == value


def small_shape(tiling, **changes):
    fields = {"num_rows": 16, "dim": 24, "num_classes": 40, "weight_dtype": torch.float32,
              "matmul_dtype": torch.float32, "has_index": True}  # fmt: skip
    return tiling.TuneShape(**{**fields, **changes})


def fake_tuning(tiling, monkeypatch, tiles: list) -> tuple[list, object]:
    """Tiling as on a GPU, with `tiles` as the forward's candidates and a timer under which
    the second candidate is the faster (nothing runs); returns (a list that grows by one per
    timing, the timer)."""
    monkeypatch.setattr(tiling, "should_tune", lambda device, shape: True)
    monkeypatch.setattr(tiling, "rounded_forward_candidates", lambda *args: tiles)
    monkeypatch.setattr(tiling, "candidates", lambda *args: tiles)
    times = []

    def timer(run):
        times.append(1)
        return 1e-3 if len(times) % 2 == 0 else 2e-3

    return times, timer


@pytest.mark.parametrize("kernel", ["forward", "forward_keep"])
def test_tuning_keeps_the_fastest_candidate_that_runs(tiling, kernel):
    kernels = triton_stats.triton_kernels()
    small = kernels.KernelTiles(16, 16, 16, 1, 1)
    wide = kernels.KernelTiles(32, 16, 32, 1, 1)
    table = kernels.TileConfig(small, target_programs=4)
    problem = tiling.ScratchProblem(torch.device("cpu"), small_shape(tiling))
    answers = iter([2e-3, 1e-3, None])

    def timer(run):
        run()  # the launch itself, interpreted
        seconds = next(answers)
        if seconds is None:
            raise RuntimeError("OutOfResources: out of resource: shared memory\nRequired: 1")
        return seconds

    failing = kernels.KernelTiles(16, 32, 16, 1, 1)
    best, timings = tiling.tune_kernel(kernel, problem, table, timer, [small, wide, failing])
    assert best == wide
    assert [t["ms"] for t in timings] == [2.0, 1.0, None]
    assert timings[2]["error"] == "RuntimeError: OutOfResources: out of resource: shared memory"


def test_the_row_epilogue_is_timed_on_its_candidates_and_the_fastest_kept(tiling, monkeypatch):
    # With the fused update the backward's row epilogue (its tiles: values a program holds,
    # warps) is timed too: each candidate launches the epilogue over the scratch classes with
    # its own classes per program and warps, as a fused update with momentum runs it (the
    # scratch rows and momentum move), and the fastest that runs is kept.
    kernels = triton_stats.triton_kernels()
    gemm_backward = importlib.import_module("recognition.heads.kernels.gemm_backward")
    table = kernels.TileConfig(kernels.KernelTiles(16, 16, 16, 1, 1), target_programs=4)
    options = tiling.finish_candidates(table.finish)
    assert options[0] == table.finish and len(set(options)) == len(options) > 2
    for tiles in options:
        tiles.check("candidate")
        assert tiles.values // (32 * tiles.num_warps) <= 32  # values per thread, as the table
    shape = small_shape(tiling, fused_update=True, keeps_logits=True, matmul_dtype=torch.bfloat16)
    assert shape.kernels == ["forward_keep", "finish"]
    problem = tiling.ScratchProblem(torch.device("cpu"), shape)
    launches = []
    recorded = RecordedKernel(
        gemm_backward._finish_kernel,
        lambda grid, kwargs: launches.append((grid[0], kwargs["BLOCK_C"], kwargs["num_warps"])),
    )
    monkeypatch.setattr(gemm_backward, "_finish_kernel", recorded)
    before = problem.weight.clone()
    small, large = kernels.FinishTiles(64, 1), kernels.FinishTiles(512, 2)
    answers = iter([2e-3, 1e-3])
    best, timings = tiling.tune_kernel(
        "finish", problem, table, lambda run: run() or next(answers), [small, large]
    )
    assert best == large and [t["ms"] for t in timings] == [2.0, 1.0]
    # 40 classes at D 24 (padded to 32): 2 and then 16 class rows a program.
    assert launches == [(20, 2, 1), (3, 16, 2)]
    assert not torch.equal(problem.weight, before)  # the update ran: the rows moved
    assert problem._update[0].sgd.momentum_buffer.abs().sum() > 0


def test_tiles_are_timed_once_then_cached_per_shape(tiling, tmp_path, monkeypatch, caplog):
    kernels = triton_stats.triton_kernels()
    tiles = [kernels.KernelTiles(16, 16, 16, 1, 1), kernels.KernelTiles(32, 16, 16, 1, 1)]
    table = kernels.TileConfig(tiles[0], target_programs=4)
    monkeypatch.setattr(kernels, "default_tiles", lambda device, dim, dtype: table)
    times, timer = fake_tuning(tiling, monkeypatch, tiles)

    cpu, cache = torch.device("cpu"), tuning.TuningCache(tmp_path)
    with caplog.at_level(logging.INFO, logger=tiling.__name__):
        config = tiling.tiles_for(cpu, small_shape(tiling), cache, timer)
    assert len(times) == 2
    assert config == kernels.TileConfig(tiles[1], 4, forward_keep=tiles[0])
    assert sum("head tiles: " in r.getMessage() for r in caplog.records) == 1
    entries = cache.entries("tiles")
    assert [e["key"]["kernel"] for e in entries] == ["forward"]
    assert all(e["tiles"] == tiles[1].__dict__ and len(e["timings"]) == 2 for e in entries)

    tiling.tiles_for(cpu, small_shape(tiling), cache, timer)  # this process remembers
    monkeypatch.setattr(tiling, "_TUNED", {})
    monkeypatch.setattr(tiling, "_CONFIGS", {})
    assert tiling.tiles_for(cpu, small_shape(tiling), tuning.TuningCache(tmp_path), timer) == config
    assert len(times) == 2  # a new process reads the cache

    # Another N, or the partial-FC index: timed again. The forward keeping its logits: its
    # own tiles, timed (the other kernel's stay the table's).
    tiling.tiles_for(cpu, small_shape(tiling, num_rows=32), cache, timer)
    assert len(times) == 4
    tiling.tiles_for(cpu, small_shape(tiling, has_index=False), cache, timer)
    assert len(times) == 6
    keeping = tiling.tiles_for(cpu, small_shape(tiling, keeps_logits=True), cache, timer)
    assert len(times) == 8
    assert keeping == kernels.TileConfig(tiles[0], 4, forward_keep=tiles[1])
    # With the fused update the row epilogue too (its own candidates), cached by its kernel.
    finishes = [kernels.FinishTiles(64, 1), kernels.FinishTiles(128, 1)]
    monkeypatch.setattr(tiling, "finish_candidates", lambda *args: finishes)
    fused = tiling.tiles_for(cpu, small_shape(tiling, fused_update=True), cache, timer)
    assert len(times) == 10  # the forward's as before (its key), the epilogue's timed
    assert fused == kernels.TileConfig(tiles[1], 4, forward_keep=tiles[0], finish=finishes[1])
    assert [e["key"]["kernel"] for e in cache.entries("tiles")].count("finish") == 1
    monkeypatch.setattr(tiling, "_TUNED", {})
    monkeypatch.setattr(tiling, "_CONFIGS", {})
    again = tiling.tiles_for(cpu, small_shape(tiling, fused_update=True), cache, timer)
    assert again == fused and len(times) == 10  # both read from the cache

    cache.path("tiles").write_text("{truncated")
    monkeypatch.setattr(tiling, "_TUNED", {})
    monkeypatch.setattr(tiling, "_CONFIGS", {})
    with caplog.at_level(logging.WARNING, logger=tuning.__name__):
        tiling.tiles_for(cpu, small_shape(tiling), tuning.TuningCache(tmp_path), timer)
    assert len(times) == 12
    assert any("ignoring the tuning cache" in r.getMessage() for r in caplog.records)


def test_nothing_is_tuned_on_the_cpu_or_for_small_problems(tiling):
    kernels = triton_stats.triton_kernels()

    def timer(run):
        raise AssertionError("timed")

    cpu = torch.device("cpu")
    assert tiling.tiles_for(cpu, small_shape(tiling), None, timer) == kernels.INTERPRETER_TILES
    big = small_shape(tiling, num_rows=1024, dim=512, num_classes=1_000_000)
    assert not tiling.should_tune(cpu, big)
    assert tiling.MIN_TUNED_WORK > 128 * 1000 * 128  # the default run's head: never tuned


def test_the_forward_tries_the_larger_tiles_ptxas_allowed(tiling):
    # Rows rounded beforehand leave shared memory and registers to larger tiles than the
    # footprint rule (drawn for rows rounded in the kernel) lets through: a K step of 64, a
    # tile of 256 classes. The table's tiles come first; fp32 operands keep the rule.
    kernels = triton_stats.triton_kernels()
    table = kernels.gpu_tiles(512, 132, "half").forward
    options = tiling.rounded_forward_candidates(table, torch.bfloat16, 512)
    assert options[0] == table and len(options) == tiling.MAX_CANDIDATES
    assert kernels.KernelTiles(128, 128, 64, 8, 3) in options
    assert kernels.KernelTiles(256, 128, 64, 8, 3) in options
    assert all(t.block_d <= 64 for t in tiling.rounded_forward_candidates(table, torch.float16, 64))
    assert tiling.rounded_forward_candidates(table, torch.float32, 512) == tiling.candidates(
        512, table
    )


def test_the_forward_keeping_its_logits_tries_the_forwards_tiles_where_tma_stores_them(tiling):
    # From sm_90 the kept tile leaves through shared memory (a tensor descriptor's TMA
    # store): the keeping forward fits the forward's tiles and tries its larger ones. Before
    # sm_90 the store takes registers: narrower tiles, and the footprint rule's neighbours.
    kernels = triton_stats.triton_kernels()
    hopper = kernels.gpu_tiles(512, 132, "half", tma=True)
    ampere = kernels.gpu_tiles(512, 108, "half", tma=False)
    assert hopper.forward_keep == hopper.forward == ampere.forward
    assert ampere.forward_keep.block_n < ampere.forward.block_n
    shape = small_shape(tiling, keeps_logits=True, matmul_dtype=torch.bfloat16)
    problem = tiling.ScratchProblem(torch.device("cpu"), shape)
    tried = []
    problem.run = lambda name, config: tried.append(config.forward_keep)  # nothing launched
    d_pad = kernels.padded_dim(shape.dim)
    for table, expected in (
        (hopper, tiling.rounded_forward_candidates(hopper.forward, torch.bfloat16, d_pad)),
        (ampere, tiling.candidates(d_pad, ampere.forward_keep)),
    ):
        tried.clear()
        tiling.tune_kernel("forward_keep", problem, table, lambda run: run() or 1e-3)
        assert tried == expected and len(tried) > 1
