"""MXNet / insightface RecordIO (`train.rec` + `train.idx`), read and written without mxnet.

**The .rec file** is a sequence of records, each

    uint32 magic 0xced7230a | uint32 lrecord | payload | zero padding to a multiple of 4

little-endian; the low 29 bits of `lrecord` are the payload length, the upper 3 bits a
continuation flag: 0 a whole record; 1, 2, 3 the first, middle and last part of a record
that the writer split where its data held the magic word at a 4-byte-aligned offset (the
magic word itself is not stored: a reader puts it back between the parts).

**The payload** of an image record is the image header `IfQQ` - flag (uint32), label
(float32), id (uint64), id2 (uint64) - then, when flag > 0, `flag` float32 labels that
replace the header's label, then the encoded image (JPEG as distributed).

**The .idx file** is text, one `key<TAB>offset` line per record: the byte offset of the
record's magic word in the .rec file.

**insightface's packs** (MS1M-ArcFace, MS1MV2/3, Glint360K, WebFace) put a header-only
record at key 0 whose labels are [first identity key, end key]. Keys 1 .. first-1 are the
images, in identity order, each with its class id as label; keys first .. end-1 are one
record per identity whose labels are the [start, stop) image keys of that identity. A pack
without that record 0 (flag 0) is read as images only, labels from every image header.

`RecordIODataset` opens its file handle lazily in each process (a handle inherited through
fork would share its file offset with the parent and the other workers) and holds the index
as two int64 arrays.
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from PIL import Image

from recognition.data.source import BadImagePolicy, TrainSource
from recognition.data.transforms import decode_rgb

log = logging.getLogger(__name__)

MAGIC = 0xCED7230A
_MAGIC_BYTES = struct.pack("<I", MAGIC)
_RECORD_HEAD = struct.Struct("<II")  # magic, lrecord
IMAGE_HEADER = struct.Struct("<IfQQ")  # flag, label, id, id2
_LENGTH_MASK = (1 << 29) - 1
MAX_RECORD_BYTES = _LENGTH_MASK


class RecordIOError(ValueError):
    """A .rec or .idx file that does not follow the format (the message names it)."""


@dataclass(frozen=True)
class ImageHeader:
    """The header of an image record. `labels` holds the flag > 0 labels, else (label,)."""

    flag: int
    label: float
    id: int
    id2: int
    labels: tuple[float, ...]


# ---------------------------------------------------------------------- payloads


def pack_payload(
    label: float | tuple[float, ...], image: bytes, id: int = 0, id2: int = 0
) -> bytes:
    """An image record's payload: header (and label array when `label` is a tuple), image."""
    if isinstance(label, tuple):
        head = IMAGE_HEADER.pack(len(label), 0.0, id, id2)
        return head + struct.pack(f"<{len(label)}f", *label) + image
    return IMAGE_HEADER.pack(0, float(label), id, id2) + image


def unpack_payload(payload: bytes, where: str) -> tuple[ImageHeader, bytes]:
    """(header, encoded image) of an image record's payload; RecordIOError naming `where`."""
    if len(payload) < IMAGE_HEADER.size:
        raise RecordIOError(f"{where}: record of {len(payload)} bytes is shorter than its header")
    flag, label, id_, id2 = IMAGE_HEADER.unpack_from(payload)
    start = IMAGE_HEADER.size
    if flag > 0:
        end = start + 4 * flag
        if end > len(payload):
            raise RecordIOError(f"{where}: header announces {flag} labels past the record's end")
        labels = struct.unpack_from(f"<{flag}f", payload, start)
        start = end
    else:
        labels = (label,)
    return ImageHeader(flag, label, id_, id2, tuple(labels)), payload[start:]


# ---------------------------------------------------------------------- the .idx file


