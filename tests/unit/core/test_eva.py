"""The timm Eva family (DINOv3, EVA-02): adapter, Emb and parameter counts, rates against the reference, bounds.

Three independent routes, as in tests/unit/core/test_reference.py: timm's ``forward_features``; the literal reference
(built from the model's own modules, no adapter); the adapter (``embed`` + ``run_blocks``) with the fast path.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from raystudy.core.bounds import measure_token_stats, upper_bounds
from raystudy.core.components import (
    StackedLinear,
    TimmEvaAdapter,
    UnsupportedModelError,
    count_parameters,
    get_adapter,
    head_parameters,
    trainable_parameters,
)
from raystudy.core.models import build_model
from raystudy.core.plasticity import pair_rates, pair_rates_tensor
from raystudy.core.plasticity_reference import pair_rates_reference, reference_blocks, reference_embedding
from raystudy.vocab import COMPONENTS, CONFIGURATIONS, MODES
from tests.support.families import EVA_MODELS, dinov3_style, eva02_style, eva_style, images, randomize_norms

TOL = dict(rtol=1e-5, atol=1e-5)
D, P, DEPTH = 48, 8, 2  # the tiny models' width, patch size and depth (tests/support/families.py)


def model_of(name: str) -> nn.Module:
    torch.manual_seed(0)
    return randomize_norms(EVA_MODELS[name]()).eval()


def merged_rates(model, x, y, mode):
    fast = pair_rates(model, x, y, mode=mode)
    ref = pair_rates_reference(model, x, y, mode=mode)
    merged = fast.merge(ref, on=["pair", "layer", "component"], suffixes=("", "_ref"))
    assert len(merged) == len(fast) == x.shape[0] * len(model.blocks) * len(COMPONENTS)
    return merged


def rates_close(model, x, y, mode) -> bool:
    merged = merged_rates(model, x, y, mode)
    return bool(np.allclose(merged["rate"], merged["rate_ref"], rtol=1e-5, atol=0))


# --------------------------------------------------------------------------------- fast path vs reference


@pytest.mark.parametrize("name", sorted(EVA_MODELS))
@pytest.mark.parametrize("mode", MODES)
def test_pair_rates_match_reference(name, mode):
    model = model_of(name)
    x, y = images(5, 1), images(5, 2)
    merged = merged_rates(model, x, y, mode)
    assert (merged["rate"] > 0).all()
    np.testing.assert_allclose(merged["rate"], merged["rate_ref"], rtol=1e-5, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_dinov3_style_at_another_image_size(mode):
    """A dynamic-size model on a non-square 48 x 40 image (6 x 5 patches): the rope follows the grid."""
    model = model_of("dinov3-style")
    x, y = images(3, 3, size=48)[..., :40], images(3, 4, size=48)[..., :40]
    assert rates_close(model, x, y, mode)
    adapter = get_adapter(model)
    with torch.no_grad():
        z = adapter.embed(x)
        assert z.shape == (3, 3 + 6 * 5, D)
        assert adapter.attention_kwargs()["rope"].shape[0] == 6 * 5
        torch.testing.assert_close(model.norm(adapter.run_blocks(z)), model.forward_features(x), **TOL)


def test_gated_fc1_is_the_stacked_linear_map():
    """FC1's rate is ``||[W_g; W_x](x - y)|| / ||x - y||`` on the embeddings, written out here by hand."""
    model = model_of("dinov3-style")
    x, y = images(4, 5), images(4, 6)
    with torch.no_grad():
        dz = (get_adapter(model).embed(x) - get_adapter(model).embed(y)).double()  # (N, n, d)
        mlp = model.blocks[1].mlp
        w = torch.cat([mlp.fc1_g.weight, mlp.fc1_x.weight]).double()  # (2h, d)
        want = torch.linalg.vector_norm(dz @ w.T, dim=(1, 2)) / torch.linalg.vector_norm(dz, dim=(1, 2))
        got = pair_rates_tensor(model, x, y)[:, 1, COMPONENTS.index("FC1")]
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5)
    b = get_adapter(model).blocks()[1]
    assert isinstance(b.FC1, StackedLinear) and b.FC1.weight.shape == (2 * 200, D) and b.FC1.in_features == D
    assert b.input_module("FC1") is mlp.fc1_g and b.input_module("FC2") is mlp.fc2
    assert list(b.FC1.parameters()) == []  # a view: it owns no parameters


