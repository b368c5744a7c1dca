"""Figures of a study (matplotlib, Agg canvas; every figure is written as PNG and SVG).

Every function takes tidy DataFrames following the table schemas of :data:`raystudy.vocab.SCHEMAS`
(see ``docs/architecture.md``), writes ``<path_stem>.png`` and ``<path_stem>.svg`` and returns both paths.
Figures are built on :class:`matplotlib.figure.Figure` with an Agg canvas, never through ``pyplot``: no
global state, no GUI backend, safe in worker threads. The palette, markers and font scale are
:mod:`raystudy.analysis.style`'s: each configuration has one colour and one marker in every figure, no two
alike (:func:`configuration_styles`); a component (plasticity, bounds) is drawn in the colour of the
configuration that trains it; every text takes a size of the one scale :data:`FONT` (``@styled``).
Bars start at 0, a group of fewer than :data:`MIN_VIOLIN_POINTS` values is drawn as its points (no
violin), and a legend names only what its figure draws.

When a table holds several models, datasets or modes, each combination gets its own panel.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, MaxNLocator

from raystudy.analysis.style import (
    CONFIGURATION_COLORS,
    FONT,
    MARKERS,
    configuration_styles,
    styled,
)
from raystudy.vocab import BOUNDS_FORMULAS, RANDOM_BLOCKS, RANDOM_INIT, TRIALS_CONFIGURATIONS, pretrained_rows

#: The name the colours had before the vocabulary was unified (kept for user code).
COMPONENT_COLORS = CONFIGURATION_COLORS

#: Columns that split a table into panels when they hold more than one value.
FACET_KEYS: tuple[str, ...] = ("model", "dataset", "mode", "optimizer")

#: A log axis is used when the plotted values span more than this ratio.
LOG_RATIO = 100.0

#: How the depth figure draws each control (:data:`raystudy.vocab.CONTROL_WEIGHTS`): line style, legend label.
CONTROL_LINES: dict[str, tuple[str, str]] = {RANDOM_INIT: ("--", "random init"),
                                             RANDOM_BLOCKS: ("-.", "random blocks, the model's embeddings")}

#: Below this many values a group is drawn as its points, not as a violin (a density of a few points misleads).
MIN_VIOLIN_POINTS = 5

#: Above this many values per violin, the kernel density is estimated on a fixed random subset.
MAX_VIOLIN_POINTS = 100_000


def _require(df: pd.DataFrame, columns: Sequence[str], name: str) -> None:
    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"{name}: expected a pandas DataFrame, got {type(df).__name__}")
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ValueError(f"{name}: missing column(s) {missing}")
    if df.empty:
        raise ValueError(f"{name}: the table is empty")


def _ordered(names) -> list[str]:
    """Configuration names in TRIALS_CONFIGURATIONS order, unknown names last (sorted)."""
    names = set(names)
    return [c for c in TRIALS_CONFIGURATIONS if c in names] + sorted(names - set(TRIALS_CONFIGURATIONS))


def _color(name: str, names: Sequence[str] = ()) -> str:
    """The colour of configuration ``name`` in a figure showing ``names`` (:func:`configuration_styles`)."""
    return configuration_styles([*names, name])[str(name)][0]


def _marker(name: str, names: Sequence[str] = ()) -> str:
    return configuration_styles([*names, name])[str(name)][1]


def _facets(df: pd.DataFrame, keys: Sequence[str] = FACET_KEYS) -> tuple[list[tuple[str, pd.DataFrame]], str]:
    """Split ``df`` by the ``keys`` that vary; returns ``[(panel title, rows)]`` and the constant part."""
    present = [k for k in keys if k in df.columns]
    varying = [k for k in present if df[k].nunique(dropna=False) > 1]
    constant = ", ".join(f"{df[k].iloc[0]}" for k in present if k not in varying)
    if not varying:
        return [("", df)], constant
    panels = []
    for values, rows in df.groupby(varying, sort=True, dropna=False):
        values = values if isinstance(values, tuple) else (values,)
        panels.append((", ".join(str(v) for v in values), rows))
    return panels, constant


def _grid(n: int, *, width: float = 5.2, height: float = 3.8, max_cols: int = 3) -> tuple[Figure, list]:
    cols = min(n, max_cols)
    rows = int(np.ceil(n / cols))
    fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def _title(fig: Figure, title: str, constant: str) -> None:
    text = title or ""
    if constant:
        text = f"{text} — {constant}" if text else constant
    if text:
        fig.suptitle(wrap_title(fig, text), fontsize=FONT["title"])


def wrap_title(fig: Figure, text: str, fontsize: float = FONT["title"]) -> str:
    """``text`` broken into lines that fit the figure's width (a character ~0.55 of the font size wide)."""
    chars = max(20, int(fig.get_figwidth() * 72 / (0.55 * fontsize)))
    return textwrap.fill(text, width=chars, break_long_words=False, break_on_hyphens=False)


