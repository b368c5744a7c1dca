"""Which figures a study's analysis draws, under which names, titles and captions; and drawing them.

:func:`figure_jobs` plans every figure the inputs allow (cheap: nothing is drawn, notes say what is omitted);
:func:`chosen_figures` keeps all, none or those matching shell patterns (``raystudy analyze --figures``);
:func:`draw_figures` draws them into ``figures/`` (PNG + SVG each).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from raystudy.analysis import authors_figures as AF
from raystudy.analysis import beyond as B
from raystudy.analysis import change as CH
from raystudy.analysis import figures as F
from raystudy.analysis import pretraining as P
from raystudy.analysis import selection_figures as SelF
from raystudy.analysis import sweep_figures as SF
from raystudy.analysis import vtab as V
from raystudy.analysis.inputs import FINAL, SEARCH, StudyInputs
from raystudy.analysis.options import DEFAULT_FIXED_RUN, fixed_run_list
from raystudy.analysis.render import phase_note
from raystudy.analysis.tables import phase_of, reported_accuracies
from raystudy.terminal import progress_bar
from raystudy.vocab import BOUNDS_FORMULAS, PAPER_RANKING


@dataclass
class FigureInfo:
    name: str
    title: str
    caption: str
    paths: list[Path]


def _slug(*parts) -> str:
    return "_".join(re.sub(r"[^A-Za-z0-9.+-]+", "-", str(p)).strip("-") for p in parts if str(p))




#: A figure to draw: (name, title, caption, draw(path stem) -> paths).
FigureJob = tuple[str, str, str, Callable[[Path], list[Path]]]


def _plasticity_figures(inputs: StudyInputs, path: pd.DataFrame | None = None) -> list[FigureJob]:
    """The plasticity figures; ``path``: the ``plasticity_pretraining`` table, whose figure comes before the bounds'."""
    p, jobs = inputs.plasticity, []
    if p is not None:
        depth = p if inputs.control is None else pd.concat([p, inputs.control], ignore_index=True)
        jobs.append(("plasticity_depth", "Plasticity across depth",
                     "Mean rate ||f(x) − f(y)||_F / ||x − y||_F per layer and component with its 95% interval; "
                     "dashed: the random-init control on the same pairs; dash-dotted: the component control "
                     "(random-init blocks fed the model's own embeddings); the dotted line marks plasticity 1.",
                     lambda s: F.plot_plasticity_depth(depth, s)))
        jobs.append(("plasticity_distribution", "Plasticity per layer, box over layers and datasets (the paper's "
                     "Fig. 2, left, and Fig. 4)",
                     "The authors' statistic (apps/plots/finetuning.py, ablation_analysis.py): per component, a box "
                     "of its per-layer plasticity (each layer's mean rate over pairs), every dataset's layers "
                     "pooled; components in the paper's plasticity order; whiskers to the furthest value within "
                     "1.5 IQR, values beyond not drawn.", lambda s: AF.plot_plasticity_boxes(p, s)))
        if inputs.rates is not None:
            rates = inputs.rates
            jobs.append(("plasticity_rate_violins", "Distribution of per-pair rates",
                         "raystudy's statistic: every pair's rate of each component, pooled over layers, a panel "
                         "per dataset (violin, quartiles, median); the paper's boxes of per-layer means are the "
                         "figure above.", lambda s: F.plot_rate_distribution(rates, s)))
    if path is not None:
        jobs.append(P.figure_job(path))
    if inputs.bounds is not None:
        b = inputs.bounds
        formulas = set(F.bounds_of(b))
        which = {BOUNDS_FORMULAS[0]: "",
                 BOUNDS_FORMULAS[1]: " The authors' formulas (their Fig. 7's theory.py), not the paper's."}
        both = (" A panel for each formulas: the paper's (Section 4) and the authors' (their Fig. 7's theory.py, "
                "what the published figure plots), from the same weights.")
        jobs.append(("bounds", "Upper bounds and measured plasticity",
                     "Theoretical upper bounds (dashed) next to the measured plasticity (solid), log scale."
                     + (both if len(formulas) > 1 else which[formulas.pop()]), lambda s: F.plot_bounds(b, p, s)))
    return jobs


def _swept_runs(inputs: StudyInputs) -> pd.DataFrame:
    """The finetuning runs that may have curves: counted trials and diverged ones without an evaluation."""
    ex = inputs.excluded
    late = ex[ex["diverged"]] if ex is not None and len(ex) else None
    return pd.concat([inputs.counted, late], ignore_index=True) if late is not None else inputs.counted


