"""Checkpoints: the sharded training state in `torch.distributed.checkpoint` (DCP) format,
resumable on any number of ranks, and the single-file backbone export.

A training checkpoint is a directory `checkpoints/step_<N:08d>/` that DCP writes: one
`__<rank>_0.distcp` file per rank and a `.metadata` index. `save_checkpoint` takes a dict of
parts, each a `Stateful` (`state_dict()` / `load_state_dict()`: the backbone and head
modules, Precision, the optimizer adapter, the scheduler, the run's progress and RNG) or a
plain value, and knows none of their insides: a part's state dict is flattened into entries
`<part>/<key>` wherever it holds tensors (`flatten_state`), anything else is one entry. The
training run's parts (recognition.training) give these entries:

| entry                         | holds                                         | written by |
|-------------------------------|-----------------------------------------------|------------|
| `format`                      | {"version": FORMAT_VERSION}                   | rank 0     |
| `backbone/<name>`             | the backbone's state_dict (replicated)        | rank 0     |
| `head/weight`                 | the class matrix (num_classes, D)             | every rank |
| `head/_extra_state`           | the partial FC sampling step                  | rank 0     |
| `head/margin.running_mean`,   | AdaFace only: its running norm statistics     | rank 0 (*) |
| `head/margin.running_std`     | (float64 scalars, the same on every rank)     |            |
| `precision/masters/<key>`     | O2 fp32 masters (the head's: rows)            | 0; rows: all |
| `precision/scaler`, `level`.. | the fp16 loss scaler's state, level, dtype    | rank 0     |
| `optimizer/state/<i>/<name>`  | momentum, Adam moments (the head's: rows)     | 0; rows: all |
| `optimizer/param_groups`      | learning rates, weight decay, ...             | rank 0     |
| `scheduler`, `progress`       | LR schedule; step, epoch, position in epoch   | rank 0     |
| `meta`                        | the config, the number and hash of classes    | rank 0     |
| `rng/<rank>/...`              | each rank's random streams                    | each rank  |

(*) Replicated entries are written by the lowest rank that holds them: with a pipelined
backbone the head's are the first rank of the last stage's.

Versions: 1 (no `format` entry) kept the partial FC step in `progress`; it loads (see
recognition.training.state), and a version newer than this code's is refused by name.

Class rows. Each rank passes its shard of the class matrix, of its master and of their
optimizer state as the plain local tensor marked with the global shape (num_classes, ...)
and the global row where the shard starts (`recognition.sharded`: the head records its
rows' placement, Precision and the optimizer adapter copy it to the tensors that stand for
them). The planners here (`_RowsSavePlanner`, `_SafeLoadPlanner`) plan those rows as
chunks of one global tensor with DCP's own write and read items, the same on every
supported torch release; each rank writes its own chunk,
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
import dataclasses
import errno
import logging
import os
import pickle
import random
import re
import shutil
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
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
from torch.distributed.checkpoint.default_planner import (
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from recognition import distributed
from recognition.models import build_backbone
from recognition.precision import master_weights
from recognition.sharded import rows_of

__all__ = [
    "FORMAT_VERSION",
    "atomic_save",
    "checkpoint_entries",
    "checkpoint_version",
    "export_backbone",
    "flatten_state",
    "latest_checkpoint",
    "list_checkpoints",
    "load_backbone",
    "load_backbone_file",
    "load_checkpoint",
    "read_checkpoint",
    "rows_of",
    "save_checkpoint",
]

log = logging.getLogger(__name__)

CHECKPOINT_RE = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp-"
METADATA_FILE = ".metadata"
BACKBONE_FORMAT = "recognition-backbone-v1"
# The layout of a training checkpoint. 1: written before checkpoints recorded a version
# (no "format" entry; the head's sampling step in "progress"). 2: Stateful parts.
FORMAT_VERSION = 2
FORMAT_ENTRY = "format"


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
    except (OSError, RuntimeError) as exc:  # torch's zip writer raises RuntimeError
        raise OSError(_write_failure(exc, path)) from None
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
        if "Weights only load failed" in str(exc) and "Unsupported global" in str(exc):
            # torch's message goes on to advise weights_only=False, which would run whatever
            # code the file names: not advice to relay about a file of unknown origin.
            raise ValueError(
                f"checkpoint {path}: refused, it holds Python objects other than tensors and "
                "plain containers (a checkpoint of this project is data only; a pickle from "
                "elsewhere could run code when loaded)"
            ) from None
        raise ValueError(
            f"checkpoint {path}: not a checkpoint file of this project (truncated, or another "
            "format)"
        ) from None


def rng_state() -> dict[str, Any]:
    """This process's torch, Python, NumPy (and CUDA) RNG states, as weights_only-loadable data.

    CUDA: the stream of this process's own device only (`torch.cuda.current_device()`, the
    rank's `local_rank` once distributed setup has set it), not every visible device's: a
    rank draws on its own device alone, and a run resumed with its ranks placed otherwise
    (8 ranks on one node, then on two nodes of 4 GPUs) sees another number of devices.
    """
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": _numpy_state_to_plain(np.random.get_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state()` returned (its CUDA stream to this process's device)."""
    torch.set_rng_state(state["torch"])
    random.setstate(_to_tuple(state["python"]))
    np.random.set_state(_numpy_state_from_plain(state["numpy"]))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], torch.cuda.current_device())


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