def _fmt_lr(lr: float) -> str:
    """``0.003 -> "3e-3"`` (the notation of the tables)."""
    mant, exp = f"{float(lr):.3e}".split("e")
    return f"{mant.rstrip('0').rstrip('.')}e{int(exp)}"


def _needs_log(values: np.ndarray) -> bool:
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v) & (v > 0)]
    return v.size > 1 and v.max() / v.min() > LOG_RATIO


def save_figure(fig: Figure, path_stem: str | Path) -> list[Path]:
    """Write ``<path_stem>.png`` (150 dpi) and ``<path_stem>.svg``; returns both paths."""
    stem = Path(path_stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_name(stem.name + ".png"), stem.with_name(stem.name + ".svg")]
    fig.savefig(paths[0], dpi=150)
    # The layout is solved once: the SVG keeps the PNG's (a layout engine would solve it again, ~1/3 of a save).
    fig.set_layout_engine("none")
    # A fixed hash salt and no date keep the SVG byte-identical across runs.
    with matplotlib.rc_context({"svg.hashsalt": "raystudy"}):
        fig.savefig(paths[1], metadata={"Date": None})
    return paths


def category_ticks(ax, positions, labels, *, pad: float = 4.0) -> None:
    """Tick labels ``labels`` at ``positions`` on ``ax``'s x axis, turned vertical when side by side they
    would touch (as the fixed-lr figure draws them): many or long configuration names never overlap."""
    ax.set_xticks(positions, labels)
    renderer = ax.figure.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer).padded(pad) for t in ax.get_xticklabels() if t.get_text()]
    if any(a.overlaps(b) for a, b in zip(boxes, boxes[1:])):
        ax.set_xticks(positions, labels, rotation=90)


def _legend(fig: Figure, axes: list, title: str = "component") -> None:
    """One legend for the figure, right of the panels: every labelled artist the panels draw, once each
    (first panel first), none when nothing is labelled."""
    entries: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if entries:
        fig.legend(list(entries.values()), list(entries), loc="outside right center", frameon=False, title=title)


