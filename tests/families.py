"""Tiny random-init models of every supported family, and random inputs, for the science-core tests."""

from __future__ import annotations

import torch
from conftest import tiny_vit
from torch import nn


def deit_distilled():
    from timm.models.deit import VisionTransformerDistilled

    return VisionTransformerDistilled(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=4, num_classes=7)


def dinov2_style():
    # LayerScale + register tokens, as in timm's *_dinov2 / *_reg models
    return tiny_vit(init_values=0.5, reg_tokens=2, class_token=True, no_embed_class=True, depth=2)


def clip_style():
    # a LayerNorm before the blocks (norm_pre), no class token, average pooling
    return tiny_vit(pre_norm=True, class_token=False, global_pool="avg", depth=2)


def beit(shared: bool = False):
    from timm.models.beit import Beit

    model = Beit(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=4, num_classes=10, init_values=0.3,
                 use_rel_pos_bias=not shared, use_shared_rel_pos_bias=shared)
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():  # non-zero position biases, so the shared bias really matters
        if "relative_position_bias_table" in name:
            p.data = torch.randn(p.shape, generator=g)
    return model


#: The five models the fast path is checked on against the reference, in both modes.
MODELS = {"vit": tiny_vit, "deit-distilled": deit_distilled, "dinov2-style": dinov2_style, "beit": beit,
          "beit-shared-bias": lambda: beit(shared=True)}
#: Every variant of every family whose embedding stage differs: checked against the model's own forward.
VARIANTS = {**MODELS, "clip-style": clip_style}


def images(n, seed, size=32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, size, size, generator=g)


def randomize_norms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random LayerNorm affine parameters, so LN rates are not all equal to those of a plain normalisation."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            m.weight.data = 1 + 0.5 * torch.randn(m.weight.shape, generator=g)
            m.bias.data = 0.1 * torch.randn(m.bias.shape, generator=g)
    return model
