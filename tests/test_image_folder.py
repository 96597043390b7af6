"""ImageFolderDataset and the input transforms: labels, image modes, flips, bad files.

`classes` and `paths` are lazy sequences over the compact index and `labels` an int32 array
(they were lists): the tests compare them as lists.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from recognition.data.image_folder import ImageFolderDataset
from recognition.data.transforms import load_rgb, normalise, to_rgb

# One 8-bit level in the [-1, 1] input range.
LEVEL = 2.0 / 255.0


def expected_input(rgb: np.ndarray) -> torch.Tensor:
    """Reference (3, H, W) input for an (H, W, 3) array of 8-bit values, in float64."""
    return torch.from_numpy(rgb.astype(np.float64) / 127.5 - 1.0).permute(2, 0, 1)


def asymmetric_rgb(height: int = 16, width: int = 12, seed: int = 0) -> np.ndarray:
    """(H, W, 3) uint8 random image: never equal to its own mirror image."""
    return np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def save_png(path: Path, array: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)
    return path


@pytest.fixture
def three_identities(tmp_path: Path) -> Path:
    """root/{b,a,c}/ with 2, 3 and 1 lossless images, plus things that must be ignored."""
    root = tmp_path / "faces"
    counts = {"b": 2, "a": 3, "c": 1}
    for seed, (name, count) in enumerate(counts.items()):
        for n in range(count):
            save_png(root / name / f"img{n}.png", asymmetric_rgb(seed=10 * seed + n))
    (root / "a" / "notes.txt").write_text("not an image")
    (root / "a" / "nested").mkdir()
    save_png(root / "a" / "nested" / "deep.png", asymmetric_rgb())
    save_png(root / ".cache" / "x.png", asymmetric_rgb())
    (root / "README").write_text("a file at the root is not an identity")
    return root


def test_labels_follow_sorted_folder_names(three_identities: Path):
    dataset = ImageFolderDataset(three_identities, (16, 12), train=False)
    assert list(dataset.classes) == ["a", "b", "c"]
    assert dataset.num_classes == 3
    assert len(dataset) == 6
    assert list(dataset.paths) == [
        "a/img0.png",
        "a/img1.png",
        "a/img2.png",
        "b/img0.png",
        "b/img1.png",
        "c/img0.png",
    ]
    assert dataset.labels.tolist() == [0, 0, 0, 1, 1, 2]
    for index, (path, label) in enumerate(zip(dataset.paths, dataset.labels, strict=True)):
        image, got_label = dataset[index]
        assert got_label == label
        reference = np.asarray(Image.open(three_identities / path))
        torch.testing.assert_close(image.double(), expected_input(reference), atol=1e-6, rtol=0)


def test_class_names_fix_the_label_order(three_identities: Path):
    dataset = ImageFolderDataset(three_identities, 16, train=False, class_names=["c", "a"])
    assert list(dataset.classes) == ["c", "a"]
    assert dataset.labels.tolist() == [0, 1, 1, 1]  # c's one image, then a's three; b is left out
    assert dataset.paths[0] == "c/img0.png"
    with pytest.raises(FileNotFoundError, match="'zz'"):
        ImageFolderDataset(three_identities, 16, class_names=["a", "zz"])
    with pytest.raises(ValueError, match="twice"):
        ImageFolderDataset(three_identities, 16, class_names=["a", "a"])


def test_extensions_are_matched_in_any_case(tmp_path: Path):
    folder = _mkdir(tmp_path / "x")
    for n, extension in enumerate([".JPG", ".jpeg", ".Png", ".bmp", ".PPM", ".webp", ".pgm"]):
        image = Image.fromarray(asymmetric_rgb(seed=n))
        image = image.convert("L") if extension == ".pgm" else image
        image.save(folder / f"{n}{extension}")
    (folder / "7.gif").write_bytes(b"GIF89a")  # not an accepted extension: ignored
    dataset = ImageFolderDataset(tmp_path, 8)
    assert len(dataset) == 7
    for index in range(len(dataset)):
        image, label = dataset[index]
        assert image.shape == (3, 8, 8) and label == 0


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


def test_grey_pgm_8_and_16_bit(tmp_path: Path):
    grey = np.arange(24 * 20, dtype=np.int64).reshape(24, 20) % 256
    # Written by hand (binary PGM, "P5"), so that the reader is checked against the format
    # rather than against PIL's own writer.
    header = b"P5\n20 24\n255\n"
    _mkdir(tmp_path / "p")
    (tmp_path / "p" / "8bit.pgm").write_bytes(header + grey.astype(np.uint8).tobytes())
    deep = (np.arange(24 * 20).reshape(24, 20) * 131) % 65536  # uses the full 16-bit range
    header16 = b"P5\n20 24\n65535\n"
    (tmp_path / "p" / "16bit.pgm").write_bytes(header16 + deep.astype(">u2").tobytes())

    dataset = ImageFolderDataset(tmp_path, (24, 20))
    assert list(dataset.paths) == ["p/16bit.pgm", "p/8bit.pgm"]
    image16, _ = dataset[0]
    image8, _ = dataset[1]
    for image in (image8, image16):
        assert image.shape == (3, 24, 20) and image.dtype == torch.float32
    torch.testing.assert_close(
        image8.double(), expected_input(np.stack([grey] * 3, -1)), atol=1e-6, rtol=0
    )
    deep_as_8bit = np.rint(deep * 255.0 / 65535.0)
    torch.testing.assert_close(
        image16.double(),
        expected_input(np.stack([deep_as_8bit] * 3, -1)),
        atol=LEVEL * 0.51,
        rtol=0,
    )
    # The 16-bit image spans the whole range: a clipping conversion would be mostly white.
    assert image16.min() < -0.9 and image16.max() > 0.9 and image16.mean().abs() < 0.2


def test_rgba_png_drops_alpha(tmp_path: Path):
    rng = np.random.default_rng(1)
    rgba = rng.integers(0, 256, size=(10, 14, 4), dtype=np.uint8)
    rgba[:, :4, 3] = 0  # fully transparent strip: its colour is kept all the same
    path = save_png(tmp_path / "x" / "a.png", rgba)
    image, _ = ImageFolderDataset(tmp_path, (10, 14))[0]
    torch.testing.assert_close(image.double(), expected_input(rgba[..., :3]), atol=1e-6, rtol=0)
    assert load_rgb(path).mode == "RGB"


def test_palette_png_with_transparency(tmp_path: Path, recwarn):
    palette_image = Image.new("P", (6, 4), 1)
    palette_image.putpalette([255, 0, 0, 0, 255, 0] + [0, 0, 0] * 254)  # 0 red, 1 green
    palette_image.paste(0, (0, 0, 3, 4))  # left half red
    _mkdir(tmp_path / "x")
    palette_image.save(tmp_path / "x" / "p.png", transparency=0)  # red is transparent
    assert "transparency" in Image.open(tmp_path / "x" / "p.png").info
    image, _ = ImageFolderDataset(tmp_path, (4, 6))[0]
    reference = np.zeros((4, 6, 3))
    reference[:, :3, 0] = 255.0  # the palette's colours, alpha dropped
    reference[:, 3:, 1] = 255.0
    torch.testing.assert_close(image.double(), expected_input(reference), atol=1e-6, rtol=0)
    assert not [w for w in recwarn if "Palette images with Transparency" in str(w.message)]


def test_cmyk_jpeg(tmp_path: Path):
    cmyk = Image.new("CMYK", (32, 24), (0, 255, 255, 0))  # pure red in CMYK
    cmyk.paste((0, 0, 0, 255), (16, 0, 32, 24))  # right half black
    _mkdir(tmp_path / "x")
    cmyk.save(tmp_path / "x" / "c.jpg", quality=95)
    assert Image.open(tmp_path / "x" / "c.jpg").mode == "CMYK"
    image, _ = ImageFolderDataset(tmp_path, (24, 32))[0]
    assert image.shape == (3, 24, 32)
    # Away from the edge where JPEG rings: red on the left, black on the right.
    left = image[:, :, :12].mean(dim=(1, 2))
    right = image[:, :, 20:].mean(dim=(1, 2))
    torch.testing.assert_close(left, torch.tensor([1.0, -1.0, -1.0]), atol=0.05, rtol=0)
    torch.testing.assert_close(right, torch.tensor([-1.0, -1.0, -1.0]), atol=0.05, rtol=0)


def test_large_jpeg_is_resized(tmp_path: Path):
    array = np.zeros((1500, 2000, 3), dtype=np.uint8)
    array[:, :1000] = (200, 100, 50)  # left half coloured, right half black
    _mkdir(tmp_path / "x")
    Image.fromarray(array).save(tmp_path / "x" / "big.jpg", quality=95)
    image, _ = ImageFolderDataset(tmp_path, (30, 40))[0]
    assert image.shape == (3, 30, 40) and image.dtype == torch.float32
    assert image.min() >= -1.0 and image.max() <= 1.0
    expected_left = torch.tensor([200.0, 100.0, 50.0]) / 127.5 - 1.0
    torch.testing.assert_close(image[:, :, :18].mean(dim=(1, 2)), expected_left, atol=0.03, rtol=0)
    torch.testing.assert_close(image[:, :, 22:].mean(dim=(1, 2)), -torch.ones(3), atol=0.03, rtol=0)


def test_flip_only_when_training(tmp_path: Path):
    rgb = asymmetric_rgb(12, 10)
    save_png(tmp_path / "x" / "a.png", rgb)
    plain = expected_input(rgb).float()
    flipped = expected_input(rgb[:, ::-1].copy()).float()  # the manual mirror image
    assert not torch.equal(plain, flipped)

    evaluation = ImageFolderDataset(tmp_path, (12, 10), train=False)
    torch.manual_seed(0)
    for _ in range(20):
        torch.testing.assert_close(evaluation[0][0], plain, atol=1e-6, rtol=0)

    training = ImageFolderDataset(tmp_path, (12, 10), train=True)
    torch.manual_seed(0)
    num_flipped = 0
    for _ in range(40):
        image, _ = training[0]
        if torch.allclose(image, flipped, atol=1e-6):
            num_flipped += 1
        else:
            torch.testing.assert_close(image, plain, atol=1e-6, rtol=0)
    assert 5 <= num_flipped <= 35  # p = 0.5; this range fails with probability < 1e-5


def test_corrupt_and_empty_jpegs_name_the_file(tmp_path: Path):
    buffer = io.BytesIO()
    Image.fromarray(asymmetric_rgb(64, 64)).save(buffer, format="JPEG")
    data = buffer.getvalue()
    folder = _mkdir(tmp_path / "x")
    (folder / "0_good.jpg").write_bytes(data)
    (folder / "1_truncated.jpg").write_bytes(data[: len(data) // 2])
    (folder / "2_empty.jpg").write_bytes(b"")
    (folder / "3_garbage.jpg").write_bytes(b"this is not a jpeg at all" * 10)
    dataset = ImageFolderDataset(tmp_path, 16)
    assert dataset[0][0].shape == (3, 16, 16)
    for index, name in [(1, "1_truncated.jpg"), (2, "2_empty.jpg"), (3, "3_garbage.jpg")]:
        with pytest.raises(ValueError, match=f"x/{name}"):
            dataset[index]
    # The check must not have been made by switching on PIL's lenient global mode.
    assert not ImageFile.LOAD_TRUNCATED_IMAGES


def test_bad_roots_and_folders(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        ImageFolderDataset(tmp_path / "nowhere", 16)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(NotADirectoryError, match="file.txt"):
        ImageFolderDataset(tmp_path / "file.txt", 16)
    empty_root = _mkdir(tmp_path / "empty_root")
    with pytest.raises(ValueError, match="no identity folders"):
        ImageFolderDataset(empty_root, 16)

    root = tmp_path / "faces"
    save_png(root / "alice" / "1.png", asymmetric_rgb())
    _mkdir(root / "bob")
    (root / "bob" / "readme.txt").write_text("no images here")
    with pytest.raises(ValueError, match=r"faces/bob: identity folder holds no images"):
        ImageFolderDataset(root, 16)
    for bad_size in (0, (16,), (16, -2), 3.5):
        with pytest.raises(ValueError, match="image_size"):
            ImageFolderDataset(tmp_path / "faces", bad_size)  # type: ignore[arg-type]


def test_works_in_a_dataloader(three_identities: Path):
    dataset = ImageFolderDataset(three_identities, 8, train=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=False)
    images, labels = next(iter(loader))
    assert images.shape == (4, 3, 8, 8) and images.dtype == torch.float32
    assert labels.tolist() == [0, 0, 0, 1]


def test_normalise_and_to_rgb_helpers():
    values = torch.arange(256, dtype=torch.uint8).reshape(1, 16, 16).expand(3, 16, 16)
    reference = torch.arange(256, dtype=torch.float64).reshape(1, 16, 16) / 127.5 - 1.0
    torch.testing.assert_close(
        normalise(values).double(), reference.expand(3, 16, 16), atol=1e-6, rtol=0
    )
    assert normalise(values).dtype == torch.float32
    float_image = Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32), "F")
    assert np.asarray(to_rgb(float_image))[0, :, 0].tolist() == [0, 128, 255]
    bilevel = Image.fromarray(np.array([[0, 1]], dtype=bool))
    assert np.asarray(to_rgb(bilevel))[0].tolist() == [[0, 0, 0], [255, 255, 255]]
