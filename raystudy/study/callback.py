"""The driver side of a study's Tune experiment: tables and terminal kept up to date as trials end.

:class:`StudyCallback` ingests each finished trial into ``trials.parquet`` / ``curves.parquet`` (atomic
rewrites) and prints its line (:class:`~raystudy.study.progress.Progress`), plus a summary every minute.
:func:`tracking_callbacks` are Ray Tune's own experiment-tracking integrations a spec asks for.
"""

from __future__ import annotations

from typing import Any

from ray import tune

from raystudy.study.progress import Progress
from raystudy.study.results import ResultTables, trial_dir, trial_row
from raystudy.study.spec import StudySpec


def failed_trial_row(spec: StudySpec, point: dict[str, Any], error: BaseException | str) -> dict[str, Any]:
    """The ``trials.parquet`` row of a trial that ended without a result of its own:
    :func:`raystudy.distributed.train.failed_summary` of its run config, as a :func:`trial_row`."""
    from raystudy.distributed.train import failed_summary
    from raystudy.study.jobs import finetune_job

    cfg, _ = finetune_job(spec, point, trial_dir(spec.out, point["trial_id"]))
    return trial_row(point, spec.model, failed_summary(cfg, error), spec.model_kwargs)


class StudyCallback(tune.Callback):
    """Ingest each finished trial into the study's tables and print progress (runs in the driver)."""

    def __init__(self, spec: StudySpec, tables: ResultTables, progress: Progress):
        self.spec, self.tables, self.progress = spec, tables, progress

    def _ingest(self, point: dict) -> tuple[dict | None, str | None]:
        """The trial's row from its directory (``None`` if it wrote no summary) and why it has none."""
        try:
            row = self.tables.ingest(point, self.spec.model, self.spec.model_kwargs)
        except Exception as e:  # a malformed summary: recorded as failed, the study goes on
            return None, f"could not read the trial's summary: {e}"
        return row, None if row is not None else "the trial ended without writing summary.json"

    def _record_failure(self, point: dict, error: str) -> dict:
        row = failed_trial_row(self.spec, point, error)
        self.tables.add(row)
        return row

    def on_trial_start(self, iteration, trials, trial, **info):
        self.progress.running.add(trial.config["point"]["trial_id"])

    def on_trial_recover(self, iteration, trials, trial, **info):
        tid = trial.config["point"]["trial_id"]
        self.progress.echo(f"[{self.progress.prefix}] retrying {tid} after a failure ({trial.error_file})")

    def on_trial_complete(self, iteration, trials, trial, **info):
        point = trial.config["point"]
        row, why = self._ingest(point)
        if row is None:
            row = self._record_failure(point, why)
        self.progress.trial_finished(point["trial_id"], row)

    def on_trial_error(self, iteration, trials, trial, **info):
        point = trial.config["point"]
        error = f"failed after {self.spec.trial_retries} retries; see {trial.error_file or trial.path}"
        row, _ = self._ingest(point)  # the run's own failed summary (with its error) when it got that far
        if row is None or row["status"] != "failed":
            row = self._record_failure(point, error)
        self.progress.trial_finished(point["trial_id"], row)

    def on_step(self, iteration, trials, **info):
        self.progress.tick()


def tracking_callbacks(spec: StudySpec) -> list:
    """Ray Tune's logger callbacks for the spec's ``tracking`` (``wandb``: W&B project = study name;
    ``mlflow``: experiment = study name, tracking URI from ``MLFLOW_TRACKING_URI`` or MLflow's default).
    The packages are checked by :func:`raystudy.study.tune.check_tracking` before anything runs."""
    out = []
    for name in spec.tracking:
        if name == "wandb":
            from ray.air.integrations.wandb import WandbLoggerCallback

            out.append(WandbLoggerCallback(project=spec.name, group=spec.name))
        elif name == "mlflow":
            from ray.air.integrations.mlflow import MLflowLoggerCallback

            out.append(MLflowLoggerCallback(experiment_name=spec.name))
    return out
