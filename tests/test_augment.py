"""`data.augment`: the presets and their refusals, the draws as a function of (seed, epoch,
index), each operation against a reference computed another way, the CPU path against the
GPU path's batched code (run here on CPU tensors), and resumed batches bit for bit.

The GPU path on real JPEGs through `decode_batch` is in test_gpu_decode.py."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms.v2 import functional as TF

import train
from recognition.config import PRESETS, AugmentConfig, ConfigError, load_config, save_config
from recognition.data.augment import SampleAugment, apply_augment, draw_augment, draw_flip
from recognition.data.augment_batch import augment_batch
from recognition.data.sampler import AugmentedView, EpochBatches, ResumableSampler, sample_seed

DOCS = Path(__file__).resolve().parent.parent / "docs" / "data.md"

# Every operation on about half the samples, with ranges that exercise each one.
EVERYTHING = dict(
    preset="none", flip=0.5, crop=0.5, crop_mode="resize", colour=0.5, grey=0.3, low_res=0.5,
    blur=0.5, blur_sigma=[0.3, 1.2], erase=0.5,
)  # fmt: skip


class Noise(Dataset):
    """`count` random (3, H, W) images in [-1, 1] (as a source gives them), label = index."""

    def __init__(self, count: int, size: tuple[int, int] = (24, 20), seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.images = torch.rand(count, 3, *size, generator=generator) * 2 - 1

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        return self.images[index].clone(), index


# ---------------------------------------------------------------------- the config


def documented_presets() -> dict[str, dict]:
    """docs/data.md's preset table: {preset: {setting: value}}."""
    lines = DOCS.read_text().splitlines()
    start = lines.index("| setting | none | flip | face | reid |")
    names = [cell.strip() for cell in lines[start].strip("|").split("|")][1:]
    table: dict[str, dict] = {name: {} for name in names}
    for line in itertools.takewhile(lambda x: x.startswith("|"), lines[start + 2 :]):
        key, *cells = [cell.strip() for cell in line.strip("|").split("|")]
        for name, cell in zip(names, cells, strict=True):
            table[name][key.strip("`")] = yaml.safe_load(cell)
    return table


@pytest.mark.parametrize("name", ["none", "flip", "face", "reid"])
def test_presets_resolve_to_their_documented_settings(name):
    documented = documented_presets()[name]
    resolved = load_config("default", [f"data.augment={name}"]).data.augment
    assert resolved.preset == name
    assert set(documented) == set(resolved.settings())
    for key, value in documented.items():
        got = getattr(resolved, key)
        if isinstance(value, str):
            assert got == value, key
        else:  # the table rounds 4/3 to 1.3333
            np.testing.assert_allclose(got, value, rtol=1e-4, err_msg=key)


def test_the_default_is_todays_flip_and_single_keys_override_a_preset():
    assert load_config("default").data.augment == AugmentConfig(preset="flip")
    assert AugmentConfig().settings() == {**PRESETS["none"], "flip": 0.5}
    cfg = load_config("default", ["data.augment=face", "data.augment.blur=0"]).data.augment
    assert cfg.blur == 0.0 and cfg.low_res == 0.2 and cfg.preset == "face"
    # The long form, and the shorthand after a single key: the shorthand replaces the section.
    assert load_config("default", ["data.augment.preset=reid"]).data.augment == AugmentConfig(
        preset="reid"
    )
    last = load_config("default", ["data.augment.crop=0.3", "data.augment=reid"]).data.augment
    assert last == AugmentConfig(preset="reid")


def test_a_file_and_its_base_take_the_shorthand(tmp_path):
    (tmp_path / "base.yaml").write_text("data:\n  augment: face\n")
    (tmp_path / "child.yaml").write_text("base: base\ndata:\n  augment:\n    grey: 0.5\n")
    cfg = load_config(str(tmp_path / "child.yaml")).data.augment
    assert cfg == AugmentConfig(preset="face", grey=0.5)


