"""DCP's planners and file reader as the checkpoints use them: class rows written and read
as chunks of one global tensor, and the `.metadata` index read as data, never code.

Class rows. Each rank passes its shard of the class matrix, of its master and of their
optimizer state as the plain local tensor marked with the global shape (num_classes, ...)
and the global row where the shard starts (`recognition.sharded`: the head records its
rows' placement, Precision and the optimizer adapter copy it to the tensors that stand for
them). The planners here (`RowsSavePlanner`, `SafeLoadPlanner`) plan those rows as
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

A checkpoint is data, never code: objects are read back with `torch.load(weights_only=True)`
and DCP's `.metadata` index (a pickle) with an allow-list of DCP's own metadata types.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    Metadata,
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


class SafeReader(FileSystemReader):
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


class RowsSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, with `rows_of` tensors written as chunks of one tensor.

    The rows are planned here rather than through a DCP tensor protocol so that the same
    code saves (and `SafeLoadPlanner` reshards) on every supported torch release.
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


class SafeLoadPlanner(DefaultLoadPlanner):
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
