"""The built-in synthetic data set: determinism, layout, pairs file, markers, baseline."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from recognition.data.synthetic import (
    COMPLETE_MARKER,
    GENERATING_MARKER,
    SyntheticSpec,
    ensure_synthetic_dataset,
    generate_synthetic_dataset,
)
from recognition.evaluation.synthetic_baseline import main, pixel_cosine_baseline
from recognition.evaluation.verification import kfold_accuracy

TINY = SyntheticSpec(
    num_identities=8,
    images_per_identity=4,
    num_val_identities=6,
    val_images_per_identity=4,
    num_folds=3,
    pairs_per_fold=5,
    image_size=32,
    seed=3,
)


def all_files(root: Path) -> dict[str, bytes]:
    """Every file under `root` by relative path, with its bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory) -> Path:
    return ensure_synthetic_dataset(tmp_path_factory.mktemp("synthetic"), TINY, num_workers=1)


def test_generation_is_deterministic_and_independent_of_workers(tiny_root: Path, tmp_path: Path):
    again = ensure_synthetic_dataset(tmp_path / "again", TINY, num_workers=2)
    first, second = all_files(tiny_root), all_files(again)
    assert sorted(first) == sorted(second)
    assert all(first[name] == second[name] for name in first)

    other_seed = SyntheticSpec(**{**TINY.__dict__, "seed": 4})
    different = all_files(ensure_synthetic_dataset(tmp_path / "seed4", other_seed, num_workers=1))
    assert sorted(different) == sorted(first)
    assert sum(different[name] != first[name] for name in first if name.endswith(".jpg")) > 0.9 * (
        TINY.num_identities * TINY.images_per_identity
        + TINY.num_val_identities * TINY.val_images_per_identity
    )


def test_layout(tiny_root: Path):
    train = sorted(p.name for p in (tiny_root / "train").iterdir())
    assert train == [f"id_{i:05d}" for i in range(TINY.num_identities)]
    for name in train:
        files = sorted(p.name for p in (tiny_root / "train" / name).iterdir())
        assert files == sorted(f"{n}.jpg" for n in range(TINY.images_per_identity))
    val = sorted(p.name for p in (tiny_root / "val").iterdir() if p.is_dir())
    assert len(val) == TINY.num_val_identities and not set(val) & set(train)
    for name in val:
        files = sorted(p.name for p in (tiny_root / "val" / name).iterdir())
        assert files == [f"{name}_{n:04d}.jpg" for n in range(1, TINY.val_images_per_identity + 1)]
    with Image.open(tiny_root / "train" / train[0] / "0.jpg") as image:
        assert image.format == "JPEG" and image.mode == "RGB"
        assert image.size == (TINY.image_size, TINY.image_size)
    marker = json.loads((tiny_root / COMPLETE_MARKER).read_text())
    assert marker == TINY.to_json()
    assert marker["num_identities"] == TINY.num_identities
    assert not (tiny_root / GENERATING_MARKER).exists()


def test_images_of_an_identity_vary(tiny_root: Path):
    """Every image is a new draw of pose, background and lighting, never a copy."""
    folder = tiny_root / "train" / "id_00000"
    images = [np.asarray(Image.open(folder / f"{n}.jpg"), dtype=np.float64) for n in range(4)]
    for a in range(4):
        for b in range(a + 1, 4):
            assert np.abs(images[a] - images[b]).mean() > 10.0


def test_pairs_file_is_well_formed_lfw_view2(tiny_root: Path):
    lines = (tiny_root / "val" / "pairs.txt").read_text().splitlines()
    assert lines[0] == f"{TINY.num_folds}\t{TINY.pairs_per_fold}"
    body = [line.split("\t") for line in lines[1:]]
    per_fold = 2 * TINY.pairs_per_fold
    assert len(body) == TINY.num_folds * per_fold
    identities_by_fold = []
    for fold in range(TINY.num_folds):
        chunk = body[fold * per_fold : (fold + 1) * per_fold]
        same, different = chunk[: TINY.pairs_per_fold], chunk[TINY.pairs_per_fold :]
        assert all(len(fields) == 3 for fields in same)
        assert all(len(fields) == 4 for fields in different)
        names = set()
        for name, n1, n2 in same:
            assert int(n1) != int(n2)
            names.add(name)
            for n in (n1, n2):
                assert 1 <= int(n) <= TINY.val_images_per_identity
                assert (tiny_root / "val" / name / f"{name}_{int(n):04d}.jpg").is_file()
        for name1, n1, name2, n2 in different:
            assert name1 != name2
            names.update((name1, name2))
            for name, n in ((name1, n1), (name2, n2)):
                assert (tiny_root / "val" / name / f"{name}_{int(n):04d}.jpg").is_file()
        assert len({tuple(f) for f in same}) == len(same)  # no repeated pair
        assert len({tuple(f) for f in different}) == len(different)
        identities_by_fold.append(names)
    # Folds are identity-disjoint, as in LFW View 2.
    for a in range(TINY.num_folds):
        for b in range(a + 1, TINY.num_folds):
            assert not identities_by_fold[a] & identities_by_fold[b]