@styled
def plot_plasticity_depth(plasticity: pd.DataFrame, path_stem: str | Path, *, title: str = "") -> list[Path]:
    """Plasticity of each component across depth with its 95% interval band.

    ``plasticity`` follows ``plasticity.parquet`` (``layer, component, plasticity, ci95`` used; ``model,
    dataset, mode`` split panels when they vary). x: layer (0-based), y: plasticity = mean rate
    ``||f(x) - f(y)||_F / ||x - y||_F`` over pairs; band: ``plasticity +- ci95``. One line per component in
    COMPONENTS order; a dotted line marks plasticity 1 (above: the component amplifies input differences).
    The controls' rows are drawn beside them in the same colour, each control in its line style
    (:data:`CONTROL_LINES`): ``weights = random_init`` (the random-init control) dashed, ``weights =
    random_blocks`` (the component control: random-init blocks fed the model's embeddings) dash-dotted. The y
    axis is logarithmic when the values span more than :data:`LOG_RATIO`.
    """
    _require(plasticity, ["layer", "component", "plasticity", "ci95"], "plasticity")
    panels, constant = _facets(plasticity)
    fig, axes = _grid(len(panels))
    log = _needs_log(plasticity["plasticity"].to_numpy())
    for ax, (name, rows) in zip(axes, panels):
        controls = {w: rows[rows["weights"] == w] if "weights" in rows.columns else rows.iloc[:0]
                    for w in CONTROL_LINES}
        rows = pretrained_rows(rows)
        for comp in _ordered(rows["component"].unique()):
            r = rows[rows["component"] == comp].groupby("layer", as_index=False)[["plasticity", "ci95"]].mean()
            r = r.sort_values("layer")
            x, y, ci = r["layer"].to_numpy(), r["plasticity"].to_numpy(float), r["ci95"].to_numpy(float)
            ax.plot(x, y, color=_color(comp), marker=MARKERS.get(comp, "o"), ms=4, lw=1.8, label=comp)
            ci = np.nan_to_num(ci, nan=0.0)
            lo = np.maximum(y - ci, y * 1e-3) if log else y - ci
            ax.fill_between(x, lo, y + ci, color=_color(comp), alpha=0.2, lw=0)
        for weights, control in controls.items():
            _draw_control(ax, control, *CONTROL_LINES[weights])
        ax.axhline(1.0, color="black", lw=0.8, ls=":", zorder=0)
        if log:
            ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("layer")
        ax.set_ylabel("plasticity (mean rate, 95% band)")
        ax.grid(alpha=0.3)
        if name:
            ax.set_title(name)
    _legend(fig, axes)
    _title(fig, title or "Plasticity across depth", constant)
    return save_figure(fig, path_stem)


def _draw_control(ax, control: pd.DataFrame, ls: str, label: str) -> None:
    """One control's plasticity across depth: one line of style ``ls`` per component (its colour, no band),
    one legend entry ``label`` for all of them."""
    for comp in _ordered(control["component"].unique()):
        r = control[control["component"] == comp].groupby("layer", as_index=False)["plasticity"].mean()
        r = r.sort_values("layer")
        ax.plot(r["layer"].to_numpy(), r["plasticity"].to_numpy(float), color=_color(comp), ls=ls, lw=1.2,
                alpha=0.8)
    if len(control):
        ax.plot([], [], color="0.4", ls=ls, lw=1.2, label=label)


def _finite_groups(groups: list[tuple[str, np.ndarray]], log: bool) -> list[tuple[str, np.ndarray]]:
    """``groups`` with their finite values (log10 of the positive ones when ``log``), empty groups left out."""
    out = []
    for name, values in groups:
        v = np.asarray(values, dtype=float)
        v = v[np.isfinite(v)]
        if log:
            v = np.log10(v[v > 0])
        if v.size:
            out.append((name, v))
    return out


def _violin_bodies(ax, data: list[np.ndarray], names: list[str], positions: np.ndarray) -> None:
    """A violin per group of at least MIN_VIOLIN_POINTS values with some spread, in its configuration's colour."""
    rng = np.random.default_rng(0)
    idx = [i for i, d in enumerate(data) if d.size >= MIN_VIOLIN_POINTS and np.ptp(d) > 0]
    if not idx:
        return
    kde = [d if d.size <= MAX_VIOLIN_POINTS else rng.choice(d, MAX_VIOLIN_POINTS, replace=False)
           for d in (data[i] for i in idx)]
    parts = ax.violinplot(kde, positions=positions[idx], widths=0.8, showextrema=False)
    for body, i in zip(parts["bodies"], idx):
        body.set_facecolor(_color(names[i], names))
        body.set_edgecolor(_color(names[i], names))
        body.set_alpha(0.55)


