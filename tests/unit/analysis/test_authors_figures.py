"""The paper's figures drawn with the authors' statistics (raystudy/analysis/authors_figures.py), checked against
literal transcriptions of the authors' plotting code on small synthetic tables:

- Fig. 2 (left) / Fig. 4: apps/plots/finetuning.py ``get_intro`` and apps/plots/ablation_analysis.py
  ``get_plasticity_ablation``: per dataset and component ``mean = np.mean(ratio, axis=-1)`` of the ``(layers,
  pairs)`` rates, appended under the component's rank ``plasticity_rank = [5, 1, 4, 2, 3]`` of the keys ``LN1,
  MHA, LN2, FC1, FC2``, then ``sns.boxplot(..., showfliers=False)``;
- Fig. 19: apps/plots/finetuning.py ``get_best_performance``: per dataset and component the lr of the best mean
  test accuracy over seeds (strict ``>``: the first lr on ties), ``np.std`` over seeds there; bars = mean over
  datasets, error = ``sqrt(mean(std^2)) / sqrt(len(seeds))``.

The numbers each figure draws come from a pure function, tested here; each figure is rendered once and its
artists read back. Which figures the analysis writes under which names, and their captions, are read from
the pipeline's figure jobs without drawing them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib import cbook
from matplotlib.container import BarContainer

from raystudy.analysis import authors_figures as AF
from raystudy.analysis.figure_jobs import _accuracy_figures, _plasticity_figures
from raystudy.analysis.inputs import read_inputs
from raystudy.analysis.pipeline import compute_tables
from raystudy.analysis.tables import best_lr_table
from raystudy.io import write_result
from tests.unit.analysis.test_analysis import make_study

#: The authors' component keys in the order their pickles hold them, and the rank of each (get_intro).
AUTHORS_KEYS = ("LN1", "MHA", "LN2", "FC1", "FC2")
AUTHORS_RANK = (5, 1, 4, 2, 3)
DATASETS = ("cifar10", "clipart", "sketch")
LAYERS, PAIRS = 4, 7
SEEDS = (0, 42, 3407)
LRS = (3e-3, 1e-2, 3e-2)


# ---------------------------------------------------------------- Fig. 2 (left) / Fig. 4

def _ratios(rng) -> dict[str, dict[str, np.ndarray]]:
    """``{dataset: {component: rates of shape (layers, pairs)}}``, the authors' ``get_sensitivity`` output."""
    base = {"LN1": 0.5, "MHA": 6.0, "LN2": 0.8, "FC1": 3.0, "FC2": 2.0}
    return {ds: {c: rng.lognormal(np.log(base[c] * (1 + 0.2 * np.arange(LAYERS)))[:, None], 0.4, (LAYERS, PAIRS))
                 for c in AUTHORS_KEYS} for ds in DATASETS}


def _plasticity_table(ratios, mode: str = "embedding") -> pd.DataFrame:
    """``plasticity.parquet`` of those rates (``plasticity`` = a layer's mean rate over pairs), rows shuffled."""
    rows = [dict(model="vit_b", dataset=ds, mode=mode, layer=layer, component=c, plasticity=r[layer].mean(),
                 std=r[layer].std(ddof=1), ci95=0.0, n_pairs=PAIRS)
            for ds, by_c in ratios.items() for c, r in by_c.items() for layer in range(LAYERS)]
    return pd.DataFrame(rows).sample(frac=1.0, random_state=3).reset_index(drop=True)


def _authors_box_values(ratios) -> dict[int, list[float]]:
    """get_intro's ``dict_df`` as ``{rank: values}``, transcribed."""
    dict_df = {"": [], "Rates of Change": []}
    for dataset_name in DATASETS:
        dict_values = ratios[dataset_name]
        for j, key in enumerate(dict_values.keys()):
            ratio = np.asarray(dict_values[key])
            mean = np.mean(ratio, axis=-1)
            rank = AUTHORS_RANK[j]
            for val in mean:
                dict_df[""].append(rank)
                dict_df["Rates of Change"].append(val)
    out: dict[int, list[float]] = {}
    for rank, val in zip(dict_df[""], dict_df["Rates of Change"]):
        out.setdefault(rank, []).append(val)
    return out


def test_the_box_inputs_are_the_authors_per_layer_means():
    ratios = _ratios(np.random.default_rng(0))
    got = AF.plasticity_box_inputs(_plasticity_table(ratios))
    assert list(dict.fromkeys(got["component"])) == ["MHA", "FC1", "FC2", "LN2", "LN1"]  # the paper's rank order
    authors = _authors_box_values(ratios)
    for rank, comp in enumerate(["MHA", "FC1", "FC2", "LN2", "LN1"], start=1):
        mine = got[got["component"] == comp]
        assert len(mine) == len(DATASETS) * LAYERS == len(authors[rank])
        # the same values in the same order (dataset, then layer), up to the rounding of one mean
        assert mine["value"].to_numpy() == pytest.approx(authors[rank], rel=1e-12)


