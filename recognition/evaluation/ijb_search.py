"""IJB-B / IJB-C 1:N identification: gallery and probe lists, the tiled search, CMC, TPIR@FPIR.

The release's 1:N lists, next to the 1:1 meta files (:mod:`recognition.evaluation.ijb`)::

    <root>/meta/ijbb_1N_gallery_S1.csv   <root>/meta/ijbc_1N_gallery_G1.csv
    <root>/meta/ijbb_1N_gallery_S2.csv   <root>/meta/ijbc_1N_gallery_G2.csv
    <root>/meta/ijbb_1N_probe_mixed.csv  <root>/meta/ijbc_1N_probe_mixed.csv

Comma-separated, a header line first, one row per image of a template; the columns
``TEMPLATE_ID`` and ``SUBJECT_ID`` are read (found by name in the header), the rest
(``FILENAME``, ``SIGHTING_ID``, face boxes...) are not: a template's images and media come
from face_tid_mid, so templates are pooled exactly as the 1:1 mode pools them, from the
same image features.

The protocol: every probe template is searched in each gallery on its own. A probe is
*mated* in a gallery when its subject is enrolled there (each subject has one template in
one of the two galleries), *non-mated* otherwise. Per gallery:

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

import csv
import logging
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from threadpoolctl import threadpool_limits

from recognition.data.pairs import parse_count
from recognition.evaluation.embeddings import Extraction
from recognition.evaluation.ijb import (
    IJB_NAMES,
    NO_FEATURE_SCORE,
    cached_features,
    default_threads,
    load_protocol,
    numbered_lines,
    protocol_features,
    template_features,
)
from recognition.evaluation.run import write_json
from recognition.evaluation.verification import far_key, tar_at_far_sorted, to_json_dict

log = logging.getLogger(__name__)

GALLERIES = {"ijbb": ("S1", "S2"), "ijbc": ("G1", "G2")}
"""The release's names of its two galleries."""
DEFAULT_RANKS = (1, 5, 10)
DEFAULT_FPIR_TARGETS = (1e-2, 1e-1)
TOP_K = 10
"""Candidates kept per probe and gallery (the candidate list of the search)."""


# ------------------------------------------------------------------------------ meta files


@dataclass(frozen=True)
class TemplateList:
    """The templates of one 1:N file, each once in order of first appearance: ``templates``
    (T,) and ``subjects`` (T,) int64 ids, ``lines`` (T,) the line each first appears on."""

    path: Path
    templates: np.ndarray
    subjects: np.ndarray
    lines: np.ndarray

    def where(self, index: int) -> str:
        return f"{self.path}:{int(self.lines[index])}"


@dataclass(frozen=True)
class SearchProtocol:
    """The 1:N lists of one IJB set: two galleries by the release's names, and the probes."""

    name: str
    galleries: dict[str, TemplateList]
    probes: TemplateList

    def template_ids(self) -> np.ndarray:
        """Every template id of the three lists (T,)."""
        lists = [g.templates for g in self.galleries.values()] + [self.probes.templates]
        return np.concatenate(lists)


def search_meta_files(root: str | os.PathLike, name: str) -> dict[str, Path]:
    """The 1:N file paths of ``name`` under ``root``: the two galleries by their release
    names (S1, S2 for ijbb; G1, G2 for ijbc), and ``probes``."""
    if name not in IJB_NAMES:
        raise ValueError(f"--ijb-name: expected one of {', '.join(IJB_NAMES)}, got {name!r}")
    meta = Path(root) / "meta"
    files = {g: meta / f"{name}_1N_gallery_{g}.csv" for g in GALLERIES[name]}
    files["probes"] = meta / f"{name}_1N_probe_mixed.csv"
    return files


