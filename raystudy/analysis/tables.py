"""The study's accuracy and cost tables, as pure functions of validated DataFrames.

All functions take the *counted* trials (see :mod:`raystudy.analysis.inputs`: status ok, or diverged with
the test accuracy of its best-validation checkpoint before the divergence; column ``diverged`` flags
those) and, where the linear probe enters, its ``LP`` rows (``probes``); accuracies stay fractions in
[0, 1]. Every table is computed per ``model`` internally; :func:`finish` drops that column when the study
holds a single model, so a one-model study gets exactly the documented columns. Rows are ordered by model,
dataset, optimizer and configuration (``TRIALS_CONFIGURATIONS`` order: ``LP`` after ``Head``).

Notation: ``a[d, o, c, l, s]`` is the test accuracy of the trial on dataset ``d`` with optimizer ``o``,
configuration ``c``, learning rate ``l`` and seed ``s``. Every ``std`` is the **population** standard
deviation (``ddof=0``: ``sqrt(mean((x - mean(x))**2))``, 0 for a single value), as the paper's authors
compute it (``numpy.std`` default); see :func:`population_std`. ``n_diverged`` counts the diverged runs
behind a value.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from raystudy.analysis.inputs import FINAL, SEARCH
from raystudy.vocab import COMPONENTS, LINEAR_PROBE, TRIALS_CONFIGURATIONS

#: Key of a learning-rate sweep: one (model, dataset, optimizer, configuration).
SWEEP = ["model", "dataset", "optimizer", "configuration"]
#: Label of the rows that aggregate over datasets.
OVERALL = "overall"
#: Delta degrees of freedom of every spread the analysis reports (the paper's ``numpy.std`` default).
DDOF = 0


def population_std(values) -> float:
    """``sqrt(mean((x - mean(x))**2))`` of the non-NaN ``values`` (``ddof=0``; 0 for one value, NaN for none)."""
    v = np.asarray(values, dtype=float)
    v = v[~np.isnan(v)]
    return float(np.std(v, ddof=DDOF)) if v.size else float("nan")


def order(df: pd.DataFrame) -> pd.DataFrame:
    """Sort by model, dataset (``overall`` last), optimizer and configuration order; fresh index."""
    keys, cols = [], []
    for c in ("model", "dataset", "optimizer", "mode", "configuration", "reference", "other"):
        if c not in df.columns:
            continue
        cols.append(c)
        if c in ("configuration", "other", "reference"):
            rank = {n: i for i, n in enumerate(TRIALS_CONFIGURATIONS)}
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


def n_models(counted: pd.DataFrame) -> int:
    return int(counted["model"].nunique())


def _diverged(df: pd.DataFrame) -> pd.Series:
    """The ``diverged`` flags of ``df`` as 0/1 (all 0 when the column is absent)."""
    if "diverged" not in df.columns:
        return pd.Series(0, index=df.index)
    return df["diverged"].fillna(False).astype(bool).astype(int)


def seed_means(counted: pd.DataFrame) -> pd.DataFrame:
    """Per sweep and lr: ``mean = mean_s a[d,o,c,l,s]``, ``std`` over seeds (ddof 0), ``n_seeds`` and
    ``n_diverged``."""
    g = counted.assign(n_diverged=_diverged(counted)).groupby(SWEEP + ["lr"], sort=False)
    out = g["test_acc"].agg(mean="mean", std=population_std, n_seeds="count")
    return out.join(g["n_diverged"].sum()).reset_index()


def probe_rows(probes: pd.DataFrame | None, counted: pd.DataFrame) -> pd.DataFrame:
    """The linear probe as best-lr rows: per model and dataset the mean and std (ddof 0) over probe seeds,
    repeated for every optimizer the dataset's trials used (the probe has no optimizer and no lr)."""
    cols = SWEEP + ["lr", "mean", "std", "n_seeds", "n_diverged"]
    if probes is None or probes.empty:
        return pd.DataFrame(columns=cols)
    p = probes.groupby(["model", "dataset"], sort=False)["test_acc"].agg(
        mean="mean", std=population_std, n_seeds="count").reset_index()
    opts = counted[["model", "dataset", "optimizer"]].drop_duplicates()
    rows = p.merge(opts, on=["model", "dataset"], how="inner")
    return rows.assign(configuration=LINEAR_PROBE, lr=np.nan, n_diverged=0)[cols]


