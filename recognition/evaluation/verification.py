"""Verification metrics on scored pairs: k-fold accuracy, ROC, AUC, EER and TAR@FAR.

Scores are similarities (higher = more alike, e.g. cosine); a pair is predicted "same"
when its score is strictly above the threshold.

:func:`evaluate_verification` returns a dict whose public keys go to JSON as they are
(:func:`to_json_dict` converts them) and one private key, ``"_roc"``, holding the ROC curve
``(fpr, tpr)`` as arrays for :func:`recognition.evaluation.plots.plot_roc`;
:func:`to_json_dict` drops every key that starts with an underscore.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from recognition.evaluation.report import text_table

DEFAULT_FAR_TARGETS = (1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6)


def far_key(far: float) -> str:
    """The JSON key of a FAR target: 1e-3 -> ``"1e-3"``, 2.5e-4 -> ``"2.5e-4"``."""
    return np.format_float_scientific(far, trim="-", exp_digits=1)


def contiguous_folds(num_pairs: int, num_folds: int) -> np.ndarray:
    """Fold ids (num_pairs,) that split the pairs, in order, into near-equal contiguous folds."""
    if num_folds < 2:
        raise ValueError(f"num_folds: need at least 2 folds for k-fold accuracy, got {num_folds}")
    if num_pairs < num_folds:
        raise ValueError(
            f"num_folds: {num_folds} folds need at least as many pairs, got {num_pairs}"
        )
    return np.arange(num_pairs) * num_folds // num_pairs


def balanced_folds(issame: np.ndarray, num_folds: int) -> np.ndarray:
    """Fold ids (P,) giving every fold a contiguous run of the genuine AND of the impostor pairs.

    For files that put all same pairs before all different ones in a single fold (the
    ``pairsDevTest.txt`` layout): contiguous folds would then hold one kind only, while
    these hold both in the file's proportion, as the folds of View 2 do.
    """
    issame = np.asarray(issame, dtype=bool)
    fold = np.empty(len(issame), dtype=np.int64)
    for mask in (issame, ~issame):
        fold[mask] = contiguous_folds(int(mask.sum()), num_folds)
    return fold


def kfold_accuracy(scores: np.ndarray, same: np.ndarray, folds: np.ndarray) -> float:
    """Mean k-fold verification accuracy of similarity `scores` (higher means same).

    For each fold, the threshold that maximises accuracy on the other folds (searched over
    the midpoints between their sorted scores; the lowest such threshold on ties) is applied
    to the held-out fold. `same` is a bool array, `folds` the fold index of each pair.
    """
    _, accuracies = held_out_folds(scores, same, folds)
    return float(np.mean(accuracies))


def held_out_folds(
    scores: np.ndarray, same: np.ndarray, folds: np.ndarray
) -> tuple[list[float], list[float]]:
    """Per fold, in sorted fold-id order: the threshold :func:`best_threshold` picks on the
    OTHER folds, and its accuracy on this one. Returns (thresholds, accuracies)."""
    thresholds, accuracies = [], []
    for fold in np.unique(folds):
        test = folds == fold
        threshold, _ = best_threshold(scores[~test], same[~test])
        thresholds.append(threshold)
        accuracies.append(float(((scores[test] > threshold) == same[test]).mean()))
    return thresholds, accuracies


def best_threshold(scores: np.ndarray, issame: np.ndarray) -> tuple[float, float]:
    """The threshold that maximises accuracy on these pairs, and that accuracy.

    Candidates are the midpoints between consecutive distinct scores plus one threshold
    below all scores (everything "same") and the largest score (everything "different");
    ties go to the smallest threshold. O(P log P) through cumulative counts.
    """
    scores = np.asarray(scores, dtype=np.float64)
    issame = np.asarray(issame, dtype=bool)
    unique, inverse = np.unique(scores, return_inverse=True)  # (U,) ascending
    num_genuine_at = np.bincount(inverse, weights=issame, minlength=len(unique))
    num_impostor_at = np.bincount(inverse, weights=~issame, minlength=len(unique))
    num_genuine = num_genuine_at.sum()

    # Candidate j (0..U) lies just above unique[j-1] and below unique[j]: pairs scoring at
    # or below unique[j-1] are called "different". Right answers = genuine above + impostors
    # at or below.
    impostors_below = np.concatenate([[0.0], np.cumsum(num_impostor_at)])  # (U+1,)
    genuine_above = num_genuine - np.concatenate([[0.0], np.cumsum(num_genuine_at)])
    correct = genuine_above + impostors_below
    j = int(np.argmax(correct))  # first maximum = smallest threshold

    if j == 0:
        threshold = float(np.nextafter(unique[0], -np.inf))
    elif j == len(unique):
        threshold = float(unique[-1])
    else:
        lo, hi = unique[j - 1], unique[j]
        threshold = float(lo + (hi - lo) / 2)
        # Adjacent floats: the midpoint can round up onto `hi`, which would flip those pairs.
        if threshold >= hi:
            threshold = float(lo)
    return threshold, float(correct[j] / len(scores))


def equal_error_rate(fpr: np.ndarray, tpr: np.ndarray) -> float:
    """Where the ROC polyline crosses FPR = 1 - TPR (linear interpolation between points)."""
    fnr = 1.0 - np.asarray(tpr, dtype=np.float64)
    fpr = np.asarray(fpr, dtype=np.float64)
    gap = fnr - fpr  # non-increasing from 1 at (0, 0) to -1 at (1, 1)
    i = int(np.argmax(gap <= 0))
    if i == 0:
        return float(fpr[0])
    alpha = gap[i - 1] / (gap[i - 1] - gap[i])
    return float(fpr[i - 1] + alpha * (fpr[i] - fpr[i - 1]))


def tar_at_far(
    scores: np.ndarray, issame: np.ndarray, far: float
) -> tuple[float, float] | tuple[None, None]:
    """(TAR, threshold) at a false accept rate, or (None, None) when it cannot be measured.

    The threshold is the impostor score that floor(FAR x impostors) impostor scores exceed
    (fewer when impostor scores tie there); TAR is the fraction of genuine scores strictly
    above it. Below 1/FAR impostor pairs not one impostor may be accepted, so the rate is
    not measurable and None is returned.
    """
    scores = np.asarray(scores, dtype=np.float64)
    issame = np.asarray(issame, dtype=bool)
    return tar_at_far_sorted(np.sort(scores[issame]), np.sort(scores[~issame])[::-1], far)


def tar_at_far_sorted(
    genuine: np.ndarray, impostor: np.ndarray, far: float
) -> tuple[float, float] | tuple[None, None]:
    """:func:`tar_at_far` from genuine scores sorted ascending and impostors descending.

    For callers that need several FARs of millions of pairs and sort once.
    """
    # The small slack keeps far * n from rounding down below an integer (1e-3 * 3000).
    num_accepted = int(np.floor(far * len(impostor) + 1e-9))
    if num_accepted < 1:
        return None, None
    threshold = float(impostor[num_accepted]) if num_accepted < len(impostor) else -np.inf
    # Genuine scores strictly above the threshold, counted in the sorted array.
    num_above = len(genuine) - int(np.searchsorted(genuine, threshold, side="right"))
    return num_above / len(genuine), threshold


def evaluate_verification(
    scores: np.ndarray | Sequence[float],
    issame: np.ndarray | Sequence[bool],
    folds: np.ndarray | Sequence[int] | None = None,
    num_folds: int = 10,
    far_targets: Sequence[float] = DEFAULT_FAR_TARGETS,
) -> dict:
    """Every verification metric of scored pairs.

    Takes scores (P,) (higher = more similar), issame (P,) and optionally a fold id per
    pair; without ``folds`` the pairs are split, in order, into ``num_folds`` contiguous
    folds (the LFW protocol, whose files list the folds one after another).

    Returns a dict:
      - ``num_pairs``
      - ``accuracy``, ``accuracy_std``: mean and population std over folds of the held-out
        accuracy, each fold's threshold chosen to maximise accuracy on the OTHER folds
      - ``threshold``: the best threshold on all pairs (for deployment; its accuracy on the
        same pairs is optimistic, hence the k-fold figure above)
      - ``fold_thresholds``, ``fold_accuracies``: per fold, in sorted fold-id order
      - ``auc``, ``eer``: from the ROC over all pairs
      - ``tar_at_far``: {"1e-1": TAR, ...}, None where impostors < 1/FAR
      - ``far_thresholds``: the score threshold used for each TAR@FAR (None likewise)
      - ``_roc``: (fpr, tpr) arrays of the ROC; private, dropped by :func:`to_json_dict`
    Raises ValueError for mismatched lengths, non-finite scores, a single class, or fewer
    than two folds.
    """
    from sklearn.metrics import roc_auc_score, roc_curve  # 0.8 s: in runs that evaluate only

    scores, issame = _checked_pairs(scores, issame)
    for far in far_targets:
        if not 0.0 < far < 1.0:
            raise ValueError(f"far_targets: each target must lie in (0, 1), got {far}")
    fold_thresholds, fold_accuracies = held_out_folds(
        scores, issame, _fold_ids(folds, scores, num_folds)
    )
    threshold, _ = best_threshold(scores, issame)
    fpr, tpr, _ = roc_curve(issame, scores)
    results = {
        "num_pairs": int(len(scores)),
        "accuracy": float(np.mean(fold_accuracies)),
        "accuracy_std": float(np.std(fold_accuracies)),
        "threshold": threshold,
        "fold_thresholds": fold_thresholds,
        "fold_accuracies": fold_accuracies,
        "auc": float(roc_auc_score(issame, scores)),
        "eer": equal_error_rate(fpr, tpr),
        "tar_at_far": {},
        "far_thresholds": {},
        "_roc": (fpr, tpr),
    }
    for far in far_targets:
        tar, far_threshold = tar_at_far(scores, issame, far)
        results["tar_at_far"][far_key(far)] = tar
        results["far_thresholds"][far_key(far)] = far_threshold
    return results


def _checked_pairs(
    scores: np.ndarray | Sequence[float], issame: np.ndarray | Sequence[bool]
) -> tuple[np.ndarray, np.ndarray]:
    """(scores (P,) float64, issame (P,) bool), or a ValueError for mismatched lengths,
    non-finite scores or a single class."""
    scores = np.asarray(scores, dtype=np.float64)
    issame = np.asarray(issame)
    if scores.ndim != 1:
        raise ValueError(f"scores: expected a 1-D array, got shape {scores.shape}")
    if issame.shape != scores.shape:
        raise ValueError(f"issame: shape {issame.shape} does not match scores {scores.shape}")
    if issame.dtype != bool:
        if not np.isin(issame, (0, 1)).all():
            raise ValueError("issame: expected booleans (or 0/1)")
        issame = issame.astype(bool)
    if not np.isfinite(scores).all():
        raise ValueError(f"scores: {int((~np.isfinite(scores)).sum())} values are NaN or inf")
    num_genuine = int(issame.sum())
    num_impostor = len(issame) - num_genuine
    if num_genuine == 0 or num_impostor == 0:
        raise ValueError(
            f"issame: need both genuine and impostor pairs, got {num_genuine} genuine and "
            f"{num_impostor} impostor"
        )
    return scores, issame


def _fold_ids(
    folds: np.ndarray | Sequence[int] | None, scores: np.ndarray, num_folds: int
) -> np.ndarray:
    """A fold id per pair: ``folds`` checked, or ``num_folds`` contiguous folds without."""
    if folds is None:
        folds = contiguous_folds(len(scores), num_folds)
    else:
        folds = np.asarray(folds)
        if folds.shape != scores.shape:
            raise ValueError(f"folds: shape {folds.shape} does not match scores {scores.shape}")
    num_fold_ids = len(np.unique(folds))
    if num_fold_ids < 2:
        raise ValueError(
            f"folds: need at least 2 folds for k-fold accuracy, got {num_fold_ids} "
            "(pass folds=None to split the pairs into num_folds folds)"
        )
    return folds


def to_json_dict(results: Mapping) -> dict:
    """A copy of ``results`` without private (``_``-prefixed) keys, with plain Python numbers.

    Non-finite floats (a -inf TAR@FAR threshold) become None so the JSON stays standard.
    """

    def convert(value):
        if isinstance(value, Mapping):
            return {str(k): convert(v) for k, v in value.items() if not str(k).startswith("_")}
        if isinstance(value, list | tuple | np.ndarray):
            return [convert(v) for v in value]
        if isinstance(value, bool | np.bool_):
            return bool(value)
        if isinstance(value, int | np.integer):
            return int(value)
        if isinstance(value, float | np.floating):
            return float(value) if np.isfinite(value) else None
        return value

    return convert(results)


def format_table(results: Mapping[str, Mapping], far_keys: Sequence[str] | None = None) -> str:
    """A console table with one row per target (e.g. a dataset or a checkpoint).

    Takes {name: evaluate_verification result}. Columns: pairs, accuracy ± std (%), AUC,
    EER (%), XNorm when any result holds ``xnorm``, and TAR (%) at each FAR in ``far_keys``
    (default: every key the results hold, in order); "-" where a value is missing or could
    not be measured.
    """
    if far_keys is None:
        far_keys = list(dict.fromkeys(k for r in results.values() for k in r.get("tar_at_far", {})))
    show_xnorm = any("xnorm" in r for r in results.values())
    header = ["target", "pairs", "accuracy %", "AUC", "EER %"] + ["XNorm"] * show_xnorm
    header += [f"TAR%@{k}" for k in far_keys]
    rows = [header]
    for name, r in results.items():
        tars = r.get("tar_at_far", {})
        row = [
            str(name),
            str(r["num_pairs"]),
            f"{100 * r['accuracy']:.2f} ± {100 * r['accuracy_std']:.2f}",
            f"{r['auc']:.4f}",
            f"{100 * r['eer']:.2f}",
        ]
        if show_xnorm:
            row.append(f"{r['xnorm']:.2f}" if r.get("xnorm") is not None else "-")
        row += ["-" if tars.get(k) is None else f"{100 * tars[k]:.2f}" for k in far_keys]
        rows.append(row)
    return text_table(rows)
