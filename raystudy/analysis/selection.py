"""Plasticity against the field's selection criteria at matched budgets: accuracy, cost, tests and overlap.

A budgeted configuration ``<criterion>:B`` (``auto:5%``: plasticity, the paper's criterion; ``random:5%``: its
seeded control; ``rgn``, ``grad``, ``taylor``, ``fisher``, ``magnitude``: :data:`raystudy.vocab.CRITERIA`) packs
the (component, block) units of the criterion's order into the budget ``B``; ``<criterion>:B:weights`` selects
single weights (a mask) instead. Two tables and a figure compare the criteria at one budget and granularity:

* ``criteria`` (:func:`criteria_table`): per (model,) optimizer, granularity, budget, criterion and dataset (or
  VTAB-1k task) the accuracy ``mean`` and ``std`` over seeds, taken as the study's other tables take it
  (:func:`cell_accuracies`); ``overall`` rows: ``mean = mean_d acc_d``, ``std = std_d acc_d`` over the
  datasets the criterion ran, and the Wilcoxon signed-rank test of ``auto`` against the criterion, paired by
  dataset, Holm-corrected across the criteria of the budget (:func:`holm`). The criteria's scoring cost
  (``selection_seconds``, ``selection_flops``) when ``trials.parquet`` records it.
* ``criteria_overlap`` (:func:`overlap_table`): the Jaccard index ``|A ∩ B| / |A ∪ B|`` of two criteria's
  selections (units; mask entries at the weights granularity), averaged over seed pairs per dataset, then
  over datasets (``overall``).
* the units figure (:mod:`raystudy.analysis.selection_figures`): how often over seeds each criterion chose
  each unit, per dataset (:func:`unit_frequency`).

A trial's units are its row's ``selection`` column where present, else ``units`` (the canonical combination
the run trained, ``FC1@2+MHA@0-1``, parsed by :func:`raystudy.core.expressions.parse`); its mask is the
safetensors file ``selection_mask`` names (relative to its study directory: ``{parameter: bool tensor}``).
Accuracies are fractions, spreads population standard deviations (ddof 0) as everywhere in the analysis.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pandas as pd

from raystudy.analysis import vtab as V
from raystudy.analysis.render import (
    LR_RULES,
    PHASE_TEXT,
    STD_NOTE,
    Block,
    Rendered,
    fmt_count,
    fmt_duration,
    fmt_num,
    fmt_p,
    pct,
    pm,
)
from raystudy.analysis.stats import signed_rank_test, smallest_p_note, smallest_wilcoxon_p, statistic_note
from raystudy.analysis.tables import OVERALL, _with_model, phase_rows, population_std
from raystudy.core.expressions import Budgeted, ExpressionError, parse
from raystudy.vocab import COMPONENTS, CRITERIA

#: The tables of this module, in report order.
TABLES = ("criteria", "criteria_overlap")
#: The report section (and the title of its tables' group) shown when a study has criterion budgets.
SECTION_TITLE = "Selection criteria at matched budgets"
#: The criteria in the order the tables list them: plasticity, its random control, the field's criteria.
CRITERION_ORDER: tuple[str, ...] = ("auto", "random") + CRITERIA
#: The reference of the tests: plasticity (``auto:B``).
REFERENCE = "auto"
#: the reference of a granularity without ``auto`` (single weights: plasticity scores no entry)
CONTROL = "random"
#: The granularities of a budget: (component, block) units, or single weights (``:weights``).
GRANULARITIES: tuple[str, ...] = ("units", "weights")
WEIGHTS_SUFFIX = ":weights"
#: The tests are two-sided: no criterion is the favourite.
ALTERNATIVE = "two-sided"
#: Columns of ``trials.parquet`` holding a trial's scoring cost, when recorded (mean per dataset and cell).
COST_COLUMNS: tuple[str, ...] = ("selection_seconds", "selection_flops")
#: Columns holding a trial's chosen units, the first present and non-null one read.
SELECTION_COLUMNS: tuple[str, ...] = ("selection", "units")
MASK_COLUMN = "selection_mask"
GROUP = ["model", "optimizer", "granularity", "budget"]

Unit = tuple[str, int]


def budget_of(configuration) -> tuple[str, str, str] | None:
    """``(criterion, budget, granularity)`` of a budgeted configuration: ``"fisher:1%"`` -> ``("fisher", "1%",
    "units")``, ``"fisher:0.1%:weights"`` -> ``("fisher", "0.1%", "weights")``; ``None`` for anything else."""
    text, granularity = str(configuration), GRANULARITIES[0]
    if text.endswith(WEIGHTS_SUFFIX):
        text, granularity = text[:-len(WEIGHTS_SUFFIX)], GRANULARITIES[1]
    try:
        tree = parse(text)
    except ExpressionError:
        try:  # a grammar that spells the granularity itself
            tree = parse(str(configuration))
        except ExpressionError:
            return None
    if not isinstance(tree, Budgeted):
        return None
    granularity = getattr(tree, "granularity", None) or granularity
    return tree.strategy, str(tree.budget), str(granularity)


def has_criteria(counted: pd.DataFrame | None) -> bool:
    """Whether any counted trial trains a criterion's budget (``rgn:B``, ``fisher:B:weights``, ...)."""
    if counted is None or not len(counted):
        return False
    keys = (budget_of(c) for c in counted["configuration"].dropna().unique())
    return any(k is not None and k[0] in CRITERIA for k in keys)


