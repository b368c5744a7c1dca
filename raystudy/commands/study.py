"""``raystudy study``: run, continue or inspect a study (the grid of finetuning runs + plasticity + analysis).

``experiments/full_study.py`` is the same command as a script (``make demo`` runs it).
"""

from __future__ import annotations

import argparse
import os
import sys

DESCRIPTION = (
    "Run a study: the grid dataset x configuration x optimizer x lr x seed of finetuning runs on Ray Tune "
    "(each trial a Ray Train run), the plasticity of every dataset, and the analysis. Results land in the "
    "study directory (--out): trials.parquet, curves.parquet, plasticity.parquet, bounds.parquet, tb/, "
    "tune/, analysis/. Re-running the same command continues an interrupted study (only missing trials "
    "run) and does nothing for a finished one; --resume DIR continues the study stored in DIR. The preset "
    "is `demo` (built-in data, local Ray, a few minutes on 2 CPUs) unless a cluster address is given, then "
    "`paper`."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=None,
                   help="preset name (demo, paper, paper-vtab1k) or a spec YAML file; "
                        "default: demo, or paper with --address")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue the study in DIR with the spec stored there (spec.yaml); --set may still "
                        "change resources (e.g. max_concurrent_trials), not what a trial means")
    p.add_argument("--out", default=None, help="study directory: a local path or a pyarrow URI (s3://...)")
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                   help="Ray cluster address ('auto' on a cluster node; default: RAY_ADDRESS or a local Ray)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec field (YAML value; dotted keys for plasticity.* / pretrain.*), "
                        "e.g. --set steps=200 --set 'seeds=[0,1]' --set plasticity.pairs=512")
    p.add_argument("--datasets", default=None, help="comma-separated subset of the preset's datasets")
    p.add_argument("--configurations", default=None, help="comma-separated, e.g. MHA,FC1,LN1")
    p.add_argument("--seeds", default=None, help="comma-separated seeds")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--search", choices=["grid", "optuna"], default=None,
                   help="grid: every lr of the spec; optuna: TPE over the lr range, --samples runs per "
                        "(dataset, configuration, optimizer, seed)")
    p.add_argument("--samples", type=int, default=None, help="runs per cell with --search optuna")
    p.add_argument("--max-concurrent-trials", type=int, default=None, help="0: as many as resources allow")
    p.add_argument("--workers", type=int, default=None, help="Ray Train workers (DDP) per trial")
    p.add_argument("--gpus-per-worker", type=float, default=None)
    p.add_argument("--data-root", default=None, help="directory holding the prepared stores")
    p.add_argument("--weights", default=None, help="local weights file of the model")
    p.add_argument("--no-plasticity", action="store_true", help="skip the plasticity measurement")
    p.add_argument("--no-analysis", action="store_true", help="skip the analysis")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the spec and print the grid and what is already done; launch nothing")


def register(subparsers) -> None:
    p = subparsers.add_parser("study", help="run or continue a study (Ray Tune over the finetuning grid)",
                              description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=run)


def spec_from_args(args: argparse.Namespace):
    """The study spec: preset (or the stored spec with --resume), then flags, then --set overrides."""
    from raystudy.study.spec import load_preset
    from raystudy.study.tune import load_study_spec

    if args.resume:
        if args.preset:
            raise ValueError("--resume DIR continues the stored spec; do not combine it with --preset")
        spec = load_study_spec(args.resume)
    else:
        spec = load_preset(args.preset or ("paper" if args.address else "demo"))
    flags: dict = {}
    if args.out and not args.resume:
        flags["out"] = args.out
    if args.steps is not None:
        flags["steps"] = args.steps
    if args.search is not None:
        flags["search"] = args.search
    if args.samples is not None:
        flags["samples"] = args.samples
    if args.max_concurrent_trials is not None:
        flags["max_concurrent_trials"] = args.max_concurrent_trials
    if args.workers is not None:
        flags["workers_per_trial"] = args.workers
    if args.gpus_per_worker is not None:
        flags["gpus_per_worker"] = args.gpus_per_worker
    if args.data_root is not None:
        flags["data_root"] = args.data_root
    if args.weights is not None:
        flags["weights"] = args.weights
    if args.seeds is not None:
        flags["seeds"] = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.configurations is not None:
        flags["configurations"] = [c.strip() for c in args.configurations.split(",") if c.strip()]
    if flags:
        spec = spec.with_overrides(flags)
    if args.datasets is not None:
        spec = spec.with_overrides([f"datasets=[{args.datasets}]"])
    if args.overrides:
        spec = spec.with_overrides(args.overrides)
    if args.no_plasticity:
        spec.plasticity.enabled = False
    if args.no_analysis:
        spec.analysis = False
    return spec


def dry_run(spec) -> int:
    from raystudy.study.results import ResultTables, exists
    from raystudy.study.tune import resolve_paths

    spec.validate(check_files=False)
    spec = resolve_paths(spec)
    grid = spec.grid()
    tables = ResultTables(spec.out) if exists(spec.out) else None
    done = tables.done_ids() if tables else set()
    print(f"study {spec.name!r} -> {spec.out}")
    print(f"  model {spec.model} (weights: {spec.weights}); {len(spec.datasets)} dataset(s), "
          f"{len(spec.configurations)} configuration(s), optimizers {spec.optimizers}, seeds {spec.seeds}")
    print(f"  {spec.steps} steps, batch {spec.batch_size}, {spec.workers_per_trial} worker(s)/trial, "
          f"{spec.gpus_per_worker} GPU/worker, max concurrent {spec.max_concurrent_trials or 'unlimited'}")
    if spec.search == "grid":
        todo = [p for p in grid if p["trial_id"] not in done]
        print(f"  grid: {len(grid)} trials, {len(grid) - len(todo)} done, {len(todo)} to run")
        for p in todo[:20]:
            print(f"    {p['trial_id']}")
        if len(todo) > 20:
            print(f"    ... and {len(todo) - 20} more")
    else:
        print(f"  optuna: {spec.samples} runs in each of {len(spec.groups())} cells = {spec.total_trials()} trials")
    return 0


def run(args: argparse.Namespace) -> int:
    from raystudy.study.tune import run_study

    spec = spec_from_args(args)
    if args.dry_run:
        return dry_run(spec)
    outcome = run_study(spec, address=args.address, verbose=getattr(args, "verbose", False))
    return 0 if outcome.counts.get("failed", 0) == 0 else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``experiments/full_study.py``: the same flags as ``raystudy study``."""
    import logging

    parser = argparse.ArgumentParser(prog="full_study.py", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging, Ray worker output")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(message)s")
    try:
        return run(args)
    except (ValueError, FileNotFoundError, TypeError) as e:
        if args.verbose:
            raise
        print(f"full_study.py: error: {e}", file=sys.stderr)
        return 2
