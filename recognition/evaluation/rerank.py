"""k-reciprocal re-ranking (Zhong et al., CVPR 2017), in memory bounded by blocks.

The probes (Q) and the gallery (G) are pooled into N = Q + G items with L2-normalised
features x. Definitions, with k1, k2 and lambda the method's parameters:

- original distance: d(i, j) = |x_i - x_j|^2 = 2 - 2 <x_i, x_j>, divided by the largest
  d(i, .) of item i's row over all N items (as the authors' code scales it);
- N(i, k): the k + 1 items nearest to i (i itself among them), nearest first, equal
  distances in item order (probes first, then the gallery, each in its given order);
- R(i, k) = {j in N(i, k) : i in N(j, k)}, the k-reciprocal neighbours;
- R*(i) = R(i, k1) united with R(c, h) for each c in R(i, k1) whose set shares more than
  two thirds of its members with R(i, k1): |R(c, h) & R(i, k1)| > 2/3 |R(c, h)|, where
  h = round(k1 / 2), halves rounded to even (the paper writes >=; the authors' code, whose
  published numbers everyone compares with, uses >, and so does this);
- V_i: weights exp(-d(i, j)) on j in R*(i), 0 elsewhere, scaled to sum 1;
- local query expansion (k2 > 1): V_i replaced by the mean of V_j over j in the k2 items
  nearest to i (i itself among them);
- Jaccard distance d_J(p, g) = 1 - sum_j min(V_pj, V_gj) / sum_j max(V_pj, V_gj);
- final distance: (1 - lambda) d_J(p, g) + lambda d(p, g), for probes p and gallery items g.

Memory. No N x N matrix is ever held: the neighbour lists come from the distances of
`block_rows` items at a time (a block of rows of d and their selection, about 16 bytes per
entry), the V vectors are sparse (at most (k1 + 1)(h + 2) non-zeros before the expansion,
k2 times that after), and the final distances come a block of probes at a time (b x G),
with the sum of minima over shared non-zeros found through the gallery's columns (an
inverted index), its pairs bounded per block. What stays is the features (N x D float32),
the lists and V: `memory_bound` bounds the bytes for a gallery, and docs/evaluation.md says
the largest that fits 24 GiB (benchmarks/rerank.py measures them).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sparse

# What one block of the neighbour search and of the final distances may take, in bytes.
BLOCK_BYTES = 1 << 30
# Bytes per entry of a block of the neighbour search: the float32 distances, argpartition's
# int64 indices, and a float32 temporary.
SEARCH_BYTES_PER_ENTRY = 16
# Bytes per entry of a block of the final distances: the sum of minima and the final
# distances (float64), then the original distances and their matmul's temporary.
FINAL_BYTES_PER_ENTRY = 32
# Bytes per (probe non-zero, gallery non-zero) pair of the inverted index: its position and
# flat index (int64), both weights and their minimum (float64), its probe (int64), and a
# temporary.
PAIR_BYTES = 56


@dataclass(frozen=True)
class RerankParams:
    """k1, k2 and lambda of the re-ranking (the paper's defaults: 20, 6, 0.3)."""

    k1: int = 20
    k2: int = 6
    lambda_value: float = 0.3

    def __post_init__(self) -> None:
        if self.k1 < 1:
            raise ValueError(f"--rerank-k1: must be at least 1, got {self.k1}")
        if self.k2 < 1:
            raise ValueError(f"--rerank-k2: must be at least 1, got {self.k2}")
        if not 0.0 <= self.lambda_value <= 1.0:
            raise ValueError(f"--rerank-lambda: must lie in [0, 1], got {self.lambda_value}")

    @property
    def half(self) -> int:
        """h = k1 / 2 rounded half to even (Python's round, numpy's around)."""
        return round(self.k1 / 2)

    def as_dict(self) -> dict[str, float]:
        return {"k1": self.k1, "k2": self.k2, "lambda": self.lambda_value}


def memory_bound(
    num_items: int,
    dim: int,
    params: RerankParams = RerankParams(),
    block_bytes: int = BLOCK_BYTES,
) -> int:
    """An upper bound on the bytes `KReciprocalReranker` holds for `num_items` probes and
    gallery items of dimension `dim` with float32 features: every R* at its largest, and the
    largest holding of each phase added up (they do not all live at once).

    Per item: the features (4 dim), the neighbour lists; per non-zero of V before the
    expansion (at most (k1 + 1)(h + 2) a row) the COO triplets and the CSR matrix made of
    them (60 bytes); per non-zero after it (at most k2 times that, N at most) the expanded
    matrix and its probe rows and gallery columns (48 bytes); and two blocks.
    """
    k = max(params.k1 + 1, params.k2)
    before = min(num_items, (params.k1 + 1) * (params.half + 2))
    after = min(num_items, before * params.k2)
    features = num_items * dim * 4
    lists = num_items * k * 8 + num_items * (params.k1 + params.half + 2) * 9
    sparse_bytes = num_items * (60 * before + 48 * after)
    return features + lists + sparse_bytes + 2 * block_bytes


class KReciprocalReranker:
    """The re-ranked distances of probes (Q, D) against a gallery (G, D) (module docstring).

    Features need not be normalised; they are, in float64 when both are float64 (what the
    tests compare with a plain reference) else in float32. `distance_blocks` yields the
    final distances a block of probes at a time. `block_bytes` bounds each block's memory.
    """

    def __init__(
        self,
        query: np.ndarray,
        gallery: np.ndarray,
        params: RerankParams = RerankParams(),
        *,
        block_bytes: int = BLOCK_BYTES,
    ) -> None:
        exact = query.dtype == np.float64 and gallery.dtype == np.float64
        dtype = np.float64 if exact else np.float32
        features = np.concatenate([query, gallery]).astype(dtype, copy=False)  # a new array
        features /= np.maximum(np.linalg.norm(features, axis=1, keepdims=True), 1e-12)
        self.features = features  # (N, D)
        self.num_query = len(query)
        self.params = params
        self.block_bytes = block_bytes
        num_items = len(self.features)
        # N(i, k1) (and the k2 nearest) and each row's largest distance, a block at a time.
        self.neighbours, self.row_max = self._search(min(max(params.k1 + 1, params.k2), num_items))
        weights = self._expanded_weights()  # V, (N, N) sparse
        if params.k2 > 1:
            weights = self._query_expansion(weights, min(params.k2, num_items))
        self.query_weights = weights[: self.num_query].tocsr()  # (Q, N)
        self.gallery_columns = weights[self.num_query :].tocsc()  # (G, N): who holds column k
        del weights
        self.query_sums = np.asarray(self.query_weights.sum(axis=1)).ravel()
        self.gallery_sums = np.asarray(self.gallery_columns.sum(axis=1)).ravel()

    # ------------------------------------------------------------------ neighbours

    def _distances(self, rows: slice, columns: slice | None = None) -> np.ndarray:
        """Unscaled original distances of items `rows` against items `columns` (all)."""
        other = self.features if columns is None else self.features[columns]
        distances = self.features[rows] @ other.T
        distances *= -2.0  # in place: 2 - 2 <x, y>, clamped at 0, no temporary of its size
        distances += 2.0
        return np.maximum(distances, 0.0, out=distances)

    def _search(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k nearest items of every item (N, k), nearest first, ties by index, and the
        largest distance of every row (N,)."""
        num_items = len(self.features)
        block = max(1, self.block_bytes // (SEARCH_BYTES_PER_ENTRY * num_items))
        neighbours = np.empty((num_items, k), dtype=np.int64)
        row_max = np.empty(num_items, dtype=self.features.dtype)
        for start in range(0, num_items, block):
            rows = slice(start, min(start + block, num_items))
            distances = self._distances(rows)  # (b, N)
            row_max[rows] = distances.max(axis=1)
            neighbours[rows] = smallest(distances, k)
        # A row of identical items has the largest distance 0: nothing to scale.
        row_max[row_max <= 0] = 1.0
        return neighbours, row_max

    def _reciprocal(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """R(i, k) of every item as N(i, k) (N, k + 1) and a mask (N, k + 1) of who is in it."""
        members = self.neighbours[:, : k + 1]
        mask = np.empty(members.shape, dtype=bool)
        items = np.arange(len(members))
        block = max(1, self.block_bytes // (members.shape[1] ** 2 * 9))
        for start in range(0, len(members), block):
            rows = slice(start, start + block)
            # i is in R(i, k) of its neighbour j when i is among j's own k + 1 nearest.
            back = members[members[rows]]  # (b, k + 1, k + 1)
            mask[rows] = (back == items[rows, None, None]).any(axis=2)
        return members, mask

    # ------------------------------------------------------------------ V

    def _expanded_weights(self) -> sparse.csr_matrix:
        """V: the Gaussian weights of every item on its R* (rows sum to 1), sparse (N, N)."""
        params, num_items = self.params, len(self.features)
        full, full_mask = self._reciprocal(min(params.k1, num_items - 1))
        half, half_mask = self._reciprocal(min(params.half, full.shape[1] - 1))
        width = full.shape[1] * (1 + half.shape[1])
        block = max(1, self.block_bytes // (full.shape[1] ** 2 * half.shape[1] * 2 + width * 64))
        rows_out, cols_out, vals_out = [], [], []
        for start in range(0, num_items, block):
            items = np.arange(start, min(start + block, num_items))
            members = expanded_members(
                full[items], full_mask[items], half, half_mask, sentinel=num_items
            )  # (b, width), sorted, sentinel-padded
            valid = members < num_items
            rows = np.broadcast_to(items[:, None], members.shape)[valid]
            columns = members[valid]
            distances = self._pair_distances(rows, columns) / self.row_max[rows]
            weights = np.exp(-distances.astype(np.float64))
            totals = np.bincount(rows - start, weights=weights, minlength=len(items))
            rows_out.append(rows)
            cols_out.append(columns)
            vals_out.append(weights / totals[rows - start])
        rows, columns = np.concatenate(rows_out), np.concatenate(cols_out)
        return sparse.csr_matrix(
            (np.concatenate(vals_out), (rows, columns)), shape=(num_items, num_items)
        )

    def _pair_distances(self, rows: np.ndarray, columns: np.ndarray) -> np.ndarray:
        """Unscaled original distances of the pairs (rows[n], columns[n]), a block at a time."""
        out = np.empty(len(rows), dtype=self.features.dtype)
        block = max(1, self.block_bytes // (self.features.shape[1] * 16))
        for start in range(0, len(rows), block):
            part = slice(start, start + block)
            dots = np.einsum("nd,nd->n", self.features[rows[part]], self.features[columns[part]])
            out[part] = np.maximum(2.0 - 2.0 * dots, 0.0)
        return out

    def _query_expansion(self, weights: sparse.csr_matrix, k2: int) -> sparse.csr_matrix:
        """Each V_i replaced by the mean of V_j over the k2 items nearest to i."""
        num_items = weights.shape[0]
        rows = np.repeat(np.arange(num_items), k2)
        average = sparse.csr_matrix(
            (np.full(num_items * k2, 1.0 / k2), (rows, self.neighbours[:, :k2].ravel())),
            shape=(num_items, num_items),
        )
        return (average @ weights).tocsr()

    # ------------------------------------------------------------------ final distances

    def distance_blocks(self) -> Iterator[tuple[int, int, np.ndarray]]:
        """(start, stop, final distances (stop - start, G) float64) over the probes in order."""
        num_gallery = self.gallery_columns.shape[0]
        row_limit = max(1, self.block_bytes // (FINAL_BYTES_PER_ENTRY * max(num_gallery, 1)))
        pair_limit = max(1, self.block_bytes // PAIR_BYTES)
        cumulative = np.concatenate([[0], np.cumsum(self._pairs_per_query())])
        start = 0
        while start < self.num_query:
            # The most probes whose pairs fit; one at least, whatever its number of pairs.
            by_pairs = np.searchsorted(cumulative, cumulative[start] + pair_limit, "right") - 1
            stop = min(self.num_query, start + row_limit, max(start + 1, int(by_pairs)))
            yield start, stop, self._final(start, stop)
            start = stop

    def _pairs_per_query(self) -> np.ndarray:
        """How many (probe non-zero, gallery non-zero) pairs share a column, per probe."""
        column_counts = np.diff(self.gallery_columns.indptr)
        per_entry = column_counts[self.query_weights.indices]
        owners = np.repeat(np.arange(self.num_query), np.diff(self.query_weights.indptr))
        return np.bincount(owners, weights=per_entry, minlength=self.num_query).astype(np.int64)

    def _final(self, start: int, stop: int) -> np.ndarray:
        """The final distances of probes [start, stop) against the gallery (b, G)."""
        num_gallery = self.gallery_columns.shape[0]
        block = self.query_weights[start:stop]
        owners = np.repeat(np.arange(stop - start), np.diff(block.indptr))
        columns = block.indices
        counts = np.diff(self.gallery_columns.indptr)[columns]
        first = self.gallery_columns.indptr[columns]
        # Every pair: the probe's weight on column k and each gallery item's weight on k.
        position = np.repeat(first - np.cumsum(counts) + counts, counts)
        position += np.arange(counts.sum())
        minima = np.minimum(np.repeat(block.data, counts), self.gallery_columns.data[position])
        flat = np.repeat(owners, counts) * num_gallery + self.gallery_columns.indices[position]
        shared = np.bincount(flat, weights=minima, minlength=(stop - start) * num_gallery)
        del position, minima, flat  # the pairs go before the dense arrays come
        shared = shared.reshape(stop - start, num_gallery)  # sum_j min(V_pj, V_gj)
        # sum_j max(a, b) = sum_j a + sum_j b - sum_j min(a, b); in place, one array at a time.
        final = self.query_sums[start:stop, None] + self.gallery_sums[None, :]
        final -= shared
        np.divide(shared, final, out=final)  # min / max
        del shared
        lam = self.params.lambda_value
        final *= -(1.0 - lam)
        final += 1.0 - lam  # (1 - lambda) x the Jaccard distance
        original = self._distances(slice(start, stop), slice(self.num_query, None))
        original /= self.row_max[start:stop, None]
        original *= lam
        final += original
        return final


def smallest(distances: np.ndarray, k: int) -> np.ndarray:
    """The indices (b, k) of each row's k smallest entries, ascending, equal values in index
    order: what a stable argsort of the row starts with, at the cost of a partition."""
    if k >= distances.shape[1]:
        return np.argsort(distances, axis=1, kind="stable")[:, :k]
    picked = np.argpartition(distances, k - 1, axis=1)[:, :k]
    values = np.take_along_axis(distances, picked, axis=1)
    kth = values.max(axis=1)
    # Rows where the k-th value ties with entries left out: the partition chose among them
    # arbitrarily; a stable sort of the row chooses by index.
    ties = (distances <= kth[:, None]).sum(axis=1) > k
    for row in np.flatnonzero(ties):
        picked[row] = np.argsort(distances[row], kind="stable")[:k]
        values[row] = distances[row, picked[row]]
    # Ascending by value, then by index: sort by index first, then stably by value.
    by_index = np.argsort(picked, axis=1)
    picked = np.take_along_axis(picked, by_index, axis=1)
    values = np.take_along_axis(values, by_index, axis=1)
    return np.take_along_axis(picked, np.argsort(values, axis=1, kind="stable"), axis=1)


def expanded_members(
    full: np.ndarray,
    full_mask: np.ndarray,
    half: np.ndarray,
    half_mask: np.ndarray,
    *,
    sentinel: int,
) -> np.ndarray:
    """R*(i) for a block of items: (b, width) sorted member indices, `sentinel` where none.

    `full`, `full_mask` (b, k1 + 1): N(i, k1) of the block's items and who of it is in
    R(i, k1); `half`, `half_mask` (N, h + 1): the same at h for every item."""
    in_full = np.where(full_mask, full, -1)  # (b, k1 + 1): R(i, k1), -1 elsewhere
    candidates = half[full]  # (b, k1 + 1, h + 1): N(c, h) of every neighbour c of i
    candidate_mask = half_mask[full] & full_mask[:, :, None]  # R(c, h) of c in R(i, k1)
    shared = (candidates[..., None] == in_full[:, None, None, :]).any(axis=3) & candidate_mask
    sizes = candidate_mask.sum(axis=2)
    # |R(c, h) & R(i, k1)| > 2/3 |R(c, h)|, in integers.
    accepted = 3 * shared.sum(axis=2) > 2 * sizes  # (b, k1 + 1)
    taken = candidate_mask & accepted[:, :, None]
    members = np.concatenate(
        [
            np.where(full_mask, full, sentinel),
            np.where(taken, candidates, sentinel).reshape(len(full), -1),
        ],
        axis=1,
    )
    members.sort(axis=1)
    repeated = np.zeros(members.shape, dtype=bool)
    repeated[:, 1:] = members[:, 1:] == members[:, :-1]
    return np.where(repeated, sentinel, members)
