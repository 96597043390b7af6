"""Verification metrics against brute-force float64 references, scikit-learn-free formulas
and scores whose answers are known; plus the table, the JSON view and the ROC plot."""

import json
import time

import numpy as np
import pytest
from scipy.interpolate import interp1d
from scipy.optimize import brentq
from sklearn.metrics import roc_curve

from recognition.evaluation.plots import plot_roc
from recognition.evaluation.verification import (
    balanced_folds,
    best_threshold,
    evaluate_verification,
    far_key,
    format_table,
    to_json_dict,
)

# ---------------------------------------------------------------- brute-force references


def brute_best_threshold(scores, issame):
    """O(P^2): try every candidate threshold, keep the first (smallest) best one."""
    unique = np.unique(scores)
    candidates = [np.nextafter(unique[0], -np.inf)]
    candidates += [(a + b) / 2 for a, b in zip(unique[:-1], unique[1:], strict=True)]
    candidates += [unique[-1]]
    best_t, best_acc = None, -1.0
    for t in candidates:
        acc = np.mean((scores > t) == issame)
        if acc > best_acc:
            best_t, best_acc = t, acc
    return best_t, best_acc


def brute_kfold(scores, issame, folds):
    accuracies, thresholds = [], []
    for f in np.unique(folds):
        test = folds == f
        t, _ = brute_best_threshold(scores[~test], issame[~test])
        thresholds.append(t)
        accuracies.append(np.mean((scores[test] > t) == issame[test]))
    return np.array(accuracies), np.array(thresholds)


def brute_auc(scores, issame):
    """Mann-Whitney: P(genuine > impostor) + half P(tie), over every pair of pairs."""
    genuine = scores[issame][:, None]
    impostor = scores[~issame][None, :]
    return np.mean((genuine > impostor) + 0.5 * (genuine == impostor))


def brute_tar_at_far(scores, issame, far):
    """Best TAR over every threshold whose FAR does not exceed the target."""
    genuine, impostor = scores[issame], scores[~issame]
    if len(impostor) * far < 1:
        return None
    best = 0.0
    for t in np.concatenate([[-np.inf], np.unique(scores)]):
        if np.mean(impostor > t) <= far:
            best = max(best, np.mean(genuine > t))
    return best


def brentq_eer(scores, issame):
    """The classic EER: solve 1 - FPR = TPR(FPR) on the interpolated ROC."""
    fpr, tpr, _ = roc_curve(issame, scores)
    return brentq(lambda x: 1.0 - x - interp1d(fpr, tpr)(x), 0.0, 1.0)


def random_scores(seed, num_pairs, decimals=None):
    rng = np.random.default_rng(seed)
    issame = rng.random(num_pairs) < 0.5
    scores = rng.normal(size=num_pairs) + 1.2 * issame
    if decimals is not None:
        scores = np.round(scores, decimals)  # many ties
    return scores, issame


# ---------------------------------------------------------------------------- the tests


@pytest.mark.parametrize(
    "seed, num_pairs, decimals, num_folds",
    [(0, 600, None, 10), (1, 500, 1, 10), (2, 97, 0, 5), (3, 12, 1, 6), (4, 4, None, 4)],
)
def test_kfold_matches_brute_force(seed, num_pairs, decimals, num_folds):
    scores, issame = random_scores(seed, num_pairs, decimals)
    issame[:2] = [True, False]  # both classes even in the tiniest case
    result = evaluate_verification(scores, issame, num_folds=num_folds)

    folds = np.arange(num_pairs) * num_folds // num_pairs  # LFW-style contiguous folds
    accuracies, thresholds = brute_kfold(scores, issame, folds)
    assert result["num_pairs"] == num_pairs
    np.testing.assert_allclose(result["fold_accuracies"], accuracies, rtol=0, atol=1e-12)
    np.testing.assert_allclose(result["fold_thresholds"], thresholds, rtol=0, atol=1e-12)
    assert result["accuracy"] == pytest.approx(accuracies.mean(), abs=1e-12)
    assert result["accuracy_std"] == pytest.approx(accuracies.std(), abs=1e-12)
    t, _ = brute_best_threshold(scores, issame)
    assert result["threshold"] == pytest.approx(t, abs=1e-12)
    assert result["auc"] == pytest.approx(brute_auc(scores, issame), abs=1e-12)
    for far in (1e-1, 1e-2, 1e-3):
        expected = brute_tar_at_far(scores, issame, far)
        got = result["tar_at_far"][far_key(far)]
        assert got == (None if expected is None else pytest.approx(expected, abs=1e-12))