def read_template_list(path: Path) -> TemplateList:
    """One 1:N file: its templates and their subjects, every row checked.

    Raises FileNotFoundError for a missing file; ValueError naming file:line for a header
    without TEMPLATE_ID and SUBJECT_ID, a row too short, an id that is not an integer >= 0,
    or a template listed with two subjects; ValueError naming the file when it has no row.
    """
    if not path.is_file():
        raise FileNotFoundError(f"IJB meta file not found: {path}")
    first: dict[int, tuple[int, int]] = {}  # template -> (subject, line)
    columns = None
    reader = csv.reader(line for _, line in numbered_lines(path))
    for fields in reader:
        number = reader.line_num
        fields = [v.strip() for v in fields]
        if not any(fields):
            continue
        if columns is None:
            columns = _header_columns(fields, f"{path}:{number}")
            continue
        where = f"{path}:{number}"
        if len(fields) <= max(columns):
            raise ValueError(
                f"{where}: expected at least {max(columns) + 1} fields (TEMPLATE_ID and "
                f"SUBJECT_ID in columns {columns[0] + 1} and {columns[1] + 1}), got "
                f"{len(fields)}"
            )
        template = parse_count(fields[columns[0]], where, "TEMPLATE_ID")
        subject = parse_count(fields[columns[1]], where, "SUBJECT_ID")
        seen = first.setdefault(template, (subject, number))
        if seen[0] != subject:
            raise ValueError(
                f"{where}: template {template} has subject {subject} here but {seen[0]} "
                f"on line {seen[1]}"
            )
    if not first:
        raise ValueError(f"{path}: no rows; expected a header and TEMPLATE_ID,SUBJECT_ID,...")
    templates = np.fromiter(first, np.int64, len(first))
    subjects, lines = (np.array(v, np.int64) for v in zip(*first.values(), strict=True))
    return TemplateList(path, templates, subjects, lines)


def _header_columns(fields: Sequence[str], where: str) -> tuple[int, int]:
    names = [v.upper() for v in fields]
    if "TEMPLATE_ID" not in names or "SUBJECT_ID" not in names:
        raise ValueError(
            f"{where}: expected a header naming the TEMPLATE_ID and SUBJECT_ID columns, got "
            f"{','.join(fields)!r}"
        )
    return names.index("TEMPLATE_ID"), names.index("SUBJECT_ID")


def load_search_protocol(root: str | os.PathLike, name: str) -> SearchProtocol:
    """Read and cross-check the three 1:N files of ``name`` under ``root``.

    The protocol's galleries enrol each subject once and are disjoint, and no probe is a
    gallery template (it would find itself): a list that breaks this is refused with a
    ValueError naming both lines, as is any malformed line (:func:`read_template_list`).
    """
    files = search_meta_files(root, name)
    galleries = {g: read_template_list(files[g]) for g in GALLERIES[name]}
    probes = read_template_list(files["probes"])
    enrolled: dict[int, str] = {}  # subject -> where
    gallery_template: dict[int, str] = {}  # template -> where
    for gallery in galleries.values():
        for i, (template, subject) in enumerate(
            zip(gallery.templates.tolist(), gallery.subjects.tolist(), strict=True)
        ):
            where = gallery.where(i)
            if template in gallery_template:
                raise ValueError(
                    f"{where}: template {template} is already a gallery template "
                    f"({gallery_template[template]}); the galleries are disjoint"
                )
            if subject in enrolled:
                raise ValueError(
                    f"{where}: subject {subject} is already enrolled ({enrolled[subject]}); "
                    "the protocol enrols each subject once, in one gallery"
                )
            enrolled[subject], gallery_template[template] = where, where
    for i, template in enumerate(probes.templates.tolist()):
        if template in gallery_template:
            raise ValueError(
                f"{probes.where(i)}: probe template {template} is also a gallery template "
                f"({gallery_template[template]}); a probe must not be searched for itself"
            )
    return SearchProtocol(name, galleries, probes)


# ------------------------------------------------------------------------------ search


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


# ------------------------------------------------------------------------------ the run


