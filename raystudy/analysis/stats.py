"""Statistical tests: Wilcoxon signed-rank of a reference configuration, plasticity/accuracy rank agreement.

Both use :mod:`scipy.stats`; these functions only assemble the paired samples.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
from scipy import stats

from raystudy.analysis.options import (
    DEFAULT_ALTERNATIVE,
    DEFAULT_PAIR_BY,
    DEFAULT_REFERENCE,
    DEFAULT_ROUND,
    check_options,
    unknown_reference,
)
from raystudy.analysis.ranks import order_string, tau_b, tied
from raystudy.analysis.tables import OVERALL, _with_model, finish, n_models
from raystudy.core.expressions import canonical, is_configuration
from raystudy.vocab import COMPONENTS, LINEAR_PROBE, TRIALS_CONFIGURATIONS

ALPHA = 0.05


def paired_samples(best_lr: pd.DataFrame, counted: pd.DataFrame, pair_by: str,
                   probes: pd.DataFrame | None = None) -> pd.DataFrame:
    """One accuracy per (model, optimizer, configuration, pair): the unit the test pairs on.

    ``pair_by="dataset"``: the pair is the dataset, the value the best-lr mean over seeds.
    ``pair_by="dataset_seed"``: the pair is (dataset, seed), the value the seed's accuracy at its
    configuration's best learning rate on that dataset (``LP``: the probe of that seed, for every optimizer).
    """
    b = _with_model(best_lr, counted)
    cols = ["model", "optimizer", "configuration", "pair", "acc"]
    if pair_by == "dataset":
        pairs = b.assign(pair=b["dataset"].astype(str))
        return pairs.rename(columns={"mean": "acc"})[cols]
    key = ["model", "dataset", "optimizer", "configuration", "lr"]
    runs = counted.merge(b[b["configuration"] != LINEAR_PROBE][key], on=key, how="inner")
    if probes is not None and len(probes):
        lp = b[b["configuration"] == LINEAR_PROBE][["model", "dataset", "optimizer"]]
        runs = pd.concat([runs, probes.drop(columns=["optimizer"]).merge(lp, on=["model", "dataset"])])
    runs = runs.assign(pair=runs["dataset"].astype(str) + " / seed " + runs["seed"].astype(str))
    return runs.rename(columns={"test_acc": "acc"})[cols]


def signed_rank_test(ref: pd.Series, other: pd.Series, alternative: str) -> tuple[float, float, int]:
    """``(statistic, p_value, n_pairs)`` of ``scipy.stats.wilcoxon(ref, other)`` over their shared pairs.

    ``ref`` and ``other`` are accuracies indexed by pair; NaN statistic and p-value without pairs or when
    every difference is zero.
    """
    joined = pd.concat([ref.rename("ref"), other.rename("other")], axis=1, join="inner")
    if not len(joined) or (joined["ref"] == joined["other"]).all():
        return np.nan, np.nan, len(joined)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # scipy's note on tiny samples
        res = stats.wilcoxon(joined["ref"], joined["other"], alternative=alternative)
    return float(res.statistic), float(res.pvalue), len(joined)


def statistic_note(alternative: str, difference: str) -> str:
    """What ``scipy.stats.wilcoxon``'s statistic is under ``alternative`` (``difference``: e.g. "reference − other")."""
    if alternative == "two-sided":
        return (f"statistic: min(W+, W−), the smaller of the rank sums of the positive and of the negative "
                f"differences ({difference}), as scipy reports it for a two-sided test")
    return f"statistic: W+, the sum of the ranks of the positive differences ({difference})"


def smallest_p_note(alternative: str, n_pairs) -> str:
    """The smallest exact p-value a Wilcoxon test can reach with the pair counts ``n_pairs`` of a table:
    ``2^-n`` one-sided, ``2^(1-n)`` two-sided (every difference of one sign)."""
    two = alternative == "two-sided"
    ns = sorted({int(n) for n in n_pairs if n == n and n > 0})
    reach = ", ".join(f"{min(1.0, 2.0 ** ((1 if two else 0) - n)):.3g} for n = {n}" for n in ns)
    return (f"With n pairs the smallest attainable {'two' if two else 'one'}-sided exact p-value is "
            f"{'2^(1-n)' if two else '2^-n'}" + (f": {reach} here." if reach else "."))


def smallest_wilcoxon_p(n_pairs: int, alternative: str) -> float:
    """The smallest p-value ``scipy.stats.wilcoxon`` returns on ``n_pairs`` paired differences: all of one sign
    (the alternative's) with distinct magnitudes. Exactly ``2**-n`` one-sided, ``2 * 2**-n`` two-sided."""
    if n_pairs < 1:
        return math.nan
    sign = -1.0 if alternative == "less" else 1.0
    return float(stats.wilcoxon(sign * np.arange(1.0, n_pairs + 1), alternative=alternative).pvalue)