def _violins(ax, groups: list[tuple[str, np.ndarray]], *, log: bool, ylabel: str, points: bool = True) -> None:
    """Per group (coloured by configuration): a violin with its quartiles (black bar), median (white dot)
    and extremes when it has MIN_VIOLIN_POINTS values or more, else its values as dots (``points``; False
    when the caller draws every value itself) and their median (a bar); ``log`` plots log10 values."""
    kept = _finite_groups(groups, log)
    if not kept:
        ax.text(0.5, 0.5, "no finite values", ha="center", va="center", transform=ax.transAxes)
        return
    names, data = [n for n, _ in kept], [d for _, d in kept]
    positions = np.arange(1, len(data) + 1)
    _violin_bodies(ax, data, names, positions)
    rng = np.random.default_rng(0)
    for pos, d, name in zip(positions, data, names):
        color, marker = configuration_styles(names)[name]
        if d.size < MIN_VIOLIN_POINTS:
            if points:
                ax.scatter(pos + rng.uniform(-0.12, 0.12, d.size), d, s=16, color=color, marker=marker,
                           edgecolor="black", linewidth=0.3, zorder=3)
            ax.hlines(np.median(d), pos - 0.25, pos + 0.25, color=color, lw=2, zorder=2)
            continue
        q1, med, q3 = np.percentile(d, [25, 50, 75])
        ax.vlines(pos, q1, q3, color="black", lw=3)
        ax.scatter([pos], [med], color="white", edgecolor="black", zorder=3, s=22)
        ax.hlines([d.min(), d.max()], pos - 0.12, pos + 0.12, color=color, lw=1)
    category_ticks(ax, positions, names)
    if log:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"$10^{{{v:g}}}$"))
        ylabel = f"{ylabel} (log scale)"
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)


@styled
def plot_rate_distribution(rates: pd.DataFrame, path_stem: str | Path, *, title: str = "") -> list[Path]:
    """Distribution of the per-pair rates of each component, pooled over layers.

    ``rates`` follows ``rates.parquet`` (``component, rate`` used; ``model, dataset, mode`` split panels).
    One violin per component (COMPONENTS order) with its quartiles (black bar), median (white dot) and
    extremes; the axis is log10 when the rates span more than :data:`LOG_RATIO` (non-positive rates are
    then left out). Above :data:`MAX_VIOLIN_POINTS` values per violin the density is estimated on a fixed
    random subset; quartiles and extremes always use every value.
    """
    _require(rates, ["component", "rate"], "rates")
    panels, constant = _facets(rates)
    fig, axes = _grid(len(panels), width=5.6)
    log = _needs_log(rates["rate"].to_numpy())
    for ax, (name, rows) in zip(axes, panels):
        comps = _ordered(rows["component"].unique())
        groups = [(c, rows.loc[rows["component"] == c, "rate"].to_numpy()) for c in comps]
        _violins(ax, groups, log=log, ylabel=r"rate $\|f(x)-f(y)\|_F\,/\,\|x-y\|_F$")
        ax.axhline(0.0 if log else 1.0, color="black", lw=0.8, ls=":", zorder=0)
        ax.set_xlabel("component")
        if name:
            ax.set_title(name)
    _title(fig, title or "Per-pair rates (all layers)", constant)
    return save_figure(fig, path_stem)


