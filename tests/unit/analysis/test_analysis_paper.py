"""The analysis as the paper computes it: ddof-0 spreads, diverged runs counted and flagged, the linear probe as
the relative-gain reference, the optimizer tables on the subset both ran, and every figure in the report.

Expected numbers are computed here from the raw synthetic rows (numpy for the spreads, plain loops for the
rest), never by calling the functions under test.
"""

from __future__ import annotations

import base64
import math
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from tests.unit.analysis.test_analysis import (
    COMPONENTS,
    CONFIGS,
    SEEDS,
    by_key,
    expected_best,
    is_counted,
    make_study,
    raw_trials,
)

DATASETS = ("cifar100", "clipart", "sketch")
ADAMW_DATASETS = ("cifar100", "clipart")


@pytest.fixture(scope="module")
def paper(tmp_path_factory):
    """A study with linear-probe rows, diverged runs, and AdamW on 2 of 3 datasets and seed 0 only; analysed
    with the figures :data:`DRAWN` and the HTML report."""
    from raystudy.analysis.html_report import write_report
    from raystudy.analysis.pipeline import run_analysis

    d = make_study(tmp_path_factory.mktemp("paper") / "s", seed=11, datasets=DATASETS, probe=True,
                   adamw_datasets=ADAMW_DATASETS, adamw_seeds=(0,), rates=True)
    res = run_analysis(d, figures=DRAWN)
    return d, res, write_report(res)


def accuracies(trials, ds, opt, config, lr=None, seeds=None) -> list[float]:
    """Counted test accuracies of a sweep (optionally one lr, some seeds), in seed order."""
    return [t["test_acc"] for t in sorted(trials, key=lambda t: t["seed"])
            if is_counted(t) and (t["dataset"], t["optimizer"], t["configuration"]) == (ds, opt, config)
            and (lr is None or t["lr"] == lr) and (seeds is None or t["seed"] in seeds)]


# ---------------------------------------------------------------- spreads: ddof 0

def test_spreads_are_population_std(paper):
    d, res, _ = paper
    trials = raw_trials(d)
    best = by_key(res.tables["best_lr"], ["dataset", "optimizer", "configuration"])
    grid = by_key(res.tables["lr_grid"], ["dataset", "optimizer", "configuration"])
    stab = by_key(res.tables["stability"], ["dataset", "optimizer", "configuration"])
    differs = 0
    for ds in DATASETS:
        for config in CONFIGS:
            r = best[(ds, "sgd", config)]
            at_best = np.array(accuracies(trials, ds, "sgd", config, lr=r["lr"]))
            assert r["std"] == pytest.approx(np.std(at_best), abs=1e-12)  # numpy's default: ddof 0
            differs += not math.isclose(r["std"], np.std(at_best, ddof=1), abs_tol=1e-9)
            lrs = sorted({t["lr"] for t in trials if t["optimizer"] == "sgd"})
            means = [np.mean(accuracies(trials, ds, "sgd", config, lr=lr)) for lr in lrs]
            assert grid[(ds, "sgd", config)]["std"] == pytest.approx(np.std(means), abs=1e-12)
            pooled = accuracies(trials, ds, "sgd", config)
            assert stab[(ds, "sgd", config)]["std"] == pytest.approx(np.std(pooled), abs=1e-12)
    assert differs == len(DATASETS) * len(CONFIGS)  # ddof 1 would give other numbers everywhere
    overall = by_key(res.tables["overall"], ["optimizer", "configuration"])
    for config in CONFIGS:
        per_ds = [best[(ds, "sgd", config)]["mean"] for ds in DATASETS]
        assert overall[("sgd", config)]["std"] == pytest.approx(np.std(per_ds), abs=1e-12)
    for name in ("best_lr", "lr_grid", "overall", "stability", "optimizers"):
        assert "ddof = 0" in (d / "analysis" / f"{name}.md").read_text(), name


# ---------------------------------------------------------------- diverged runs: counted and flagged

def test_diverged_run_counted_with_its_accuracy_and_flagged(paper):
    d, res, html_path = paper
    trials = raw_trials(d)
    late = [t for t in trials if t["status"] == "diverged" and not math.isnan(t["test_acc"])]
    early = [t for t in trials if t["status"] == "diverged" and math.isnan(t["test_acc"])]
    assert late and early
    stab = by_key(res.tables["stability"], ["dataset", "optimizer", "configuration"])
    for t in late:
        key = (t["dataset"], t["optimizer"], t["configuration"])
        sweep = [x for x in trials if (x["dataset"], x["optimizer"], x["configuration"]) == key]
        with_it = [x["test_acc"] for x in sweep if x["status"] == "ok" or x is t
                   or (x["status"] == "diverged" and not math.isnan(x["test_acc"]))]
        without = [x["test_acc"] for x in sweep if x["status"] == "ok"]
        r = stab[key]
        assert r["mean"] == pytest.approx(sum(with_it) / len(with_it), abs=1e-12)
        assert r["mean"] != pytest.approx(sum(without) / len(without), abs=1e-12)
        assert r["n_trials"] == len(with_it) and r["n_diverged"] == len(with_it) - len(without) >= 1
    excluded = pd.read_csv(d / "analysis" / "excluded.csv")
    assert sorted(excluded["trial_id"]) == sorted(t["trial_id"] for t in trials if not is_counted(t)
                                                   and t["configuration"] != "LP")
    assert {t["trial_id"] for t in early} <= set(excluded["trial_id"])
    assert not {t["trial_id"] for t in late} & set(excluded["trial_id"])
    stability_md = (d / "analysis" / "stability.md").read_text()
    assert " ‡" in stability_md and "‡: includes diverged run(s)" in stability_md
    page = html_path.read_text()
    assert "‡: includes diverged run(s)" in page and "diverged before any evaluation" in page


