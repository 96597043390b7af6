"""IResNet backbones for aligned faces (ArcFace's "improved" ResNet, 18 to 200 layers).

The layout follows the published arcface_torch models so that their state dicts load here
with `load_state_dict(strict=True)` at `width=1.0`:

    conv1 - bn1 - prelu                      stem, stride 1 (faces are small: 112x112)
    layer1..layer4                           64, 128, 256, 512 channels, each stride 2
        block: bn1 - conv1 - bn2 - prelu - conv2(stride) - bn3, + downsample(x)
    bn2 - flatten - dropout - fc - features  features: BatchNorm1d, scale frozen at 1

The spatial map after layer4 is (H / 16, W / 16) of the input (7x7 for 112x112), and it is
flattened into the fc rather than pooled: the position of a feature on an aligned face
carries identity information that global pooling would throw away.

`features` is a BN neck in the re-id sense: with `neck_features` set (training does when
head.triplet_weight > 0) forward returns, in training mode, (the fc's output, embeddings),
the triplet loss's features and the margin head's.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from recognition.config import image_size_pair
from recognition.models.batch_norm import BatchNorm1d, BatchNorm2d
from recognition.models.units import UnitChain

# Every BatchNorm of the published models uses PyTorch's default epsilon.
BN_EPS = 1e-5

# The four stages' channel counts at width 1 and their number of blocks per depth.
STAGE_CHANNELS = (64, 128, 256, 512)
STEM_CHANNELS = 64
IRESNET_LAYERS: dict[str, tuple[int, int, int, int]] = {
    "iresnet18": (2, 2, 2, 2),
    "iresnet34": (3, 4, 6, 3),
    "iresnet50": (3, 4, 14, 3),
    "iresnet100": (3, 13, 30, 3),
    "iresnet200": (6, 26, 60, 6),
}


def scaled_channels(channels: int, width: float) -> int:
    """Channel count `channels * width`, rounded, and never below one."""
    return max(1, round(channels * width))


def four_stage_sides(image_size: int | tuple[int, int], family: str) -> tuple[int, int]:
    """(H, W) of `image_size` for a backbone of four stride-2 stages (`family` names it in the
    error): each side a positive multiple of 16."""
    try:
        sides = image_size_pair(image_size)
    except ValueError:
        sides = (0, 0)
    if any(s < 16 or s % 16 for s in sides):
        raise ValueError(
            f"image_size: {family} needs a side or (H, W) that are multiples of 16 (four "
            f"stride-2 stages), got {image_size}; 112 is the usual face crop"
        )
    return sides


def conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> nn.Conv2d:
    """A 3x3 convolution with padding 1 and no bias (a BatchNorm always follows)."""
    return nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)


class IBasicBlock(nn.Module):
    """Pre-activation-style residual block of IResNet.

    Takes (B, in_channels, H, W) and returns (B, out_channels, H / stride, W / stride).
    Unlike torchvision's BasicBlock the stride sits in the *second* conv, there is a
    BatchNorm in front of the first conv, PReLU replaces ReLU, and nothing follows the sum.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.bn1 = BatchNorm2d(in_channels, eps=BN_EPS)
        self.conv1 = conv3x3(in_channels, out_channels)
        self.bn2 = BatchNorm2d(out_channels, eps=BN_EPS)
        self.prelu = nn.PReLU(out_channels)
        self.conv2 = conv3x3(out_channels, out_channels, stride)
        self.bn3 = BatchNorm2d(out_channels, eps=BN_EPS)
        # The shortcut needs a projection only where the shape changes; its two children
        # are named downsample.0 / downsample.1 as in the published checkpoints.
        self.downsample: nn.Sequential | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                BatchNorm2d(out_channels, eps=BN_EPS),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn3(self.conv2(self.prelu(self.bn2(self.conv1(self.bn1(x))))))
        identity = x if self.downsample is None else self.downsample(x)
        return out + identity


