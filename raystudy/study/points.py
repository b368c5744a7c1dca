"""Grid points of a study and their ids: what a trial is called in the study directory and its tables.

A grid point is one ``(dataset, configuration, optimizer, lr, seed)``; its id (:func:`trial_id`) names the
trial's folder ``trials/<trial_id>/`` and its rows, stably across runs and machines.
"""

from __future__ import annotations

from typing import Any


def format_lr(lr: float) -> str:
    """Learning rate as it appears in trial ids: shortest round-tripping repr (``0.003``, ``1e-05``)."""
    return repr(float(lr))


def trial_id(dataset: str, configuration: str, optimizer: str, lr: float, seed: int) -> str:
    """The stable id of a grid point, e.g. ``cifar10-MHA-sgd-lr0.01-s0`` (an expression's canonical,
    path-safe spelling: ``FC1+MHA`` and ``MHA+FC1`` are one trial, ``auto:5%`` becomes ``auto_5pct``)."""
    from raystudy.core.expressions import path_safe  # torch (raystudy.core): --help stays light

    return f"{dataset}-{path_safe(configuration)}-{optimizer}-lr{format_lr(lr)}-s{int(seed)}"


def grid_point(dataset: str, configuration: str, optimizer: str, lr: float, seed: int) -> dict[str, Any]:
    """The grid point as a trial receives it: its :func:`trial_id` and its five axes."""
    return {
        "trial_id": trial_id(dataset, configuration, optimizer, lr, seed),
        "dataset": dataset, "configuration": configuration, "optimizer": optimizer,
        "lr": float(lr), "seed": int(seed),
    }
