"""Rankings with ties: when two values tie, how a ranking prints, and Kendall's tau-b between two rankings.

Two values tie when they differ by at most :data:`TIE_RTOL` of the larger magnitude::

    |a - b| <= TIE_RTOL * max(|a|, |b|)

(a random-init control's LN1 and LN2 see the same input with the same initial weights: bit-identical
plasticity, which a sort would otherwise print as an order). A ranking prints most first, ``" > "`` between
tie groups and ``" = "`` within one (``MHA 6.20 > FC1 1.92 > LN1 1.42 = LN2 1.42``), tied names in their
given order. Correlations of rankings use the values with each tie group set to one value, so Kendall's
tau is tau-b (``scipy.stats.kendalltau``'s default, which corrects for ties) and a tie never counts as an
order either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pandas as pd
from scipy import stats

#: Relative tolerance within which two values tie (see the module docstring).
TIE_RTOL = 1e-6
#: How the reports state the tie rule.
TIE_RULE = f"'=' joins values equal within a relative {TIE_RTOL:g}"


def tie_groups(values: pd.Series) -> list[list]:
    """The index labels of ``values`` (NaN left out), most first, grouped where values tie: each group holds
    the values within :data:`TIE_RTOL` of its first (largest) one, in their given order."""
    groups: list[list] = []
    first = math.nan
    for label, v in values.dropna().sort_values(ascending=False, kind="stable").items():
        if groups and math.isclose(v, first, rel_tol=TIE_RTOL, abs_tol=0.0):
            groups[-1].append(label)
        else:
            groups.append([label])
            first = v
    position = {label: i for i, label in enumerate(values.index)}
    return [sorted(g, key=position.__getitem__) for g in groups]


def tied(values: pd.Series) -> pd.Series:
    """``values`` with each tie group's values set to its first one (exact ties, for ``scipy.stats``)."""
    out = values.astype(float).copy()
    for group in tie_groups(values):
        out.loc[group] = float(values.loc[group[0]])
    return out


def order_string(values: pd.Series, fmt: Callable[[float], str] | None = None,
                 label: Callable[[object], str] = str) -> str:
    """``values`` as a ranking, most first: ``"MHA > FC1 > LN1 = LN2"``; with ``fmt`` each name followed by
    its value (``"MHA 6.20 > ..."``); ``label`` prints an index label."""
    def item(k) -> str:
        return f"{label(k)} {fmt(values.loc[k])}" if fmt else label(k)
    return " > ".join(" = ".join(item(k) for k in group) for group in tie_groups(values))


def ranks(values: pd.Series) -> pd.Series:
    """Each component's rank (1: most plastic; a tie shares its group's best rank)."""
    out, rank = {}, 1
    for group in tie_groups(values):
        out.update({c: rank for c in group})
        rank += len(group)
    return pd.Series(out, dtype=float)


def strict_scores(ranking: Sequence[str]) -> pd.Series:
    """A strict ranking (most first, e.g. :data:`raystudy.vocab.PAPER_RANKING`) as scores that sort to it."""
    return pd.Series(range(len(ranking), 0, -1), index=list(ranking), dtype=float)


def tau_b(a: pd.Series, b: pd.Series) -> tuple[float, float]:
    """Kendall's tau-b and its two-sided p-value between the rankings of ``a`` and ``b`` (values by name,
    over the names both have, ties within :data:`TIE_RTOL` made exact); NaN below two names or when either
    side is one tie."""
    common = [k for k in a.dropna().index if k in b.dropna().index]
    if len(common) < 2:
        return math.nan, math.nan
    x, y = tied(a.loc[common]), tied(b.loc[common])
    if x.nunique() < 2 or y.nunique() < 2:
        return math.nan, math.nan
    k = stats.kendalltau(x.to_numpy(), y.to_numpy())
    return float(k.statistic), float(k.pvalue)