def best_lr_table(counted: pd.DataFrame, probes: pd.DataFrame | None = None,
                  select_by: str = "test") -> pd.DataFrame:
    """The paper's full results table (Table 8): for each dataset x configuration the best learning rate.

    ``lr* = argmax_l mean_s a[d,o,c,l,s]`` (ties: the smaller lr) with ``a`` the test accuracy
    (``select_by="test"``, the paper's rule) or the best-validation accuracy (``"val"``: test never
    chooses); columns ``dataset, optimizer, configuration, lr, mean, std, n_seeds, n_diverged`` give ``lr*``,
    the mean and std (ddof 0) over seeds of the TEST accuracy at ``lr*``, and how many of those seeds' runs
    diverged. ``LP`` rows (:func:`probe_rows`, lr NaN) are added when ``probes`` has rows.
    """
    sm = seed_means(counted).sort_values(SWEEP + ["lr"], kind="stable").reset_index(drop=True)
    score = sm["mean"]
    if select_by == "val":
        val = counted.groupby(SWEEP + ["lr"], sort=False)["best_val_acc"].mean().rename("val_mean").reset_index()
        score = sm.merge(val, on=SWEEP + ["lr"], how="left")["val_mean"].fillna(-np.inf)
    best = sm.loc[score.groupby([sm[k] for k in SWEEP], sort=False).idxmax()]
    lp = probe_rows(probes, counted)
    if len(lp):
        best = pd.concat([best, lp.astype(best.dtypes.to_dict())], ignore_index=True)
    return finish(best, ["dataset", "optimizer", "configuration", "lr", "mean", "std", "n_seeds", "n_diverged"],
                  n_models(counted))


def final_fit_table(final: pd.DataFrame, probes: pd.DataFrame | None = None) -> pd.DataFrame:
    """The ``best_lr`` table's shape read from the final fit's rows (``phase: final``, one lr per sweep, the one
    the search chose on validation): per sweep ``lr`` (the lr it was retrained at), ``mean`` and ``std`` (ddof
    0) over seeds of the test accuracy, ``n_seeds``, ``n_diverged``; ``LP`` rows (:func:`probe_rows`) added."""
    g = final.assign(n_diverged=_diverged(final)).groupby(SWEEP, sort=False)
    out = g["test_acc"].agg(mean="mean", std=population_std, n_seeds="count")
    out = out.join(g["lr"].median()).join(g["n_diverged"].sum()).reset_index()
    lp = probe_rows(probes, final)
    if len(lp):
        out = pd.concat([out, lp.astype(out.dtypes.to_dict())], ignore_index=True)
    return finish(out, ["dataset", "optimizer", "configuration", "lr", "mean", "std", "n_seeds", "n_diverged"],
                  n_models(final))


def phase_of(final: pd.DataFrame | None) -> str:
    """The phase a study's report answers from: :data:`~raystudy.analysis.inputs.FINAL` when it has counted
    final-fit rows, else :data:`~raystudy.analysis.inputs.SEARCH`."""
    return FINAL if final is not None and len(final) else SEARCH


def phase_rows(final: pd.DataFrame | None, counted: pd.DataFrame) -> pd.DataFrame:
    """The trials of the phase the report answers from (:func:`phase_of`): ``final``'s, else ``counted``."""
    return final if phase_of(final) == FINAL else counted


def reported_accuracies(best_lr: pd.DataFrame, counted: pd.DataFrame, final: pd.DataFrame | None,
                        probes: pd.DataFrame | None = None, notes: list[str] | None = None,
                        ) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """``(per-dataset accuracies, the trials behind them, phase)`` that every table, figure and headline
    reporting a configuration's accuracy reads, so that the report answers from one phase: the final fit where
    the study has one (:func:`final_fit_table`, its rows, :data:`~raystudy.analysis.inputs.FINAL`), else the lr
    search (``best_lr``, ``counted``, :data:`~raystudy.analysis.inputs.SEARCH`). The lr search's own tables
    (``best_lr``, ``lr_grid``, ``stability``) read the search. A configuration searched but not refit is left
    out of the final fit's (noted)."""
    if phase_of(final) == SEARCH:
        return best_lr, counted, SEARCH
    missing = sorted(set(zip(counted["optimizer"], counted["configuration"]))
                     - set(zip(final["optimizer"], final["configuration"])))
    if missing and notes is not None:
        notes.append(f"Final fit: no final-phase rows of {', '.join(f'{c} ({o})' for o, c in missing)}: left out of "
                     "every table and figure that reads the final fit (the lr search's tables keep them).")
    return final_fit_table(final, probes), final, FINAL


