"""The controls of the plasticity measurement: the table ``plasticity_control`` and the report's ranking
headlines.

A plasticity job measures, beside the model, two controls on the same pairs (``plasticity.control:
random_init``; rows of ``plasticity.parquet`` by ``weights``, :data:`raystudy.vocab.WEIGHTS`):

* ``random_init``, the whole-model control: the same architecture at its library's own seeded
  initialisation, its embedding stage included, so its components see other inputs than the model's;
* ``random_blocks``, the component control: the same random init with the model's own embedding stage
  copied in, so its random-init blocks see the model's embeddings.

Each is read off one number per (model, dataset, mode, component) and weights, a mean over layers, and three
ratios of them (:data:`RATIOS`)::

    pretrained      = mean_l P_pretrained(component, l)          (random_init, random_blocks likewise)
    ratio           = pretrained / random_init      the pretraining's whole effect (> 1: more plastic)
    weights_ratio   = pretrained / random_blocks    the component weights' own effect (same inputs)
    inputs_ratio    = random_blocks / random_init   the inputs' effect (the embedding's; same blocks)

so that ``ratio = weights_ratio x inputs_ratio``. A table measured before the component control has no
``random_blocks`` rows: its ``random_blocks``, ``weights_ratio`` and ``inputs_ratio`` are empty and a note says so.

The headlines rank the components (mean over layers and datasets, most plastic first): measured, each
control's, and the paper's :data:`raystudy.vocab.PAPER_RANKING`, with Kendall's tau-b between each two (on
the values, ties kept as ties: :mod:`raystudy.analysis.ranks`; 1 the same order, -1 reversed).
"""

from __future__ import annotations

import pandas as pd

from raystudy.analysis.ranks import TIE_RULE, order_string, strict_scores, tau_b, tie_groups
from raystudy.analysis.render import Block, Rendered, fmt_num, fmt_p
from raystudy.vocab import COMPONENTS, CONTROL_WEIGHTS, PAPER_RANKING, PRETRAINED, RANDOM_BLOCKS, RANDOM_INIT

TABLES = ("plasticity_control",)
#: The keys of one row of ``plasticity_control`` (``mode``: one model may be measured in both).
KEYS = ["model", "dataset", "mode", "component"]
#: The ratios of ``plasticity_control``: name -> (numerator, denominator) weights, and what each measures.
RATIOS: dict[str, tuple[str, str, str]] = {
    "ratio": (PRETRAINED, RANDOM_INIT, "the pretraining's whole effect"),
    "weights_ratio": (PRETRAINED, RANDOM_BLOCKS, "the component weights' own effect, on the same inputs"),
    "inputs_ratio": (RANDOM_BLOCKS, RANDOM_INIT, "the inputs' effect (the embedding's), through the same blocks"),
}
#: The value columns of ``plasticity_control``, in order: each weights' mean, the ratios after what they divide.
VALUE_COLUMNS: tuple[str, ...] = (PRETRAINED, RANDOM_INIT, "ratio", RANDOM_BLOCKS, "weights_ratio", "inputs_ratio")
#: Each control's headline (:data:`raystudy.vocab.CONTROL_WEIGHTS`), before its ranking; ``{mode}``: the mode.
CONTROL_HEADLINES: dict[str, str] = {
    RANDOM_INIT: "Random-init control ({mode} mode, same pairs, mean over layers and datasets)",
    RANDOM_BLOCKS: "Component control (random-init blocks fed the model's own embeddings; {mode} mode, same pairs, "
                   "mean over layers and datasets)",
}


def _layer_means(p: pd.DataFrame, name: str) -> pd.DataFrame:
    """``KEYS`` + ``name``: the plasticity of each component, mean over layers."""
    return p.groupby(KEYS, sort=False).agg(**{name: ("plasticity", "mean")}).reset_index()


def _weights_rows(control: pd.DataFrame, weights: str) -> pd.DataFrame:
    """The rows of ``control`` measured with ``weights``."""
    return control[control["weights"] == weights]


