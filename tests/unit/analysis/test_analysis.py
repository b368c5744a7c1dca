"""Analysis tables, tests, figures and degraded paths on synthetic study directories with known values.

Every expected number is recomputed here from the raw synthetic rows with plain Python loops (and scipy
for the test distributions, plus an exact enumeration of the signed-rank null distribution), never by
calling the functions under test.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from raystudy.io import TableError
from raystudy.storage import write_parquet_atomic
from tests.support.study_tables import (
    COMPONENTS,
    CONFIGS,
    DATASETS,
    LRS,
    SEEDS,
    by_key,
    diverged_runs,
    expected_best,
    is_counted,
    make_study,
    mean,
    pop_std,
    raw_trials,
    signed_rank_exact_p,
    sweeps,
)

# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def study(tmp_path_factory) -> tuple[Path, dict]:
    from raystudy.analysis import analyze

    d = make_study(tmp_path_factory.mktemp("study") / "s1")
    return d, analyze(d, figures=False)  # figures: test_cli_analyze_and_report, on a smaller study


# ---------------------------------------------------------------- tables vs independent computations

def test_every_table_written_as_csv_and_markdown(study):
    d, tables = study
    assert list(tables) == ["best_lr", "lr_grid", "overall", "relative_gain", "optimizers", "wilcoxon", "stability",
                            "ranking", "cost"]
    for name, df in tables.items():
        csv = pd.read_csv(d / "analysis" / f"{name}.csv")
        assert list(csv.columns) == list(df.columns), name
        assert len(csv) == len(df) > 0, name
        pd.testing.assert_frame_equal(csv, df.reset_index(drop=True), check_dtype=False, obj=name)
        md = (d / "analysis" / f"{name}.md").read_text()
        assert md.startswith("# ") and "|" in md, name
    assert not (d / "analysis" / "figures").exists()


def test_best_lr_matches_loops(study):
    d, tables = study
    t = tables["best_lr"]
    assert list(t.columns) == ["dataset", "optimizer", "configuration", "lr", "mean", "std", "n_seeds", "n_diverged"]
    exp = expected_best(raw_trials(d))
    div = diverged_runs(raw_trials(d))
    assert len(t) == len(exp) == len(DATASETS) * len(LRS) * len(CONFIGS)
    got = by_key(t, ["dataset", "optimizer", "configuration"])
    for (_model, ds, opt, comp), (lr, m, s, n) in exp.items():
        r = got[(ds, opt, comp)]
        assert r["lr"] == lr and r["n_seeds"] == n
        assert r["mean"] == pytest.approx(m, abs=1e-12)
        assert r["std"] == pytest.approx(s, abs=1e-12)
        assert r["n_diverged"] == sum((_model, ds, opt, comp, lr, seed) in div for seed in SEEDS)
    assert t["n_diverged"].sum() > 0  # some best-lr means do count a diverged run
    # Rows in configuration order within each dataset/optimizer; CSV keeps fractions.
    assert list(t["configuration"][:7]) == list(CONFIGS)
    assert t["mean"].between(0, 1).all()


def test_failed_trials_never_counted(study):
    d, tables = study
    trials = raw_trials(d)
    bad = [t for t in trials if not is_counted(t)]
    assert {t["status"] for t in bad} == {"diverged", "failed"}
    # A failed trial carries test_acc 0.999: counting it would push some mean above every ok accuracy.
    assert tables["stability"]["max"].max() < 0.999
    assert tables["lr_grid"]["n_trials"].sum() == len(trials) - len(bad)
    n_div = sum(t["status"] == "diverged" for t in trials if is_counted(t))
    assert tables["lr_grid"]["n_diverged"].sum() == n_div > 0  # diverged runs with an evaluation count
    md = (d / "analysis" / "best_lr.md").read_text()
    n_early = sum(t["status"] == "diverged" for t in bad)
    n_fail = sum(t["status"] == "failed" for t in bad)
    assert f"{len(bad)} of {len(trials)} trials excluded" in md
    assert f"{n_early} diverged before any evaluation" in md and f"{n_fail} status failed" in md
    excluded = pd.read_csv(d / "analysis" / "excluded.csv")
    assert sorted(excluded["trial_id"]) == sorted(t["trial_id"] for t in bad)


def test_lr_grid_matches_loops(study):
    d, tables = study
    t = tables["lr_grid"]
    assert list(t.columns) == ["dataset", "optimizer", "configuration", "mean", "std", "n_lrs", "n_trials",
                               "n_diverged"]
    got = by_key(t, ["dataset", "optimizer", "configuration"])
    for (_model, ds, opt, comp), by_lr in sweeps(raw_trials(d)).items():
        means = [mean(by_lr[lr].values()) for lr in sorted(by_lr)]
        r = got[(ds, opt, comp)]
        assert r["mean"] == pytest.approx(mean(means), abs=1e-12)
        assert r["std"] == pytest.approx(pop_std(means), abs=1e-12)
        assert r["n_lrs"] == len(by_lr)
        assert r["n_trials"] == sum(len(v) for v in by_lr.values())


def test_overall_matches_loops(study):
    d, tables = study
    t = tables["overall"]
    assert list(t.columns) == ["optimizer", "configuration", "mean", "std", "n_datasets", "n_diverged", "lr_grid_mean",
                               "lr_grid_std"]
    best = expected_best(raw_trials(d))
    sw = sweeps(raw_trials(d))
    got = by_key(t, ["optimizer", "configuration"])
    assert len(got) == len(LRS) * len(CONFIGS)
    for opt in LRS:
        for comp in CONFIGS:
            accs = [best[("vit_tiny", ds, opt, comp)][1] for ds in DATASETS]
            grid_means, grid_stds = [], []
            for ds in DATASETS:
                by_lr = sw[("vit_tiny", ds, opt, comp)]
                seed_means = [mean(by_lr[lr].values()) for lr in by_lr]
                grid_means.append(mean(seed_means))
                grid_stds.append(pop_std(seed_means))
            r = got[(opt, comp)]
            assert r["mean"] == pytest.approx(mean(accs), abs=1e-12)
            assert r["std"] == pytest.approx(pop_std(accs), abs=1e-12)
            assert r["n_datasets"] == len(DATASETS)
            assert r["lr_grid_mean"] == pytest.approx(mean(grid_means), abs=1e-12)
            assert r["lr_grid_std"] == pytest.approx(mean(grid_stds), abs=1e-12)


def test_relative_gain_matches_loops(study):
    d, tables = study
    t = tables["relative_gain"]
    best = expected_best(raw_trials(d))
    got = by_key(t, ["dataset", "optimizer", "configuration"])
    assert "Head" not in set(t["configuration"])
    for opt in LRS:
        for comp in CONFIGS[:-1]:
            gains, accs, heads = [], [], []
            for ds in DATASETS:
                acc, head = best[("vit_tiny", ds, opt, comp)][1], best[("vit_tiny", ds, opt, "Head")][1]
                r = got[(ds, opt, comp)]
                assert r["accuracy"] == pytest.approx(acc, abs=1e-12)
                assert r["reference_accuracy"] == pytest.approx(head, abs=1e-12) and r["reference"] == "Head"
                assert r["relative_gain"] == pytest.approx((acc - head) / head, abs=1e-12)
                gains.append((acc - head) / head)
                accs.append(acc)
                heads.append(head)
            r = got[("overall", opt, comp)]
            assert r["relative_gain"] == pytest.approx(mean(gains), abs=1e-12)
            assert r["accuracy"] == pytest.approx(mean(accs), abs=1e-12)
            assert r["reference_accuracy"] == pytest.approx(mean(heads), abs=1e-12)
    assert list(t["dataset"])[-1] == "overall"


def test_wilcoxon_matches_scipy_and_exact_enumeration(study):
    d, tables = study
    t = tables["wilcoxon"]
    assert list(t.columns) == ["optimizer", "reference", "other", "statistic", "p_value", "n_pairs", "significant"]
    best = expected_best(raw_trials(d))
    got = by_key(t, ["optimizer", "other"])
    assert len(got) == len(LRS) * (len(CONFIGS) - 1)
    for opt in LRS:
        for other in CONFIGS:
            if other == "MHA":
                continue
            x = [best[("vit_tiny", ds, opt, "MHA")][1] for ds in DATASETS]
            y = [best[("vit_tiny", ds, opt, other)][1] for ds in DATASETS]
            ref = stats.wilcoxon(x, y, alternative="greater")
            t_plus, p_exact = signed_rank_exact_p(x, y)
            r = got[(opt, other)]
            assert r["reference"] == "MHA" and r["n_pairs"] == len(DATASETS)
            assert r["statistic"] == pytest.approx(ref.statistic) == pytest.approx(t_plus)
            assert r["p_value"] == pytest.approx(ref.pvalue, rel=1e-12) == pytest.approx(p_exact, rel=1e-9)
            assert r["significant"] == (p_exact < 0.05)
    # The synthetic effect is large: MHA beats the LayerNorms and Head on all 7 datasets (p = 2^-7).
    assert got[("sgd", "LN1")]["p_value"] == pytest.approx(2.0 ** -7)
    assert got[("sgd", "Head")]["significant"]


def test_wilcoxon_two_sided_and_dataset_seed_pairs(tmp_path):
    from raystudy.analysis.inputs import read_inputs
    from raystudy.analysis.pipeline import compute_tables

    d = make_study(tmp_path / "s", seed=3, curves=False, bounds=False, plasticity=False,
                   datasets=DATASETS[:4])
    inputs = read_inputs(d)
    t = compute_tables(inputs, reference="FC1", alternative="two-sided", pair_by="dataset_seed")["wilcoxon"]
    trials = raw_trials(d)
    best = expected_best(trials)
    acc = {(t_["dataset"], t_["optimizer"], t_["configuration"], t_["lr"], t_["seed"]): t_["test_acc"]
           for t_ in trials if is_counted(t_)}
    got = by_key(t, ["optimizer", "other"])
    for opt in LRS:
        for other in CONFIGS:
            if other == "FC1":
                continue
            x, y = [], []
            for ds in DATASETS[:4]:
                lr_ref, lr_oth = best[("vit_tiny", ds, opt, "FC1")][0], best[("vit_tiny", ds, opt, other)][0]
                for s in SEEDS:
                    a, b = acc.get((ds, opt, "FC1", lr_ref, s)), acc.get((ds, opt, other, lr_oth, s))
                    if a is not None and b is not None:
                        x.append(a)
                        y.append(b)
            ref = stats.wilcoxon(x, y, alternative="two-sided")
            r = got[(opt, other)]
            assert r["reference"] == "FC1" and r["n_pairs"] == len(x)
            assert r["statistic"] == pytest.approx(ref.statistic)
            assert r["p_value"] == pytest.approx(ref.pvalue, rel=1e-12)
            if len(x) <= 12:
                assert r["p_value"] == pytest.approx(signed_rank_exact_p(x, y, "two-sided")[1], rel=1e-9)


def test_stability_matches_loops(study):
    d, tables = study
    t = tables["stability"]
    assert list(t.columns) == ["dataset", "optimizer", "configuration", "mean", "std", "min", "max", "range",
                               "n_trials", "n_diverged"]
    got = by_key(t, ["dataset", "optimizer", "configuration"])
    per = defaultdict(list)
    for (_model, ds, opt, comp), by_lr in sweeps(raw_trials(d)).items():
        v = [a for seeds in by_lr.values() for a in seeds.values()]
        r = got[(ds, opt, comp)]
        assert r["std"] == pytest.approx(pop_std(v), abs=1e-12)
        assert r["range"] == pytest.approx(max(v) - min(v), abs=1e-12)
        assert (r["min"], r["max"], r["n_trials"]) == (min(v), max(v), len(v))
        assert r["mean"] == pytest.approx(mean(v), abs=1e-12)
        per[(opt, comp)].append((pop_std(v), max(v) - min(v), len(v)))
    for (opt, comp), vals in per.items():
        r = got[("overall", opt, comp)]
        assert r["std"] == pytest.approx(mean(v[0] for v in vals), abs=1e-12)
        assert r["range"] == pytest.approx(mean(v[1] for v in vals), abs=1e-12)
        assert r["n_trials"] == sum(v[2] for v in vals)


def kendall_tau_by_pairs(a, b) -> float:
    """Kendall's tau-a by counting concordant and discordant pairs (no ties in the synthetic data)."""
    n, s = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            s += np.sign(a[i] - a[j]) * np.sign(b[i] - b[j])
    return s / (n * (n - 1) / 2)