def canonical_reference(reference: str) -> str:
    """``reference`` in its one spelling: a vocabulary name as it is, an expression by
    :func:`raystudy.core.expressions.canonical` (``FC1+MHA`` -> ``MHA+FC1``); ``ValueError`` when it is neither."""
    if reference in TRIALS_CONFIGURATIONS:
        return reference
    if not isinstance(reference, str) or not is_configuration(reference):
        raise ValueError(unknown_reference(reference))
    return canonical(reference)


def reference_in(reference: str, configurations) -> str | None:
    """The spelling in ``configurations`` (a study's) of the configuration ``reference`` names: equal canonical
    spellings match (``FC1+MHA`` finds ``MHA+FC1``); ``None`` when the study has no such configuration."""
    want = canonical_reference(reference)
    for c in configurations:
        if str(c) in TRIALS_CONFIGURATIONS or is_configuration(str(c)):
            if canonical_reference(str(c)) == want:
                return str(c)
    return None


def configuration_order(names) -> list[str]:
    """The vocabulary's configurations in its order, then configuration expressions sorted."""
    names = set(names)
    return [c for c in TRIALS_CONFIGURATIONS if c in names] + sorted(names - set(TRIALS_CONFIGURATIONS))


def wilcoxon_table(best_lr: pd.DataFrame, counted: pd.DataFrame, *, reference: str = DEFAULT_REFERENCE,
                   alternative: str = DEFAULT_ALTERNATIVE, pair_by: str = DEFAULT_PAIR_BY,
                   alpha: float = ALPHA, probes: pd.DataFrame | None = None,
                   round_to: int | None = DEFAULT_ROUND) -> pd.DataFrame:
    """Wilcoxon signed-rank tests of ``reference`` against every other configuration.

    For each optimizer and each other configuration ``c``: pairs ``(a_ref[p], a_c[p])`` over the pairs
    ``p`` both have (see :func:`paired_samples`), ``scipy.stats.wilcoxon(a_ref, a_c, alternative=...)``
    (``"greater"``: the reference is better). ``statistic`` and ``p_value`` are NaN without pairs or when
    every difference is zero; ``significant`` is ``p_value < alpha``. ``round_to``: test the accuracies as
    percentages rounded to that many decimals (the paper's authors test the two-decimal values of their
    Table 8, where scipy drops the pairs that rounding made equal). ``reference`` may be a configuration
    expression: it is matched to the study's configurations by canonical spelling
    (:func:`~raystudy.analysis.options.reference_in`) and reported in the study's spelling. Columns:
    ``optimizer, reference, other, statistic, p_value, n_pairs, significant``.
    """
    check_options(reference, alternative, pair_by, round_to)
    canonical_reference(reference)
    samples = paired_samples(best_lr, counted, pair_by, probes)
    rows = []
    for (model, opt), grp in samples.groupby(["model", "optimizer"], sort=True):
        acc = {c: g.set_index("pair")["acc"] for c, g in grp.groupby("configuration", sort=False)}
        if round_to is not None:
            acc = {c: (100 * a).round(round_to) for c, a in acc.items()}
        ref = reference_in(reference, acc)
        if ref is None:
            continue
        for other in [c for c in configuration_order(acc) if c != ref]:
            stat, p, n = signed_rank_test(acc[ref], acc[other], alternative)
            rows.append(dict(model=model, optimizer=opt, reference=ref, other=other, statistic=stat,
                             p_value=p, n_pairs=n, significant=bool(p < alpha)))
    cols = ["optimizer", "reference", "other", "statistic", "p_value", "n_pairs", "significant"]
    return finish(pd.DataFrame(rows, columns=["model"] + cols), cols, n_models(counted))


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
               plasticity_ranking=order_string(both["p"]), accuracy_ranking=order_string(both["a"]))
    p, a = tied(both["p"]), tied(both["a"])  # ties within TIE_RTOL count as ties, never as an order
    if len(both) >= 3 and p.nunique() > 1 and a.nunique() > 1:
        s = stats.spearmanr(p, a)
        tau, tau_p = tau_b(p, a)
        row.update(spearman=float(s.statistic), spearman_p=spearman_p_value(p, a), kendall=tau, kendall_p=tau_p)
    return row


