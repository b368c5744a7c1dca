"""The paper's figures drawn with the authors' own statistics (``apps/plots/finetuning.py``,
``apps/plots/ablation_analysis.py``), beside raystudy's views of the same data.

- **Fig. 2 (left) and Fig. 4** (``get_intro``, ``get_plasticity_ablation``): per component, a box of its
  *per-layer plasticity*, the mean rate over pairs of each layer (``np.mean(ratio, axis=-1)`` of the
  ``(layers, pairs)`` rates), pooled over the datasets (Fig. 2: 11 datasets x 12 layers = 132 values a box;
  Fig. 4: one dataset's layers). Components in the paper's plasticity order ``MHA, FC1, FC2, LN2, LN1``
  (:data:`~raystudy.vocab.PAPER_RANKING`), seaborn's box (quartiles, whiskers to the furthest value within
  1.5 IQR, no outliers drawn). raystudy's own view, the violins of every pair's rate pooled over layers,
  is :func:`raystudy.analysis.figures.plot_rate_distribution`.
- **Fig. 19** (``get_best_performance``): one bar per component (same order), its height the mean over
  datasets of the best-lr accuracy (mean over seeds at the lr of the best mean test accuracy), its error bar
  the pooled standard error ``sqrt(mean_d std_d^2) / sqrt(n_seeds)`` with ``std_d`` the ``np.std`` (ddof 0) over
  seeds at that lr. raystudy's own view, bars per dataset with the std over seeds, is
  :func:`raystudy.analysis.sweep_figures.plot_best_accuracy`.

Each figure has a pure function returning exactly the numbers it draws (:func:`plasticity_boxes`,
:func:`overall_accuracy_bars`). Same conventions as :mod:`raystudy.analysis.figures` (Agg canvas, PNG + SVG,
one colour per configuration, bars from 0: the authors' axis starts at 89%, so each bar is labelled with
its value instead).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from raystudy.analysis.figures import _color, _facets, _grid, _require, _title, category_ticks, save_figure
from raystudy.analysis.style import FONT, styled
from raystudy.vocab import PAPER_RANKING

#: Whiskers reach the furthest value within WHIS x IQR of the quartiles (seaborn's and matplotlib's default,
#: the authors' ``sns.boxplot``); values beyond are not drawn (``showfliers=False``).
WHIS = 1.5

#: The columns that split the plasticity boxes into panels (the datasets are pooled in a box).
BOX_PANELS = ("model", "mode")


def plasticity_box_inputs(plasticity: pd.DataFrame) -> pd.DataFrame:
    """The values of the paper's plasticity boxes: one row per (model, mode, dataset, layer, component).

    ``plasticity`` follows ``plasticity.parquet``, whose ``plasticity`` is a layer's mean rate over pairs
    (the authors' ``np.mean(ratio, axis=-1)``); rows repeated for one key (two studies of one dataset) are
    averaged. Returns ``model, mode, dataset, layer, component, value``, components in
    :data:`~raystudy.vocab.PAPER_RANKING` order (others left out), then dataset and layer.
    """
    _require(plasticity, ["model", "dataset", "mode", "layer", "component", "plasticity"], "plasticity")
    keys = ["model", "mode", "dataset", "layer", "component"]
    p = plasticity[plasticity["component"].isin(PAPER_RANKING)]
    out = p.groupby(keys, sort=False, as_index=False)["plasticity"].mean().rename(columns={"plasticity": "value"})
    rank = out["component"].map({c: i for i, c in enumerate(PAPER_RANKING)})
    return out.assign(_rank=rank).sort_values(["model", "mode", "_rank", "dataset", "layer"], kind="stable") \
        .drop(columns="_rank").reset_index(drop=True)


def box_stats(values) -> dict[str, float]:
    """A box of ``values`` as seaborn draws it (matplotlib's ``boxplot_stats`` with ``whis`` = :data:`WHIS`):
    ``q1, med, q3`` = the 25/50/75th percentiles (linear interpolation), ``whislo`` / ``whishi`` = the smallest
    value >= ``q1 - WHIS * iqr`` / the largest <= ``q3 + WHIS * iqr`` (the quartile itself when none
    passes it), over the ``n`` finite values."""
    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    q1, med, q3 = np.percentile(x, [25, 50, 75])
    iqr = q3 - q1
    low, high = x[x >= q1 - WHIS * iqr].min(), x[x <= q3 + WHIS * iqr].max()  # never empty: q1 <= max(x)
    return dict(n=int(x.size), q1=float(q1), med=float(med), q3=float(q3), whislo=float(min(low, q1)),
                whishi=float(max(high, q3)))


def plasticity_boxes(plasticity: pd.DataFrame) -> pd.DataFrame:
    """What the paper's Fig. 2 (left) / Fig. 4 draws: per model, mode and component (PAPER_RANKING order)
    the :func:`box_stats` of its per-layer plasticity over every dataset and layer
    (:func:`plasticity_box_inputs`), with ``n_datasets``."""
    values = plasticity_box_inputs(plasticity)
    rows = []
    for (model, mode, comp), g in values.groupby(["model", "mode", "component"], sort=False):
        rows.append(dict(model=model, mode=mode, component=comp, n_datasets=g["dataset"].nunique(),
                         **box_stats(g["value"])))
    return pd.DataFrame(rows)


@styled
def plot_plasticity_boxes(plasticity: pd.DataFrame, path_stem: str | Path, *, title: str = "") -> list[Path]:
    """The paper's Fig. 2 (left) and Fig. 4: a box per component of its per-layer plasticity, datasets pooled
    (:func:`plasticity_boxes`); one panel per model and mode; a dotted line at plasticity 1."""
    boxes = plasticity_boxes(plasticity)
    panels, constant = _facets(boxes, BOX_PANELS)
    fig, axes = _grid(len(panels), width=5.0)
    for ax, (name, rows) in zip(axes, panels):
        stats = [dict(r._asdict(), label=r.component) for r in rows.itertuples(index=False)]
        art = ax.bxp(stats, showfliers=False, patch_artist=True, widths=0.6,
                     medianprops=dict(color="#333333"), whiskerprops=dict(color="#333333", ls="--"))
        for patch, comp in zip(art["boxes"], rows["component"]):
            patch.set_facecolor(_color(comp))
            patch.set_edgecolor("#333333")
        category_ticks(ax, np.arange(1, len(stats) + 1), list(rows["component"]))
        ax.axhline(1.0, color="black", lw=0.8, ls=":", zorder=0)
        ax.set_xlabel("component, by the paper's plasticity rank")
        ax.set_ylabel("plasticity per layer (mean rate)")
        ax.grid(axis="y", alpha=0.3)
        n_ds = int(rows["n_datasets"].max())
        ax.set_title(f"{name + ' · ' if name else ''}{n_ds} dataset{'s' if n_ds > 1 else ''} × layers")
    _title(fig, title or "Plasticity per layer, box over layers and datasets", constant)
    return save_figure(fig, path_stem)


def overall_accuracy_bars(best_lr: pd.DataFrame) -> pd.DataFrame:
    """What the paper's Fig. 19 draws: per (model,) optimizer and component (PAPER_RANKING order; the
    study's other configurations left out) the bar ``height = mean_d mean_d`` and the pooled standard error
    ``se = sqrt(mean_d (std_d^2 / n_d))`` over the datasets ``d`` that have the component.

    ``best_lr`` as written by the analysis (``mean``, ``std`` (ddof 0) and ``n_seeds`` over seeds at each
    dataset's best lr, fractions). With ``n`` seeds on every dataset, ``se = sqrt(mean_d std_d^2) / sqrt(n)``:
    the authors' ``pooled_std / np.sqrt(len(seeds))``. Columns ``[model,] optimizer, configuration, height,
    se, n_datasets``.
    """
    _require(best_lr, ["dataset", "optimizer", "configuration", "mean", "std", "n_seeds"], "best_lr")
    keys = [k for k in ("model", "optimizer") if k in best_lr.columns]
    b = best_lr[best_lr["configuration"].isin(PAPER_RANKING)]
    b = b.assign(_var=b["std"].astype(float) ** 2 / b["n_seeds"].astype(float), _rank=b["configuration"].map(
        {c: i for i, c in enumerate(PAPER_RANKING)}))
    g = b.groupby([*keys, "_rank", "configuration"], sort=True)
    out = g.agg(height=("mean", "mean"), _var=("_var", "mean"), n_datasets=("dataset", "nunique")).reset_index()
    out["se"] = np.sqrt(out.pop("_var"))
    return out[[*keys, "configuration", "height", "se", "n_datasets"]]


@styled
def plot_overall_accuracy(best_lr: pd.DataFrame, path_stem: str | Path, *, title: str = "") -> list[Path]:
    """The paper's Fig. 19: a bar per component of its best-lr test accuracy averaged over datasets, error bar
    the pooled standard error over seeds (:func:`overall_accuracy_bars`), each bar labelled ``mean ± se``;
    one panel per (model,) optimizer."""
    bars = overall_accuracy_bars(best_lr)
    _require(bars, ["configuration"], "best_lr's components")
    panels, constant = _facets(bars, ("model", "optimizer"))
    fig, axes = _grid(len(panels), width=5.0)
    for ax, (name, rows) in zip(axes, panels):
        x, h, se = np.arange(len(rows)), 100 * rows["height"].to_numpy(float), 100 * rows["se"].to_numpy(float)
        ax.bar(x, h, 0.7, yerr=se, color=[_color(c) for c in rows["configuration"]], edgecolor="white",
                     error_kw=dict(lw=1.2, capsize=0, ecolor="#333333"))
        for xi, v, e in zip(x, h, np.nan_to_num(se)):  # above the error bar
            ax.text(xi, v + e + 1.5, f"{v:.2f}\n±{e:.2f}", ha="center", va="bottom", fontsize=FONT["small"])
        category_ticks(ax, x, list(rows["configuration"]))
        ax.set_ylim(0, 115)  # from 0: a bar's height is its value; room above 100 for the labels
        ax.set_yticks(np.arange(0, 101, 20))
        ax.set_xlabel("component, by the paper's plasticity rank")
        ax.set_ylabel("best-lr test accuracy (%), mean over datasets")
        ax.grid(axis="y", alpha=0.3)
        n_ds = int(rows["n_datasets"].max())
        ax.set_title(f"{name + ' · ' if name else ''}{n_ds} dataset{'s' if n_ds > 1 else ''}")
    _title(fig, title or "Best accuracy, mean over datasets (± pooled standard error over seeds)", constant)
    return save_figure(fig, path_stem)