def spearman_by_formula(a, b) -> float:
    """``1 - 6 sum d^2 / (n (n^2 - 1))`` on the ranks (no ties)."""
    ra, rb = stats.rankdata(a), stats.rankdata(b)
    n = len(a)
    return 1 - 6 * float(((ra - rb) ** 2).sum()) / (n * (n * n - 1))


def spearman_exact_p(a, b) -> float:
    """Two-sided exact p of Spearman's rho: all n! rank pairings, 2 * min(P(rho >= obs), P(rho <= obs))."""
    obs = spearman_by_formula(a, b)
    rb = stats.rankdata(b)
    rhos = np.array([spearman_by_formula(perm, rb) for perm in itertools.permutations(stats.rankdata(a))])
    return min(1.0, 2 * min(np.mean(rhos >= obs - 1e-12), np.mean(rhos <= obs + 1e-12)))


def test_ranking_matches_independent_correlations(study):
    d, tables = study
    t = tables["ranking"]
    assert list(t.columns) == ["dataset", "optimizer", "mode", "spearman", "spearman_p", "kendall", "kendall_p",
                               "n_components", "plasticity_ranking", "accuracy_ranking"]
    plast = pd.read_parquet(d / "plasticity.parquet").to_dict("records")
    pl = defaultdict(list)
    for r in plast:
        pl[(r["dataset"], r["component"])].append(r["plasticity"])
    best = expected_best(raw_trials(d))
    got = by_key(t, ["dataset", "optimizer"])
    assert len(got) == len(LRS) * (len(DATASETS) + 1)
    for opt in LRS:
        p_all, a_all = defaultdict(list), defaultdict(list)
        for ds in DATASETS:
            p = [mean(pl[(ds, c)]) for c in COMPONENTS]
            a = [best[("vit_tiny", ds, opt, c)][1] for c in COMPONENTS]
            for c, pv, av in zip(COMPONENTS, p, a):
                p_all[c].append(pv)
                a_all[c].append(av)
            r = got[(ds, opt)]
            assert r["n_components"] == 5 and r["mode"] == "embedding"
            assert r["spearman"] == pytest.approx(spearman_by_formula(p, a), abs=1e-12)
            assert r["spearman_p"] == pytest.approx(spearman_exact_p(p, a), rel=1e-9)
            assert r["kendall"] == pytest.approx(kendall_tau_by_pairs(p, a), abs=1e-12)
            assert r["kendall_p"] == pytest.approx(stats.kendalltau(p, a).pvalue, rel=1e-9)
            order = sorted(COMPONENTS, key=lambda c: -p[COMPONENTS.index(c)])
            assert r["plasticity_ranking"] == " > ".join(order)
        p = [mean(p_all[c]) for c in COMPONENTS]
        a = [mean(a_all[c]) for c in COMPONENTS]
        r = got[("overall", opt)]
        assert r["spearman"] == pytest.approx(spearman_by_formula(p, a), abs=1e-12)
        assert r["kendall"] == pytest.approx(kendall_tau_by_pairs(p, a), abs=1e-12)
        assert r["plasticity_ranking"] == "MHA > FC1 > FC2 > LN2 > LN1"


