"""The element granularity ``<criterion>:B:weights``: its grammar, its mask (the top entries of the criterion's
element scores, against an independent literal computation: |theta| for magnitude, per-sample gradients by
a plain loop for fisher), the mask cached in the study directory and recorded in the trial's row, and a run
that trains exactly the chosen entries (every other entry bit-identical, the count equal to the budget),
also when it resumes from a checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from raystudy.core.expression_lists import split_configurations
from raystudy.core.expressions import (
    Budget,
    Budgeted,
    ExpressionError,
    canonical,
    element_budget,
    parse,
    path_safe,
    resolve,
)
from raystudy.core.finetune import FinetuneConfig, build_finetune_model, train_local
from raystudy.core.finetune.driver import InjectedFailure
from raystudy.core.finetune.masks import read_masks, top_elements, write_masks
from raystudy.distributed.inprocess import run_in_process
from raystudy.distributed.train import TrainResources
from raystudy.vocab import COMPONENTS
from tests.support.models import tiny_vit
from tests.support.stores import make_store

TINY = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4)
D, H, L, C = 48, 192, 3, 10
PATHS = {"LN1": ["norm1.weight", "norm1.bias"],
         "MHA": ["attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias"],
         "LN2": ["norm2.weight", "norm2.bias"], "FC1": ["mlp.fc1.weight", "mlp.fc1.bias"],
         "FC2": ["mlp.fc2.weight", "mlp.fc2.bias"]}
CANDIDATES = [f"blocks.{b}.{p}" for b in range(L) for c in COMPONENTS for p in PATHS[c]]
#: the units' entries: per block LN1 2d, MHA 4d^2 + 4d, LN2 2d, FC1 dH + H, FC2 Hd + d
UNIT_ENTRIES = L * (2 * D + (4 * D * D + 4 * D) + 2 * D + (D * H + H) + (H * D + D))  # 84,816
TOTAL = 95_040  # All of the tiny ViT without the head (tests/ray/test_expressions_wired.py counts it)
HEAD = D * C + C


# ----------------------------------------------------------------------------------------------- grammar
def test_weights_parse_canonical_and_path_safe():
    tree = parse("fisher:0.10%:weights")
    assert tree == Budgeted("fisher", Budget(0.1, "%"), weights=True) != parse("fisher:0.1%")
    assert canonical("grad:100000:weights") == "grad:100k:weights" and canonical("fisher:0.1%") == "fisher:0.1%"
    assert path_safe("magnitude:1%:weights") == "magnitude_1pct_weights"
    assert path_safe("random:0.5%:weights") == "random_0.5pct_weights"
    assert split_configurations("fisher:1%:weights, MHA,random:0.1%:weights, lora:r=8:fc1,qkv, grad:2k:weights") == [
        "fisher:1%:weights", "MHA", "random:0.1%:weights", "lora:r=8:fc1,qkv", "grad:2k:weights"]


@pytest.mark.parametrize("text, position, message", [
    ("auto:1%:weights", 0, "plasticity is measured per (component, block) unit"),
    ("fisher:1%:units", 10, "expected 'weights' after 'fisher:1%'"),
    ("fisher:1%:", 10, "expected 'weights' after 'fisher:1%'"),
    ("grad:2k:weights:x", 15, "unexpected ':' after 'grad:2k:weights'"),
])
def test_weights_errors_point_at_the_fault(text, position, message):
    with pytest.raises(ExpressionError) as e:
        parse(text)
    assert e.value.position == position and message in str(e.value)


def test_element_budget_reads_b_as_a_unit_budget_does_capped_at_the_units_entries():
    model = tiny_vit()
    assert element_budget(model, parse("magnitude:1%:weights")) == TOTAL // 100 == 950
    assert element_budget(model, parse("fisher:1234:weights")) == 1234
    assert element_budget(model, parse("grad:100k:weights")) == UNIT_ENTRIES == 84_816
    with pytest.raises(ValueError, match="below one parameter"):
        element_budget(model, parse("taylor:0.001%:weights"))


def test_random_weights_draw_exactly_the_budget_from_the_seed():
    model = tiny_vit()
    a, b, other = (resolve(model, "random:2%:weights", seed=s) for s in (0, 0, 1))
    assert sum(int(m.sum()) for m in a.masks.values()) == a.budget == TOTAL * 2 // 100 == 1900
    assert all(torch.equal(a.masks[n], b.masks[n]) for n in a.masks) and set(a.masks) <= set(CANDIDATES)
    assert any(n not in other.masks or not torch.equal(a.masks[n], other.masks[n]) for n in a.masks)
    assert [n for n, _ in a.parameters] == [n for n in CANDIDATES if n in a.masks]  # model order
    # uniform over the units' entries: each tensor holds about its share of the chosen entries
    sizes = dict((n, p.numel()) for n, p in model.named_parameters())
    fc1 = sum(int(a.masks.get(f"blocks.{b}.mlp.fc1.weight", torch.zeros(1)).sum()) for b in range(L))
    assert abs(fc1 - 1900 * L * sizes["blocks.0.mlp.fc1.weight"] / UNIT_ENTRIES) < 60  # ~ 645 +- 3 sigma
    with pytest.raises(ValueError, match="needs the mask of its fisher scores"):
        resolve(model, "fisher:2%:weights")


# ----------------------------------------------------------------------------------------------- runs
@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("weights") / "store", n_per_split=(24, 8, 12))


def _spec(store, out, configuration):
    from raystudy.study.spec import StudySpec

    return StudySpec(name="w", out=str(out), model="vit_tiny_patch16_224", model_kwargs=TINY, img_size=32,
                     weights=None, datasets={"tiny": store}, configurations=[configuration],
                     optimizers={"sgd": [0.5]}, seeds=[0], steps=3, batch_size=8, eval_period=3, log_period=1,
                     warmup_steps=1, augment=False, shuffle=False, criteria_batches=2)


def by_hand(criterion: str, cfg: FinetuneConfig, store) -> dict[str, torch.Tensor]:
    """The element scores of the candidate tensors, literally: |theta| of the run's model, or the mean over
    the run's first 2 batches of 8 rows (store order: shuffle off, no augmentation) of each sample's squared
    gradient, each by its own .backward()."""
    from raystudy.core.finetune.data import SplitData

    model = build_finetune_model(cfg, C).eval()
    params = dict(model.named_parameters())
    if criterion == "magnitude":
        return {n: params[n].detach().abs() for n in CANDIDATES}
    data = SplitData(store, "train")
    rows = np.arange(2 * 8) % len(data)
    x, y = data.load(rows, size=32, train=False)
    sums = {n: torch.zeros_like(params[n]) for n in CANDIDATES}
    for i in range(len(rows)):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        for n in CANDIDATES:
            sums[n] += params[n].grad.square()
    return {n: s / len(rows) for n, s in sums.items()}


# about 10 s on 2 cores: a per-sample gradient pass twice, two 3-step runs
@pytest.mark.parametrize("criterion, budget, entries", [("magnitude", "1%", 950), ("fisher", "1500", 1500)])
def test_a_weights_budget_trains_exactly_the_entries_its_criterion_chooses(store, tmp_path, criterion, budget,
                                                                           entries):
    from raystudy.study.jobs import finetune_job
    from raystudy.study.points import grid_point
    from raystudy.study.results import trial_row

    configuration = f"{criterion}:{budget}:weights"
    spec = _spec(store, tmp_path / "study", configuration)
    point = grid_point("tiny", configuration, "sgd", 0.5, 0)
    unscored, _ = finetune_job(spec, point, str(tmp_path / "run"), score=False)  # a failed trial's row
    assert unscored.selection is None and unscored.selection_mask is None
    cfg, _ = finetune_job(spec, point, str(tmp_path / "run"))

    # the mask: cached beside the unit scores, equal to top_elements of the literal scores, of the budget's size
    name = f"{criterion}_b2_s0_*_w{budget.replace('%', 'pct')}.safetensors"
    (cached,) = (tmp_path / "study" / "criteria" / "tiny").glob(name)
    assert cfg.selection_mask == str(cached)
    masks = load_file(cached)
    assert all(m.dtype == torch.bool and m.any() for m in masks.values()) and set(masks) <= set(CANDIDATES)
    expected = top_elements(by_hand(criterion, cfg, store), entries)
    assert sum(int(m.sum()) for m in expected.values()) == entries
    for n in CANDIDATES:
        chosen = masks.get(n, torch.zeros_like(expected[n]))
        assert torch.equal(chosen, expected[n]), n
    touched = [(c, b) for b in range(L) for c in COMPONENTS if any(f"blocks.{b}.{p}" in masks for p in PATHS[c])]
    assert cfg.selection == canonical("+".join(f"{c}@{b}" for c, b in touched))

    before = {n: p.detach().clone() for n, p in build_finetune_model(cfg, C).named_parameters()}
    summary, ft = train_local(cfg.validate(), tensorboard=False)
    after = {n: p.detach() for n, p in ft.model.named_parameters()}
    changed = 0
    for n in before:
        trained = expected.get(n, torch.zeros_like(before[n], dtype=torch.bool))
        if n.startswith("head."):
            assert not torch.equal(after[n], before[n])  # the head trains as in every configuration
            continue
        assert torch.equal(after[n][~trained], before[n][~trained]), n  # every other entry: bit for bit
        changed += int((after[n][trained] != before[n][trained]).sum())
    assert changed >= 0.9 * entries, (changed, entries)
    assert summary["trainable_params"] == entries + HEAD and summary["selection_entries"] == entries
    assert summary["selection_mask"] == f"criteria/tiny/{cached.name}" and summary["units"] == cfg.selection
    row = trial_row(point, spec.model, summary)
    assert row["selection_mask"] == summary["selection_mask"] and row["selection_entries"] == entries
    assert read_masks(str(tmp_path / "study" / row["selection_mask"])).keys() == masks.keys()
    # the selection cost: the mask's scoring pass, timed once and kept in its file's header
    seconds = float(json.loads(cached.read_bytes()[8:8 + int.from_bytes(cached.read_bytes()[:8], "little")])
                    ["__metadata__"]["seconds"])
    assert seconds > 0 and cfg.selection_seconds == seconds and row["selection_seconds"] == seconds


def _cfg(out, store, mask, **kw) -> FinetuneConfig:
    base = dict(model="vit_tiny_patch16_224", model_kwargs=TINY, img_size=32, store=store, out_dir=str(out),
                configuration="magnitude:2%:weights", selection_mask=mask, optimizer="adamw", lr=3e-3,
                weight_decay=0.1, steps=6, batch_size=8, eval_period=2, log_period=1, checkpoint_period=2,
                shuffle=True, augment=True, seed=3, save_final=True)
    base.update(kw)
    return FinetuneConfig(**base)


RESULTS = ("status", "best_val_acc", "best_val_step", "test_acc", "final_val_loss", "final_train_loss",
           "steps_completed", "trainable_params", "units", "selection_entries", "selection_mask")


# about 6 s: three short in-process runs
def test_a_weights_run_resumes_exactly_with_its_mask(store, tmp_path, faults):
    """AdamW with weight decay (which moves every entry whatever its gradient): the run fails after its
    step-3 report (checkpoint at 2) and resumes with its mask re-applied; curves, results and final weights
    equal the uninterrupted run's bit for bit, and every entry outside the mask is the pretrained one."""
    start = {n: p.detach().clone() for n, p in build_finetune_model(_cfg(tmp_path, store, None), C).named_parameters()}
    masks = top_elements({n: start[n].abs() for n in CANDIDATES}, TOTAL * 2 // 100)
    mask = str(tmp_path / "mask.safetensors")
    write_masks(mask, masks)
    res = TrainResources(cpus_per_worker=1, cleanup_checkpoints=False)
    ref = run_in_process(_cfg(tmp_path / "ref", store, mask), res, storage=str(tmp_path / "c_ref"))
    faults(fail_after_step={"run": 3})
    cfg = _cfg(tmp_path / "run", store, mask)
    with pytest.raises(InjectedFailure):
        run_in_process(cfg, res, storage=str(tmp_path / "c_run"))
    torch.manual_seed(999)  # the resumed run owes nothing to the caller's RNG
    resumed = run_in_process(cfg, res, storage=str(tmp_path / "c_run"))
    assert resumed["num_restores"] == 1 and resumed["restored_from_step"] == 2
    assert {k: resumed[k] for k in RESULTS} == {k: ref[k] for k in RESULTS}
    assert ref["selection_entries"] == 1900 and ref["trainable_params"] == 1900 + HEAD
    a, b = (pd.read_parquet(tmp_path / x / "curves.parquet").drop(columns="images_per_s") for x in ("ref", "run"))
    pd.testing.assert_frame_equal(a, b)
    fa, fb = (load_file(tmp_path / x / "final_model.safetensors") for x in ("ref", "run"))
    assert set(fa) == set(fb) and all(torch.equal(fa[n], fb[n]) for n in fa)
    for n, t in start.items():
        frozen = ~masks[n] if n in masks else torch.ones_like(t, dtype=torch.bool)
        if not n.startswith("head."):
            assert torch.equal(fb[n][frozen], t[frozen]), n
    assert sum(int((fb[n][m] != start[n][m]).sum()) for n, m in masks.items()) == 1900  # AdamW moves each


def test_a_weights_config_needs_its_mask_and_a_mask_needs_a_weights_budget(store, tmp_path):
    with pytest.raises(ValueError, match="fisher:<budget>:weights needs `selection_mask`"):
        _cfg(tmp_path, store, None, configuration="fisher:1%:weights").validate()
    with pytest.raises(ValueError, match="only a :weights budget has a mask"):
        _cfg(tmp_path, store, str(tmp_path / "m.safetensors"), configuration="MHA").validate()
    _cfg(tmp_path, store, None, configuration="random:1%:weights").validate()  # drawn from the seed
