"""Figures a reader can trust (#32 item 6): every figure of the analysis, for a study of the demo's shape and
one of eight configurations, drawn from hand-built tables (no Ray) and inspected as matplotlib objects.

Saving is replaced by a recorder (the figures are built as in a real analysis; only the PNG and SVG writes are
skipped, which keeps this file to seconds). What is checked: bars start at 0; lr axes are ticked at the grid's
values, labelled plainly; no violin of fewer than 5 values (the values are drawn instead); every configuration
has its own colour and marker, the same in every figure, and the palette stays distinct under simulated
colour-blindness (computed here, Machado et al. 2009); every text takes a size of one scale; a legend names
only what its figure draws (no "diverged" when nothing diverged); datasets are told apart in the scatter
plots; the report's table of contents has no duplicate label and shows every figure at its true size.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import PathCollection, PolyCollection
from matplotlib.colors import to_hex, to_rgb
from matplotlib.container import BarContainer, ErrorbarContainer
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.markers import MarkerStyle
from matplotlib.patches import Patch
from matplotlib.text import Text

from raystudy.analysis.figure_jobs import FigureInfo
from raystudy.analysis.html_report import _figure, toc_entries, unique_labels
from raystudy.analysis.pipeline import run_analysis
from raystudy.analysis.scope import scope_items
from raystudy.io import write_result

MODEL = "vit_tiny"
DEMO = dict(configs=("MHA", "LN1", "LN2", "FC1", "FC2", "Head"), lrs=(0.03, 0.3), datasets=("dsA", "dsB"),
            seeds=(0, 1), diverged=False, rates=False)
EIGHT = dict(configs=("LN1", "MHA", "LN2", "FC1", "FC2", "All", "Emb", "Head"), lrs=(0.01, 0.03, 0.3),
             datasets=("dsA", "dsB", "dsC"), seeds=(0, 1), diverged=True, rates=True)
COMPONENTS = ("LN1", "MHA", "LN2", "FC1", "FC2")
#: Trainable parameters (Head and LP train the same head: the same count, drawn side by side).
PARAMS = {"LN1": 1_536, "MHA": 28_224, "LN2": 1_537, "FC1": 56_448, "FC2": 55_344, "All": 143_000, "Emb": 9_000,
          "Head": 1_000, "LP": 1_000}
SHIFT = {"LN1": -0.04, "MHA": 0.03, "LN2": -0.03, "FC1": 0.025, "FC2": 0.01, "All": 0.035, "Emb": 0.0, "Head": -0.08}
#: The scatter markers a figure may use, to recognise a PathCollection's marker by its path.
MARKER_NAMES = ("o", "s", "^", "v", "D", "P", "X", "*", "h", "<", ">", "p", "x")


# ---------------------------------------------------------------- a study written by hand

def _trials(spec: dict) -> pd.DataFrame:
    rows = []
    for di, ds in enumerate(spec["datasets"]):
        for config, (li, lr), s in itertools.product(spec["configs"], enumerate(spec["lrs"]), spec["seeds"]):
            acc = 0.6 + 0.05 * di + SHIFT[config] + 0.01 * li + 0.004 * s + 0.001 * len(rows) % 0.003
            status = "diverged" if spec["diverged"] and (config, li, s, di) == ("MHA", len(spec["lrs"]) - 1, 1, 0) \
                else "ok"
            rows.append(dict(trial_id=f"{ds}-{config}-{lr:g}-s{s}", dataset=ds, model=MODEL, configuration=config,
                             optimizer="sgd", lr=lr, seed=s, steps=40, batch_size=8,
                             trainable_params=PARAMS[config], status=status, best_val_acc=acc, best_val_step=20,
                             test_acc=acc, final_val_loss=1.0, wall_seconds=1.0))
        rows.append(dict(trial_id=f"{ds}-LP-s0", dataset=ds, model=MODEL, configuration="LP", optimizer=None,
                         lr=np.nan, seed=0, steps=None, batch_size=None, trainable_params=PARAMS["LP"],
                         status="ok", best_val_acc=np.nan, best_val_step=None, test_acc=0.5 + 0.05 * di,
                         final_val_loss=np.nan, wall_seconds=1.0))
    df = pd.DataFrame(rows)
    for c in ("trainable_params", "best_val_step", "steps", "batch_size"):
        df[c] = df[c].astype("Int64")
    return df


def _changes(trials: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for t in trials[trials["configuration"] != "LP"].itertuples():
        trained = COMPONENTS if t.configuration == "All" else (t.configuration,)
        for layer in range(2):
            rows += [dict(trial_id=t.trial_id, layer=layer, component=c, measure="weight_change",
                          value=0.01 * (1 + COMPONENTS.index(c)) * (1 + t.lr) if c in trained else 0.0)
                     for c in COMPONENTS]
            rows.append(dict(trial_id=t.trial_id, layer=layer, component=None, measure="cka",
                             value=0.9 - 0.1 * layer - t.lr / 3))
    return pd.DataFrame(rows)


def _curves(trials: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame([dict(trial_id=t.trial_id, step=step, lr_now=t.lr, train_loss=2.0 / (1 + step),
                              grad_norm=(1 + t.lr) / (1 + step / 10), val_loss=2.0 - t.test_acc + 1 / (1 + step),
                              val_acc=t.test_acc) for t in trials[trials["configuration"] != "LP"].itertuples()
                         for step in range(0, 40, 10)])


def _plasticity_tables(spec: dict, study: Path) -> None:
    base = {"LN1": 0.4, "MHA": 3.0, "LN2": 0.6, "FC1": 2.0, "FC2": 1.3}
    p = [dict(model=MODEL, dataset=ds, mode="embedding", layer=layer, component=c,
              plasticity=base[c] * (1 + 0.1 * layer + 0.05 * di), std=0.1, ci95=0.05, n_pairs=6)
         for di, ds in enumerate(spec["datasets"]) for layer in range(4) for c in COMPONENTS]
    write_result(pd.DataFrame(p), study, "plasticity")
    write_result(pd.DataFrame([dict(model=MODEL, layer=layer, component=c, bound=base[c] * 20, radius=19.4, seq_len=17)
                               for layer in range(4) for c in COMPONENTS]), study, "bounds")
    if spec["rates"]:
        write_result(pd.DataFrame([dict(r, pair=i, rate=r["plasticity"] * (0.7 + 0.1 * i)) for r in p
                                   for i in range(6)]).drop(columns=["plasticity", "std", "ci95", "n_pairs"]),
                     study, "rates")


def _study(path: Path, spec: dict) -> Path:
    trials = _trials(spec)
    write_result(trials, path, "trials")
    write_result(_curves(trials), path, "curves")
    write_result(_changes(trials), path, "changes")
    _plasticity_tables(spec, path)
    return path


@pytest.fixture(scope="module", params=["demo", "eight"])
def drawn(request, tmp_path_factory):
    """``(spec, analysis result, {figure name: Figure})`` with every figure of the analysis recorded at save."""
    spec = DEMO if request.param == "demo" else EIGHT
    study = _study(tmp_path_factory.mktemp(request.param) / "study", spec)
    figures: dict[str, Figure] = {}

    def record(fig, fname, *args, **kwargs):
        name = Path(fname).name.rsplit(".", 1)[0]
        if name not in figures:
            for ax in fig.axes:  # the tick labels, made now under the figure's style
                ax.get_xticklabels(), ax.get_yticklabels()
            figures[name] = fig

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Figure, "savefig", record)
        res = run_analysis(study)
    return spec, res, figures


# ---------------------------------------------------------------- what a figure draws

def _scatter_marker(c: PathCollection) -> str | None:
    path = c.get_paths()[0].vertices
    for m in MARKER_NAMES:
        style = MarkerStyle(m)
        ref = style.get_path().transformed(style.get_transform()).vertices
        if ref.shape == path.shape and np.allclose(ref, path):
            return m
    return None


def _drawn(fig: Figure) -> dict[str, set]:
    """Colours, line styles, markers and labels of the artists drawn on the panels of ``fig``."""
    out: dict[str, set] = {"color": set(), "ls": set(), "marker": set(), "label": set()}
    for ax in fig.axes:
        for line in ax.lines:
            out["color"] |= {to_hex(line.get_color()), to_hex(line.get_markerfacecolor())}
            out["ls"].add(line.get_linestyle())
            out["marker"].add(line.get_marker())
        for c in ax.collections:
            out["color"] |= {to_hex(x) for x in [*c.get_facecolors(), *c.get_edgecolors()]}
            if isinstance(c, PathCollection) and len(c.get_offsets()):
                out["marker"].add(_scatter_marker(c))
        out["color"] |= {to_hex(p.get_facecolor()) for p in ax.patches}
        out["label"] |= {a.get_label() for a in [*ax.lines, *ax.collections, *ax.containers]}
    return out


def _legend_entries(fig: Figure) -> list[tuple[str, object]]:
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
    return [(t.get_text(), h) for leg in legends for t, h in zip(leg.get_texts(), leg.legend_handles)]


def _handle_style(h) -> tuple[str, str | None, str | None]:
    """(colour, line style or None, marker or None) of a legend handle."""
    if isinstance(h, ErrorbarContainer):
        h = h.lines[0]
    if isinstance(h, Line2D):
        ls = h.get_linestyle() if h.get_linestyle() not in ("None", "", " ") else None
        marker = h.get_marker() if h.get_marker() not in ("None", "", " ", None) else None
        color = h.get_markeredgecolor() if ls is None and h.get_markerfacecolor() == "none" else h.get_color()
        return to_hex(color), ls, marker
    if isinstance(h, Patch):
        return to_hex(h.get_facecolor()), None, None
    colours = h.get_facecolor() if len(h.get_facecolor()) else h.get_edgecolor()  # errorbar: a LineCollection
    return to_hex(colours[0]), None, None


def _configuration_colors(fig: Figure, names) -> dict[str, tuple[str, str | None]]:
    """{configuration: (colour, marker)} of the legend entries of ``fig`` that name a configuration."""
    return {text: _handle_style(h)[::2] for text, h in _legend_entries(fig) if text.split(",")[0] in names}


# ---------------------------------------------------------------- the checks

def test_bars_start_at_zero(drawn):
    _, _, figures = drawn
    with_bars = [n for n, f in figures.items() if any(isinstance(c, BarContainer) for ax in f.axes
                                                      for c in ax.containers)]
    assert {"best_accuracy", "best_accuracy_per_dataset", "relative_gain"} <= set(with_bars)
    for name in with_bars:
        for ax in figures[name].axes:
            bars = [p for c in ax.containers if isinstance(c, BarContainer) for p in c.patches]
            assert all(p.get_y() == 0 for p in bars), name
            assert not bars or ax.get_ylim()[0] <= 0, (name, ax.get_ylim())
    assert all(ax.get_ylim()[0] == 0 for n in ("best_accuracy", "best_accuracy_per_dataset") for ax in figures[n].axes)


def test_lr_axes_are_ticked_at_the_grid(drawn):
    spec, _, figures = drawn
    axes = [ax for f in figures.values() for ax in f.axes if ax.get_xlabel() == "learning rate"]
    assert axes and all(ax in figures["accuracy_vs_lr"].axes for ax in axes)
    for ax in axes:
        assert ax.get_xscale() == "log"
        assert ax.get_xticks().tolist() == pytest.approx(list(spec["lrs"]))
        assert [t.get_text() for t in ax.get_xticklabels()] == [f"{lr:g}" for lr in spec["lrs"]]
        assert ax.get_xticks(minor=True).size == 0
    assert [t.get_text() for t in axes[0].get_xticklabels()][:2] == (["0.03", "0.3"] if spec is DEMO
                                                                     else ["0.01", "0.03"])


def test_no_violin_of_fewer_than_five_values(drawn):
    spec, res, figures = drawn
    n_values = len(spec["lrs"]) * len(spec["seeds"])  # per dataset and configuration
    dist = figures["accuracy_distribution"]
    violins = [c for ax in dist.axes for c in ax.collections if isinstance(c, PolyCollection)]
    expected = len(spec["datasets"]) * len(spec["configs"]) if n_values >= 5 else 0
    assert len(violins) == expected
    dots = sum(len(c.get_offsets()) for ax in dist.axes for c in ax.collections
               if isinstance(c, PathCollection) and _scatter_marker(c) not in (None, "x") and len(c.get_offsets()) > 1)
    assert dots >= len(res.inputs.counted) - 1  # every trial drawn (a single-point group is counted out above)
    # the paper's boxes of per-layer plasticity (datasets pooled: one box per component); raystudy's violins of
    # the per-pair rates only with rates.parquet (eight: 24 rates per component and dataset)
    boxes = figures["plasticity_distribution"]
    assert [len(ax.patches) for ax in boxes.axes] == [len(COMPONENTS)]
    assert not [c for ax in boxes.axes for c in ax.collections if isinstance(c, PolyCollection)]
    assert ("plasticity_rate_violins" in figures) == spec["rates"]
    if spec["rates"]:
        violins = figures["plasticity_rate_violins"]
        polys = [c for ax in violins.axes for c in ax.collections if isinstance(c, PolyCollection)]
        assert len(polys) == len(COMPONENTS) * len(spec["datasets"])


def test_every_configuration_has_its_own_colour_and_marker(drawn):
    spec, _, figures = drawn
    names = (*spec["configs"], "LP")
    seen: dict[str, tuple] = {}
    for fname, fig in figures.items():
        styles = _configuration_colors(fig, names)
        by_config = {}
        for text, style in styles.items():
            by_config.setdefault(text.split(",")[0], style)
        colours = [c for c, _ in by_config.values()]
        assert len(set(colours)) == len(colours), (fname, by_config)
        for config, (colour, _marker) in by_config.items():
            assert seen.setdefault(config, colour) == colour, (fname, config)  # one colour in every figure
    assert {"LN1", "LN2", "Head", "LP"} <= set(seen)
    vs_lr = figures["accuracy_vs_lr"].axes[0]
    lines = {ln.get_label(): (to_hex(ln.get_color()), ln.get_marker()) for ln in vs_lr.lines
             if ln.get_label() in spec["configs"]}
    assert len(lines) == len(spec["configs"])
    assert len({c for c, _ in lines.values()}) == len({m for _, m in lines.values()}) == len(lines)
    params = {c.get_label(): c.lines[0].get_xdata()[0] for c in figures["accuracy_vs_params"].axes[0].containers}
    assert PARAMS["Head"] == PARAMS["LP"] and params["Head"] != params["LP"]  # side by side, not one on the other
    assert params["Head"] == pytest.approx(PARAMS["Head"], rel=0.2)


#: Machado, Oliveira & Fernandes (2009) dichromacy simulation matrices (severity 1) on linear RGB.
CVD = {"normal": np.eye(3),
       "protanopia": np.array([[0.152286, 1.052583, -0.204868], [0.114503, 0.786281, 0.099216],
                               [-0.003882, -0.048116, 1.051998]]),
       "deuteranopia": np.array([[0.367322, 0.860646, -0.227968], [0.280085, 0.672501, 0.047413],
                                 [-0.011820, 0.042940, 0.968881]]),
       "tritanopia": np.array([[1.255528, -0.076749, -0.178779], [-0.078411, 0.930809, 0.147602],
                               [0.004733, 0.691367, 0.303900]])}


def _lab(hex_colour: str, matrix: np.ndarray) -> np.ndarray:
    """CIELAB (D65) of ``hex_colour`` seen through ``matrix``."""
    c = np.array(to_rgb(hex_colour))
    rgb = np.clip(matrix @ np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4), 0, 1)
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]) @ rgb
    t = xyz / np.array([0.95047, 1.0, 1.08883])
    f = np.where(t > (6 / 29) ** 3, np.cbrt(t), t / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def test_the_palette_is_told_apart_by_every_reader():
    from raystudy.analysis.style import CONFIGURATION_COLORS, MARKERS, configuration_styles
    from raystudy.vocab import TRIALS_CONFIGURATIONS

    styles = configuration_styles(TRIALS_CONFIGURATIONS)
    assert len({c for c, _ in styles.values()}) == len({m for _, m in styles.values()}) == len(TRIALS_CONFIGURATIONS)
    worst = min((np.linalg.norm(_lab(CONFIGURATION_COLORS[a], m) - _lab(CONFIGURATION_COLORS[b], m)), a, b, v)
                for a, b in itertools.combinations(TRIALS_CONFIGURATIONS, 2) for v, m in CVD.items())
    assert worst[0] >= 15, worst  # CIE76 delta E: the old palette's All / Head were 9.7 apart (tritanopia)
    ln = np.linalg.norm(_lab(CONFIGURATION_COLORS["LN1"], np.eye(3)) - _lab(CONFIGURATION_COLORS["LN2"], np.eye(3)))
    assert ln >= 50  # LN1 and LN2 were two blues 26 apart
    assert MARKERS["LN1"] != MARKERS["LN2"] and MARKERS["Head"] != MARKERS["LP"]


def test_one_font_scale(drawn):
    from raystudy.analysis.style import FONT

    _, _, figures = drawn
    titles, ticks = set(), set()
    for name, fig in figures.items():
        texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
        sizes = {t.get_fontsize() for t in texts}
        assert sizes <= set(FONT.values()), (name, sizes)
        if fig._suptitle is not None:
            titles.add(fig._suptitle.get_fontsize())
        ticks |= {t.get_fontsize() for ax in fig.axes for t in ax.get_yticklabels() if t.get_text()}
    assert len(titles) == 1 and len(ticks) == 1, (titles, ticks)  # the same in the bounds figure as elsewhere


def test_legends_name_only_what_is_drawn(drawn):
    spec, _, figures = drawn
    for name, fig in figures.items():
        d = _drawn(fig)
        for text, h in _legend_entries(fig):
            if text in d["label"]:
                continue
            colour, ls, marker = _handle_style(h)
            r, g, b = to_rgb(colour)
            assert (r == g == b) or colour in d["color"], (name, text, colour)
            assert ls is None or ls in d["ls"], (name, text, ls)
            assert marker is None or marker in d["marker"], (name, text, marker)
        texts = [t for t, _ in _legend_entries(fig)]
        assert len(texts) == len(set(texts)), name
    every_run = [t for n, f in figures.items() if n.startswith("curves_all") for t, _ in _legend_entries(f)]
    assert ("diverged" in every_run) == spec["diverged"]
    assert ("diverged" in [t for t, _ in _legend_entries(figures["accuracy_fixed_lr_sgd"])]) is False


def test_datasets_are_told_apart_in_scatter_plots(drawn):
    spec, _, figures = drawn
    for name in ("change_vs_plasticity", "cka_vs_gain"):
        fig = figures[name]
        texts = [t for t, _ in _legend_entries(fig)]
        assert set(spec["datasets"]) <= set(texts), name
        markers = {_scatter_marker(c) for ax in fig.axes for c in ax.collections if isinstance(c, PathCollection)}
        assert len(markers - {None}) == len(spec["datasets"]), (name, markers)


def test_table_of_contents_labels_are_unique(drawn):
    _, res, _ = drawn
    titles = [r.title for r in res.rendered.values()] + [f.title for f in res.figures]
    assert len(set(titles)) < len(titles)  # a table and its figure share a title ("Relative gain over ...")
    labels = [label for _, label in toc_entries(res)]
    anchors = [a for a, _ in toc_entries(res)]
    assert len(set(labels)) == len(labels) and len(set(anchors)) == len(anchors)
    sections = ["summary", *(["scope"] if scope_items(res) else []), *(["notes"] if res.notes or res.footnote else [])]
    assert anchors == [*sections, *(f"table-{n}" for n in res.rendered), *(f"figure-{f.name}" for f in res.figures)]


def test_unique_labels_and_true_size_figures(tmp_path):
    assert unique_labels(["A", "B", "A", "A"], ["table", "table", "figure", "figure"]) == \
        ["A (table)", "B", "A (figure)", "A (figure 2)"]
    from raystudy.analysis.figures import save_figure

    fig = Figure(figsize=(6.0, 4.2))
    fig.subplots().plot([0, 1], [0, 1])
    paths = save_figure(fig, tmp_path / "f")
    html = _figure(FigureInfo("f", "F", "c", paths))
    assert re.search(r'width="(\d+)"', html).group(1) == str(round(6.0 * 96))  # 6 inches at 96 CSS px each


def test_points_at_nearly_the_same_x_are_drawn_side_by_side():
    from raystudy.analysis.sweep_figures import DODGE, dodged

    x = np.array([1000.0, 28_224.0, 1000.0, 1536.0, 1537.0])
    lo, hi = 1000 / np.sqrt(DODGE), 1000 * np.sqrt(DODGE)
    mid = np.sqrt(1536 * 1537)
    assert dodged(x) == pytest.approx([lo, 28_224.0, hi, mid / np.sqrt(DODGE), mid * np.sqrt(DODGE)])
