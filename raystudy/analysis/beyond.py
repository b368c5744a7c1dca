"""Tables and figures of studies beyond the paper's seven configurations (configuration expressions).

When a study trains configuration expressions (``MHA+FC1``, ``MHA@8-11``, ``auto:5%``, ``random:5%``,
``lora:r=8``, ``dora:r=8``, ``ia3``, ``bias``: :mod:`raystudy.core.expressions`) three questions follow, one
table each:

* ``frontier``: best-lr accuracy against trainable parameters, per dataset and overall, with the Pareto
  frontier marked (:func:`pareto_mask`); drawn by :func:`plot_frontier`, one figure per dataset and one
  overall.
* ``matched_budget``: ``auto:B`` against ``random:B`` against every PEFT configuration (``lora:r=k``,
  ``dora:r=k``, ``loha``, ``lokr``, ``vera``, ``ia3``) and BitFit (``bias``) whose trainable-parameter count
  matches ``B``, paired Wilcoxon signed-rank tests over datasets (:func:`matched_budget_table`).
* ``unit_gain``: Spearman correlation of a (component, block) unit's plasticity with the accuracy gain of
  training that unit alone (configurations such as ``MHA@3``) over ``Head`` (or the linear probe ``LP``).

Accuracies are fractions, spreads population standard deviations (ddof 0) as everywhere in the analysis.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
from scipy import stats

from raystudy.analysis import figures as F
from raystudy.analysis.ranks import order_string, tied
from raystudy.analysis.render import STD_NOTE, Block, Rendered, fmt_count, fmt_lr, fmt_num, fmt_p, pct
from raystudy.analysis.stats import _match_models, signed_rank_test, smallest_p_note, spearman_p_value, statistic_note
from raystudy.analysis.tables import OVERALL, _with_model, finish, n_models, population_std, recorded_counts
from raystudy.core.expressions import BIAS, METHODS, Adapter, Budgeted, Combination, ExpressionError, parse
from raystudy.vocab import COMPONENTS, CRITERIA, LINEAR_PROBE, TRIALS_CONFIGURATIONS

#: The tables of this module, in report order.
TABLES = ("frontier", "matched_budget", "unit_gain")
#: A PEFT or BitFit configuration matches a budget when their trainable-parameter counts differ by at most
#: this factor.
DEFAULT_TOLERANCE = 1.5
#: The families that join a budget by their count (not by a ``B`` of their own), in comparison order after
#: ``auto`` and ``random``: the PEFT methods, then BitFit.
MATCHED_FAMILIES: tuple[str, ...] = tuple(METHODS) + (BIAS,)
#: The families of the matched-budget comparisons, in the order a pair names them: plasticity, its random
#: control, the selection criteria of the literature, the matched families.
BUDGET_FAMILIES: tuple[str, ...] = ("auto", "random") + CRITERIA + MATCHED_FAMILIES
#: The alternative of the matched-budget tests (no configuration is the favourite).
MATCHED_ALTERNATIVE = "two-sided"
KEYS = ["model", "dataset", "optimizer", "configuration"]


def family(configuration: str) -> str:
    """``auto``, ``random``, a criterion (``fisher``, ...), a PEFT method (``lora``, ``dora``, ``loha``, ``lokr``,
    ``vera``, ``ia3``), ``bias`` (BitFit: ``bias`` or ``bias@blocks`` alone), ``combination`` (any other
    expression) or the paper name itself."""
    if configuration in TRIALS_CONFIGURATIONS:
        return configuration
    try:
        tree = parse(configuration)
    except ExpressionError:
        return "combination"
    if isinstance(tree, Budgeted):
        return tree.strategy
    if isinstance(tree, Adapter):
        return tree.method
    terms = tree.normalised().terms
    return BIAS if len(terms) == 1 and terms[0].name == BIAS else "combination"


def has_expressions(counted: pd.DataFrame) -> bool:
    """Whether any counted trial trains a configuration outside the paper's names."""
    return bool(len(counted)) and not counted["configuration"].isin(TRIALS_CONFIGURATIONS).all()


# --------------------------------------------------------------------------------------------------
# Frontier
# --------------------------------------------------------------------------------------------------


