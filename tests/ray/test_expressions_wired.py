"""Configuration expressions wired into finetuning and the study: combinations, budgets and LoRA trained by
``train_local``; exactly the selected parameters change, LoRA runs save merged plain-timm weights and resume
exactly, budgets resolve once per trial into ``FinetuneConfig.selection``."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from raystudy.core.finetune import FinetuneConfig, Finetuner, build_finetune_model, train_local
from raystudy.vocab import COMPONENTS
from tests.support.runs import kill_at_first_checkpoint
from tests.support.stores import make_store

TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4)
D, H, L, C = 48, 192, 3, 10
# per block: LN1 2D, MHA qkv D*3D + 3D and proj D*D + D, LN2 2D, FC1 D*H + H, FC2 H*D + D
SIZES = {"LN1": 2 * D, "MHA": D * 3 * D + 3 * D + D * D + D, "LN2": 2 * D, "FC1": D * H + H, "FC2": H * D + D}
HEAD = D * C + C


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("wired") / "store", n_per_split=(24, 8, 12))


def tiny_cfg(store, out, **kw) -> FinetuneConfig:
    base = dict(model="vit_tiny_patch16_224", model_kwargs=TINY, img_size=32, store=store, out_dir=str(out),
                steps=4, batch_size=8, eval_period=2, log_period=1, lr=0.1, shuffle=False, augment=False)
    base.update(kw)
    return FinetuneConfig(**base)


def initial_state(cfg: FinetuneConfig) -> dict[str, torch.Tensor]:
    """The run's model before training: built with the same seed (the head too), no selection applied."""
    model = build_finetune_model(cfg, C)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def changed(before: dict, after: dict) -> set[str]:
    return {n for n in before if not torch.equal(before[n], after[n])}


def unit_names(units) -> set[str]:
    """Parameter names of (component, block) units of the tiny ViT, written out here independently."""
    paths = {"LN1": ["norm1.weight", "norm1.bias"],
             "MHA": ["attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias"],
             "LN2": ["norm2.weight", "norm2.bias"], "FC1": ["mlp.fc1.weight", "mlp.fc1.bias"],
             "FC2": ["mlp.fc2.weight", "mlp.fc2.bias"]}
    return {f"blocks.{b}.{p}" for c, b in units for p in paths[c]}


# ---------------------------------------------------------------------------------------------------
# Validation and the CLI
# ---------------------------------------------------------------------------------------------------


def test_config_validates_expressions_and_selection(store, tmp_path):
    for ok in ("MHA@1-2+FC1", "lora:r=4", "random:30%", "All", "FC1@0,2"):
        tiny_cfg(store, tmp_path, configuration=ok).validate()
    tiny_cfg(store, tmp_path, configuration="auto:30%", selection="MHA@1+FC1@2").validate()
    with pytest.raises(ValueError, match=r"(?s)unknown name 'Attn'.*\n  MHA\+Attn\n      \^"):
        tiny_cfg(store, tmp_path, configuration="MHA+Attn").validate()
    with pytest.raises(ValueError, match="auto:<budget> needs `selection`"):
        tiny_cfg(store, tmp_path, configuration="auto:30%").validate()
    with pytest.raises(ValueError, match="only a budget .auto:, random:, a criterion. has a selection"):
        tiny_cfg(store, tmp_path, configuration="MHA", selection="FC1").validate()
    with pytest.raises(ValueError, match="expected a combination"):
        tiny_cfg(store, tmp_path, configuration="random:5%", selection="lora:r=2").validate()
    cfg = tiny_cfg(store, tmp_path, configuration="auto:30%", selection="MHA@1")
    assert FinetuneConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # config.json round trip


def test_cli_accepts_expressions_and_prints_the_caret(store, tmp_path, capsys):
    from raystudy.cli import build_parser
    from raystudy.commands.finetune import config_from_args

    base = ["finetune", "--store", store, "--out", str(tmp_path)]
    for expr in ("MHA@8-11+FC1", "lora:r=4"):
        cfg, _ = config_from_args(build_parser().parse_args([*base, "--configuration", expr]))
        assert cfg.configuration == expr
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--configuration", "MHA@3-1"])
    err = capsys.readouterr().err
    assert "the range 3-1 is descending (position 6)" in err and "  MHA@3-1\n        ^" in err