class IResNet(UnitChain):
    """IResNet trunk plus the flatten-fc-BN embedding layer.

    Takes images (B, 3, H, W) at `image_size`, normalised, and returns embeddings
    (B, embedding_size), not L2-normalised (the margin head normalises). As a `UnitChain`
    its units are "stem", every block ("layer1.0" ... "layer4.2") and "embedding".

    Args:
        layers: number of blocks in each of the four stages, e.g. (3, 4, 14, 3).
        embedding_size: output dimension D.
        width: multiplies every channel count; 1.0 gives the published shapes, small
            values (0.125, 0.25) give models that train on a CPU.
        dropout: dropout probability on the flattened map before the fc.
        image_size: side of a square input or its (H, W); each a multiple of 16 (four
            stride-2 stages). The fc's input size depends on it.
        zero_init_residual: start every block's residual branch at zero (its last
            BatchNorm's scale is set to 0), so each block begins as the identity.
    """

    def __init__(
        self,
        layers: tuple[int, int, int, int] | list[int],
        *,
        embedding_size: int = 512,
        width: float = 1.0,
        dropout: float = 0.0,
        image_size: int | tuple[int, int] = 112,
        zero_init_residual: bool = False,
    ) -> None:
        super().__init__()
        if len(layers) != 4 or any(int(n) < 1 for n in layers):
            raise ValueError(f"layers: need four positive block counts, got {list(layers)}")
        if embedding_size < 1:
            raise ValueError(f"embedding_size: must be positive, got {embedding_size}")
        if not width > 0:
            raise ValueError(f"width: must be positive, got {width}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout: must be in [0, 1), got {dropout}")
        sides = four_stage_sides(image_size, "IResNet")
        self.embedding_size = embedding_size
        self.image_size: tuple[int, int] = (sides[0], sides[1])
        # Training mode returns (fc output, embeddings) when set (the triplet loss's).
        self.neck_features = False

        stem_channels = scaled_channels(STEM_CHANNELS, width)
        self.conv1 = conv3x3(3, stem_channels)
        self.bn1 = BatchNorm2d(stem_channels, eps=BN_EPS)
        self.prelu = nn.PReLU(stem_channels)

        in_channels = stem_channels
        stages = []
        for num_blocks, channels in zip(layers, STAGE_CHANNELS, strict=True):
            out_channels = scaled_channels(channels, width)
            blocks = [IBasicBlock(in_channels, out_channels, stride=2)]
            blocks += [IBasicBlock(out_channels, out_channels) for _ in range(int(num_blocks) - 1)]
            stages.append(nn.Sequential(*blocks))
            in_channels = out_channels
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.unit_names = (
            "stem",
            *(f"layer{i}.{j}" for i, stage in enumerate(stages, 1) for j in range(len(stage))),
            "embedding",
        )

        map_height, map_width = sides[0] // 16, sides[1] // 16
        self.bn2 = BatchNorm2d(in_channels, eps=BN_EPS)
        self.dropout = nn.Dropout(p=dropout)
        self.fc = nn.Linear(in_channels * map_height * map_width, embedding_size)
        self.features = BatchNorm1d(embedding_size, eps=BN_EPS)

        self._init_weights(zero_init_residual)

    def _init_weights(self, zero_init_residual: bool) -> None:
        # The published models draw every conv from N(0, 0.1) and start BatchNorms at
        # (1, 0); the fc and PReLU (0.25) keep PyTorch's defaults. We do the same so
        # that training from scratch behaves like the reference runs.
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.normal_(module.weight, 0.0, 0.1)
            elif isinstance(module, (nn.BatchNorm2d, nn.BatchNorm1d)):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        # The feature BN's scale is fixed at 1 and never trained: only its shift and
        # running statistics move. It stays a Parameter (requires_grad=False) so that the
        # published state dicts, which hold `features.weight`, load strictly.
        self.features.weight.requires_grad_(False)
        if zero_init_residual:
            # bn3 is the last op of the residual branch, so a zero scale there makes
            # the block start as identity (+ projection).
            for module in self.modules():
                if isinstance(module, IBasicBlock):
                    nn.init.zeros_(module.bn3.weight)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) -> the last stage's map (B, C, H / 16, W / 16)."""
        x = self.prelu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return x

    def unit_modules(self, unit: str) -> tuple[str, ...]:
        if unit == "stem":
            return ("conv1", "bn1", "prelu")
        if unit == "embedding":
            return ("bn2", "dropout", "fc", "features")
        return (unit,)

    def forward_unit(
        self, unit: str, x: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One unit: images -> stem map, a block's map -> the next, last map -> embeddings
        (or, training with `neck_features`, (fc output, embeddings))."""
        if unit == "stem":
            if x.shape[-2:] != self.image_size:
                height, width = self.image_size
                raise ValueError(
                    f"IResNet built for {height}x{width} (HxW) images, "
                    f"got input of shape {tuple(x.shape)}"
                )
            return self.prelu(self.bn1(self.conv1(x)))
        if unit == "embedding":
            x = self.dropout(torch.flatten(self.bn2(x), 1))  # (B, C * H/16 * W/16)
            x = self.fc(x)
            if self.neck_features and self.training:
                return x, self.features(x)
            return self.features(x)
        return self.get_submodule(unit)(x)


def iresnet(name: str, **kwargs: Any) -> IResNet:
    """The IResNet called `name` (a key of IRESNET_LAYERS: "iresnet50" has 3, 4, 14, 3
    blocks per stage), built with `IResNet`'s keyword arguments (embedding_size, width,
    dropout, image_size, zero_init_residual)."""
    if name not in IRESNET_LAYERS:
        raise ValueError(f"unknown IResNet {name!r} (choose from {', '.join(IRESNET_LAYERS)})")
    return IResNet(IRESNET_LAYERS[name], **kwargs)


# iresnet18(...) ... iresnet200(...): the table's depths by name.
iresnet18 = partial(iresnet, "iresnet18")
iresnet34 = partial(iresnet, "iresnet34")
iresnet50 = partial(iresnet, "iresnet50")
iresnet100 = partial(iresnet, "iresnet100")
iresnet200 = partial(iresnet, "iresnet200")
