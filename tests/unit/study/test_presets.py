"""The presets shipped with the package (raystudy/presets/*.yaml): each loads and validates, and its grid
has the size its YAML says, counted here from the raw YAML without the spec code. Also the plasticity
study's entry point (experiments/plasticity_study.py), which runs the plasticity-only presets. No Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import raystudy
from raystudy.study.spec import PRESET_DIR, load_preset, preset_names
from tests.support.processes import REPO

ROOT = REPO



PRESET_FILES = sorted((Path(raystudy.__file__).parent / "presets").glob("*.yaml"))



#: the study's own defaults the YAML may leave out (StudySpec: all 7 configurations, sgd x 4 lrs, 3 seeds)
DEFAULT_AXES = {"configurations": 7, "lrs": 4, "seeds": 3}



def _sizes_from_yaml(raw: dict) -> tuple[int, int]:
    """``(grid points, trials)`` from the YAML as written: per dataset, configurations x (every optimizer's
    lrs x its seeds), where a dataset entry that is a mapping may name its own ``optimizers`` (replacing the
    study's) and ``seeds`` (a list for all its optimizers, or optimizer -> list); an Optuna search runs
    ``samples`` trials per (dataset, configuration, optimizer, seed); ``final_fit`` adds one final trial per
    (dataset, configuration, optimizer, seed)."""
    configurations = len(raw["configurations"]) if "configurations" in raw else DEFAULT_AXES["configurations"]
    study_optimizers = raw.get("optimizers", {"sgd": [None] * DEFAULT_AXES["lrs"]})
    study_seeds = raw.get("seeds", [None] * DEFAULT_AXES["seeds"])
    points = cells = 0
    for entry in raw["datasets"].values():
        entry = entry if isinstance(entry, dict) else {}
        optimizers = entry.get("optimizers", study_optimizers)
        seeds = entry.get("seeds", study_seeds)
        for opt, lrs in optimizers.items():
            n_seeds = len(seeds.get(opt, study_seeds) if isinstance(seeds, dict) else seeds)
            points += configurations * len(lrs) * n_seeds
            cells += configurations * n_seeds
    if raw.get("search", "grid") == "grid":
        return points, points + (cells if raw.get("final_fit") else 0)
    return points, cells * raw.get("samples", 4)



def test_presets_are_package_data():
    """One preset system, inside the package (a wheel ships them): no presets left in experiments/."""
    assert PRESET_DIR == Path(raystudy.__file__).parent / "presets"
    assert set(preset_names()) == {p.stem for p in PRESET_FILES}
    assert {"demo", "paper", "paper-vtab1k", "paper-model-size", "plasticity-demo", "plasticity-paper"} <= set(
        preset_names())
    assert not (ROOT / "experiments" / "presets").exists()



@pytest.mark.parametrize("path", PRESET_FILES, ids=lambda p: p.stem)
def test_every_preset_loads_validates_and_has_its_grid(path):
    raw = yaml.safe_load(path.read_text())
    spec = load_preset(path.stem)
    assert spec.name == raw["name"] == path.stem  # the preset's name is its file name
    spec.validate(check_files=False)
    points, trials = _sizes_from_yaml(raw)
    assert len(spec.grid()) == points and spec.total_trials() == trials
    assert len({p["trial_id"] for p in spec.grid()}) == points  # every trial id distinct
    if path.stem.startswith("plasticity-"):
        assert raw["configurations"] == [] and points == trials == 0
        assert spec.plasticity.enabled


def test_every_preset_that_pretrains_the_toy_uses_the_one_recipe():
    """One pretraining recipe (AdamW lr 1e-2, 300 steps): at lr 1e-3 the toy keeps its random-init component
    order, so a demo pretrained so would show the initialisation's ranking, not pretraining's."""
    from raystudy.study.pretrain import TOY_PRETRAINING

    pretraining = {name: load_preset(name).pretrain for name in preset_names() if load_preset(name).pretrain.enabled}
    assert {"demo", "plasticity-demo", "selection-demo", "vtab1k-demo", "beyond-demo"} <= set(pretraining)
    assert {name: p for name, p in pretraining.items() if p != TOY_PRETRAINING} == {}
    assert TOY_PRETRAINING.lr == 1e-2 and TOY_PRETRAINING.steps == 300 and TOY_PRETRAINING.optimizer == "adamw"


def test_grid_sizes_of_the_named_presets():
    """The sizes docs/studies.md and the preset comments state (independent of the YAML parsing above)."""
    sizes = {name: load_preset(name).total_trials() for name in preset_names()}
    assert sizes["paper"] == 11 * 6 * 4 * 3 + 4 * 6 * 4 * 1 == 888  # SGD everywhere + the AdamW ablation
    assert sizes["paper-vtab1k"] == 11 * 7 * 8 * 3 == 1848
    assert sizes["paper-model-size"] == 1 * 6 * 4 * 3 == 72
    assert sizes["paper-low-data"] == 5 * 6 * 1 * 1 == 30
    assert sizes["demo"] == 2 * 6 * 2 * 2 == 48
    assert sizes["beyond"] == 11 * 25 * 4 * 3 == 3300
    assert sizes["beyond-demo"] == 2 * 8 * 1 * 1 == 16
    assert sizes["plasticity-demo"] == sizes["plasticity-paper"] == 0
    assert sizes["vtab1k"] == 19 * 16 * 4 * 3 + 19 * 16 * 3 == 3648 + 912  # search, then the final fit
    assert sizes["vtab1k-demo"] == 3 * 12 * 2 * 2 + 3 * 12 * 2 == 144 + 72
    assert sizes["selection"] == 19 * 39 * 4 * 3 + 19 * 39 * 3 == 8892 + 2223  # 21 unit + 18 weights budgets
    assert sizes["selection-demo"] == 3 * 13 * 2 * 2 + 3 * 13 * 2 == 156 + 78  # 7 unit + 6 weights budgets



@pytest.mark.parametrize("name", ["selection", "selection-demo"])
def test_selection_presets_compare_every_strategy_at_each_budget_as_their_headers_say(name):
    """Every criterion, auto and random at each budget (a unit-granularity budget, parsed by the grammar),
    the protocol of vtab1k (val chooses, final fit), and the header's run counts those of the grid."""
    from raystudy.core.expressions import Budgeted, normalise
    from raystudy.vocab import CRITERIA

    spec, vtab = load_preset(name), load_preset("vtab1k" if name == "selection" else "vtab1k-demo")
    trees = [normalise(c) for c in spec.configurations]
    assert all(isinstance(t, Budgeted) for t in trees)
    units = list(dict.fromkeys(str(t.budget) for t in trees if not t.weights))
    weights = list(dict.fromkeys(str(t.budget) for t in trees if t.weights))
    assert units and weights
    # every strategy at each unit budget; every one but auto (plasticity is per unit) at each weights budget
    assert sorted(str(t) for t in trees) == sorted(
        [f"{s}:{b}" for s in ("auto", "random", *CRITERIA) for b in units]
        + [f"{s}:{b}:weights" for s in ("random", *CRITERIA) for b in weights])
    assert spec.final_fit and spec.analysis_select_by == "val" and spec.plasticity.enabled
    assert spec.datasets == vtab.datasets and spec.model == vtab.model and spec.optimizers == vtab.optimizers
    assert (spec.steps, spec.batch_size, spec.resize, spec.augment) == (vtab.steps, vtab.batch_size, vtab.resize,
                                                                          vtab.augment)
    search, final = len(spec.grid()), len(spec.groups())
    header = (PRESET_DIR / f"{name}.yaml").read_text().split("\nname:")[0]
    assert f"= {search:,} search trials" in header and f"= {final:,} final trials" in header
    assert f"({search + final:,} runs" in header or f"{search + final:,} runs," in header



def test_plasticity_presets_measure_what_the_old_plasticity_study_did():
    demo, paper = load_preset("plasticity-demo"), load_preset("plasticity-paper")
    assert sorted(demo.datasets) == ["shift-color", "shift-noise"] and demo.builtin_data
    assert demo.pretrain.enabled and demo.weights is None  # a pretrained toy, not a random init
    assert demo.plasticity.pairs == 384 and demo.img_size == 32
    assert paper.model == "vit_base_patch16_224.orig_in21k" and paper.pretrain_store == "imagenet-val"
    assert paper.plasticity.pairs == 12800 and paper.plasticity.mode == "embedding"
    assert len(paper.datasets) == 11 and set(paper.datasets) == set(load_preset("paper").datasets)



def test_paper_presets_use_the_authors_weights():
    """Every paper preset (and the commands in their comments) names the original ImageNet-21k weights
    (timm's ``orig_in21k``, the Google checkpoints the authors load), never ``augreg``."""
    for path in PRESET_FILES:
        if "paper" in path.stem:
            text = path.read_text()
            assert "augreg" not in text, path.stem
            assert load_preset(path.stem).model.endswith(".orig_in21k"), path.stem



def test_model_size_preset_is_table_9():
    """ViT-L/16 on clipart with the authors' model_size.sh grid and the DomainNet protocol of ``paper``."""
    spec, paper = load_preset("paper-model-size"), load_preset("paper")
    spec.validate(check_files=False)
    assert spec.model == "vit_large_patch16_224.orig_in21k" and spec.weights.endswith(".safetensors")
    assert spec.datasets == {"clipart": paper.datasets["clipart"]}
    assert spec.configurations == paper.configurations == ["LN1", "MHA", "LN2", "FC1", "FC2", "All"]
    assert spec.protocol("clipart").optimizers == {"sgd": [3e-3, 1e-2, 3e-2, 6e-2]}
    assert spec.protocol("clipart").seeds == {"sgd": [0, 42, 3407]}
    mine, theirs = spec.protocol("clipart"), paper.protocol("clipart")
    assert (mine.steps, mine.eval_period, mine.warmup_steps) == (theirs.steps, theirs.eval_period,
                                                                 theirs.warmup_steps) == (20000, 500, 2000)
    assert spec.batch_size == 512 and spec.micro_batch_size == 128 and spec.train_final_norm
    assert [p["trial_id"] for p in spec.grid()][:2] == ["clipart-LN1-sgd-lr0.003-s0", "clipart-LN1-sgd-lr0.003-s42"]



def test_demo_builtin_data_and_pretraining_stage(tmp_path):
    """The demo's own data and pretrained model (tiny sizes): the weights file exists, loads into the model,
    differs from the random init the run started from, and the training loss went down."""
    import math

    import pandas as pd
    import timm
    import torch
    from safetensors.torch import load_file

    from raystudy.core.models import build_model
    from raystudy.data.store import read_meta
    from raystudy.study.pretrain import prepare_builtin_data, pretrain_weights

    spec = load_preset("demo").with_overrides({
        "out": str(tmp_path / "study"), "pretrain.steps": 40, "pretrain.batch_size": 32, "pretrain.warmup_steps": 4,
        "pretrain.lr": 2e-3,
    })
    lines: list[str] = []
    stores = prepare_builtin_data(spec, lines.append, n_train=256, n_test=64)
    assert {"pretrain", *spec.datasets} <= set(stores) and spec.resolved_data_root() == str(tmp_path / "study/data")
    weights = tmp_path / "study" / "pretrained" / "model.safetensors"
    summary = pretrain_weights(spec, str(weights), echo=lines.append)
    assert weights.is_file() and summary["status"] == "ok" and summary["steps"] == 40

    num_classes = int(read_meta(stores["pretrain"])["num_classes"])
    trained = load_file(str(weights))
    build_model(spec.model, num_classes=num_classes, weights=str(weights), img_size=32, **spec.model_kwargs)  # loads
    torch.manual_seed(spec.pretrain.seed)  # the run's own random init, rebuilt with timm directly
    init = timm.create_model(spec.model, num_classes=num_classes, img_size=32, **spec.model_kwargs).state_dict()
    assert set(trained) == set(init)
    moved = [k for k in init if k.startswith("blocks.") and not torch.equal(trained[k], init[k])]
    assert len(moved) == len([k for k in init if k.startswith("blocks.")])  # every block parameter trained

    curves = pd.read_parquet(weights.parent / "run" / "curves.parquet").dropna(subset=["train_loss"])
    first, last = curves.train_loss.iloc[0], curves.train_loss.iloc[-1]
    assert math.isfinite(last) and last < first and last < math.log(num_classes)  # below chance level

    # the pretraining runs in the study's precision and records it (auto: fp32 on this CPU; bf16 autocast)
    written = json.loads((weights.parent / "run" / "summary.json").read_text())
    assert summary["precision"] == written["precision"] == "fp32"
    bf16 = spec.with_overrides({"precision": "bf16", "pretrain.steps": 3, "pretrain.warmup_steps": 1})
    bf16_weights = tmp_path / "study" / "bf16" / "model.safetensors"
    assert pretrain_weights(bf16, str(bf16_weights), echo=lines.append)["precision"] == "bf16"
    assert json.loads((bf16_weights.parent / "run" / "summary.json").read_text())["precision"] == "bf16"



@pytest.mark.parametrize("preset, counts", [
    ("vtab1k", {"ia3": 12 * (2304 + 3072), "bias": 12 * 8448 + 768, "lora:r=46": 12 * 46 * (768 + 2304 + 768 + 768),
                "dora:r=46": 12 * (46 * 4608 + 2304 + 768), "lora:r=8": 12 * 8 * 4608}),
    ("vtab1k-demo", {"ia3": 4 * (192 + 256), "bias": 4 * (64 + 192 + 64 + 64 + 256 + 64) + 64,
                     "lora:r=12": 4 * 12 * 384, "dora:r=12": 4 * (12 * 384 + 192 + 64)}),
])
def test_vtab1k_presets_match_their_budgets(preset, counts):
    """The counts the presets' comments state, on the preset's own model (meta device), and every adapter or
    BitFit configuration within the matched-budget tolerance of one of the preset's budgets."""
    import timm
    import torch

    from raystudy.analysis.beyond import DEFAULT_TOLERANCE
    from raystudy.core.expressions import Budgeted, normalise, resolve

    spec = load_preset(preset)

    def model():
        with torch.device("meta"):
            return timm.create_model(spec.model.split(".")[0], num_classes=10, **spec.model_kwargs)

    total = sum(p.numel() for n, p in model().named_parameters() if not n.startswith("head."))
    budgets = {normalise(c).budget.parameters(total) for c in spec.configurations
               if isinstance(normalise(c), Budgeted)}
    assert len(budgets) == 2
    for configuration, expected in counts.items():
        assert configuration in spec.configurations
        n = resolve(model(), configuration).num_parameters
        assert n == expected, configuration
        if configuration != "lora:r=8":
            assert min(max(n / b, b / n) for b in budgets) <= DEFAULT_TOLERANCE, configuration  # head aside