def test_a_view_without_its_input_module_fails_loudly(monkeypatch):
    """A stacked FC1 the forward never calls, with no ``inputs`` entry, would leave hidden-mode rates unset."""
    import raystudy.core.components as components

    real = components._eva_fc1
    monkeypatch.setattr(components, "_eva_fc1", lambda i, mlp: real(i, mlp)[:2] + ({},))
    model = model_of("dinov3-style")
    pair_rates(model, images(2, 1), images(2, 2), mode="embedding")  # embedding mode reads the weight only
    with pytest.raises(RuntimeError, match="FC1 of block 0 was never called"):
        pair_rates(model, images(2, 1), images(2, 2), mode="hidden")


# --------------------------------------------------------------------------------- against timm's forward


@pytest.mark.parametrize("name", sorted(EVA_MODELS))
def test_adapter_embed_and_run_blocks_reproduce_forward_features(name):
    model = model_of(name)
    x = images(3, 7)
    adapter = get_adapter(model)
    assert adapter.family == "timm-eva"
    with torch.no_grad():
        got = model.norm(adapter.run_blocks(adapter.embed(x)))
        expected = model.forward_features(x)
    torch.testing.assert_close(got, expected, **TOL)


def _fc1_modules(mlp: nn.Module) -> list[nn.Module]:
    return [mlp.fc1_g, mlp.fc1_x] if hasattr(mlp, "fc1_g") else [mlp.fc1]


@pytest.mark.parametrize("name", sorted(EVA_MODELS))
def test_reference_reproduces_forward_features_and_its_component_inputs(name):
    """The reference's blocks give timm's output, and every component sees the input and output it has in
    timm's forward (hooks; a SwiGLU's FC1 output is ``[fc1_g, fc1_x]`` concatenated, its input ``fc1_g``'s)."""
    model = model_of(name)
    x = images(3, 8)
    seen = [{} for _ in model.blocks]
    hooks = []

    def keep(layer, key):
        def fn(mod, args, out):
            seen[layer][key] = (args[0].detach().double().numpy(), out.detach().double().numpy())
        return fn

    for layer, blk in enumerate(model.blocks):
        modules = {"LN1": blk.norm1, "MHA": blk.attn, "LN2": blk.norm2, "FC2": blk.mlp.fc2}
        modules.update({f"FC1.{i}": m for i, m in enumerate(_fc1_modules(blk.mlp))})
        hooks += [m.register_forward_hook(keep(layer, key)) for key, m in modules.items()]
    try:
        with torch.no_grad():
            expected = model.forward_features(x)
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        final, records = reference_blocks(model, *reference_embedding(model, x))
        torch.testing.assert_close(model.norm(final), expected, **TOL)
    for layer, rec in enumerate(records):
        parts = [seen[layer][k] for k in sorted(seen[layer]) if k.startswith("FC1.")]
        seen[layer]["FC1"] = (parts[0][0], np.concatenate([out for _, out in parts], axis=-1))
        for comp in COMPONENTS:
            for got, want in zip(rec[comp], seen[layer][comp]):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{name} {layer} {comp}")


def test_an_adapter_that_forgets_the_rope_is_caught(monkeypatch):
    model = model_of("dinov3-style")
    x, y = images(4, 9), images(4, 10)
    assert rates_close(model, x, y, "embedding")
    monkeypatch.setattr(TimmEvaAdapter, "attention_kwargs", lambda self: {"rope": None})
    assert not rates_close(model, x, y, "embedding")
    assert not rates_close(model, x, y, "hidden")


# --------------------------------------------------------------------------------- parameters


