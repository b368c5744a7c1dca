"""A self-contained HTML report of a study: summary, notes, every table and every figure.

Figures are embedded as base64 PNG ``data:`` URIs and tables inline, with inline CSS and no external
resource, so the single file opens offline in any browser and can be mailed around. A tiny inline script
records on ``<body>`` whether every image decoded (``data-images-ok``) and how many tables and images the
page holds (``data-tables``, ``data-images``), which the headless-browser test reads back.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import os
from collections.abc import Collection
from pathlib import Path

import pandas as pd

from raystudy import __version__, storage
from raystudy.analysis.control import ranking_headlines
from raystudy.analysis.inputs import FINAL
from raystudy.analysis.options import (
    DEFAULT_ALTERNATIVE,
    DEFAULT_FIXED_RUN,
    DEFAULT_PAIR_BY,
    DEFAULT_REFERENCE,
    DEFAULT_ROUND,
    DEFAULT_SEEDS,
)
from raystudy.analysis.pipeline import AnalysisResult, lr_rules, run_analysis
from raystudy.analysis.pretraining import path_headlines
from raystudy.analysis.ranks import order_string
from raystudy.analysis.render import LR_RULES, PHASE_TEXT, md_escape, pct
from raystudy.analysis.scope import SCOPE_TITLE, scope_items, thesis_sentences
from raystudy.analysis.selection import SECTION_TITLE as CRITERIA_TITLE
from raystudy.analysis.selection import TABLES as CRITERIA_TABLES
from raystudy.analysis.selection import criteria_headlines
from raystudy.analysis.selection_figures import FIGURE_PREFIX as CRITERIA_FIGURES
from raystudy.analysis.stats import configuration_order
from raystudy.analysis.style import CONFIGURATION_COLORS, configuration_styles
from raystudy.analysis.tables import phase_of
from raystudy.analysis.vtab import lr_rule_text
from raystudy.vocab import LINEAR_PROBE, RANDOM_BLOCKS

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0; color: #1d2733;
       background: #f6f7f9; line-height: 1.45; }
header { background: #1d2733; color: #fff; padding: 1.2rem 2rem; }
header h1 { margin: 0 0 .3rem 0; font-size: 1.6rem; }
header p { margin: 0; opacity: .85; font-size: .9rem; }
main { max-width: 1200px; margin: 0 auto; padding: 1rem 2rem 3rem; }
nav ul { columns: 3; list-style: none; padding: 0; font-size: .9rem; }
nav a { color: #0b5cad; text-decoration: none; }
section.block { background: #fff; border-radius: 8px; padding: 1rem 1.4rem; margin: 1.2rem 0;
                box-shadow: 0 1px 3px rgba(0,0,0,.08); }
h2 { border-bottom: 2px solid #e3e6ea; padding-bottom: .3rem; }
h3 { margin-bottom: .2rem; }
h4 { margin: .8rem 0 .3rem; color: #44505c; }
p.caption { margin-top: 0; color: #44505c; font-size: .92rem; }
table { border-collapse: collapse; margin: .4rem 0 .8rem; font-size: .88rem; font-variant-numeric: tabular-nums; }
th, td { padding: .28rem .6rem; border-bottom: 1px solid #e3e6ea; text-align: right; white-space: nowrap; }
/* long headers wrap, so that the widest table (cost) fits a 1,400 px window without scrolling */
thead th { background: #eef1f4; text-align: center; white-space: normal; vertical-align: bottom; }
tbody th { text-align: left; font-weight: 600; }
tbody tr:hover { background: #f3f7fc; }
td strong, th strong { color: #0b4f9c; }
small.detail { color: #7a8591; font-size: .78rem; }
.table-scroll { overflow-x: auto; }
ul.footnotes { font-size: .82rem; color: #5a6570; padding-left: 1.2rem; }
ul.notes li { margin: .2rem 0; }
.notes { background: #fff8e6; border-left: 4px solid #e0a400; padding: .6rem 1rem; border-radius: 4px; }
figure { margin: 1rem 0 1.6rem; }
figure img { max-width: 100%; height: auto; border: 1px solid #e3e6ea; border-radius: 4px; background: #fff; }
figcaption { font-size: .88rem; color: #44505c; margin-top: .3rem; }
dl.summary { display: grid; grid-template-columns: max-content 1fr; gap: .25rem 1rem; margin: 0; }
dl.summary dt { font-weight: 600; }
dl.summary dd { margin: 0; }
.swatch { display: inline-block; width: .8rem; height: .8rem; border-radius: 2px; margin: 0 .25rem -0.1rem .6rem; }
"""

