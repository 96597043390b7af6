"""JPEG batches decoded on the GPU (`data.decode=gpu`): the loader's workers only read bytes.

With `data.decode=cpu` every DataLoader worker decodes, resizes and normalises its samples
(`TrainSource.__getitem__`, augmented by `AugmentedView`). With `gpu` the work is split:

    worker   EncodedView[(index, sample_seed)] -> (payload, label, augment, index)
               payload: the file's or record's bytes (1-D uint8) when nvJPEG can decode
               them (`gpu_decodable`); otherwise the image decoded by the CPU path's own
               decoder (PIL), (3, h, w) uint8: PNG and other formats, CMYK, 12-bit and
               arithmetic-coded JPEGs, and truncated files (which PIL then names as bad)
               augment: the sample's `SampleAugment`, drawn from its seed (`draw_augment`)
             collate_encoded -> EncodedBatch: the batch's bytes in one tensor, its labels,
               flips, indices and (when any sample has more than a flip) augmentations
    main     decode_batch(batch, source, device=...) -> ((B, 3, H, W) float32 in [-1, 1],
               (B,) labels) on `device`: torchvision.io.decode_jpeg of the list of byte
               tensors (on a CUDA device one batched nvJPEG call), then the CPU path's steps
               on the whole batch: resize where the size differs, augment (the flip alone,
               or `augment_batch`), normalise, memory format

`DeviceBatches` wraps the DataLoader so that iterating it gives those device tensors: the
training loop's `.to(device, memory_format=...)` then has nothing left to do. With
`data.decode_ahead` > 0 (the default, 2) a thread of its own decodes that many batches
ahead on a CUDA stream of its own (`recognition.data.ahead`), so the training thread never
decodes nor waits for a decode.

The augmentation is drawn from the sample's seed by `draw_augment` in the worker, as
`AugmentedView` draws it, and applied to the batch on the device by `augment_batch`, the
batched form of the CPU path's `apply_augment`: a sample is augmented the same way with
either decoder (to float rounding), and a resumed run sees the same data.
On the CPU, torchvision's decode_jpeg and PIL are the same libjpeg-turbo and give the same
pixels; nvJPEG differs from it by a few levels (docs/data.md).

**Bad images** follow `on_bad_image` as on the CPU path. A file the worker routes to PIL is
checked there. A JPEG that passed `gpu_decodable` but that the device decoder refuses is
decoded again in the main process by PIL (the CPU path's decoder, which decides what is
bad); a failure there raises the ValueError naming the file ("error") or takes the CPU
path's substitute, the next readable image of the identity ("skip", counted as there).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import torch
import torchvision.io
from torch.utils.data import Dataset
from torchvision.transforms.v2 import functional as TF

from recognition.config import AugmentConfig
from recognition.data.ahead import made_ahead
from recognition.data.augment import SampleAugment, draw_augment
from recognition.data.augment_batch import augment_batch
from recognition.data.source import TrainSource
from recognition.data.teacher_table import TeacherTable
from recognition.data.transforms import decode_rgb, normalise, resize

# Start-of-frame markers nvJPEG decodes: baseline, extended and progressive Huffman. The
# others (lossless, hierarchical, arithmetic coding) go to the CPU decoder.
_GPU_FRAMES = (0xC0, 0xC1, 0xC2)
_FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # DHT, JPG, DAC are not frames
_STANDALONE = frozenset([0x01, *range(0xD0, 0xD9)])  # TEM, RSTn, SOI: no length field
_JPEG_START = b"\xff\xd8\xff"  # SOI, then the first marker's 0xFF


def gpu_decodable(data: bytes) -> bool:
    """Whether `data` is a JPEG that nvJPEG decodes as the CPU path would.

    True for a complete baseline or progressive 8-bit JPEG of 1 (grey) or 3 (YCbCr)
    components. False for anything else, which the CPU path's decoder (PIL) handles: not a
    JPEG, CMYK / YCCK or Adobe RGB, 12-bit, lossless or arithmetic-coded, and a file whose
    last scan has no end-of-image marker after it (truncated: PIL refuses it, and a
    device decoder might fill the missing part in silently instead). Reads the markers up
    to the frame header and searches the tail: microseconds per image.
    """
    if len(data) < 4 or data[:3] != _JPEG_START:
        return False
    position, adobe_transform = 2, None
    while position + 4 <= len(data):
        if data[position] != 0xFF:
            return False
        marker = data[position + 1]
        if marker == 0xFF:  # fill byte before a marker
            position += 1
            continue
        if marker in _STANDALONE:
            position += 2
            continue
        length = int.from_bytes(data[position + 2 : position + 4], "big")
        segment = data[position + 4 : position + 2 + length]
        if marker == 0xEE and segment[:5] == b"Adobe" and len(segment) >= 12:
            adobe_transform = segment[11]  # 0: RGB or CMYK stored as they are
        if marker in _FRAMES:
            if marker not in _GPU_FRAMES or len(segment) < 6:
                return False
            precision, components = segment[0], segment[5]
            if precision != 8 or components not in (1, 3):
                return False
            if components == 3 and adobe_transform == 0:
                return False
            # Entropy-coded data never holds 0xFFD9 or 0xFFDA (0xFF bytes are stuffed), so an
            # end-of-image marker after the last start-of-scan means the last scan is whole.
            return data.rfind(b"\xff\xd9") > data.rfind(b"\xff\xda") > position
        position += 2 + length
    return False


# ---------------------------------------------------------------------- in the workers


class EncodedView(Dataset):
    """`source` as the GPU path's workers read it, indexed like `AugmentedView`.

    `view[(index, sample_seed)]` is `(payload, label, augment, index)`: payload the sample's
    encoded bytes as a 1-D uint8 tensor when `gpu_decodable`, else the image decoded here by
    the CPU path's decoder as (3, h, w) uint8; augment its `SampleAugment` under `augment`
    (`draw_augment` of its seed, at the source's input size). Unreadable images follow the
    source's `on_bad_image`.
    """

    def __init__(self, source: TrainSource, augment: AugmentConfig) -> None:
        self.source = source
        self.augment = augment

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int, SampleAugment, int]:
        index, seed = int(key[0]), key[1]
        payload = self.source.load_with_policy(index, self._payload)
        augment = draw_augment(self.augment, seed, self.source.image_size)
        return payload, int(self.source.labels[index]), augment, index

    def _payload(self, index: int) -> torch.Tensor:
        data = self.source.encoded(index)
        if gpu_decodable(data):
            return torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return TF.pil_to_tensor(decode_rgb(data, self.source.describe(index)))


@dataclass
class EncodedBatch:
    """A batch as the GPU path's workers send it (see `collate_encoded`)."""

    data: torch.Tensor
    """(total bytes,) uint8: the encoded samples one after the other."""
    lengths: torch.Tensor
    """(B,) int64: each sample's number of bytes in `data`; 0 for one in `decoded`."""
    decoded: list[torch.Tensor]
    """(3, h, w) uint8 images the worker decoded, in batch order."""
    labels: torch.Tensor
    """(B,) int64."""
    flips: torch.Tensor
    """(B,) bool: mirror the sample left-right."""
    indices: torch.Tensor
    """(B,) int64: the samples' indices in the source (for messages and substitutes)."""
    augments: list[SampleAugment] | None = None
    """Each sample's augmentation when any does more than flip (`augment_batch`); None: the
    flips are all there is."""

    def __len__(self) -> int:
        return len(self.labels)

    def pin_memory(self) -> EncodedBatch:
        """The batch with what is copied to the device in page-locked memory (the DataLoader's
        pin_memory calls this). The bytes are not: the decoder reads them on the host."""
        return replace(
            self,
            decoded=[image.pin_memory() for image in self.decoded],
            labels=self.labels.pin_memory(),
            flips=self.flips.pin_memory(),
        )


def collate_encoded(samples: list[tuple[torch.Tensor, int, SampleAugment, int]]) -> EncodedBatch:
    """The DataLoader's `collate_fn` for `EncodedView` samples.

    The bytes travel as one tensor, not one per sample: every tensor a worker sends costs
    a shared-memory segment and a file descriptor.
    """
    payloads = [sample[0] for sample in samples]
    augments = [sample[2] for sample in samples]
    encoded = [payload for payload in payloads if payload.dim() == 1]
    return EncodedBatch(
        data=torch.cat(encoded) if encoded else torch.empty(0, dtype=torch.uint8),
        lengths=torch.tensor([p.numel() if p.dim() == 1 else 0 for p in payloads]),
        decoded=[payload for payload in payloads if payload.dim() != 1],
        labels=torch.tensor([sample[1] for sample in samples], dtype=torch.int64),
        flips=torch.tensor([sample[2].flip for sample in samples], dtype=torch.bool),
        indices=torch.tensor([sample[3] for sample in samples], dtype=torch.int64),
        augments=augments if any(a.beyond_flip for a in augments) else None,
    )


# ---------------------------------------------------------------------- in the main process


def decode_jpegs(chunks: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """torchvision's decode_jpeg of the 1-D uint8 tensors `chunks` as RGB on `device` (one
    batched nvJPEG call on a CUDA device). Raises RuntimeError when any of them fails."""
    with warnings.catch_warnings():
        # torchvision 0.29 deprecates its decoders in favour of TorchCodec, whose releases
        # do not yet go back to torch 2.11; the call is the same on 0.26 to 0.29.
        warnings.simplefilter("ignore", DeprecationWarning)
        return torchvision.io.decode_jpeg(
            chunks, mode=torchvision.io.ImageReadMode.RGB, device=device
        )


def decode_batch(
    batch: EncodedBatch,
    source: TrainSource,
    *,
    device: torch.device,
    image_size: tuple[int, int],
    memory_format: torch.memory_format = torch.contiguous_format,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The network's input from a batch of `collate_encoded`, decoded on `device`.

    Returns ((B, 3, H, W) float32 in [-1, 1] in `memory_format`, (B,) int64 labels), both on
    `device`: the samples `AugmentedView(source)` gives, decoded by decode_jpeg instead of
    PIL, with `image_size` = (H, W). `source` is the one the workers read: it names a file
    the device decoder refuses, and gives its substitute.

    Nothing here waits for the device: the flips select with `torch.where`, the other
    augmentations take their parameters from the host (`augment_batch`), and the host
    tensors go over with non-blocking copies.
    """
    lengths = batch.lengths.tolist()
    encoded_at = [i for i, length in enumerate(lengths) if length > 0]
    images: list[torch.Tensor | None] = [None] * len(lengths)
    if encoded_at:
        chunks = list(torch.split(batch.data, [lengths[i] for i in encoded_at]))
        for i, image in zip(encoded_at, _decode_or_none(chunks, device), strict=True):
            if image is None:
                image = _cpu_fallback(source, int(batch.indices[i])).to(device, non_blocking=True)
            images[i] = image
    decoded = iter(batch.decoded)
    for i, length in enumerate(lengths):
        if length == 0:
            images[i] = next(decoded).to(device, non_blocking=True)
    pixels = _resize_and_stack(images, image_size)  # type: ignore[arg-type]  # (B, 3, H, W) uint8
    if batch.augments is None:
        flips = batch.flips.to(device, non_blocking=True).view(-1, 1, 1, 1)
        pixels = torch.where(flips, pixels.flip(-1), pixels)
        # Flipping before the normalisation (CPU path: after) changes nothing: it moves values.
        inputs = normalise(pixels)
    else:
        scaled = augment_batch(TF.to_dtype(pixels, torch.float32, scale=True), batch.augments)
        inputs = (scaled - 0.5) / 0.5  # as `normalise`, from [0, 1] (not in place: grey's view)
    inputs = inputs.contiguous(memory_format=memory_format)
    return inputs, batch.labels.to(device, non_blocking=True)


def _decode_or_none(chunks: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """decode_jpegs of `chunks`, with None for each one that does not decode."""
    try:
        return list(decode_jpegs(chunks, device))
    except RuntimeError:
        # The batched call fails as a whole: find the culprits one by one (rare).
        results: list[torch.Tensor | None] = []
        for chunk in chunks:
            try:
                results.append(decode_jpegs([chunk], device)[0])
            except RuntimeError:
                results.append(None)
        return results


def _cpu_fallback(source: TrainSource, index: int) -> torch.Tensor:
    """Sample `index` decoded by the CPU path's decoder (PIL), under `on_bad_image`."""
    return source.load_with_policy(index, lambda i: TF.pil_to_tensor(source.decode(i)))


def _resize_and_stack(images: list[torch.Tensor], size: tuple[int, int]) -> torch.Tensor:
    """(3, h, w) uint8 images of any sizes as one (B, 3, H, W) uint8 batch at `size`."""
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, image in enumerate(images):
        by_shape.setdefault(tuple(image.shape[-2:]), []).append(i)
    sized = list(images)
    for shape, members in by_shape.items():
        if shape == tuple(size):
            continue
        # One resize per input size (the same antialiased bilinear resize as the CPU path).
        resized = resize(torch.stack([images[i] for i in members]), size)
        for i, image in zip(members, resized.unbind(0), strict=True):
            sized[i] = image
    return torch.stack(sized)


class DeviceBatches:
    """Iterating gives the batches of `loader` (a DataLoader of `EncodedView` with
    `collate_encoded`) decoded by `decode_batch` on `device`: (images, labels) there, as
    the training loop takes them from any loader; with `targets` (a distilled run's
    `TeacherTable`), (images, labels, the teacher's embeddings of the samples as flipped).
    `ahead` (data.decode_ahead): batches decoded ahead by a thread of its own, on a CUDA
    stream of its own (`recognition.data.ahead`); 0: each one when it is asked for."""

    def __init__(
        self,
        loader: Iterable[EncodedBatch],
        source: TrainSource,
        *,
        device: torch.device,
        image_size: tuple[int, int],
        memory_format: torch.memory_format = torch.contiguous_format,
        targets: TeacherTable | None = None,
        ahead: int = 0,
    ) -> None:
        self.loader = loader
        self.source = source
        self.device = device
        self.image_size = image_size
        self.memory_format = memory_format
        self.targets = targets
        self.ahead = ahead

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        # The DataLoader's iterator (and its workers) start here, in the caller's thread;
        # `made_ahead` decodes in a thread of its own (on a CUDA stream of its own).
        encoded = iter(self.loader)
        yield from made_ahead(self._decoded(encoded), self.ahead, self.device)

    def _decoded(self, encoded: Iterator[EncodedBatch]) -> Iterator[tuple[torch.Tensor, ...]]:
        for batch in encoded:
            decoded = decode_batch(
                batch,
                self.source,
                device=self.device,
                image_size=self.image_size,
                memory_format=self.memory_format,
            )
            if self.targets is None:
                yield decoded
            else:
                rows = self.targets.lookup_batch(batch.indices, batch.flips)
                yield (*decoded, rows.to(self.device, non_blocking=True))


def nvjpeg_problem(device: torch.device) -> str | None:
    """Why decode_jpeg cannot decode on `device` (a torchvision built without nvJPEG, a
    driver problem), or None when a tiny JPEG decodes there."""
    import io

    import numpy as np
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buffer, format="JPEG")
    probe = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    try:
        decode_jpegs([probe], device)
    except RuntimeError as error:
        return str(error).strip().splitlines()[-1] if str(error).strip() else repr(error)
    return None


def holds_jpeg(source: TrainSource, probes: int = 16) -> bool:
    """Whether the first sample of `source` and others spread evenly over it (`probes` in
    all) are JPEG files or records; unreadable ones are not counted."""
    count = len(source)
    seen = 0
    for index in sorted({round(k * (count - 1) / max(1, probes - 1)) for k in range(probes)}):
        try:
            data = source.encoded(index)
        except (ValueError, OSError):
            continue
        if data[:3] != _JPEG_START:
            return False
        seen += 1
    return seen > 0
