"""The re-id protocol (`--reid`, `reid:`): Market-1501 ranking of query/ against
bounding_box_test/, CMC and mAP (`recognition.evaluation.reid`)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from recognition.config import EvalTarget
from recognition.evaluation.protocols.base import Protocol

if TYPE_CHECKING:
    import numpy as np
    from torch import nn

    from recognition.evaluation.embeddings import Extraction


class ReID(Protocol):
    """A Market-1501 layout (`target.reid`): each query ranks the gallery by cosine."""

    kind = "reid"

    def check(self) -> None:
        """Both folders there (their files are listed when evaluated)."""
        from recognition.evaluation.reid import REID_FOLDERS

        root = Path(self.target.reid or "")
        for folder in REID_FOLDERS:
            if not (root / folder).is_dir():
                raise FileNotFoundError(f"eval target {self.name}: {root / folder} not found")

    def evaluate(
        self,
        backbone: nn.Module | None,
        image_size: int | tuple[int, int],
        extraction: Extraction,
        *,
        xnorm: bool = False,
    ) -> tuple[dict, np.ndarray, list[str]]:
        from recognition.data.market1501 import list_folder
        from recognition.evaluation.embeddings import PathDataset
        from recognition.evaluation.reid import REID_FOLDERS, reid_from_embeddings

        root = Path(self.target.reid or "")
        paths = [
            f"{folder}/{name}"
            for folder in REID_FOLDERS
            for name in list_folder(root / folder).paths
        ]
        embeddings = extraction(backbone, PathDataset(paths, size=image_size, root=root))
        return reid_from_embeddings(embeddings, paths, str(root)), embeddings, paths

    def from_embeddings(self, embeddings: np.ndarray, paths: list[str]) -> dict:
        from recognition.evaluation.reid import reid_from_embeddings

        return reid_from_embeddings(embeddings, paths, self.options.get("source", self.name))

    def scalars(self, result: Mapping) -> dict[str, float]:
        names = ["mAP", *(k for k in result if k.startswith("rank") and k[4:].isdigit())]
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
            help="re-id ranking (CMC, mAP) on a Market-1501 layout: ROOT/query and "
            "ROOT/bounding_box_test; with --embeddings no ROOT is needed",
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
        return {"source": str(args.embeddings)} if args.embeddings is not None else {}
