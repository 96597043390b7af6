"""The `model` section: the backbone, its embedding and its optional pipeline stages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from recognition.config.values import ConfigError
from recognition.registry import BACKBONES, names

# The ViTs (model.backbone=vit_*) are not cut into pipeline stages: which tokens a training
# step leaves out is drawn before the first block and needed after the last.
UNCUT_BACKBONE_PREFIX = "vit_"


@dataclass
class ModelConfig:
    """The `model` section: the backbone, its embedding and its optional pipeline stages."""

    backbone: str = "iresnet18"
    """One of {backbones}: a face backbone in arcface_torch's layout (IResNet, MobileFaceNet,
    ViT; docs/backbones.md) or resnet50_reid (torchvision's ResNet-50 for person re-id);
    recognition/registry.py lists them."""
    embedding_size: int = 128
    """Dimension of the embedding (the features the head and the evaluation see)."""
    width: float = 0.125
    """Channel multiplier of the backbone (1.0 = the published architecture; the default
    run's 1/8 trains on a CPU in minutes). resnet50_reid has fixed widths: 1.0 only."""
    dropout: float = 0.0
    """Dropout probability on the last feature map before the embedding layer."""
    sync_bn: bool = False
    """With several processes, turn every BatchNorm into a SyncBatchNorm: batch statistics
    over the global batch instead of each rank's (with pipeline stages: over the
    data-parallel ranks of a stage, per micro-batch). Needs GPUs (torch's SyncBatchNorm
    does not run on CPU)."""
    freeze_bn: bool = False
    """Freeze every BatchNorm of the backbone: its running statistics stay as loaded (the
    layers run in eval mode even while the model trains) and its affine weights and biases
    get no gradient and no optimizer state. For fine-tuning a loaded backbone
    (train.init_backbone) on batches too small or too unlike its training data for good batch
    statistics. Not with model.pipeline_stages > 1."""
    pipeline_stages: int = 1
    """Cut the backbone into this many stages, one per rank, run as a pipeline over
    micro-batches (torch.distributed.pipelining); the world size must be a multiple of it
    (world / stages data-parallel replicas). 1: no pipeline."""
    micro_batch_size: int | None = None
    """Samples per pipeline micro-batch; must divide train.batch_size. null: the batch in
    2 x pipeline_stages micro-batches."""
    pipeline_schedule: Literal["gpipe", "1f1b"] = "1f1b"
    """gpipe: every micro-batch's forward, then every backward (activations of all
    micro-batches held); 1f1b: one forward, one backward in turn after a warm-up
    (activations of at most pipeline_stages micro-batches; needs as many micro-batches)."""
    pipeline_split: list[str] | None = None
    """The units where stages 2..P begin (P - 1 names such as layer3.0; the units are
    "stem", each block "layerI.J" and "embedding"); null: cut where the forward FLOPs of
    the stages are closest to equal."""

    def __post_init__(self) -> None:
        if self.backbone not in BACKBONES:
            raise ConfigError(
                f"model.backbone: unknown {self.backbone!r} (choose from {names(BACKBONES)})"
            )
        if self.embedding_size < 1:
            raise ConfigError("model.embedding_size: must be at least 1")
        if self.pipeline_stages < 1:
            raise ConfigError("model.pipeline_stages: must be at least 1")
        if self.pipeline_stages > 1 and self.backbone.startswith(UNCUT_BACKBONE_PREFIX):
            raise ConfigError(
                f"model.pipeline_stages={self.pipeline_stages}: a ViT ({self.backbone}) is not "
                "cut into stages (the tokens a step masks are drawn before its first block and "
                "restored after its last); train it with model.pipeline_stages=1"
            )
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ConfigError("model.micro_batch_size: must be at least 1 (or null)")
        if self.pipeline_split is not None and len(self.pipeline_split) != self.pipeline_stages - 1:
            raise ConfigError(
                f"model.pipeline_split: {len(self.pipeline_split)} names for "
                f"{self.pipeline_stages} stages (model.pipeline_stages); give one per stage "
                "after the first, or null"
            )
        if not 0.0 < self.width <= 4.0:
            raise ConfigError(f"model.width: {self.width} is outside (0, 4]")
        if "width" in BACKBONES[self.backbone].keys and self.width != 1.0:
            raise ConfigError(
                f"model.width: {self.backbone} has fixed widths and takes model.width=1.0 only, "
                f"got {self.width:g} (the default 0.125 is the built-in IResNet-18's)"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout: {self.dropout} is outside [0, 1)")
