"""The tiny models of the tests: timm ViTs small enough for two CPU cores, and the study tests' model."""

from __future__ import annotations


def tiny_vit(**overrides):
    """A small timm ViT (32 px, 8 px patches -> 17 tokens, d=48, 3 blocks, 4 heads)."""
    from timm.models.vision_transformer import VisionTransformer

    kw = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4, num_classes=10)
    kw.update(overrides)
    return VisionTransformer(**kw)


#: the tiny ViT of the end-to-end study tests (timm's vit_tiny_patch16_224 shrunk to 32 px)
STUDY_MODEL = "vit_tiny_patch16_224"
STUDY_TINY = {"patch_size": 8, "embed_dim": 48, "depth": 3, "num_heads": 4}
