"""How well the loaded backbone's features tell the new classes apart, measured during the
centroid pass (`head.init=centroids`) at no extra pass over the data.

**The signal: d'** of the images' pair cosines, the separation of the same-identity pairs'
cosines from the different-identity pairs' (their means' difference over the root of their
mean variance). Verification thresholds exactly these cosines, so d' says how well the
backbone as loaded would verify the new identities (with Gaussian scores, an accuracy of
about Phi(d'/2)): the question a recipe that keeps the backbone near its start has to ask.
It is a property of the pairs, not of the number of classes; a nearest-other-centroid
margin shrinks as classes are added even when each class is as well apart as before, so a
threshold on it would not carry from a thousand classes to a million, and a leave-one-out
nearest-centroid accuracy needs every centroid before any image can be scored (a second
pass, or every embedding kept).

**Exact, from sums.** Over N unit embeddings x_i with classes c, every pair i < j:
    same pairs:  sum cos = (sum_c |S_c|^2 - N) / 2,  sum cos^2 = (sum_c |M_c|_F^2 - N) / 2
    all pairs:   sum cos = (|T|^2 - N) / 2,          sum cos^2 = (|G|_F^2 - N) / 2
with S_c the class's sum of embeddings, M_c = sum_i x_i x_i^T over its images, T the sum and
G = sum_i x_i x_i^T over all images; different pairs are all pairs less same pairs.

**Over ranks.** A rank embeds the images of its own classes only (the centroid pass), so
each class's S_c and M_c are whole on one rank and |S_c|^2, |M_c|_F^2 are plain numbers;
T (D) and G (D x D) are sums over the ranks' images. One all-reduce of D^2 + D + 4 float64
(2 MB at D = 512) at the end: bounded by the embedding size, whatever the number of classes,
images or ranks. Memory: G, and M of the one class that may go on into the next batch
(D x D each); the images come in label order, so a class is complete when the next begins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from recognition import distributed


@dataclass(frozen=True)
class Separation:
    """The pair-cosine statistics of the new classes' images under the loaded backbone."""

    same_mean: float
    same_std: float
    different_mean: float
    different_std: float
    num_same_pairs: int
    num_different_pairs: int

    @property
    def d_prime(self) -> float:
        """(same mean - different mean) / sqrt((same var + different var) / 2); nan
        without pairs of both kinds."""
        spread = math.sqrt((self.same_std**2 + self.different_std**2) / 2)
        if not (self.num_same_pairs and self.num_different_pairs) or spread == 0:
            return math.nan
        return (self.same_mean - self.different_mean) / spread


class PairMoments:
    """Accumulates what `Separation` needs from unit embeddings that come in label order
    (a class's images contiguous, possibly across batches), on one rank's classes."""

    def __init__(self, dim: int, device: torch.device) -> None:
        f64 = torch.float64
        self.total = torch.zeros(dim, dtype=f64, device=device)  # T
        self.second = torch.zeros(dim, dim, dtype=f64, device=device)  # G
        # [N, sum_c |S_c|^2, sum_c |M_c|_F^2, sum_c n_c (n_c - 1) / 2]
        self.scalars = torch.zeros(4, dtype=f64, device=device)
        # The class that may go on in the next batch: its label, S, M and image count.
        self._label = -1
        self._sum = torch.zeros(dim, dtype=f64, device=device)
        self._outer = torch.zeros(dim, dim, dtype=f64, device=device)
        self._count = 0

    @torch.no_grad()
    def update(self, embeddings: torch.Tensor, labels: torch.Tensor) -> None:
        """Add one batch: `embeddings` (B, D) float64 of length 1, `labels` (B,) in
        non-decreasing order, continuing the previous batch's order."""
        self.total += embeddings.sum(0)
        self.second += embeddings.T @ embeddings
        self.scalars[0] += len(labels)
        uniq, inverse, counts = torch.unique_consecutive(
            labels, return_inverse=True, return_counts=True
        )
        sums = embeddings.new_zeros(len(uniq), embeddings.shape[1])
        sums.index_add_(0, inverse, embeddings)  # (U, D): each class's S over its rows here
        gram = embeddings @ embeddings.T  # (B, B)
        # |M_c|_F^2 sums the squared cosines of the class's ordered pairs: those within this
        # batch, and twice those between its earlier images (their M) and these.
        self.scalars[2] += (gram * gram)[inverse[:, None] == inverse[None, :]].sum()
        here = counts.tolist()
        totals = list(here)
        if int(uniq[0]) == self._label:
            first = embeddings[: here[0]]
            self.scalars[2] += 2 * ((first @ self._outer) * first).sum()
            sums[0] += self._sum
            totals[0] += self._count
        else:
            self._add_classes(self._sum[None], [self._count])
            self._outer.zero_()
        if len(uniq) > 1:  # every class but the last is complete
            self._add_classes(sums[:-1], totals[:-1])
            self._outer.zero_()
        last = embeddings[len(labels) - here[-1] :]
        self._outer += last.T @ last
        self._label, self._sum, self._count = int(uniq[-1]), sums[-1].clone(), totals[-1]

    def _add_classes(self, sums: torch.Tensor, counts: list[int]) -> None:
        """Add complete classes' |S_c|^2 (`sums` (K, D)) and pair counts."""
        self.scalars[1] += (sums * sums).sum()
        self.scalars[3] += sum(n * (n - 1) // 2 for n in counts)

    def finish(self) -> Separation:
        """The statistics over every rank's images (collective: one all-reduce)."""
        self._add_classes(self._sum[None], [self._count])  # the last class (or nothing)
        self._label, self._count = -1, 0
        self._sum.zero_()
        dim = len(self.total)
        flat = torch.cat([self.total, self.second.flatten(), self.scalars])
        flat = distributed.all_reduce_tensor_sum(flat)
        total, second = flat[:dim], flat[dim : dim + dim * dim]
        n, s_sq, m_sq, same_pairs = flat[dim + dim * dim :].tolist()
        all_pairs = n * (n - 1) / 2
        same_sum, same_sq = (s_sq - n) / 2, (m_sq - n) / 2
        all_sum = (float(total @ total) - n) / 2
        all_sq = (float(second @ second) - n) / 2
        diff_pairs = all_pairs - same_pairs
        same_mean, same_std = _mean_std(same_sum, same_sq, same_pairs)
        diff_mean, diff_std = _mean_std(all_sum - same_sum, all_sq - same_sq, diff_pairs)
        return Separation(
            same_mean, same_std, diff_mean, diff_std, round(same_pairs), round(diff_pairs)
        )


def _mean_std(total: float, squares: float, count: float) -> tuple[float, float]:
    """Mean and (population) standard deviation from a sum and a sum of squares."""
    if count <= 0:
        return math.nan, math.nan
    mean = total / count
    return mean, math.sqrt(max(squares / count - mean * mean, 0.0))
