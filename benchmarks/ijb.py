"""Benchmark of IJB-C-sized 1:1 scoring: pair scores and the ROC of 15.7 million pairs.

    python -m benchmarks.ijb               # 23,000 templates, 15.7M pairs, 1 and 2 threads
    python -m benchmarks.ijb --pairs 2000000 --threads 2 --json ijb.json
    python -m benchmarks.ijb --sklearn     # also time scikit-learn's roc_curve

No images and no model: random template features (D = 512, unit rows) stand in for the
pooled templates, drawn around one centre per identity so that genuine pairs (the IJB-C
share, 19,557 of 15,658,489) score higher than impostors. For each thread count it times:

    score  recognition.evaluation.ijb.score_pairs (tiled, chunked gathers and einsum)
    roc    recognition.evaluation.ijb.roc_metrics (AUC, TAR at six FARs, the ROC polyline)

reporting wall time and the process's CPU time (on a shared machine the CPU time is the
steadier figure: it does not grow while the process waits for a core). The target is under
20 s of wall time for score + roc on 2 cores.
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks import timing
from recognition.evaluation.ijb import roc_metrics, score_pairs

IJBC_PAIRS = 15_658_489
IJBC_GENUINE = 19_557


def make_problem(
    num_templates: int, num_pairs: int, dim: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(features (T, D) unit float32, left (P,), right (P,), issame (P,)) at IJB-C's ratio."""
    rng = np.random.default_rng(seed)
    num_ids = num_templates // 6
    identity = rng.integers(0, num_ids, size=num_templates)
    centres = rng.standard_normal((num_ids, dim), dtype=np.float32)
    features = centres[identity] + 3.0 * rng.standard_normal((num_templates, dim), np.float32)
    features /= np.linalg.norm(features, axis=1, keepdims=True)
    num_genuine = round(num_pairs * IJBC_GENUINE / IJBC_PAIRS)
    # Genuine pairs: two templates of one identity; impostors: any two of different ones.
    by_id = np.argsort(identity, kind="stable")
    starts = np.searchsorted(identity[by_id], np.arange(num_ids + 1))
    sizes = np.diff(starts)
    ids = rng.choice(np.flatnonzero(sizes >= 2), size=num_genuine)
    a = rng.integers(0, sizes[ids])
    b = (a + rng.integers(1, sizes[ids])) % sizes[ids]
    left = np.concatenate([by_id[starts[ids] + a], rng.integers(0, num_templates, num_pairs)])
    right = np.concatenate([by_id[starts[ids] + b], rng.integers(0, num_templates, num_pairs)])
    random_left, random_right = left[num_genuine:], right[num_genuine:]
    impostor = num_genuine + np.flatnonzero(identity[random_left] != identity[random_right])
    keep = np.concatenate([np.arange(num_genuine), impostor[: num_pairs - num_genuine]])
    issame = np.arange(len(keep)) < num_genuine
    return features, left[keep], right[keep], issame


def score_and_roc(
    features: np.ndarray, left: np.ndarray, right: np.ndarray, issame: np.ndarray, threads: int
) -> tuple[tuple[np.ndarray, dict], list[float]]:
    """One run: ((scores, metrics), [score s, score CPU s, roc s, roc CPU s])."""
    scores, score_wall, score_cpu = timing.timed(
        score_pairs, features, left, right, num_threads=threads
    )
    metrics, roc_wall, roc_cpu = timing.timed(roc_metrics, scores, issame)
    return (scores, metrics), [score_wall, score_cpu, roc_wall, roc_cpu]


def time_sklearn(issame: np.ndarray, scores: np.ndarray) -> float:
    """Seconds of scikit-learn's roc_curve + roc_auc_score on the same scores."""
    from sklearn.metrics import roc_auc_score, roc_curve

    _, roc_s, _ = timing.timed(roc_curve, issame, scores)
    _, auc_s, _ = timing.timed(roc_auc_score, issame, scores)
    return roc_s + auc_s


def print_rows(rows: list[dict], sklearn_s: float | None, reference: dict) -> None:
    """The table of the runs, scikit-learn's time, and the reference run's metrics."""
    header = (
        f"{'threads':>7}  {'score s':>8}  {'(cpu)':>7}  {'roc s':>6}  {'(cpu)':>6}  {'total s':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['threads']:>7}  {r['score_s']:>8.2f}  {r['score_cpu_s']:>7.2f}  "
            f"{r['roc_s']:>6.2f}  {r['roc_cpu_s']:>6.2f}  {r['total_s']:>8.2f}"
        )
    if sklearn_s is not None:
        print(f"scikit-learn roc_curve + roc_auc_score on the same scores: {sklearn_s:.2f} s")
    tars = ", ".join(
        f"{k}: {'-' if v is None else f'{100 * v:.2f}'}" for k, v in reference["tar_at_far"].items()
    )
    print(f"AUC {reference['auc']:.4f}; TAR % at FAR {tars}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--templates", type=int, default=23_000)
    parser.add_argument("--pairs", type=int, default=IJBC_PAIRS)
    timing.add_thread_args(parser, repeats=1, repeats_help="best of this many runs")
    parser.add_argument("--sklearn", action="store_true", help="also time sklearn's roc_curve")
    timing.add_output_args(parser)
    args = parser.parse_args(argv)

    features, left, right, issame = make_problem(args.templates, args.pairs, args.dim, args.seed)
    print(
        f"{len(features):,} templates x {args.dim}, {len(left):,} pairs "
        f"({int(issame.sum()):,} genuine); {timing.cpus()}",
        flush=True,
    )
    measured = timing.over_threads(
        lambda threads: score_and_roc(features, left, right, issame, threads),
        args.threads,
        args.repeats,
    )
    rows = []
    for threads, runs, (_, metrics) in measured:
        # The best run: the least wall time of score + roc.
        score_s, score_cpu_s, roc_s, roc_cpu_s = min(runs, key=lambda run: run[0] + run[2])
        rows.append(
            {
                "threads": threads,
                "score_s": score_s,
                "score_cpu_s": score_cpu_s,
                "roc_s": roc_s,
                "roc_cpu_s": roc_cpu_s,
                "total_s": score_s + roc_s,
                "auc": metrics["auc"],
                "tar_at_far": metrics["tar_at_far"],
            }
        )
    last_scores = measured[-1][2][0]
    sklearn_s = time_sklearn(issame, last_scores) if args.sklearn else None
    print_rows(rows, sklearn_s, reference=measured[0][2][1])
    timing.save_results(
        args.json,
        {
            "templates": len(features),
            "dim": args.dim,
            "pairs": len(left),
            "genuine": int(issame.sum()),
            "runs": rows,
            "sklearn_roc_s": sklearn_s,
        },
    )


if __name__ == "__main__":
    main()