def pareto_mask(params, acc) -> np.ndarray:
    """Points on the Pareto frontier of (fewer parameters, higher accuracy).

    Point ``i`` is dominated when some ``j`` has ``params[j] <= params[i]`` and ``acc[j] >= acc[i]`` with
    one of them strict; the frontier is every point not dominated (exact duplicates both stay). Sweep in
    increasing ``params``: among points of equal ``params`` only those with the group's largest accuracy
    can stay, and they stay when that accuracy beats every point with fewer parameters.
    """
    p, a = np.asarray(params, float), np.asarray(acc, float)
    mask = np.zeros(len(p), bool)
    best_below = -np.inf
    for value in np.unique(p):
        group = np.flatnonzero(p == value)
        top = a[group].max()
        if top > best_below:
            mask[group[a[group] == top]] = True
        best_below = max(best_below, top)
    return mask


def _params_at_best(best: pd.DataFrame, counted: pd.DataFrame) -> pd.DataFrame:
    """``best`` (best-lr rows, model column restored) with ``trainable_params``: the median over the
    configuration's counted trials at its best lr on that dataset (seeds of ``random:B`` may differ)."""
    c = counted.assign(trainable_params=recorded_counts(counted["trainable_params"]))
    med = c.groupby(KEYS + ["lr"], sort=False)["trainable_params"].median().reset_index()
    return best.merge(med, on=KEYS + ["lr"], how="left")


def _overall_points(per: pd.DataFrame, notes: list[str]) -> pd.DataFrame:
    """Per model, optimizer and configuration covering every dataset: the mean and std (ddof 0) over
    datasets of the best-lr accuracy, the median of the trainable parameters."""
    rows = []
    for (model, opt), g in per.groupby(["model", "optimizer"], sort=True):
        n = g["dataset"].nunique()
        cover = g.groupby("configuration")["dataset"].nunique()
        partial = sorted(cover[cover < n].index)
        if partial:
            notes.append(f"Overall frontier ({opt}): left out {partial}, not run on all {n} datasets.")
        full = g[g["configuration"].isin(cover[cover == n].index)].groupby("configuration", sort=False)
        o = full["mean"].agg(mean="mean", std=population_std).join(full["trainable_params"].median())
        rows.append(o.join(full["n_seeds"].min()).reset_index().assign(model=model, optimizer=opt, dataset=OVERALL))
    return pd.concat(rows, ignore_index=True) if rows else per.iloc[0:0]


def frontier_table(best_lr: pd.DataFrame, counted: pd.DataFrame, notes: list[str] | None = None) -> pd.DataFrame:
    """Best-lr accuracy and trainable parameters of every trained configuration, Pareto frontier marked.

    Per (model,) dataset and optimizer: each configuration's best-lr ``mean`` and ``std`` over seeds (the
    ``best_lr`` table; ``LP`` left out: not a finetuning run), ``trainable_params`` (median over its trials
    at that lr; head included) and ``on_frontier`` (:func:`pareto_mask` over the points with a count).
    ``dataset == "overall"`` rows: mean and std over datasets, median parameters, for the configurations
    run on every dataset. Columns ``dataset, optimizer, configuration, family, trainable_params, mean, std,
    lr, n_seeds, on_frontier``.
    """
    notes = notes if notes is not None else []
    best = _with_model(best_lr, counted)
    per = _params_at_best(best[best["configuration"] != LINEAR_PROBE], counted)
    out = pd.concat([per, _overall_points(per, notes)], ignore_index=True)
    out["on_frontier"] = False
    for _, g in out.groupby(["model", "dataset", "optimizer"], sort=False):
        g = g.dropna(subset=["trainable_params", "mean"])
        out.loc[g.index, "on_frontier"] = pareto_mask(g["trainable_params"], g["mean"])
    out["family"] = out["configuration"].map(family)
    cols = ["dataset", "optimizer", "configuration", "family", "trainable_params", "mean", "std", "lr", "n_seeds",
            "on_frontier"]
    return finish(out, cols, n_models(counted))


# --------------------------------------------------------------------------------------------------
# Matched budgets
# --------------------------------------------------------------------------------------------------


