"""Person re-identification ranking: CMC and mAP under the Market-1501 protocol.

Each query ranks the whole gallery by cosine similarity (higher first; equal scores keep
gallery order). Per query, the protocol removes from its ranking
  - gallery crops of the same person seen by the same camera (finding them is trivial), and
  - junk crops (person id -1, `recognition.data.market1501.JUNK_ID`),
and counts as true matches the same person seen by other cameras. Distractors (person id
0000) stay in the ranking as non-matches. A query with no true match left is skipped and
counted in ``num_skipped``.

CMC at rank k: the fraction of queries whose first true match is among the first k kept
gallery crops. AP: the mean, over the query's true matches, of the precision at each
match's rank (non-interpolated, as scikit-learn's ``average_precision_score`` on tie-free
scores); mAP is its mean over the queries.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from torch import nn

from recognition.data.market1501 import JUNK_ID, list_folder, parse_name
from recognition.evaluation.embeddings import (
    DEFAULT_EXTRACTION,
    Extraction,
    PathDataset,
    save_embeddings,
)
from recognition.evaluation.report import print_report, text_table
from recognition.evaluation.verification import to_json_dict

log = logging.getLogger(__name__)

DEFAULT_RANKS = (1, 5, 10)


def rank_gallery(
    query_embeddings: np.ndarray,
    query_ids: np.ndarray,
    query_cams: np.ndarray,
    gallery_embeddings: np.ndarray,
    gallery_ids: np.ndarray,
    gallery_cams: np.ndarray,
    *,
    ranks: Sequence[int] = DEFAULT_RANKS,
    max_rank: int = 50,
    chunk_size: int = 256,
) -> dict:
    """CMC and mAP of queries (Q, D) against a gallery (G, D) under the Market-1501 protocol.

    Ids and cameras are (Q,) / (G,) integer arrays. Embeddings need not be normalised.
    Returns a dict: ``num_query``, ``num_gallery``, ``num_skipped`` (queries without a true
    match), ``mAP``, ``rank1``/``rank5``/... for ``ranks``, and ``cmc`` (the first
    ``max_rank`` values of the CMC curve, index 0 = rank 1). Raises ValueError for
    mismatched shapes or when no query has a true match.
    """
    q = _unit(query_embeddings, "query_embeddings")
    g = _unit(gallery_embeddings, "gallery_embeddings")
    query_ids, query_cams = _ids(query_ids, len(q), "query"), _ids(query_cams, len(q), "query")
    gallery_ids = _ids(gallery_ids, len(g), "gallery")
    gallery_cams = _ids(gallery_cams, len(g), "gallery")
    if q.shape[1] != g.shape[1]:
        raise ValueError(f"embeddings: query dim {q.shape[1]} != gallery dim {g.shape[1]}")
    if any(r < 1 for r in ranks) or max_rank < 1:
        raise ValueError(f"ranks: must be >= 1, got {list(ranks)} and max_rank {max_rank}")
    num_ranks = max(max_rank, *ranks)

    cmc_hits = np.zeros(num_ranks, dtype=np.int64)  # queries whose first match is at rank k
    average_precisions: list[np.ndarray] = []
    num_skipped = 0
    for start in range(0, len(q), chunk_size):
        stop = min(start + chunk_size, len(q))
        scores = q[start:stop] @ g.T  # (C, G)
        # Stable: equal scores keep gallery order, so the ranking is deterministic.
        order = np.argsort(-scores, axis=1, kind="stable")  # (C, G)
        ids = gallery_ids[order]
        cams = gallery_cams[order]
        qid = query_ids[start:stop, None]
        qcam = query_cams[start:stop, None]
        same_person = ids == qid
        removed = (ids == JUNK_ID) | (same_person & (cams == qcam))
        match = same_person & ~removed  # (C, G) in ranked order
        kept = ~removed
        position = np.cumsum(kept, axis=1) - 1  # rank (0-based) among the kept crops
        num_matches = match.sum(axis=1)
        valid = num_matches > 0
        num_skipped += int((~valid).sum())
        if not valid.any():
            continue
        match, position, num_matches = match[valid], position[valid], num_matches[valid]
        first = np.where(match, position, np.iinfo(np.int64).max).min(axis=1)
        np.add.at(cmc_hits, first[first < num_ranks], 1)
        # Precision at the j-th match (1-based j) found at kept rank p: j / (p + 1).
        matches_so_far = np.cumsum(match, axis=1)
        # (Removed crops ahead of every kept one sit at position -1; masked out anyway.)
        precision = np.where(match, matches_so_far / np.maximum(position + 1, 1), 0.0)
        average_precisions.append(precision.sum(axis=1) / num_matches)

    num_valid = len(q) - num_skipped
    if num_valid == 0:
        raise ValueError(
            "no query has a true match in the gallery (same person, another camera); check "
            "that query and gallery come from the same data set"
        )
    cmc = np.cumsum(cmc_hits) / num_valid
    results = {
        "num_query": int(len(q)),
        "num_gallery": int(len(g)),
        "num_skipped": num_skipped,
        "mAP": float(np.concatenate(average_precisions).mean()),
    }
    for r in ranks:
        results[f"rank{r}"] = float(cmc[r - 1])
    results["cmc"] = [float(x) for x in cmc[:max_rank]]
    return results


def format_reid_table(results: Mapping[str, Mapping], ranks: Sequence[int] = DEFAULT_RANKS) -> str:
    """A console table, one row per target: queries, gallery, mAP and CMC at ``ranks`` (%)."""
    header = ["target", "queries", "gallery", "mAP %"] + [f"rank-{r} %" for r in ranks]
    rows = [header]
    for name, r in results.items():
        rows.append(
            [str(name), str(r["num_query"] - r["num_skipped"]), str(r["num_gallery"])]
            + [f"{100 * r['mAP']:.2f}"]
            + [f"{100 * r[f'rank{k}']:.2f}" for k in ranks]
        )
    return text_table(rows)


def report_reid(results: dict[str, dict], *, json_path: Path | None = None) -> str:
    """Print the re-id table; write JSON (flat for one target, else keyed by target)."""
    payload = next(iter(results.values())) if len(results) == 1 else results
    return print_report(format_reid_table(results), to_json_dict(payload), json_path)


def _unit(x: np.ndarray, name: str) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or len(x) == 0:
        raise ValueError(f"{name}: expected a non-empty (N, D) array, got shape {x.shape}")
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def _ids(x: np.ndarray, n: int, name: str) -> np.ndarray:
    x = np.asarray(x)
    if x.shape != (n,) or x.dtype.kind not in "iu":
        raise ValueError(f"{name} ids/cameras: expected ({n},) integers, got {x.shape} {x.dtype}")
    return x.astype(np.int64)


# ------------------------------------------------------------- from a backbone or a file


REID_FOLDERS = ("query", "bounding_box_test")
"""Market-1501's probe and gallery folders under the data set root."""


