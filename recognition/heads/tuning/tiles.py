"""The Triton head kernels' tiles, chosen by timing among those that fit.

`margin_softmax_triton.gpu_tiles` holds, per operand kind, the forward's tiles that ptxas
showed to fit an H100 (sm_90) without spilling registers (`python -m
benchmarks.head_kernel_resources`): they bound what fits, not what is fastest. On a GPU the
forward kernel the run uses (whose tiles the backward's gradient-of-logits kernel runs on
too; or the forward that keeps its logits, `forward_keep`) is timed here at the run's
shapes with each of its candidates - the table's tiles and, for the forward on half
operands (keeping its logits or not: on sm_90 the kept tile leaves through shared memory,
at the same registers), larger tiles ptxas showed to fit on rounded rows
(`ROUNDED_FORWARD`), else their
neighbours (one more pipeline stage, half the class or row block, more warps, a wider step
over D, ...) whose register footprint (`footprint`: the fp32 values per thread of the tiles
a program keeps live) is no larger than the table's - and the fastest is kept: in memory
for the process, and in the tuning cache (`tuning/measure.py`, file `head-tiles.json`) for
later runs, with every candidate's time. With the fused update the backward's row epilogue
(`finish`: the values a program holds and its warps) is timed likewise on
`FINISH_CANDIDATES`, stepping scratch rows and momentum as the update does. A candidate that does
not launch (more shared memory than the GPU offers: Triton raises OutOfResources) or fails
otherwise is dropped; the table's tiles stay when no candidate runs.

The timing runs on scratch tensors of the run's N, D and dtypes with at most TUNE_CLASSES
classes, enough programs to fill the GPU many times over, so that the weight is never
touched: at most MAX_CANDIDATES compilations, once per device, shape and Triton version.

Not tuned: on the CPU (the interpreter runs its own large tiles, and timing it means
nothing), and problems under MIN_TUNED_WORK (N x classes x D), where a step takes
microseconds whatever the tiles.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from recognition.heads.tuning import measure

logger = logging.getLogger(__name__)

# The kernels whose tiles are tuned: the forward, and the forward keeping its logits (a run
# uses one of the two and tunes that one), and with the fused update the backward's row
# epilogue that applies it (`finish`).
KERNEL_NAMES = ("forward", "forward_keep", "finish")
MAX_CANDIDATES = 6  # the table's tiles included
TUNE_CLASSES = 1 << 17  # scratch classes (fewer when the run has fewer)
MIN_TUNED_WORK = 1 << 30  # N x classes x D below which the table's tiles are used untimed
SCALE = 64.0  # the logit scale s of the scratch problem

# Tiles chosen in this process, by cache key (a kernel's), and whole TileConfigs by launch
# (what a forward asks for, found without building the keys): no disk after the first.
_TUNED: dict[str, object] = {}
_CONFIGS: dict[tuple, object] = {}


def _kernels() -> ModuleType:
    return importlib.import_module("recognition.heads.kernels.margin_softmax_triton")


@dataclass(frozen=True)
class TuneShape:
    """What the tiles are tuned for: N rows of the global batch, embedding size D, classes
    taking part on this rank, the weight and matmul dtypes, whether a partial-FC row index
    is used, whether the forward keeps its logits for the backward."""

    num_rows: int
    dim: int
    num_classes: int
    weight_dtype: torch.dtype
    matmul_dtype: torch.dtype
    has_index: bool = False
    keeps_logits: bool = False
    fused_update: bool = False

    @property
    def kernel(self) -> str:
        """The forward kernel whose tiles a launch of this shape uses."""
        return "forward_keep" if self.keeps_logits else "forward"

    @property
    def kernels(self) -> list[str]:
        """The kernels tuned for this shape: its forward, and with the fused update the row
        epilogue (a fifth of the step at 1M classes on an H200: the rows and their momentum
        read and written in fp32; without it the epilogue only writes a gradient)."""
        return [self.kernel, "finish"] if self.fused_update else [self.kernel]


def describe(tiles) -> str:
    """'128x128x32 w8 s3': classes x rows x D step, warps, stages; an epilogue's '8192
    values w8'."""
    if isinstance(tiles, _kernels().FinishTiles):
        return f"{tiles.values} values w{tiles.num_warps}"
    return f"{tiles.block_c}x{tiles.block_n}x{tiles.block_d} w{tiles.num_warps} s{tiles.num_stages}"


def footprint(d_pad: int, tiles) -> float:
    """fp32 values per thread of the tiles one program of the forward keeps live: the logits
    tile (rows x classes) and the operand tiles of its D loop. A proxy for registers: tiles
    with no larger a footprint than tiles that fit, fit."""
    c, n, step = tiles.block_c, tiles.block_n, min(tiles.block_d, d_pad)
    return (n * c + (n + c) * step) / (32 * tiles.num_warps)