def _fixed_run_job(curves: pd.DataFrame, rr: pd.DataFrame, fixed_run: dict, label: str, parts: tuple,
                   notes: list[str]) -> list[FigureJob]:
    """The fixed-run figure of one (model,) dataset and optimizer (none when no run is at that seed and lr),
    a note naming the configurations that have no such run."""
    seed, lr = fixed_run["seed"], fixed_run["lr"]
    chosen = F.fixed_runs(rr, seed, lr)
    if chosen.empty:
        return []
    missing = [c for c in F._ordered(rr["configuration"].unique()) if c not in set(chosen["configuration"])]
    if missing:
        notes.append(f"fixed_run: no run of {', '.join(missing)} at seed {seed}, lr {lr:g} on {label}: the "
                     "fixed-run figure shows the other configurations.")
    title = f"Gradient norm and validation loss at seed {seed}, lr {lr:g} — {label}"
    return [(_slug("curves", "fixed", *parts), title,
             f"The run at seed {seed} and lr {lr:g} of each configuration on {label} (the paper's Fig. 5, middle "
             "and right, fixes Sketch, SGD, seed 42, lr 1e-2; its Fig. 54, Sketch, AdamW, seed 0, lr 1e-4), beside "
             "the best runs.",
             lambda s: F.plot_curves(curves, chosen, s, title=f"{label} · seed {seed} · lr {lr:g}",
                                     legend="fixed run"))]


def _fixed_jobs(curves: pd.DataFrame, rr: pd.DataFrame, fixed: list[dict], key: tuple, label: str, parts: tuple,
                notes: list[str]) -> tuple[list[FigureJob], set[int]]:
    """The fixed-run figures of one ``key = (model, dataset, optimizer)``: one per fixed run of ``fixed`` on
    that dataset (and optimizer, when the fixed run names one) with runs at its seed and lr, named
    ``curves_fixed_<parts>``, with ``_seed<S>_lr<L>`` added when several share ``key``; and the indices of the
    fixed runs drawn."""
    _, ds, opt = key
    found = [(i, r) for i, r in enumerate(fixed) if r["dataset"] == ds and r.get("optimizer", opt) == opt
             and len(F.fixed_runs(rr, r["seed"], r["lr"]))]
    jobs = []
    for _, r in found:
        named = parts if len(found) == 1 else (*parts, f"seed{r['seed']}", f"lr{r['lr']:g}")
        jobs += _fixed_run_job(curves, rr, r, label, named, notes)
    return jobs, {i for i, _ in found}


def _curve_figures(inputs: StudyInputs, curves: pd.DataFrame, notes: list[str],
                   fixed_run: dict | list | None = DEFAULT_FIXED_RUN) -> list[FigureJob]:
    """Per (model,) dataset and optimizer: the best run of each configuration (Fig. 5, middle and right),
    the runs of each ``fixed_run`` on its dataset (:func:`~raystudy.analysis.options.fixed_run_list`), and
    every run of the sweep (Figs. 21-58)."""
    best, runs, fixed = F.best_runs(inputs.counted), _swept_runs(inputs), fixed_run_list(fixed_run)
    many_models = runs["model"].nunique() > 1
    jobs, drawn = [], set()
    for (model, ds, opt), rr in runs.groupby(["model", "dataset", "optimizer"], sort=True):
        if not set(rr["trial_id"]) & set(curves["trial_id"]):
            notes.append(f"curves.parquet has no rows for the runs on {ds} / {opt}.")
            continue
        label = f"{model} · {ds} · {opt}" if many_models else f"{ds} · {opt}"
        parts = (model, ds, opt) if many_models else (ds, opt)
        bb = best[(best["model"] == model) & (best["dataset"] == ds) & (best["optimizer"] == opt)]
        if len(bb):
            jobs.append((_slug("curves", *parts), f"Gradient norm and validation loss — {label}",
                         f"Best run (highest test accuracy) of each configuration on {label}.",
                         lambda s, bb=bb, label=label: F.plot_curves(curves, bb, s, title=label)))
        more, done = _fixed_jobs(curves, rr, fixed, (model, ds, opt), label, parts, notes)
        jobs, drawn = jobs + more, drawn | done
        jobs.append((_slug("curves", "all", *parts), f"Every run: gradient norm and validation loss — {label}",
                     f"Every learning rate and seed on {label} (the paper's Figs. 21-58): a panel per "
                     "configuration, colour = learning rate, line style = seed, x = diverged run.",
                     lambda s, rr=rr, label=label: SF.plot_sweep_curves(curves, rr, s, title=label)))
    for r in (r for i, r in enumerate(fixed) if i not in drawn):
        where = f"{r['dataset']} / {r['optimizer']}" if "optimizer" in r else r["dataset"]
        notes.append(f"fixed_run: no run with curves on {where} at seed {r['seed']}, lr {r['lr']:g}: the fixed-run "
                     "figure (the paper's Fig. 5, middle and right) is omitted.")
    return jobs


