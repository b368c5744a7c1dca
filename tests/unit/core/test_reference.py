"""The literal plasticity reference against timm's own forward, and the adapters and the fast path against both.

Three independent routes to the same numbers: timm's ``forward_features``; the reference
(:mod:`raystudy.core.plasticity_reference`, built from the model's modules, no adapter); the adapters
(``embed`` + ``run_blocks``) with the fast path on top. Each pair of routes is compared here, and two
planted adapter bugs are shown to be caught.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from raystudy.core.components import TimmBeitAdapter, TimmViTAdapter, get_adapter
from raystudy.core.plasticity import pair_rates
from raystudy.core.plasticity_reference import pair_rates_reference, reference_blocks, reference_tokens
from raystudy.vocab import COMPONENTS, MODES
from tests.support.families import MODELS, VARIANTS, beit, clip_style, images, randomize_norms

TOL = dict(rtol=1e-5, atol=1e-5)  # float32 forwards of the same modules in another order


def model_of(variant: str) -> nn.Module:
    torch.manual_seed(0)
    return randomize_norms(VARIANTS[variant]()).eval()


def rates_close(model, x, y, mode) -> bool:
    fast = pair_rates(model, x, y, mode=mode)
    ref = pair_rates_reference(model, x, y, mode=mode)
    merged = fast.merge(ref, on=["pair", "layer", "component"], suffixes=("", "_ref"))
    assert len(merged) == len(fast) == x.shape[0] * len(model.blocks) * len(COMPONENTS)
    return bool(np.allclose(merged["rate"], merged["rate_ref"], rtol=1e-5, atol=0))


# --------------------------------------------------------------------------------- fast path vs reference


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("mode", MODES)
def test_pair_rates_match_reference(family, mode):
    model = model_of(family)
    x, y = images(6, 1), images(6, 2)
    fast = pair_rates(model, x, y, mode=mode)
    assert list(fast.columns) == ["pair", "layer", "component", "rate"]
    assert (fast["rate"] > 0).all()
    assert rates_close(model, x, y, mode)


# --------------------------------------------------------------------------------- against timm's forward


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_adapter_embed_and_run_blocks_reproduce_forward_features(variant):
    """``norm(run_blocks(embed(x)))`` equals timm's ``forward_features(x)`` (which ends with ``norm``)."""
    model = model_of(variant)
    x = images(3, 5)
    adapter = get_adapter(model)
    with torch.no_grad():
        got = model.norm(adapter.run_blocks(adapter.embed(x)))
        expected = model.forward_features(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_reference_reproduces_forward_features_and_its_component_inputs(variant):
    """The reference's tokens and step-by-step blocks give timm's output, and in hidden mode every component
    sees exactly the input and output it has inside timm's own forward (captured with forward hooks)."""
    model = model_of(variant)
    x = images(3, 6)
    seen = [{} for _ in model.blocks]
    hooks = []
    for layer, blk in enumerate(model.blocks):
        modules = {"LN1": blk.norm1, "MHA": blk.attn, "LN2": blk.norm2, "FC1": blk.mlp.fc1, "FC2": blk.mlp.fc2}
        for name, module in modules.items():
            def keep(mod, args, out, layer=layer, name=name):
                seen[layer][name] = (args[0].detach().double().numpy(), out.detach().double().numpy())

            hooks.append(module.register_forward_hook(keep))
    try:
        with torch.no_grad():
            expected = model.forward_features(x)
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        final, records = reference_blocks(model, reference_tokens(model, x))
        torch.testing.assert_close(model.norm(final), expected, **TOL)
    for layer, rec in enumerate(records):
        for name in COMPONENTS:
            for got, want in zip(rec[name], seen[layer][name]):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{variant} {layer} {name}")


# --------------------------------------------------------------------------------- planted adapter bugs


def test_an_adapter_embedding_bug_is_caught(monkeypatch):
    """An adapter that forgets ``norm_pre`` disagrees with timm and with the reference."""
    model = model_of("clip-style")
    x, y = images(4, 7), images(4, 8)
    assert rates_close(model, x, y, "embedding")

    def embed_without_norm_pre(self, images):
        m = self.model
        return m.patch_drop(m._pos_embed(m.patch_embed(images)))

    monkeypatch.setattr(TimmViTAdapter, "embed", embed_without_norm_pre)
    assert not rates_close(model, x, y, "embedding")
    assert not rates_close(model, x, y, "hidden")
    with torch.no_grad():
        adapter = get_adapter(model)
        assert not torch.allclose(model.norm(adapter.run_blocks(adapter.embed(x))), model.forward_features(x),
                                  **TOL)


def test_an_adapter_attention_bug_is_caught(monkeypatch):
    """An adapter that drops BEiT's shared relative position bias disagrees with the reference in MHA."""
    model = randomize_norms(beit(shared=True)).eval()
    x, y = images(4, 9), images(4, 10)
    assert rates_close(model, x, y, "embedding")
    monkeypatch.setattr(TimmBeitAdapter, "attention_kwargs", lambda self: {"shared_rel_pos_bias": None})
    assert not rates_close(model, x, y, "embedding")
    assert not rates_close(model, x, y, "hidden")


# --------------------------------------------------------------------------------- the reference's own checks


def test_reference_rejects_what_it_does_not_implement():
    with pytest.raises(TypeError, match="VisionTransformer and Beit"):
        pair_rates_reference(nn.Sequential(nn.Linear(3, 3)), images(2, 1), images(2, 2))
    with pytest.raises(ValueError, match="mode: unknown value 'layer'"):
        pair_rates_reference(clip_style(), images(2, 1), images(2, 2), mode="layer")