def test_explicit_interleaved_folds_match_brute_force():
    scores, issame = random_scores(5, 300, decimals=1)
    folds = np.random.default_rng(5).integers(0, 7, size=300) * 3 + 2  # ids need not be 0..k-1
    result = evaluate_verification(scores, issame, folds=folds)
    accuracies, thresholds = brute_kfold(scores, issame, folds)
    np.testing.assert_allclose(result["fold_accuracies"], accuracies, atol=1e-12)
    np.testing.assert_allclose(result["fold_thresholds"], thresholds, atol=1e-12)


@pytest.mark.parametrize("seed, decimals", [(6, None), (7, 1), (8, 0)])
def test_best_threshold_reaches_the_best_accuracy_of_any_threshold(seed, decimals):
    # Independent of the candidate rule: no threshold at all (each score, or below all)
    # does better than the one chosen, and the chosen one scores what it claims.
    scores, issame = random_scores(seed, 400, decimals)
    threshold, accuracy = best_threshold(scores, issame)
    every = np.concatenate([[-np.inf], scores])
    best_possible = max(np.mean((scores > t) == issame) for t in every)
    assert accuracy == pytest.approx(best_possible, abs=1e-12)
    assert np.mean((scores > threshold) == issame) == pytest.approx(accuracy, abs=1e-12)


def test_perfectly_separable():
    rng = np.random.default_rng(0)
    issame = np.tile([True, False], 500)
    scores = np.where(issame, rng.uniform(0.5, 1.0, 1000), rng.uniform(-1.0, 0.4, 1000))
    result = evaluate_verification(scores, issame)
    assert result["accuracy"] == 1.0
    assert result["accuracy_std"] == 0.0
    assert result["auc"] == 1.0
    assert result["eer"] == 0.0
    assert 0.4 > scores[~issame].max()
    assert scores[~issame].max() < result["threshold"] < scores[issame].min()
    assert result["tar_at_far"]["1e-1"] == 1.0
    assert result["tar_at_far"]["1e-2"] == 1.0
    assert result["tar_at_far"]["1e-3"] is None  # 500 impostors < 1 / 1e-3


