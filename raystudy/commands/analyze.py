"""``raystudy analyze DIR`` and ``raystudy report DIR``: tables, figures and the HTML report of a study."""

from __future__ import annotations

import argparse
import sys

from raystudy.analysis.options import (
    DEFAULT_ALTERNATIVE,
    DEFAULT_FIXED_RUN,
    DEFAULT_PAIR_BY,
    DEFAULT_REFERENCE,
    DEFAULT_ROUND,
    DEFAULT_SEEDS,
    DEFAULT_SELECT_BY,
    FIXED_RUN_KEYS,
    FIXED_RUN_OPTIONAL,
    check_options,
    check_subset,
    output_folder,
    reference_problem,
    tables_problem,
)
from raystudy.study.signals import analysis_interrupted, sigterm_exits
from raystudy.vocab import ALTERNATIVES, PAIR_BY, SELECT_BY, TRIALS_CONFIGURATIONS


def _seeds(text: str) -> list[int]:
    """``--analysis-seeds 0,42`` -> ``[0, 42]``."""
    try:
        seeds = [int(s) for s in text.split(",")]
        check_subset(seeds, None)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of integer seeds ({e})") from None
    return seeds


def _fixed_run(text: str) -> dict:
    """``--fixed-run sketch,42,0.01`` -> ``{"dataset": "sketch", "seed": 42, "lr": 0.01}``; a fourth value
    names the optimizer: ``sketch,0,1e-4,adamw`` -> ``{..., "optimizer": "adamw"}``."""
    parts = text.split(",")
    keys = FIXED_RUN_KEYS + FIXED_RUN_OPTIONAL
    try:
        if not len(FIXED_RUN_KEYS) <= len(parts) <= len(keys):
            raise ValueError(f"{len(parts)} value(s)")
        run = dict(zip(keys, (parts[0], int(parts[1]), float(parts[2]), *parts[3:])))
        check_subset(None, run)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {','.join(k.upper() for k in FIXED_RUN_KEYS)}"
                                         f"[,{','.join(k.upper() for k in FIXED_RUN_OPTIONAL)}], e.g. "
                                         f"sketch,42,0.01 or sketch,0,1e-4,adamw ({e})") from None
    return run


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("study_dir", metavar="DIR", nargs="+",
                   help="study directory holding trials.parquet, plasticity.parquet, ...; several (e.g. ViT-B and "
                        "ViT-L, or two methods' studies) are analysed together, their tables concatenated")
    p.add_argument("--out", default=None, metavar="OUT",
                   help="output folder or URI (default: DIR/analysis; required with several DIRs)")
    p.add_argument("--reference", default=DEFAULT_REFERENCE, metavar="CONFIGURATION",
                   help="configuration the Wilcoxon tests compare against every other one "
                        f"({', '.join(TRIALS_CONFIGURATIONS)}, or an expression the study trained: MHA+FC1, "
                        f"auto:5%%, lora:r=8; LP: the linear probe; default: {DEFAULT_REFERENCE})")
    p.add_argument("--alternative", default=DEFAULT_ALTERNATIVE, choices=ALTERNATIVES,
                   help=f"Wilcoxon alternative: 'greater' = the reference is better (default: {DEFAULT_ALTERNATIVE})")
    p.add_argument("--pair-by", default=DEFAULT_PAIR_BY, choices=PAIR_BY,
                   help="Wilcoxon pairs: datasets (best-lr means over seeds) or (dataset, seed) pairs at each "
                        f"configuration's best learning rate (default: {DEFAULT_PAIR_BY})")
    p.add_argument("--round", dest="round_to", type=int, default=DEFAULT_ROUND, metavar="N",
                   help="test the accuracies rounded to N decimals of a percent, as a table prints them (the "
                        "paper's authors test their Table 8's two-decimal values: --round 2; default: unrounded)")
    p.add_argument("--select-by", choices=SELECT_BY, default=None,
                   help="choose each sweep's best lr by its mean test accuracy over seeds (the paper's rule, the "
                        f"default of the paper's tables: {DEFAULT_SELECT_BY}) or by its mean best-validation "
                        "accuracy (val: test never chooses; the default of VTAB-1k's table without final rows)")
    p.add_argument("--analysis-seeds", dest="seeds", type=_seeds, default=DEFAULT_SEEDS, metavar="S,S",
                   help="only these seeds' trials in every table and figure (the paper's Table 9: "
                        "--analysis-seeds 0; the spec's analysis_seeds; "
                        "default: every seed)")
    p.add_argument("--fixed-run", type=_fixed_run, action="append", default=DEFAULT_FIXED_RUN,
                   metavar="DATASET,SEED,LR",
                   help="also draw the curves of each configuration's run at this dataset, seed and lr; a fourth "
                        "value, an optimizer, keeps that optimizer's runs alone (the paper's Fig. 5: "
                        "sketch,42,0.01,sgd; its Fig. 54: sketch,0,1e-4,adamw); repeat for several; default: the "
                        "best runs only")


