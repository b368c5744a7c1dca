"""Figures of the finetuning sweeps: every run's curves, accuracy at each fixed lr, against lr, per dataset
and against the number of trainable parameters (the paper's Figs. 5 and 21-58; Fig. 19 per dataset).

Same conventions as :mod:`raystudy.analysis.figures` (Agg canvas, PNG + SVG, one colour per configuration).
Accuracies come in as fractions and are drawn in percent; every spread is the population standard
deviation (``ddof=0``, :func:`raystudy.analysis.tables.population_std`). A diverged run (counted with the
test accuracy of its best-validation checkpoint before the divergence) is drawn as a black ``x``.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

from raystudy.analysis.figures import (
    _color,
    _facets,
    _fmt_lr,
    _grid,
    _legend,
    _marker,
    _needs_log,
    _ordered,
    _require,
    _title,
    grouped_bars,
    save_figure,
)
from raystudy.analysis.selection import _budget_sort, budget_of
from raystudy.analysis.style import configuration_styles, styled
from raystudy.analysis.tables import population_std
from raystudy.vocab import LINEAR_PROBE, TRIALS_CONFIGURATIONS

#: Line style of the k-th seed of a sweep (cycled).
SEED_STYLES = ("-", "--", ":", "-.")
#: How a diverged run is marked in every figure of this module.
DIVERGED_STYLE = dict(marker="x", color="black", s=28, linewidths=1.2, zorder=5)


def _lr_colors(lrs) -> dict[float, tuple]:
    """One viridis colour per learning rate, small (dark) to large (light)."""
    lrs = sorted(set(float(x) for x in lrs))
    cmap = matplotlib.colormaps["viridis"]
    return {lr: cmap(0.85 * i / max(len(lrs) - 1, 1)) for i, lr in enumerate(lrs)}


def _is_diverged(runs: pd.DataFrame) -> pd.Series:
    if "diverged" in runs.columns:
        return runs["diverged"].fillna(False).astype(bool)
    return (runs["status"] == "diverged") if "status" in runs.columns else pd.Series(False, index=runs.index)


def _curve_legend(fig: Figure, colors: dict, seeds: list, diverged: bool) -> None:
    """lr colours and seed line styles of the every-run figure, and the diverged mark when one is drawn."""
    handles = [Line2D([], [], color=c, lw=2, label=f"lr {_fmt_lr(lr)}") for lr, c in colors.items()]
    handles += [Line2D([], [], color="black", lw=1.2, ls=SEED_STYLES[i % len(SEED_STYLES)], label=f"seed {s}")
                for i, s in enumerate(seeds)]
    if diverged:
        handles.append(Line2D([], [], color="black", marker="x", lw=0, label="diverged"))
    fig.legend(handles=handles, loc="outside right center", frameon=False, title="run")


def _curve_panel(ax, curves: pd.DataFrame, runs: pd.DataFrame, col: str, colors: dict, seeds: list) -> set[str]:
    """Every run of one configuration on ``ax``: one line per (lr, seed); returns what was drawn (``"line"``,
    ``"diverged"``)."""
    drawn = set()
    for r, diverged in zip(runs.itertuples(), _is_diverged(runs)):
        c = curves[curves["trial_id"] == r.trial_id].dropna(subset=[col]).sort_values("step")
        if c.empty:
            continue
        style = SEED_STYLES[seeds.index(r.seed) % len(SEED_STYLES)]
        ax.plot(c["step"], c[col], color=colors[float(r.lr)], ls=style, lw=1.2)
        drawn.add("line")
        if diverged:
            ax.scatter(c["step"].iloc[-1:], c[col].iloc[-1:], **DIVERGED_STYLE)
            drawn.add("diverged")
    return drawn


#: Configuration panels per row of the every-run curves figure (more wrap onto further rows).
CURVE_COLUMNS = 4
#: The two quantities of a curves figure, with their axis labels.
CURVE_QUANTITIES = (("grad_norm", "gradient norm"), ("val_loss", "validation loss"))


def _curve_axes(n_configs: int) -> tuple[Figure, list[list]]:
    """Per configuration its two axes (gradient norm above validation loss), wrapping after CURVE_COLUMNS;
    every gradient-norm axis shares one y axis, every validation-loss axis another."""
    cols = min(n_configs, CURVE_COLUMNS)
    blocks = int(np.ceil(n_configs / cols))
    fig = Figure(figsize=(3.6 * cols + 1.6, 5.0 * blocks + 0.4), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.subplots(2 * blocks, cols, squeeze=False, sharex=True)
    pairs = [[grid[2 * (i // cols), i % cols], grid[2 * (i // cols) + 1, i % cols]] for i in range(n_configs)]
    for i in range(n_configs, blocks * cols):
        grid[2 * (i // cols), i % cols].set_visible(False)
        grid[2 * (i // cols) + 1, i % cols].set_visible(False)
    for k in (0, 1):
        for pair in pairs[1:]:
            pair[k].sharey(pairs[0][k])
    return fig, pairs


@styled
def plot_sweep_curves(curves: pd.DataFrame, runs: pd.DataFrame, path_stem: str | Path, *,
                      title: str = "") -> list[Path]:
    """Gradient norm (upper panel) and validation loss (lower panel) of every run of one sweep (Figs. 21-58).

    ``runs``: the trials of one model, dataset and optimizer (``trial_id, configuration, lr, seed``, and
    ``diverged`` or ``status``); ``curves`` follows ``curves.parquet``. A pair of panels per configuration
    (at most CURVE_COLUMNS per row), each quantity on one y axis shared by every configuration (so the
    components' scales compare); one line per (lr, seed): colour = lr, line style = seed; a diverged run ends
    in a black ``x``. Log axis when a quantity spans more than LOG_RATIO.
    """
    _require(curves, ["trial_id", "step", "grad_norm", "val_loss"], "curves")
    _require(runs, ["trial_id", "configuration", "lr", "seed"], "runs")
    mine = curves[curves["trial_id"].isin(set(runs["trial_id"]))]
    configs = _ordered(runs["configuration"].unique())
    colors, seeds = _lr_colors(runs["lr"]), sorted(runs["seed"].unique())
    fig, pairs = _curve_axes(len(configs))
    drawn: set[str] = set()
    for config, pair in zip(configs, pairs):
        for ax, (col, label) in zip(pair, CURVE_QUANTITIES):
            panel = _curve_panel(ax, mine, runs[runs["configuration"] == config], col, colors, seeds)
            if not panel:
                ax.text(0.5, 0.5, f"no {label}", ha="center", va="center", transform=ax.transAxes)
            drawn |= panel
            ax.grid(alpha=0.3)
            ax.set_ylabel(label)
        pair[0].set_title(config, color=_color(config, configs), fontweight="bold")
        pair[1].set_xlabel("step")
        pair[1].tick_params(labelbottom=True)
    for k, (col, _label) in enumerate(CURVE_QUANTITIES):
        if _needs_log(mine[col].to_numpy()):
            pairs[0][k].set_yscale("log")
    _curve_legend(fig, colors, seeds, "diverged" in drawn)
    _title(fig, title, "")
    return save_figure(fig, path_stem)


def _seed_points(ax, rows: pd.DataFrame, configs: list[str]) -> None:
    """Per configuration at x = its position: every seed's accuracy (dot, ``x`` when diverged) and the mean."""
    rng = np.random.default_rng(0)
    for pos, config in enumerate(configs):
        r = rows[rows["configuration"] == config]
        if r.empty:
            continue
        acc, div = 100 * r["test_acc"].to_numpy(float), _is_diverged(r).to_numpy()
        x = pos + rng.uniform(-0.12, 0.12, acc.size)
        ax.scatter(x[~div], acc[~div], s=14, color=_color(config, configs), marker=_marker(config, configs),
                   edgecolor="black", linewidth=0.3, zorder=3)
        if div.any():
            ax.scatter(x[div], acc[div], **DIVERGED_STYLE)
        ax.hlines(acc.mean(), pos - 0.3, pos + 0.3, color=_color(config, configs), lw=2.2, zorder=2)


def _row_limits(rows: pd.DataFrame) -> tuple[float, float]:
    acc = 100 * rows["test_acc"].to_numpy(float)
    pad = max(0.5, 0.08 * (acc.max() - acc.min()))
    return acc.min() - pad, acc.max() + pad


@styled
def plot_accuracy_fixed_lr(counted: pd.DataFrame, path_stem: str | Path, *, title: str = "") -> list[Path]:
    """Test accuracy per configuration at each fixed learning rate (the fixed-lr view of Fig. 5, left).

    One row of panels per (model, optimizer, dataset), one panel per learning rate of that dataset's grid
    (ascending), sharing the row's y range; in a panel every seed's accuracy per configuration (dot; black
    ``x`` when the run diverged) and the mean over seeds (bar).
    """
    _require(counted, ["dataset", "configuration", "lr", "seed", "test_acc"], "trials")
    rows_, constant = _facets(counted, ("model", "optimizer", "dataset"))
    n_cols = int(max(r["lr"].nunique() for _, r in rows_))
    configs = _ordered(counted["configuration"].unique())
    fig = Figure(figsize=(0.42 * len(configs) * n_cols + 2.5, 2.6 * len(rows_) + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(rows_), n_cols, squeeze=False)
    for ax_row, (name, rows) in zip(axes, rows_):
        lrs = sorted(rows["lr"].unique())
        for ax, lr in zip(ax_row, lrs):
            _seed_points(ax, rows[rows["lr"] == lr], configs)
            ax.set_ylim(*_row_limits(rows))
            ax.set_xticks(range(len(configs)), configs, rotation=90)
            ax.set_title(f"{name + ' · ' if name else ''}lr {_fmt_lr(lr)}")
            ax.grid(axis="y", alpha=0.3)
        ax_row[0].set_ylabel("test accuracy (%)")
        for ax in ax_row[len(lrs):]:
            ax.set_visible(False)
    _title(fig, title or "Test accuracy at each fixed learning rate", constant)
    return save_figure(fig, path_stem)


def lr_ticks(ax, lrs) -> None:
    """A log x axis ticked at the grid's learning rates ``lrs`` only, labelled plainly (``0.03``, ``0.3``):
    the values a reader looks up in the tables, not decades the grid may not hold."""
    grid = sorted(set(float(x) for x in lrs))
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(grid))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_locator(NullLocator())
    if len(grid) == 1:  # one lr: a decade around it, so that the log axis has a width
        ax.set_xlim(grid[0] / 3, grid[0] * 3)


#: The most configurations one panel of the accuracy-against-lr figure draws (the vocabulary's eight
#: finetuning configurations fit one): more are split over panels, one per family (:func:`lr_groups`).
MAX_LINES = 8
#: The most lines of a panel drawn with their band (± std over seeds): more bands hide one another.
MAX_BANDS = 4


def _lr_family(config: str) -> tuple:
    """The sort key and label of ``config``'s family: the vocabulary's configurations, one budget of a
    granularity (``20% of units``: the criteria at a matched budget), or every other expression."""
    if config in TRIALS_CONFIGURATIONS:
        return (0,), ""
    key = budget_of(config)
    if key is None:
        return (2,), "other configurations"
    _, budget, granularity = key
    return (1, granularity != "units", _budget_sort(budget)), f"{budget} of {granularity}"


def lr_groups(configs: list[str]) -> list[tuple[str, list[str]]]:
    """``[(label, configurations)]`` of the accuracy-against-lr panels: all in one (label ``""``) up to
    :data:`MAX_LINES`; beyond, one per family (:func:`_lr_family`), each cut in chunks of at most MAX_LINES
    (labelled ``1/2``, ``2/2``)."""
    if len(configs) <= MAX_LINES:
        return [("", list(configs))]
    families: dict[tuple, tuple[str, list[str]]] = {}
    for c in configs:
        key, label = _lr_family(c)
        families.setdefault(key, (label, []))[1].append(c)
    out = []
    for key in sorted(families):
        label, members = families[key]
        chunks = [members[i:i + MAX_LINES] for i in range(0, len(members), MAX_LINES)]
        out += [(f"{label or 'configurations'}{f' {k + 1}/{len(chunks)}' if len(chunks) > 1 else ''}", chunk)
                for k, chunk in enumerate(chunks)]
    return out


def _lr_lines(ax, rows: pd.DataFrame, configs: list[str], styles: dict[str, tuple[str, str]]) -> None:
    """Mean over seeds (line) against lr per configuration of ``configs``, ± std (band, ddof 0) when they are
    at most :data:`MAX_BANDS`; ``x`` where runs diverged. ``styles``: the figure's (colour, marker) of each."""
    for config in configs:
        r = rows[rows["configuration"] == config].assign(div=lambda d: _is_diverged(d).astype(int))
        if r.empty:
            continue
        g = r.groupby("lr")
        m = g["test_acc"].mean() * 100
        sd = g["test_acc"].agg(population_std) * 100
        color, marker = styles[config]
        ax.plot(m.index, m.to_numpy(), color=color, marker=marker, ms=4, lw=1.6, label=config)
        if len(configs) <= MAX_BANDS:
            ax.fill_between(m.index, m - sd, m + sd, color=color, alpha=0.15, lw=0)
        hit = (g["div"].sum() > 0).to_numpy()
        if hit.any():
            ax.scatter(m.index[hit], m.to_numpy()[hit], **DIVERGED_STYLE)


def _probe_line(ax, rows: pd.DataFrame, probes: pd.DataFrame | None) -> None:
    """The linear probe of the panel's dataset (and model), dashed: it has no lr."""
    if probes is None or not len(probes):
        return
    lp = probes[probes["dataset"] == rows["dataset"].iloc[0]]
    if "model" in lp.columns:
        lp = lp[lp["model"] == rows["model"].iloc[0]]
    if len(lp):
        ax.axhline(100 * lp["test_acc"].mean(), color=_color(LINEAR_PROBE), ls="--", lw=1.4, label=LINEAR_PROBE)


@styled
def plot_accuracy_vs_lr(counted: pd.DataFrame, path_stem: str | Path, probes: pd.DataFrame | None = None, *,
                        title: str = "") -> list[Path]:
    """Test accuracy against the learning rate per configuration, one panel per (model, optimizer, dataset)
    and, beyond :data:`MAX_LINES` configurations, per family of them (:func:`lr_groups`: the criteria of one
    budget together), a row of panels per (model, optimizer, dataset).

    Line: mean over seeds at each lr; band: +- the std over seeds (ddof 0) in a panel of at most
    :data:`MAX_BANDS` lines; black ``x``: an lr whose seeds include a diverged run. The linear probe
    (``probes``, no lr) is a dashed horizontal line. Log lr axis.
    """
    _require(counted, ["dataset", "configuration", "lr", "test_acc"], "trials")
    facets, constant = _facets(counted, ("model", "optimizer", "dataset"))
    configs = _ordered(counted["configuration"].unique())
    styles, groups = configuration_styles(configs), lr_groups(configs)
    panels = [(" · ".join(p for p in (name, label) if p), rows, members) for name, rows in facets
              for label, members in groups]
    fig, axes = _grid(len(panels), width=4.4, height=3.3, max_cols=len(groups) if 1 < len(groups) <= 4 else 4)
    for ax, (name, rows, members) in zip(axes, panels):
        _lr_lines(ax, rows, members, styles)
        _probe_line(ax, rows, probes)
        lr_ticks(ax, rows["lr"])
        ax.set_xlabel("learning rate")
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3, which="both")
        if name:
            ax.set_title(name)
    _legend(fig, axes, "configuration")
    _title(fig, title or "Test accuracy against the learning rate", constant)
    return save_figure(fig, path_stem)


