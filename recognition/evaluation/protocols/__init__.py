"""Evaluation protocols behind one interface (`Protocol`), for `evaluate.py` and for the
evaluation during training: a target's kind (`pairs`, `bin`, `ijb`, `reid`: the
`eval.targets[i]` key that is set) names its protocol in `recognition.registry.PROTOCOLS`.

`evaluate_protocols` runs several on one backbone, `report` prints their tables (one per
protocol class) and writes one JSON file and the ROC of those that have one; `scalars` gives
the numbers that metrics.jsonl logs and `eval.best_metric` chooses among.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recognition.config import EvalTarget
from recognition.evaluation.protocols.base import Protocol, path_problem
from recognition.registry import PROTOCOLS, load

if TYPE_CHECKING:
    from torch import nn

    from recognition.evaluation.embeddings import Extraction
    from recognition.evaluation.onnx_model import OnnxInput

log = logging.getLogger(__name__)


def protocol_class(kind: str) -> type[Protocol]:
    """The Protocol subclass registered for the target kind `kind`."""
    return load(PROTOCOLS, kind, "eval.targets")


def protocol_for(target: EvalTarget, **options: Any) -> Protocol:
    """The protocol that evaluates `target` (by its kind), with `options`."""
    return protocol_class(target.kind)(target, **options)


def evaluate_protocols(
    backbone: nn.Module | None,
    protocols: Sequence[Protocol],
    image_size: int | tuple[int, int] | None,
    extraction: Extraction,
    *,
    export_path: Path | None = None,
    xnorm: bool = False,
) -> dict[str, dict]:
    """{target name: result} of `backbone` on each protocol, in order.

    With `export_path` the embeddings are written there (one target), or to
    `<stem>.<target name>.npz` beside it for each of several targets.
    """
    from recognition.evaluation.embeddings import save_embeddings

    results: dict[str, dict] = {}
    for protocol in protocols:
        name = protocol.name
        results[name], embeddings, paths = protocol.evaluate(
            backbone, image_size, extraction, xnorm=xnorm
        )
        if export_path is not None and embeddings is not None and paths is not None:
            out = export_path
            if len(protocols) > 1:
                out = export_path.with_name(f"{export_path.stem}.{name}{export_path.suffix}")
            save_embeddings(out, embeddings, paths)
            log.info("wrote %d embeddings to %s", len(paths), out)
    return results


def evaluate_targets(
    backbone: nn.Module,
    targets: Sequence[EvalTarget],
    image_size: int | tuple[int, int],
    extraction: Extraction | None = None,
    *,
    export_path: Path | None = None,
    xnorm: bool = False,
) -> dict[str, dict]:
    """Results {target name: metrics} of `backbone` on each target, through its protocol
    (`evaluate_protocols`, which says how `export_path` is used); `extraction` None: the
    default `Extraction`."""
    from recognition.evaluation.embeddings import DEFAULT_EXTRACTION

    extraction = DEFAULT_EXTRACTION if extraction is None else extraction
    protocols = [protocol_for(target) for target in targets]
    return evaluate_protocols(
        backbone, protocols, image_size, extraction, export_path=export_path, xnorm=xnorm
    )


def scalars(protocols: Sequence[Protocol], results: Mapping[str, Mapping]) -> dict[str, float]:
    """`eval/<target>/<metric>`: value for every result (what metrics.jsonl logs)."""
    values = {}
    for protocol in protocols:
        if protocol.name in results:
            measured = protocol.scalars(results[protocol.name])
            values |= {f"eval/{protocol.name}/{k}": v for k, v in measured.items()}
    return values


def report(
    protocols: Sequence[Protocol],
    results: Mapping[str, Mapping],
    *,
    json_path: Path | None = None,
    roc_path: Path | None = None,
    flat_json: bool = False,
) -> str:
    """Print a table per protocol class; write the JSON (keyed by target, or flat for one
    target with `flat_json`) and the ROC of the results that have one. Returns the tables."""
    from recognition.evaluation.plots import plot_roc
    from recognition.evaluation.report import print_report
    from recognition.evaluation.verification import to_json_dict

    # One table per class that defines `table` (pairs and .bin share verification's).
    groups: dict[type[Protocol], dict[str, Mapping]] = {}
    for protocol in protocols:
        owner = next(c for c in type(protocol).__mro__ if "table" in vars(c))
        groups.setdefault(owner, {})[protocol.name] = results[protocol.name]
    tables, curves, titles = [], {}, []
    for owner, subset in groups.items():
        tables.append(owner.table(subset))
        if (title := owner.roc_title(subset)) is not None:
            curves |= {n: r for n, r in subset.items() if "_roc" in r}
            titles.append(title)
    if flat_json and len(results) == 1:
        payload = to_json_dict(next(iter(results.values())))
    else:
        payload = {name: to_json_dict(r) for name, r in results.items()}
    text = print_report("\n\n".join(tables), payload, json_path)
    if roc_path is not None and curves:
        plot_roc(curves, roc_path, title=titles[0] if len(titles) == 1 else "ROC")
        log.info("wrote %s", roc_path)
    return text


def onnx_input(args: argparse.Namespace) -> OnnxInput | None:
    """evaluate.py's --onnx-* flags as an OnnxInput; None when none is given (the default)."""
    from recognition.evaluation.onnx_model import OnnxInput

    if args.onnx_mean is None and args.onnx_std is None and not args.onnx_bgr:
        return None
    default = OnnxInput()
    return OnnxInput(args.onnx_mean or default.mean, args.onnx_std or default.std, args.onnx_bgr)


__all__ = [
    "Protocol",
    "evaluate_protocols",
    "evaluate_targets",
    "onnx_input",
    "path_problem",
    "protocol_class",
    "protocol_for",
    "report",
    "scalars",
]
