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

Phases (:data:`raystudy.vocab.PHASES`): rows whose ``phase`` is ``final`` (a benchmark's refit at the
val-chosen lr on train + val) are kept apart in ``final``, so every table of the lr search reads the
``search`` rows alone (a study without the column: every row is a search row).

Weights (:data:`raystudy.vocab.WEIGHTS`): ``plasticity`` and ``rates`` hold the rows measured with the
model's own weights (``pretrained``; a table without the column predates the control and is all
``pretrained``), so every table and figure about the measurement reads those; ``control`` holds the
controls' plasticity rows, ``weights`` telling them apart (``random_init``, and ``random_blocks`` where the
table has the component control; ``None`` without a control), read by :mod:`raystudy.analysis.control` and
the depth figure.

Several study directories (:func:`read_studies`): their tables concatenated, column ``study`` naming each
row's directory; a trial id, or a key (model, dataset, configuration, optimizer, lr, seed, phase), in two of
them is an error naming both, unless the rows are identical (then kept once).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import pandas as pd

from raystudy import storage
from raystudy.analysis.options import tables_problem
from raystudy.io import TableError, read_result, table_path
from raystudy.vocab import (
    BOUNDS_FORMULAS,
    COMPONENTS,
    FINAL_STATUSES,
    LINEAR_PROBE,
    PHASES,
    STATUSES,
    TRIALS_CONFIGURATIONS,
    check_name,
    columns,
    control_rows,
    pretrained_rows,
)

#: A run that diverged: counted with its pre-divergence best-validation test accuracy, and flagged.
DIVERGED = check_name("diverged", STATUSES, "status")
#: The statuses whose trials enter the accuracy statistics (when they have a test accuracy).
COUNTED = FINAL_STATUSES
SEARCH, FINAL = (check_name(p, PHASES, "phase") for p in ("search", "final"))
#: What makes a trial one run: two rows of one key in two studies are the same run.
RUN_KEY = ["model", "dataset", "configuration", "optimizer", "lr", "seed", "phase"]


@dataclass
class StudyInputs:
    """The tables of one study directory.

    ``counted``: the finetuning trials that enter the accuracy statistics (status ok or diverged, with a
    test accuracy; column ``diverged`` marks the latter); ``probes``: the counted linear-probe (``LP``) rows;
    ``excluded``: every other trial row; ``final``: the counted ``final``-phase rows (none: ``None``), which
    no other table reads. ``study_dirs``: the directories read (one, or several for :func:`read_studies`).
    """

    study_dir: str
    trials: pd.DataFrame | None = None
    final: pd.DataFrame | None = None
    study_dirs: list[str] = field(default_factory=list)
    counted: pd.DataFrame | None = None
    probes: pd.DataFrame | None = None
    excluded: pd.DataFrame | None = None
    curves: pd.DataFrame | None = None
    plasticity: pd.DataFrame | None = None
    control: pd.DataFrame | None = None
    bounds: pd.DataFrame | None = None
    rates: pd.DataFrame | None = None
    pretraining: pd.DataFrame | None = None  # plasticity along the pretraining (plasticity_pretraining.parquet)
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

    return replace(inputs, trials=of(inputs.trials), counted=of(inputs.counted), excluded=of(inputs.excluded),
                   final=of(inputs.final))


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


def split_phases(trials: pd.DataFrame, path: str) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """``(search rows, final rows or None)`` of ``trials`` by column ``phase`` (absent: all search rows; a
    missing value counts as search); an unknown phase names the file and the rows."""
    if "phase" not in trials.columns:
        return trials, None
    phase = trials["phase"].astype("string").fillna(SEARCH)
    bad = ~phase.isin(PHASES)
    if bad.any():
        raise _fail(path, "phase", f"unknown value(s) {sorted(set(phase[bad]))} at "
                                   f"{_rows(trials, bad, 'trial_id')}; expected one of {list(PHASES)}")
    final = (phase == FINAL).to_numpy()
    rows = trials.assign(phase=phase.astype(object))
    return rows[~final].reset_index(drop=True), (rows[final].reset_index(drop=True) if final.any() else None)


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
    if "bounds" in df.columns:  # which formulas (a table written before the column reads as the paper's)
        _known(df, "bounds", BOUNDS_FORMULAS, path)
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
            setattr(inputs, name, check(pretrained_rows(df) if name == "rates" else df, inputs.path(name)))
        elif name == "curves" and inputs.trials is not None:
            inputs.notes.append("No curves.parquet: the gradient-norm and validation-loss figures are omitted.")
    if inputs.bounds is None:
        inputs.notes.append("No bounds.parquet: the bounds figure is omitted.")
    inputs.pretraining = read_result(inputs.study_dir, "plasticity_pretraining", required=False)  # demos only


