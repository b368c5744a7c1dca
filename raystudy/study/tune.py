"""Ray Tune orchestration: a study spec -> its missing grid points -> one Ray Train run each -> tables.

:func:`run_study` is the whole study (what ``experiments/full_study.py`` and ``raystudy study`` call):

1. :func:`prepare_study`: the study directory (``spec.yaml`` written, or checked against the one already
   there: a study directory never silently changes meaning), the demo extras when the spec asks for them
   (the built-in data, a pretrained model: :mod:`raystudy.study.pretrain`), and every check (stores,
   weights, tracking packages) before anything is launched;
2. :func:`plan_study`: what is left, from the study directory alone (no Ray needed to say "nothing");
3. :func:`measure_plasticity`: the plasticity of every dataset not yet measured
   (:func:`raystudy.distributed.plasticity.run_plasticity`);
4. :func:`raystudy.study.probes.run_probes`: the linear probe (``LP`` rows of ``trials.parquet``) of every
   dataset not yet probed, when ``probe.enabled``; then :func:`build_study_caches`: the uint8 caches the
   trials read (``data_path: cache``), built or repaired once as a Ray Data job, verified when valid;
5. :func:`launch_trials`: the finetuning grid through Ray Tune, one trial (:func:`run_trial`) per grid point;
   with ``final_fit``, then :func:`launch_final_fit`: a dependent stage (:mod:`raystudy.study.final`), one
   trial per (dataset, configuration, optimizer, seed) on train + val at the lr chosen on validation, for
   every sweep whose search has ended (a resumed study runs only the final trials left).
   Under ``execution: train`` a trial is a light driver (``trial_driver_cpus``) that runs the Ray Train run
   of its grid point (:func:`raystudy.distributed.train.run_finetune`, ``RunConfig(name=trial_id,
   callbacks=[TuneReportCallback()])``) and waits for it; under ``execution: actor`` (the default for one
   worker per trial) the trial trains in its own Tune actor, which Tune reuses for the next trial
   (:func:`raystudy.distributed.inprocess.run_in_process`). Only grid points without a final row (``ok`` or
   ``diverged``) in ``trials.parquet`` are launched, so an interrupted study resumes where it stopped and a
   finished one launches nothing. The Ray Train run of a trial is named by its trial id, so a trial cut off
   by a killed driver restarts from its last checkpoint. A study with ``configurations: []`` has no trial:
   it measures plasticity only;
6. the analysis (:func:`raystudy.analysis.report`).

In the driver, :class:`raystudy.study.callback.StudyCallback` rewrites the tables as each trial ends and
prints one line per finished trial and a periodic summary (:mod:`raystudy.study.progress`). Ray starts
through :func:`raystudy.distributed.cluster.init_ray` (quiet unless ``verbose``).

The pieces it drives live beside it: the stored spec (:mod:`raystudy.study.persist`), one trial
(:mod:`raystudy.study.trial`), the plasticity stage (:mod:`raystudy.study.measure`), full disks and
unresumable run folders (:mod:`raystudy.study.health`), SIGTERM (:mod:`raystudy.study.signals`); import
their names from there. Ray itself is imported inside the functions that start it, so
that the commands can check a spec with this module without starting Ray.
"""

from __future__ import annotations

import os
import shlex
import time
from dataclasses import dataclass, field

