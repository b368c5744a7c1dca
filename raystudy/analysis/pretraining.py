"""Plasticity along the pretraining: the table ``plasticity_pretraining``, its figure and the report's headline.

A study that pretrains its model (the demos' toy) measures the components' plasticity at a few steps of the
pretraining (``plasticity_pretraining.parquet``, :mod:`raystudy.study.pretrain_path`; step 0 is the random
init). Per (model, mode, step) the table holds each component's plasticity (mean over layers and datasets),
the ranking (ties as ties, :mod:`raystudy.analysis.ranks`) and Kendall's tau-b of that ranking with the step-0
one (the random init the pretraining started from), with the last step's, and with the paper's
(:data:`raystudy.vocab.PAPER_RANKING`). The figure draws each component's rank against the step (a bump
chart: the ranking's path from the random init's order toward the trained one) beside its plasticity (log
scale); the headline says where the path starts and ends and the first step whose ranking differs from the
random init's.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from raystudy.analysis import figures as F
from raystudy.analysis.ranks import TIE_RULE, order_string, ranks, strict_scores, tau_b
from raystudy.analysis.render import Block, Rendered, fmt_num
from raystudy.analysis.style import MARKERS, styled
from raystudy.vocab import COMPONENTS, PAPER_RANKING

TABLES = ("plasticity_pretraining",)
FIGURE = "plasticity_pretraining_path"
KEYS = ["model", "mode", "step"]


def pretraining_table(path: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, mode, step): each component's plasticity (mean over layers and datasets), the
    ``ranking`` and ``tau_init`` / ``tau_final`` / ``tau_paper`` (Kendall's tau-b with the step-0 ranking, the
    last step's and the paper's; NaN where the path has no step 0)."""
    rows = []
    for (model, mode), g in path.groupby(["model", "mode"], sort=True):
        means = {step: s.groupby("component")["plasticity"].mean().reindex(list(COMPONENTS)).dropna()
                 for step, s in g.groupby("step", sort=True)}
        first, last = means.get(0), means[max(means)]
        for step, m in means.items():
            rows.append(dict(model=model, mode=mode, step=int(step), **{c: m.get(c) for c in COMPONENTS},
                             ranking=order_string(m),
                             tau_init=tau_b(m, first)[0] if first is not None else float("nan"),
                             tau_final=tau_b(m, last)[0], tau_paper=tau_b(m, strict_scores(PAPER_RANKING))[0]))
    return pd.DataFrame(rows, columns=[*KEYS, *COMPONENTS, "ranking", "tau_init", "tau_final", "tau_paper"])


def pretraining_tables(inputs, notes: list[str]) -> dict[str, pd.DataFrame]:
    """``{"plasticity_pretraining": ...}`` when the study measured plasticity along its pretraining."""
    if inputs.pretraining is None or inputs.pretraining.empty:
        return {}
    return {"plasticity_pretraining": pretraining_table(inputs.pretraining)}


def render_plasticity_pretraining(t: pd.DataFrame) -> Rendered:
    blocks = []
    for (model, mode), g in t.groupby(["model", "mode"], sort=True):
        rows = [[str(r["step"]), *(fmt_num(r[c], 2) for c in COMPONENTS), r["ranking"], fmt_num(r["tau_init"], 2),
                 fmt_num(r["tau_final"], 2), fmt_num(r["tau_paper"], 2)] for _, r in g.iterrows()]
        blocks.append(Block(f"model: {model} · mode: {mode}",
                            ["step", *COMPONENTS, "ranking", "τ-b vs step 0", "τ-b vs last", "τ-b vs paper"], rows))
    return Rendered("plasticity_pretraining", "Plasticity along the pretraining",
                    "Plasticity of each component (mean over layers and datasets) at steps of the model's "
                    "pretraining, step 0 being its random init, on the study's own pairs; the ranking at each step "
                    "and Kendall's τ-b with the random init's ranking, the last step's and the paper's.", blocks,
                    [f"Ranking: {TIE_RULE}."])


