"""Which implementation computes the head's local statistics (`head.kernel`), and the Triton
kernels' tiles.

"torch" is `local_stats.LocalClassStats`; "triton" the kernels of heads/kernels/ through
`triton_stats.TritonClassStats`, on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1;
float64 statistics fall back to torch with one log line. "auto" decides by measurement: at
its first forward on a CUDA device (kernels compiled, float32 statistics) it times a few
forward-and-backward steps of both paths on that forward's own tensors - N, D, the rank's
classes, the partial-FC sample, the matmul dtype, the chunk size - without touching the
weight, takes the maximum of each time over the ranks (so that every rank chooses alike)
and keeps the faster, logging one line with both times; the times are cached per device
name, versions and shapes (`measure.TuningCache`), so a later run at the same shapes starts
without measuring. Elsewhere (the CPU, the interpreter, float64) auto is torch, with one
log line. The Triton path's tiles are timed too (`tiles`).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.distributed import ProcessGroup

from recognition.heads.kept_rows import KeptRows
from recognition.heads.local_stats import BLOCK_SIZE, LocalClassStats
from recognition.heads.triton_stats import FusedSGD, TritonClassStats
from recognition.heads.tuning import measure as measuring
from recognition.heads.tuning.measure import TuningCache

KERNELS = ("auto", "triton", "torch")
PATHS = ("torch", "triton")  # the order in which choose_kernel measures them


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cannot_measure(device: torch.device, stats_dtype: torch.dtype) -> str | None:
    """Why head.kernel=auto takes torch without measuring here, or None: it measures on a
    CUDA device, with the kernels compiled, for float32 statistics."""
    if device.type != "cuda":
        return f"the Triton kernels run compiled on CUDA devices only, this forward is on {device}"
    if triton_interpreting():
        return "TRITON_INTERPRET is set: the Triton kernels would run interpreted"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if stats_dtype != torch.float32:
        return f"statistics in {stats_dtype}: the Triton kernels take float32"
    return None


@dataclass(frozen=True)
class StatsInputs:
    """One forward's inputs of the local statistics (local_stats.LocalClassStats's)."""

    norm_embeddings: Tensor  # (N, D), statistics dtype
    row_index: Tensor | None  # (K,) taking-part rows, or None for all
    target_row: Tensor  # (N,) row of the weight, -1 where another rank owns the label
    scale: float
    matmul_dtype: torch.dtype


@dataclass
class ShardShape:
    """What the choice and the tiles depend on besides a forward's tensors: the rank's shard
    (its weight, classes, D), the chunk size (None: keep the logits for backward), the ranks
    that must agree, and what the Triton path keeps of the rows between fused updates."""

    weight: Tensor
    num_local: int
    embedding_size: int
    chunk_size: int | None
    world_size: int
    group: ProcessGroup | None
    kept_rows: KeptRows | None = None


class KernelSelector:
    """head.kernel for one head: `uses_triton` answers per forward; "auto"'s measured answer
    is kept per (device type, statistics dtype). Choices go to `logger` (the head's), each
    notice once."""

    def __init__(self, kernel: str, cache: TuningCache, logger: logging.Logger) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"head.kernel: {kernel!r} is not one of {', '.join(KERNELS)}")
        if kernel == "triton" and importlib.util.find_spec("triton") is None:
            raise ValueError("head.kernel: triton is not installed (use auto or torch)")
        self.kernel, self.cache, self.logger = kernel, cache, logger
        self.auto: dict[tuple[str, torch.dtype], str] = {}
        self.logged: set[str] = set()  # the one-line notices already logged

    def log_once(self, message: str) -> None:
        if message not in self.logged:
            self.logged.add(message)
            self.logger.info(message)

    def uses_triton(
        self,
        device: torch.device,
        stats_dtype: torch.dtype,
        measure: Callable[[], Any],
        planning: bool = False,
    ) -> bool:
        """Whether this forward runs the Triton kernels. For kernel="auto" the answer of
        `measure()` (called once per device type and statistics dtype, on CUDA only) or
        torch; every choice not asked for is logged once. `planning`: on the run planner's
        fake tensors (standing for a GPU's), where the kernels' launches are left out."""
        if self.kernel == "torch":
            return False
        if self.kernel == "auto":
            return self._auto_uses_triton(device, stats_dtype, measure)
        if device.type != "cuda" and not triton_interpreting() and not planning:
            raise ValueError(
                f"head.kernel=triton: the kernels run on CUDA tensors, got {device.type} "
                "(or set TRITON_INTERPRET=1 to interpret them on the CPU)"
            )
        if stats_dtype != torch.float32:
            self.log_once(
                f"head.kernel=triton: statistics in {stats_dtype} are not supported by the "
                "kernel; using the torch path"
            )
            return False
        return True

    def local_stats(
        self,
        shard: ShardShape,
        inputs: StatsInputs,
        compute_dtype: torch.dtype,
        fused: FusedSGD | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(max, sum-exp, target cosine) over the shard's taking-part classes, by the path
        this forward takes (measuring both at auto's first forward on a GPU); `fused`: the
        fused update this training forward's backward applies, or None."""
        x = inputs
        device = x.norm_embeddings.device
        planning = is_fake(x.norm_embeddings)
        if self.uses_triton(device, compute_dtype, lambda: self.measure(shard, inputs), planning):
            if x.matmul_dtype == torch.float64:
                x = replace(x, matmul_dtype=torch.float32)
            return self._triton_stats(shard, x, fused)
        if fused is not None:
            raise RuntimeError(
                "head.fused_update: this forward cannot use the Triton kernel (see the log), "
                "so nothing would update the class rows"
            )
        return self._torch_stats(shard, x)

    @staticmethod
    def _torch_stats(shard: ShardShape, x: StatsInputs) -> tuple[Tensor, Tensor, Tensor]:
        keep_logits = shard.chunk_size is None
        return LocalClassStats.apply(
            x.norm_embeddings, shard.weight, x.row_index, x.target_row, x.scale,
            BLOCK_SIZE if keep_logits else shard.chunk_size, keep_logits, x.matmul_dtype,
        )  # fmt: skip

    def _triton_stats(
        self, shard: ShardShape, x: StatsInputs, fused: FusedSGD | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        tiles = self.triton_tiles(shard, x, fused_update=fused is not None)
        return TritonClassStats.apply(
            x.norm_embeddings, shard.weight, x.row_index, x.target_row, x.scale,
            x.matmul_dtype, fused, tiles, shard.chunk_size is None, shard.kept_rows,
        )  # fmt: skip

    def _auto_uses_triton(
        self, device: torch.device, stats_dtype: torch.dtype, measure: Callable[[], Any]
    ) -> bool:
        where = (device.type, stats_dtype)
        if where not in self.auto:
            why_not = cannot_measure(device, stats_dtype)
            if why_not is not None:
                self.auto[where] = "torch"
                self.log_once(f"head.kernel=auto: torch ({why_not})")
            else:
                self.auto[where] = measure().kernel
        return self.auto[where] == "triton"

    def measure(self, shard: ShardShape, inputs: StatsInputs) -> KernelChoice:
        """head.kernel=auto: time a few training steps of the local statistics (forward and
        backward, weight untouched) on this forward's tensors with either implementation, or
        read the times from the cache, agree with the other ranks and log the choice."""
        device = inputs.norm_embeddings.device
        num_rows = inputs.norm_embeddings.shape[0]
        row_index = inputs.row_index
        num_taking_part = shard.num_local if row_index is None else row_index.numel()
        key = {
            "device": measuring.device_name(device),
            **measuring.software_versions(),
            "rows": num_rows,
            "dim": shard.embedding_size,
            "classes": shard.num_local,
            "taking_part": num_taking_part,
            "weight": str(shard.weight.dtype).removeprefix("torch."),
            "matmul": str(inputs.matmul_dtype).removeprefix("torch."),
            "chunk_size": shard.chunk_size,
            "deterministic": torch.are_deterministic_algorithms_enabled(),
        }
        # Own leaves: their .grad is the timing's; the weight's rows are the same.
        timed = replace(inputs, norm_embeddings=inputs.norm_embeddings.detach().requires_grad_())
        timed_shard = replace(shard, weight=shard.weight.detach().requires_grad_(True))

        def measure(path: str) -> float:
            def step() -> None:
                with torch.enable_grad():
                    if path == "torch":
                        outputs = self._torch_stats(timed_shard, timed)
                    else:
                        outputs = self._triton_stats(timed_shard, timed, None)
                    # d loss / d sum-exp and d loss / d target cos: ones, as good as any.
                    torch.autograd.backward(outputs[1:], [torch.ones_like(o) for o in outputs[1:]])
                timed.norm_embeddings.grad = timed_shard.weight.grad = None

            return measuring.time_steps(step, device)

        def agree(seconds: list[float]) -> list[float]:
            if shard.world_size == 1:
                return seconds
            slowest = torch.tensor(seconds, dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=shard.group)
            return slowest.tolist()

        choice = choose_kernel(key, measure, self.cache, agree)
        source = "measured" if choice.source == "measured" else f"from {choice.source}"
        self.logger.info(
            "head.kernel=auto: %s (N %d, D %d, %s classes taking part on this rank, %s "
            "matmuls, %s, slowest rank; %s)",
            choice.describe(), num_rows, shard.embedding_size, f"{num_taking_part:,}",
            key["matmul"], key["device"], source,
        )  # fmt: skip
        return choice

    def triton_tiles(
        self, shard: ShardShape, inputs: StatsInputs, fused_update: bool = False
    ) -> Any:
        """The kernels' TileConfig for this forward's shapes (timed on a GPU: tile_tuning);
        `fused_update`: its backward applies the update (the epilogue's tiles are timed)."""
        tile_tuning = importlib.import_module("recognition.heads.tuning.tiles")
        norm_embeddings, row_index = inputs.norm_embeddings, inputs.row_index
        shape = tile_tuning.TuneShape(
            num_rows=norm_embeddings.shape[0],
            dim=norm_embeddings.shape[1],
            num_classes=shard.num_local if row_index is None else row_index.numel(),
            weight_dtype=shard.weight.dtype,
            matmul_dtype=inputs.matmul_dtype,
            has_index=row_index is not None,
            keeps_logits=shard.chunk_size is None,
            fused_update=fused_update,
        )
        return tile_tuning.tiles_for(norm_embeddings.device, shape, self.cache)


@dataclass
class KernelChoice:
    """What `head.kernel=auto` chose, from which seconds per step (inf where a path failed)."""

    kernel: str
    seconds: dict[str, float]
    errors: dict[str, str] = field(default_factory=dict)
    source: str = "measured"  # or the cache file it came from

    def describe(self) -> str:
        """'triton, 3.10 ms per step against 5.20 ms for torch' and any failure."""
        other = "torch" if self.kernel == "triton" else "triton"
        text = (
            f"{self.kernel}, {_ms(self.seconds[self.kernel])} per step against "
            f"{_ms(self.seconds[other])} for {other}"
        )
        for path, error in self.errors.items():
            text += f"; the {path} path failed: {error}"
        return text


def _ms(seconds: float) -> str:
    return "-" if not math.isfinite(seconds) else f"{seconds * 1e3:.2f} ms"


def choose_kernel(
    key: Mapping[str, Any],
    measure: Callable[[str], float],
    cache: TuningCache | None,
    agree: Callable[[list[float]], list[float]] | None = None,
) -> KernelChoice:
    """Torch or Triton for the head's local statistics, whichever steps faster.

    `measure(path)` returns seconds per training step of "torch", then of "triton"; an
    exception makes that path's time infinite (an out-of-memory torch path, a kernel that
    does not compile), and its first line is kept. The times are read from `cache` under
    `key` when there, and stored there after a measurement in which both paths ran.
    `agree` maps this process's times to the ones every rank decides from (the maximum over
    the ranks: a step ends when the slowest rank is done), so that all ranks choose alike.
    Triton wins only when strictly faster; with both paths failed the choice is torch, whose
    own error then surfaces in the run.
    """
    entry = cache.get("kernel", key) if cache is not None else None
    seconds = _cached_seconds(entry)
    errors: dict[str, str] = {}
    source = "measured"
    if seconds is not None:
        assert cache is not None
        source = str(cache.path("kernel"))
    else:
        seconds = []
        for path in PATHS:
            try:
                seconds.append(float(measure(path)))
            except Exception as exc:  # any failure rules the path out; the run goes on
                seconds.append(math.inf)
                lines = str(exc).strip().splitlines() or [""]
                errors[path] = f"{type(exc).__name__}: {lines[0]}"
        if cache is not None and not errors:
            cache.put("kernel", key, {"seconds": dict(zip(PATHS, seconds, strict=True))})
    if agree is not None:
        seconds = agree(seconds)
    by_path = dict(zip(PATHS, seconds, strict=True))
    kernel = "triton" if by_path["triton"] < by_path["torch"] else "torch"
    return KernelChoice(kernel, by_path, errors, source)


def _cached_seconds(entry: dict | None) -> list[float] | None:
    if entry is None:
        return None
    try:
        seconds = [float(entry["seconds"][path]) for path in PATHS]
    except (KeyError, TypeError, ValueError):
        return None
    return seconds if all(s > 0 for s in seconds) else None