SCRIPT = """
(function () {
  function check() {
    var imgs = Array.prototype.slice.call(document.images);
    var bad = imgs.filter(function (i) { return !(i.complete && i.naturalWidth > 0); });
    document.body.setAttribute("data-images", String(imgs.length));
    document.body.setAttribute("data-images-ok", bad.length === 0 ? "true" : "false");
    document.body.setAttribute("data-tables", String(document.querySelectorAll("table").length));
  }
  if (document.readyState === "complete") { check(); } else { window.addEventListener("load", check); }
})();
"""


def _e(text) -> str:
    return html.escape(str(text))


def _join(values) -> str:
    return ", ".join(str(v) for v in values)


def _phase(res: AnalysisResult) -> str:
    """The phase the report answers from, as the headline says it (:data:`~raystudy.analysis.render.PHASE_TEXT`;
    the lr search's with its lr rule)."""
    if phase_of(res.inputs.final) == FINAL:
        return PHASE_TEXT[FINAL]
    rule = LR_RULES[lr_rules(res.options.get("select_by"))[0]]
    return f"the lr search (the grid's trials, trained on train; test accuracy at each dataset's lr with {rule})"


def _headlines(res: AnalysisResult) -> list[str]:
    """One line per optimizer ranking the configurations by overall accuracy, from the phase every table that
    reports an accuracy reads (:func:`raystudy.analysis.tables.reported_accuracies`: the final fit where the
    study has one), which it names; the selection criteria against plasticity, as their section tests them
    (:func:`raystudy.analysis.selection.criteria_headlines`); the plasticity rankings
    (:func:`raystudy.analysis.control.ranking_headlines`)."""
    lines = []
    overall = res.tables.get("overall")
    if overall is not None:
        for keys, g in overall.groupby([c for c in ("model", "optimizer") if c in overall.columns], sort=True):
            keys = keys if isinstance(keys, tuple) else (keys,)
            ranking = order_string(g.set_index("configuration")["mean"], pct)
            lines.append(f"{' · '.join(map(str, keys))}: {ranking} — test accuracy (%), mean over datasets, from "
                         f"{_phase(res)}")
    lines += criteria_headlines(res.tables.get("criteria"))
    if res.inputs.plasticity is not None:  # measured, the controls' and the paper's ranking, Kendall's tau
        lines += ranking_headlines(res.inputs.plasticity, res.inputs.control)
    if "plasticity_pretraining" in res.tables:  # where the ranking comes from: its path along the pretraining
        lines += path_headlines(res.tables["plasticity_pretraining"])
    return lines + [f"Thesis check: {s}" for s in thesis_sentences(res.tables.get("ranking"))]


