"""The Optuna learning-rate search: one TPE search per (dataset, configuration, optimizer, seed) cell, with
per-cell budgets and the history of a resumed study. No Ray instance needed (the searcher is driven directly)."""

from __future__ import annotations

import math

import pytest

from raystudy.study.points import trial_id
from raystudy.study.results import ResultTables, trial_row
from raystudy.study.search import GroupedOptunaSearch, optuna_plan
from raystudy.study.spec import StudySpec


def _spec(tmp_path, **kw):
    data = dict(name="o", out=str(tmp_path), model="m", weights="w", datasets={"a": "a"}, pretrain_store="p",
                configurations=["MHA", "LN1"], optimizers={"sgd": [1e-3, 3e-2]}, seeds=[0], steps=10,
                warmup_steps=1, search="optuna", samples=3)
    data.update(kw)
    return StudySpec.from_dict(data)


def _summary(lr, acc, status="ok"):
    return {"steps": 10, "batch_size": 8, "trainable_params": 1, "status": status, "best_val_acc": acc,
            "best_val_step": 5, "test_acc": acc, "final_val_loss": 1.0, "wall_seconds": 1.0}


def test_plan_counts_what_each_cell_already_has(tmp_path):
    spec = _spec(tmp_path)
    tables = ResultTables(str(tmp_path))
    p = {"trial_id": trial_id("a", "MHA", "sgd", 0.01, 0), "dataset": "a", "configuration": "MHA",
         "optimizer": "sgd", "lr": 0.01, "seed": 0}
    tables.add(trial_row(p, "m", _summary(0.01, 0.7)))
    q = dict(p, trial_id=trial_id("a", "MHA", "sgd", 0.02, 0), lr=0.02)
    tables.add(trial_row(q, "m", _summary(0.02, math.nan, status="diverged")))
    budget, history = optuna_plan(spec, tables)
    assert budget == {("a", "MHA", "sgd", 0): 1, ("a", "LN1", "sgd", 0): 3}
    assert sorted(history[("a", "MHA", "sgd", 0)]) == [(0.01, 0.7), (0.02, 0.0)]  # diverged counts as 0


def test_grouped_search_respects_budgets_ranges_and_history(tmp_path):
    from ray.tune.search import Searcher

    spec = _spec(tmp_path)
    budget = {("a", "MHA", "sgd", 0): 2, ("a", "LN1", "sgd", 0): 3}
    history = {("a", "MHA", "sgd", 0): [(0.01, 0.7)], ("a", "LN1", "sgd", 0): []}
    searcher = GroupedOptunaSearch(spec, budget, history, seed=1)
    suggestions = []
    for i in range(10):
        s = searcher.suggest(f"t{i}")
        if s == Searcher.FINISHED:
            break
        suggestions.append((f"t{i}", s["point"]))
    assert len(suggestions) == 5
    cells = [(p["dataset"], p["configuration"], p["optimizer"], p["seed"]) for _, p in suggestions]
    assert cells.count(("a", "MHA", "sgd", 0)) == 2 and cells.count(("a", "LN1", "sgd", 0)) == 3
    for _, p in suggestions:
        assert 1e-3 <= p["lr"] <= 3e-2
        assert p["trial_id"] == trial_id(p["dataset"], p["configuration"], "sgd", p["lr"], 0)
    assert len({p["trial_id"] for _, p in suggestions}) == 5
    for tid, _ in suggestions:  # completion reaches the cell's own Optuna study
        searcher.on_trial_complete(tid, {"objective": 0.5})
    studies = {cell: s._ot_study for cell, s in searcher.searchers.items()}
    assert len(studies[("a", "LN1", "sgd", 0)].trials) == 3
    # the resumed cell's earlier result is in its study as an evaluated trial, next to the 2 new ones
    mha = studies[("a", "MHA", "sgd", 0)].trials
    assert len(mha) == 3 and mha[0].params["lr"] == pytest.approx(0.01) and mha[0].value == pytest.approx(0.7)
    assert all(t.value == 0.5 for t in studies[("a", "LN1", "sgd", 0)].trials)
