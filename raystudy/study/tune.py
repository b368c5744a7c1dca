"""Ray Tune orchestration: a study spec -> its missing grid points -> one Ray Train run each -> tables.

:func:`run_study` is the whole study (what ``experiments/full_study.py`` and ``raystudy study`` call):

1. the study directory: ``spec.yaml`` is written (or checked against the one already there: a study
   directory never silently changes meaning);
2. the demo extras, when the spec asks for them: the built-in data (``builtin_data``) and a pretrained
   model (``pretrain``, :mod:`raystudy.study.pretrain`);
3. validation of every store and the weights file, before anything is launched;
4. the plasticity of every dataset not yet measured (:func:`raystudy.distributed.plasticity.run_plasticity`);
5. the finetuning grid through Ray Tune: each Tune trial is a light driver (``trial_driver_cpus``) that
   builds the Ray Train run (:func:`raystudy.distributed.train.run_finetune`, ``RunConfig(name=trial_id,
   callbacks=[TuneReportCallback()])``) and waits for it. Only grid points without a final row (``ok`` or
   ``diverged``) in ``trials.parquet`` are launched, so an interrupted study resumes where it stopped and a
   finished one launches nothing. The Ray Train run of a trial is named by its trial id, so a trial cut off
   by a killed driver restarts from its last checkpoint;
6. the analysis (:func:`raystudy.analysis.analyze` and :func:`raystudy.analysis.report`).

A :class:`StudyCallback` in the driver rewrites ``trials.parquet``/``curves.parquet`` atomically as each
trial ends and prints ``done / running / failed / total`` with an ETA.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs

from raystudy.io import read_result, write_result
from raystudy.study.results import (
    FINAL_STATUSES,
    ResultTables,
    exists,
    failed_row,
    filesystem,
    join,
    read_text,
    trial_dir,
    write_text_atomic,
)
from raystudy.study.spec import SpecError, StudySpec, grid_point, load_spec_file

log = logging.getLogger(__name__)

SPEC_FILE = "spec.yaml"


def _echo(msg: str) -> None:
    print(msg, flush=True)


def _fmt_seconds(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")


def is_uri(path: str) -> bool:
    return "://" in str(path)


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
    resolved = spec.with_overrides({"out": out, "data_root": data_root, "weights": weights})
    resolved.datasets = resolved.dataset_stores()
    if resolved.pretrain_store is not None:
        resolved.pretrain_store = resolved.pretrain_store_path()
    return resolved


def stored_spec(study_dir: str) -> StudySpec | None:
    """The spec a study directory was created with, or ``None`` for a new directory."""
    path = join(study_dir, SPEC_FILE)
    text = read_text(path)
    if text is None:
        return None
    import yaml

    return StudySpec.from_dict(yaml.safe_load(text) or {}, where=path)


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
    write_text_atomic(spec.to_yaml(), join(spec.out, SPEC_FILE))


# ----------------------------------------------------------------------------------------------------
# Progress
# ----------------------------------------------------------------------------------------------------


@dataclass
class Progress:
    """Counts of the study's trials and an ETA from this launch's throughput (trials per second)."""

    total: int
    done_before: int
    echo: Any = _echo
    prefix: str = "study"
    running: set = field(default_factory=set)
    counts: dict = field(default_factory=lambda: {"ok": 0, "diverged": 0, "failed": 0})
    t0: float = field(default_factory=time.time)

    @property
    def finished_now(self) -> int:
        return sum(self.counts.values())

    def eta(self) -> float:
        n = self.finished_now
        remaining = self.total - self.done_before - n
        if n == 0 or remaining <= 0:
            return math.nan if remaining > 0 else 0.0
        return (time.time() - self.t0) / n * remaining

    def line(self, event: str = "") -> str:
        c = self.counts
        done = self.done_before + c["ok"] + c["diverged"]
        pending = self.total - done - c["failed"] - len(self.running)
        return (
            f"[{self.prefix}] {done}/{self.total} done, {len(self.running)} running, {c['failed']} failed, "
            f"{max(pending, 0)} pending (this launch: {c['ok']} ok, {c['diverged']} diverged)"
            f" | elapsed {_fmt_seconds(time.time() - self.t0)}, ETA {_fmt_seconds(self.eta())}"
            + (f" | {event}" if event else "")
        )

    def show(self, event: str = "") -> None:
        self.echo(self.line(event))


def _tune_callback_class():
    from ray import tune

    class StudyCallback(tune.Callback):
        """Driver-side: ingest each finished trial into the tables (atomic rewrite) and print progress."""

        def __init__(self, spec: StudySpec, tables: ResultTables, progress: Progress):
            self.spec, self.tables, self.progress = spec, tables, progress

        @staticmethod
        def _point(trial) -> dict:
            return trial.config["point"]

        def on_trial_start(self, iteration, trials, trial, **info):
            tid = self._point(trial)["trial_id"]
            self.progress.running.add(tid)
            self.progress.show(f"started {tid}")

        def on_trial_recover(self, iteration, trials, trial, **info):
            tid = self._point(trial)["trial_id"]
            self.progress.show(f"retrying {tid} after a failure ({trial.error_file})")

        def on_trial_complete(self, iteration, trials, trial, **info):
            point = self._point(trial)
            tid = point["trial_id"]
            self.progress.running.discard(tid)
            try:
                row = self.tables.ingest(point, self.spec.model)
            except Exception as e:  # a malformed summary: record it as failed, keep the study going
                row = None
                err = f"could not read the trial's summary: {e}"
            else:
                err = "the trial ended without writing summary.json"
            if row is None:
                row = failed_row(point, self.spec.model, self.spec.steps, self.spec.batch_size, err)
                self.tables.add(row)
            self.progress.counts[row["status"]] += 1
            acc = row.get("test_acc", math.nan)
            self.progress.show(f"{tid}: {row['status']}, test acc {acc:.3f}")

        def on_trial_error(self, iteration, trials, trial, **info):
            point = self._point(trial)
            tid = point["trial_id"]
            self.progress.running.discard(tid)
            err = f"failed after {self.spec.trial_retries} retries; see {trial.error_file or trial.path}"
            try:  # the run's own failed summary (with its error) when it got that far
                row = self.tables.ingest(point, self.spec.model)
            except Exception:
                row = None
            if row is None or row["status"] != "failed":
                self.tables.add(failed_row(point, self.spec.model, self.spec.steps, self.spec.batch_size, err))
            self.progress.counts["failed"] += 1
            self.progress.show(f"{tid}: FAILED ({err})")

    return StudyCallback


# ----------------------------------------------------------------------------------------------------
# One trial (runs in a Tune trial process, anywhere in the cluster)
# ----------------------------------------------------------------------------------------------------


def finetune_config(spec: StudySpec, point: dict, out_dir: str):
    """The :class:`~raystudy.core.finetune.FinetuneConfig` of one grid point."""
    from raystudy.core.finetune import FinetuneConfig

    return FinetuneConfig(
        model=spec.model, model_kwargs=dict(spec.model_kwargs), weights=spec.weights, img_size=spec.img_size,
        store=spec.datasets[point["dataset"]], component=point["configuration"], optimizer=point["optimizer"],
        lr=float(point["lr"]), seed=int(point["seed"]), steps=spec.steps, batch_size=spec.batch_size,
        eval_period=spec.eval_period, warmup_steps=spec.warmup_steps, augment=spec.augment, shuffle=spec.shuffle,
        checkpoint_period=spec.checkpoint_period, amp_bf16=spec.amp_bf16, train_final_norm=spec.train_final_norm,
        workers=spec.workers_per_trial, gpus_per_worker=spec.gpus_per_worker, cpus_per_worker=spec.cpus_per_worker,
        max_failures=spec.worker_retries, out_dir=out_dir,
        fail_after_step=spec.inject_failures.get(point["trial_id"]),
    )


@contextmanager
def local_dir_for(target: str):
    """A local directory standing for ``target``: ``target`` itself when local, else a temporary directory
    uploaded to the URI when the block ends (also when it raises: a failed run's summary is kept)."""
    if not is_uri(target):
        os.makedirs(target, exist_ok=True)
        yield target
        return
    tmp = tempfile.mkdtemp(prefix="raystudy-")
    try:
        yield tmp
    finally:
        try:
            fs, p = filesystem(target)
            fs.create_dir(p, recursive=True)
            pafs.copy_files(tmp, p, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
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


class TrialFailed(RuntimeError):
    """A trial's Ray Train run ended with status ``failed`` (its workers failed beyond ``worker_retries``)."""


def run_trial(config: dict, spec_dict: dict) -> None:
    """The Tune trainable: one grid point = one Ray Train run; reports the run summary to Tune at the end."""
    import ray.train
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from raystudy.distributed.train import run_finetune

    spec = StudySpec.from_dict(spec_dict)
    point = config["point"]
    tid = point["trial_id"]
    target = trial_dir(spec.out, tid)
    with local_dir_for(target) as run_dir:
        if not is_uri(spec.out):
            _link_tensorboard(spec.out, tid, run_dir)
        cfg = finetune_config(spec, point, run_dir)
        run_config = ray.train.RunConfig(
            name=tid, storage_path=join(spec.out, "train"),
            failure_config=ray.train.FailureConfig(max_failures=spec.worker_retries),
        )
        summary = run_finetune(cfg, run_config=run_config, callbacks=[TuneReportCallback()])
        if summary.get("status") == "failed":
            # Raising hands the trial to Tune's FailureConfig: a retry resumes from the run's checkpoints.
            raise TrialFailed(f"{tid}: {summary.get('error', 'Ray Train run failed')}")
        tb_copy = join(spec.out, "tb", tid)
        if is_uri(spec.out) or not os.path.lexists(tb_copy):
            src = os.path.join(run_dir, "tb")
            if os.path.isdir(src):
                fs, p = filesystem(tb_copy)
                fs.create_dir(p, recursive=True)
                pafs.copy_files(src, p, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
    final = {k: v for k, v in summary.items() if isinstance(v, int | float | str | bool)}
    # ("trial_id" is Tune's own key in every result: the study's id goes under another name)
    final.update({"study_trial_id": tid, "dataset": point["dataset"], "configuration": point["configuration"]})
    # the searcher's objective: a diverged run counts as chance-level, never NaN
    acc = summary.get("best_val_acc")
    final["objective"] = float(acc) if summary.get("status") == "ok" and acc is not None and math.isfinite(acc) else 0.0
    tune.report(final)


# ----------------------------------------------------------------------------------------------------
# Optuna over the learning rate, one search per (dataset, configuration, optimizer, seed) cell
# ----------------------------------------------------------------------------------------------------


def _grouped_searcher_class():
    from ray.tune.search import Searcher
    from ray.tune.search.optuna import OptunaSearch

    class GroupedOptunaSearch(Searcher):
        """One :class:`OptunaSearch` (TPE over ``lr``, log scale) per study cell, ``budget[cell]`` runs each.

        Cells are served round-robin so they progress side by side; earlier results of a cell (a resumed
        study) are given to its searcher as evaluated points. The objective is ``best_val_acc`` (0 for a
        diverged run). No metric is declared to Tune: intermediate Ray Train reports do not carry it.
        """

        def __init__(self, spec: StudySpec, budget: dict[tuple, int], history: dict[tuple, list], seed: int = 0):
            super().__init__(metric=None, mode=None)
            self.spec = spec
            self.cells = [c for c in budget if budget[c] > 0]
            self.left = dict(budget)
            self.searchers = {}
            from optuna.distributions import FloatDistribution

            for i, cell in enumerate(self.cells):
                lo, hi = spec.lr_range(cell[2])
                past = history.get(cell, [])
                self.searchers[cell] = OptunaSearch(
                    space={"lr": FloatDistribution(lo, hi, log=True)}, metric="objective", mode="max", seed=seed + i,
                    points_to_evaluate=[{"lr": lr} for lr, _ in past] or None,
                    evaluated_rewards=[v for _, v in past] or None,
                )
            self.owner: dict[str, tuple] = {}
            self.used_ids: set[str] = set()
            self._next = 0

        def set_search_properties(self, metric, mode, config, **spec):
            return True

        def suggest(self, trial_id: str):
            open_cells = [c for c in self.cells if self.left[c] > 0]
            if not open_cells:
                return Searcher.FINISHED
            cell = open_cells[self._next % len(open_cells)]
            self._next += 1
            params = self.searchers[cell].suggest(trial_id)
            if params is None or params == Searcher.FINISHED:
                return params
            self.left[cell] -= 1
            self.owner[trial_id] = cell
            dataset, configuration, optimizer, seed = cell
            lr = float(f"{params['lr']:.4g}")
            point = grid_point(dataset, configuration, optimizer, lr, seed)
            if point["trial_id"] in self.used_ids:  # two samples that round alike: keep more digits
                point = grid_point(dataset, configuration, optimizer, float(params["lr"]), seed)
            self.used_ids.add(point["trial_id"])
            return {"point": point}

        def on_trial_result(self, trial_id: str, result: dict) -> None:
            pass  # intermediate Ray Train reports have no objective yet

        def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False):
            cell = self.owner.get(trial_id)
            if cell is not None:
                self.searchers[cell].on_trial_complete(trial_id, result, error)

    return GroupedOptunaSearch


def optuna_plan(spec: StudySpec, tables: ResultTables) -> tuple[dict, dict]:
    """Remaining runs per cell (``samples`` minus the cell's final rows) and each cell's past (lr, objective)."""
    budget, history = {}, {}
    rows = list(tables.rows.values())
    for g in spec.groups():
        cell = (g["dataset"], g["configuration"], g["optimizer"], g["seed"])
        past = [
            (float(r["lr"]), float(r["best_val_acc"]) if r["status"] == "ok" else 0.0)
            for r in rows
            if r["status"] in FINAL_STATUSES and (r["dataset"], r["component"], r["optimizer"], int(r["seed"])) == cell
        ]
        history[cell] = past
        budget[cell] = max(spec.samples - len(past), 0)
    return budget, history


# ----------------------------------------------------------------------------------------------------
# Launching
# ----------------------------------------------------------------------------------------------------


def _next_launch_name(spec: StudySpec) -> str:
    fs, p = filesystem(join(spec.out, "tune"))
    n = 0
    if fs.get_file_info(p).type == pafs.FileType.Directory:
        n = len([i for i in fs.get_file_info(pafs.FileSelector(p)) if i.type == pafs.FileType.Directory])
    return f"{spec.name}-{n:03d}"


def launch_trials(spec: StudySpec, tables: ResultTables, points: list[dict] | None, *, total: int,
                  done_before: int, echo=_echo, verbose: bool = False):
    """Run ``points`` (grid search) or the remaining Optuna budget (``points is None``) as one Tune
    experiment under ``<out>/tune/<name>-<n>``; returns the :class:`ray.tune.ResultGrid`."""
    from ray import tune

    progress = Progress(total=total, done_before=done_before, echo=echo, prefix=spec.name)
    callback = _tune_callback_class()(spec, tables, progress)
    trainable = _trainable(spec)
    name = _next_launch_name(spec)
    if points is not None:
        param_space = {"point": tune.grid_search(points)}
        tune_config = tune.TuneConfig(num_samples=1, reuse_actors=True)
        n = len(points)
    else:
        budget, history = optuna_plan(spec, tables)
        n = sum(budget.values())
        searcher = _grouped_searcher_class()(spec, budget, history)
        param_space = {}
        tune_config = tune.TuneConfig(search_alg=searcher, num_samples=n, reuse_actors=True)
    tune_config.max_concurrent_trials = spec.max_concurrent_trials or None
    tune_config.trial_name_creator = lambda t: t.config["point"]["trial_id"]
    tune_config.trial_dirname_creator = lambda t: t.config["point"]["trial_id"]
    run_config = tune.RunConfig(
        name=name, storage_path=join(spec.out, "tune"), callbacks=[callback], verbose=1 if verbose else 0,
        failure_config=tune.FailureConfig(max_failures=spec.trial_retries),
    )
    if not verbose:
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # Tune's legacy reporter at verbose=0 prints nothing
    echo(f"[{spec.name}] launching {n} trial(s) as Tune experiment {join(spec.out, 'tune', name)}")
    progress.show()
    tuner = tune.Tuner(trainable, param_space=param_space, tune_config=tune_config, run_config=run_config)
    results = tuner.fit()
    progress.show("launch finished")
    return results


def _trainable(spec: StudySpec):
    from ray import tune

    return tune.with_resources(
        tune.with_parameters(run_trial, spec_dict=spec.to_dict()), {"cpu": spec.trial_driver_cpus}
    )


def tune_experiments(study_dir: str) -> list[str]:
    """The Tune experiment directories of a study, one per launch, oldest first."""
    fs, p = filesystem(join(study_dir, "tune"))
    if fs.get_file_info(p).type != pafs.FileType.Directory:
        return []
    infos = fs.get_file_info(pafs.FileSelector(p))
    return sorted(join(join(study_dir, "tune"), i.base_name) for i in infos if i.type == pafs.FileType.Directory)


def restore_tuner(experiment_path: str, spec: StudySpec | None = None):
    """``tune.Tuner.restore`` of one launch of a study (``.get_results()`` is its ``ResultGrid``).

    ``spec`` defaults to the study's ``spec.yaml`` (the directory above ``tune/``). Needs a Ray instance.
    """
    from ray import tune

    if spec is None:
        spec = load_study_spec(experiment_path.rstrip("/").rsplit("/", 2)[0])
    return tune.Tuner.restore(experiment_path, trainable=_trainable(spec))


# ----------------------------------------------------------------------------------------------------
# Plasticity and bounds
# ----------------------------------------------------------------------------------------------------


def measure_plasticity(spec: StudySpec, echo=_echo) -> list[str]:
    """Plasticity (and bounds) of every dataset not yet in ``plasticity.parquet``; returns the datasets run.

    The job's tables name datasets by their store's ``dataset.json`` name; they are renamed to the
    spec's dataset names so they join with ``trials.parquet``.
    """
    from raystudy.data.store import read_meta
    from raystudy.distributed.plasticity import PlasticityJob, run_plasticity

    p = spec.plasticity
    have = read_result(spec.out, "plasticity", required=False)
    measured = set() if have is None else set(have["dataset"])
    todo = [d for d in spec.datasets if d not in measured]
    if not todo:
        echo(f"[{spec.name}] plasticity: all {len(spec.datasets)} dataset(s) already measured")
        return []
    rename = {read_meta(spec.datasets[d])["name"]: d for d in todo}
    n_runs = 0
    fs, root = filesystem(join(spec.out, "plasticity"))
    if fs.get_file_info(root).type == pafs.FileType.Directory:
        n_runs = len(fs.get_file_info(pafs.FileSelector(root)))
    target = join(spec.out, "plasticity", f"run-{n_runs:03d}")
    echo(f"[{spec.name}] plasticity of {todo}: {p.pairs} pairs each, {p.workers} worker(s) -> {target}")
    t0 = time.time()
    with local_dir_for(target) as out_dir:
        job = PlasticityJob(
            model=spec.model, weights=spec.weights, model_kwargs=dict(spec.model_kwargs),
            pretrain=spec.pretrain_store, downstream=[spec.datasets[d] for d in todo], pairs=p.pairs,
            batch_size=p.batch_size, mode=p.mode, workers=p.workers, gpus_per_worker=p.gpus_per_worker,
            cpus_per_worker=p.cpus_per_worker, torch_threads=p.torch_threads, seed=0, img_size=spec.img_size,
            amp_bf16=spec.amp_bf16,
            out_dir=out_dir,
        )
        run_plasticity(job)
        for table in ("plasticity", "rates"):
            new = read_result(out_dir, table, required=False)
            if new is None:
                continue
            new["dataset"] = new["dataset"].map(lambda n: rename.get(n, n))
            old = read_result(spec.out, table, required=False)
            if old is not None:
                old = old[~old["dataset"].isin(todo)]
                import pandas as pd

                new = pd.concat([old, new], ignore_index=True)
            write_result(new, spec.out, table)
        bounds = read_result(out_dir, "bounds", required=False)
        if bounds is not None:  # the bounds depend on the model and the pretraining images only
            write_result(bounds, spec.out, "bounds")
    echo(f"[{spec.name}] plasticity done in {_fmt_seconds(time.time() - t0)}")
    return todo


# ----------------------------------------------------------------------------------------------------
# The whole study
# ----------------------------------------------------------------------------------------------------


@dataclass
class StudyOutcome:
    study_dir: str
    total: int
    launched: int
    counts: dict
    analysis_dir: str | None = None
    report: str | None = None
    wall_seconds: float = 0.0


def _init_ray(address: str | None, verbose: bool) -> bool:
    """Connect to ``address`` (a cluster) or start a local Ray; ``True`` if this call started it."""
    import ray

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    if ray.is_initialized():
        return False
    if not verbose:  # Ray Data's per-dataset INFO lines would drown the study's progress lines
        logging.getLogger("ray.data").setLevel(logging.WARNING)
    kwargs: dict[str, Any] = {"log_to_driver": verbose, "configure_logging": verbose}
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(include_dashboard=False, **kwargs)
    return True


def prepare_builtin_data(spec: StudySpec, echo=_echo) -> StudySpec:
    """Prepare the built-in procedural stores under ``data_root`` (kept when already there)."""
    from raystudy.data.synthetic import prepare_default

    root = spec.resolved_data_root()
    t0 = time.time()
    stores = prepare_default(root)
    echo(f"[{spec.name}] built-in data in {root}: {sorted(stores)} ({_fmt_seconds(time.time() - t0)})")
    missing = [d for d, p in spec.datasets.items() if os.path.basename(p) not in stores and d not in stores]
    if missing:
        raise SpecError(f"datasets: {missing} are not among the built-in stores {sorted(stores)}")
    return spec


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


def run_study(spec: StudySpec, *, address: str | None = None, verbose: bool = False, echo=_echo) -> StudyOutcome:
    """Run (or continue) the study ``spec`` end to end; see the module docstring."""
    t_start = time.time()
    spec.validate(check_files=False)
    spec = resolve_paths(spec)
    check_stored(spec)
    echo(f"[{spec.name}] study directory {spec.out}")

    if spec.builtin_data:
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
    write_spec(spec)  # only a valid spec marks the directory as a study

    # What is left to do, decided from the study directory alone (no Ray needed to say "nothing").
    plasticity_todo = []
    if spec.plasticity.enabled:
        have = read_result(spec.out, "plasticity", required=False)
        measured = set() if have is None else set(have["dataset"])
        plasticity_todo = [d for d in spec.datasets if d not in measured]
        if not plasticity_todo:
            echo(f"[{spec.name}] plasticity: all {len(spec.datasets)} dataset(s) already measured")
    tables = ResultTables(spec.out)
    total = spec.total_trials()
    missing: list[dict] | None = None
    if spec.search == "grid":
        grid = spec.grid()
        picked = tables.reconcile(grid, spec.model)
        if picked:
            echo(f"[{spec.name}] recovered {len(picked)} finished trial(s) from their directories")
        done = tables.done_ids()
        missing = [p for p in grid if p["trial_id"] not in done]
        to_launch = len(missing)
        retry = [p["trial_id"] for p in missing if tables.status(p["trial_id"]) == "failed"]
        if retry:
            more = " ..." if len(retry) > 5 else ""
            echo(f"[{spec.name}] retrying {len(retry)} failed trial(s): {retry[:5]}{more}")
    else:
        to_launch = sum(optuna_plan(spec, tables)[0].values())
    if to_launch == 0:
        echo(f"[{spec.name}] all {total} trial(s) already done: nothing to run")

    if plasticity_todo or to_launch:
        started = _init_ray(address, verbose)
        try:
            if plasticity_todo:
                measure_plasticity(spec, echo)
            if to_launch:
                launch_trials(spec, tables, missing, total=total, done_before=total - to_launch, echo=echo,
                              verbose=verbose)
        finally:
            if started:
                import ray

                ray.shutdown()
    launched = to_launch

    counts = tables.counts()
    outcome = StudyOutcome(study_dir=spec.out, total=total, launched=launched, counts=counts)
    if spec.analysis:
        from raystudy.analysis import report

        t0 = time.time()
        outcome.report = str(report(spec.out))  # runs the analysis (tables, figures) and writes report.html
        outcome.analysis_dir = join(spec.out, "analysis")
        echo(f"[{spec.name}] analysis written in {_fmt_seconds(time.time() - t0)}")
    outcome.wall_seconds = time.time() - t_start
    _print_summary(spec, outcome, echo)
    return outcome


def _print_summary(spec: StudySpec, o: StudyOutcome, echo=_echo) -> None:
    c = o.counts
    echo("")
    echo(f"Study {spec.name!r}: {c['ok'] + c['diverged']}/{o.total} trials done (ok {c['ok']}, diverged "
         f"{c['diverged']}, failed {c['failed']}); {o.launched} launched this time, {_fmt_seconds(o.wall_seconds)}")
    echo(f"  results:     {o.study_dir}/  (trials.parquet, curves.parquet, plasticity.parquet, bounds.parquet)")
    echo(f"  TensorBoard: tensorboard --logdir {join(o.study_dir, 'tb')}")
    echo(f"  Tune:        {join(o.study_dir, 'tune')}/<launch>  (ray.tune.Tuner.restore / ResultGrid)")
    if o.analysis_dir:
        echo(f"  analysis:    {o.analysis_dir}/")
        echo(f"  report:      {o.report}")


def load_study_spec(study_dir: str) -> StudySpec:
    """The spec stored in a study directory (for ``--resume DIR``)."""
    path = join(study_dir, SPEC_FILE)
    if not exists(path):
        raise SpecError(f"--resume: {study_dir} holds no study ({SPEC_FILE} not found)")
    if is_uri(path):
        import yaml

        return StudySpec.from_dict(yaml.safe_load(read_text(path)), where=path)
    return load_spec_file(path)