def test_dinov3_style_parameter_counts():
    """Every configuration against a count from the architecture (d = 48, 8 px patches, 2 blocks, h = 200)."""
    model = dinov3_style()
    h = 200  # int(4 * 48) = 192 aligned up to a multiple of 40
    expected = {
        "LN1": DEPTH * 2 * D, "LN2": DEPTH * 2 * D,
        "MHA": DEPTH * (3 * D * D + D * D + D),  # qkv without bias (qkv_bias=False), proj with bias
        "FC1": DEPTH * 2 * (h * D + h),  # fc1_g and fc1_x
        "FC2": DEPTH * (D * h + D),
        "Emb": D * 3 * P * P + D + D + 2 * D,  # patch conv + bias, class token, 2 registers; no pos_embed
        "Head": 0,
    }
    expected["All"] = sum(expected.values()) + DEPTH * 2 * D + 2 * D  # + gamma_1/gamma_2 + final norm
    counts = {c: count_parameters(trainable_parameters(model, c)) for c in CONFIGURATIONS}
    assert counts == expected
    assert count_parameters(head_parameters(model)) == D * 10 + 10
    assert counts["All"] + D * 10 + 10 == sum(p.numel() for p in model.parameters())


def test_eva02_style_parameter_counts_and_names():
    model = eva02_style()
    h = 128  # int(48 * 4 * 2 / 3)
    counts = {c: count_parameters(trainable_parameters(model, c)) for c in CONFIGURATIONS}
    assert counts["MHA"] == DEPTH * ((D * D + D) + D * D + (D * D + D) + (D * D + D))  # q, k (no bias), v, proj
    assert counts["FC1"] == DEPTH * 2 * (h * D + h) and counts["FC2"] == DEPTH * (D * h + D)
    assert {n: p.numel() for n, p in trainable_parameters(model, "Emb")} == {
        "patch_embed.proj.weight": D * 3 * P * P, "patch_embed.proj.bias": D, "cls_token": D, "pos_embed": 17 * D}
    all_names = {n for n, _ in trainable_parameters(model, "All")}
    chosen = set().union(*({n for n, _ in trainable_parameters(model, c)} for c in COMPONENTS + ("Emb",)))
    # the MLP's inner norm (before fc2) and the pooled features' fc_norm belong to no component: All only
    assert all_names - chosen == {f"blocks.{i}.mlp.norm.{p}" for i in range(DEPTH) for p in ("weight", "bias")} | {
        "fc_norm.weight", "fc_norm.bias"}


def _names(params) -> set[str]:
    return {n for n, _ in params}


@pytest.mark.parametrize("name", sorted(EVA_MODELS))
def test_emb_is_what_the_first_block_sees(name):
    """Emb = the parameters the first block's input depends on, found by autograd through timm's forward."""
    model = EVA_MODELS[name]().eval()
    captured = {}
    hook = model.blocks[0].register_forward_pre_hook(lambda _m, args: captured.setdefault("x", args[0]))
    model(images(2, 15))
    hook.remove()
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(captured["x"].sum(), list(params.values()), allow_unused=True)
    assert _names(trainable_parameters(model, "Emb")) == {n for n, g in zip(params, grads) if g is not None}


@pytest.mark.parametrize("name", sorted(EVA_MODELS))
def test_selections_partition_the_model(name):
    """Components (with LayerScale), Emb, head and final norm are disjoint; what is left is the MLP's inner norm."""
    from raystudy.core.finetune import final_norm_parameters, select_and_freeze

    model = EVA_MODELS[name]()
    groups = [_names(trainable_parameters(model, c, include_layerscale=True)) for c in COMPONENTS]
    groups += [_names(trainable_parameters(model, "Emb")), _names(head_parameters(model)),
               _names(final_norm_parameters(model))]
    assert sum(map(len, groups)) == len(set().union(*groups))
    rest = _names(model.named_parameters()) - set().union(*groups)
    assert rest == {n for n, _ in model.named_parameters() if ".mlp.norm." in n}
    for config in CONFIGURATIONS:
        sel = select_and_freeze(model, config)
        assert {n for n, p in model.named_parameters() if p.requires_grad} == set(sel.names)


def test_layerscale_attaches_to_mha_and_fc2_on_request():
    model = dinov3_style()
    for comp, gamma in (("MHA", "gamma_1"), ("FC2", "gamma_2")):
        plain = {n for n, _ in trainable_parameters(model, comp)}
        with_ls = {n for n, _ in trainable_parameters(model, comp, include_layerscale=True)}
        assert with_ls - plain == {f"blocks.{i}.{gamma}" for i in range(DEPTH)}


