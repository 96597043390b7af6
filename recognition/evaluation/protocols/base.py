"""`Protocol`: what every evaluation protocol does, for `evaluate.py` and for the evaluation
during training alike (docs/extending.md says how to add one).

A protocol evaluates a backbone on one target (`EvalTarget`: a pairs file, a `.bin`, an IJB
release, a re-id set) and gives a result dict (JSON-able through `to_json_dict`), the
result's scalars under the names `eval.best_metric` takes, and a table of several results.
Its command-line side (its flags, the targets and problems they make) lives beside, so that
a protocol's flags are its own. Nothing here imports torch: `evaluate.py` checks every flag
before it loads a model.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from recognition.config import EvalTarget

if TYPE_CHECKING:
    import numpy as np
    from torch import nn

    from recognition.evaluation.embeddings import Extraction


class Protocol:
    """One evaluation of a backbone on `target`. Subclasses set `kind` (their
    registry.PROTOCOLS key) and override `evaluate` and `scalars`, and `table`; the others
    have working defaults.

    `options` are what the command line adds for the protocol (its `options` classmethod);
    during training there are none.
    """

    kind: ClassVar[str] = ""

    def __init__(self, target: EvalTarget, **options: Any) -> None:
        self.target = target
        self.options = options

    @property
    def name(self) -> str:
        """The target's label: the row of the table, the `<target>` of metric names."""
        return self.target.label

    @property
    def needs_model(self) -> bool:
        """Whether `evaluate` needs the backbone (False: it finds its own, e.g. from cached
        features)."""
        return True

    @property
    def has_roc(self) -> bool:
        """Whether its result holds a ROC (`--roc` draws it)."""
        return False

    def check(self) -> None:
        """Raise FileNotFoundError / ValueError naming the file when the target's inputs are
        missing or malformed: what can be told without torch, before any work."""

    def evaluate(
        self,
        backbone: nn.Module | None,
        image_size: int | tuple[int, int],
        extraction: Extraction,
        *,
        xnorm: bool = False,
    ) -> tuple[dict, np.ndarray | None, list[str] | None]:
        """(result, embeddings (N, D), their paths) of `backbone` (float32, eval mode) on
        the target at `image_size`; embeddings and paths None when there are none to
        export. With `xnorm`, the result also holds the embeddings' mean norm, if the
        protocol measures it."""
        raise NotImplementedError

    def from_embeddings(self, embeddings: np.ndarray, paths: list[str]) -> dict:
        """The result from stored embeddings and their paths (evaluate.py --embeddings)."""
        raise ValueError(f"--embeddings: a {self.kind} target needs a model (--checkpoint)")

    def scalars(self, result: Mapping) -> dict[str, float]:
        """{metric: value} of `result` as `eval.best_metric` names them (`accuracy`,
        `tar@far=1e-3`, ...); the unmeasurable left out."""
        raise NotImplementedError

    @classmethod
    def table(cls, results: Mapping[str, Mapping]) -> str:
        """The console table of {target name: result} of this protocol."""
        raise NotImplementedError

    @classmethod
    def roc_title(cls, results: Mapping[str, Mapping]) -> str | None:
        """The title of the ROC plot of these results; None: they have no ROC."""
        return None

    # ------------------------------------------------------------------ the command line

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add the protocol's own flags to evaluate.py's `parser`."""

    @classmethod
    def targets(cls, args: argparse.Namespace) -> list[EvalTarget]:
        """The targets of this kind that evaluate.py's flags name, in order."""
        return []

    @classmethod
    def options(cls, args: argparse.Namespace) -> dict[str, Any]:
        """The keyword options evaluate.py's flags give each target's protocol."""
        return {}

    @classmethod
    def problems(cls, args: argparse.Namespace) -> list[str]:
        """What is wrong with the protocol's flags, a line each (all at once), before work."""
        return []


def path_problem(path: Path | None, flag: str) -> str | None:
    """Why the output `path` of `flag` cannot be written (a folder), or None."""
    if path is not None and path.is_dir():
        return f"{flag}: {path} is a folder"
    return None
