"""The analysis of one study directory: tables (CSV + Markdown), figures (PNG + SVG) and notes.

:func:`run_analysis` reads the Parquet tables (:mod:`raystudy.analysis.inputs`), computes every table
(:mod:`raystudy.analysis.tables`, :mod:`raystudy.analysis.stats`), writes them to ``<out>/<name>.csv``
(fractions, full precision) and ``<out>/<name>.md`` (percent), draws the figures into ``<out>/figures/``
and returns everything the HTML report needs. ``<out>`` defaults to ``<study_dir>/analysis``.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pyarrow.fs as pafs
from tqdm.auto import tqdm

from raystudy.analysis import figures as F
from raystudy.analysis import render as R
from raystudy.analysis.inputs import StudyInputs, load_study
from raystudy.analysis.stats import check_options, ranking_table, wilcoxon_table
from raystudy.analysis.tables import (
    best_lr_table,
    cost_table,
    lr_grid_table,
    overall_table,
    relative_gain_table,
    stability_table,
)

log = logging.getLogger(__name__)

#: Every table the analysis can write, in report order.
TABLES = ("best_lr", "lr_grid", "overall", "relative_gain", "wilcoxon", "stability", "ranking", "cost")


@dataclass
class FigureInfo:
    name: str
    title: str
    caption: str
    paths: list[Path]


@dataclass
class AnalysisResult:
    study_dir: str
    out_dir: Path
    inputs: StudyInputs
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    rendered: dict[str, R.Rendered] = field(default_factory=dict)
    figures: list[FigureInfo] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    footnote: str = ""
    options: dict = field(default_factory=dict)
    upload_to: str | None = None  # the URI the local ``out_dir`` is mirrored to, if any

    @property
    def files(self) -> list[Path]:
        out = []
        for name in list(self.tables) + (["excluded"] if (self.out_dir / "excluded.csv").exists() else []):
            out += [self.out_dir / f"{name}.csv", self.out_dir / f"{name}.md"]
        for f in self.figures:
            out += f.paths
        return out


def write_text_atomic(path: Path, text: str) -> Path:
    """Write ``text`` to a temporary file beside ``path`` and rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def output_target(study_dir: str | os.PathLike, out_dir: str | os.PathLike | None) -> tuple[Path, str | None]:
    """Where outputs are written: ``(local folder, URI to upload it to or None)``.

    Default ``<study_dir>/analysis``. Matplotlib writes local files, so for a URI (``s3://...``, ``gs://...``,
    ``file://...``) everything is staged in a local temporary folder and uploaded with pyarrow afterwards.
    """
    target = str(out_dir) if out_dir is not None else f"{str(study_dir).rstrip('/')}/analysis"
    if "://" in target:
        return Path(tempfile.mkdtemp(prefix="raystudy-analysis-")), target
    return Path(target), None


def publish(local: Path, uri: str | None) -> None:
    """Replace the contents of ``uri`` by those of the local folder ``local`` (no-op without a URI)."""
    if uri is None:
        return
    fs, path = pafs.FileSystem.from_uri(uri)
    fs.create_dir(path, recursive=True)
    fs.delete_dir_contents(path, missing_dir_ok=True)
    pafs.copy_files(str(local.absolute()), path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)


def _slug(*parts) -> str:
    return "_".join(re.sub(r"[^A-Za-z0-9.+-]+", "-", str(p)).strip("-") for p in parts if str(p))


