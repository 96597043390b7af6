"""The GPU data path (`data.decode=gpu`), tested on the CPU against the CPU path.

`decode_batch` takes a device: with device cpu it runs torchvision's decode_jpeg on the CPU,
which is the same libjpeg-turbo as PIL, so the batches must equal the CPU path's exactly
(measured: 0 levels of difference on every JPEG here and on the synthetic faces). Same
labels, same flips for the same (seed, epoch, index), bad images and non-JPEG files handled
as the CPU path handles them. The tests at the end need CUDA (nvJPEG) and skip without it;
they are not what tests the feature here.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import needs_cuda
from PIL import Image

from recognition.config import AugmentConfig, ConfigError, DataConfig, load_config
from recognition.data import gpu_decode, pack
from recognition.data.augment import draw_augment
from recognition.data.build import build_loader, resolve_decode
from recognition.data.gpu_decode import (
    EncodedView,
    collate_encoded,
    decode_batch,
    gpu_decodable,
    holds_jpeg,
)
from recognition.data.image_folder import ImageFolderDataset
from recognition.data.recordio import RecordIODataset
from recognition.data.sampler import AugmentedView, EpochBatches, ResumableSampler, draw_flip
from recognition.data.transforms import network_input
from recognition.training import train

SIZE = (32, 32)
FLIP, NONE = AugmentConfig(preset="flip"), AugmentConfig(preset="none")


def encode(image: Image.Image, format: str = "JPEG", **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format, **options)
    return buffer.getvalue()


def face(seed: int, size: tuple[int, int] = (32, 32)) -> Image.Image:
    """Smooth shapes and noise: JPEG's chroma subsampling and IDCT both matter on it."""
    rng = np.random.default_rng(seed)
    height, width = size
    y, x = np.mgrid[0:height, 0:width]
    base = 120 + 80 * np.sin(x / (3 + seed % 5))[..., None] * np.array([1.0, 0.6, 0.2])
    image = base + 30 * np.cos(y / 4)[..., None] + rng.normal(0, 12, (height, width, 3))
    return Image.fromarray(np.clip(image, 0, 255).astype(np.uint8))


def make_folder(root: Path, identities: int = 4, per: int = 5) -> Path:
    """JPEGs of two sizes: 32x32 (no resize) and 40x28 (resized to 32x32)."""
    for c in range(identities):
        (root / f"id{c}").mkdir(parents=True, exist_ok=True)
        for n in range(per):
            size = (32, 32) if n % 2 == 0 else (40, 28)
            (root / f"id{c}" / f"{n}.jpg").write_bytes(encode(face(10 * c + n, size), quality=90))
    return root


def bogus_huffman(data: bytes) -> bytes:
    """`data` with its first Huffman table made impossible: a JPEG header that `gpu_decodable`
    accepts but no decoder (libjpeg-turbo, nvJPEG) decodes."""
    data = bytearray(data)
    table = data.find(b"\xff\xc4")
    data[table + 5 : table + 21] = b"\xff" * 16
    return bytes(data)