def test_old_data_flip_still_loads_and_a_saved_config_keeps_every_setting(tmp_path):
    """data.flip (before data.augment): true is a flip of half the images, false none; a run
    directory's config.yaml of that time loads. The saved config names every setting."""
    assert load_config("default", ["data.flip=false"]).data.augment == AugmentConfig(flip=0.0)
    assert load_config("default", ["data.flip=true"]).data.augment == AugmentConfig()
    old = tmp_path / "config.yaml"
    old.write_text("data:\n  root: data/faces\n  flip: false\n  image_size: 48\n")
    assert load_config(str(old)).data.augment.flip == 0.0
    cfg = load_config("default", ["data.augment=face", "data.augment.erase=0.25"])
    save_config(cfg, tmp_path / "saved.yaml")
    saved = yaml.safe_load((tmp_path / "saved.yaml").read_text())["data"]
    assert "flip" not in saved and saved["augment"]["erase"] == 0.25
    assert saved["augment"]["low_res_scale"] == [0.2, 1.0]  # resolved, not null
    assert load_config(str(tmp_path / "saved.yaml")) == cfg


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.augment=faces", "data.augment.preset: 'faces' is not one of none, flip, face"),
        ("data.augment.crop=1.5", "data.augment.crop: 1.5 is a probability, it must lie in [0, 1]"),
        ("data.augment.erase=-0.1", "data.augment.erase: -0.1 is a probability"),
        ("data.augment.crop_scale=[0.9, 0.2]", "data.augment.crop_scale: [0.9, 0.2] is upside"),
        ("data.augment.crop_scale=[0.5, 1.5]", "crop_scale: [0.5, 1.5] must lie in (0, 1]"),
        ("data.augment.crop_scale=[0, 0.5]", "data.augment.crop_scale: [0, 0.5] must lie in"),
        ("data.augment.crop_ratio=[0, 2]", "data.augment.crop_ratio: [0, 2] must lie in (0, inf)"),
        ("data.augment.crop_ratio=[2, 1]", "data.augment.crop_ratio: [2, 1] is upside down"),
        ("data.augment.crop_ratio=[1]", "data.augment.crop_ratio: expected [min, max]"),
        ("data.augment.low_res_scale=[0.1, 2]", "data.augment.low_res_scale: [0.1, 2] must lie"),
        ("data.augment.erase_scale=[0.5, 0.1]", "data.augment.erase_scale: [0.5, 0.1] is upside"),
        ("data.augment.blur_sigma=[-1, 1]", "data.augment.blur_sigma: [-1, 1] must lie in (0,"),
        ("data.augment.brightness=1.5", "data.augment.brightness: 1.5 must lie in [0, 1]"),
        ("data.augment.crop_pad=-2", "data.augment.crop_pad: -2 pixels must be 0 or more"),
        ("data.augment.crop_mode=zoom", "data.augment.crop_mode: 'zoom' is not one of resize"),
        ("data.augment.hue=0.1", "data.augment.hue: unknown config key"),
        ("data.flip=maybe", "data.flip: expected true or false, got 'maybe'"),
    ],
)  # fmt: skip
def test_bad_settings_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError) as caught:
        load_config("default", [override])
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_settings_refused_together_name_the_key():
    # The default's 48-pixel input cannot hold a 55-pixel kernel (sigma 9).
    with pytest.raises(ConfigError, match=r"^data.augment.blur_sigma: a sigma of 9 needs a 55"):
        load_config("default", ["data.augment.blur=0.1", "data.augment.blur_sigma=[1, 9]"])
    load_config("default", ["data.augment.blur_sigma=[1, 9]"])  # no blur: no kernel
    with pytest.raises(ConfigError, match=r"^data.flip: false \(data.augment.flip=0\) conflicts"):
        load_config("default", ["data.flip=false", "data.augment.flip=0.5"])


def test_show_config_lists_the_resolved_settings(capsys):
    assert train.main(["--show-config", "data.augment=face", "data.augment.erase=0.3"]) == 0
    shown = capsys.readouterr().out
    block = shown[shown.index("  augment:") :].split("\n  synthetic:")[0]
    settings = yaml.safe_load(block)["augment"]
    assert settings == {"preset": "face", **PRESETS["face"], "erase": 0.3}
    assert "    low_res: 0.2  # Probability of low resolution" in block


# ---------------------------------------------------------------------- the draws


