"""Figures of a study with many configurations (#45 item 3): the selection preset's 13 budgeted configurations
(7 criteria at 20% of units, 6 at 1% of weights) on three VTAB-1k tasks, every figure drawn from hand-built
tables (tests/support/study_tables.py, no Ray; saving replaced by a recorder) and read back as matplotlib
objects.

What is checked: in every figure each configuration has its own colour, the same in every figure, and any two
configurations' colours are at least :data:`MIN_DELTA_E` apart (CIE76 delta E in CIELAB, computed here from
sRGB by the CIE formulas); the vocabulary's documented colours are unchanged; the accuracy-against-lr figure
holds at most :data:`MAX_LINES` lines per panel and draws bands only where a panel has at most
:data:`MAX_BANDS` lines.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from matplotlib.collections import PathCollection, PolyCollection
from matplotlib.colors import to_hex, to_rgb
from matplotlib.container import ErrorbarContainer
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from raystudy.analysis.pipeline import run_analysis
from tests.support.study_tables import SELECTION_CONFIGS, SELECTION_TASKS, selection_study

#: The smallest CIE76 delta E between two configurations' colours in one figure: the Okabe-Ito blue and sky
#: blue of the vocabulary are 26.4 apart; the colours the demo's report repeated were 17.5 (auto:20% #31A354,
#: grad:20% #2CA02C) and 12.2 apart (rgn:20% #8C564B, taylor:1%:weights #843C39).
MIN_DELTA_E = 25.0
#: Lines per panel of the accuracy-against-lr figure, and the most lines a panel draws with their bands.
MAX_LINES, MAX_BANDS = 8, 4
#: The documented colours of the vocabulary's configurations (docs: raystudy/analysis/style.py's docstring).
VOCABULARY_COLOURS = {"LN1": "#0072B2", "MHA": "#D55E00", "LN2": "#009E73", "FC1": "#E69F00", "FC2": "#CC79A7",
                      "All": "#000000", "Emb": "#56B4E9", "Head": "#555555", "LP": "#F0E442"}


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    """``(analysis result, {figure name: Figure})`` of the selection-shaped study, every figure recorded."""
    study = selection_study(tmp_path_factory.mktemp("thirteen") / "study", curves=True)
    figures: dict[str, Figure] = {}

    def record(fig, fname, *args, **kwargs):
        figures.setdefault(Path(fname).name.rsplit(".", 1)[0], fig)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Figure, "savefig", record)
        res = run_analysis(study)
    return res, figures


def lab(hex_colour: str) -> np.ndarray:
    """CIELAB (D65) of an sRGB colour: linearise, XYZ by the sRGB matrix, then the CIE 1976 formulas."""
    c = np.array(to_rgb(hex_colour))
    rgb = np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]) @ rgb
    t = xyz / np.array([0.95047, 1.0, 1.08883])
    f = np.where(t > (6 / 29) ** 3, np.cbrt(t), t / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def delta_e(a: str, b: str) -> float:
    return float(np.linalg.norm(lab(a) - lab(b)))


def _handle_colour(h) -> str:
    if isinstance(h, ErrorbarContainer):
        h = h.lines[0]
    if isinstance(h, Line2D):
        return to_hex(h.get_color() if h.get_linestyle() not in ("None", "", " ") else h.get_markerfacecolor())
    if isinstance(h, Patch):
        return to_hex(h.get_facecolor())
    colours = h.get_facecolor() if len(h.get_facecolor()) else h.get_edgecolor()  # an error bar's LineCollection
    return to_hex(colours[0])


def configuration_colours(fig: Figure) -> dict[str, set[str]]:
    """{configuration: the colours the figure draws it in}: its legend entries, the artists it labels, the
    points above its tick on a categorical axis, the title of its panel."""
    out: dict[str, set[str]] = {}
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
    for leg in legends:
        for text, h in zip(leg.get_texts(), leg.legend_handles):
            if text.get_text() in SELECTION_CONFIGS:
                out.setdefault(text.get_text(), set()).add(_handle_colour(h))
    for ax in fig.axes:
        for line in ax.lines:
            if line.get_label() in SELECTION_CONFIGS:
                out.setdefault(line.get_label(), set()).add(to_hex(line.get_color()))
        if ax.get_title() in SELECTION_CONFIGS:
            out.setdefault(ax.get_title(), set()).add(to_hex(ax.title.get_color()))
        ticks = {round(float(t), 6): lab_.get_text() for t, lab_ in zip(ax.get_xticks(), ax.get_xticklabels())}
        for c in ax.collections:
            if not isinstance(c, PathCollection) or not len(c.get_offsets()) or not ticks:
                continue
            x = float(np.mean(c.get_offsets()[:, 0]))
            name = ticks[min(ticks, key=lambda t: abs(t - x))]
            if name in SELECTION_CONFIGS and abs(min(ticks, key=lambda t: abs(t - x)) - x) < 0.3:
                out.setdefault(name, set()).add(to_hex(c.get_facecolors()[0]))
    return out


def test_every_figure_tells_the_thirteen_configurations_apart(drawn):
    _, figures = drawn
    seen: dict[str, str] = {}
    checked = []
    for name, fig in figures.items():
        colours = configuration_colours(fig)
        if not colours:  # the units heatmap, the every-run curves (colour = lr): no configuration colour
            continue
        checked.append(name)
        assert all(len(c) == 1 for c in colours.values()), (name, colours)
        one = {k: next(iter(v)) for k, v in colours.items()}
        assert len(set(one.values())) == len(one), (name, one)
        closest = min((delta_e(one[a], one[b]), a, b) for a, b in itertools.combinations(one, 2))
        assert closest[0] >= MIN_DELTA_E, (name, closest)
        for config, colour in one.items():
            assert seen.setdefault(config, colour) == colour, (name, config)  # one colour in every figure
    assert set(seen) == set(SELECTION_CONFIGS)
    assert {"accuracy_distribution", "accuracy_vs_lr", "accuracy_vs_params", "best_accuracy_per_dataset",
            "frontier_overall", "vtab_frontier"} <= set(checked), checked
    assert all(len(configuration_colours(figures[n])) == len(SELECTION_CONFIGS)
               for n in ("accuracy_distribution", "accuracy_vs_lr", "vtab_frontier"))


def test_the_vocabularys_colours_stay_and_expressions_keep_away_from_them():
    from raystudy.analysis.style import CONFIGURATION_COLORS, configuration_styles
    from raystudy.vocab import TRIALS_CONFIGURATIONS

    assert {k: v.upper() for k, v in CONFIGURATION_COLORS.items()} == VOCABULARY_COLOURS
    styles = configuration_styles([*TRIALS_CONFIGURATIONS, *SELECTION_CONFIGS])
    assert {k: styles[k][0].upper() for k in TRIALS_CONFIGURATIONS} == VOCABULARY_COLOURS
    for a, b in itertools.combinations([*TRIALS_CONFIGURATIONS, *SELECTION_CONFIGS], 2):
        assert styles[a] != styles[b]
        if a in SELECTION_CONFIGS or b in SELECTION_CONFIGS:  # the vocabulary's own pairs: the test above
            assert delta_e(styles[a][0], styles[b][0]) >= MIN_DELTA_E, (a, b, styles[a], styles[b])
    many = [f"auto:{k}%" for k in range(1, 21)]  # 20 expressions: 20 distinct colours, then markers tell apart
    assert len({configuration_styles(many)[n][0] for n in many}) == 20
    more = configuration_styles(many + ["auto:25%", "auto:30%"])
    assert len(set(more.values())) == 22


def test_accuracy_against_lr_reads_at_thirteen_configurations(drawn):
    _, figures = drawn
    fig = figures["accuracy_vs_lr"]
    panels = [ax for ax in fig.axes if ax.get_xlabel() == "learning rate"]
    per_panel = [[ln.get_label() for ln in ax.lines if ln.get_label() in SELECTION_CONFIGS] for ax in panels]
    bands = [[c for c in ax.collections if isinstance(c, PolyCollection)] for ax in panels]
    assert all(0 < len(lines) <= MAX_LINES for lines in per_panel), per_panel
    assert all(not b or len(lines) <= MAX_BANDS for lines, b in zip(per_panel, bands))
    assert sum(len(b) for b in bands) == sum(len(lines) for lines in per_panel if len(lines) <= MAX_BANDS)
    # every configuration on every task, once: a panel per (task, budget), the budget's criteria together
    drawn_once = sorted((ax.get_title(), c) for ax, lines in zip(panels, per_panel) for c in lines)
    assert len(drawn_once) == len(set(drawn_once)) == len(SELECTION_TASKS) * len(SELECTION_CONFIGS)
    for ax, lines in zip(panels, per_panel):
        budgets = {c.split(":", 1)[1] for c in lines}
        assert len(budgets) == 1 and next(iter(budgets)).split(":")[0] in ax.get_title(), (ax.get_title(), lines)
    assert len(panels) == len(SELECTION_TASKS) * 2
