"""Figures a reader can tell apart: a colour and a marker for each of 8 configurations, long titles wrapped."""

from __future__ import annotations

from pathlib import Path

from tests.support.study_tables import configuration_study

BEYOND_8 = ("MHA+FC1", "MHA@2-3", "MHA@0", "MHA@3", "FC1@0", "auto:10%", "random:10%", "lora:r=12")


def test_every_figure_of_8_configurations_gives_each_its_own_colour_and_marker(tmp_path, monkeypatch):
    import numpy as np
    from matplotlib.colors import to_hex

    from raystudy.analysis import authors_figures as AF
    from raystudy.analysis import figures as F
    from raystudy.analysis import sweep_figures as SF
    from raystudy.analysis.pipeline import run_analysis

    drawn = {}

    def keep(fig, stem):  # recorded, not written: the test draws each figure itself below
        drawn[Path(stem).name] = fig
        return [Path(f"{stem}.png"), Path(f"{stem}.svg")]

    monkeypatch.setattr(F, "save_figure", keep)
    monkeypatch.setattr(SF, "save_figure", keep)
    monkeypatch.setattr(AF, "save_figure", keep)
    res = run_analysis(configuration_study(tmp_path / "s", set(BEYOND_8)))
    assert {f.name for f in res.figures} == set(drawn)
    assert {"accuracy_vs_params", "accuracy_vs_lr", "best_accuracy_per_dataset", "frontier_overall"} <= set(drawn)
    seen = {}  # configuration -> (colour, marker) across every figure
    for name, fig in drawn.items():
        renderer = fig.canvas.get_renderer()
        fig.canvas.draw()
        if fig._suptitle is not None:  # the title inside the figure, not clipped on either side
            box = fig._suptitle.get_window_extent(renderer)
            assert box.x0 >= 0 and box.x1 <= fig.bbox.width, (name, box, fig.bbox.width)
        for ax in fig.axes:  # category tick labels side by side never overlap (8 configuration names)
            boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
            for a, b in zip(boxes, boxes[1:]):
                assert not a.overlaps(b), (name, [t.get_text() for t in ax.get_xticklabels()])
        for legend in fig.legends:
            styles = {}
            for handle, text in zip(legend.legend_handles, legend.get_texts()):
                label = text.get_text()
                if label in BEYOND_8:
                    color = handle.get_color() if hasattr(handle, "get_color") else handle.get_facecolor()
                    color = np.asarray(color) if not isinstance(color, str) else color
                    marker = handle.get_marker() if hasattr(handle, "get_marker") else None
                    styles[label] = (to_hex(color[0] if getattr(color, "ndim", 0) == 2 else color), marker)
            if styles:
                assert len(styles) == 8, (name, styles)
                assert len({c for c, _ in styles.values()}) == 8, (name, styles)  # 8 distinct colours
                for label, style in styles.items():
                    if style[1] is not None and label in seen and seen[label][1] is not None:
                        assert seen[label] == style, (name, label)  # the same in every figure
                    seen.setdefault(label, style)
    assert len(seen) == 8


def test_a_title_longer_than_its_figure_is_wrapped_not_clipped():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from raystudy.analysis.figures import _title

    fig = Figure(figsize=(3.5, 3), layout="constrained")
    FigureCanvasAgg(fig)
    fig.subplots()
    _title(fig, "Test accuracy at each fixed learning rate of every configuration", "model vit_tiny · sgd")
    fig.canvas.draw()
    box = fig._suptitle.get_window_extent(fig.canvas.get_renderer())
    assert fig._suptitle.get_text().count("\n") >= 1
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width, (box, fig.bbox.width)