def keys_of(source, epoch: int = 1, seed: int = 3) -> list[tuple[int, int]]:
    sampler = ResumableSampler(len(source), seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def both_paths(source, keys, memory_format=torch.contiguous_format, augment=FLIP):
    """(CPU path's images, labels), (GPU path's on device cpu, its batch)."""
    cpu = [AugmentedView(source, augment)[key] for key in keys]
    batch = collate_encoded([EncodedView(source, augment)[key] for key in keys])
    images, labels = decode_batch(
        batch,
        source,
        device=torch.device("cpu"),
        image_size=SIZE,
        memory_format=memory_format,
    )
    # The CPU path's batch as the step sees it (flips alone ship uint8, normalised there).
    cpu_images = network_input(torch.stack([x for x, _ in cpu]))
    return (cpu_images, [y for _, y in cpu]), (images, labels, batch)


@pytest.mark.parametrize("kind", ["folder", "recordio"])
def test_decode_batch_on_cpu_equals_the_cpu_path(tmp_path: Path, kind: str):
    folder = make_folder(tmp_path / "faces")
    if kind == "folder":
        source = ImageFolderDataset(folder, SIZE)
    else:
        pack.main([str(folder), str(tmp_path / "rec")])
        source = RecordIODataset(tmp_path / "rec", SIZE)
    keys = keys_of(source)
    (expected, expected_labels), (images, labels, batch) = both_paths(
        source, keys, torch.channels_last
    )
    assert (batch.lengths > 0).all() and batch.decoded == []  # the workers sent bytes only
    assert labels.dtype == torch.int64 and labels.tolist() == expected_labels
    flips = [draw_flip(seed) for _, seed in keys]
    assert batch.flips.tolist() == flips and 0 < sum(flips) < len(flips)
    assert images.shape == (len(keys), 3, *SIZE) and images.dtype == torch.float32
    assert images.is_contiguous(memory_format=torch.channels_last)
    # Tolerance 0: on the CPU both decoders are libjpeg-turbo (resized and flipped samples too).
    assert torch.equal(images, expected)


# Every operation of data.augment on about half the samples.
EVERYTHING = AugmentConfig(
    preset="none", flip=0.5, crop=0.5, colour=0.5, grey=0.3, low_res=0.5, blur=0.5,
    blur_sigma=[0.3, 1.2], erase=0.5,
)  # fmt: skip


@pytest.mark.parametrize(
    "augment",
    [AugmentConfig(preset="face"), AugmentConfig(preset="reid"), EVERYTHING],
    ids=["face", "reid", "everything"],
)
def test_decode_batch_augments_as_the_cpu_path(tmp_path: Path, augment: AugmentConfig):
    """data.augment on the GPU path (drawn by the workers, applied to the batch by
    augment_batch) against the CPU path (AugmentedView, image by image), on JPEGs of two
    sizes: the same parameters, images equal to float rounding."""
    source = ImageFolderDataset(make_folder(tmp_path / "faces", identities=6), SIZE)
    keys = keys_of(source)
    (expected, _), (images, labels, batch) = both_paths(source, keys, augment=augment)
    assert batch.augments == [draw_augment(augment, seed, SIZE) for _, seed in keys]
    assert sum(a.beyond_flip for a in batch.augments) >= 4
    torch.testing.assert_close(images, expected, rtol=0, atol=1e-5)
    plain = both_paths(source, keys, augment=NONE)[0][0]
    assert (images - plain).flatten(1).abs().amax(1).gt(0.01).sum() >= 4


def test_flips_follow_seed_epoch_and_index(tmp_path: Path):
    """The worker's flip is the CPU path's (`draw_flip` of the sample's seed), and, image by
    image (not through two shuffled orders), it changes between epochs."""
    source = ImageFolderDataset(make_folder(tmp_path / "faces"), SIZE)
    view = EncodedView(source, FLIP)
    one, other = keys_of(source, epoch=1), keys_of(source, epoch=2)
    assert [view[key][2].flip for key in one] == [draw_flip(seed) for _, seed in one]
    by_index = [{view[key][3]: view[key][2].flip for key in keys} for keys in (one, other)]
    assert set(by_index[0]) == set(by_index[1])
    assert any(by_index[0][i] != by_index[1][i] for i in by_index[0])
    assert not any(EncodedView(source, NONE)[key][2].flip for key in one)


@pytest.fixture
def odd_folder(tmp_path: Path) -> Path:
    """JPEGs nvJPEG decodes (grey, progressive, 4:4:4) and files it does not: PNG (8- and
    16-bit), CMYK JPEG, a PNG named .jpg."""
    root = tmp_path / "odd"
    for c in range(2):
        (root / f"id{c}").mkdir(parents=True)
    files = {
        "id0/0_grey.jpg": encode(face(1).convert("L")),
        "id0/1_progressive.jpg": encode(face(2), progressive=True),
        "id0/2_444.jpg": encode(face(3), subsampling=0, quality=95),
        "id0/3.png": encode(face(4, (36, 30)), "PNG"),
        "id1/0_cmyk.jpg": encode(face(5).convert("CMYK")),
        "id1/1_png_named.jpg": encode(face(6), "PNG"),
        "id1/2.jpg": encode(face(7, (40, 28))),
    }
    sixteen = (np.asarray(face(8).convert("L"), dtype=np.uint16) * 257).astype(np.uint16)
    files["id1/3_16bit.png"] = encode(Image.fromarray(sixteen), "PNG")
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root


def test_non_jpeg_files_are_decoded_by_the_workers_with_the_same_pixels(odd_folder: Path):
    source = ImageFolderDataset(odd_folder, SIZE)
    keys = [(index, 1000 + index) for index in range(len(source))]
    (expected, expected_labels), (images, labels, batch) = both_paths(source, keys)
    on_device = {source.paths[i] for i, n in enumerate(batch.lengths.tolist()) if n > 0}
    assert on_device == {"id0/0_grey.jpg", "id0/1_progressive.jpg", "id0/2_444.jpg", "id1/2.jpg"}
    assert len(batch.decoded) == 4  # the PNGs, the CMYK JPEG: decoded by PIL in the worker
    assert labels.tolist() == expected_labels
    assert torch.equal(images, expected)


def test_gpu_decodable_reads_the_header():
    image = face(0)
    assert gpu_decodable(encode(image))
    assert gpu_decodable(encode(image, progressive=True))
    assert gpu_decodable(encode(image.convert("L")))
    good = encode(image)
    assert not gpu_decodable(good[:-2])  # no end-of-image marker: truncated
    assert not gpu_decodable(good[: len(good) // 2])
    assert not gpu_decodable(encode(image.convert("CMYK")))
    assert not gpu_decodable(encode(image, "PNG"))
    assert not gpu_decodable(b"")
    assert not gpu_decodable(b"\xff\xd8\xff")


@pytest.fixture
def bad_folder(tmp_path: Path) -> Path:
    root = make_folder(tmp_path / "faces", identities=2, per=3)
    good = encode(face(99))
    (root / "id0" / "3_truncated.jpg").write_bytes(good[: len(good) // 2])
    (root / "id0" / "4_empty.jpg").write_bytes(b"")
    (root / "id1" / "3_bogus.jpg").write_bytes(bogus_huffman(good))  # fails on the device
    return root


def test_bad_image_error_names_the_file(bad_folder: Path):
    source = ImageFolderDataset(bad_folder, SIZE)
    paths = list(source.paths)
    view = EncodedView(source, FLIP)
    # Found by the worker (routed to PIL), with the CPU path's message.
    with pytest.raises(ValueError, match=r"id0/3_truncated.jpg: cannot decode.*on_bad_image=skip"):
        view[(paths.index("id0/3_truncated.jpg"), 0)]
    with pytest.raises(ValueError, match=r"id0/4_empty.jpg: cannot decode"):
        view[(paths.index("id0/4_empty.jpg"), 0)]
    # Found by the device decoder: the main process names the file in one line.
    bogus = paths.index("id1/3_bogus.jpg")
    batch = collate_encoded([view[(bogus, 0)], view[(0, 1)]])
    assert batch.lengths.tolist()[0] > 0
    with pytest.raises(ValueError) as caught:
        decode_batch(batch, source, device=torch.device("cpu"), image_size=SIZE)
    assert str(caught.value).startswith(f"{bad_folder / 'id1' / '3_bogus.jpg'}: cannot decode")
    assert "on_bad_image=skip" in str(caught.value) and "\n" not in str(caught.value)


def test_bad_image_skip_substitutes_as_the_cpu_path(bad_folder: Path):
    source = ImageFolderDataset(bad_folder, SIZE, on_bad_image="skip")
    keys = [(index, 7 * index) for index in range(len(source))]
    (expected, expected_labels), (images, labels, _) = both_paths(source, keys)
    # The CPU path replaced the three bad images once, the GPU path once more.
    assert source.take_bad_image_count() == 6
    assert labels.tolist() == expected_labels
    assert torch.equal(images, expected)


def test_a_jpeg_the_device_refuses_is_decoded_by_pil(tmp_path: Path, monkeypatch):
    source = ImageFolderDataset(make_folder(tmp_path / "faces"), SIZE)
    keys = keys_of(source)
    refused = source.encoded(keys[2][0])
    real = gpu_decode.decode_jpegs

    def picky(chunks, device):  # a device decoder that cannot read one of the files
        if any(chunk.numpy().tobytes() == refused for chunk in chunks):
            raise RuntimeError("Error while decoding JPEG images")
        return real(chunks, device)

    monkeypatch.setattr(gpu_decode, "decode_jpegs", picky)
    (expected, _), (images, _, _) = both_paths(source, keys)
    assert torch.equal(images, expected)
    assert source.take_bad_image_count() == 0


def test_decode_choice(tmp_path: Path, monkeypatch):
    jpegs = ImageFolderDataset(make_folder(tmp_path / "faces"), SIZE)
    pngs_root = tmp_path / "pngs"
    (pngs_root / "a").mkdir(parents=True)
    for n in range(3):
        (pngs_root / "a" / f"{n}.png").write_bytes(encode(face(n), "PNG"))
    pngs = ImageFolderDataset(pngs_root, SIZE)
    assert holds_jpeg(jpegs) and not holds_jpeg(pngs)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)

    def choice(decode: str, device: torch.device, source=jpegs) -> str:
        return resolve_decode(DataConfig(decode=decode), device, source)

    # Without a CUDA device: gpu is an error naming the key, auto quietly the CPU path.
    with pytest.raises(ConfigError, match=r"^data.decode: gpu .* trains on cpu \(no CUDA"):
        choice("gpu", cpu)
    assert choice("auto", cpu) == "cpu" and choice("cpu", cpu) == "cpu"
    with pytest.raises(ConfigError, match=r"^data.decode: gpu .* train.device=cpu"):
        load_config("default", ["data.decode=gpu", "train.device=cpu"])
    assert load_config("default", []).data.decode == "auto"

    # On a CUDA device (the nvJPEG probe stubbed): auto follows what the data holds.
    monkeypatch.setattr("recognition.data.build.nvjpeg_problem", lambda device: None)
    assert choice("auto", cuda) == "gpu" and choice("gpu", cuda) == "gpu"
    assert choice("auto", cuda, pngs) == "cpu" and choice("gpu", cuda, pngs) == "gpu"
    assert choice("cpu", cuda) == "cpu"
    monkeypatch.setattr(
        "recognition.data.build.nvjpeg_problem", lambda device: "not compiled with nvJPEG"
    )
    assert choice("auto", cuda) == "cpu"
    with pytest.raises(ConfigError, match=r"^data.decode: gpu, .*not compiled with nvJPEG"):
        choice("gpu", cuda)


def test_gpu_without_cuda_stops_at_start_up_naming_the_key(tmp_path: Path, capsys):
    """train.py data.decode=gpu where the run trains on the CPU: one line, exit 1, nothing
    written into the run directory."""
    import train as entry

    data = make_folder(tmp_path / "faces")
    out = tmp_path / "run"
    assert entry.main(tiny_run(data, out, "gpu")) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: data.decode: gpu decodes JPEGs with nvJPEG on a CUDA")
    assert not (out / "config.yaml").exists() and not (out / "checkpoints").exists()


def test_loader_batches_across_epochs_with_workers(tmp_path: Path):
    """`build_loader` with gpu on the CPU: worker processes send EncodedBatch, the batches
    equal the CPU path's over an epoch boundary, and the bytes come whole out of the workers."""
    source = ImageFolderDataset(make_folder(tmp_path / "faces"), SIZE)
    cfg = DataConfig(root=str(tmp_path / "faces"), image_size=32, num_workers=2)
    loaders = {}
    for decode in ("cpu", "gpu"):
        batches = EpochBatches(ResumableSampler(len(source), seed=5), 6, 3)
        batches.start_at(0, 1)
        loaders[decode] = build_loader(
            cfg,
            source,
            batches,
            decode=decode,
            device=torch.device("cpu"),
            generator=torch.Generator().manual_seed(0),
        )
    cpu_batches, gpu_batches = iter(loaders["cpu"]), iter(loaders["gpu"])
    for _ in range(5):  # 2 batches of epoch 0, 3 of epoch 1
        x_cpu, y_cpu = next(cpu_batches)
        x_gpu, y_gpu = next(gpu_batches)
        assert x_cpu.dtype == torch.uint8  # normalised by the step (network_input)
        assert torch.equal(y_cpu, y_gpu) and torch.equal(network_input(x_cpu), x_gpu)


def tiny_run(data: Path, out: Path, decode: str = "cpu") -> list[str]:
    return [
        f"output_dir={out}",
        f"data.root={data}",
        "data.synthetic.enabled=false",
        "data.image_size=32",
        "data.num_workers=0",
        f"data.decode={decode}",
        "model.width=0.125",
        "model.embedding_size=8",
        "train.batch_size=6",
        "train.epochs=2",
        "train.log_every=1",
        "train.progress=false",
        "eval.targets=[]",
        "eval.at_end=false",
    ]


def losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def test_training_losses_equal_with_either_decoder(tmp_path: Path, monkeypatch):
    """Two epochs of training (6 steps) give the same losses, to the bit, with the batches
    decoded by the workers or by `decode_batch` (forced onto the CPU device here)."""
    data = make_folder(tmp_path / "faces")
    reference = losses(train(load_config("default", tiny_run(data, tmp_path / "cpu"))))
    monkeypatch.setattr("recognition.training.build.resolve_decode", lambda *args: "gpu")
    decoded = losses(train(load_config("default", tiny_run(data, tmp_path / "gpu"))))
    assert len(reference) == 6 and decoded == reference


def test_training_with_augmentation_steps_on_the_same_images_with_either_decoder(
    tmp_path: Path, monkeypatch
):
    """train() with data.augment=face (its operations on half the images): the steps see
    the same images with either decoder, to float rounding (the batched resampling and blur
    add their sums in another order): the first step's loss (the same weights, inputs a
    rounding apart) agrees to 1e-5, the later ones, after updates that compound the rounding
    in this tiny run whose loss climbs, to 1e-2."""
    data = make_folder(tmp_path / "faces")
    augment = ["data.augment=face", *(f"data.augment.{key}=0.5" for key in
               ("crop", "colour", "grey", "low_res", "blur"))]  # fmt: skip
    cpu = losses(train(load_config("default", [*tiny_run(data, tmp_path / "cpu"), *augment])))
    monkeypatch.setattr("recognition.training.build.resolve_decode", lambda *args: "gpu")
    gpu = losses(train(load_config("default", [*tiny_run(data, tmp_path / "gpu"), *augment])))
    assert len(cpu) == 6 and gpu[0] == pytest.approx(cpu[0], rel=1e-5)
    assert gpu == pytest.approx(cpu, rel=1e-2)


# ---------------------------------------------------------------------- on a GPU (skipped here)


# nvJPEG rounds its IDCT and upsamples chroma its own way. Measured on an H200 (torch 2.11,
# torchvision 0.26) on the synthetic faces below: a mean of 2.04 levels of 255 and a maximum of
# 107 (at sharp colour edges, where 4:2:0 chroma upsampling differs most). What these tests
# are for moves the mean much further (measured on the CPU on the same images): a 3x3 blur
# 4.1, a one-pixel shift 7.3, red and blue swapped 39, a wrong flip 48. So the mean is
# bounded between the two, and the maximum, which a one-pixel shift and nvJPEG's chroma both
# take past 100, is not.
NVJPEG_MEAN_LEVELS = 3.0


@needs_cuda
def test_nvjpeg_batches_match_the_cpu_path_within_tolerance(tmp_path: Path):
    """nvJPEG against libjpeg-turbo on the same files: same labels and flips, pixels within
    NVJPEG_MEAN_LEVELS on average. The differences measured are printed (pytest -s)."""
    from recognition.data.synthetic import SyntheticSpec, ensure_synthetic_dataset

    ensure_synthetic_dataset(tmp_path / "synthetic", SyntheticSpec.training_set(16, 8))
    source = ImageFolderDataset(tmp_path / "synthetic" / "train", 112)
    keys = keys_of(source)
    expected = network_input(torch.stack([AugmentedView(source, FLIP)[key][0] for key in keys]))
    batch = collate_encoded([EncodedView(source, FLIP)[key] for key in keys])
    images, labels = decode_batch(
        batch.pin_memory(),
        source,
        device=torch.device("cuda"),
        image_size=(112, 112),
        memory_format=torch.channels_last,
    )
    assert images.is_cuda and images.is_contiguous(memory_format=torch.channels_last)
    assert labels.cpu().tolist() == [int(source.labels[i]) for i, _ in keys]
    levels = (images.cpu() - expected).abs() * 127.5  # [-1, 1] back to 0..255 levels
    print(f"nvJPEG vs PIL: mean {levels.mean():.3f}, max {levels.max():.1f} levels")
    assert levels.mean() <= NVJPEG_MEAN_LEVELS
    mirrored = (images.cpu().flip(-1) - expected).abs() * 127.5
    assert mirrored.mean() > 4 * NVJPEG_MEAN_LEVELS  # the bound does tell a wrong flip apart


@needs_cuda
def test_nvjpeg_batches_augment_as_the_cpu_path(tmp_path: Path):
    """data.augment=face on the device (augment_batch on CUDA) against the CPU path: the
    same parameters, pixels within the decoders' NVJPEG_MEAN_LEVELS on average."""
    from recognition.data.synthetic import SyntheticSpec, ensure_synthetic_dataset

    ensure_synthetic_dataset(tmp_path / "synthetic", SyntheticSpec.training_set(16, 8))
    source = ImageFolderDataset(tmp_path / "synthetic" / "train", 112)
    keys = keys_of(source)
    augment = AugmentConfig(preset="face")
    expected = torch.stack([AugmentedView(source, augment)[key][0] for key in keys])
    batch = collate_encoded([EncodedView(source, augment)[key] for key in keys])
    assert batch.augments is not None
    images, _ = decode_batch(
        batch.pin_memory(), source, device=torch.device("cuda"), image_size=(112, 112)
    )
    levels = (images.cpu() - expected).abs() * 127.5
    print(f"augmented, nvJPEG vs PIL: mean {levels.mean():.3f}, max {levels.max():.1f} levels")
    assert levels.mean() <= NVJPEG_MEAN_LEVELS


@needs_cuda
def test_training_with_nvjpeg_steps_on_the_cpu_paths_batches(tmp_path: Path, monkeypatch):
    """10 steps on a CUDA device with data.decode=gpu and with cpu: the training step gets
    the same labels and, within the decoders' levels (as above), the same images, and the
    losses are finite. The memory check is off: its planner steps the model too, on fake
    tensors, and would add a batch to those recorded. The losses themselves are not
    compared: this tiny untrained run moves its first loss by 1-3 % for inputs changed by a
    level or two, and its later ones by tens of % (measured on the CPU with noise in place
    of nvJPEG's differences)."""
    import recognition.training.build as build_module

    data = make_folder(tmp_path / "faces", identities=6, per=10)
    real_step = build_module.train_step
    batches = {}
    for decode in ("cpu", "gpu"):
        seen = batches[decode] = []

        def step(model, head, micro_batches, *rest, seen=seen):
            seen.extend((x.float().cpu(), y.cpu()) for x, y in micro_batches)
            return real_step(model, head, micro_batches, *rest)

        monkeypatch.setattr(build_module, "train_step", step)
        overrides = tiny_run(data, tmp_path / decode, decode)
        overrides += ["train.device=cuda", "train.max_steps=10", "train.memory_check=false"]
        run_losses = losses(train(load_config("default", overrides)))
        assert len(run_losses) == 10 and all(np.isfinite(run_losses)), run_losses
    assert len(batches["gpu"]) == len(batches["cpu"]) == 10
    for (gpu, gpu_labels), (cpu, cpu_labels) in zip(batches["gpu"], batches["cpu"], strict=True):
        assert torch.equal(gpu_labels, cpu_labels)
        levels = (gpu - cpu).abs() * 127.5
        print(f"nvJPEG vs PIL: mean {levels.mean():.3f}, max {levels.max():.1f} levels")
        assert levels.mean() <= NVJPEG_MEAN_LEVELS


def _ahead_threads() -> list:
    import threading

    return [t for t in threading.enumerate() if t.name == "decode-ahead"]


def gpu_loader(folder: Path, ahead: int, augment: AugmentConfig, workers: int = 1):
    source = ImageFolderDataset(folder, SIZE)
    cfg = DataConfig(
        root=str(folder), image_size=32, num_workers=workers, decode_ahead=ahead, augment=augment
    )
    batches = EpochBatches(ResumableSampler(len(source), seed=5), 4, 4)
    batches.start_at(0, 2)
    return build_loader(
        cfg,
        source,
        batches,
        decode="gpu",
        device=torch.device("cpu"),
        generator=torch.Generator().manual_seed(0),
    )


@pytest.mark.parametrize("augment", [FLIP, AugmentConfig(preset="face")])
def test_batches_decoded_ahead_equal_those_decoded_when_asked(tmp_path: Path, augment):
    """data.decode_ahead: the batches a thread decodes 1 or 3 ahead are, bit for bit and in
    order, those the training thread decodes itself (0), across an epoch boundary; the thread
    runs while they are taken and is gone once the iterator is closed."""
    folder = make_folder(tmp_path / "faces")
    seen = {}
    for ahead in (0, 1, 3):
        iterator = iter(gpu_loader(folder, ahead, augment))
        seen[ahead] = [next(iterator) for _ in range(6)]  # 2 batches of epoch 0, 4 of epoch 1
        assert len(_ahead_threads()) == (1 if ahead else 0)
        iterator.close()
        assert _ahead_threads() == []
    for ahead in (1, 3):
        for (x0, y0), (x, y) in zip(seen[0], seen[ahead], strict=True):
            assert torch.equal(x0, x) and torch.equal(y0, y)


def test_an_error_in_the_decoding_thread_reaches_the_training_thread():
    """What the thread raises (a bad image under on_bad_image=error) is raised where the
    batch is taken, after the batches before it, with its message; the thread ends."""
    from recognition.data.ahead import made_ahead

    def batches():
        for i in range(5):
            if i == 3:
                raise ValueError("faces/b/3.jpg: not an image")
            yield (torch.tensor([i]),)

    taken = []
    with pytest.raises(ValueError, match="faces/b/3.jpg: not an image"):
        for (x,) in made_ahead(batches(), 2, torch.device("cpu")):
            taken.append(int(x))
    assert taken == [0, 1, 2] and _ahead_threads() == []


def test_stopping_early_stops_the_thread_and_the_loaders_workers(tmp_path: Path):
    """The loop's stop_workers on a DeviceBatches iterator whose thread is blocked on a full
    queue: the thread stops, the DataLoader iterator it held is closed, the workers exit."""
    import multiprocessing
    import time

    from recognition.data.workers import stop_workers

    before = {child.pid for child in multiprocessing.active_children()}
    loader = gpu_loader(make_folder(tmp_path / "faces"), 2, FLIP, workers=2)
    iterator = iter(loader)
    next(iterator)
    time.sleep(0.5)  # the thread fills its 2 slots and waits on the full queue
    assert len(_ahead_threads()) == 1
    stop_workers(loader, iterator)
    assert _ahead_threads() == []
    assert [c.pid for c in multiprocessing.active_children() if c.pid not in before] == []


def test_decode_ahead_below_zero_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="data.decode_ahead: must be 0 or more"):
        DataConfig(decode_ahead=-1)


@needs_cuda
def test_nvjpeg_batches_decoded_ahead_on_a_stream_equal_those_decoded_when_asked(tmp_path):
    """On CUDA the thread decodes on a stream of its own: the step's stream waits for each
    batch's event, so the batches equal those decoded in the training thread."""
    folder = make_folder(tmp_path / "faces")
    source = ImageFolderDataset(folder, SIZE)
    seen = {}
    for ahead in (0, 2):
        cfg = DataConfig(root=str(folder), image_size=32, num_workers=1, decode_ahead=ahead)
        batches = EpochBatches(ResumableSampler(len(source), seed=5), 4, 4)
        loader = build_loader(
            cfg, source, batches, decode="gpu", device=torch.device("cuda"),
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        iterator = iter(loader)
        seen[ahead] = [tuple(t.clone() for t in next(iterator)) for _ in range(6)]
        iterator.close()
    for (x0, y0), (x, y) in zip(seen[0], seen[2], strict=True):
        assert torch.equal(x0, x) and torch.equal(y0, y)
