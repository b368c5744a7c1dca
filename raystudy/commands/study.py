"""``raystudy study``: run, continue or inspect a study (the grid of finetuning runs + plasticity + analysis).

``experiments/full_study.py`` is the same command as a script (``make demo`` runs it), and
``experiments/plasticity_study.py`` the same with the plasticity-only presets. Flags set spec fields (the
spec's settings of role ``study_flag``: :func:`raystudy.study.spec.flag_fields`), ``--set key=value`` any
field (``--set datasets.pets.steps=2000`` one dataset's protocol); ``--print-spec`` shows the result as YAML,
``--dry-run`` the resolved per-dataset protocol and the grid (``--dry-run --json``: one JSON object,
:func:`dry_run_json`), with its cost: FLOPs, GPU-hours and wall time per dataset and in total
(:mod:`raystudy.study.cost`; ``--gpus K``, ``--mfu X`` or a GPU benchmark's ``--gpu-result FILE`` set what
they assume), or for a CPU study (no GPU per trial) CPU core-hours at the rate measured on this CPU
(:mod:`raystudy.study.cpu_cost`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from raystudy.cli import Parser, interrupted, setup_logging
from raystudy.distributed.cluster import check_cluster_auth
from raystudy.setting_flags import add_flags
from raystudy.storage import exists
from raystudy.study.persist import load_study_spec
from raystudy.study.spec import StudySpec, flag_fields, load_preset, preset_names
from raystudy.vocab import CONFIGURATIONS, RANDOM_INIT, TRACKERS

DESCRIPTION = (
    "Run a study: the grid dataset x configuration x optimizer x lr x seed of finetuning runs on Ray Tune "
    "(each trial a Ray Train run), the plasticity of every dataset, and the analysis. Results land in the "
    "study directory (--out): trials.parquet, curves.parquet, plasticity.parquet, bounds.parquet, tb/, "
    "tune/, analysis/. Re-running the same command continues an interrupted study (only missing trials "
    "run) and does nothing for a finished one; --resume DIR continues the study stored in DIR. The preset "
    "is `demo` (built-in data, local Ray, a few minutes on 2 CPUs) unless a cluster address is given, then "
    "`paper`; an empty --configurations (presets plasticity-demo, plasticity-paper) measures plasticity only."
)


#: a Ctrl-C while the command starts, before the study holds its directory (imports, checks)
STARTING = ("interrupted (Ctrl-C) during the start-up, before the study held {out}: nothing had started, nothing "
            "is lost; run the same command again to start it")


def _int_list(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _name_list(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def _configuration_list(text: str) -> str:
    """The comma list as given: the spec splits it (:meth:`StudySpec.normalize`) once its names are checked,
    so that a misspelt name is refused before the expression grammar loads torch."""
    return text


#: flags whose value is a comma list
_LIST_TYPES = {"configurations": _configuration_list, "seeds": _int_list, "tracking": _name_list}
_FLAG_HELP = {
    "configurations": f"comma-separated, some of {','.join(CONFIGURATIONS)} or expressions; empty: plasticity only",
    "seeds": "comma-separated (a preset's per-dataset seeds are replaced)",
    "steps": "every run's: the study's and every dataset's (a preset's per-dataset steps are replaced; "
             "--set datasets.NAME.steps=N sets one dataset's)",
    "workers_per_trial": "per trial",
    "tracking": f"comma-separated ({', '.join(TRACKERS)})",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=None,
                   help=f"preset name ({', '.join(preset_names())}) or a spec YAML file; "
                        "default: demo, or paper with --address")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue the study in DIR with the spec stored there (spec.yaml); --set may still "
                        "change resources (e.g. max_concurrent_trials), not what a trial means")
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                   help="Ray cluster address ('auto' on a cluster node; default: RAY_ADDRESS or a local Ray)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec field (YAML value; dotted keys for plasticity.* / pretrain.*), "
                        "e.g. --set steps=200 --set 'seeds=[0,1]' --set plasticity.pairs=512")
    spec = p.add_argument_group("spec fields (not given: the preset's value; the default shown is the field's)")
    add_flags(spec, StudySpec, flag_fields(StudySpec), unset=True, help=_FLAG_HELP, types=_LIST_TYPES)
    p.add_argument("--datasets", default=None, help="comma-separated subset of the preset's datasets")
    p.add_argument("--no-plasticity", action="store_true", help="skip the plasticity measurement")
    p.add_argument("--no-analysis", action="store_true", help="skip the analysis")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the spec and print the grid and what is already done; launch nothing")
    p.add_argument("--json", action="store_true",
                   help="with --dry-run: print one JSON object (per-dataset protocol, trial ids, probes, cost)")
    cost = p.add_argument_group("the cost a --dry-run prints (FLOPs, GPU-hours or a CPU study's core-hours, wall "
                                "time; docs/studies.md)")
    cost.add_argument("--gpus", type=float, default=None, metavar="K",
                      help="GPUs the wall time assumes (default: max_concurrent_trials x workers_per_trial x "
                           "gpus_per_worker; 8 when max_concurrent_trials is 0)")
    cost.add_argument("--mfu", type=float, default=None, metavar="X",
                      help="model FLOPs utilisation assumed, a fraction (default: --gpu-result's, else 0.35)")
    cost.add_argument("--gpu-result", default=None, metavar="FILE",
                      help='a GPU benchmark result JSON (benchmarks/gpu_check.py) whose "mfu": {"bf16": ..., '
                           '"fp32": ...} (and optional "peak_tflops", "device") the cost uses')
    p.add_argument("--print-spec", action="store_true",
                   help="print the resolved spec (preset + flags + --set) as YAML and exit; launch nothing")


def register(subparsers) -> None:
    p = subparsers.add_parser("study", help="run or continue a study (Ray Tune over the finetuning grid)",
                              description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=run)


def preset_of(args: argparse.Namespace, prefix: str = "") -> str:
    """The preset to load: ``--preset``, else ``paper`` with a cluster address and ``demo`` without; a
    preset name (not a file) gets ``prefix`` (``plasticity-``: ``--preset paper`` is ``plasticity-paper``)."""
    name = args.preset or ("paper" if args.address else "demo")
    is_file = bool(os.path.splitext(name)[1]) or os.sep in name
    return name if is_file or name.startswith(prefix) else prefix + name


def spec_from_args(args: argparse.Namespace, *, preset_prefix: str = ""):
    """The study spec: preset (or the stored spec with --resume), then flags, then --set overrides."""
    if args.resume:
        if args.preset:
            raise ValueError("--resume DIR continues the stored spec; do not combine it with --preset")
        spec = load_study_spec(args.resume)
    else:
        spec = load_preset(preset_of(args, preset_prefix))
    flags = {field: getattr(args, field) for field in flag_fields(StudySpec) if getattr(args, field) is not None}
    if args.resume:
        flags.pop("out", None)
    if flags:
        spec = spec.with_overrides(flags)
    for flag in ("steps", "seeds"):  # these flags set every run's value: drop the datasets' own
        if getattr(args, flag) is not None:
            spec = spec.with_overrides({f"datasets.{d}.{flag}": None for d, o in spec.dataset_overrides.items()
                                        if getattr(o, flag) is not None})
    if args.datasets is not None:
        spec = spec.with_overrides([f"datasets=[{args.datasets}]"])
    if args.overrides:
        spec = spec.with_overrides(args.overrides)
    if args.no_plasticity:
        spec.plasticity.enabled = False
    if args.no_analysis:
        spec.analysis = False
    return spec


def dry_run(spec, *, as_json: bool = False, gpus: float | None = None, mfu: float | None = None,
            gpu_result: str | None = None) -> int:
    """Validate ``spec`` (against the spec of the study already in ``out``, if any), print what the study
    would run and what it costs (``as_json``: as one JSON object, :func:`dry_run_json`, with its ``problems``)
    and check every file and folder a launch would read or write
    (:func:`raystudy.study.preflight.launch_problems`): each problem listed on stderr, exit status 1 when
    there is any. Launches nothing, writes nothing. The cost (:func:`raystudy.study.cost.study_cost`) assumes
    ``gpus`` GPUs at an MFU of ``mfu`` or the one measured in ``gpu_result`` (defaults: the spec's concurrency,
    0.35); a CPU study asked none of them is priced in core-hours at the rate its model reaches on this CPU
    (:func:`raystudy.study.cpu_cost.study_rate`, a second or so of timing); it needs neither the weights nor
    the stores (without a store, its evaluations are left out)."""
    from raystudy.study import cost, cpu_cost, preflight, selection_cost  # torch, pandas: --help stays light

    spec, problems = preflight.preflight(spec)  # a study directory created with another protocol is refused here
    flags = {"gpus": gpus, "mfu": mfu, "gpu_result": gpu_result}
    rate = cpu_cost.study_rate(spec, **flags)  # a CPU study: measured on this CPU, priced in core-hours
    estimate = selection_cost.add_selection(spec, cost.study_cost(spec, rate=rate), rate=rate, **flags)
    if as_json:
        print(json.dumps({**dry_run_json(spec, estimate), "problems": problems}, indent=1))
    else:
        print_plan(spec)
        print("\n".join(cost.cost_lines(estimate) + selection_cost.selection_lines(estimate.get("selection"))))
        if problems:
            print(f"{len(problems)} problem(s) a launch would meet:", file=sys.stderr)
            for problem in problems:
                print(f"  - {problem}", file=sys.stderr)
        else:
            print("  checked: every store, weights file and output folder a launch needs")
    return 1 if problems else 0


def print_plan(spec) -> None:
    """The dry run's text: the study, its plasticity and probes, the per-dataset protocol and the grid."""
    from raystudy.study.results import ResultTables  # pandas: --help stays light

    tables = ResultTables(spec.out) if exists(spec.out) else None
    done = tables.done_ids() if tables else set()
    print(f"study {spec.name!r} -> {spec.out}")
    print(f"  model {spec.model} (weights: {spec.weights}); {len(spec.datasets)} dataset(s)")
    p = spec.plasticity
    if p.enabled:
        control = f", beside its {p.control} control (seed {p.control_seed})" if p.control == RANDOM_INIT else ""
        print(f"  plasticity: {p.pairs} pairs per dataset ({p.mode}){control}, {p.workers} worker(s)")
    if spec.probe.enabled:
        print(f"  probes: {len(spec.probe_datasets())} (linear probe once per dataset, "
              f"augment={spec.probe.augment}, seed {spec.probe.seed})")
    if not spec.configurations:
        print("  grid: 0 trials (plasticity only)")
        return
    print(f"  {len(spec.configurations)} configuration(s) {spec.configurations}; batch {spec.batch_size}, "
          f"{spec.workers_per_trial} worker(s)/trial, {spec.gpus_per_worker} GPU/worker, "
          f"max concurrent {spec.max_concurrent_trials or 'unlimited'}")
    print_protocols(spec)
    if spec.search == "grid":
        print_grid(spec.grid(), done)
        if spec.final_fit:
            n = len(spec.groups())
            print(f"  final fit: {n} trials after the search, one per dataset, configuration, optimizer and seed, "
                  "on train + val at the lr chosen on val (ids known once the search ends)")
    else:
        print(f"  optuna: {spec.samples} runs in each of {len(spec.groups())} cells = {spec.total_trials()} trials")