@styled
def plot_best_accuracy(best_lr: pd.DataFrame, path_stem: str | Path, *, title: str = "") -> list[Path]:
    """Best-lr accuracy per dataset and configuration as grouped bars (raystudy's view of the paper's Fig. 19,
    which averages the components' bars over datasets: :func:`raystudy.analysis.authors_figures.plot_overall_accuracy`).

    ``best_lr`` as written by the analysis (``dataset, configuration, mean, std``; ``LP`` rows included):
    bar = mean over seeds at the best lr, error bar = std over seeds (ddof 0); one panel per optimizer.
    """
    _require(best_lr, ["dataset", "configuration", "mean", "std"], "best_lr")
    panels, constant = _facets(best_lr, ("model", "optimizer"))
    n_ds = best_lr["dataset"].nunique()
    fig, axes = _grid(len(panels), width=max(5.5, 0.9 * n_ds + 2.5), height=3.8, max_cols=1 if n_ds > 5 else 2)
    for ax, (name, rows) in zip(axes, panels):
        grouped_bars(ax, rows, "mean", err="std")
        ax.set_ylim(0, 100)  # from 0: a bar's height is its value
        ax.set_ylabel("best-lr test accuracy (%)")
        if name:
            ax.set_title(name)
    _legend(fig, axes, "configuration")
    _title(fig, title or "Best accuracy per dataset", constant)
    return save_figure(fig, path_stem)