def _match_models(plast: pd.DataFrame, accuracy: pd.DataFrame, notes: list[str]) -> pd.DataFrame | None:
    """``plast`` with its model renamed to the finetuned one when each table holds one model under different
    names; ``None`` (noted) when no model and dataset is in both tables."""
    p_models, t_models = set(plast["model"]), set(accuracy["model"])
    if not p_models & t_models:
        if len(p_models) != 1 or len(t_models) != 1:
            notes.append("Ranking agreement omitted: no model appears in both plasticity.parquet and trials.parquet.")
            return None
        notes.append(f"Ranking agreement: plasticity model {next(iter(p_models))!r} and finetuned model "
                     f"{next(iter(t_models))!r} differ in name; matched by dataset.")
        plast = plast.assign(model=next(iter(t_models)))
    shared = set(zip(plast["model"], plast["dataset"])) & set(zip(accuracy["model"], accuracy["dataset"]))
    if not shared:
        notes.append("Ranking agreement omitted: no dataset appears in both plasticity.parquet and trials.parquet.")
        return None
    missing = sorted({d for m, d in zip(accuracy["model"], accuracy["dataset"]) if (m, d) not in shared})
    if missing:
        notes.append(f"Ranking agreement: no plasticity measured for dataset(s) {missing}.")
    return plast


def _undefined_notes(rows: list[dict], notes: list[str]) -> None:
    """Say why a ranking row's correlations are undefined ('–'): too few components, or a constant ranking."""
    few = sorted({r["n_components"] for r in rows if r["n_components"] < 3})
    if few:
        notes.append(f"Ranking agreement: Spearman and Kendall need at least 3 components; rows with "
                     f"{' or '.join(map(str, few))} of them show '–'.")
    if any(r["n_components"] >= 3 and np.isnan(r["spearman"]) for r in rows):
        notes.append("Ranking agreement: '–' in rows with 3 or more components: the plasticities or the "
                     "accuracies are all equal there (a constant ranking has no correlation).")


def _ranking_rows(pm: pd.DataFrame, bo: pd.DataFrame, **keys) -> list[dict]:
    """Rows of one model, mode and optimizer: each shared dataset, then the mean over them (``overall``)."""
    datasets = sorted(set(pm["dataset"]) & set(bo["dataset"]))
    rows = []
    for ds in datasets:
        p = pm[pm["dataset"] == ds].set_index("component")["plasticity"]
        a = bo[bo["dataset"] == ds].set_index("component")["mean"]
        rows.append(dict(keys, dataset=ds, **_correlate(p, a)))
    if datasets:
        p = pm[pm["dataset"].isin(datasets)].groupby("component")["plasticity"].mean()
        a = bo[bo["dataset"].isin(datasets)].groupby("component")["mean"].mean()
        rows.append(dict(keys, dataset=OVERALL, **_correlate(p, a)))
    return rows


def ranking_table(plasticity: pd.DataFrame, best_lr: pd.DataFrame, counted: pd.DataFrame,
                  notes: list[str] | None = None) -> pd.DataFrame | None:
    """Agreement between each dataset's plasticity ranking and its accuracy ranking of the five components.

    Plasticity of a component on a dataset: mean over layers of ``plasticity`` (per model and mode).
    Accuracy: the best-lr mean accuracy of the configuration that trains that component (per optimizer).
    For every dataset x optimizer x mode, ``scipy.stats.spearmanr`` (p-value: exact permutation test,
    :func:`spearman_p_value`) and ``scipy.stats.kendalltau`` (tau-b, exact p-value for small samples without
    ties) over the components both tables have, values within :data:`raystudy.analysis.ranks.TIE_RTOL` tied
    (:mod:`raystudy.analysis.ranks`) (NaN below 3 components or for a constant ranking). Rows
    with ``dataset == "overall"`` correlate the mean over the shared datasets of both quantities. Plasticity
    and trials are matched on model and dataset; when their model names differ and each table holds one
    model, on dataset alone (noted). ``None`` when no dataset is in both tables.
    """
    notes = notes if notes is not None else []
    b = _with_model(best_lr, counted)
    # Only the five one-component configurations have a plasticity to compare with.
    b = b[b["configuration"].isin(COMPONENTS)].rename(columns={"configuration": "component"})
    if b.empty:
        notes.append(f"Ranking agreement omitted: no trial trains one of the five components alone "
                     f"({', '.join(COMPONENTS)}), the configurations plasticity ranks.")
        return None
    plast = plasticity.groupby(["model", "dataset", "mode", "component"], sort=False)["plasticity"].mean()
    plast = _match_models(plast.reset_index(), b, notes)
    if plast is None:
        return None
    rows = []
    for (model, mode), pm in plast.groupby(["model", "mode"], sort=True):
        for opt, bo in b[b["model"] == model].groupby("optimizer", sort=True):
            rows += _ranking_rows(pm, bo, model=model, optimizer=opt, mode=mode)
    if not rows:
        return None
    _undefined_notes(rows, notes)
    cols = ["dataset", "optimizer", "mode", "spearman", "spearman_p", "kendall", "kendall_p", "n_components",
            "plasticity_ranking", "accuracy_ranking"]
    return finish(pd.DataFrame(rows), cols, n_models(counted))
