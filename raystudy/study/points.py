"""Grid points of a study and their ids: what a trial is called in the study directory and its tables.

A grid point is one ``(dataset, configuration, optimizer, lr, seed)``; its id (:func:`trial_id`) names the
trial's folder ``trials/<trial_id>/`` and its rows, stably across runs and machines. A point of a study's
final fit (``final_fit``, :mod:`raystudy.study.final`) carries ``phase: final`` (:data:`raystudy.vocab.PHASES`)
and its id ends in ``-final``, so that it never shares a folder or a row with the search trial of the same
axes; a search point's id is what it always was.
"""

from __future__ import annotations

from typing import Any

from raystudy.vocab import PHASES, check_name

#: the phase of a point without one: the grid's search
SEARCH = PHASES[0]
#: the key of a Tune trial's config holding the study's trial id (Tune's own ``trial_id`` is another id):
#: ``ExperimentAnalysis(...).dataframe()["config/study_trial_id"]`` joins ``trials.parquet``'s ``trial_id``
STUDY_TRIAL_ID = "study_trial_id"


def format_lr(lr: float) -> str:
    """Learning rate as it appears in trial ids: shortest round-tripping repr (``0.003``, ``1e-05``)."""
    return repr(float(lr))


def trial_id(dataset: str, configuration: str, optimizer: str, lr: float, seed: int, phase: str = SEARCH) -> str:
    """The stable id of a grid point, e.g. ``cifar10-MHA-sgd-lr0.01-s0`` (an expression's canonical,
    path-safe spelling: ``FC1+MHA`` and ``MHA+FC1`` are one trial, ``auto:5%`` becomes ``auto_5pct``); a
    final-fit point's id adds ``-final`` (``cifar10-MHA-sgd-lr0.01-s0-final``)."""
    from raystudy.core.expressions import path_safe  # torch (raystudy.core): --help stays light

    suffix = "" if check_name(phase, PHASES, "phase") == SEARCH else f"-{phase}"
    return f"{dataset}-{path_safe(configuration)}-{optimizer}-lr{format_lr(lr)}-s{int(seed)}{suffix}"


def grid_point(dataset: str, configuration: str, optimizer: str, lr: float, seed: int,
               phase: str = SEARCH) -> dict[str, Any]:
    """The grid point as a trial receives it: its :func:`trial_id` and its five axes, and ``phase`` for a
    final-fit point (a search point has none: :func:`phase_of`)."""
    point = {
        "trial_id": trial_id(dataset, configuration, optimizer, lr, seed, phase),
        "dataset": dataset, "configuration": configuration, "optimizer": optimizer,
        "lr": float(lr), "seed": int(seed),
    }
    return point if phase == SEARCH else {**point, "phase": phase}


def phase_of(point: dict[str, Any]) -> str:
    """The phase of a grid point: its ``phase``, else ``search``."""
    return point.get("phase") or SEARCH


def tune_config(point: dict[str, Any]) -> dict[str, Any]:
    """The Tune trial config of a grid point: ``{"point": point, "study_trial_id": its trial id}``."""
    return {"point": point, STUDY_TRIAL_ID: point["trial_id"]}
