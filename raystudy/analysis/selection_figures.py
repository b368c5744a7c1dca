"""The units figure of the selection criteria: which (component, block) units each criterion chose, per dataset.

One figure per (model,) budget at the units granularity: a heatmap panel per dataset (small multiples, one
under the other), a row per criterion (:data:`~raystudy.analysis.selection.CRITERION_ORDER`), a column per unit
ordered by block, then component (LN1 MHA LN2 FC1 FC2 within a block), the cell's shade the fraction of seeds
whose selection contains the unit (:func:`raystudy.analysis.selection.unit_frequency`, drawn from
:func:`frequency_matrix`): 1 for a unit a deterministic criterion chose, a fraction for ``random``'s.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from raystudy.analysis import figures as F
from raystudy.analysis.selection import (
    CRITERION_ORDER,
    REFERENCE,
    seed_selections,
    study_root,
    unit_frequency,
)
from raystudy.analysis.style import FONT, styled
from raystudy.analysis.tables import OVERALL, phase_rows
from raystudy.vocab import COMPONENTS

#: The colour map of the selection frequency (sequential, colour-blind safe, light = never chosen).
FREQUENCY_CMAP = "Blues"
#: The colour of the lines between blocks (visible on the map's white and on its darkest blue).
BLOCK_LINE = "#888888"
#: The names of this module's figures start so (``criteria_units_5pct``); the report shows them in its section.
FIGURE_PREFIX = "criteria_units"
#: Up to this many units every column is labelled ``MHA@3``; beyond, the block numbers alone.
MAX_UNIT_LABELS = 30


def unit_columns(depth: int) -> list[str]:
    """``["LN1@0", "MHA@0", ..., "FC2@<depth-1>"]``: the units by block, then component."""
    return [f"{c}@{b}" for b in range(depth) for c in COMPONENTS]


def frequency_matrix(freq: pd.DataFrame, dataset: str) -> pd.DataFrame:
    """The panel of ``dataset``: rows the criteria present (:data:`CRITERION_ORDER`), columns
    :func:`unit_columns`, values the selection frequency over seeds. ``freq``: one model and budget of
    :func:`~raystudy.analysis.selection.unit_frequency`."""
    f = freq[freq["dataset"] == dataset]
    depth = int(freq["block"].max()) + 1
    crits = [c for c in CRITERION_ORDER if c in set(f["criterion"])]
    out = pd.DataFrame(np.nan, index=crits, columns=unit_columns(depth))
    for r in f.itertuples():
        out.loc[r.criterion, f"{r.component}@{r.block}"] = float(r.frequency)
    return out


def _label(criterion: str) -> str:
    return f"{criterion} (plasticity)" if criterion == REFERENCE else criterion


def _panel(ax, m: pd.DataFrame, title: str):
    """One dataset's heatmap: white lines between blocks, block numbers (or unit names) on the x axis."""
    image = ax.imshow(m.to_numpy(float), cmap=FREQUENCY_CMAP, vmin=0, vmax=1, aspect="auto",
                      interpolation="nearest")
    n_comp, depth = len(COMPONENTS), m.shape[1] // len(COMPONENTS)
    for b in range(1, depth):
        ax.axvline(b * n_comp - 0.5, color=BLOCK_LINE, lw=0.8)
    ax.set_yticks(range(len(m.index)), [_label(c) for c in m.index])
    if m.shape[1] <= MAX_UNIT_LABELS:
        ax.set_xticks(range(m.shape[1]), list(m.columns), rotation=90, fontsize=FONT["small"])
    else:
        ax.set_xticks([b * n_comp + (n_comp - 1) / 2 for b in range(depth)], [str(b) for b in range(depth)])
        ax.set_xlabel(f"block (units within a block: {' '.join(COMPONENTS)})")
    ax.set_title(title)
    return image


@styled
def plot_unit_frequency(freq: pd.DataFrame, path_stem: str | Path, *, title: str = "") -> list[Path]:
    """The units figure of one (model,) budget (module docstring); ``freq``: its rows of
    :func:`~raystudy.analysis.selection.unit_frequency`. Writes PNG and SVG, returns both paths."""
    F._require(freq, ["dataset", "criterion", "block", "component", "frequency"], "unit frequency")
    datasets = sorted(set(freq["dataset"].astype(str)) - {OVERALL})
    n_units = (int(freq["block"].max()) + 1) * len(COMPONENTS)
    n_crit = freq["criterion"].nunique()
    width = min(16.0, max(6.5, 2.5 + 0.2 * n_units))
    fig, axes = F._grid(len(datasets), width=width, height=0.9 + 0.32 * n_crit, max_cols=1)
    image = None
    for ax, ds in zip(axes, datasets):
        image = _panel(ax, frequency_matrix(freq, ds), ds)
    fig.colorbar(image, ax=axes, shrink=min(1.0, 3.0 / len(axes) + 0.2), label="selection frequency over seeds")
    F._title(fig, title or "Units each criterion chose", "")
    return F.save_figure(fig, path_stem)


def figure_jobs(inputs, slug) -> list[tuple]:
    """``(name, title, caption, draw)`` per (model,) budget with units (the selections of the trials of the phase
    the report answers from, :func:`~raystudy.analysis.tables.phase_rows`:
    :func:`~raystudy.analysis.selection.seed_selections`), for the analysis pipeline."""
    freq = unit_frequency(seed_selections(phase_rows(inputs.final, inputs.counted), study_root(inputs)))
    many = freq["model"].nunique() > 1
    jobs = []
    for (model, budget), rows in freq.groupby(["model", "budget"], sort=False):
        parts = (model, budget) if many else (budget,)
        title = f"Units each criterion chose — {' · '.join(map(str, parts))}"
        jobs.append((FIGURE_PREFIX + "_" + slug(*(str(p).replace("%", "pct") for p in parts)), title,
                     "Per dataset, a row per criterion and a column per (component, block) unit ordered by block, "
                     f"then component ({' '.join(COMPONENTS)}); shade: the fraction of seeds whose selection "
                     "contains the unit (a deterministic criterion chooses alike at every seed, random does not).",
                     lambda s, rows=rows, title=title: plot_unit_frequency(rows, s, title=title)))
    return jobs