def summary_items(res: AnalysisResult) -> list[tuple[str, str]]:
    """The report's summary as (label, plain text) pairs: what the study holds, how each best lr and each
    VTAB-1k accuracy was selected, which tests ran (the HTML and the Markdown report both show these)."""
    inp = res.inputs
    items = [("study directory" if len(inp.study_dirs) <= 1 else "study directories", res.study_dir)]
    if inp.trials is not None:
        t = inp.trials
        probe_rows = t["configuration"].astype(str) == LINEAR_PROBE  # counted apart: a probe is no trial
        n_trials, n_probes = int((~probe_rows).sum()), int(probe_rows.sum())
        n_ok = 0 if inp.counted is None else len(inp.counted)
        n_div = 0 if inp.counted is None else int(inp.counted["diverged"].sum())
        items += [("models", _join(sorted(t["model"].astype(str).unique()))),
                  ("datasets", _join(sorted(t["dataset"].astype(str).unique()))),
                  ("configurations", _join(configuration_order(t["configuration"].dropna().astype(str)))),
                  ("optimizers", _join(sorted(t["optimizer"].dropna().astype(str).unique()))),
                  ("learning rates", _join(f"{v:g}" for v in sorted(pd.to_numeric(t["lr"]).dropna().unique()))),
                  ("seeds", _join(sorted(t["seed"].dropna().unique()))),
                  ("trials", f"{n_trials} in total, {n_ok} counted ({n_div} of them diverged, counted with their "
                             f"pre-divergence best-validation accuracy), {n_trials - n_ok} excluded")]
        if n_probes:
            n_fit = 0 if inp.probes is None else len(inp.probes)
            items.append(("linear probes", f"{n_probes} ({n_fit} counted), one per dataset; not trials"))
        if inp.final is not None:
            items.append(("final fits", f"{len(inp.final)} counted final-phase row(s) (retrained on train + val, "
                                        "VTAB-1k's train800val200, at the val-chosen lr): read by the headlines and "
                                        "every table and figure that reports a configuration's accuracy; the lr "
                                        "search's own (best lr, lr grid, stability, the accuracy-against-lr "
                                        "figures) read the search trials"))
    if inp.plasticity is not None:
        p = inp.plasticity
        items += [("plasticity", f"{p['model'].nunique()} model(s), {p['dataset'].nunique()} dataset(s), "
                                 f"modes {_join(sorted(p['mode'].unique()))}, {p['layer'].nunique()} layers")]
        c = inp.control
        if c is not None:
            seeds = _join(sorted({int(v) for v in c["init_seed"].dropna()})) if "init_seed" in c.columns else "–"
            blocks = c[c["weights"] == RANDOM_BLOCKS]
            items.append(("random-init control", f"the same architecture at its library's own init (seed {seeds}) "
                                                 f"on the same pairs: {c['dataset'].nunique()} dataset(s)"))
            items.append(("component control", f"the random-init blocks fed the model's own embeddings (seed {seeds}) "
                                                f"on the same pairs: {blocks['dataset'].nunique()} dataset(s)"
                          if len(blocks) else "not measured (plasticity.parquet predates it)"))
    o = res.options
    paper_rule, _ = lr_rules(o.get("select_by"))
    if "best_lr" in res.tables:
        items.append(("best lr", f"the learning rate with {LR_RULES[paper_rule]}"))
    if "vtab" in res.tables:
        items.append(("VTAB-1k table", lr_rule_text(res.tables["vtab"]["lr_rule"].iloc[0])))
    items.append(("tests", tests_held(res)))
    return items


def tests_held(res: AnalysisResult) -> str:
    """The summary's line of the tests the report holds, each with what it pairs and where it is; ``none``
    (and why the Wilcoxon tests against the reference are missing) when it holds none."""
    o, t = res.options, res.tables
    held = []
    if "wilcoxon" in t:
        held.append(f"Wilcoxon vs {o['reference']}, alternative {o['alternative']}, paired by "
                    f"{o['pair_by'].replace('_', ' and ')}"
                    + (f", on values rounded to {o['round_to']} decimal(s) of a percent" if o["round_to"] is not None
                       else "") + " (table wilcoxon)")
    if "criteria" in t:
        held.append("Wilcoxon signed-rank of plasticity (auto) against each selection criterion (random at the "
                    "weights granularity), two-sided, paired over datasets, Holm-corrected across each budget's "
                    f"criteria (section '{CRITERIA_TITLE}')")
    for name, over in (("matched_budget", "datasets"), ("vtab_matched_budget", "VTAB-1k tasks")):
        if name in t:
            held.append(f"Wilcoxon signed-rank at matched budgets, two-sided, paired over {over}, uncorrected "
                        f"(table {name})")
    if "ranking" in t:
        held.append("Spearman and Kendall correlations of the components' plasticity and accuracy rankings "
                    "(table ranking, the thesis check)")
    if "unit_gain" in t:
        held.append("Spearman correlation of a unit's plasticity and the accuracy gain of training it alone "
                    "(table unit_gain)")
    if res.inputs.plasticity is not None:
        held.append("Kendall τ-b between the plasticity rankings (headlines)")
    missing = "" if "wilcoxon" in t else f"the Wilcoxon tests against {o['reference']} were omitted (see the notes)"
    if not held:
        return f"none: {missing}"
    return "; ".join(held) + (f"; {missing}" if missing else "")


def _summary(res: AnalysisResult) -> str:
    inp = res.inputs
    items = [(k, _e(v)) for k, v in summary_items(res)]
    names = configuration_order(inp.trials["configuration"].dropna().astype(str)) if inp.trials is not None \
        else list(CONFIGURATION_COLORS)
    colours = "".join(f'<span class="swatch" style="background:{c}"></span>{_e(n)}'
                      for n, (c, _marker) in configuration_styles(names).items())
    items.append(("colours", colours))
    body = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in items)
    heads = _headlines(res)
    head_html = ("<h3>Headlines</h3><ul>" + "".join(f"<li>{_e(h)}</li>" for h in heads) + "</ul>") if heads else ""
    return f'<section class="block" id="summary"><h2>Summary</h2><dl class="summary">{body}</dl>{head_html}</section>'