def test_box_stats_are_seaborn_s_box():
    by_hand = AF.box_stats([1.0, 2.0, 3.0, 4.0, 100.0])  # q1 2, q3 4, iqr 2: 100 lies beyond 4 + 3
    assert by_hand == dict(n=5, q1=2.0, med=3.0, q3=4.0, whislo=1.0, whishi=4.0)
    assert AF.box_stats([0.0, 10.0, 11.0, 12.0, 13.0, np.nan]) == dict(n=5, q1=10.0, med=11.0, q3=12.0,
                                                                       whislo=10.0, whishi=13.0)  # 0 < 10 - 3
    rng = np.random.default_rng(1)
    for x in (rng.lognormal(0, 1, 37), rng.normal(0, 1, 8), np.array([2.0, 2.0, 2.0])):
        ref = cbook.boxplot_stats(x, whis=AF.WHIS)[0]  # what sns.boxplot hands matplotlib
        got = AF.box_stats(x)
        assert [got[k] for k in ("q1", "med", "q3", "whislo", "whishi")] == pytest.approx(
            [ref[k] for k in ("q1", "med", "q3", "whislo", "whishi")], rel=1e-12)


def test_plasticity_boxes_pool_the_datasets_per_model_and_mode():
    ratios = _ratios(np.random.default_rng(2))
    table = pd.concat([_plasticity_table(ratios), _plasticity_table(ratios, "sequence")], ignore_index=True)
    boxes = AF.plasticity_boxes(table)
    assert boxes[["mode", "component"]].values.tolist() == [
        [m, c] for m in ("embedding", "sequence") for c in ("MHA", "FC1", "FC2", "LN2", "LN1")]
    assert (boxes["n"] == len(DATASETS) * LAYERS).all() and (boxes["n_datasets"] == len(DATASETS)).all()
    mha = np.array(_authors_box_values(ratios)[1])
    q1, med, q3 = np.percentile(mha, [25, 50, 75])
    row = boxes.iloc[0]
    assert (row["q1"], row["med"], row["q3"]) == pytest.approx((q1, med, q3), rel=1e-12)


# ---------------------------------------------------------------- Fig. 19

def _trials(rng) -> pd.DataFrame:
    """Counted trials: 3 datasets x 5 components (and All) x 3 lrs x 3 seeds, test accuracies drawn."""
    rows = [dict(model="vit_b", dataset=ds, optimizer="sgd", configuration=c, lr=lr, seed=s, diverged=False,
                 test_acc=float(np.clip(0.7 + 0.05 * di + 0.02 * li + rng.normal(0, 0.02), 0, 1)))
            for di, ds in enumerate(DATASETS) for c in (*AUTHORS_KEYS, "All") for li, lr in enumerate(LRS)
            for s in SEEDS]
    # cifar10's LN1: the first two lrs tie on their mean (binary fractions: exact) with other stds; the first wins
    for i, acc in enumerate((0.75, 0.5, 0.625, 0.625, 0.625, 0.625, 0.25, 0.25, 0.25)):
        rows[i]["test_acc"] = acc
    return pd.DataFrame(rows)


def _authors_bars(data: pd.DataFrame) -> tuple[list[float], list[float]]:
    """get_best_performance's bar heights and pooled standard errors in the order MHA, FC1, FC2, LN2, LN1,
    transcribed (percent)."""
    results = {}
    for dataset_name in DATASETS:
        results[dataset_name] = {}
        for trainable_component in AUTHORS_KEYS:
            best_values, temp_std, index = 0, [], 0
            for j, lr in enumerate(LRS):
                values = []
                for seed in SEEDS:
                    root_ind = ((data["dataset"] == dataset_name) & (data["lr"] == float(lr))
                                & (data["seed"] == int(seed)) & (data["configuration"] == trainable_component))
                    values.append(np.asarray(data[root_ind]["test_acc"]) * 100)
                mean_values = np.asarray(values).mean()
                temp_std.append(np.asarray(values).std())
                if mean_values > best_values:
                    best_values = mean_values
                    index = j
            results[dataset_name][trainable_component] = (best_values, temp_std[index])
    ordered = ["MHA", "FC1", "FC2", "LN2", "LN1"]
    heights = [np.mean([results[d][c][0] for d in DATASETS]) for c in ordered]
    pooled_std = [np.sqrt(np.mean(np.square([results[d][c][1] for d in DATASETS]))) for c in ordered]
    return heights, list(np.asarray(pooled_std) / np.sqrt(len(SEEDS)))


def test_the_bars_are_the_authors_means_and_pooled_standard_errors():
    trials = _trials(np.random.default_rng(4))
    bars = AF.overall_accuracy_bars(best_lr_table(trials))
    assert bars["configuration"].tolist() == ["MHA", "FC1", "FC2", "LN2", "LN1"]  # All left out, as the authors'
    heights, se = _authors_bars(trials)
    assert (100 * bars["height"]).tolist() == pytest.approx(heights, rel=1e-12)
    assert (100 * bars["se"]).tolist() == pytest.approx(se, rel=1e-12)
    assert (bars["n_datasets"] == len(DATASETS)).all()