from raystudy.analysis.options import study_analysis_dir
from raystudy.core.models import WeightsError, check_weights_format
from raystudy.data.cache import kinds_read
from raystudy.data.splits import SPLITS
from raystudy.data.store import read_meta
from raystudy.distributed.cache import build_caches
from raystudy.distributed.cluster import check_cluster_auth, init_ray, orphaned_placement_groups_removed
from raystudy.distributed.job_inputs import weights_problem
from raystudy.distributed.reaper import start_reaper
from raystudy.io import table_path
from raystudy.storage import delete_file, exists, folder_problem, is_uri, join, subdirs, write_json_atomic
from raystudy.study import final
from raystudy.study.checks import SpecError, pretraining_writes_weights, weights_not_found
from raystudy.study.health import (
    StudyStorageError,
    check_run_dirs,
    disk_full_message,
    storage_errors,
)
from raystudy.study.hparams import write_study_hparams
from raystudy.study.jobs import set_aside_unreadable_cache
from raystudy.study.lock import StudyLock
from raystudy.study.measure import measure_plasticity, plasticity_todo
from raystudy.study.persist import (
    ANALYSIS_STAMP,
    SPEC_FILE,
    analysis_current,
    analysis_inputs,
    check_stored,
    check_tracking,
    load_study_spec,
    resolve_paths,
    row_conflicts_message,
    write_spec,
)
from raystudy.study.preflight import configuration_problems
from raystudy.study.pretrain import prepare_builtin_data, pretrain_weights
from raystudy.study.pretrain_path import measure_path, path_done
from raystudy.study.probes import probe_todo, run_probes
from raystudy.study.progress import Echo, Progress, fmt_seconds
from raystudy.study.progress import echo as _echo
from raystudy.study.results import TABLE_PERIOD, ResultTables
from raystudy.study.signals import (
    Interrupted,
    Stage,
    analysis_interrupted,
    ctrl_c_named,
    sigint_noticed,
    sigterm_exits,
    tune_interrupt_lines,
)
from raystudy.study.spec import StudySpec
from raystudy.study.trial import trainable
from raystudy.vocab import FINAL_STATUSES, SCHEMAS

__all__ = ["StudyOutcome", "restore_command", "restore_tuner", "resume_command", "run_study", "tables_written",
           "tune_experiments"]


# ----------------------------------------------------------------------------------------------------
# Launching
# ----------------------------------------------------------------------------------------------------


def _next_launch_name(spec: StudySpec) -> str:
    return f"{spec.name}-{len(subdirs(join(spec.out, 'tune'))):03d}"


def _search_setup(spec: StudySpec, tables: ResultTables, points: list[dict] | None):
    """``(param_space, TuneConfig, number of trials)`` of a grid (``points``) or the Optuna budget."""
    from ray import tune

    from raystudy.study.schedule import FirstPending, GridPoints  # Ray Tune

    if points is not None:
        # one point per trial in the grid's order, the study's trial id beside it (Tune's trial_id is Tune's);
        # not Tune's grid_search, which deep-copies the list of every point for each variant (O(n) a trial)
        n = len(points)
        param_space = {}
        tune_config = tune.TuneConfig(search_alg=GridPoints(points), num_samples=n, reuse_actors=True)
    else:
        from raystudy.study.search import GroupedOptunaSearch, optuna_plan  # Optuna and Ray Tune

        budget, history = optuna_plan(spec, tables)
        n = sum(budget.values())
        param_space = {}
        tune_config = tune.TuneConfig(search_alg=GroupedOptunaSearch(spec, budget, history), num_samples=n,
                                      reuse_actors=True)
    tune_config.scheduler = FirstPending()  # FIFO, at a constant cost per trial
    tune_config.max_concurrent_trials = spec.max_concurrent_trials or None
    tune_config.trial_name_creator = _trial_name
    tune_config.trial_dirname_creator = _trial_name
    return param_space, tune_config, n


def _trial_name(trial) -> str:
    return trial.config["point"]["trial_id"]