def read_idx(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """(keys, offsets) of the .idx file `path`, two int64 arrays sorted by key.

    Raises RecordIOError naming the file and line for a malformed line or a repeated key.
    """
    path = Path(path)
    data = path.read_bytes()
    lines = data.split(b"\n")
    if lines and lines[-1].strip() == b"":
        lines.pop()
    # Fast path: every line is two integers. On any surprise, the slow path finds the line.
    try:
        table = np.array(data.split(), dtype=np.int64).reshape(-1, 2)
        ok = len(table) == len(lines)
    except ValueError:
        ok = False
    if not ok:
        for number, line in enumerate(lines, 1):
            fields = line.split()
            if len(fields) != 2 or not all(f.lstrip(b"-").isdigit() for f in fields):
                raise RecordIOError(
                    f"{path}:{number}: expected 'key<TAB>offset', got {line[:60]!r}"
                )
        raise RecordIOError(f"{path}: cannot parse")  # pragma: no cover (lines all parsed)
    keys, offsets = table[:, 0], table[:, 1]
    if len(keys) and (keys.min() < 0 or offsets.min() < 0):
        bad = int(np.flatnonzero((keys < 0) | (offsets < 0))[0])
        raise RecordIOError(f"{path}:{bad + 1}: negative key or offset")
    order = np.argsort(keys, kind="stable")
    keys, offsets = keys[order], offsets[order]
    repeated = np.flatnonzero(keys[1:] == keys[:-1])
    if len(repeated):
        raise RecordIOError(f"{path}: key {int(keys[repeated[0]])} appears twice")
    return np.ascontiguousarray(keys), np.ascontiguousarray(offsets)


# ---------------------------------------------------------------------- reading


class RecordReader:
    """Random access to the records of `rec_path` through the offsets of `idx_path`."""

    def __init__(self, rec_path: str | os.PathLike, idx_path: str | os.PathLike) -> None:
        self.rec_path = Path(rec_path)
        self.idx_path = Path(idx_path)
        if not self.rec_path.is_file():
            raise FileNotFoundError(f"{self.rec_path}: no such RecordIO file")
        if not self.idx_path.is_file():
            raise FileNotFoundError(f"{self.idx_path}: no such RecordIO index")
        self.keys, self.offsets = read_idx(self.idx_path)
        self.size = self.rec_path.stat().st_size
        beyond = np.flatnonzero(self.offsets + _RECORD_HEAD.size > self.size)
        if len(beyond):
            raise RecordIOError(
                f"{self.idx_path}: key {int(self.keys[beyond[0]])} points at offset "
                f"{int(self.offsets[beyond[0]])}, past the end of {self.rec_path} "
                f"({self.size} bytes): truncated .rec or the wrong .idx"
            )
        # Keys 0..N-1 (the usual case) index the offsets directly.
        self._dense = bool(len(self.keys) == 0 or self.keys[-1] == len(self.keys) - 1)
        self._file: BinaryIO | None = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.keys)

    def _handle(self) -> BinaryIO:
        # One handle per process: a handle inherited through fork shares its offset.
        if self._file is None or self._pid != os.getpid():
            self._file = open(self.rec_path, "rb")  # noqa: SIM115 (lives as long as the reader)
            self._pid = os.getpid()
        return self._file

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_file"], state["_pid"] = None, -1
        return state

    def offset(self, key: int) -> int:
        if self._dense:
            if not 0 <= key < len(self.keys):
                raise KeyError(f"{self.idx_path}: no key {key}")
            return int(self.offsets[key])
        position = int(np.searchsorted(self.keys, key))
        if position >= len(self.keys) or self.keys[position] != key:
            raise KeyError(f"{self.idx_path}: no key {key}")
        return int(self.offsets[position])

    def read(self, key: int) -> bytes:
        """The payload of record `key` (parts of a split record joined back)."""
        offset = self.offset(key)
        where = f"{self.rec_path} (key {key}, offset {offset})"
        f = self._handle()
        f.seek(offset)
        parts: list[bytes] = []
        while True:
            head = f.read(_RECORD_HEAD.size)
            if len(head) < _RECORD_HEAD.size:
                raise RecordIOError(f"{where}: truncated record header")
            magic, lrecord = _RECORD_HEAD.unpack(head)
            if magic != MAGIC:
                raise RecordIOError(
                    f"{where}: bad magic 0x{magic:08x} (expected 0x{MAGIC:08x}): not a "
                    "RecordIO file, or an .idx that does not belong to it"
                )
            cflag, length = lrecord >> 29, lrecord & _LENGTH_MASK
            data = f.read(length)
            if len(data) < length:
                raise RecordIOError(f"{where}: truncated record ({len(data)} of {length} bytes)")
            if cflag == 0 and not parts:
                return data
            expected = (1,) if not parts else (2, 3)
            if cflag not in expected:
                raise RecordIOError(f"{where}: continuation flag {cflag} out of sequence")
            parts.append(data)
            if cflag == 3:
                return _MAGIC_BYTES.join(parts)
            f.seek((-length) % 4, os.SEEK_CUR)

    def read_image(self, key: int) -> tuple[ImageHeader, bytes]:
        """(header, encoded image bytes) of image record `key`."""
        return unpack_payload(self.read(key), f"{self.rec_path} (key {key})")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# ---------------------------------------------------------------------- writing


