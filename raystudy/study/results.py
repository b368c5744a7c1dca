"""A study directory and its result tables, kept consistent while trials finish.

Layout of ``<out>/`` (local path or pyarrow URI)::

    spec.yaml            the resolved study spec (what was run)
    trials.parquet       one row per grid point (trial_id unique), rewritten atomically as trials finish
    curves.parquet/      the training curves of every finished trial, with its trial_id: a Parquet dataset
                         of one file per trial (part-<trial_id>.parquet), read as one table
    changes.parquet/     what finetuning changed in every finished trial (weight change per component and
                         block, CKA per block; raystudy.core.change), a dataset of one file per trial alike
    plasticity.parquet   rates.parquet  bounds.parquet      the plasticity measurement
    trials/<trial_id>/   one finetuning run: summary.json, curves.parquet, changes.parquet, tb/ (its TensorBoard)
    tb/<trial_id>/       the TensorBoard run of every finished trial (``tensorboard --logdir <out>/tb``); the
                         study's HParams experiment in ``tb/`` itself (:mod:`raystudy.study.hparams`)
    train/<trial_id>/    Ray Train's run storage (checkpoints), so an interrupted trial resumes from them
    tune/<launch>/       one Tune experiment per launch (``restore_tuner`` / ``ResultGrid``)
    analysis/            tables, statistical tests, figures and report.html

The per-trial ``summary.json`` is the source of truth: the study tables are a projection of the trial
directories and can always be rebuilt from them (:meth:`ResultTables.reconcile`), so a driver killed
between a trial's end and the table rewrite loses nothing.

A finished trial costs the same at the 10,000th trial as at the 100th: its curves are one new file of the
``curves.parquet/`` dataset (``pd.read_parquet``, ``pyarrow.dataset``, DuckDB and Polars read the folder as
one table), and ``trials.parquet``, one file, is rewritten at most every ``period`` seconds
(:data:`TABLE_PERIOD` while a study runs) and at :meth:`ResultTables.flush`. Every file is written to a
temporary name and renamed, so a crash never leaves a torn table. Studies written before keep a single
``curves.parquet`` file: it is read as it is, and split into the dataset at the first write.

A ``trials.parquet`` row is :func:`trial_row` of a run summary, also for a trial that failed after all its
retries (its summary is :func:`raystudy.core.finetune.driver.failed_summary`: NaN / null results, never a
``-1`` sentinel). Every row carries the model's constructor arguments as a JSON string (``model_kwargs``).
Studies written before the vocabulary was unified call the ``configuration`` column ``component``:
:func:`raystudy.io.read_result` renames it on read, so they load and resume.

:func:`load_study` reads a study directory for a notebook (``raystudy.load_study(dir)``).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raystudy.io import TableError, read_result, write_result
from raystudy.storage import (
    delete_dir,
    exists,
    filesystem,
    join,
    move_aside,
    read_bytes,
    read_text,
    write_parquet_atomic,
)
from raystudy.study.points import grid_point, phase_of
from raystudy.vocab import (
    FINAL_STATUSES,
    LINEAR_PROBE,
    PHASES,
    RENAMED_COLUMNS,
    RUN_CURVE_COLUMNS,
    SCHEMAS,
    STATUSES,
    TRIAL_COUNT_EXTRAS,
    columns,
    control_rows,
    pretrained_rows,
)

#: columns every row has beyond the schema's: the model's constructor arguments (JSON, sorted keys)
TRIAL_EXTRAS = ("model_kwargs",)
#: integer result columns that older studies filled with -1 when a trial failed (now null)
OLD_SENTINELS = ("trainable_params", "best_val_step", "steps_completed")
#: the grid's axes: the order of ``trials.parquet``
SORT_KEYS = ["dataset", "configuration", "optimizer", "lr", "seed"]
#: seconds between two rewrites of ``trials.parquet`` while a study's trials finish: one rewrite (about
#: 40 ms at 10,000 rows on a laptop core) per 5 s at most takes under 1% of Tune's event loop at any study
#: size, and the table a reader sees is at most 5 s behind the trial directories
TABLE_PERIOD = 5.0
#: the curve columns of every part file, and their types: each part has the same schema, so a reader that
#: takes the dataset's schema from one file (``pd.read_parquet``) gets every column of every trial
CURVE_TYPES = {**{f.name: f.type for f in SCHEMAS["curves"]},
               **{c: pa.float64() for c in RUN_CURVE_COLUMNS if c not in SCHEMAS["curves"].names}}
#: the per-trial tables written as a dataset of one part file per trial, and each part's columns and types
PART_TYPES = {"curves": CURVE_TYPES, "changes": {f.name: f.type for f in SCHEMAS["changes"]}}

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
    ``error``, so that the study goes on and runs that trial again; so does one that is not UTF-8 text."""
    path = join(trial_dir(study_dir, trial_id), "summary.json")
    data = read_bytes(path)
    if data is None:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return _malformed(path, f"not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})")
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


