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
5. :func:`launch_trials`: the finetuning grid through Ray Tune, one trial (:func:`run_trial`) per grid point.
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
"""

from __future__ import annotations

import errno
import importlib.util
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from raystudy.io import read_result, write_result
from raystudy.storage import exists, is_uri, join, read_text, subdirs, upload_dir, write_text_atomic
from raystudy.study.lock import StudyLock
from raystudy.study.probes import probe_todo, run_probes
from raystudy.study.progress import Progress, fmt_seconds
from raystudy.study.progress import echo as _echo
from raystudy.study.results import ResultTables, quarantine, trial_dir
from raystudy.study.spec import SpecError, StudySpec, load_spec_file

__all__ = ["Progress", "StudyOutcome", "StudyStorageError", "load_study_spec", "restore_tuner", "run_study",
           "tune_experiments"]

log = logging.getLogger(__name__)

SPEC_FILE = "spec.yaml"
#: the package each ``tracking`` entry needs (Ray Tune's integration imports it)
TRACKING_PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}

Echo = Callable[[str], object]


# ----------------------------------------------------------------------------------------------------
# The study directory and its spec
# ----------------------------------------------------------------------------------------------------


def resolve_paths(spec: StudySpec) -> StudySpec:
    """Absolute local paths for everything trials read or write (trial processes run in other cwds)."""
    out = spec.out if is_uri(spec.out) else os.path.abspath(spec.out)
    data_root = spec.resolved_data_root()
    data_root = data_root if is_uri(data_root) else os.path.abspath(data_root)
    weights = spec.weights
    if weights is not None and not is_uri(weights):
        weights = os.path.abspath(weights)
    if weights is None and spec.pretrain.enabled:
        weights = join(out, "pretrained", "model.safetensors")  # what the pretraining step writes
    cache_dir = spec.cache_dir
    if cache_dir is not None and not is_uri(cache_dir):
        cache_dir = os.path.abspath(cache_dir)
    resolved = spec.with_overrides({"out": out, "data_root": data_root, "weights": weights, "cache_dir": cache_dir})
    resolved.datasets = resolved.dataset_stores()
    if resolved.pretrain_store is not None:
        resolved.pretrain_store = resolved.pretrain_store_path()
    return resolved


def stored_spec(study_dir: str) -> StudySpec | None:
    """The spec a study directory was created with, or ``None`` for a new directory."""
    import yaml

    path = join(study_dir, SPEC_FILE)
    text = read_text(path)
    return None if text is None else StudySpec.from_dict(yaml.safe_load(text) or {}, where=path)


def load_study_spec(study_dir: str) -> StudySpec:
    """The spec stored in a study directory (for ``--resume DIR``)."""
    path = join(study_dir, SPEC_FILE)
    if not exists(path):
        raise SpecError(f"--resume: {study_dir} holds no study ({SPEC_FILE} not found)")
    return stored_spec(study_dir) if is_uri(path) else load_spec_file(path)


def check_stored(spec: StudySpec) -> None:
    """Refuse ``spec`` if its directory already holds a study whose trials mean something else.

    Growing the grid (datasets, configurations, lrs, seeds) is allowed; changing what a trial means
    (model, weights, steps, ...) is an error naming the fields.
    """
    stored = stored_spec(spec.out)
    if stored is not None:
        conflicts = spec.conflicts(stored)
        if conflicts:
            raise SpecError(
                f"out: {spec.out} already holds a study created with another spec ({'; '.join(conflicts)}); "
                "choose another --out, or continue that study with --resume"
            )


def write_spec(spec: StudySpec) -> None:
    write_text_atomic(join(spec.out, SPEC_FILE), spec.to_yaml())


def check_tracking(spec: StudySpec) -> None:
    """Every experiment tracker of ``spec.tracking`` has its package installed (else a :class:`SpecError`
    naming it), checked before anything runs."""
    for name in spec.tracking:
        package = TRACKING_PACKAGES[name]
        if package not in sys.modules and importlib.util.find_spec(package) is None:
            raise SpecError(f"tracking: {name} needs the package {package!r}, which is not installed "
                            f"(pip install {package}), or remove {name!r} from tracking")


# ----------------------------------------------------------------------------------------------------
# One trial (runs in a Tune trial process, anywhere in the cluster)
# ----------------------------------------------------------------------------------------------------


@contextmanager
def local_dir_for(target: str) -> Iterator[str]:
    """A local directory standing for ``target``: ``target`` itself when local, else a temporary directory of
    the same name, uploaded to the URI when the block ends (also when it raises: a failed run's summary is
    kept). The name is kept because a run is known by its folder's name (e.g. by :mod:`raystudy.faults`)."""
    if not is_uri(target):
        os.makedirs(target, exist_ok=True)
        yield target
        return
    tmp = tempfile.mkdtemp(prefix="raystudy-")
    local = os.path.join(tmp, target.rstrip("/").rsplit("/", 1)[-1])
    os.makedirs(local)
    try:
        yield local
    finally:
        try:
            upload_dir(local, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _link_tensorboard(study_dir: str, tid: str, run_dir: str) -> None:
    """``<study>/tb/<trial_id>`` -> the trial's ``tb/`` (a relative symlink: live in TensorBoard)."""
    tb_root = os.path.join(study_dir, "tb")
    os.makedirs(tb_root, exist_ok=True)
    link = os.path.join(tb_root, tid)
    if not os.path.lexists(link):
        try:
            os.symlink(os.path.relpath(os.path.join(run_dir, "tb"), tb_root), link, target_is_directory=True)
        except OSError:  # file systems without symlinks: copied after the run instead
            pass


def _copy_tensorboard(study_dir: str, tid: str, run_dir: str) -> None:
    """``<study>/tb/<trial_id>``: a copy of the run's ``tb/`` where no link could be made (URIs)."""
    target = join(study_dir, "tb", tid)
    src = os.path.join(run_dir, "tb")
    if (is_uri(study_dir) or not os.path.lexists(target)) and os.path.isdir(src):
        upload_dir(src, target)


class TrialFailed(RuntimeError):
    """A trial's Ray Train run ended with status ``failed`` (its workers failed beyond ``worker_retries``)."""


def _finetune_point(spec: StudySpec, point: dict, run_dir: str) -> dict:
    """The run of one grid point into ``run_dir``, where ``spec.trial_execution`` says; its summary (raises
    :class:`TrialFailed` for a Ray Train run that failed)."""
    from raystudy.study.jobs import finetune_job

    tid = point["trial_id"]
    cfg, resources = finetune_job(spec, point, run_dir)
    if spec.trial_execution == "actor":
        from ray import tune

        from raystudy.distributed.inprocess import run_in_process

        # a failure raises: Tune's FailureConfig re-runs the trial, which resumes from its checkpoints
        return run_in_process(cfg, resources, storage=join(spec.out, "train", tid), on_report=tune.report)
    return _train_point(spec, tid, cfg, resources)


def _train_point(spec: StudySpec, tid: str, cfg, resources) -> dict:
    """The Ray Train run of one grid point (``RunConfig(name=trial_id)``: a re-run resumes its checkpoints)."""
    import ray.train
    from ray.tune.integration.ray_train import TuneReportCallback

    from raystudy.distributed.train import run_finetune

    run_config = ray.train.RunConfig(
        name=tid, storage_path=join(spec.out, "train"),
        failure_config=ray.train.FailureConfig(max_failures=spec.worker_retries),
    )
    summary = run_finetune(cfg, resources, run_config=run_config, callbacks=[TuneReportCallback()])
    if summary.get("status") == "failed":
        # Raising hands the trial to Tune's FailureConfig: a retry resumes from the run's checkpoints.
        raise TrialFailed(f"{tid}: {summary.get('error', 'Ray Train run failed')}")
    return summary


def final_report(summary: dict, point: dict) -> dict:
    """What a trial reports to Tune at its end: the summary's scalars, the study's ids, the objective."""
    final = {k: v for k, v in summary.items() if isinstance(v, int | float | str | bool)}
    # ("trial_id" is Tune's own key in every result: the study's id goes under another name)
    final.update({"study_trial_id": point["trial_id"], "dataset": point["dataset"],
                  "configuration": point["configuration"]})
    # the searcher's objective: a diverged run counts as chance-level, never NaN
    acc = summary.get("best_val_acc")
    ok = summary.get("status") == "ok" and isinstance(acc, int | float) and acc == acc
    final["objective"] = float(acc) if ok else 0.0
    return final


def run_trial(config: dict, spec_dict: dict) -> None:
    """The Tune trainable: one grid point (``config["point"]``) = one Ray Train run; reports its summary."""
    from ray import tune

    spec = StudySpec.from_dict(spec_dict)
    point = config["point"]
    tid = point["trial_id"]
    with local_dir_for(trial_dir(spec.out, tid)) as run_dir:
        if not is_uri(spec.out):
            _link_tensorboard(spec.out, tid, run_dir)
        summary = _finetune_point(spec, point, run_dir)
        _copy_tensorboard(spec.out, tid, run_dir)
    tune.report(final_report(summary, point))


def _trainable(spec: StudySpec):
    """The Tune trainable of the spec's trials with its resources: a light driver (``trial_driver_cpus``)
    waiting on a Ray Train run, or under ``execution: actor`` the worker's own CPUs and GPUs."""
    from ray import tune

    if spec.trial_execution == "actor":
        resources = {"cpu": spec.cpus_per_worker or spec.trial_driver_cpus, "gpu": spec.gpus_per_worker}
    else:
        resources = {"cpu": spec.trial_driver_cpus}
    return tune.with_resources(tune.with_parameters(run_trial, spec_dict=spec.to_dict()), resources)


# ----------------------------------------------------------------------------------------------------
# Launching
# ----------------------------------------------------------------------------------------------------


def _next_launch_name(spec: StudySpec) -> str:
    return f"{spec.name}-{len(subdirs(join(spec.out, 'tune'))):03d}"


def _search_setup(spec: StudySpec, tables: ResultTables, points: list[dict] | None):
    """``(param_space, TuneConfig, number of trials)`` of a grid (``points``) or the Optuna budget."""
    from ray import tune

    if points is not None:
        param_space = {"point": tune.grid_search(points)}
        tune_config = tune.TuneConfig(num_samples=1, reuse_actors=True)
        n = len(points)
    else:
        from raystudy.study.search import GroupedOptunaSearch, optuna_plan

        budget, history = optuna_plan(spec, tables)
        n = sum(budget.values())
        param_space = {}
        tune_config = tune.TuneConfig(search_alg=GroupedOptunaSearch(spec, budget, history), num_samples=n,
                                      reuse_actors=True)
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

    from raystudy.distributed.cluster import orphaned_placement_groups_removed
    from raystudy.study.callback import StudyCallback, tracking_callbacks

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
    tuner = tune.Tuner(_trainable(spec), param_space=param_space, tune_config=tune_config, run_config=run_config)
    try:
        with orphaned_placement_groups_removed():  # a Ray Train controller lost with its node leaves one
            results = tuner.fit()
    except Exception:
        if study_callback.disk_full:  # e.g. Tune reading back an error file the full disk left empty
            raise StudyStorageError(disk_full_message(spec.out, f" ({study_callback.disk_full})")) from None
        raise
    progress.show("launch finished")
    if study_callback.disk_full:
        raise StudyStorageError(disk_full_message(spec.out, f" ({study_callback.disk_full})"))
    return results


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

    from raystudy.distributed.cluster import init_ray

    init_ray()
    path = str(experiment_path)
    path = path if is_uri(path) else os.path.abspath(path)
    if spec is None:
        spec = load_study_spec(path.rstrip("/").rsplit("/", 2)[0])
    return tune.Tuner.restore(path, trainable=_trainable(spec))


# ----------------------------------------------------------------------------------------------------
# Plasticity and bounds
# ----------------------------------------------------------------------------------------------------


def plasticity_todo(spec: StudySpec) -> list[str]:
    """The spec's datasets without rows in ``plasticity.parquet`` (all of them when plasticity is off: [])."""
    if not spec.plasticity.enabled:
        return []
    have = read_result(spec.out, "plasticity", required=False)
    measured = set() if have is None else set(have["dataset"])
    return [d for d in spec.datasets if d not in measured]


def _merge_plasticity(spec: StudySpec, run_dir: str, todo: list[str], rename: dict[str, str]) -> None:
    """Fold one plasticity run's tables into the study's: rows of ``todo`` replaced, dataset names mapped
    from the stores' names to the spec's; the bounds (model and pretraining images only) replaced."""
    import pandas as pd

    for table in ("plasticity", "rates"):
        new = read_result(run_dir, table, required=False)
        if new is None:
            continue
        new["dataset"] = new["dataset"].map(lambda n: rename.get(n, n))
        old = read_result(spec.out, table, required=False)
        if old is not None:
            new = pd.concat([old[~old["dataset"].isin(todo)], new], ignore_index=True)
        write_result(new, spec.out, table)
    bounds = read_result(run_dir, "bounds", required=False)
    if bounds is not None:
        write_result(bounds, spec.out, "bounds")


def measure_plasticity(spec: StudySpec, echo: Echo = _echo) -> list[str]:
    """Plasticity (and bounds) of every dataset not yet in ``plasticity.parquet``; returns the datasets run.

    The job's tables name datasets by their store's ``dataset.json`` name; they are renamed to the
    spec's dataset names so they join with ``trials.parquet``.
    """
    from raystudy.data.store import read_meta
    from raystudy.distributed.plasticity import run_plasticity
    from raystudy.study.jobs import plasticity_job

    todo = plasticity_todo(spec)
    if not todo:
        echo(f"[{spec.name}] plasticity: all {len(spec.datasets)} dataset(s) already measured")
        return []
    rename = {read_meta(spec.datasets[d])["name"]: d for d in todo}
    target = join(spec.out, "plasticity", f"run-{len(subdirs(join(spec.out, 'plasticity'))):03d}")
    echo(f"[{spec.name}] plasticity of {todo}: {spec.plasticity.pairs} pairs each, "
         f"{spec.plasticity.workers} worker(s) -> {target}")
    t0 = time.monotonic()
    with local_dir_for(target) as run_dir:
        run_plasticity(plasticity_job(spec, todo, None, run_dir))
        _merge_plasticity(spec, run_dir, todo, rename)
    echo(f"[{spec.name}] plasticity done in {fmt_seconds(time.monotonic() - t0)}")
    return todo


def build_study_caches(spec: StudySpec, points: list[dict] | None, echo: Echo = _echo) -> dict:
    """Every uint8 cache the trials of ``points`` (``None``: of every dataset) will read, built or repaired
    once as a Ray Data job before they launch (``data_path: cache``); a valid cache is only verified, and
    each trial's ``prepare_caches`` then only verifies. One line per cache built, nothing otherwise."""
    if spec.data_path != "cache":
        return {}
    from raystudy.data.cache import kind_of
    from raystudy.data.store import SPLITS
    from raystudy.distributed.cache import build_caches

    names = list(spec.datasets) if points is None else sorted({p["dataset"] for p in points})
    return build_caches([spec.store_path(spec.datasets[d]) for d in names], SPLITS,
                        [kind_of(s, spec.augment) for s in SPLITS], spec.img_size, spec.cache_dir,
                        echo=lambda line: echo(f"[{spec.name}] {line}"))


# ----------------------------------------------------------------------------------------------------
# Guarding the study directory: full disks, corrupt Ray Train folders, SIGTERM
# ----------------------------------------------------------------------------------------------------

#: Ray Train's record of a run's checkpoints, in ``<out>/train/<trial_id>/`` (Ray writes it in place)
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"


class StudyStorageError(ValueError):
    """The study directory cannot be written (a full disk); one line naming it. A ``ValueError``, so every
    command reports it without a traceback."""


def disk_full(exc: BaseException | str | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from, or an error text) is a full disk (ENOSPC)."""
    seen = 0
    while isinstance(exc, BaseException) and seen < 20:
        if getattr(exc, "errno", None) == errno.ENOSPC or disk_full(str(exc)):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return isinstance(exc, str) and ("No space left on device" in exc or "[Errno 28]" in exc)


def disk_full_message(study_dir: str, detail: str = "") -> str:
    return (f"study directory {study_dir}: no space left on device (ENOSPC){detail}; make room and run the "
            "same command again: finished trials are kept, unfinished ones resume from their checkpoints")


@contextmanager
def storage_errors(study_dir: str) -> Iterator[None]:
    """Turn a full disk anywhere in the block into one :class:`StudyStorageError` naming ``study_dir``."""
    try:
        yield
    except StudyStorageError:
        raise
    except Exception as e:
        if disk_full(e):
            raise StudyStorageError(disk_full_message(study_dir)) from None
        raise


class Terminated(SystemExit):
    """Raised in the driver's main thread by SIGTERM, so that ``finally`` blocks run: Ray is shut down and
    the study lock released."""


@contextmanager
def sigterm_exits(echo: Echo = _echo, prefix: str = "study") -> Iterator[None]:
    """While the block runs, SIGTERM raises :class:`Terminated` (exit status 143) in the main thread.

    Ray's own handler (installed by ``ray.init``) kills the local Ray processes from inside the signal
    handler and exits; the driver then aborts half-way, without releasing what it holds.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
        echo(f"[{prefix}] SIGTERM: stopping (run the same command again to resume)")
        raise Terminated(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_dir_problem(run_dir: str) -> str | None:
    """Why Ray Train could not resume from ``run_dir`` (``<out>/train/<trial_id>``), or ``None``.

    Checks Ray's checkpoint snapshot (readable JSON listing checkpoint folders; a full disk leaves it
    empty, and Ray then fails every attempt with ``CheckpointManagerInitializationError``) and, on local
    paths, every checkpoint it lists (:func:`raystudy.core.finetune.state.checkpoint_problem`).
    """
    from raystudy.core.finetune.state import checkpoint_problem

    snapshot = join(run_dir, RAY_SNAPSHOT)
    text = read_text(snapshot)
    if text is None:
        return None
    try:
        state = json.loads(text)
        names = [r["checkpoint_dir_name"] for r in state["checkpoint_results"]]
    except (ValueError, KeyError, TypeError):
        return f"{snapshot} is unreadable ({len(text)} bytes: empty or truncated)"
    for name in names:
        folder = join(run_dir, name)
        if not exists(folder):
            return f"{snapshot} lists the checkpoint {folder}, which is missing"
        problem = None if is_uri(folder) else checkpoint_problem(folder)
        if problem:
            return problem
    return None


def check_run_dirs(spec: StudySpec, done: set[str], echo: Echo = _echo) -> list[str]:
    """Before a launch: move aside (``<run dir>.corrupt-<n>``) every Ray Train folder of an unfinished trial
    that Ray could not resume from, so that the trial starts afresh instead of failing at every attempt;
    returns the folders moved. Temporary files left by a killed writer in the study are removed."""
    moved = []
    for name in subdirs(join(spec.out, "train")):
        if name in done or ".corrupt-" in name:
            continue
        run_dir = join(spec.out, "train", name)
        problem = run_dir_problem(run_dir)
        if problem:
            target = quarantine(run_dir)
            echo(f"[{spec.name}] {name}: its checkpoints cannot be resumed from ({problem}); moved aside to "
                 f"{target}, the trial starts from step 0")
            moved.append(target)
    if not is_uri(spec.out):
        _remove_temporaries(spec.out, done)
    return moved


def _remove_temporaries(study_dir: str, done: set[str]) -> None:
    """Delete ``.<name>.<hex>.tmp`` files of :func:`raystudy.storage.atomic_output` left by a killed writer
    (in the study folder and the folders of unfinished trials; the lock keeps other writers out)."""
    folders = [study_dir] + [os.path.join(study_dir, "trials", t) for t in subdirs(join(study_dir, "trials"))
                             if t not in done]
    for folder in folders:
        for entry in os.scandir(folder):
            if entry.is_file() and entry.name.startswith(".") and entry.name.endswith(".tmp"):
                os.remove(entry.path)


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


def check_weights_load(spec: StudySpec) -> None:
    """Build the model with its weights once in the driver, as every trial will, so a checkpoint that does
    not fit the model (wrong architecture, missing keys) stops the study before any launch."""
    from raystudy.core.models import build_model
    from raystudy.data.store import read_meta

    if spec.weights is None or is_uri(spec.weights):
        return
    num_classes = int(read_meta(next(iter(spec.datasets.values())))["num_classes"])
    kwargs = dict(spec.model_kwargs)
    kwargs.pop("img_size", None)
    try:
        build_model(spec.model, num_classes=num_classes, weights=spec.weights, img_size=spec.img_size, **kwargs)
    except (ValueError, TypeError, RuntimeError) as e:
        raise SpecError(f"weights: {spec.weights} cannot be loaded into {spec.model}: {e}") from None


def prepare_study(spec: StudySpec, echo: Echo = _echo) -> StudySpec:
    """Validate, resolve and check ``spec``, build what the demo builds, and write ``spec.yaml`` (only a
    valid spec marks a directory as a study); returns the resolved spec."""
    spec.validate(check_files=False)
    check_tracking(spec)
    spec = resolve_paths(spec)
    check_stored(spec)
    echo(f"[{spec.name}] study directory {spec.out}")
    if spec.builtin_data:
        from raystudy.study.pretrain import prepare_builtin_data

        prepare_builtin_data(spec, echo)
    spec.check_files(weights=False)  # stores, before any work
    if spec.pretrain.enabled:
        from raystudy.study.pretrain import pretrain_weights

        if exists(spec.weights):
            echo(f"[{spec.name}] pretrained weights found: {spec.weights}")
        else:
            pretrain_weights(spec, spec.weights, echo=echo)
    spec.check_files(weights=True)
    check_weights_load(spec)
    write_spec(spec)
    return spec


def plan_study(spec: StudySpec, tables: ResultTables, echo: Echo = _echo) -> StudyPlan:
    """What is left to do, decided from the study directory alone; finished trials the tables missed (a
    killed driver) are picked up from their directories first."""
    if tables.repaired:
        rebuilt = tables.rebuild(list(spec.datasets), spec.model, spec.model_kwargs)
        for path, moved in tables.repaired:
            echo(f"[{spec.name}] {path} was unreadable (moved aside to {moved}); rebuilt the tables from the "
                 f"summaries of {len(rebuilt)} trial(s) in {join(spec.out, 'trials')}")
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
        plan = StudyPlan(todo, points, len(points), total,
                         retry=[p["trial_id"] for p in points if tables.status(p["trial_id"]) == "failed"])
    else:
        from raystudy.study.search import optuna_plan

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
            echo: Echo = _echo) -> None:
    """Run the plan on Ray (started here, and shut down after, unless it was running already). A local Ray
    started here is watched by a reaper process that ends it if the driver is killed (SIGKILL)."""
    from raystudy.distributed.cluster import init_ray
    from raystudy.distributed.reaper import start_reaper

    local = not (address or os.environ.get("RAY_ADDRESS")) or address == "local"
    started = init_ray(address, verbose=verbose)
    if started and local:
        start_reaper()
    try:
        with sigterm_exits(echo, spec.name):  # again: ray.init installed its own SIGTERM handler
            if plan.plasticity:
                measure_plasticity(spec, echo)
            if plan.probes:  # before the grid: the relative gain's reference exists even if the grid is cut off
                run_probes(spec, tables, echo, address=address)
            if plan.to_launch:
                check_run_dirs(spec, tables.done_ids(), echo)
                build_study_caches(spec, plan.points, echo)  # decoded once here, not in every trial's driver
                launch_trials(spec, tables, plan.points, total=plan.total,
                              done_before=plan.total - plan.to_launch, echo=echo, verbose=verbose)
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
    out = spec.out if is_uri(spec.out) else os.path.abspath(spec.out)
    with StudyLock(out, echo=echo), sigterm_exits(echo, spec.name), storage_errors(out):
        spec = prepare_study(spec, echo)
        tables = ResultTables(spec.out, repair=True)
        plan = plan_study(spec, tables, echo)
        if plan.plasticity or plan.probes or plan.to_launch:
            execute(spec, tables, plan, address=address, verbose=verbose, echo=echo)
        outcome = StudyOutcome(study_dir=spec.out, total=plan.total, launched=plan.to_launch,
                               counts=tables.counts(), probes=tables.counts(probes=True))
        if spec.analysis:
            from raystudy.analysis import report

            t0 = time.monotonic()
            outcome.report = str(report(spec.out))  # runs the analysis (tables, figures), writes report.html
            outcome.analysis_dir = join(spec.out, "analysis")
            echo(f"[{spec.name}] analysis written in {fmt_seconds(time.monotonic() - t0)}")
    outcome.wall_seconds = time.monotonic() - t_start
    print_summary(spec, outcome, echo)
    return outcome


def print_summary(spec: StudySpec, o: StudyOutcome, echo: Echo = _echo) -> None:
    c = o.counts
    echo("")
    echo(f"Study {spec.name!r}: {c['ok'] + c['diverged']}/{o.total} trials done (ok {c['ok']}, diverged "
         f"{c['diverged']}, failed {c['failed']}); {o.launched} launched this time, {fmt_seconds(o.wall_seconds)}")
    if spec.probe.enabled:
        echo(f"  probes:      {o.probes['ok']}/{len(spec.probe_datasets())} fitted (failed {o.probes['failed']}) "
             f"-> {join(o.study_dir, 'probes')}/<dataset>/probe.json")
    echo(f"  results:     {o.study_dir}/  (trials.parquet, curves.parquet, plasticity.parquet, bounds.parquet)")
    echo(f"  notebook:    raystudy.load_study({o.study_dir!r})")
    echo(f"  TensorBoard: tensorboard --logdir {join(o.study_dir, 'tb')}")
    echo(f"  Tune:        {join(o.study_dir, 'tune')}/<launch>  (ray.tune.Tuner.restore / ResultGrid)")
    if o.analysis_dir:
        echo(f"  analysis:    {o.analysis_dir}/")
        echo(f"  report:      {o.report}")
