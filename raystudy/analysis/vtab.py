"""VTAB-1k's tables: the benchmark's per-task layout, its Pareto frontier and matched-budget tests over tasks.

When every dataset of a study is a VTAB-1k task (:data:`raystudy.vocab.VTAB_TASKS`, the 19 task folders),
three tables follow:

* ``vtab``: one row per (model,) optimizer and configuration; a column per task in the benchmark's order,
  grouped Natural | Specialized | Structured (:data:`raystudy.vocab.VTAB_GROUPS`), then each group's mean,
  then both means the field reports: ``mean_tasks`` (the mean over the tasks, "mean of 19 tasks") and
  ``mean_groups`` (the mean of the three group means); ``trainable_params`` (median over the tasks).
* ``vtab_frontier``: ``mean_tasks`` against trainable parameters with the Pareto frontier marked
  (:func:`raystudy.analysis.beyond.pareto_mask`).
* ``vtab_matched_budget``: :func:`raystudy.analysis.beyond.matched_budget_table` on the per-task accuracies:
  paired Wilcoxon signed-rank tests over tasks at matched budgets (a dataset is a task here).

A task's accuracy of a configuration (:func:`task_accuracies`): with ``final``-phase rows (the benchmark's
protocol: after the lr search on train800 / val200, the selected lr retrained on train800val200, test
reported) the mean over seeds of those rows' ``test_acc``; without them the search trials' test accuracy at
the lr chosen by ``select_by`` (:func:`raystudy.analysis.tables.best_lr_table`; validation by default here,
:data:`VTAB_SELECT_BY`). Accuracies are fractions, spreads population standard deviations (ddof 0).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from raystudy.analysis import beyond as B
from raystudy.analysis.render import LR_RULES, Block, Rendered, pct
from raystudy.analysis.stats import configuration_order
from raystudy.analysis.tables import _with_model, best_lr_table, finish, population_std, recorded_counts
from raystudy.vocab import VTAB_GROUPS, VTAB_TASKS

#: The tables of this module, in report order.
TABLES = ("vtab", "vtab_frontier", "vtab_matched_budget")
#: How the lr of a task is chosen from the search trials when the study has no final rows.
VTAB_SELECT_BY = "val"
#: Column ``lr_rule`` of the ``vtab`` table when it reads the final rows.
FINAL = "final"
MEAN_TASKS, MEAN_GROUPS = "mean_tasks", "mean_groups"
KEYS = ["model", "dataset", "optimizer", "configuration"]


def is_vtab(counted: pd.DataFrame | None) -> bool:
    """Whether ``counted`` has rows and every dataset is a VTAB-1k task folder name."""
    return counted is not None and bool(len(counted)) and set(counted["dataset"].astype(str)) <= set(VTAB_TASKS)


def task_order(tasks) -> list[str]:
    """The VTAB-1k tasks among ``tasks`` in the benchmark's order (Natural, Specialized, Structured)."""
    tasks = set(tasks)
    return [t for t in VTAB_TASKS if t in tasks]


def _final_accuracies(final: pd.DataFrame) -> pd.DataFrame:
    """Per (model, task, optimizer, configuration) of the final rows: mean, std (ddof 0) and count over seeds
    of ``test_acc``, the median trainable parameters, the lr retrained."""
    f = final.assign(trainable_params=recorded_counts(final["trainable_params"]))
    g = f.groupby(KEYS, sort=False)
    out = g["test_acc"].agg(mean="mean", std=population_std, n_seeds="count")
    return out.join(g["trainable_params"].median()).join(g["lr"].median()).reset_index()


def task_accuracies(counted: pd.DataFrame, probes: pd.DataFrame | None, final: pd.DataFrame | None,
                    select_by: str, notes: list[str]) -> tuple[pd.DataFrame, str]:
    """``(per-task accuracies, lr_rule)``: columns ``model, dataset, optimizer, configuration, mean, std,
    n_seeds, trainable_params, lr``; ``lr_rule`` is :data:`FINAL` when ``final`` has rows (then only those are
    read; the configurations searched but never refit are noted), else ``select_by``."""
    if final is not None and len(final):
        per = _final_accuracies(final)
        searched = set(zip(counted["optimizer"], counted["configuration"]))
        missing = configuration_order({c for o, c in searched - set(zip(per["optimizer"], per["configuration"]))})
        if missing:
            notes.append(f"VTAB-1k table: no final (train800val200) rows of {', '.join(missing)}: left out of the "
                         "table, which reads the final rows.")
        return per, FINAL
    best = _with_model(best_lr_table(counted, probes, select_by), counted)
    per = B._params_at_best(best, counted)
    return per[KEYS + ["mean", "std", "n_seeds", "trainable_params", "lr"]], select_by