def selection_units(text) -> frozenset[Unit] | None:
    """The (component, block) units of a canonical combination: ``"FC1@2+MHA@0-1"`` -> ``{("MHA", 0),
    ("MHA", 1), ("FC1", 2)}``; ``None`` for a missing value, a non-combination or a term without blocks."""
    if text is None or (isinstance(text, float) and np.isnan(text)):
        return None
    try:
        tree = parse(str(text)).normalised()
    except (ExpressionError, AttributeError):
        return None
    units = set()
    for term in tree.terms:
        if term.name not in COMPONENTS or term.blocks is None:
            return None
        units |= {(term.name, int(b)) for b in term.blocks}
    return frozenset(units)


def _budget_sort(budget: str) -> tuple:
    """Budgets in increasing size: percentages first, then counts."""
    b = parse(f"auto:{budget}").budget
    return (b.unit != "%", float(b.amount))


def _sorted(df: pd.DataFrame, pairs: tuple[str, ...] = ("criterion",)) -> pd.DataFrame:
    """Rows by model, optimizer, granularity, budget (by size), criterion order, dataset (``overall`` last)."""
    key = {"granularity": GRANULARITIES.index, "budget": _budget_sort,
           "dataset": lambda v: (v == OVERALL, str(v)), **{p: CRITERION_ORDER.index for p in pairs}}
    cols = [c for c in ("model", "optimizer", "granularity", "budget", *pairs, "dataset") if c in df.columns]
    tmp = pd.DataFrame({c: df[c].map(key.get(c, str)) for c in cols}, index=df.index)
    return df.loc[tmp.sort_values(cols, kind="stable").index].reset_index(drop=True)


