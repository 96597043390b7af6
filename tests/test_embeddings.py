"""Embedding extraction (flip, sum, normalise), image loading, .npz export, pair scoring."""

import copy

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from recognition.data.pairs import load_pairs
from recognition.evaluation.embeddings import (
    PathDataset,
    extract_embeddings,
    index_paths,
    load_embeddings,
    load_image,
    pair_scores,
    save_embeddings,
    verify_pairs,
)
from recognition.evaluation.verification import balanced_folds, evaluate_verification


def tiny_model(seed=0, embedding_size=5):
    """Conv + BatchNorm (whose train/eval outputs differ) + linear: not flip-invariant."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, stride=2),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, embedding_size),
    )
    # Non-trivial running statistics, so eval mode is distinguishable from train mode.
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    return model


def reference_embeddings(model, images, flip):
    """float64 copy of the model, one image at a time, flip summed and normalised by hand."""
    model64 = copy.deepcopy(model).double().eval()
    out = []
    with torch.no_grad():
        for x in images.double():
            e = model64(x[None])[0]
            if flip:
                e = e + model64(x.flip(-1)[None])[0]  # width is the last axis of CHW
            out.append((e / torch.sqrt((e * e).sum())).numpy())
    return np.stack(out)


class TupleDataset(Dataset):
    def __init__(self, images):
        self.images = images

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], i  # (image, label)


@pytest.mark.parametrize("flip", [True, False])
def test_flip_sum_normalise_matches_manual(flip):
    model = tiny_model()
    model.train()
    images = torch.rand(11, 3, 8, 8) * 2 - 1
    got = extract_embeddings(model, TupleDataset(images), batch_size=4, flip=flip, progress=False)
    assert got.dtype == np.float32 and got.shape == (11, 5)
    np.testing.assert_allclose(got, reference_embeddings(model, images, flip), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    assert model.training  # mode restored


def test_flip_changes_the_embedding():
    # Guards the test above: for this model the flip must matter, or it proves nothing.
    model = tiny_model()
    images = torch.rand(3, 3, 8, 8) * 2 - 1
    with_flip = extract_embeddings(model, images, batch_size=2, flip=True, progress=False)
    without = extract_embeddings(model, images, batch_size=2, flip=False, progress=False)
    assert np.abs(with_flip - without).max() > 1e-2


def test_accepts_dataloader_and_plain_tensor_dataset():
    model = tiny_model(1)
    images = torch.rand(7, 3, 8, 8) * 2 - 1
    loader = DataLoader(TensorDataset(images, torch.arange(7)), batch_size=3)
    got = extract_embeddings(model, loader, progress=False)
    np.testing.assert_allclose(got, reference_embeddings(model, images, True), atol=1e-5)


def test_half_precision_model_gets_cast_inputs():
    model = tiny_model(2).to(torch.bfloat16)
    images = torch.rand(4, 3, 8, 8) * 2 - 1
    got = extract_embeddings(model, images, batch_size=4, progress=False)
    reference = reference_embeddings(model.float(), images, True)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, reference, atol=0.05)


def test_extract_rejects_empty_dataset_and_bad_model_output():
    model = tiny_model()
    with pytest.raises(ValueError, match="empty"):
        extract_embeddings(model, torch.zeros(0, 3, 8, 8), progress=False)
    with pytest.raises(ValueError, match="model: expected"):
        extract_embeddings(nn.Conv2d(3, 2, 3), torch.zeros(2, 3, 8, 8), progress=False)
    with pytest.raises(ValueError, match="images: expected"):
        extract_embeddings(model, torch.zeros(2, 8, 8), progress=False)


def test_load_image_modes_and_values(tmp_path):
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, size=(6, 5, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "rgb.png")
    grey = rng.integers(0, 256, size=(6, 5), dtype=np.uint8)
    Image.fromarray(grey).save(tmp_path / "grey.png")
    Image.fromarray(np.dstack([rgb, np.full((6, 5), 7, np.uint8)])).save(tmp_path / "rgba.png")

    x = load_image(tmp_path / "rgb.png", (6, 5))  # (H, W): no resize
    assert x.shape == (3, 6, 5) and x.dtype == torch.float32
    np.testing.assert_allclose(x.numpy(), rgb.transpose(2, 0, 1) / 127.5 - 1.0, atol=1e-6)
    g = load_image(tmp_path / "grey.png", (6, 5))
    for c in range(3):  # grey becomes three equal channels
        np.testing.assert_allclose(g[c].numpy(), grey / 127.5 - 1.0, atol=1e-6)
    a = load_image(tmp_path / "rgba.png", (6, 5))
    np.testing.assert_allclose(a.numpy(), x.numpy(), atol=1e-6)  # alpha dropped

    resized = load_image(tmp_path / "rgb.png", (12, 4))
    assert resized.shape == (3, 12, 4)
    assert resized.min() >= -1.0 and resized.max() <= 1.0
    assert load_image(tmp_path / "grey.png", 9).shape == (3, 9, 9)


def test_load_image_corrupt_and_missing(tmp_path):
    rgb = np.random.default_rng(1).integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "good.jpg", quality=90)
    data = (tmp_path / "good.jpg").read_bytes()
    (tmp_path / "truncated.jpg").write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.jpg").write_bytes(b"this is not an image at all")
    for name in ("truncated.jpg", "garbage.jpg"):
        with pytest.raises(ValueError, match=f"{name}: cannot decode image"):
            load_image(tmp_path / name, 64)
    with pytest.raises(FileNotFoundError, match="absent.jpg"):
        load_image(tmp_path / "absent.jpg", 64)


def test_path_dataset_with_root(tmp_path):
    (tmp_path / "A").mkdir()
    pixels = np.full((10, 10, 3), 255, np.uint8)
    Image.fromarray(pixels).save(tmp_path / "A" / "A_0001.png")
    dataset = PathDataset(["A/A_0001.png"], size=(4, 6), root=tmp_path)
    assert len(dataset) == 1
    x = dataset[0]
    assert x.shape == (3, 4, 6)
    np.testing.assert_allclose(x.numpy(), 1.0)


def test_npz_round_trip(tmp_path):
    rng = np.random.default_rng(2)
    embeddings = rng.normal(size=(4, 3))  # float64 in, float32 stored
    paths = ["A/A_0001.jpg", "A/A_0002.jpg", "Bé/Bé_0001.jpg", "C/C_0001.jpg"]
    path = tmp_path / "out" / "emb.npz"
    save_embeddings(path, embeddings, paths)
    loaded, loaded_paths = load_embeddings(path)
    assert loaded.dtype == np.float32
    np.testing.assert_array_equal(loaded, embeddings.astype(np.float32))
    assert loaded_paths == paths
    with np.load(path) as data:  # the documented keys, readable without our code
        assert sorted(data.files) == ["embeddings", "paths"]
    assert [p.name for p in path.parent.iterdir()] == ["emb.npz"]  # no temp file left


def test_save_embeddings_rejects_bad_shapes(tmp_path):
    path = tmp_path / "emb.npz"
    with pytest.raises(ValueError, match="paths: 2 paths for 3 embeddings"):
        save_embeddings(path, np.zeros((3, 4)), ["a", "b"])
    with pytest.raises(ValueError, match="embeddings: expected an \\(N, D\\)"):
        save_embeddings(path, np.zeros(3), ["a", "b", "c"])
    assert not path.exists()


def test_load_embeddings_rejects_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="none.npz"):
        load_embeddings(tmp_path / "none.npz")
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="bad.npz"):
        load_embeddings(bad)
    nokey = tmp_path / "nokey.npz"
    np.savez(nokey, emb=np.zeros((2, 3), np.float32), paths=np.array(["a", "b"]))
    with pytest.raises(ValueError, match="nokey.npz: missing key"):
        load_embeddings(nokey)
    short = tmp_path / "short.npz"
    np.savez(short, embeddings=np.zeros((2, 3), np.float32), paths=np.array(["a"]))
    with pytest.raises(ValueError, match="short.npz: 'paths' must be 2 strings"):
        load_embeddings(short)
    flat = tmp_path / "flat.npz"
    np.savez(flat, embeddings=np.zeros(6, np.float32), paths=np.array(["a"]))
    with pytest.raises(ValueError, match="flat.npz: 'embeddings' must be an \\(N, D\\)"):
        load_embeddings(flat)


def write_pairs_file(tmp_path, text):
    path = tmp_path / "pairs.txt"
    path.write_text(text)
    return load_pairs(path)


def test_verify_pairs_uses_cosine_and_file_folds(tmp_path):
    rng = np.random.default_rng(3)
    names = [f"P{i}" for i in range(5)]
    lines = ["2 6"]
    for _ in range(2):
        lines += [
            f"{rng.choice(names)} {rng.integers(1, 4)} {rng.integers(1, 4)}" for _ in range(6)
        ]
        lines += [
            f"{a} {rng.integers(1, 4)} {b} {rng.integers(1, 4)}"
            for a, b in (rng.choice(names, 2, replace=False) for _ in range(6))
        ]
    pairs = write_pairs_file(tmp_path, "\n".join(lines) + "\n")
    paths = pairs.images()
    embeddings = rng.normal(size=(len(paths), 8)) * rng.uniform(0.5, 3, (len(paths), 1))
    index = index_paths(paths)

    # float64 reference cosine, written out per pair
    expected = []
    for a, b in zip(pairs.left, pairs.right, strict=True):
        u, v = embeddings[index[a]], embeddings[index[b]]
        expected.append(u @ v / np.sqrt((u @ u) * (v @ v)))
    np.testing.assert_allclose(pair_scores(embeddings, index, pairs), expected, atol=1e-12)

    result = verify_pairs(embeddings, index, pairs)
    reference = evaluate_verification(np.array(expected), pairs.issame, folds=pairs.fold)
    assert len(result["fold_accuracies"]) == 2
    for key in ("accuracy", "accuracy_std", "auc", "eer", "threshold"):
        assert result[key] == pytest.approx(reference[key], abs=1e-12)


def test_verify_pairs_one_fold_file_uses_balanced_folds(tmp_path):
    rng = np.random.default_rng(4)
    lines = ["20"] + [f"A {i} {i + 1}" for i in range(1, 21)]
    lines += [f"A {i} B {i}" for i in range(1, 21)]
    pairs = write_pairs_file(tmp_path, "\n".join(lines) + "\n")
    paths = pairs.images()
    embeddings = rng.normal(size=(len(paths), 4))
    result = verify_pairs(embeddings, index_paths(paths), pairs, num_folds=5)
    scores = pair_scores(embeddings, index_paths(paths), pairs)
    folds = balanced_folds(pairs.issame, 5)
    reference = evaluate_verification(scores, pairs.issame, folds=folds)
    assert len(result["fold_accuracies"]) == 5
    assert result["accuracy"] == pytest.approx(reference["accuracy"], abs=1e-12)


def test_verify_pairs_missing_embedding_names_line(tmp_path):
    pairs = write_pairs_file(tmp_path, "1\nA 1 2\nA 1 B 1\n")
    index = {"A/A_0001.jpg": 0, "A/A_0002.jpg": 1}
    with pytest.raises(ValueError, match="pairs.txt:3: no embedding for image 'B/B_0001.jpg'"):
        verify_pairs(np.eye(3), index, pairs, num_folds=2)


def test_pair_scores_falls_back_to_other_extension(tmp_path):
    pairs = write_pairs_file(tmp_path, "1\nA 1 2\nA 1 B 1\n")
    index = {"A/A_0001.png": 0, "A/A_0002.png": 1, "B/B_0001.png": 2}
    embeddings = np.array([[1.0, 0.0], [0.0, 2.0], [-3.0, 0.0]])
    np.testing.assert_allclose(pair_scores(embeddings, index, pairs), [0.0, -1.0], atol=1e-12)
    ambiguous = {**index, "B/B_0001.jpeg": 1}
    with pytest.raises(ValueError, match="pairs.txt:3"):
        pair_scores(embeddings, ambiguous, pairs)


def test_index_paths_rejects_duplicates():
    assert index_paths(["a", "b"]) == {"a": 0, "b": 1}
    with pytest.raises(ValueError, match="'a' appears twice"):
        index_paths(["a", "b", "a"])
