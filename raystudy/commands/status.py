"""``raystudy status DIR``: a running or finished study's progress, from another terminal."""

from __future__ import annotations

import argparse

from raystudy.study.persist import load_study_spec


def register(subparsers) -> None:
    p = subparsers.add_parser("status", help="a study's progress: done / running / failed / pending, ETA, last errors",
                              description="Read a study directory (never Ray, no driver needed) and print how many "
                                          "of its grid's trials are done, failed, running or pending, whether a "
                                          "driver holds it, an ETA and the latest errors (raystudy.study.status).")
    p.add_argument("study_dir", metavar="DIR", help="the study directory (its spec.yaml and trials/)")
    p.add_argument("--json", action="store_true", help="print it as JSON (the trial ids of each state included)")
    p.set_defaults(func=run_status)


def run_status(args: argparse.Namespace) -> int:
    load_study_spec(args.study_dir, what=None)  # a folder that holds no study: refused before pandas and torch load
    from raystudy.study.status import study_status  # pandas, torch: --help stays light

    status = study_status(args.study_dir)
    print(status.to_json() if args.json else "\n".join(status.lines()))
    return 0
