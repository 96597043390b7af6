"""The IJB tables and files: a console table per mode, its JSON, the 1:1 ROC plot."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from recognition.evaluation.plots import plot_roc
from recognition.evaluation.report import print_report, text_table
from recognition.evaluation.verification import to_json_dict

log = logging.getLogger(__name__)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def format_ijb_table(results: Mapping[str, Mapping]) -> str:
    """A console table, one row per {name: :func:`evaluate_ijb` result}: counts, AUC, TAR%."""
    far_keys = list(dict.fromkeys(k for r in results.values() for k in r["tar_at_far"]))
    header = ["target", "images", "templates", "pairs", "AUC"] + [f"TAR%@{k}" for k in far_keys]
    rows = [header]
    for name, r in results.items():
        counts = [str(r[k]) for k in ("num_images", "num_templates", "num_pairs")]
        rows.append(
            [str(name), *counts, f"{r['auc']:.4f}"]
            + [_percent(r["tar_at_far"][k]) for k in far_keys]
        )
    return text_table(rows)


def report_ijb(
    results: dict,
    *,
    json_path: Path | None = None,
    roc_path: Path | None = None,
) -> str:
    """Print the table of one :func:`evaluate_ijb` result; write its JSON and ROC plot."""
    name = results["name"]
    table = print_report(format_ijb_table({name: results}), to_json_dict(results), json_path)
    if roc_path is not None:
        plot_roc({name: results}, roc_path, title=f"{name.upper()} 1:1 verification")
        log.info("wrote %s", roc_path)
    return table


def format_search_table(results: Mapping) -> str:
    """A console table of one :func:`evaluate_ijb_search` result: a row per gallery and
    their mean; counts, CMC % and TPIR % at each FPIR."""
    ranks = list(results["cmc"])
    fpirs = list(results["tpir_at_fpir"])
    header = ["target", "probes", "gallery", "mated", "non-mated"]
    header += [f"rank-{r}%" for r in ranks] + [f"TPIR%@FPIR={f}" for f in fpirs]
    name, num_probes = results["name"], str(results["num_probes"])
    rows = [header]
    for gallery_name, g in results["galleries"].items():
        counts = [str(g[k]) for k in ("num_templates", "num_mated", "num_non_mated")]
        rows.append(
            [f"{name}/{gallery_name}", num_probes, *counts]
            + [_percent(g["cmc"][r]) for r in ranks]
            + [_percent(g["tpir_at_fpir"][f]) for f in fpirs]
        )
    rows.append(
        [f"{name} mean", num_probes, "", "", ""]
        + [_percent(results["cmc"][r]) for r in ranks]
        + [_percent(results["tpir_at_fpir"][f]) for f in fpirs]
    )
    return text_table(rows)


def report_search(results: dict, *, json_path: Path | None = None) -> str:
    """Print the table of one :func:`evaluate_ijb_search` result; write its JSON."""
    return print_report(format_search_table(results), to_json_dict(results), json_path)