def save_checkpoint(run_dir: Path, step: int, parts: Mapping[str, Any], keep: int) -> Path:
    """Write `parts` as the checkpoint of `step`, atomically; delete all but the `keep` newest.

    Collective: every rank of the default group calls it with its own `parts`, a dict of
    name -> a `Stateful` (anything with `state_dict()` / `load_state_dict()`: a module, an
    optimizer adapter, Precision, a scheduler), a tensor, or a picklable object (see
    `flatten_state` for how they become entries). A "format" entry records the layout's
    version. Returns the directory.
    """
    state = flatten_state(parts)
    state[FORMAT_ENTRY] = {"version": FORMAT_VERSION}
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
                planner=_RowsSavePlanner(),
                no_dist=no_dist,
            )
    except CheckpointException as exc:
        if is_main:  # nothing half-written stays behind; the previous checkpoints are intact
            shutil.rmtree(tmp, ignore_errors=True)
        error = _plain_error(exc, f"saving checkpoint {final} failed", OSError)
        if isinstance(error, OSError) and _is_disk_full(error):
            error = OSError(_write_failure(error, final))
        raise error from None
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


def load_checkpoint(
    path: Path,
    parts: dict[str, Any],
    *,
    optional: Iterable[str] = (),
    collective: bool = True,
) -> set[str]:
    """Restore `parts` (as `save_checkpoint` takes them) from the checkpoint at `path`.

    A `Stateful` part gets `load_state_dict()` with its `state_dict()` structure, each
    tensor filled in place (the rows it stands for, when it carries rows: this rank's shard
    under the current world size, whatever it was at save time) and each object replaced
    by the stored one; entries the checkpoint lacks are left out of what it receives, and
    a part stored whole (an older layout) gets the stored object. A plain tensor in `parts`
    is filled in place, any other plain value is replaced in `parts` by the stored object.

    A part of which the checkpoint holds nothing is an error, unless named in `optional`.
    With `collective` (the default) every rank of the default group must call it; False
    reads in this process alone. Returns the names of the parts found. Raises ValueError
    naming `path` and the entry on a mismatch.
    """
    entries = checkpoint_entries(path)
    version = checkpoint_version(path, entries)
    if version > FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {path}: format version {version}, this code reads versions up to "
            f"{FORMAT_VERSION}: update the code to resume it"
        )
    optional = set(optional)
    live: dict[str, Any] = {}
    request: dict[str, Any] = {}
    for name, part in parts.items():
        if not _is_stateful(part):
            if name in entries:
                request[name] = part if torch.is_tensor(part) else None
            elif name not in optional:
                raise ValueError(
                    f"checkpoint {path}: no entry {name!r}; it was saved by a different model "
                    "or precision level"
                )
            continue
        live[name] = part.state_dict()
        if name in entries:  # stored whole: an object, or an older layout of the part
            request[name] = None
            continue
        flat: dict[str, Any] = {}
        _flatten(name, live[name], flat)
        found = {k: (v if torch.is_tensor(v) else None) for k, v in flat.items() if k in entries}
        if not found and name not in optional:
            raise ValueError(
                f"checkpoint {path}: no entry for {name!r}; it was saved by a different model "
                "or precision level"
            )
        request.update(found)
    _check_shapes(path, entries, request)
    no_dist = not collective or distributed.world_size() == 1
    try:
        with _quiet_single_process(no_dist):
            dcp.load(
                request,
                storage_reader=_SafeReader(path),
                planner=_SafeLoadPlanner(),
                no_dist=no_dist,
            )
    except CheckpointException as exc:
        raise _plain_error(exc, f"checkpoint {path}: cannot be read", ValueError) from None
    loaded: set[str] = set()
    for name, part in parts.items():
        if name not in live:
            if name in request:
                parts[name] = request[name]
                loaded.add(name)
            continue
        if name in request:
            state = request[name]
        else:
            state = _unflatten(name, live[name], request)
            if state is _MISSING or (isinstance(state, Mapping) and not state):
                continue  # an optional part the checkpoint does not hold
        try:
            part.load_state_dict(state)
        except (RuntimeError, KeyError, ValueError) as exc:
            raise ValueError(f"checkpoint {path}: {name!r} cannot be restored: {exc}") from exc
        loaded.add(name)
    return loaded


