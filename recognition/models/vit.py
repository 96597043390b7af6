"""Vision transformers (`vit_t` ... `vit_h`): arcface_torch's face ViTs, in its layout.

The state dict has arcface_torch's keys and shapes (`backbones/vit.py` there), so its
`backbone.pth` files load here with `load_state_dict(strict=True)` at `width=1.0`:

    pos_embed (1, N, D), mask_token (1, 1, D)
    patch_embed.proj         conv 9x9 stride 9 with bias: 112x112 -> 12 x 12 = N = 144 tokens
    blocks.I                 pre-norm transformer block, 8 heads:
        norm1 - attn.qkv (no bias) - attention - attn.proj, + x
        norm2 - mlp.fc1 (4 D) - ReLU6 - mlp.fc2, + x
    norm                     LayerNorm
    feature.0 - 3            flatten the N tokens, Linear(N D -> D, no bias), BatchNorm1d
                             (eps 2e-5), Linear(D -> embedding, no bias), BatchNorm1d (2e-5)

There is no class token: every token's output goes into the embedding, in order, as an
IResNet's flattened map does. Training adds two regularisers arcface_torch uses: stochastic
depth (each block's residual branches dropped per sample, rates rising linearly from 0 at
the first block to `drop_path_rate` at the last), and token masking (a random `mask_ratio`
of the tokens is left out of the blocks, and `mask_token` stands in for them after the final
norm). Sizes and settings by name are get_model's (`VIT_SIZES`); vit_b, vit_l and vit_h
recompute each block's activations in backward (activation checkpointing), as there.

`width` scales D (a multiple of the 8 heads); any input of at least 9 pixels a side
works (N = (H // 9) x (W // 9), the rest of the image cut off as there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torchvision.ops import StochasticDepth

from recognition.config import image_size_pair

PATCH_SIZE = 9
NUM_HEADS = 8
MLP_RATIO = 4
FEATURE_BN_EPS = 2e-5


@dataclass(frozen=True)
class ViTSize:
    """One named size: its width D, depth, and training settings."""

    embed_dim: int
    depth: int
    drop_path_rate: float
    mask_ratio: float
    checkpointing: bool
    """Recompute each block's activations in backward instead of keeping them."""


# As arcface_torch's get_model builds them (its vit_l is the WebFace42M entry
# "vit_l_dp005_mask_005"; plain vit_t, vit_s, vit_b and vit_h are its own names).
VIT_SIZES: dict[str, ViTSize] = {
    "vit_t": ViTSize(256, 12, 0.1, 0.1, False),
    "vit_s": ViTSize(512, 12, 0.1, 0.1, False),
    "vit_b": ViTSize(512, 24, 0.1, 0.1, True),
    "vit_l": ViTSize(768, 24, 0.05, 0.05, True),
    "vit_h": ViTSize(1024, 48, 0.1, 0.0, True),
}