def test_the_pooled_standard_error_weighs_each_dataset_by_its_own_seeds():
    best = pd.DataFrame(dict(dataset=["a", "b"], optimizer="sgd", configuration="MHA", lr=0.01, mean=[0.8, 0.9],
                             std=[0.02, 0.04], n_seeds=[2, 4]))
    (row,) = AF.overall_accuracy_bars(best).itertuples()
    assert row.height == pytest.approx(0.85) and row.se == pytest.approx(np.sqrt((0.02**2 / 2 + 0.04**2 / 4) / 2))


# ---------------------------------------------------------------- each figure rendered once

def test_each_figure_draws_its_numbers(tmp_path, monkeypatch):
    drawn, save = {}, AF.save_figure

    def keep(fig, stem):
        drawn[Path(stem).name] = fig
        return save(fig, stem)

    monkeypatch.setattr(AF, "save_figure", keep)
    ratios = _ratios(np.random.default_rng(5))
    paths = AF.plot_plasticity_boxes(_plasticity_table(ratios), tmp_path / "boxes")
    assert [p.suffix for p in paths] == [".png", ".svg"] and all(p.stat().st_size > 0 for p in paths)
    (ax,) = drawn["boxes"].axes
    boxes = AF.plasticity_boxes(_plasticity_table(ratios))
    spans = np.array([(p.get_path().vertices[:, 1].min(), p.get_path().vertices[:, 1].max()) for p in ax.patches])
    assert spans == pytest.approx(boxes[["q1", "q3"]].to_numpy(), rel=1e-12)
    flat = {round(float(y[0]), 9) for y in (ln.get_ydata() for ln in ax.lines) if len(set(y)) == 1}
    for r in boxes.itertuples():
        assert {round(r.med, 9), round(r.whislo, 9), round(r.whishi, 9)} <= flat
    assert [t.get_text() for t in ax.get_xticklabels()] == ["MHA", "FC1", "FC2", "LN2", "LN1"]

    trials = _trials(np.random.default_rng(6))
    AF.plot_overall_accuracy(best_lr_table(trials), tmp_path / "bars")
    (ax,) = drawn["bars"].axes
    (bar,) = [c for c in ax.containers if isinstance(c, BarContainer)]
    heights, se = _authors_bars(trials)
    assert [p.get_height() for p in bar.patches] == pytest.approx(heights, rel=1e-12)
    segments = bar.errorbar.lines[2][0].get_segments()
    assert [(s[1][1] - s[0][1]) / 2 for s in segments] == pytest.approx(se, rel=1e-9)
    assert ax.get_ylim()[0] == 0  # bars from 0, each labelled with its value
    assert [t.get_text() for t in ax.texts] == [f"{h:.2f}\n±{e:.2f}" for h, e in zip(heights, se)]


# ---------------------------------------------------------------- the analysis: names and captions

def test_the_report_shows_both_statistics_under_their_names(tmp_path):
    inputs = read_inputs(make_study(tmp_path / "s", rates=True, datasets=("cifar10", "sketch")))
    notes: list[str] = []
    jobs = {name: (title, caption) for name, title, caption, _ in
            _plasticity_figures(inputs) + _accuracy_figures(inputs, compute_tables(inputs), notes)}
    assert "Fig. 2, left, and Fig. 4" in jobs["plasticity_distribution"][0]
    assert jobs["plasticity_distribution"][1].startswith("The authors' statistic")
    assert jobs["plasticity_rate_violins"][1].startswith("raystudy's statistic")
    assert "Fig. 19" in jobs["best_accuracy"][0] and jobs["best_accuracy"][1].startswith("The authors' statistic")
    assert jobs["best_accuracy_per_dataset"][1].startswith("raystudy's statistic")
    names = list(jobs)
    assert names.index("plasticity_distribution") + 1 == names.index("plasticity_rate_violins")
    assert names.index("best_accuracy") + 1 == names.index("best_accuracy_per_dataset")

    no_rates = read_inputs(make_study(tmp_path / "t", datasets=("cifar10",)))
    assert [n for n, *_ in _plasticity_figures(no_rates)] == ["plasticity_depth", "plasticity_distribution", "bounds"]


def test_without_a_component_fig_19_is_omitted_with_a_note(tmp_path):
    d = make_study(tmp_path / "s", datasets=("cifar10",), plasticity=False, bounds=False, curves=False)
    trials = pd.read_parquet(d / "trials.parquet")
    write_result(trials[trials["configuration"].isin(["All", "Head"])].reset_index(drop=True), d, "trials")
    inputs = read_inputs(d)
    notes: list[str] = []
    names = [n for n, *_ in _accuracy_figures(inputs, compute_tables(inputs, notes=notes), notes)]
    assert "best_accuracy" not in names and "best_accuracy_per_dataset" in names
    assert any("the paper's Fig. 19" in n and "is omitted" in n for n in notes)