def test_cost_matches_loops(study):
    d, tables = study
    t = tables["cost"]
    assert list(t.columns) == ["optimizer", "configuration", "trainable_params", "grad_memory_bytes",
                               "optimizer_memory_bytes", "wall_seconds", "wall_seconds_std", "total_wall_seconds",
                               "n_trials", "images_per_s"]
    trials = raw_trials(d)
    failed = [x for x in trials if x["status"] == "failed"]
    assert failed and all(pd.isna(x["trainable_params"]) for x in failed)  # null: never a parameter count

    def median_recorded(rows, column):
        return float(np.median([x[column] for x in rows if not pd.isna(x[column])]))

    got = by_key(t, ["optimizer", "configuration"])
    for opt in LRS:
        for config in CONFIGS:
            mine = [x for x in trials if x["optimizer"] == opt and x["configuration"] == config]
            ok = [x for x in mine if x["status"] == "ok"]
            r = got[(opt, config)]
            for column in ("trainable_params", "optimizer_memory_bytes", "grad_memory_bytes"):
                assert r[column] == median_recorded(mine, column), column
            assert r["wall_seconds"] == pytest.approx(mean(x["wall_seconds"] for x in ok), abs=1e-9)
            assert r["wall_seconds_std"] == pytest.approx(pop_std(x["wall_seconds"] for x in ok), abs=1e-9)
            assert r["total_wall_seconds"] == pytest.approx(
                sum(x["wall_seconds"] for x in mine if not math.isnan(x["wall_seconds"])), abs=1e-9)
            assert r["images_per_s"] == pytest.approx(mean(x["images_per_s"] for x in ok), abs=1e-9)
            assert r["n_trials"] == len(mine)
    md = (d / "analysis" / "cost.md").read_text()
    assert "nan" not in md and "KiB" in md


