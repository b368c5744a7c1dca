"""The analysis of one study directory: tables (CSV + Markdown), figures (PNG + SVG) and notes.

:func:`run_analysis` reads the Parquet tables (:mod:`raystudy.analysis.inputs`), computes every table
(:mod:`raystudy.analysis.tables`, :mod:`raystudy.analysis.stats`), writes them to ``<out>/<name>.csv``
(fractions, full precision) and ``<out>/<name>.md`` (percent), draws the figures into ``<out>/figures/``
and returns everything the HTML report needs. ``<out>`` defaults to ``<study_dir>/analysis``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from raystudy import storage
from raystudy.analysis import beyond as B
from raystudy.analysis import change as CH
from raystudy.analysis import control as C
from raystudy.analysis import pretraining as P
from raystudy.analysis import render as R
from raystudy.analysis import selection as S
from raystudy.analysis import vtab as V
from raystudy.analysis.figure_jobs import FigureInfo, chosen_figures, draw_figures, figure_jobs, kept_figures_note
from raystudy.analysis.inputs import FINAL, SEARCH, StudyInputs, only_seeds, read_studies
from raystudy.analysis.options import (
    DEFAULT_ALTERNATIVE,
    DEFAULT_FIXED_RUN,
    DEFAULT_PAIR_BY,
    DEFAULT_REFERENCE,
    DEFAULT_ROUND,
    DEFAULT_SEEDS,
    DEFAULT_SELECT_BY,
    check_options,
    check_subset,
    output_folder,
)
from raystudy.analysis.stats import (
    canonical_reference,
    configuration_order,
    ranking_table,
    reference_in,
    wilcoxon_table,
)
from raystudy.analysis.tables import (
    best_lr_table,
    cost_table,
    lr_grid_table,
    optimizer_table,
    overall_table,
    phase_of,
    relative_gain_table,
    reported_accuracies,
    shared_subset,
    stability_table,
)
from raystudy.faults import injected
from raystudy.vocab import LINEAR_PROBE

log = logging.getLogger(__name__)

#: The files of every table: CSV (fractions, full precision), Markdown and LaTeX (booktabs; percent).
TABLE_FORMATS = (".csv", ".md", ".tex")
#: Every table the analysis can write, in report order.
TABLES = ("best_lr", "lr_grid", "overall", "relative_gain", "optimizers", "wilcoxon", "stability", "ranking",
          *B.TABLES, *S.TABLES, *CH.TABLES, *V.TABLES, *C.TABLES, *P.TABLES, "cost")


@dataclass
class AnalysisResult:
    study_dir: str
    out_dir: Path
    inputs: StudyInputs
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    rendered: dict[str, R.Rendered] = field(default_factory=dict)
    figures: list[FigureInfo] = field(default_factory=list)  # the figures drawn
    available_figures: list[str] = field(default_factory=list)  # every figure the study allows, drawn or not
    notes: list[str] = field(default_factory=list)
    footnote: str = ""
    options: dict = field(default_factory=dict)
    upload_to: str | None = None  # the URI the local ``out_dir`` is mirrored to, if any

    @property
    def files(self) -> list[Path]:
        out = []
        for name in list(self.tables) + (["excluded"] if (self.out_dir / "excluded.csv").exists() else []):
            out += [self.out_dir / f"{name}{ext}" for ext in TABLE_FORMATS]
        for f in self.figures:
            out += f.paths
        return out


def _gain_notes(gain: pd.DataFrame | None, inputs: StudyInputs, notes: list[str]) -> None:
    """Say which baseline the relative gain uses, and when it is omitted."""
    if gain is None:
        notes.append(f"No {LINEAR_PROBE} (linear probe) rows and no Head trials: the relative-gain table and "
                     "figure are omitted.")
    elif gain["reference"].iloc[0] != LINEAR_PROBE:
        notes.append(f"No {LINEAR_PROBE} (linear probe) rows: the relative gain uses Head (an SGD-trained "
                     "classifier on the frozen backbone) as its reference instead of the authors' linear probe.")
    else:
        missing = sorted(set(inputs.counted["dataset"]) - set(inputs.probes["dataset"]))
        if missing:
            notes.append(f"No {LINEAR_PROBE} row for dataset(s) {missing}: left out of the relative gain.")


def _subset_notes(tables: dict, counted: pd.DataFrame, notes: list[str]) -> None:
    if "optimizers" not in tables and counted["optimizer"].nunique() > 1:
        notes.append("No dataset and seed on which every optimizer ran: the optimizer comparison is omitted.")
    counts = tables["overall"].groupby("optimizer")["n_datasets"].agg(["min", "max"])
    for opt, r in counts.iterrows():
        if r["min"] != r["max"]:
            notes.append(f"{opt}: not every configuration has counted trials on every dataset "
                         f"({r['min']}–{r['max']} datasets); overall means cover different datasets.")


def _spread_notes(counted: pd.DataFrame, notes: list[str]) -> None:
    """Spreads that are 0 because nothing varied: one learning rate (and one seed) per configuration."""
    per = counted.groupby([c for c in ("model", "dataset", "optimizer", "configuration") if c in counted.columns])
    if per.size().max() <= 1:
        notes.append("Each configuration ran one learning rate and one seed per dataset: the spreads of the "
                     "learning-rate grid and of the stability table are 0 by construction, not a measured "
                     "stability.")
    elif per["lr"].nunique().max() <= 1:
        notes.append("Each configuration ran one learning rate per dataset: the learning-rate grid's spread is 0 "
                     "by construction.")


def _accuracy_tables(ok: pd.DataFrame, inputs: StudyInputs, notes: list[str], select_by: str = DEFAULT_SELECT_BY,
                     **options) -> dict:
    """The tables built on the counted trials' accuracies (every one but ``cost``); omitted ones noted. The lr
    search's own (``best_lr``, ``lr_grid``, ``stability``) read the search trials, every other one the
    accuracies the report answers from (:func:`~raystudy.analysis.tables.reported_accuracies`: the final fit
    where the study has one)."""
    tables = {"best_lr": best_lr_table(ok, inputs.probes, select_by), "lr_grid": lr_grid_table(ok)}
    reported, rows, _phase = reported_accuracies(tables["best_lr"], ok, inputs.final, inputs.probes, notes)
    tables["overall"] = overall_table(reported, tables["lr_grid"], ok)
    gain = relative_gain_table(reported, ok)
    _gain_notes(gain, inputs, notes)
    if gain is not None:
        tables["relative_gain"] = gain
    optimizers = optimizer_table(ok)
    if optimizers is not None:
        tables["optimizers"] = optimizers
    wilcoxon = wilcoxon_table(reported, rows, probes=inputs.probes, **options)
    if len(wilcoxon):
        tables["wilcoxon"] = wilcoxon
    else:
        ref = options["reference"]
        notes.append(f"No {ref} trials: the Wilcoxon tests against {ref} are omitted.")
    tables["stability"] = stability_table(ok)
    _spread_notes(ok, notes)
    if inputs.plasticity is not None:
        ranking = ranking_table(inputs.plasticity, reported, ok, notes)
        if ranking is not None:
            tables["ranking"] = ranking
    _subset_notes(tables, ok, notes)
    if B.has_expressions(ok):  # configuration expressions: frontier, matched budgets, unit gains
        tables.update(B.beyond_tables(reported, rows, inputs.plasticity, notes))
    return tables


def lr_rules(select_by: str | None) -> tuple[str, str]:
    """``(the paper's tables' rule, VTAB-1k's table's rule)``: ``select_by`` for both, or by default test
    (:data:`~raystudy.analysis.options.DEFAULT_SELECT_BY`) and validation
    (:data:`raystudy.analysis.vtab.VTAB_SELECT_BY`)."""
    return (select_by or DEFAULT_SELECT_BY, select_by or V.VTAB_SELECT_BY)


def study_reference(reference: str, inputs: StudyInputs) -> str:
    """``reference`` as the study spells it (``FC1+MHA`` -> the study's ``MHA+FC1``: canonical spellings
    compared). One the study does not have is an error naming the configurations it has; the default
    reference, ``MHA``, absent from a study that never trained it, stays as given (the tests are omitted, noted)."""
    if inputs.counted is None or inputs.counted.empty:
        return reference
    probes = inputs.probes if inputs.probes is not None else inputs.counted.iloc[0:0]
    have = configuration_order(set(inputs.counted["configuration"]) | set(probes["configuration"]))
    found = reference_in(reference, have)
    if found is None and reference != DEFAULT_REFERENCE:
        raise ValueError(f"reference: {reference!r} is not a configuration of {inputs.study_dir} (canonical "
                         f"spellings compared); its configurations: {', '.join(have)}")
    return found or reference


def compute_tables(inputs: StudyInputs, *, reference: str = DEFAULT_REFERENCE,
                   alternative: str = DEFAULT_ALTERNATIVE, pair_by: str = DEFAULT_PAIR_BY,
                   round_to: int | None = DEFAULT_ROUND, notes: list[str] | None = None,
                   select_by: str | None = None) -> dict[str, pd.DataFrame]:
    """Every table computable from ``inputs`` (pure: writes nothing). Omitted ones are explained in ``notes``;
    ``select_by``: how each sweep's best lr is chosen (:data:`~raystudy.vocab.SELECT_BY`; None:
    test for the paper's tables, validation for VTAB-1k's, :func:`lr_rules`)."""
    check_options(reference, alternative, pair_by, round_to, select_by)
    canonical_reference(reference)
    notes = notes if notes is not None else []
    # the plasticity measurement's own: also without trials
    control = {**C.control_tables(inputs, notes), **P.pretraining_tables(inputs, notes)}
    if inputs.trials is None:
        return control
    ok = inputs.counted
    if ok is None or ok.empty:
        notes.append("No trial has a counted test accuracy: the accuracy tables and figures are omitted.")
        return {**control, "cost": cost_table(inputs.trials, inputs.trials.iloc[0:0], inputs.probes)}
    reference = study_reference(reference, inputs)
    paper_rule, vtab_rule = lr_rules(select_by)
    tables = _accuracy_tables(ok, inputs, notes, paper_rule, reference=reference, alternative=alternative,
                              pair_by=pair_by, round_to=round_to)
    if V.is_vtab(ok):
        tables.update(V.vtab_tables(ok, inputs.probes, inputs.final, vtab_rule, notes))
    if S.has_criteria(ok):  # plasticity against the selection criteria at matched budgets
        tables.update(S.selection_tables(tables["best_lr"], inputs, (paper_rule, vtab_rule), notes))
    tables.update(CH.change_tables(inputs, tables["best_lr"], notes))  # what finetuning changed
    tables["cost"] = cost_table(inputs.trials, ok, inputs.probes)
    tables.update(control)
    return {k: tables[k] for k in TABLES if k in tables}


#: The tables of the lr search itself (and of its trials' changes and cost): in a study with a final fit they read
#: the search trials, every other accuracy table the final fit (:func:`~raystudy.analysis.tables.reported_accuracies`).
SEARCH_TABLES = ("best_lr", "lr_grid", "stability", "optimizers", *CH.TABLES, "cost")
#: Tables without accuracies (the plasticity measurement): no phase.
PHASELESS_TABLES = C.TABLES


def _phase_footnote(name: str, inputs: StudyInputs) -> str | None:
    """The phase note of table ``name`` in a study with a final fit (:func:`~raystudy.analysis.render.phase_note`)."""
    if phase_of(inputs.final) != FINAL or name in PHASELESS_TABLES:
        return None
    return R.phase_note(SEARCH if name in SEARCH_TABLES else FINAL)


def render_tables(tables: dict[str, pd.DataFrame], inputs: StudyInputs, *, reference: str, alternative: str,
                  pair_by: str, footnote: str, round_to: int | None = None,
                  select_by: str | None = None) -> dict[str, R.Rendered]:
    out: dict[str, R.Rendered] = {}
    for name, df in tables.items():
        if name == "overall":
            r = R.render_overall(df, tables.get("wilcoxon"), reference)
        elif name == "wilcoxon":
            r = R.render_wilcoxon(df, alternative=alternative, pair_by=pair_by, reference=reference, round_to=round_to)
        elif name == "cost":
            r = R.render_cost(df, inputs.trials)
        elif name == "best_lr":
            r = R.render_best_lr(df, lr_rules(select_by)[0])
        elif name == "optimizers":
            r = R.render_optimizers(df, shared_subset(inputs.counted))
        elif name in CH.TABLES:
            r = getattr(CH, f"render_{name}")(df)
        elif name in B.TABLES:
            r = getattr(B, f"render_{name}")(df)
        elif name in S.TABLES:
            r = getattr(S, f"render_{name}")(df)
        elif name in V.TABLES:
            r = getattr(V, f"render_{name}")(df)
        elif name in C.TABLES:
            r = getattr(C, f"render_{name}")(df)
        elif name in P.TABLES:
            r = getattr(P, f"render_{name}")(df)
        else:
            r = getattr(R, f"render_{name}")(df)
        if footnote and name != "cost":
            r.footnotes.append(footnote)
        phase = _phase_footnote(name, inputs)
        if phase:
            r.footnotes.append(phase)
        out[name] = r
    return out


def _clean(out_dir: Path, fig_dir: Path | None) -> None:
    """Remove outputs of an earlier run (only names this module writes; the figures unless ``fig_dir`` is
    None), so nothing stale survives."""
    for name in (*TABLES, "excluded", "notes"):
        for ext in TABLE_FORMATS:
            (out_dir / f"{name}{ext}").unlink(missing_ok=True)
    if fig_dir is not None and fig_dir.is_dir():
        for f in fig_dir.iterdir():
            if f.suffix in (".png", ".svg"):
                f.unlink()


def _write_tables(res: AnalysisResult) -> None:
    """Per table ``<name>.csv`` (fractions, full precision), ``<name>.md`` and ``<name>.tex`` (percent, the same
    cells: :meth:`~raystudy.analysis.render.Rendered.markdown`, :meth:`~raystudy.analysis.render.Rendered.latex`)."""
    out, excluded = res.out_dir, res.inputs.excluded
    tables = [(name, df, res.rendered[name]) for name, df in res.tables.items()]
    if excluded is not None and len(excluded):
        tables.append(("excluded", excluded, R.render_excluded(excluded)))
    for name, df, rendered in tables:
        storage.write_text_atomic(out / f"{name}.csv", df.to_csv(index=False))
        storage.write_text_atomic(out / f"{name}.md", rendered.markdown())
        storage.write_text_atomic(out / f"{name}.tex", rendered.latex())


def _write_notes(res: AnalysisResult) -> None:
    """``notes.md``: one list item per note (escaped: notes quote dataset and model names)."""
    notes = res.notes + ([res.footnote] if res.footnote else [])
    lines = ["# Analysis notes", ""] + [f"- {R.md_escape(n)}" for n in notes]
    storage.write_text_atomic(res.out_dir / "notes.md", "\n".join(lines) + "\n")


def _seeds_noted(inputs: StudyInputs, seeds, notes: list[str]) -> StudyInputs:
    """``inputs`` of ``seeds`` alone (:func:`raystudy.analysis.inputs.only_seeds`), with a note of what was left."""
    kept = only_seeds(inputs, seeds)
    left = len(inputs.trials) - len(kept.trials)
    notes.append(f"Seeds {', '.join(map(str, seeds))} only (option seeds): {left} trial(s) of other seeds are left "
                 "out of every table and figure.")
    return kept


def study_dirs(study_dir) -> list[str]:
    """One study directory or several (a list), as given (:func:`~raystudy.analysis.inputs.read_studies`
    resolves them: the printed paths stay the ones typed)."""
    many = study_dir if isinstance(study_dir, list | tuple) else [study_dir]
    if not many:
        raise ValueError("study_dir: at least one study directory")
    return [str(d) for d in many]


def run_analysis(study_dir: str | os.PathLike | list, *, reference: str = DEFAULT_REFERENCE,
                 alternative: str = DEFAULT_ALTERNATIVE, pair_by: str = DEFAULT_PAIR_BY,
                 round_to: int | None = DEFAULT_ROUND, out_dir: str | os.PathLike | None = None,
                 figures: bool | Collection[str] = True, seeds: list[int] | None = DEFAULT_SEEDS,
                 fixed_run: dict | list | None = DEFAULT_FIXED_RUN, select_by: str | None = None) -> AnalysisResult:
    """Read ``study_dir``, write every table and figure to ``out_dir``; returns all of it.

    ``study_dir``: one study directory, or a list of several analysed together (their tables concatenated,
    :func:`raystudy.analysis.inputs.read_studies`; ``out_dir`` then required). ``out_dir`` defaults to
    ``<study_dir>/analysis``; a URI there (or a URI study directory) is written
    through a local staging folder (``res.out_dir``) and uploaded (``res.upload_to``). ``seeds``: only these
    seeds' trials enter the tables and figures (the paper's Table 9: ``[0]``); ``fixed_run``: ``{dataset,
    seed, lr}`` (and perhaps ``optimizer``), or a list of them, whose runs' curves are drawn beside the best
    runs' (the paper's Figs. 5 and 54); ``select_by`` (None:
    :func:`lr_rules`' defaults): each
    sweep's best lr by mean ``"test"`` accuracy (the paper's rule) or mean best-``"val"`` accuracy.
    """
    check_options(reference, alternative, pair_by, round_to, select_by)
    canonical_reference(reference)
    check_subset(seeds, fixed_run)
    options = dict(reference=reference, alternative=alternative, pair_by=pair_by, round_to=round_to,
                   select_by=select_by)
    dirs = study_dirs(study_dir)
    target = output_folder(dirs, out_dir)
    inputs = read_studies(dirs)
    problem = storage.folder_problem(target)  # a file on the way, no permission: refused before any table
    if problem:
        raise ValueError(f"out_dir (--out): {problem}")
    _test_hold()
    out, uri = storage.staged(target, prefix="raystudy-analysis-")
    res = AnalysisResult(", ".join(dirs), out, inputs, notes=list(inputs.notes), upload_to=uri,
                         options={**options, "seeds": seeds, "fixed_run": fixed_run})
    if seeds is not None and inputs.trials is not None:
        res.inputs = inputs = _seeds_noted(inputs, seeds, res.notes)
    res.options["reference"] = options["reference"] = study_reference(reference, inputs)
    res.tables = compute_tables(inputs, notes=res.notes, **options)
    if inputs.excluded is not None and len(inputs.excluded):
        res.footnote = R.excluded_footnote(len(inputs.trials), inputs.excluded)
    res.rendered = render_tables(res.tables, inputs, footnote=res.footnote, **options)
    every = figure_jobs(inputs, res.tables, res.notes, fixed_run)
    res.available_figures = [name for name, *_ in every]
    jobs = chosen_figures(every, figures)
    _clean(out, (out / "figures") if figures is True else None)  # a selection, or none, keeps the others
    _write_tables(res)
    res.figures = draw_figures(jobs, out / "figures")
    kept = kept_figures_note(out / "figures", res.figures) if figures is not True else None
    if kept:
        res.notes.append(kept)
    _write_notes(res)
    storage.publish(out, uri)
    for n in res.notes:
        log.debug("%s", n)
    return res


def _test_hold() -> None:
    """The test fault ``hold_analysis`` (:mod:`raystudy.faults`): create the file it names, then wait 120 s."""
    marker = injected("hold_analysis")
    if marker:
        Path(marker).touch()
        time.sleep(120)


def analyze(study_dir: str | os.PathLike, *, reference: str = DEFAULT_REFERENCE,
            alternative: str = DEFAULT_ALTERNATIVE, pair_by: str = DEFAULT_PAIR_BY,
            round_to: int | None = DEFAULT_ROUND, out_dir: str | os.PathLike | None = None,
            figures: bool | Collection[str] = True, seeds: list[int] | None = DEFAULT_SEEDS,
            fixed_run: dict | list | None = DEFAULT_FIXED_RUN, select_by: str | None = None) -> dict[str, pd.DataFrame]:
    """Analyse a study directory; write tables (CSV + Markdown) and figures under ``<study_dir>/analysis``.

    Returns the tables by name (``best_lr, lr_grid, overall, relative_gain, optimizers, wilcoxon, stability,
    ranking, cost``; the ones the inputs do not allow are absent and explained in ``analysis/notes.md``).
    ``reference``: the configuration the Wilcoxon tests compare against; ``alternative``: ``"greater"``
    (the reference is better), ``"two-sided"`` or ``"less"``; ``pair_by``: ``"dataset"`` (best-lr means)
    or ``"dataset_seed"``; ``round_to``: test the accuracies rounded to that many decimals of a percent (the
    paper's authors: 2). ``out_dir``: another folder or URI for the outputs. ``seeds``, ``fixed_run`` and
    ``select_by``: as :func:`run_analysis`.
    """
    return run_analysis(study_dir, reference=reference, alternative=alternative, pair_by=pair_by,
                        round_to=round_to, out_dir=out_dir, figures=figures, seeds=seeds, fixed_run=fixed_run,
                        select_by=select_by).tables
