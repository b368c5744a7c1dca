"""Statistical tests: Wilcoxon signed-rank of a reference configuration, plasticity/accuracy rank agreement.

Both use :mod:`scipy.stats`; these functions only assemble the paired samples.
"""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
from scipy import stats

from raystudy.analysis.tables import OVERALL, _with_model, finish, n_models
from raystudy.core.components import COMPONENTS, CONFIGURATIONS

PAIR_BY = ("dataset", "dataset_seed")
ALTERNATIVES = ("greater", "two-sided", "less")
ALPHA = 0.05


def check_options(reference: str, alternative: str, pair_by: str) -> None:
    """Reject unknown option values with an error naming the parameter."""
    if reference not in CONFIGURATIONS:
        raise ValueError(f"reference: unknown configuration {reference!r}; expected one of {list(CONFIGURATIONS)}")
    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative: {alternative!r} is not one of {list(ALTERNATIVES)}")
    if pair_by not in PAIR_BY:
        raise ValueError(f"pair_by: {pair_by!r} is not one of {list(PAIR_BY)}")


def paired_samples(best_lr: pd.DataFrame, trials_ok: pd.DataFrame, pair_by: str) -> pd.DataFrame:
    """One accuracy per (model, optimizer, component, pair): the unit the test pairs on.

    ``pair_by="dataset"``: the pair is the dataset, the value the best-lr mean over seeds.
    ``pair_by="dataset_seed"``: the pair is (dataset, seed), the value the seed's accuracy at its
    configuration's best learning rate on that dataset.
    """
    b = _with_model(best_lr, trials_ok)
    if pair_by == "dataset":
        return b.assign(pair=b["dataset"].astype(str))[["model", "optimizer", "component", "pair", "mean"]].rename(
            columns={"mean": "acc"})
    key = ["model", "dataset", "optimizer", "component", "lr"]
    runs = trials_ok.merge(b[key], on=key, how="inner")
    runs = runs.assign(pair=runs["dataset"].astype(str) + " / seed " + runs["seed"].astype(str))
    return runs[["model", "optimizer", "component", "pair", "test_acc"]].rename(columns={"test_acc": "acc"})


def wilcoxon_table(best_lr: pd.DataFrame, trials_ok: pd.DataFrame, *, reference: str = "MHA",
                   alternative: str = "greater", pair_by: str = "dataset", alpha: float = ALPHA) -> pd.DataFrame:
    """Wilcoxon signed-rank tests of ``reference`` against every other configuration.

    For each optimizer and each other configuration ``c``: pairs ``(a_ref[p], a_c[p])`` over the pairs
    ``p`` both have (see :func:`paired_samples`), ``scipy.stats.wilcoxon(a_ref, a_c, alternative=...)``
    (``"greater"``: the reference is better). ``statistic`` and ``p_value`` are NaN without pairs or when
    every difference is zero; ``significant`` is ``p_value < alpha``. Columns: ``optimizer, reference,
    other, statistic, p_value, n_pairs, significant``.
    """
    check_options(reference, alternative, pair_by)
    samples = paired_samples(best_lr, trials_ok, pair_by)
    rows = []
    for (model, opt), grp in samples.groupby(["model", "optimizer"], sort=True):
        ref = grp[grp["component"] == reference].set_index("pair")["acc"]
        if ref.empty:
            continue
        for other in CONFIGURATIONS:
            if other == reference or other not in set(grp["component"]):
                continue
            oth = grp[grp["component"] == other].set_index("pair")["acc"]
            joined = pd.concat([ref.rename("ref"), oth.rename("other")], axis=1, join="inner")
            stat = p = np.nan
            if len(joined) and not np.allclose(joined["ref"] - joined["other"], 0.0, rtol=0, atol=0):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)  # scipy's note on tiny samples
                    res = stats.wilcoxon(joined["ref"], joined["other"], alternative=alternative)
                stat, p = float(res.statistic), float(res.pvalue)
            rows.append(dict(model=model, optimizer=opt, reference=reference, other=other, statistic=stat,
                             p_value=p, n_pairs=len(joined), significant=bool(p < alpha)))
    cols = ["optimizer", "reference", "other", "statistic", "p_value", "n_pairs", "significant"]
    out = pd.DataFrame(rows, columns=["model"] + cols)
    return finish(out, cols, n_models(trials_ok))


def _order_string(values: pd.Series) -> str:
    """``"MHA > FC1 > ..."``: components by decreasing value."""
    return " > ".join(values.sort_values(ascending=False, kind="stable").index)


#: Up to this many components the Spearman p-value is exact (all n! pairings), beyond it scipy's t approximation.
EXACT_SPEARMAN_MAX_N = 8


