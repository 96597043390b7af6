"""IJB-B / IJB-C 1:N identification, by its former module name: the names it has always
offered, now kept in :mod:`recognition.evaluation.ijb` (the lists in ``search_protocol``,
the search and its metrics in ``search``, the table in ``report``)."""

from recognition.evaluation.ijb.report import format_search_table, report_search
from recognition.evaluation.ijb.search import (
    DEFAULT_FPIR_TARGETS,
    DEFAULT_RANKS,
    TOP_K,
    SearchResult,
    evaluate_ijb_search,
    identification_metrics,
    search_gallery,
)
from recognition.evaluation.ijb.search_protocol import (
    GALLERIES,
    SearchProtocol,
    TemplateList,
    load_search_protocol,
    read_template_list,
    search_meta_files,
)

__all__ = [
    "DEFAULT_FPIR_TARGETS",
    "DEFAULT_RANKS",
    "GALLERIES",
    "TOP_K",
    "SearchProtocol",
    "SearchResult",
    "TemplateList",
    "evaluate_ijb_search",
    "format_search_table",
    "identification_metrics",
    "load_search_protocol",
    "read_template_list",
    "report_search",
    "search_gallery",
    "search_meta_files",
]