# ---------------------------------------------------------------- the linear probe as the reference

def test_relative_gain_uses_the_linear_probe(paper):
    d, res, _ = paper
    trials = raw_trials(d)
    lp = {t["dataset"]: t["test_acc"] for t in trials if t["configuration"] == "LP"}
    best = expected_best(trials)
    gain = res.tables["relative_gain"]
    assert set(gain["reference"]) == {"LP"} and "LP" not in set(gain["configuration"])
    got = by_key(gain, ["dataset", "optimizer", "configuration"])
    for opt, datasets in (("sgd", DATASETS), ("adamw", ADAMW_DATASETS)):
        for config in CONFIGS:  # Head too: it is an ordinary configuration against LP
            gains = []
            for ds in datasets:
                acc = best[("vit_tiny", ds, opt, config)][1]
                r = got[(ds, opt, config)]
                assert r["reference_accuracy"] == pytest.approx(lp[ds], abs=1e-12)
                assert r["relative_gain"] == pytest.approx((acc - lp[ds]) / lp[ds], abs=1e-12)
                gains.append((acc - lp[ds]) / lp[ds])
            assert got[("overall", opt, config)]["relative_gain"] == pytest.approx(sum(gains) / len(gains), abs=1e-12)
    assert "over the linear probe (LP" in (d / "analysis" / "relative_gain.md").read_text()
    assert "relative gain uses Head" not in " ".join(res.notes)
    # LP in the best-lr table: its probe accuracy, after Head, in every optimizer block that has the dataset.
    b = res.tables["best_lr"]
    for (ds, _opt), g in b.groupby(["dataset", "optimizer"]):
        assert list(g["configuration"]) == list(CONFIGS) + ["LP"]
        row = g[g["configuration"] == "LP"].iloc[0]
        assert row["mean"] == pytest.approx(lp[ds]) and math.isnan(row["lr"]) and row["n_seeds"] == 1
    assert "LP" in (d / "analysis" / "best_lr.md").read_text().split("\n## optimizer: sgd")[1].split("\n")[2]


def test_without_probe_rows_the_gain_falls_back_to_head_with_a_note(tmp_path):
    from raystudy.analysis import analyze

    d = make_study(tmp_path / "s", datasets=DATASETS[:2], curves=False, plasticity=False, bounds=False)
    gain = analyze(d, figures=False)["relative_gain"]
    assert set(gain["reference"]) == {"Head"}
    assert "the relative gain uses Head" in (d / "analysis" / "notes.md").read_text()


def test_reference_lp_in_the_wilcoxon_tests(tmp_path, capsys):
    import argparse

    from raystudy.commands import analyze as command

    parser = argparse.ArgumentParser()
    command.register(parser.add_subparsers())  # the sub-command's own options, as `raystudy analyze` has them
    d = make_study(tmp_path / "s", seed=4, datasets=("a", "b", "c", "d", "e", "f"), probe=True, curves=False,
                   plasticity=False, bounds=False)
    args = parser.parse_args(["analyze", str(d), "--reference", "LP", "--no-figures"])
    assert args.func(args) == 0
    capsys.readouterr()
    w = pd.read_csv(d / "analysis" / "wilcoxon.csv")
    trials = raw_trials(d)
    lp = {t["dataset"]: t["test_acc"] for t in trials if t["configuration"] == "LP"}
    best = expected_best(trials)
    sgd = w[w["optimizer"] == "sgd"]
    assert list(sgd["other"]) == list(CONFIGS) and set(sgd["reference"]) == {"LP"}
    for r in sgd.to_dict("records"):
        datasets = sorted(lp)
        x = [lp[ds] for ds in datasets]
        y = [best[("vit_tiny", ds, "sgd", r["other"])][1] for ds in datasets]
        expected = stats.wilcoxon(x, y, alternative="greater")
        assert r["n_pairs"] == len(datasets) and r["p_value"] == pytest.approx(expected.pvalue, rel=1e-12)


# ---------------------------------------------------------------- optimizers on the subset they share

