"""RecordIO (.rec/.idx): reading records written by an independent writer, the pack CLI's
round trip, multi-part records and the errors on damaged files."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from recognition.data import pack
from recognition.data.image_folder import ImageFolderDataset
from recognition.data.recordio import (
    RecordIODataset,
    RecordIOError,
    RecordReader,
    RecordWriter,
    pack_payload,
)

MAGIC = 0xCED7230A


def png_bytes(seed: int, size: tuple[int, int] = (12, 10), mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    array = rng.integers(0, 256, size=(size[0], size[1], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array).convert(mode).save(buffer, format="PNG")
    return buffer.getvalue()


def raw_record(payload: bytes, cflag: int = 0) -> bytes:
    """One record as the format describes it, packed by hand (independent of the module)."""
    pad = b"\0" * ((4 - len(payload) % 4) % 4)
    return struct.pack("<II", MAGIC, (cflag << 29) | len(payload)) + payload + pad


def raw_image_payload(label, image: bytes, id_: int) -> bytes:
    if isinstance(label, list):
        return (
            struct.pack("<IfQQ", len(label), 0.0, id_, 0)
            + struct.pack(f"<{len(label)}f", *label)
            + image
        )
    return struct.pack("<IfQQ", 0, float(label), id_, 0) + image


def write_insightface_pack(folder: Path, images: list[bytes], labels: list[int]) -> None:
    """train.rec/.idx laid out as insightface's packs, written with struct alone."""
    num_images = len(images)
    classes = sorted(set(labels))
    records = {}
    first = num_images + 1
    records[0] = raw_image_payload([float(first), float(first + len(classes))], b"", 0)
    for key, (image, label) in enumerate(zip(images, labels, strict=True), 1):
        records[key] = raw_image_payload(label, image, key)
    for c in classes:
        keys = [k for k, label in enumerate(labels, 1) if label == c]
        records[first + c] = raw_image_payload([float(keys[0]), float(keys[-1] + 1)], b"", 0)
    rec, idx = bytearray(), []
    # Written in a shuffled key order: readers must go by the .idx offsets, not the order.
    for key in np.random.default_rng(0).permutation(sorted(records)):
        idx.append(f"{key}\t{len(rec)}")
        rec += raw_record(records[int(key)])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.rec").write_bytes(bytes(rec))
    (folder / "train.idx").write_text("\n".join(idx) + "\n")


@pytest.fixture
def pack_dir(tmp_path: Path) -> tuple[Path, list[bytes], list[int]]:
    labels = [0, 0, 0, 1, 2, 2]
    images = [png_bytes(i) for i in range(len(labels))]
    write_insightface_pack(tmp_path / "pack", images, labels)
    return tmp_path / "pack", images, labels


def test_reader_reads_an_independently_written_pack(pack_dir):
    folder, images, labels = pack_dir
    dataset = RecordIODataset(folder, (12, 10))
    assert len(dataset) == 6 and dataset.num_classes == 3
    assert dataset.labels.tolist() == labels
    assert [dataset.class_name(c) for c in range(3)] == ["0", "1", "2"]
    for i in range(len(dataset)):
        assert dataset.encoded(i) == images[i]
        image, label = dataset[i]
        reference = np.asarray(Image.open(io.BytesIO(images[i])), dtype=np.float64)
        expected = torch.from_numpy(reference / 127.5 - 1.0).permute(2, 0, 1)
        torch.testing.assert_close(image.double(), expected, atol=1e-6, rtol=0)
        assert label == labels[i]


def test_pack_without_identity_section_reads_header_labels(tmp_path: Path):
    rec, idx = bytearray(), []
    labels = [3, 1, 1, 0]
    for key, label in enumerate(labels):
        idx.append(f"{key}\t{len(rec)}")
        rec += raw_record(raw_image_payload(label, png_bytes(key), key))
    (tmp_path / "train.rec").write_bytes(bytes(rec))
    (tmp_path / "train.idx").write_text("\n".join(idx) + "\n")
    dataset = RecordIODataset(tmp_path, 8)
    assert dataset.labels.tolist() == labels and dataset.num_classes == 4
    assert dataset[0][0].shape == (3, 8, 8)


def test_multi_part_record_is_joined_with_the_magic_word(tmp_path: Path):
    magic = struct.pack("<I", MAGIC)
    payload = b"abcd" + magic + b"efgh" + magic + b"ij"
    # By hand: the writer drops the aligned magic words and flags the parts 1, 2, 3.
    rec = raw_record(b"abcd", 1) + raw_record(b"efgh", 2) + raw_record(b"ij", 3)
    rec += raw_record(b"next")
    (tmp_path / "a.rec").write_bytes(rec)
    (tmp_path / "a.idx").write_text(f"0\t0\n1\t{len(rec) - 12}\n")
    reader = RecordReader(tmp_path / "a.rec", tmp_path / "a.idx")
    assert reader.read(0) == payload and reader.read(1) == b"next"

    # Our writer splits the same way, and an unaligned magic word stays inside its part.
    writer = RecordWriter(tmp_path / "b.rec", tmp_path / "b.idx")
    writer.write(0, payload)
    writer.write(1, b"x" + magic + b"yz")
    writer.close()
    assert (tmp_path / "b.rec").read_bytes() == rec[: len(rec) - 12] + raw_record(
        b"x" + magic + b"yz"
    )
    reader = RecordReader(tmp_path / "b.rec", tmp_path / "b.idx")
    assert reader.read(0) == payload and reader.read(1) == b"x" + magic + b"yz"


