"""What the report says beside its tables: why a ranking is omitted, what the bold notes and the Wilcoxon
footnotes mean, spreads that are zero by construction, rankings as written, probes counted apart from trials,
names from the data escaped."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from raystudy.cli import main as cli
from tests.support.study_tables import configuration_study

EVIL = "<script>alert(1)</script>|x"


def test_markdown_escapes_names_from_data(tmp_path):
    from raystudy.analysis.pipeline import run_analysis
    from tests.unit.analysis.test_analysis import make_study

    datasets = ("cifar10", EVIL, "two\nlines & [a link](http://example.com) `code` *em*")
    d = make_study(tmp_path / "s", datasets=datasets, models=("vit_tiny", "vit<b>tiny</b>"), curves=False)
    res = run_analysis(d, figures=False)
    mds = sorted((d / "analysis").glob("*.md"))
    assert {"best_lr.md", "lr_grid.md", "overall.md", "notes.md", "excluded.md"} <= {p.name for p in mds}
    for md in mds:
        text = md.read_text()
        assert not re.search(r"<\s*/?\s*(script|b)\b", text), md.name
        assert not re.search(r"(?<!\\)\]\(http", text) and "two\nlines" not in text, md.name  # no live link
        for block in text.split("\n\n"):  # every table row has its header's number of unescaped cell breaks
            rows = [line for line in block.splitlines() if line.startswith("|")]
            assert len({len(re.findall(r"(?<!\\)\|", r)) for r in rows}) <= 1, (md.name, block)
    best = (d / "analysis" / "best_lr.md").read_text()
    assert "| &lt;script>alert(1)&lt;/script>\\|x |" in best
    assert "two lines &amp; \\[a link\\](http://example.com) \\`code\\` \\*em\\*" in best
    assert "## model: vit&lt;b>tiny&lt;/b> · optimizer: sgd" in best
    # the CSV keeps the names as they are; the rendered cells (the HTML report's source) too
    assert EVIL in set(res.tables["best_lr"]["dataset"])



def _notes_of(res) -> str:
    return "\n".join(res.notes + [n for r in res.rendered.values() for n in r.footnotes])


def test_each_reason_the_ranking_is_omitted_or_undefined_is_noted(tmp_path):
    from raystudy.analysis.pipeline import run_analysis

    composite = run_analysis(configuration_study(tmp_path / "a", {"Head", "MHA+FC1", "MHA@2-3", "auto:10%"}),
                             figures=False)
    assert "ranking" not in composite.tables
    assert "no trial trains one of the five components alone" in _notes_of(composite)
    assert "no model appears in both" not in _notes_of(composite)  # the model is in both tables
    two = run_analysis(configuration_study(tmp_path / "b", {"Head", "MHA", "LN1"}, relabel={"MHA@0": "LN1"}),
                       figures=False)
    assert set(two.tables["ranking"]["n_components"]) == {2} and two.tables["ranking"]["spearman"].isna().all()
    assert "need at least 3 components; rows with 2 of them show '–'" in _notes_of(two)
    flat = run_analysis(configuration_study(tmp_path / "c", {"MHA", "LN1", "FC1"}, constant_plasticity=True,
                                             relabel={"MHA@0": "LN1", "FC1@0": "FC1"}), figures=False)
    assert set(flat.tables["ranking"]["n_components"]) == {3} and flat.tables["ranking"]["spearman"].isna().all()
    assert "the plasticities or the accuracies are all equal there" in _notes_of(flat)
    assert "need at least 3" not in _notes_of(flat)


def test_the_summary_and_the_bold_notes_name_what_the_tables_hold(tmp_path):
    from raystudy.analysis.html_report import write_report
    from raystudy.analysis.pipeline import run_analysis

    composite = run_analysis(configuration_study(tmp_path / "a", {"Head", "MHA+FC1", "auto:10%"}), figures=False)
    assert "wilcoxon" not in composite.tables  # no MHA trials: nothing to test against
    html = Path(write_report(composite)).read_text()
    assert ("<dt>tests</dt><dd>Kendall τ-b between the plasticity rankings (headlines); the Wilcoxon tests against "
            "MHA were omitted (see the notes)</dd>") in html  # the tests it holds: the headlines' (#45)
    assert "Wilcoxon vs MHA" not in html
    assert "Bold:" not in _notes_of(composite)
    some = run_analysis(configuration_study(tmp_path / "b", {"Head", "MHA", "LN1", "FC1"},
                                             relabel={"MHA@0": "LN1", "FC1@0": "FC1"}), figures=False)
    assert "Bold: the best of the components LN1, MHA, FC1 for the dataset." in some.rendered["best_lr"].footnotes
    assert "Wilcoxon vs MHA, alternative greater" in Path(write_report(some)).read_text()


@pytest.mark.parametrize("alternative", ["greater", "two-sided"])
def test_the_wilcoxon_footnotes_name_the_statistic_they_print(tmp_path, alternative):
    """scipy prints W+ for a one-sided test and min(W+, W−) for a two-sided one: each footnote says which,
    and the numbers are those (rank sums computed here)."""
    from scipy import stats

    from raystudy.analysis.pipeline import run_analysis

    study = configuration_study(tmp_path / "s", {"Head", "MHA", "All", "auto:10%", "random:10%", "lora:r=12"})
    res = run_analysis(study, alternative=alternative, pair_by="dataset", figures=False)
    said = "W+, the sum of the ranks of the positive differences (reference − other)" if alternative == "greater" \
        else "min(W+, W−), the smaller of the rank sums of the positive and of the negative differences"
    assert any(said in n for n in res.rendered["wilcoxon"].footnotes), res.rendered["wilcoxon"].footnotes
    assert any("min(W+, W−)" in n for n in res.rendered["matched_budget"].footnotes)  # always two-sided
    acc = res.tables["best_lr"].pivot(index="dataset", columns="configuration", values="mean")

    def rank_sums(a, b):
        d = (acc[a] - acc[b]).to_numpy()
        d = d[d != 0]
        r = stats.rankdata(np.abs(d))
        return r[d > 0].sum(), r[d < 0].sum()

    for row in res.tables["wilcoxon"].itertuples():
        plus, minus = rank_sums(row.reference, row.other)
        assert row.statistic == pytest.approx(plus if alternative == "greater" else min(plus, minus), abs=1e-9)
    for row in res.tables["matched_budget"].itertuples():
        plus, minus = rank_sums(row.first, row.second)
        assert row.statistic == pytest.approx(min(plus, minus), abs=1e-9) and plus != minus
    # the smallest attainable p-value, for the study's 5 pairs: scipy's p when every difference has one sign
    for name, alt in (("wilcoxon", alternative), ("matched_budget", "two-sided")):
        floor = stats.wilcoxon(np.arange(1.0, 6.0), np.zeros(5), alternative=alt).pvalue
        assert f"{floor:.3g} for n = 5 here." in res.rendered[name].footnotes[-1], res.rendered[name].footnotes


def test_spreads_that_are_zero_by_construction_are_noted(tmp_path):
    import pandas as pd

    from raystudy.analysis.pipeline import run_analysis
    from raystudy.io import read_result, write_result

    full = configuration_study(tmp_path / "full", {"Head", "MHA", "auto:10%"})
    assert "by construction" not in _notes_of(run_analysis(full, figures=False))  # 2 lrs x 2 seeds
    trials = read_result(full, "trials")
    lr = trials["lr"].min()
    for name, keep, said in (("one", (trials["lr"] == lr) & (trials["seed"] == 0), "one learning rate and one seed"),
                             ("seeds", trials["lr"] == lr, "one learning rate per dataset")):
        write_result(pd.DataFrame(trials[keep]), tmp_path / name, "trials")
        notes = _notes_of(run_analysis(tmp_path / name, figures=False))
        assert f"Each configuration ran {said}" in notes and "0 by construction" in notes


def test_probes_are_counted_apart_from_trials(tmp_path):
    from raystudy.analysis.html_report import write_report
    from raystudy.analysis.pipeline import run_analysis
    from raystudy.io import read_result
    from raystudy.study.results import load_study
    from tests.unit.analysis.test_analysis import DATASETS, make_study

    path = make_study(tmp_path / "s", probe=True, plasticity=False, bounds=False, curves=False,
                      datasets=DATASETS[:2])
    trials = read_result(path, "trials")
    n_probes = int((trials.configuration == "LP").sum())
    n_trials = len(trials) - n_probes
    assert n_probes >= 1 and n_trials > n_probes
    assert f"trials: {n_trials} rows (+ {n_probes} rows of linear probes)" in repr(load_study(str(path)))
    html = Path(write_report(run_analysis(str(path), figures=False))).read_text()  # the counts, not the figures
    assert f"{n_trials} in total, " in html and f"{len(trials)} in total" not in html
    assert f"{n_probes} ({n_probes} counted), one per dataset; not trials" in html


def test_markdown_tables_show_rankings_as_written(tmp_path):
    from raystudy.analysis.pipeline import run_analysis

    res = run_analysis(configuration_study(tmp_path / "s", {"MHA", "LN1", "FC1"},
                                            relabel={"MHA@0": "LN1", "FC1@0": "FC1"}), figures=False)
    md = (res.out_dir / "ranking.md").read_text()
    assert "&gt;" not in md and " > " in md
    ranking = res.tables["ranking"]["plasticity_ranking"].iloc[0]
    assert ranking.count(" > ") == 2 and ranking in md


@pytest.mark.parametrize("round_to", [0, 2])
def test_wilcoxon_on_values_rounded_as_printed(tmp_path, round_to, capsys):
    """``analyze --round N`` tests the best-lr accuracies as percentages rounded to N decimals (scipy on the
    rounded values, computed here from the best-lr table), and says so in the footnote and the summary."""
    from scipy import stats

    from raystudy.analysis.html_report import write_report
    from raystudy.analysis.pipeline import run_analysis

    study = configuration_study(tmp_path / "s", {"Head", "MHA", "LN1", "FC1"},
                                 relabel={"MHA@0": "LN1", "FC1@0": "FC1"})
    res = run_analysis(study, round_to=round_to, figures=False)
    acc = (100 * res.tables["best_lr"].pivot(index="dataset", columns="configuration", values="mean")).round(round_to)
    for row in res.tables["wilcoxon"].itertuples():
        d = acc[row.reference] - acc[row.other]
        if (d == 0).all():
            assert np.isnan(row.p_value)
            continue
        ref = stats.wilcoxon(acc[row.reference], acc[row.other], alternative="greater")
        assert (row.statistic, row.p_value) == pytest.approx((ref.statistic, ref.pvalue), abs=1e-12)
    assert any(f"rounded to {round_to} decimal(s)" in n for n in res.rendered["wilcoxon"].footnotes)
    assert f"on values rounded to {round_to} decimal(s) of a percent" in Path(write_report(res)).read_text()
    assert cli(["analyze", str(study), "--no-figures", "--round", "9"]) == 2
    assert "round_to: decimals of a percent from 0 to 6" in capsys.readouterr().err