def _fixed_lr_figures(ok: pd.DataFrame) -> list[FigureJob]:
    """The fixed-lr view of Fig. 5 (left), one figure per (model,) optimizer."""
    many_models = ok["model"].nunique() > 1
    jobs = []
    for (model, opt), rows in ok.groupby(["model", "optimizer"], sort=True):
        parts = (model, opt) if many_models else (opt,)
        label = " · ".join(map(str, parts))
        jobs.append(("accuracy_fixed_lr_" + _slug(*parts), f"Test accuracy at each fixed learning rate — {label}",
                     "Every seed's test accuracy per configuration (dot; x: diverged, counted with its "
                     "pre-divergence best-validation accuracy) and the mean over seeds (bar), one panel per "
                     "dataset and learning rate.",
                     lambda s, rows=rows: SF.plot_accuracy_fixed_lr(rows, s)))
    return jobs


def _accuracy_figures(inputs: StudyInputs, tables: dict[str, pd.DataFrame], notes: list[str]) -> list[FigureJob]:
    ok, probes = inputs.counted, inputs.probes
    jobs = [("accuracy_distribution", "Test accuracy over learning rates × seeds",
             "Every counted trial of each configuration (dots) with its distribution (Fig. 5, left).",
             lambda s: F.plot_accuracy_distribution(ok, s))]
    jobs += _fixed_lr_figures(ok)
    jobs.append(("accuracy_vs_lr", "Test accuracy against the learning rate",
                 "Mean over seeds per configuration and learning rate, ± std over seeds (ddof 0, band, in a panel "
                 f"of at most {SF.MAX_BANDS} lines: more bands hide one another); beyond {SF.MAX_LINES} "
                 "configurations a panel per family (one budget's criteria together); x: an lr with a diverged run; "
                 "dashed: the linear probe.", lambda s: SF.plot_accuracy_vs_lr(ok, s, probes)))
    best = reported_accuracies(tables["best_lr"], ok, inputs.final, probes)[0]  # the final fit where there is one
    if best["configuration"].isin(PAPER_RANKING).any():
        jobs.append(("best_accuracy", "Best accuracy, mean over datasets (the paper's Fig. 19)",
                     "The authors' statistic (apps/plots/finetuning.py, get_best_performance): per component, "
                     "the best-lr test accuracy averaged over datasets; error bar: the pooled standard error "
                     "sqrt(mean over datasets of std²) / sqrt(seeds), std over seeds at the best lr (ddof 0).",
                     lambda s: AF.plot_overall_accuracy(best, s)))
    else:
        notes.append(f"No component ({', '.join(PAPER_RANKING)}) among the configurations: the paper's Fig. 19 "
                     "(the components' best accuracy, mean over datasets) is omitted.")
    jobs.append(("best_accuracy_per_dataset", "Best accuracy per dataset",
                 "raystudy's statistic: best-lr test accuracy per dataset and configuration, ± std over seeds "
                 "(ddof 0); the paper's Fig. 19 averages the components' bars over datasets (the figure above).",
                 lambda s: SF.plot_best_accuracy(best, s)))
    overall, cost = tables["overall"], tables["cost"]
    if cost["trainable_params"].notna().any():
        jobs.append(("accuracy_vs_params", "Accuracy against trainable parameters",
                     "Best-lr test accuracy (mean over datasets ± std over datasets, ddof 0) against each "
                     "configuration's median number of trainable parameters.",
                     lambda s: SF.plot_accuracy_vs_params(overall, cost, s)))
    return jobs