# ---------------------------------------------------------------------------------------------------
# Training: exactly the selection changes
# ---------------------------------------------------------------------------------------------------


def test_a_combination_trains_exactly_its_units_and_the_head(store, tmp_path):
    cfg = tiny_cfg(store, tmp_path, configuration="MHA@1-2+FC1")
    before = initial_state(cfg)
    summary, ft = train_local(cfg, tensorboard=False)
    after = {n: p.detach() for n, p in ft.model.named_parameters()}
    units = [("MHA", 1), ("MHA", 2)] + [("FC1", b) for b in range(L)]
    want = unit_names(units) | {"head.weight", "head.bias"}
    assert changed(before, after) == want  # every other parameter bit-identical
    assert set(ft.trained.names) == want
    assert summary["trainable_params"] == 2 * SIZES["MHA"] + L * SIZES["FC1"] + HEAD == 47_530
    assert summary["units"] == "MHA@1-2+FC1" and summary["configuration"] == "MHA@1-2+FC1"


def plasticity_table(values: dict[tuple[str, int], float], dataset: str = "tiny", mode: str = "embedding"):
    rows = [{"model": "m", "dataset": dataset, "mode": mode, "layer": b, "component": c, "plasticity": v,
             "std": 0.0, "ci95": 0.0, "n_pairs": 4} for (c, b), v in values.items()]
    return pd.DataFrame(rows)


def test_auto_budget_resolved_by_the_study_job_trains_its_units(store, tmp_path):
    """``auto:28%`` through ``finetune_job`` with a constructed plasticity table: the units are packed in
    plasticity order (checked by hand below), recorded in ``selection`` and the summary, and trained alone."""
    from raystudy.study.jobs import finetune_job
    from raystudy.study.points import grid_point
    from raystudy.study.spec import StudySpec

    # All (head excluded) of the tiny ViT: embedding + blocks + final norm
    emb = 3 * 8 * 8 * D + D + D + 17 * D
    block = sum(SIZES.values())
    total = emb + L * block + 2 * D
    assert total == 95_040  # 10,128 + 3 * 28,272 + 96
    budget = total * 28 // 100  # 26,611: FC2@2 + MHA@2 (18,672) fit, FC1@0 (9,408 more) does not
    # plasticity: FC2 of block 2 highest, then MHA@2, FC1@0, then the rest small; a NaN unit never chosen
    values = {(c, b): 0.01 * (b + 1) + 0.001 * COMPONENTS.index(c) for c in COMPONENTS for b in range(L)}
    values.update({("FC2", 2): 9.0, ("MHA", 2): 8.0, ("FC1", 0): 7.0, ("LN1", 0): float("nan")})
    table = pd.concat([plasticity_table(values), plasticity_table({k: 100.0 for k in values}, dataset="other")])
    order = sorted([u for u in values if not np.isnan(values[u])], key=lambda u: (-values[u], u[1],
                                                                                     COMPONENTS.index(u[0])))
    chosen, used = [], 0
    for u in order:  # first fit, written out again
        if used + SIZES[u[0]] <= budget:
            chosen.append(u)
            used += SIZES[u[0]]
    assert chosen[:2] == [("FC2", 2), ("MHA", 2)] and ("FC1", 0) not in chosen  # FC1@0 did not fit any more

    spec = StudySpec(name="t", out=str(tmp_path / "study"), model="vit_tiny_patch16_224", model_kwargs=TINY,
                     img_size=32, weights=None, datasets={"tiny": store}, configurations=["auto:28%"],
                     optimizers={"sgd": [0.1]}, seeds=[0], steps=4, batch_size=8, eval_period=2, log_period=1,
                     warmup_steps=1, augment=False, shuffle=False)
    point = grid_point("tiny", "auto:28%", "sgd", 0.1, 0)
    cfg, _ = finetune_job(spec, point, str(tmp_path / "run"), plasticity=table)
    assert cfg.selection is not None
    cfg.validate()
    before = initial_state(cfg)
    summary, ft = train_local(cfg, tensorboard=False)
    after = {n: p.detach() for n, p in ft.model.named_parameters()}
    assert changed(before, after) == unit_names(chosen) | {"head.weight", "head.bias"}
    assert summary["trainable_params"] == used + HEAD and used <= budget
    assert summary["units"] == cfg.selection and summary["configuration"] == "auto:28%"
    assert json.loads((tmp_path / "run" / "config.json").read_text())["selection"] == cfg.selection


