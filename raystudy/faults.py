"""Fault injection for tests, kept out of every production config.

A test sets the environment variable ``RAYSTUDY_FAULTS`` to the path of a JSON file before Ray starts (Ray
workers inherit the driver's environment), then writes into that file which faults to inject, e.g.
``{"fail_after_step": {"trial-a": 3}, "crash_at_batch": 2}``. Production code asks :func:`injected` at the
few places a fault can be injected; with the variable unset (always, outside tests) it answers ``None``
without touching the disk. The file is read at each call, so one Ray session serves many tests.

Kinds in use: ``fail_after_step`` (a finetuning run, keyed by its output folder's name: the first attempt
raises after that step's checkpoint), ``hold_after_checkpoint`` (a finetuning run, keyed by its folder's name:
the first attempt waits after its first checkpoint until its folder holds ``.release`` or that many seconds
pass, so that a test can act on a run known to be mid-way), ``crash_at_batch`` (the plasticity pipeline:
the first actor to reach that batch kills its own process) and ``hold_analysis`` (an analysis, a path: it
creates that file once it has read its study's tables, then waits 120 s, so that a test can signal an
analysis known to be under way).
"""

from __future__ import annotations

import json
import os
from typing import Any

ENV = "RAYSTUDY_FAULTS"


def injected(kind: str, key: str | None = None) -> Any | None:
    """The fault of ``kind`` (for ``key`` when the file maps keys to values), or ``None``."""
    path = os.environ.get(ENV)
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            faults = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    value = faults.get(kind)
    if key is not None and isinstance(value, dict):
        return value.get(key)
    return value
