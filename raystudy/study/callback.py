"""The driver side of a study's Tune experiment: tables and terminal kept up to date as trials end.

:class:`StudyCallback` adds each finished trial to ``trials.parquet`` / ``curves.parquet`` /
``changes.parquet`` (its curves and changes one new file each, the trials table rewritten on a timer and at
the experiment's end, each write atomic) and prints
its line (:class:`~raystudy.study.progress.Progress`), plus a summary every minute.
:func:`tracking_callbacks` are Ray Tune's own experiment-tracking integrations a spec asks for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ray import tune

from raystudy.core.finetune.driver import failed_summary
from raystudy.study.health import disk_full
from raystudy.study.jobs import finetune_job
from raystudy.study.progress import Progress
from raystudy.study.results import ResultTables, trial_dir, trial_row
from raystudy.study.spec import StudySpec

if TYPE_CHECKING:
    import pyarrow as pa


def failed_trial_row(spec: StudySpec, point: dict[str, Any], error: BaseException | str) -> dict[str, Any]:
    """The ``trials.parquet`` row of a trial that ended without a result of its own:
    :func:`raystudy.core.finetune.driver.failed_summary` of its run config, as a :func:`trial_row`."""
    cfg, _ = finetune_job(spec, point, trial_dir(spec.out, point["trial_id"]), score=False)  # no scoring here
    return trial_row(point, spec.model, failed_summary(cfg, error), spec.model_kwargs)


class StudyCallback(tune.Callback):
    """Ingest each finished trial into the study's tables and print progress (runs in the driver).

    A table rewrite that fails (a full disk) is reported once and does not stop the driver: the rows stay in
    memory and the trial directories keep the truth (the next run rebuilds the tables from them). On a
    full disk, :attr:`disk_full` says where it struck and :meth:`stopper` ends the launch.
    """

    def __init__(self, spec: StudySpec, tables: ResultTables, progress: Progress):
        self.spec, self.tables, self.progress = spec, tables, progress
        self.disk_full: str | None = None
        self.write_failed = False

    def stopper(self) -> tune.stopper.Stopper:
        """A Tune stopper that ends the whole launch once the disk is full (every write would fail)."""
        callback = self

        class StopOnFullDisk(tune.stopper.Stopper):
            def __call__(self, trial_id, result):
                return False

            def stop_all(self):
                return callback.disk_full is not None

        return StopOnFullDisk()

    def _note_disk_full(self, where: str, error: BaseException | str) -> None:
        if self.disk_full is None and disk_full(error):
            self.disk_full = where

    def _writing(self, action, *args) -> None:
        """``action(*args)``, a write of the tables; an ``OSError`` (a full disk) is reported once and noted."""
        try:
            action(*args)
        except OSError as e:
            self._note_disk_full("writing trials.parquet", e)
            if not self.write_failed:
                self.progress.echo(f"[{self.progress.prefix}] could not write the study's tables in "
                                   f"{self.spec.out} ({e}); they are rebuilt from the trial directories on "
                                   "the next run")
            self.write_failed = True

    def flush(self) -> None:
        """Write what the tables deferred (:meth:`ResultTables.flush`): at the experiment's end, and by the
        launch when it stops in any other way (an interrupt, an error)."""
        self._writing(self.tables.flush)

    def _read(self, point: dict) -> tuple[dict | None, pa.Table | None, pa.Table | None, str | None]:
        """The trial's row, curves and changes from its directory (``None`` if it wrote no summary) and why
        it has no row."""
        try:
            found = self.tables.read_trial(point, self.spec.model, self.spec.model_kwargs)
        except Exception as e:  # a malformed summary: recorded as failed, the study goes on
            return None, None, None, f"could not read the trial's summary: {e}"
        if found is None:
            return None, None, None, "the trial ended without writing summary.json"
        return *found, None

    def _finish(self, trial, row: dict | None, curves: pa.Table | None, changes: pa.Table | None,
                error: str | None) -> None:
        """Add the trial's row (a failed one with ``error`` when it has none of its own), with how many
        times Tune restarted it, and its curves and changes to the tables, then print its line."""
        point = trial.config["point"]
        if row is None:
            row = failed_trial_row(self.spec, point, error)
        row["trial_restarts"] = int(trial.run_metadata.num_failures)
        if row["status"] == "failed":
            self._note_disk_full(f"trial {point['trial_id']}", row.get("error") or "")
        self._writing(self.tables.add, row, curves, changes)
        self.progress.trial_finished(point["trial_id"], row)

    def on_trial_start(self, iteration, trials, trial, **info):
        self.progress.trial_started(trial.config["point"]["trial_id"])

    def on_trial_recover(self, iteration, trials, trial, **info):
        tid = trial.config["point"]["trial_id"]
        self.progress.echo(f"[{self.progress.prefix}] retrying {tid} after a failure ({_error_line(trial)})")

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._finish(trial, *self._read(trial.config["point"]))

    def on_trial_error(self, iteration, trials, trial, **info):
        tid = trial.config["point"]["trial_id"]
        error = (f"failed after {self.spec.trial_retries} retries: {_error_line(trial)}; see "
                 f"{trial_dir(self.spec.out, tid)} and {trial.path}/error.txt")
        self._note_disk_full(f"trial {tid}", _error_text(trial))
        row, curves, changes, _ = self._read(trial.config["point"])  # the run's own failed summary (its error)
        self._finish(trial, row if row is not None and row["status"] == "failed" else None, curves, changes, error)

    def on_step(self, iteration, trials, **info):
        self.progress.tick()

    def on_experiment_end(self, trials, **info):
        self.flush()


def _error_text(trial) -> str:
    """A Tune trial's error (its exception and traceback) as text, ``""`` when there is none."""
    try:
        text = str(trial.get_error() or "")
        if not text and getattr(trial, "error_file", None):  # not yet synced to storage (at a retry)
            with open(trial.error_file, encoding="utf-8", errors="replace") as f:
                text = f.read()
        return text
    except Exception:  # the error file may not be readable (a full disk)
        return ""


def _error_line(trial) -> str:
    """The last line of a Tune trial's error (its exception), at most 300 characters; never a path of Ray's
    temporary session folder."""
    lines = [ln.strip() for ln in _error_text(trial).splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "no error message"


def tracking_callbacks(spec: StudySpec) -> list:
    """Ray Tune's logger callbacks for the spec's ``tracking`` (``wandb``: W&B project = study name;
    ``mlflow``: experiment = study name, tracking URI from ``MLFLOW_TRACKING_URI`` or MLflow's default).
    The packages are checked by :func:`raystudy.study.persist.check_tracking` before anything runs."""
    out = []
    for name in spec.tracking:
        if name == "wandb":
            from ray.air.integrations.wandb import WandbLoggerCallback

            out.append(WandbLoggerCallback(project=spec.name, group=spec.name))
        elif name == "mlflow":
            from ray.air.integrations.mlflow import MLflowLoggerCallback

            out.append(MLflowLoggerCallback(experiment_name=spec.name))
    return out
