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
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import pandas as pd
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raystudy.io import SCHEMAS, read_result, write_result

FINAL_STATUSES = ("ok", "diverged")  # a trial with one of these is done; "failed" is retried on resume
STATUSES = ("ok", "diverged", "failed")
TRIAL_FLOATS = ("lr", "best_val_acc", "test_acc", "final_val_loss", "wall_seconds")


def join(base: str, *parts: str) -> str:
    """Join path parts of a local path or URI with '/'."""
    return "/".join([str(base).rstrip("/"), *[p.strip("/") for p in parts]])


def filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    """pyarrow filesystem and in-filesystem path for a local path or URI."""
    if "://" in str(path):
        return pafs.FileSystem.from_uri(str(path))
    return pafs.LocalFileSystem(), os.path.abspath(str(path))


def exists(path: str) -> bool:
    fs, p = filesystem(path)
    return fs.get_file_info(p).type != pafs.FileType.NotFound


def read_text(path: str) -> str | None:
    fs, p = filesystem(path)
    try:
        with fs.open_input_stream(p) as f:
            return f.read().decode()
    except (FileNotFoundError, OSError):
        return None


def write_text_atomic(text: str, path: str) -> None:
    fs, p = filesystem(path)
    parent, name = p.rsplit("/", 1)
    fs.create_dir(parent, recursive=True)
    tmp = f"{parent}/.{name}.{os.getpid()}.tmp"
    with fs.open_output_stream(tmp) as f:
        f.write(text.encode())
    fs.move(tmp, p)


def trial_dir(study_dir: str, trial_id: str) -> str:
    return join(study_dir, "trials", trial_id)


def read_trial_summary(study_dir: str, trial_id: str) -> dict[str, Any] | None:
    """``trials/<id>/summary.json`` as a dict, or ``None`` when the trial has not finished."""
    text = read_text(join(trial_dir(study_dir, trial_id), "summary.json"))
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None  # a torn write of a killed run: treat the trial as unfinished


def read_trial_curves(study_dir: str, trial_id: str) -> pd.DataFrame | None:
    path = join(trial_dir(study_dir, trial_id), "curves.parquet")
    fs, p = filesystem(path)
    if fs.get_file_info(p).type == pafs.FileType.NotFound:
        return None
    return pq.read_table(p, filesystem=fs).to_pandas()


def trial_row(point: dict[str, Any], model: str, summary: dict[str, Any]) -> dict[str, Any]:
    """One ``trials.parquet`` row: the grid point's identity, then the run's summary (extra keys kept).

    ``component`` is the configuration name (one of the 5 components, All or Head), as in ARCHITECTURE.md.
    """
    row = {k: v for k, v in summary.items() if not isinstance(v, dict | list)}
    row.update({
        "trial_id": point["trial_id"], "dataset": point["dataset"], "model": model,
        "component": point["configuration"], "optimizer": point["optimizer"],
        "lr": float(point["lr"]), "seed": int(point["seed"]),
    })
    if row.get("status") not in STATUSES:
        raise ValueError(f"trial {point['trial_id']}: summary status {row.get('status')!r} not in {STATUSES}")
    return row


def failed_row(point: dict[str, Any], model: str, steps: int, batch_size: int, error: str) -> dict[str, Any]:
    """The row of a trial that failed after all retries (no metrics)."""
    nan = math.nan
    return {
        "trial_id": point["trial_id"], "dataset": point["dataset"], "model": model,
        "component": point["configuration"], "optimizer": point["optimizer"], "lr": float(point["lr"]),
        "seed": int(point["seed"]), "steps": int(steps), "batch_size": int(batch_size),
        "trainable_params": -1, "status": "failed", "best_val_acc": nan, "best_val_step": -1,
        "test_acc": nan, "final_val_loss": nan, "wall_seconds": nan, "error": str(error)[:2000],
    }


class ResultTables:
    """``trials.parquet`` and ``curves.parquet`` of one study, held in memory and rewritten atomically.

    Rows are keyed by ``trial_id``: adding a trial that already has a row replaces it (a failed trial that
    succeeds on resume), so the table never holds duplicates.
    """

    def __init__(self, study_dir: str):
        self.study_dir = str(study_dir)
        trials = read_result(self.study_dir, "trials", required=False)
        curves = read_result(self.study_dir, "curves", required=False)
        self.rows: dict[str, dict[str, Any]] = {}
        if trials is not None:
            for rec in trials.to_dict("records"):
                self.rows[rec["trial_id"]] = rec
        self.curves: dict[str, pd.DataFrame] = {}
        if curves is not None and len(curves):
            for tid, df in curves.groupby("trial_id", sort=False):
                self.curves[tid] = df.reset_index(drop=True)

    # --- queries ---------------------------------------------------------------------------------

    def status(self, trial_id: str) -> str | None:
        row = self.rows.get(trial_id)
        return None if row is None else row["status"]

    def done_ids(self) -> set[str]:
        return {tid for tid, r in self.rows.items() if r["status"] in FINAL_STATUSES}

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(STATUSES, 0)
        for r in self.rows.values():
            out[r["status"]] = out.get(r["status"], 0) + 1
        return out

    def trials_frame(self) -> pd.DataFrame:
        cols = list(SCHEMAS["trials"])
        if not self.rows:
            return pd.DataFrame(columns=cols)
        df = pd.DataFrame(list(self.rows.values()))
        extra = [c for c in df.columns if c not in cols]
        df = df[cols + extra]
        for c in TRIAL_FLOATS:
            df[c] = pd.to_numeric(df[c], errors="coerce").astype("float64")
        for c in ("seed", "steps", "batch_size", "trainable_params", "best_val_step"):
            df[c] = pd.to_numeric(df[c], errors="coerce").fillna(-1).astype("int64")
        return df.sort_values(["dataset", "component", "optimizer", "lr", "seed"], kind="stable").reset_index(drop=True)

    def curves_frame(self) -> pd.DataFrame:
        cols = list(SCHEMAS["curves"])
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
            for c in SCHEMAS["curves"]:
                if c not in curves:
                    curves[c] = math.nan
            self.curves[tid] = curves
        else:
            self.curves.pop(tid, None)
        if write:
            self.write()

    def write(self) -> None:
        """Rewrite ``trials.parquet`` then ``curves.parquet``, each atomically."""
        write_result(self.trials_frame(), self.study_dir, "trials")
        write_result(self.curves_frame(), self.study_dir, "curves")

    def ingest(self, point: dict[str, Any], model: str, *, write: bool = True) -> dict[str, Any] | None:
        """Add the trial from its directory (``summary.json`` + ``curves.parquet``); ``None`` if unfinished."""
        summary = read_trial_summary(self.study_dir, point["trial_id"])
        if summary is None:
            return None
        row = trial_row(point, model, summary)
        self.add(row, read_trial_curves(self.study_dir, point["trial_id"]), write=write)
        return row

    def reconcile(self, points: list[dict[str, Any]], model: str) -> list[str]:
        """Pick up trials that finished (summary written) but never reached the tables, e.g. because the
        driver was killed in between; returns their ids. Rows already final are left alone."""
        picked = []
        for point in points:
            if self.status(point["trial_id"]) in FINAL_STATUSES:
                continue
            row = self.ingest(point, model, write=False)
            if row is not None and row["status"] in FINAL_STATUSES:
                picked.append(point["trial_id"])
        if picked:
            self.write()
        return picked
