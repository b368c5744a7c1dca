"""Guarding a study directory: a full disk (ENOSPC) named in one line, Ray Train folders that cannot be
resumed from moved aside, temporary files of killed writers removed.

:func:`disk_full` recognises a full disk in an exception chain or an error text (also Tune's, read back by
:class:`raystudy.study.callback.StudyCallback`); :func:`storage_errors` turns it into a
:class:`StudyStorageError`; :func:`check_run_dirs` runs before every launch.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager

from raystudy.core.finetune.checkpoint import RAY_SNAPSHOT
from raystudy.core.finetune.state import checkpoint_problem
from raystudy.storage import exists, is_uri, join, read_text, subdirs
from raystudy.study.progress import Echo
from raystudy.study.progress import echo as _echo
from raystudy.study.results import quarantine
from raystudy.study.spec import StudySpec


class StudyStorageError(ValueError):
    """The study directory cannot be written (a full disk); one line naming it. A ``ValueError``, so every
    command reports it without a traceback."""


def disk_full(exc: BaseException | str | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from, or an error text) is a full disk (ENOSPC)."""
    seen = 0
    while isinstance(exc, BaseException) and seen < 20:
        if getattr(exc, "errno", None) == errno.ENOSPC or disk_full(str(exc)):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return isinstance(exc, str) and ("No space left on device" in exc or "[Errno 28]" in exc)


def disk_full_message(study_dir: str, detail: str = "") -> str:
    return (f"study directory {study_dir}: no space left on device (ENOSPC){detail}; make room and run the "
            "same command again: finished trials are kept, unfinished ones resume from their checkpoints")


@contextmanager
def storage_errors(study_dir: str) -> Iterator[None]:
    """Turn a full disk anywhere in the block into one :class:`StudyStorageError` naming ``study_dir``."""
    try:
        yield
    except StudyStorageError:
        raise
    except Exception as e:
        if disk_full(e):
            raise StudyStorageError(disk_full_message(study_dir)) from None
        raise


def run_dir_problem(run_dir: str) -> str | None:
    """Why Ray Train could not resume from ``run_dir`` (``<out>/train/<trial_id>``), or ``None``: a snapshot
    of an older version, which reported its checkpoints to Ray (today's runs report none, so Ray writes none).

    Checks Ray's checkpoint snapshot (readable JSON listing checkpoint folders; a full disk leaves it
    empty, and Ray then fails every attempt with ``CheckpointManagerInitializationError``) and, on local
    paths, every checkpoint it lists (:func:`raystudy.core.finetune.state.checkpoint_problem`).
    """
    snapshot = join(run_dir, RAY_SNAPSHOT)
    text = read_text(snapshot)
    if text is None:
        return None
    try:
        state = json.loads(text)
        names = [r["checkpoint_dir_name"] for r in state["checkpoint_results"]]
    except (ValueError, KeyError, TypeError):
        return f"{snapshot} is unreadable ({len(text)} bytes: empty or truncated)"
    for name in names:
        folder = join(run_dir, name)
        if not exists(folder):
            return f"{snapshot} lists the checkpoint {folder}, which is missing"
        problem = None if is_uri(folder) else checkpoint_problem(folder)
        if problem:
            return problem
    return None


def check_run_dirs(spec: StudySpec, done: set[str], echo: Echo = _echo) -> list[str]:
    """Before a launch: move aside (``<run dir>.corrupt-<n>``) every Ray Train folder of an unfinished trial
    that Ray could not resume from, so that the trial starts afresh instead of failing at every attempt;
    returns the folders moved. Temporary files left by a killed writer in the study are removed."""
    moved = []
    for name in subdirs(join(spec.out, "train")):
        if name in done or ".corrupt-" in name:
            continue
        run_dir = join(spec.out, "train", name)
        problem = run_dir_problem(run_dir)
        if problem:
            target = quarantine(run_dir)
            echo(f"[{spec.name}] {name}: its checkpoints cannot be resumed from ({problem}); moved aside to "
                 f"{target}, the trial starts from step 0")
            moved.append(target)
    if not is_uri(spec.out):
        _remove_temporaries(spec.out, done)
    return moved


def _remove_temporaries(study_dir: str, done: set[str]) -> None:
    """Delete ``.<name>.<hex>.tmp`` files of :func:`raystudy.storage.atomic_output` left by a killed writer
    (in the study folder, its ``curves.parquet/`` dataset and the folders of unfinished trials; the lock
    keeps other writers out)."""
    curves = os.path.join(study_dir, "curves.parquet")
    folders = [study_dir, *([curves] if os.path.isdir(curves) else [])]
    folders += [os.path.join(study_dir, "trials", t) for t in subdirs(join(study_dir, "trials")) if t not in done]
    for folder in folders:
        for entry in os.scandir(folder):
            if entry.is_file() and entry.name.startswith(".") and entry.name.endswith(".tmp"):
                os.remove(entry.path)