def launch_trials(spec: StudySpec, tables: ResultTables, points: list[dict] | None, *, total: int,
                  done_before: int, echo: Echo = _echo, verbose: bool = False):
    """Run ``points`` (grid search) or the remaining Optuna budget (``points is None``) as one Tune
    experiment under ``<out>/tune/<name>-<n>``; returns the :class:`ray.tune.ResultGrid`."""
    from ray import tune

    from raystudy.study.callback import StudyCallback, tracking_callbacks  # Ray (a tune.Callback)

    progress = Progress(total=total, done_before=done_before, echo=echo, prefix=spec.name)
    param_space, tune_config, n = _search_setup(spec, tables, points)
    name = _next_launch_name(spec)
    study_callback = StudyCallback(spec, tables, progress)
    run_config = tune.RunConfig(
        name=name, storage_path=join(spec.out, "tune"), verbose=1 if verbose else 0,
        callbacks=[study_callback, *tracking_callbacks(spec)], stop=study_callback.stopper(),
        failure_config=tune.FailureConfig(max_failures=spec.trial_retries),
    )
    if not verbose:
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # Tune's legacy reporter at verbose=0 prints nothing
    echo(f"[{spec.name}] launching {n} trial(s) as Tune experiment {join(spec.out, 'tune', name)}")
    write_study_hparams(spec)  # TensorBoard's HParams experiment: every axis with its domain
    tuner = tune.Tuner(trainable(spec), param_space=param_space, tune_config=tune_config, run_config=run_config)
    try:
        # a Ray Train controller lost with its node leaves a placement group behind
        with orphaned_placement_groups_removed(), sigint_noticed() as interrupted, \
                tune_interrupt_lines(echo, spec.name):
            results = tuner.fit()
            stopped = interrupted()
    except Exception:
        if study_callback.disk_full:  # e.g. Tune reading back an error file the full disk left empty
            raise StudyStorageError(disk_full_message(spec.out, f" ({study_callback.disk_full})")) from None
        raise
    finally:
        study_callback.flush()  # the rows the timer deferred, however the launch ended
    if stopped:
        raise Interrupted(f"[{spec.name}] interrupted (Ctrl-C): the launch stopped with "
                          f"{done_line(spec, tables, total)}; nothing was analysed; {resume_line(spec.out)}")
    progress.show("launch finished")
    if study_callback.disk_full:
        raise StudyStorageError(disk_full_message(spec.out, f" ({study_callback.disk_full})"))
    return results


def launch_final_fit(spec: StudySpec, tables: ResultTables, *, total: int, echo: Echo = _echo,
                     verbose: bool = False) -> None:
    """The final fit's trials not yet done (:func:`raystudy.study.final.final_points`: the sweeps whose search
    has ended, at their val-chosen lr) as one more Tune launch; the sweeps that must wait are named."""
    tables.flush()  # the search's rows: what the lrs are chosen from
    points, waiting = final.final_points(spec, tables.trials_frame())
    for line in waiting:
        echo(f"[{spec.name}] final fit waits: {line}")
    tables.reconcile(points, spec.model, spec.model_kwargs)  # finished before a killed driver wrote its row
    done = tables.done_ids()
    todo = [p for p in points if p["trial_id"] not in done]
    if not todo:
        return
    echo(f"[{spec.name}] final fit: {len(todo)} trial(s) on train + val at the lr chosen on val")
    launch_trials(spec, tables, todo, total=total, done_before=total - len(todo), echo=echo, verbose=verbose)


def tune_experiments(study_dir: str) -> list[str]:
    """The Tune experiment directories of a study, one per launch, oldest first (absolute paths or URIs:
    ``tune.Tuner.restore`` needs one or the other)."""
    root = join(study_dir if is_uri(study_dir) else os.path.abspath(study_dir), "tune")
    return [join(root, name) for name in subdirs(root)]


def restore_tuner(experiment_path: str, spec: StudySpec | None = None):
    """``tune.Tuner.restore`` of one launch of a study (``.get_results()`` is its ``ResultGrid``).

    ``experiment_path`` may be relative. ``spec`` defaults to the study's ``spec.yaml`` (the directory above
    ``tune/``). Starts a quiet local Ray (:func:`~raystudy.distributed.cluster.init_ray`) when none runs.
    """
    from ray import tune

    init_ray()
    path = str(experiment_path)
    path = path if is_uri(path) else os.path.abspath(path)
    if spec is None:
        spec = load_study_spec(path.rstrip("/").rsplit("/", 2)[0])
    return tune.Tuner.restore(path, trainable=trainable(spec))


def build_study_caches(spec: StudySpec, points: list[dict] | None, echo: Echo = _echo) -> dict:
    """Every uint8 cache the trials of ``points`` (``None``: of every dataset) will read, built or repaired
    once as a Ray Data job before they launch (``data_path: cache``); a valid cache is only verified, and
    each trial's ``prepare_caches`` then only verifies. One line per cache built, nothing otherwise."""
    if spec.data_path != "cache":
        return {}
    names = list(spec.datasets) if points is None else sorted({p["dataset"] for p in points})
    reads = [(s, k) for s in SPLITS
             for k in kinds_read(s, spec.augment, spec.val_split, spec.resize, train_on_val=spec.final_fit)]
    return build_caches([spec.store_path(spec.datasets[d]) for d in names], [s for s, _ in reads],
                        [k for _, k in reads], spec.img_size, spec.cache_dir,
                        echo=lambda line: echo(f"[{spec.name}] {line}"))