def print_protocols(spec) -> None:
    """One line per dataset: its resolved steps / eval period / warmup / log period, and per optimizer
    its lr grid x seeds = runs."""
    n = len(spec.configurations)
    print("  per dataset (steps, eval period, warmup, log period; optimizer lrs x seeds):")
    width = max(len(d) for d in spec.datasets)
    for name, p in spec.protocols().items():
        grids = "; ".join(f"{o} {lrs} x seeds {p.seeds[o]}" for o, lrs in p.optimizers.items())
        print(f"    {name:<{width}}  {p.steps} steps, eval {p.eval_period}, warmup {p.warmup_steps}, "
              f"log {p.log_period}; {grids} -> {p.trials(n)} runs")


def print_grid(grid: list[dict], done: set[str]) -> None:
    """The grid's size (per optimizer), what is done, and the first trial ids still to run."""
    todo = [p for p in grid if p["trial_id"] not in done]
    per_opt: dict[str, int] = {}
    for p in grid:
        per_opt[p["optimizer"]] = per_opt.get(p["optimizer"], 0) + 1
    print(f"  grid: {len(grid)} trials, {len(grid) - len(todo)} done, {len(todo)} to run "
          f"({', '.join(f'{o} {k}' for o, k in per_opt.items())})")
    for p in todo[:20]:
        print(f"    {p['trial_id']}")
    if len(todo) > 20:
        print(f"    ... and {len(todo) - 20} more")


