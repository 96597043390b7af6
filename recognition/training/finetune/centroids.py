"""`head.init=centroids`: each class row starts as its class's mean embedding.

One pass over the training data before step 1, under the loaded backbone (fp32, eval mode,
no gradients, the images as the data set gives them: no flip, no augmentation, so the row is
the class's embedding as evaluation would see it).

Why each rank embeds the images of its own classes only: the class matrix is sharded by
contiguous blocks of classes (`recognition.heads.margin_softmax.shard_range`), and a row is
needed on its owner alone. Had every rank embedded a 1/W share of all images, the sum of a
class would be spread over every rank and would have to travel to its owner (an
all-to-all per batch, or a reduce of a class-sized buffer, which is the full matrix on
every rank unless cut into chunks). Taking instead the images whose labels fall in the
rank's own block, the rank owns every sum it makes: no collective is needed besides the
three counts of the closing log line, and the work is balanced as well as the images per
class are (the shards hold equal numbers of classes). Memory: the weight shard the head
already holds (C_local x D), plus one batch's embeddings and their per-class sums (at most
B x D float64), because the images are visited in label order: a class's sum is complete
when the next class begins, and goes straight into its row.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset
from tqdm import tqdm

from recognition import distributed
from recognition.data.source import TrainSource
from recognition.data.workers import exit_with_parent
from recognition.distributed import DistInfo
from recognition.heads.margin_softmax import ShardedMarginSoftmax
from recognition.training.finetune.separation import PairMoments, Separation

log = logging.getLogger(__name__)


def own_images(labels: np.ndarray, class_start: int, num_local: int) -> np.ndarray:
    """Indices of the samples whose labels lie in [class_start, class_start + num_local),
    sorted by label, then by index."""
    labels = np.asarray(labels)
    mine = np.flatnonzero((labels >= class_start) & (labels < class_start + num_local))
    return mine[np.argsort(labels[mine], kind="stable")]


@torch.no_grad()
def init_centroids(
    backbone: nn.Module,
    head: ShardedMarginSoftmax,
    source: TrainSource,
    dist_info: DistInfo,
    *,
    batch_size: int,
    num_workers: int = 0,
    memory_format: torch.memory_format = torch.preserve_format,
    progress: bool = True,
) -> Separation:
    """Set this rank's class rows of `head` to their classes' centroids (collective: the
    counts of the log line are summed over ranks); returns how well the backbone's
    features separate the classes (`recognition.training.finetune.separation`, over every rank's
    images, the same on every rank), measured on the embeddings of this pass.

    A row becomes the mean of its images' L2-normalised embeddings, normalised to length 1.
    The head compares directions only, but the length sets how fast a row turns (the
    gradient of a normalised row shrinks as 1/length): at length 1, about nine times a
    random row's (WEIGHT_INIT_STD * sqrt(512) = 0.23), the rows keep their good start
    for longer than at a random row's length (measured once on benchmarks/finetune.py's
    data: held-out accuracy after 55 of 220 steps 0.913 at length 1, 0.888 at a random
    row's, 0.900 from random rows). A class with no image keeps its random row.
    """
    indices = own_images(source.labels, head.class_start, head.num_local)
    loader = DataLoader(
        Subset(source, indices.tolist()),
        batch_size=batch_size,
        num_workers=num_workers,
        worker_init_fn=exit_with_parent if num_workers else None,
    )
    was_training = backbone.training
    backbone.eval()
    device, weight = dist_info.device, head.weight
    filled = 0
    moments = PairMoments(head.embedding_size, device)
    open_label, open_sum = -1, None  # the class whose images may go on in the next batch
    bar = tqdm(
        total=len(indices),
        desc="head.init=centroids",
        unit="image",
        disable=not (progress and dist_info.is_main),
    )

    def write(label: int, total: torch.Tensor) -> None:
        nonlocal filled
        weight[label - head.class_start] = F.normalize(total, dim=0).to(weight)
        filled += 1

    try:
        for images, labels in loader:
            images = images.to(device, memory_format=memory_format)
            embeddings = F.normalize(backbone(images).double(), dim=1)  # (B, D)
            labels = labels.to(device)
            moments.update(embeddings, labels)
            uniq, inverse = torch.unique_consecutive(labels, return_inverse=True)
            sums = torch.zeros(len(uniq), embeddings.shape[1], dtype=torch.float64, device=device)
            sums.index_add_(0, inverse, embeddings)  # (U, D): the batch's classes
            first = int(uniq[0])
            if open_sum is not None and first == open_label:
                sums[0] += open_sum
            elif open_sum is not None:
                write(open_label, open_sum)
            for label, total in zip(uniq[:-1].tolist(), sums[:-1], strict=True):
                write(label, total)
            open_label, open_sum = int(uniq[-1]), sums[-1]
            bar.update(len(labels))
        if open_sum is not None:
            write(open_label, open_sum)
    finally:
        bar.close()
        backbone.train(was_training)
    log_counts(len(indices), filled, head.num_local, device)
    return moments.finish()


def log_counts(num_images: int, num_filled: int, num_classes: int, device: torch.device) -> None:
    """Log the pass's images, rows set and classes without images, summed over ranks
    (collective)."""
    counts = torch.tensor([num_images, num_filled, num_classes], dtype=torch.int64)
    num_images, num_filled, num_classes = (
        int(c) for c in distributed.all_reduce_tensor_sum(counts.to(device)).cpu().tolist()
    )
    log.info(
        "head.init=centroids: %d class rows from %d images; %d classes with no image keep "
        "their random row",
        num_filled,
        num_images,
        num_classes - num_filled,
    )
