"""A study's final fit (``final_fit: true``): VTAB-1k's protocol (VPT, NOAH, V-PETL Bench) after the lr search.

The grid's search trials train on the store's train split and validate on val (VTAB-1k: train800 / val200).
Once every search trial of a sweep (dataset, configuration, optimizer) has ended (``ok`` or ``diverged``), its
lr is chosen on validation: ``lr* = argmax_l mean_s best_val_acc[d, o, c, l, s]`` (ties: the smaller lr),
:func:`raystudy.analysis.tables.best_lr_table` with ``select_by="val"``, the analysis' own rule (test never
chooses). Then one more trial per seed of the sweep runs at ``lr*`` for the same steps on train + val
(``train_splits: train+val``, VTAB-1k's train800val200: no validation, the last step tested): its grid
point has ``phase: final`` (:data:`raystudy.vocab.PHASES`), its id ends in ``-final``
(:func:`raystudy.study.points.trial_id`), and its ``trials.parquet`` row has ``phase`` ``final``.

The stage depends on the search: how many final trials there are is known before (one per (dataset,
configuration, optimizer, seed) cell: :func:`final_cells`, which the dry run's cost counts), their lrs only
after. A sweep whose search has a trial not yet ended (still to run, or failed: retried on the next run)
waits: :func:`final_points` names it, and the next run of the study fits it. A sweep whose every trial
diverged before its first evaluation has no lr to choose and no final trial (also named).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pandas as pd

from raystudy.analysis.inputs import validate_trials
from raystudy.analysis.tables import best_lr_table
from raystudy.data.store import read_meta
from raystudy.study.points import SEARCH, grid_point
from raystudy.vocab import FINAL_STATUSES, LINEAR_PROBE, PHASES

FINAL = PHASES[1]
#: a sweep of the lr search: (dataset, configuration, optimizer)
Sweep = tuple[str, str, str]


def final_cells(spec) -> Counter:
    """``{(dataset, configuration, seed): final trials}`` of ``spec`` (none without ``final_fit``): one per
    (dataset, configuration, optimizer, seed) cell, whatever lr it will be."""
    if not spec.final_fit:
        return Counter()
    return Counter((c["dataset"], c["configuration"], c["seed"]) for c in spec.groups())


def search_rows(spec, trials: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``trials`` that are this spec's grid trials (``phase`` search or none; not ``LP``)."""
    if trials.empty:
        return trials
    phase = trials["phase"].fillna(SEARCH) if "phase" in trials.columns else pd.Series(SEARCH, index=trials.index)
    ids = {p["trial_id"] for p in spec.grid()}
    keep = (phase == SEARCH) & trials["trial_id"].isin(ids) & (trials["configuration"] != LINEAR_PROBE)
    return trials[keep]


def chosen_lrs(spec, trials: pd.DataFrame) -> dict[Sweep, float]:
    """``{(dataset, configuration, optimizer): lr*}`` chosen on validation from the search rows of ``trials``
    (:func:`raystudy.analysis.tables.best_lr_table`, ``select_by="val"``; counted rows as the analysis counts
    them: ok, or diverged with a test accuracy)."""
    rows = search_rows(spec, trials)
    if rows.empty:
        return {}
    counted = validate_trials(rows, f"{spec.out}/trials.parquet")[0]
    if counted.empty:
        return {}
    best = best_lr_table(counted, select_by="val")
    return {(r.dataset, r.configuration, r.optimizer): float(r.lr) for r in best.itertuples()}


def final_points(spec, trials: pd.DataFrame) -> tuple[list[dict[str, Any]], list[str]]:
    """The final trials' grid points that can run now, in grid order, and the sweeps that cannot (why, one
    line each): a sweep runs once each of its search trials has a row with status ok or diverged."""
    grid = spec.grid()
    ended = set(trials.loc[trials["status"].isin(FINAL_STATUSES), "trial_id"]) if not trials.empty else set()
    sweeps: dict[Sweep, list[dict]] = {}
    for p in grid:
        sweeps.setdefault((p["dataset"], p["configuration"], p["optimizer"]), []).append(p)
    lrs = chosen_lrs(spec, trials)
    points, waiting = [], []
    for sweep, members in sweeps.items():
        left = [p["trial_id"] for p in members if p["trial_id"] not in ended]
        if left:
            waiting.append(f"{'/'.join(sweep)}: {len(left)} search trial(s) not ended (first: {left[0]})")
        elif sweep not in lrs:
            waiting.append(f"{'/'.join(sweep)}: no search trial with a validation accuracy (all diverged early)")
        else:
            seeds = dict.fromkeys(p["seed"] for p in members)
            points += [grid_point(*sweep, lrs[sweep], seed, phase=FINAL) for seed in seeds]
    return points, waiting


def store_problems(spec) -> list[str]:
    """Why a dataset's store cannot be fit on train + val (one line each, naming its ``dataset.json``): no
    val rows of its own. Empty without ``final_fit``."""
    if not spec.final_fit:
        return []
    out = []
    for name, path in spec.datasets.items():
        store = spec.store_path(path)
        if not int(read_meta(store)["counts"].get("val", 0)):
            out.append(f"final_fit: datasets.{name}: {store}/dataset.json has no val rows to train on "
                       "(train_splits train+val needs a val split of its own)")
    return out