def dry_run_json(spec, cost: dict | None = None) -> dict:
    """What the study would run, as one JSON-able object: ``{"datasets": {name: {"store", "steps",
    "eval_period", "warmup_steps", "log_period", "optimizers": {opt: [lrs]}, "seeds": {opt: [seeds]},
    "trials"}}, "trials": [trial ids], "total_trials", "final_trials", "probes": [dataset names]}`` (trial
    ids: the grid's, in launch order; an Optuna search lists none, its ids are drawn as it runs;
    ``final_trials``: how many of ``total_trials`` the final fit runs after the search, their lrs unknown
    before it ends, so their ids are not listed).

    With ``cost`` (:func:`raystudy.study.cost.study_cost`): each dataset also carries ``flops``, ``gpu_hours``
    (a CPU study: ``cpu_hours``, core-hours, and ``gpu_hours`` null),
    ``wall_hours`` and ``cost`` (its breakdown: train / eval / probe FLOPs, rows, per-image FLOPs), and
    ``"cost"`` the total's (``flops``, ``gpu_hours``, ``wall_hours``, ``trials``, ...) with what they assume:
    ``mfu``, ``gpus``, ``precision``, ``peak_tflops``, ``device``, where each comes from, and ``notes``."""
    n = len(spec.configurations)
    datasets = {
        name: {"store": spec.datasets[name], "steps": p.steps, "eval_period": p.eval_period,
               "warmup_steps": p.warmup_steps, "log_period": p.log_period, "optimizers": p.optimizers,
               "seeds": p.seeds, "trials": p.trials(n) if spec.search == "grid" else None}
        for name, p in spec.protocols().items()
    }
    if cost is not None:
        for name, d in cost["datasets"].items():
            datasets[name].update({k: d.get(k) for k in ("flops", "gpu_hours", "cpu_hours", "wall_hours")
                                   if k in d}, cost=d)
    trials = [p["trial_id"] for p in spec.grid()] if spec.search == "grid" else []
    out = {"datasets": datasets, "trials": trials, "total_trials": spec.total_trials(),
           "final_trials": len(spec.groups()) if spec.final_fit else 0, "probes": spec.probe_datasets()}
    if cost is not None:
        out["cost"] = {**cost["total"], **{k: v for k, v in cost.items() if k not in ("datasets", "total")}}
    return out


