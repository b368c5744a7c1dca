"""Tiny random-init models of every supported family, and random inputs, for the science-core tests."""

from __future__ import annotations

import torch
from torch import nn

from tests.support.models import tiny_vit


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


# --------------------------------------------------------------------------------------------- timm Eva family


def _eva(**overrides):
    """A tiny timm ``Eva`` (32 px, 8 px patches -> 16 patches, d=48, 2 blocks, 4 heads) with random biases and
    LayerScale, so that no parameter sits at a special value (zero q/v biases, constant gammas)."""
    from timm.models.eva import Eva

    kw = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=4, num_classes=10)
    model = Eva(**{**kw, **overrides})
    g = torch.Generator().manual_seed(2)
    for name, p in model.named_parameters():
        if name.endswith(("q_bias", "v_bias", "fc1_g.bias", "fc1_x.bias", "fc1.bias")):
            p.data = 0.2 * torch.randn(p.shape, generator=g)
        elif ".gamma_" in name:
            p.data = 0.5 + 0.3 * torch.randn(p.shape, generator=g)
    return model


def dinov3_style():
    # as vit_huge_plus_patch16_dinov3 / vit_7b_patch16_dinov3: RoPE (dinov3 type, rotate-half), class token +
    # registers, no absolute position embedding, LayerScale, dynamic image size, SwiGLU with separate
    # fc1_g / fc1_x and an aligned hidden width (192 -> 200)
    return _eva(qkv_bias=False, init_values=0.5, rope_type="dinov3", rope_temperature=100, rope_rotate_half=True,
                use_rot_pos_emb=True, use_abs_pos_emb=False, num_reg_tokens=2, use_fc_norm=False,
                dynamic_img_size=True, swiglu_mlp=True, swiglu_align_to=40)


def eva02_style():
    # as eva02_base_patch14_224: RoPE (cat type), absolute position embedding, separate q/k/v projections,
    # SwiGLU with separate fc1_g / fc1_x and a LayerNorm before fc2 (scale_mlp)
    return _eva(qkv_fused=False, mlp_ratio=4 * 2 / 3, swiglu_mlp=True, scale_mlp=True, use_rot_pos_emb=True,
                ref_feat_shape=(4, 4))


def eva02_glu_style():
    # as eva02_tiny_patch14_224: RoPE, fused qkv with q/v biases, packed SwiGLU (GluMlp, one fc1 d -> 2h)
    return _eva(mlp_ratio=4 * 2 / 3, swiglu_mlp=True, use_rot_pos_emb=True, ref_feat_shape=(4, 4))


def eva_style():
    # EVA (01): no RoPE, plain GELU Mlp, LayerScale; the attention bound applies here
    return _eva(init_values=0.5, use_rot_pos_emb=False)


#: Eva models checked against the reference and timm's forward (tests/unit/core/test_eva.py).
EVA_MODELS = {"dinov3-style": dinov3_style, "eva02-style": eva02_style, "eva02-glu-style": eva02_glu_style,
              "eva-style": eva_style}
