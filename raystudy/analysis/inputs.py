"""Read and validate the Parquet tables of a study directory (never Ray).

:func:`read_inputs` reads ``trials``, ``curves``, ``plasticity``, ``bounds`` and ``rates`` through
:func:`raystudy.io.read_result` (which already names the file and the missing columns) and checks the
values the analysis relies on. Every problem raises :class:`raystudy.io.TableError` naming the file, the
column and, where it helps, the offending rows. Absent optional tables are ``None`` and reported in
``notes``; an absent ``trials`` *and* ``plasticity`` is an error (nothing to analyse). ``trials.parquet``
of an older study (its ``configuration`` column still called ``component``) is read as today's.

Which trials count (as the paper's authors count them): a trial whose status is ``ok`` or ``diverged``
and that has a ``test_acc``. A diverged run keeps the test accuracy of its best-validation checkpoint
before the divergence (the tables flag it, ``n_diverged``); a diverged run that never reached an
evaluation, and every ``failed`` trial, is excluded. Linear-probe rows (configuration ``LP``, written
once per dataset by the probe, no optimizer or learning rate) are kept apart in ``probes``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import pandas as pd

from raystudy.io import TableError, read_result, table_path
from raystudy.vocab import COMPONENTS, FINAL_STATUSES, LINEAR_PROBE, STATUSES, TRIALS_CONFIGURATIONS, check_name

#: A run that diverged: counted with its pre-divergence best-validation test accuracy, and flagged.
DIVERGED = check_name("diverged", STATUSES, "status")
#: The statuses whose trials enter the accuracy statistics (when they have a test accuracy).
COUNTED = FINAL_STATUSES


@dataclass
class StudyInputs:
    """The tables of one study directory.

    ``counted``: the finetuning trials that enter the accuracy statistics (status ok or diverged, with a
    test accuracy; column ``diverged`` marks the latter); ``probes``: the counted linear-probe (``LP``) rows;
    ``excluded``: every other trial row.
    """

    study_dir: str
    trials: pd.DataFrame | None = None
    counted: pd.DataFrame | None = None
    probes: pd.DataFrame | None = None
    excluded: pd.DataFrame | None = None
    curves: pd.DataFrame | None = None
    plasticity: pd.DataFrame | None = None
    bounds: pd.DataFrame | None = None
    rates: pd.DataFrame | None = None
    notes: list[str] = field(default_factory=list)

    def path(self, table: str) -> str:
        return table_path(self.study_dir, table)


def only_seeds(inputs: StudyInputs, seeds) -> StudyInputs:
    """``inputs`` with the finetuning trials (all, counted and excluded) of ``seeds`` alone; the linear probes
    (one per dataset, not per seed) and the per-trial tables (curves: joined by trial id) stay whole."""
    keep = {int(s) for s in seeds}

    def of(df: pd.DataFrame | None) -> pd.DataFrame | None:
        if df is None:
            return None
        probe = df["configuration"] == LINEAR_PROBE
        return df[probe | df["seed"].isin(keep)].reset_index(drop=True)

    return replace(inputs, trials=of(inputs.trials), counted=of(inputs.counted), excluded=of(inputs.excluded))


def _fail(path: str, column: str, message: str) -> TableError:
    return TableError(f"{path}: column {column!r}: {message}")


def _rows(df: pd.DataFrame, mask: pd.Series, id_column: str | None = None, limit: int = 5) -> str:
    idx = df.index[mask.to_numpy()]
    shown = [str(df.at[i, id_column]) if id_column else str(i) for i in idx[:limit]]
    more = f" and {len(idx) - limit} more" if len(idx) > limit else ""
    label = id_column if id_column else "row"
    return f"{label} {', '.join(shown)}{more}"


def _numeric(df: pd.DataFrame, column: str, path: str) -> pd.Series:
    """``df[column]`` as float; a non-numeric value raises naming the file, column and rows."""
    converted = pd.to_numeric(df[column], errors="coerce")
    bad = converted.isna() & df[column].notna()
    if bad.any():
        raise _fail(path, column, f"non-numeric value(s) at {_rows(df, bad)}")
    return converted.astype(float)


def _not_empty(df: pd.DataFrame, path: str) -> None:
    if df.empty:
        raise TableError(f"{path}: the table is empty (no rows)")


def _known(df: pd.DataFrame, column: str, allowed: tuple[str, ...], path: str) -> None:
    unknown = sorted(set(df[column].dropna().astype(str)) - set(allowed))
    if unknown or df[column].isna().any():
        what = f"unknown value(s) {unknown}" if unknown else "missing value(s)"
        raise _fail(path, column, f"{what}; expected one of {list(allowed)}")


def _known_configurations(df: pd.DataFrame, path: str) -> None:
    """Every ``configuration`` is a name of :data:`TRIALS_CONFIGURATIONS` or a configuration expression
    (``MHA+FC1``, ``MHA@8-11``, ``auto:5%``, ``lora:r=8``: :mod:`raystudy.core.expressions`)."""
    from raystudy.core.expressions import is_configuration  # torch (raystudy.core): not for `import`

    values = df["configuration"].dropna().astype(str)
    unknown = sorted(v for v in set(values) if v not in TRIALS_CONFIGURATIONS and not is_configuration(v))
    if unknown or df["configuration"].isna().any():
        what = f"unknown value(s) {unknown}" if unknown else "missing value(s)"
        raise _fail(path, "configuration", f"{what}; expected one of {list(TRIALS_CONFIGURATIONS)} "
                                           "or a configuration expression")


def _no_nulls(df: pd.DataFrame, columns: list[str], path: str, id_column: str | None = None) -> None:
    for c in columns:
        bad = df[c].isna()
        if bad.any():
            raise _fail(path, c, f"missing value(s) at {_rows(df, bad, id_column)}")


def _check_range(df: pd.DataFrame, path: str) -> None:
    bad = (df["test_acc"] < 0) | (df["test_acc"] > 1)
    if bad.any():
        raise _fail(path, "test_acc", f"accuracies must be fractions in [0, 1]; out of range at "
                                      f"{_rows(df, bad, 'trial_id')}")


def _check_counted(counted: pd.DataFrame, path: str) -> None:
    """Counted trials need their keys, a ``test_acc`` fraction, a positive lr, and no key twice."""
    _no_nulls(counted, ["model", "dataset", "optimizer", "lr", "seed", "test_acc"], path, "trial_id")
    _check_range(counted, path)
    bad = counted["lr"] <= 0
    if bad.any():
        raise _fail(path, "lr", f"non-positive learning rate at {_rows(counted, bad, 'trial_id')}")
    key = ["model", "dataset", "optimizer", "configuration", "lr", "seed"]
    dup = counted.duplicated(key, keep=False)
    if dup.any():
        raise _fail(path, "seed", f"counted trials repeat the same {key} at {_rows(counted, dup, 'trial_id')}")


def _check_probes(probes: pd.DataFrame, path: str) -> None:
    """Probe rows need model, dataset and ``test_acc`` (no optimizer or lr), one per model, dataset and seed."""
    _no_nulls(probes, ["model", "dataset", "test_acc"], path, "trial_id")
    _check_range(probes, path)
    dup = probes.duplicated(["model", "dataset", "seed"], keep=False)
    if dup.any():
        raise _fail(path, "seed", f"{LINEAR_PROBE} rows repeat the same model, dataset and seed at "
                                  f"{_rows(probes, dup, 'trial_id')}")


def validate_trials(trials: pd.DataFrame, path: str) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Check ``trials`` and split it into (counted trials, probe rows, excluded trials).

    Every row needs a known ``configuration`` (``TRIALS_CONFIGURATIONS``: ``LP`` included). A row counts
    when its status is ok or diverged and it has a ``test_acc``; the others (failed, missing status, or
    diverged before any evaluation) are excluded. Counted trials need ``dataset, optimizer, lr, seed`` and a
    ``test_acc`` in [0, 1] (a fraction, not a percentage), and no two may share model, dataset, optimizer,
    configuration, lr and seed (it would count a run twice). Counted ``LP`` rows go to the probes.
    """
    _not_empty(trials, path)
    df = trials.reset_index(drop=True).copy()
    _known_configurations(df, path)
    for c in ("lr", "test_acc", "wall_seconds", "trainable_params"):
        df[c] = _numeric(df, c, path)
    status = df["status"].astype("string").fillna("missing")
    df["status"] = status.astype(object)
    df["diverged"] = (status == DIVERGED).to_numpy()
    keep = (status.isin(COUNTED) & df["test_acc"].notna()).to_numpy()
    probe = (df["configuration"] == LINEAR_PROBE).to_numpy()
    counted, probes = df[keep & ~probe].copy(), df[keep & probe].copy()
    _check_counted(counted, path)
    _check_probes(probes, path)
    return tuple(x.reset_index(drop=True) for x in (counted, probes, df[~keep].copy()))