# ----------------------------------------------------------------------------------------------------
# The whole study
# ----------------------------------------------------------------------------------------------------


@dataclass
class StudyOutcome:
    study_dir: str
    total: int
    launched: int
    counts: dict
    probes: dict = field(default_factory=dict)  # LP rows per status
    analysis_dir: str | None = None
    report: str | None = None
    wall_seconds: float = 0.0


@dataclass
class StudyPlan:
    """What a run of the study still has to do: datasets to measure, datasets to probe, grid points to launch
    (``None`` with Optuna: its budget), how many trials that is, out of ``total``."""

    plasticity: list[str]
    points: list[dict] | None
    to_launch: int
    total: int
    retry: list[str] = field(default_factory=list)
    probes: list[str] = field(default_factory=list)


def check_weights_format_of(spec: StudySpec) -> None:
    """A local weights file that is no weights file at all (text, empty) stops the study at once."""
    if spec.weights is not None and not is_uri(spec.weights):
        try:
            check_weights_format(spec.weights)
        except WeightsError as e:
            raise SpecError(f"weights: {e}") from None


def check_given_weights(spec: StudySpec) -> None:
    """The weights file of the resolved ``spec`` exists, unless its own pretraining writes it (:func:`~raystudy.
    study.checks.pretraining_writes_weights`), and is a weights file: checked before anything is built or
    written, so that a missing ``--weights`` stops a launch at once and leaves no folder behind."""
    if spec.weights is None or (pretraining_writes_weights(spec) and not exists(spec.weights)):
        return
    if not exists(spec.weights):
        raise SpecError(weights_not_found(spec))
    check_weights_format_of(spec)


def check_weights_load(spec: StudySpec) -> None:
    """Build the model with its weights once in the driver, as every trial will, so a checkpoint that does
    not fit the model (wrong architecture, missing keys) stops the study before any launch."""
    if spec.weights is None or is_uri(spec.weights):
        return
    error = weights_problem(spec, int(read_meta(next(iter(spec.datasets.values())))["num_classes"]), flag="weights")
    if error:
        raise SpecError(error)


def prepare_study(spec: StudySpec, echo: Echo = _echo, stage: Stage | None = None) -> StudySpec:
    """Validate, resolve and check ``spec``, build what the demo builds, and write ``spec.yaml`` (only a
    valid spec marks a directory as a study); returns the resolved spec. ``stage`` is kept up to date (what a
    Ctrl-C interrupts).

    What can be checked without the built-in data and the pretrained weights is checked first (the weights
    file given, the configurations on the meta-device model, the stores not built here); a launch that then
    builds (the built-in data, the pretraining: minutes) writes ``spec.yaml`` before it, so that a study stopped
    while building is a study (``raystudy status``, ``--resume``), and removes it again if a check after the
    build refuses the spec (a directory it created is then no study)."""
    stage = stage or Stage()
    spec.validate(check_files=False)
    check_tracking(spec)
    spec = resolve_paths(spec)
    check_stored(spec)
    if not spec.builtin_data:
        spec.check_files(weights=False)  # stores, before any work
    check_given_weights(spec)
    problems = configuration_problems(spec)  # a layer or block the model lacks: refused before any trial
    if problems:
        raise SpecError("\n".join(problems))
    if spec.analysis:  # its folder a link out of the study: refused now, not after the trials
        study_analysis_dir(spec.out)
    echo(f"[{spec.name}] study directory {spec.out}")
    builds = spec.builtin_data or (pretraining_writes_weights(spec) and not exists(spec.weights))
    written_here = builds and not exists(join(spec.out, SPEC_FILE))
    if builds:
        write_spec(spec)
    try:
        _build_and_check(spec, echo, stage)
    except SpecError:
        if written_here:
            delete_file(join(spec.out, SPEC_FILE))
        raise
    write_spec(spec)
    return spec