def test_markdown_shows_percent_and_marks_best(study):
    d, _ = study
    best = expected_best(raw_trials(d))
    div = diverged_runs(raw_trials(d))
    md = (d / "analysis" / "best_lr.md").read_text()
    sgd_block = md.split("## optimizer: sgd")[1]
    marked = 0
    for line in sgd_block.splitlines():
        if not line.startswith("| ") or line.startswith("| dataset"):
            continue
        ds = line.split(" | ")[0][2:]
        cells = {}
        for config in CONFIGS:  # "mean ± std [‡] (lr 1e-2)" in percent, lr as mantissa e exponent
            lr, m, s, _n = best[("vit_tiny", ds, "sgd", config)]
            mant, exp = f"{lr:e}".split("e")
            mark = " ‡" if any(("vit_tiny", ds, "sgd", config, lr, seed) in div for seed in SEEDS) else ""
            marked += bool(mark)
            cells[config] = f"{100 * m:.1f} ± {100 * s:.1f}{mark}"
            assert f"{cells[config]} (lr {float(mant):g}e{int(exp)})" in line.replace("**", ""), config
        top = max(COMPONENTS, key=lambda c: best[("vit_tiny", ds, "sgd", c)][1])
        assert line.count("**") == 2 and f"**{cells[top]}**" in line  # bold: the best of the five components
    assert marked and "‡: includes diverged run(s)" in md and "ddof = 0" in md
    w = (d / "analysis" / "wilcoxon.md").read_text()
    assert "one-sided" in w and "paired over datasets" in w