@styled
def plot_bounds(bounds: pd.DataFrame, plasticity: pd.DataFrame | None, path_stem: str | Path, *,
                title: str = "") -> list[Path]:
    """Theoretical upper bounds (dashed) next to the measured plasticity (solid) across depth, log scale.

    ``bounds`` follows ``bounds.parquet`` (``model, layer, component, bound``, and ``bounds``: which formulas,
    the paper's where absent); ``plasticity`` (optional) follows ``plasticity.parquet`` and is averaged over
    datasets, in ``embedding`` mode when present (the mode the bounds are stated for). One panel per model
    and formulas (:data:`BOUNDS_TITLES` names the formulas where a table holds several); non-finite or
    non-positive bounds are skipped.
    """
    _require(bounds, ["model", "layer", "component", "bound"], "bounds")
    if plasticity is not None:
        _require(plasticity, ["model", "layer", "component", "plasticity"], "plasticity")
        if "mode" in plasticity.columns and (plasticity["mode"] == "embedding").any():
            plasticity = plasticity[plasticity["mode"] == "embedding"]
    models = sorted(bounds["model"].astype(str).unique())
    formulas = bounds_of(bounds)
    shown = [f for f in BOUNDS_FORMULAS if (formulas == f).any()]
    panels = [(m, f) for m in models for f in shown if ((bounds["model"].astype(str) == m) & (formulas == f)).any()]
    fig, axes = _grid(len(panels), width=6.0, height=4.2)
    drawn: set[tuple[str, str]] = set()
    for ax, (model, formula) in zip(axes, panels):
        p = None
        if plasticity is not None:
            p = plasticity[plasticity["model"].astype(str) == model]
            if p.empty and plasticity["model"].nunique() == 1 and len(models) == 1:
                p = plasticity  # one model each side under different names
        drawn |= _bounds_panel(ax, bounds[(bounds["model"].astype(str) == model) & (formulas == formula)], p)
        names = ([model] if len(models) > 1 else []) + ([BOUNDS_TITLES[formula]] if len(shown) > 1 else [])
        if names:
            ax.set_title(" · ".join(names))
    comps = [c for c in _ordered(bounds["component"].unique()) if any(d[0] == c for d in drawn)]
    handles = [Line2D([], [], color=_color(c), marker=MARKERS[c], lw=1.8, ms=4, label=c) for c in comps]
    kinds = {k for _, k in drawn}
    handles += [Line2D([], [], color="black", lw=1.8, label="measured")] if "measured" in kinds else []
    handles += [Line2D([], [], color="black", lw=1.6, ls="--", label="upper bound")] if "bound" in kinds else []
    if handles:
        fig.legend(handles=handles, loc="outside right center", frameon=False, title="component")
    _title(fig, title or "Upper bounds and measured plasticity", models[0] if len(models) == 1 else "")
    return save_figure(fig, path_stem)


#: a panel's title for each formulas of the bounds (:data:`raystudy.vocab.BOUNDS_FORMULAS`)
BOUNDS_TITLES = {"paper": "the paper's formulas (Section 4)", "authors": "the authors' formulas (their Fig. 7)"}


def bounds_of(bounds: pd.DataFrame) -> pd.Series:
    """The formulas of each row of a bounds table: its column ``bounds``, the paper's where it has none."""
    if "bounds" in bounds.columns:
        return bounds["bounds"].astype(str)
    return pd.Series(BOUNDS_FORMULAS[0], index=bounds.index)


def _bounds_panel(ax, b: pd.DataFrame, p: pd.DataFrame | None) -> set[tuple[str, str]]:
    """One model's bounds (dashed) and measured plasticity (solid) per component on ``ax`` (log y);
    returns the ``(component, "bound" | "measured")`` lines drawn."""
    drawn = set()
    for comp in _ordered(b["component"].unique()):
        bb = b[b["component"] == comp].groupby("layer")["bound"].mean().sort_index()
        bb = bb[np.isfinite(bb) & (bb > 0)]
        if len(bb):
            ax.plot(bb.index, bb.to_numpy(), color=_color(comp), ls="--", lw=1.6, marker=MARKERS[comp],
                    ms=3, mfc="none")
            drawn.add((comp, "bound"))
        if p is not None and len(p):
            pp = p[p["component"] == comp].groupby("layer")["plasticity"].mean().sort_index()
            if len(pp):
                ax.plot(pp.index, pp.to_numpy(), color=_color(comp), lw=1.8, marker=MARKERS[comp], ms=4)
                drawn.add((comp, "measured"))
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer")
    ax.set_ylabel("plasticity / upper bound (log scale)")
    ax.grid(alpha=0.3, which="both")
    return drawn


