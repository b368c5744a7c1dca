"""What finetuning changed (issue #23 item 3, its measures): the relative weight change per (component, block)
and the linear CKA of block outputs, against independent computations on a toy ViT: CKA by the kernel (HSIC)
formula, CKA of identical features and of a model and itself after zero steps is 1 in every block, the weight
change of a frozen component is 0 and that of a trained one is its hand-computed norm ratio."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import timm
import torch

from raystudy.core.change import component_parameters, linear_cka, representation_cka, weight_change
from raystudy.core.finetune import FinetuneConfig, Finetuner
from tests.support.models import STUDY_MODEL, STUDY_TINY
from tests.support.stores import make_store


def _toy() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(STUDY_MODEL, img_size=32, num_classes=10, **STUDY_TINY).eval()


def cka_by_kernels(x: np.ndarray, y: np.ndarray) -> float:
    """HSIC form: tr(K H L H) / sqrt(tr(K H K H) tr(L H L H)), K = X X^T, L = Y Y^T, H = I - 11^T / n."""
    n = len(x)
    h = np.eye(n) - np.ones((n, n)) / n
    k, l_ = x @ x.T, y @ y.T

    def hsic(a, b):
        return np.trace(a @ h @ b @ h)

    return hsic(k, l_) / np.sqrt(hsic(k, k) * hsic(l_, l_))


def test_linear_cka_is_the_kernel_formula_and_invariant():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(30, 5)), rng.normal(size=(30, 7))
    assert linear_cka(torch.tensor(x), torch.tensor(y)) == pytest.approx(cka_by_kernels(x, y), abs=1e-12)
    q, _ = np.linalg.qr(rng.normal(size=(5, 5)))
    assert linear_cka(torch.tensor(x), torch.tensor(3.0 * x @ q + 2.0)) == pytest.approx(1.0, abs=1e-12)
    assert linear_cka(torch.tensor(x), torch.tensor(x)) == pytest.approx(1.0, abs=1e-12)
    with pytest.raises(ValueError, match="30 and 29 samples"):
        linear_cka(torch.tensor(x), torch.tensor(y[:29]))


def test_a_model_and_itself_after_zero_steps_have_cka_one_in_every_block():
    model = _toy()
    images = torch.randn(6, 3, 32, 32)
    rows = representation_cka(model, copy.deepcopy(model), images)
    assert [r["block"] for r in rows] == [0, 1, 2] and all(r["cka"] == pytest.approx(1.0, abs=1e-6) for r in rows)
    other = _toy()
    with torch.no_grad():
        other.blocks[2].mlp.fc2.weight.mul_(-3.0)
    moved = representation_cka(model, other, images)
    assert moved[0]["cka"] == pytest.approx(1.0, abs=1e-6) and moved[1]["cka"] == pytest.approx(1.0, abs=1e-6)
    assert moved[2]["cka"] < 0.999  # only the last block's output moved


def test_weight_change_by_hand_and_zero_for_what_did_not_train(tmp_path):
    model = _toy()
    names = component_parameters(model)
    assert names[("MHA", 1)] == ["blocks.1.attn.qkv.weight", "blocks.1.attn.qkv.bias", "blocks.1.attn.proj.weight",
                                 "blocks.1.attn.proj.bias"]
    assert names[("LN1", 0)] == ["blocks.0.norm1.weight", "blocks.0.norm1.bias"]
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    final = {k: v.clone() for k, v in initial.items()}
    final["blocks.1.attn.proj.weight"] += 0.1
    rows = {(r["component"], r["block"]): r["change"] for r in weight_change(model, initial, final)}
    w0 = torch.cat([initial[n].double().flatten() for n in names[("MHA", 1)]])
    delta = 0.1 * initial["blocks.1.attn.proj.weight"].numel() ** 0.5
    assert rows[("MHA", 1)] == pytest.approx(delta / float(w0.norm()), rel=1e-6)  # float32 weights + 0.1
    assert all(v == 0.0 for k, v in rows.items() if k != ("MHA", 1)) and len(rows) == 5 * 3

    store = make_store(tmp_path / "store", n_per_split=(16, 8, 8))
    ft = Finetuner(FinetuneConfig(model=STUDY_MODEL, model_kwargs=STUDY_TINY, img_size=32, store=store,
                                  out_dir=str(tmp_path / "run"), steps=3, batch_size=8, eval_period=3,
                                  configuration="MHA", lr=0.1))
    start = {k: v.clone() for k, v in ft.model.state_dict().items()}
    ft.run()
    trained = {(r["component"], r["block"]): r["change"] for r in weight_change(ft.model, start, ft.model.state_dict())}
    assert all(trained[("MHA", b)] > 0 for b in range(3))
    assert all(v == 0.0 for (c, _), v in trained.items() if c != "MHA")  # frozen: bit-identical weights


def test_cka_to_start_is_the_two_model_cka_and_leaves_the_model_as_it_was():
    """The one-model measure (start values swapped in block by block) equals representation_cka of a second
    model holding the start values; the model's parameters and training mode are its own again after."""
    from raystudy.core.change import cka_to_start, holding

    model, images = _toy().train(), torch.randn(5, 3, 32, 32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    start = {n: p.detach().clone() + 0.05 * torch.randn_like(p) for n, p in model.named_parameters()
             if n.startswith(("blocks.1.", "blocks.2.mlp", "pos_embed", "patch_embed"))}
    rows = cka_to_start(model, images, start)
    pretrained = copy.deepcopy(model)
    pretrained.load_state_dict({**before, **start})
    expected = representation_cka(pretrained, copy.deepcopy(model), images)
    assert [r["cka"] for r in rows] == pytest.approx([r["cka"] for r in expected], abs=1e-9)
    assert all(r["cka"] < 0.9999 for r in rows)  # the embedding moved: every block's output differs
    assert model.training and all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert [r["cka"] for r in cka_to_start(model, images, {})] == pytest.approx([1.0] * 3, abs=1e-12)
    with pytest.raises(RuntimeError, match="boom"), holding(model, start):
        raise RuntimeError("boom")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
