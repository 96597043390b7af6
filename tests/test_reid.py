"""Re-id CMC / mAP against a per-query loop, scikit-learn's AP and hand-checked cases."""

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
    aps, skipped = [], 0
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
    valid = len(qf) - skipped
    return cmc / valid, float(np.mean(aps)), skipped


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
    cmc, mean_ap, skipped = reference(qf, qid, qcam, gf, gid, gcam)
    assert result["num_skipped"] == skipped
    assert result["mAP"] == pytest.approx(mean_ap, abs=1e-12)
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
    # AP = (1/2 + 2/4) / 2 = 0.5; first match at rank 2.
    assert result["mAP"] == pytest.approx(0.5)
    assert result["cmc"] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert result["rank1"] == 0.0 and result["rank5"] == 1.0

    # A second query (person 2, camera 2) whose only gallery crop shares its camera: skipped.
    two = rank_gallery(
        at([0, 90]), np.array([1, 2]), np.array([1, 2]), gallery, gid, gcam, max_rank=5
    )
    assert two["num_skipped"] == 1 and two["mAP"] == pytest.approx(0.5)
    table = format_reid_table({"market": two})
    assert "market" in table.splitlines()[2] and "50.00" in table


def test_no_valid_query_and_bad_shapes():
    f = np.eye(2)
    with pytest.raises(ValueError, match="no query has a true match"):
        rank_gallery(f, np.array([1, 2]), np.array([1, 1]), f, np.array([1, 2]), np.array([1, 1]))
    with pytest.raises(ValueError, match="gallery"):
        rank_gallery(f, np.array([1, 2]), np.array([1, 1]), f, np.array([1]), np.array([1, 1]))
