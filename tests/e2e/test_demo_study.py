"""What `make demo` gives a user (``conftest.demo_study``: ``experiments/full_study.py`` as written): the five
components, Head and LP with two seeds, a thesis check computed from its own tables, a pretraining that moved
plasticity toward the paper's ranking, and a report that says so."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from scipy import stats

from raystudy.vocab import COMPONENTS
from tests.support.processes import REPO


@pytest.fixture(scope="module")
def demo(demo_study) -> Path:
    assert demo_study["returncode"] == 0, demo_study["stdout"][-3000:] + demo_study["stderr"][-3000:]
    return Path(demo_study["cwd"]) / "results" / "demo"


def test_the_demo_finetunes_every_component_with_two_seeds(demo):
    trials = pd.read_parquet(demo / "trials.parquet")
    runs = trials[trials["configuration"] != "LP"]
    assert set(runs["configuration"]) == {*COMPONENTS, "Head"}
    assert sorted(runs["seed"].unique()) == [0, 1] and sorted(runs["lr"].unique()) == [0.03, 0.3]
    assert len(runs) == 48 and (runs["status"] == "ok").all()
    assert (trials["configuration"] == "LP").sum() == 2


def test_the_thesis_check_is_computed_from_the_demos_own_tables(demo):
    ranking = pd.read_csv(demo / "analysis" / "ranking.csv")
    overall = ranking[ranking["dataset"] == "overall"].iloc[0]
    assert overall["n_components"] == 5 and pd.notna(overall["kendall"])
    # recomputed here: mean plasticity over layers and datasets, best-lr accuracy mean over datasets
    plast = pd.read_parquet(demo / "plasticity.parquet")
    if "weights" in plast:
        plast = plast[plast["weights"] == "pretrained"]
    p = plast.groupby(["dataset", "component"])["plasticity"].mean().groupby("component").mean()
    best = pd.read_csv(demo / "analysis" / "best_lr.csv")
    acc = best[best["configuration"].isin(COMPONENTS)].groupby("configuration")["mean"].mean()
    tau, pval = stats.kendalltau(p[list(COMPONENTS)], acc[list(COMPONENTS)])
    assert overall["kendall"] == pytest.approx(tau) and overall["kendall_p"] == pytest.approx(pval)
    report = (demo / "analysis" / "report.md").read_text()
    assert "## What this study can show" in report
    assert f"Kendall τ {tau:.2f} (p {pval:.3f}, 5 components)" in report


def test_the_demos_pretraining_puts_mha_above_the_layernorms(demo):
    """The recipe of presets/demo.yaml: MHA the most plastic and the LayerNorms the least, as in the paper (a
    random init of the same architecture ranks them the other way round)."""
    plast = pd.read_parquet(demo / "plasticity.parquet")
    if "weights" in plast:
        plast = plast[plast["weights"] == "pretrained"]
    for dataset, g in plast.groupby("dataset"):
        p = g.groupby("component")["plasticity"].mean()
        assert p.idxmax() == "MHA", (dataset, p)
        assert p["FC1"] > p["FC2"] > max(p["LN1"], p["LN2"]), (dataset, p)


def test_the_demo_measures_both_controls_beside_every_plasticity(demo):
    plast = pd.read_parquet(demo / "plasticity.parquet")
    keys = ["dataset", "layer", "component"]
    every = plast.groupby(keys)["weights"].agg(lambda w: tuple(sorted(w)))
    assert len(every) == 2 * 4 * 5 and (every == ("pretrained", "random_blocks", "random_init")).all()
    control = pd.read_csv(demo / "analysis" / "plasticity_control.csv")
    means = {w: plast[plast["weights"] == w].groupby(["dataset", "component"])["plasticity"].mean()
             for w in ("pretrained", "random_init", "random_blocks")}
    for r in control.itertuples():
        for w in means:
            assert getattr(r, w) == pytest.approx(means[w][(r.dataset, r.component)]), w
        assert r.weights_ratio == pytest.approx(r.pretrained / r.random_blocks)
        assert r.inputs_ratio == pytest.approx(r.random_blocks / r.random_init)
    # the pretraining moved MHA up and LN1 down against the same architecture at its random init
    mha, ln1 = control[control["component"] == "MHA"], control[control["component"] == "LN1"]
    assert (mha["ratio"] > 10).all() and (ln1["ratio"] < 0.5).all()
    report = (demo / "analysis" / "report.md").read_text()
    rankings = next(ln for ln in report.splitlines() if ln.startswith("- Rankings: measured "))
    assert "; random-init " in rankings and "; random-blocks " in rankings
    assert "; paper MHA > FC1 > FC2 > LN2 > LN1" in rankings and "LN1 = LN2" in rankings  # the control's tie
    assert "- Kendall τ-b between the rankings: measured vs random-init " in report
    assert " measured vs random-blocks " in report


def test_the_scope_section_reads_as_docs_analysis_shows(demo):
    """docs/analysis.md quotes the demo report's section "What this study can show": each quoted line (the
    thesis check's varies with the run: '...') is in the report as the demo wrote it."""
    page = (REPO / "docs" / "analysis.md").read_text()
    quoted = page.split("In the demo's `report.md` it reads")[1].split("```text\n")[1].split("```")[0]
    report = (demo / "analysis" / "report.md").read_text().splitlines()
    lines = [ln for ln in quoted.splitlines() if not ln.endswith("...")]
    assert len(lines) == 4
    for line in lines:
        assert line in report, line
