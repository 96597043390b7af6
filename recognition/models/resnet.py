"""ResNet-50 backbone for person re-identification ("bag of tricks" baseline).

torchvision's ResNet-50 trunk with three changes that the strong re-id baseline of Luo et
al. (2019) found to matter:

- last stride 1: layer4 keeps the resolution of layer3, so a 256x128 crop ends in a 16x8
  map instead of 8x4 — more spatial detail for almost no extra parameters;
- global average pooling to a 2048-d vector;
- a BN neck (BNNeck): BatchNorm1d on the pooled vector, whose shift (bias) is frozen at
  zero. The metric loss (the triplet loss, head.triplet_weight) sees the features before the
  BN, the classifier (the margin head, whose normalised class rows have no bias) the ones
  after it, which are also the embeddings evaluation ranks by. With `neck_features` set
  (training does when head.triplet_weight > 0) forward returns both in training mode:
  (pooled features (B, 2048), embeddings (B, D)); in eval mode the embeddings alone.

An optional Linear maps the BN output to `embedding_size` when that differs from 2048.
No weights are downloaded: `pretrained_path` may point to a local torchvision state dict.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torchvision.models import resnet50

from recognition.config import image_size_pair
from recognition.models.units import UnitChain

TRUNK_CHANNELS = 2048
# Where ReIDResNet50 keeps the torchvision trunk: its state-dict keys are "base." + the
# torchvision key.
TRUNK_PREFIX = "base."
# The usual re-id input (H, W): person boxes keep their 2:1 aspect ratio.
REID_IMAGE_SIZE = (256, 128)


class ReIDResNet50(UnitChain):
    """ResNet-50 with last stride 1, global average pooling and a BN neck.

    Takes images (B, 3, H, W) of any size (256x128 is usual) and returns embeddings
    (B, embedding_size), not L2-normalised. As a `UnitChain` its units are "stem", every
    bottleneck ("layer1.0" ... "layer4.2", under `base`) and "embedding" (pool, neck, fc).

    Args:
        embedding_size: output dimension; 2048 returns the BN-neck features directly,
            any other value adds a Linear(2048 -> embedding_size) after the neck.
        dropout: dropout probability on the BN-neck features (0 in the baseline).
        pretrained_path: optional local file with a torchvision ResNet-50 state dict
            (e.g. the ImageNet weights); its `fc.*` entries are ignored.
    """

    def __init__(
        self,
        *,
        embedding_size: int = TRUNK_CHANNELS,
        dropout: float = 0.0,
        pretrained_path: str | None = None,
    ) -> None:
        super().__init__()
        if embedding_size < 1:
            raise ValueError(f"embedding_size: must be positive, got {embedding_size}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout: must be in [0, 1), got {dropout}")
        self.embedding_size = embedding_size
        # Training mode returns (pooled features, embeddings) when set (the triplet loss's).
        self.neck_features = False

        self.base = resnet50(weights=None)
        # torchvision's classifier is replaced by the BN neck below.
        self.base.fc = nn.Identity()
        if pretrained_path is not None:
            load_torchvision_weights(self.base, pretrained_path)
        # Last stride 1: torchvision ("v1.5") puts layer4's stride in the first block's 3x3
        # conv and in its shortcut projection; both must change or the shapes disagree.
        first_block = self.base.layer4[0]
        first_block.conv2.stride = (1, 1)
        first_block.downsample[0].stride = (1, 1)

        self.bnneck = nn.BatchNorm1d(TRUNK_CHANNELS)
        nn.init.ones_(self.bnneck.weight)
        nn.init.zeros_(self.bnneck.bias)
        # A frozen zero shift keeps the normalised features centred on the origin, which
        # is what a cosine / softmax classifier on top of them wants.
        self.bnneck.bias.requires_grad_(False)
        self.dropout = nn.Dropout(p=dropout)
        self.fc: nn.Linear | None = None
        if embedding_size != TRUNK_CHANNELS:
            self.fc = nn.Linear(TRUNK_CHANNELS, embedding_size)
        self.unit_names = (
            "stem",
            *(
                f"layer{i}.{j}"
                for i in range(1, 5)
                for j in range(len(getattr(self.base, f"layer{i}")))
            ),
            "embedding",
        )

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) -> layer4's map (B, 2048, ceil(H / 16), ceil(W / 16))."""
        base = self.base
        x = base.maxpool(base.relu(base.bn1(base.conv1(x))))
        return base.layer4(base.layer3(base.layer2(base.layer1(x))))

    def unit_modules(self, unit: str) -> tuple[str, ...]:
        if unit == "stem":
            return ("base.conv1", "base.bn1", "base.relu", "base.maxpool")
        if unit == "embedding":
            return ("bnneck", "dropout") + (("fc",) if self.fc is not None else ())
        return (f"base.{unit}",)

    def forward_unit(
        self, unit: str, x: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One unit: images -> stem map, a bottleneck's map -> the next, map -> embeddings
        (or, training with `neck_features`, (pooled features, embeddings))."""
        if unit == "stem":
            base = self.base
            return base.maxpool(base.relu(base.bn1(base.conv1(x))))
        if unit == "embedding":
            pooled = x.mean(dim=(2, 3))  # (B, 2048)
            x = self.dropout(self.bnneck(pooled))
            embeddings = x if self.fc is None else self.fc(x)
            if self.neck_features and self.training:
                return pooled, embeddings
            return embeddings
        return self.base.get_submodule(unit)(x)


def load_torchvision_weights(model: nn.Module, path: str) -> None:
    """Load a torchvision ResNet-50 state dict from `path` into `model` (its fc excluded).

    Raises FileNotFoundError if the file does not exist and ValueError, naming the file
    and the offending keys, if the state dict does not fit a ResNet-50 trunk.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model.pretrained_path: no such file: {path}")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise ValueError(f"{path}: expected a state dict, got {type(state).__name__}")
    state = torchvision_trunk(state)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as error:
        raise ValueError(f"{path}: not a torchvision ResNet-50 state dict: {error}") from error


def torchvision_trunk(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of a torchvision ResNet-50 state dict that the re-id trunk takes: all but
    the ImageNet classifier's `fc.*` (the BN neck and its optional fc replace it)."""
    return {k: v for k, v in state.items() if not k.startswith("fc.")}


def resnet50_reid(
    *,
    embedding_size: int = TRUNK_CHANNELS,
    width: float = 1.0,
    dropout: float = 0.0,
    image_size: int | tuple[int, int] = REID_IMAGE_SIZE,
    pretrained_path: str | None = None,
) -> ReIDResNet50:
    """Build `ReIDResNet50` with the common backbone signature.

    `width` must be 1 (the torchvision trunk has fixed widths). `image_size` is only
    validated: global pooling makes the model accept any input size.
    """
    if width != 1.0:
        raise ValueError(f"model.width: resnet50_reid supports only width 1.0, got {width}")
    try:
        image_size_pair(image_size)
    except ValueError:
        raise ValueError(f"image_size: must be positive, got {image_size}") from None
    return ReIDResNet50(
        embedding_size=embedding_size, dropout=dropout, pretrained_path=pretrained_path
    )