@styled
def plot_accuracy_distribution(counted: pd.DataFrame, path_stem: str | Path, *, title: str = "") -> list[Path]:
    """Test accuracy over learning rates x seeds per configuration, one panel per dataset (and optimizer).

    Every trial as a dot (the configuration's colour and marker) with, when the configuration has at least
    MIN_VIOLIN_POINTS trials there, its violin (when it has spread), quartiles and median, else the median (bar).
    """
    _require(counted, ["dataset", "configuration", "test_acc"], "trials")
    panels, constant = _facets(counted, ("model", "optimizer", "dataset"))
    fig, axes = _grid(len(panels), width=5.0, height=3.6)
    rng = np.random.default_rng(0)
    for ax, (name, rows) in zip(axes, panels):
        configs = _ordered(rows["configuration"].unique())
        groups = _finite_groups([(c, 100 * rows.loc[rows["configuration"] == c, "test_acc"].to_numpy(float))
                                 for c in configs], log=False)
        _violins(ax, groups, log=False, ylabel="test accuracy (%)", points=False)
        for pos, (config, v) in enumerate(groups, start=1):
            color, marker = configuration_styles(configs)[config]
            ax.scatter(pos + rng.uniform(-0.15, 0.15, v.size), v, s=14, color=color, marker=marker,
                       edgecolor="black", linewidth=0.3, alpha=0.8, zorder=4)
        ax.set_xlabel("configuration")
        if name:
            ax.set_title(name)
    _title(fig, title or "Test accuracy over learning rates × seeds", constant)
    return save_figure(fig, path_stem)


def best_runs(counted: pd.DataFrame) -> pd.DataFrame:
    """The ok trial with the highest test accuracy per model, dataset, optimizer and configuration
    (ties: the first ``trial_id``)."""
    t = counted.sort_values(["test_acc", "trial_id"], ascending=[False, True], kind="stable")
    return t.drop_duplicates(["model", "dataset", "optimizer", "configuration"]).reset_index(drop=True)


def fixed_runs(runs: pd.DataFrame, seed: int, lr: float) -> pd.DataFrame:
    """The trial at ``seed`` and ``lr`` (equal to 1e-9 relative) of each model, dataset, optimizer and
    configuration among ``runs`` (ties: the first ``trial_id``): the paper's Fig. 5 (middle and right) draws
    Sketch's runs at seed 42 and lr 1e-2."""
    t = runs[(runs["seed"] == seed) & np.isclose(runs["lr"].astype(float), lr, rtol=1e-9, atol=0.0)]
    t = t.sort_values("trial_id", kind="stable")
    return t.drop_duplicates(["model", "dataset", "optimizer", "configuration"]).reset_index(drop=True)


