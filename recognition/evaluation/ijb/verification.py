"""IJB-B / IJB-C 1:1 template verification: pair scores, ROC, AUC and TAR@FAR.

A pair's score is the cosine of its two templates (:mod:`recognition.evaluation.ijb.templates`);
a pair whose template has no feature scores -1, below every threshold, so a genuine one
counts as a false reject. The result is TAR at FAR 1e-6 ... 1e-1, AUC and the ROC.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from recognition.evaluation.ijb.release import IJBOptions, default_threads, release_templates
from recognition.evaluation.ijb.templates import NO_FEATURE_SCORE
from recognition.evaluation.verification import DEFAULT_FAR_TARGETS, far_key, tar_at_far_sorted

log = logging.getLogger(__name__)

ROC_POINTS = 200
"""Points of the ROC kept in the JSON (log-spaced FARs)."""


def score_pairs(
    features: np.ndarray,
    left: np.ndarray,
    right: np.ndarray,
    *,
    chunk_size: int = 2048,
    num_threads: int | None = None,
) -> np.ndarray:
    """Dot products (P,) float32 of rows ``left[p]`` and ``right[p]`` of ``features`` (T, D).

    With unit rows these are the pairs' cosines. Vectorised in chunks of ``chunk_size``
    pairs over ``num_threads`` threads (default: the CPUs this process may use). Gathering
    the rows costs more than multiplying them, so the pairs are visited tile by tile
    (blocks of ~256 left and right templates): both blocks then stay in cache while their
    pairs are scored. Raises ValueError for an index outside [0, T).
    """
    features = np.ascontiguousarray(features, dtype=np.float32)
    left = np.asarray(left, dtype=np.int64)
    right = np.asarray(right, dtype=np.int64)
    num_templates = len(features)
    num_pairs = len(left)
    if left.shape != right.shape or left.ndim != 1:
        raise ValueError(f"pairs: left {left.shape} and right {right.shape} must be equal 1-D")
    scores = np.empty(num_pairs, np.float32)
    if num_pairs == 0:
        return scores
    for side in (left, right):
        if side.min() < 0 or side.max() >= num_templates:
            raise ValueError(f"pairs: template index outside [0, {num_templates})")

    # Tile keys below 2**15 sort as int16, which numpy sorts by radix: linear time.
    block = max(256, -(-num_templates // 181))
    num_blocks = -(-num_templates // block)
    key = (left // block) * num_blocks + right // block
    key = key.astype(np.int16 if num_blocks**2 < 2**15 else np.int64)
    order = np.argsort(key, kind="stable")
    del key

    def score_range(start: int, stop: int) -> None:
        a = np.empty((chunk_size, features.shape[1]), np.float32)
        b = np.empty_like(a)
        out = np.empty(chunk_size, np.float32)
        for s in range(start, stop, chunk_size):
            pairs = order[s : min(s + chunk_size, stop)]
            n = len(pairs)
            # mode="clip" writes into `out` directly (the default buffers a copy); the
            # indices were checked above, so nothing is clipped.
            np.take(features, left[pairs], axis=0, out=a[:n], mode="clip")
            np.take(features, right[pairs], axis=0, out=b[:n], mode="clip")
            np.einsum("pd,pd->p", a[:n], b[:n], out=out[:n])
            scores[pairs] = out[:n]

    num_threads = num_threads or default_threads()
    bounds = np.linspace(0, num_pairs, num_threads + 1).astype(np.int64)
    if num_threads == 1:
        score_range(0, num_pairs)
    else:
        # numpy releases the GIL in take and einsum, so threads share the work.
        with ThreadPoolExecutor(num_threads) as pool:
            for future in [
                pool.submit(score_range, int(a), int(b))
                for a, b in zip(bounds[:-1], bounds[1:], strict=True)
            ]:
                future.result()
    return scores


def roc_metrics(
    scores: np.ndarray,
    issame: np.ndarray,
    far_targets: Sequence[float] = DEFAULT_FAR_TARGETS,
) -> dict:
    """AUC, TAR@FAR and the ROC of scored pairs, from one sort of each class.

    Takes scores (P,) and issame (P,). Returns a dict: ``auc`` (the probability that a
    genuine pair outscores an impostor pair, ties counting half: the area under the ROC),
    ``tar_at_far`` and ``far_thresholds`` ({"1e-6": ...}; None where there are fewer than
    1/FAR impostors; the rule of
    :func:`recognition.evaluation.verification.tar_at_far`), ``roc`` ({"far": [...],
    "tar": [...]}: the ROC at ``ROC_POINTS`` log-spaced FARs, for JSON) and ``_roc``
    ((fpr, tpr): every corner of the ROC polyline, for the plot). Raises ValueError when
    a class is missing or a score is not finite.
    """
    scores = np.asarray(scores)
    issame = np.asarray(issame, dtype=bool)
    if scores.shape != issame.shape or scores.ndim != 1:
        raise ValueError(f"scores {scores.shape} and issame {issame.shape} must be equal 1-D")
    if not np.isfinite(scores).all():
        raise ValueError(f"scores: {int((~np.isfinite(scores)).sum())} are NaN or inf")
    genuine = np.sort(scores[issame])  # ascending
    impostor = np.sort(scores[~issame])
    num_genuine, num_impostor = len(genuine), len(impostor)
    if num_genuine == 0 or num_impostor == 0:
        raise ValueError(
            f"pairs: need genuine and impostor pairs, got {num_genuine} and {num_impostor}"
        )
    # Only the genuine scores (tens of thousands) are looked up among the impostors.
    below = np.searchsorted(impostor, genuine, side="left")
    at_or_below = np.searchsorted(impostor, genuine, side="right")
    wins = below.sum(dtype=np.float64) + 0.5 * (at_or_below - below).sum(dtype=np.float64)
    auc = wins / (float(num_genuine) * float(num_impostor))

    impostor_descending = impostor[::-1]
    tars, thresholds = {}, {}
    for far in far_targets:
        tar, threshold = tar_at_far_sorted(genuine, impostor_descending, far)
        tars[far_key(far)], thresholds[far_key(far)] = tar, threshold

    # The ROC polyline turns only where genuine scores sit: at each distinct genuine score g,
    # from (impostors > g, genuine > g) to (impostors >= g, genuine >= g).
    levels = np.unique(genuine)[::-1]
    corners = []
    for values, count in ((impostor, num_impostor), (genuine, num_genuine)):
        above = count - np.searchsorted(values, levels, side="right")
        at_or_above = count - np.searchsorted(values, levels, side="left")
        path = np.stack([above, at_or_above], axis=1).ravel()
        corners.append(np.concatenate([[0], path, [count]]) / count)
    fpr, tpr = corners
    fars = np.logspace(np.log10(1.0 / num_impostor), 0.0, ROC_POINTS)
    at = np.searchsorted(fpr, fars * (1 + 1e-9), side="right") - 1
    return {
        "auc": float(auc),
        "tar_at_far": tars,
        "far_thresholds": thresholds,
        "roc": {"far": fars.tolist(), "tar": tpr[at].tolist()},
        "_roc": (fpr, tpr),
    }


def evaluate_ijb(root: str | os.PathLike, name: str, **options: Any) -> dict:
    """IJB 1:1 verification of a checkpoint (or of cached image features) on ``root``.

    ``options`` are the fields of :class:`~recognition.evaluation.ijb.release.IJBOptions`
    (checkpoint, features_path, image_size, score_weight, batch_size, flip, device,
    num_workers, progress, num_threads): the features come from ``features_path`` when it is
    a file, else from the backbone of ``checkpoint``. Returns :func:`roc_metrics`' dict plus
    ``name``, ``num_images``, ``num_unreadable_images``, ``num_templates`` (those the pairs
    use), ``num_templates_without_feature``, ``num_pairs``, ``num_genuine``,
    ``num_impostor``, ``num_pairs_without_feature``, ``score_weight`` and ``flip``.
    """
    options = IJBOptions(**options)
    release = release_templates(root, name, options)
    protocol = release.protocol
    left, right = (release.rows(protocol.pairs[:, k]) for k in (0, 1))
    scores = score_pairs(release.unit, left, right, num_threads=options.num_threads)
    pair_ok = release.has_feature[left] & release.has_feature[right]
    scores[~pair_ok] = NO_FEATURE_SCORE

    used = np.unique(protocol.pairs)
    templates_without = used[~release.has_feature[release.rows(used)]]
    if len(templates_without):
        log.warning(
            "%d templates have no readable image (first ids: %s); their %d pairs score %g",
            len(templates_without),
            ", ".join(str(t) for t in templates_without[:5]),
            int((~pair_ok).sum()),
            NO_FEATURE_SCORE,
        )
    results = {
        "name": name,
        "num_images": len(protocol.images),
        "num_unreadable_images": int((~release.readable).sum()),
        "num_templates": len(used),
        "num_templates_without_feature": len(templates_without),
        "num_pairs": len(scores),
        "num_genuine": int(protocol.issame.sum()),
        "num_impostor": int((~protocol.issame).sum()),
        "num_pairs_without_feature": int((~pair_ok).sum()),
        "score_weight": bool(options.score_weight),
        "flip": bool(options.flip),
    }
    results.update(roc_metrics(scores, protocol.issame))
    return results