def test_existing_dataset_is_reused(tiny_root: Path, caplog):
    before = {p: p.stat().st_mtime_ns for p in tiny_root.rglob("*.jpg")}
    with caplog.at_level(logging.INFO, logger="recognition.data.synthetic"):
        assert ensure_synthetic_dataset(tiny_root, TINY) == tiny_root
    assert not caplog.records
    assert before == {p: p.stat().st_mtime_ns for p in tiny_root.rglob("*.jpg")}


def test_generation_logs_one_info_line(tmp_path: Path, caplog):
    with caplog.at_level(logging.INFO, logger="recognition.data.synthetic"):
        ensure_synthetic_dataset(tmp_path / "new", TINY, num_workers=1)
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(messages) == 1
    assert "Generating" in messages[0] and str(tmp_path / "new") in messages[0]


def test_interrupted_generation_is_redone(tiny_root: Path, tmp_path: Path, monkeypatch):
    root = tmp_path / "broken"

    def fail_after_half(*args, **kwargs):
        raise KeyboardInterrupt

    import recognition.data.synthetic.generation as generation

    monkeypatch.setattr(generation, "write_lfw_pairs", fail_after_half)
    with pytest.raises(KeyboardInterrupt):
        ensure_synthetic_dataset(root, TINY, num_workers=1)
    monkeypatch.undo()
    assert (root / GENERATING_MARKER).exists() and not (root / COMPLETE_MARKER).exists()
    (root / "train" / "id_00000" / "0.jpg").write_bytes(b"half-written")
    ensure_synthetic_dataset(root, TINY, num_workers=1)
    assert all_files(root) == all_files(tiny_root)


def test_changed_spec_regenerates(tmp_path: Path):
    root = ensure_synthetic_dataset(tmp_path / "d", TINY, num_workers=1)
    smaller = SyntheticSpec(**{**TINY.__dict__, "num_identities": 5})
    ensure_synthetic_dataset(root, smaller, num_workers=1)
    assert len(list((root / "train").iterdir())) == 5
    assert json.loads((root / COMPLETE_MARKER).read_text())["num_identities"] == 5


def test_refuses_a_foreign_directory(tmp_path: Path):
    root = tmp_path / "mine"
    (root / "train" / "someone").mkdir(parents=True)
    (root / "train" / "someone" / "photo.jpg").write_bytes(b"precious")
    with pytest.raises(ValueError, match="refusing"):
        ensure_synthetic_dataset(root, TINY)
    assert (root / "train" / "someone" / "photo.jpg").read_bytes() == b"precious"


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"num_identities": 0}, "num_identities"),
        ({"image_size": 8}, "image_size"),
        ({"val_images_per_identity": 1}, "val_images_per_identity"),
        ({"num_val_identities": 5}, "num_val_identities"),  # < 2 per fold
        ({"pairs_per_fold": 500}, "pairs_per_fold"),  # more than the folds can form
        ({"seed": -1}, "seed"),
    ],
)
def test_spec_validation_names_the_field(changes: dict, field: str):
    with pytest.raises(ValueError, match=f"SyntheticSpec.{field}"):
        SyntheticSpec(**{**TINY.__dict__, **changes})