def _budget_reference(size: pd.Series, budget, realized: list[str]) -> float:
    """The trainable-parameter count a configuration is matched against at ``budget``: the cap itself,
    ``B`` in parameters plus the head (as ``trainable_params`` counts it), when the study ran ``All`` and
    ``Head`` (``B`` of a percentage is ``floor((All - Head) * B / 100)``); else the median count the budget's
    ``auto``/``random`` configurations reached. Units pack coarsely (a LayerNorm unit or a whole MHA), so a
    budget's selections may fall well short of the cap; a method is matched to the cap they all share."""
    if not {"All", "Head"} <= set(size.index) or not np.isfinite(size[["All", "Head"]]).all():
        return float(size[realized].median())
    head = float(size["Head"])
    return budget.parameters(int(size["All"] - head)) + head


def _budget_groups(per: pd.DataFrame, tolerance: float, notes: list[str]) -> dict[str, list[str]]:
    """``{budget: [auto:B, random:B, lora:r=k, ia3, bias, ...]}``: budgeted configurations by their budget
    ``B``; each configuration of :data:`MATCHED_FAMILIES` joins the budget whose reference count
    (:func:`_budget_reference`) is nearest (log ratio) when within ``tolerance``."""
    groups: dict[str, list[str]] = {}
    budgets = {}
    size = per.groupby("configuration")["trainable_params"].median()
    for c in sorted(size.index):
        tree = parse(c) if c not in TRIALS_CONFIGURATIONS else None
        if isinstance(tree, Budgeted):
            groups.setdefault(str(tree.budget), []).append(c)
            budgets[str(tree.budget)] = tree.budget
    ref = {b: _budget_reference(size, budgets[b], cs) for b, cs in groups.items()}
    for c in sorted(c for c in size.index if family(c) in MATCHED_FAMILIES):
        ratio = {b: abs(np.log(size[c] / r)) for b, r in ref.items() if np.isfinite(size[c]) and r > 0}
        b = min(ratio, key=ratio.get) if ratio else None
        if b is None or ratio[b] > np.log(tolerance):
            notes.append(f"Matched budgets: {c} ({fmt_count(size[c])} parameters) matches no budget within a "
                         f"factor {tolerance:g}.")
            continue
        groups[b].append(c)
    return groups


def _comparisons(configs: list[str]) -> list[tuple[str, str]]:
    """Every pair of configurations of different families, in :data:`BUDGET_FAMILIES` order (auto, random,
    rgn, grad, ..., lora, dora, ..., ia3, bias)."""
    cs = sorted(configs, key=lambda c: (BUDGET_FAMILIES.index(family(c)), c))
    return [(a, b) for i, a in enumerate(cs) for b in cs[i + 1:] if family(a) != family(b)]


def _compare(g: pd.DataFrame, a: str, b: str, alternative: str) -> dict:
    acc = {c: g[g["configuration"] == c].set_index("dataset")["mean"] for c in (a, b)}
    size = {c: g.loc[g["configuration"] == c, "trainable_params"].median() for c in (a, b)}
    shared = acc[a].index.intersection(acc[b].index)
    stat, p, n = signed_rank_test(acc[a], acc[b], alternative)
    return dict(first=a, second=b, params_first=size[a], params_second=size[b],
                mean_first=acc[a][shared].mean(), mean_second=acc[b][shared].mean(), statistic=stat,
                p_value=p, n_pairs=n)


