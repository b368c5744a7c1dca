"""One trial of a study, as it runs in a Tune trial process anywhere in the cluster.

:func:`run_trial` is the Tune trainable (:func:`trainable` adds its resources): one grid point -> one
finetuning run in ``<out>/trials/<trial_id>/``, under ``execution: actor`` in the trial's own (reused) Tune
actor (:func:`raystudy.distributed.inprocess.run_in_process`), under ``execution: train`` as the Ray Train
run named by the trial id (:func:`raystudy.distributed.train.run_finetune`), so that a re-run resumes its
checkpoints. Its end is reported to Tune by :func:`final_report`.

Ray is imported inside the functions that run in a trial: :mod:`raystudy.study.tune` imports this module
for :func:`trainable`, and the commands import that one to check a spec without starting Ray.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from raystudy.storage import copy_dir, exists, is_uri, join, uploaded_folder
from raystudy.study.jobs import finetune_job
from raystudy.study.points import STUDY_TRIAL_ID
from raystudy.study.results import trial_dir
from raystudy.study.spec import StudySpec


@contextmanager
def local_dir_for(target: str) -> Iterator[str]:
    """A local directory standing for ``target``: ``target`` itself when local, else a temporary directory of
    the same name, uploaded to the URI when the block ends (also when it raises: a failed run's summary is
    kept). The name is kept because a run is known by its folder's name (e.g. by :mod:`raystudy.faults`)."""
    if not is_uri(target):
        os.makedirs(target, exist_ok=True)
        yield target
        return
    with uploaded_folder(target, name=target.rstrip("/").rsplit("/", 1)[-1]) as local:
        yield local


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
    """``<study>/tb/<trial_id>``: a copy of the run's ``tb/`` where no link could be made (URIs). On object
    storage, a Ray Train run whose worker 0 ran on another node uploaded its ``tb/`` to the trial's folder
    itself (:func:`raystudy.distributed.train.run_finetune`): the copy is made from there."""
    target = join(study_dir, "tb", tid)
    src = os.path.join(run_dir, "tb")
    if is_uri(study_dir) and not os.path.isdir(src):
        src = join(trial_dir(study_dir, tid), "tb")
    if (is_uri(study_dir) or not os.path.lexists(target)) and exists(src):
        copy_dir(src, target)


class TrialFailed(RuntimeError):
    """A trial's Ray Train run ended with status ``failed`` (its workers failed beyond ``worker_retries``)."""


def _finetune_point(spec: StudySpec, point: dict, run_dir: str) -> dict:
    """The run of one grid point into ``run_dir``, where ``spec.trial_execution`` says; its summary (raises
    :class:`TrialFailed` for a Ray Train run that failed)."""
    tid = point["trial_id"]
    cfg, resources = finetune_job(spec, point, run_dir)
    if spec.trial_execution == "actor":
        from ray import tune

        from raystudy.distributed.inprocess import run_in_process  # Ray (see the module docstring)

        # a failure raises: Tune's FailureConfig re-runs the trial, which resumes from its checkpoints
        return run_in_process(cfg, resources, storage=join(spec.out, "train", tid), on_report=tune.report)
    return _train_point(spec, tid, cfg, resources)


def _train_point(spec: StudySpec, tid: str, cfg, resources) -> dict:
    """The Ray Train run of one grid point (``RunConfig(name=trial_id)``: a re-run resumes its checkpoints)."""
    import ray.train
    from ray.tune.integration.ray_train import TuneReportCallback

    from raystudy.distributed.train import run_finetune  # Ray Train (see the module docstring)

    run_config = ray.train.RunConfig(
        name=tid, storage_path=join(spec.out, "train"),
        failure_config=ray.train.FailureConfig(max_failures=spec.worker_retries),
    )
    upload_to = trial_dir(spec.out, tid) if is_uri(spec.out) else None  # cfg.out_dir: its local staging
    summary = run_finetune(cfg, resources, run_config=run_config, callbacks=[TuneReportCallback()],
                           upload_to=upload_to)
    if summary.get("status") == "failed":
        # Raising hands the trial to Tune's FailureConfig: a retry resumes from the run's checkpoints.
        raise TrialFailed(f"{tid}: {summary.get('error', 'Ray Train run failed')}")
    return summary


def final_report(summary: dict, point: dict) -> dict:
    """What a trial reports to Tune at its end: the summary's scalars, the study's ids, the objective."""
    final = {k: v for k, v in summary.items() if isinstance(v, int | float | str | bool)}
    # ("trial_id" is Tune's own key in every result: the study's id goes under another name)
    final.update({STUDY_TRIAL_ID: point["trial_id"], "dataset": point["dataset"],
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


def trainable(spec: StudySpec):
    """The Tune trainable of the spec's trials with its resources: a light driver (``trial_driver_cpus``)
    waiting on a Ray Train run, or under ``execution: actor`` the worker's own CPUs and GPUs."""
    from ray import tune

    if spec.trial_execution == "actor":
        resources = {"cpu": spec.cpus_per_worker or spec.trial_driver_cpus, "gpu": spec.gpus_per_worker}
    else:
        resources = {"cpu": spec.trial_driver_cpus}
    return tune.with_resources(tune.with_parameters(run_trial, spec_dict=spec.to_dict()), resources)