# ---------------------------------------------------------------- degraded paths and errors

def test_without_plasticity_parts_are_omitted_with_a_note(tmp_path):
    from raystudy.analysis.pipeline import run_analysis

    d = make_study(tmp_path / "s", plasticity=False, bounds=False, curves=False, head=False, memory=False,
                   failures=False, datasets=DATASETS[:2])
    (d / "analysis").mkdir()
    (d / "analysis" / "ranking.csv").write_text("stale\n")  # from an earlier run with plasticity
    res = run_analysis(d, figures=False)
    tables = res.tables
    assert "ranking" not in tables and "relative_gain" not in tables
    assert not (d / "analysis" / "ranking.csv").exists()
    notes = (d / "analysis" / "notes.md").read_text()
    assert "No plasticity.parquet" in notes and "no Head trials" in notes and "No curves.parquet" in notes
    assert "excluded" not in (d / "analysis" / "best_lr.md").read_text()
    assert "grad_memory_bytes" not in tables["cost"].columns and "images_per_s" not in tables["cost"].columns
    names = ("accuracy_distribution", "accuracy_fixed_lr_adamw", "accuracy_fixed_lr_sgd", "accuracy_vs_lr",
             "best_accuracy", "best_accuracy_per_dataset", "accuracy_vs_params")
    assert sorted(res.available_figures) == sorted(names)  # drawn: test_cli_analyze_and_report_write_every_figure


def test_plasticity_only_study(tmp_path):
    from raystudy.analysis.pipeline import run_analysis

    d = make_study(tmp_path / "s", rates=True, datasets=DATASETS[:2])
    (d / "trials.parquet").unlink()
    (d / "curves.parquet").unlink()
    res = run_analysis(d, figures=["plasticity_depth"])
    assert res.tables == {}
    assert set(res.available_figures) == {"plasticity_depth", "plasticity_distribution", "plasticity_rate_violins",
                                          "bounds"}
    assert sorted(p.name for p in (d / "analysis" / "figures").iterdir()) == ["plasticity_depth.png",
                                                                      "plasticity_depth.svg"]
    assert "No trials.parquet" in (d / "analysis" / "notes.md").read_text()


def test_uri_study_dir_and_empty_curves(tmp_path):
    from raystudy.analysis import report
    from raystudy.vocab import columns

    d = make_study(tmp_path / "s", curves=False, plasticity=False, bounds=False, datasets=DATASETS[:2])
    write_parquet_atomic(d / "curves.parquet", pd.DataFrame(columns=columns("curves")))  # no trial evaluated
    local = report(d.as_uri(), figures=["relative_gain"])  # file:///...: staged, then uploaded next to the tables
    assert local.name == "report.html" and local.parent != d / "analysis"
    uploaded = d / "analysis" / "report.html"
    assert uploaded.read_text() == local.read_text()
    assert (d / "analysis" / "best_lr.csv").exists() and (d / "analysis" / "figures" / "relative_gain.png").exists()
    assert "curves.parquet has no rows" in (d / "analysis" / "notes.md").read_text()


def _write_trials(d: Path, df: pd.DataFrame) -> None:
    write_parquet_atomic(d / "trials.parquet", df)


@pytest.mark.parametrize("mutate, column", [
    (lambda df: df.drop(columns=["test_acc"]), "test_acc"),
    (lambda df: df.assign(test_acc=df["test_acc"] * 100), "test_acc"),
    (lambda df: df.assign(configuration=df["configuration"].replace({"MHA": "attn"})), "configuration"),
    (lambda df: df.assign(lr=df["lr"].astype(str).replace({"0.01": "ten"})), "lr"),
    (lambda df: pd.concat([df, df.iloc[[0]]]), "seed"),
])
def test_malformed_trials_name_file_and_column(tmp_path, mutate, column):
    from raystudy.analysis import analyze

    d = make_study(tmp_path / "s", plasticity=False, bounds=False, curves=False, failures=False,
                   datasets=DATASETS[:2])
    _write_trials(d, mutate(pd.read_parquet(d / "trials.parquet")))
    with pytest.raises(TableError) as e:
        analyze(d, figures=False)
    msg = str(e.value)
    assert str(d / "trials.parquet") in msg and column in msg