def test_draws_follow_the_settings():
    """Over many seeds: each operation on its share of the samples, every parameter within
    its range (checked against the settings, not the drawing code)."""
    # Ratios away from 1, so that a box drawn on its side is seen.
    cfg = AugmentConfig(
        **{**EVERYTHING, "crop_scale": [0.3, 0.8], "crop_ratio": [1.2, 2.0]},
        erase_ratio=[1.5, 3.0],
    )
    size = (40, 30)
    draws = [draw_augment(cfg, seed, size) for seed in range(2000)]
    share = {
        "flip": np.mean([d.flip for d in draws]),
        "crop": np.mean([d.crop is not None for d in draws]),
        "colour": np.mean([d.colour is not None for d in draws]),
        "grey": np.mean([d.grey for d in draws]),
        "blur": np.mean([d.blur is not None for d in draws]),
    }
    for key, value in share.items():  # 4 standard errors of 2,000 draws: about 0.045
        assert abs(value - getattr(cfg, key)) < 0.05, key
    for d in draws:
        if d.crop is not None:  # area and width / height within range, up to whole pixels
            top, left, h, w = d.crop
            assert 0 <= top <= 40 - h and 0 <= left <= 30 - w
            assert 0.3 * 1200 - (h + w) <= h * w <= 0.8 * 1200 + (h + w)
            assert 1.2 <= (w + 0.5) / (h - 0.5) and (w - 0.5) / (h + 0.5) <= 2.0
        if d.colour is not None:
            assert all(0.5 <= f <= 1.5 for f in d.colour)
        if d.low_res is not None:
            assert 0.5 * 40 - 1 <= d.low_res[0] <= 40 and 0.5 * 30 - 1 <= d.low_res[1] <= 30
        if d.blur is not None:
            assert d.blur[0] == 2 * math.ceil(3 * 1.2) + 1 and 0.3 <= d.blur[1] <= 1.2
        if d.erase is not None:  # strictly inside; height / width this time
            top, left, h, w = d.erase
            assert 0 <= top and top + h <= 40 and 0 <= left and left + w <= 30
            assert h < 40 and w < 30
            assert 0.02 * 1200 - (h + w) <= h * w <= 0.33 * 1200 + (h + w)
            assert 1.5 <= (h + 0.5) / (w - 0.5) and (h - 0.5) / (w + 0.5) <= 3.0
    pads = [d.crop[:2] for d in (draw_augment(AugmentConfig(preset="reid"), s, size)
                                 for s in range(400))]  # fmt: skip
    assert {t for t, _ in pads} == set(range(-10, 11)) == {left for _, left in pads}


def test_a_sample_draw_is_a_function_of_seed_epoch_and_index():
    cfg = AugmentConfig(**EVERYTHING)

    def draw(seed, epoch, index):
        return draw_augment(cfg, sample_seed(seed, epoch, index), (24, 20))

    same = [draw(3, 1, i) for i in range(50)]
    # The flip is the first draw, as the default draws it, whatever else is on.
    assert [d.flip for d in same] == [draw_flip(sample_seed(3, 1, i)) for i in range(50)]
    assert [draw(3, 1, i) for i in reversed(range(50))] == same[::-1]
    for other in ([draw(3, 2, i) for i in range(50)], [draw(4, 1, i) for i in range(50)]):
        assert sum(a != b for a, b in zip(same, other, strict=True)) > 45
    assert len(set(same)) == 50  # the index matters too


def test_the_flip_preset_is_the_flip_every_run_had():
    """The default draws the flip exactly as before data.augment: mirrored when the first
    draw of random.Random(sample seed) is below 0.5, nothing else changed (bit for bit)."""
    base = Noise(64)
    view = AugmentedView(base, AugmentConfig())
    sampler = ResumableSampler(len(base), seed=5)
    flipped = 0
    for index, seed in sampler:
        expected = base.images[index]
        if random.Random(seed).random() < 0.5:
            expected, flipped = expected.flip(-1), flipped + 1
        assert torch.equal(view[(index, seed)][0], expected)
    assert 0 < flipped < len(base)


def test_workers_and_order_do_not_change_an_image():
    """Whichever worker loads a sample, in whatever order: the same image per key."""
    view = AugmentedView(Noise(48), AugmentConfig(**EVERYTHING))
    keys = [(i, sample_seed(0, 2, i)) for i in range(48)]
    alone = {key: view[key][0] for key in reversed(keys)}
    loader = DataLoader(view, batch_size=8, sampler=keys, num_workers=2)
    loaded = torch.cat([images for images, _ in loader])
    for key, image in zip(keys, loaded, strict=True):
        assert torch.equal(image, alone[key])
    assert sum(not torch.equal(view[k][0], Noise(48)[k[0]][0]) for k in keys) > 40


