"""Benchmark of k-reciprocal re-ranking's memory and time as the gallery grows.

    python -m benchmarks.rerank                        # N = 2,500 ... 20,000, D = 2048
    python -m benchmarks.rerank --sizes 5000 10000 --dim 512 --json rerank.json
    python -m benchmarks.rerank --block-mib 64       # small blocks: the growth per item alone

No images and no model: random unit features around one centre per identity (8 images an
identity, as in re-id sets), one item in 7 a probe (Market-1501: 3,368 queries, 19,732
gallery crops). For each N it runs `KReciprocalReranker` (k1 = 20, k2 = 6, lambda = 0.3)
and consumes every block of final distances, and reports: the wall and CPU time; the peak
of the memory numpy and scipy allocated meanwhile (tracemalloc; the features' own array
included); the non-zeros of V per item; `memory_bound` (every R* at its largest); and what
the three N x N float32 matrices of a dense implementation (distances, V, ranking) would
take. From them: the largest N within 24 GiB, by the bound and by the measured peaks (their
growth per item between the two largest runs, extrapolated, plus 1 GiB blocks). The blocks
(`--block-mib`, 1 GiB each by default) must be full at both of those runs for the growth
to be the items' alone: at the default size that takes N well above 20,000; 64 MiB blocks
fill at a few thousand.
"""

from __future__ import annotations

import argparse
import tracemalloc

import numpy as np

from benchmarks import timing
from benchmarks.table import print_table
from recognition.evaluation.rerank import (
    BLOCK_BYTES,
    KReciprocalReranker,
    RerankParams,
    memory_bound,
)

BUDGET = 24 * 2**30


def make_features(num_items: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(probes, gallery) unit float32 features: 8 per identity around its centre."""
    rng = np.random.default_rng(seed)
    identities = rng.integers(0, max(1, num_items // 8), num_items)
    centres = rng.standard_normal((identities.max() + 1, dim), dtype=np.float32)
    x = centres[identities] + 1.2 * rng.standard_normal((num_items, dim), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    num_query = num_items // 7
    return x[:num_query], x[num_query:]


def run(query: np.ndarray, gallery: np.ndarray, params: RerankParams, block_bytes: int) -> dict:
    """One re-ranking, every block consumed; its time, peak memory and V's size."""

    def rerank() -> tuple[int, float]:
        reranker = KReciprocalReranker(query, gallery, params, block_bytes=block_bytes)
        nonzeros = reranker.query_weights.nnz + reranker.gallery_columns.nnz
        checksum = 0.0
        for _, _, block in reranker.distance_blocks():
            checksum += float(block.min())  # each block used, then dropped
        return nonzeros, checksum

    tracemalloc.start()
    (nonzeros, _), wall, cpu = timing.timed(rerank)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    num_items = len(query) + len(gallery)
    return {
        "items": num_items,
        "wall_s": wall,
        "cpu_s": cpu,
        "peak_bytes": peak,
        "nonzeros_per_item": nonzeros / num_items,
        "bound_bytes": memory_bound(num_items, query.shape[1], params, block_bytes),
        "dense_bytes": 3 * 4 * num_items**2,
    }


def largest(fits) -> int:
    """The largest N (to 1,000) for which fits(N) holds, by bisection."""
    low, high = 0, 1
    while fits(high * 1000):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle * 1000) else (low, middle)
    return low * 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2_500, 5_000, 10_000, 20_000])
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument(
        "--block-mib", type=int, default=BLOCK_BYTES // 2**20, help="the blocks' budget each"
    )
    timing.add_output_args(parser)
    args = parser.parse_args(argv)
    params = RerankParams()
    print(f"k1 {params.k1}, k2 {params.k2}, lambda {params.lambda_value}, D {args.dim}; "
          f"{timing.cpus()}", flush=True)  # fmt: skip
    block_bytes = args.block_mib * 2**20
    rows = [run(*make_features(n, args.dim, args.seed), params, block_bytes) for n in args.sizes]
    mib = 2**20
    print_table(
        [("N", 7), ("wall s", 7), ("(cpu)", 7), ("peak MiB", 9), ("KiB/item", 9),
         ("nnz/item", 9), ("bound MiB", 10), ("dense MiB", 10), ("dense/peak", 11)],
        [[f"{r['items']:,}", f"{r['wall_s']:.1f}", f"{r['cpu_s']:.1f}",
          f"{r['peak_bytes'] / mib:,.0f}", f"{r['peak_bytes'] / r['items'] / 1024:.1f}",
          f"{r['nonzeros_per_item']:.0f}", f"{r['bound_bytes'] / mib:,.0f}",
          f"{r['dense_bytes'] / mib:,.0f}", f"{r['dense_bytes'] / r['peak_bytes']:.1f}x"]
         for r in rows],
    )  # fmt: skip
    # The peak's growth per item between the two largest runs (the blocks' share, which
    # stops growing once they reach their size, drops out), extrapolated to 24 GiB.
    a, b = rows[-2], rows[-1]
    per_item = (b["peak_bytes"] - a["peak_bytes"]) / (b["items"] - a["items"])
    fixed = b["peak_bytes"] - per_item * b["items"] + 2 * (BLOCK_BYTES - block_bytes)
    # At the default 1 GiB blocks: what rank_gallery uses.
    by_bound = largest(lambda n: memory_bound(n, args.dim, params) <= BUDGET)
    by_measure = int((BUDGET - fixed) // per_item // 1000 * 1000)
    by_dense = largest(lambda n: 3 * 4 * n**2 <= BUDGET)
    print(
        f"largest N within 24 GiB: {by_bound:,} by the bound (every R* at its largest); "
        f"{by_measure:,} extrapolating the measured peaks ({per_item / 1024:.1f} KiB per item "
        f"+ {fixed / 2**20:,.0f} MiB); a dense implementation: {by_dense:,}"
    )
    timing.save_results(
        args.json,
        {"dim": args.dim, "params": params.as_dict(), "results": rows,
         "largest_by_bound": by_bound, "largest_by_measure": by_measure,
         "measured_bytes_per_item": per_item, "measured_fixed_bytes": fixed,
         "largest_dense": by_dense},
    )  # fmt: skip


if __name__ == "__main__":
    main()