def _build_and_check(spec: StudySpec, echo: Echo, stage: Stage) -> None:
    """The built-in data and the pretrained weights the resolved ``spec`` asks for, then the checks that need
    them (stores, weights loaded into the model)."""
    if spec.builtin_data:
        stage.now = "the preparation of the built-in data"
        prepare_builtin_data(spec, echo)
    stage.now = "the start-up checks"
    spec.check_files(weights=False)
    if spec.pretrain.enabled and exists(spec.weights):
        echo(f"[{spec.name}] pretrained weights found: {spec.weights}")
    elif pretraining_writes_weights(spec):
        stage.now = "the pretraining"
        pretrain_weights(spec, spec.weights, echo=echo)
        stage.now = "the start-up checks"
    spec.check_files(weights=True)
    for problem in final.store_problems(spec):
        raise SpecError(problem)
    check_weights_load(spec)
    if spec.pretrain.enabled and spec.pretrain.path_steps and spec.plasticity.enabled and not path_done(spec):
        stage.now = "the plasticity along the pretraining"
        measure_path(spec, echo)
        stage.now = "the start-up checks"


def plan_study(spec: StudySpec, tables: ResultTables, echo: Echo = _echo) -> StudyPlan:
    """What is left to do, decided from the study directory alone; finished trials the tables missed (a
    killed driver) are picked up from their directories first, and unreadable files of the criteria cache are
    moved aside, each named once here (:func:`raystudy.study.jobs.set_aside_unreadable_cache`), for the
    trials to compute them again."""
    set_aside_unreadable_cache(spec.out)
    if tables.repaired:
        rebuilt = tables.rebuild(list(spec.datasets), spec.model, spec.model_kwargs)
        for path, moved in tables.repaired:
            echo(f"[{spec.name}] {path} was unreadable (moved aside to {moved}); rebuilt the tables from the "
                 f"summaries of {len(rebuilt)} trial(s) in {join(spec.out, 'trials')}")
    changed = spec.row_conflicts(tables.rows)
    if changed:
        raise SpecError(row_conflicts_message(spec, changed))
    todo = plasticity_todo(spec)
    if spec.plasticity.enabled and not todo:
        echo(f"[{spec.name}] plasticity: all {len(spec.datasets)} dataset(s) already measured")
    total = spec.total_trials()
    if spec.search == "grid":
        grid = spec.grid()
        picked = tables.reconcile(grid, spec.model, spec.model_kwargs)
        if picked:
            echo(f"[{spec.name}] recovered {len(picked)} finished trial(s) from their directories")
        done = tables.done_ids()
        points = [p for p in grid if p["trial_id"] not in done]
        finals_done = sum(1 for r in tables.rows.values()
                          if r.get("phase") == final.FINAL and r.get("status") in FINAL_STATUSES)
        finals_left = sum(final.final_cells(spec).values()) - finals_done
        plan = StudyPlan(todo, points, len(points) + finals_left, total,
                         retry=[p["trial_id"] for p in points if tables.status(p["trial_id"]) == "failed"])
    else:
        from raystudy.study.search import optuna_plan  # Optuna and Ray Tune

        plan = StudyPlan(todo, None, sum(optuna_plan(spec, tables)[0].values()), total)
    plan.probes = probe_todo(spec, tables)
    if plan.probes:
        echo(f"[{spec.name}] probes: {len(plan.probes)} of {len(spec.probe_datasets())} dataset(s) to fit")
    if plan.retry:
        more = " ..." if len(plan.retry) > 5 else ""
        echo(f"[{spec.name}] retrying {len(plan.retry)} failed trial(s): {plan.retry[:5]}{more}")
    if total == 0:
        echo(f"[{spec.name}] no finetuning trials (configurations: []): plasticity only")
    elif plan.to_launch == 0:
        echo(f"[{spec.name}] all {total} trial(s) already done: nothing to run")
    return plan