def evaluate_ijb_search(
    root: str | os.PathLike,
    name: str,
    *,
    checkpoint: str | os.PathLike | None = None,
    features_path: str | os.PathLike | None = None,
    image_size: int | Sequence[int] | None = None,
    score_weight: bool = False,
    batch_size: int = 128,
    flip: bool = True,
    device: torch.device | None = None,
    num_workers: int = 0,
    progress: bool = True,
    num_threads: int | None = None,
) -> dict:
    """IJB 1:N identification of a checkpoint (or of cached image features) on ``root``.

    The arguments and the features file are those of
    :func:`recognition.evaluation.ijb.evaluate_ijb` (one file serves both modes). Every meta
    file is read and checked before any image is embedded. Returns ``name``, ``mode``
    ("1n"), ``num_images``, ``num_unreadable_images``, ``num_probes``,
    ``num_probes_without_feature``, ``galleries`` ({"G1": {``num_templates``,
    ``num_templates_without_feature``, and :func:`identification_metrics`' dict}, ...}),
    ``cmc`` and ``tpir_at_fpir`` (the means over the galleries), ``score_weight``, ``flip``.
    """
    search = load_search_protocol(root, name)
    cached = cached_features(features_path)
    protocol = load_protocol(root, name, check_images=not cached, pairs=False)
    features, readable = protocol_features(
        protocol,
        checkpoint=checkpoint,
        features_path=features_path,
        image_size=image_size,
        extraction=Extraction(batch_size, flip, device, num_workers, progress),
    )
    template_ids, unit = template_features(
        features, readable, protocol, score_weight, more_templates=search.template_ids()
    )
    has_feature = np.linalg.norm(unit, axis=1) > 0
    listed = np.isin(template_ids, protocol.face_template)

    def rows(templates: TemplateList, what: str) -> tuple[np.ndarray, int]:
        # Template rows of `unit`; counts (and logs) those without a feature.
        index = np.searchsorted(template_ids, templates.templates)
        without = templates.templates[~has_feature[index]]
        if len(without):
            log.warning(
                "%d %s templates have no feature (%d of them no face_tid_mid line; first "
                "ids: %s); they score %g against everything",
                len(without),
                what,
                int((~listed[index]).sum()),
                ", ".join(str(t) for t in without[:5]),
                NO_FEATURE_SCORE,
            )
        return index, len(without)

    probe_rows, num_probes_without = rows(search.probes, "probe")
    galleries = {}
    for gallery_name, gallery in search.galleries.items():
        gallery_rows, num_without = rows(gallery, f"gallery {gallery_name}")
        column = {s: c for c, s in enumerate(gallery.subjects.tolist())}
        mate = np.array([column.get(s, -1) for s in search.probes.subjects.tolist()], np.int64)
        result = search_gallery(
            unit[probe_rows],
            unit[gallery_rows],
            mate,
            probe_ok=has_feature[probe_rows],
            gallery_ok=has_feature[gallery_rows],
            num_threads=num_threads,
        )
        metrics = identification_metrics(result)
        if metrics["num_mated"] == 0:
            log.warning("gallery %s: no probe's subject is enrolled in it", gallery_name)
        galleries[gallery_name] = {
            "num_templates": len(gallery.templates),
            "num_templates_without_feature": num_without,
            **metrics,
        }
    per_gallery = list(galleries.values())
    return {
        "name": name,
        "mode": "1n",
        "num_images": len(protocol.images),
        "num_unreadable_images": int((~readable).sum()),
        "num_probes": len(search.probes.templates),
        "num_probes_without_feature": num_probes_without,
        "galleries": galleries,
        "cmc": _mean_over_galleries([g["cmc"] for g in per_gallery]),
        "tpir_at_fpir": _mean_over_galleries([g["tpir_at_fpir"] for g in per_gallery]),
        "score_weight": bool(score_weight),
        "flip": bool(flip),
    }


def format_search_table(results: Mapping) -> str:
    """A console table of one :func:`evaluate_ijb_search` result: a row per gallery and
    their mean; counts, CMC % and TPIR % at each FPIR."""
    ranks = list(results["cmc"])
    fpirs = list(results["tpir_at_fpir"])
    header = ["target", "probes", "gallery", "mated", "non-mated"]
    header += [f"rank-{r}%" for r in ranks] + [f"TPIR%@FPIR={f}" for f in fpirs]

    def percent(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.2f}"

    name, num_probes = results["name"], str(results["num_probes"])
    rows = [header]
    for gallery_name, g in results["galleries"].items():
        counts = [str(g[k]) for k in ("num_templates", "num_mated", "num_non_mated")]
        rows.append(
            [f"{name}/{gallery_name}", num_probes, *counts]
            + [percent(g["cmc"][r]) for r in ranks]
            + [percent(g["tpir_at_fpir"][f]) for f in fpirs]
        )
    rows.append(
        [f"{name} mean", num_probes, "", "", ""]
        + [percent(results["cmc"][r]) for r in ranks]
        + [percent(results["tpir_at_fpir"][f]) for f in fpirs]
    )
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    lines = [
        "  ".join(
            [row[0].ljust(widths[0])]
            + [v.rjust(w) for v, w in zip(row[1:], widths[1:], strict=True)]
        ).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def report_search(results: dict, *, json_path: Path | None = None) -> str:
    """Print the table of one :func:`evaluate_ijb_search` result; write its JSON."""
    table = format_search_table(results)
    print(table, flush=True)
    if json_path is not None:
        write_json(json_path, to_json_dict(results))
        log.info("wrote %s", json_path)
    return table