def test_kfold_accuracy_against_hand_computed_cases():
    # Separable scores: every fold's threshold from the other folds is perfect.
    same = np.array([True, False] * 10)
    folds = np.repeat(np.arange(5), 4)
    scores = np.where(same, 0.9, 0.1) + np.linspace(0, 0.05, 20)
    assert kfold_accuracy(scores, same, folds) == 1.0
    # One "same" pair per fold scores lowest of all: any threshold learnt on the other folds
    # (which separates everything else) misclassifies exactly it, i.e. 3 of 4 right per fold.
    scores = np.where(same, 0.9, 0.1)
    scores[np.arange(0, 20, 4)] = -1.0
    assert kfold_accuracy(scores, same, folds) == pytest.approx(0.75)


def brute_force_kfold_accuracy(scores: np.ndarray, same: np.ndarray, folds: np.ndarray) -> float:
    """Reference: try every cut between distinct training scores, keep the lowest best one."""
    accuracies = []
    for fold in np.unique(folds):
        test = folds == fold
        distinct = np.unique(scores[~test])
        candidates = np.concatenate(
            [[distinct[0] - 1.0], (distinct[1:] + distinct[:-1]) / 2.0, [distinct[-1] + 1.0]]
        )
        train_accuracy = [((scores[~test] > t) == same[~test]).mean() for t in candidates]
        threshold = candidates[int(np.argmax(train_accuracy))]
        accuracies.append(((scores[test] > threshold) == same[test]).mean())
    return float(np.mean(accuracies))


@pytest.mark.parametrize("seed", range(5))
def test_kfold_accuracy_against_brute_force(seed: int):
    rng = np.random.default_rng(seed)
    same = rng.random(120) < 0.5
    # Overlapping classes, rounded so that many scores tie.
    scores = np.round(rng.normal(np.where(same, 0.6, 0.3), 0.2), 1)
    folds = np.repeat(np.arange(6), 20)
    expected = brute_force_kfold_accuracy(scores, same, folds)
    assert kfold_accuracy(scores, same, folds) == pytest.approx(expected, abs=1e-12)


def test_pixel_cosine_baseline_matches_an_independent_computation(tiny_root: Path):
    lines = (tiny_root / "val" / "pairs.txt").read_text().splitlines()[1:]

    def pixels(name: str, n: str) -> np.ndarray:
        path = tiny_root / "val" / name / f"{name}_{int(n):04d}.jpg"
        return np.asarray(Image.open(path).convert("RGB"), dtype=np.float64).ravel()

    scores, same = [], []
    for line in lines:
        fields = line.split("\t")
        if len(fields) == 3:
            a, b = pixels(fields[0], fields[1]), pixels(fields[0], fields[2])
        else:
            a, b = pixels(fields[0], fields[1]), pixels(fields[2], fields[3])
        scores.append(np.corrcoef(a, b)[0, 1])  # cosine of mean-centred vectors
        same.append(len(fields) == 3)
    folds = np.arange(len(lines)) // (2 * TINY.pairs_per_fold)
    expected = kfold_accuracy(np.array(scores), np.array(same), folds)
    got = pixel_cosine_baseline(tiny_root)
    assert 0.0 <= got <= 1.0
    assert got == pytest.approx(expected, abs=1e-12)


def test_command_line(tmp_path: Path, capsys):
    args = ["--out", str(tmp_path / "cli"), "--workers", "1"]
    for name, value in TINY.__dict__.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    main(args)
    assert "pixel-cosine baseline accuracy" in capsys.readouterr().out
    assert json.loads((tmp_path / "cli" / COMPLETE_MARKER).read_text()) == TINY.to_json()


def test_generate_into_existing_empty_directory(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    ensure_synthetic_dataset(tmp_path / "empty", TINY, num_workers=1)
    assert (tmp_path / "empty" / COMPLETE_MARKER).exists()
    generate_synthetic_dataset(tmp_path / "direct", TINY, num_workers=1)
    assert all_files(tmp_path / "direct") == all_files(tmp_path / "empty")


def test_blur_matches_a_scipy_convolution():
    from scipy.ndimage import correlate

    from recognition.data.synthetic import _blur_rows

    rgb = np.random.default_rng(0).uniform(0, 255, size=(9, 7, 3))
    centre = 2.5
    kernel_1d = np.array([1.0, centre, 1.0]) / (centre + 2.0)
    kernel = np.outer(kernel_1d, kernel_1d)[:, :, None]  # (3, 3, 1): channels blurred apart
    expected = correlate(rgb, kernel, mode="nearest")
    got = _blur_rows(rgb.astype(np.float32).reshape(9, 21), centre, channels=3).reshape(9, 7, 3)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-3)