def test_reversed_scores():
    rng = np.random.default_rng(1)
    issame = np.tile([True, False], 500)  # every contiguous fold is half genuine
    scores = np.where(issame, rng.uniform(-1.0, 0.4, 1000), rng.uniform(0.5, 1.0, 1000))
    result = evaluate_verification(scores, issame)
    # No threshold beats guessing one class: all-"same" (the smallest threshold) wins the
    # tie, so a held-out fold scores its share of genuine pairs (one half), less any genuine
    # pair scoring below every training score.
    assert 0.49 <= result["accuracy"] <= 0.5
    accuracies, _ = brute_kfold(scores, issame, np.arange(1000) // 100)
    assert result["accuracy"] == pytest.approx(accuracies.mean(), abs=1e-12)
    assert max(result["fold_thresholds"]) < np.sort(scores)[1]
    assert result["auc"] == 0.0
    assert result["eer"] == 1.0
    assert result["tar_at_far"]["1e-1"] == 0.0
    assert result["threshold"] < scores.min()


def test_eer_known_value():
    # A threshold between 0.6 and 0.65 rejects one genuine in four and accepts one impostor
    # in four: FAR = FRR = 0.25 there.
    scores = np.array([0.6, 0.7, 0.8, 0.9, 0.1, 0.2, 0.3, 0.65])
    issame = np.array([1, 1, 1, 1, 0, 0, 0, 0], dtype=bool)
    result = evaluate_verification(scores, issame, num_folds=2)
    assert result["eer"] == pytest.approx(0.25, abs=1e-12)


@pytest.mark.parametrize("seed", [10, 11, 12])
def test_eer_matches_brentq_on_interpolated_roc(seed):
    scores, issame = random_scores(seed, 2000)
    result = evaluate_verification(scores, issame)
    assert result["eer"] == pytest.approx(brentq_eer(scores, issame), abs=1e-9)


def test_tar_at_far_null_rule_with_300_impostors():
    scores, issame = random_scores(13, 600)
    issame[:] = False
    issame[:300] = True
    result = evaluate_verification(scores, issame)
    tars = result["tar_at_far"]
    assert list(tars) == ["1e-1", "1e-2", "1e-3", "1e-4", "1e-5", "1e-6"]
    assert tars["1e-1"] == pytest.approx(brute_tar_at_far(scores, issame, 1e-1), abs=1e-12)
    assert tars["1e-2"] == pytest.approx(brute_tar_at_far(scores, issame, 1e-2), abs=1e-12)
    assert tars["1e-3"] is None and tars["1e-4"] is None and tars["1e-6"] is None
    assert result["far_thresholds"]["1e-3"] is None


def test_tar_at_far_exact_count_boundary():
    # 1000 impostors: exactly one may be accepted at 1e-3, so the threshold is the second
    # highest impostor score and only genuine scores strictly above it count.
    impostor = np.linspace(0.0, 1.0, 1000)
    genuine = np.array([impostor[-2], 0.9995, 1.5, 2.0])  # the first one ties: rejected
    scores = np.concatenate([genuine, impostor])
    issame = np.arange(len(scores)) < len(genuine)
    result = evaluate_verification(scores, issame, far_targets=(1e-3, 1e-4))
    assert result["far_thresholds"]["1e-3"] == impostor[-2]
    assert result["tar_at_far"]["1e-3"] == 0.75
    assert result["tar_at_far"]["1e-4"] is None


def test_tar_at_far_counts_survive_float_rounding():
    # 0.29 * 100 = 28.999999999999996 in floats: 29 impostors may still be accepted.
    scores, issame = random_scores(18, 200)
    issame[:] = np.arange(200) < 100
    result = evaluate_verification(scores, issame, far_targets=(0.29,))
    expected = brute_tar_at_far(scores, issame, 0.29)
    assert result["tar_at_far"]["2.9e-1"] == pytest.approx(expected, abs=1e-12)
    impostor = np.sort(scores[~issame])[::-1]
    assert result["far_thresholds"]["2.9e-1"] == impostor[29]


def test_far_keys():
    assert [far_key(f) for f in (1e-1, 1e-3, 1e-6, 2.5e-4)] == ["1e-1", "1e-3", "1e-6", "2.5e-4"]


def test_balanced_folds_hold_both_kinds_in_file_order():
    issame = np.array([True] * 20 + [False] * 20)  # the pairsDevTest.txt layout
    folds = balanced_folds(issame, 4)
    for f in range(4):
        assert issame[folds == f].sum() == 5 and (~issame[folds == f]).sum() == 5
    np.testing.assert_array_equal(folds[:20], np.repeat(np.arange(4), 5))


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"scores": [0.1, 0.2], "issame": [True]}, "issame: shape"),
        ({"scores": [0.1, np.nan], "issame": [True, False]}, "NaN or inf"),
        ({"scores": [0.1, 0.2], "issame": [True, True]}, "both genuine and impostor"),
        ({"scores": [0.1, 0.2], "issame": [True, False], "folds": [0, 0]}, "at least 2 folds"),
        ({"scores": [0.1, 0.2, 0.3], "issame": [True, False, True]}, "at least as many pairs"),
        (
            {"scores": [0.1, 0.2], "issame": [True, False], "num_folds": 2, "far_targets": [1.0]},
            "far_targets",
        ),
        ({"scores": [[0.1, 0.2]], "issame": [[True, False]]}, "1-D"),
        ({"scores": [0.1, 0.2], "issame": [2, 0], "num_folds": 2}, "booleans"),
    ],
)
def test_bad_input(kwargs, fragment):
    with pytest.raises(ValueError, match=None) as info:
        evaluate_verification(**kwargs)
    assert fragment in str(info.value)