def test_empty_and_malformed_other_tables(tmp_path):
    from raystudy.analysis import analyze

    d = make_study(tmp_path / "s", curves=False, failures=False, datasets=DATASETS[:2])
    good = pd.read_parquet(d / "plasticity.parquet")
    write_parquet_atomic(d / "plasticity.parquet", good.iloc[0:0])
    with pytest.raises(TableError, match=r"plasticity\.parquet: the table is empty"):
        analyze(d, figures=False)
    write_parquet_atomic(d / "plasticity.parquet", good.drop(columns=["ci95"]))
    with pytest.raises(TableError, match=r"plasticity\.parquet: missing column\(s\) \['ci95'\]"):
        analyze(d, figures=False)
    (d / "plasticity.parquet").write_bytes(b"not parquet")
    with pytest.raises(TableError, match=r"plasticity\.parquet: not a readable Parquet file"):
        analyze(d, figures=False)
    (d / "plasticity.parquet").unlink()
    write_parquet_atomic(d / "bounds.parquet", pd.read_parquet(d / "bounds.parquet").assign(bound="big"))
    with pytest.raises(TableError, match=r"bounds\.parquet: column 'bound': non-numeric"):
        analyze(d, figures=False)
    with pytest.raises(TableError, match="neither trials.parquet nor plasticity.parquet"):
        analyze(tmp_path / "nothing-here", figures=False)


def test_bad_options_name_the_parameter(tmp_path):
    from raystudy.analysis import analyze

    d = make_study(tmp_path / "s", plasticity=False, bounds=False, curves=False, datasets=DATASETS[:2])
    with pytest.raises(ValueError, match=r"reference: unknown value 'ATTN'; expected one of \['LN1', 'MHA'"):
        analyze(d, reference="ATTN")
    with pytest.raises(ValueError, match=r"pair_by: unknown value 'seed'; expected one of \['dataset', "):
        analyze(d, pair_by="seed")
    with pytest.raises(ValueError, match=r"alternative: unknown value 'bigger'; expected one of \['greater'"):
        analyze(d, alternative="bigger")
    assert not (d / "analysis").exists()  # rejected before anything is written


def test_several_models_get_a_model_column(tmp_path):
    from raystudy.analysis import analyze

    d = make_study(tmp_path / "s", models=("vit_a", "vit_b"), curves=False, bounds=False, datasets=DATASETS[:3])
    tables = analyze(d, figures=False)
    for name, df in tables.items():
        assert df.columns[0] == "model", name
        assert set(df["model"]) == {"vit_a", "vit_b"}, name
    best = tables["best_lr"]
    exp = expected_best(raw_trials(d))
    for r in best.to_dict("records"):
        assert r["mean"] == pytest.approx(exp[(r["model"], r["dataset"], r["optimizer"], r["configuration"])][1])


def test_old_study_directory_gives_the_same_tables(tmp_path):
    """A study written before the vocabulary was unified (``component`` column, ``-1`` for a failed trial's
    counts) analyses to exactly the tables of the same study written today."""
    from raystudy.analysis import analyze

    old = make_study(tmp_path / "old", old=True, seed=7, datasets=DATASETS[:3], rates=True)
    new = make_study(tmp_path / "new", seed=7, datasets=DATASETS[:3], rates=True)
    raw = pd.read_parquet(old / "trials.parquet")
    assert "component" in raw.columns and "configuration" not in raw.columns
    failed = raw["status"] == "failed"
    assert failed.any() and (raw.loc[failed, "trainable_params"] == -1).all()
    assert (raw.loc[failed, "best_val_step"] == -1).all()
    t_old, t_new = analyze(old, figures=False), analyze(new, figures=False)
    assert list(t_old) == list(t_new) == ["best_lr", "lr_grid", "overall", "relative_gain", "optimizers", "wilcoxon",
                                          "stability", "ranking", "cost"]
    for name in t_new:
        pd.testing.assert_frame_equal(t_old[name], t_new[name], obj=name)
        assert (old / "analysis" / f"{name}.md").read_text() == (new / "analysis" / f"{name}.md").read_text()
    assert (old / "analysis" / "notes.md").read_text() == (new / "analysis" / "notes.md").read_text()
    cost = t_old["cost"]  # the -1 of old failed rows is no parameter count
    assert (cost["trainable_params"] > 0).all() and "configuration" in cost.columns


def paired_accuracies(trials: list[dict], opt: str, config: str, pair_by: str) -> dict:
    """pair -> accuracy of ``config``: per dataset its best-lr mean over seeds (``dataset``), or per (dataset,
    seed) that seed's ok accuracy at the configuration's best lr on the dataset (``dataset_seed``)."""
    best = expected_best(trials)
    if pair_by == "dataset":
        return {ds: v[1] for (_m, ds, o, c), v in best.items() if (o, c) == (opt, config)}
    return {(t["dataset"], t["seed"]): t["test_acc"] for t in trials
            if is_counted(t) and (t["optimizer"], t["configuration"]) == (opt, config)
            and t["lr"] == best[(t["model"], t["dataset"], opt, config)][0]}


