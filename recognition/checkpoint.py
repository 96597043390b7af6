"""Checkpoints: the sharded training state in `torch.distributed.checkpoint` (DCP) format,
resumable on any number of ranks, and the single-file backbone export.

A training checkpoint is a directory `checkpoints/step_<N:08d>/` that DCP writes: one
`__<rank>_0.distcp` file per rank and a `.metadata` index. Its entries have flat names:

| entry                            | holds                                     | written by  |
|----------------------------------|-------------------------------------------|-------------|
| `backbone/<name>`                | the backbone's state_dict (replicated)    | rank 0      |
| `head/weight`                    | the class matrix (num_classes, D)         | every rank  |
| `precision/masters/<key>`        | O2 fp32 masters (the head's: rows)        | 0; rows: all |
| `precision/scaler`               | the fp16 loss scaler's state              | rank 0      |
| `optimizer/state/<index>/<name>` | momentum, Adam moments (the head's: rows) | 0; rows: all |
| `optimizer/param_groups`         | learning rates, weight decay, ...         | rank 0      |
| what the caller adds             | scheduler, progress, config; `rng/<rank>` | 0; each     |

Class rows. Each rank passes its shard of the class matrix, of its master and of their
optimizer state as the plain local tensor carrying DCP's `CheckpointableTensor` fields (see
`rows_of`): the global shape (num_classes, ...) and the global row where the shard starts.
DCP records the shards as chunks of one global tensor and each rank writes its own chunk,
so nothing is ever gathered on one rank. To load, each rank asks for the rows of *its*
shard under the current world size (`shard_range`); DCP reads them from whichever saved
chunks overlap them. That is how a checkpoint of 2 ranks resumes on 1 or 3: the class
matrix is re-split, and the momentum rows with it. Shards are contiguous, possibly uneven
(`shard_range` gives the first ranks one class more), which is why the rows are described
by offsets rather than by a DTensor placement (`Shard(0)` splits like `torch.chunk`).

Replicated tensors (the backbone) and objects that every rank passes under the same name
are written once, by rank 0 (DCP's save planner keeps one copy of entries several ranks
hold; rank 0's, since the BatchNorm running statistics of the ranks drift apart between two
of DDP's broadcasts of rank 0's).

Atomic. Rank 0 creates `checkpoints/.tmp-step_<N>/`, every rank writes its file there (DCP
fsyncs them), DCP writes `.metadata` last, then rank 0 renames the directory to
`step_<N>` and fsyncs the parent. A run killed during a save leaves a `.tmp-*` directory that
nothing reads (and the next save removes); only `step_*` directories holding a
`.metadata` count as checkpoints. Multi-node runs need a file system that every node sees.

A checkpoint is data, never code: objects are read back with `torch.load(weights_only=True)`
and DCP's `.metadata` index (a pickle) with an allow-list of DCP's own metadata types.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import random
import re
import shutil
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import (
    CheckpointException,
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.metadata import StorageMeta

from recognition import distributed
from recognition.heads import ShardedMarginSoftmax
from recognition.precision import Precision

log = logging.getLogger(__name__)

CHECKPOINT_RE = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp-"
METADATA_FILE = ".metadata"
BACKBONE_FORMAT = "recognition-backbone-v1"
OPTIMIZER_STATE_RE = re.compile(r"^optimizer/state/(\d+)/(.+)$")


# ---------------------------------------------------------------------- single files


def atomic_save(obj: Any, path: Path) -> None:
    """torch.save to a temporary file beside `path`, fsync, then rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)


def load_file(path: Path) -> dict[str, Any]:
    """Load a single-file checkpoint (a backbone export) as plain tensors and containers."""
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path}: no such file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for truncated / foreign files
        raise ValueError(f"checkpoint {path}: cannot be read ({exc})") from exc