def matched_budget_table(frontier: pd.DataFrame, *, tolerance: float = DEFAULT_TOLERANCE,
                         alternative: str = MATCHED_ALTERNATIVE, notes: list[str] | None = None) -> pd.DataFrame:
    """``auto:B`` vs ``random:B`` vs the PEFT methods and BitFit at matched budgets, paired Wilcoxon tests
    over datasets.

    From the per-dataset rows of :func:`frontier_table`: per (model,) optimizer and budget ``B`` (see
    :func:`_budget_groups`), every pair ``(first, second)`` of configurations of different families is
    tested with ``scipy.stats.wilcoxon(a_first, a_second, alternative)`` where ``a_c[d]`` is the best-lr
    mean accuracy on dataset ``d`` and the pairs are the datasets both ran (``n_pairs``; NaN statistic and
    p-value without pairs or when every difference is zero). ``mean_*``: mean over those datasets;
    ``params_*``: median trainable parameters over datasets. Columns ``optimizer, budget, first, second,
    params_first, params_second, mean_first, mean_second, statistic, p_value, n_pairs``.
    """
    notes = notes if notes is not None else []
    per = frontier[frontier["dataset"] != OVERALL]
    per = per if "model" in per.columns else per.assign(model="")
    rows = []
    for (model, opt), g in per.groupby(["model", "optimizer"], sort=True):
        for budget, configs in _budget_groups(g, tolerance, notes).items():
            rows += [dict(model=model, optimizer=opt, budget=budget, **_compare(g, a, b, alternative))
                     for a, b in _comparisons(configs)]
    cols = ["optimizer", "budget", "first", "second", "params_first", "params_second", "mean_first", "mean_second",
            "statistic", "p_value", "n_pairs"]
    out = pd.DataFrame(rows, columns=["model"] + cols)
    return finish(out, cols, int(per["model"].nunique()))


# --------------------------------------------------------------------------------------------------
# Plasticity against the gain of one unit
# --------------------------------------------------------------------------------------------------


def single_unit(configuration: str) -> tuple[str, int] | None:
    """``("MHA", 3)`` for ``MHA@3`` (one component in one block); ``None`` for anything else."""
    if configuration in TRIALS_CONFIGURATIONS:
        return None
    try:
        tree = parse(configuration)
    except ExpressionError:
        return None
    if not isinstance(tree, Combination):
        return None
    tree = tree.normalised()
    if len(tree.terms) != 1 or tree.terms[0].name not in COMPONENTS or len(tree.terms[0].blocks or ()) != 1:
        return None
    return tree.terms[0].name, tree.terms[0].blocks[0]


def unit_gains(best_lr: pd.DataFrame, counted: pd.DataFrame) -> pd.DataFrame:
    """Per (model, dataset, optimizer) and single-unit configuration: ``gain = mean - baseline_mean`` where
    the baseline is the best-lr mean of ``Head`` on that dataset, else of ``LP`` (``best_lr`` with probes).
    Columns ``model, dataset, optimizer, component, layer, gain, baseline``."""
    b = _with_model(best_lr, counted)
    units = b.assign(unit=b["configuration"].map(single_unit)).dropna(subset=["unit"])
    rows = []
    for (model, ds, opt), g in units.groupby(["model", "dataset", "optimizer"], sort=True):
        base = b[(b["model"] == model) & (b["dataset"] == ds) & (b["optimizer"] == opt)].set_index("configuration")
        name = "Head" if "Head" in base.index else LINEAR_PROBE if LINEAR_PROBE in base.index else None
        if name is None:
            continue
        rows += [dict(model=model, dataset=ds, optimizer=opt, component=r.unit[0], layer=r.unit[1],
                      gain=r.mean - base.loc[name, "mean"], baseline=name) for r in g.itertuples()]
    return pd.DataFrame(rows, columns=["model", "dataset", "optimizer", "component", "layer", "gain", "baseline"])


def _order_units(values: pd.Series) -> str:
    """``"MHA@3 > FC1@0 > ..."``: units by decreasing value."""
    return order_string(values, label=lambda unit: f"{unit[0]}@{unit[1]}")


def _unit_row(p: pd.Series, gain: pd.Series, **keys) -> dict:
    both = pd.concat([p.rename("p"), gain.rename("g")], axis=1, join="inner").dropna()
    row = dict(keys, spearman=np.nan, spearman_p=np.nan, n_units=len(both),
               plasticity_ranking=_order_units(both["p"]), gain_ranking=_order_units(both["g"]))
    p, g = tied(both["p"]), tied(both["g"])  # ties within TIE_RTOL count as ties, as the printed ranking shows
    if len(both) >= 3 and p.nunique() > 1 and g.nunique() > 1:
        row.update(spearman=float(stats.spearmanr(p, g).statistic), spearman_p=spearman_p_value(p, g))
    return row


