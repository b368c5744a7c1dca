"""A study directory for a notebook (``raystudy.load_study``), old directories included, and the rows of
failed trials (nulls, not -1). No Ray: the directories are written here, column by column."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

import raystudy
from raystudy.io import TableError, read_result
from raystudy.study.points import trial_id
from raystudy.study.results import ResultTables, load_study, trial_row
from raystudy.study.spec import StudySpec
from raystudy.study.tune import tune_experiments

IDS = [trial_id("a", "MHA", "sgd", 0.01, 0), trial_id("a", "LN1", "sgd", 0.1, 0), trial_id("b", "MHA", "sgd", 0.01, 0)]


def _old_study(root: Path) -> Path:
    """A study as written before the vocabulary was unified: ``component`` column, -1 sentinels of a
    failed trial, ``inject_failures`` in spec.yaml, no ``model_kwargs`` column."""
    root.mkdir()
    trials = pd.DataFrame({
        "trial_id": IDS, "dataset": ["a", "a", "b"], "model": ["m"] * 3, "component": ["MHA", "LN1", "MHA"],
        "optimizer": ["sgd"] * 3, "lr": [0.01, 0.1, 0.01], "seed": [0, 0, 0], "steps": [6, 6, 6],
        "batch_size": [8, 8, 8], "trainable_params": [1000, 200, -1], "status": ["ok", "diverged", "failed"],
        "best_val_acc": [0.5, 0.1, math.nan], "best_val_step": [3, 3, -1], "test_acc": [0.45, 0.1, math.nan],
        "final_val_loss": [1.2, math.nan, math.nan], "wall_seconds": [10.0, 8.0, math.nan],
        "num_restores": [0, 1, 0],
    })
    trials.to_parquet(root / "trials.parquet")
    curves = pd.DataFrame({
        "trial_id": [IDS[0]] * 3 + [IDS[1]] * 2, "step": [1, 2, 3, 1, 2],
        "lr": [0.002, 0.006, 0.01, 0.05, 0.1], "train_loss": [2.0, 1.8, 1.5, 2.0, math.inf],
        "grad_norm": [1.0] * 5, "val_loss": [math.nan, math.nan, 1.2, math.nan, math.nan],
        "val_acc": [math.nan, math.nan, 0.5, math.nan, math.nan],
    })
    curves.to_parquet(root / "curves.parquet")
    plasticity = pd.DataFrame({
        "model": "m", "dataset": ["a"] * 2, "mode": "embedding", "layer": [0, 0], "component": ["MHA", "LN1"],
        "plasticity": [2.5, 0.7], "std": [0.1, 0.2], "ci95": [0.05, 0.1], "n_pairs": [16, 16],
    })
    plasticity.to_parquet(root / "plasticity.parquet")
    bounds = pd.DataFrame({"model": "m", "layer": [0], "component": ["MHA"], "bound": [9.0], "radius": [3.0],
                           "seq_len": [17]})
    bounds.to_parquet(root / "bounds.parquet")
    spec = {"name": "old", "out": str(root), "model": "m", "weights": "w", "datasets": {"a": "a", "b": "b"},
            "pretrain_store": "p", "configurations": ["MHA", "LN1"], "optimizers": {"sgd": [0.01, 0.1]},
            "seeds": [0], "inject_failures": {IDS[0]: 3}}
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    return root


def test_load_study_reads_an_old_directory(tmp_path):
    study = load_study(str(_old_study(tmp_path / "old")))
    t = study.trials.set_index("trial_id")
    assert "component" not in t.columns and t.loc[IDS, "configuration"].tolist() == ["MHA", "LN1", "MHA"]
    # the failed trial's -1 counts are read as null; the others keep their values and integer type
    assert pd.isna(t.at[IDS[2], "trainable_params"]) and pd.isna(t.at[IDS[2], "best_val_step"])
    assert t.loc[IDS[:2], "trainable_params"].tolist() == [1000, 200]
    assert str(t["trainable_params"].dtype) == "Int64" and str(t["num_restores"].dtype) == "Int64"
    assert set(t.model_kwargs) == {"{}"}
    # curves: one row per logged step, with the columns of its own trial
    c = study.curves
    assert len(c) == 5 and c.groupby("trial_id").size().to_dict() == {IDS[0]: 3, IDS[1]: 2}
    for _, row in c.iterrows():
        assert row.configuration == t.at[row.trial_id, "configuration"]
        assert row.dataset == t.at[row.trial_id, "dataset"] and row.status == t.at[row.trial_id, "status"]
        assert row.lr == t.at[row.trial_id, "lr"]
    # the old file's scheduled lr (its column `lr`) is read as lr_now, beside the trial's base rate lr
    assert c.groupby("trial_id").lr_now.apply(list).to_dict() == {IDS[0]: [0.002, 0.006, 0.01], IDS[1]: [0.05, 0.1]}
    old = pd.read_parquet(tmp_path / "old" / "plasticity.parquet")  # before the control: read as pretrained
    pd.testing.assert_frame_equal(study.plasticity, old.assign(weights="pretrained", precision="fp32"))
    assert study.control is None
    assert study.bounds.bound.tolist() == [9.0] and study.rates is None
    assert study.spec["name"] == "old" and "trials: 3 rows" in repr(study)


def test_old_directory_resumes_with_todays_columns(tmp_path):
    root = _old_study(tmp_path / "old")
    tables = ResultTables(str(root))
    assert tables.done_ids() == set(IDS[:2]) and tables.status(IDS[2]) == "failed"
    p = {"trial_id": IDS[2], "dataset": "b", "configuration": "MHA", "optimizer": "sgd", "lr": 0.01, "seed": 0}
    summary = {"status": "ok", "steps": 6, "batch_size": 8, "trainable_params": 1000, "best_val_acc": 0.4,
               "best_val_step": 6, "test_acc": 0.35, "final_val_loss": 1.3, "wall_seconds": 9.0,
               "model_kwargs": {"depth": 3}, "configuration": "MHA"}
    tables.add(trial_row(p, "m", summary))  # the failed trial succeeds on resume: rewritten with new columns
    schema = pq.read_schema(root / "trials.parquet")
    assert "configuration" in schema.names and "component" not in schema.names
    assert schema.field("trainable_params").type == pa.int64() and schema.field("num_restores").type == pa.int64()
    trials = read_result(root, "trials").set_index("trial_id")
    assert trials.at[IDS[2], "status"] == "ok" and json.loads(trials.at[IDS[2], "model_kwargs"]) == {"depth": 3}
    assert trials.at[IDS[0], "wall_seconds"] == 10.0  # untouched rows kept as they were


def test_curves_parts_written_before_and_after_lr_now_read_as_one_table(tmp_path):
    """A study resumed across the rename of curves' scheduled rate holds part files of both kinds: an old
    part's ``lr`` (the scheduled rate) and a new part's ``lr_now`` are both read as ``lr_now``, whichever
    part comes first, and no ``lr`` column is left to be mistaken for the base rate; a new trial's curves
    from an older run's own file (``lr``) are written with ``lr_now``."""
    folder = tmp_path / "s" / "curves.parquet"
    folder.mkdir(parents=True)
    old = pd.DataFrame({"trial_id": ["t1"] * 2, "step": [1, 2], "lr": [0.001, 0.002], "train_loss": [2.0, 1.9],
                        "grad_norm": [1.0, 1.0], "val_loss": [None, 1.5], "val_acc": [None, 0.4]})
    new = old.rename(columns={"lr": "lr_now"}).assign(trial_id="t2", lr_now=[0.003, 0.004])
    for first, second in (("part-a", "part-b"), ("part-b", "part-a")):  # either kind first in the listing
        old.to_parquet(folder / f"{first}.parquet")
        new.to_parquet(folder / f"{second}.parquet")
        got = read_result(tmp_path / "s", "curves")
        assert "lr" not in got.columns
        assert got.set_index(["trial_id", "step"])["lr_now"].to_dict() == {
            ("t1", 1): 0.001, ("t1", 2): 0.002, ("t2", 1): 0.003, ("t2", 2): 0.004}
    tables = ResultTables(str(tmp_path / "fresh"))
    p = {"trial_id": "t3", "dataset": "a", "configuration": "MHA", "optimizer": "sgd", "lr": 0.01, "seed": 0}
    tables.add(trial_row(p, "m", {"status": "ok", "steps": 2}), old.drop(columns="trial_id"))
    part = pq.read_table(tmp_path / "fresh" / "curves.parquet" / "part-t3.parquet")
    assert "lr" not in part.column_names and part["lr_now"].to_pylist() == [0.001, 0.002]