def reid_from_embeddings(embeddings: np.ndarray, paths: Sequence[str], source: str) -> dict:
    """CMC / mAP from embeddings whose paths are ``query/<name>`` and ``bounding_box_test/<name>``.

    Ids and cameras come from the Market-1501 file names. ``source`` names the embeddings in
    errors. Returns :func:`recognition.evaluation.reid.rank_gallery`'s dict.
    """
    rows: dict[str, list[int]] = {folder: [] for folder in REID_FOLDERS}
    for i, path in enumerate(paths):
        folder = Path(path).parts[0] if Path(path).parts else ""
        if folder in rows:
            rows[folder].append(i)
    for folder, indices in rows.items():
        if not indices:
            raise ValueError(
                f"{source}: no embedding of a {folder}/ image (re-id needs paths "
                f"{REID_FOLDERS[0]}/<name> and {REID_FOLDERS[1]}/<name>)"
            )
    parsed = {f: np.array([parse_name(paths[i]) for i in rows[f]]) for f in REID_FOLDERS}
    query, gallery = (np.asarray(rows[f]) for f in REID_FOLDERS)
    return rank_gallery(
        embeddings[query],
        parsed["query"][:, 0],
        parsed["query"][:, 1],
        embeddings[gallery],
        parsed["bounding_box_test"][:, 0],
        parsed["bounding_box_test"][:, 1],
    )


def evaluate_reid(
    backbone: nn.Module,
    root: Path,
    image_size: int | tuple[int, int],
    extraction: Extraction = DEFAULT_EXTRACTION,
    *,
    export_path: Path | None = None,
) -> dict:
    """Re-id ranking of `backbone` on a Market-1501-style ``root`` (query/ and gallery folders).

    Returns :func:`recognition.evaluation.reid.rank_gallery`'s dict; with ``export_path``
    writes the embeddings with paths ``query/<name>``, ``bounding_box_test/<name>``.
    """
    paths: list[str] = []
    for folder in REID_FOLDERS:
        listing = list_folder(root / folder)
        paths += [f"{folder}/{name}" for name in listing.paths]
    embeddings = extraction(backbone, PathDataset(paths, size=image_size, root=root))
    if export_path is not None:
        save_embeddings(export_path, embeddings, paths)
        log.info("wrote %d embeddings to %s", len(paths), export_path)
    return reid_from_embeddings(embeddings, paths, str(root))