def test_optimizer_tables_on_the_shared_subset(paper):
    d, res, _ = paper
    trials = raw_trials(d)
    t = res.tables["optimizers"]
    assert list(t.columns) == ["dataset", "optimizer", "configuration", "mean", "std", "n_lrs", "n_seeds", "n_trials",
                               "n_diverged"]
    assert set(t["dataset"]) == set(ADAMW_DATASETS) | {"overall"}  # sketch: SGD only, left out
    got = by_key(t, ["dataset", "optimizer", "configuration"])
    for opt in ("sgd", "adamw"):
        for config in CONFIGS:
            means, stds = [], []
            for ds in ADAMW_DATASETS:
                v = np.array(accuracies(trials, ds, opt, config, seeds=(0,)))  # seed 0: where AdamW ran
                r = got[(ds, opt, config)]
                assert r["mean"] == pytest.approx(v.mean(), abs=1e-12)
                assert r["std"] == pytest.approx(np.std(v), abs=1e-12)
                assert r["n_seeds"] == 1 and r["n_trials"] == len(v)
                means.append(v.mean())
                stds.append(np.std(v))
            r = got[("overall", opt, config)]
            assert r["mean"] == pytest.approx(np.mean(means), abs=1e-12)
            assert r["std"] == pytest.approx(np.mean(stds), abs=1e-12)
    md = (d / "analysis" / "optimizers.md").read_text()
    assert "datasets cifar100, clipart; seeds 0" in md
    # The SGD tables elsewhere still use all three datasets and seeds.
    assert res.tables["overall"].set_index(["optimizer", "configuration"]).loc[("sgd", "MHA"), "n_datasets"] == 3


def test_one_optimizer_has_no_optimizer_table(tmp_path):
    from raystudy.analysis import analyze

    d = make_study(tmp_path / "s", datasets=DATASETS[:2], adamw_datasets=(), curves=False, plasticity=False,
                   bounds=False)
    assert "optimizers" not in analyze(d, figures=False)


# ---------------------------------------------------------------- figures: written and in the report

NEW_FIGURES = ["accuracy_fixed_lr_sgd", "accuracy_fixed_lr_adamw", "accuracy_vs_lr", "best_accuracy",
               "best_accuracy_per_dataset",
               "accuracy_vs_params"] + [f"curves_all_{ds}_sgd" for ds in DATASETS] + [
    f"curves_all_{ds}_adamw" for ds in ADAMW_DATASETS]
#: The figures the fixture draws: one of each kind (a sweep figure costs ~2.5 s; each is drawn and checked
#: line by line in test_sweep_curves_draw_one_line_per_lr_and_seed and tests/unit/analysis/test_figures_trust.py).
DRAWN = ["accuracy_fixed_lr_sgd", "accuracy_vs_lr", "best_accuracy", "best_accuracy_per_dataset",
         "accuracy_vs_params", f"curves_all_{DATASETS[0]}_sgd"]


class _Images(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images: dict[str, str] = {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img" and "data-figure" in a:
            self.images[a["data-figure"]] = a["src"]


def test_every_new_figure_is_written_and_in_the_report(paper):
    from PIL import Image

    d, res, html_path = paper
    fig_dir = d / "analysis" / "figures"
    parser = _Images()
    parser.feed(html_path.read_text())
    assert set(NEW_FIGURES) <= set(res.available_figures)
    for name in DRAWN:
        for ext in ("png", "svg"):
            assert (fig_dir / f"{name}.{ext}").stat().st_size > 5_000, (name, ext)
        with Image.open(fig_dir / f"{name}.png") as im:
            assert len(im.convert("RGB").getcolors(maxcolors=1 << 20)) > 50, name  # not a blank canvas
        src = parser.images[name]
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]) == (fig_dir / f"{name}.png").read_bytes(), name
    assert set(parser.images) == {p.stem for p in fig_dir.glob("*.png")}
    page = html_path.read_text()
    assert "http://" not in page and "https://" not in page


def test_sweep_curves_draw_one_line_per_lr_and_seed(tmp_path):
    from raystudy.analysis.inputs import read_inputs
    from raystudy.analysis.sweep_figures import plot_sweep_curves

    d = make_study(tmp_path / "s", datasets=DATASETS[:1], plasticity=False, bounds=False, failures=False)
    inputs = read_inputs(d)
    runs = inputs.counted[inputs.counted["optimizer"] == "sgd"]
    paths = plot_sweep_curves(inputs.curves, runs, tmp_path / "curves")
    svg = paths[1].read_text()
    # Per configuration panel, 2 rows (gradient norm, validation loss) x 3 lrs x 3 seeds lines.
    n_lines = svg.count('id="line2d_')
    assert n_lines >= len(CONFIGS) * 2 * 3 * len(SEEDS)
    assert Path(paths[0]).stat().st_size > 20_000
    assert set(runs["configuration"]) == set(CONFIGS) and set(COMPONENTS) <= set(runs["configuration"])