def make_folder(root: Path) -> None:
    for c, name in enumerate(["bob", "alice", "carol", "dave"]):
        (root / name).mkdir(parents=True)
        for n in range(c + 1):
            mode = "L" if (c + n) % 3 == 0 else "RGB"  # some grey images too
            (root / name / f"{n}.png").write_bytes(png_bytes(10 * c + n, (9, 7), mode))
    (root / "alice" / "notes.txt").write_text("not an image")


def test_pack_cli_round_trip(tmp_path: Path, capsys):
    make_folder(tmp_path / "faces")
    assert pack.main([str(tmp_path / "faces"), str(tmp_path / "packed"), "--threads", "2"]) == 0
    assert "packed 10 images of 4 identities" in capsys.readouterr().out
    folder = ImageFolderDataset(tmp_path / "faces", (9, 7))
    packed = RecordIODataset(tmp_path / "packed", (9, 7))
    assert len(packed) == len(folder) == 10
    assert packed.labels.tolist() == folder.labels.tolist()
    assert (tmp_path / "packed" / "classes.txt").read_text().split() == list(folder.classes)
    for i in range(len(folder)):
        assert packed.encoded(i) == (tmp_path / "faces" / folder.paths[i]).read_bytes()
        image_a, label_a = folder[i]
        image_b, label_b = packed[i]
        assert label_a == label_b and torch.equal(image_a, image_b)
    assert not list((tmp_path / "packed").glob("*.tmp"))


def test_pack_cli_errors_name_the_folder(tmp_path: Path, capsys):
    assert pack.main([str(tmp_path / "missing"), str(tmp_path / "out")]) == 1
    assert "missing" in capsys.readouterr().err
    (tmp_path / "f" / "empty_identity").mkdir(parents=True)
    (tmp_path / "f" / "x").mkdir()
    (tmp_path / "f" / "x" / "1.png").write_bytes(png_bytes(0))
    assert pack.main([str(tmp_path / "f"), str(tmp_path / "out")]) == 1
    assert "empty_identity" in capsys.readouterr().err
    assert not (tmp_path / "out" / "train.rec").exists()
    assert pack.main([str(tmp_path / "f"), str(tmp_path / "out"), "--skip-empty"]) == 0


def test_damaged_files_give_errors_naming_them(pack_dir, tmp_path: Path):
    folder, _, _ = pack_dir
    idx_text = (folder / "train.idx").read_text()
    rec = (folder / "train.rec").read_bytes()
    offsets = {int(k): int(v) for k, v in (line.split("\t") for line in idx_text.splitlines())}

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "train.rec").write_bytes(rec)
    (bad / "train.idx").write_text(idx_text.replace("\t", " x", 1))
    with pytest.raises(RecordIOError, match=r"bad/train.idx:1: expected 'key<TAB>offset'"):
        RecordIODataset(bad, 8)
    lines = idx_text.splitlines()
    (bad / "train.idx").write_text("\n".join(lines + [lines[0]]) + "\n")
    with pytest.raises(RecordIOError, match="appears twice"):
        RecordIODataset(bad, 8)

    # Bad magic at image 2's record.
    (bad / "train.idx").write_text(idx_text)
    damaged = bytearray(rec)
    damaged[offsets[2] : offsets[2] + 4] = b"\0\0\0\0"
    (bad / "train.rec").write_bytes(bytes(damaged))
    dataset = RecordIODataset(bad, 8)
    with pytest.raises(RecordIOError, match=r"bad/train.rec \(key 2, offset \d+\): bad magic"):
        dataset[1]

    # Truncated: the last record loses its tail; the reader says so when it gets there.
    last = max(offsets, key=offsets.get)
    (bad / "train.rec").write_bytes(rec[: offsets[last] + 20])
    reader = RecordReader(bad / "train.rec", bad / "train.idx")
    with pytest.raises(RecordIOError, match=f"key {last}.*truncated record"):
        reader.read(last)
    # Truncated before an offset of the .idx: caught when the pack is opened.
    (bad / "train.rec").write_bytes(rec[: offsets[last] - 8])
    with pytest.raises(RecordIOError, match="past the end of .*bad/train.rec"):
        RecordIODataset(bad, 8)

    # A corrupt image inside an intact record: the error names the record.
    writer = RecordWriter(bad / "train.rec", bad / "train.idx")
    writer.write(0, pack_payload(0.0, png_bytes(1)))
    writer.write(1, pack_payload(0.0, b"\xff\xd8 not really a jpeg"))
    writer.close()
    dataset = RecordIODataset(bad, 8)
    with pytest.raises(ValueError, match=r"bad/train.rec \(key 1\): cannot decode image"):
        dataset[1]


def test_header_label_disagreeing_with_the_identity_section_is_an_error(tmp_path: Path):
    images = [png_bytes(i) for i in range(3)]
    write_insightface_pack(tmp_path, images, [0, 1, 1])
    # Rewrite image 1's header label (key 1: label 0 -> 5) in place.
    idx = dict(line.split("\t") for line in (tmp_path / "train.idx").read_text().splitlines())
    rec = bytearray((tmp_path / "train.rec").read_bytes())
    label_at = int(idx["1"]) + 8 + 4  # record head, then the header's flag
    rec[label_at : label_at + 4] = struct.pack("<f", 5.0)
    (tmp_path / "train.rec").write_bytes(bytes(rec))
    dataset = RecordIODataset(tmp_path, 8)
    with pytest.raises(RecordIOError, match=r"key 1\): header label 5 differs from 0"):
        dataset[0]
