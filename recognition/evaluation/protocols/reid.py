"""The re-id protocol (`--reid`, `reid:`): each query ranks the gallery of a re-id data set
(Market-1501 / DukeMTMC-reID's query/ against bounding_box_test/, MSMT17's list files,
CUHK03's new-protocol split), by cosine or by the k-reciprocal re-ranked distance; CMC, mAP
and mINP (`recognition.evaluation.reid`)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recognition.config import EvalTarget
from recognition.evaluation.protocols.base import Protocol

if TYPE_CHECKING:
    import numpy as np
    from torch import nn

    from recognition.evaluation.embeddings import Extraction

# evaluate.py's --rerank-* flags and the RerankParams fields they set.
RERANK_FLAGS = (("--rerank-k1", "k1"), ("--rerank-k2", "k2"), ("--rerank-lambda", "lambda_value"))


class ReID(Protocol):
    """A re-id data set's release at `target.reid`. Options (evaluate.py's flags; none during
    training): `rerank` (RerankParams or None), `cuhk03_boxes`, `source` (the embeddings
    file's name, with --embeddings)."""

    kind = "reid"

    @property
    def root(self) -> Path | None:
        """The data set's root; None for embeddings named by Market-1501's own paths."""
        return None if self.target.reid in (None, ".") else Path(self.target.reid)

    def check(self) -> None:
        """The release there, by its files (they are read when evaluated)."""
        from recognition.data.reid_sets import reid_layout
        from recognition.evaluation.reid import REID_FOLDERS

        if self.root is None or reid_layout(self.root) in ("msmt17", "cuhk03"):
            return
        for folder in REID_FOLDERS:  # a Market-1501 / DukeMTMC-reID layout
            if not (self.root / folder).is_dir():
                raise FileNotFoundError(
                    f"eval target {self.name}: {self.root / folder} not found (Market-1501's "
                    "layout; MSMT17's list files or CUHK03's split files would do too)"
                )

    def _ranking(self) -> dict[str, Any]:
        return {
            "rerank": self.options.get("rerank"),
            "cuhk03_boxes": self.options.get("cuhk03_boxes", "labeled"),
        }

    def evaluate(
        self,
        backbone: nn.Module | None,
        image_size: int | tuple[int, int],
        extraction: Extraction,
        *,
        xnorm: bool = False,
    ) -> tuple[dict, np.ndarray, list[str]]:
        from recognition.data.reid_sets import reid_test_sets
        from recognition.evaluation.embeddings import PathDataset
        from recognition.evaluation.reid import rank_gallery, relative_paths

        root = self.root or Path(".")
        ranking = self._ranking()
        query, gallery = reid_test_sets(root, cuhk03_boxes=ranking["cuhk03_boxes"])
        paths = relative_paths(root, query) + relative_paths(root, gallery)
        embeddings = extraction(backbone, PathDataset(paths, size=image_size, root=root))
        num_query = len(query)
        result = rank_gallery(
            embeddings[:num_query], query.person_ids, query.camera_ids,
            embeddings[num_query:], gallery.person_ids, gallery.camera_ids,
            rerank=ranking["rerank"],
        )  # fmt: skip
        return result, embeddings, paths

    def from_embeddings(self, embeddings: np.ndarray, paths: list[str]) -> dict:
        from recognition.evaluation.reid import reid_from_embeddings

        source = self.options.get("source", self.name)
        return reid_from_embeddings(embeddings, paths, source, root=self.root, **self._ranking())

    def scalars(self, result: Mapping) -> dict[str, float]:
        names = ["mAP", "mINP", *(k for k in result if k.startswith("rank") and k[4:].isdigit())]
        return {k: float(result[k]) for k in names if result.get(k) is not None}

    @classmethod
    def table(cls, results: Mapping[str, Mapping]) -> str:
        from recognition.evaluation.reid import format_reid_table

        return format_reid_table(results)

    # ------------------------------------------------------------------ the command line

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--reid",
            type=Path,
            nargs="?",
            const=Path("."),
            metavar="ROOT",
            help="re-id ranking (CMC, mAP, mINP) on a re-id data set: Market-1501's (or "
            "DukeMTMC-reID's) ROOT/query and ROOT/bounding_box_test, MSMT17's list files, "
            "CUHK03's new-protocol split; with --embeddings of a Market-1501 layout no ROOT "
            "is needed",
        )
        parser.add_argument(
            "--rerank",
            action="store_true",
            help="rank by the k-reciprocal re-ranked distance (Zhong et al. 2017)",
        )
        for flag, metavar, default in (("--rerank-k1", "K1", 20), ("--rerank-k2", "K2", 6)):
            parser.add_argument(
                flag, type=int, metavar=metavar, help=f"re-ranking's {metavar.lower()} "
                f"(default {default})"
            )  # fmt: skip
        parser.add_argument(
            "--rerank-lambda", type=float, metavar="L", help="re-ranking's lambda (default 0.3)"
        )
        parser.add_argument(
            "--cuhk03-boxes",
            choices=["labeled", "detected"],
            default="labeled",
            help="CUHK03: the split of the hand-labeled boxes or of the detected ones",
        )

    @classmethod
    def targets(cls, args: argparse.Namespace) -> list[EvalTarget]:
        if args.reid is None:
            return []
        if args.embeddings is not None and args.reid == Path("."):
            # The embeddings' paths say query/ and bounding_box_test/: named after the file.
            return [EvalTarget(reid=".", name=args.embeddings.stem)]
        return [EvalTarget(reid=str(args.reid))]

    @classmethod
    def options(cls, args: argparse.Namespace) -> dict:
        from recognition.evaluation.rerank import RerankParams

        given = {field: getattr(args, _dest(flag)) for flag, field in RERANK_FLAGS}
        given = {field: value for field, value in given.items() if value is not None}
        options: dict[str, Any] = {
            "rerank": RerankParams(**given) if args.rerank else None,
            "cuhk03_boxes": args.cuhk03_boxes,
        }
        if args.embeddings is not None:
            options["source"] = str(args.embeddings)
        return options

    @classmethod
    def problems(cls, args: argparse.Namespace) -> list[str]:
        """--rerank without --reid, a --rerank-* flag without --rerank, values out of range."""
        from recognition.evaluation.rerank import RerankParams

        given = {flag: getattr(args, _dest(flag)) for flag, _ in RERANK_FLAGS}
        given = {flag: value for flag, value in given.items() if value is not None}
        if args.reid is None and (args.rerank or given):
            return ["--rerank: re-ranks the re-id ranking; use it with --reid"]
        if given and not args.rerank:
            return [f"{flag}: only with --rerank" for flag in given]
        if args.rerank:
            fields = {field: given[flag] for flag, field in RERANK_FLAGS if flag in given}
            try:
                RerankParams(**fields)
            except ValueError as exc:
                return [str(exc)]
        return []


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")