def checkpoint_version(path: Path, entries: Mapping[str, Any] | None = None) -> int:
    """The layout version of the checkpoint at `path` (1 for one that records none)."""
    entries = checkpoint_entries(path) if entries is None else entries
    if FORMAT_ENTRY not in entries:
        return 1
    holder: dict[str, Any] = {FORMAT_ENTRY: None}
    with _quiet_single_process(True):
        dcp.load(holder, storage_reader=_SafeReader(path), planner=_SafeLoadPlanner(), no_dist=True)
    value = holder[FORMAT_ENTRY]
    if not isinstance(value, dict) or not isinstance(value.get("version"), int):
        raise ValueError(f"checkpoint {path}: malformed format entry {value!r}")
    return value["version"]


def flatten_state(parts: Mapping[str, Any]) -> dict[str, Any]:
    """The flat entries (name -> tensor or object) that `save_checkpoint` writes for `parts`.

    A Stateful part's `state_dict()` is flattened: a dict that holds tensors becomes one
    entry per key, "<part>/<key>" (recursively: "optimizer/state/3/momentum_buffer"), and
    anything else (a dict without tensors, a list, a number) is one entry. A plain value
    is one entry under its name.
    """
    state: dict[str, Any] = {}
    for name, part in parts.items():
        if _is_stateful(part):
            _flatten(name, part.state_dict(), state)
        else:
            state[name] = part
    return state


_MISSING = object()


def _is_stateful(value: Any) -> bool:
    return (
        not torch.is_tensor(value)
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )


def _holds_tensor(value: Mapping) -> bool:
    return any(
        torch.is_tensor(v) or (isinstance(v, Mapping) and _holds_tensor(v)) for v in value.values()
    )


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping) and _holds_tensor(value):
        for key, item in value.items():
            _flatten(f"{prefix}/{key}", item, out)
    else:
        out[prefix] = value


def _unflatten(prefix: str, template: Any, loaded: Mapping[str, Any]) -> Any:
    """`template`'s structure (and key types) with the loaded leaves; missing leaves left out."""
    if isinstance(template, Mapping) and _holds_tensor(template):
        out = {}
        for key, item in template.items():
            value = _unflatten(f"{prefix}/{key}", item, loaded)
            if value is not _MISSING:
                out[key] = value
        return out
    return loaded.get(prefix, _MISSING)


def _check_shapes(path: Path, entries: Mapping[str, Any], request: Mapping[str, Any]) -> None:
    for name, value in request.items():
        if not torch.is_tensor(value):
            continue
        stored = entries[name]
        shape = getattr(value, "global_shape", tuple(value.shape))
        if not isinstance(stored, TensorStorageMetadata) or tuple(stored.size) != tuple(shape):
            have = tuple(stored.size) if isinstance(stored, TensorStorageMetadata) else "data"
            raise ValueError(
                f"checkpoint {path}: entry {name!r} has shape {have}, expected {tuple(shape)}"
            )