class RecordWriter:
    """Writes a .rec and its .idx (to `<path>.tmp` files, renamed into place on `close`)."""

    def __init__(self, rec_path: str | os.PathLike, idx_path: str | os.PathLike) -> None:
        self.rec_path = Path(rec_path)
        self.idx_path = Path(idx_path)
        self._rec_tmp = self.rec_path.with_name(self.rec_path.name + ".tmp")
        self._idx_tmp = self.idx_path.with_name(self.idx_path.name + ".tmp")
        self._rec = open(self._rec_tmp, "wb")  # noqa: SIM115
        self._idx = open(self._idx_tmp, "w")  # noqa: SIM115

    def write(self, key: int, payload: bytes) -> None:
        """Append record `key`, split where the payload holds the magic word (as dmlc does)."""
        if len(payload) > MAX_RECORD_BYTES:
            raise ValueError(f"{self.rec_path}: record {key} is over {MAX_RECORD_BYTES} bytes")
        self._idx.write(f"{key}\t{self._rec.tell()}\n")
        cuts = []
        found = payload.find(_MAGIC_BYTES)
        while found >= 0:
            if found % 4 == 0:  # only aligned occurrences could be mistaken for a record start
                cuts.append(found)
                found = payload.find(_MAGIC_BYTES, found + 4)
            else:
                found = payload.find(_MAGIC_BYTES, found + 1)
        if not cuts:
            self._part(0, payload)
            return
        start = 0
        for number, cut in enumerate(cuts):
            self._part(1 if number == 0 else 2, payload[start:cut])
            start = cut + 4
        self._part(3, payload[start:])

    def write_image(self, key: int, label: float | tuple[float, ...], image: bytes) -> None:
        self.write(key, pack_payload(label, image, id=key))

    def _part(self, cflag: int, data: bytes) -> None:
        self._rec.write(_RECORD_HEAD.pack(MAGIC, (cflag << 29) | len(data)))
        self._rec.write(data)
        self._rec.write(b"\0" * ((-len(data)) % 4))

    def close(self) -> None:
        for f in (self._rec, self._idx):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        os.replace(self._rec_tmp, self.rec_path)
        os.replace(self._idx_tmp, self.idx_path)

    def abort(self) -> None:
        """Close and remove the temporary files (nothing replaces an existing pack)."""
        for f, tmp in ((self._rec, self._rec_tmp), (self._idx, self._idx_tmp)):
            f.close()
            tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------- the dataset


