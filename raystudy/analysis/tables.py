"""The study's accuracy and cost tables, as pure functions of validated DataFrames.

All functions take the *ok* trials (``status == "ok"``, see :mod:`raystudy.analysis.inputs`); accuracies
stay fractions in [0, 1]. Every table is computed per ``model`` internally; :func:`finish` drops that
column when the study holds a single model, so a one-model study gets exactly the documented columns.
Rows are ordered by model, dataset, optimizer and configuration (``CONFIGURATIONS`` order).

Notation: ``a[d, o, c, l, s]`` is the test accuracy of the trial on dataset ``d`` with optimizer ``o``,
configuration ``c``, learning rate ``l`` and seed ``s``; ``std`` is always the sample standard deviation
(``ddof=1``; NaN for a single value).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from raystudy.vocab import COMPONENTS, CONFIGURATIONS

#: Key of a learning-rate sweep: one (model, dataset, optimizer, configuration).
SWEEP = ["model", "dataset", "optimizer", "configuration"]
#: Label of the rows that aggregate over datasets.
OVERALL = "overall"


def order(df: pd.DataFrame) -> pd.DataFrame:
    """Sort by model, dataset (``overall`` last), optimizer and configuration order; fresh index."""
    keys, cols = [], []
    for c in ("model", "dataset", "optimizer", "mode", "configuration", "reference", "other"):
        if c not in df.columns:
            continue
        cols.append(c)
        if c in ("configuration", "other", "reference"):
            rank = {n: i for i, n in enumerate(CONFIGURATIONS)}
            keys.append(df[c].map(lambda v, r=rank: r.get(v, len(r))))
        elif c == "dataset":
            keys.append(df[c].map(lambda v: (v == OVERALL, str(v))))
        else:
            keys.append(df[c].astype(str))
    if not cols:
        return df.reset_index(drop=True)
    tmp = pd.DataFrame({f"_k{i}": k for i, k in enumerate(keys)}, index=df.index)
    idx = tmp.sort_values(list(tmp.columns), kind="stable").index
    return df.loc[idx].reset_index(drop=True)


def finish(df: pd.DataFrame, columns: list[str], n_models: int) -> pd.DataFrame:
    """Order rows, keep ``columns`` (plus a leading ``model`` when the study has several models)."""
    cols = (["model"] if n_models > 1 else []) + columns
    return order(df)[cols]


def n_models(trials_ok: pd.DataFrame) -> int:
    return int(trials_ok["model"].nunique())


def seed_means(trials_ok: pd.DataFrame) -> pd.DataFrame:
    """Per sweep and lr: ``mean = mean_s a[d,o,c,l,s]``, ``std`` over seeds and ``n_seeds``."""
    g = trials_ok.groupby(SWEEP + ["lr"], sort=False)["test_acc"]
    return g.agg(mean="mean", std="std", n_seeds="count").reset_index()


def best_lr_table(trials_ok: pd.DataFrame) -> pd.DataFrame:
    """The paper's full results table: for each dataset x configuration the best learning rate.

    ``lr* = argmax_l mean_s a[d,o,c,l,s]`` (ties: the smaller lr); columns ``dataset, optimizer,
    configuration, lr, mean, std, n_seeds`` give ``lr*`` and the mean and std over seeds at ``lr*``.
    """
    sm = seed_means(trials_ok).sort_values(SWEEP + ["lr"], kind="stable")
    best = sm.loc[sm.groupby(SWEEP, sort=False)["mean"].idxmax()]
    return finish(best, ["dataset", "optimizer", "configuration", "lr", "mean", "std", "n_seeds"], n_models(trials_ok))


def best_component(best_lr: pd.DataFrame) -> pd.Series:
    """Boolean mask of the rows of ``best_lr`` (or any table with ``mean``) that are the best among the five
    components for their model, dataset and optimizer (``All`` and ``Head`` never qualify)."""
    keys = [k for k in ("model", "dataset", "optimizer") if k in best_lr.columns]
    comp = best_lr[best_lr["configuration"].isin(COMPONENTS)]
    top = comp.groupby(keys, sort=False)["mean"].transform("max")
    mask = pd.Series(False, index=best_lr.index)
    mask.loc[comp.index] = np.isclose(comp["mean"], top, rtol=0, atol=1e-12)
    return mask


def lr_grid_table(trials_ok: pd.DataFrame) -> pd.DataFrame:
    """Mean and std over the learning-rate grid, seeds averaged first (the paper's Adam/SGD tables).

    ``m_l = mean_s a[d,o,c,l,s]``; ``mean = mean_l m_l``, ``std = std_l m_l``; ``n_lrs`` learning rates with
    at least one ok trial and ``n_trials`` ok trials in the sweep.
    """
    sm = seed_means(trials_ok)
    g = sm.groupby(SWEEP, sort=False)
    out = g["mean"].agg(["mean", "std"]).join(g["lr"].count().rename("n_lrs")).join(
        g["n_seeds"].sum().rename("n_trials")).reset_index()
    return finish(out, ["dataset", "optimizer", "configuration", "mean", "std", "n_lrs", "n_trials"],
                  n_models(trials_ok))


def _with_model(table: pd.DataFrame, trials_ok: pd.DataFrame) -> pd.DataFrame:
    """``table`` with its ``model`` column restored when :func:`finish` dropped it (one-model study)."""
    if "model" in table.columns:
        return table
    return table.assign(model=trials_ok["model"].iloc[0])


def overall_table(best_lr: pd.DataFrame, lr_grid: pd.DataFrame, trials_ok: pd.DataFrame) -> pd.DataFrame:
    """Mean over datasets per configuration (the paper's Table 1).

    ``mean``/``std``: mean and std over datasets of the best-lr accuracy; ``n_datasets``: datasets with an
    ok trial; ``lr_grid_mean``: mean over datasets of the lr-grid mean; ``lr_grid_std``: mean over datasets
    of the lr-grid std (the typical spread across learning rates).
    """
    b = _with_model(best_lr, trials_ok)
    g = _with_model(lr_grid, trials_ok)
    key = ["model", "optimizer", "configuration"]
    out = b.groupby(key, sort=False)["mean"].agg(mean="mean", std="std", n_datasets="count")
    grid = g.groupby(key, sort=False).agg(lr_grid_mean=("mean", "mean"), lr_grid_std=("std", "mean"))
    out = out.join(grid).reset_index()
    return finish(out, ["optimizer", "configuration", "mean", "std", "n_datasets", "lr_grid_mean", "lr_grid_std"],
                  n_models(trials_ok))


def relative_gain_table(best_lr: pd.DataFrame, trials_ok: pd.DataFrame) -> pd.DataFrame | None:
    """Improvement of each configuration over linear probing: ``(acc_c - acc_Head) / acc_Head``.

    ``acc`` is the best-lr mean accuracy. Per dataset and, in rows with ``dataset == "overall"``, the mean
    over datasets of ``accuracy``, ``head_accuracy`` and ``relative_gain`` (the mean of the per-dataset
    gains). ``None`` when no dataset has ``Head`` trials.
    """
    b = _with_model(best_lr, trials_ok)
    key = ["model", "dataset", "optimizer"]
    head = b[b["configuration"] == "Head"][key + ["mean"]].rename(columns={"mean": "head_accuracy"})
    if head.empty:
        return None
    rows = b[b["configuration"] != "Head"].merge(head, on=key, how="inner").rename(columns={"mean": "accuracy"})
    if rows.empty:
        return None
    rows["relative_gain"] = (rows["accuracy"] - rows["head_accuracy"]) / rows["head_accuracy"]
    overall = rows.groupby(["model", "optimizer", "configuration"], sort=False)[
        ["accuracy", "head_accuracy", "relative_gain"]].mean().reset_index().assign(dataset=OVERALL)
    out = pd.concat([rows, overall], ignore_index=True)
    return finish(out, ["dataset", "optimizer", "configuration", "accuracy", "head_accuracy", "relative_gain"],
                  n_models(trials_ok))


def stability_table(trials_ok: pd.DataFrame) -> pd.DataFrame:
    """Spread of test accuracy over learning rates x seeds per dataset x configuration.

    Over every ok trial of a sweep: ``mean``, ``std``, ``min``, ``max``, ``range = max - min`` and
    ``n_trials``. Rows with ``dataset == "overall"`` average each statistic over datasets (``n_trials``:
    the sum).
    """
    g = trials_ok.groupby(SWEEP, sort=False)["test_acc"]
    per = g.agg(mean="mean", std="std", min="min", max="max", n_trials="count").reset_index()
    per["range"] = per["max"] - per["min"]
    stats = ["mean", "std", "min", "max", "range"]
    og = per.groupby(["model", "optimizer", "configuration"], sort=False)
    overall = og[stats].mean().join(og["n_trials"].sum()).reset_index().assign(dataset=OVERALL)
    out = pd.concat([per, overall], ignore_index=True)
    return finish(out, ["dataset", "optimizer", "configuration"] + stats + ["n_trials"], n_models(trials_ok))


#: Optional memory columns of ``trials.parquet`` (written by the finetuning run summary).
MEMORY_COLUMNS = ("grad_memory_bytes", "optimizer_memory_bytes")


def recorded_counts(values: pd.Series) -> pd.Series:
    """``values`` as float with nulls, non-numbers and values <= 0 as NaN (a count or size not recorded)."""
    v = pd.to_numeric(values, errors="coerce").astype(float)
    return v.where(v > 0)


def cost_table(trials: pd.DataFrame, trials_ok: pd.DataFrame) -> pd.DataFrame:
    """Cost per configuration and optimizer.

    ``trainable_params`` and the memory columns are medians over the configuration's trials that recorded
    them: a failed trial records null there (studies written before nulls recorded ``-1``; any value <= 0
    counts as missing). They vary only with the classifier head, i.e. the number of classes of a dataset.
    ``wall_seconds`` and ``wall_seconds_std`` are the mean and std per ok trial; ``total_wall_seconds`` sums
    every trial with a recorded time, failed ones included (the compute actually spent); ``n_trials`` counts
    all trials. ``grad_memory_bytes`` / ``optimizer_memory_bytes`` appear only when ``trials.parquet`` has
    them (with at least one value), and ``images_per_s`` (mean training throughput per ok trial) likewise.
    """
    key = ["model", "optimizer", "configuration"]
    df = trials.copy()
    mem = [c for c in MEMORY_COLUMNS if c in df.columns and recorded_counts(df[c]).notna().any()]
    for c in ["trainable_params", *mem]:
        df[c] = recorded_counts(df[c])
    df["wall_seconds"] = pd.to_numeric(df["wall_seconds"], errors="coerce")
    g = df.groupby(key, sort=False)
    out = g[["trainable_params", *mem]].median()
    out = out.join(g["wall_seconds"].sum(min_count=1).rename("total_wall_seconds"))
    out = out.join(g["trial_id"].count().rename("n_trials"))
    ok = trials_ok.assign(wall_seconds=pd.to_numeric(trials_ok["wall_seconds"], errors="coerce"))
    out = out.join(ok.groupby(key, sort=False)["wall_seconds"].agg(wall_seconds="mean", wall_seconds_std="std"))
    speed = "images_per_s" in ok.columns and pd.to_numeric(ok["images_per_s"], errors="coerce").notna().any()
    if speed:
        ok = ok.assign(images_per_s=pd.to_numeric(ok["images_per_s"], errors="coerce"))
        out = out.join(ok.groupby(key, sort=False)["images_per_s"].mean())
    cols = ["optimizer", "configuration", "trainable_params", *mem, "wall_seconds", "wall_seconds_std",
            "total_wall_seconds", "n_trials", *(["images_per_s"] if speed else [])]
    return finish(out.reset_index(), cols, int(df["model"].nunique()))