def execute(spec: StudySpec, tables: ResultTables, plan: StudyPlan, *, address: str | None, verbose: bool,
            echo: Echo = _echo, stage: Stage | None = None) -> None:
    """Run the plan on Ray (started here, and shut down after, unless it was running already). A local Ray
    started here is watched by a reaper process that ends it if the driver is killed (SIGKILL). ``stage`` is
    kept up to date (what a Ctrl-C interrupts)."""
    stage = stage or Stage()
    local = not (address or os.environ.get("RAY_ADDRESS")) or address == "local"
    stage.now = "the start of Ray"
    started = init_ray(address, verbose=verbose)
    if started and local:
        start_reaper()
    try:
        with sigterm_exits(echo, spec.name):  # again: ray.init installed its own SIGTERM handler
            if plan.plasticity:
                stage.now = "the plasticity measurement"
                measure_plasticity(spec, echo)
            if plan.probes:  # before the grid: the relative gain's reference exists even if the grid is cut off
                stage.now = "the linear probes"
                run_probes(spec, tables, echo, address=address)
            if plan.to_launch:
                stage.now = "the preparation of the trials"
                check_run_dirs(spec, tables.done_ids(), echo)
                # decoded once here, not in every trial's driver (a final fit's: every dataset's)
                build_study_caches(spec, None if spec.final_fit else plan.points, echo)
                stage.now = "the trials"
                if plan.points is None or plan.points:  # a grid whose search is done launches its final fit only
                    launch_trials(spec, tables, plan.points, total=plan.total,
                                  done_before=plan.total - plan.to_launch, echo=echo, verbose=verbose)
                if spec.final_fit:
                    launch_final_fit(spec, tables, total=plan.total, echo=echo, verbose=verbose)
    finally:
        if started:
            import ray

            ray.shutdown()


def run_study(spec: StudySpec, *, address: str | None = None, verbose: bool = False,
              echo: Echo = _echo) -> StudyOutcome:
    """Run (or continue) the study ``spec`` end to end; see the module docstring. The study directory is
    locked for the run (:class:`~raystudy.study.lock.StudyLock`); a full disk ends it with one
    :class:`StudyStorageError` line; SIGTERM stops it cleanly (Ray shut down, lock released)."""
    t_start = time.monotonic()
    spec.validate(check_files=False)
    check_cluster_auth(address)  # a cluster that would refuse this driver: one line before anything is written
    out = spec.out if is_uri(spec.out) else os.path.abspath(spec.out)
    for name, folder in (("out", out), ("cache_dir", spec.cache_dir)):
        why = folder_problem(folder)  # a file on the way, a read-only mount: one line, before the lock file
        if why:
            raise SpecError(f"{name}: {why}")
    stage = Stage()
    with StudyLock(out, echo=echo), sigterm_exits(echo, spec.name), storage_errors(out), \
            ctrl_c_named(spec.name, stage, lambda: resume_line(out)):
        spec = prepare_study(spec, echo, stage)
        tables = ResultTables(spec.out, repair=True, period=TABLE_PERIOD)
        plan = plan_study(spec, tables, echo)
        try:
            if plan.plasticity or plan.probes or plan.to_launch:
                execute(spec, tables, plan, address=address, verbose=verbose, echo=echo, stage=stage)
        finally:
            tables.flush()  # every row on disk before the analysis reads it, also when the study is stopped
        outcome = StudyOutcome(study_dir=spec.out, total=plan.total, launched=plan.to_launch,
                               counts=tables.counts(), probes=tables.counts(probes=True))
        if spec.analysis:
            stage.now = "the analysis"
            # ours again (ray.init installed its own), saying how to redo the analysis alone
            with sigterm_exits(echo, line=f"[{spec.name}] {analysis_interrupted([spec.out])}"):
                outcome.report = analyse(spec, echo)
            outcome.analysis_dir = join(spec.out, "analysis")
    outcome.wall_seconds = time.monotonic() - t_start
    print_summary(spec, outcome, echo)
    return outcome