def print_spec(spec) -> int:
    """Validate ``spec`` (without its files) and print it as YAML: a spec file ``--preset FILE`` reads."""
    spec.validate(check_files=False)
    print(spec.to_yaml(), end="")
    return 0


def run(args: argparse.Namespace, *, preset_prefix: str = "") -> int:
    if args.json and not args.dry_run:
        raise ValueError("--json: only with --dry-run (the study's results are its tables)")
    cost_flags = {"gpus": args.gpus, "mfu": args.mfu, "gpu_result": args.gpu_result}
    if not args.dry_run and any(v is not None for v in cost_flags.values()):
        raise ValueError("--gpus, --mfu, --gpu-result: only with --dry-run (they set the cost it prints)")
    spec = spec_from_args(args, preset_prefix=preset_prefix)
    spec.validate(check_files=False)  # before torch, Ray and pandas load: a bad value is refused within a second
    if args.print_spec:
        return print_spec(spec)
    if args.dry_run:
        return dry_run(spec, as_json=args.json, **cost_flags)
    check_cluster_auth(args.address)  # before torch's import: a refusing cluster is one line within a second
    try:
        from raystudy.study.tune import run_study  # torch, pandas, matplotlib (study.tune): --help stays light

        outcome = run_study(spec, address=args.address, verbose=getattr(args, "verbose", False))
    except KeyboardInterrupt as e:
        if str(e):  # the study's own line: what it interrupted, how to resume
            raise
        raise KeyboardInterrupt(STARTING.format(out=spec.out)) from None
    failed = outcome.counts.get("failed", 0) + outcome.probes.get("failed", 0)
    return 0 if failed == 0 else 1


def main(argv: list[str] | None = None, *, prog: str = "full_study.py", preset_prefix: str = "") -> int:
    """Entry point of the scripts in ``experiments/``: the flags of ``raystudy study``.

    ``preset_prefix`` is prepended to a preset name (``plasticity_study.py`` uses ``plasticity-``, so its
    default presets are ``plasticity-demo`` and, with ``--address``, ``plasticity-paper``).
    """
    parser = Parser(prog=prog, description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging, Ray's own logs")
    add_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    try:
        return run(args, preset_prefix=preset_prefix)
    except (ValueError, FileNotFoundError, TypeError) as e:
        if args.verbose:
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        return interrupted(prog, e)
