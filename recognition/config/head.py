"""The `head` section: the margin and its parameters, label smoothing, the triplet loss beside
the margin softmax, Partial FC sampling, logit chunks and the kernel of the head's local
statistics."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from recognition.config.values import ConfigError
from recognition.registry import MARGINS, names

MARGIN_KEYS = ("m", "m1", "m2", "m3", "h", "t_alpha")
"""The head's margin values, each taken by the margins whose `registry.MARGINS` entry lists
it in its `keys`."""


@dataclass
class HeadConfig:
    """The `head` section: the margin, its parameters, and the sharded head's kernels."""

    margin: str = "cosface"
    """One of {margins} (recognition/registry.py, docs/margins.md)."""
    scale: float | None = 30.0
    """Logit scale s; null takes the margin's default."""
    m: float | None = 0.1
    """The margin of arcface / cosface / sphereface / am_softmax / adaface; null takes the
    margin's default. The default run's 0.1 is small: from scratch a larger one learns
    nothing for its first ~1,000 steps, which is its whole budget."""
    m1: float | None = None
    """Combined margin: the multiplicative angle margin m1; only with margin=combined."""
    m2: float | None = None
    """Combined margin: the additive angle margin m2; only with margin=combined."""
    m3: float | None = None
    """Combined margin s*(cos(m1*theta + m2) - m3); only with margin=combined."""
    h: float | None = None
    """AdaFace: how far a norm must lie from the running mean, in running stds (1/h), for the
    full margin; >= 0, null takes 0.333. Only with margin=adaface."""
    t_alpha: float | None = None
    """AdaFace: weight of each batch in the running norm statistics, in [0, 1]; null takes
    0.01. Only with margin=adaface."""
    init: Literal["random", "centroids"] = "random"
    """How the class rows start: random (drawn from the seed, the same on any number of
    ranks), or centroids: each row is the normalised mean of the L2-normalised embeddings of
    its class's training images under the loaded backbone (one pass over the training data
    before step 1, un-augmented, the backbone in eval mode; each rank embeds only the images
    of its own classes). Needs train.init_backbone; a resumed run takes its rows from the
    checkpoint."""
    sample_rate: float = 1.0
    """Fraction of the negative classes each rank samples per step (Partial FC). Where the
    sample (sample_rate x the rank's classes) is at least the global batch, a step reads
    nothing on the host; a smaller one is read every step (its positives are counted)."""
    chunk_size: int | None = None
    """Classes per logit chunk, recomputed in backward (memory O(batch x chunk_size));
    null keeps the logits of the whole shard for backward (faster, memory O(batch x
    classes per rank): fp32 on the torch path; on the Triton path in the matmul dtype, with
    the rows rounded to it once per step). null is never replaced by a size chosen
    automatically: `python train.py --plan` shows what each needs."""
    kernel: Literal["auto", "triton", "torch"] = "auto"
    """The head's local statistics: torch (the reference code), triton (fused kernels, CUDA
    or TRITON_INTERPRET=1) or auto (on CUDA the faster of the two, timed at the first step
    at the run's shapes and cached; torch elsewhere)."""
    tuning_cache: str | None = None
    """Folder of the head's measured choices (auto's kernel, the Triton tiles), a JSON file
    each; null: $XDG_CACHE_HOME/recognition (~/.cache/recognition)."""
    label_smoothing: float = 0.0
    """Label smoothing eps of the margin softmax's cross-entropy, in [0, 1): the target class
    gets 1 - eps + eps/C and every class eps/C, over the margin-modified logits (as
    F.cross_entropy's label_smoothing; 0.1 in the strong re-id baseline). Not with
    head.sample_rate < 1 (partial FC) nor head.fused_update."""
    id_weight: float = 1.0
    """Weight of the margin softmax's loss (the ID loss) in the training loss; 0 trains the
    metric loss alone (the head still runs, for its accuracy)."""
    triplet_weight: float = 0.0
    """Weight of a batch-hard triplet loss added to the ID loss (0: none). Each sample of
    the global batch (every rank's, gathered) is an anchor: its farthest positive against
    its nearest negative, by the Euclidean distance between the backbone's features before
    its BN neck (resnet50_reid: the pooled 2048 features; IResNet: the fc's output; a
    backbone without a neck: its embeddings), while the margin head and evaluation see the
    neck's output. Needs data.sampler=pk."""
    triplet_margin: float | None = 0.3
    """The triplet loss's margin: max(0, d(a, p) - d(a, n) + margin); null: the soft margin
    log(1 + exp(d(a, p) - d(a, n)))."""
    fused_update: bool = False
    """Apply the head's SGD step inside the Triton backward (no weight-sized gradient).
    Needs head.kernel=triton, optim.name=sgd, optim.grad_clip=null, train.accumulate_steps=1
    and precision O0, or O1 with bf16."""

    def __post_init__(self) -> None:
        if self.margin not in MARGINS:
            raise ConfigError(
                f"head.margin: unknown {self.margin!r} (choose from {names(MARGINS)})"
            )
        self._check_margin_keys()
        if self.margin == "adaface":
            self._check_adaface()
        if self.scale is not None and self.scale <= 0:
            raise ConfigError("head.scale: must be positive")
        if not 0.0 < self.sample_rate <= 1.0:
            raise ConfigError(f"head.sample_rate: {self.sample_rate} is outside (0, 1]")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ConfigError("head.chunk_size: must be at least 1 (or null)")
        self._check_losses()

    def _check_losses(self) -> None:
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"head.label_smoothing: {self.label_smoothing} is outside [0, 1)")
        if self.label_smoothing > 0 and self.sample_rate < 1.0:
            raise ConfigError(
                "head.label_smoothing: not with partial FC (head.sample_rate="
                f"{self.sample_rate}), whose softmax runs over classes sampled anew at every "
                "step; set head.sample_rate=1 or head.label_smoothing=0"
            )
        if self.label_smoothing > 0 and self.fused_update:
            raise ConfigError(
                "head.label_smoothing: not with head.fused_update (the smoothing term's "
                "gradient reaches the class rows after the Triton backward has stepped them)"
            )
        for name in ("id_weight", "triplet_weight"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"head.{name}: must be a finite number >= 0, got {value}")
        if self.id_weight == 0 and self.triplet_weight == 0:
            raise ConfigError("head.id_weight and head.triplet_weight are both 0: no loss left")
        if self.triplet_margin is not None and not (
            math.isfinite(self.triplet_margin) and self.triplet_margin >= 0
        ):
            raise ConfigError(
                f"head.triplet_margin: must be >= 0 (or null: the soft margin), got "
                f"{self.triplet_margin}"
            )

    def _check_margin_keys(self) -> None:
        """Refuse a margin value that head.margin does not take (registry.MARGINS' keys)."""
        takes = MARGINS[self.margin].keys
        for key in MARGIN_KEYS:
            value = getattr(self, key)
            if value is None or key in takes:
                continue
            users = [name for name, entry in MARGINS.items() if key in entry.keys]
            own = ", ".join(f"head.{k}" for k in takes) or "no margin value"
            raise ConfigError(
                f"head.{key}: only used with head.margin={' or '.join(users)}; "
                f"head.margin={self.margin} takes {own} (set head.{key}=null)"
            )

    def _check_adaface(self) -> None:
        if self.m is not None and not 0.0 <= self.m < math.pi / 2:
            raise ConfigError(f"head.m: AdaFace's margin must lie in [0, pi/2), got {self.m}")
        if self.h is not None and self.h < 0:
            raise ConfigError(f"head.h: must be >= 0, got {self.h}")
        if self.t_alpha is not None and not 0.0 <= self.t_alpha <= 1.0:
            raise ConfigError(f"head.t_alpha: must lie in [0, 1], got {self.t_alpha}")
