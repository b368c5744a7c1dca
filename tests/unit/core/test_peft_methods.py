"""The PEFT family (LoRA, DoRA, LoHa, LoKr, VeRA, IA3) and BitFit as configurations: exact counts on
vit_base_patch16_224, merged == unmerged after training, frozen weights bit-identical, seeded init, merged
weights against their formulas, plain-timm exports and exact resume after an injected worker failure."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from raystudy.core.expressions import ExpressionError, bias_parameters, resolve
from raystudy.core.finetune import FinetuneConfig, build_finetune_model, train_local
from raystudy.core.finetune.driver import InjectedFailure
from raystudy.core.peft_methods import METHODS, adapted_layers, is_adapted, merge
from raystudy.distributed.inprocess import run_in_process
from raystudy.distributed.train import TrainResources
from tests.support.models import tiny_vit
from tests.support.stores import make_store
from tests.unit.core.test_lora import _train  # seeded SGD steps of the trainable parameters on random images

# ------------------------------------------------------------------------------------------- vit_base counts
# vit_base_patch16_224: d = 768, 12 blocks, MLP hidden 3072; qkv 768 -> 2304, proj 768 -> 768, fc2 3072 -> 768.
D, QKV, HID, BLOCKS = 768, 3 * 768, 3072, 12
LORA8 = 8 * (D + QKV) + 8 * (D + D)  # A (8, in) + B (out, 8) on qkv and proj: 24,576 + 12,288
PER_BLOCK = {
    "lora:r=8": LORA8,  # 36,864
    "dora:r=8": LORA8 + QKV + D,  # LoRA's plus the magnitude vectors m (out) of qkv and proj: 39,936
    "loha:r=8": 2 * LORA8,  # two (B_i, A_i) pairs per layer: 73,728
    # LoKr r=8: W1 (out_l, in_m) kron (B2 (out_k, 8) A2 (8, in_n)); peft factors 768 = 24 * 32 and
    # 2304 = 48 * 48; qkv (out 48*48, in 24*32): W1 48*24 + B2 48*8 + A2 8*32 = 1,792;
    # proj (out 24*32, in 24*32): W1 24*24 + B2 32*8 + A2 8*32 = 1,088
    "lokr:r=8": (48 * 24 + 48 * 8 + 8 * 32) + (24 * 24 + 32 * 8 + 8 * 32),  # 2,880
    "vera:r=256": (QKV + 256) + (D + 256),  # lambda_b (out) + lambda_d (r) per layer: 3,584
    "ia3": QKV + HID,  # qkv's output scaled (2304), fc2's input (the 3072-wide hidden activation): 5,376
    # BitFit: norm1 768 + qkv 2304 + proj 768 + norm2 768 + fc1 3072 + fc2 768 = 8,448 (+ patch_embed 768 once)
    "bias": D + QKV + D + D + HID + D,
}


@pytest.fixture(scope="module")
def vit_base_meta():
    import timm

    def build():
        with torch.device("meta"):  # shapes only, no weights
            return timm.create_model("vit_base_patch16_224", num_classes=10)

    return build


@pytest.mark.parametrize("expr", sorted(PER_BLOCK))
def test_counts_on_vit_base(vit_base_meta, expr):
    expected = BLOCKS * PER_BLOCK[expr] + (D if expr == "bias" else 0)
    assert resolve(vit_base_meta(), expr).num_parameters == expected


def test_the_stated_figures():
    assert [PER_BLOCK[k] for k in ("lora:r=8", "dora:r=8", "loha:r=8", "lokr:r=8", "vera:r=256", "ia3", "bias")] \
        == [36_864, 39_936, 73_728, 2_880, 3_584, 5_376, 8_448]
    assert BLOCKS * PER_BLOCK["bias"] + D == 102_144


def test_bias_only_blocks(vit_base_meta):
    r = resolve(vit_base_meta(), "bias@8-11")
    assert r.num_parameters == 4 * PER_BLOCK["bias"] == 33_792
    assert {n.split(".")[1] for n in r.names} == {"8", "9", "10", "11"} and r.units == ()


# ------------------------------------------------------------------------------------------------ a tiny ViT
# tiny_vit: d = 48, 3 blocks, 4 heads, MLP 192, 10 classes
CASES = {"lora": "lora:r=4", "dora": "dora:r=4", "loha": "loha:r=4", "lokr": "lokr:r=4", "vera": "vera:r=16",
         "ia3": "ia3", "bias": "bias"}
d, L = 48, 3
TINY_COUNTS = {
    "lora": L * (4 * (d + 3 * d) + 4 * (d + d)),
    "dora": L * (4 * (d + 3 * d) + 4 * (d + d) + 3 * d + d),
    "loha": L * 2 * (4 * (d + 3 * d) + 4 * (d + d)),
    # 48 = 6 * 8, 144 = 12 * 12; qkv: W1 12*6 + B2 12*4 + A2 4*8 (4 < max(12, 8) / 2); proj: W1 6*6 + full W2
    # 8*8 (r = 4 is not below max(8, 8) / 2)
    "lokr": L * ((12 * 6 + 12 * 4 + 4 * 8) + (6 * 6 + 8 * 8)),
    "vera": L * ((3 * d + 16) + (d + 16)),
    "ia3": L * (3 * d + 4 * d),
    "bias": L * (d + 3 * d + d + d + 4 * d + d) + d,
}


def _prepared(name, seed=0):
    """(model, its parameters before, the configuration's trainable parameters): what select_and_freeze does."""
    torch.manual_seed(0)
    model = tiny_vit()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = resolve(model, CASES[name], seed=seed).parameters
    chosen = {n for n, _ in params}
    for n, p in model.named_parameters():
        p.requires_grad_(n in chosen or n.startswith("head."))
    return model, before, params


def _plain(name: str) -> str:
    return name.replace(".base_layer.", ".")


@pytest.mark.parametrize("name", sorted(CASES))
def test_counts_seeded_init_starts_at_the_base_model(name):
    model, before, params = _prepared(name, seed=3)
    assert sum(p.numel() for _, p in params) == TINY_COUNTS[name]
    again = _prepared(name, seed=3)[2]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(params, again))
    if name in ("lora", "dora", "loha", "lokr"):  # a randomly drawn factor: another seed draws another
        assert any(not torch.equal(a, b) for (_, a), (_, b) in zip(params, _prepared(name, seed=4)[2]))
    other = tiny_vit()
    torch.manual_seed(5)
    resolve(other, CASES[name], seed=3)
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(3))  # the global RNG is where the caller left it (fork_rng)
    base = tiny_vit()
    base.load_state_dict(before)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(model.eval()(x), base.eval()(x), atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_merged_equals_unmerged_and_frozen_weights_are_bit_identical(name):
    model, before, params = _prepared(name)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    _train(model, steps=4)
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
            assert torch.equal(p, before[_plain(n)]), n  # the pretrained value under its plain name
    trained = [n for n, p in params if not torch.equal(p, before.get(n, torch.full_like(p, float("nan"))))]
    assert trained  # the method's parameters moved
    merged = merge(model)
    assert not is_adapted(merged) and is_adapted(model) == (name != "bias")
    assert list(merged.state_dict()) == list(tiny_vit().state_dict())  # a plain timm model's names
    x = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        out, out_merged = model(x), merged.eval()(x)
    assert (out - out_merged).abs().max() <= 1e-5
    base = tiny_vit()
    base.load_state_dict(before)
    with torch.no_grad():
        assert not torch.allclose(out, base.eval()(x), atol=1e-3)  # training changed the function


def test_merged_weights_follow_the_formulas():
    """IA3 and DoRA merged weights computed here from their definitions (not through peft)."""
    model, before, _ = _prepared("ia3")
    _train(model, steps=4)
    named, merged = dict(model.named_parameters()), merge(model).state_dict()
    for i in range(L):
        qkv, fc2 = f"blocks.{i}.attn.qkv", f"blocks.{i}.mlp.fc2"
        l_qkv = named[f"{qkv}.ia3_l.default"].reshape(-1)  # (144,): scales the output rows, bias too
        l_fc2 = named[f"{fc2}.ia3_l.default"].reshape(-1)  # (192,): scales fc2's input columns
        assert l_qkv.shape == (3 * d,) and l_fc2.shape == (4 * d,)
        torch.testing.assert_close(merged[f"{qkv}.weight"], l_qkv[:, None] * before[f"{qkv}.weight"])
        torch.testing.assert_close(merged[f"{qkv}.bias"], l_qkv * before[f"{qkv}.bias"])
        torch.testing.assert_close(merged[f"{fc2}.weight"], before[f"{fc2}.weight"] * l_fc2[None, :])
        torch.testing.assert_close(merged[f"{fc2}.bias"], before[f"{fc2}.bias"])
    model, before, _ = _prepared("dora")
    _train(model, steps=4)
    named, merged = dict(model.named_parameters()), merge(model).state_dict()
    for i in range(L):
        key = f"blocks.{i}.attn.proj"
        adapted = before[f"{key}.weight"] + named[f"{key}.lora_B.default.weight"] @ named[
            f"{key}.lora_A.default.weight"]  # W + B A (scaling 1)
        m = named[f"{key}.lora_magnitude_vector.default.weight"]  # (48,): one magnitude per output row
        want = m[:, None] * adapted / adapted.norm(dim=1, keepdim=True)
        torch.testing.assert_close(merged[f"{key}.weight"], want, atol=1e-6, rtol=1e-5)


def test_bias_selection_and_adapter_errors():
    model = tiny_vit()
    names = [n for n, _ in bias_parameters(model)]
    want = ["patch_embed.proj.bias"] + [f"blocks.{i}.{m}.bias" for i in range(L) for m in (
        "norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2")]
    assert names == want  # the head's and the final norm's biases are not BitFit's
    union = resolve(model, "bias+LN1+LN2")
    assert union.num_parameters == TINY_COUNTS["bias"] + L * 2 * d  # LN weights added; their biases once
    assert resolve(model, "bias@1").names == [f"blocks.1.{m}.bias" for m in (
        "norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2")]
    with pytest.raises(ValueError, match="out of range"):
        resolve(model, "bias@3")
    with pytest.raises(ExpressionError) as info:
        resolve(tiny_vit(), "ia3:nonexistent")
    assert info.value.position == 4 and str(info.value).endswith("  ia3:nonexistent\n      ^")
    with pytest.raises(ExpressionError) as info:
        resolve(tiny_vit(), "vera:r=8:fc1,qkvv")
    assert info.value.position == 13 and "['qkvv']" in str(info.value)


def test_registry_markers_are_pefts_own_names():
    """Every marker names a tensor peft's layer of that method holds (``adapter_layer_names``)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, m in METHODS.items():
        model = tiny_vit()
        resolve(model, CASES[name])
        layer = next(x for x in model.modules() if isinstance(x, BaseTunerLayer))
        assert set(m.markers) <= set(layer.adapter_layer_names), name
        assert adapted_layers(n for n, p in model.named_parameters() if p.requires_grad) == sorted(
            f"blocks.{i}.{t}" for i in range(L) for t in (
                ("attn.qkv", "mlp.fc2") if name == "ia3" else ("attn.proj", "attn.qkv")))


# ----------------------------------------------------------------------------------- runs: export and resume
@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("peft") / "store", n_per_split=(24, 8, 12))


def _cfg(store, out, configuration, **kw) -> FinetuneConfig:
    base = dict(model="vit_tiny_patch16_224", model_kwargs=dict(patch_size=8, embed_dim=48, depth=3, num_heads=4),
                img_size=32, store=store, out_dir=str(out), configuration=configuration, steps=6, batch_size=8,
                eval_period=2, log_period=1, lr=0.2, checkpoint_period=2, shuffle=True, augment=True, seed=3,
                save_final=True)
    base.update(kw)
    return FinetuneConfig(**base)


@pytest.mark.parametrize("name", sorted(CASES))
def test_exported_weights_are_the_merged_model_under_plain_names(store, tmp_path, name):
    cfg = _cfg(store, tmp_path, CASES[name])
    plain = build_finetune_model(cfg, 10)  # the pretrained (here: seeded) model the run starts from
    start = {n: t.detach().clone() for n, t in plain.state_dict().items()}
    summary, ft = train_local(cfg, tensorboard=False)
    assert summary["trainable_params"] == TINY_COUNTS[name] + d * 10 + 10 and summary["units"] == CASES[name]
    best = load_file(tmp_path / "best_trainable.safetensors")
    assert set(best) <= set(start)  # plain timm names only
    plain.load_state_dict({**start, **best})
    x = torch.randn(12, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), ft.trainable_set_to(ft.best_state):
        ft.model.eval()
        unmerged = ft.model(x)
    with torch.no_grad():
        assert (plain.eval()(x) - unmerged).abs().max() <= 1e-5
        plain.load_state_dict(load_file(tmp_path / "final_model.safetensors"))
        assert (plain(x) - ft.model.eval()(x)).abs().max() <= 1e-5


RESULTS = ("status", "best_val_acc", "best_val_step", "test_acc", "final_val_loss", "final_train_loss",
           "steps_completed", "trainable_params", "units")


@pytest.mark.parametrize("name", sorted(CASES))
def test_resume_after_a_worker_failure_is_exact(store, tmp_path, faults, name):
    """The run fails after its step-3 report (checkpoint at 2) and resumes from its checkpoint: the same
    curves, results and final merged weights as the uninterrupted run, bit for bit."""
    res = TrainResources(cpus_per_worker=1, cleanup_checkpoints=False)
    ref = run_in_process(_cfg(store, tmp_path / "ref", CASES[name]), res, storage=str(tmp_path / "c_ref"))
    faults(fail_after_step={"run": 3})
    cfg = _cfg(store, tmp_path / "run", CASES[name])
    with pytest.raises(InjectedFailure):
        run_in_process(cfg, res, storage=str(tmp_path / "c_run"))
    torch.manual_seed(999)  # the resumed run owes nothing to the caller's RNG
    resumed = run_in_process(cfg, res, storage=str(tmp_path / "c_run"))
    assert resumed["num_restores"] == 1 and resumed["restored_from_step"] == 2
    assert {k: resumed[k] for k in RESULTS} == {k: ref[k] for k in RESULTS}
    a, b = (pd.read_parquet(tmp_path / x / "curves.parquet").drop(columns="images_per_s") for x in ("ref", "run"))
    pd.testing.assert_frame_equal(a, b)
    fa, fb = (load_file(tmp_path / x / "final_model.safetensors") for x in ("ref", "run"))
    assert set(fa) == set(fb)
    assert all(torch.equal(fa[n], fb[n]) for n in fa)


@pytest.mark.parametrize("name", sorted(CASES))
def test_dry_run_counts_every_method_on_the_meta_device(name):
    """raystudy.study.cost builds the model on the meta device and selects through select_and_freeze: every
    method injects there (peft moves VeRA's CPU-drawn projections to the layer's device) and is counted."""
    from raystudy.study.cost import image_flops

    kw = dict(model_kwargs=dict(patch_size=8, embed_dim=48, depth=3, num_heads=4), img_size=32)
    head = image_flops("vit_tiny_patch16_224", "Head", **kw)
    counted = image_flops("vit_tiny_patch16_224", CASES[name], **kw)
    assert counted.device == "meta" and counted.note == ""
    assert counted.forward >= head.forward and counted.backward > head.backward
