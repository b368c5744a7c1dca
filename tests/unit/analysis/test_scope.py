"""The report's section "What this study can show" (raystudy.analysis.scope), against independent computations:
the Wilcoxon and Kendall bounds from their exact null distributions, the thesis check from scipy on the study's
own means."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from raystudy.analysis.html_report import write_report
from raystudy.analysis.pipeline import run_analysis
from raystudy.analysis.scope import (
    SCOPE_TITLE,
    pairs_needed,
    scope_items,
    smallest_kendall_p,
    thesis_sentences,
)
from raystudy.analysis.stats import smallest_wilcoxon_p
from raystudy.io import write_result

COMPONENTS = ("LN1", "MHA", "LN2", "FC1", "FC2")
PLASTICITY = {"MHA": 3.0, "FC1": 2.0, "FC2": 1.5, "LN2": 0.5, "LN1": 0.4}  # the paper's order
ACCURACY = {"MHA": 0.80, "FC1": 0.75, "LN2": 0.72, "FC2": 0.70, "LN1": 0.60, "Head": 0.50}  # FC2 and LN2 swapped


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_the_smallest_wilcoxon_p_is_the_exact_nulls_tail(n):
    assert smallest_wilcoxon_p(n, "greater") == pytest.approx(2.0 ** -n)
    assert smallest_wilcoxon_p(n, "less") == pytest.approx(2.0 ** -n)
    assert smallest_wilcoxon_p(n, "two-sided") == pytest.approx(min(1.0, 2 * 2.0 ** -n))


def test_pairs_needed_and_kendalls_floor():
    assert pairs_needed("greater") == 5 and pairs_needed("two-sided") == 6  # 1/32 < 0.05 <= 1/16; 2/64 < 0.05
    assert smallest_kendall_p(5) == pytest.approx(2 / math.factorial(5))
    assert smallest_kendall_p(4) == pytest.approx(2 / math.factorial(4))
    assert math.isnan(smallest_kendall_p(2)) and math.isnan(smallest_wilcoxon_p(0, "greater"))


def _study(path: Path, datasets=("a", "b", "c"), seeds=(0, 1), configurations=(*COMPONENTS, "Head")) -> Path:
    rng = np.random.default_rng(0)
    rows = []
    for tid, (ds, conf, seed) in enumerate(itertools.product(datasets, configurations, seeds)):
        acc = ACCURACY[conf] + rng.normal(0, 0.005)
        rows.append(dict(trial_id=f"t{tid}", dataset=ds, model="vit_tiny", configuration=conf, optimizer="sgd",
                         lr=0.1, seed=seed, steps=40, batch_size=32, trainable_params=100 * (tid % 7 + 1),
                         status="ok", best_val_acc=acc, best_val_step=40, test_acc=acc, final_val_loss=1.0,
                         wall_seconds=2.0))
    write_result(pd.DataFrame(rows), path, "trials")
    write_result(pd.DataFrame([dict(model="vit_tiny", dataset=ds, mode="embedding", layer=layer, component=c,
                                    plasticity=PLASTICITY[c] * (1 + 0.1 * layer), std=0.1, ci95=0.05, n_pairs=64)
                               for ds in datasets for layer in range(3) for c in COMPONENTS]), path, "plasticity")
    return path


def test_the_section_states_scale_power_and_the_thesis_check(tmp_path):
    res = run_analysis(_study(tmp_path / "s"), figures=False)
    items = dict(scope_items(res))
    assert "40 steps of batch 32 per trial" in items["model scale"]
    assert items["seeds"].startswith("2 (0, 1): each accuracy is the mean of 2 runs")
    # 3 datasets, one-sided: 1/8, and 5 pairs are needed
    assert "3 pair(s) per test" in items["tests"] and "can reach is 0.125 (one-sided)" in items["tests"]
    assert "needs at least 5 pairs (p 0.0312)" in items["tests"]
    assert "two optimizers" in items["omitted"]
    # the thesis check, computed here from the study's own numbers
    means = {c: np.mean([ACCURACY[c]]) for c in COMPONENTS}
    order = sorted(COMPONENTS, key=lambda c: -PLASTICITY[c])
    tau, p = stats.kendalltau([PLASTICITY[c] for c in order], [means[c] for c in order])
    assert tau == pytest.approx(0.8)
    thesis = items["thesis check"]
    assert thesis == ("sgd, embedding mode, mean over datasets: accuracy ranks the components MHA > FC1 > LN2 > FC2 "
                      f"> LN1, plasticity ranks them MHA > FC1 > FC2 > LN2 > LN1; Kendall τ {tau:.2f} (p {p:.3f}, 5 "
                      "components): same direction, not significant (τ > 0, p ≥ 0.05; the smallest p 5 components "
                      "allow is 0.017).")
    report = Path(write_report(res))
    html, md = report.read_text(), report.with_suffix(".md").read_text()
    assert f'<a href="#scope">{SCOPE_TITLE}</a>' in html and f"<h2>{SCOPE_TITLE}</h2>" in html
    assert f"## {SCOPE_TITLE}" in md and f"- Thesis check: {thesis}" in md


def test_without_three_components_the_thesis_check_says_why(tmp_path):
    res = run_analysis(_study(tmp_path / "s", datasets=("a",), seeds=(0,), configurations=("MHA", "LN1", "Head")),
                       figures=False)
    items = dict(scope_items(res))
    assert items["thesis check"] == ("sgd, embedding mode, mean over datasets: not computed: it needs at least 3 of "
                                     "the five components finetuned alone, this study ranks MHA > LN1.")
    assert "1 (0): every accuracy is one run" in items["seeds"]
    assert "can reach is 0.5 (one-sided)" in items["tests"]


def test_thesis_sentences_read_the_overall_row():
    ranking = pd.DataFrame([
        dict(dataset="a", optimizer="sgd", mode="embedding", kendall=-1.0, kendall_p=0.01, n_components=5,
             plasticity_ranking="x", accuracy_ranking="y"),
        dict(dataset="overall", optimizer="sgd", mode="embedding", kendall=-0.6, kendall_p=0.23, n_components=5,
             plasticity_ranking="MHA > FC1", accuracy_ranking="FC1 > MHA")])
    [sentence] = thesis_sentences(ranking)
    assert sentence.startswith("sgd, embedding mode, mean over datasets: accuracy ranks the components FC1 > MHA")
    assert sentence.endswith("; Kendall τ -0.60 (p 0.230, 5 components): not supported (τ ≤ 0).")