def compute_tables(inputs: StudyInputs, *, reference: str = "MHA", alternative: str = "greater",
                   pair_by: str = "dataset", notes: list[str] | None = None) -> dict[str, pd.DataFrame]:
    """Every table computable from ``inputs`` (pure: writes nothing). Omitted ones are explained in ``notes``."""
    check_options(reference, alternative, pair_by)
    notes = notes if notes is not None else []
    tables: dict[str, pd.DataFrame] = {}
    ok = inputs.trials_ok
    if inputs.trials is None:
        return tables
    if ok is None or ok.empty:
        notes.append("No trial has status ok: the accuracy tables and figures are omitted.")
        tables["cost"] = cost_table(inputs.trials, inputs.trials.iloc[0:0])
        return tables
    tables["best_lr"] = best_lr_table(ok)
    tables["lr_grid"] = lr_grid_table(ok)
    wilcoxon = wilcoxon_table(tables["best_lr"], ok, reference=reference, alternative=alternative, pair_by=pair_by)
    tables["overall"] = overall_table(tables["best_lr"], tables["lr_grid"], ok)
    gain = relative_gain_table(tables["best_lr"], ok)
    if gain is not None:
        tables["relative_gain"] = gain
    else:
        notes.append("No Head (linear probing) trials: the relative-gain table and figure are omitted.")
    if len(wilcoxon):
        tables["wilcoxon"] = wilcoxon
    else:
        notes.append(f"No {reference} trials: the Wilcoxon tests against {reference} are omitted.")
    tables["stability"] = stability_table(ok)
    if inputs.plasticity is not None:
        ranking = ranking_table(inputs.plasticity, tables["best_lr"], ok, notes)
        if ranking is not None:
            tables["ranking"] = ranking
    tables["cost"] = cost_table(inputs.trials, ok)
    counts = tables["overall"].groupby("optimizer")["n_datasets"].agg(["min", "max"])
    for opt, r in counts.iterrows():
        if r["min"] != r["max"]:
            notes.append(f"{opt}: not every configuration has ok trials on every dataset "
                         f"({r['min']}–{r['max']} datasets); overall means cover different datasets.")
    return {k: tables[k] for k in TABLES if k in tables}


def render_tables(tables: dict[str, pd.DataFrame], inputs: StudyInputs, *, reference: str, alternative: str,
                  pair_by: str, footnote: str) -> dict[str, R.Rendered]:
    out: dict[str, R.Rendered] = {}
    for name, df in tables.items():
        if name == "overall":
            r = R.render_overall(df, tables.get("wilcoxon"), reference)
        elif name == "wilcoxon":
            r = R.render_wilcoxon(df, alternative=alternative, pair_by=pair_by, reference=reference)
        elif name == "cost":
            r = R.render_cost(df, inputs.trials)
        else:
            r = getattr(R, f"render_{name}")(df)
        if footnote and name != "cost":
            r.footnotes.append(footnote)
        out[name] = r
    return out


def draw_figures(inputs: StudyInputs, tables: dict[str, pd.DataFrame], fig_dir: Path,
                 notes: list[str]) -> list[FigureInfo]:
    """Draw every figure the inputs allow into ``fig_dir`` (PNG + SVG each)."""
    jobs = []  # (name, title, caption, callable(stem) -> paths)
    p, ok = inputs.plasticity, inputs.trials_ok
    if p is not None:
        jobs.append(("plasticity_depth", "Plasticity across depth",
                     "Mean rate ||f(x) − f(y)||_F / ||x − y||_F per layer and component with its 95% interval; "
                     "the dotted line marks plasticity 1.", lambda s: F.plot_plasticity_depth(p, s)))
        if inputs.rates is not None:
            rates = inputs.rates
            jobs.append(("plasticity_distribution", "Distribution of per-pair rates",
                         "Per-pair rates of each component, pooled over layers (violin, quartiles, median).",
                         lambda s: F.plot_rate_distribution(rates, s)))
        else:
            jobs.append(("plasticity_distribution", "Distribution of plasticity over layers",
                         "Per-layer plasticity of each component (no rates.parquet: the per-pair rates were not "
                         "kept).", lambda s: F.plot_plasticity_layers(p, s)))
    if inputs.bounds is not None:
        b = inputs.bounds
        jobs.append(("bounds", "Upper bounds and measured plasticity",
                     "Theoretical upper bounds (dashed) next to the measured plasticity (solid), log scale.",
                     lambda s: F.plot_bounds(b, p, s)))
    if ok is not None and len(ok):
        jobs.append(("accuracy_distribution", "Test accuracy over learning rates × seeds",
                     "Every ok trial of each configuration (dots) with its distribution.",
                     lambda s: F.plot_accuracy_distribution(ok, s)))
        if "relative_gain" in tables:
            g = tables["relative_gain"]
            jobs.append(("relative_gain", "Relative gain over linear probing",
                         "(acc − acc_Head) / acc_Head of the best-lr accuracies, per dataset and overall.",
                         lambda s: F.plot_relative_gain(g, s)))
        if inputs.curves is not None:
            runs = F.best_runs(ok)
            many_models = runs["model"].nunique() > 1
            for (model, ds, opt), rr in runs.groupby(["model", "dataset", "optimizer"], sort=True):
                missing = set(rr["trial_id"]) - set(inputs.curves["trial_id"])
                if missing == set(rr["trial_id"]):
                    notes.append(f"curves.parquet has no rows for the best runs on {ds} / {opt}.")
                    continue
                label = f"{model} · {ds} · {opt}" if many_models else f"{ds} · {opt}"
                stem = _slug("curves", model, ds, opt) if many_models else _slug("curves", ds, opt)
                c = inputs.curves
                jobs.append((stem, f"Gradient norm and validation loss — {label}",
                             f"Best run (highest test accuracy) of each configuration on {label}.",
                             lambda s, c=c, rr=rr, label=label: F.plot_curves(c, rr, s, title=label)))
    figs = []
    for name, title, caption, draw in tqdm(jobs, desc="figures", unit="fig", leave=False):
        figs.append(FigureInfo(name, title, caption, draw(fig_dir / name)))
    return figs


