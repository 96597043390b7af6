"""k-reciprocal re-ranking against the paper's equations written out plainly in float64.

The reference below is one loop per definition (Zhong et al. 2017: the k-reciprocal sets,
their expansion with k1/2, the Gaussian-weighted V vectors, local query expansion with k2,
the Jaccard distance, the final mix with lambda), on whole N x N matrices and Python sets;
nothing of the blocked, sparse implementation is shared with it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.metrics import average_precision_score

from recognition.evaluation.reid import rank_gallery
from recognition.evaluation.rerank import (
    KReciprocalReranker,
    RerankParams,
    memory_bound,
    smallest,
)


def reference_rerank(query, gallery, k1, k2, lam):
    """Final distances (Q, G) and how many candidate sets the expansion took in."""
    x = np.concatenate([query, gallery]).astype(np.float64)
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    n, q = len(x), len(query)
    d = np.array([[((x[i] - x[j]) ** 2).sum() for j in range(n)] for i in range(n)])
    d = d / d.max(axis=1, keepdims=True)  # each row scaled by its largest distance
    ranking = [sorted(range(n), key=lambda j, i=i: (d[i, j], j)) for i in range(n)]

    def nearest(i, k):  # N(i, k): the k + 1 nearest, i itself among them
        return ranking[i][: k + 1]

    def reciprocal(i, k):  # R(i, k)
        return {j for j in nearest(i, k) if i in nearest(j, k)}

    half = round(k1 / 2)
    v = np.zeros((n, n))
    expansions = 0
    for i in range(n):
        r = reciprocal(i, k1)
        r_star = set(r)
        for c in r:
            r_c = reciprocal(c, half)
            if len(r_c & r) > 2 / 3 * len(r_c):
                r_star |= r_c
                expansions += len(r_c - r) > 0
        weights = {j: math.exp(-d[i, j]) for j in r_star}
        total = sum(weights.values())
        for j, w in weights.items():
            v[i, j] = w / total
    if k2 > 1:
        v = np.array([v[ranking[i][:k2]].mean(axis=0) for i in range(n)])
    final = np.empty((q, n - q))
    for p in range(q):
        for g in range(n - q):
            a, b = v[p], v[q + g]
            jaccard = 1 - np.minimum(a, b).sum() / np.maximum(a, b).sum()
            final[p, g] = (1 - lam) * jaccard + lam * d[p, q + g]
    return final, expansions


def clustered(seed, num_query=8, num_gallery=40, dim=6, people=6, noise=0.45):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(people, dim))
    query = centres[rng.integers(0, people, num_query)] + noise * rng.normal(size=(num_query, dim))
    gallery = centres[rng.integers(0, people, num_gallery)]
    gallery = gallery + noise * rng.normal(size=(num_gallery, dim))
    return query, gallery


def ours(query, gallery, params, **kwargs):
    reranker = KReciprocalReranker(query, gallery, params, **kwargs)
    blocks = list(reranker.distance_blocks())
    starts = [start for start, _, _ in blocks]
    assert starts == sorted(starts) and blocks[-1][1] == len(query)
    return np.concatenate([block for _, _, block in blocks]), len(blocks)


CASES = [
    (6, 3, 0.3),
    (5, 1, 0.0),  # h = round(2.5) = 2; no query expansion; the Jaccard distance alone
    (20, 6, 0.3),  # the paper's defaults
    (7, 4, 0.2),  # h = round(3.5) = 4 (7 // 2 would be 3)
    (3, 8, 0.5),  # k2 beyond k1 + 1
    (4, 2, 1.0),  # lambda 1: the original distance
]


@pytest.mark.parametrize("k1, k2, lam", CASES)
def test_matches_the_papers_equations(k1, k2, lam):
    query, gallery = clustered(seed=k1 + k2)
    expected, expansions = reference_rerank(query, gallery, k1, k2, lam)
    params = RerankParams(k1, k2, lam)
    got, _ = ours(query, gallery, params)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
    # Tiny blocks: every probe its own block, the neighbour search a row at a time.
    got_small, num_blocks = ours(query, gallery, params, block_bytes=1)
    assert num_blocks == len(query)
    np.testing.assert_allclose(got_small, expected, rtol=0, atol=1e-12)
    # float32 features: the same within float32's rounding.
    got32, _ = ours(query.astype(np.float32), gallery.astype(np.float32), params)
    np.testing.assert_allclose(got32, expected, rtol=0, atol=2e-5)
    if k1 >= 6:  # the expansion takes new members in (with h <= 2 it never can)
        assert expansions > 0


def test_reranking_changes_the_order():
    query, gallery = clustered(seed=3)
    got, _ = ours(query, gallery, RerankParams(6, 3, 0.3))
    x = np.concatenate([query, gallery])
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    cosine = x[: len(query)] @ x[len(query) :].T
    changed = [
        not np.array_equal(np.argsort(got[p], kind="stable"), np.argsort(-cosine[p], kind="stable"))
        for p in range(len(query))
    ]
    assert any(changed)


def test_smallest_is_a_stable_sorts_start():
    rng = np.random.default_rng(0)
    distances = rng.integers(0, 5, size=(40, 30)).astype(np.float32)  # many ties
    for k in (1, 3, 7, 30):
        expected = np.argsort(distances, axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(smallest(distances, k), expected)


def test_parameters_are_checked_and_the_bound_grows_linearly():
    for kwargs, flag in [({"k1": 0}, "--rerank-k1"), ({"k2": 0}, "--rerank-k2"),
                         ({"lambda_value": 1.5}, "--rerank-lambda")]:  # fmt: skip
        with pytest.raises(ValueError, match=flag):
            RerankParams(**kwargs)
    # Linear in the items once R* and its expansion are at their largest (k2 x 252 items).
    small, large, zero = (memory_bound(n, 2048) for n in (10_000, 20_000, 0))
    assert large - small == small - zero > 0


def test_rank_gallery_ranks_by_the_reranked_distance():
    """CMC, mAP and mINP of `rank_gallery(..., rerank=...)` against a per-query loop over the
    reference's distances (lower first; same-camera matches and junk removed)."""
    rng = np.random.default_rng(7)
    query, gallery = clustered(seed=7, num_query=10, num_gallery=45)
    qid, gid = rng.integers(1, 5, 10), rng.integers(-1, 5, 45)
    qcam, gcam = rng.integers(1, 4, 10), rng.integers(1, 4, 45)
    distances, _ = reference_rerank(query, gallery, 6, 3, 0.3)
    firsts, aps, inps = [], [], []
    for p in range(len(query)):
        kept = [
            g
            for g in range(len(gallery))
            if gid[g] != -1 and not (gid[g] == qid[p] and gcam[g] == qcam[p])
        ]
        labels = np.array([gid[g] == qid[p] for g in kept])
        if not labels.any():
            continue
        ranked = labels[np.argsort(distances[p, kept], kind="stable")]
        firsts.append(int(np.argmax(ranked)))
        aps.append(average_precision_score(labels, -distances[p, kept]))
        inps.append(labels.sum() / (np.flatnonzero(ranked).max() + 1))
    result = rank_gallery(query, qid, qcam, gallery, gid, gcam, max_rank=5,
                          rerank=RerankParams(6, 3, 0.3))  # fmt: skip
    assert result["num_skipped"] == len(query) - len(aps) and aps
    assert result["mAP"] == pytest.approx(np.mean(aps), abs=1e-12)
    assert result["mINP"] == pytest.approx(np.mean(inps), abs=1e-12)
    assert result["rank1"] == pytest.approx(np.mean(np.array(firsts) < 1), abs=1e-12)
    assert result["rerank"] == {"k1": 6, "k2": 3, "lambda": 0.3}
    plain = rank_gallery(query, qid, qcam, gallery, gid, gcam, max_rank=5)
    assert plain["mAP"] != result["mAP"]