def rng_state() -> dict[str, Any]:
    """This process's torch, Python, NumPy (and CUDA) RNG states, as weights_only-loadable data."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": _numpy_state_to_plain(np.random.get_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state()` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(_to_tuple(state["python"]))
    np.random.set_state(_numpy_state_from_plain(state["numpy"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------- DCP checkpoints


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def is_checkpoint(path: Path) -> bool:
    """Whether `path` is a complete DCP checkpoint directory (its `.metadata` written)."""
    return (path / METADATA_FILE).is_file()


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in folder.iterdir()
        if (m := CHECKPOINT_RE.match(p.name)) and is_checkpoint(p)
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def rows_of(tensor: Tensor, start: int, num_rows: int) -> Tensor:
    """`tensor` (R, ...) marked as rows [start, start + R) of a (num_rows, ...) global tensor.

    Returns a view sharing `tensor`'s storage (DCP loads into it in place) that carries the
    fields of DCP's `CheckpointableTensor` protocol; `tensor` itself is left unmarked.
    """
    if tensor.ndim < 1 or not 0 <= start <= start + tensor.shape[0] <= num_rows:
        raise ValueError(
            f"rows_of: rows [{start}, {start + tensor.shape[0] if tensor.ndim else '?'}) do not "
            f"fit in {num_rows} rows"
        )
    view = tensor.detach()  # a new tensor object, the same storage
    zeros = (0,) * (tensor.ndim - 1)
    view.global_shape = (num_rows, *tensor.shape[1:])  # type: ignore[attr-defined]
    view.global_offsets = ((start, *zeros),)  # type: ignore[attr-defined]
    view.local_offsets = ((0, *zeros),)  # type: ignore[attr-defined]
    view.local_sizes = (tuple(tensor.shape),)  # type: ignore[attr-defined]
    return view


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write `state` as the checkpoint of `step`, atomically; delete all but the `keep` newest.

    Collective: every rank of the default group calls it with its own `state` (a flat dict
    of name -> tensor, `rows_of` tensor, or picklable object). Returns the directory.
    """
    final = checkpoint_path(run_dir, step)
    tmp = final.with_name(TMP_PREFIX + final.name)
    is_main = distributed.rank() == 0
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while saving
        tmp.mkdir(parents=True)
    distributed.barrier()
    no_dist = distributed.world_size() == 1
    try:
        with _quiet_single_process(no_dist):
            dcp.save(
                state,
                storage_writer=FileSystemWriter(tmp, sync_files=True),
                planner=DefaultSavePlanner(
                    flatten_state_dict=False,
                    flatten_sharded_tensors=False,
                    # Replicated entries from rank 0: ranks' BatchNorm running statistics
                    # differ between DDP's broadcasts of rank 0's, and rank 0's are the ones
                    # DDP (and the backbone export) treat as the model's.
                    dedup_save_to_lowest_rank=True,
                ),
                no_dist=no_dist,
            )
    except CheckpointException as exc:
        raise _plain_error(exc, f"saving checkpoint {final} failed", OSError) from None
    # dcp.save returns on every rank once rank 0 has written .metadata: the files are complete.
    if is_main:
        if final.exists():  # the same step saved again (a resumed run): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in final.parent.glob(TMP_PREFIX + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        log.info("saved checkpoint %s", final)
    distributed.barrier()
    return final


def checkpoint_entries(path: Path) -> dict[str, Any]:
    """What the checkpoint at `path` holds: entry name -> DCP storage metadata.

    Tensors have `TensorStorageMetadata` (`.size`, `.properties.dtype`, `.chunks`), objects
    `BytesStorageMetadata`. Raises FileNotFoundError / ValueError naming `path`.
    """
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path}: no such checkpoint directory")
    if not is_checkpoint(path):
        raise ValueError(
            f"checkpoint {path}: no {METADATA_FILE} (not a checkpoint, or one whose save was "
            "interrupted)"
        )
    try:
        return dict(_SafeReader(path).read_metadata().state_dict_metadata)
    except Exception as exc:
        raise ValueError(f"checkpoint {path}: cannot read its metadata ({exc})") from exc