def validate_plasticity(df: pd.DataFrame, path: str) -> pd.DataFrame:
    _not_empty(df, path)
    df = df.reset_index(drop=True).copy()
    _known(df, "component", COMPONENTS, path)
    for c in ("layer", "plasticity", "ci95"):
        df[c] = _numeric(df, c, path)
    _no_nulls(df, ["model", "dataset", "mode", "layer", "plasticity"], path)
    df["layer"] = df["layer"].astype(int)
    return df


def validate_bounds(df: pd.DataFrame, path: str) -> pd.DataFrame:
    _not_empty(df, path)
    df = df.reset_index(drop=True).copy()
    _known(df, "component", COMPONENTS, path)
    for c in ("layer", "bound"):
        df[c] = _numeric(df, c, path)
    _no_nulls(df, ["model", "layer"], path)
    df["layer"] = df["layer"].astype(int)
    return df


def validate_curves(df: pd.DataFrame, path: str) -> pd.DataFrame:
    _not_empty(df, path)
    df = df.reset_index(drop=True).copy()
    for c in ("step", "grad_norm", "val_loss", "train_loss"):
        df[c] = _numeric(df, c, path)
    _no_nulls(df, ["trial_id", "step"], path)
    return df


def validate_rates(df: pd.DataFrame, path: str) -> pd.DataFrame:
    _not_empty(df, path)
    df = df.reset_index(drop=True).copy()
    _known(df, "component", COMPONENTS, path)
    df["rate"] = _numeric(df, "rate", path)
    return df


