"""Where a run's checkpoints live: one layout with a completion marker, and the checkpointers that use it.

A checkpoint is a folder of :meth:`~raystudy.core.finetune.Finetuner.save`'s files (:mod:`.state`) plus
``.complete``, written after everything else::

    <storage>/checkpoint_00000050/   state.pt, rng_rank0.pt, ..., .complete

Only folders with the marker whose files verify (:func:`~raystudy.core.finetune.state.checkpoint_problem`)
are resumed from. The storage folder is local or a URI (:mod:`raystudy.storage`). A run directory of an
older version, with ``step_00000050/`` folders (``train_local``'s earlier layout, no marker), still resumes.

A *checkpointer* is what a run (:func:`raystudy.core.finetune.run.run`) asks to resume and to save:

* ``restore(ft)``: load the newest complete checkpoint into the :class:`Finetuner` ``ft``; its restore
  record (:meth:`Finetuner.load`) or None when there is none;
* ``saved(ft, event)``: a context manager that writes ``ft``'s checkpoint at ``event`` and yields its folder
  while the event is reported (Ray Train hands that folder to ``ray.train.report``);
* ``final``: whether the run's final event is checkpointed too.

:class:`DirectoryCheckpointer` is the one of local and in-actor runs; Ray Train's wraps
``ray.train.report(checkpoint=...)`` in :mod:`raystudy.distributed.train`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Protocol

from raystudy.core.finetune.loop import Event, Finetuner
from raystudy.core.finetune.state import ForeignCheckpoint, checkpoint_problem
from raystudy.storage import (
    delete_dir,
    download_dir,
    exists,
    is_uri,
    join,
    move_aside,
    publish,
    staged,
    subdirs,
    write_text_atomic,
)

log = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint_"
#: written into a checkpoint folder after everything else: a folder without it is never resumed from
COMPLETE_MARKER = ".complete"
#: the folders of the earlier local layout (``train_local``: ``step_XXXXXXXX``, no marker), still resumed
LEGACY_PREFIX = "step_"


class Checkpointer(Protocol):
    """Where a run resumes from and how it writes a checkpoint (the module docstring)."""

    final: bool

    def restore(self, ft: Finetuner) -> dict | None: ...

    def saved(self, ft: Finetuner, event: Event) -> contextlib.AbstractContextManager[str | None]: ...


def _steps(storage: str, prefix: str) -> list[int]:
    return sorted(int(n[len(prefix):]) for n in subdirs(storage) if n.startswith(prefix) and n[len(prefix):].isdigit())


def checkpoint_steps(storage: str) -> list[int]:
    """The steps of the complete checkpoints under ``storage``, oldest first."""
    return [s for s in _steps(storage, CHECKPOINT_PREFIX) if exists(join(checkpoint_path(storage, s), COMPLETE_MARKER))]


def checkpoint_path(storage: str, step: int) -> str:
    return join(storage, f"{CHECKPOINT_PREFIX}{step:08d}")


def mark_complete(folder: str | os.PathLike, step: int) -> None:
    """Write the completion marker of the checkpoint ``folder`` (the last file of a checkpoint)."""
    write_text_atomic(join(folder, COMPLETE_MARKER), f"{step}\n")


def save_checkpoint(ft: Finetuner, storage: str, keep: int | None) -> str:
    """Write ``ft``'s checkpoint at its step into ``storage`` and return its folder, then delete all but the
    ``keep`` newest complete ones (all kept when None) and any incomplete folder (left by a full disk or a
    killed writer)."""
    target = checkpoint_path(storage, ft.step)
    delete_dir(target)  # an older attempt's checkpoint of this step: never complete while being rewritten
    local, uri = staged(target)
    try:
        ft.save(local)
        publish(local, uri)
    finally:
        if uri is not None:
            shutil.rmtree(local, ignore_errors=True)
    mark_complete(target, ft.step)
    complete = checkpoint_steps(storage)
    stale = {checkpoint_path(storage, s) for s in (complete[:-keep] if keep else [])}
    stale |= {checkpoint_path(storage, s) for s in _steps(storage, CHECKPOINT_PREFIX)} \
        - {checkpoint_path(storage, s) for s in complete}  # (folders moved aside, ``.foreign-1``, are kept)
    for folder in sorted(stale):
        delete_dir(folder)
    return target


def _candidates(storage: str) -> list[str]:
    """The checkpoint folders to resume from, newest step first: complete ones of today's layout, and the
    folders of the earlier ``step_*`` layout (at an equal step, today's first)."""
    found = [(s, 1, checkpoint_path(storage, s)) for s in checkpoint_steps(storage)]
    found += [(s, 0, join(storage, f"{LEGACY_PREFIX}{s:08d}")) for s in _steps(storage, LEGACY_PREFIX)]
    return [folder for *_, folder in sorted(found, reverse=True)]


def resume_latest(ft: Finetuner, storage: str) -> dict | None:
    """Load the newest complete checkpoint under ``storage`` into ``ft``; its restore record, or None.

    A checkpoint that cannot be resumed from, because its files do not verify
    (:func:`~raystudy.core.finetune.state.checkpoint_problem`) or another run wrote it
    (:class:`~raystudy.core.finetune.state.ForeignCheckpoint`), is moved aside (``<folder>.corrupt-<n>`` or
    ``.foreign-<n>``: kept, never read again, so a re-run does not meet it), noted in
    ``ft.skipped_checkpoints`` (the run's summary) and the one before it is tried."""
    for folder in _candidates(storage):
        with tempfile.TemporaryDirectory(prefix="raystudy-resume-") as tmp:
            local = folder
            if is_uri(folder):
                download_dir(folder, tmp)
                local = tmp
            problem, tag = checkpoint_problem(local), "corrupt"
            if problem is None:
                try:
                    return ft.load(local)
                except ForeignCheckpoint as e:
                    problem, tag = str(e), "foreign"
        message = f"skipping checkpoint {folder}: {problem}; moved aside to {move_aside(folder, tag)}"
        ft.skipped_checkpoints.append(message)
        log.warning("%s", message)
    return None


class DirectoryCheckpointer:
    """Checkpoints in a folder of their own (local or a URI), ``keep`` newest kept (all when None); the run's
    final event is not checkpointed (its outputs are the run's own files)."""

    final = False

    def __init__(self, storage: str | os.PathLike, keep: int | None = None):
        self.storage, self.keep = str(storage), keep

    def restore(self, ft: Finetuner) -> dict | None:
        return resume_latest(ft, self.storage)

    @contextlib.contextmanager
    def saved(self, ft: Finetuner, event: Event) -> Iterator[str]:
        yield save_checkpoint(ft, self.storage, self.keep)


class NoCheckpoints:
    """A run that neither resumes nor writes checkpoints."""

    final = False

    def restore(self, ft: Finetuner) -> dict | None:
        return None

    @contextlib.contextmanager
    def saved(self, ft: Finetuner, event: Event) -> Iterator[None]:
        yield None