def test_a_resumed_epoch_sees_the_same_batches_bit_for_bit():
    """The run's chain (EpochBatches over ResumableSampler, AugmentedView): batches from a
    position mid-epoch equal those of the run that went straight through."""
    view = AugmentedView(Noise(40), AugmentConfig(**EVERYTHING))

    def batches(epoch: int, batch: int, count: int) -> list[torch.Tensor]:
        order = EpochBatches(ResumableSampler(40, seed=9), batch_size=4, batches_per_epoch=10)
        order.start_at(epoch, batch)
        loader = DataLoader(view, batch_sampler=order)
        return [images for images, _ in itertools.islice(iter(loader), count)]

    straight = batches(0, 0, 16)  # into the second epoch
    resumed = batches(0, 7, 9)
    assert all(torch.equal(a, b) for a, b in zip(straight[7:], resumed, strict=True))
    assert not torch.equal(straight[1], straight[11])  # the next epoch draws again


# ---------------------------------------------------------------------- the operations


def ramp(size=(12, 10)) -> torch.Tensor:
    """(3, H, W) in [0, 1], every pixel and channel different."""
    count = 3 * size[0] * size[1]
    return (torch.arange(count, dtype=torch.float32) / count).view(3, *size)


def test_each_geometric_operation_against_array_slicing():
    x = ramp()
    expected = np.zeros((3, 12, 10), np.float32)  # shifted 3 down and 2 right: black top-left
    expected[:, 3:, 2:] = x.numpy()[:, :9, :8]
    got = apply_augment(x, SampleAugment(crop=(-3, -2, 12, 10)))
    np.testing.assert_array_equal(got.numpy(), expected)
    kept = np.zeros((3, 12, 10), np.float32)
    kept[:, 2:7, 1:9] = x.numpy()[:, 2:7, 1:9]
    got = apply_augment(x, SampleAugment(crop=(2, 1, 5, 8), crop_in_place=True))
    np.testing.assert_array_equal(got.numpy(), kept)
    erased = x.numpy().copy()
    erased[:, 4:10, 3:5] = 0.5
    np.testing.assert_array_equal(apply_augment(x, SampleAugment(erase=(4, 3, 6, 2))), erased)
    np.testing.assert_array_equal(apply_augment(x, SampleAugment(flip=True)), x.numpy()[..., ::-1])
    # A box resized to the input: bilinear (align_corners=False) from the box's own pixels.
    box = x[:, 2:8, 3:8].double()
    reference = torch.nn.functional.interpolate(box[None], (12, 10), mode="bilinear")[0]
    got = apply_augment(x, SampleAugment(crop=(2, 3, 6, 5)))
    np.testing.assert_allclose(got, reference.float(), atol=1e-6)


def test_each_photometric_operation_against_float64_formulas():
    x = ramp().double()
    luma = 0.2989 * x[0] + 0.587 * x[1] + 0.114 * x[2]
    got = apply_augment(x.float(), SampleAugment(grey=True)).double()
    np.testing.assert_allclose(got, luma.expand(3, -1, -1), atol=1e-6)
    b, c, s = 1.3, 0.6, 1.4
    y = (x * b).clamp(0, 1)
    mean = (0.2989 * y[0] + 0.587 * y[1] + 0.114 * y[2]).mean()
    y = (y * c + mean * (1 - c)).clamp(0, 1)
    grey = 0.2989 * y[0] + 0.587 * y[1] + 0.114 * y[2]
    y = (y * s + grey * (1 - s)).clamp(0, 1)
    got = apply_augment(x.float(), SampleAugment(colour=(b, c, s)))
    np.testing.assert_allclose(got, y.float(), atol=1e-6)