def load_checkpoint(path: Path, state: dict[str, Any], *, collective: bool = True) -> None:
    """Fill `state` from the checkpoint at `path`.

    `state` names the entries to read: a tensor (or `rows_of` tensor) is filled in place with
    its values (the rows it stands for), any other value is replaced by the stored object.
    With `collective` (the default) every rank of the default group must call it; False
    reads in this process alone. Raises ValueError naming `path` and the entry on a mismatch.
    """
    entries = checkpoint_entries(path)
    missing = sorted(set(state) - set(entries))
    if missing:
        raise ValueError(
            f"checkpoint {path}: no entry {missing[0]!r} ({len(missing)} missing); it was saved "
            "by a different model or precision level"
        )
    for name, value in state.items():
        if torch.is_tensor(value):
            stored = entries[name]
            shape = getattr(value, "global_shape", tuple(value.shape))
            if not isinstance(stored, TensorStorageMetadata) or tuple(stored.size) != shape:
                have = tuple(stored.size) if isinstance(stored, TensorStorageMetadata) else "data"
                raise ValueError(
                    f"checkpoint {path}: entry {name!r} has shape {have}, expected {shape}"
                )
    no_dist = not collective or distributed.world_size() == 1
    try:
        with _quiet_single_process(no_dist):
            dcp.load(
                state,
                storage_reader=_SafeReader(path),
                planner=_SafeLoadPlanner(),
                no_dist=no_dist,
            )
    except CheckpointException as exc:
        raise _plain_error(exc, f"checkpoint {path}: cannot be read", ValueError) from None


def read_checkpoint(path: Path, prefixes: Iterable[str] = ("",)) -> dict[str, Any]:
    """Every entry of the checkpoint whose name starts with one of `prefixes`, whole.

    In this process alone, whatever the world size it was saved with: the class matrix comes
    back as one (num_classes, D) tensor. For inspection, tests and exports; it costs the
    memory of everything it reads.
    """
    prefixes = tuple(prefixes)
    state: dict[str, Any] = {}
    for name, stored in checkpoint_entries(path).items():
        if not name.startswith(prefixes):
            continue
        if isinstance(stored, TensorStorageMetadata):
            state[name] = torch.empty(tuple(stored.size), dtype=stored.properties.dtype)
        else:
            state[name] = None
    load_checkpoint(path, state, collective=False)
    return state