def test_cli_analyze_out_reference_and_pair_by(tmp_path, capsys):
    """``raystudy analyze --out --reference --pair-by``: files land in --out, the Wilcoxon rows are the
    reference against every other configuration on the pairs the option names (scipy on pairs built here)."""
    from raystudy.cli import main

    datasets = DATASETS[:5]
    d = make_study(tmp_path / "s", seed=5, plasticity=False, bounds=False, curves=False, datasets=datasets)
    trials = raw_trials(d)
    written = [f"{n}.{e}" for n in ("best_lr", "lr_grid", "overall", "relative_gain", "optimizers", "wilcoxon",
                                     "stability", "cost", "excluded") for e in ("csv", "md", "tex")] + ["notes.md"]
    n_pairs = {}
    for ref, pair_by in (("LN2", "dataset"), ("FC1", "dataset_seed")):
        out = tmp_path / f"out-{ref}-{pair_by}"
        assert main(["analyze", str(d), "--out", str(out), "--reference", ref, "--pair-by", pair_by,
                     "--no-figures"]) == 0
        assert f"written to {out}" in capsys.readouterr().out
        assert sorted(p.name for p in out.iterdir()) == sorted(written)
        w = pd.read_csv(out / "wilcoxon.csv")
        assert list(w["other"]) == [c for c in CONFIGS if c != ref] * 2  # adamw rows, then sgd rows
        assert set(w["reference"]) == {ref} and list(w["optimizer"]) == ["adamw"] * 6 + ["sgd"] * 6
        for r in w.to_dict("records"):
            a = paired_accuracies(trials, r["optimizer"], ref, pair_by)
            b = paired_accuracies(trials, r["optimizer"], r["other"], pair_by)
            shared = sorted(set(a) & set(b))
            expected = stats.wilcoxon([a[k] for k in shared], [b[k] for k in shared], alternative="greater")
            assert r["n_pairs"] == len(shared)
            assert r["statistic"] == pytest.approx(expected.statistic)
            assert r["p_value"] == pytest.approx(expected.pvalue, rel=1e-12)
            assert r["significant"] == (expected.pvalue < 0.05)
            n_pairs[(pair_by, r["optimizer"], r["other"])] = r["n_pairs"]
        assert f"paired over {'datasets' if pair_by == 'dataset' else '(dataset, seed) pairs'}" in (
            out / "wilcoxon.md").read_text()
    assert not (d / "analysis").exists()  # --out replaced the default folder
    assert {v for (p, *_), v in n_pairs.items() if p == "dataset"} == {len(datasets)}
    # (dataset, seed) pairs: one per seed where both configurations have an ok run at their best lr.
    seed_pairs = [v for (p, *_), v in n_pairs.items() if p == "dataset_seed"]
    assert len(seed_pairs) == 12 and all(len(datasets) < v <= len(datasets) * len(SEEDS) for v in seed_pairs)
    report_dir = tmp_path / "report"
    assert main(["report", str(d), "--out", str(report_dir), "--reference", "All", "--pair-by", "dataset",
                 "--no-figures"]) == 0
    assert Path(capsys.readouterr().out.strip().splitlines()[-1]) == report_dir / "report.html"
    assert "Wilcoxon vs All, alternative greater, paired by dataset" in (report_dir / "report.html").read_text()
    assert main(["analyze", str(d), "--reference", "attn"]) == 2  # checked by the analysis (the grammar needs core)
    assert "raystudy analyze: error: reference: unknown value 'attn'" in capsys.readouterr().err


def test_cli_analyze_and_report_write_every_figure(tmp_path, capsys):
    """Every figure kind once (one dataset, both optimizers); ``analyze --no-figures`` afterwards keeps them and
    says so, so report.md's links still resolve."""
    from PIL import Image

    from raystudy.cli import main

    ds = DATASETS[0]
    d = make_study(tmp_path / "s", rates=True, datasets=(ds,))
    assert main(["analyze", str(d), "--no-figures", "--alternative", "two-sided"]) == 0
    out = capsys.readouterr().out
    assert str(d / "analysis" / "wilcoxon.csv") in out and "Figures not drawn" not in out  # none there yet
    assert "two-sided" in (d / "analysis" / "wilcoxon.md").read_text()
    assert main(["report", str(d)]) == 0
    path = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert path == d / "analysis" / "report.html" and path.stat().st_size > 50_000
    figs = ["plasticity_depth", "plasticity_distribution", "plasticity_rate_violins", "bounds",
            "accuracy_distribution", "relative_gain", "accuracy_fixed_lr_adamw", "accuracy_fixed_lr_sgd",
            "accuracy_vs_lr", "best_accuracy", "best_accuracy_per_dataset", "accuracy_vs_params"]
    figs += [f"curves_{ds}_{opt}" for opt in ("adamw", "sgd")] + [f"curves_all_{ds}_{opt}" for opt in ("adamw", "sgd")]
    fig_dir = d / "analysis" / "figures"
    written = sorted(f"{f}.{ext}" for f in figs for ext in ("png", "svg"))
    assert sorted(p.name for p in fig_dir.iterdir()) == written
    for f in figs:
        with Image.open(fig_dir / f"{f}.png") as im:
            assert im.size[0] > 600 and im.size[1] > 400, f
            assert len(im.convert("RGB").getcolors(maxcolors=1 << 20)) > 50, f  # not a blank canvas
        assert (fig_dir / f"{f}.svg").read_text().rstrip().endswith("</svg>")
    before = {p.name: p.read_bytes() for p in fig_dir.iterdir()}
    assert main(["analyze", str(d), "--no-figures"]) == 0  # tables only: the figures stay, the report's links hold
    out = capsys.readouterr().out
    assert f"note: Figures not drawn (--no-figures): figures/ keeps the {len(figs)} figure(s) of an earlier" in out
    assert {p.name: p.read_bytes() for p in fig_dir.iterdir()} == before
    links = re.findall(r"\]\((figures/[^)]+)\)", (d / "analysis" / "report.md").read_text())
    assert len(links) == len(figs) and all((d / "analysis" / link).is_file() for link in links)
    _write_trials(d, pd.read_parquet(d / "trials.parquet").drop(columns=["status"]))
    assert main(["analyze", str(d)]) == 2
    err = capsys.readouterr().err
    assert "trials.parquet" in err and "status" in err and "Traceback" not in err


