"""The selection study's report says one thing (#45 item 3): its headline and every section answer from one
phase (the final fit where the study has one) and say which; a headline answers the study's question (each
criterion against plasticity, Wilcoxon p and Holm p); the summary's tests line lists the tests the report
holds; the scope section says how many test examples each accuracy rests on.

Synthetic studies (tests/support/study_tables.py: the selection preset's shape; test_analysis_criteria's
six-dataset study, whose p-values differ), no Ray; every expected number computed here from the rows (numpy,
scipy.stats.wilcoxon, Holm by a hand loop)."""

from __future__ import annotations

import html as html_text
import re

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from raystudy.analysis.figure_jobs import figure_jobs
from raystudy.analysis.html_report import _headlines, build_html, summary_items
from raystudy.analysis.pipeline import run_analysis
from raystudy.analysis.scope import scope_items
from raystudy.io import write_result
from tests.support.study_tables import (
    SELECTION_CONFIGS,
    SELECTION_LRS,
    SELECTION_TASKS,
    SELECTION_TEST_EXAMPLES,
    selection_rows,
    selection_study,
)
from tests.unit.analysis.test_analysis_criteria import CRITERIA, DATASETS, _best, _holm_by_hand, _rows, _write

FINAL_WORDS = "from the final fit (each configuration retrained on train + val at the lr chosen on validation"


def _final_means(rows) -> dict[str, dict[str, float]]:
    """configuration -> task -> mean over seeds of the final rows' test accuracy."""
    return {c: {t: float(np.mean([r["test_acc"] for r in rows if r["phase"] == "final" and r["configuration"] == c
                                  and r["dataset"] == t])) for t in SELECTION_TASKS} for c in SELECTION_CONFIGS}


def _search_means(rows) -> dict[str, float]:
    """configuration -> mean over tasks of the search's test accuracy at the lr of the highest mean test
    accuracy over seeds (the paper's rule; ties: the smaller lr)."""
    out = {}
    for c in SELECTION_CONFIGS:
        per = []
        for t in SELECTION_TASKS:
            by_lr = {lr: np.mean([r["test_acc"] for r in rows if r["phase"] == "search" and r["configuration"] == c
                                  and r["dataset"] == t and r["lr"] == lr]) for lr in SELECTION_LRS}
            per.append(by_lr[max(SELECTION_LRS, key=lambda lr: (by_lr[lr], -lr))])
        out[c] = float(np.mean(per))
    return out


def _ranking(line: str) -> dict[str, float]:
    """``{configuration: value}`` of a headline ``"sgd: a 70.1 > b 69.0 = c 69.0 — ..."``, in its order."""
    body = line.split(": ", 1)[1].split(" — ")[0]
    items = [x.rsplit(" ", 1) for x in re.split(r" > | = ", body)]
    return {name: float(value) for name, value in items}


def _assert_ranks(ranked: dict[str, float], means: dict[str, float]) -> None:
    """The headline ranks every configuration by ``means`` (fractions), most first, each printed to 0.1 point."""
    assert set(ranked) == set(means)
    order = list(ranked)
    assert all(means[a] >= means[b] - 1e-12 for a, b in zip(order, order[1:]))
    assert all(ranked[c] == pytest.approx(100 * means[c], abs=0.05 + 1e-9) for c in means)


def _against(line: str, c: str, ref: str) -> list[float]:
    """``[accuracy, ref − accuracy, p, Holm p]`` of criterion ``c`` in a criteria headline."""
    found = re.search(rf"\b{c} ([\d.]+) \({ref} − {c} ([+-][\d.]+) points, p ([\d.]+), Holm p ([\d.]+)\)", line)
    return [float(x) for x in found.groups()]


@pytest.fixture(scope="module")
def selection(tmp_path_factory):
    """``(rows, analysis result)`` of the selection preset's shape with its final fit."""
    study = selection_study(tmp_path_factory.mktemp("selection") / "study")
    return selection_rows(), run_analysis(study, figures=False)


