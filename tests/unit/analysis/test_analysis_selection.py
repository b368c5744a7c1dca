"""Analysis options the paper presets set (issue #20 item 6): ``seeds`` (the paper's Table 9 reads seed 0
alone: apps/plots/ablation_model_size.py ``table_results(..., seeds=[0])``, mean and np.std over the lr grid)
and ``fixed_run`` (the paper's Fig. 5, middle and right: apps/plots/finetuning.py draws Sketch's runs at seed
42, lr 1e-2, next to which raystudy keeps its best-run figure). Checked against hand computations on the
synthetic trials table of tests/support/study_tables.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from raystudy.analysis import figures as F
from raystudy.analysis.html_report import write_report
from raystudy.analysis.options import check_subset
from raystudy.analysis.pipeline import run_analysis
from raystudy.study.checks import SpecError
from raystudy.study.spec import load_preset
from tests.unit.analysis.test_analysis import make_study

FIXED = {"dataset": "sketch", "seed": 42, "lr": 0.01}
#: the paper's Fig. 54 (apps/plots/ablation_adam.py): Sketch's AdamW run at seed 0, lr 1e-2 / 100
FIG_54 = {"dataset": "sketch", "seed": 0, "lr": 1e-4, "optimizer": "adamw"}


def _study(tmp_path):
    return make_study(tmp_path / "study", datasets=("clipart", "sketch"), failures=False, head=False,
                      plasticity=False, bounds=False)


def test_seeds_keep_only_those_seeds_trials_in_the_tables(tmp_path):
    path = _study(tmp_path)
    res = run_analysis(path, seeds=[0], figures=False)
    trials = pd.read_parquet(path / "trials.parquet")
    got = res.tables["lr_grid"].set_index(["dataset", "optimizer", "configuration"])
    for (ds, opt, config), rows in trials[trials["seed"] == 0].groupby(["dataset", "optimizer", "configuration"]):
        values = [float(v) for v in rows.sort_values("lr")["test_acc"]]  # one per lr: seed 0 alone
        assert got.loc[(ds, opt, config), "mean"] == pytest.approx(sum(values) / len(values))
        assert got.loc[(ds, opt, config), "std"] == pytest.approx(float(np.std(values)))  # ddof 0, as np.std
        assert got.loc[(ds, opt, config), "n_trials"] == len(values)
    every = run_analysis(path, out_dir=tmp_path / "every", figures=False).tables["lr_grid"]
    assert (every["n_trials"] == 3 * got["n_trials"].to_numpy()).all()  # three seeds without the option
    assert any("Seeds 0 only" in n and f"{2 * len(trials) // 3} trial(s)" in n for n in res.notes)


def test_fixed_run_figure_draws_exactly_those_runs(tmp_path, monkeypatch):
    drawn, real = [], F.plot_curves

    def recording(curves, runs, path_stem, **kw):
        drawn.append((str(path_stem), kw.get("legend"), sorted(runs["trial_id"])))
        return real(curves, runs, path_stem, **kw)

    monkeypatch.setattr(F, "plot_curves", recording)
    path = _study(tmp_path)
    res = run_analysis(path, fixed_run=FIXED, figures=["curves_fixed_*"])
    trials = pd.read_parquet(path / "trials.parquet")
    want = trials[(trials["dataset"] == "sketch") & (trials["seed"] == 42) & np.isclose(trials["lr"], 0.01)]
    assert set(want["optimizer"]) == {"sgd"} and len(want) == 6  # LN1 ... FC2 and All, one run each
    (fixed,) = [d for d in drawn if d[1] == "fixed run"]
    assert fixed[0].endswith("curves_fixed_sketch_sgd") and fixed[2] == sorted(want["trial_id"])
    names = res.available_figures
    assert names.index("curves_fixed_sketch_sgd") == names.index("curves_sketch_sgd") + 1  # beside the best runs
    (info,) = res.figures
    assert info.name == "curves_fixed_sketch_sgd"
    assert all(p.exists() and p.stat().st_size > 0 for p in info.paths)
    assert not any(n.startswith("fixed_run") for n in res.notes)


def test_a_missing_fixed_run_is_a_note_in_the_report(tmp_path):
    path = _study(tmp_path)
    res = run_analysis(path, fixed_run={**FIXED, "seed": 7}, figures=False)
    assert not [f for f in res.available_figures if f.startswith("curves_fixed")]
    note = ("fixed_run: no run with curves on sketch at seed 7, lr 0.01: the fixed-run figure (the paper's "
            "Fig. 5, middle and right) is omitted.")
    assert note in res.notes
    html = write_report(res).read_text(encoding="utf-8")
    assert "no run with curves on sketch at seed 7" in html


def test_fixed_runs_of_one_optimizer_each_give_fig_5_and_fig_54(tmp_path, monkeypatch):
    drawn, real = {}, F.plot_curves

    def recording(curves, runs, path_stem, **kw):
        drawn[Path(path_stem).name] = sorted(runs["trial_id"])
        return real(curves, runs, path_stem, **kw)

    monkeypatch.setattr(F, "plot_curves", recording)
    path = _study(tmp_path)
    res = run_analysis(path, fixed_run=[{**FIXED, "optimizer": "sgd"}, FIG_54], figures=["curves_fixed_*"])
    trials = pd.read_parquet(path / "trials.parquet")
    sketch = trials[trials["dataset"] == "sketch"]
    for name, (seed, lr, opt) in (("curves_fixed_sketch_sgd", (42, 0.01, "sgd")),
                                  ("curves_fixed_sketch_adamw", (0, 1e-4, "adamw"))):
        want = sketch[(sketch["seed"] == seed) & np.isclose(sketch["lr"], lr) & (sketch["optimizer"] == opt)]
        assert len(want) == 6 and drawn[name] == sorted(want["trial_id"])  # LN1 ... FC2 and All
    names = res.available_figures
    assert names.index("curves_fixed_sketch_adamw") == names.index("curves_sketch_adamw") + 1
    assert not any(n.startswith("fixed_run") for n in res.notes)

    drawn.clear()  # two fixed runs of one dataset and optimizer: each its own figure, named by seed and lr
    res = run_analysis(path, out_dir=tmp_path / "two", fixed_run=[FIXED, {**FIXED, "seed": 0}, {**FIG_54, "lr": 1.0}],
                       figures=["curves_fixed_*"])
    assert {"curves_fixed_sketch_sgd_seed42_lr0.01", "curves_fixed_sketch_sgd_seed0_lr0.01"} <= set(drawn)
    assert not [n for n in drawn if n.startswith("curves_fixed_sketch_adamw")]
    assert ("fixed_run: no run with curves on sketch / adamw at seed 0, lr 1: the fixed-run figure (the paper's "
            "Fig. 5, middle and right) is omitted.") in res.notes


def test_option_checks_and_the_presets():
    check_subset([0], FIXED)
    check_subset(None, [FIXED, FIG_54])
    for seeds, fixed, match in (([], None, "seeds"), (["0"], None, "seeds"), (None, {"dataset": "sketch"}, "fixed_run"),
                                (None, {**FIXED, "lr": -1}, "fixed_run"), (None, [], "fixed_run"),
                                (None, [FIXED, {**FIXED, "seed": "0"}], "fixed_run: dataset a name"),
                                (None, {**FIXED, "optimizer": "adam"}, "fixed_run: optimizer: unknown value 'adam'"),
                                (None, {**FIXED, "epoch": 3}, "fixed_run: a mapping of"), (None, 3, "fixed_run")):
        with pytest.raises(ValueError, match=match):
            check_subset(seeds, fixed)
    spec = load_preset("paper").with_overrides({"fixed_run": {"dataset": "sketch", "seed": 42}})
    with pytest.raises(SpecError, match="^fixed_run: a mapping of dataset, seed, lr"):
        spec.validate(check_files=False)
    with pytest.raises(SpecError, match="^analysis_seeds: a non-empty list"):
        load_preset("paper").with_overrides({"analysis_seeds": []}).validate(check_files=False)
    assert load_preset("paper").fixed_run == [{**FIXED, "optimizer": "sgd"}, FIG_54]
    assert load_preset("paper").analysis_seeds is None
    assert load_preset("paper-model-size").analysis_seeds == [0]


def test_the_cli_reaches_both_options(tmp_path, capsys):
    from raystudy.cli import main

    path = _study(tmp_path)
    out = tmp_path / "cli"
    assert main(["analyze", str(path), "--out", str(out), "--analysis-seeds", "0", "--fixed-run", "sketch,0,0.01",
                 "--fixed-run", "sketch,0,1e-4,adamw", "--figures", "curves_fixed_*"]) == 0
    want = run_analysis(path, seeds=[0], figures=False, out_dir=tmp_path / "api").tables["lr_grid"]
    got = pd.read_csv(out / "lr_grid.csv")
    assert got["n_trials"].tolist() == want["n_trials"].tolist()
    assert got["mean"].to_numpy() == pytest.approx(want["mean"].to_numpy())
    assert (out / "figures" / "curves_fixed_sketch_sgd.png").exists()  # a seed --analysis-seeds keeps
    assert (out / "figures" / "curves_fixed_sketch_adamw.png").exists()  # the second fixed run, AdamW's alone
    assert len(list((out / "figures").iterdir())) == 4  # --figures: those two alone, PNG and SVG
    capsys.readouterr()
    assert main(["analyze", str(path), "--out", str(out), "--figures", "curves_fixed_*", "--figures", "depth"]) == 2
    err = capsys.readouterr().err
    assert "figures: no figure of this study matches 'curves_fixed_*', 'depth'; it has accuracy_distribution" in err
    assert main(["analyze", str(path), "--out", str(out), "--figures", "curves_sketch_sgd"]) == 0
    out_text = capsys.readouterr().out
    assert "note: Figures not drawn (--figures): figures/ keeps the 2 figure(s) of an earlier analysis" in out_text
    assert len(list((out / "figures").iterdir())) == 6  # the fixed runs' stay beside the one drawn now
    for flag, value, match in (("--analysis-seeds", "0,x", "'0,x': a comma-separated list of integer seeds"),
                               ("--fixed-run", "sketch,42", "'sketch,42': expected DATASET,SEED,LR"),
                               ("--fixed-run", "sketch,0,1e-4,adam", "unknown value 'adam'")):
        with pytest.raises(SystemExit):
            main(["analyze", str(path), flag, value])
        assert match in capsys.readouterr().err


def test_analysis_round_is_a_spec_field_the_paper_sets():
    assert load_preset("paper").analysis_round == 2 and load_preset("demo").analysis_round is None
    with pytest.raises(SpecError, match="analysis_round"):
        load_preset("paper").with_overrides({"analysis_round": -1}).validate(check_files=False)


def test_select_by_val_chooses_each_lr_by_validation_and_reports_test(tmp_path):
    path = _study(tmp_path)
    trials = pd.read_parquet(path / "trials.parquet")
    flip = (trials["dataset"] == "sketch") & (trials["configuration"] == "MHA")
    trials.loc[flip, "best_val_acc"] = 1.0 - trials.loc[flip, "test_acc"]  # validation prefers the worst test lr
    trials.to_parquet(path / "trials.parquet", index=False)
    ok = trials[trials["status"] == "ok"]
    res = run_analysis(path, select_by="val", figures=False)
    test = run_analysis(path, out_dir=tmp_path / "test", figures=False).tables["best_lr"]
    got = res.tables["best_lr"].set_index(["dataset", "optimizer", "configuration"])
    differs = 0
    for key, rows in ok.groupby(["dataset", "optimizer", "configuration"]):
        by_lr = rows.groupby("lr")[["best_val_acc", "test_acc"]].mean()
        lr = by_lr["best_val_acc"].idxmax()  # first of the sorted lrs on a tie: the smaller one
        assert got.loc[key, "lr"] == lr and got.loc[key, "mean"] == pytest.approx(by_lr.loc[lr, "test_acc"])
        differs += lr != by_lr["test_acc"].idxmax()
    assert differs > 0  # the two rules disagree somewhere on these trials, so the test can tell them apart
    assert not test.set_index(["dataset", "optimizer", "configuration"])["lr"].equals(got["lr"])
    html = write_report(res).read_text(encoding="utf-8")
    assert "highest mean best-validation accuracy over seeds (validation only: test never chooses)" in html
    with pytest.raises(ValueError, match="select_by: unknown value 'train'"):
        run_analysis(path, select_by="train", figures=False)
    assert load_preset("paper").analysis_select_by == "test"
    with pytest.raises(SpecError, match="analysis_select_by"):
        load_preset("paper").with_overrides({"analysis_select_by": "x"}).validate(check_files=False)