def test_random_budget_is_reproducible_per_seed(store, tmp_path):
    from raystudy.study.jobs import selection_of
    from raystudy.study.spec import StudySpec

    spec = StudySpec(name="t", out=str(tmp_path), model="vit_tiny_patch16_224", model_kwargs=TINY, img_size=32)
    picks = {s: selection_of(spec, tiny_cfg(store, tmp_path, configuration="random:30%", seed=s), "tiny")[0]
             for s in (0, 0, 1, 2, 3)}
    again = selection_of(spec, tiny_cfg(store, tmp_path, configuration="random:30%", seed=0), "tiny")[0]
    assert again == picks[0]
    assert len(set(picks.values())) > 1  # the seed changes the units
    # the run itself (no selection given) trains the units the study resolves for its seed
    ft = Finetuner(tiny_cfg(store, tmp_path, configuration="random:30%", seed=2))
    assert ft.trained.chosen == picks[2]
    assert selection_of(spec, tiny_cfg(store, tmp_path, configuration="MHA@1"), "tiny") == (None, {})


# ---------------------------------------------------------------------------------------------------
# LoRA: frozen base, merged plain-timm weights, exact resume
# ---------------------------------------------------------------------------------------------------


def lora_names(rank_layers=("qkv", "proj")) -> set[str]:
    return {f"blocks.{b}.attn.{t}.lora_{m}.default.weight" for b in range(L) for t in rank_layers for m in "AB"}


def test_lora_trains_the_adapters_and_head_and_saves_merged_plain_weights(store, tmp_path):
    from safetensors.torch import load_file

    cfg = tiny_cfg(store, tmp_path, configuration="lora:r=2", steps=6, eval_period=2, lr=0.3, save_final=True)
    before = initial_state(cfg)  # plain names: the LoRA-free model the run starts from
    summary, ft = train_local(cfg, tensorboard=False)
    after = {n.replace(".base_layer.", "."): p.detach() for n, p in ft.model.named_parameters()}
    assert set(ft.trained.names) == lora_names() | {"head.weight", "head.bias"}
    for n, t in before.items():  # the frozen base, bit-identical; only the head among them changed
        assert torch.equal(t, after[n]) or n.startswith("head."), n
    assert not torch.equal(before["head.weight"], after["head.weight"])
    assert all(after[n].abs().max() > 0 for n in lora_names() if ".lora_B." in n)  # B starts at 0, trained
    # qkv: A (2, 48) + B (144, 2); proj: A (2, 48) + B (48, 2); per block 576; plus the head
    assert summary["trainable_params"] == L * (2 * (D + 3 * D) + 2 * (D + D)) + HEAD == 2_218
    assert summary["units"] == "lora:r=2" and summary["status"] == "ok"

    best = load_file(tmp_path / "best_trainable.safetensors")
    adapted = {f"blocks.{b}.attn.{t}.weight" for b in range(L) for t in ("qkv", "proj")}
    assert set(best) == adapted | {"head.weight", "head.bias"}
    plain = build_finetune_model(cfg, C)  # a plain timm model: the pretrained state + the saved one
    plain.load_state_dict({**before, **best})
    x = torch.randn(12, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), ft.trainable_set_to(ft.best_state):
        ft.model.eval()
        unmerged = ft.model(x)
    with torch.no_grad():
        assert (plain.eval()(x) - unmerged).abs().max() <= 1e-5
    final = load_file(tmp_path / "final_model.safetensors")
    assert set(final) == set(before)  # the whole model, merged, under timm's names
    with torch.no_grad():
        plain.load_state_dict(final)
        assert (plain(x) - ft.model(x)).abs().max() <= 1e-5


