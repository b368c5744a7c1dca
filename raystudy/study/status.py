"""A study's progress read from its directory alone (``raystudy status DIR``): no Ray, no driver needed.

A trial is *final* (``ok``, ``diverged``, ``failed``) once ``trials.parquet`` holds it as done (``ok`` or
``diverged``: the record a launch goes by, whatever its summary holds), once its ``trials/<id>/summary.json`` is
written or, without one, once ``trials.parquet`` holds its row (the driver's row of a trial that failed before its
run wrote a summary),
*running* while its folder exists without one and the study's driver holds ``study.lock``; without a live driver the
same trial is *resumable* when its run left a complete checkpoint (``train/<id>/checkpoint_*/.complete``: ``--resume``
continues it from there) and *unfinished* otherwise (``--resume`` starts it again); it is *pending* before either
folder exists. The ETA is the remaining trials times the median wall time of the final ones, divided by the
number running (one when none runs).
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
from dataclasses import asdict, dataclass, field

import pandas as pd

from raystudy.core.finetune.checkpoint import checkpoint_steps
from raystudy.io import read_result, table_path
from raystudy.storage import exists, is_uri, join, read_text, subdirs
from raystudy.study.lock import LOCK_FILE, describe, holder_alive
from raystudy.study.persist import load_study_spec
from raystudy.study.progress import fmt_seconds
from raystudy.study.results import read_trial_summary, trial_dir
from raystudy.vocab import FINAL_STATUSES, STATUSES

log = logging.getLogger(__name__)

#: how many of the latest failed trials :func:`study_status` reports
LAST_ERRORS = 3
#: the states of :func:`study_status`, final ones first, and those still to run (the ETA's)
STATES = ("ok", "diverged", "failed", "running", "resumable", "unfinished", "pending")
LEFT = ("running", "resumable", "unfinished", "pending")


@dataclass
class StudyStatus:
    """What :func:`study_status` found: per state the trial ids (grid order), the driver, the ETA (seconds,
    NaN when unknown) and the latest errors ``[(trial_id, first line)]``."""

    name: str
    study_dir: str
    trials: dict[str, list[str]] = field(default_factory=dict)
    driver: str = "none"
    eta_seconds: float = math.nan
    median_trial_seconds: float = math.nan
    last_errors: list[tuple[str, str]] = field(default_factory=list)

    def count(self, state: str) -> int:
        return len(self.trials.get(state, []))

    def lines(self) -> list[str]:
        """The report :func:`raystudy status <raystudy.commands.status>` prints."""
        total = sum(len(v) for v in self.trials.values())
        final = self.count("ok") + self.count("diverged")
        out = [f"Study {self.name!r} ({self.study_dir}): {final}/{total} trials done "
               f"(ok {self.count('ok')}, diverged {self.count('diverged')}), failed {self.count('failed')}, "
               f"running {self.count('running')}, resumable {self.count('resumable')}, "
               f"unfinished {self.count('unfinished')}, pending {self.count('pending')}",
               f"  driver: {self.driver}"]
        if any(self.count(s) for s in LEFT):
            out.append(f"  ETA {fmt_seconds(self.eta_seconds)} (median trial {fmt_seconds(self.median_trial_seconds)}, "
                       f"{max(1, self.count('running'))} at a time)")
        if self.last_errors:
            out.append("  last errors:")
            out += [f"    {tid}: {line}" for tid, line in self.last_errors]
        return out

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str)


def _driver(study_dir: str) -> tuple[str, bool]:
    """The lock holder's description and whether it is running (a holder on another host counts as running)."""
    text = read_text(join(study_dir, LOCK_FILE))
    if text is None:
        return "none (no launch running)", False
    try:
        holder = json.loads(text)
    except ValueError:
        return f"unknown ({join(study_dir, LOCK_FILE)} is unreadable)", False
    alive = holder_alive(holder)
    if alive is False:
        return f"none (the last launch, {describe(holder)}, is gone)", False
    return f"running ({describe(holder)})" + ("" if alive else ", another host: not checked"), True


def _table_rows(study_dir: str) -> dict[str, dict]:
    """``trials.parquet``'s rows by trial id (none when it is absent or unreadable: the summaries still say)."""
    try:
        df = read_result(study_dir, "trials", required=False)
    except Exception as e:  # a torn or foreign table: the next launch repairs it; status only reads
        log.warning("%s: %s; read from the trials' summaries alone", table_path(study_dir, "trials"), e)
        return {}
    if df is None:
        return {}
    return {r["trial_id"]: {k: (None if v is pd.NA else v) for k, v in r.items()}
            for r in df.to_dict("records") if r.get("status") in STATUSES}


def _record(study_dir: str, tid: str, row: dict | None, running: bool) -> dict | None:
    """What says how trial ``tid`` ended, or None while it has not: its ``trials.parquet`` row when that says
    it is done (``ok``, ``diverged``: the record a launch goes by, which never runs the trial again, whatever
    its ``summary.json`` holds), else its summary, else a row without a summary (the driver's record of a
    trial that failed early) unless the trial is running again."""
    if row is not None and row.get("status") in FINAL_STATUSES:
        return row
    summary = read_trial_summary(study_dir, tid)
    return row if summary is None and not running else summary


def study_status(study_dir: str | os.PathLike) -> StudyStatus:
    """The state of every grid trial of the study in ``study_dir`` (see the module docstring)."""
    study_dir = str(study_dir)
    spec = load_study_spec(study_dir, what=None)
    driver, live = _driver(study_dir)
    status = StudyStatus(spec.name, study_dir, {s: [] for s in STATES}, driver)
    started = set(subdirs(join(study_dir, "trials"))) | set(subdirs(join(study_dir, "train")))
    rows = _table_rows(study_dir)
    walls, failed = [], []
    for point in spec.grid():
        tid = point["trial_id"]
        summary = _record(study_dir, tid, rows.get(tid), live and tid in started)
        if summary is not None:
            state = summary.get("status", "failed")
            status.trials[state if state in status.trials else "failed"].append(tid)
            wall = summary.get("wall_seconds")
            if isinstance(wall, int | float) and math.isfinite(wall) and state != "failed":
                walls.append(float(wall))
            if state == "failed":
                path = join(trial_dir(study_dir, tid), "summary.json")
                mtime = 0.0 if is_uri(path) or not exists(path) else os.path.getmtime(path)
                error = summary.get("error")
                error = error if isinstance(error, str) and error else "no error recorded"
                failed.append((mtime, tid, error.splitlines()[0][:200]))
        elif tid in started and live:
            status.trials["running"].append(tid)
        elif checkpoint_steps(join(study_dir, "train", tid)):
            status.trials["resumable"].append(tid)
        elif tid in started:
            status.trials["unfinished"].append(tid)
        else:
            status.trials["pending"].append(tid)
    status.last_errors = [(tid, line) for _, tid, line in sorted(failed, reverse=True)[:LAST_ERRORS]]
    if walls:
        status.median_trial_seconds = statistics.median(walls)
        remaining = sum(status.count(s) for s in LEFT)
        status.eta_seconds = remaining * status.median_trial_seconds / max(1, status.count("running"))
    return status