def test_failed_trial_row_has_nulls_and_the_model_kwargs(tmp_path):
    """The one way to record a trial without a result: the run's failed summary as a trial row."""
    from raystudy.study.callback import failed_trial_row

    spec = StudySpec.from_dict({"name": "f", "out": str(tmp_path / "s"), "model": "vit_tiny_patch16_224",
                                "model_kwargs": {"depth": 2, "embed_dim": 48}, "weights": "w",
                                "datasets": {"a": str(tmp_path / "no-store")}, "pretrain_store": "p",
                                "configurations": ["MHA"], "optimizers": {"sgd": [0.01]}, "seeds": [0]})
    point = {"trial_id": IDS[0], "dataset": "a", "configuration": "MHA", "optimizer": "sgd", "lr": 0.01, "seed": 0}
    row = failed_trial_row(spec, point, "boom: the workers died")
    assert row["status"] == "failed" and row["error"] == "boom: the workers died"
    assert row["trainable_params"] is None and row["best_val_step"] is None  # the store is missing: not counted
    assert math.isnan(row["best_val_acc"]) and math.isnan(row["test_acc"])
    assert json.loads(row["model_kwargs"]) == {"depth": 2, "embed_dim": 48} and row["configuration"] == "MHA"
    tables = ResultTables(str(tmp_path / "s"))
    tables.add(row)
    back = read_result(tmp_path / "s", "trials")
    assert back.status.tolist() == ["failed"] and back.trainable_params.isna().all()
    assert pq.read_schema(tmp_path / "s" / "trials.parquet").field("best_val_step").type == pa.int64()


