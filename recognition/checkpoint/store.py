"""The training checkpoint: the sharded training state in `torch.distributed.checkpoint`
(DCP) format, resumable on any number of ranks; saved, loaded, read whole and verified.

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

How class rows reshard and why replicated entries come from rank 0:
`recognition.checkpoint.planners`. Atomic: rank 0 creates `checkpoints/.tmp-step_<N>/`,
every rank writes its file there (DCP fsyncs them), DCP writes `.metadata` last, then rank
0 renames the directory to `step_<N>` and fsyncs the parent (`recognition.checkpoint.files`).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    CheckpointException,
    FileSystemWriter,
    TensorStorageMetadata,
)

from recognition import distributed
from recognition.checkpoint.entries import (
    MISSING,
    flatten,
    flatten_state,
    is_stateful,
    unflatten,
)
from recognition.checkpoint.files import (
    METADATA_FILE,
    TMP_PREFIX,
    checkpoint_path,
    fsync_dir,
    is_checkpoint,
    is_disk_full,
    list_checkpoints,
    write_failure,
)
from recognition.checkpoint.planners import RowsSavePlanner, SafeLoadPlanner, SafeReader

log = logging.getLogger(__name__)

# The layout of a training checkpoint. 1: written before checkpoints recorded a version
# (no "format" entry; the head's sampling step in "progress"). 2: Stateful parts.
FORMAT_VERSION = 2
FORMAT_ENTRY = "format"


# ---------------------------------------------------------------------- save


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
                planner=RowsSavePlanner(),
                no_dist=no_dist,
            )
    except CheckpointException as exc:
        if is_main:  # nothing half-written stays behind; the previous checkpoints are intact
            shutil.rmtree(tmp, ignore_errors=True)
        error = _plain_error(exc, f"saving checkpoint {final} failed", OSError)
        if isinstance(error, OSError) and is_disk_full(error):
            error = OSError(write_failure(error, final))
        raise error from None
    # dcp.save returns on every rank once rank 0 has written .metadata: the files are complete.
    if is_main:
        _publish(tmp, final, run_dir, keep)
    distributed.barrier()
    return final


def _publish(tmp: Path, final: Path, run_dir: Path, keep: int) -> None:
    """Rename the complete `tmp` to `final`; drop all but the `keep` newest and leftovers."""
    if final.exists():  # the same step saved again (a resumed run): replace it
        shutil.rmtree(final)
    tmp.replace(final)
    fsync_dir(final.parent)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in final.parent.glob(TMP_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True)
    log.info("saved checkpoint %s", final)


# ---------------------------------------------------------------------- what it holds


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
        return dict(SafeReader(path).read_metadata().state_dict_metadata)
    except Exception as exc:
        raise ValueError(f"checkpoint {path}: cannot read its metadata ({exc})") from exc


def checkpoint_version(path: Path, entries: Mapping[str, Any] | None = None) -> int:
    """The layout version of the checkpoint at `path` (1 for one that records none)."""
    entries = checkpoint_entries(path) if entries is None else entries
    if FORMAT_ENTRY not in entries:
        return 1
    holder: dict[str, Any] = {FORMAT_ENTRY: None}
    with _quiet_single_process(True):
        dcp.load(holder, storage_reader=SafeReader(path), planner=SafeLoadPlanner(), no_dist=True)
    value = holder[FORMAT_ENTRY]
    if not isinstance(value, dict) or not isinstance(value.get("version"), int):
        raise ValueError(f"checkpoint {path}: malformed format entry {value!r}")
    return value["version"]


# ---------------------------------------------------------------------- load


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
    _check_version(path, entries)
    live, request = _plan_request(path, entries, parts, set(optional))
    _check_shapes(path, entries, request)
    _read_entries(path, request, collective)
    return _restore_parts(path, parts, live, request)


def _check_version(path: Path, entries: Mapping[str, Any]) -> None:
    version = checkpoint_version(path, entries)
    if version > FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {path}: format version {version}, this code reads versions up to "
            f"{FORMAT_VERSION}: update the code to resume it"
        )


def _plan_request(
    path: Path, entries: Mapping[str, Any], parts: Mapping[str, Any], optional: set[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What to read for `parts`: (the live `state_dict()` of each Stateful part by name,
    entry name -> the tensor to fill in place, or None for an object to read)."""
    live: dict[str, Any] = {}
    request: dict[str, Any] = {}
    for name, part in parts.items():
        if not is_stateful(part):
            if name in entries:
                request[name] = part if torch.is_tensor(part) else None
            elif name not in optional:
                raise ValueError(
                    f"checkpoint {path}: no entry {name!r}; it was saved by a different model "
                    "or precision level"
                )
            continue
        live[name] = part.state_dict()
        request.update(_request_stateful(path, entries, name, live[name], name in optional))
    return live, request


def _request_stateful(
    path: Path, entries: Mapping[str, Any], name: str, state: Any, optional: bool
) -> dict[str, Any]:
    """The entries to read for the Stateful part `name`, whose live state dict is `state`."""
    if name in entries:  # stored whole: an object, or an older layout of the part
        return {name: None}
    flat: dict[str, Any] = {}
    flatten(name, state, flat)
    found = {k: (v if torch.is_tensor(v) else None) for k, v in flat.items() if k in entries}
    if not found and not optional:
        raise ValueError(
            f"checkpoint {path}: no entry for {name!r}; it was saved by a different model "
            "or precision level"
        )
    return found


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


def _read_entries(path: Path, request: dict[str, Any], collective: bool) -> None:
    """Fill `request`'s tensors in place and replace its objects by the stored ones."""
    no_dist = not collective or distributed.world_size() == 1
    try:
        with _quiet_single_process(no_dist):
            dcp.load(
                request,
                storage_reader=SafeReader(path),
                planner=SafeLoadPlanner(),
                no_dist=no_dist,
            )
    except CheckpointException as exc:
        raise _plain_error(exc, f"checkpoint {path}: cannot be read", ValueError) from None


def _restore_parts(
    path: Path, parts: dict[str, Any], live: Mapping[str, Any], request: Mapping[str, Any]
) -> set[str]:
    """Hand each part what was read for it; returns the names of the parts found."""
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
            state = unflatten(name, live[name], request)
            if state is MISSING or (isinstance(state, Mapping) and not state):
                continue  # an optional part the checkpoint does not hold
        try:
            part.load_state_dict(state)
        except (RuntimeError, KeyError, ValueError) as exc:
            raise ValueError(f"checkpoint {path}: {name!r} cannot be restored: {exc}") from exc
        loaded.add(name)
    return loaded


# ---------------------------------------------------------------------- read whole


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