def path_headlines(t: pd.DataFrame) -> list[str]:
    """Per (model, mode): the ranking at step 0 and at the last step with their τ-b with the paper, and the
    first step whose ranking is no longer the random init's (or that none moved)."""
    lines = []
    for (_model, mode), g in t.groupby(["model", "mode"], sort=True):
        g = g.sort_values("step")
        first, last = g.iloc[0], g.iloc[-1]
        if first["step"] != 0:
            continue
        moved = g[g["ranking"] != first["ranking"]]
        kept = [str(int(k)) for k in g["step"] if len(moved) and k < moved["step"].iloc[0]]
        when = (f"the ranking first departs from the random init's at step {int(moved['step'].iloc[0])} (at step(s) "
                f"{', '.join(kept)} before it, a model pretrained that little keeps the random-init order)"
                if len(moved) else "pretraining never moved the random init's ranking")
        lines.append(f"Along the pretraining ({mode} mode, steps {', '.join(str(int(s)) for s in g['step'])}): step 0 "
                     f"(random init) {first['ranking']} (τ-b with the paper {fmt_num(first['tau_paper'], 2)}) → "
                     f"step {int(last['step'])} {last['ranking']} (τ-b with the paper {fmt_num(last['tau_paper'], 2)}, "
                     f"with step 0 {fmt_num(last['tau_init'], 2)}); {when}.")
    return lines


@styled
def plot_pretraining_path(t: pd.DataFrame, path_stem: str | Path, *, title: str = "") -> list[Path]:
    """Per (model, mode) of :func:`pretraining_table`'s ``t``: each component's rank at each step (left; 1 at
    the top, ties drawn at one rank) and its plasticity (right, log scale), one colour per component."""
    groups = list(t.groupby(["model", "mode"], sort=True))
    fig, axes = F._grid(2 * len(groups), max_cols=2)
    for (key, g), (ax_rank, ax_value) in zip(groups, zip(axes[::2], axes[1::2])):
        g = g.sort_values("step")
        steps = g["step"].to_numpy()
        rank_rows = pd.DataFrame([ranks(r[list(COMPONENTS)].astype(float).dropna()) for _, r in g.iterrows()])
        for comp in COMPONENTS:
            if comp not in rank_rows.columns:
                continue
            style = dict(color=F._color(comp), marker=MARKERS.get(comp, "o"), ms=5, lw=1.8, label=comp)
            ax_rank.plot(steps, rank_rows[comp].to_numpy(), **style)
            ax_value.plot(steps, g[comp].to_numpy(float), **style)
        ax_rank.set_ylim(len(COMPONENTS) + 0.5, 0.5)
        ax_rank.set_yticks(range(1, len(COMPONENTS) + 1))
        ax_rank.set_ylabel("rank (1: most plastic)")
        ax_value.set_yscale("log")
        ax_value.set_ylabel("plasticity (mean over layers and datasets)")
        for ax in (ax_rank, ax_value):
            ax.set_xticks(steps)
            ax.set_xlabel("pretraining step (0: random init)")
            ax.grid(alpha=0.3)
            ax.set_title(" · ".join(map(str, key)) if len(groups) > 1 else ("rank" if ax is ax_rank else "value"))
    F._legend(fig, axes)
    F._title(fig, title or "Plasticity along the pretraining", "")
    return F.save_figure(fig, path_stem)


def figure_job(t: pd.DataFrame):
    """``(name, title, caption, draw)`` of the path figure (:func:`plot_pretraining_path`)."""
    return (FIGURE, "Plasticity along the pretraining",
            "Each component's rank (1: most plastic; ties share a rank) and plasticity (mean over layers and "
            "datasets, log scale) at steps of the pretraining, step 0 being the random init: the ranking's path "
            "from the random init's order toward the pretrained model's.",
            lambda stem: plot_pretraining_path(t, stem))