def spearman_p_value(x, y) -> float:
    """Two-sided p-value of Spearman's rho.

    For ``n <= EXACT_SPEARMAN_MAX_N`` it is exact: ``scipy.stats.permutation_test`` over all ``n!``
    pairings (twice the smaller one-sided p, at most 1). ``scipy.stats.spearmanr``'s own p-value uses a
    t approximation that is badly off for five components (it reports ~1e-24 for a perfect ranking, whose
    exact p-value is 2/120).
    """
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) > EXACT_SPEARMAN_MAX_N:
        return float(stats.spearmanr(x, y).pvalue)
    ry = stats.rankdata(y)
    ry = ry - ry.mean()

    def rho(a, axis=-1):
        ra = stats.rankdata(a, axis=axis)
        ra = ra - ra.mean(axis=axis, keepdims=True)
        return (ra * ry).sum(axis=axis) / np.sqrt((ra ** 2).sum(axis=axis) * (ry ** 2).sum())

    res = stats.permutation_test((x,), rho, permutation_type="pairings", n_resamples=np.inf,
                                 alternative="two-sided", vectorized=True)
    return float(res.pvalue)


def _correlate(plast: pd.Series, acc: pd.Series) -> dict:
    both = pd.concat([plast.rename("p"), acc.rename("a")], axis=1, join="inner").dropna()
    both = both.loc[[c for c in COMPONENTS if c in both.index]]
    row = dict(spearman=np.nan, spearman_p=np.nan, kendall=np.nan, kendall_p=np.nan, n_components=len(both),
               plasticity_ranking=_order_string(both["p"]), accuracy_ranking=_order_string(both["a"]))
    if len(both) >= 3 and both["p"].nunique() > 1 and both["a"].nunique() > 1:
        s = stats.spearmanr(both["p"], both["a"])
        k = stats.kendalltau(both["p"], both["a"])
        row.update(spearman=float(s.statistic), spearman_p=spearman_p_value(both["p"], both["a"]),
                   kendall=float(k.statistic),
                   kendall_p=float(k.pvalue))
    return row


def ranking_table(plasticity: pd.DataFrame, best_lr: pd.DataFrame, trials_ok: pd.DataFrame,
                  notes: list[str] | None = None) -> pd.DataFrame | None:
    """Agreement between each dataset's plasticity ranking and its accuracy ranking of the five components.

    Plasticity of a component on a dataset: mean over layers of ``plasticity`` (per model and mode).
    Accuracy: the best-lr mean accuracy (per optimizer). For every dataset x optimizer x mode,
    ``scipy.stats.spearmanr`` (p-value: exact permutation test, :func:`spearman_p_value`) and
    ``scipy.stats.kendalltau`` (tau-b, exact p-value for small samples without ties) over the components
    both tables have (NaN below 3 components or for a constant ranking). Rows with
    ``dataset == "overall"`` correlate the mean over the shared datasets of both quantities. Plasticity and
    trials are matched on model and dataset; when their model names differ and each table holds one model,
    on dataset alone (noted).
    ``None`` when no dataset is in both tables.
    """
    notes = notes if notes is not None else []
    b = _with_model(best_lr, trials_ok)
    b = b[b["component"].isin(COMPONENTS)]
    plast = plasticity.groupby(["model", "dataset", "mode", "component"], sort=False)["plasticity"].mean()
    plast = plast.reset_index()
    p_models, t_models = set(plast["model"]), set(b["model"])
    if not p_models & t_models:
        if len(p_models) == 1 and len(t_models) == 1:
            notes.append(f"Ranking agreement: plasticity model {next(iter(p_models))!r} and finetuned model "
                         f"{next(iter(t_models))!r} differ in name; matched by dataset.")
            plast["model"] = next(iter(t_models))
        else:
            notes.append("Ranking agreement omitted: no model appears in both plasticity.parquet and trials.parquet.")
            return None
    shared = set(zip(plast["model"], plast["dataset"])) & set(zip(b["model"], b["dataset"]))
    if not shared:
        notes.append("Ranking agreement omitted: no dataset appears in both plasticity.parquet and trials.parquet.")
        return None
    missing = sorted({d for m, d in zip(b["model"], b["dataset"]) if (m, d) not in shared})
    if missing:
        notes.append(f"Ranking agreement: no plasticity measured for dataset(s) {missing}.")
    rows = []
    for (model, mode), pm in plast.groupby(["model", "mode"], sort=True):
        for opt, bo in b[b["model"] == model].groupby("optimizer", sort=True):
            datasets = sorted(set(pm["dataset"]) & set(bo["dataset"]))
            for ds in datasets:
                p = pm[pm["dataset"] == ds].set_index("component")["plasticity"]
                a = bo[bo["dataset"] == ds].set_index("component")["mean"]
                rows.append(dict(model=model, dataset=ds, optimizer=opt, mode=mode, **_correlate(p, a)))
            if datasets:
                p = pm[pm["dataset"].isin(datasets)].groupby("component")["plasticity"].mean()
                a = bo[bo["dataset"].isin(datasets)].groupby("component")["mean"].mean()
                rows.append(dict(model=model, dataset=OVERALL, optimizer=opt, mode=mode, **_correlate(p, a)))
    if not rows:
        return None
    cols = ["dataset", "optimizer", "mode", "spearman", "spearman_p", "kendall", "kendall_p", "n_components",
            "plasticity_ranking", "accuracy_ranking"]
    return finish(pd.DataFrame(rows), cols, n_models(trials_ok))