def read_trial_curves(study_dir: str, trial_id: str, table: str = "curves") -> pa.Table | None:
    """The trial's own ``curves.parquet`` (or another ``table`` of its run: ``changes``) as an Arrow table
    (``None`` when it wrote none)."""
    path = join(trial_dir(study_dir, trial_id), f"{table}.parquet")
    if not exists(path):
        return None
    fs, p = filesystem(path)
    return pq.read_table(p, filesystem=fs)


def _point_of(study_dir: str, tid: str, datasets: list[str]) -> dict[str, Any] | None:
    """The grid point of trial directory ``tid`` from its summary (configuration, optimizer, lr, seed) and
    the one dataset of ``datasets`` whose trial id it is; ``None`` when there is none."""
    s = read_trial_summary(study_dir, tid)
    try:
        values = (s.get("configuration") or s["component"], s["optimizer"], float(s["lr"]), int(s["seed"]))
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    for dataset, phase in itertools.product(datasets, PHASES):
        point = grid_point(dataset, *values, phase=phase)
        if point["trial_id"] == tid:
            return point
    return None


def trial_row(point: dict[str, Any], model: str, summary: dict[str, Any],
              model_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One ``trials.parquet`` row: the grid point's identity, then the run's summary (extra keys kept).

    ``configuration`` is what the trial trains (:data:`raystudy.vocab.CONFIGURATIONS`); ``phase`` the point's
    (:func:`~raystudy.study.points.phase_of`: ``search``, or ``final`` for a final fit's trial). ``model_kwargs``
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
        "phase": phase_of(point),
    })
    warnings = summary.get("checkpoint_warnings")
    if isinstance(warnings, list) and warnings:  # the terminal names the first checkpoint moved aside
        row["checkpoint_warning"] = str(warnings[0])
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


def part_name(trial_id: str) -> str:
    """The file of one trial's curves in the ``curves.parquet/`` dataset (``part-``: never ``_`` or ``.``
    first, the prefixes dataset readers skip)."""
    return f"part-{trial_id}.parquet"


def _part_table(trial_id: str, curves: pd.DataFrame | pa.Table, table_name: str = "curves") -> pa.Table:
    """One trial's curves (or rows of another per-trial table: ``changes``) as a part file holds them:
    ``trial_id`` first, every column of :data:`PART_TYPES` (NaN where the run logged none) with its type, the
    run's other columns after. Built in Arrow (a finished trial's own file is read as Arrow): a few columns
    of 120 rows cost well under a millisecond."""
    types = PART_TYPES[table_name]
    table = curves if isinstance(curves, pa.Table) else pa.Table.from_pandas(curves, preserve_index=False)
    renamed = {old: new for old, new in RENAMED_COLUMNS.get(table_name, {}).items()  # an older run's own file
               if old in table.column_names and new not in table.column_names}
    table = table.rename_columns([renamed.get(c, c) for c in table.column_names]) if renamed else table
    n, have = table.num_rows, set(table.column_names)
    columns = {"trial_id": pa.array([trial_id] * n, types["trial_id"])}
    for name, kind in types.items():
        if name != "trial_id":
            columns[name] = table[name].cast(kind) if name in have else pa.array(np.full(n, np.nan), kind)
    for name in table.column_names:
        if name not in columns:
            columns[name] = table[name]
    return pa.table(columns)


