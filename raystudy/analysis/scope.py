"""What a study can show: its scale, the power of its tests, what was omitted, and the paper's thesis check.

The report's section "What this study can show" (:func:`scope_items`) is derived from the analysis itself:
nothing here is configured. The thesis (plastic components finetune better) is checked by the ``ranking``
table's Kendall tau between the components' plasticity ranking and their accuracy ranking.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
from scipy import stats

from raystudy.analysis.stats import smallest_wilcoxon_p
from raystudy.analysis.tables import OVERALL, phase_rows
from raystudy.vocab import COMPONENTS, LINEAR_PROBE

if TYPE_CHECKING:
    from raystudy.analysis.pipeline import AnalysisResult

#: the significance level the section's sentences speak of
ALPHA = 0.05
#: the section's title in the HTML and the Markdown report
SCOPE_TITLE = "What this study can show"


def pairs_needed(alternative: str, alpha: float = ALPHA) -> int:
    """The fewest pairs whose smallest Wilcoxon p-value (:func:`smallest_wilcoxon_p`) is below ``alpha``."""
    n = 1
    while smallest_wilcoxon_p(n, alternative) >= alpha:
        n += 1
    return n


def smallest_kendall_p(n: int) -> float:
    """The smallest two-sided p-value of Kendall's tau over ``n`` items (both rankings equal: tau = 1), exact:
    ``2 / n!`` (``scipy.stats.kendalltau``'s exact distribution)."""
    if n < 3:
        return math.nan
    return float(stats.kendalltau(np.arange(n), np.arange(n)).pvalue)


def thesis_sentences(ranking: pd.DataFrame | None) -> list[str]:
    """The paper's thesis check, one sentence per model, optimizer and plasticity mode of ``ranking`` (the
    analysis' ``ranking`` table): its ``overall`` row (the mean over datasets), or its one dataset's row. Does
    the components' accuracy ranking follow their plasticity ranking? Supported (Kendall τ > 0, p < 0.05),
    same direction but not significant (τ > 0), not supported (τ ≤ 0), or not computed (τ undefined)."""
    if ranking is None or ranking.empty:
        return []
    out = []
    keys = [c for c in ("model", "optimizer", "mode") if c in ranking.columns]
    for group, g in ranking.groupby(keys, sort=True):
        group = group if isinstance(group, tuple) else (group,)
        row = g[g["dataset"] == OVERALL] if (g["dataset"] == OVERALL).any() else g
        if len(row) != 1:
            continue
        r = row.iloc[0]
        what = "mean over datasets" if r["dataset"] == OVERALL else f"dataset {r['dataset']}"
        label = ", ".join(f"{v} mode" if k == "mode" else str(v) for k, v in zip(keys, group))
        if pd.isna(r["kendall"]):
            why = (f"it needs at least 3 of the five components finetuned alone, this study ranks "
                   f"{r['accuracy_ranking']}" if int(r["n_components"]) < 3 else
                   "the plasticities or the accuracies are all equal")
            out.append(f"{label}, {what}: not computed: {why}.")
            continue
        n, tau, p = int(r["n_components"]), float(r["kendall"]), float(r["kendall_p"])
        verdict = (f"supported (τ > 0, p < {ALPHA:g})" if tau > 0 and p < ALPHA else
                   f"same direction, not significant (τ > 0, p ≥ {ALPHA:g}; the smallest p {n} components allow "
                   f"is {smallest_kendall_p(n):.3f})" if tau > 0 else "not supported (τ ≤ 0)")
        out.append(f"{label}, {what}: accuracy ranks the components {r['accuracy_ranking']}, plasticity ranks "
                   f"them {r['plasticity_ranking']}; Kendall τ {tau:.2f} (p {p:.3f}, {n} components): {verdict}.")
    return out


def _thesis(res: AnalysisResult) -> str:
    sentences = thesis_sentences(res.tables.get("ranking"))
    if sentences:
        return " ".join(sentences)
    why = [n for n in res.notes if n.startswith(("Ranking agreement", "Spearman and Kendall"))]
    trained = [] if res.inputs.counted is None else sorted(
        set(res.inputs.counted["configuration"].astype(str)) & set(COMPONENTS))
    reason = why[0] if why else (
        "no plasticity table" if res.inputs.plasticity is None else
        f"it needs at least 3 of the five components finetuned alone; this study trains "
        f"{', '.join(trained) or 'none'}")
    return f"not computed: {reason}"


def _scale(res: AnalysisResult) -> str | None:
    t = res.inputs.trials
    if t is None or t.empty:
        return None
    t = t[t["configuration"].astype(str) != LINEAR_PROBE]  # a probe has no steps
    parts = []
    for model, g in t.groupby("model", sort=True):
        kwargs = g["model_kwargs"].dropna().astype(str).iloc[0] if "model_kwargs" in g else ""
        size = f" at {int(g['img_size'].dropna().iloc[0])} px" if "img_size" in g and g["img_size"].notna().any() \
            else ""
        steps = sorted(pd.to_numeric(g["steps"]).dropna().astype(int).unique())
        trainable = pd.to_numeric(g["trainable_params"]).dropna()
        batch = int(g["batch_size"].dropna().iloc[0])
        text = f"{model}{f' {kwargs}' if kwargs and kwargs != '{}' else ''}{size}, " \
               f"{'/'.join(map(str, steps))} steps of batch {batch} per trial"
        if len(trainable):
            text += f"; {int(trainable.min()):,} to {int(trainable.max()):,} trainable parameters per trial"
        parts.append(text)
    p = res.inputs.rates
    if p is not None and len(p):
        pairs = p.groupby("dataset")["pair"].nunique()
        parts.append(f"plasticity from {int(pairs.min())}{'' if pairs.min() == pairs.max() else f'-{int(pairs.max())}'}"
                     " pairs of inputs per dataset")
    return "; ".join(parts)


def _seeds(res: AnalysisResult) -> str | None:
    counted = res.inputs.counted
    if counted is None or counted.empty:
        return None
    seeds = sorted(pd.to_numeric(counted["seed"]).dropna().astype(int).unique())
    if len(seeds) == 1:
        return (f"1 ({seeds[0]}): every accuracy is one run; no spread over seeds is measured, and the stability "
                "table's spread is over learning rates alone")
    return f"{len(seeds)} ({', '.join(map(str, seeds))}): each accuracy is the mean of {len(seeds)} runs"


def _power(label: str, paired: str, n: int, alt: str, m: int = 1) -> str:
    """What ``n`` pairs (of ``paired``) allow a Wilcoxon test of alternative ``alt``: the smallest p-value, and
    the pairs a significant one needs; with ``m`` tests Holm-corrected together, the smallest corrected p."""
    low, need = smallest_wilcoxon_p(n, alt), pairs_needed(alt)
    side = "two-sided" if alt == "two-sided" else "one-sided"
    text = (f"{label}: {n} pair(s) per test (paired by {paired}); the smallest p-value {n} pair(s) can reach is "
            f"{low:.3g} ({side})")
    if m > 1:
        text += f", {min(1.0, m * low):.3g} after Holm over {m} tests"
    if not low < ALPHA:
        text += (f", so no difference can be significant at {ALPHA:g} here: that needs at least {need} pairs "
                 f"(p {smallest_wilcoxon_p(need, alt):.3g})")
    return text


def _criteria_power(c: pd.DataFrame) -> list[str]:
    """The power of the criteria section's tests (its ``overall`` rows), per granularity and budget."""
    o = c[(c["dataset"] == OVERALL) & c["n_pairs"].notna()]
    out = []
    for (gran, budget), g in o.groupby(["granularity", "budget"], sort=False):
        ref = g["reference"].dropna().iloc[0]
        out.append(_power(f"Wilcoxon signed-rank of {ref} against each criterion at {budget} of {gran}", "dataset",
                          int(g["n_pairs"].max()), "two-sided", len(g)))
    return out


def _tests(res: AnalysisResult) -> str | None:
    """The power of every test family the report holds (the Wilcoxon tests against the reference, the selection
    criteria's); ``None`` without counted trials."""
    o, w, c = res.options, res.tables.get("wilcoxon"), res.tables.get("criteria")
    counted = res.inputs.counted
    if counted is None or counted.empty:
        return None
    parts = []
    if w is not None and len(w):
        parts.append(_power(f"Wilcoxon signed-rank against {o.get('reference')}",
                            str(o.get("pair_by", "dataset")).replace("_", " and "),
                            int(pd.to_numeric(w["n_pairs"]).max()), o.get("alternative", "greater")))
    if c is not None and len(c):
        parts += _criteria_power(c)
    if not parts:
        return f"none held: no {o.get('reference')} trials to test against (see the notes)"
    return "; ".join(parts)


#: the column of ``trials.parquet`` that counts the test examples behind a run's ``test_acc``
TEST_EXAMPLES = "test_examples"


def _count(values: pd.Series) -> str:
    """``500`` or, where runs saw different splits, ``480-500``."""
    lo, hi = int(values.min()), int(values.max())
    return f"{lo:,}" if lo == hi else f"{lo:,}-{hi:,}"


def _test_examples(res: AnalysisResult) -> str | None:
    """How many test examples each accuracy rests on, per dataset, and the step one example makes, ``100 / n``
    percentage points; read from the rows the report answers from (the final fit's where the study has one)."""
    counted = res.inputs.counted
    if counted is None or counted.empty:
        return None
    rows = phase_rows(res.inputs.final, counted)
    if TEST_EXAMPLES not in rows.columns or pd.to_numeric(rows[TEST_EXAMPLES], errors="coerce").isna().all():
        return ("not recorded: trials.parquet has no test_examples column (a study run before raystudy recorded "
                "it), so the step one test example makes (100 / n points for a test split of n) is unknown here")
    n = rows.assign(n=pd.to_numeric(rows[TEST_EXAMPLES], errors="coerce")).dropna(subset=["n"])
    per = [(ds, g["n"]) for ds, g in n.groupby("dataset", sort=True)]
    steps = ", ".join(f"{ds} {_count(v)} (one example = {100 / v.max():.2g}"
                      + (f"-{100 / v.min():.2g}" if v.min() != v.max() else "") + " points)" for ds, v in per)
    return (f"{steps}: a run's accuracy is its correct test examples / n (per sample), so it moves in steps of "
            "100 / n percentage points, and a mean over seeds in steps of that divided by the seeds")


#: the paper's tables a study may lack without a note, and what each needs
NEEDS = {"optimizers": "The optimizer comparison needs at least two optimizers"}


def _omitted(res: AnalysisResult) -> str:
    omitted = [n for n in res.notes if "omitted" in n.lower() or "undefined" in n.lower()]
    if res.tables.get("best_lr") is not None:
        omitted += [f"{why} (table {name})." for name, why in NEEDS.items() if name not in res.tables]
    if not omitted:
        return "none: every analysis the study's grid allows was computed (the notes list what each table left out)"
    return " ".join(omitted)


def scope_items(res: AnalysisResult) -> list[tuple[str, str]]:
    """The section "What this study can show" as (label, plain text) pairs: model scale, seeds, the test
    examples behind each accuracy and the step one makes, the Wilcoxon tests' pairs and the smallest p-value
    they can reach, what was omitted and why, and the thesis check."""
    items = [("model scale", _scale(res)), ("seeds", _seeds(res)), ("test examples", _test_examples(res)),
             ("tests", _tests(res)),
             ("omitted", _omitted(res)), ("thesis check", _thesis(res))]
    return [(k, v) for k, v in items if v]