def test_the_headline_and_every_section_answer_from_the_final_fit(selection, tmp_path):
    rows, res = selection
    final = _final_means(rows)
    overall = {c: float(np.mean(list(final[c].values()))) for c in SELECTION_CONFIGS}
    search = _search_means(rows)
    # the study's data make the demo's contradiction: the search ranks magnitude first, the final fit auto
    assert search["magnitude:20%"] > search["auto:20%"] and overall["auto:20%"] > overall["magnitude:20%"]
    line = next(h for h in _headlines(res) if h.startswith("sgd: "))
    assert FINAL_WORDS in line
    _assert_ranks(_ranking(line), overall)
    # the criteria section reads the same numbers
    crit = res.tables["criteria"]
    o = crit[crit["dataset"] == "overall"].set_index("configuration")
    assert all(o.loc[c, "mean"] == pytest.approx(overall[c], abs=1e-12) for c in SELECTION_CONFIGS)
    assert set(crit["lr_rule"]) == {"final"}
    # every table that reports an accuracy: the final fit; the lr search's own: the search
    t = res.tables["overall"].set_index("configuration")
    f = res.tables["frontier"]
    f = f[f["dataset"] == "overall"].set_index("configuration")
    v = res.tables["vtab"].set_index("configuration")
    for c in SELECTION_CONFIGS:
        assert t.loc[c, "mean"] == pytest.approx(overall[c], abs=1e-12)
        assert f.loc[c, "mean"] == pytest.approx(overall[c], abs=1e-12)
        assert v.loc[c, "mean_tasks"] == pytest.approx(overall[c], abs=1e-12)
    best = res.tables["best_lr"].groupby("configuration")["mean"].mean()
    assert all(best[c] == pytest.approx(search[c], abs=1e-12) for c in SELECTION_CONFIGS)
    for name, r in res.rendered.items():  # and each table says which
        search_table = name in ("best_lr", "lr_grid", "stability", "cost")
        phase = "Phase: the lr search" if search_table else "Phase: the final fit"
        assert r.footnotes[-1].startswith(phase), (name, r.footnotes[-1])
    captions = {name: caption for name, _t, caption, _d in figure_jobs(res.inputs, res.tables, [])}
    for name, caption in captions.items():
        search_figure = name.startswith(("accuracy_distribution", "accuracy_fixed_lr", "accuracy_vs_lr"))
        assert ("Phase: the lr search" if search_figure else "Phase: the final fit") in caption, name
    assert {"best_accuracy_per_dataset", "accuracy_vs_params", "frontier_overall", "vtab_frontier"} <= set(captions)
    html = build_html(res)
    assert "read by the VTAB-1k table only" not in html and "read by the headlines and every table" in html
    assert f"<li>{html_text.escape(line)}</li>" in html

    bare = run_analysis(selection_study(tmp_path / "bare", final=False), figures=False)
    line = next(h for h in _headlines(bare) if h.startswith("sgd: "))
    assert "from the lr search (the grid's trials, trained on train; test accuracy at each dataset's lr with the " \
           "highest mean test accuracy over seeds" in line
    _assert_ranks(_ranking(line), search)
    assert not any("Phase:" in n for r in bare.rendered.values() for n in r.footnotes)


def _criteria_line(lines: list[str], heading: str) -> str:
    return next(h for h in lines if h.startswith(f"Selection criteria, {heading}: "))


@pytest.mark.parametrize("budget", ["1%", "5%"])
def test_a_headline_answers_the_selection_question(tmp_path, budget):
    """Six datasets (test_analysis_criteria's study): p-values that differ, and Holm that changes them."""
    rows = _rows()
    res = run_analysis(_write(tmp_path / "s", rows), figures=False)
    line = _criteria_line(_headlines(res), f"sgd · units · {budget}")
    means = {c: [_best(rows, c, budget, ds)[0] for ds in DATASETS] for c in CRITERIA}
    others = [c for c in CRITERIA if c != "auto"]
    p = {c: stats.wilcoxon(means["auto"], means[c], alternative="two-sided").pvalue for c in others}
    holm = dict(zip(others, _holm_by_hand([p[c] for c in others])))
    auto = float(re.match(rf"Selection criteria, sgd · units · {budget}: auto \(plasticity\) ([\d.]+) against ",
                          line).group(1))
    assert auto == pytest.approx(100 * np.mean(means["auto"]), abs=0.05 + 1e-9)  # printed to 0.1
    for c in others:
        got = _against(line, c, "auto")
        want = [100 * np.mean(means[c]), 100 * (np.mean(means["auto"]) - np.mean(means[c])), p[c], holm[c]]
        assert got == pytest.approx(want, abs=0.05 + 1e-9), c
        assert got[2:] == pytest.approx(want[2:], abs=5e-4 + 1e-12), c  # p-values printed to 0.001
    assert f"paired over {len(DATASETS)} datasets, Holm over the {len(others)} criteria" in line
    assert "from the lr search" in line
    differ = [c for c in others if holm[c] < 0.05]
    assert line.endswith(f"; {', '.join(differ)} differ(s) from auto at 0.05 after Holm." if differ else
                         "; no criterion differs from auto at 0.05 after Holm.")
    assert len({round(v, 9) for v in p.values()}) > 1 and any(holm[c] > p[c] for c in others)  # Holm matters