@pytest.mark.parametrize("link", ["analysis", "analysis/figures"])
def test_an_analysis_folder_that_links_out_of_the_study_is_refused(tmp_path, capsys, link):
    """A symbolic link where the analysis goes by default would take its files (and the clearing of an earlier
    analysis's) out of the study directory: refused in one line naming it; --out writes through it when asked."""
    from raystudy.cli import main

    d = make_study(tmp_path / "s", datasets=DATASETS[:1], plasticity=False, bounds=False, curves=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "overall.csv").write_text("someone else's\n")
    if link == "analysis/figures":
        (d / "analysis").mkdir()  # a real analysis/ above the link
    (d / link).symlink_to(elsewhere, target_is_directory=True)
    said = (f"raystudy {{cmd}}: error: {d / link} is a symbolic link (to {elsewhere}): the analysis writes only "
            f"inside the study directory; remove the link, or give --out {d / 'analysis'} to write through it\n")
    for cmd in ("analyze", "report"):
        assert main([cmd, str(d), "--no-figures"]) == 2
        assert capsys.readouterr().err == said.format(cmd=cmd)
    assert [p.name for p in elsewhere.iterdir()] == ["overall.csv"]
    assert (elsewhere / "overall.csv").read_text() == "someone else's\n"
    if link == "analysis":  # asked for: written through the link
        assert main(["analyze", str(d), "--no-figures", "--out", str(d / "analysis")]) == 0
        assert (elsewhere / "overall.csv").read_text() != "someone else's\n"


#: The documented palette (Okabe-Ito): one colour per configuration, written out here, not imported.
PALETTE = {"LN1": "#0072b2", "MHA": "#d55e00", "LN2": "#009e73", "FC1": "#e69f00", "FC2": "#cc79a7",
           "Emb": "#56b4e9", "All": "#000000", "Head": "#555555", "LP": "#f0e442"}


def test_plot_functions_for_the_plasticity_cli(tmp_path):
    from raystudy.analysis.figures import plot_plasticity_depth, plot_rate_distribution
    from raystudy.analysis.style import CONFIGURATION_COLORS

    assert {k: v.lower() for k, v in CONFIGURATION_COLORS.items()} == PALETTE
    d = make_study(tmp_path / "s", rates=True, curves=False, bounds=False, datasets=DATASETS[:1])
    p = pd.read_parquet(d / "plasticity.parquet")
    paths = plot_plasticity_depth(p, tmp_path / "fig" / "depth", title="t")
    assert [x.suffix for x in paths] == [".png", ".svg"] and all(x.stat().st_size > 5_000 for x in paths)
    svg = paths[1].read_text().lower()
    for comp in COMPONENTS:  # a legend entry per component (matplotlib names each text in a comment) ...
        assert f"<!-- {comp.lower()} -->" in svg
        assert f"stroke: {PALETTE[comp]}" in svg  # ... and its line in its colour
    for config in ("all", "head"):  # configurations that are not components are not plasticity lines
        assert f"<!-- {config} -->" not in svg
    r = pd.read_parquet(d / "rates.parquet")
    assert [x.suffix for x in plot_rate_distribution(r, tmp_path / "rates")] == [".png", ".svg"]
    with pytest.raises(ValueError, match=r"rates: missing column\(s\) \['rate'\]"):
        plot_rate_distribution(r.drop(columns=["rate"]), tmp_path / "x")
