"""Re-id CMC / mAP / mINP against a per-query loop, scikit-learn's AP, the definition of INP
and hand-checked cases (with ties)."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import average_precision_score

from recognition.evaluation.reid import format_reid_table, rank_gallery


def reference(qf, qid, qcam, gf, gid, gcam, max_rank=50):
    """Straightforward protocol: one query at a time, explicit junk rules, sklearn's AP."""
    qf = qf / np.linalg.norm(qf, axis=1, keepdims=True)
    gf = gf / np.linalg.norm(gf, axis=1, keepdims=True)
    cmc = np.zeros(max_rank)
    aps, inps, skipped = [], [], 0
    for i in range(len(qf)):
        scores = []
        labels = []
        for j in range(len(gf)):
            if gid[j] == -1:
                continue  # junk: neither match nor non-match
            if gid[j] == qid[i] and gcam[j] == qcam[i]:
                continue  # same person, same camera: removed
            scores.append(float(np.dot(qf[i], gf[j])))
            labels.append(gid[j] == qid[i])
        labels = np.array(labels)
        if not labels.any():
            skipped += 1
            continue
        scores = np.array(scores)
        ranked = labels[np.argsort(-scores, kind="stable")]
        first = int(np.argmax(ranked))
        if first < max_rank:
            cmc[first:] += 1
        aps.append(average_precision_score(labels, scores))
        # INP = |G_i| / R_hard: the matches over the 1-based rank of the last of them.
        hardest = max(r for r in range(len(ranked)) if ranked[r]) + 1
        inps.append(labels.sum() / hardest)
    valid = len(qf) - skipped
    return cmc / valid, float(np.mean(aps)), skipped, float(np.mean(inps))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_the_reference_on_random_data(seed):
    rng = np.random.default_rng(seed)
    num_people, dim = 15, 8
    centres = rng.normal(size=(num_people + 1, dim))
    gid = rng.integers(-1, num_people + 1, size=300)  # -1 junk, 0 distractors, 1.. people
    gcam = rng.integers(1, 7, size=300)
    qid = rng.integers(1, num_people + 1, size=60)
    qcam = rng.integers(1, 7, size=60)
    # Noisy features around each person's centre: rankings mix matches and non-matches;
    # continuous noise keeps the scores free of ties.
    gf = centres[np.maximum(gid, 0)] + 1.2 * rng.normal(size=(300, dim))
    qf = centres[qid] + 1.2 * rng.normal(size=(60, dim))
    result = rank_gallery(qf, qid, qcam, gf, gid, gcam, chunk_size=7)
    cmc, mean_ap, skipped, mean_inp = reference(qf, qid, qcam, gf, gid, gcam)
    assert result["num_skipped"] == skipped
    assert result["mAP"] == pytest.approx(mean_ap, abs=1e-12)
    assert result["mINP"] == pytest.approx(mean_inp, abs=1e-12)
    np.testing.assert_allclose(result["cmc"], cmc, atol=1e-12)
    for k in (1, 5, 10):
        assert result[f"rank{k}"] == pytest.approx(cmc[k - 1], abs=1e-12)
    assert 0.05 < result["rank1"] < 0.95  # the case is neither trivial nor hopeless


def test_hand_checked_case():
    # 1-D embeddings as angles on the unit circle, so the ranking is easy to read.
    def at(degrees):
        return np.array([[np.cos(np.radians(d)), np.sin(np.radians(d))] for d in degrees])

    # Query: person 1, camera 1, at 0 degrees. Gallery ranked by angle from the query:
    #   5 deg: person 1 cam 1  -> same camera: removed
    #  10 deg: person -1       -> junk: removed
    #  20 deg: person 0        -> distractor, kept: rank 1, non-match
    #  30 deg: person 1 cam 2  -> match at kept rank 2
    #  40 deg: person 2 cam 2  -> rank 3, non-match
    #  50 deg: person 1 cam 3  -> match at kept rank 4
    gallery = at([5, 10, 20, 30, 40, 50])
    gid = np.array([1, -1, 0, 1, 2, 1])
    gcam = np.array([1, 2, 2, 2, 2, 3])
    result = rank_gallery(at([0]), np.array([1]), np.array([1]), gallery, gid, gcam, max_rank=5)
    # AP = (1/2 + 2/4) / 2 = 0.5; first match at rank 2; INP = 2 matches / rank 4 = 0.5.
    assert result["mAP"] == pytest.approx(0.5)
    assert result["mINP"] == pytest.approx(0.5)
    assert result["cmc"] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert result["rank1"] == 0.0 and result["rank5"] == 1.0

    # A second query (person 2, camera 2) whose only gallery crop shares its camera: skipped.
    two = rank_gallery(
        at([0, 90]), np.array([1, 2]), np.array([1, 2]), gallery, gid, gcam, max_rank=5
    )
    assert two["num_skipped"] == 1 and two["mAP"] == pytest.approx(0.5)
    table = format_reid_table({"market": two})
    assert "market" in table.splitlines()[2] and "50.00" in table
    assert "mINP %" in table.splitlines()[0] and two["rerank"] is None


def test_ties_keep_gallery_order_for_cmc_map_and_minp():
    # Embeddings whose cosines are exactly 1, 0 or -1: ties are exact, whatever the BLAS.
    gallery = np.array([[0, 1], [1, 0], [0, 1], [0, 1], [0, 1], [-1, 0]], dtype=np.float64)
    gid = np.array([2, 1, 1, 3, 1, 4])
    gcam = np.array([1, 2, 3, 2, 1, 2])
    queries = np.array([[1, 0], [0, 1]], dtype=np.float64)
    qid, qcam = np.array([1, 3]), np.array([1, 1])
    result = rank_gallery(queries, qid, qcam, gallery, gid, gcam, max_rank=4)
    # Query 1 (person 1, camera 1) at [1, 0]: gallery 1 scores 1; gallery 0, 2, 3, 4 tie at
    # 0 and keep their order, gallery 4 (same person, same camera) removed; gallery 5 last.
    # Kept ranking: 1 (match), 0, 2 (match), 3, 5. AP = (1/1 + 2/3) / 2, INP = 2 / 3.
    # Query 2 (person 3, camera 1) at [0, 1]: gallery 0, 2, 3, 4 tie at 1 in gallery order,
    # then 1, 5. Its match, gallery 3, is third: AP = 1/3, INP = 1/3.
    # Another tie rule would move both hardest matches (matches first: INP 1 and 1; last:
    # 2/4 and 1/4).
    assert result["mAP"] == pytest.approx(((1 + 2 / 3) / 2 + 1 / 3) / 2)
    assert result["mINP"] == pytest.approx((2 / 3 + 1 / 3) / 2)
    assert result["cmc"] == [0.5, 0.5, 1.0, 1.0]


def test_no_valid_query_and_bad_shapes():
    f = np.eye(2)
    with pytest.raises(ValueError, match="no query has a true match"):
        rank_gallery(f, np.array([1, 2]), np.array([1, 1]), f, np.array([1, 2]), np.array([1, 1]))
    with pytest.raises(ValueError, match="gallery"):
        rank_gallery(f, np.array([1, 2]), np.array([1, 1]), f, np.array([1]), np.array([1, 1]))
