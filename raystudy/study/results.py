"""A study directory and its result tables, kept consistent while trials finish.

Layout of ``<out>/`` (local path or pyarrow URI)::

    spec.yaml            the resolved study spec (what was run)
    trials.parquet       one row per grid point (trial_id unique), rewritten atomically as trials finish
    curves.parquet       the training curves of every finished trial, with its trial_id
    plasticity.parquet   rates.parquet  bounds.parquet      the plasticity measurement
    trials/<trial_id>/   one finetuning run: summary.json, curves.parquet, tb/ (its TensorBoard run)
    tb/<trial_id>/       the TensorBoard run of every finished trial (``tensorboard --logdir <out>/tb``)
    train/<trial_id>/    Ray Train's run storage (checkpoints), so an interrupted trial resumes from them
    tune/<launch>/       one Tune experiment per launch (``tune.Tuner.restore`` / ``ResultGrid``)
    analysis/            tables, statistical tests, figures and report.html

The per-trial ``summary.json`` is the source of truth: the study tables are a projection of the trial
directories and can always be rebuilt from them (:meth:`ResultTables.reconcile`), so a driver killed
between a trial's end and the table rewrite loses nothing.

A ``trials.parquet`` row is :func:`trial_row` of a run summary, also for a trial that failed after all its
retries (its summary is :func:`raystudy.distributed.train.failed_summary`: NaN / null results, never a
``-1`` sentinel). Every row carries the model's constructor arguments as a JSON string (``model_kwargs``).
Studies written before the vocabulary was unified call the ``configuration`` column ``component``:
:func:`raystudy.io.read_result` renames it on read, so they load and resume.

:func:`load_study` reads a study directory for a notebook (``raystudy.load_study(dir)``).
"""

from __future__ import annotations

import json
import logging
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raystudy.io import TableError, read_result, write_result
from raystudy.storage import exists, filesystem, join, move_aside, read_text
from raystudy.study.spec import grid_point
from raystudy.vocab import FINAL_STATUSES, LINEAR_PROBE, SCHEMAS, STATUSES, TRIAL_COUNT_EXTRAS, columns

#: columns every row has beyond the schema's: the model's constructor arguments (JSON, sorted keys)
TRIAL_EXTRAS = ("model_kwargs",)
#: integer result columns that older studies filled with -1 when a trial failed (now null)
OLD_SENTINELS = ("trainable_params", "best_val_step", "steps_completed")
#: the grid's axes: the order of ``trials.parquet``
SORT_KEYS = ["dataset", "configuration", "optimizer", "lr", "seed"]

log = logging.getLogger(__name__)


def trial_dir(study_dir: str, trial_id: str) -> str:
    return join(study_dir, "trials", trial_id)


def quarantine(path: str) -> str:
    """Move the file or folder ``path`` aside to ``<path>.corrupt-<n>`` (the first free ``n``, from 1) so
    that nothing reads it again and nothing is lost; returns the new path."""
    return move_aside(path, "corrupt")


def read_trial_summary(study_dir: str, trial_id: str) -> dict[str, Any] | None:
    """``trials/<id>/summary.json`` as a dict, or ``None`` when the trial has not finished. A summary that is
    no run's (not a JSON object, an unknown ``status``) makes the trial ``failed``, with the file named in its
    ``error``, so that the study goes on and runs that trial again."""
    path = join(trial_dir(study_dir, trial_id), "summary.json")
    text = read_text(path)
    if text is None:
        return None
    try:
        summary = json.loads(text)
    except json.JSONDecodeError:
        return None  # a torn write of a killed run: treat the trial as unfinished
    if not isinstance(summary, dict):
        return _malformed(path, f"a JSON {type(summary).__name__}, not an object")
    if summary.get("status") not in STATUSES:
        return _malformed(path, f"status {summary.get('status')!r} not in {STATUSES}")
    return summary


def _malformed(path: str, reason: str) -> dict[str, Any]:
    log.warning("%s: %s; the trial counts as failed and runs again", path, reason)
    blank = dict.fromkeys(SCHEMAS["trials"].names)  # every column a row holds, null: nothing was measured
    return {**blank, "status": "failed", "error": f"{path}: {reason}"}


def read_trial_curves(study_dir: str, trial_id: str) -> pd.DataFrame | None:
    path = join(trial_dir(study_dir, trial_id), "curves.parquet")
    if not exists(path):
        return None
    fs, p = filesystem(path)
    return pq.read_table(p, filesystem=fs).to_pandas()


