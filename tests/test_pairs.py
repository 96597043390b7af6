"""LFW protocol files: parsing both layouts, errors that name file and line, image lookup."""

import re

import numpy as np
import pytest

from recognition.data.pairs import Pairs, load_pairs, resolve_images, write_pairs

# Two folds of two pairs of each kind; tabs and spaces mixed as real files do.
VIEW2 = """2\t2
Abel_Pacheco\t1\t4
Akhmed_Zakayev  1 3
Abdel_Madi_Shabneh\t1\tDean_Barker\t1
Abdel_Madi_Shabneh 1 Giancarlo_Fisichella 1
Aaron_Peirsol\t1\t2
Aaron_Peirsol\t3\t4
Aaron_Sorkin\t2\tFrank_Solich\t5
Abdullah\t3\tMichael_Powell\t12
"""


def write(tmp_path, text, name="pairs.txt"):
    path = tmp_path / name
    path.write_text(text)
    return path


def error_at(path, line):
    """A regex matching an error message that starts by naming FILE:LINE."""
    return "^" + re.escape(f"{path}:{line}:")


def test_view2_layout(tmp_path):
    path = write(tmp_path, VIEW2)
    pairs = load_pairs(path)
    assert pairs.num_folds == 2
    assert len(pairs) == 8
    assert pairs.left[0] == "Abel_Pacheco/Abel_Pacheco_0001.jpg"
    assert pairs.right[0] == "Abel_Pacheco/Abel_Pacheco_0004.jpg"
    assert pairs.left[2] == "Abdel_Madi_Shabneh/Abdel_Madi_Shabneh_0001.jpg"
    assert pairs.right[2] == "Dean_Barker/Dean_Barker_0001.jpg"
    assert pairs.right[7] == "Michael_Powell/Michael_Powell_0012.jpg"
    np.testing.assert_array_equal(pairs.issame, [1, 1, 0, 0, 1, 1, 0, 0])
    np.testing.assert_array_equal(pairs.fold, [0, 0, 0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(pairs.line_numbers, np.arange(2, 10))
    assert pairs.issame.dtype == bool
    assert pairs.source == str(path)


def test_dev_layout_is_one_fold(tmp_path):
    text = "2\nA 1 2\nB 3 4\nA 1 B 2\nC 1 D 1\n"
    pairs = load_pairs(write(tmp_path, text, "pairsDevTest.txt"))
    assert pairs.num_folds == 1
    np.testing.assert_array_equal(pairs.issame, [1, 1, 0, 0])
    np.testing.assert_array_equal(pairs.fold, [0, 0, 0, 0])
    assert pairs.right[3] == "D/D_0001.jpg"


def test_blank_lines_are_skipped_but_line_numbers_kept(tmp_path):
    text = "\n1\t1\n\nA 1 2\n   \nA 1 B 2\n\n"
    pairs = load_pairs(write(tmp_path, text))
    np.testing.assert_array_equal(pairs.line_numbers, [4, 6])
    assert pairs.location(1) == f"{tmp_path / 'pairs.txt'}:6"


@pytest.mark.parametrize("ext", ["png", ".png"])
def test_extension_parameter(tmp_path, ext):
    pairs = load_pairs(write(tmp_path, "1\nA 1 2\nA 1 B 2\n"), ext=ext)
    assert pairs.left == ["A/A_0001.png", "A/A_0001.png"]
    assert pairs.right == ["A/A_0002.png", "B/B_0002.png"]


def test_images_lists_each_path_once_in_first_use_order(tmp_path):
    pairs = load_pairs(write(tmp_path, "1\nA 1 2\nA 2 B 1\n"))
    assert pairs.images() == ["A/A_0001.jpg", "A/A_0002.jpg", "B/B_0001.jpg"]


@pytest.mark.parametrize(
    "text, line, fragment",
    [
        # A different-pair line (4 fields) where fold 1 still expects a same pair.
        (
            "2 2\nA 1 2\nA 1 B 2\nA 1 B 2\nC 1 D 1\n" + "A 1 2\n" * 2 + "A 1 B 2\n" * 2,
            3,
            "expected 3 fields",
        ),
        # A same-pair line where a different pair is due.
        ("1 1\nA 1 2\nA 1 2\n", 3, "expected 4 fields"),
        ("1 1\nA 1 2 3 4 5\nA 1 B 2\n", 2, "expected 3 fields"),
        ("1 1\nA one 2\nA 1 B 2\n", 2, "must be an integer, got 'one'"),
        ("1 1\nA 1 2\nA 1 B 2.5\n", 3, "must be an integer, got '2.5'"),
        ("1 1\nA 1 -2\nA 1 B 2\n", 2, "must be >= 0"),
        ("1\nA 1 2\nA 1 ../B 2\n", 3, "identity name"),
        # Header problems are reported on the header's own line.
        ("A 1 2\nA 1 B 2\n", 1, "the header line is missing"),
        ("ten 300\nA 1 2\nA 1 B 2\n", 1, "must hold integers"),
        ("1 2 3 4 5\n", 1, "expected a header"),
        ("0 300\n", 1, ">= 1"),
        # The header promises more lines than the file has (last one cut off)...
        ("1 2\nA 1 2\nA 3 4\nA 1 B 2\n", 1, "promises 1 fold(s) x (2 same + 2 different) = 4"),
        # ...or fewer: the first extra line is named.
        ("1\nA 1 2\nA 1 B 2\nC 1 D 2\n", 4, "extra line"),
    ],
)
def test_malformed_files_name_file_and_line(tmp_path, text, line, fragment):
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=error_at(path, line)) as info:
        load_pairs(path)
    assert fragment in str(info.value)


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_empty_file(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=re.escape(f"{path}: empty pairs file")):
        load_pairs(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_pairs(tmp_path / "nope.txt")


def touch_images(root, paths):
    for p in paths:
        (root / p).parent.mkdir(parents=True, exist_ok=True)
        (root / p).write_bytes(b"")


def test_resolve_images_finds_other_extensions(tmp_path):
    pairs = load_pairs(write(tmp_path, "1\nA 1 2\nA 1 B 1\n"))
    root = tmp_path / "images"
    touch_images(root, ["A/A_0001.jpg", "A/A_0002.png", "B/B_0001.PGM"])
    resolved = resolve_images(pairs, root)
    assert resolved.left == ["A/A_0001.jpg", "A/A_0001.jpg"]
    assert resolved.right == ["A/A_0002.png", "B/B_0001.PGM"]
    np.testing.assert_array_equal(resolved.issame, pairs.issame)
    assert pairs.right[0] == "A/A_0002.jpg"  # the input is left as it was


def test_resolve_images_names_line_and_missing_path(tmp_path):
    path = write(tmp_path, "2\nA 1 2\nA 1 3\nA 1 B 1\nA 2 C 4\n")
    root = tmp_path / "images"
    touch_images(root, ["A/A_0001.jpg", "A/A_0002.jpg", "A/A_0003.jpg", "B/B_0001.jpg"])
    with pytest.raises(FileNotFoundError, match=error_at(path, 5)) as info:
        resolve_images(load_pairs(path), root)
    assert "C/C_0004.jpg" in str(info.value)
    assert str(root) in str(info.value)


def test_resolve_images_counts_other_missing_images(tmp_path):
    path = write(tmp_path, "1\nA 1 2\nB 1 C 1\n")
    root = tmp_path / "images"
    touch_images(root, ["A/A_0001.jpg"])
    with pytest.raises(FileNotFoundError, match=error_at(path, 2)) as info:
        resolve_images(load_pairs(path), root)
    assert "A/A_0002.jpg" in str(info.value)
    assert "2 more images are missing" in str(info.value)


def test_resolve_images_missing_root(tmp_path):
    pairs = load_pairs(write(tmp_path, "1\nA 1 2\nA 1 B 1\n"))
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        resolve_images(pairs, tmp_path / "no_such_dir")


@pytest.mark.parametrize("num_folds, dev_format", [(3, False), (1, True), (1, False)])
def test_write_then_load_round_trip(tmp_path, num_folds, dev_format):
    rng = np.random.default_rng(num_folds)
    names = [f"person_{i}" for i in range(6)]
    per_fold = 5
    same = [
        [
            (str(rng.choice(names)), int(rng.integers(1, 20)), int(rng.integers(1, 20)))
            for _ in range(per_fold)
        ]
        for _ in range(num_folds)
    ]
    different = [
        [
            (
                str(rng.choice(names)),
                int(rng.integers(1, 20)),
                str(rng.choice(names)),
                int(rng.integers(1, 20)),
            )
            for _ in range(per_fold)
        ]
        for _ in range(num_folds)
    ]
    path = tmp_path / "sub" / "pairs.txt"
    write_pairs(path, list(zip(same, different, strict=True)), dev_format=dev_format)
    first = path.read_text().splitlines()[0]
    assert first == (f"{per_fold}" if dev_format else f"{num_folds}\t{per_fold}")

    pairs = load_pairs(path, ext="png")
    assert pairs.num_folds == num_folds
    expected_left, expected_right, expected_same, expected_fold = [], [], [], []
    for f in range(num_folds):
        for name, n1, n2 in same[f]:
            expected_left.append(f"{name}/{name}_{n1:04d}.png")
            expected_right.append(f"{name}/{name}_{n2:04d}.png")
            expected_same.append(True)
            expected_fold.append(f)
        for name1, n1, name2, n2 in different[f]:
            expected_left.append(f"{name1}/{name1}_{n1:04d}.png")
            expected_right.append(f"{name2}/{name2}_{n2:04d}.png")
            expected_same.append(False)
            expected_fold.append(f)
    assert pairs.left == expected_left
    assert pairs.right == expected_right
    np.testing.assert_array_equal(pairs.issame, expected_same)
    np.testing.assert_array_equal(pairs.fold, expected_fold)
    assert not list(path.parent.glob(".*tmp"))  # no temporary file left behind


SAME = [("A", 1, 2)]
DIFF = [("A", 1, "B", 2)]


@pytest.mark.parametrize(
    "folds, kwargs, fragment",
    [
        ([], {}, "at least one fold"),
        ([(SAME, DIFF, DIFF)], {}, "folds[0] must be a (same, different) tuple"),
        ([(SAME, DIFF), (SAME, DIFF + DIFF)], {}, "folds[1] has 2 different pairs"),
        ([(SAME, DIFF), (SAME + SAME, DIFF)], {}, "folds[1] has 2 same pairs"),
        ([([], [])], {}, "a fold needs at least one"),
        ([(SAME, DIFF)] * 2, {"dev_format": True}, "one fold"),
        ([([("A B", 1, 2)], DIFF)], {}, "folds[0] same pair 0"),
        ([(SAME, [("A", 1, "B", -2)])], {}, "folds[0] different pair 0"),
        ([(SAME, [("A", 1, "B", True)])], {}, "folds[0] different pair 0"),
        ([(SAME, [("A", 1, "B")])], {}, "expected (name1, n1, name2, n2)"),
    ],
)
def test_write_pairs_rejects_bad_input(tmp_path, folds, kwargs, fragment):
    path = tmp_path / "pairs.txt"
    with pytest.raises(ValueError) as info:
        write_pairs(path, folds, **kwargs)
    assert fragment in str(info.value)
    assert not path.exists()


def test_pairs_checks_lengths():
    with pytest.raises(ValueError, match="issame has 1 entries but left has 2"):
        Pairs(["a", "b"], ["c", "d"], np.array([True]), np.array([0, 0]), num_folds=1)