def best_component(best_lr: pd.DataFrame) -> pd.Series:
    """Boolean mask of the rows of ``best_lr`` (or any table with ``mean``) that are the best among the five
    components for their model, dataset and optimizer (``All`` and ``Head`` never qualify)."""
    keys = [k for k in ("model", "dataset", "optimizer") if k in best_lr.columns]
    comp = best_lr[best_lr["configuration"].isin(COMPONENTS)]
    top = comp.groupby(keys, sort=False)["mean"].transform("max")
    mask = pd.Series(False, index=best_lr.index)
    mask.loc[comp.index] = np.isclose(comp["mean"], top, rtol=0, atol=1e-12)
    return mask


def lr_grid_table(counted: pd.DataFrame) -> pd.DataFrame:
    """Mean and std over the learning-rate grid, seeds averaged first.

    ``m_l = mean_s a[d,o,c,l,s]``; ``mean = mean_l m_l``, ``std = std_l m_l`` (ddof 0); ``n_lrs`` learning
    rates with at least one counted trial, ``n_trials`` counted trials in the sweep, ``n_diverged`` of them
    diverged.
    """
    sm = seed_means(counted)
    g = sm.groupby(SWEEP, sort=False)
    out = g["mean"].agg(mean="mean", std=population_std).join(g["lr"].count().rename("n_lrs")).join(
        g["n_seeds"].sum().rename("n_trials")).join(g["n_diverged"].sum()).reset_index()
    return finish(out, ["dataset", "optimizer", "configuration", "mean", "std", "n_lrs", "n_trials", "n_diverged"],
                  n_models(counted))


def _with_model(table: pd.DataFrame, counted: pd.DataFrame) -> pd.DataFrame:
    """``table`` with its ``model`` column restored when :func:`finish` dropped it (one-model study)."""
    if "model" in table.columns:
        return table
    return table.assign(model=counted["model"].iloc[0])


def overall_table(best_lr: pd.DataFrame, lr_grid: pd.DataFrame, counted: pd.DataFrame) -> pd.DataFrame:
    """Mean over datasets per configuration (the paper's Table 1).

    ``mean``/``std``: mean and std (ddof 0) over datasets of the best-lr accuracy; ``n_datasets``: datasets
    with a counted trial; ``n_diverged``: diverged runs behind those best-lr accuracies; ``lr_grid_mean``:
    mean over datasets of the lr-grid mean; ``lr_grid_std``: mean over datasets of the lr-grid std (the
    typical spread across learning rates; NaN for ``LP``, which has no lr grid).
    """
    b = _with_model(best_lr, counted)
    g = _with_model(lr_grid, counted)
    key = ["model", "optimizer", "configuration"]
    bg = b.groupby(key, sort=False)
    out = bg["mean"].agg(mean="mean", std=population_std, n_datasets="count").join(bg["n_diverged"].sum())
    grid = g.groupby(key, sort=False).agg(lr_grid_mean=("mean", "mean"), lr_grid_std=("std", "mean"))
    out = out.join(grid).reset_index()
    return finish(out, ["optimizer", "configuration", "mean", "std", "n_datasets", "n_diverged", "lr_grid_mean",
                        "lr_grid_std"], n_models(counted))


def gain_reference(best_lr: pd.DataFrame) -> str | None:
    """The relative gain's baseline: ``LP`` (the authors' linear probe) when ``best_lr`` has probe rows,
    else ``Head`` (a trained classifier) when it has Head rows, else ``None``."""
    names = set(best_lr["configuration"])
    return next((c for c in (LINEAR_PROBE, "Head") if c in names), None)