def test_lora_resume_is_exact(store, tmp_path):
    """Killed after its checkpoint at step 4, a resumed LoRA run reproduces the uninterrupted one bitwise
    (adapters, head, curves, summary) and its adapters come from the checkpoint, not a fresh init."""
    kw = dict(configuration="lora:r=2:fc1,qkv", optimizer="adamw", lr=3e-3, steps=8, eval_period=3,
              checkpoint_period=4, shuffle=True, augment=True, batch_size=6, seed=5)
    ref, ref_ft = train_local(tiny_cfg(store, tmp_path / "ref", **kw), tensorboard=False)

    cfg = tiny_cfg(store, tmp_path / "run", **kw)
    ckdir = tmp_path / "run" / "ckpt"
    first = Finetuner(cfg)

    kill_at_first_checkpoint(first, ckdir)
    assert first.step == 4
    torch.manual_seed(999)
    summary, ft = train_local(cfg, checkpoint_dir=ckdir, resume=True, tensorboard=False)
    assert ft.restores[0]["step"] == 4 and summary["num_restores"] == 1
    names = {n for n, _ in ref_ft.trained.trainable}
    assert any(".mlp.fc1.lora_A." in n for n in names)  # FC1 wrapped: the registry still finds the blocks
    assert names == set(ft.trained.names)
    for a, b in zip(ref_ft.curves, ft.curves):
        assert {k: v for k, v in a.items() if k != "images_per_s"} == {k: v for k, v in b.items()
                                                                         if k != "images_per_s"}
    ref_params, params = dict(ref_ft.model.named_parameters()), dict(ft.model.named_parameters())
    assert set(ref_params) == set(params)
    for n in ref_params:  # every parameter, frozen base included
        assert torch.equal(ref_params[n], params[n]), n
    for k in ("best_val_acc", "best_val_step", "test_acc", "final_val_loss", "trainable_params", "units"):
        assert summary[k] == ref[k]


#: the method the Ray Train resume below runs (about 80 s on two cores): VeRA, whose frozen projections are
#: shared by every layer as buffers that DDP broadcasts, the one thing an adapter adds on this path. LoRA's and
#: the others' adapters are injected, wrapped by DDP and checkpointed the same way; every method's exact resume
#: after an injected failure (IA3's bias-scaling merge included) is tested in one process in
#: tests/unit/core/test_peft_methods.py.
RAY_METHODS = ("vera:r=8",)


@pytest.mark.parametrize("configuration", RAY_METHODS)
def test_adapters_on_ray_train_resume_exactly_after_a_worker_failure(ray_session, store, tmp_path, faults,
                                                                     monkeypatch, configuration):
    """2 DDP workers, the workers fail after the checkpoint of step 3 and restart from it: the run ends with
    the single-process uninterrupted run's curves and merged final weights (plain timm names), per method."""
    from safetensors.torch import load_file

    from raystudy.distributed.train import TrainResources, run_finetune

    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")  # see tests/ray/test_finetune_ray.py
    kw = dict(configuration=configuration, steps=6, eval_period=3, checkpoint_period=3, save_final=True, lr=0.3)
    ref, _ = train_local(tiny_cfg(store, tmp_path / "ref", **kw), tensorboard=False)
    faults(fail_after_step={"failing": 3})
    cfg = tiny_cfg(store, tmp_path / "failing", **kw)
    summary = run_finetune(cfg, TrainResources(workers=2, max_failures=1))
    assert summary["status"] == "ok" and summary["num_restores"] == 1 and summary["restored_from_step"] == 3
    a, b = (pd.read_parquet(tmp_path / d / "curves.parquet") for d in ("ref", "failing"))
    for col in ("train_loss", "grad_norm", "val_loss"):
        torch.testing.assert_close(torch.tensor(b[col].values), torch.tensor(a[col].values), rtol=1e-5, atol=0,
                                   equal_nan=True)
    for k in ("best_val_acc", "best_val_step", "test_acc", "trainable_params", "units"):
        assert summary[k] == ref[k]
    fa, fb = (load_file(tmp_path / d / "final_model.safetensors") for d in ("ref", "failing"))
    assert set(fa) == set(fb) == set(initial_state(cfg))
    for n in fa:
        assert float((fb[n] - fa[n]).norm() / fa[n].norm().clamp_min(1e-12)) <= 1e-5, n
    assert set(load_file(tmp_path / "failing" / "best_trainable.safetensors")) == set(
        load_file(tmp_path / "ref" / "best_trainable.safetensors"))
