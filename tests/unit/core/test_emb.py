"""The ``Emb`` configuration: the embedding stage of every family, its exact size, and freezing with it."""

from __future__ import annotations

import pytest
import torch

from raystudy.core.components import embedding_parameters, head_parameters, trainable_parameters
from raystudy.core.finetune import final_norm_parameters, select_and_freeze
from raystudy.core.models import build_model
from raystudy.vocab import BASELINES, COMPONENTS, CONFIGURATIONS, LINEAR_PROBE, TRIALS_CONFIGURATIONS
from tests.support.families import VARIANTS, beit, clip_style, deit_distilled, dinov2_style
from tests.support.models import tiny_vit

D, P = 48, 8  # the tiny models' width and patch size (tests/support/families.py): 32 px images -> 16 patches
PATCH = D * 3 * P * P + D  # conv weight + bias


def names(params) -> set[str]:
    return {n for n, _ in params}


def test_vocabulary():
    assert CONFIGURATIONS == ("LN1", "MHA", "LN2", "FC1", "FC2", "Emb", "All", "Head")
    assert COMPONENTS + BASELINES == ("LN1", "MHA", "LN2", "FC1", "FC2", "All", "Head")  # the paper's seven
    assert LINEAR_PROBE == "LP" and LINEAR_PROBE not in CONFIGURATIONS
    assert TRIALS_CONFIGURATIONS == CONFIGURATIONS + ("LP",)


def test_vit_base_emb_is_742_656_parameters():
    with torch.device("meta"):
        model = build_model("vit_base_patch16_224", num_classes=10)
    emb = trainable_parameters(model, "Emb")
    sizes = {n: p.numel() for n, p in emb}
    assert sizes == {
        "patch_embed.proj.weight": 768 * 3 * 16 * 16,  # 589,824: a 16x16 conv from 3 channels to d = 768
        "patch_embed.proj.bias": 768,
        "cls_token": 768,
        "pos_embed": 197 * 768,  # 151,296: (224 / 16)^2 = 196 patches + the class token
    }
    assert 768 * 3 * 16 * 16 + 768 == 590_592
    assert sum(sizes.values()) == 590_592 + 768 + 151_296 == 742_656
    assert names(embedding_parameters(model)) == set(sizes)


PATCH_NAMES = {"patch_embed.proj.weight": D * 3 * P * P, "patch_embed.proj.bias": D}


@pytest.mark.parametrize("build, expected", [
    (tiny_vit, {**PATCH_NAMES, "cls_token": D, "pos_embed": 17 * D}),
    (deit_distilled, {**PATCH_NAMES, "cls_token": D, "dist_token": D, "pos_embed": 18 * D}),
    (dinov2_style, {**PATCH_NAMES, "cls_token": D, "reg_token": 2 * D, "pos_embed": 16 * D}),  # no_embed_class
    # timm's Beit class defaults to an absolute pos_embed (the pretrained beit_* configs turn it off)
    (beit, {**PATCH_NAMES, "cls_token": D, "pos_embed": 17 * D}),
    (lambda: beit(shared=True), {**PATCH_NAMES, "cls_token": D, "pos_embed": 17 * D}),  # not rel_pos_bias
    # no class token; the patch projection has no bias when a LayerNorm follows it
    (clip_style, {"patch_embed.proj.weight": D * 3 * P * P, "pos_embed": 16 * D, "norm_pre.weight": D,
                  "norm_pre.bias": D}),
], ids=["vit", "deit-distilled", "dinov2-style", "beit", "beit-shared-bias", "clip-style"])
def test_emb_names_per_family(build, expected):
    model = build()
    assert {n: p.numel() for n, p in trainable_parameters(model, "Emb")} == expected


def test_beit_without_absolute_position_embedding():
    from timm.models.beit import Beit

    model = Beit(img_size=32, patch_size=8, embed_dim=D, depth=2, num_heads=4, num_classes=10,
                 use_abs_pos_emb=False, use_rel_pos_bias=True)  # as the pretrained beit_* / beitv2_* models
    assert names(trainable_parameters(model, "Emb")) == {"patch_embed.proj.weight", "patch_embed.proj.bias",
                                                          "cls_token"}
    assert names(trainable_parameters(model, "Emb")) == first_block_inputs(model)


def first_block_inputs(model: torch.nn.Module) -> set[str]:
    """Parameters the first block's input depends on, from the model's own forward (no registry)."""
    captured = {}
    hook = model.blocks[0].register_forward_pre_hook(lambda _m, args: captured.setdefault("x", args[0]))
    model.eval()
    model(torch.randn(2, 3, 32, 32))
    hook.remove()
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(captured["x"].sum(), list(params.values()), allow_unused=True)
    return {n for n, g in zip(params, grads) if g is not None}


@pytest.mark.parametrize("family", sorted(VARIANTS))
def test_emb_is_what_the_first_block_sees(family):
    model = VARIANTS[family]()
    assert names(trainable_parameters(model, "Emb")) == first_block_inputs(model)


@pytest.mark.parametrize("family", sorted(VARIANTS))
def test_emb_is_disjoint_from_components_head_and_final_norm(family):
    model = VARIANTS[family]()
    emb = names(trainable_parameters(model, "Emb"))
    others = [names(head_parameters(model)), names(final_norm_parameters(model))]
    others += [names(trainable_parameters(model, c, include_layerscale=True)) for c in COMPONENTS]
    assert all(not emb & o for o in others)
    rest = names(model.named_parameters()) - emb - set().union(*others)
    assert rest == ({"rel_pos_bias.relative_position_bias_table"} if family == "beit-shared-bias" else set())


@pytest.mark.parametrize("train_final_norm", [False, True])
def test_freezing_with_emb_trains_only_emb_and_head(train_final_norm):
    torch.manual_seed(0)
    model = deit_distilled()
    expected = {"patch_embed.proj.weight", "patch_embed.proj.bias", "cls_token", "dist_token", "pos_embed",
                "head.weight", "head.bias", "head_dist.weight", "head_dist.bias"}
    if train_final_norm:
        expected |= {"norm.weight", "norm.bias"}
    sel = select_and_freeze(model, "Emb", train_final_norm=train_final_norm)
    assert set(sel.names) == expected
    assert {n for n, p in model.named_parameters() if p.requires_grad} == expected
    assert sel.num_trainable == PATCH + D + D + 18 * D + 2 * (D * 7 + 7) + (2 * D if train_final_norm else 0)

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD([p for _, p in sel.trainable], lr=0.1)
    model.train()
    loss = torch.nn.functional.cross_entropy(model(torch.randn(4, 3, 32, 32)), torch.arange(4))
    loss.backward()
    opt.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed == expected
