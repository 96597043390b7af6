"""MobileFaceNet (`mbf`, `mbf_large`): arcface_torch's mobile face backbones, in its layout.

The state dict has arcface_torch's keys and shapes (`backbones/mobilefacenet.py` there), so
its `backbone.pth` files load here with `load_state_dict(strict=True)` at `width=1.0`:

    layers.0                   conv 3x3 stride 2 - BN - PReLU (the stem)
    layers.1                   mbf: a grouped 3x3 conv - BN - PReLU; mbf_large: 2 blocks
    layers.2, 4, 6             a block of stride 2 (no shortcut), widening at 4
    layers.3, 5, 7             stride-1 residual blocks (`layers.J.layers.K`)
        block: 1x1 expand - BN - PReLU, depthwise 3x3 - BN - PReLU, 1x1 project - BN
    conv_sep                   1x1 conv to 512 channels - BN - PReLU
    features                   GDC: a depthwise conv over the whole map - BN, flatten,
                               a bias-free Linear to the embedding, BatchNorm1d

Every conv, BN and PReLU sits in a `layers` Sequential (`layers.3.layers.0.layers.1.layers.0`
is the depthwise conv of block 0 of stage 3), as there. The blocks' inner (depthwise) widths
are 128, 256 and 512 whatever the model's scale; the outer widths are 64 and 128 x scale (2
for mbf, 4 for mbf_large).

Input: four stride-2 stages take 112x112 to a 7x7 map, which GDC's 7x7 depthwise conv
reduces to one vector. Here any side that is a multiple of 16 works: the GDC kernel is the
size of the last map (7x7 at 112, as published). `width` scales every channel count.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from recognition.models.batch_norm import BatchNorm1d, BatchNorm2d
from recognition.models.iresnet import four_stage_sides, scaled_channels
from recognition.models.units import UnitChain

# name: (blocks of the four residual stages, scale of the outer widths).
MBF_LAYOUTS: dict[str, tuple[tuple[int, int, int, int], int]] = {
    "mbf": ((1, 4, 6, 2), 2),
    "mbf_large": ((2, 8, 12, 4), 4),
}
STEM_CHANNELS = 64  # x scale
WIDE_CHANNELS = 128  # x scale, from layers.4 on
INNER_CHANNELS = (128, 256, 512)  # the blocks' depthwise widths (fixed by the layout)
STEM_GROUPS = 64  # layers.1's groups when it is a single conv (mbf)
EMBEDDING_CHANNELS = 512  # conv_sep's output, GDC's width


class ConvUnit(nn.Module):
    """conv (no bias) - BatchNorm - PReLU (or no activation: `linear`), in `self.layers`."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel: int | tuple[int, int] = 1,
        stride: int = 1,
        padding: int = 0,
        groups: int = 1,
        *,
        linear: bool = False,
    ) -> None:
        super().__init__()
        parts: list[nn.Module] = [
            nn.Conv2d(
                in_channels, out_channels, kernel, stride, padding, groups=groups, bias=False
            ),
            BatchNorm2d(out_channels),
        ]
        if not linear:
            parts.append(nn.PReLU(out_channels))
        self.layers = nn.Sequential(*parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class DepthwiseBlock(nn.Module):
    """1x1 to `inner` channels, depthwise 3x3 (`stride`), 1x1 to `out_channels` without
    activation; plus the input when `residual` (stride 1, same width)."""

    def __init__(
        self, in_channels: int, out_channels: int, inner: int, stride: int, residual: bool
    ) -> None:
        super().__init__()
        self.residual = residual
        self.layers = nn.Sequential(
            ConvUnit(in_channels, inner),
            ConvUnit(inner, inner, 3, stride, 1, groups=inner),
            ConvUnit(inner, out_channels, linear=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(x)
        return out + x if self.residual else out


class ResidualStage(nn.Module):
    """`num_blocks` residual DepthwiseBlocks of `channels` channels, in `self.layers`."""

    def __init__(self, channels: int, num_blocks: int, inner: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *(DepthwiseBlock(channels, channels, inner, 1, True) for _ in range(num_blocks))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class GDC(nn.Module):
    """Global depthwise conv: a (map-sized) depthwise conv - BN, flatten, Linear, BN1d."""

    def __init__(self, channels: int, map_hw: tuple[int, int], embedding_size: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            ConvUnit(channels, channels, map_hw, groups=channels, linear=True),
            nn.Flatten(),
            nn.Linear(channels, embedding_size, bias=False),
            BatchNorm1d(embedding_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class MobileFaceNet(UnitChain):
    """MobileFaceNet in arcface_torch's layout (see the module docstring).

    Takes images (B, 3, H, W) at `image_size` and returns embeddings (B, embedding_size),
    not L2-normalised. As a `UnitChain` its units are "stem" (layers.0), layers.1 (or its
    blocks), each stride-2 block ("layers.2") and each residual block ("layers.3.layers.0"),
    "conv_sep" and "embedding" (GDC).

    Args:
        blocks: residual blocks of layers.1, 3, 5 and 7 (layers.1 is one plain grouped conv
            when its count is 1).
        scale: multiplies the outer widths (64 and 128).
        embedding_size, dropout (on the flattened GDC output, before the Linear),
        width (multiplies every channel count; 1.0: the published shapes), image_size (a
        side or (H, W), multiples of 16).
    """

    def __init__(
        self,
        blocks: tuple[int, int, int, int],
        scale: int,
        *,
        embedding_size: int = 512,
        width: float = 1.0,
        dropout: float = 0.0,
        image_size: int | tuple[int, int] = 112,
    ) -> None:
        super().__init__()
        sides = four_stage_sides(image_size, "MobileFaceNet")
        if embedding_size < 1:
            raise ValueError(f"embedding_size: must be positive, got {embedding_size}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout: must be in [0, 1), got {dropout}")
        self.embedding_size = embedding_size
        self.image_size: tuple[int, int] = sides
        self.layout = (tuple(blocks), scale)
        self.width = width

        def ch(n: int) -> int:
            return scaled_channels(n, width)

        narrow, wide = ch(STEM_CHANNELS * scale), ch(WIDE_CHANNELS * scale)
        inner = [ch(n) for n in INNER_CHANNELS]
        stem_groups = ch(STEM_GROUPS)
        if blocks[0] == 1 and narrow % stem_groups:
            raise ValueError(
                f"model.width: {width:g} gives layers.1 {narrow} channels in {stem_groups} "
                "groups, which do not divide them; use a width that is a power of two"
            )
        self.layers = nn.ModuleList(
            [
                ConvUnit(3, narrow, 3, 2, 1),
                ConvUnit(narrow, narrow, 3, 1, 1, groups=stem_groups)
                if blocks[0] == 1
                else ResidualStage(narrow, blocks[0], inner[0]),
                DepthwiseBlock(narrow, narrow, inner[0], 2, False),
                ResidualStage(narrow, blocks[1], inner[0]),
                DepthwiseBlock(narrow, wide, inner[1], 2, False),
                ResidualStage(wide, blocks[2], inner[1]),
                DepthwiseBlock(wide, wide, inner[2], 2, False),
                ResidualStage(wide, blocks[3], inner[1]),
            ]
        )
        self.conv_sep = ConvUnit(wide, ch(EMBEDDING_CHANNELS))
        self.dropout = nn.Dropout(p=dropout)
        map_hw = (sides[0] // 16, sides[1] // 16)
        self.features = GDC(ch(EMBEDDING_CHANNELS), map_hw, embedding_size)
        self.unit_names = ("stem", *self._block_units(), "conv_sep", "embedding")
        self._init_weights()

    def _block_units(self) -> list[str]:
        names = []
        for i, layer in enumerate(self.layers):
            if i == 0:
                continue
            if isinstance(layer, ResidualStage):
                names += [f"layers.{i}.layers.{j}" for j in range(len(layer.layers))]
            else:
                names.append(f"layers.{i}")
        return names

    def _init_weights(self) -> None:
        # As arcface_torch draws them: convs and the Linear from Kaiming's normal over the
        # fan-out (ReLU gain), BatchNorms at (1, 0); PReLU keeps its 0.25.
        for module in self.modules():
            if isinstance(module, nn.Conv2d | nn.Linear):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d | nn.BatchNorm1d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def unit_modules(self, unit: str) -> tuple[str, ...]:
        if unit == "stem":
            return ("layers.0",)
        if unit == "embedding":
            return ("dropout", "features")
        return (unit,)

    def forward_unit(self, unit: str, x: torch.Tensor) -> torch.Tensor:
        """One unit: images -> stem map, a block's map -> the next, last map -> embeddings."""
        if unit == "stem":
            if x.shape[-2:] != self.image_size:
                height, width = self.image_size
                raise ValueError(
                    f"MobileFaceNet built for {height}x{width} (HxW) images, "
                    f"got input of shape {tuple(x.shape)}"
                )
            return self.get_submodule("layers.0")(x)
        if unit == "embedding":
            gdc, flatten, linear, norm = self.features.layers
            x = self.dropout(flatten(gdc(x)))  # (B, 512 * width)
            return norm(linear(x))
        return self.get_submodule(unit)(x)


def mobilefacenet(name: str, **kwargs: Any) -> MobileFaceNet:
    """The MobileFaceNet called `name` ("mbf" or "mbf_large", MBF_LAYOUTS), built with
    `MobileFaceNet`'s keyword arguments (embedding_size, width, dropout, image_size)."""
    if name not in MBF_LAYOUTS:
        raise ValueError(f"unknown MobileFaceNet {name!r} (choose from {', '.join(MBF_LAYOUTS)})")
    blocks, scale = MBF_LAYOUTS[name]
    return MobileFaceNet(blocks, scale, **kwargs)


def mbf(**kwargs: Any) -> MobileFaceNet:
    """arcface_torch's `mbf` (`mobilefacenet("mbf", ...)`)."""
    return mobilefacenet("mbf", **kwargs)


def mbf_large(**kwargs: Any) -> MobileFaceNet:
    """arcface_torch's `mbf_large` (`mobilefacenet("mbf_large", ...)`)."""
    return mobilefacenet("mbf_large", **kwargs)
