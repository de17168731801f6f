"""torchvision's VisionTransformer, sized down (ViT-Tiny's width), on patches sized for the images:
4 pixels at 28-32 px, 16 at 224.

Its Linear layers (attention projections and MLPs) carry nearly all of its FLOPs, which is what
fp8 training converts: the model on which `precision=fp8` can show what it does.
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import nn
from torchvision.models.vision_transformer import VisionTransformer

from mpexp.errors import ConfigError

# model.patch_size=null takes the first of these that divides the image into at most AUTO_TOKENS
# patches: 4 at 28-32 px (49, 64 patches), 16 at 224 (ViT-B/16's 14 x 14)
PATCH_SIDES = (4, 8, 16, 32)
AUTO_TOKENS = 196


class SelfAttention(nn.Module):
    """Multi-head self-attention from two nn.Linear layers (qkv and proj), in place of
    torchvision's nn.MultiheadAttention.

    nn.MultiheadAttention hands its raw weights to F.multi_head_attention_forward and never calls
    a Linear module, so a module swap (fp8's conversion) cannot reach its projections, a third of
    the model's matrix work. This computes the same function, through Linear layers, and keeps
    nn.MultiheadAttention's initialisation (Xavier-uniform projections, zero biases) and its call
    (query, key, value, need_weights) -> (output, weights).
    """

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        # as nn.MultiheadAttention: Xavier over the stacked (3 * width, width) in-projection
        nn.init.xavier_uniform_(self.qkv.weight)
        nn.init.zeros_(self.qkv.bias)
        nn.init.zeros_(self.proj.bias)

    def forward(self, query, key=None, value=None, need_weights: bool = False):
        # torchvision's encoder block calls self_attention(x, x, x, need_weights=False)
        n, length, width = query.shape
        # (n, length, 3 * width) -> q, k, v, each (n, heads, length, width / heads)
        qkv = self.qkv(query).reshape(n, length, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(n, length, width)), None


def vit(
    in_channels: int = 3,
    num_classes: int = 10,
    image_size: tuple[int, int] = (32, 32),
    patch_size: int | None = None,
    width: int = 192,
    depth: int = 6,
    heads: int = 3,
    mlp_ratio: int = 4,
    max_tokens: int = 1024,
) -> nn.Module:
    """A ViT of `depth` blocks of `width` (ViT-Tiny's width and heads, half its depth) on patches
    of `patch_size` pixels (None: from the image size, `patch_side`): 4 gives 49 tokens on 28x28
    images and 64 on 32x32, 7 gives 16 on 28x28, 16 gives 196 on 224x224. A patch size that gives
    more than `max_tokens` tokens is refused: attention's cost grows with their square."""
    if width % heads:
        raise ConfigError(
            f"model.width={width} must be a multiple of model.heads={heads}: each head takes "
            "width / heads channels."
        )
    height, wide = image_size
    if height != wide:
        raise ValueError(f"it takes square images only, not {height}x{wide}")
    if patch_size is None:
        patch_size = patch_side(height)
    if height % patch_size:
        raise ValueError(f"{height} pixels are not a whole number of model.patch_size={patch_size}")
    tokens = (height // patch_size) ** 2
    if tokens > max_tokens:
        raise ConfigError(
            f"model.patch_size={patch_size} cuts {height}x{height} images into {tokens:,} patches, "
            f"more than model.max_tokens={max_tokens:,} (attention's cost grows with their "
            f"square): give model.patch_size=null ({_auto_text(height)}), or raise "
            "model.max_tokens."
        )
    model = VisionTransformer(
        image_size=height,
        patch_size=patch_size,
        num_layers=depth,
        num_heads=heads,
        hidden_dim=width,
        mlp_dim=mlp_ratio * width,
        num_classes=num_classes,
    )
    # torchvision's stem takes 3 channels; this one the data's, initialised as torchvision does
    model.conv_proj = nn.Conv2d(in_channels, width, kernel_size=patch_size, stride=patch_size)
    nn.init.trunc_normal_(model.conv_proj.weight, std=math.sqrt(1 / (in_channels * patch_size**2)))
    nn.init.zeros_(model.conv_proj.bias)
    for block in model.encoder.layers:
        block.self_attention = SelfAttention(width, heads)
    # neither torchvision's forward nor SelfAttention keeps Python-side state: the step may be
    # captured as a CUDA graph (mpexp.step.performance.declares_capturable)
    model.capturable = True
    return model


def patch_side(side: int) -> int:
    """The patch size for `side`-pixel images where none is given: the first of PATCH_SIDES that
    divides the side into at most AUTO_TOKENS patches."""
    for patch in PATCH_SIDES:
        if side % patch == 0 and (side // patch) ** 2 <= AUTO_TOKENS:
            return patch
    raise ConfigError(
        f"model.patch_size=null: no patch of {', '.join(map(str, PATCH_SIDES))} pixels divides "
        f"{side}x{side} images into at most {AUTO_TOKENS} patches. Give model.patch_size (a "
        f"divisor of {side}), or another dataset.image_size (224: patches of 16)."
    )


def _auto_text(side: int) -> str:
    try:
        patch = patch_side(side)
    except ConfigError:
        return f"none fits {side} px"
    return f"{patch} here, {(side // patch) ** 2} patches"