def _means(row: pd.Series, tasks: list[str]) -> dict:
    """The group means, the mean over tasks and the mean of the group means of one configuration's task
    accuracies ``row`` (tasks it lacks are left out of each mean)."""
    present = [t for t in tasks if pd.notna(row.get(t))]
    out = {}
    for group in VTAB_GROUPS:
        values = [row[t] for t in present if VTAB_TASKS[t][0] == group]
        out[group] = float(np.mean(values)) if values else np.nan
    groups = [out[g] for g in VTAB_GROUPS if pd.notna(out[g])]
    out[MEAN_TASKS] = float(np.mean([row[t] for t in present])) if present else np.nan
    out[MEAN_GROUPS] = float(np.mean(groups)) if groups else np.nan
    out["n_tasks"] = len(present)
    return out


def vtab_table(per: pd.DataFrame, lr_rule: str, notes: list[str] | None = None) -> pd.DataFrame:
    """The benchmark's layout of the per-task accuracies ``per`` (:func:`task_accuracies`).

    One row per (model,) optimizer and configuration: ``trainable_params`` (median over tasks, head
    included), a column per task present (benchmark order, value ``mean`` over seeds), each group's mean over
    its tasks present, ``mean_tasks = mean_t a_t`` and ``mean_groups = mean_g (mean_{t in g} a_t)``,
    ``n_tasks``, ``n_seeds`` (the fewest seeds behind a task) and ``lr_rule`` (how each task's lr was chosen).
    """
    notes = notes if notes is not None else []
    tasks = task_order(per["dataset"])
    wide = per.pivot_table(index=["model", "optimizer", "configuration"], columns="dataset", values="mean",
                           aggfunc="first").reindex(columns=tasks)
    g = per.groupby(["model", "optimizer", "configuration"])
    wide = wide.join(g["trainable_params"].median()).join(g["n_seeds"].min())
    means = pd.DataFrame([_means(r, tasks) for _, r in wide.iterrows()], index=wide.index)
    out = wide.join(means).reset_index().assign(lr_rule=lr_rule)
    short = out[out["n_tasks"] < len(tasks)]
    if len(short):
        notes.append(f"VTAB-1k table: {', '.join(configuration_order(short['configuration']))} ran fewer than the "
                     f"{len(tasks)} tasks; their means cover the tasks they ran (column n_tasks).")
    cols = ["optimizer", "configuration", "trainable_params", *tasks, *VTAB_GROUPS, MEAN_TASKS, MEAN_GROUPS,
            "n_tasks", "n_seeds", "lr_rule"]
    return finish(out, cols, int(per["model"].nunique()))


def vtab_frontier_table(vtab: pd.DataFrame) -> pd.DataFrame:
    """``mean_tasks`` against ``trainable_params`` per (model,) optimizer, ``on_frontier`` by
    :func:`raystudy.analysis.beyond.pareto_mask` over the configurations with a parameter count (``LP``:
    none)."""
    t = _with_model(vtab, vtab.assign(model="")).assign(family=lambda d: d["configuration"].map(B.family))
    t = t.assign(on_frontier=False)
    for _, g in t.groupby(["model", "optimizer"], sort=False):
        g = g.dropna(subset=["trainable_params", MEAN_TASKS])
        t.loc[g.index, "on_frontier"] = B.pareto_mask(g["trainable_params"], g[MEAN_TASKS])
    t = t.sort_values(["model", "optimizer", "trainable_params"], kind="stable")
    cols = ["optimizer", "configuration", "family", "trainable_params", MEAN_TASKS, "n_tasks", "on_frontier"]
    return t[(["model"] if "model" in vtab.columns else []) + cols].reset_index(drop=True)


def vtab_tables(counted: pd.DataFrame, probes: pd.DataFrame | None, final: pd.DataFrame | None,
                select_by: str, notes: list[str]) -> dict[str, pd.DataFrame]:
    """Every table of this module the study allows (``vtab_matched_budget`` when two budget families meet)."""
    per, lr_rule = task_accuracies(counted, probes, final, select_by, notes)
    tables = {"vtab": vtab_table(per, lr_rule, notes)}
    tables["vtab_frontier"] = vtab_frontier_table(tables["vtab"])
    matched = B.matched_budget_table(per, notes=[])
    if len(matched):
        tables["vtab_matched_budget"] = matched
    return tables


# --------------------------------------------------------------------------------------------------
# Rendering and the frontier figure
# --------------------------------------------------------------------------------------------------


def lr_rule_text(lr_rule: str) -> str:
    """The caption's statement of how each task's accuracy was obtained."""
    if lr_rule == FINAL:
        return ("trained on train800val200 at the lr chosen on val200 (phase final), test accuracy, mean over "
                "seeds")
    return (f"search trials (trained on train800), test accuracy at the lr with {LR_RULES[lr_rule]} per "
            "task")


