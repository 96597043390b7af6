"""insightface .bin reading: Python 2 and 3 pickles load, anything else is refused unexecuted."""

from __future__ import annotations

import io
import os
import pickle
import struct

import numpy as np
import pytest
import torch
from PIL import Image

from recognition.data.insightface_bin import BinDataset, UnsafePickleError, load_bin
from recognition.data.transforms import center_crop, to_input_tensor


def encoded_images(num: int, size: int = 20, fmt: str = "PNG") -> list[bytes]:
    rng = np.random.default_rng(num)
    out = []
    for _ in range(num):
        buffer = io.BytesIO()
        pixels = rng.integers(0, 255, size=(size, size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(buffer, format=fmt)
        out.append(buffer.getvalue())
    return out


def python2_pickle(bins: list[bytes], issame: list[bool]) -> bytes:
    """The opcodes Python 2's cPickle writes at protocol 2 for (list of str, list of bool).

    Written by hand: Python 3 cannot produce a Python 2 `str` (BINSTRING) itself.
    """
    out = bytearray(b"\x80\x02")  # PROTO 2
    out += b"]("  # EMPTY_LIST, MARK
    for data in bins:
        out += b"T" + struct.pack("<I", len(data)) + data  # BINSTRING: a Python 2 str
    out += b"e"  # APPENDS
    out += b"]("
    for value in issame:
        out += b"\x88" if value else b"\x89"  # NEWTRUE / NEWFALSE
    out += b"e"
    out += b"\x86."  # TUPLE2, STOP
    return bytes(out)


@pytest.mark.parametrize("protocol", [2, 4, 5])
@pytest.mark.parametrize("issame_kind", ["list", "numpy", "numpy_scalars"])
@pytest.mark.parametrize("bins_kind", ["bytes", "uint8_arrays"])
def test_python3_pickles_load(tmp_path, protocol, issame_kind, bins_kind):
    bins = encoded_images(6)
    issame = [True, False, True]
    stored_bins = bins if bins_kind == "bytes" else [np.frombuffer(b, np.uint8) for b in bins]
    if issame_kind == "list":
        stored_issame = issame
    elif issame_kind == "numpy":
        stored_issame = np.array(issame)
    else:
        stored_issame = [np.bool_(v) for v in issame]
    path = tmp_path / "set.bin"
    path.write_bytes(pickle.dumps((stored_bins, stored_issame), protocol=protocol))
    loaded = load_bin(path)
    assert loaded.images == bins
    assert loaded.issame.dtype == bool and loaded.issame.tolist() == issame
    assert len(loaded) == 3


def test_python2_pickle_loads(tmp_path):
    # Bytes above 127 check that latin-1 decoding round-trips every byte value.
    bins = encoded_images(4) + [bytes(range(256)), b"\xff\xd8"]
    path = tmp_path / "py2.bin"
    path.write_bytes(python2_pickle(bins, [False, True, True]))
    loaded = load_bin(path)
    assert loaded.images == bins
    assert loaded.issame.tolist() == [False, True, True]


class RunsACommand:
    """What a crafted .bin holds: unpickling it calls os.system."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.mark.parametrize("where", ["top", "in_bins", "in_issame"])
def test_malicious_pickle_is_refused_and_nothing_runs(tmp_path, where):
    marker = tmp_path / "pwned"
    payload = RunsACommand(f"touch {marker}")
    # Sanity: the payload really runs a command when unpickled without restriction.
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(RunsACommand(f"touch {probe}")))
    assert probe.exists()

    bins = encoded_images(2)
    data = {
        "top": payload,
        "in_bins": ([bins[0], payload], [True]),
        "in_issame": (bins, [payload]),
    }[where]
    path = tmp_path / "evil.bin"
    path.write_bytes(pickle.dumps(data, protocol=2))
    with pytest.raises(UnsafePickleError) as info:
        load_bin(path)
    message = str(info.value)
    assert str(path) in message and "posix.system" in message
    assert not marker.exists()


@pytest.mark.parametrize(
    "global_name",
    [b"builtins\neval", b"__builtin__\neval", b"numpy\nload", b"subprocess\nPopen"],
)
def test_any_other_global_is_refused(tmp_path, global_name):
    path = tmp_path / "g.bin"
    # GLOBAL, then an argument tuple and REDUCE: refused at GLOBAL, before any call.
    path.write_bytes(b"\x80\x02c" + global_name + b"\nX\x01\x00\x00\x001\x85R.")
    with pytest.raises(UnsafePickleError, match=global_name.replace(b"\n", b".").decode()):
        load_bin(path)


def test_object_arrays_are_refused(tmp_path):
    path = tmp_path / "obj.bin"
    path.write_bytes(pickle.dumps((encoded_images(2), np.array([True], dtype=object))))
    with pytest.raises(ValueError, match="obj.bin"):
        load_bin(path)


@pytest.mark.parametrize(
    "data, match",
    [
        ((["x"] * 3, [True]), "3 images for 1 pairs"),
        ([1, 2, 3], "expected a pickled"),
        (([b"a", b"b"], [2]), "booleans"),
        (([], []), "no pairs"),
        (([b"a", 5], [True]), r"bins\[1\]"),
    ],
)
def test_malformed_contents_are_named(tmp_path, data, match):
    path = tmp_path / "bad.bin"
    path.write_bytes(pickle.dumps(data))
    with pytest.raises(ValueError, match=match) as info:
        load_bin(path)
    assert str(path) in str(info.value)


def test_truncated_and_missing_files(tmp_path):
    path = tmp_path / "cut.bin"
    path.write_bytes(pickle.dumps((encoded_images(2), [True]))[:-30])
    with pytest.raises(ValueError, match="cut.bin"):
        load_bin(path)
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        load_bin(tmp_path / "nope.bin")


def test_dataset_decodes_like_training_and_names_bad_images(tmp_path):
    bins = encoded_images(2, size=30)
    bins[1] = b"not an image"
    path = tmp_path / "set.bin"
    path.write_bytes(pickle.dumps((bins, [True])))
    dataset = BinDataset(load_bin(path), size=16, crop=20)
    assert dataset.size == (16, 16)
    expected = to_input_tensor(
        center_crop(Image.open(io.BytesIO(bins[0])).convert("RGB"), 20), (16, 16)
    )
    torch.testing.assert_close(dataset[0], expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"set.bin: image 1"):
        dataset[1]


def test_center_crop_takes_the_middle():
    pixels = np.arange(10 * 8 * 3, dtype=np.uint8).reshape(10, 8, 3)  # H=10, W=8
    cropped = np.asarray(center_crop(Image.fromarray(pixels), 4))
    np.testing.assert_array_equal(cropped, pixels[3:7, 2:6])
    # A crop larger than the image keeps the image.
    assert center_crop(Image.fromarray(pixels), 50).size == (8, 10)