def relative_gain_table(best_lr: pd.DataFrame, counted: pd.DataFrame) -> pd.DataFrame | None:
    """Improvement of each configuration over linear probing (Table 8): ``(acc_c - acc_ref) / acc_ref``.

    ``acc`` is the best-lr mean accuracy; ``ref`` is :func:`gain_reference` (``LP``, else ``Head``), named in
    column ``reference``. Per dataset and, in rows with ``dataset == "overall"``, the mean over datasets of
    ``accuracy``, ``reference_accuracy`` and ``relative_gain`` (the mean of the per-dataset gains, as the
    authors average them). Datasets without the reference are left out. ``None`` without a reference.
    """
    b = _with_model(best_lr, counted)
    ref = gain_reference(b)
    if ref is None:
        return None
    key = ["model", "dataset", "optimizer"]
    base = b[b["configuration"] == ref][key + ["mean"]].rename(columns={"mean": "reference_accuracy"})
    rows = b[b["configuration"] != ref].merge(base, on=key, how="inner").rename(columns={"mean": "accuracy"})
    if rows.empty:
        return None
    rows["relative_gain"] = (rows["accuracy"] - rows["reference_accuracy"]) / rows["reference_accuracy"]
    overall = rows.groupby(["model", "optimizer", "configuration"], sort=False)[
        ["accuracy", "reference_accuracy", "relative_gain"]].mean().reset_index().assign(dataset=OVERALL)
    out = pd.concat([rows, overall], ignore_index=True).assign(reference=ref)
    return finish(out, ["dataset", "optimizer", "configuration", "reference", "accuracy", "reference_accuracy",
                        "relative_gain"], n_models(counted))


def _spread_rows(counted: pd.DataFrame) -> pd.DataFrame:
    """Per sweep, over every counted trial (lrs x seeds pooled): mean, std (ddof 0), min, max, range, counts."""
    g = counted.assign(n_diverged=_diverged(counted)).groupby(SWEEP, sort=False)
    per = g["test_acc"].agg(mean="mean", std=population_std, min="min", max="max", n_trials="count")
    per = per.join(g["lr"].nunique().rename("n_lrs")).join(g["seed"].nunique().rename("n_seeds"))
    per = per.join(g["n_diverged"].sum()).reset_index()
    per["range"] = per["max"] - per["min"]
    return per


def stability_table(counted: pd.DataFrame) -> pd.DataFrame:
    """Spread of test accuracy over learning rates x seeds per dataset x configuration.

    Over every counted trial of a sweep: ``mean``, ``std`` (ddof 0), ``min``, ``max``, ``range = max - min``,
    ``n_trials`` and ``n_diverged``. Rows with ``dataset == "overall"`` average each statistic over datasets
    (``n_trials``, ``n_diverged``: the sum).
    """
    per = _spread_rows(counted)
    stats = ["mean", "std", "min", "max", "range"]
    og = per.groupby(["model", "optimizer", "configuration"], sort=False)
    overall = og[stats].mean().join(og[["n_trials", "n_diverged"]].sum()).reset_index().assign(dataset=OVERALL)
    out = pd.concat([per, overall], ignore_index=True)
    return finish(out, ["dataset", "optimizer", "configuration"] + stats + ["n_trials", "n_diverged"],
                  n_models(counted))


def shared_subset(counted: pd.DataFrame) -> pd.DataFrame:
    """The (model, dataset, seed) triples on which every optimizer of the model has counted trials."""
    runs = counted[["model", "dataset", "seed", "optimizer"]].drop_duplicates()
    n_opt = counted.groupby("model")["optimizer"].nunique().rename("n_opt")
    per = runs.groupby(["model", "dataset", "seed"])["optimizer"].nunique().rename("n").reset_index()
    per = per.merge(n_opt, left_on="model", right_index=True)
    return per[per["n"] == per["n_opt"]][["model", "dataset", "seed"]].reset_index(drop=True)


def optimizer_table(counted: pd.DataFrame) -> pd.DataFrame | None:
    """The optimizers side by side on the subset every one of them ran (the paper's Tables 2 and 10).

    Trials restricted to the (dataset, seed) pairs of :func:`shared_subset`; per dataset x optimizer x
    configuration, as the authors' ``ablation.py``: ``mean`` and ``std`` (ddof 0) of the test accuracy over
    the learning-rate grid x seeds pooled (with one seed: the std across learning rates), ``n_lrs``,
    ``n_seeds``, ``n_trials``, ``n_diverged``. Rows with ``dataset == "overall"`` average ``mean`` and
    ``std`` over the datasets (counts summed). ``None`` unless the study has two optimizers sharing a subset.
    """
    if counted.groupby("model")["optimizer"].nunique().max() < 2:
        return None
    subset = shared_subset(counted)
    if subset.empty:
        return None
    per = _spread_rows(counted.merge(subset, on=["model", "dataset", "seed"], how="inner"))
    og = per.groupby(["model", "optimizer", "configuration"], sort=False)
    overall = og[["mean", "std"]].mean().join(og[["n_trials", "n_diverged"]].sum())
    overall = overall.join(og[["n_lrs", "n_seeds"]].max()).reset_index().assign(dataset=OVERALL)
    out = pd.concat([per, overall], ignore_index=True)
    return finish(out, ["dataset", "optimizer", "configuration", "mean", "std", "n_lrs", "n_seeds", "n_trials",
                        "n_diverged"], n_models(counted))