class _SafeReader(FileSystemReader):
    """DCP's file reader, whose `.metadata` pickle may only name DCP's metadata types.

    DCP writes its index with pickle and reads it back with `pickle.load`, which would run
    whatever code a crafted file names; this reader unpickles it with an allow-list.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"not DCP metadata but {type(metadata).__name__}")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            (module == "torch.distributed.checkpoint.metadata" and name[:1].isupper())
            or (module, name) in _METADATA_GLOBALS
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")
        return super().find_class(module, name)


_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner for flat state dicts, reading objects with weights_only."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item: Any, value: Any) -> None:
        self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


# ---------------------------------------------------------------------- the training state


def training_state(
    backbone: nn.Module,
    head: ShardedMarginSoftmax,
    optimizer: torch.optim.Optimizer,
    precision: Precision,
) -> dict[str, Any]:
    """The model side of a checkpoint as flat DCP entries (see the module docstring).

    `backbone` is the bare module (not its DDP wrapper). Tensors are live views, the head's
    rows and their optimizer and master rows marked with `rows_of`; optimizer state is what
    exists now (none before the first step). Add the run's own objects to the returned dict.
    """
    head_param = _head_param(head, precision)
    state: dict[str, Any] = {f"backbone/{k}": v for k, v in backbone.state_dict().items()}
    for name, value in head.state_dict().items():
        state[f"head/{name}"] = _head_rows(head, value) if name == "weight" else value
    for key, param, master in precision.masters():
        value = master.detach()
        state[f"precision/masters/{key}"] = (
            _head_rows(head, value) if param is head.weight else value
        )
    state["precision/scaler"] = precision.scaler.state_dict() if precision.scaler else {}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    packed = optimizer.state_dict()
    for index, values in packed["state"].items():
        for name, value in values.items():
            if params[index] is head_param and _is_row_state(value, head_param):
                value = _head_rows(head, value)
            state[f"optimizer/state/{index}/{name}"] = value
    state["optimizer/param_groups"] = packed["param_groups"]
    return state


def load_training_state(
    path: Path,
    backbone: nn.Module,
    head: ShardedMarginSoftmax,
    optimizer: torch.optim.Optimizer,
    precision: Precision,
    objects: Iterable[str] = (),
) -> dict[str, Any]:
    """Restore what `training_state` saved into the live modules, on this world size.

    Collective. The backbone and the head's rows (this rank's shard under the current world
    size, whatever it was at save time) are loaded in place, then the optimizer state and
    the precision state (scaler, O2 masters, copied into the half model). `objects` names
    further entries to read (those the caller added to the saved state; a name missing from
    the checkpoint comes back as None). Returns {name: object} for them.
    """
    entries = checkpoint_entries(path)
    stored = entries.get("head/weight")
    if not isinstance(stored, TensorStorageMetadata):
        raise ValueError(f"checkpoint {path}: no head/weight entry (not a training checkpoint)")
    if tuple(stored.size) != (head.num_classes, head.embedding_size):
        raise ValueError(
            f"checkpoint {path}: its class matrix is {tuple(stored.size)}, this run's head is "
            f"({head.num_classes}, {head.embedding_size}): different data.root or "
            "model.embedding_size"
        )
    live = training_state(backbone, head, optimizer, precision)
    state = {k: v for k, v in live.items() if not k.startswith("optimizer/state/")}
    # The optimizer may hold no state yet (no step taken): its tensors are allocated from the
    # checkpoint's entries, the head's at this rank's number of rows.
    params = [p for group in optimizer.param_groups for p in group["params"]]
    head_param = _head_param(head, precision)
    for name, entry in entries.items():
        match = OPTIMIZER_STATE_RE.match(name)
        if match is None:
            continue
        index = int(match.group(1))
        if index >= len(params):
            raise ValueError(
                f"checkpoint {path}: optimizer state for parameter {index}, the optimizer has "
                f"{len(params)}: a different model"
            )
        if not isinstance(entry, TensorStorageMetadata):
            state[name] = None
            continue
        param = params[index]
        value = torch.empty(tuple(entry.size), dtype=entry.properties.dtype, device=param.device)
        if param is head_param and tuple(entry.size) == (head.num_classes, *param.shape[1:]):
            value = _head_rows(head, torch.empty_like(param, dtype=entry.properties.dtype))
        state[name] = value
    if precision.level != "O2":
        state = {k: v for k, v in state.items() if not k.startswith("precision/masters/")}
    for name in objects:
        if name in entries:
            state[name] = None
    load_checkpoint(path, state)

    packed: dict[int, dict[str, Any]] = {}
    for name, value in state.items():
        if match := OPTIMIZER_STATE_RE.match(name):
            packed.setdefault(int(match.group(1)), {})[match.group(2)] = value
    optimizer.load_state_dict({"state": packed, "param_groups": state["optimizer/param_groups"]})
    masters = {key: master for key, _, master in precision.masters()}  # filled in place
    precision.load_state_dict({"scaler": state["precision/scaler"], "masters": masters})
    return {name: state.get(name) for name in objects}


def _head_param(head: ShardedMarginSoftmax, precision: Precision) -> Tensor:
    """The tensor the optimizer steps for the head's weight: its O2 master, or the weight."""
    return next((m for _, p, m in precision.masters() if p is head.weight), head.weight)


def _head_rows(head: ShardedMarginSoftmax, tensor: Tensor) -> Tensor:
    return rows_of(tensor, head.class_start, head.num_classes)


