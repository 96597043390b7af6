"""Whether a checkpoint's files are whole, without reading its tensors: what
`train.resume=auto` asks of each checkpoint, newest first, before it loads one.

`.metadata` must read, and every item it names - one per entry and rank, `torch.save`d at
an offset of its data file - must lie within the file and look whole where it begins and
where it ends: DCP's file writer saves each item as a zip archive (a local file header at
its start, the end of its central directory in its last 22 bytes, pointing back inside
the item). So a lost or truncated file, a file cut in its last item, and an item whose
start or end was overwritten are found by a few small reads per item; a flipped bit inside
a tensor's data is not (the load reads every byte, and torch's reader checks what it can).
"""

from __future__ import annotations

import struct
from pathlib import Path

from recognition.checkpoint.files import METADATA_FILE
from recognition.checkpoint.planners import SafeReader

ZIP_HEAD = b"PK\x03\x04"  # a zip's first local file header
ZIP_END = b"PK\x05\x06"  # the end-of-central-directory record, 22 bytes without a comment
ZIP_END_SIZE = 22
# zip64's end-of-directory record (56 bytes) and its locator (20) before the plain record.
ZIP64_TAIL = ZIP_END_SIZE + 56 + 20


def verify_checkpoint(path: Path) -> str | None:
    """What makes the checkpoint at `path` unreadable, or None when its files look whole
    (see the module docstring); it reads no tensor data."""
    try:
        metadata = SafeReader(path).read_metadata()
    except Exception as exc:  # noqa: BLE001  (any damage: truncated pickle, foreign file)
        return f"its {METADATA_FILE} cannot be read ({exc})"
    items: dict[str, list[tuple[int, int]]] = {}
    for info in (metadata.storage_data or {}).values():
        items.setdefault(info.relative_path, []).append((info.offset, info.length))
    for name, extents in items.items():
        file = path / name
        if not file.is_file():
            return f"its data file {name} is missing"
        problem = _file_problem(file, sorted(extents))
        if problem is not None:
            return f"its data file {name} {problem}"
    return None


def _file_problem(file: Path, extents: list[tuple[int, int]]) -> str | None:
    """What is wrong with the items (offset, length) of one data file, or None."""
    size = file.stat().st_size
    needed = max(offset + length for offset, length in extents)
    if size < needed:
        return f"is truncated ({size} bytes, needs {needed})"
    with open(file, "rb") as stream:
        stream.seek(extents[0][0])
        if stream.read(4) != ZIP_HEAD:  # another writer's format: the sizes are all we know
            return None
        for number, (offset, length) in enumerate(extents):
            problem = _item_problem(stream, offset, length)
            if problem is not None:
                return f"is damaged in item {number + 1} of {len(extents)} ({problem})"
    return None


def _item_problem(stream, offset: int, length: int) -> str | None:
    """What is wrong with the zip archive of `length` bytes at `offset`, or None."""
    if length < 4 + ZIP_END_SIZE:
        return f"{length} bytes"
    stream.seek(offset)
    if stream.read(4) != ZIP_HEAD:
        return f"no zip header at byte {offset}"
    stream.seek(offset + length - ZIP_END_SIZE)
    end = stream.read(ZIP_END_SIZE)
    if end[:4] != ZIP_END:
        return f"no end of zip directory before byte {offset + length}"
    # The central directory's size and offset (from the item's start) end where this record
    # begins, or where the zip64 records before it begin (0xFFFFFFFF: kept in those).
    directory_size, directory_offset = struct.unpack("<II", end[12:20])
    if 0xFFFFFFFF in (directory_size, directory_offset):
        return None
    if directory_offset + directory_size not in (length - ZIP_END_SIZE, length - ZIP64_TAIL):
        return f"its zip directory does not end at byte {offset + length - ZIP_END_SIZE}"
    return None