#: Optional memory columns of ``trials.parquet`` (written by the finetuning run summary).
MEMORY_COLUMNS = ("grad_memory_bytes", "optimizer_memory_bytes")


def recorded_counts(values: pd.Series) -> pd.Series:
    """``values`` as float with nulls, non-numbers and values <= 0 as NaN (a count or size not recorded)."""
    v = pd.to_numeric(values, errors="coerce").astype(float)
    return v.where(v > 0)


#: The optimizer cell of the linear probe's cost row (it is fit by scikit-learn, not by a study optimizer).
NO_OPTIMIZER = "–"


def _run_costs(counted: pd.DataFrame, probes: pd.DataFrame | None) -> pd.DataFrame:
    """The runs whose time is a run's cost: counted trials that did not diverge (a diverged run stops
    early), and the probe rows."""
    runs = counted[_diverged(counted) == 0]
    if probes is not None and len(probes):
        runs = pd.concat([runs, probes.assign(optimizer=NO_OPTIMIZER)], ignore_index=True)
    return runs.assign(wall_seconds=pd.to_numeric(runs["wall_seconds"], errors="coerce"))


def cost_table(trials: pd.DataFrame, counted: pd.DataFrame, probes: pd.DataFrame | None = None) -> pd.DataFrame:
    """Cost per configuration and optimizer.

    ``trainable_params`` and the memory columns are medians over the configuration's trials that recorded
    them: a failed trial records null there (studies written before nulls recorded ``-1``; any value <= 0
    counts as missing). They vary only with the classifier head, i.e. the number of classes of a dataset.
    ``wall_seconds`` and ``wall_seconds_std`` (ddof 0) are the mean and std per completed run (status ok;
    diverged runs stop early); ``total_wall_seconds`` sums every trial with a recorded time, failed ones
    included (the compute actually spent); ``n_trials`` counts all trials. ``grad_memory_bytes`` /
    ``optimizer_memory_bytes`` appear only when ``trials.parquet`` has them (with at least one value), and
    ``images_per_s`` (mean training throughput per completed run) likewise, and ``selection_seconds`` (a
    budget's selection cost: the wall time of the scoring pass its selection came from, mean over its trials).
    The ``LP`` row's optimizer is :data:`NO_OPTIMIZER`.
    """
    key = ["model", "optimizer", "configuration"]
    df = trials.assign(optimizer=trials["optimizer"].where(trials["configuration"] != LINEAR_PROBE, NO_OPTIMIZER))
    mem = [c for c in MEMORY_COLUMNS if c in df.columns and recorded_counts(df[c]).notna().any()]
    for c in ["trainable_params", *mem]:
        df[c] = recorded_counts(df[c])
    df["wall_seconds"] = pd.to_numeric(df["wall_seconds"], errors="coerce")
    g = df.groupby(key, sort=False)
    out = g[["trainable_params", *mem]].median()
    out = out.join(g["wall_seconds"].sum(min_count=1).rename("total_wall_seconds"))
    out = out.join(g["trial_id"].count().rename("n_trials"))
    ok = _run_costs(counted, probes)
    out = out.join(ok.groupby(key, sort=False)["wall_seconds"].agg(wall_seconds="mean",
                                                                   wall_seconds_std=population_std))
    speed = "images_per_s" in ok.columns and pd.to_numeric(ok["images_per_s"], errors="coerce").notna().any()
    if speed:
        ok = ok.assign(images_per_s=pd.to_numeric(ok["images_per_s"], errors="coerce"))
        out = out.join(ok.groupby(key, sort=False)["images_per_s"].mean())
    selection = "selection_seconds" in df.columns \
        and pd.to_numeric(df["selection_seconds"], errors="coerce").notna().any()
    if selection:  # a budget's scoring pass before training (raystudy.study.jobs.selection_seconds)
        out = out.join(df.assign(selection_seconds=pd.to_numeric(df["selection_seconds"], errors="coerce"))
                       .groupby(key, sort=False)["selection_seconds"].mean())
    cols = ["optimizer", "configuration", "trainable_params", *mem, "wall_seconds", "wall_seconds_std",
            "total_wall_seconds", "n_trials", *(["images_per_s"] if speed else []),
            *(["selection_seconds"] if selection else [])]
    return finish(out.reset_index(), cols, int(df["model"].nunique()))