def _unit_rows(pm: pd.DataFrame, gm: pd.DataFrame, **keys) -> list[dict]:
    """One row per dataset both tables have, then ``overall`` (means over those datasets per unit)."""
    datasets = sorted(set(pm["dataset"]) & set(gm["dataset"]))
    rows = []
    unit = ["component", "layer"]
    for ds in datasets:
        p = pm[pm["dataset"] == ds].set_index(unit)["plasticity"]
        g = gm[gm["dataset"] == ds].set_index(unit)["gain"]
        rows.append(_unit_row(p, g, **keys, dataset=ds, baseline=gm.loc[gm["dataset"] == ds, "baseline"].iloc[0]))
    if len(datasets) > 1:
        p = pm[pm["dataset"].isin(datasets)].groupby(unit)["plasticity"].mean()
        g = gm[gm["dataset"].isin(datasets)].groupby(unit)["gain"].mean()
        rows.append(_unit_row(p, g, **keys, dataset=OVERALL, baseline=", ".join(sorted(set(gm["baseline"])))))
    return rows


def unit_gain_table(plasticity: pd.DataFrame | None, best_lr: pd.DataFrame, counted: pd.DataFrame,
                    notes: list[str] | None = None) -> pd.DataFrame | None:
    """Spearman correlation of a unit's plasticity with the accuracy gain of training that unit alone.

    Units: the single-unit configurations (:func:`single_unit`); plasticity of unit (c, b): the
    ``plasticity`` of component ``c`` at layer ``b`` (per model, dataset and mode); gain:
    :func:`unit_gains`. Per dataset x optimizer x mode ``scipy.stats.spearmanr`` over the units both have
    (p-value: :func:`~raystudy.analysis.stats.spearman_p_value`; NaN below 3 units or for constant values),
    and an ``overall`` row on the means over datasets. ``None`` (noted) without single-unit configurations,
    plasticity or a baseline.
    """
    notes = notes if notes is not None else []
    gains = unit_gains(best_lr, counted)
    if plasticity is None or gains.empty:
        why = "no plasticity table" if plasticity is None else "no single-unit configuration (such as MHA@3) " \
            "with a Head or LP baseline"
        notes.append(f"Unit gain against plasticity omitted: {why}.")
        return None
    plast = plasticity.groupby(["model", "dataset", "mode", "component", "layer"])["plasticity"].mean()
    plast = _match_models(plast.reset_index(), gains, [])
    if plast is None:
        notes.append("Unit gain against plasticity omitted: no model and dataset in both tables.")
        return None
    rows = []
    for (model, mode), pm in plast.groupby(["model", "mode"], sort=True):
        for opt, gm in gains[gains["model"] == model].groupby("optimizer", sort=True):
            rows += _unit_rows(pm, gm, model=model, optimizer=opt, mode=mode)
    cols = ["dataset", "optimizer", "mode", "baseline", "spearman", "spearman_p", "n_units", "plasticity_ranking",
            "gain_ranking"]
    return finish(pd.DataFrame(rows, columns=["model"] + cols), cols, n_models(counted)) if rows else None


def beyond_tables(best_lr: pd.DataFrame, counted: pd.DataFrame, plasticity: pd.DataFrame | None,
                  notes: list[str]) -> dict[str, pd.DataFrame]:
    """Every table of this module the study allows (``best_lr`` with its ``LP`` rows when the study has them)."""
    tables = {"frontier": frontier_table(best_lr, counted, notes)}
    matched = matched_budget_table(tables["frontier"], notes=notes)
    if len(matched):
        tables["matched_budget"] = matched
    else:
        notes.append("Matched budgets omitted: no budget with two families among auto:B, random:B and a matching "
                     "PEFT or BitFit configuration.")
    gain = unit_gain_table(plasticity, best_lr, counted, notes)
    if gain is not None:
        tables["unit_gain"] = gain
    return tables


# --------------------------------------------------------------------------------------------------
# Rendering and figures
# --------------------------------------------------------------------------------------------------