def _clean(out_dir: Path, fig_dir: Path) -> None:
    """Remove outputs of an earlier run (only names this module writes), so nothing stale survives."""
    for name in (*TABLES, "excluded", "notes"):
        for ext in (".csv", ".md"):
            (out_dir / f"{name}{ext}").unlink(missing_ok=True)
    if fig_dir.is_dir():
        for f in fig_dir.iterdir():
            if f.suffix in (".png", ".svg"):
                f.unlink()


def run_analysis(study_dir: str | os.PathLike, *, reference: str = "MHA", alternative: str = "greater",
                 pair_by: str = "dataset", out_dir: str | os.PathLike | None = None,
                 figures: bool = True) -> AnalysisResult:
    """Read ``study_dir``, write every table and figure to ``out_dir``; returns all of it.

    ``out_dir`` defaults to ``<study_dir>/analysis``; a URI there (or a URI study directory) is written
    through a local staging folder (``res.out_dir``) and uploaded (``res.upload_to``).
    """
    check_options(reference, alternative, pair_by)
    inputs = load_study(study_dir)
    out, uri = output_target(study_dir, out_dir)
    res = AnalysisResult(str(study_dir), out, inputs, notes=list(inputs.notes), upload_to=uri,
                         options=dict(reference=reference, alternative=alternative, pair_by=pair_by))
    res.tables = compute_tables(inputs, reference=reference, alternative=alternative, pair_by=pair_by,
                                notes=res.notes)
    if inputs.excluded is not None and len(inputs.excluded):
        res.footnote = R.excluded_footnote(len(inputs.trials), inputs.excluded)
    res.rendered = render_tables(res.tables, inputs, reference=reference, alternative=alternative,
                                 pair_by=pair_by, footnote=res.footnote)
    fig_dir = out / "figures"
    _clean(out, fig_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, df in res.tables.items():
        write_text_atomic(out / f"{name}.csv", df.to_csv(index=False))
        write_text_atomic(out / f"{name}.md", res.rendered[name].markdown())
    if inputs.excluded is not None and len(inputs.excluded):
        write_text_atomic(out / "excluded.csv", inputs.excluded.to_csv(index=False))
        write_text_atomic(out / "excluded.md", R.render_excluded(inputs.excluded).markdown())
    if figures:
        res.figures = draw_figures(inputs, res.tables, fig_dir, res.notes)
    lines = ["# Analysis notes", ""] + [f"- {n}" for n in res.notes + ([res.footnote] if res.footnote else [])]
    write_text_atomic(out / "notes.md", "\n".join(lines) + "\n")
    publish(out, uri)
    for n in res.notes:
        log.debug("%s", n)
    return res


def analyze(study_dir: str | os.PathLike, *, reference: str = "MHA", alternative: str = "greater",
            pair_by: str = "dataset", out_dir: str | os.PathLike | None = None,
            figures: bool = True) -> dict[str, pd.DataFrame]:
    """Analyse a study directory; write tables (CSV + Markdown) and figures under ``<study_dir>/analysis``.

    Returns the tables by name (``best_lr, lr_grid, overall, relative_gain, wilcoxon, stability, ranking,
    cost``; the ones the inputs do not allow are absent and explained in ``analysis/notes.md``).
    ``reference``: the configuration the Wilcoxon tests compare against; ``alternative``: ``"greater"``
    (the reference is better), ``"two-sided"`` or ``"less"``; ``pair_by``: ``"dataset"`` (best-lr means)
    or ``"dataset_seed"``.
    """
    return run_analysis(study_dir, reference=reference, alternative=alternative, pair_by=pair_by,
                        out_dir=out_dir, figures=figures).tables
