"""The `data` section: where the training images are, how they are read, sampled and
decoded, and the built-in synthetic set (`data.synthetic`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from recognition.config.augment import AugmentConfig, blur_kernel_size
from recognition.config.synthetic import SyntheticConfig
from recognition.config.values import ConfigError, check_image_size, image_size_pair
from recognition.registry import FORMATS, names


@dataclass
class DataConfig:
    """The `data` section: the training images, how they are read, sampled and decoded."""

    root: str = "data/synthetic/train"
    """An image folder (one sub-folder per identity), a folder holding an insightface
    RecordIO pack (`train.rec` + `train.idx`), or a person re-id data set's release: a
    Market-1501 / DukeMTMC-reID folder (`bounding_box_train/`), MSMT17 (its list files) or
    CUHK03 (the new protocol's split files); see `format`."""
    format: str = "auto"
    """auto or one of {formats}. auto: the first format whose marker data.root holds
    (recordio: train.rec and train.idx; market1501: bounding_box_train/; msmt17:
    list_train.txt; cuhk03: cuhk03_new_protocol_config_*.mat), else folder
    (recognition/registry.py)."""
    cuhk03_boxes: Literal["labeled", "detected"] = "labeled"
    """CUHK03: train on the hand-labeled boxes (cuhk03_new_protocol_config_labeled.mat over
    images_labeled/) or the detected ones."""
    image_size: int | list[int] | str = 48
    """Input size in pixels: one side (a square, 112 for aligned faces; the default run's
    48), [H, W] (e.g. [256, 128] for person crops) or "HxW" (256x128, made [H, W]); images
    of any size are resized to it."""
    num_workers: int = 2
    """DataLoader worker processes that read and decode images; 0: in the training process."""
    cache_dir: str | None = None
    """Where the image-folder index is cached; null: inside data.root (hidden file)."""
    rebuild_index: bool = False
    """Rebuild the cached image-folder index even if it looks current."""
    on_empty_class: Literal["error", "skip"] = "error"
    """An identity folder without images: stop with its name, or leave it out."""
    on_bad_image: Literal["error", "skip"] = "error"
    """An unreadable image: stop with its name, or replace it by another image of the same
    identity (counted, the first few logged, the total reported at the end of each epoch)."""
    sampler: Literal["random", "pk"] = "random"
    """random: a fresh permutation per epoch; pk: batches of P identities x K images."""
    pk_instances: int = 4
    """K, images per identity in a batch with sampler=pk (train.batch_size / K identities)."""
    pin_memory: bool | None = None
    """Page-locked batches for asynchronous copies to the GPU; null: on when training on GPU."""
    persistent_workers: bool = True
    """Keep the DataLoader worker processes from one epoch to the next."""
    prefetch_factor: int | None = None
    """Batches each worker loads ahead; null: torch's default (2). Needs num_workers > 0
    (`data.num_workers=0` on the command line clears a file's value)."""
    channels_last: bool = False
    """Feed the backbone NHWC (channels-last) tensors and convert its weights: faster convs
    on GPUs with tensor cores, especially under O1/O2."""
    decode: Literal["auto", "cpu", "gpu"] = "auto"
    """Where images are decoded. cpu: in the DataLoader workers (PIL). gpu: the workers read
    the encoded bytes only and each batch is decoded on the training GPU (nvJPEG through
    torchvision.io.decode_jpeg) and augmented there; non-JPEG files are decoded by the
    workers. auto: gpu when training on a CUDA device and the data holds JPEGs, else cpu."""
    decode_ahead: int = 2
    """With data.decode=gpu: batches decoded ahead by a thread of their own, on a CUDA stream
    of their own, so that the training thread neither decodes nor waits; 0: each batch is
    decoded in the training thread when the step asks for it."""
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)

    @property
    def image_hw(self) -> tuple[int, int]:
        """`image_size` as (H, W): the one place a side becomes a pair."""
        return image_size_pair(self.image_size)

    def __post_init__(self) -> None:
        self.image_size = check_image_size(self.image_size, "data.image_size")
        if self.format != "auto" and self.format not in FORMATS:
            raise ConfigError(
                f"data.format: unknown {self.format!r} (choose from auto, {names(FORMATS)})"
            )
        if self.num_workers < 0:
            raise ConfigError("data.num_workers: must be 0 or more")
        if self.pk_instances < 1:
            raise ConfigError("data.pk_instances: must be at least 1")
        kernel = blur_kernel_size(self.augment.blur_sigma[1])
        if self.augment.blur > 0 and kernel > min(self.image_hw):
            raise ConfigError(
                f"data.augment.blur_sigma: a sigma of {self.augment.blur_sigma[1]:g} needs a "
                f"{kernel}-pixel kernel, larger than the {min(self.image_hw)}-pixel side of "
                "data.image_size"
            )
        if self.decode_ahead < 0:
            raise ConfigError("data.decode_ahead: must be 0 or more")
        if self.prefetch_factor is not None:
            if self.prefetch_factor < 1:
                raise ConfigError("data.prefetch_factor: must be at least 1 (or null)")
            if self.num_workers == 0:
                raise ConfigError(
                    "data.prefetch_factor: only with worker processes (data.num_workers > 0); "
                    "with data.num_workers=0, set data.prefetch_factor=null"
                )