class RecordIODataset(TrainSource):
    """The images of an insightface pack `root/train.rec` + `root/train.idx` as a dataset.

    Samples are the image records in key order; `labels` come from record 0's identity
    section when there is one (identity i is the i-th identity record, which insightface's
    packs keep in class order; each image's own header label is checked against it when
    read), else from every image header (a full pass over the file). Class names are the
    label numbers. Decoding as `ImageFolderDataset` (any mode to RGB, resized, [-1, 1]).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        image_size: int | tuple[int, int],
        *,
        train: bool = False,
        on_bad_image: BadImagePolicy = "error",
        rec_name: str = "train",
    ) -> None:
        super().__init__(root, image_size, train=train, on_bad_image=on_bad_image)
        self.reader = RecordReader(self.root / f"{rec_name}.rec", self.root / f"{rec_name}.idx")
        self.image_keys, self.labels = _image_keys_and_labels(self.reader)
        self._num_classes = int(self.labels.max()) + 1 if len(self.labels) else 0
        if len(self.labels) == 0:
            raise RecordIOError(f"{self.reader.rec_path}: holds no image records")

    @property
    def num_classes(self) -> int:
        return self._num_classes

    def class_name(self, label: int) -> str:
        return str(label)

    def describe(self, index: int) -> str:
        return f"{self.reader.rec_path} (key {int(self.image_keys[index])})"

    def encoded(self, index: int) -> bytes:
        """The encoded image bytes of sample `index` (its header label checked)."""
        key = int(self.image_keys[index])
        header, image = self.reader.read_image(key)
        if int(header.labels[0]) != int(self.labels[index]):
            raise RecordIOError(
                f"{self.reader.rec_path} (key {key}): header label {header.labels[0]:g} "
                f"differs from {int(self.labels[index])}, its identity's number in record 0's "
                "identity section: the pack's identities are not in label order"
            )
        return image

    def decode(self, index: int) -> Image.Image:
        return decode_rgb(self.encoded(index), self.describe(index))


def _image_keys_and_labels(reader: RecordReader) -> tuple[np.ndarray, np.ndarray]:
    """(image keys, int32 labels) of a pack, from record 0's identity section if it has one."""
    if len(reader) == 0:
        raise RecordIOError(f"{reader.idx_path}: no records")
    if int(reader.keys[0]) == 0:
        header0, _ = reader.read_image(0)
        if header0.flag >= 2:
            first, end = (int(v) for v in header0.labels[:2])
            if not 1 <= first <= end:
                raise RecordIOError(
                    f"{reader.rec_path} (key 0): identity range [{first}, {end}) is invalid"
                )
            image_keys = np.arange(1, first, dtype=np.int64)
            if end > first:
                labels = np.empty(len(image_keys), dtype=np.int32)
                labels.fill(-1)
                for label, key in enumerate(range(first, end)):
                    header, _ = reader.read_image(key)
                    start, stop = (int(v) for v in header.labels[:2])
                    if not 1 <= start <= stop <= first:
                        raise RecordIOError(
                            f"{reader.rec_path} (key {key}): identity {label} spans image keys "
                            f"[{start}, {stop}), outside 1..{first - 1}"
                        )
                    labels[start - 1 : stop - 1] = label
                if (labels < 0).any():
                    missing = int(image_keys[np.flatnonzero(labels < 0)[0]])
                    raise RecordIOError(
                        f"{reader.rec_path}: image key {missing} belongs to no identity record"
                    )
                return image_keys, labels
            return image_keys, _labels_from_headers(reader, image_keys)
    keys = reader.keys
    return keys, _labels_from_headers(reader, keys)


def _labels_from_headers(reader: RecordReader, keys: np.ndarray) -> np.ndarray:
    log.info("%s: reading the label of every record (no identity section)", reader.rec_path)
    labels = np.empty(len(keys), dtype=np.int32)
    for i, key in enumerate(keys):
        header, _ = reader.read_image(int(key))
        labels[i] = int(header.labels[0])
    if len(labels) and labels.min() < 0:
        raise RecordIOError(f"{reader.rec_path}: negative label {int(labels.min())}")
    return labels
