import numpy as np
import pytest

from recognition.data.market1501 import JUNK_ID, list_folder, parse_name


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("0002_c1s1_000451_03.jpg", (2, 1)),
        ("1501_c6s4_001902_01.jpg", (1501, 6)),
        ("-1_c3s2_000100_00.jpg", (-1, 3)),
        ("0000_c5s3_094637_06.jpg", (0, 5)),
        ("some/dir/0042_c2s1_000001_00.jpg", (42, 2)),
        ("0005_c2_f0046985.jpg", (5, 2)),  # DukeMTMC-reID
    ],
)
def test_parse_name(name, expected):
    assert parse_name(name) == expected


@pytest.mark.parametrize("name", ["Thumbs.db", "abc_c1s1_0.jpg", "0002_x1s1_000451_03.jpg", ""])
def test_parse_name_rejects_and_names_the_file(name):
    with pytest.raises(ValueError, match="not a Market-1501 file name"):
        parse_name(name)


def test_list_folder(tmp_path):
    names = ["0002_c1s1_000451_03.jpg", "-1_c3s2_000100_00.jpg", "0001_c2s1_000001_00.jpg"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "Thumbs.db").write_bytes(b"")
    images = list_folder(tmp_path)
    assert images.paths == sorted(names)
    expected = {name: parse_name(name) for name in names}
    for path, pid, cam in zip(images.paths, images.person_ids, images.camera_ids, strict=True):
        assert (pid, cam) == expected[path]
    assert images.person_ids.dtype == np.int64
    kept = list_folder(tmp_path, keep_junk=False)
    assert JUNK_ID not in kept.person_ids and len(kept) == 2


def test_list_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        list_folder(tmp_path / "missing")
    with pytest.raises(ValueError, match="no Market-1501 images"):
        list_folder(tmp_path)
    (tmp_path / "bad_name.jpg").write_bytes(b"")
    with pytest.raises(ValueError, match="bad_name.jpg"):
        list_folder(tmp_path)