def candidates(d_pad: int, table, limit: int | None = None) -> list:
    """The table's tiles first, then the neighbours that fit (valid for the compiler, a D
    step within D, a footprint no larger than the table's), fewest changes first, at most
    `limit` (default MAX_CANDIDATES) in all."""
    kernels = _kernels()
    limit = MAX_CANDIDATES if limit is None else limit
    bound = footprint(d_pad, table)
    options = []
    # Each axis: the table's value first, then the changes in the order they are tried.
    for block_c in (table.block_c, table.block_c // 2, table.block_c * 2):
        for block_n in (table.block_n, table.block_n // 2, table.block_n * 2):
            for block_d in (table.block_d, table.block_d * 2):
                for num_warps in (table.num_warps, table.num_warps * 2):
                    for num_stages in (table.num_stages, table.num_stages + 1):
                        values = (block_c, block_n, block_d, num_warps, num_stages)
                        options.append(kernels.KernelTiles(*values))
    order = sorted(range(len(options)), key=lambda i: (_changes(options[i], table), i))
    chosen = []
    for index in order:
        tiles = options[index]
        try:
            tiles.check("candidate")
        except ValueError:
            continue
        if tiles.block_d > max(d_pad, 16) or footprint(d_pad, tiles) > bound:
            continue
        if tiles not in chosen:
            chosen.append(tiles)
        if len(chosen) == limit:
            break
    return chosen


# The forward's tiles on class rows rounded to bf16 / fp16 beforehand (the GEMM backward's
# forward and its gradient-of-logits kernel): larger than the footprint rule allows, which was
# drawn for rows rounded in the kernel, and all without spills on sm_90 (ptxas through
# benchmarks/head_kernel_resources.py, D 512, Triton 3.8: 98,304 to 147,456 bytes of shared
# memory, 173 to 254 registers); 128x256x64 spilled and is not here.
ROUNDED_FORWARD = ((128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (256, 128, 64, 8, 3),
                   (128, 256, 32, 8, 3), (128, 128, 128, 8, 2))  # fmt: skip


def rounded_forward_candidates(table_tiles, matmul_dtype: torch.dtype, d_pad: int) -> list:
    """The table's forward tiles, then ROUNDED_FORWARD's with a D step within D, for half
    operands (MAX_CANDIDATES in all); for fp32 operands (nothing rounded) the footprint
    rule's `candidates`."""
    kernels = _kernels()
    if matmul_dtype not in (torch.bfloat16, torch.float16):
        return candidates(d_pad, table_tiles)
    options = [table_tiles] + [
        kernels.KernelTiles(*values) for values in ROUNDED_FORWARD if values[2] <= d_pad
    ]
    return list(dict.fromkeys(options))[:MAX_CANDIDATES]


# The row epilogue's candidates after the table's (values, warps): at most 32 values per
# thread of each live tile, as the table's (ptxas, sm_90, D 512: no spill), from 2 to 32 class
# rows a program of D 512 - fewer warps or smaller programs leave more of them resident per
# SM, larger ones fewer programs.
FINISH_CANDIDATES = ((4096, 4), (4096, 8), (2048, 4), (2048, 2), (1024, 2))


def finish_candidates(table_tiles) -> list:
    """The table's epilogue tiles, then FINISH_CANDIDATES (MAX_CANDIDATES in all)."""
    kernels = _kernels()
    options = [table_tiles] + [kernels.FinishTiles(*values) for values in FINISH_CANDIDATES]
    return list(dict.fromkeys(options))[:MAX_CANDIDATES]


def _changes(tiles, table) -> int:
    return sum(getattr(tiles, f) != getattr(table, f) for f in asdict(table))


def operand_kind(device: torch.device, matmul_dtype: torch.dtype) -> str:
    """The matmul operands as the kernels take them: bf16, fp16, tf32 or fp32."""
    if matmul_dtype != torch.float32:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(matmul_dtype, str(matmul_dtype))
    return _kernels().input_precision(matmul_dtype, device).replace("ieee", "fp32")


def should_tune(device: torch.device, shape: TuneShape) -> bool:
    """Tiles are timed on a CUDA device with compiled kernels, for problems large enough."""
    work = shape.num_rows * shape.num_classes * shape.dim
    return device.type == "cuda" and not _kernels().INTERPRET and work >= MIN_TUNED_WORK


def tiles_for(
    device: torch.device,
    shape: TuneShape,
    cache: measure.TuningCache | None,
    timer: Callable[[Callable[[], object]], float] | None = None,
):
    """The TileConfig for a launch of `shape` on `device`: the table's (`default_tiles`)
    where nothing is tuned, else each kernel's tiles from this process's memory, the
    `cache`, or a timing of its candidates (`timer(run)` -> seconds; default: the median of
    a few runs after a warm-up that compiles)."""
    kernels = _kernels()
    table = kernels.default_tiles(device, shape.dim, shape.matmul_dtype)
    if not should_tune(device, shape):
        return table
    launch = (device, shape, torch.are_deterministic_algorithms_enabled(), table)
    if launch in _CONFIGS:
        return _CONFIGS[launch]
    timer = timer or (lambda run: measure.time_steps(run, device, repeats=5))
    chosen, problem = {}, None
    for name in shape.kernels:
        key = tile_key(name, device, shape)
        text = measure.key_text(key)
        tiles = _TUNED.get(text)
        if tiles is None:
            tiles = _cached_tiles(cache, key, name)
        if tiles is None:
            # Outside the caller's autocast and autograd: the scratch problem is its own.
            with torch.autocast(device.type, enabled=False), torch.no_grad():
                problem = problem or ScratchProblem(device, shape)
                tiles, timings = tune_kernel(name, problem, table, timer)
            if cache is not None and any(t["ms"] is not None for t in timings):
                cache.put("tiles", key, {"tiles": asdict(tiles), "timings": timings})
            _log_tuned(name, shape, device, tiles, getattr(table, name), timings)
        _TUNED[text] = tiles
        chosen[name] = tiles
    _CONFIGS[launch] = dataclasses.replace(table, **chosen)
    return _CONFIGS[launch]


def tile_key(kernel: str, device: torch.device, shape: TuneShape) -> dict:
    """What one kernel's tiles are cached under: device, versions and the shapes that
    kernel's time depends on (the epilogue's: whether it keeps the rows' rounded copy)."""
    key = {
        "kernel": kernel,
        "device": measure.device_name(device),
        **measure.software_versions(),
        "rows": shape.num_rows,
        "dim": shape.dim,
        "classes": min(shape.num_classes, TUNE_CLASSES),
        "weight": str(shape.weight_dtype).removeprefix("torch."),
        "operands": operand_kind(device, shape.matmul_dtype),
        "row_index": shape.has_index,
        "class_rows": "rounded",
    }
    if kernel == "finish":
        key["keeps_rows"] = shape.keeps_logits
    return key


def _cached_tiles(cache: measure.TuningCache | None, key: dict, kernel: str):
    entry = cache.get("tiles", key) if cache is not None else None
    if entry is None:
        return None
    kernels = _kernels()
    kind = kernels.FinishTiles if kernel == "finish" else kernels.KernelTiles
    try:
        tiles = kind(**entry["tiles"])
        tiles.check("cached tiles")
    except (KeyError, TypeError, ValueError):
        return None
    return tiles


def tune_kernel(
    name: str, problem: ScratchProblem, table, timer: Callable, options: list | None = None
) -> tuple[object, list[dict]]:
    """Time kernel `name` with each candidate (`options`, default
    `rounded_forward_candidates`; for the forward keeping its logits on a GPU that stores
    them through registers (its table's tiles are not the forward's: before sm_90), the
    footprint rule's `candidates`, since larger tiles spill there; for the row epilogue
    `finish_candidates`). Returns the fastest tiles (the table's when none ran) and every
    candidate's {"tiles", "ms", "error"}."""
    kernels = _kernels()
    table_tiles = getattr(table, name)
    d_pad = kernels.padded_dim(problem.shape.dim)
    if options is None and name == "finish":
        options = finish_candidates(table_tiles)
    if options is None and name == "forward_keep" and table.forward_keep != table.forward:
        options = candidates(d_pad, table_tiles)
    if options is None:
        options = rounded_forward_candidates(table_tiles, problem.shape.matmul_dtype, d_pad)
    timings, best, best_s = [], table_tiles, None
    for tiles in options:
        config = dataclasses.replace(table, **{name: tiles})
        try:
            seconds = float(timer(lambda config=config: problem.run(name, config)))
            error = None
        except Exception as exc:  # OutOfResources, a compiler error: the candidate is out
            seconds, error = None, f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        ms = None if seconds is None else seconds * 1e3
        timings.append({"tiles": asdict(tiles), "ms": ms, "error": error})
        if seconds is not None and (best_s is None or seconds < best_s):
            best, best_s = tiles, seconds
    return best, timings


def _log_tuned(name, shape, device, tiles, table_tiles, timings) -> None:
    by_tiles = {tuple(t["tiles"].values()): t["ms"] for t in timings}
    best_ms = by_tiles.get(tuple(asdict(tiles).values()))
    table_ms = by_tiles.get(tuple(asdict(table_tiles).values()))
    failed = sum(t["ms"] is None for t in timings)
    logger.info(
        "head tiles: %s at N %d, D %d, %s operands on %s: %s (%s ms; the table's %s: %s ms; "
        "%d candidates timed, %d did not run)",
        name, shape.num_rows, shape.dim, operand_kind(device, shape.matmul_dtype),
        measure.device_name(device), describe(tiles), _fmt_ms(best_ms), describe(table_tiles),
        _fmt_ms(table_ms), len(timings), failed,
    )  # fmt: skip


def _fmt_ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.3f}"


class ScratchProblem:
    """Tensors of `shape` (at most TUNE_CLASSES classes) on `device` to time the kernels on:
    random unit embeddings, N(0, 0.01) class rows, half the rows owning a target."""

    def __init__(self, device: torch.device, shape: TuneShape) -> None:
        kernels = _kernels()
        self.shape = shape
        num_classes = min(shape.num_classes, TUNE_CLASSES)
        num_weight_rows = 2 * num_classes if shape.has_index else num_classes
        # The class rows drawn where they live (a GPU draws 10^8 numbers at once); the
        # small tensors on the CPU.
        on_device = torch.Generator(device=device).manual_seed(0)
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(num_weight_rows, shape.dim, generator=on_device, device=device)
        self.weight = (weight * 0.01).to(shape.weight_dtype)
        self.row_index = None
        if shape.has_index:  # a sorted sample of half the rows, as partial FC takes them
            sample = torch.randperm(num_weight_rows, generator=on_device, device=device)
            self.row_index = sample[:num_classes].sort().values
        embeddings = torch.randn(shape.num_rows, shape.dim, generator=generator)
        self.embeddings = F.normalize(embeddings, dim=1).to(device)
        target = torch.randint(0, num_classes, (shape.num_rows,), generator=generator)
        target[shape.num_rows // 2 :] = -1  # rows whose label another rank owns
        self.target_pos = target.to(device)
        eps = max(1e-12, torch.finfo(shape.weight_dtype).tiny)
        self.eps = eps
        self.inv_norm = kernels.inverse_norms(self.weight, self.row_index, eps)
        self._update: tuple | None = None  # the epilogue's inputs, made at its first run

    def _update_inputs(self) -> tuple:
        """What the row epilogue takes as a training step's fused update hands it (SGD with
        momentum, gated, the target rows' share, the rows' inverse norms and - when the
        forward keeps its logits - their rounded copy kept current), and a U of every
        scratch class in the row product's dtype. Its runs step the scratch rows."""
        kernels = _kernels()
        host = importlib.import_module("recognition.heads.kernels.host")
        shape, device = self.shape, self.weight.device
        num_rows, dim = self.embeddings.shape
        buffer = torch.zeros(self.weight.shape, dtype=torch.float32, device=device)
        step_ok = torch.ones((), dtype=torch.bool, device=device)
        sgd = kernels.SGDUpdate(0.01, 0.9, 5e-4, False, buffer, step_ok)
        all_inv_norm = kernels.inverse_norms(self.weight, None, self.eps)
        rounded = None
        if shape.keeps_logits and shape.weight_dtype != shape.matmul_dtype:
            rounded = self.weight.to(shape.matmul_dtype)
        zeros = torch.zeros(num_rows, dtype=torch.float32, device=device)
        inputs = host.BackwardInputs(
            self.embeddings, self.weight, self.row_index, self.inv_norm, self.target_pos,
            row_max=zeros, grad_sumexp=zeros, scale=SCALE, matmul_dtype=shape.matmul_dtype,
            target_grad=torch.zeros(num_rows, dim, dtype=torch.float32, device=device),
            sgd=sgd, norm_limit=1.0 / self.eps, kept_rows=(rounded, all_inv_norm),
        )  # fmt: skip
        u_dtype = torch.bfloat16 if shape.matmul_dtype == torch.bfloat16 else torch.float32
        u = torch.randn(self.inv_norm.shape[0], dim, device=device).mul_(1e-3).to(u_dtype)
        return inputs, u

    def run(self, name: str, tiles) -> None:
        """One launch of kernel `name` (the forward, keeping its logits or not, or the row
        epilogue) with `tiles` (a TileConfig)."""
        if name not in KERNEL_NAMES:
            raise ValueError(f"ScratchProblem.run: unknown kernel {name!r}")
        if name == "finish":
            if self._update is None:
                self._update = self._update_inputs()
            inputs, u = self._update
            gemm_backward = importlib.import_module("recognition.heads.kernels.gemm_backward")
            gemm_backward._finish(inputs, u, None, 0, inputs.num_classes, tiles.finish)
            return
        common = (self.embeddings, self.weight, self.row_index, self.inv_norm, self.target_pos)
        keep = name == "forward_keep"
        _kernels().class_stats(*common, SCALE, self.shape.matmul_dtype, tiles, keep=keep)