def test_threshold_search_is_not_quadratic():
    scores, issame = random_scores(14, 200_000)
    start = time.perf_counter()
    evaluate_verification(scores, issame)
    # About 0.3 s here; a per-threshold scan over 200k pairs would take minutes.
    assert time.perf_counter() - start < 10.0


def test_json_view_and_table():
    scores, issame = random_scores(15, 600)
    result = evaluate_verification(scores, issame)
    public = to_json_dict(result)
    assert "_roc" not in public and "_roc" in result
    assert set(public) >= {
        "num_pairs",
        "accuracy",
        "accuracy_std",
        "threshold",
        "auc",
        "eer",
        "tar_at_far",
    }
    again = json.loads(json.dumps(public, allow_nan=False))
    assert again["tar_at_far"]["1e-3"] is None
    assert again["accuracy"] == result["accuracy"]

    table = format_table(
        {"lfw": result, "cfp_fp": {**result, "accuracy": 1.0, "accuracy_std": 0.0}}
    )
    lines = table.splitlines()
    assert len(lines) == 4  # header, rule, two rows
    assert lines[2].startswith("lfw")
    assert f"{100 * result['accuracy']:.2f} ± {100 * result['accuracy_std']:.2f}" in lines[2]
    assert "100.00 ± 0.00" in lines[3]
    assert f"{100 * result['tar_at_far']['1e-1']:.2f}" in lines[2]
    assert lines[2].split()[-1] == "-"  # TAR@FAR=1e-6 not measurable with ~300 impostors
    assert "TAR%@1e-3" in lines[0]


def test_roc_plot_writes_png(tmp_path):
    a = evaluate_verification(*random_scores(16, 4000))
    scores, issame = random_scores(17, 4000)
    fpr, tpr, _ = roc_curve(issame, scores * 2)
    path = tmp_path / "plots" / "roc.png"
    plot_roc({"model a": a, "model b": (fpr, tpr, {"1e-2": 0.5, "1e-4": None})}, path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 5000


def test_roc_plot_rejects_bad_curves(tmp_path):
    with pytest.raises(ValueError, match="results"):
        plot_roc({}, tmp_path / "roc.png")
    with pytest.raises(ValueError, match="'x'"):
        plot_roc({"x": (np.zeros(3), np.zeros(4), {})}, tmp_path / "roc.png")
    assert not (tmp_path / "roc.png").exists()


@pytest.mark.parametrize("decimals", [None, 2])
def test_tar_at_far_matches_scikit_learn_roc(decimals):
    """TAR@FAR = the highest TPR among scikit-learn's ROC points with FPR <= FAR."""
    scores, issame = random_scores(11, 30_000, decimals)
    num_impostors = int((~issame).sum())
    result = evaluate_verification(scores, issame)
    fpr, tpr, thresholds = roc_curve(issame, scores, drop_intermediate=False)
    for far in (1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6):
        got = result["tar_at_far"][far_key(far)]
        if num_impostors < 1 / far:
            assert got is None, far
            continue
        allowed = fpr <= far + 1e-12
        assert got == pytest.approx(tpr[allowed].max(), abs=1e-12), far
        # The threshold lies on the impostor scores: at or below it nothing more is accepted.
        threshold = result["far_thresholds"][far_key(far)]
        assert np.mean(scores[~issame] > threshold) <= far
        assert threshold in set(scores[~issame])