def analyse(spec: StudySpec, echo: Echo = _echo) -> str:
    """The study's report (:func:`raystudy.analysis.html_report.report` with the spec's analysis options), drawn
    unless the one in ``analysis/`` was drawn from the tables as they are now, with the same options (its
    stamp: :func:`~raystudy.study.results.analysis_inputs`); returns the report's path."""
    options = {"seeds": spec.analysis_seeds, "fixed_run": spec.fixed_run, "round_to": spec.analysis_round,
               "select_by": spec.analysis_select_by}
    inputs = analysis_inputs(spec.out, options)
    if analysis_current(spec.out, inputs):
        echo(f"[{spec.name}] analysis up to date with the tables: nothing redrawn (raystudy report {spec.out} "
             "draws it again)")
        return join(spec.out, "analysis", "report.html")
    from raystudy.analysis.html_report import report  # scipy: only for a spec that asks

    t0 = time.monotonic()
    path = str(report(spec.out, **options))
    write_json_atomic(join(spec.out, ANALYSIS_STAMP), analysis_inputs(spec.out, options))
    echo(f"[{spec.name}] analysis written in {fmt_seconds(time.monotonic() - t0)}")
    return path


def print_summary(spec: StudySpec, o: StudyOutcome, echo: Echo = _echo) -> None:
    c = o.counts
    echo("")
    echo(f"Study {spec.name!r}: {c['ok'] + c['diverged']}/{o.total} trials done (ok {c['ok']}, diverged "
         f"{c['diverged']}, failed {c['failed']}); {o.launched} launched this time, {fmt_seconds(o.wall_seconds)}")
    if spec.probe.enabled:
        echo(f"  probes:      {o.probes['ok']}/{len(spec.probe_datasets())} fitted (failed {o.probes['failed']}) "
             f"-> {join(o.study_dir, 'probes')}/<dataset>/probe.json")
    echo(f"  results:     {o.study_dir}/  ({', '.join(tables_written(o.study_dir)) or 'no table yet'})")
    echo(f"  notebook:    raystudy.load_study({o.study_dir!r})")
    echo(f"  TensorBoard: tensorboard --logdir {join(o.study_dir, 'tb')}")
    echo(f"  Tune:        {restore_command(o.study_dir)}")
    echo(f"  resume:      {resume_command(o.study_dir)}")
    if o.analysis_dir:
        echo(f"  analysis:    {o.analysis_dir}/")
        echo(f"  report:      {o.report}")


def done_line(spec: StudySpec, tables: ResultTables, total: int) -> str:
    """``3/48 trials done`` (the finetuning trials' final rows, never the linear probes'), then, with probes,
    ``, 1/2 probes fitted``."""
    c = tables.counts()
    line = f"{c['ok'] + c['diverged']}/{total} trials done"
    if spec.probe.enabled:
        line += f", {tables.counts(probes=True)['ok']}/{len(spec.probe_datasets())} probes fitted"
    return line


def tables_written(study_dir: str) -> list[str]:
    """The result tables present in ``study_dir``, in :data:`raystudy.vocab.SCHEMAS` order
    (``trials.parquet``, ``curves.parquet``, ``changes.parquet``, ``plasticity.parquet``, ``rates.parquet``,
    ...): a file, or a dataset folder of parts."""
    return [f"{t}.parquet" for t in SCHEMAS if exists(table_path(study_dir, t))]


def _shell_word(word: str) -> str:
    """``word`` in double quotes when nothing in it is special there, else :func:`shlex.quote`'s quoting."""
    return f'"{word}"' if not set(word) & set('"$`\\!') else shlex.quote(word)


def restore_command(study_dir: str) -> str:
    """A shell command that restores the study's newest Tune launch (:func:`restore_tuner`, which brings the
    trainable ``tune.Tuner.restore`` needs) and prints its results as a table."""
    code = (f"from raystudy.study.tune import restore_tuner, tune_experiments; "
            f"grid = restore_tuner(tune_experiments({study_dir!r})[-1]).get_results(); print(grid.get_dataframe())")
    return f"python -c {_shell_word(code)}"


def resume_line(study_dir: str) -> str:
    """How to continue a stopped study, in words: the same command, or ``raystudy study --resume DIR`` once the
    study directory holds its ``spec.yaml`` (not Tune's ``Tuner.restore``, which does not resume a study)."""
    also = f" (or {resume_command(study_dir)})" if exists(join(study_dir, SPEC_FILE)) else ""
    return f"run the same command again{also} to resume"


def resume_command(study_dir: str) -> str:
    """The command that continues the study stored in ``study_dir`` (``raystudy study --resume``)."""
    return f"raystudy study --resume {shlex.quote(study_dir)}"
