"""The random-init control of the plasticity measurement: the table ``plasticity_control`` and the report's
ranking headlines.

A plasticity job measures, beside the model, the same architecture at its library's own seeded
initialisation on the same pairs (``plasticity.control: random_init``; rows ``weights = random_init`` of
``plasticity.parquet``, :data:`raystudy.vocab.WEIGHTS`). How much of a component's plasticity is the
architecture's and how much the pretraining's is read off two numbers per (model, dataset, mode, component),
each a mean over layers::

    pretrained   = mean_l P_pretrained(component, l)
    random_init  = mean_l P_random_init(component, l)
    ratio        = pretrained / random_init        (> 1: pretraining made the component more plastic)

The headlines rank the components three ways (mean over layers and datasets, most plastic first): measured,
random-init, and the paper's :data:`raystudy.vocab.PAPER_RANKING`, with Kendall's tau-b between each two (on
the values, ties kept as ties: :mod:`raystudy.analysis.ranks`; 1 the same order, -1 reversed).
"""

from __future__ import annotations

import pandas as pd

from raystudy.analysis.ranks import TIE_RULE, order_string, strict_scores, tau_b, tie_groups
from raystudy.analysis.render import Block, Rendered, fmt_num, fmt_p
from raystudy.vocab import COMPONENTS, PAPER_RANKING

TABLES = ("plasticity_control",)
#: The keys of one row of ``plasticity_control`` (``mode``: one model may be measured in both).
KEYS = ["model", "dataset", "mode", "component"]


def _layer_means(p: pd.DataFrame, name: str) -> pd.DataFrame:
    """``KEYS`` + ``name``: the plasticity of each component, mean over layers."""
    return p.groupby(KEYS, sort=False).agg(**{name: ("plasticity", "mean")}).reset_index()


def plasticity_control_table(plasticity: pd.DataFrame, control: pd.DataFrame) -> pd.DataFrame:
    """Per (model, dataset, mode, component): ``pretrained`` and ``random_init`` plasticity (each the mean over
    layers of ``plasticity.parquet``'s rows of those weights), ``ratio = pretrained / random_init`` and the
    control's ``init_seed`` where recorded; components in COMPONENTS order. Only keys measured both ways."""
    t = _layer_means(plasticity, "pretrained").merge(_layer_means(control, "random_init"), on=KEYS)
    t["ratio"] = t["pretrained"] / t["random_init"]
    if "init_seed" in control.columns:
        seeds = control.groupby(KEYS[:3], sort=False)["init_seed"].first().reset_index()
        t = t.merge(seeds, on=KEYS[:3], how="left")
    order = {c: i for i, c in enumerate(COMPONENTS)}
    return t.sort_values(KEYS, key=lambda s: s.map(order) if s.name == "component" else s).reset_index(drop=True)


def control_tables(inputs, notes: list[str]) -> dict[str, pd.DataFrame]:
    """``{"plasticity_control": ...}`` of a study's :class:`~raystudy.analysis.inputs.StudyInputs` (``{}`` with
    a note when the study has plasticity but no random-init rows)."""
    if inputs.plasticity is None:
        return {}
    if inputs.control is None:
        notes.append("No random-init control in plasticity.parquet (plasticity.control: none, or measured before "
                     "the control existed): the plasticity_control table is omitted.")
        return {}
    return {"plasticity_control": plasticity_control_table(inputs.plasticity, inputs.control)}


def render_plasticity_control(t: pd.DataFrame) -> Rendered:
    blocks = []
    for (model, dataset, mode), g in t.groupby(["model", "dataset", "mode"], sort=True):
        rows = [[r.component, fmt_num(r.pretrained), fmt_num(r.random_init), fmt_num(r.ratio, 2)]
                for r in g.itertuples()]
        blocks.append(Block(f"model: {model} · dataset: {dataset} · mode: {mode}",
                            ["component", "pretrained", "random init", "ratio"], rows))
    seeds = sorted({int(s) for s in t["init_seed"].dropna()}) if "init_seed" in t.columns else []
    return Rendered("plasticity_control", "Plasticity against the random-init control",
                    "Plasticity of each component (mean over layers) with the model's weights and with the same "
                    "architecture at its library's own random initialisation, measured on the same pairs; ratio = "
                    "pretrained / random init.", blocks,
                    [f"Control init seed(s): {', '.join(map(str, seeds))}."] if seeds else [])


def headline_mode(plasticity: pd.DataFrame) -> str:
    """The mode the headlines rank in: ``embedding`` (the paper's) when measured, else the first one."""
    return "embedding" if (plasticity["mode"] == "embedding").any() else str(plasticity["mode"].iloc[0])


def component_ranking(plasticity: pd.DataFrame, mode: str) -> pd.Series:
    """Plasticity per component in ``mode``, mean over layers and datasets (and models), most plastic first."""
    return plasticity[plasticity["mode"] == mode].groupby("component")["plasticity"].mean().sort_values(
        ascending=False)


def ranking_headlines(plasticity: pd.DataFrame, control: pd.DataFrame | None) -> list[str]:
    """The report's plasticity headlines: the measured ranking (with values), the random-init control's (when
    measured in the same mode), the paper's, and Kendall's tau-b between each two; ties print as ties
    (:mod:`raystudy.analysis.ranks`)."""
    mode = headline_mode(plasticity)
    measured = component_ranking(plasticity, mode)
    lines = [f"Plasticity ({mode} mode, mean over layers and datasets): " + order_string(measured, _two)]
    rankings = {"measured": measured}
    if control is not None and (control["mode"] == mode).any():
        random_init = component_ranking(control, mode)
        lines.append(f"Random-init control ({mode} mode, same pairs, mean over layers and datasets): "
                     + order_string(random_init, _two))
        rankings["random-init"] = random_init
    rankings["paper"] = strict_scores(PAPER_RANKING)
    lines.append("Rankings: " + "; ".join(f"{name} {order_string(r)}" for name, r in rankings.items())
                 + (f" ({TIE_RULE})" if any(len(g) > 1 for r in rankings.values() for g in tie_groups(r)) else ""))
    names = list(rankings)
    taus = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            tau, p = tau_b(rankings[a], rankings[b])
            taus.append(f"{a} vs {b} {fmt_num(tau, 2)} (p {fmt_p(p)})")
    lines.append("Kendall τ-b between the rankings: " + "; ".join(taus))
    return lines


def _two(v: float) -> str:
    return fmt_num(v, 2)