def _params_by_configuration(cost: pd.DataFrame) -> pd.DataFrame:
    """Median trainable parameters per (model,) configuration over optimizers (they do not change them)."""
    keys = [k for k in ("model", "configuration") if k in cost.columns]
    return cost.groupby(keys, sort=False)["trainable_params"].median().reset_index()


#: Factor between the x of two points a log axis would draw at the same place (:func:`dodged`).
DODGE = 1.12


def dodged(x: np.ndarray) -> np.ndarray:
    """``x`` (positive) with each run of n values closer than a factor DODGE to the next (sorted) spread to
    ``c * DODGE ** (k - (n - 1) / 2)``, k = 0..n-1 in that order, around their geometric mean ``c``: points at
    (nearly) the same parameter count (``Head`` and ``LP`` train the same head, LN1 and LN2 as many
    parameters) drawn side by side on a log axis, not one on the other."""
    x = np.asarray(x, dtype=float)
    out, order = x.copy(), np.argsort(x, kind="stable")
    runs = [[order[0]]] if x.size else []
    for prev, i in zip(order, order[1:]):
        if x[i] < x[prev] * DODGE:
            runs[-1].append(i)
        else:
            runs.append([i])
    for run in runs:
        centre = np.exp(np.log(x[run]).mean())
        out[run] = centre * DODGE ** (np.arange(len(run)) - (len(run) - 1) / 2)
    return out


