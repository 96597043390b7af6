"""What both IJB modes start from: a release's templates, from its meta files to unit features.

:func:`release_templates` reads the 1:1 meta files (:mod:`recognition.evaluation.ijb.protocol`),
makes or reads the image features (:mod:`recognition.evaluation.ijb.features`) and pools them
(:mod:`recognition.evaluation.ijb.templates`); :class:`IJBOptions` holds the keywords that
the 1:1 and the 1:N entries share.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from recognition.evaluation.embeddings import Extraction
from recognition.evaluation.ijb.features import cached_features, protocol_features
from recognition.evaluation.ijb.protocol import IJBProtocol, load_protocol
from recognition.evaluation.ijb.templates import template_features
from recognition.evaluation.onnx_model import OnnxInput


def default_threads() -> int:
    """The CPUs this process may use (the scoring's default thread count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class IJBOptions:
    """The keywords of :func:`~recognition.evaluation.ijb.verification.evaluate_ijb` and
    :func:`~recognition.evaluation.ijb.search.evaluate_ijb_search`.

    With ``features_path`` naming an existing file the image features come from it (no
    model runs; it must have been made with the same release, flip and, when given, the same
    checkpoint weights and input size); otherwise the backbone of ``checkpoint`` (or
    ``backbone``, a float32 module in eval mode: the evaluation during training) embeds every
    image (at ``image_size``, default the checkpoint's) and, with ``features_path``, they are
    saved there. ``score_weight`` weighs each image's feature by its detector score before
    pooling; ``onnx_input`` how an ONNX ``checkpoint`` wants its images (None: as training
    normalises them); ``batch_size``, ``flip``, ``device``, ``num_workers`` and ``progress`` are the
    extraction's (:class:`~recognition.evaluation.embeddings.Extraction`); ``num_threads``
    the scoring's (default: :func:`default_threads`).
    """

    checkpoint: str | os.PathLike | None = None
    backbone: nn.Module | None = None
    features_path: str | os.PathLike | None = None
    image_size: int | Sequence[int] | None = None
    score_weight: bool = False
    batch_size: int = 128
    flip: bool = True
    device: torch.device | None = None
    num_workers: int = 0
    progress: bool = True
    num_threads: int | None = None
    onnx_input: OnnxInput | None = None

    def extraction(self) -> Extraction:
        return Extraction(self.batch_size, self.flip, self.device, self.num_workers, self.progress)


@dataclass(frozen=True)
class ReleaseTemplates:
    """A release's pooled templates: its ``protocol``, the images' ``readable`` mask (I,),
    ``template_ids`` (T,) sorted, their ``unit`` features (T, D) (zero rows for templates
    without a feature) and ``has_feature`` (T,)."""

    protocol: IJBProtocol
    readable: np.ndarray
    template_ids: np.ndarray
    unit: np.ndarray
    has_feature: np.ndarray

    def rows(self, templates: np.ndarray) -> np.ndarray:
        """The rows of ``unit`` that hold the template ids ``templates`` (any shape)."""
        return np.searchsorted(self.template_ids, templates)


def release_templates(
    root: str | os.PathLike,
    name: str,
    options: IJBOptions,
    *,
    pairs: bool = True,
    more_templates: np.ndarray | None = None,
) -> ReleaseTemplates:
    """The templates of release ``name`` under ``root``, pooled from its image features.

    The meta files are read and checked first (the images too, unless the features come from
    a file); without ``pairs`` the pairs file is not read. ``more_templates`` (the 1:N lists'
    template ids) get a row too, a zero one when face_tid_mid lists none of their images.
    """
    check_images = not cached_features(options.features_path)
    protocol = load_protocol(root, name, check_images=check_images, pairs=pairs)
    features, readable = protocol_features(
        protocol,
        checkpoint=options.checkpoint,
        backbone=options.backbone,
        features_path=options.features_path,
        image_size=options.image_size,
        extraction=options.extraction(),
        onnx_input=options.onnx_input,
    )
    template_ids, unit = template_features(
        features, readable, protocol, options.score_weight, more_templates=more_templates
    )
    has_feature = np.linalg.norm(unit, axis=1) > 0
    return ReleaseTemplates(protocol, readable, template_ids, unit, has_feature)
