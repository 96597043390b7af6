"""IJB-B / IJB-C 1:N lists: the two galleries and the mixed probes, read and cross-checked.

The release's 1:N lists, next to the 1:1 meta files (:mod:`recognition.evaluation.ijb.protocol`)::

    <root>/meta/ijbb_1N_gallery_S1.csv   <root>/meta/ijbc_1N_gallery_G1.csv
    <root>/meta/ijbb_1N_gallery_S2.csv   <root>/meta/ijbc_1N_gallery_G2.csv
    <root>/meta/ijbb_1N_probe_mixed.csv  <root>/meta/ijbc_1N_probe_mixed.csv

Comma-separated, a header line first, one row per image of a template; the columns
``TEMPLATE_ID`` and ``SUBJECT_ID`` are read (found by name in the header), the rest
(``FILENAME``, ``SIGHTING_ID``, face boxes...) are not: a template's images and media come
from face_tid_mid, so templates are pooled exactly as the 1:1 mode pools them, from the
same image features.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recognition.data.pairs import parse_count
from recognition.evaluation.ijb.protocol import meta_folder, numbered_lines, require_meta_file

GALLERIES = {"ijbb": ("S1", "S2"), "ijbc": ("G1", "G2")}
"""The release's names of its two galleries."""


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
    meta = meta_folder(root, name)
    files = {g: meta / f"{name}_1N_gallery_{g}.csv" for g in GALLERIES[name]}
    files["probes"] = meta / f"{name}_1N_probe_mixed.csv"
    return files


def read_template_list(path: Path) -> TemplateList:
    """One 1:N file: its templates and their subjects, every row checked.

    Raises FileNotFoundError for a missing file; ValueError naming file:line for a header
    without TEMPLATE_ID and SUBJECT_ID, a row too short, an id that is not an integer >= 0,
    or a template listed with two subjects; ValueError naming the file when it has no row.
    """
    require_meta_file(path)
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
