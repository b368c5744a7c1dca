"""LoRA through peft on a timm ViT: counts, merged == unmerged after training, frozen weights untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raystudy.core.components import head_parameters
from raystudy.core.expressions import resolve
from raystudy.core.lora import apply_lora, is_lora, lora_parameters
from raystudy.core.peft_methods import merge, target_modules
from tests.support.models import tiny_vit

D, H, DEPTH = 48, 192, 3  # tiny_vit


def _adapted(rank=4, targets=("proj", "qkv"), seed=0):
    torch.manual_seed(0)
    model = tiny_vit()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = apply_lora(model, rank, targets, seed=seed)
    for n, p in model.named_parameters():  # what select_and_freeze does: the adapters and the head train
        p.requires_grad_(n in {m for m, _ in params} or n.startswith("head."))
    return model, original, params


def _train(model, steps=5):
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model.train()
    for _ in range(steps):
        x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def test_targets_and_counts():
    model = tiny_vit()
    assert target_modules(model) == [f"blocks.{i}.attn.{t}" for i in range(DEPTH) for t in ("qkv", "proj")]
    r = 4
    params = apply_lora(model, r)
    # per block: qkv A (4, 48) + B (144, 4); proj A (4, 48) + B (48, 4)
    assert sum(p.numel() for _, p in params) == DEPTH * (r * (D + 3 * D) + r * (D + D)) == 3 * 1_152
    assert [n for n, _ in params] == [n for n, _ in lora_parameters(model)]
    assert all(p.requires_grad for _, p in params)
    assert "blocks.0.attn.qkv.base_layer.weight" in dict(model.named_parameters())


def test_other_targets_through_an_expression():
    model = tiny_vit()
    resolved = resolve(model, "lora:r=2:fc1,qkv")
    assert resolved.configuration == "lora:r=2:fc1,qkv" and resolved.units == ()
    assert resolved.num_parameters == DEPTH * (2 * (D + H) + 2 * (D + 3 * D))  # fc1: 48 -> 192; qkv: 48 -> 144
    with pytest.raises(ValueError, match="name no linear layer"):
        apply_lora(tiny_vit(), 2, ("qkvv",))
    with pytest.raises(ValueError, match="already has peft adapters"):
        apply_lora(model, 2)


def test_init_is_seeded_and_starts_at_the_base_model():
    a, _, pa = _adapted(seed=3)
    b, _, pb = _adapted(seed=3)
    c, _, pc = _adapted(seed=4)
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(pa, pb))
    assert not torch.equal(pa[0][1], pc[0][1])  # lora_A differs across seeds
    torch.manual_seed(0)
    base = tiny_vit()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():  # B = 0: the adapted model computes exactly the base model
        assert torch.equal(a.eval()(x), base.eval()(x))


def test_merged_equals_unmerged_after_training_and_frozen_weights_untouched():
    model, original, params = _adapted(rank=4)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    head_before = {n: p.detach().clone() for n, p in head_parameters(model)}
    _train(model)
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n  # bit-identical
    # ... and equal to the original model's weights under their original names
    for n, p in frozen.items():
        assert torch.equal(p, original[n.replace(".base_layer.", ".")]), n
    assert any(".lora_B." in n and p.abs().max() > 0 for n, p in params)  # the adapters did train
    assert not torch.equal(dict(model.named_parameters())["head.weight"], head_before["head.weight"])

    merged = merge(model)
    assert not is_lora(merged) and is_lora(model)
    assert list(merged.state_dict()) == list(tiny_vit().state_dict())  # a plain timm model's names
    named = dict(model.named_parameters())
    for i in range(DEPTH):  # W + (alpha / r) B A with alpha = r
        key = f"blocks.{i}.attn.qkv"
        want = named[f"{key}.base_layer.weight"] + named[f"{key}.lora_B.default.weight"] @ named[
            f"{key}.lora_A.default.weight"]
        assert torch.allclose(merged.state_dict()[f"{key}.weight"], want, atol=1e-6)
    x = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        out, out_merged, out_before = model(x), merged.eval()(x), tiny_vit_with(original)(x)
    assert (out - out_merged).abs().max() <= 1e-5
    assert not torch.allclose(out, out_before, atol=1e-3)  # training changed the function


def tiny_vit_with(state):
    model = tiny_vit()
    model.load_state_dict(state)
    return model.eval()
