"""Person re-identification ranking: CMC, mAP and mINP under the Market-1501 protocol.

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
scores); mAP is its mean over the queries. INP (Ye et al. 2021): the number of true matches
over the rank of the hardest (last) one among the kept crops, |G_i| / R_hard; mINP is its
mean over the queries. Ties: all three rank by one stable sort, so equal scores keep gallery
order (a match tied with a non-match ranks ahead of it when it comes first in the gallery).
With re-ranking (`rerank`, rerank.py) the queries rank by the re-ranked distance, lower
first, under the same rules.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
from torch import nn

from recognition.data.market1501 import JUNK_ID, PersonImages, parse_name
from recognition.data.reid_sets import reid_test_sets
from recognition.evaluation.embeddings import (
    DEFAULT_EXTRACTION,
    Extraction,
    PathDataset,
    save_embeddings,
)
from recognition.evaluation.report import print_report, text_table
from recognition.evaluation.rerank import KReciprocalReranker, RerankParams
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
    rerank: RerankParams | None = None,
) -> dict:
    """CMC, mAP and mINP of queries (Q, D) against a gallery (G, D) under the Market-1501
    protocol, by cosine similarity or, with `rerank`, by the k-reciprocal re-ranked distance.

    Ids and cameras are (Q,) / (G,) integer arrays. Embeddings need not be normalised.
    Returns a dict: ``num_query``, ``num_gallery``, ``num_skipped`` (queries without a true
    match), ``mAP``, ``mINP``, ``rank1``/``rank5``/... for ``ranks``, ``cmc`` (the first
    ``max_rank`` values of the CMC curve, index 0 = rank 1) and ``rerank`` (its k1, k2,
    lambda, or None). Raises ValueError for mismatched shapes or when no query has a true
    match.
    """
    q = _matrix(query_embeddings, "query_embeddings")
    g = _matrix(gallery_embeddings, "gallery_embeddings")
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
    inverse_penalties: list[np.ndarray] = []
    num_skipped = 0
    if rerank is None:
        blocks = _cosine_blocks(_unit(q), _unit(g), chunk_size)
    else:  # float32 (no copy of float32 embeddings) unless both are float64 (the tests')
        dtype = np.float64 if q.dtype == g.dtype == np.float64 else np.float32
        reranker = KReciprocalReranker(
            q.astype(dtype, copy=False), g.astype(dtype, copy=False), rerank
        )
        blocks = ((a, b, -d) for a, b, d in reranker.distance_blocks())
    for start, stop, scores in blocks:
        first, precisions, inverse_penalty, skipped = _block_metrics(
            scores, query_ids[start:stop], query_cams[start:stop], gallery_ids, gallery_cams
        )
        num_skipped += skipped
        np.add.at(cmc_hits, first[first < num_ranks], 1)
        average_precisions.append(precisions)
        inverse_penalties.append(inverse_penalty)

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
        "mINP": float(np.concatenate(inverse_penalties).mean()),
    }
    for r in ranks:
        results[f"rank{r}"] = float(cmc[r - 1])
    results["cmc"] = [float(x) for x in cmc[:max_rank]]
    results["rerank"] = None if rerank is None else rerank.as_dict()
    return results


def _cosine_blocks(
    q: np.ndarray, g: np.ndarray, chunk_size: int
) -> Iterator[tuple[int, int, np.ndarray]]:
    """(start, stop, cosine scores (C, G)) of the queries, `chunk_size` at a time."""
    for start in range(0, len(q), chunk_size):
        stop = min(start + chunk_size, len(q))
        yield start, stop, q[start:stop] @ g.T


def _block_metrics(
    scores: np.ndarray,
    query_ids: np.ndarray,
    query_cams: np.ndarray,
    gallery_ids: np.ndarray,
    gallery_cams: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """For a block of queries' scores (C, G), higher first: the kept rank (0-based) of each
    valid query's first match, its AP, its INP, and how many queries had no match."""
    # Stable: equal scores keep gallery order, so the ranking is deterministic.
    order = np.argsort(-scores, axis=1, kind="stable")  # (C, G)
    ids = gallery_ids[order]
    cams = gallery_cams[order]
    same_person = ids == query_ids[:, None]
    removed = (ids == JUNK_ID) | (same_person & (cams == query_cams[:, None]))
    match = same_person & ~removed  # (C, G) in ranked order
    position = np.cumsum(~removed, axis=1) - 1  # rank (0-based) among the kept crops
    num_matches = match.sum(axis=1)
    valid = num_matches > 0
    match, position, num_matches = match[valid], position[valid], num_matches[valid]
    first = np.where(match, position, np.iinfo(np.int64).max).min(axis=1)
    # Precision at the j-th match (1-based j) found at kept rank p: j / (p + 1).
    matches_so_far = np.cumsum(match, axis=1)
    # (Removed crops ahead of every kept one sit at position -1; masked out anyway.)
    precision = np.where(match, matches_so_far / np.maximum(position + 1, 1), 0.0)
    # INP: the matches over the kept rank (1-based) of the last, hardest one.
    hardest = np.where(match, position, -1).max(axis=1)
    inverse_penalty = num_matches / (hardest + 1)
    return first, precision.sum(axis=1) / num_matches, inverse_penalty, int((~valid).sum())


