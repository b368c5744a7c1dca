"""The analysis of plasticity along the pretraining (raystudy/analysis/pretraining.py) on a synthetic path whose
rankings are known: the random init's order held for the first steps, then the trained one. Means, rankings,
Kendall's tau-b (by hand, from concordant and discordant pairs) and the headline, then through the analysis
into its table, figure and report."""

from __future__ import annotations

import itertools
import math

import pandas as pd
import pytest

from raystudy.analysis.pretraining import path_headlines, pretraining_table
from raystudy.analysis.ranks import ranks
from raystudy.io import write_result
from raystudy.vocab import COMPONENTS, PAPER_RANKING

INIT = {"LN1": 1.4, "MHA": 0.02, "LN2": 1.4, "FC1": 0.32, "FC2": 0.15}  # LN1 = LN2: the random init's tie
EARLY = {"LN1": 1.0, "MHA": 0.09, "LN2": 0.97, "FC1": 0.36, "FC2": 0.17}  # the same order: not moved yet
TRAINED = {"LN1": 0.13, "MHA": 6.1, "LN2": 0.12, "FC1": 2.6, "FC2": 0.45}
PATH = {0: INIT, 30: EARLY, 300: TRAINED}


def tau_b_by_hand(x: list[float], y: list[float]) -> float:
    nc = nd = tx = ty = 0
    for i, j in itertools.combinations(range(len(x)), 2):
        dx, dy = x[i] - x[j], y[i] - y[j]
        tx, ty = tx + (dx == 0), ty + (dy == 0)
        nc, nd = nc + (dx * dy > 0), nd + (dx * dy < 0)
    n0 = len(x) * (len(x) - 1) // 2
    return (nc - nd) / math.sqrt((n0 - tx) * (n0 - ty))


def _rows() -> pd.DataFrame:
    """Two datasets x two layers per step; layer l and dataset d shift the value by +-, so means are PATH's."""
    return pd.DataFrame([dict(model="toy", dataset=ds, mode="embedding", step=step, layer=layer, component=c,
                              plasticity=v[c] * (1 + sign * 0.1), std=0.0, ci95=0.0, n_pairs=8)
                         for step, v in PATH.items() for ds, sign in (("a", 1), ("b", -1)) for layer in (0, 1)
                         for c in COMPONENTS])


def test_the_table_means_rankings_and_taus():
    t = pretraining_table(_rows()).set_index("step")
    paper = {c: len(PAPER_RANKING) - i for i, c in enumerate(PAPER_RANKING)}
    for step, v in PATH.items():
        assert [t.loc[step, c] for c in COMPONENTS] == pytest.approx([v[c] for c in COMPONENTS])
        for col, other in (("tau_init", INIT), ("tau_final", TRAINED), ("tau_paper", paper)):
            want = tau_b_by_hand([v[c] for c in COMPONENTS], [other[c] for c in COMPONENTS])
            assert t.loc[step, col] == pytest.approx(want), (step, col)
    assert t.loc[0, "ranking"] == "LN1 = LN2 > FC1 > FC2 > MHA"
    assert t.loc[30, "ranking"] == "LN1 > LN2 > FC1 > FC2 > MHA"
    assert t.loc[300, "ranking"] == "MHA > FC1 > FC2 > LN1 > LN2"
    assert ranks(pd.Series(INIT)).to_dict() == {"LN1": 1, "LN2": 1, "FC1": 3, "FC2": 4, "MHA": 5}


def test_the_headline_says_where_the_path_starts_ends_and_first_moves():
    (line,) = path_headlines(pretraining_table(_rows()))
    t = pretraining_table(_rows()).set_index("step")
    assert line.startswith("Along the pretraining (embedding mode, steps 0, 30, 300): step 0 (random init) "
                           "LN1 = LN2 > FC1 > FC2 > MHA")
    assert f"step 300 MHA > FC1 > FC2 > LN1 > LN2 (τ-b with the paper {t.loc[300, 'tau_paper']:.2f}" in line
    # step 30's ranking breaks the LN1 = LN2 tie: it differs from step 0's, so the path moved there
    assert "the ranking first departs from the random init's at step 30 (at step(s) 0 before it, a model " \
           "pretrained that little keeps the random-init order)" in line
    still = _rows()
    still.loc[still["step"] == 30, "plasticity"] = still.loc[still["step"] == 0, "plasticity"].to_numpy()
    assert "first departs from the random init's at step 300 (at step(s) 0, 30 before it" in \
        path_headlines(pretraining_table(still))[0]


def test_the_analysis_writes_the_table_the_figure_and_the_headline(tmp_path):
    from raystudy.analysis.html_report import write_report
    from raystudy.analysis.pipeline import run_analysis

    final = _rows()[lambda r: r["step"] == 300].drop(columns="step")
    write_result(final, tmp_path, "plasticity")
    write_result(_rows(), tmp_path, "plasticity_pretraining")
    res = run_analysis(tmp_path, figures=["plasticity_pretraining_path"])
    written = pd.read_csv(res.out_dir / "plasticity_pretraining.csv")
    assert written["step"].tolist() == [0, 30, 300] and written["ranking"].iloc[-1] == "MHA > FC1 > FC2 > LN1 > LN2"
    assert [f.name for f in res.figures] == ["plasticity_pretraining_path"]
    assert (res.out_dir / "figures" / "plasticity_pretraining_path.png").stat().st_size > 10_000
    md = write_report(res).with_suffix(".md").read_text()
    assert "Along the pretraining (embedding mode, steps 0, 30, 300)" in md
    assert "Plasticity along the pretraining" in md