def _read_optional(inputs: StudyInputs) -> None:
    """Read ``curves``, ``bounds`` and ``rates`` into ``inputs`` where present; absent ones become notes."""
    for name, check in (("curves", validate_curves), ("bounds", validate_bounds), ("rates", validate_rates)):
        df = read_result(inputs.study_dir, name, required=False)
        if name == "curves" and df is not None and df.empty:
            # A study whose trials all failed (or none evaluated yet) legitimately has no curve rows.
            inputs.notes.append("curves.parquet has no rows: the gradient-norm and validation-loss figures are "
                                "omitted.")
        elif df is not None:
            setattr(inputs, name, check(df, inputs.path(name)))
        elif name == "curves" and inputs.trials is not None:
            inputs.notes.append("No curves.parquet: the gradient-norm and validation-loss figures are omitted.")
    if inputs.bounds is None:
        inputs.notes.append("No bounds.parquet: the bounds figure is omitted.")


def read_inputs(study_dir: str | os.PathLike) -> StudyInputs:
    """Read and validate every table of ``study_dir`` for the analysis; absent optional tables become notes.

    (Not :func:`raystudy.load_study`, the notebook's :class:`~raystudy.study.results.Study` of a directory.)"""
    inputs = StudyInputs(study_dir=str(study_dir))
    trials = read_result(inputs.study_dir, "trials", required=False)
    if trials is not None:
        inputs.trials = trials
        inputs.counted, inputs.probes, inputs.excluded = validate_trials(trials, inputs.path("trials"))
    else:
        inputs.notes.append("No trials.parquet: the finetuning tables and figures are omitted.")
    plasticity = read_result(inputs.study_dir, "plasticity", required=False)
    if plasticity is not None:
        inputs.plasticity = validate_plasticity(plasticity, inputs.path("plasticity"))
    else:
        inputs.notes.append("No plasticity.parquet: the plasticity figures and the ranking agreement are omitted.")
    if trials is None and plasticity is None:
        raise TableError(f"{inputs.study_dir}: neither trials.parquet nor plasticity.parquet found; "
                         "is this a study directory?")
    _read_optional(inputs)
    return inputs