def plasticity_control_table(plasticity: pd.DataFrame, control: pd.DataFrame) -> pd.DataFrame:
    """Per (model, dataset, mode, component): the plasticity with each weights (``pretrained``, ``random_init``,
    ``random_blocks``: the mean over layers of ``plasticity.parquet``'s rows of those weights), the
    :data:`RATIOS` and the controls' ``init_seed`` where recorded; columns :data:`VALUE_COLUMNS`, components in
    COMPONENTS order. Only keys measured with the model and the random init; ``random_blocks`` and its ratios
    are NaN where the component control was not measured."""
    t = _layer_means(plasticity, PRETRAINED).merge(_layer_means(_weights_rows(control, RANDOM_INIT), RANDOM_INIT),
                                                   on=KEYS)
    t = t.merge(_layer_means(_weights_rows(control, RANDOM_BLOCKS), RANDOM_BLOCKS), on=KEYS, how="left")
    for name, (top, bottom, _) in RATIOS.items():
        t[name] = t[top] / t[bottom]
    t = t[[*KEYS, *VALUE_COLUMNS]]
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
    if not (inputs.control["weights"] == RANDOM_BLOCKS).any():
        notes.append(f"No component control (weights = {RANDOM_BLOCKS}) in plasticity.parquet (measured before it "
                     f"existed): plasticity_control's {RANDOM_BLOCKS}, weights_ratio and inputs_ratio are empty, "
                     "and the headlines rank the random-init control alone.")
    return {"plasticity_control": plasticity_control_table(inputs.plasticity, inputs.control)}


def render_plasticity_control(t: pd.DataFrame) -> Rendered:
    blocks = []
    for (model, dataset, mode), g in t.groupby(["model", "dataset", "mode"], sort=True):
        rows = [[r.component, *(fmt_num(getattr(r, c), 2 if c in RATIOS else 3) for c in VALUE_COLUMNS)]
                for r in g.itertuples()]
        blocks.append(Block(f"model: {model} · dataset: {dataset} · mode: {mode}",
                            ["component", *(c.replace("_", " ") for c in VALUE_COLUMNS)], rows))
    seeds = sorted({int(s) for s in t["init_seed"].dropna()}) if "init_seed" in t.columns else []
    ratios = "; ".join(f"{name.replace('_', ' ')} = {top.replace('_', ' ')} / {bottom.replace('_', ' ')}: {what}"
                       for name, (top, bottom, what) in RATIOS.items())
    return Rendered("plasticity_control", "Plasticity against the random-init and the component control",
                    "Plasticity of each component (mean over layers), measured on the same pairs with the model's "
                    "weights (pretrained), with the same architecture at its library's own random initialisation "
                    "(random init: its embedding too, so its components see other inputs) and with those random-init "
                    "blocks fed the model's own embeddings (random blocks: the component control). " + ratios
                    + " (ratio = weights ratio × inputs ratio; – where not measured).", blocks,
                    [f"Control init seed(s): {', '.join(map(str, seeds))}."] if seeds else [])


def headline_mode(plasticity: pd.DataFrame) -> str:
    """The mode the headlines rank in: ``embedding`` (the paper's) when measured, else the first one."""
    return "embedding" if (plasticity["mode"] == "embedding").any() else str(plasticity["mode"].iloc[0])


def component_ranking(plasticity: pd.DataFrame, mode: str) -> pd.Series:
    """Plasticity per component in ``mode``, mean over layers and datasets (and models), most plastic first."""
    return plasticity[plasticity["mode"] == mode].groupby("component")["plasticity"].mean().sort_values(
        ascending=False)


def ranking_headlines(plasticity: pd.DataFrame, control: pd.DataFrame | None) -> list[str]:
    """The report's plasticity headlines: the measured ranking (with values), each control's measured in the
    same mode (the random init's, the component control's), the paper's, and Kendall's tau-b between each two;
    ties print as ties (:mod:`raystudy.analysis.ranks`)."""
    mode = headline_mode(plasticity)
    measured = component_ranking(plasticity, mode)
    lines = [f"Plasticity ({mode} mode, mean over layers and datasets): " + order_string(measured, _two)]
    rankings = {"measured": measured}
    for weights in CONTROL_WEIGHTS:
        rows = None if control is None else _weights_rows(control, weights)
        if rows is None or not (rows["mode"] == mode).any():
            continue
        ranking = component_ranking(rows, mode)
        lines.append(CONTROL_HEADLINES[weights].format(mode=mode) + ": " + order_string(ranking, _two))
        rankings[weights.replace("_", "-")] = ranking
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
