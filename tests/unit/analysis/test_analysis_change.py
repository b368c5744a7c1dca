"""What finetuning changed, analysed (#23 item 3): weight change beside plasticity per component, and the CKA
to the pretrained model beside the accuracy gain, on hand-built trials, changes and plasticity tables whose
expected rows are computed by hand below; then through the whole analysis (tables, figures, report)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from raystudy.analysis.change import best_trials, change_plasticity_table, change_tables, cka_gain_table, read_changes
from raystudy.analysis.html_report import write_report
from raystudy.analysis.inputs import read_inputs
from raystudy.analysis.pipeline import run_analysis
from raystudy.analysis.tables import best_lr_table
from raystudy.io import TableError, write_result
from raystudy.vocab import COMPONENTS

#: (configuration, lr, seed) -> test accuracy: MHA's best lr is 0.1 (mean 0.72 > 0.61), Head's only lr 0.1 (0.51)
ACC = {("MHA", 0.01, 0): 0.60, ("MHA", 0.01, 1): 0.62, ("MHA", 0.1, 0): 0.70, ("MHA", 0.1, 1): 0.74,
       ("Head", 0.1, 0): 0.50, ("Head", 0.1, 1): 0.52}
#: (configuration, lr, seed) -> MHA's weight change in blocks 0, 1 and the CKA of blocks 0, 1
CHANGED = {("MHA", 0.01, 0): ((9.0, 9.0), (0.1, 0.1)), ("MHA", 0.01, 1): ((9.0, 9.0), (0.1, 0.1)),
           ("MHA", 0.1, 0): ((0.1, 0.3), (0.9, 0.7)), ("MHA", 0.1, 1): ((0.2, 0.4), (0.95, 0.85)),
           ("Head", 0.1, 0): ((0.0, 0.0), (1.0, 1.0)), ("Head", 0.1, 1): ((0.0, 0.0), (1.0, 1.0))}


def _tid(c, lr, s):
    return f"d1-{c}-sgd-lr{lr:g}-s{s}"


def _trials() -> pd.DataFrame:
    return pd.DataFrame([{
        "trial_id": _tid(c, lr, s), "dataset": "d1", "model": "m", "configuration": c, "optimizer": "sgd", "lr": lr,
        "seed": s, "steps": 10, "batch_size": 8, "trainable_params": 100, "status": "ok", "best_val_acc": acc,
        "best_val_step": 10, "test_acc": acc, "final_val_loss": 1.0, "wall_seconds": 1.0}
        for (c, lr, s), acc in ACC.items()])


def _changes() -> pd.DataFrame:
    rows = []
    for (c, lr, s), (mha, cka) in CHANGED.items():
        for layer in range(2):
            rows += [{"trial_id": _tid(c, lr, s), "layer": layer, "component": comp, "measure": "weight_change",
                      "value": mha[layer] if comp == "MHA" else 0.0} for comp in COMPONENTS]
            rows.append({"trial_id": _tid(c, lr, s), "layer": layer, "component": None, "measure": "cka",
                         "value": cka[layer]})
    return pd.DataFrame(rows)


def _plasticity() -> pd.DataFrame:
    return pd.DataFrame([{"model": "m", "dataset": "d1", "mode": "embedding", "layer": layer, "component": comp,
                          "plasticity": (2.0, 4.0)[layer] if comp == "MHA" else 1.0, "std": 0.1, "ci95": 0.1,
                          "n_pairs": 8} for layer in range(2) for comp in COMPONENTS])


def test_the_tables_by_hand():
    trials, notes = _trials(), []
    best_lr = best_lr_table(trials)
    best = best_trials(trials, best_lr)
    assert sorted(best["trial_id"]) == sorted(_tid(c, 0.1, s) for c in ("MHA", "Head") for s in (0, 1))
    t = change_plasticity_table(best, _changes(), _plasticity(), notes)
    # MHA at lr 0.1: blocks and seeds (0.1, 0.3, 0.2, 0.4) -> 0.25; plasticity (2 + 4) / 2; Head: all frozen
    assert t.to_dict("records") == [{"dataset": "d1", "optimizer": "sgd", "configuration": "MHA", "component": "MHA",
                                     "mode": "embedding", "plasticity": 3.0, "weight_change": pytest.approx(0.25),
                                     "n_seeds": 2}]
    g = cka_gain_table(best, best_lr, _changes(), notes)
    assert list(g["trial_id"]) == [_tid("MHA", 0.1, 0), _tid("MHA", 0.1, 1)] and set(g["reference"]) == {"Head"}
    assert g["reference_accuracy"].tolist() == pytest.approx([0.51, 0.51])
    assert g["gain"].tolist() == pytest.approx([0.70 - 0.51, 0.74 - 0.51])
    assert g["mean_cka"].tolist() == pytest.approx([0.8, 0.9]) and g["last_cka"].tolist() == pytest.approx([0.7, 0.85])
    no_plasticity = change_plasticity_table(best, _changes(), None, notes)
    assert math.isnan(no_plasticity["plasticity"].iloc[0]) and no_plasticity["weight_change"].iloc[0] == 0.25
    assert cka_gain_table(best[best.configuration == "MHA"], best_lr_table(trials[trials.configuration == "MHA"]),
                          _changes(), notes) is None
    assert "no LP or Head rows" in notes[-1]


def test_the_analysis_writes_both_tables_and_figures(tmp_path):
    study = tmp_path / "study"
    write_result(_trials(), study, "trials")
    write_result(_plasticity(), study, "plasticity")
    notes: list[str] = []
    assert change_tables(read_inputs(study), best_lr_table(_trials()), notes) == {} and "No changes.parquet" in notes[0]
    write_result(_changes(), study, "changes")
    res = run_analysis(study, out_dir=tmp_path / "analysis", figures=["change_vs_plasticity", "cka_vs_gain"])
    assert {"change_plasticity", "cka_gain"} <= set(res.tables)
    written = pd.read_csv(tmp_path / "analysis" / "cka_gain.csv")
    assert written["gain"].tolist() == pytest.approx([0.19, 0.23])
    figures = {f.name for f in res.figures}
    assert {"change_vs_plasticity", "cka_vs_gain"} <= figures
    assert (tmp_path / "analysis" / "figures" / "cka_vs_gain.png").stat().st_size > 0
    report = write_report(res).read_text()
    assert "Weight change against plasticity, per component" in report and "cka_vs_gain" in report


def test_a_bad_changes_table_names_its_file_and_column(tmp_path):
    bad = _changes()
    bad.loc[0, "measure"] = "wieght"
    write_result(bad, tmp_path, "changes")
    with pytest.raises(TableError, match=r"changes.parquet: column 'measure': unknown value\(s\) \['wieght'\]"):
        read_changes([str(tmp_path)])