def _scope(res: AnalysisResult) -> str:
    body = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in scope_items(res))
    return (f'<section class="block" id="scope"><h2>{SCOPE_TITLE}</h2><dl class="summary">{body}</dl></section>'
            if body else "")


def build_markdown(res: AnalysisResult) -> str:
    """The report as one Markdown file: the summary (:func:`summary_items`), headlines, notes, then every
    table's Markdown (its title one level down) and a link per figure."""
    name = Path(str(res.study_dir).split(",")[0].rstrip("/")).name or str(res.study_dir)
    out = [f"# raystudy report: {md_escape(name)}", "", "## Summary", ""]
    out += [f"- **{md_escape(k)}**: {md_escape(v)}" for k, v in summary_items(res)]
    out += ["", *(f"- {md_escape(h)}" for h in _headlines(res))]
    scope = scope_items(res)
    if scope:
        out += ["", f"## {SCOPE_TITLE}", "", *(f"- **{md_escape(k)}**: {md_escape(v)}" for k, v in scope)]
    notes = res.notes + ([res.footnote] if res.footnote else [])
    if notes:
        out += ["", "## Notes", "", *(f"- {md_escape(n)}" for n in notes)]
    for r in res.rendered.values():
        out += ["", r.markdown().replace("# ", "## ", 1).replace("\n## ", "\n### ")]
    if res.figures:
        out += ["", "## Figures", ""]
        out += [f"- [{md_escape(f.title)}](figures/{f.name}.png)" for f in res.figures]
    return "\n".join(out).rstrip() + "\n"


#: Pixels of a figure's PNG (150 dpi) per CSS pixel (96 per inch): every figure shown at its true size (wider
#: ones shrunk to the page), so that one font size in points reads the same in every figure.
PNG_PER_CSS_PX = 150 / 96


def _png_width(data: bytes) -> int:
    """The width in pixels of a PNG (bytes 16-19 of its IHDR chunk, big-endian)."""
    return int.from_bytes(data[16:20], "big")


def _figure(info) -> str:
    png = next(p for p in info.paths if p.suffix == ".png").read_bytes()
    data, width = base64.b64encode(png).decode("ascii"), round(_png_width(png) / PNG_PER_CSS_PX)
    return (f'<figure id="figure-{_e(info.name)}"><h3>{_e(info.title)}</h3>'
            f'<img src="data:image/png;base64,{data}" alt="{_e(info.title)}" data-figure="{_e(info.name)}" '
            f'width="{width}">'
            f"<figcaption>{_e(info.caption)} (PNG and SVG in figures/{_e(info.name)}.*)</figcaption></figure>")


def unique_labels(labels: list[str], kinds: list[str]) -> list[str]:
    """``labels`` made unique: one that repeats says its kind (``"Best accuracy per dataset (figure)"``), and
    one still repeated then its rank (``"... (figure 2)"``)."""
    counts = {lab: labels.count(lab) for lab in labels}
    out = [f"{lab} ({kind})" if counts[lab] > 1 else lab for lab, kind in zip(labels, kinds)]
    seen: dict[str, int] = {}
    for i, lab in enumerate(list(out)):
        seen[lab] = seen.get(lab, 0) + 1
        if out.count(lab) > 1 and seen[lab] > 1:
            out[i] = f"{lab[:-1]} {seen[lab]})" if lab.endswith(")") else f"{lab} ({seen[lab]})"
    return out


def toc_entries(res: AnalysisResult) -> list[tuple[str, str]]:
    """``(anchor, label)`` of the report's table of contents: summary, scope, notes, every table, every
    figure; the labels unique (:func:`unique_labels`)."""
    entries = [("summary", "Summary", "section")]
    entries += [("scope", SCOPE_TITLE, "section")] if scope_items(res) else []
    entries += [("notes", "Notes", "section")] if res.notes or res.footnote else []
    entries += [("criteria", CRITERIA_TITLE, "section")] if any(map(_in_criteria_section, res.rendered)) else []
    entries += [(f"table-{n}", r.title, "table") for n, r in res.rendered.items()]
    entries += [(f"figure-{f.name}", f.title, "figure") for f in res.figures]
    labels = unique_labels([lab for _, lab, _ in entries], [k for _, _, k in entries])
    return [(anchor, label) for (anchor, _, _), label in zip(entries, labels)]


