"""The training-data factory, bad-image policy, Market-1501 source, P x K sampler, configs."""

from __future__ import annotations

import io
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from recognition.checkpoint import load_backbone
from recognition.config import AugmentConfig, ConfigError, DataConfig, load_config
from recognition.data import pack
from recognition.data.build import build_sampler, build_train_dataset, resolve_format
from recognition.data.image_folder import ImageFolderDataset
from recognition.data.market_train import Market1501TrainDataset
from recognition.data.recordio import RecordIODataset
from recognition.data.sampler import IdentityBalancedSampler
from recognition.training import TrainingError, train


def jpeg(seed: int, mode: str = "RGB", size: int = 24) -> bytes:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    image.convert(mode).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def png(seed: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((20, 20, 3), seed % 256, np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def make_folder(root: Path, identities: int = 3, per: int = 4) -> Path:
    for c in range(identities):
        (root / f"id{c}").mkdir(parents=True, exist_ok=True)
        for n in range(per):
            (root / f"id{c}" / f"{n}.jpg").write_bytes(jpeg(10 * c + n))
    return root


def make_market(root: Path, persons: int = 6, per: int = 4) -> Path:
    folder = root / "bounding_box_train"
    folder.mkdir(parents=True)
    for p in range(persons):
        pid = 2 + 3 * p  # ids with gaps, as in the real data
        for n in range(per):
            name = f"{pid:04d}_c{1 + n % 6}s1_{100 * n:06d}_0{n}.jpg"
            (folder / name).write_bytes(jpeg(100 * p + n, size=32))
    (folder / "-1_c1s1_000001_00.jpg").write_bytes(jpeg(7))  # junk: left out
    (folder / "0000_c1s1_000002_00.jpg").write_bytes(jpeg(8))  # distractor: left out
    (folder / "Thumbs.db").write_bytes(b"x")
    return root


# ---------------------------------------------------------------------- the factory


def test_format_auto_picks_the_source(tmp_path: Path):
    folder = make_folder(tmp_path / "faces")
    assert resolve_format(DataConfig(root=str(folder))) == "folder"
    dataset = build_train_dataset(DataConfig(root=str(folder), image_size=16))
    assert isinstance(dataset, ImageFolderDataset) and dataset.num_classes == 3
    assert dataset.index.source is not None  # cached and memory-mapped

    assert pack.main([str(folder), str(tmp_path / "rec")]) == 0
    packed = build_train_dataset(DataConfig(root=str(tmp_path / "rec"), image_size=16))
    assert isinstance(packed, RecordIODataset)
    assert packed.labels.tolist() == dataset.labels.tolist()

    market = make_market(tmp_path / "market")
    source = build_train_dataset(DataConfig(root=str(market), image_size=16))
    assert isinstance(source, Market1501TrainDataset)
    assert source.num_classes == 6 and len(source) == 24
    assert [source.class_name(c) for c in range(6)] == [f"{2 + 3 * p:04d}" for p in range(6)]
    for i in range(len(source)):  # labels from the file names
        assert source.class_name(int(source.labels[i])) == source.paths[i][:4]

    with pytest.raises(ConfigError, match="data.prefetch_factor"):
        DataConfig(num_workers=0, prefetch_factor=2)


# ---------------------------------------------------------------------- bad images


@pytest.fixture
def messy_folder(tmp_path: Path) -> Path:
    root = make_folder(tmp_path / "faces", identities=2, per=3)
    good = jpeg(1)
    (root / "id0" / "3_truncated.jpg").write_bytes(good[: len(good) // 2])
    (root / "id0" / "4_empty.jpg").write_bytes(b"")
    (root / "id1" / "3_png_named.jpg").write_bytes(png(5))  # wrong extension: decodes
    (root / "id1" / "4_grey.jpg").write_bytes(jpeg(2, "L"))
    (root / "id1" / "5_cmyk.jpg").write_bytes(jpeg(3, "CMYK"))
    return root


def test_bad_image_error_names_the_file(messy_folder: Path):
    dataset = ImageFolderDataset(messy_folder, 16)
    bad = [i for i, p in enumerate(dataset.paths) if "truncated" in p][0]
    with pytest.raises(ValueError, match="id0/3_truncated.jpg: cannot decode"):
        dataset[bad]
    for i, path in enumerate(dataset.paths):  # grey, CMYK and the PNG named .jpg all load
        if path.startswith("id1/"):
            image, label = dataset[i]
            assert image.shape == (3, 16, 16) and label == 1


def test_bad_image_skip_substitutes_the_same_identity_and_counts(messy_folder: Path, caplog):
    dataset = ImageFolderDataset(messy_folder, 16, on_bad_image="skip")
    paths = list(dataset.paths)
    truncated = paths.index("id0/3_truncated.jpg")
    empty = paths.index("id0/4_empty.jpg")
    image, label = dataset[truncated]
    assert label == 0
    # The next readable image of the identity, wrapping around: 4 is bad too, so 0.
    assert torch.equal(image, dataset[paths.index("id0/0.jpg")][0])
    assert "3_truncated.jpg" in caplog.text
    assert dataset.take_bad_image_count() == 1
    assert dataset.take_bad_image_count() == 0

    # Over an epoch in two worker processes: the counts add up in the parent.
    loader = DataLoader(dataset, batch_size=4, num_workers=2)
    labels = torch.cat([y for _, y in loader])
    assert labels.tolist() == dataset.labels.tolist()
    assert dataset.take_bad_image_count() == 2
    assert empty != truncated

    # An identity with nothing readable is an error.
    for name in ("0.jpg", "1.jpg", "2.jpg"):
        (messy_folder / "id0" / name).write_bytes(b"broken")
    with pytest.raises(ValueError, match="identity 'id0'.*none of its 5 images"):
        dataset[truncated]


def test_training_reports_bad_images_at_the_end_of_the_epoch(messy_folder: Path, tmp_path):
    cfg = load_config(
        "default",
        [
            f"output_dir={tmp_path / 'run'}",
            f"data.root={messy_folder}",
            "data.synthetic.enabled=false",
            "data.image_size=16",
            "data.num_workers=0",
            "data.on_bad_image=skip",
            "model.width=0.125",
            "model.embedding_size=8",
            "train.batch_size=5",
            "train.epochs=1",
            "train.progress=false",
            "eval.targets=[]",
        ],
    )
    run_dir = train(cfg)
    assert "epoch 0: 2 unreadable images replaced" in (run_dir / "train.log").read_text()


# ---------------------------------------------------------------------- P x K sampler


def test_pk_batches_hold_whole_groups_and_ranks_do_not_overlap():
    rng = np.random.default_rng(0)
    labels = np.sort(rng.integers(0, 23, size=300)).astype(np.int32)
    labels[:2] = 23  # identity 23 has 2 images, fewer than K: its group repeats images
    k, batch, world = 4, 12, 3
    samplers = [
        IdentityBalancedSampler(
            labels, instances=k, batch_size=batch, num_replicas=world, rank=r, seed=7
        )
        for r in range(world)
    ]
    per_rank = [[i for i, _ in s] for s in samplers]
    assert len({len(x) for x in per_rank}) == 1 and len(per_rank[0]) % batch == 0
    assert len(samplers[0]) == len(per_rank[0])
    groups_seen = []
    for indices in per_rank:
        for start in range(0, len(indices), batch):
            batch_labels = labels[indices[start : start + batch]]
            groups = batch_labels.reshape(-1, k)
            assert (groups == groups[:, :1]).all()  # each group: one identity
            groups_seen += [
                tuple(sorted(indices[start + g * k : start + g * k + k])) for g in range(3)
            ]
    # No group is served twice (a group would repeat if ranks overlapped).
    assert len(groups_seen) == len(set(groups_seen))
    # Every identity with >= K images shows up; an epoch uses most of the data.
    assert set(labels[np.concatenate(per_rank)].tolist()) >= set(range(23)) - {0}


def test_pk_resume_and_epochs():
    labels = np.repeat(np.arange(10), 6).astype(np.int32)
    sampler = IdentityBalancedSampler(labels, instances=3, batch_size=6, num_replicas=2, rank=1)
    sampler.set_epoch(4)
    full = list(sampler)
    sampler.set_epoch(4, start=6)
    assert list(sampler) == full[6:] and len(sampler) == len(full) - 6
    sampler.set_epoch(5)
    assert [i for i, _ in sampler] != [i for i, _ in full]
    # The same order on a fresh sampler (nothing but (seed, epoch) decides it).
    again = IdentityBalancedSampler(labels, instances=3, batch_size=6, num_replicas=2, rank=1)
    again.set_epoch(4)
    assert list(again) == full
    # Seeds differ per position even when the index repeats.
    assert len({seed for _, seed in full}) == len(full)
    with pytest.raises(ConfigError, match="data.pk_instances"):
        build_sampler(
            DataConfig(sampler="pk", pk_instances=4),
            labels,
            batch_size=6,
            num_replicas=1,
            rank=0,
            seed=0,
        )
    counts = Counter(labels[[i for i, _ in full]].tolist())
    assert all(v % 3 == 0 for v in counts.values())


# ---------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    "name, backbone, margin, scale, m",
    [
        ("ms1m_arcface", "iresnet50", "arcface", 64.0, 0.5),
        ("glint360k_cosface", "iresnet100", "cosface", 64.0, 0.4),
        ("webface42m_arcface_pfc", "iresnet100", "arcface", 64.0, 0.5),
        ("market1501_reid", "resnet50_reid", "cosface", 30.0, 0.35),
    ],
)
def test_shipped_configs_load(name, backbone, margin, scale, m):
    cfg = load_config(name)
    assert (cfg.model.backbone, cfg.head.margin, cfg.head.scale, cfg.head.m) == (
        backbone,
        margin,
        scale,
        m,
    )
    assert cfg.name == name
    if name != "market1501_reid":
        assert (cfg.optim.name, cfg.optim.lr, cfg.optim.weight_decay) == ("sgd", 0.1, 5e-4)
        assert (cfg.train.batch_size, cfg.train.epochs, cfg.data.image_size) == (128, 20, 112)
        assert cfg.head.sample_rate == (0.2 if "pfc" in name else 1.0)
    else:
        assert cfg.data.sampler == "pk" and cfg.train.batch_size % cfg.data.pk_instances == 0
        assert cfg.data.image_size == [256, 128]  # person crops keep their 2:1 aspect ratio


def test_market1501_config_trains_on_a_tiny_market_tree(tmp_path: Path):
    root = make_market(tmp_path / "market", persons=6, per=4)
    cfg = load_config(
        "market1501_reid",
        [
            f"output_dir={tmp_path / 'run'}",
            f"data.root={root}",
            # [H, W] like the config's [256, 128]: IResNet checks every batch is 32x16.
            "data.image_size=[32, 16]",
            "data.num_workers=0",
            "model.backbone=iresnet18",
            "model.width=0.125",
            "model.embedding_size=8",
            "train.batch_size=8",
            "train.max_steps=2",
            "train.progress=false",
            "precision.level=O0",
        ],
    )
    run_dir = train(cfg)
    assert (run_dir / "classes.txt").read_text().split() == [f"{2 + 3 * p:04d}" for p in range(6)]
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) >= 1
    # The export keeps (H, W), and rebuilds a backbone that takes 32x16 images.
    backbone, image_size = load_backbone(run_dir / "backbone.pt", torch.device("cpu"))
    assert image_size == (32, 16)
    with torch.no_grad():
        assert backbone(torch.randn(2, 3, 32, 16)).shape == (2, 8)

    # Resuming on other data with as many classes but other names is refused, naming
    # classes.txt (person 0002 renamed 0099: the same class matrix shape, other labels).
    for crop in (root / "bounding_box_train").glob("0002_*.jpg"):
        crop.rename(crop.with_name("0099" + crop.name[4:]))
    with pytest.raises(TrainingError, match="classes.txt"):
        train(load_config(str(run_dir / "config.yaml"), ["train.resume=true", "train.max_steps=3"]))


class _Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)


@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("wrapped", [False, True])
def test_stop_workers_ends_a_loaders_workers_at_once(persistent, wrapped):
    """A DataLoader's workers, or those of a generator over one (DeviceBatches), are gone
    when stop_workers returns, persistent or not; the loader and iterator stay referenced
    (as the run holds them), so nothing but stop_workers can have ended them."""
    import multiprocessing

    from recognition.data.workers import stop_workers

    before = {child.pid for child in multiprocessing.active_children()}
    loader = DataLoader(_Numbers(), batch_size=4, num_workers=2, persistent_workers=persistent)
    holder = type("Holder", (), {})()  # what DeviceBatches is to the training loop
    holder.loader = loader
    iterator = (batch for batch in loader) if wrapped else iter(loader)
    assert int(next(iterator)[0]) == 0

    def ours() -> list[int]:
        return [c.pid for c in multiprocessing.active_children() if c.pid not in before]

    assert len(ours()) == 2
    stop_workers(holder if wrapped else loader, iterator)
    assert ours() == []
    del iterator, loader, holder


@pytest.mark.parametrize("kind", ["folder", "recordio"])
def test_cpu_workers_ship_uint8_and_the_step_sees_the_images_of_before(tmp_path: Path, kind):
    """data.decode=cpu with flips alone: a worker's batch is uint8 (a quarter of float32's
    bytes), and what the step sees after `network_input` is, bit for bit, each image decoded,
    flipped by its seed and normalised as (x / 255 - 0.5) / 0.5 in float32, computed here
    with numpy from the sample's encoded bytes."""
    from recognition.data.build import build_loader
    from recognition.data.sampler import ResumableSampler
    from recognition.data.transforms import network_input

    folder = make_folder(tmp_path / "faces", identities=2, per=3)
    if kind == "recordio":
        pack.main([str(folder), str(tmp_path / "rec")])
        folder = tmp_path / "rec"
    cfg = DataConfig(root=str(folder), image_size=24, num_workers=1)
    source = build_train_dataset(cfg)
    sampler = ResumableSampler(len(source), seed=3)
    sampler.set_epoch(1)
    keys = list(sampler)
    loader = build_loader(cfg, source, [keys], decode="cpu", device=torch.device("cpu"))
    images, labels = next(iter(loader))
    assert images.dtype == torch.uint8 and images.shape == (len(keys), 3, 24, 24)
    expected = []
    for index, seed in keys:
        rgb = np.asarray(Image.open(io.BytesIO(source.encoded(index))).convert("RGB"))
        if random.Random(seed).random() < 0.5:  # the flip preset's draw
            rgb = rgb[:, ::-1]
        scaled = rgb.transpose(2, 0, 1).astype(np.float32) * np.float32(1 / 255)
        expected.append((scaled - np.float32(0.5)) / np.float32(0.5))
    seen = network_input(images)
    assert seen.dtype == torch.float32
    assert torch.equal(seen, torch.from_numpy(np.stack(expected)))
    assert labels.tolist() == [int(source.labels[i]) for i, _ in keys]


def test_presets_that_augment_in_float_ship_float(tmp_path: Path):
    """data.augment=face augments in float on the worker (apply_augment): its batches stay
    float32 in [-1, 1], which `network_input` passes through unchanged."""
    from recognition.data.build import build_loader
    from recognition.data.sampler import ResumableSampler
    from recognition.data.transforms import network_input

    cfg = DataConfig(root=str(make_folder(tmp_path / "faces", 2, 2)), image_size=24,
                     num_workers=0, augment=AugmentConfig(preset="face"))  # fmt: skip
    source = build_train_dataset(cfg)
    keys = list(ResumableSampler(len(source), seed=1))
    images, _ = next(iter(build_loader(cfg, source, [keys], decode="cpu",
                                       device=torch.device("cpu"))))  # fmt: skip
    assert images.dtype == torch.float32 and -1 <= images.min() and images.max() <= 1
    assert network_input(images) is images