def read_inputs(study_dir: str | os.PathLike) -> StudyInputs:
    """Read and validate every table of ``study_dir`` for the analysis; absent optional tables become notes.

    (Not :func:`raystudy.load_study`, the notebook's :class:`~raystudy.study.results.Study` of a directory.)"""
    inputs = StudyInputs(study_dir=str(study_dir), study_dirs=[str(study_dir)])
    trials = read_result(inputs.study_dir, "trials", required=False)
    if trials is not None:
        trials, final = split_phases(trials, inputs.path("trials"))
        inputs.trials = trials
        inputs.counted, inputs.probes, inputs.excluded = validate_trials(trials, inputs.path("trials"))
        if final is not None:
            inputs.final = validate_trials(final, inputs.path("trials") + " (phase final)")[0]
    else:
        inputs.notes.append("No trials.parquet: the finetuning tables and figures are omitted.")
    plasticity = read_result(inputs.study_dir, "plasticity", required=False)
    if plasticity is not None:
        plasticity = validate_plasticity(plasticity, inputs.path("plasticity"))
        inputs.plasticity, inputs.control = pretrained_rows(plasticity), control_rows(plasticity)
    else:
        inputs.notes.append("No plasticity.parquet: the plasticity figures and the ranking agreement are omitted.")
    if trials is None and plasticity is None:
        raise TableError(tables_problem(inputs.study_dir))
    _read_optional(inputs)
    return inputs


def _tag(df: pd.DataFrame | None, study: str) -> pd.DataFrame | None:
    return None if df is None else df.assign(study=study)


def _concat(frames: list[pd.DataFrame | None]) -> pd.DataFrame | None:
    frames = [f for f in frames if f is not None]
    return pd.concat(frames, ignore_index=True) if frames else None


def _run_keys(trials: pd.DataFrame) -> pd.DataFrame:
    """``trials`` with the :data:`RUN_KEY` columns filled for comparison (phase absent: search)."""
    keyed = trials.assign(phase=trials["phase"].fillna(SEARCH) if "phase" in trials.columns else SEARCH)
    return keyed.assign(lr=pd.to_numeric(keyed["lr"], errors="coerce").round(12))


def _check_collisions(parts: list[StudyInputs]) -> list[bool]:
    """Per study, a mask of the trial rows an earlier study already holds identically (kept once); a trial id or
    :data:`RUN_KEY` shared by two studies with different rows raises naming both directories."""
    schema = columns("trials")
    seen: dict[tuple, tuple[str, tuple]] = {}
    masks = []
    for inp in parts:
        t = _run_keys(inp.trials)
        dup = []
        for r in t.to_dict("records"):
            values = tuple(str(r.get(c)) for c in schema if c in r)
            hit = False
            for key in (("trial_id", str(r["trial_id"])), ("run", tuple(str(r[c]) for c in RUN_KEY))):
                if key in seen:
                    other, other_values = seen[key]
                    if other_values != values:
                        what = f"trial_id {key[1]}" if key[0] == "trial_id" else \
                            ", ".join(f"{c}={v}" for c, v in zip(RUN_KEY, key[1]))
                        raise TableError(f"{other} and {inp.study_dir}: both hold a trial with {what} and the "
                                         "rows differ; analyse them apart, or remove one")
                    hit = True
                else:
                    seen[key] = (inp.study_dir, values)
            dup.append(hit)
        masks.append(dup)
    return masks


def read_studies(study_dirs) -> StudyInputs:
    """Read several study directories (:func:`read_inputs` each) as one: every table concatenated, column
    ``study`` naming the directory (made absolute) of each trial row, ``study_dirs`` the same; identical
    plasticity, bounds and rates rows are kept once; trial collisions: :func:`_check_collisions`."""
    given = [str(d) for d in study_dirs]
    if len(given) == 1:
        return read_inputs(given[0])
    parts = [read_inputs(d) for d in given]
    dirs = [storage.absolute_path(d) for d in given]  # the study column: absolute, resolved where they enter
    with_trials = [p for p in parts if p.trials is not None]
    masks = dict(zip(map(id, with_trials), _check_collisions(with_trials)))
    merged = StudyInputs(study_dir=", ".join(given), study_dirs=dirs)
    for name in ("trials", "counted", "probes", "excluded", "final"):
        frames = []
        for p in with_trials:
            df = getattr(p, name)
            if df is not None and name != "trials":  # a row identical to an earlier study's is kept once
                known = p.trials[masks[id(p)]]["trial_id"] if any(masks[id(p)]) else []
                df = df[~df["trial_id"].isin(set(known))]
            elif df is not None:
                df = df[[not m for m in masks[id(p)]]]
            frames.append(_tag(df, storage.absolute_path(p.study_dir)))
        setattr(merged, name, _concat(frames))
    for name in ("curves", "plasticity", "control", "bounds", "rates", "pretraining"):
        df = _concat([getattr(p, name) for p in parts])
        setattr(merged, name, None if df is None else df.drop_duplicates(ignore_index=True))
    merged.notes = [f"{p.study_dir}: {n}" for p in parts for n in p.notes]
    return merged