def _trial_figures(inputs: StudyInputs, tables: dict[str, pd.DataFrame], notes: list[str],
                   fixed_run: dict | list | None = DEFAULT_FIXED_RUN) -> list[FigureJob]:
    ok = inputs.counted
    if ok is None or not len(ok):
        return []
    jobs = _accuracy_figures(inputs, tables, notes)
    if "relative_gain" in tables:
        g = tables["relative_gain"]
        ref = g["reference"].iloc[0]
        jobs.append(("relative_gain", "Relative gain over linear probing",
                     f"(acc − acc_{ref}) / acc_{ref} of the best-lr accuracies, per dataset and overall.",
                     lambda s: F.plot_relative_gain(g, s)))
    if "frontier" in tables:
        jobs += B.figure_jobs(tables["frontier"], _slug)
    if "criteria" in tables:
        jobs += SelF.figure_jobs(inputs, _slug)
    jobs += CH.figure_jobs(tables)
    if "vtab_frontier" in tables:
        jobs.append(V.figure_job(tables["vtab_frontier"]))
    if inputs.curves is not None:
        jobs += _curve_figures(inputs, inputs.curves, notes, fixed_run)
    elif fixed_run is not None:
        notes.append("fixed_run: no curves.parquet: the fixed-run figure is omitted.")
    return jobs


#: The figures (name prefixes) of the lr search's trials themselves: in a study with a final fit they read the
#: search trials, every other accuracy figure the final fit (:func:`~raystudy.analysis.tables.reported_accuracies`).
SEARCH_FIGURES = ("accuracy_distribution", "accuracy_fixed_lr", "accuracy_vs_lr", "curves", *CH.FIGURES)


def _with_phases(jobs: list[FigureJob], inputs: StudyInputs) -> list[FigureJob]:
    """The trial figures ``jobs`` with, in a study with a final fit, each caption ending in its phase
    (:func:`~raystudy.analysis.render.phase_note`)."""
    if phase_of(inputs.final) != FINAL:
        return jobs
    return [(name, title, f"{caption} {phase_note(SEARCH if name.startswith(SEARCH_FIGURES) else FINAL)}", draw)
            for name, title, caption, draw in jobs]


def figure_jobs(inputs: StudyInputs, tables: dict[str, pd.DataFrame], notes: list[str],
                fixed_run: dict | list | None = DEFAULT_FIXED_RUN) -> list[FigureJob]:
    """Every figure the inputs allow, not drawn yet (the notes of what is omitted are added here); ``fixed_run``
    adds the curves of one dataset's runs at one seed and lr (:data:`raystudy.analysis.options.FIXED_RUN_KEYS`,
    perhaps of one optimizer), or of each of a list of such runs. In a study with a final fit each caption says
    which phase the figure reads (:func:`_with_phases`)."""
    return (_plasticity_figures(inputs, tables.get("plasticity_pretraining"))
            + _with_phases(_trial_figures(inputs, tables, notes, fixed_run), inputs))


def chosen_figures(jobs: list[FigureJob], figures: bool | Collection[str]) -> list[FigureJob]:
    """``jobs`` to draw: all (``True``: figures/ is emptied first), none (``False``), or those whose name
    matches one of the shell patterns ``figures`` (``"curves_all_*"``; the other files of figures/ are kept); a
    pattern that matches no figure is an error naming them all."""
    if isinstance(figures, bool):
        return list(jobs) if figures else []
    names = [j[0] for j in jobs]
    unknown = [f for f in figures if not fnmatch.filter(names, f)]
    if unknown:
        raise ValueError(f"figures: no figure of this study matches {', '.join(map(repr, unknown))}; "
                         f"it has {', '.join(names) or 'none'}")
    return [j for j in jobs if any(fnmatch.fnmatchcase(j[0], f) for f in figures)]


def draw_figures(jobs: list[FigureJob], fig_dir: Path) -> list[FigureInfo]:
    """Draw ``jobs`` into ``fig_dir`` (PNG + SVG each), with a progress bar."""
    return [FigureInfo(name, title, caption, draw(fig_dir / name))
            for name, title, caption, draw in progress_bar(jobs, desc="figures", unit="fig", leave=False)]


def kept_figures_note(fig_dir: Path, drawn: list[FigureInfo]) -> str | None:
    """What a run that drew some figures or none (``figures`` not ``True``) left in ``fig_dir``: an earlier
    analysis's figures, not redrawn."""
    names = {f.name for f in drawn}
    kept = [f.stem for f in fig_dir.glob("*.png") if f.stem not in names] if fig_dir.is_dir() else []
    if not kept:
        return None
    how = "--no-figures" if not drawn else "--figures"
    return (f"Figures not drawn ({how}): figures/ keeps the {len(kept)} figure(s) of an earlier analysis, "
            "drawn from the tables as they were then.")
