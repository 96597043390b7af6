"""Benchmark of IJB-C-sized 1:N identification: 20,000 probes searched in 3,500 gallery templates.

    python -m benchmarks.ijb_search                  # D = 512, 1 and 2 threads, median of 5
    python -m benchmarks.ijb_search --threads 2 --repeats 3 --json ijb_search.json
    python -m benchmarks.ijb_search --full-sort      # also the whole-matrix argsort way

No images and no model: random unit template features (D = 512) drawn around one centre per
subject. The gallery is split like IJB-C's (G1 1,750 and G2 1,750 templates, one subject
each, disjoint); every probe's subject is enrolled in one of them, so each gallery sees
about half its probes mated and half non-mated. For each thread count it times, per run:

    search   recognition.evaluation.ijb.search.search_gallery on G1 and on G2 (blocks of
             probes: one matmul each, top-10, mate score and rank)
    metrics  identification_metrics of both (CMC rank-1/5/10, TPIR at FPIR 1e-2 and 1e-1)

and reports the median wall time and the process's CPU time of the runs. ``--full-sort``
also times the way of the legacy scripts on the same features: the whole (P, G) score matrix
and one argsort per probe row, for both galleries.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from benchmarks import timing
from benchmarks.table import print_table
from recognition.evaluation.ijb.search import identification_metrics, search_gallery


def make_problem(
    num_gallery: int, num_probes: int, dim: int, seed: int
) -> tuple[list[np.ndarray], np.ndarray, list[np.ndarray]]:
    """(two galleries' unit features, probes' unit features (P, D), each gallery's mate
    column per probe (P,), -1 where the probe's subject is in the other gallery)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((num_gallery, dim), dtype=np.float32)

    def unit(subjects: np.ndarray, noise: float) -> np.ndarray:
        x = centres[subjects] + noise * rng.standard_normal((len(subjects), dim), np.float32)
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    # Subject s is the gallery template s: G1 holds the first half, G2 the rest.
    split = num_gallery // 2
    gallery = unit(np.arange(num_gallery), 1.5)
    probe_subjects = rng.integers(0, num_gallery, num_probes)
    probes = unit(probe_subjects, 2.5)
    mates = [
        np.where(probe_subjects < split, probe_subjects, -1),
        np.where(probe_subjects >= split, probe_subjects - split, -1),
    ]
    return [gallery[:split], gallery[split:]], probes, mates


def run_once(galleries, probes, mates, threads: int) -> tuple[list[dict], list[float]]:
    """Both galleries searched and measured: (their metrics, [search s, search CPU s,
    metrics s, metrics CPU s])."""
    metrics, times = [], [0.0, 0.0, 0.0, 0.0]
    for gallery, mate in zip(galleries, mates, strict=True):
        result, wall, cpu = timing.timed(search_gallery, probes, gallery, mate, num_threads=threads)
        measured, m_wall, m_cpu = timing.timed(identification_metrics, result)
        metrics.append(measured)
        for i, value in enumerate((wall, cpu, m_wall, m_cpu)):
            times[i] += value
    return metrics, times


def full_sort(galleries, probes, mates) -> list[int]:
    """Rank-1 hits the legacy way: the whole score matrix, every row argsorted."""
    hits = []
    for gallery, mate in zip(galleries, mates, strict=True):
        order = np.argsort(-(probes @ gallery.T), axis=1)  # (P, G)
        mated = mate >= 0
        hits.append(int((order[mated, 0] == mate[mated]).sum()))
    return hits


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gallery", type=int, default=3_500, help="templates, both galleries")
    parser.add_argument("--probes", type=int, default=20_000)
    timing.add_thread_args(parser, repeats=5, repeats_help="median of this many runs")
    parser.add_argument("--full-sort", action="store_true", help="also time the full argsort")
    timing.add_output_args(parser)
    args = parser.parse_args(argv)

    galleries, probes, mates = make_problem(args.gallery, args.probes, args.dim, args.seed)
    print(
        f"{args.probes:,} probes x {len(galleries[0]):,} + {len(galleries[1]):,} gallery "
        f"templates x {args.dim}; {timing.cpus()}",
        flush=True,
    )
    measured = timing.over_threads(
        lambda threads: run_once(galleries, probes, mates, threads), args.threads, args.repeats
    )
    rows = []
    for threads, runs, _ in measured:
        median = [statistics.median(r[i] for r in runs) for i in range(4)]
        rows.append(
            {
                "threads": threads,
                "search_s": median[0],
                "search_cpu_s": median[1],
                "metrics_s": median[2],
                "metrics_cpu_s": median[3],
                "total_s": median[0] + median[2],
                "runs": runs,
            }
        )
    reference = measured[0][2]
    full_sort_s = None
    if args.full_sort:
        hits, full_sort_s, _ = timing.timed(full_sort, galleries, probes, mates)
        for hit, metrics in zip(hits, reference, strict=True):
            assert hit == round(metrics["cmc"]["1"] * metrics["num_mated"]), (hit, metrics)
    print_rows(rows, full_sort_s, reference)
    timing.save_results(
        args.json,
        {
            "gallery": [len(g) for g in galleries],
            "probes": args.probes,
            "dim": args.dim,
            "repeats": args.repeats,
            "results": rows,
            "full_sort_s": full_sort_s,
            "metrics": reference,
        },
    )


def print_rows(rows: list[dict], full_sort_s: float | None, reference: list[dict]) -> None:
    """The table of the runs, the full sort's time, and each gallery's metrics."""
    print_table(
        [("threads", 7), ("search s", 9), ("(cpu)", 7), ("metrics s", 10), ("(cpu)", 7),
         ("total s", 8)],
        [[r["threads"], f"{r['search_s']:.2f}", f"{r['search_cpu_s']:.2f}",
          f"{r['metrics_s']:.3f}", f"{r['metrics_cpu_s']:.3f}", f"{r['total_s']:.2f}"]
         for r in rows],
    )  # fmt: skip
    if full_sort_s is not None:
        print(f"whole matrix + argsort per row, both galleries (rank-1 only): {full_sort_s:.2f} s")
    for name, m in zip(("G1", "G2"), reference, strict=True):
        cmc = ", ".join(f"rank-{k} {100 * v:.2f}" for k, v in m["cmc"].items())
        tpir = ", ".join(f"FPIR {k}: {100 * v:.2f}" for k, v in m["tpir_at_fpir"].items())
        print(f"{name}: {m['num_mated']:,} mated, {m['num_non_mated']:,} non-mated; CMC % {cmc}; "
              f"TPIR % {tpir}")  # fmt: skip


if __name__ == "__main__":
    main()
