"""The IJB-B / IJB-C protocol (`--ijb`, `ijb:`): 1:1 template verification (AUC, TAR@FAR)
or 1:N identification (CMC, TPIR@FPIR), `recognition.evaluation.ijb`.

From the command line the release's features may come from a features file
(`--save-features`), with no model; during training the run's backbone embeds the images at
each evaluation."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recognition.config import EvalTarget
from recognition.evaluation.protocols.base import Protocol

if TYPE_CHECKING:
    from torch import nn

    from recognition.evaluation.embeddings import Extraction


class IJB(Protocol):
    """An IJB-B/C release (`target.ijb`): 1:1 or 1:N by `target.ijb_mode`.

    Options (the command line's): `checkpoint` (a file the IJB code loads itself, so that a
    features file records it), `features_path`, `score_weight`, `onnx_input`.
    """

    kind = "ijb"

    @property
    def has_roc(self) -> bool:
        return self.target.ijb_mode == "11"

    @property
    def needs_model(self) -> bool:
        return not (self.options.get("checkpoint") or self.options.get("features_path"))

    def check(self) -> None:
        """The meta folder there (its files are read and checked when evaluated)."""
        root = Path(self.target.ijb or "")
        if not (root / "meta").is_dir():
            raise FileNotFoundError(f"eval target {self.name}: IJB meta folder not found: {root}")

    def evaluate(
        self,
        backbone: nn.Module | None,
        image_size: int | tuple[int, int] | None,
        extraction: Extraction,
        *,
        xnorm: bool = False,
    ) -> tuple[dict, None, None]:
        from recognition.evaluation.ijb.search import evaluate_ijb_search
        from recognition.evaluation.ijb.verification import evaluate_ijb

        search = self.target.ijb_mode == "1n"
        result = (evaluate_ijb_search if search else evaluate_ijb)(
            self.target.ijb,
            self.target.ijb_set(),
            checkpoint=self.options.get("checkpoint"),
            backbone=None if self.options.get("checkpoint") else backbone,
            features_path=self.options.get("features_path"),
            image_size=image_size,
            score_weight=bool(self.options.get("score_weight")),
            batch_size=extraction.batch_size,
            flip=extraction.flip,
            device=extraction.device,
            num_workers=extraction.num_workers,
            progress=extraction.progress,
            onnx_input=self.options.get("onnx_input"),
        )
        return result, None, None

    def scalars(self, result: Mapping) -> dict[str, float]:
        if result.get("mode") == "1n":
            values = {f"rank{r}": v for r, v in result["cmc"].items()}
            values |= {f"tpir@fpir={f}": v for f, v in result["tpir_at_fpir"].items()}
        else:
            values = {"auc": result["auc"]}
            values |= {f"tar@far={f}": v for f, v in result["tar_at_far"].items()}
        return {k: float(v) for k, v in values.items() if v is not None}

    @classmethod
    def table(cls, results: Mapping[str, Mapping]) -> str:
        from recognition.evaluation.ijb.report import format_ijb_table, format_search_table

        verification = {n: r for n, r in results.items() if r.get("mode") != "1n"}
        tables = [format_ijb_table(verification)] if verification else []
        tables += [format_search_table(r) for r in results.values() if r.get("mode") == "1n"]
        return "\n\n".join(tables)

    @classmethod
    def roc_title(cls, results: Mapping[str, Mapping]) -> str | None:
        names = [r["name"].upper() for r in results.values() if r.get("mode") != "1n"]
        return f"{', '.join(names)} 1:1 verification" if names else None

    # ------------------------------------------------------------------ the command line

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--ijb",
            type=Path,
            metavar="ROOT",
            help="IJB-B/C templates on ROOT/meta and ROOT/loose_crop (see --ijb-mode)",
        )
        parser.add_argument("--ijb-name", choices=["ijbb", "ijbc"], help="which IJB set ROOT holds")
        parser.add_argument(
            "--ijb-mode",
            choices=["11", "1n"],
            default="11",
            help="11: 1:1 template verification (TAR@FAR); 1n: 1:N identification of the "
            "mixed probes in galleries G1/G2 (S1/S2 for IJB-B): CMC and TPIR@FPIR",
        )
        parser.add_argument(
            "--ijb-score-weight",
            action="store_true",
            help="weigh each image's feature by its detector score before pooling",
        )
        parser.add_argument(
            "--save-features",
            type=Path,
            metavar="F.npz",
            help="with --ijb: the image features are read from F.npz when it exists (no "
            "model runs), else computed and written there; one file serves both --ijb-modes",
        )

    @classmethod
    def targets(cls, args: argparse.Namespace) -> list[EvalTarget]:
        if args.ijb is None:
            return []
        return [EvalTarget(ijb=str(args.ijb), ijb_name=args.ijb_name, ijb_mode=args.ijb_mode)]

    @classmethod
    def options(cls, args: argparse.Namespace) -> dict[str, Any]:
        from recognition.evaluation.protocols import onnx_input

        return {
            "checkpoint": args.checkpoint,
            "features_path": args.save_features,
            "score_weight": args.ijb_score_weight,
            "onnx_input": onnx_input(args),
        }

    @classmethod
    def problems(cls, args: argparse.Namespace) -> list[str]:
        problems = []
        given = [
            flag
            for flag, on in (
                ("--ijb-name", args.ijb_name is not None),
                ("--ijb-mode", args.ijb_mode != "11"),
                ("--ijb-score-weight", args.ijb_score_weight),
                ("--save-features", args.save_features is not None),
            )
            if on
        ]
        if args.ijb is None:
            problems += [f"{flag}: only with --ijb" for flag in given]
            return problems
        if args.ijb_name is None:
            problems.append("--ijb: needs --ijb-name ijbb or ijbc")
        if args.embeddings is not None:
            problems.append("--ijb: takes --checkpoint (or --save-features), not --embeddings")
        if args.checkpoint is None and args.save_features is None:
            problems.append("--ijb: needs --checkpoint (or an existing --save-features file)")
        if args.ijb_mode == "1n" and args.roc is not None and not (args.pairs or args.bin):
            problems.append("--roc: the 1:1 mode's curve; --ijb-mode 1n has none")
        return problems