def test_the_selection_headline_reads_the_final_fit(selection):
    rows, res = selection
    final = _final_means(rows)
    line = _criteria_line(_headlines(res), "sgd · units · 20%")
    units = [c for c in SELECTION_CONFIGS if c.endswith("20%")]
    auto = [final["auto:20%"][t] for t in SELECTION_TASKS]
    p = {c: stats.wilcoxon(auto, [final[c][t] for t in SELECTION_TASKS], alternative="two-sided").pvalue
         for c in units[1:]}
    holm = dict(zip(p, _holm_by_hand(list(p.values()))))
    assert p["magnitude:20%"] == pytest.approx(0.25) and holm["magnitude:20%"] == 1.0  # 3 tasks: 2 * 2**-3
    for c in units[1:]:
        mine = [final[c][t] for t in SELECTION_TASKS]
        got = _against(line, c.split(":")[0], "auto")
        assert got == pytest.approx([100 * np.mean(mine), 100 * (np.mean(auto) - np.mean(mine)), p[c], holm[c]],
                                    abs=0.05 + 1e-9), c
    assert "magnitude" in line and ", p 0.250, Holm p 1.000)" in line
    assert FINAL_WORDS in line and line.endswith("no criterion differs from auto at 0.05 after Holm (the smallest "
                                                 "two-sided p-value 3 pairs allow is 0.25).")
    weights = _criteria_line(_headlines(res), "sgd · weights · 1%")
    assert weights.startswith("Selection criteria, sgd · weights · 1%: random (the control: plasticity scores no "
                              "single weight) ")


def test_the_summary_lists_the_tests_the_report_holds(selection):
    _, res = selection
    assert "wilcoxon" not in res.tables  # no MHA: the paper's tests against MHA are not held
    line = dict(summary_items(res))["tests"]
    assert not line.startswith("none")
    assert ("Wilcoxon signed-rank of plasticity (auto) against each selection criterion (random at the weights "
            "granularity), two-sided, paired over datasets, Holm-corrected across each budget's criteria (section "
            "'Selection criteria at matched budgets')") in line
    with_p = {n for n, t in res.tables.items() if any(c == "p_value" or c.endswith("_p") for c in t.columns)}
    assert with_p == {"criteria", "matched_budget", "vtab_matched_budget"}
    assert all(f"table {n}" in line for n in with_p - {"criteria"})
    assert "the Wilcoxon tests against MHA were omitted" in line
    # the scope section speaks of the same tests: 3 tasks, two-sided: 2 * 2**-3; Holm over 6 criteria: 1
    scope = dict(scope_items(res))["tests"]
    assert "against MHA" not in scope
    assert ("Wilcoxon signed-rank of auto against each criterion at 20% of units: 3 pair(s) per test (paired by "
            f"dataset); the smallest p-value 3 pair(s) can reach is {2 * 2 ** -3:.3g} (two-sided), 1 after Holm "
            "over 6 tests") in scope
    assert "random against each criterion at 1% of weights" in scope
    html = build_html(res)
    assert "<dt>tests</dt><dd>Wilcoxon signed-rank of plasticity (auto)" in html and "selection tests" not in html


def test_the_scope_says_how_many_test_examples_each_accuracy_rests_on(selection, tmp_path):
    rows, res = selection
    line = dict(scope_items(res))["test examples"]
    for task, n in SELECTION_TEST_EXAMPLES.items():
        step = {500: "0.2", 400: "0.25", 250: "0.4"}[n]  # 100 / n percentage points
        assert f"{task} {n} (one example = {step} points)" in line
        assert all(abs(r["test_acc"] * n - round(r["test_acc"] * n)) < 1e-9 for r in rows if r["dataset"] == task)
    assert "steps of 100 / n percentage points" in line
    old = run_analysis(selection_study(tmp_path / "old", test_examples=False), figures=False)
    assert dict(scope_items(old))["test examples"].startswith("not recorded: trials.parquet has no test_examples")
    # a study whose runs saw different test splits of one dataset (a final fit on another split): a range
    mixed = pd.DataFrame([dict(r, test_examples=r["test_examples"] - (20 if r["phase"] == "final" and r["seed"] else 0))
                          for r in rows])
    for c in ("trainable_params", "best_val_step", "steps", "batch_size"):
        mixed[c] = mixed[c].astype("Int64")
    write_result(mixed, tmp_path / "mixed", "trials")
    ranged = dict(scope_items(run_analysis(tmp_path / "mixed", figures=False)))["test examples"]
    assert "cifar 480-500 (one example = 0.2-0.21 points)" in ranged
