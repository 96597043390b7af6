"""Verification protocols: an LFW-style pairs file (`--pairs`, `pairs:`) and an insightface
`.bin` (`--bin`, `bin:`): accuracy over 10 folds, AUC, EER and TAR@FAR of the pairs' cosines
(`recognition.evaluation.verification`)."""

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

    from recognition.data.pairs import Pairs
    from recognition.evaluation.embeddings import Extraction


class Verification(Protocol):
    """What both verification kinds share: their scalars, table and ROC."""

    def scalars(self, result: Mapping) -> dict[str, float]:
        values = {k: float(result[k]) for k in ("accuracy", "auc", "eer")}
        if result.get("xnorm") is not None:
            values["xnorm"] = float(result["xnorm"])
        for far, tar in result.get("tar_at_far", {}).items():
            if tar is not None:
                values[f"tar@far={far}"] = float(tar)
        return values

    @classmethod
    def table(cls, results: Mapping[str, Mapping]) -> str:
        from recognition.evaluation.verification import format_table

        return format_table(results)

    @classmethod
    def roc_title(cls, results: Mapping[str, Mapping]) -> str | None:
        return "ROC"

    @property
    def has_roc(self) -> bool:
        return True


class PairsVerification(Verification):
    """An LFW-format pairs file; its images under `images` (default: the file's folder)."""

    kind = "pairs"

    def check(self) -> None:
        """The pairs file read, and every image it names found."""
        load_target(self.target)

    def evaluate(
        self,
        backbone: nn.Module | None,
        image_size: int | tuple[int, int],
        extraction: Extraction,
        *,
        xnorm: bool = False,
    ) -> tuple[dict, np.ndarray, list[str]]:
        import numpy as np

        from recognition.evaluation.embeddings import PathDataset, index_paths, verify_pairs

        pairs, root = load_target(self.target)
        paths = pairs.images()
        dataset = PathDataset(paths, size=image_size, root=root, crop=self.target.crop)
        embeddings, norms = extraction(backbone, dataset, return_norms=True)
        result = verify_pairs(embeddings, index_paths(paths), pairs)
        if xnorm:
            result["xnorm"] = float(np.mean(norms, dtype=np.float64))
        return result, embeddings, paths

    def from_embeddings(self, embeddings: np.ndarray, paths: list[str]) -> dict:
        from recognition.data.pairs import load_pairs
        from recognition.evaluation.embeddings import index_paths, verify_pairs

        return verify_pairs(embeddings, index_paths(paths), load_pairs(self.target.pairs))

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--pairs", type=Path, help="LFW-format pairs file")
        parser.add_argument(
            "--images",
            type=Path,
            help="folder the pairs' image names resolve in (default: the pairs' folder); "
            "without --pairs, with --export-embeddings: embed every image under it",
        )
        parser.add_argument(
            "--crop",
            type=int,
            metavar="PIXELS",
            help="centre square cut from each original image before resizing (e.g. 150 for "
            "LFW's 250x250 photos; --pairs and --bin)",
        )

    @classmethod
    def targets(cls, args: argparse.Namespace) -> list[EvalTarget]:
        if args.pairs is None:
            return []
        images = str(args.images) if args.images else None
        return [EvalTarget(pairs=str(args.pairs), images=images, crop=args.crop)]

    @classmethod
    def problems(cls, args: argparse.Namespace) -> list[str]:
        if args.crop is not None and args.crop < 1:
            return [f"--crop: must be a positive size, got {args.crop}"]
        if args.crop is not None and args.pairs is None and not args.bin:
            return ["--crop: only with --pairs or --bin"]
        return []


class BinVerification(Verification):
    """An insightface `.bin`: its images and issame list, pairs (2i, 2i + 1) in order."""

    kind = "bin"

    def check(self) -> None:
        """The file there (it is read in full only when evaluated)."""
        if not Path(self.target.bin or "").is_file():
            raise FileNotFoundError(f"eval target {self.name}: {self.target.bin} not found")

    def evaluate(
        self,
        backbone: nn.Module | None,
        image_size: int | tuple[int, int],
        extraction: Extraction,
        *,
        xnorm: bool = False,
    ) -> tuple[dict, np.ndarray, list[str]]:
        import numpy as np

        from recognition.data.insightface_bin import BinDataset, load_bin

        path = self.target.bin
        assert path is not None
        bin_pairs = load_bin(path)
        dataset = BinDataset(bin_pairs, size=image_size, crop=self.target.crop)
        embeddings, norms = extraction(backbone, dataset, return_norms=True)
        paths = [f"{Path(path).name}/{i}" for i in range(len(dataset))]
        result = verify_consecutive(embeddings, bin_pairs.issame)
        if xnorm:
            result["xnorm"] = float(np.mean(norms, dtype=np.float64))
        return result, embeddings, paths

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--bin",
            type=Path,
            action="append",
            default=[],
            metavar="FILE.bin",
            help="insightface verification set (lfw.bin, cfp_fp.bin, ...); may be repeated",
        )

    @classmethod
    def targets(cls, args: argparse.Namespace) -> list[EvalTarget]:
        return [EvalTarget(bin=str(path), crop=args.crop) for path in args.bin]


def load_target(target: EvalTarget) -> tuple[Pairs, Path]:
    """Read a target's pairs and check that every image exists; returns (pairs, image root)."""
    from recognition.data.pairs import load_pairs, resolve_images

    if target.pairs is None:
        raise ValueError(f"target {target.label}: not a pairs target")
    pairs = load_pairs(target.pairs)
    root = Path(target.images) if target.images else Path(target.pairs).parent
    return resolve_images(pairs, root), root


def verify_consecutive(embeddings: np.ndarray, issame: np.ndarray, num_folds: int = 10) -> dict:
    """Verification metrics of pairs (2i, 2i+1) of ``embeddings`` (2N, D), as a .bin orders them.

    The N pairs are split in order into ``num_folds`` contiguous folds (insightface's
    unshuffled 10-fold protocol). Returns :func:`evaluate_verification`'s dict.
    """
    import numpy as np

    from recognition.evaluation.verification import evaluate_verification

    unit = np.asarray(embeddings, dtype=np.float64)
    unit = unit / np.maximum(np.linalg.norm(unit, axis=1, keepdims=True), 1e-12)
    scores = np.einsum("pd,pd->p", unit[0::2], unit[1::2])  # (N,)
    return evaluate_verification(scores, issame, num_folds=num_folds)
