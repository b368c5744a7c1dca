"""Core science: component registry, plasticity, bounds, model loading.

The fast plasticity path against the literal reference and timm's own forward: tests/unit/core/test_reference.py.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from raystudy.core.bounds import (
    attention_bound,
    measure_token_stats,
    token_radius,
    token_sigma,
    upper_bounds,
)
from raystudy.core.components import UnsupportedModelError, get_adapter, head_parameters, trainable_parameters
from raystudy.core.input_checks import PlasticityInputError
from raystudy.core.models import WeightsError, build_model, load_weights
from raystudy.core.plasticity import pair_rates, pair_rates_tensor, summarize
from raystudy.core.plasticity_reference import reference_tokens
from raystudy.vocab import COMPONENTS, CONFIGURATIONS
from tests.support.families import beit, deit_distilled, dinov2_style, images, randomize_norms
from tests.support.models import tiny_vit

# ----------------------------------------------------------------------------------------------- registry


def test_vit_base_parameter_counts():
    with torch.device("meta"):
        model = build_model("vit_base_patch16_224", num_classes=10)
    counts = {c: sum(p.numel() for _, p in trainable_parameters(model, c)) for c in CONFIGURATIONS}
    assert counts == {
        "LN1": 18_432, "MHA": 28_348_416, "LN2": 18_432, "FC1": 28_348_416, "FC2": 28_320_768,
        "Emb": 742_656, "All": 85_798_656, "Head": 0,
    }
    assert sum(p.numel() for _, p in head_parameters(model)) == 7_690


def test_selections_are_disjoint_and_named():
    model = tiny_vit()
    names = {c: {n for n, _ in trainable_parameters(model, c)} for c in COMPONENTS}
    for i, a in enumerate(COMPONENTS):
        for b in COMPONENTS[i + 1:]:
            assert not names[a] & names[b]
    assert names["MHA"] == {f"blocks.{i}.attn.{p}" for i in range(3) for p in
                            ("qkv.weight", "qkv.bias", "proj.weight", "proj.bias")}
    assert names["FC2"] == {f"blocks.{i}.mlp.fc2.{p}" for i in range(3) for p in ("weight", "bias")}
    all_names = {n for n, _ in trainable_parameters(model, "All")}
    assert all_names == {n for n, _ in model.named_parameters()} - {"head.weight", "head.bias"}


def test_layerscale_belongs_to_no_component_by_default():
    model = dinov2_style()
    default = {n for n, _ in trainable_parameters(model, "MHA")}
    assert not any(".ls1." in n for n in default)
    with_ls = {n for n, _ in trainable_parameters(model, "MHA", include_layerscale=True)}
    assert with_ls - default == {"blocks.0.ls1.gamma", "blocks.1.ls1.gamma"}
    fc2 = {n for n, _ in trainable_parameters(model, "FC2", include_layerscale=True)}
    assert {"blocks.0.ls2.gamma", "blocks.1.ls2.gamma"} <= fc2


def test_beit_family_selections():
    model = beit()
    assert get_adapter(model).family == "timm-beit"
    mha = {n for n, _ in trainable_parameters(model, "MHA")}
    assert "blocks.1.attn.relative_position_bias_table" in mha and "blocks.0.attn.q_bias" in mha
    assert not any("gamma" in n for n in mha)
    with_ls = {n for n, _ in trainable_parameters(model, "MHA", include_layerscale=True)}
    assert with_ls - mha == {"blocks.0.gamma_1", "blocks.1.gamma_1"}
    assert {n for n, _ in trainable_parameters(model, "FC2", include_layerscale=True)} - {
        n for n, _ in trainable_parameters(model, "FC2")} == {"blocks.0.gamma_2", "blocks.1.gamma_2"}
    with pytest.warns(UserWarning, match="relative_position_bias_table"):
        table = upper_bounds(model, radius=1.0, seq_len=17, sigma=1.0)
    assert table[table.component == "MHA"]["bound"].isna().all()
    assert table[table.component == "FC1"]["bound"].notna().all()


def test_distilled_model_has_two_heads():
    model = deit_distilled()
    assert {n for n, _ in head_parameters(model)} == {"head.weight", "head.bias", "head_dist.weight", "head_dist.bias"}
    assert not any(n.startswith("head") for n, _ in trainable_parameters(model, "All"))


def test_unsupported_model_lists_families():
    with pytest.raises(UnsupportedModelError, match="timm-vit"):
        get_adapter(nn.Sequential(nn.Linear(3, 3)))
    with pytest.raises(UnsupportedModelError, match="supports the families"):
        trainable_parameters(nn.Linear(2, 2), "MHA")
    with pytest.raises(ValueError, match="unknown configuration 'Attn'"):
        trainable_parameters(tiny_vit(), "Attn")


def test_post_norm_blocks_are_rejected():
    from timm.models.vision_transformer import ResPostBlock

    model = tiny_vit(block_fn=ResPostBlock)
    with pytest.raises(UnsupportedModelError, match="ResPostBlock"):
        get_adapter(model)


# ----------------------------------------------------------------------------------------------- plasticity


def test_modes_differ_and_embedding_inputs_are_shared():
    model = randomize_norms(tiny_vit())
    x, y = images(4, 3), images(4, 4)
    emb = pair_rates_tensor(model, x, y, mode="embedding")
    hid = pair_rates_tensor(model, x, y, mode="hidden")
    # In embedding mode layer 0 sees the embeddings in both modes for LN1: identical there, not beyond.
    torch.testing.assert_close(emb[:, 0, 0], hid[:, 0, 0], rtol=1e-5, atol=0)
    assert not torch.allclose(emb[:, 1:, 1], hid[:, 1:, 1])


def test_linear_rates_never_exceed_spectral_bounds():
    model = randomize_norms(tiny_vit(depth=2), seed=3)
    x, y = images(16, 5), images(16, 6) * 3
    st = measure_token_stats(model, torch.cat([x, y]))
    bounds = upper_bounds(model, radius=st.radius, seq_len=st.seq_len, sigma=st.sigma).set_index(["layer", "component"])
    for mode, column in (("embedding", "bound"), ("hidden", "bound_hidden")):
        rates = pair_rates(model, x, y, mode=mode)
        worst = rates.groupby(["layer", "component"])["rate"].max()
        for (layer, comp), r in worst.items():
            if comp in ("FC1", "FC2"):
                assert r <= bounds.loc[(layer, comp), column] * (1 + 1e-6), (mode, layer, comp)
        # the lifted FC2 bound is the tighter one
        fc2 = bounds.xs("FC2", level="component")
        assert (fc2["bound"] <= fc2["bound_hidden"]).all()


def test_embedding_rates_respect_all_bounds_with_conservative_radius():
    """With r = the largest token norm and sigma = the smallest token std of the pairs, every bound holds."""
    model = randomize_norms(tiny_vit(depth=2), seed=4)
    x, y = images(12, 7), images(12, 8)
    with torch.no_grad():
        z = reference_tokens(model, torch.cat([x, y])).double().numpy()
    r_max = float(np.linalg.norm(z, axis=-1).max())
    sigma = float(np.sqrt(z.var(-1) + 1e-6).min())
    bounds = upper_bounds(model, radius=r_max, seq_len=z.shape[1], sigma=sigma).set_index(["layer", "component"])
    worst = pair_rates(model, x, y).groupby(["layer", "component"])["rate"].max()
    assert (worst <= bounds["bound"].reindex(worst.index) * (1 + 1e-6)).all()


def test_bf16_autocast_keeps_float32_norms():
    model = randomize_norms(tiny_vit())
    x, y = images(4, 9), images(4, 10)
    exact = pair_rates_tensor(model, x, y)
    approx = pair_rates_tensor(model, x, y, amp_dtype=torch.bfloat16)
    assert approx.dtype == torch.float32
    torch.testing.assert_close(approx, exact, rtol=5e-2, atol=1e-3)


def test_model_left_in_its_training_mode():
    model = tiny_vit().train()
    pair_rates(model, images(2, 1), images(2, 2))
    assert model.training


def test_bad_inputs_have_clear_errors():
    model = tiny_vit()
    x, y = images(3, 1), images(3, 2)
    with pytest.raises(PlasticityInputError, match=r"same shape.*\(3, 3, 32, 32\).*\(2, 3, 32, 32\)"):
        pair_rates(model, x, y[:2])
    y_dup = y.clone()
    y_dup[1] = x[1]
    with pytest.raises(PlasticityInputError, match=r"pair\(s\) \[1\] have identical embeddings"):
        pair_rates(model, x, y_dup)
    with pytest.raises(PlasticityInputError, match=r"pair\(s\) \[1\] have identical inputs to LN1 of block 0"):
        pair_rates(model, x, y_dup, mode="hidden")
    y_nan = y.clone()
    y_nan[2, 0, 0, 0] = float("nan")
    with pytest.raises(PlasticityInputError, match=r"y has non-finite values.*\[2\]"):
        pair_rates(model, x, y_nan)
    x_inf = x.clone()
    x_inf[0, 1, 2, 3] = float("inf")
    with pytest.raises(PlasticityInputError, match=r"x has non-finite"):
        pair_rates(model, x_inf, y)
    with pytest.raises(PlasticityInputError, match="unknown mode 'layer'"):
        pair_rates(model, x, y, mode="layer")
    with pytest.raises(PlasticityInputError, match=r"\(N, C, H, W\)"):
        pair_rates(model, x[0], y[0])
    with pytest.raises(UnsupportedModelError):
        pair_rates(nn.Conv2d(3, 3, 1), x, y)


def test_summarize_matches_hand_computation():
    rng = np.random.default_rng(0)
    rates = pd.DataFrame(
        [(p, layer, c, float(rng.random())) for p in range(5) for layer in range(2) for c in COMPONENTS],
        columns=["pair", "layer", "component", "rate"],
    )
    table = summarize(rates)
    assert list(table.columns) == ["layer", "component", "plasticity", "std", "ci95", "n_pairs"]
    assert list(table["component"][:5]) == list(COMPONENTS)
    for _, row in table.iterrows():
        vals = rates[(rates.layer == row.layer) & (rates.component == row.component)]["rate"].to_numpy()
        assert row.plasticity == pytest.approx(vals.mean(), rel=1e-12)
        assert row["std"] == pytest.approx(vals.std(ddof=1), rel=1e-12)
        assert row.ci95 == pytest.approx(1.96 * vals.std(ddof=1) / math.sqrt(5), rel=1e-12)
        assert row.n_pairs == 5
    with pytest.raises(ValueError, match="lacks column"):
        summarize(rates.drop(columns="rate"))


# ----------------------------------------------------------------------------------------------- bounds


def test_attention_bound_matches_independent_formula():
    model = tiny_vit(depth=1)
    attn = model.blocks[0].attn
    w = attn.qkv.weight.detach().double().numpy()
    o = attn.proj.weight.detach().double().numpy()
    d, heads = 48, 4
    k = d // heads
    r, n = 2.5, 17
    expected = 0.0
    for h in range(heads):
        sl = slice(h * k, (h + 1) * k)
        q, kk, v = w[0:d][sl], w[d:2 * d][sl], w[2 * d:][sl]
        a = q.T @ kk / math.sqrt(k)
        spec = lambda m: np.linalg.svd(m, compute_uv=False)[0]
        expected += spec(o[:, sl]) * spec(v) * math.sqrt(3 * n + (12 * n + 3) * r**4 * spec(a) ** 2)
    assert attention_bound(attn, radius=r, seq_len=n) == pytest.approx(expected, rel=1e-10)


def test_bounds_table_and_layernorm_bound():
    model = randomize_norms(tiny_vit(depth=2))
    table = upper_bounds(model, radius=3.0, seq_len=17, sigma=0.5)
    assert list(table.columns[:3]) == ["layer", "component", "bound"]
    assert len(table) == 10
    gamma = model.blocks[1].norm2.weight.detach().abs().max().item()
    ln2 = table[(table.layer == 1) & (table.component == "LN2")]["bound"].item()
    assert ln2 == pytest.approx(gamma / 0.5)
    fc1 = table[(table.layer == 0) & (table.component == "FC1")]["bound"].item()
    assert fc1 == pytest.approx(np.linalg.svd(model.blocks[0].mlp.fc1.weight.detach().double().numpy())[1][0])
    assert upper_bounds(model, radius=3.0, seq_len=17)["bound"].isna().sum() == 4  # LN rows without sigma
    with pytest.raises(ValueError, match="radius and seq_len must be positive"):
        upper_bounds(model, radius=0, seq_len=17)


def test_token_statistics():
    t = torch.randn(3, 5, 8)
    r = token_radius(t)
    np.testing.assert_allclose(r.numpy(), np.sqrt((t.numpy() ** 2).sum(-1).mean(-1)), rtol=1e-6)
    s = token_sigma(t, eps=0.0)
    np.testing.assert_allclose(s.numpy(), t.numpy().std(-1), rtol=1e-5)
    model = tiny_vit()
    x = images(10, 3)
    st = measure_token_stats(model, x, batch_size=3)
    with torch.no_grad():
        z = reference_tokens(model, x).double().numpy()  # (10, 17, 48)
    assert st.radius == pytest.approx(np.sqrt((z**2).sum(-1).mean(-1)).mean(), rel=1e-5)
    assert st.sigma == pytest.approx(np.sqrt(z.var(-1) + 1e-6).min(), rel=1e-5)
    assert st.seq_len == 17 and st.count == 10


# ----------------------------------------------------------------------------------------------- models


def test_build_model_loads_local_weights(tmp_path):
    from safetensors.torch import save_file

    kw = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=4)
    src = build_model("vit_tiny_patch16_224", num_classes=5, **kw)
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, tmp_path / "w.safetensors")
    torch.save({"state_dict": {f"module.{k}": v for k, v in src.state_dict().items()}}, tmp_path / "w.pt")
    for f in ("w.safetensors", "w.pt"):
        same = build_model("vit_tiny_patch16_224", num_classes=5, weights=tmp_path / f, **kw)
        for (n, a), (_, b) in zip(src.state_dict().items(), same.state_dict().items()):
            assert torch.equal(a, b), n
    # another class count: backbone loaded, head newly initialised
    other = build_model("vit_tiny_patch16_224", num_classes=3, weights=tmp_path / "w.safetensors", **kw)
    assert torch.equal(other.blocks[1].attn.qkv.weight, src.blocks[1].attn.qkv.weight)
    assert other.head.weight.shape == (3, 48)
    # a headless checkpoint (timm's in21k originals): backbone loaded, head newly initialised
    save_file({k: v.contiguous() for k, v in src.state_dict().items() if not k.startswith("head.")},
              tmp_path / "headless.safetensors")
    headless = build_model("vit_tiny_patch16_224", num_classes=4, weights=tmp_path / "headless.safetensors", **kw)
    assert torch.equal(headless.blocks[0].mlp.fc1.weight, src.blocks[0].mlp.fc1.weight)
    assert headless.head.weight.shape == (4, 48)


def test_weights_errors_name_file_and_keys(tmp_path):
    kw = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=4)
    src = build_model("vit_tiny_patch16_224", num_classes=5, **kw)
    state = src.state_dict()
    state.pop("blocks.1.norm1.weight")
    state["extra.weight"] = torch.zeros(1)
    torch.save(state, tmp_path / "bad.pth")
    with pytest.raises(WeightsError, match=r"bad.pth.*missing keys \['blocks.1.norm1.weight'\].*unexpected keys"):
        load_weights(build_model("vit_tiny_patch16_224", num_classes=5, **kw), tmp_path / "bad.pth")
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        build_model("vit_tiny_patch16_224", weights=tmp_path / "nope.safetensors", **kw)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(WeightsError, match="junk.pt"):
        build_model("vit_tiny_patch16_224", weights=tmp_path / "junk.pt", **kw)
    with pytest.raises(ValueError, match="unknown timm model 'vit_nonexistent'"):
        build_model("vit_nonexistent")
