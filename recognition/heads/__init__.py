"""Classification heads: margins (ArcFace, CosFace, ...) and the margin-softmax loss."""

from recognition.heads.margin_softmax import ShardedMarginSoftmax, shard_range
from recognition.heads.margins import (
    MARGINS,
    AMSoftmax,
    ArcFace,
    CombinedMargin,
    CosFace,
    Margin,
    SphereFace,
    build_margin,
)

__all__ = [
    "MARGINS",
    "AMSoftmax",
    "ArcFace",
    "CombinedMargin",
    "CosFace",
    "Margin",
    "ShardedMarginSoftmax",
    "SphereFace",
    "build_margin",
    "shard_range",
]