class ResultTables:
    """``trials.parquet``, ``curves.parquet/`` and ``changes.parquet/`` of one study: the rows held in memory,
    the curves and changes on disk (one part file per trial each).

    Rows are keyed by ``trial_id``: adding a trial that already has a row replaces it (a failed trial that
    succeeds on resume), so the table never holds duplicates. ``period``: the least time in seconds between
    two rewrites of ``trials.parquet`` (0: at every :meth:`add`; a study runs with :data:`TABLE_PERIOD`);
    ``clock`` tells the time for it.
    """

    def __init__(self, study_dir: str, *, repair: bool = False, period: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self.study_dir = str(study_dir)
        self.period, self.clock = period, clock
        #: (corrupt table file, where it was moved) of a ``repair`` open: rebuild with :meth:`rebuild`
        self.repaired: list[tuple[str, str]] = []
        self.rows: dict[str, dict[str, Any]] = {}
        self.int_columns: set[str] = set()  # integer columns of the file (pandas reads them as floats with nulls)
        trials = self._read("trials", repair)
        if trials is not None:
            fs, p = filesystem(join(self.study_dir, "trials.parquet"))
            self.int_columns = {f.name for f in pq.read_schema(fs.open_input_file(p)) if pa.types.is_integer(f.type)}
            for rec in trials.to_dict("records"):
                self.rows[rec["trial_id"]] = _clear_sentinels(rec)
        #: rows added since ``trials.parquet`` was last written, and when that was (by ``clock``)
        self.deferred, self.written_at = False, -math.inf
        #: an old study's single ``curves.parquet`` file (split into the dataset at the first write)
        self.single_file = False
        #: the trials that have curves in ``curves.parquet``, changes in ``changes.parquet``
        self.curve_ids = self._curve_ids(repair)
        self.change_ids = self._part_ids(self.changes_path, repair)

    @property
    def curves_path(self) -> str:
        return join(self.study_dir, "curves.parquet")

    @property
    def changes_path(self) -> str:
        return join(self.study_dir, "changes.parquet")

    def _part_ids(self, path: str, repair: bool) -> set[str]:
        """The trial ids of the part files in the dataset folder ``path`` (one listing, no file read); a
        folder without parts (a writer killed in its first part) is removed with ``repair``."""
        fs, p = filesystem(path)
        if fs.get_file_info(p).type != pafs.FileType.Directory:
            return set()
        names = (i.base_name for i in fs.get_file_info(pafs.FileSelector(p)))
        ids = {n[len("part-"):-len(".parquet")] for n in names if n.startswith("part-") and n.endswith(".parquet")}
        if repair and not ids:
            delete_dir(path)
        return ids

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

    def _curve_ids(self, repair: bool) -> set[str]:
        """The trial ids of ``curves.parquet``: the part files' names (one listing, no file read), or the
        ``trial_id`` column of an old study's single file."""
        fs, p = filesystem(self.curves_path)
        kind = fs.get_file_info(p).type
        if kind == pafs.FileType.Directory:
            return self._part_ids(self.curves_path, repair)
        old = self._read("curves", repair) if kind == pafs.FileType.File else None
        self.single_file = old is not None
        return set() if old is None else set(old["trial_id"])

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
        for name in cols:  # a summary without a column (an older or a hand-written run) has it null
            if name not in df:
                df[name] = None
        for name in TRIAL_EXTRAS:
            if name not in df:
                df[name] = None
            df[name] = df[name].fillna("{}")  # rows of older studies: kwargs unknown -> the spec's ({})
        first = cols + list(TRIAL_EXTRAS)
        df = _typed(df[first + [c for c in df.columns if c not in first]], cols, self.int_columns)
        return df.sort_values(SORT_KEYS, kind="stable").reset_index(drop=True)

    def curves_frame(self) -> pd.DataFrame:
        """The curves of the trials that have a row, by ``trial_id`` (read from disk: either layout)."""
        cols = columns("curves")
        df = read_result(self.study_dir, "curves", required=False) if self.curve_ids else None
        if df is None:
            return pd.DataFrame(columns=cols)
        df = df[df["trial_id"].isin(list(self.rows))].sort_values("trial_id", kind="stable")
        return df[cols + [c for c in df.columns if c not in cols]].reset_index(drop=True)

    def changes_frame(self) -> pd.DataFrame:
        """What finetuning changed in the trials that have a row (``changes.parquet/``), by ``trial_id``."""
        cols = columns("changes")
        df = read_result(self.study_dir, "changes", required=False) if self.change_ids else None
        if df is None:
            return pd.DataFrame(columns=cols)
        df = df[df["trial_id"].isin(list(self.rows))].sort_values("trial_id", kind="stable")
        return df[cols].reset_index(drop=True)

    # --- updates ---------------------------------------------------------------------------------

    def add(self, row: dict[str, Any], curves: pd.DataFrame | pa.Table | None = None,
            changes: pd.DataFrame | pa.Table | None = None) -> None:
        """Insert or replace the row of ``row['trial_id']`` and write its curves and changes (one part file
        each, the same cost at any size of the study); ``trials.parquet`` is rewritten when ``period``
        seconds have passed since it last was, else by a later :meth:`add` or :meth:`flush`."""
        self._put(row, curves, changes)
        if self.clock() - self.written_at >= self.period:
            self.flush()

    def flush(self) -> None:
        """Rewrite ``trials.parquet`` (atomically) if rows were added since it was last written. The curves
        of those rows are on disk already: a driver killed before leaves curves without a row (ignored, and
        the trial picked up again by :meth:`reconcile`), never a final row without its curves."""
        if self.deferred:
            write_result(self.trials_frame(), self.study_dir, "trials")
            self.deferred, self.written_at = False, self.clock()

    def _put(self, row: dict[str, Any], curves: pd.DataFrame | pa.Table | None,
             changes: pd.DataFrame | pa.Table | None = None) -> None:
        """Hold the row (written by :meth:`flush`) and write or remove its trial's part files now."""
        tid = row["trial_id"]
        self.rows[tid], self.deferred = dict(row), True
        if self.single_file:
            self._split_single_file()
        self._put_part("curves", tid, curves)
        self._put_part("changes", tid, changes)

    def _parts(self, table: str) -> tuple[str, set[str]]:
        """The dataset folder of the per-trial ``table`` and the ids of its part files."""
        return (self.curves_path, self.curve_ids) if table == "curves" else (self.changes_path, self.change_ids)

    def _put_part(self, table: str, tid: str, rows: pd.DataFrame | pa.Table | None) -> None:
        """Write the trial's part file of ``table`` (``curves`` | ``changes``), or remove it without rows."""
        path, ids = self._parts(table)
        if rows is not None:
            write_parquet_atomic(join(path, part_name(tid)), _part_table(tid, rows, table))
            ids.add(tid)
        elif tid in ids:
            self._drop_part(tid, table)

    def _drop_part(self, trial_id: str, table: str = "curves") -> None:
        """Delete the trial's part file of ``table``, and the dataset's folder once it holds none (an empty
        folder is no table a reader can read)."""
        path, ids = self._parts(table)
        fs, p = filesystem(path)
        fs.delete_file(f"{p}/{part_name(trial_id)}")
        ids.discard(trial_id)
        if not ids:
            delete_dir(path)

    def _split_single_file(self) -> None:
        """An old study's single ``curves.parquet`` becomes the dataset: the file is moved aside, each of its
        trials written as a part, then the file deleted. A driver killed in between leaves a dataset with
        some parts (:meth:`reconcile` takes the others from the trial directories) and the moved file."""
        old = read_result(self.study_dir, "curves")
        aside = move_aside(self.curves_path, "single")
        for tid, df in old.groupby("trial_id", sort=False):
            write_parquet_atomic(join(self.curves_path, part_name(tid)), _part_table(tid, df))
        fs, p = filesystem(aside)
        fs.delete_file(p)
        self.single_file = False

    def read_trial(self, point: dict[str, Any], model: str, model_kwargs: dict[str, Any] | None = None
                   ) -> tuple[dict[str, Any], pa.Table | None, pa.Table | None] | None:
        """The trial's row, curves and changes from its directory (``summary.json``, ``curves.parquet``,
        ``changes.parquet``; either table ``None`` when absent); ``None`` if it has not finished."""
        tid = point["trial_id"]
        summary = read_trial_summary(self.study_dir, tid)
        if summary is None:
            return None
        return (trial_row(point, model, summary, model_kwargs), read_trial_curves(self.study_dir, tid),
                read_trial_curves(self.study_dir, tid, "changes"))

    def ingest(self, point: dict[str, Any], model: str, model_kwargs: dict[str, Any] | None = None) -> dict | None:
        """:meth:`add` the trial from its directory (:meth:`read_trial`); returns its row, ``None`` if unfinished."""
        found = self.read_trial(point, model, model_kwargs)
        if found is not None:
            self.add(*found)
        return None if found is None else found[0]

    def reconcile(self, points: list[dict[str, Any]], model: str,
                  model_kwargs: dict[str, Any] | None = None) -> list[str]:
        """Pick up trials that finished (summary written) but never reached the tables, e.g. because the
        driver was killed in between, and final rows whose curves are missing (a driver killed between the
        two rewrites of an older version); returns their ids. Complete final rows are left alone."""
        picked = []
        for point in points:
            tid = point["trial_id"]
            if self.status(tid) in FINAL_STATUSES and all(
                    tid in ids or not exists(join(trial_dir(self.study_dir, tid), f"{table}.parquet"))
                    for table, ids in (("curves", self.curve_ids), ("changes", self.change_ids))):
                continue
            found = self.read_trial(point, model, model_kwargs)
            if found is not None:
                self._put(*found)
                if found[0]["status"] in FINAL_STATUSES:
                    picked.append(tid)
        if picked:
            self.flush()
        return picked

    def rebuild(self, datasets: list[str], model: str, model_kwargs: dict[str, Any] | None = None) -> list[str]:
        """Re-add every trial directory with a summary (``trials/<id>/summary.json`` and its curves) whose id
        is a trial of one of ``datasets``, then rewrite ``trials.parquet``; returns the ids. How a corrupt
        table of a :attr:`repaired` open is rebuilt (grid or Optuna: the ids come from the directories)."""
        found = []
        fs, p = filesystem(join(self.study_dir, "trials"))
        if fs.get_file_info(p).type == pafs.FileType.Directory:
            for info in fs.get_file_info(pafs.FileSelector(p)):
                point = info.type == pafs.FileType.Directory and _point_of(self.study_dir, info.base_name, datasets)
                trial = point and self.read_trial(point, model, model_kwargs)
                if trial:
                    self._put(*trial)
                    found.append(point["trial_id"])
        self.deferred = True  # written even when empty: the table exists again
        self.flush()
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
    ``configuration``, ``optimizer``, ``seed``, ``status`` and its base learning rate ``lr`` (``lr_now``: the
    schedule's value at that step); ``plasticity``, ``rates``, ``bounds``: the
    plasticity measurement with the model's own weights (``None`` when the study has none); ``control``: the
    controls' plasticity rows (``weights = random_init``, and ``random_blocks``: the component control, where
    measured; ``None`` without a control); ``spec``: the
    stored ``spec.yaml`` as a dict;
    ``changes``: what finetuning changed, one row per (trial, layer, component, measure), with the same
    trial columns as ``curves`` (``None`` when no trial recorded any).
    """

    path: str
    trials: pd.DataFrame
    curves: pd.DataFrame
    plasticity: pd.DataFrame | None = None
    rates: pd.DataFrame | None = None
    bounds: pd.DataFrame | None = None
    spec: dict[str, Any] = field(default_factory=dict)
    changes: pd.DataFrame | None = None
    control: pd.DataFrame | None = None

    def __repr__(self) -> str:
        parts = [f"{name}: {len(df)} rows" for name in ("trials", "curves", "changes", "plasticity", "control", "rates",
                                                                "bounds")
                 if (df := getattr(self, name)) is not None]
        probes = int((self.trials["configuration"].astype(str) == LINEAR_PROBE).sum()) if len(self.trials) else 0
        if probes:  # the linear probes' rows are counted apart, as the command line and the report count them
            parts[0] = f"trials: {len(self.trials) - probes} rows (+ {probes} rows of linear probes)"
        return f"Study({self.path!r}; {', '.join(parts)})"


def joined_curves(trials: pd.DataFrame, curves: pd.DataFrame) -> pd.DataFrame:
    """``curves`` (or the ``changes`` table) with the trial columns of :data:`CURVE_TRIAL_COLUMNS` and the
    trial's base learning rate ``lr``, by ``trial_id``."""
    own = trials[["trial_id", *CURVE_TRIAL_COLUMNS, "lr"]]
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
    changes = tables.changes_frame() if tables.change_ids else None
    spec_text = read_text(join(study_dir, "spec.yaml"))
    plasticity = read_result(study_dir, "plasticity", required=False)
    return Study(
        path=study_dir, trials=trials, curves=joined_curves(trials, tables.curves_frame()),
        plasticity=pretrained_rows(plasticity), control=control_rows(plasticity),
        rates=pretrained_rows(read_result(study_dir, "rates", required=False)),
        bounds=read_result(study_dir, "bounds", required=False),
        spec=(yaml.safe_load(spec_text) or {}) if spec_text else {},
        changes=None if changes is None else joined_curves(trials, changes),
    )