def _blocks(t: pd.DataFrame, keys: list[str], columns: list[str], cells, sort_by: str | None = None) -> list[Block]:
    """One block per value of ``keys`` (and model); rows sorted by ``sort_by`` within a block; bold first cell
    on the frontier."""
    blocks = []
    keys = (["model"] if "model" in t.columns else []) + keys
    for vals, g in t.groupby(keys, sort=False) if keys else [((), t)]:
        vals = vals if isinstance(vals, tuple) else (vals,)
        heading = " · ".join(f"{k}: {v}" for k, v in zip(keys, vals))
        g = g.sort_values(sort_by, kind="stable") if sort_by else g
        rows = [cells(r) for _, r in g.iterrows()]
        bold = {(i, 0) for i, (_, r) in enumerate(g.iterrows()) if r.get("on_frontier", False)}
        blocks.append(Block(heading, columns, rows, bold))
    return blocks


def render_frontier(t: pd.DataFrame) -> Rendered:
    def cells(r):
        value = pct(r["mean"]) + (f" ± {pct(r['std'])}" if r["n_seeds"] > 1 or r["dataset"] == OVERALL else "")
        return [r["configuration"], fmt_count(r["trainable_params"]), value,
                "–" if r["dataset"] == OVERALL else fmt_lr(r["lr"]), "yes" if r["on_frontier"] else ""]
    blocks = _blocks(t, ["dataset", "optimizer"], ["configuration", "trainable parameters", "accuracy (%)",
                                                   "best lr", "on the frontier"], cells, "trainable_params")
    return Rendered("frontier", "Accuracy against trainable parameters (Pareto frontier)",
                    "Best-lr test accuracy (mean ± std over seeds; overall: over datasets) and trainable "
                    "parameters (head included; median over the trials) of every configuration; bold: on the "
                    "Pareto frontier (no configuration is at least as accurate with at most as many parameters).",
                    blocks, [STD_NOTE])


def render_matched_budget(t: pd.DataFrame) -> Rendered:
    def cells(r):
        return [r["budget"], r["first"], r["second"], f"{fmt_count(r['params_first'])} / "
                f"{fmt_count(r['params_second'])}", f"{pct(r['mean_first'])} / {pct(r['mean_second'])}",
                fmt_num(r["statistic"], 1), fmt_p(r["p_value"]), str(int(r["n_pairs"]))]
    blocks = _blocks(t, ["optimizer"], ["budget", "first", "second", "trainable parameters", "accuracy (%)",
                                        "statistic", "p-value", "pairs (datasets)"], cells)
    return Rendered("matched_budget", "Plasticity-guided, random, PEFT and BitFit at matched budgets",
                    f"auto:B (units by plasticity), random:B (units in a seeded random order) and each PEFT "
                    f"configuration (lora, dora, loha, lokr, vera, ia3) or BitFit (bias) whose parameter count is "
                    f"nearest the budget (within a factor {DEFAULT_TOLERANCE:g} of B, in parameters plus the "
                    "head, when the study ran All and Head; else of what auto:B and random:B reached): best-lr "
                    "accuracy, mean over the paired datasets; scipy.stats.wilcoxon, "
                    f"{MATCHED_ALTERNATIVE}, paired over datasets (best-lr means over seeds).", blocks,
                    [f"{statistic_note(MATCHED_ALTERNATIVE, 'first − second')}; p-value '–' without pairs or "
                     "when every difference is zero.",
                     smallest_p_note(MATCHED_ALTERNATIVE, t["n_pairs"])])


def render_unit_gain(t: pd.DataFrame) -> Rendered:
    def cells(r):
        return [r["dataset"], r["optimizer"], r["mode"], r["baseline"],
                f"{fmt_num(r['spearman'], 2)} (p {fmt_p(r['spearman_p'])})", str(int(r["n_units"])),
                r["plasticity_ranking"], r["gain_ranking"]]
    blocks = _blocks(t, [], ["dataset", "optimizer", "mode", "baseline", "Spearman ρ", "units",
                             "plasticity ranking", "gain ranking"], cells)
    return Rendered("unit_gain", "Plasticity of a unit against the gain of training it alone",
                    "Spearman correlation between the plasticity of a (component, block) unit and the best-lr "
                    "accuracy gain of training that unit alone (configurations such as MHA@3) over the baseline "
                    "(Head, else the linear probe LP).", blocks,
                    ["p-values two-sided, exact up to 8 units (all n! pairings)."])