@styled
def plot_curves(curves: pd.DataFrame, runs: pd.DataFrame, path_stem: str | Path, *, title: str = "",
                legend: str = "best run") -> list[Path]:
    """Gradient norm (left) and validation loss (right) against the step for the given runs.

    ``runs``: one trial per configuration (e.g. :func:`best_runs` or :func:`fixed_runs` for one dataset and
    optimizer; ``legend`` titles the legend) with
    ``trial_id, configuration, lr``; ``curves`` follows ``curves.parquet``. Rows without a value (validation
    loss between evaluations) are skipped; log axis when a quantity spans more than :data:`LOG_RATIO`.
    """
    _require(curves, ["trial_id", "step", "grad_norm", "val_loss"], "curves")
    _require(runs, ["trial_id", "configuration"], "runs")
    fig, axes = _grid(2, width=5.4, height=3.8, max_cols=2)
    mine = curves[curves["trial_id"].isin(set(runs["trial_id"]))]
    for ax, col, label in zip(axes, ("grad_norm", "val_loss"), ("gradient norm", "validation loss")):
        drawn = False
        configs = _ordered(runs["configuration"].unique())
        for config in configs:
            r = runs[runs["configuration"] == config].iloc[0]
            c = mine[mine["trial_id"] == r["trial_id"]].dropna(subset=[col]).sort_values("step")
            if c.empty:
                continue
            lr = f", lr {_fmt_lr(r['lr'])}" if "lr" in r and pd.notna(r["lr"]) else ""
            ax.plot(c["step"], c[col], color=_color(config, configs), lw=1.5,
                    marker=_marker(config, configs) if len(c) < 30 else None, ms=3, label=f"{config}{lr}")
            drawn = True
        if drawn and _needs_log(mine[col].to_numpy()):
            ax.set_yscale("log")
        if not drawn:
            ax.text(0.5, 0.5, f"no {label} recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    _legend(fig, axes, legend)
    _title(fig, title, "")
    return save_figure(fig, path_stem)


def grouped_bars(ax, rows: pd.DataFrame, value: str, *, err: str | None = None, scale: float = 100.0) -> None:
    """Grouped bars on ``ax``: x = dataset (``overall`` last, after a dotted line), one bar per configuration
    (TRIALS_CONFIGURATIONS order, its colour) of ``scale * rows[value]``, error bars ``scale * rows[err]``."""
    datasets = list(dict.fromkeys(sorted(rows["dataset"].astype(str), key=lambda d: (d == "overall", d))))
    configs = _ordered(rows["configuration"].unique())
    width = 0.8 / max(len(configs), 1)
    x = np.arange(len(datasets))
    for k, config in enumerate(configs):
        r = rows[rows["configuration"] == config]
        r = r.set_index(r["dataset"].astype(str))
        y = [scale * float(r[value].get(d, np.nan)) for d in datasets]
        yerr = [scale * float(r[err].get(d, np.nan)) for d in datasets] if err else None
        ax.bar(x + (k - (len(configs) - 1) / 2) * width, y, width, yerr=yerr, color=_color(config, configs),
               label=config, edgecolor="white", linewidth=0.5, error_kw=dict(lw=0.8, capsize=1.5, ecolor="#333333"))
    if "overall" in datasets and len(datasets) > 1:
        ax.axvline(len(datasets) - 1.5, color="grey", lw=0.8, ls=":")
    category_ticks(ax, x, datasets)
    ax.grid(axis="y", alpha=0.3)


@styled
def plot_relative_gain(relative_gain: pd.DataFrame, path_stem: str | Path, *, title: str = "") -> list[Path]:
    """Grouped bars of the relative gain over linear probing, per dataset (and overall), per configuration.

    ``relative_gain`` as written by the analysis (``dataset, configuration, relative_gain`` fractions, and
    ``reference``: ``LP`` or ``Head``; rows with ``dataset == "overall"`` last); one panel per optimizer (and
    model).
    """
    _require(relative_gain, ["dataset", "configuration", "relative_gain"], "relative_gain")
    panels, constant = _facets(relative_gain, ("model", "optimizer"))
    n_ds = relative_gain["dataset"].nunique()
    ref = relative_gain["reference"].iloc[0] if "reference" in relative_gain.columns else "Head"
    fig, axes = _grid(len(panels), width=max(5.5, 0.75 * n_ds + 2.5), height=3.8, max_cols=1 if n_ds > 5 else 2)
    for ax, (name, rows) in zip(axes, panels):
        grouped_bars(ax, rows, "relative_gain")
        ax.axhline(0, color="black", lw=0.8)
        ax.set_ylabel(f"gain over {ref} (%)")
        if name:
            ax.set_title(name)
    _legend(fig, axes, "configuration")
    _title(fig, title or f"Relative gain over linear probing ({ref})", constant)
    return save_figure(fig, path_stem)