def with_budgets(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``df`` that train a budget, with columns ``criterion``, ``budget``, ``granularity``."""
    keys = df["configuration"].map(budget_of)
    keep = keys.notna()
    out = df[keep].copy()
    out[["criterion", "budget", "granularity"]] = pd.DataFrame(keys[keep].tolist(), index=out.index,
                                                               columns=["criterion", "budget", "granularity"])
    return out


# --------------------------------------------------------------------------------------------------
# The matched-budget table
# --------------------------------------------------------------------------------------------------


def cell_accuracies(best_lr: pd.DataFrame, counted: pd.DataFrame, probes, final, rules: tuple[str, str],
                    ) -> tuple[pd.DataFrame, str]:
    """``(per-dataset accuracies, lr_rule)`` as the study's other tables take them: a study with a final fit
    from its final rows (:func:`raystudy.analysis.vtab.task_accuracies`, lr_rule ``final``, as the headline and
    every table that reports an accuracy: :func:`raystudy.analysis.tables.reported_accuracies`); a VTAB-1k
    study without one per task as its ``vtab`` table (the search trials at the lr of ``rules[1]``), any other
    study's from ``best_lr`` (``rules[0]``: the lr of the highest mean test accuracy over seeds by default; the
    TEST mean and std over seeds at that lr). Columns ``model, dataset, optimizer, configuration, mean, std,
    n_seeds, lr``."""
    if V.is_vtab(counted) or (final is not None and len(final)):
        per, rule = V.task_accuracies(counted, probes, final, rules[1], [])  # its notes: the vtab table's
        return per, rule
    return _with_model(best_lr, counted), rules[0]


def _costs(counted: pd.DataFrame) -> pd.DataFrame | None:
    """Per (model, dataset, configuration): the mean over its counted trials of each recorded cost column."""
    cols = [c for c in COST_COLUMNS
            if c in counted.columns and pd.to_numeric(counted[c], errors="coerce").notna().any()]
    if not cols:
        return None
    c = counted.assign(**{k: pd.to_numeric(counted[k], errors="coerce") for k in cols})
    return c.groupby(["model", "dataset", "configuration"], sort=False)[cols].mean().reset_index()


def holm(p_values) -> np.ndarray:
    """Holm's step-down adjusted p-values: with the ``m`` finite p-values sorted, ``p_(1) <= ... <= p_(m)``,
    ``adj_(i) = max_{j <= i} min(1, (m - j + 1) p_(j))``; NaN stays NaN (not counted in ``m``)."""
    p = np.asarray(p_values, dtype=float)
    out = np.full(p.shape, np.nan)
    finite = np.flatnonzero(np.isfinite(p))
    order = finite[np.argsort(p[finite], kind="stable")]
    m = len(order)
    running = 0.0
    for j, i in enumerate(order):
        running = max(running, min(1.0, (m - j) * p[i]))
        out[i] = running
    return out


def _overall(rows: pd.DataFrame, costs: list[str]) -> pd.DataFrame:
    """Per (group, criterion): mean and std (ddof 0) over datasets of the per-dataset means, the fewest seeds,
    the number of datasets, the mean of each cost over datasets."""
    g = rows.groupby(GROUP + ["criterion", "configuration"], sort=False)
    out = g["mean"].agg(mean="mean", std=population_std, n_datasets="count").join(g["n_seeds"].min())
    if costs:
        out = out.join(g[costs].mean())
    return out.reset_index().assign(dataset=OVERALL)


def _tests(rows: pd.DataFrame) -> pd.DataFrame:
    """Per group: ``auto`` against every other criterion, ``scipy.stats.wilcoxon`` over the shared datasets
    (:func:`~raystudy.analysis.stats.signed_rank_test`), then :func:`holm` over the group's p-values. A group
    without ``auto`` (the weights granularity: plasticity scores no entry) tests against ``random``, the
    control, instead; column ``reference`` says which."""
    out = []
    for _, g in rows.groupby(GROUP, sort=False):
        acc = {c: r.set_index("dataset")["mean"] for c, r in g.groupby("criterion", sort=False)}
        ref = next((c for c in (REFERENCE, CONTROL) if c in acc), None)
        if ref is None:
            continue
        tests = []
        for other in (c for c in CRITERION_ORDER if c in acc and c != ref):
            stat, p, n = signed_rank_test(acc[ref], acc[other], ALTERNATIVE)
            tests.append(dict(zip(GROUP, g.iloc[0][GROUP]), criterion=other, reference=ref, statistic=stat,
                              p_value=p, n_pairs=n))
        adjusted = holm([t["p_value"] for t in tests])
        out += [dict(t, p_holm=a) for t, a in zip(tests, adjusted)]
    return pd.DataFrame(out, columns=GROUP + ["criterion", "reference", "statistic", "p_value", "n_pairs",
                                              "p_holm"])


def criteria_table(per: pd.DataFrame, counted: pd.DataFrame, lr_rule: str) -> pd.DataFrame:
    """The matched-budget table of the criteria (see the module docstring).

    ``per``: :func:`cell_accuracies`. Dataset rows: ``mean``, ``std``, ``n_seeds``, ``lr`` of the cell; the
    cost columns (:data:`COST_COLUMNS`, when recorded) the mean over the cell's counted trials. ``overall``
    rows: :func:`_overall`, and for every criterion but ``auto`` the test against ``auto`` (``statistic``,
    ``p_value``, ``n_pairs``: the datasets both ran; ``p_holm``: :func:`holm` over the budget's criteria).
    Columns ``[model,] optimizer, granularity, budget, criterion, configuration, dataset, mean, std, n_seeds,
    n_datasets, lr, [costs,] statistic, p_value, p_holm, n_pairs, lr_rule``.
    """
    rows = with_budgets(per)
    costs = _costs(with_budgets(counted))
    cost_cols = [c for c in COST_COLUMNS if costs is not None and c in costs.columns]
    if costs is not None:
        rows = rows.merge(costs, on=["model", "dataset", "configuration"], how="left")
    rows = rows.assign(n_datasets=1)
    overall = _overall(rows, cost_cols).merge(_tests(rows), on=GROUP + ["criterion"], how="left")
    out = _sorted(pd.concat([rows, overall], ignore_index=True)).assign(lr_rule=lr_rule)
    for c in ("reference", "statistic", "p_value", "p_holm", "n_pairs"):
        out[c] = out[c] if c in out.columns else np.nan
    cols = ["optimizer", "granularity", "budget", "criterion", "configuration", "dataset", "mean", "std", "n_seeds",
            "n_datasets", "lr", *cost_cols, "reference", "statistic", "p_value", "p_holm", "n_pairs", "lr_rule"]
    return out[(["model"] if out["model"].nunique() > 1 else []) + cols]


# --------------------------------------------------------------------------------------------------
# What each criterion chose: per seed, overlap, frequency
# --------------------------------------------------------------------------------------------------


def _study_of(counted: pd.DataFrame, study_dir: str) -> pd.Series:
    """Each row's study directory: column ``study`` (several studies analysed together), else ``study_dir``."""
    if "study" in counted.columns:
        return counted["study"].fillna(study_dir).astype(str)
    return pd.Series(study_dir, index=counted.index)


def _chosen_units(counted: pd.DataFrame) -> pd.Series:
    """Each row's units (:func:`selection_units`) from the first of :data:`SELECTION_COLUMNS` that has them."""
    out = pd.Series([None] * len(counted), index=counted.index, dtype=object)
    for col in (c for c in SELECTION_COLUMNS if c in counted.columns):
        parsed = counted[col].map(selection_units)
        out = out.where(out.notna(), parsed)
    return out


def seed_selections(counted: pd.DataFrame, study_dir: str = ".", notes: list[str] | None = None) -> pd.DataFrame:
    """One row per (model, dataset, granularity, budget, criterion, seed): what its trials chose, ``units``
    (a frozenset, or None) and ``mask`` (the absolute path of its safetensors mask, or None). Learning rates
    and optimizers do not change a selection; where two of one key's trials disagree, the most frequent choice
    is kept (ties: the first trial's) and ``notes`` says so."""
    notes = notes if notes is not None else []
    b = with_budgets(counted)
    b = b.assign(units=_chosen_units(b), mask=None)
    if MASK_COLUMN in b.columns:
        where = _study_of(b, study_dir)
        b["mask"] = [str(Path(s) / m) if isinstance(m, str) and m else None for s, m in zip(where, b[MASK_COLUMN])]
    keys = ["model", "dataset", "granularity", "budget", "criterion", "seed"]
    rows = []
    for key, g in b.groupby(keys, sort=True):
        picks = list(zip(g["units"], g["mask"]))
        if len(set(picks)) > 1:
            notes.append(f"Selections: the trials of {g['configuration'].iloc[0]} on {key[1]}, seed {key[5]}, chose "
                         "differently across learning rates or optimizers; the most frequent choice is kept.")
        units, mask = max(picks, key=lambda p: (picks.count(p), -picks.index(p)))
        rows.append(dict(zip(keys, key), units=units, mask=mask))
    return pd.DataFrame(rows, columns=keys + ["units", "mask"])


def jaccard(a: frozenset, b: frozenset) -> float:
    """``|A ∩ B| / |A ∪ B|`` of two sets (NaN when both are empty)."""
    union = len(a | b)
    return len(a & b) / union if union else float("nan")


def mask_jaccard(a: dict, b: dict) -> float:
    """Jaccard of two masks ``{parameter: bool array}`` over their entries: ``sum |A ∧ B| / sum |A ∨ B|``; a
    parameter one mask lacks counts as all False there."""
    inter = union = 0
    for name in set(a) | set(b):
        x = np.asarray(a[name], bool) if name in a else np.zeros_like(np.asarray(b[name], bool))
        y = np.asarray(b[name], bool) if name in b else np.zeros_like(x)
        inter += int(np.logical_and(x, y).sum())
        union += int(np.logical_or(x, y).sum())
    return inter / union if union else float("nan")


def _load_mask(path: str, cache: dict) -> dict | None:
    if path not in cache:
        from safetensors.numpy import load_file  # read only for weights-granularity studies
        cache[path] = load_file(path) if Path(path).is_file() else None
    return cache[path]


def _pair_value(x: pd.Series, y: pd.Series, granularity: str, cache: dict) -> float:
    if granularity == GRANULARITIES[1]:
        a, b = (_load_mask(r["mask"], cache) if r["mask"] else None for r in (x, y))
        return mask_jaccard(a, b) if a is not None and b is not None else float("nan")
    return jaccard(x["units"], y["units"]) if x["units"] is not None and y["units"] is not None else float("nan")


def _overlap_rows(chosen: pd.DataFrame) -> list[dict]:
    """Per (model, granularity, budget, dataset) and pair of criteria: the mean Jaccard over every pair of
    their seeds (``n_pairs`` pairs with a value)."""
    rows, cache = [], {}
    for (model, gran, budget, ds), g in chosen.groupby(["model", "granularity", "budget", "dataset"], sort=False):
        present = [c for c in CRITERION_ORDER if c in set(g["criterion"])]
        for first, second in itertools.combinations(present, 2):
            xs, ys = (g[g["criterion"] == c] for c in (first, second))
            values = [_pair_value(x, y, gran, cache) for (_, x), (_, y) in itertools.product(xs.iterrows(),
                                                                                             ys.iterrows())]
            values = [v for v in values if np.isfinite(v)]
            if values:
                rows.append(dict(model=model, granularity=gran, budget=budget, first=first, second=second,
                                 dataset=ds, jaccard=float(np.mean(values)), n_pairs=len(values)))
    return rows


def overlap_table(chosen: pd.DataFrame) -> pd.DataFrame | None:
    """Jaccard overlap of every two criteria's selections at one budget and granularity.

    ``chosen``: :func:`seed_selections`. Per dataset: ``jaccard = mean_{s, s'} J(A_s, B_s')`` over every seed
    ``s`` of the first criterion and ``s'`` of the second (a deterministic criterion chooses alike at every
    seed; ``random`` does not), ``n_pairs`` such pairs; units: :func:`jaccard` of the unit sets; weights:
    :func:`mask_jaccard` of the masks. ``overall``: ``jaccard`` the mean over the datasets, ``jaccard_std``
    their std (ddof 0), ``n_datasets``. Columns ``[model,] granularity, budget, first, second, dataset,
    jaccard, jaccard_std, n_pairs, n_datasets``; ``None`` without two criteria at one budget.
    """
    rows = pd.DataFrame(_overlap_rows(chosen))
    if rows.empty:
        return None
    rows = rows.assign(jaccard_std=0.0, n_datasets=1)
    g = rows.groupby(["model", "granularity", "budget", "first", "second"], sort=False)
    overall = g["jaccard"].agg(jaccard="mean", jaccard_std=population_std, n_datasets="count")
    overall = overall.join(g["n_pairs"].sum()).reset_index().assign(dataset=OVERALL)
    out = _sorted(pd.concat([rows, overall], ignore_index=True), ("first", "second"))
    cols = ["granularity", "budget", "first", "second", "dataset", "jaccard", "jaccard_std", "n_pairs", "n_datasets"]
    return out[(["model"] if out["model"].nunique() > 1 else []) + cols]


def unit_frequency(chosen: pd.DataFrame, depth: int | None = None) -> pd.DataFrame:
    """How often each criterion chose each unit, per (model, budget, dataset), at the units granularity.

    ``chosen``: :func:`seed_selections`. ``count`` = the seeds whose units contain (component, block),
    ``n_seeds`` = the seeds with units, ``frequency = count / n_seeds``; every unit of ``depth`` blocks
    (default: the model's deepest block chosen, plus one) times :data:`~raystudy.vocab.COMPONENTS`. Columns
    ``model, budget, dataset, criterion, block, component, count, n_seeds, frequency``.
    """
    u = chosen[(chosen["granularity"] == GRANULARITIES[0]) & chosen["units"].notna()]
    cols = ["model", "budget", "dataset", "criterion", "block", "component", "count", "n_seeds", "frequency"]
    if u.empty:
        return pd.DataFrame(columns=cols)
    deepest = {m: 1 + max(b for units in g["units"] for _, b in units) for m, g in u.groupby("model")}
    rows = []
    for (model, budget, ds, crit), g in u.groupby(["model", "budget", "dataset", "criterion"], sort=False):
        n = len(g)
        for block, comp in itertools.product(range(depth or deepest[model]), COMPONENTS):
            k = sum((comp, block) in units for units in g["units"])
            rows.append(dict(model=model, budget=budget, dataset=ds, criterion=crit, block=block, component=comp,
                             count=k, n_seeds=n, frequency=k / n))
    return _sorted(pd.DataFrame(rows, columns=cols))


# --------------------------------------------------------------------------------------------------
# The tables of a study, rendered
# --------------------------------------------------------------------------------------------------


def study_root(inputs) -> str:
    """The directory a one-study analysis reads (a mask path is relative to it; several studies: column
    ``study`` names each row's)."""
    return inputs.study_dirs[0] if inputs.study_dirs else inputs.study_dir


def selection_tables(best_lr: pd.DataFrame, inputs, rules: tuple[str, str], notes: list[str]) -> dict:
    """``criteria`` and ``criteria_overlap`` of a study with criterion budgets (:func:`has_criteria`);
    ``rules``: the lr rules of the paper's tables and of VTAB-1k's (:func:`cell_accuracies`)."""
    per, rule = cell_accuracies(best_lr, inputs.counted, inputs.probes, inputs.final, rules)
    counted = phase_rows(inputs.final, inputs.counted)  # the final fit scores its selections on train + val
    tables = {"criteria": criteria_table(per, counted, rule)}
    if not any(c in counted.columns for c in COST_COLUMNS):
        notes.append("Selection criteria: trials.parquet records no scoring cost (selection_seconds, "
                     "selection_flops); the criteria table shows accuracy alone.")
    chosen = seed_selections(counted, study_root(inputs), notes)
    weights = chosen["granularity"] == GRANULARITIES[1]
    if weights.any() and chosen.loc[weights, "mask"].isna().all():
        notes.append("Selection criteria: no selection_mask recorded for the weights-granularity trials; their "
                     "overlap is omitted.")
    units = chosen["granularity"] == GRANULARITIES[0]
    if units.any() and chosen.loc[units, "units"].isna().all():
        notes.append("Selection criteria: trials.parquet records no chosen units (column units or selection); the "
                     "overlap table and the units figure are omitted.")
    overlap = overlap_table(chosen)
    if overlap is not None:
        tables["criteria_overlap"] = overlap
    return tables


def phase_text(lr_rule: str) -> str:
    """Where the criteria table's accuracies come from, by its ``lr_rule``: the final fit, or the lr search at
    the lr of a rule (:data:`~raystudy.analysis.render.PHASE_TEXT`, :data:`~raystudy.analysis.render.LR_RULES`)."""
    if lr_rule == V.FINAL:
        return PHASE_TEXT[V.FINAL]
    return f"the lr search (the grid's trials, trained on train; test accuracy at the lr with {LR_RULES[lr_rule]})"


def _against(g: pd.DataFrame, criterion: str, ref: str) -> str:
    """``magnitude 71.3 (auto − magnitude +3.9 points, p 0.250, Holm p 1.000)`` of one overall row."""
    r = g.loc[criterion]
    return (f"{criterion} {pct(r['mean'])} ({ref} − {criterion} {100 * (g.loc[ref, 'mean'] - r['mean']):+.1f} points, "
            f"p {fmt_p(r['p_value'])}, Holm p {fmt_p(r['p_holm'])})")


def _verdict(differ: list[str], ref: str, n: int, alpha: float) -> str:
    """Which criteria differ from ``ref`` at ``alpha`` after Holm; none: and why, when ``n`` pairs cannot."""
    if differ:
        return f"{', '.join(differ)} differ(s) from {ref} at {alpha:g} after Holm"
    low = smallest_wilcoxon_p(n, ALTERNATIVE)
    return f"no criterion differs from {ref} at {alpha:g} after Holm" + (
        f" (the smallest {ALTERNATIVE} p-value {n} pairs allow is {low:.3g})" if not low < alpha else "")


def criteria_headlines(t: pd.DataFrame | None, alpha: float = 0.05) -> list[str]:
    """The selection study's answer, one line per (model,) optimizer, granularity and budget of the ``criteria``
    table (:func:`criteria_table`): the reference's accuracy (``auto``; ``random`` at the weights granularity),
    then every other criterion's with the difference, the Wilcoxon p-value and the Holm-corrected one, as the
    section tests them (over datasets, :data:`ALTERNATIVE`), the phase, and which criteria differ at ``alpha``
    after Holm (none: the smallest p-value the pairs allow, when that is the reason)."""
    if t is None or not len(t):
        return []
    o = t[t["dataset"] == OVERALL]
    keys = [k for k in ("model", "optimizer", "granularity", "budget") if k in o.columns]
    lines = []
    for vals, g in o.groupby(keys, sort=False):
        g = g.set_index("criterion")
        refs = g["reference"].dropna()
        if refs.empty:
            continue
        ref = refs.iloc[0]
        others = [c for c in CRITERION_ORDER if c in g.index and c != ref]
        n = int(pd.to_numeric(g["n_pairs"]).max())
        verdict = _verdict([c for c in others if g.loc[c, "p_holm"] < alpha], ref, n, alpha)
        what = "plasticity" if ref == REFERENCE else "the control: plasticity scores no single weight"
        lines.append(f"Selection criteria, {' · '.join(map(str, vals))}: {ref} ({what}) {pct(g.loc[ref, 'mean'])} "
                     f"against {'; '.join(_against(g, c, ref) for c in others)}: Wilcoxon signed-rank, "
                     f"{ALTERNATIVE}, paired over {n} datasets, Holm over the {len(others)} criteria; accuracy (%) "
                     f"mean over datasets from {phase_text(t['lr_rule'].iloc[0])}; {verdict}.")
    return lines


def _cost_cell(r: pd.Series) -> str:
    parts = []
    if pd.notna(r.get("selection_seconds", np.nan)):
        parts.append(fmt_duration(r["selection_seconds"]))
    if pd.notna(r.get("selection_flops", np.nan)):
        parts.append(f"{float(r['selection_flops']):.2e} FLOPs")
    return ", ".join(parts) or "–"


def _criteria_block(heading: str, g: pd.DataFrame, cost: bool) -> Block:
    """Rows: the criteria; columns: each dataset's mean ± std over seeds, the overall mean ± std over
    datasets, the cost, the test against auto (raw and Holm p-values, pairs)."""
    datasets = [d for d in dict.fromkeys(g["dataset"]) if d != OVERALL]
    crits = [c for c in CRITERION_ORDER if c in set(g["criterion"])]
    refs = g["reference"].dropna() if "reference" in g.columns else pd.Series(dtype=object)
    cols = ["criterion", *datasets, "mean over datasets", *(["selection cost"] if cost else []),
            f"p vs {refs.iloc[0] if len(refs) else REFERENCE}", "p (Holm)", "pairs"]
    rows, values = [], pd.DataFrame(index=crits, columns=[*datasets, OVERALL], dtype=float)
    for c in crits:
        cell = g[g["criterion"] == c].set_index("dataset")
        o = cell.loc[OVERALL]
        values.loc[c] = [cell["mean"].get(d, np.nan) for d in [*datasets, OVERALL]]
        rows.append([c + (" (plasticity)" if c == REFERENCE else ""),
                     *(pm(cell.loc[d, "mean"], cell.loc[d, "std"]) if d in cell.index else "" for d in datasets),
                     pm(o["mean"], o["std"]), *([_cost_cell(o)] if cost else []), fmt_p(o["p_value"]),
                     fmt_p(o["p_holm"]), "" if pd.isna(o["n_pairs"]) else str(int(o["n_pairs"]))])
    return Block(heading, cols, rows, V._bold_best(rows, values, 1))


def render_criteria(t: pd.DataFrame) -> Rendered:
    cost = any(c in t.columns for c in COST_COLUMNS)
    keys = [k for k in ("model", "optimizer", "granularity", "budget") if k in t.columns]
    blocks = [_criteria_block(" · ".join(f"{k}: {v}" for k, v in zip(keys, vals)), g, cost)
              for vals, g in t.groupby(keys, sort=False)]
    rule = V.lr_rule_text(t["lr_rule"].iloc[0]) if t["lr_rule"].iloc[0] == V.FINAL else \
        f"test accuracy at the lr with {LR_RULES[t['lr_rule'].iloc[0]]}"
    return Rendered("criteria", "Plasticity against the selection criteria at matched budgets",
                    "Per budget and granularity, each criterion's accuracy (%) per dataset (mean ± std over "
                    f"seeds; {rule}) and over datasets (mean ± std over datasets); auto: units by plasticity, "
                    "random: a seeded random order, rgn/grad/taylor/fisher/magnitude: the field's criteria. "
                    f"p vs auto: scipy.stats.wilcoxon of auto against the criterion, {ALTERNATIVE}, paired over "
                    "datasets (per-dataset means); at the weights granularity, where plasticity scores no entry, p vs "
                    "random (the control) instead; p (Holm): Holm-corrected across the budget's criteria.", blocks,
                    [STD_NOTE, f"{statistic_note(ALTERNATIVE, 'reference − criterion')}; '–' without pairs or "
                     "when every difference is zero.", smallest_p_note(ALTERNATIVE, t["n_pairs"].dropna()),
                     "Bold: the highest accuracy of each column."]
                    + (["Selection cost: the criterion's scoring pass before training (wall time, FLOPs), the mean "
                        "over the trials that recorded it per dataset, then over datasets."] if cost else []))


def render_criteria_overlap(t: pd.DataFrame) -> Rendered:
    o = t[t["dataset"] == OVERALL]
    keys = [k for k in ("model", "granularity", "budget") if k in o.columns]
    blocks = []
    for vals, g in o.groupby(keys, sort=False):
        crits = [c for c in CRITERION_ORDER if c in set(g["first"]) | set(g["second"])]
        value = {(r["first"], r["second"]): r for _, r in g.iterrows()}
        value |= {(b, a): r for (a, b), r in value.items()}
        rows = [[a, *(("–" if a == b else (fmt_num(value[(a, b)]["jaccard"], 2),
                                          f"± {fmt_num(value[(a, b)]['jaccard_std'], 2)}, "
                                          f"{fmt_count(value[(a, b)]['n_datasets'])} datasets"))
                      if a == b or (a, b) in value else "" for b in crits)] for a in crits]
        blocks.append(Block(" · ".join(f"{k}: {v}" for k, v in zip(keys, vals)), ["criterion", *crits], rows))
    return Rendered("criteria_overlap", "Overlap of the criteria's selections",
                    "Jaccard index |A ∩ B| / |A ∪ B| of two criteria's selections (units; mask entries at the "
                    "weights granularity), per dataset the mean over every pair of their seeds, then the mean ± "
                    "std over datasets; 1: the same selection, 0: disjoint.", blocks, [STD_NOTE])