def test_load_study_is_exported_and_rejects_a_non_study(tmp_path):
    assert raystudy.load_study is load_study
    with pytest.raises(TableError, match="no study here"):
        load_study(str(tmp_path))


def test_tune_experiments_are_absolute_from_a_relative_study_dir(tmp_path, monkeypatch):
    for name in ("demo-001", "demo-000"):
        (tmp_path / "study" / "tune" / name).mkdir(parents=True)
    (tmp_path / "study" / "tune" / "not-a-launch.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    found = tune_experiments("study")
    assert found == [str(tmp_path / "study" / "tune" / "demo-000"), str(tmp_path / "study" / "tune" / "demo-001")]
    assert all(os.path.isabs(p) for p in found)
    assert tune_experiments("elsewhere") == []
    uri = f"file://{tmp_path}/study"
    assert tune_experiments(uri) == [f"{uri}/tune/demo-000", f"{uri}/tune/demo-001"]


def test_reconcile_repairs_a_final_row_whose_curves_were_lost(tmp_path):
    """A driver killed between the two table rewrites of an older version left a final row without its
    curves: the next run takes them from the trial's directory; a complete study is left alone."""
    root = _old_study(tmp_path / "old")
    points = [{"trial_id": tid, "dataset": ds, "configuration": c, "optimizer": "sgd", "lr": lr, "seed": 0}
              for tid, ds, c, lr in zip(IDS, "aab", ("MHA", "LN1", "MHA"), (0.01, 0.1, 0.01))]
    run = Path(root) / "trials" / IDS[0]
    run.mkdir(parents=True)
    summary = {"status": "ok", "steps": 6, "batch_size": 8, "trainable_params": 1000, "best_val_acc": 0.5,
               "best_val_step": 3, "test_acc": 0.45, "final_val_loss": 1.2, "wall_seconds": 10.0}
    (run / "summary.json").write_text(json.dumps(summary))
    own = pd.DataFrame({"step": [1, 2], "lr": [0.005, 0.01], "train_loss": [2.0, 1.0], "grad_norm": [1.0, 1.0],
                        "val_loss": [math.nan, 1.1], "val_acc": [math.nan, 0.5]})
    own.to_parquet(run / "curves.parquet")
    pd.read_parquet(root / "curves.parquet").query("trial_id != @IDS[0]").to_parquet(root / "curves.parquet")
    assert ResultTables(str(root)).reconcile(points, "m") == [IDS[0]]
    curves = read_result(root, "curves")
    assert curves[curves.trial_id == IDS[0]].train_loss.tolist() == [2.0, 1.0]
    assert ResultTables(str(root)).reconcile(points, "m") == []  # nothing left to repair