@styled
def plot_accuracy_vs_params(overall: pd.DataFrame, cost: pd.DataFrame, path_stem: str | Path, *,
                            title: str = "") -> list[Path]:
    """Best-lr accuracy (mean over datasets, +- std over datasets, ddof 0) against trainable parameters.

    ``overall`` and ``cost`` as written by the analysis; one point per configuration (its colour and
    marker, named by the legend) at the configuration's median trainable-parameter count (log axis; equal
    counts side by side, :func:`dodged`); one panel per optimizer (and model).
    """
    _require(overall, ["optimizer", "configuration", "mean", "std"], "overall")
    _require(cost, ["configuration", "trainable_params"], "cost")
    keys = [k for k in ("model", "configuration") if k in overall.columns and k in cost.columns]
    data = overall.merge(_params_by_configuration(cost), on=keys, how="inner").dropna(subset=["trainable_params"])
    _require(data, ["trainable_params"], "overall x cost")
    panels, constant = _facets(data, ("model", "optimizer"))
    fig, axes = _grid(len(panels), width=5.4, height=4.0)
    configs = _ordered(data["configuration"].unique())
    for ax, (name, rows) in zip(axes, panels):
        x = dodged(rows["trainable_params"].to_numpy(float))
        for xi, r in zip(x, rows.itertuples()):  # named by the legend: labels beside the points overlap
            color, marker = configuration_styles(configs)[r.configuration]
            ax.errorbar(xi, 100 * r.mean, yerr=100 * r.std, color=color, marker=marker, ms=7, capsize=2, lw=1,
                        mec="black", mew=0.5, label=r.configuration)
        ax.set_xscale("log")
        ax.set_xlabel("trainable parameters (log scale)")
        ax.set_ylabel("best-lr test accuracy (%), mean over datasets")
        ax.grid(alpha=0.3, which="both")
        if name:
            ax.set_title(name)
    _legend(fig, axes, "configuration")
    _title(fig, title or "Accuracy against trainable parameters", constant)
    return save_figure(fig, path_stem)
