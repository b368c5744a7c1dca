"""Human-readable renderings of the tables: Markdown files and HTML fragments for the report.

The CSV files keep fractions and full precision; here accuracies are shown in percent with one decimal,
the best of the five components in bold (per dataset and optimizer, as in the paper), and every table
carries its caption and footnotes. Every "mean ± std" is a population standard deviation (``ddof=0``, as
the paper's authors compute it); a value computed from diverged runs (counted with the test accuracy of
their best-validation checkpoint before the divergence) carries the mark :data:`DIVERGED_MARK`.
:class:`Rendered` holds one table as cell strings so the Markdown and the HTML show exactly the same
content. (Hand-written: pandas' ``to_markdown`` needs ``tabulate``, which this project does not install,
and ``Styler`` would add jinja2 for little gain.)
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field

import pandas as pd

from raystudy.analysis.figures import _fmt_lr
from raystudy.analysis.stats import configuration_order, smallest_p_note, statistic_note
from raystudy.analysis.tables import OVERALL, best_component, recorded_counts
from raystudy.vocab import COMPONENTS, LINEAR_PROBE

#: Appended to a cell whose value includes diverged runs.
DIVERGED_MARK = " ‡"
#: The footnote of a table with :data:`DIVERGED_MARK` cells.
DIVERGED_NOTE = ("‡: includes diverged run(s), counted with the test accuracy of their best-validation "
                 "checkpoint before the divergence (column n_diverged in the CSV).")
#: How every table states its spreads.
STD_NOTE = "std: population standard deviation (ddof = 0, numpy's default, as the paper's authors compute it)."


@dataclass
class Block:
    """One grid of cells; ``bold`` holds (row, column) indices of highlighted cells.

    A cell is a string or a ``(text, detail)`` pair: Markdown shows ``text (detail)``, HTML puts the detail
    on a second, smaller line. ``groups`` (optional, one label per column): a header row above the columns,
    adjacent equal labels spanning their columns (HTML and LaTeX; Markdown has one header row).
    """

    heading: str
    columns: list[str]
    rows: list[list[str | tuple[str, str]]]
    bold: set[tuple[int, int]] = field(default_factory=set)
    groups: list[str] | None = None

    def spans(self) -> list[tuple[str, int]]:
        """``groups`` as (label, number of adjacent columns) runs."""
        runs: list[tuple[str, int]] = []
        for g in self.groups or []:
            runs = runs[:-1] + [(g, runs[-1][1] + 1)] if runs and runs[-1][0] == g else runs + [(g, 1)]
        return runs

    def cell_texts(self, escape, bold: str, detail: str = "{text} ({detail})") -> list[list[str]]:
        """Every row's cell texts for one output format: each text ``escape``d, a bold cell's wrapped by the
        format ``bold`` (of ``text``), a ``(text, detail)`` cell written as the format ``detail``."""
        out = []
        for i, row in enumerate(self.rows):
            cells = []
            for j, c in enumerate(row):
                text, extra = c if isinstance(c, tuple) else (c, "")
                shown = bold.format(text=escape(text)) if (i, j) in self.bold and text else escape(text)
                cells.append(detail.format(text=shown, detail=escape(extra)) if extra else shown)
            out.append(cells)
        return out


@dataclass
class Rendered:
    name: str
    title: str
    caption: str
    blocks: list[Block]
    footnotes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        """The table as Markdown; every text is escaped with :func:`md_escape` (names come from data)."""
        out = [f"# {md_escape(self.title)}", "", md_escape(self.caption), ""]
        for b in self.blocks:
            if b.heading:
                out += [f"## {md_escape(b.heading)}", ""]
            out.append("| " + " | ".join(md_escape(c) for c in b.columns) + " |")
            out.append("|" + "|".join(":---" if j == 0 else "---:" for j in range(len(b.columns))) + "|")
            out += ["| " + " | ".join(cells) + " |" for cells in b.cell_texts(md_escape, "**{text}**")]
            out.append("")
        out += [f"- {md_escape(n)}" for n in self.footnotes]
        return "\n".join(out).rstrip() + "\n"

    def latex(self) -> str:
        """The table as LaTeX: per block a booktabs ``tabular`` (``pandas.DataFrame.to_latex``) of the same cell
        texts as :meth:`markdown` (:func:`tex_escape`d, bold as ``\\textbf``), title, caption, headings and
        footnotes as ``%`` comments above and below (a document chooses its own float and caption)."""
        out = [f"% {tex_escape(self.title)}", f"% {tex_escape(self.caption)}"]
        for b in self.blocks:
            rows = b.cell_texts(tex_escape, "\\textbf{{{text}}}")
            header = [tex_escape(c) for c in b.columns]
            if b.groups:
                header = pd.MultiIndex.from_arrays([[tex_escape(g) for g in b.groups], header])
            df = pd.DataFrame(rows, columns=header)
            out += ([f"% {tex_escape(b.heading)}"] if b.heading else [])
            out.append(df.to_latex(index=False, escape=False, column_format="l" + "r" * (len(b.columns) - 1),
                                   multicolumn_format="c"))
        out += [f"% {tex_escape(n)}" for n in self.footnotes]
        return "\n".join(out).rstrip() + "\n"

    def html(self) -> str:
        e = html.escape
        parts = [f'<section class="table" id="table-{e(self.name)}">', f"<h3>{e(self.title)}</h3>",
                 f'<p class="caption">{e(self.caption)}</p>']
        for b in self.blocks:
            if b.heading:
                parts.append(f"<h4>{e(b.heading)}</h4>")
            head = "".join(f'<th scope="col">{e(c)}</th>' for c in b.columns)
            if b.groups:
                spans = "".join(f'<th scope="colgroup" colspan="{n}">{e(g)}</th>' for g, n in b.spans())
                head = f"{spans}</tr><tr>{head}"
            body = ["<tr>" + "".join(f'<th scope="row">{t}</th>' if j == 0 else f"<td>{t}</td>"
                                     for j, t in enumerate(cells)) + "</tr>"
                    for cells in b.cell_texts(e, "<strong>{text}</strong>",
                                              '{text}<br><small class="detail">{detail}</small>')]
            parts.append(f'<table data-table="{e(self.name)}"><thead><tr>{head}</tr></thead>'
                         f"<tbody>{''.join(body)}</tbody></table>")
        if self.footnotes:
            parts.append('<ul class="footnotes">' + "".join(f"<li>{e(n)}</li>" for n in self.footnotes) + "</ul>")
        parts.append("</section>")
        return "\n".join(parts)


#: Characters a name may carry that Markdown would read as markup: HTML (``<script>``), table cell breaks,
#: links, code spans, emphasis. A backslash is escaped too, so one in the name cannot undo an escape.
_MD_ESCAPES = {"\\": "\\\\", "&": "&amp;", "<": "&lt;", "|": "\\|", "[": "\\[", "]": "\\]",
               "`": "\\`", "*": "\\*", "\r": " ", "\n": " "}
_MD_TABLE = str.maketrans(_MD_ESCAPES)


def md_escape(text: object) -> str:
    """``text`` as one line of literal Markdown: ``&`` and ``<`` as entities (no tag can open; ``>`` stays, as
    in the rankings "MHA > FC1"), ``\\ | [ ] ` *`` backslash-escaped, line breaks as spaces (a cell, heading or
    list item built from names stays one)."""
    return str(text).translate(_MD_TABLE)



#: LaTeX's special characters, then the symbols the renderings use that plain LaTeX has no glyph for.
_TEX_ESCAPES = {"\\": "\\textbackslash{}", "&": "\\&", "%": "\\%", "$": "\\$", "#": "\\#", "_": "\\_",
                "{": "\\{", "}": "\\}", "~": "\\textasciitilde{}", "^": "\\textasciicircum{}",
                "<": "\\textless{}", ">": "\\textgreater{}", "±": "$\\pm$", "−": "$-$", "×": "$\\times$",
                "·": "$\\cdot$", "ρ": "$\\rho$", "†": "\\dag{}", "‡": "\\ddag{}", "≤": "$\\leq$",
                "≥": "$\\geq$", "\r": " ", "\n": " "}
_TEX_TABLE = str.maketrans(_TEX_ESCAPES)


def tex_escape(text: object) -> str:
    """``text`` as literal LaTeX text: ``\\ & % $ # _ { } ~ ^ < >`` escaped, ``± − × · ρ † ‡ ≤ ≥`` as math or
    symbol commands, line breaks as spaces."""
    return str(text).translate(_TEX_TABLE)


def _finite(x) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x)) and not pd.isna(x)


def pct(x, digits: int = 1) -> str:
    """A fraction as a percentage without the sign: ``0.9081 -> "90.8"``; missing values as ``–``."""
    return f"{100 * float(x):.{digits}f}" if _finite(x) else "–"


def pm(mean, std, digits: int = 1) -> str:
    """``"90.8 ± 0.2"`` in percent (``"90.8"`` when the std is undefined, e.g. one seed)."""
    return f"{pct(mean, digits)} ± {pct(std, digits)}" if _finite(std) else pct(mean, digits)


def fmt_lr(lr) -> str:
    """``0.003 -> "3e-3"``, ``0.0015 -> "1.5e-3"``."""
    return _fmt_lr(lr) if _finite(lr) else "–"


def fmt_p(p) -> str:
    if not _finite(p):
        return "–"
    return f"{p:.2e}" if p < 1e-3 else f"{p:.3f}"


def fmt_num(x, digits: int = 3) -> str:
    return f"{x:.{digits}f}" if _finite(x) else "–"


def fmt_count(x) -> str:
    return f"{int(round(float(x))):,}" if _finite(x) else "–"


def fmt_bytes(x) -> str:
    """Binary units: ``"512 B"``, ``"6.0 KiB"``, ``"330.2 MiB"``, ``"1.3 GiB"``."""
    if not _finite(x):
        return "–"
    x = float(x)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= scale:
            return f"{x / scale:,.1f} {unit}"
    return f"{x:.0f} B"


def fmt_duration(x) -> str:
    """A table cell's duration: ``12.3 s``, ``4.5 min``, ``2.1 h``; ``–`` when unknown (the terminal's
    ``3m05s`` is :func:`raystudy.study.progress.fmt_seconds`)."""
    if not _finite(x):
        return "–"
    x = float(x)
    return f"{x:.1f} s" if x < 120 else (f"{x / 60:.1f} min" if x < 7200 else f"{x / 3600:.1f} h")


def _mark(r) -> str:
    """:data:`DIVERGED_MARK` when the row ``r`` counts diverged runs."""
    n = r.get("n_diverged", 0)
    return DIVERGED_MARK if _finite(n) and n > 0 else ""


def _notes(t: pd.DataFrame, *notes: str | None) -> list[str]:
    """``notes`` (but ``None``) plus the std note, plus the diverged note when ``t`` counts diverged runs."""
    diverged = "n_diverged" in t.columns and (t["n_diverged"].fillna(0) > 0).any()
    return [*(n for n in notes if n), STD_NOTE, *([DIVERGED_NOTE] if diverged else [])]


def _bold_note(t: pd.DataFrame, where: str = "", lead: str = "the best of") -> str | None:
    """"Bold: <lead> <the components t holds> <where>."; ``None`` below two components (nothing is marked)."""
    present = [c for c in COMPONENTS if c in set(t["configuration"])]
    if len(present) < 2:
        return None
    names = f"the five components ({', '.join(COMPONENTS)})" if len(present) == len(COMPONENTS) else \
        f"the components {', '.join(present)}"
    return f"Bold: {lead} {names}{' ' + where if where else ''}."


def _groups(df: pd.DataFrame, keys: list[str]):
    """Iterate ``(heading, rows)`` over the ``keys`` present in ``df`` (model first when present)."""
    keys = (["model"] if "model" in df.columns else []) + [k for k in keys if k in df.columns]
    if not keys:
        yield "", df
        return
    for vals, rows in df.groupby(keys, sort=True):
        vals = vals if isinstance(vals, tuple) else (vals,)
        yield " · ".join(f"{k}: {v}" for k, v in zip(keys, vals)), rows


def _wide(df: pd.DataFrame, cell, *, bold: pd.Series | None = None, row_key: str = "dataset",
          block_keys: tuple[str, ...] = ("optimizer",), row_label: str = "dataset") -> list[Block]:
    """One block per optimizer (and model): a row per ``row_key`` value, a column per configuration."""
    blocks = []
    for heading, g in _groups(df, list(block_keys)):
        configs = configuration_order(g["configuration"])
        keys = list(dict.fromkeys(g.sort_values(row_key, key=lambda s: s.map(lambda v: (v == OVERALL, str(v))))[
            row_key]))
        rows, marks = [], set()
        for i, k in enumerate(keys):
            row = [str(k)]
            for j, c in enumerate(configs, start=1):
                hit = g[(g[row_key] == k) & (g["configuration"] == c)]
                row.append(cell(hit.iloc[0]) if len(hit) else "")
                if len(hit) and bold is not None and bool(bold.loc[hit.index[0]]):
                    marks.add((i, j))
            rows.append(row)
        blocks.append(Block(heading, [row_label] + configs, rows, marks))
    return blocks


def _best_mask(df: pd.DataFrame, value: str, *, lowest: bool = False) -> pd.Series:
    """Rows holding the best ``value`` among the five components per (model, dataset, optimizer)."""
    tmp = df.assign(mean=-df[value] if lowest else df[value])
    return best_component(tmp)


def _best_lr_cell(r) -> tuple[str, str]:
    """``("90.8 ± 0.2", "lr 1e-2")``; one seed: the mean alone; ``LP``: "linear probe" as the detail."""
    value = pm(r["mean"], r["std"]) if r["n_seeds"] > 1 else pct(r["mean"])
    detail = "linear probe" if r["configuration"] == LINEAR_PROBE else f"lr {fmt_lr(r['lr'])}"
    return value + _mark(r), detail


#: how each ``select_by`` chooses the best learning rate, in the best-lr table's caption
LR_RULES = {"test": "the highest mean test accuracy over seeds (the paper's rule)",
                   "val": "the highest mean best-validation accuracy over seeds (validation only: test never chooses)"}


#: The phase a table's or figure's accuracies come from (:data:`raystudy.vocab.PHASES`), as the report says it.
PHASE_TEXT = {"search": "the lr search (the grid's trials, trained on train; test accuracy at each dataset's "
                        "chosen lr)",
              "final": "the final fit (each configuration retrained on train + val at the lr chosen on validation; "
                       "test accuracy)"}


def phase_note(phase: str) -> str:
    """The sentence that ends a table's footnotes or a figure's caption in a study with a final fit: which phase
    its accuracies come from (:data:`PHASE_TEXT`), ``phase`` the study's answer phase or the lr search."""
    if phase == "final":
        return (f"Phase: {PHASE_TEXT['final']}, as the headline and every table and figure that reports a "
                "configuration's accuracy; the lr search's own tables and figures read the search trials.")
    return (f"Phase: {PHASE_TEXT['search']}; the headline and the tables and figures that report a configuration's "
            "accuracy read the final fit.")


def render_best_lr(t: pd.DataFrame, select_by: str = "test") -> Rendered:
    blocks = _wide(t, _best_lr_cell, bold=best_component(t))
    return Rendered("best_lr", "Best learning rate per dataset and configuration",
                    f"Test accuracy (%) at the learning rate with {LR_RULES[select_by]}: mean ± std over "
                    "seeds, the learning rate in parentheses (the paper's Table 8; LP: the linear probe, fit "
                    "once per dataset).", blocks,
                    _notes(t, _bold_note(t, "for the dataset")))


def render_lr_grid(t: pd.DataFrame) -> Rendered:
    blocks = _wide(t, lambda r: pm(r["mean"], r["std"]) + _mark(r), bold=best_component(t))
    return Rendered("lr_grid", "Accuracy over the learning-rate grid",
                    "Test accuracy (%): mean ± std over learning rates of the mean over seeds, one block per "
                    "optimizer.", blocks, _notes(t, _bold_note(t, "for the dataset")))


def _subset_text(subset: pd.DataFrame) -> str:
    """``"datasets cifar100, clipart; seeds 0"`` (per model when the subset holds several)."""
    parts = []
    for model, g in subset.groupby("model", sort=True):
        head = f"{model}: " if subset["model"].nunique() > 1 else ""
        parts.append(f"{head}datasets {', '.join(sorted(map(str, g['dataset'].unique())))}; seeds "
                     f"{', '.join(str(s) for s in sorted(g['seed'].unique()))}")
    return " — ".join(parts)


def render_optimizers(t: pd.DataFrame, subset: pd.DataFrame) -> Rendered:
    blocks = _wide(t, lambda r: pm(r["mean"], r["std"]) + _mark(r), bold=best_component(t))
    return Rendered("optimizers", "Optimizers compared on the runs they share",
                    "Test accuracy (%) over the learning-rate grid: mean ± std over every learning rate and "
                    "seed (the paper's Tables 2 and 10), computed only where every optimizer ran: "
                    f"{_subset_text(subset)}. The overall row averages the means and the stds over datasets.",
                    blocks, _notes(t, _bold_note(t, "for the dataset and optimizer")))


def render_overall(t: pd.DataFrame, wilcoxon: pd.DataFrame | None = None, reference: str = "MHA") -> Rendered:
    blocks = []
    sig = set()
    if wilcoxon is not None and len(wilcoxon):
        w = wilcoxon[wilcoxon["significant"]]
        sig = {(m, o, c) for m, o, c in zip(w.get("model", pd.Series([None] * len(w), index=w.index)),
                                              w["optimizer"], w["other"])}
    for heading, g in _groups(t, []):
        g = g.copy()
        g["dataset"] = "all"
        mask = best_component(g)
        rows, bold = [], set()
        for i, (idx, r) in enumerate(g.iterrows()):
            mark = " †" if (r.get("model"), r["optimizer"], r["configuration"]) in sig else ""
            rows.append([r["optimizer"], r["configuration"], pct(r["mean"]) + mark + _mark(r), pct(r["std"]),
                         pm(r["lr_grid_mean"], r["lr_grid_std"]), str(int(r["n_datasets"]))])
            if mask.loc[idx]:
                bold.add((i, 2))
        blocks.append(Block(heading, ["optimizer", "configuration", "best-lr accuracy (%)", "std over datasets",
                                      "lr-grid accuracy (%)", "datasets"], rows, bold))
    notes = _notes(t, "Best-lr accuracy: mean over datasets of the best-lr mean accuracy; lr-grid accuracy: mean "
                      "over datasets of the lr-grid mean ± the mean over datasets of the std across learning rates.",
                   _bold_note(t, "per optimizer"))
    if sig:
        notes.append(f"†: significantly different from {reference} (Wilcoxon signed-rank test, 5%).")
    return Rendered("overall", "Overall accuracy (mean over datasets)",
                    "Mean over datasets per configuration (the paper's Table 1).", blocks, notes)


def render_relative_gain(t: pd.DataFrame) -> Rendered:
    def cell(r):
        return f"{100 * r['relative_gain']:+.1f}%" if _finite(r["relative_gain"]) else "–"
    blocks = _wide(t, cell, bold=_best_mask(t, "relative_gain"))
    ref = t["reference"].iloc[0]
    what = ("the linear probe (LP: logistic regression on the frozen backbone's mean-pooled last-block features, "
            "fit once per dataset)" if ref == LINEAR_PROBE else "Head (a trained classifier on the frozen backbone; "
            "no linear-probe rows in this study)")
    return Rendered("relative_gain", "Relative gain over linear probing",
                    f"Percentage improvement of the best-lr accuracy over {what}, (acc − acc_{ref}) / acc_{ref}, "
                    "per dataset (the paper's Table 8 and Fig. 2, right); the overall row averages the "
                    "per-dataset gains.", blocks, [n for n in [_bold_note(t, lead="the largest gain among")] if n])


def render_wilcoxon(t: pd.DataFrame, *, alternative: str, pair_by: str, reference: str,
                    round_to: int | None = None) -> Rendered:
    blocks = []
    for heading, g in _groups(t, []):
        rows = [[r["optimizer"], r["reference"], r["other"], fmt_num(r["statistic"], 1), fmt_p(r["p_value"]),
                 str(int(r["n_pairs"])), "yes" if r["significant"] else "no"] for _, r in g.iterrows()]
        bold = {(i, 4) for i, (_, r) in enumerate(g.iterrows()) if r["significant"]}
        blocks.append(Block(heading, ["optimizer", "reference", "other", "statistic", "p-value", "pairs",
                                      "significant (5%)"], rows, bold))
    pairs = "datasets (best-lr mean accuracies)" if pair_by == "dataset" else \
        "(dataset, seed) pairs at each configuration's best learning rate"
    alt = {"greater": f"one-sided: {reference} better than the other configuration",
           "less": f"one-sided: {reference} worse than the other configuration",
           "two-sided": "two-sided"}[alternative]
    return Rendered("wilcoxon", f"Wilcoxon signed-rank tests of {reference} against every other configuration",
                    f"scipy.stats.wilcoxon, {alt}; paired over {pairs}.", blocks,
                    [f"{statistic_note(alternative, 'reference − other')}; p-value '–' when there are no "
                     "pairs or every difference is zero.",
                     smallest_p_note(alternative, t["n_pairs"]),
                     *([f"Tested on the accuracies rounded to {round_to} decimal(s) of a percent (as a table prints "
                        "them); pairs that rounding made equal are dropped."] if round_to is not None else [])])


def render_stability(t: pd.DataFrame) -> Rendered:
    blocks = _wide(t, lambda r: f"{pct(r['std'])} / {pct(r['range'])}{_mark(r)}",
                   bold=_best_mask(t, "std", lowest=True))
    return Rendered("stability", "Stability over learning rates × seeds",
                    "Std / range (max − min) of test accuracy (percentage points) over every learning rate and "
                    "seed; the overall row averages over datasets.", blocks,
                    _notes(t, _bold_note(t, lead="the smallest std among")))


def render_ranking(t: pd.DataFrame) -> Rendered:
    blocks = []
    for heading, g in _groups(t, []):
        rows = [[r["dataset"], r["optimizer"], r["mode"], f"{fmt_num(r['spearman'], 2)} (p {fmt_p(r['spearman_p'])})",
                 f"{fmt_num(r['kendall'], 2)} (p {fmt_p(r['kendall_p'])})", str(int(r["n_components"])),
                 r["plasticity_ranking"], r["accuracy_ranking"]] for _, r in g.iterrows()]
        blocks.append(Block(heading, ["dataset", "optimizer", "mode", "Spearman ρ", "Kendall τ", "components",
                                      "plasticity ranking", "accuracy ranking"], rows))
    return Rendered("ranking", "Agreement of plasticity and accuracy rankings",
                    "Rank correlation between the components' plasticity (mean over layers) and their best-lr "
                    "accuracy, per dataset (scipy.stats.spearmanr and kendalltau).", blocks,
                    ["p-values are two-sided and exact for small samples (Spearman: all n! pairings; Kendall: "
                     "scipy's exact distribution). With five components only ρ = 1 or τ = 1 reaches p < 0.05 "
                     "(2/120 and 2/120 = 0.017); read the rankings, not only the p-values."])


def render_cost(t: pd.DataFrame, trials: pd.DataFrame | None = None) -> Rendered:
    mem = [c for c in ("grad_memory_bytes", "optimizer_memory_bytes") if c in t.columns]
    labels = {"grad_memory_bytes": "gradient memory", "optimizer_memory_bytes": "optimizer memory"}
    speed, selection = "images_per_s" in t.columns, "selection_seconds" in t.columns
    blocks = []
    for heading, g in _groups(t, []):
        rows = []
        for _, r in g.iterrows():
            wall = fmt_duration(r["wall_seconds"])
            if _finite(r["wall_seconds_std"]):
                wall += f" ± {fmt_duration(r['wall_seconds_std'])}"
            rows.append([r["optimizer"], r["configuration"], fmt_count(r["trainable_params"]),
                         *[fmt_bytes(r[c]) for c in mem], wall, fmt_duration(r["total_wall_seconds"]),
                         str(int(r["n_trials"])), *([fmt_num(r["images_per_s"], 1)] if speed else []),
                         *([fmt_duration(r["selection_seconds"]) if _finite(r["selection_seconds"]) else "–"]
                           if selection else [])])
        blocks.append(Block(heading, ["optimizer", "configuration", "trainable parameters",
                                      *[labels[c] for c in mem], "wall time per ok trial", "total wall time",
                                      "trials", *([f"{_inputs(trials)}/s"] if speed else []),
                                      *(["selection cost"] if selection else [])], rows))
    notes = ["Trainable parameters and memory: median over the configuration's trials (they vary only with the "
             "classifier head, i.e. the number of classes); total wall time includes failed trials."]
    if not mem:
        notes.append("trials.parquet has no grad_memory_bytes / optimizer_memory_bytes: memory columns omitted.")
    if trials is not None and (spread := _params_spread(trials)):
        notes.append(spread)
    if selection:
        notes.append("Selection cost: a budget's scoring pass before training (its criterion's gradients or a "
                     "mask's), wall time as measured once and cached, mean over its trials; – where none was "
                     "timed (auto: plasticity is its own stage; other configurations select nothing).")
    return Rendered("cost", "Cost per configuration", "Trainable parameters, gradient and optimizer-state memory, "
                    "and wall time per configuration.", blocks, notes)


def _inputs(trials: pd.DataFrame | None) -> str:
    """What the study's throughput counts: its runs' ``inputs`` (``images``, ``sequences``; ``inputs`` if they
    differ; ``images`` for studies older than the column)."""
    if trials is None or "inputs" not in trials.columns:
        return "images"
    kinds = set(trials["inputs"].dropna().astype(str))
    return kinds.pop() if len(kinds) == 1 else ("inputs" if kinds else "images")


def _params_spread(trials: pd.DataFrame) -> str:
    """A note on the configurations whose trainable-parameter count varies across trials ("" if none)."""
    p = trials.assign(p=recorded_counts(trials["trainable_params"])).groupby("configuration")["p"]
    spread = p.agg(["min", "max"]).reindex(configuration_order(p.groups)).dropna()
    varied = spread[spread["min"] != spread["max"]]
    if not len(varied):
        return ""
    return "Trainable parameters vary across datasets (min–max): " + ", ".join(
        f"{c} {fmt_count(r['min'])}–{fmt_count(r['max'])}" for c, r in varied.iterrows()) + "."


def _exclusion_reason(r) -> str:
    return "diverged before any evaluation" if r["status"] == "diverged" else f"status {r['status']}"


def render_excluded(excluded: pd.DataFrame) -> Rendered:
    cols = [c for c in ("trial_id", "dataset", "optimizer", "configuration", "lr", "seed", "status") if c in excluded]
    rows = [[fmt_lr(r[c]) if c == "lr" else str(r[c]) for c in cols] for _, r in excluded.iterrows()]
    return Rendered("excluded", "Trials excluded from the accuracy statistics",
                    "Every trial without a test accuracy to count: failed (or no status), or diverged before its "
                    "first evaluation. Diverged runs with an evaluation are counted, not listed here.",
                    [Block("", cols, rows)])


def excluded_footnote(n_total: int, excluded: pd.DataFrame) -> str:
    """``"3 of 90 trials excluded from the accuracy statistics (2 status failed, 1 diverged before any
    evaluation); listed in excluded.csv."``"""
    counts = excluded.apply(_exclusion_reason, axis=1).value_counts()
    detail = ", ".join(f"{n} {s}" for s, n in counts.items())
    return (f"{len(excluded)} of {n_total} trials excluded from the accuracy statistics ({detail}); listed in "
            "excluded.csv.")