def _bold_best(rows: list[list[str]], values: pd.DataFrame, first: int) -> set[tuple[int, int]]:
    """(row, column) of the highest value of each accuracy column (columns from ``first`` on)."""
    bold = set()
    for j, c in enumerate(values.columns, start=first):
        v = values[c].to_numpy(dtype=float)
        if np.isfinite(v).any():
            bold |= {(i, j) for i in np.flatnonzero(np.isclose(v, np.nanmax(v), rtol=0, atol=1e-12))}
    return bold


def millions(n) -> str:
    """A parameter count in millions as the benchmark's tables print it (``0.29``), with two significant
    digits below 0.1 M so that small methods stay distinguishable (``0.0013``); ``–`` when unknown."""
    if pd.isna(n):
        return "–"
    return f"{n / 1e6:.2f}" if n >= 1e5 else f"{n / 1e6:.2g}"


def render_vtab(t: pd.DataFrame) -> Rendered:
    """One block per (model,) optimizer: configuration, parameters (M), the tasks, group means, both means."""
    tasks = [c for c in t.columns if c in VTAB_TASKS]
    n = len(tasks)
    means = [*VTAB_GROUPS, MEAN_TASKS, MEAN_GROUPS]
    mean_label = "mean of 19 tasks" if n == len(VTAB_TASKS) else f"mean of {n} tasks"
    columns = ["configuration", "params (M)", *tasks, *VTAB_GROUPS, mean_label, "mean of group means"]
    groups = ["", "", *(VTAB_TASKS[x][0] for x in tasks), *["group means"] * 3, *["means"] * 2]
    blocks = []
    keys = [k for k in ("model", "optimizer") if k in t.columns]
    for vals, g in t.groupby(keys, sort=False):
        vals = vals if isinstance(vals, tuple) else (vals,)
        g = g.set_index("configuration").loc[configuration_order(g["configuration"])].reset_index()
        rows = [[r["configuration"], millions(r["trainable_params"]),
                 *(pct(r[c], 1) for c in tasks + means)] for _, r in g.iterrows()]
        heading = " · ".join(f"{k}: {v}" for k, v in zip(keys, vals))
        blocks.append(Block(heading, columns, rows, _bold_best(rows, g[tasks + means], 2), groups))
    lr_rule = t["lr_rule"].iloc[0]
    return Rendered("vtab", "VTAB-1k: accuracy per task",
                    f"Top-1 test accuracy (%) per task in the benchmark's order, grouped Natural | Specialized | "
                    f"Structured, each group's mean, the mean over tasks ({mean_label}) and the mean of the three "
                    f"group means. Selection: {lr_rule_text(lr_rule)}. Params: trainable parameters in "
                    "millions (median over tasks, classifier head included).", blocks,
                    ["Bold: the best value of each column."])


def render_vtab_frontier(t: pd.DataFrame) -> Rendered:
    def cells(r):
        return [r["configuration"], r["family"], millions(r["trainable_params"]), pct(r[MEAN_TASKS], 2),
                str(int(r["n_tasks"])), "yes" if r["on_frontier"] else ""]
    blocks = B._blocks(t, ["optimizer"], ["configuration", "family", "params (M)", "mean over tasks (%)", "tasks",
                                          "on the frontier"], cells)
    return Rendered("vtab_frontier", "VTAB-1k: mean accuracy against trainable parameters (Pareto frontier)",
                    "The mean over tasks of the VTAB-1k table against each configuration's trainable parameters "
                    "(median over tasks, head included); bold: on the Pareto frontier (no configuration is at "
                    "least as accurate with at most as many parameters).", blocks)


def render_vtab_matched_budget(t: pd.DataFrame) -> Rendered:
    r = B.render_matched_budget(t)
    return Rendered("vtab_matched_budget", "VTAB-1k: matched budgets, paired over tasks",
                    r.caption.replace("paired over datasets", "paired over the VTAB-1k tasks")
                    + " The accuracies are the VTAB-1k table's.",
                    [Block(b.heading, [c.replace("(datasets)", "(tasks)") for c in b.columns], b.rows, b.bold)
                     for b in r.blocks], r.footnotes)


def figure_job(frontier: pd.DataFrame) -> tuple:
    """``(name, title, caption, draw)`` of the VTAB-1k frontier figure (:func:`raystudy.analysis.beyond.plot_frontier`
    on the ``vtab_frontier`` rows)."""
    rows = frontier.rename(columns={MEAN_TASKS: "mean"})
    title = "VTAB-1k: mean accuracy over tasks against trainable parameters"
    return ("vtab_frontier", title, "Mean over tasks of the VTAB-1k table against trainable parameters (log scale, "
            "head included); the Pareto frontier outlined, joined and labelled.",
            lambda s: B.plot_frontier(rows, s, title=title, ylabel="test accuracy (%), mean over tasks"))
