"""Build the training data from `DataConfig`: the source, the sampler, the DataLoader options.

`data.format` picks the source (`auto` looks at `data.root`):

    recordio     root/train.rec + root/train.idx      insightface packs (MS1MV3, Glint360K, ...)
    market1501   root/bounding_box_train/             Market-1501 / DukeMTMC-reID crops
    msmt17       root/list_train.txt, train/ ...       MSMT17 (V1 or V2)
    cuhk03       root/cuhk03_new_protocol_config_*.mat CUHK03, the new protocol's split
    folder       root/<identity>/<image>              anything else; cached compact index

`data.decode` picks where images are decoded (`resolve_decode`): in the DataLoader workers
(cpu, `AugmentedView`), or on the GPU, the workers reading bytes only (gpu,
`recognition.data.gpu_decode`); `build_loader` makes the loader of either.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from recognition.config import ConfigError, DataConfig
from recognition.data.formats import resolve_format
from recognition.data.gpu_decode import (
    DeviceBatches,
    EncodedView,
    collate_encoded,
    holds_jpeg,
    nvjpeg_problem,
)
from recognition.data.image_folder import ImageFolderDataset
from recognition.data.index import open_index
from recognition.data.sampler import AugmentedView, IdentityBalancedSampler, ResumableSampler
from recognition.data.source import TrainSource
from recognition.data.teacher_table import TeacherTable
from recognition.data.workers import exit_with_parent
from recognition.registry import FORMATS, load

log = logging.getLogger(__name__)


def build_train_dataset(
    data_cfg: DataConfig,
    *,
    rank_is_main: bool = True,
    barrier: Callable[[], None] = lambda: None,
    class_names: Sequence[str] | None = None,
) -> TrainSource:
    """The training source of `data_cfg` (see the module docstring).

    Collective through `barrier` for image folders: the main rank builds or checks the
    cached index while the others wait, then all map it. `class_names` fixes the label
    order of an image folder (others ignore it). Samples come unaugmented (`train=False`): the
    training loop augments through `AugmentedView`, seeded per sample (`data.augment`).
    """
    kind = resolve_format(data_cfg)
    size = data_cfg.image_hw
    policy = data_cfg.on_bad_image
    if kind != "folder":  # registry.FORMATS' contract: (root, (H, W), on_bad_image=...)
        extra = {"cuhk03_boxes": data_cfg.cuhk03_boxes} if kind == "cuhk03" else {}
        source = load(FORMATS, kind, "data.format")
        return source(data_cfg.root, size, on_bad_image=policy, **extra)
    index = open_index(
        data_cfg.root,
        cache_dir=data_cfg.cache_dir,
        class_names=class_names,
        on_empty=data_cfg.on_empty_class,
        refresh=data_cfg.rebuild_index,
        rank_is_main=rank_is_main,
        barrier=barrier,
    )
    return ImageFolderDataset(
        data_cfg.root,
        size,
        index=index,
        on_bad_image=policy,
    )


def build_sampler(
    data_cfg: DataConfig,
    labels: np.ndarray,
    *,
    batch_size: int,
    num_replicas: int,
    rank: int,
    seed: int,
) -> ResumableSampler | IdentityBalancedSampler:
    """The training order: `data.sampler` random (DistributedSampler's) or pk (P x K)."""
    if data_cfg.sampler == "pk":
        if batch_size % data_cfg.pk_instances:
            raise ConfigError(
                f"data.pk_instances: train.batch_size {batch_size} is not a multiple of "
                f"{data_cfg.pk_instances} (a batch holds whole groups of K images)"
            )
        return IdentityBalancedSampler(
            labels,
            instances=data_cfg.pk_instances,
            batch_size=batch_size,
            num_replicas=num_replicas,
            rank=rank,
            seed=seed,
        )
    return ResumableSampler(len(labels), num_replicas=num_replicas, rank=rank, seed=seed)


def loader_options(data_cfg: DataConfig, device: torch.device) -> dict[str, Any]:
    """DataLoader keyword arguments for workers, pinning and prefetching."""
    workers = data_cfg.num_workers
    options: dict[str, Any] = {
        "num_workers": workers,
        # Pinned host memory lets the copy to the GPU run asynchronously (non_blocking).
        "pin_memory": device.type == "cuda" if data_cfg.pin_memory is None else data_cfg.pin_memory,
        # Workers go when the main process goes, even when it is killed by a signal.
        "worker_init_fn": exit_with_parent,
    }
    if workers > 0:
        # Persistent workers keep their processes (and the pages of the index they touched)
        # from one epoch to the next instead of forking new ones at every epoch.
        options["persistent_workers"] = data_cfg.persistent_workers
        if data_cfg.prefetch_factor is not None:
            options["prefetch_factor"] = data_cfg.prefetch_factor
    return options


def resolve_decode(
    data_cfg: DataConfig, device: torch.device, source: TrainSource
) -> Literal["cpu", "gpu"]:
    """Where the images of `source` are decoded when training on `device`: `data.decode`,
    with `auto` resolved (gpu on a CUDA device that decodes JPEG when `source` holds JPEGs,
    else cpu).

    Raises ConfigError naming data.decode when it says gpu and `device` cannot decode: not
    a CUDA device, or a torchvision without nvJPEG.
    """
    choice = data_cfg.decode
    if choice == "cpu":
        return "cpu"
    if device.type != "cuda":
        if choice == "gpu":
            raise ConfigError(
                f"data.decode: gpu decodes JPEGs with nvJPEG on a CUDA device, but this "
                f"process trains on {device} (no CUDA device, or train.device=cpu); use "
                "data.decode=cpu, or auto, which decodes on the CPU workers here"
            )
        return "cpu"
    problem = nvjpeg_problem(device)
    if problem is not None:
        if choice == "gpu":
            raise ConfigError(
                f"data.decode: gpu, but torchvision cannot decode JPEGs on {device} ({problem}); "
                "use data.decode=cpu"
            )
        log.warning("data.decode=auto: decoding on the CPU workers, not on %s: %s", device, problem)
        return "cpu"
    if choice == "auto" and not holds_jpeg(source):
        log.info(
            "data.decode=auto: %s holds other images than JPEG; decoding them on the CPU",
            data_cfg.root,
        )
        return "cpu"
    log.info("decoding JPEGs on %s (data.decode=%s); the loader workers read bytes", device, choice)
    return "gpu"


def build_loader(
    data_cfg: DataConfig,
    source: TrainSource,
    batch_sampler: Sampler,
    *,
    decode: Literal["cpu", "gpu"],
    device: torch.device,
    memory_format: torch.memory_format = torch.preserve_format,
    generator: torch.Generator | None = None,
    targets: TeacherTable | None = None,
) -> Iterable[tuple[torch.Tensor, ...]]:
    """The training batches of `source` in the order of `batch_sampler` (batches of
    `(index, sample_seed)` keys), as ((B, 3, H, W) images, (B,) labels); with `targets` (a
    distilled run's `TeacherTable`), also the teacher's embeddings (B, D) of the views
    the samples took.

    decode=cpu: a DataLoader whose workers decode and augment (`AugmentedView`); the batches
    are on the host. decode=gpu: the workers read bytes (`EncodedView`) and the batches come
    decoded and augmented on `device`, in `memory_format` (`DeviceBatches`).
    """
    options = loader_options(data_cfg, device)
    if decode == "cpu":
        return DataLoader(
            AugmentedView(source, data_cfg.augment, targets=targets),
            batch_sampler=batch_sampler,
            generator=generator,
            **options,
        )
    loader = DataLoader(
        EncodedView(source, data_cfg.augment),
        batch_sampler=batch_sampler,
        collate_fn=collate_encoded,
        generator=generator,
        **options,
    )
    if memory_format == torch.preserve_format:
        memory_format = torch.contiguous_format
    return DeviceBatches(
        loader,
        source,
        device=device,
        image_size=data_cfg.image_hw,
        memory_format=memory_format,
        targets=targets,
        ahead=data_cfg.decode_ahead,
    )