def test_blur_and_low_resolution_against_their_closed_forms():
    """A blur of a point is its Gaussian (float64, reflected borders far away); low
    resolution keeps a flat image flat and a line a line, and wipes out what is finer than
    its pixels."""
    point = torch.zeros(3, 21, 21)
    point[:, 10, 10] = 1.0
    sigma = 1.1
    got = apply_augment(point, SampleAugment(blur=(9, sigma)))[0].double()
    taps = torch.exp(-0.5 * (torch.arange(-4, 5, dtype=torch.float64) / sigma) ** 2)
    taps /= taps.sum()
    expected = torch.zeros(21, 21, dtype=torch.float64)
    expected[6:15, 6:15] = taps[:, None] * taps[None, :]
    np.testing.assert_allclose(got, expected, atol=1e-6)
    flat = torch.full((3, 16, 16), 0.25)
    np.testing.assert_allclose(apply_augment(flat, SampleAugment(low_res=(5, 7))), flat, atol=1e-6)
    # A ramp halved and doubled: the antialiased halving averages symmetric neighbours and
    # bilinear doubling interpolates, both exact on a line, away from the clamped borders.
    ramp_ = torch.linspace(0, 1, 32).view(1, 1, 32).expand(3, 32, 32).contiguous()
    got = apply_augment(ramp_, SampleAugment(low_res=(16, 16)))
    np.testing.assert_allclose(got[..., 3:-3], ramp_[..., 3:-3], atol=1e-6)
    assert (got - ramp_)[..., 0].abs().min() > 0.01  # the border moved: it did resample
    # A pattern of one-pixel stripes has no low-resolution image: halved, it is flat grey.
    stripes = (torch.arange(32) % 2).float().view(1, 1, 32).expand(3, 32, 32).contiguous()
    got = apply_augment(stripes, SampleAugment(low_res=(32, 16)))
    np.testing.assert_allclose(got[..., 3:-3], 0.5, atol=1e-6)


@pytest.mark.parametrize(("size", "kernel", "sigma"), [((24, 20), 9, 1.2), ((7, 30), 13, 2.0)])
def test_the_cpu_paths_blur_is_torchvisions_gaussian_blur(size, kernel, sigma):
    """The CPU path blurs with two matrix products (ten times cheaper in a worker than the
    convolution): torchvision's gaussian_blur, reflected borders included, to float rounding
    (a kernel reaching past the 7-pixel side's first reflection is not needed: the config
    refuses kernels larger than the input)."""
    images = (Noise(4, size, seed=2).images + 1) / 2
    for image in images:
        if kernel > min(size):
            kernel = min(size) if min(size) % 2 else min(size) - 1
        got = apply_augment(image, SampleAugment(blur=(kernel, sigma)))
        expected = TF.gaussian_blur(image, [kernel, kernel], [sigma, sigma])
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)


@pytest.mark.parametrize(
    "settings",
    [
        {"preset": "face"},
        {"preset": "reid"},
        EVERYTHING,
        {**EVERYTHING, "crop_mode": "in_place", "crop": 0.9},
        {**EVERYTHING, "crop_mode": "pad", "crop_pad": 6, "crop": 0.9},
    ],
    ids=["face", "reid", "everything-resize", "everything-in-place", "everything-pad"],
)
def test_the_gpu_paths_batched_code_equals_the_cpu_path(settings):
    """augment_batch (data.decode=gpu's code, here on CPU tensors) against apply_augment
    (the CPU path, torchvision's functional transforms, image by image): the same images to
    float rounding, for samples that each do something else. Shape and range kept."""
    cfg = AugmentConfig(**settings)
    images = (Noise(32, (24, 20), seed=1).images + 1) / 2
    params = [draw_augment(cfg, 100 + i, (24, 20)) for i in range(32)]
    assert sum(p.beyond_flip for p in params) > 8
    expected = torch.stack([apply_augment(x, p) for x, p in zip(images, params, strict=True)])
    got = augment_batch(images, params)
    assert got.shape == images.shape and got.dtype == torch.float32
    assert 0.0 <= float(got.min()) and float(got.max()) <= 1.0
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    changed = (expected - images).flatten(1).abs().amax(1) > 1e-3
    assert changed.tolist() == [p.flip or p.beyond_flip for p in params]


def test_augmented_view_keeps_shape_and_range_for_every_preset():
    base = Noise(16, (32, 24))
    for name in ("none", "flip", "face", "reid"):
        view = AugmentedView(base, AugmentConfig(preset=name))
        for key in ((i, sample_seed(1, 0, i)) for i in range(16)):
            image, label = view[key]
            assert image.shape == (3, 32, 24) and label == key[0]
            assert -1.0 <= float(image.min()) and float(image.max()) <= 1.0


def test_a_grey_batch_normalises_without_writing_through_its_view():
    """Grey-scale returns the luma expanded to three channels (one memory location each):
    the normalisation after it must not write in place."""
    image, _ = AugmentedView(Noise(1), AugmentConfig(preset="none", grey=1.0))[(0, 0)]
    assert torch.equal(image[0], image[1]) and torch.equal(image[1], image[2])