def read_checkpoint(path: Path, prefixes: Iterable[str] = ("",)) -> dict[str, Any]:
    """Every entry of the checkpoint whose name starts with one of `prefixes`, whole.

    In this process alone, whatever the world size it was saved with: the class matrix comes
    back as one (num_classes, D) tensor. For inspection, tests and exports; it costs the
    memory of everything it reads.
    """
    prefixes = tuple(prefixes)
    state: dict[str, Any] = {}
    for name, stored in checkpoint_entries(path).items():
        if not name.startswith(prefixes) or name == FORMAT_ENTRY:
            continue
        if isinstance(stored, TensorStorageMetadata):
            state[name] = torch.empty(tuple(stored.size), dtype=stored.properties.dtype)
        else:
            state[name] = None
    load_checkpoint(path, state, collective=False)
    return state


def read_part(path: Path, name: str) -> Any:
    """Part `name` of the checkpoint as nested dicts (string keys), read whole in this process.

    The inverse of the flattening of `flatten_state`: entries "<name>/a/b" come back as
    {"a": {"b": ...}}; a part stored as one entry comes back as that object; None when the
    checkpoint holds nothing of it.
    """
    entries = read_checkpoint(path, (name,))
    if name in entries:
        return entries[name]
    nested: dict[str, Any] = {}
    for key, value in entries.items():
        if not key.startswith(name + "/"):
            continue
        *outer, last = key[len(name) + 1 :].split("/")
        level = nested
        for part in outer:
            level = level.setdefault(part, {})
        level[last] = value
    return nested or None


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


def _is_rows(value: Any) -> bool:
    """Whether `value` is a tensor marked by `rows_of` (this rank's rows of a global tensor)."""
    return torch.is_tensor(value) and hasattr(value, "global_offsets")


def _rows_chunk(tensor: Tensor) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(
        offsets=torch.Size(tensor.global_offsets[0]),  # type: ignore[attr-defined]
        sizes=tensor.shape,
    )


class _RowsSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, with `rows_of` tensors written as chunks of one tensor.

    The rows are planned here rather than through a DCP tensor protocol so that the same
    code saves (and `_SafeLoadPlanner` reshards) on every supported torch release.
    Replicated entries are written by rank 0: ranks' BatchNorm running statistics differ
    between DDP's broadcasts of rank 0's, and rank 0's are the ones DDP (and the backbone
    export) treat as the model's.
    """

    def __init__(self) -> None:
        super().__init__(
            flatten_state_dict=False,
            flatten_sharded_tensors=False,
            dedup_save_to_lowest_rank=True,
        )

    def create_local_plan(self) -> SavePlan:
        rest = {k: v for k, v in self.state_dict.items() if not _is_rows(v)}
        plan = create_default_local_save_plan(rest, self.is_coordinator)
        items = [
            WriteItem(
                index=MetadataIndex(fqn, _rows_chunk(value).offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=_rows_chunk(value),
                    properties=TensorProperties.create_from_tensor(value),
                    size=torch.Size(value.global_shape),  # type: ignore[attr-defined]
                ),
            )
            for fqn, value in self.state_dict.items()
            if _is_rows(value)
        ]
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict.get(index.fqn)
        return value if _is_rows(value) else super().lookup_object(index)


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner for flat state dicts, reading objects with weights_only
    and `rows_of` tensors as their rows of the stored tensor (whatever chunks hold them)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        rest = {k: v for k, v in self.state_dict.items() if not _is_rows(v)}
        plan = create_default_local_load_plan(rest, self.metadata, not self.allow_partial_load)
        items = [
            item
            for fqn, value in self.state_dict.items()
            if _is_rows(value)
            for item in create_read_items_for_chunk_list(
                fqn, self.metadata.state_dict_metadata[fqn], [_rows_chunk(value)]
            )
        ]
        return dataclasses.replace(plan, items=[*plan.items, *items])

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        value = self.state_dict.get(index.fqn)
        return value if _is_rows(value) else super().lookup_tensor(index)

    def load_bytes(self, read_item: Any, value: Any) -> None:
        self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


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
    checkpoint the weights are fp32: the O2 masters where the run kept any (the backbone is
    the first module the training prepares).
    """
    if path.is_dir():
        meta = read_part(path, "meta")
        if not isinstance(meta, dict) or "config" not in meta:
            raise ValueError(f"checkpoint {path}: no meta entry with the run's config")
        state = read_part(path, "backbone")
        state = state if isinstance(state, dict) else {}
        precision_state = read_part(path, "precision")
        if isinstance(precision_state, dict):
            state.update(master_weights(precision_state, 0))
        state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
        cfg = meta["config"]
        return cfg["model"], _stored_image_size(cfg["data"]["image_size"], path), state
    data = load_file(path)
    if data.get("format") == BACKBONE_FORMAT:
        return data["model"], _stored_image_size(data["image_size"], path), data["state_dict"]
    raise ValueError(f"checkpoint {path}: neither a training checkpoint nor a backbone export")


