"""The vtab1k-demo preset end to end, shrunk by overrides: built-in miniature task folders, the final fit, and the
analysis the benchmark needs (per-task table with both means, frontier, Wilcoxon over tasks, change and CKA)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from raystudy.io import read_result
from raystudy.vocab import VTAB_TASKS

CONFIGURATIONS = ["Head", "All", "auto:1%", "random:1%", "ia3", "bias"]  # All + Head: the budget caps
TASKS = ["cifar", "patch_camelyon", "dsprites_ori"]


@pytest.fixture(scope="module")
def study(ray_session, tmp_path_factory):
    from raystudy.study import tune
    from raystudy.study.spec import load_preset

    out = tmp_path_factory.mktemp("vtab1k-demo") / "study"
    spec = load_preset("vtab1k-demo").with_overrides({
        "out": str(out), "configurations": CONFIGURATIONS, "seeds": [0], "steps": 6, "eval_period": 3,
        "warmup_steps": 1, "checkpoint_period": 6, "pretrain.steps": 30, "pretrain.path_steps": [0, 30],
        "plasticity.pairs": 64, "probe.enabled": False,
    })
    lines: list[str] = []
    tune.run_study(spec, echo=lines.append)
    return out, lines


def test_vtab1k_demo_writes_the_benchmark_tables_and_figures(study):
    out, lines = study
    trials = read_result(str(out), "trials")
    assert set(trials["status"]) == {"ok"}
    search, final = trials[trials["phase"] == "search"], trials[trials["phase"] == "final"]
    assert len(search) == 3 * 6 * 2 and len(final) == 3 * 6
    # the final lr is the one with the best validation accuracy (mean over seeds; the smaller lr on a tie)
    val = search.groupby(["dataset", "configuration", "lr"])["best_val_acc"].mean().reset_index()
    chosen = val.sort_values(["best_val_acc", "lr"], ascending=[False, True]).groupby(
        ["dataset", "configuration"]).head(1).set_index(["dataset", "configuration"])["lr"]
    got = final.groupby(["dataset", "configuration"])["lr"].first()
    pd.testing.assert_series_equal(got.sort_index(), chosen.sort_index(), check_names=False)

    analysis = out / "analysis"
    vtab = pd.read_csv(analysis / "vtab.csv")
    acc = final.groupby(["configuration", "dataset"])["test_acc"].mean().unstack()
    for c in CONFIGURATIONS:
        row = vtab[vtab["configuration"] == c].iloc[0]
        groups = [acc.loc[c, t] for t in TASKS]  # one task per group: each group mean is that task
        assert sorted(VTAB_TASKS[t][0] for t in TASKS) == ["Natural", "Specialized", "Structured"]
        assert row["mean_tasks"] == pytest.approx(np.mean(groups), abs=1e-9)
        assert row["mean_groups"] == pytest.approx(np.mean(groups), abs=1e-9)
        for t in TASKS:
            assert row[t] == pytest.approx(acc.loc[c, t], abs=1e-9)
    matched = pd.read_csv(analysis / "vtab_matched_budget.csv")
    assert {("auto:1%", "random:1%"), ("auto:1%", "ia3"), ("auto:1%", "bias")} <= set(
        zip(matched["first"], matched["second"]))
    assert set(matched["n_pairs"]) == {3}
    frontier = pd.read_csv(analysis / "vtab_frontier.csv")
    assert set(frontier["configuration"]) == set(CONFIGURATIONS) and frontier["on_frontier"].any()
    for name in ("vtab_frontier", "change_vs_plasticity", "cka_vs_gain"):
        assert (analysis / "figures" / f"{name}.png").stat().st_size > 10_000, name
    changes = read_result(str(out), "changes")
    head = changes[changes["trial_id"].isin(trials[trials["configuration"] == "Head"]["trial_id"])]
    assert (head.loc[head["measure"] == "weight_change", "value"] == 0).all()
    assert np.allclose(head.loc[head["measure"] == "cka", "value"], 1.0, atol=1e-6)
    html = (analysis / "report.html").read_text()
    assert "VTAB-1k" in html and "mean of group means" in html
