"""Ties print as ties and count as ties: the headline, the rankings, the ranking table and the unit table.

The random-init control's LN1 and LN2 are bit-identical (same input, same initial weights); a sort printed
them as ``LN1 1.42 > LN2 1.42`` and every Kendall tau with the control depended on how the tie was broken.
Kendall's tau-b is computed here by hand from its definition (concordant, discordant and tied pairs)."""

from __future__ import annotations

import itertools
import math

import pandas as pd
import pytest

from raystudy.analysis.control import ranking_headlines
from raystudy.analysis.ranks import TIE_RTOL, order_string, tau_b
from raystudy.vocab import COMPONENTS, PAPER_RANKING


def tau_b_by_hand(x: list[float], y: list[float]) -> float:
    """(concordant - discordant) / sqrt((n0 - ties in x) (n0 - ties in y)) over all pairs."""
    nc = nd = tx = ty = 0
    for i, j in itertools.combinations(range(len(x)), 2):
        dx, dy = x[i] - x[j], y[i] - y[j]
        tx += dx == 0
        ty += dy == 0
        if dx * dy > 0:
            nc += 1
        elif dx * dy < 0:
            nd += 1
    n0 = len(x) * (len(x) - 1) // 2
    return (nc - nd) / math.sqrt((n0 - tx) * (n0 - ty))


def _rows(values: dict[str, float], weights: str) -> pd.DataFrame:
    return pd.DataFrame([dict(model="m", dataset="d", mode="embedding", layer=0, component=c, plasticity=v,
                              weights=weights) for c, v in values.items()])


#: The demo's shape: pretrained components apart, the control's LayerNorms bit-identical.
PRETRAINED = {"LN1": 0.38, "MHA": 6.20, "LN2": 0.33, "FC1": 1.92, "FC2": 0.42}
CONTROL = {"LN1": 1.4213, "MHA": 0.006, "LN2": 1.4213, "FC1": 0.32, "FC2": 0.16}


def test_a_tie_prints_as_a_tie_and_tau_b_counts_it():
    lines = ranking_headlines(_rows(PRETRAINED, "pretrained"), _rows(CONTROL, "random_init"))
    text = "\n".join(lines)
    assert "Random-init control (embedding mode, same pairs, mean over layers and datasets): " \
           "LN1 1.42 = LN2 1.42 > FC1 0.32 > FC2 0.16 > MHA 0.01" in text
    assert "random-init LN1 = LN2 > FC1 > FC2 > MHA" in text
    assert f"'=' joins values equal within a relative {TIE_RTOL:g}" in text
    paper = {c: len(PAPER_RANKING) - i for i, c in enumerate(PAPER_RANKING)}
    for a, b, first, second in (("measured", "random-init", PRETRAINED, CONTROL),
                                ("random-init", "paper", CONTROL, paper), ("measured", "paper", PRETRAINED, paper)):
        want = tau_b_by_hand([first[c] for c in COMPONENTS], [second[c] for c in COMPONENTS])
        assert f"{a} vs {b} {want:.2f} " in text, (a, b, want, text)
    # tau-b of the tie differs from either way of breaking it: the printed value depended on the sort
    broken = dict(CONTROL, LN2=CONTROL["LN2"] - 1e-3)
    assert tau_b_by_hand([CONTROL[c] for c in COMPONENTS], [paper[c] for c in COMPONENTS]) != pytest.approx(
        tau_b_by_hand([broken[c] for c in COMPONENTS], [paper[c] for c in COMPONENTS]))


def test_the_tolerance_is_relative_and_stated():
    v = pd.Series({"LN1": 1.0, "LN2": 1.0 + 0.5 * TIE_RTOL, "MHA": 1.0 + 10 * TIE_RTOL, "FC1": 2.0})
    assert order_string(v) == "FC1 > MHA > LN1 = LN2"
    assert order_string(v, lambda x: f"{x:.1f}") == "FC1 2.0 > MHA 1.0 > LN1 1.0 = LN2 1.0"
    tau, _ = tau_b(v, pd.Series({"LN1": 1.0, "LN2": 2.0, "MHA": 3.0, "FC1": 4.0}))
    assert tau == pytest.approx(tau_b_by_hand([1, 1, 2, 3], [1, 2, 3, 4]))
    assert math.isnan(tau_b(pd.Series({"a": 1.0, "b": 1.0}), pd.Series({"a": 1.0, "b": 2.0}))[0])  # one tie


def test_the_ranking_table_shows_and_counts_ties(tmp_path):
    from raystudy.analysis.stats import ranking_table
    from raystudy.analysis.tables import best_lr_table

    plasticity = _rows(CONTROL, "pretrained")
    accuracy = {"LN1": 0.70, "MHA": 0.60, "LN2": 0.71, "FC1": 0.66, "FC2": 0.65}
    trials = pd.DataFrame([dict(trial_id=f"t{i}", model="m", dataset="d", configuration=c, optimizer="sgd", lr=0.01,
                                seed=0, status="ok", test_acc=a, best_val_acc=a, diverged=False)
                           for i, (c, a) in enumerate(accuracy.items())])
    t = ranking_table(plasticity, best_lr_table(trials), trials)
    row = t[t["dataset"] == "d"].iloc[0]
    assert row["plasticity_ranking"] == "LN1 = LN2 > FC1 > FC2 > MHA"
    assert row["accuracy_ranking"] == "LN2 > LN1 > FC1 > FC2 > MHA"
    want = tau_b_by_hand([CONTROL[c] for c in COMPONENTS], [accuracy[c] for c in COMPONENTS])
    assert row["kendall"] == pytest.approx(want)