def register(subparsers) -> None:
    p = subparsers.add_parser("analyze", help="write the study's tables (CSV + Markdown) and figures (PNG + SVG)",
                              description="Read the Parquet tables of one or more study directories (never Ray) and "
                                          "write "
                                          "best_lr, lr_grid, overall, relative_gain, optimizers, wilcoxon, "
                                          "stability, ranking and cost tables plus figures to DIR/analysis/ "
                                          "(or --out).")
    _options(p)
    p.set_defaults(func=run_analyze)
    r = subparsers.add_parser("report", help="write a self-contained report.html (tables and figures embedded)",
                              description="Analyse the study directory like `raystudy analyze` and write "
                                          "DIR/analysis/report.html (or OUT/report.html), which opens offline; "
                                          "prints its path.")
    _options(r)
    for q in (p, r):
        which = q.add_mutually_exclusive_group()
        which.add_argument("--no-figures", action="store_true",
                           help="tables only: figures/ keeps what an earlier analysis drew (a note says so)")
        which.add_argument("--figures", action="append", metavar="PATTERN",
                           help="draw only the figures whose name matches this shell pattern (e.g. "
                                "'plasticity_*', 'curves_all_sketch_sgd'); repeat for several; the other files of "
                                "figures/ stay; default: every figure")
    r.set_defaults(func=run_report)


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse what the arguments alone tell is wrong (an option's value, a misspelt reference, a folder without
    a study's tables, several folders without ``--out``) before torch, pandas and matplotlib load: within a
    second, not after their import."""
    check_options(args.reference, args.alternative, args.pair_by, args.round_to, args.select_by)
    problem = reference_problem(args.reference)
    if problem:
        raise ValueError(problem)
    for study_dir in args.study_dir:
        problem = tables_problem(study_dir)
        if problem:
            raise FileNotFoundError(problem)
    output_folder(args.study_dir, args.out)


def _analysis(args: argparse.Namespace):
    check_arguments(args)
    from raystudy.analysis.pipeline import run_analysis  # torch, pandas, matplotlib: --help stays light

    # several DIRs without --out: run_analysis's ValueError, one line from the CLI
    res = run_analysis(args.study_dir, reference=args.reference, alternative=args.alternative,
                       pair_by=args.pair_by, round_to=args.round_to, out_dir=args.out,
                       figures=False if args.no_figures else args.figures or True,
                       seeds=args.seeds, fixed_run=args.fixed_run, select_by=args.select_by)
    for note in res.notes:
        print(f"note: {note}")
    return res


def _sigterm_said(args: argparse.Namespace):
    """SIGTERM during the analysis: one line saying it was interrupted and how to redo it, exit status 143."""
    def to_stderr(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    command = getattr(args, "command", "analyze")  # a parser of the sub-command alone sets none
    return sigterm_exits(to_stderr, line=f"raystudy {command}: {analysis_interrupted(args.study_dir, args.out)}")


def run_analyze(args: argparse.Namespace) -> int:
    with _sigterm_said(args):
        res = _analysis(args)
    if res.footnote:
        print(f"note: {res.footnote}")
    where = f"{res.upload_to} (staged in {res.out_dir})" if res.upload_to else str(res.out_dir)
    print(f"{len(res.tables)} tables and {len(res.figures)} figures written to {where}")
    for path in res.files:
        print(path)
    return 0


def run_report(args: argparse.Namespace) -> int:
    check_arguments(args)
    from raystudy.analysis.html_report import write_report  # pandas, matplotlib: --help stays light

    with _sigterm_said(args):
        res = _analysis(args)
        path = write_report(res)
    if res.upload_to:
        print(f"note: uploaded to {res.upload_to}/report.html")
    print(path)
    return 0