class PatchEmbed(nn.Module):
    """Non-overlapping 9x9 patches -> tokens (B, N, D) by a strided conv."""

    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, embed_dim, PATCH_SIZE, stride=PATCH_SIZE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    """Multi-head self-attention over (B, N, D) tokens; q, k, v from one bias-free Linear."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        # (3, B, heads, N, D / heads)
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, dim // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        # softmax(q k^T / sqrt(D / heads)) v; torch picks the fused kernel the device has.
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, dim))


class Mlp(nn.Module):
    """Linear - ReLU6 - Linear."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.ReLU6()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then + mlp(norm2(.)); each branch
    dropped per sample with probability `drop_path` in training."""

    def __init__(self, dim: int, num_heads: int, drop_path: float) -> None:
        super().__init__()
        # In arcface_torch's order (the state dict's key order follows it).
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads)
        self.drop_path = StochasticDepth(drop_path, "row") if drop_path > 0 else nn.Identity()
        self.mlp = Mlp(dim, MLP_RATIO * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class VisionTransformer(nn.Module):
    """A face ViT in arcface_torch's layout (see the module docstring).

    Takes images (B, 3, H, W) at `image_size` and returns embeddings (B, embedding_size),
    not L2-normalised.

    Args:
        size: width, depth and training settings (a `VIT_SIZES` entry).
        embedding_size, dropout (on the flattened tokens, before feature.0), width
        (multiplies D; 1.0: the published shapes), image_size (a side or (H, W), >= 9).
    """

    def __init__(
        self,
        size: ViTSize,
        *,
        embedding_size: int = 512,
        width: float = 1.0,
        dropout: float = 0.0,
        image_size: int | tuple[int, int] = 112,
    ) -> None:
        super().__init__()
        sides = _checked_sides(image_size)
        dim = round(size.embed_dim * width)
        if dim < NUM_HEADS or dim % NUM_HEADS:
            raise ValueError(
                f"model.width: {width:g} gives a ViT width of {dim}, not a positive multiple "
                f"of its {NUM_HEADS} heads"
            )
        if embedding_size < 1:
            raise ValueError(f"embedding_size: must be positive, got {embedding_size}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout: must be in [0, 1), got {dropout}")
        self.embedding_size = embedding_size
        self.image_size: tuple[int, int] = sides
        self.embed_dim = dim
        self.size = size
        self.width = width
        self.mask_ratio = size.mask_ratio
        self.checkpointing = size.checkpointing
        self.num_patches = (sides[0] // PATCH_SIZE) * (sides[1] // PATCH_SIZE)

        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_patches, dim))
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.patch_embed = PatchEmbed(dim)
        # Linear from 0 to drop_path_rate (in Python: no tensor, so that meta and fake
        # devices build it too).
        last = max(size.depth - 1, 1)
        rates = [size.drop_path_rate * i / last for i in range(size.depth)]
        self.blocks = nn.ModuleList(Block(dim, NUM_HEADS, rate) for rate in rates)
        self.norm = nn.LayerNorm(dim)
        self.dropout = nn.Dropout(p=dropout)
        self.feature = nn.Sequential(
            nn.Linear(dim * self.num_patches, dim, bias=False),
            nn.BatchNorm1d(dim, eps=FEATURE_BN_EPS),
            nn.Linear(dim, embedding_size, bias=False),
            nn.BatchNorm1d(embedding_size, eps=FEATURE_BN_EPS),
        )
        self._init_weights()
        # Without masking the token is never used: no gradient, no optimizer state, and
        # nothing for DDP to wait for (it stays in the state dict, as in the layout).
        self.mask_token.requires_grad_(self.mask_ratio > 0)

    def _init_weights(self) -> None:
        # As arcface_torch draws them: Linear weights and the position embedding from a
        # normal of std 0.02 (truncated there at +-2: 100 standard deviations, so a plain
        # normal here, which fake tensors can draw too), biases 0, LayerNorms (1, 0), the
        # mask token N(0, 0.02); the patch conv keeps PyTorch's default.
        nn.init.normal_(self.mask_token, std=0.02)
        nn.init.normal_(self.pos_embed, std=0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2:] != self.image_size:
            height, width = self.image_size
            raise ValueError(
                f"VisionTransformer built for {height}x{width} (HxW) images, "
                f"got input of shape {tuple(x.shape)}"
            )
        tokens = self.patch_embed(x) + self.pos_embed  # (B, N, D)
        restore = None
        if self.training and self.mask_ratio > 0:
            tokens, restore = _keep_random_tokens(tokens, self.mask_ratio)
        for block in self.blocks:
            if self.checkpointing and self.training and torch.is_grad_enabled():
                tokens = checkpoint(block, tokens, use_reentrant=False)
            else:
                tokens = block(tokens)
        tokens = self.norm(tokens)
        if restore is not None:
            # The left-out tokens come back as mask_token, each at its own place.
            missing = restore.shape[1] - tokens.shape[1]
            filler = self.mask_token.to(tokens.dtype).expand(tokens.shape[0], missing, -1)
            tokens = torch.cat([tokens, filler], dim=1)
            index = restore.unsqueeze(-1).expand(-1, -1, tokens.shape[2])
            tokens = torch.gather(tokens, 1, index)
        flat = self.dropout(tokens.reshape(tokens.shape[0], -1))  # (B, N * D)
        return self.feature(flat)


def _keep_random_tokens(
    tokens: torch.Tensor, mask_ratio: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random int(N (1 - mask_ratio)) of each sample's tokens, (B, N_kept, D), and for
    every position of the whole sequence where its token went in [kept, left out] (B, N)."""
    batch, num_tokens, dim = tokens.shape
    keep = int(num_tokens * (1 - mask_ratio))
    noise = torch.rand(batch, num_tokens, device=tokens.device)
    order = torch.argsort(noise, dim=1)  # the kept tokens first
    restore = torch.argsort(order, dim=1)
    kept = torch.gather(tokens, 1, order[:, :keep].unsqueeze(-1).expand(-1, -1, dim))
    return kept, restore


def _checked_sides(image_size: int | tuple[int, int]) -> tuple[int, int]:
    try:
        sides = image_size_pair(image_size)
    except ValueError:
        sides = (0, 0)
    if any(s < PATCH_SIZE for s in sides):
        raise ValueError(
            f"image_size: a ViT needs at least one {PATCH_SIZE}x{PATCH_SIZE} patch, got "
            f"{image_size}; 112 is the usual face crop"
        )
    return sides


def vit(name: str, **kwargs: Any) -> VisionTransformer:
    """The ViT called `name` (a key of VIT_SIZES), built with `VisionTransformer`'s keyword
    arguments (embedding_size, width, dropout, image_size)."""
    if name not in VIT_SIZES:
        raise ValueError(f"unknown ViT {name!r} (choose from {', '.join(VIT_SIZES)})")
    return VisionTransformer(VIT_SIZES[name], **kwargs)


def vit_t(**kwargs: Any) -> VisionTransformer:
    """arcface_torch's `vit_t` (`vit("vit_t", ...)`)."""
    return vit("vit_t", **kwargs)


def vit_s(**kwargs: Any) -> VisionTransformer:
    """arcface_torch's `vit_s` (`vit("vit_s", ...)`)."""
    return vit("vit_s", **kwargs)


def vit_b(**kwargs: Any) -> VisionTransformer:
    """arcface_torch's `vit_b` (`vit("vit_b", ...)`)."""
    return vit("vit_b", **kwargs)


def vit_l(**kwargs: Any) -> VisionTransformer:
    """arcface_torch's `vit_l` (`vit("vit_l", ...)`)."""
    return vit("vit_l", **kwargs)


def vit_h(**kwargs: Any) -> VisionTransformer:
    """arcface_torch's `vit_h` (`vit("vit_h", ...)`)."""
    return vit("vit_h", **kwargs)