def _in_criteria_section(name: str) -> bool:
    """Whether a table or figure belongs to the selection criteria's section (not to Tables / Figures)."""
    return name in CRITERIA_TABLES or name.startswith(CRITERIA_FIGURES)


def _criteria_section(res: AnalysisResult) -> str:
    """The selection criteria at matched budgets (:mod:`raystudy.analysis.selection`): its tables, then its
    figures; empty when the study has no criterion budget."""
    tables = "".join(f'<div class="table-scroll">{r.html()}</div>' for n, r in res.rendered.items()
                     if _in_criteria_section(n))
    figs = "".join(_figure(f) for f in res.figures if _in_criteria_section(f.name))
    if not tables and not figs:
        return ""
    return f'<section class="block" id="criteria"><h2>{_e(CRITERIA_TITLE)}</h2>{tables}{figs}</section>'


def build_html(res: AnalysisResult) -> str:
    """The report of an analysis as one HTML string (no external resource)."""
    toc = [f'<li><a href="#{_e(anchor)}">{_e(label)}</a></li>' for anchor, label in toc_entries(res)]
    notes = ""
    if res.notes or res.footnote:
        items = "".join(f"<li>{_e(n)}</li>" for n in res.notes + ([res.footnote] if res.footnote else []))
        notes = f'<section class="block" id="notes"><h2>Notes</h2><ul class="notes">{items}</ul></section>'
    tables = "".join(f'<div class="table-scroll">{r.html()}</div>' for n, r in res.rendered.items()
                     if not _in_criteria_section(n))
    tables = f'<section class="block" id="tables"><h2>Tables</h2>{tables}</section>' if tables else ""
    figs = "".join(_figure(f) for f in res.figures if not _in_criteria_section(f.name))
    figs = f'<section class="block" id="figures"><h2>Figures</h2>{figs}</section>' if figs else ""
    stamp = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    name = Path(str(res.study_dir).rstrip("/")).name or str(res.study_dir)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>raystudy report: {_e(name)}</title>
<style>{CSS}</style>
</head>
<body data-images-ok="pending">
<header><h1>raystudy report: {_e(name)}</h1>
<p>Component-wise finetuning and plasticity study · generated {_e(stamp)} by raystudy {_e(__version__)}</p></header>
<main>
<nav><ul>{''.join(toc)}</ul></nav>
{_summary(res)}
{_scope(res)}
{notes}
{_criteria_section(res)}
{tables}
{figs}
</main>
<script>{SCRIPT}</script>
</body>
</html>
"""


def write_report(res: AnalysisResult, path: str | os.PathLike | None = None) -> Path:
    """Write ``report.html`` and beside it ``report.md`` (:func:`build_markdown`) into the analysis folder
    (uploaded too when the folder mirrors a URI)."""
    path = Path(path) if path is not None else res.out_dir / "report.html"
    storage.write_text_atomic(path, build_html(res))
    storage.write_text_atomic(path.with_suffix(".md"), build_markdown(res))
    if res.upload_to and path.parent == res.out_dir:
        storage.publish(res.out_dir, res.upload_to)
    return path


def report(study_dir: str | os.PathLike, *, reference: str = DEFAULT_REFERENCE,
           alternative: str = DEFAULT_ALTERNATIVE, pair_by: str = DEFAULT_PAIR_BY,
           round_to: int | None = DEFAULT_ROUND, out_dir: str | os.PathLike | None = None,
           seeds: list[int] | None = DEFAULT_SEEDS, fixed_run: dict | list | None = DEFAULT_FIXED_RUN,
           select_by: str | None = None, figures: bool | Collection[str] = True) -> Path:
    """Analyse ``study_dir`` (tables and figures as :func:`raystudy.analysis.analyze`, so calling both is
    redundant) and write the self-contained ``<out_dir>/report.html`` (default
    ``<study_dir>/analysis/report.html``); returns its path (for a URI study directory: the local staged
    copy, uploaded to ``<study_dir>/analysis/report.html``); ``seeds``, ``fixed_run``, ``select_by`` and
    ``figures``: as :func:`raystudy.analysis.pipeline.run_analysis`."""
    res = run_analysis(study_dir, reference=reference, alternative=alternative, pair_by=pair_by, round_to=round_to,
                       out_dir=out_dir, seeds=seeds, fixed_run=fixed_run, select_by=select_by, figures=figures)
    return write_report(res)