def load_backbone(
    path: str | os.PathLike, device: torch.device
) -> tuple[nn.Module, int | tuple[int, int]]:
    """Rebuild a backbone from a backbone export or a training checkpoint.

    Returns the model in eval mode on `device` and the input size it was trained at (a
    square side or (H, W)).
    """
    model_cfg, image_size, state = load_backbone_file(Path(path))
    backbone = build_backbone(
        model_cfg["backbone"],
        embedding_size=model_cfg["embedding_size"],
        width=model_cfg.get("width", 1.0),
        dropout=model_cfg.get("dropout", 0.0),
        image_size=image_size,
    )
    try:
        backbone.load_state_dict(state)
    except RuntimeError as exc:
        raise ValueError(f"checkpoint {path}: weights do not fit the backbone: {exc}") from exc
    return backbone.float().eval().to(device), image_size


def _stored_image_size(value: Any, path: Path) -> int | tuple[int, int]:
    """An image size read from a checkpoint: an int stays an int, [H, W] becomes (H, W)."""
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return int(value[0]), int(value[1])
    if isinstance(value, (list, tuple)):
        raise ValueError(f"checkpoint {path}: image_size {value!r} is neither a side nor [H, W]")
    return int(value)


# ---------------------------------------------------------------------- helpers


def _is_disk_full(exc: BaseException) -> bool:
    text = str(exc)
    return getattr(exc, "errno", None) == errno.ENOSPC or any(
        mark in text for mark in ("No space left", "unexpected pos", "file write failed")
    )


def _write_failure(exc: BaseException, path: Path) -> str:
    """A one-line message for a failed write of `path`, saying so when the disk is full."""
    if not _is_disk_full(exc):
        return f"writing {path} failed: {exc}"
    try:
        free = f"{shutil.disk_usage(path.parent).free / 2**20:.0f} MiB free"
    except OSError:
        free = "free space unknown"
    return (
        f"writing {path} failed: no space left on device ({free} on its file system); "
        "what was written before is intact. Free space (or set output_dir elsewhere) and "
        "resume with train.resume=true"
    )


def verify_checkpoint(path: Path) -> str | None:
    """What makes the checkpoint at `path` unreadable, or None when its files look whole.

    Checks that `.metadata` reads and that every data file it names exists and holds the
    bytes it points to (a lost or truncated file); it reads no tensor data.
    """
    try:
        metadata = _SafeReader(path).read_metadata()
    except Exception as exc:  # noqa: BLE001  (any damage: truncated pickle, foreign file)
        return f"its {METADATA_FILE} cannot be read ({exc})"
    sizes: dict[str, int | None] = {}
    for info in (metadata.storage_data or {}).values():
        name = info.relative_path
        if name not in sizes:
            file = path / name
            sizes[name] = file.stat().st_size if file.is_file() else None
        size = sizes[name]
        if size is None:
            return f"its data file {name} is missing"
        needed = info.offset + info.length
        if size < needed:
            return f"its data file {name} is truncated ({size} bytes, needs {needed})"
    return None


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