def _count_label(n: float) -> str:
    """``20000 -> "20k"``, ``2.5e6 -> "2.5M"``: a parameter count as an axis label."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:g}{suffix}"
    return f"{n:g}"


def _frontier_panel(ax, rows: pd.DataFrame, styles: dict[str, tuple[str, str]],
                    ylabel: str = "best-lr test accuracy (%)") -> None:
    """Every configuration in its colour and marker (frontier ones large, outlined and joined; others faded) at
    its trainable parameters (log x) and best-lr accuracy (%); only frontier points are labelled, alternately
    above and below (the legend names every point)."""
    rows = rows.dropna(subset=["trainable_params", "mean"])
    for r in rows.itertuples():
        color, marker = styles[r.configuration]
        ax.scatter(r.trainable_params, 100 * r.mean, color=color, marker=marker, s=70 if r.on_frontier else 30,
                   alpha=1.0 if r.on_frontier else 0.45, edgecolor="black" if r.on_frontier else "none", zorder=3)
    front = rows[rows["on_frontier"]].sort_values("trainable_params")
    ax.plot(front["trainable_params"], 100 * front["mean"], color="black", lw=1.2, zorder=2)
    for k, r in enumerate(front.itertuples()):
        ax.annotate(r.configuration, (r.trainable_params, 100 * r.mean), textcoords="offset points",
                    xytext=(4, 6 if k % 2 == 0 else -11), fontsize=F.FONT["small"])
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _count_label(v)))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("trainable parameters (log scale)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, which="both")


@F.styled
def plot_frontier(rows: pd.DataFrame, path_stem: str | Path, *, title: str = "",
                  ylabel: str = "best-lr test accuracy (%)") -> list[Path]:
    """Best-lr accuracy against trainable parameters (log x) of one dataset (or ``overall``), a panel per
    (model,) optimizer; every configuration in its own colour and marker (the legend), frontier points large,
    outlined, joined by a line and labelled; others faded. ``rows``: rows of :func:`frontier_table`."""
    F._require(rows, ["optimizer", "configuration", "family", "trainable_params", "mean", "on_frontier"], "frontier")
    panels, constant = F._facets(rows, ("model", "optimizer"))
    styles = F.configuration_styles(F._ordered(rows["configuration"].unique()))  # {configuration: (colour, marker)}
    fig, axes = F._grid(len(panels), width=6.0, height=4.4)
    for ax, (name, g) in zip(axes, panels):
        _frontier_panel(ax, g, styles, ylabel)
        if name:
            ax.set_title(name)
    handles = [Line2D([], [], ls="", color=color, marker=marker, ms=7, label=c)
               for c, (color, marker) in styles.items()]
    if rows["on_frontier"].any():
        handles.append(Line2D([], [], color="black", lw=1.2, label="Pareto frontier"))
    fig.legend(handles=handles, loc="outside right center", frameon=False, title="configuration")
    F._title(fig, title or "Accuracy against trainable parameters", constant)
    return F.save_figure(fig, path_stem)


def figure_jobs(frontier: pd.DataFrame, slug) -> list[tuple]:
    """``(name, title, caption, draw)`` per dataset, then ``overall``, for the analysis pipeline."""
    datasets = sorted(set(frontier["dataset"]) - {OVERALL})
    datasets += [OVERALL] if (frontier["dataset"] == OVERALL).any() else []
    jobs = []
    for ds in datasets:
        rows, title = frontier[frontier["dataset"] == ds], f"Accuracy against trainable parameters — {ds}"
        what = "Mean over datasets of the best-lr accuracy" if ds == OVERALL else "Best-lr accuracy (mean over seeds)"
        jobs.append((slug("frontier", ds), title,
                     f"{what} against trainable parameters (log scale, head included) of every configuration; "
                     "the Pareto frontier outlined, joined and labelled.",
                     lambda s, rows=rows, title=title: plot_frontier(rows, s, title=title)))
    return jobs
