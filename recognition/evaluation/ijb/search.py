"""IJB-B / IJB-C 1:N identification: the tiled gallery search, CMC, TPIR@FPIR.

The protocol: every probe template is searched in each gallery on its own (the lists:
:mod:`recognition.evaluation.ijb.search_protocol`). A probe is *mated* in a gallery when its
subject is enrolled there (each subject has one template in one of the two galleries),
*non-mated* otherwise. Per gallery:

- rank of a mated probe: 1 + the number of other gallery templates scoring at least as
  high as its mate (ties count against the mate); CMC at rank r: the fraction of mated
  probes whose rank is at most r.
- FPIR threshold: with the top-1 scores of the N non-mated probes sorted high to low, the
  (k+1)-th, k = floor(FPIR x N); a search alarms when its top score is above it, so at
  most k non-mated searches alarm (fewer where scores tie there). None below 1/FPIR
  non-mated probes.
- TPIR at that FPIR (rank 1): the fraction of mated probes whose mate is rank 1 and
  scores above the threshold.

The two galleries' figures are averaged (the mean of the two rates). A template without
a feature (no readable image, or none listed) scores -1 against everything: a mated
probe or mate without one is a miss, a non-mated probe without one never alarms.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from recognition.evaluation.ijb.release import (
    IJBOptions,
    ReleaseTemplates,
    default_threads,
    release_templates,
)
from recognition.evaluation.ijb.search_protocol import TemplateList, load_search_protocol
from recognition.evaluation.ijb.templates import NO_FEATURE_SCORE
from recognition.evaluation.verification import far_key, tar_at_far_sorted

log = logging.getLogger(__name__)

DEFAULT_RANKS = (1, 5, 10)
DEFAULT_FPIR_TARGETS = (1e-2, 1e-1)
TOP_K = 10
"""Candidates kept per probe and gallery (the candidate list of the search)."""


@dataclass(frozen=True)
class SearchResult:
    """One gallery searched by every probe.

    ``top_scores`` (P, k) float32 high to low and ``top_index`` (P, k) gallery rows (ties in
    index order); ``mate_score`` (P,) float32, NaN for non-mated probes; ``mate_rank`` (P,)
    int64, 1 + the other gallery rows scoring >= the mate, 0 for non-mated probes.
    """

    top_scores: np.ndarray
    top_index: np.ndarray
    mate_score: np.ndarray
    mate_rank: np.ndarray


def search_gallery(
    probes: np.ndarray,
    gallery: np.ndarray,
    mate: np.ndarray,
    *,
    probe_ok: np.ndarray | None = None,
    gallery_ok: np.ndarray | None = None,
    k: int = TOP_K,
    block_size: int = 512,
    num_threads: int | None = None,
) -> SearchResult:
    """Search ``gallery`` (G, D) with every row of ``probes`` (P, D); scores are dot products.

    ``mate`` (P,) is each probe's gallery row, -1 where it has none. Rows whose ``probe_ok``
    / ``gallery_ok`` is False (no feature) score :data:`NO_FEATURE_SCORE` against
    everything. The probes go in blocks of ``block_size`` over ``num_threads`` threads
    (default: the CPUs this process may use), BLAS held to one thread each: a block's
    scores (block, G) are made by one matmul, reduced to its top ``k``, mate scores and
    ranks, and dropped. Raises ValueError for shapes that do not fit or a mate outside [-1, G).
    """
    probes = np.ascontiguousarray(probes, dtype=np.float32)
    gallery = np.ascontiguousarray(gallery, dtype=np.float32)
    mate = np.asarray(mate, dtype=np.int64)
    num_probes, num_gallery = len(probes), len(gallery)
    if probes.ndim != 2 or gallery.ndim != 2 or probes.shape[1] != gallery.shape[1]:
        raise ValueError(
            f"search: probes {probes.shape} and gallery {gallery.shape} must be (N, D)"
        )
    if mate.shape != (num_probes,) or (
        num_probes and not -1 <= mate.min() <= mate.max() < num_gallery
    ):
        raise ValueError(f"search: mate must be ({num_probes},) rows in [-1, {num_gallery})")
    if num_gallery == 0:
        raise ValueError("search: the gallery is empty")
    probe_bad = np.zeros(num_probes, bool) if probe_ok is None else ~np.asarray(probe_ok, bool)
    gallery_bad = (
        np.zeros(num_gallery, bool) if gallery_ok is None else ~np.asarray(gallery_ok, bool)
    )
    k = min(k, num_gallery)
    out = SearchResult(
        np.empty((num_probes, k), np.float32),
        np.empty((num_probes, k), np.int64),
        np.full(num_probes, np.nan, np.float32),
        np.zeros(num_probes, np.int64),
    )
    gallery_t = np.ascontiguousarray(gallery.T)  # (D, G)

    def search_block(start: int) -> None:
        stop = min(start + block_size, num_probes)
        scores = probes[start:stop] @ gallery_t  # (b, G)
        scores[probe_bad[start:stop]] = NO_FEATURE_SCORE
        scores[:, gallery_bad] = NO_FEATURE_SCORE
        index = _top_k_index(scores, k)
        top = np.take_along_axis(scores, index, axis=1)
        order = np.lexsort((index, -top))  # per row: score high to low, then index
        out.top_scores[start:stop] = np.take_along_axis(top, order, axis=1)
        out.top_index[start:stop] = np.take_along_axis(index, order, axis=1)
        rows = np.flatnonzero(mate[start:stop] >= 0)
        mate_score = scores[rows, mate[start + rows]]
        out.mate_score[start + rows] = mate_score
        # The mate counts itself: rank = 1 + the others at or above its score.
        out.mate_rank[start + rows] = (scores[rows] >= mate_score[:, None]).sum(axis=1)

    starts = range(0, num_probes, block_size)
    num_threads = min(num_threads or default_threads(), max(1, len(starts)))
    # One BLAS thread per block, the blocks over our threads: the reductions after each
    # matmul (argpartition, compare, sum) are single-threaded numpy, so threads over
    # blocks keep every core busy where a multi-threaded matmul alone would not.
    with threadpool_limits(1, user_api="blas"):
        if num_threads == 1:
            for start in starts:
                search_block(start)
        else:
            with ThreadPoolExecutor(num_threads) as pool:
                for future in [pool.submit(search_block, s) for s in starts]:
                    future.result()
    return out


def _top_k_index(scores: np.ndarray, k: int) -> np.ndarray:
    """Columns (b, k) of the k highest scores of each row of ``scores`` (b, G), unordered;
    where scores tie at the k-th place, the lowest columns (argpartition picks any)."""
    num_gallery = scores.shape[1]
    if k >= num_gallery:
        return np.broadcast_to(np.arange(num_gallery), scores.shape)
    index = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    top = np.take_along_axis(scores, index, axis=1)
    kth = top.min(axis=1)  # (b,) the k-th score
    at_kth = scores == kth[:, None]
    chosen_at_kth = (top == kth[:, None]).sum(axis=1)
    tied = np.flatnonzero(at_kth.sum(axis=1) > chosen_at_kth)  # more at the k-th than kept
    if len(tied):
        above = scores[tied] > kth[tied, None]
        need = k - above.sum(axis=1)
        keep = above | (at_kth[tied] & (np.cumsum(at_kth[tied], axis=1) <= need[:, None]))
        index[tied] = np.nonzero(keep)[1].reshape(len(tied), k)
    return index


# ------------------------------------------------------------------------------ metrics


def identification_metrics(
    result: SearchResult,
    ranks: Sequence[int] = DEFAULT_RANKS,
    fpir_targets: Sequence[float] = DEFAULT_FPIR_TARGETS,
) -> dict:
    """CMC and rank-1 TPIR at FPIR of one gallery's :class:`SearchResult` (the module's rules).

    Returns ``num_mated``, ``num_non_mated``, ``cmc`` ({"1": rate, ...}; None without mated
    probes), ``tpir_at_fpir`` and ``fpir_thresholds`` ({"1e-2": ...}; None below 1/FPIR
    non-mated probes or without mated ones).
    """
    mated = result.mate_rank > 0
    num_mated, num_non_mated = int(mated.sum()), int((~mated).sum())
    rank = result.mate_rank[mated]
    cmc = {str(r): float((rank <= r).mean()) if num_mated else None for r in ranks}
    non_mated_top = np.sort(result.top_scores[~mated, 0])[::-1]  # high to low
    # Mates found at rank 1 keep their score; the others can never be accepted.
    hits = np.sort(np.where(rank == 1, result.mate_score[mated], -np.inf))
    tpirs, thresholds = {}, {}
    for fpir in fpir_targets:
        tpir, threshold = (
            tar_at_far_sorted(hits, non_mated_top, fpir) if num_mated else (None, None)
        )
        tpirs[far_key(fpir)], thresholds[far_key(fpir)] = tpir, threshold
    return {
        "num_mated": num_mated,
        "num_non_mated": num_non_mated,
        "cmc": cmc,
        "tpir_at_fpir": tpirs,
        "fpir_thresholds": thresholds,
    }


def _mean_over_galleries(values: Sequence[Mapping]) -> dict:
    """{key: mean of the galleries' values}, None where a gallery has None."""
    keys = list(values[0])
    return {
        k: None if any(v[k] is None for v in values) else float(np.mean([v[k] for v in values]))
        for k in keys
    }


def evaluate_ijb_search(root: str | os.PathLike, name: str, **options: Any) -> dict:
    """IJB 1:N identification of a checkpoint (or of cached image features) on ``root``.

    ``options`` are those of :func:`recognition.evaluation.ijb.verification.evaluate_ijb`
    (the fields of :class:`~recognition.evaluation.ijb.release.IJBOptions`; one features
    file serves both modes). Every meta file is read and checked before any image is
    embedded. Returns ``name``, ``mode`` ("1n"), ``num_images``, ``num_unreadable_images``,
    ``num_probes``, ``num_probes_without_feature``, ``galleries`` ({"G1": {``num_templates``,
    ``num_templates_without_feature``, and :func:`identification_metrics`' dict}, ...}),
    ``cmc`` and ``tpir_at_fpir`` (the means over the galleries), ``score_weight``, ``flip``.
    """
    options = IJBOptions(**options)
    search = load_search_protocol(root, name)
    release = release_templates(
        root, name, options, pairs=False, more_templates=search.template_ids()
    )
    probe_rows, num_probes_without = _feature_rows(release, search.probes, "probe")
    galleries = {
        gallery_name: _search_one_gallery(
            release, search.probes, probe_rows, gallery, gallery_name, options.num_threads
        )
        for gallery_name, gallery in search.galleries.items()
    }
    per_gallery = list(galleries.values())
    return {
        "name": name,
        "mode": "1n",
        "num_images": len(release.protocol.images),
        "num_unreadable_images": int((~release.readable).sum()),
        "num_probes": len(search.probes.templates),
        "num_probes_without_feature": num_probes_without,
        "galleries": galleries,
        "cmc": _mean_over_galleries([g["cmc"] for g in per_gallery]),
        "tpir_at_fpir": _mean_over_galleries([g["tpir_at_fpir"] for g in per_gallery]),
        "score_weight": bool(options.score_weight),
        "flip": bool(options.flip),
    }


def _feature_rows(
    release: ReleaseTemplates, templates: TemplateList, what: str
) -> tuple[np.ndarray, int]:
    """The rows of ``templates`` in ``release.unit``, and how many have no feature (logged)."""
    index = release.rows(templates.templates)
    without = templates.templates[~release.has_feature[index]]
    if len(without):
        unlisted = ~np.isin(templates.templates, release.protocol.face_template)
        log.warning(
            "%d %s templates have no feature (%d of them no face_tid_mid line; first "
            "ids: %s); they score %g against everything",
            len(without),
            what,
            int(unlisted.sum()),
            ", ".join(str(t) for t in without[:5]),
            NO_FEATURE_SCORE,
        )
    return index, len(without)


def _search_one_gallery(
    release: ReleaseTemplates,
    probes: TemplateList,
    probe_rows: np.ndarray,
    gallery: TemplateList,
    gallery_name: str,
    num_threads: int | None,
) -> dict:
    """Every probe searched in ``gallery``: its counts and :func:`identification_metrics`."""
    gallery_rows, num_without = _feature_rows(release, gallery, f"gallery {gallery_name}")
    column = {s: c for c, s in enumerate(gallery.subjects.tolist())}
    mate = np.array([column.get(s, -1) for s in probes.subjects.tolist()], np.int64)
    result = search_gallery(
        release.unit[probe_rows],
        release.unit[gallery_rows],
        mate,
        probe_ok=release.has_feature[probe_rows],
        gallery_ok=release.has_feature[gallery_rows],
        num_threads=num_threads,
    )
    metrics = identification_metrics(result)
    if metrics["num_mated"] == 0:
        log.warning("gallery %s: no probe's subject is enrolled in it", gallery_name)
    return {
        "num_templates": len(gallery.templates),
        "num_templates_without_feature": num_without,
        **metrics,
    }