def _point_of(study_dir: str, tid: str, datasets: list[str]) -> dict[str, Any] | None:
    """The grid point of trial directory ``tid`` from its summary (configuration, optimizer, lr, seed) and
    the one dataset of ``datasets`` whose trial id it is; ``None`` when there is none."""
    s = read_trial_summary(study_dir, tid)
    try:
        values = (s.get("configuration") or s["component"], s["optimizer"], float(s["lr"]), int(s["seed"]))
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    for dataset in datasets:
        point = grid_point(dataset, *values)
        if point["trial_id"] == tid:
            return point
    return None


def trial_row(point: dict[str, Any], model: str, summary: dict[str, Any],
              model_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One ``trials.parquet`` row: the grid point's identity, then the run's summary (extra keys kept).

    ``configuration`` is what the trial trains (:data:`raystudy.vocab.CONFIGURATIONS`). ``model_kwargs``
    is the summary's own (the run's truth) or else the given one, stored as a JSON string.
    """
    row = {k: v for k, v in summary.items() if not isinstance(v, dict | list)}
    row.pop("component", None)  # the configuration's old name in summaries of older runs
    kwargs = summary.get("model_kwargs")
    kwargs = kwargs if isinstance(kwargs, dict) else (model_kwargs or {})
    row.update({
        "trial_id": point["trial_id"], "dataset": point["dataset"], "model": model,
        "configuration": point["configuration"], "optimizer": point["optimizer"],
        "lr": float(point["lr"]), "seed": int(point["seed"]), "model_kwargs": json.dumps(kwargs, sort_keys=True),
    })
    if row.get("status") not in STATUSES:
        raise ValueError(f"trial {point['trial_id']}: summary status {row.get('status')!r} not in {STATUSES}")
    return row


def _typed(df: pd.DataFrame, schema_cols: list[str], int_columns: set[str]) -> pd.DataFrame:
    """Schema columns as their Arrow types (integers nullable: a failed trial's counts are null); extra
    columns that are counts (:data:`~raystudy.vocab.TRIAL_COUNT_EXTRAS`), integers in the file read
    (``int_columns``) or hold only integers stay (nullable) integers, not floats because one row lacks them."""
    for name in schema_cols:
        kind = SCHEMAS["trials"].field(name).type
        if str(kind) == "int64":
            df[name] = pd.to_numeric(df[name], errors="coerce").astype("Int64")
        elif str(kind) == "double":
            df[name] = pd.to_numeric(df[name], errors="coerce").astype("float64")
    for name in df.columns.difference(schema_cols):
        values = df[name].dropna()
        if name in int_columns or name in TRIAL_COUNT_EXTRAS or (
                len(values) and all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values)):
            df[name] = pd.to_numeric(df[name], errors="coerce").astype("Int64")
    return df


def _clear_sentinels(row: dict[str, Any]) -> dict[str, Any]:
    """A failed row of an older study: its ``-1`` counts become null."""
    if row.get("status") == "failed":
        for name in OLD_SENTINELS:
            if row.get(name) == -1:
                row[name] = None
    return row


class ResultTables:
    """``trials.parquet`` and ``curves.parquet`` of one study, held in memory and rewritten atomically.

    Rows are keyed by ``trial_id``: adding a trial that already has a row replaces it (a failed trial that
    succeeds on resume), so the table never holds duplicates.
    """

    def __init__(self, study_dir: str, *, repair: bool = False):
        self.study_dir = str(study_dir)
        #: (corrupt table file, where it was moved) of a ``repair`` open: rebuild with :meth:`rebuild`
        self.repaired: list[tuple[str, str]] = []
        trials = self._read("trials", repair)
        curves = self._read("curves", repair)
        self.rows: dict[str, dict[str, Any]] = {}
        self.int_columns: set[str] = set()  # integer columns of the file (pandas reads them as floats with nulls)
        if trials is not None:
            fs, p = filesystem(join(self.study_dir, "trials.parquet"))
            self.int_columns = {f.name for f in pq.read_schema(fs.open_input_file(p)) if pa.types.is_integer(f.type)}
            for rec in trials.to_dict("records"):
                self.rows[rec["trial_id"]] = _clear_sentinels(rec)
        self.curves: dict[str, pd.DataFrame] = {}
        if curves is not None and len(curves):
            for tid, df in curves.groupby("trial_id", sort=False):
                self.curves[tid] = df.reset_index(drop=True)

    def _read(self, table: str, repair: bool) -> pd.DataFrame | None:
        """The table, ``None`` if absent. An unreadable one (a torn or corrupted file) raises a
        :class:`~raystudy.io.TableError` saying how to recover, or with ``repair`` is moved aside to
        ``<table>.parquet.corrupt-<n>`` (recorded in :attr:`repaired`) and read as absent."""
        try:
            return read_result(self.study_dir, table, required=False)
        except TableError as e:
            if not repair:
                raise TableError(f"{e}; the study's tables are rebuilt from its per-trial summaries "
                                 f"(trials/<trial_id>/summary.json) when it runs again: raystudy study "
                                 f"--resume {self.study_dir}") from None
        path = join(self.study_dir, f"{table}.parquet")
        self.repaired.append((path, quarantine(path)))
        return None

    # --- queries ---------------------------------------------------------------------------------

    def status(self, trial_id: str) -> str | None:
        row = self.rows.get(trial_id)
        return None if row is None else row["status"]

    def done_ids(self) -> set[str]:
        return {tid for tid, r in self.rows.items() if r["status"] in FINAL_STATUSES}

    def counts(self, *, probes: bool = False) -> dict[str, int]:
        """Rows per status: of the finetuning trials, or (``probes=True``) of the linear probes (``LP``)."""
        out = dict.fromkeys(STATUSES, 0)
        for r in self.rows.values():
            if (r["configuration"] == LINEAR_PROBE) == probes:
                out[r["status"]] = out.get(r["status"], 0) + 1
        return out

    def trials_frame(self) -> pd.DataFrame:
        cols = columns("trials")
        if not self.rows:
            return pd.DataFrame(columns=cols + list(TRIAL_EXTRAS))
        df = pd.DataFrame(list(self.rows.values()))
        for name in TRIAL_EXTRAS:
            if name not in df:
                df[name] = None
            df[name] = df[name].fillna("{}")  # rows of older studies: kwargs unknown -> the spec's ({})
        first = cols + list(TRIAL_EXTRAS)
        df = _typed(df[first + [c for c in df.columns if c not in first]], cols, self.int_columns)
        return df.sort_values(SORT_KEYS, kind="stable").reset_index(drop=True)

    def curves_frame(self) -> pd.DataFrame:
        cols = columns("curves")
        frames = [df for tid, df in sorted(self.curves.items()) if tid in self.rows]
        if not frames:
            return pd.DataFrame(columns=cols)
        df = pd.concat(frames, ignore_index=True)
        extra = [c for c in df.columns if c not in cols]
        return df[cols + extra]

    # --- updates ---------------------------------------------------------------------------------

    def add(self, row: dict[str, Any], curves: pd.DataFrame | None = None, *, write: bool = True) -> None:
        """Insert or replace the row of ``row['trial_id']`` (and its curves), then rewrite both tables."""
        tid = row["trial_id"]
        self.rows[tid] = dict(row)
        if curves is not None:
            curves = curves.drop(columns=["trial_id"], errors="ignore")
            curves.insert(0, "trial_id", tid)
            for c in columns("curves"):
                if c not in curves:
                    curves[c] = math.nan
            self.curves[tid] = curves
        else:
            self.curves.pop(tid, None)
        if write:
            self.write()

    def write(self) -> None:
        """Rewrite ``curves.parquet`` then ``trials.parquet``, each atomically. In this order a driver killed
        in between leaves curves without a row (ignored, and the trial is picked up again by
        :meth:`reconcile`), never a final row without its curves."""
        write_result(self.curves_frame(), self.study_dir, "curves")
        write_result(self.trials_frame(), self.study_dir, "trials")

    def ingest(self, point: dict[str, Any], model: str, model_kwargs: dict[str, Any] | None = None, *,
               write: bool = True) -> dict[str, Any] | None:
        """Add the trial from its directory (``summary.json`` + ``curves.parquet``); ``None`` if unfinished."""
        summary = read_trial_summary(self.study_dir, point["trial_id"])
        if summary is None:
            return None
        row = trial_row(point, model, summary, model_kwargs)
        self.add(row, read_trial_curves(self.study_dir, point["trial_id"]), write=write)
        return row

    def reconcile(self, points: list[dict[str, Any]], model: str,
                  model_kwargs: dict[str, Any] | None = None) -> list[str]:
        """Pick up trials that finished (summary written) but never reached the tables, e.g. because the
        driver was killed in between, and final rows whose curves are missing (a driver killed between the
        two rewrites of an older version); returns their ids. Complete final rows are left alone."""
        picked = []
        for point in points:
            tid = point["trial_id"]
            if self.status(tid) in FINAL_STATUSES and (
                    tid in self.curves or not exists(join(trial_dir(self.study_dir, tid), "curves.parquet"))):
                continue
            row = self.ingest(point, model, model_kwargs, write=False)
            if row is not None and row["status"] in FINAL_STATUSES:
                picked.append(point["trial_id"])
        if picked:
            self.write()
        return picked

    def rebuild(self, datasets: list[str], model: str, model_kwargs: dict[str, Any] | None = None) -> list[str]:
        """Re-add every trial directory with a summary (``trials/<id>/summary.json`` and its curves) whose id
        is a trial of one of ``datasets``, then rewrite both tables; returns the ids. How a corrupt table
        of a :attr:`repaired` open is rebuilt (grid or Optuna: the ids come from the directories)."""
        found = []
        fs, p = filesystem(join(self.study_dir, "trials"))
        if fs.get_file_info(p).type == pafs.FileType.Directory:
            for info in fs.get_file_info(pafs.FileSelector(p)):
                point = info.type == pafs.FileType.Directory and _point_of(self.study_dir, info.base_name, datasets)
                if point and self.ingest(point, model, model_kwargs, write=False) is not None:
                    found.append(point["trial_id"])
        self.write()
        return sorted(found)


# ----------------------------------------------------------------------------------------------------
# A study for a notebook
# ----------------------------------------------------------------------------------------------------

#: the trial columns joined onto every curve row (the curve's own ``lr`` is the scheduled one)
CURVE_TRIAL_COLUMNS = ["dataset", "model", "configuration", "optimizer", "seed", "status"]


@dataclass
class Study:
    """The tables of one study directory, read for analysis (:func:`load_study`).

    ``trials``: one row per trial (``trials.parquet``; ``configuration`` also in older studies);
    ``curves``: one row per logged step of every trial, with the trial's ``dataset``, ``model``,
    ``configuration``, ``optimizer``, ``seed``, ``status`` and its learning rate as ``trial_lr`` (the
    curve's own ``lr`` is the schedule's value at that step); ``plasticity``, ``rates``, ``bounds``: the
    plasticity measurement (``None`` when the study has none); ``spec``: the stored ``spec.yaml`` as a dict.
    """

    path: str
    trials: pd.DataFrame
    curves: pd.DataFrame
    plasticity: pd.DataFrame | None = None
    rates: pd.DataFrame | None = None
    bounds: pd.DataFrame | None = None
    spec: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        parts = [f"{name}: {len(df)} rows" for name in ("trials", "curves", "plasticity", "rates", "bounds")
                 if (df := getattr(self, name)) is not None]
        probes = int((self.trials["configuration"].astype(str) == LINEAR_PROBE).sum()) if len(self.trials) else 0
        if probes:  # the linear probes' rows are counted apart, as the command line and the report count them
            parts[0] = f"trials: {len(self.trials) - probes} rows (+ {probes} rows of linear probes)"
        return f"Study({self.path!r}; {', '.join(parts)})"


def joined_curves(trials: pd.DataFrame, curves: pd.DataFrame) -> pd.DataFrame:
    """``curves`` with the trial columns of :data:`CURVE_TRIAL_COLUMNS` and ``trial_lr``, by ``trial_id``."""
    own = trials[["trial_id", *CURVE_TRIAL_COLUMNS, "lr"]].rename(columns={"lr": "trial_lr"})
    return curves.merge(own, on="trial_id", how="left", validate="many_to_one")


def load_study(study_dir: str) -> Study:
    """The tables of the study in ``study_dir`` (local path or URI), joined for a notebook: see :class:`Study`.

    Reads studies of every version (an old ``component`` column is read as ``configuration``, old ``-1``
    counts of failed trials as null). Raises :class:`raystudy.io.TableError` when there is no study there.
    """
    import yaml

    study_dir = str(study_dir)
    tables = ResultTables(study_dir)
    if not tables.rows and not exists(join(study_dir, "spec.yaml")):
        raise TableError(f"{study_dir}: no study here (neither trials.parquet nor spec.yaml)")
    trials = tables.trials_frame()
    spec_text = read_text(join(study_dir, "spec.yaml"))
    return Study(
        path=study_dir, trials=trials, curves=joined_curves(trials, tables.curves_frame()),
        plasticity=read_result(study_dir, "plasticity", required=False),
        rates=read_result(study_dir, "rates", required=False),
        bounds=read_result(study_dir, "bounds", required=False),
        spec=(yaml.safe_load(spec_text) or {}) if spec_text else {},
    )