def test_unsupported_eva_variants_say_why():
    with pytest.raises(UnsupportedModelError, match="EvaBlockPostNorm"):
        get_adapter(eva_style().__class__(img_size=32, patch_size=8, embed_dim=D, depth=1, num_heads=4,
                                          use_post_norm=True))
    mixed = eva_style().__class__(img_size=32, patch_size=8, embed_dim=D, depth=1, num_heads=4,
                                  use_rot_pos_emb=True, rope_type="mixed")
    with pytest.raises(UnsupportedModelError, match="mixed"):
        get_adapter(mixed)


# --------------------------------------------------------------------------------- bounds


def test_bounds_nan_for_rope_attention_and_valid_for_the_stacked_fc1():
    model = model_of("dinov3-style")
    with pytest.warns(UserWarning, match="MHA bound assumptions do not hold.*RoPE"):
        table = upper_bounds(model, radius=1.0, seq_len=19, sigma=0.5)
    assert table[table.component == "MHA"][["bound", "bound_hidden"]].isna().all().all()
    fc1 = table[table.component == "FC1"].set_index("layer")["bound"]
    for layer, blk in enumerate(model.blocks):
        w = torch.cat([blk.mlp.fc1_g.weight, blk.mlp.fc1_x.weight]).detach().double()
        assert fc1[layer] == pytest.approx(float(torch.linalg.svdvals(w)[0]), rel=1e-9)
    rates = pd_max_rates(model)
    for comp in ("FC1", "FC2"):  # the linear bounds hold for the measured rates, in both modes
        bound = table[table.component == comp].set_index("layer")
        assert (rates["embedding"][comp] <= bound["bound"] * (1 + 1e-6)).all()
        assert (rates["hidden"][comp] <= bound["bound_hidden"] * (1 + 1e-6)).all()


def pd_max_rates(model) -> dict:
    x, y = images(4, 11), images(4, 12)
    return {mode: pair_rates(model, x, y, mode=mode).groupby(["component", "layer"])["rate"].max().unstack(0)
            for mode in MODES}


def test_attention_bound_applies_to_eva_without_rope():
    """Without RoPE the Castin et al. bound applies: it equals the formula written out for the fused qkv heads,
    and holds for the measured rates with the radius of the measured sequences (q bias zero, as assumed)."""
    model = model_of("eva-style")
    for blk in model.blocks:
        blk.attn.q_bias.data.zero_()
    x, y = images(4, 11), images(4, 12)
    stats = measure_token_stats(model, torch.cat([x, y]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table = upper_bounds(model, radius=stats.radius_max, seq_len=stats.seq_len, sigma=0.5)
    bound = table[table.component == "MHA"].set_index("layer")["bound"]
    n, r, k = stats.seq_len, stats.radius_max, D // 4
    for layer, blk in enumerate(model.blocks):
        q, kk, v = blk.attn.qkv.weight.detach().double().reshape(3, 4, k, D)  # (3, heads, k, d)
        o = blk.attn.proj.weight.detach().double().reshape(D, 4, k)
        want = sum(float(torch.linalg.matrix_norm(o[:, h], 2) * torch.linalg.matrix_norm(v[h], 2))
                   * math.sqrt(3 * n + (12 * n + 3) * r**4 * float(torch.linalg.matrix_norm(q[h].T @ kk[h], 2)
                                                                   / math.sqrt(k)) ** 2) for h in range(4))
        assert bound[layer] == pytest.approx(want, rel=1e-9)
    assert (pd_max_rates(model)["embedding"]["MHA"] <= bound).all()


# --------------------------------------------------------------------------------- timm's own models


@pytest.mark.parametrize("name, img_size", [("vit_small_patch16_dinov3", 32), ("eva02_tiny_patch14_224", 28)])
def test_timm_dinov3_and_eva02_are_supported(name, img_size):
    model = build_model(name, num_classes=3, img_size=img_size).eval()
    adapter = get_adapter(model)
    assert adapter.family == "timm-eva" and len(adapter.blocks()) == 12
    x, y = images(2, 13, size=img_size), images(2, 14, size=img_size)
    for mode in MODES:
        rates = pair_rates_tensor(model, x, y, mode=mode)
        assert rates.shape == (2, 12, 5) and torch.isfinite(rates).all() and (rates > 0).all()
    with torch.no_grad():
        torch.testing.assert_close(model.norm(adapter.run_blocks(adapter.embed(x))), model.forward_features(x),
                                   **TOL)
    assert count_parameters(trainable_parameters(model, "Emb")) > 0