def format_reid_table(results: Mapping[str, Mapping], ranks: Sequence[int] = DEFAULT_RANKS) -> str:
    """A console table, one row per target: queries, gallery, mAP, mINP and CMC at ``ranks``
    (%), and whether the ranking was re-ranked (k1/k2/lambda)."""
    header = ["target", "queries", "gallery", "mAP %", "mINP %"] + [f"rank-{r} %" for r in ranks]
    rows = [header + ["re-ranking"]]
    for name, r in results.items():
        rerank = r.get("rerank")
        rows.append(
            [str(name), str(r["num_query"] - r["num_skipped"]), str(r["num_gallery"])]
            + [f"{100 * r['mAP']:.2f}", f"{100 * r['mINP']:.2f}"]
            + [f"{100 * r[f'rank{k}']:.2f}" for k in ranks]
            + ["-" if not rerank else "{k1}/{k2}/{lambda}".format(**rerank)]
        )
    return text_table(rows)


def report_reid(results: dict[str, dict], *, json_path: Path | None = None) -> str:
    """Print the re-id table; write JSON (flat for one target, else keyed by target)."""
    payload = next(iter(results.values())) if len(results) == 1 else results
    return print_report(format_reid_table(results), to_json_dict(payload), json_path)


def _matrix(x: np.ndarray, name: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2 or len(x) == 0:
        raise ValueError(f"{name}: expected a non-empty (N, D) array, got shape {x.shape}")
    return x


def _unit(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length, in float64."""
    x = np.asarray(x, dtype=np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def _ids(x: np.ndarray, n: int, name: str) -> np.ndarray:
    x = np.asarray(x)
    if x.shape != (n,) or x.dtype.kind not in "iu":
        raise ValueError(f"{name} ids/cameras: expected ({n},) integers, got {x.shape} {x.dtype}")
    return x.astype(np.int64)


# ------------------------------------------------------------- from a backbone or a file


REID_FOLDERS = ("query", "bounding_box_test")
"""Market-1501's probe and gallery folders under the data set root."""


def reid_from_embeddings(
    embeddings: np.ndarray,
    paths: Sequence[str],
    source: str,
    *,
    root: Path | None = None,
    rerank: RerankParams | None = None,
    cuhk03_boxes: str = "labeled",
) -> dict:
    """CMC / mAP / mINP from stored embeddings and their image paths.

    With `root` (a re-id data set: Market-1501, MSMT17, CUHK03), its queries and gallery
    are the images its release lists, found among `paths` by their path relative to `root`
    (as `evaluate_reid` exports them); without, `paths` are Market-1501's
    ``query/<name>`` and ``bounding_box_test/<name>`` and the ids come from the names.
    ``source`` names the embeddings in errors. `rerank`, `cuhk03_boxes`: as `evaluate_reid`.
    Returns :func:`recognition.evaluation.reid.rank_gallery`'s dict.
    """
    if root is not None:
        sets = reid_test_sets(root, cuhk03_boxes=cuhk03_boxes)
        index = {path: i for i, path in enumerate(paths)}
        rows = []
        for images, role in zip(sets, ("query", "gallery"), strict=True):
            wanted = relative_paths(root, images)
            missing = [path for path in wanted if path not in index]
            if missing:
                raise ValueError(
                    f"{source}: no embedding of {len(missing)} of {root}'s {role} images "
                    f"(first: {missing[0]}); export them with --reid {root}"
                )
            rows.append(np.array([index[path] for path in wanted], dtype=np.int64))
        query, gallery = sets
        return rank_gallery(
            embeddings[rows[0]], query.person_ids, query.camera_ids,
            embeddings[rows[1]], gallery.person_ids, gallery.camera_ids, rerank=rerank,
        )  # fmt: skip
    folder_rows: dict[str, list[int]] = {folder: [] for folder in REID_FOLDERS}
    for i, path in enumerate(paths):
        folder = Path(path).parts[0] if Path(path).parts else ""
        if folder in folder_rows:
            folder_rows[folder].append(i)
    for folder, indices in folder_rows.items():
        if not indices:
            raise ValueError(
                f"{source}: no embedding of a {folder}/ image (re-id needs paths "
                f"{REID_FOLDERS[0]}/<name> and {REID_FOLDERS[1]}/<name>, or the data set's "
                "root: --reid ROOT)"
            )
    parsed = {f: np.array([parse_name(paths[i]) for i in folder_rows[f]]) for f in REID_FOLDERS}
    query_rows, gallery_rows = (np.asarray(folder_rows[f]) for f in REID_FOLDERS)
    return rank_gallery(
        embeddings[query_rows], parsed["query"][:, 0], parsed["query"][:, 1],
        embeddings[gallery_rows], parsed["bounding_box_test"][:, 0],
        parsed["bounding_box_test"][:, 1], rerank=rerank,
    )  # fmt: skip


def relative_paths(root: Path, images: PersonImages) -> list[str]:
    """The paths of `images` relative to the data set's `root` (POSIX separators)."""
    folder = Path(images.folder).relative_to(root).as_posix()
    return [f"{folder}/{path}" if folder != "." else path for path in images.paths]


def evaluate_reid(
    backbone: nn.Module,
    root: Path,
    image_size: int | tuple[int, int],
    extraction: Extraction = DEFAULT_EXTRACTION,
    *,
    export_path: Path | None = None,
    rerank: RerankParams | None = None,
    cuhk03_boxes: str = "labeled",
) -> dict:
    """Re-id ranking of `backbone` on the re-id data set at ``root`` (Market-1501's query/ and
    bounding_box_test/, MSMT17's list files, CUHK03's new-protocol split of `cuhk03_boxes`),
    re-ranked with `rerank` (None: by cosine).

    Returns :func:`recognition.evaluation.reid.rank_gallery`'s dict; with ``export_path``
    writes the embeddings with the images' paths relative to ``root`` (Market-1501:
    ``query/<name>``, ``bounding_box_test/<name>``).
    """
    query, gallery = reid_test_sets(root, cuhk03_boxes=cuhk03_boxes)
    paths = relative_paths(root, query) + relative_paths(root, gallery)
    embeddings = extraction(backbone, PathDataset(paths, size=image_size, root=root))
    if export_path is not None:
        save_embeddings(export_path, embeddings, paths)
        log.info("wrote %d embeddings to %s", len(paths), export_path)
    num_query = len(query)
    return rank_gallery(
        embeddings[:num_query], query.person_ids, query.camera_ids,
        embeddings[num_query:], gallery.person_ids, gallery.camera_ids, rerank=rerank,
    )  # fmt: skip