def _is_row_state(value: Any, param: Tensor) -> bool:
    return torch.is_tensor(value) and value.shape == param.shape


# ---------------------------------------------------------------------- the backbone alone


def export_backbone(
    path: Path,
    backbone: torch.nn.Module,
    model_cfg: dict[str, Any],
    image_size: int | Sequence[int],
) -> None:
    """Write the backbone alone (fp32 weights and how to rebuild it) for evaluation.

    `image_size` (one side, or (H, W)) is stored as an int or a [H, W] list.
    """
    state = {
        k: v.detach().float().cpu() if v.is_floating_point() else v.cpu()
        for k, v in backbone.state_dict().items()
    }
    atomic_save(
        {
            "format": BACKBONE_FORMAT,
            "model": model_cfg,
            "image_size": image_size if isinstance(image_size, int) else list(image_size),
            "state_dict": state,
        },
        path,
    )


def load_backbone_file(
    path: Path,
) -> tuple[dict[str, Any], int | tuple[int, int], dict[str, torch.Tensor]]:
    """Read a backbone export (a file) or a training checkpoint (a DCP directory).

    Returns (model config dict, input image size, backbone state dict); the size is an int
    (a square side, as every export before [H, W] sizes holds) or (H, W). From a training
    checkpoint the weights are fp32: the O2 masters where the run kept any.
    """
    if path.is_dir():
        data = read_checkpoint(path, ("backbone/", "precision/masters/0.", "meta"))
        meta = data.get("meta")
        if not isinstance(meta, dict) or "config" not in meta:
            raise ValueError(f"checkpoint {path}: no meta entry with the run's config")
        state = {
            k.removeprefix("backbone/"): v for k, v in data.items() if k.startswith("backbone/")
        }
        for key, value in data.items():
            if key.startswith("precision/masters/0."):
                state[key.removeprefix("precision/masters/0.")] = value
        state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
        cfg = meta["config"]
        return cfg["model"], _stored_image_size(cfg["data"]["image_size"], path), state
    data = load_file(path)
    if data.get("format") == BACKBONE_FORMAT:
        return data["model"], _stored_image_size(data["image_size"], path), data["state_dict"]
    raise ValueError(f"checkpoint {path}: neither a training checkpoint nor a backbone export")


def _stored_image_size(value: Any, path: Path) -> int | tuple[int, int]:
    """An image size read from a checkpoint: an int stays an int, [H, W] becomes (H, W)."""
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return int(value[0]), int(value[1])
    if isinstance(value, (list, tuple)):
        raise ValueError(f"checkpoint {path}: image_size {value!r} is neither a side nor [H, W]")
    return int(value)


# ---------------------------------------------------------------------- helpers


def _plain_error(exc: CheckpointException, what: str, kind: type[Exception]) -> BaseException:
    """The exception to raise for DCP's CheckpointException (a BaseException, which the
    entry points' `except Exception` would miss): a failed collective as it is (the caller
    reports a lost rank), anything else as `kind` saying `what`, with the ranks' errors."""
    failures = {rank: error for rank, (error, _) in exc.failures.items()}
    for error in failures.values():
        if distributed.is_collective_failure(error):
            return error
    details = "; ".join(f"rank {rank}: {error!r}" for rank, error in sorted(failures.items()))
    return kind(f"{what} ({details})")


@contextlib.contextmanager
def _quiet_single_process(no_dist: bool) -> Iterator[None]:
    """Silence DCP's warning that it saves / loads in one process: here that is on purpose."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fsync_dir(path: Path) -> None:
    """Make renames inside `path` durable."""
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _numpy_state_to_plain(state: tuple) -> list:
    name, keys, pos, has_gauss, cached = state
    return [name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, cached]


def _numpy_state_from_plain(state: list) -> tuple:
    name, keys, pos, has_gauss, cached = state
    return (name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached))


def _to_tuple(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_to_tuple(v) for v in value)
    return value
