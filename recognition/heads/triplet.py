"""The batch-hard triplet loss (Hermans et al. 2017), mined over the whole global batch, and
the training loss that adds it to the margin softmax's.

Every sample of the global batch (every rank's features, all-gathered with autograd) is an
anchor a: its hardest positive is the farthest sample of its identity, its hardest negative
the nearest sample of another identity, by the Euclidean distance between features
(d^2 = |x|^2 + |y|^2 - 2 <x, y>, clamped at 1e-12 before the square root, computed in
float32 at least). Its term is max(0, d(a, p) - d(a, n) + margin), or with no margin the
soft margin log(1 + exp(d(a, p) - d(a, n))); the loss is the mean over the anchors that have
both a positive (another sample of their identity) and a negative, 0 when none has. With
P x K batches (data.sampler=pk) every anchor has both.

Every rank computes the same loss from the same gathered batch (an N x N distance matrix:
N = 64 x W costs nothing next to the backbone), so the loss is one number on every rank, like
the margin softmax's. Its gradient follows the head's convention (margin_softmax.py): the
all-gather's backward sums the ranks' identical gradients of the gathered features, so each
rank's features receive W x d loss / d(its features), and DDP's average over the W ranks gives
the backbone the gradient of the loss on the whole batch. No value is read on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from recognition import distributed

# d^2 is clamped here before the square root: its slope stays finite at d = 0.
MIN_SQUARED_DISTANCE = 1e-12


def pairwise_distances(features: Tensor) -> Tensor:
    """Euclidean distances (N, N) between the rows of `features` (N, D), in its dtype."""
    squared_norms = (features * features).sum(dim=1)
    squared = squared_norms[:, None] + squared_norms[None, :] - 2.0 * (features @ features.T)
    return squared.clamp_min(MIN_SQUARED_DISTANCE).sqrt()


def batch_hard_triplet_loss(
    local_features: Tensor,
    local_labels: Tensor,
    margin: float | None,
    group: ProcessGroup | None = None,
) -> Tensor:
    """The batch-hard triplet loss of every rank's batch (see the module docstring).

    Takes this rank's features (B, D), any float dtype, and labels (B,); every rank of
    `group` must pass the same B. Returns a 0-dim float32 loss (float64 for float64
    features), the same on every rank. `margin` None is the soft margin.
    """
    dtype = torch.promote_types(local_features.dtype, torch.float32)
    with torch.autocast(local_features.device.type, enabled=False):
        features = local_features.to(dtype)
        labels = local_labels.to(device=features.device, dtype=torch.int64)
        if distributed.world_size(group) > 1:
            features = distributed.all_gather_autograd(features, group)  # (N, D)
            labels = distributed.all_gather_tensor(labels, group)  # (N,)
        distances = pairwise_distances(features)  # (N, N)
        same = labels[:, None] == labels[None, :]
        others = ~torch.eye(len(labels), dtype=torch.bool, device=labels.device)
        positive, negative = same & others, ~same
        hardest_positive = torch.where(positive, distances, -torch.inf).amax(dim=1)  # (N,)
        hardest_negative = torch.where(negative, distances, torch.inf).amin(dim=1)
        valid = positive.any(dim=1) & negative.any(dim=1)
        gap = hardest_positive - hardest_negative  # -inf where the anchor is not valid
        terms = F.softplus(gap) if margin is None else F.relu(gap + margin)
        terms = torch.where(valid, terms, 0.0)
        return terms.sum() / valid.sum().clamp_min(1)


@dataclass(frozen=True)
class TrainingLoss:
    """The training loss: `id_weight` x the margin softmax's loss + `triplet_weight` x the
    batch-hard triplet loss (margin `triplet_margin`, None the soft one) of `features`, over
    the ranks of `group`. Built only when it differs from the margin softmax's loss alone
    (`from_weights`), so that a run without it computes exactly what it did before."""

    id_weight: float
    triplet_weight: float
    triplet_margin: float | None
    group: ProcessGroup | None = None

    @staticmethod
    def from_weights(
        id_weight: float,
        triplet_weight: float,
        triplet_margin: float | None,
        group: ProcessGroup | None = None,
    ) -> TrainingLoss | None:
        """The loss of these weights; None for the margin softmax's loss alone (1, 0)."""
        if id_weight == 1.0 and triplet_weight == 0.0:
            return None
        return TrainingLoss(id_weight, triplet_weight, triplet_margin, group)

    def __call__(self, id_loss: Tensor, features: Tensor, labels: Tensor) -> Tensor:
        """The weighted sum, from the head's loss and this rank's features (B, D), labels (B,)."""
        loss = self.id_weight * id_loss
        if self.triplet_weight > 0:
            triplet = batch_hard_triplet_loss(features, labels, self.triplet_margin, self.group)
            loss = loss + self.triplet_weight * triplet.to(loss.dtype)
        return loss
