"""Where a run's checkpoints live: the one layout, with its completion marker, and the checkpointer that uses it.

A checkpoint is a folder of :meth:`~raystudy.core.finetune.Finetuner.save`'s files (:mod:`.state`: rank 0's
``state.pt``, every rank's ``rng_rank<r>.pt``) plus ``.complete`` (the step), written after everything else::

    <storage>/checkpoint_00000050/   state.pt, rng_rank0.pt, ..., .complete

Only folders with the marker whose files verify (:func:`~raystudy.core.finetune.state.checkpoint_problem`)
are resumed from. The storage folder is local or a URI (:mod:`raystudy.storage`): a local run's
``checkpoint_dir``, a study trial's ``<out>/train/<trial_id>/`` (both executions) or a lone Ray Train run's
``<out_dir>/ray/train/``. Every execution writes and resumes this layout, Ray Train's workers included (they
report no checkpoint to Ray, so Ray writes none of its own).

Older versions left two other layouts in a storage folder: ``step_00000050/`` (``train_local``, no marker)
and Ray Train's ``checkpoint_<date>/`` (this layout's files, ``.complete`` included, in a folder Ray named,
listed in Ray's ``checkpoint_manager_snapshot.json``). :func:`upgrade_layout` renames them into this layout
the first time a run resumes there (and drops Ray's snapshot, which lists the old names); nothing writes them.

The *checkpointer* is what a run (:func:`raystudy.core.finetune.driver.run`) asks to resume and to save:

* ``restore(ft)``: load the newest complete checkpoint into the :class:`Finetuner` ``ft``; its restore
  record (:meth:`Finetuner.load`) or None when there is none;
* ``save(ft)``: write ``ft``'s checkpoint at its step, complete, and return its folder (None: none written).

:class:`DirectoryCheckpointer` serves every execution; the workers of a Ray Train run share one storage folder
and hand it their :class:`Collective` (barrier and broadcast), :class:`NoCheckpoints` a run without any.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from typing import Protocol

from raystudy.core.finetune.loop import Finetuner
from raystudy.core.finetune.state import (
    ForeignCheckpoint,
    UnreadableCheckpoint,
    checkpoint_problem,
    load_checkpoint_file,
)
from raystudy.storage import (
    delete_dir,
    delete_file,
    download_dir,
    exists,
    is_uri,
    join,
    move,
    move_aside,
    read_text,
    staged,
    subdirs,
    upload_dir,
    write_text_atomic,
)

log = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint_"
#: written into a checkpoint folder after everything else: a folder without it is never resumed from
COMPLETE_MARKER = ".complete"
#: the folders of the earlier local layout (``train_local``: ``step_XXXXXXXX``, no marker): upgraded, never written
LEGACY_PREFIX = "step_"
#: the folders Ray Train named for the checkpoints reported to it (``checkpoint_2026-12-06_01-40-04.123456``)
RAY_FOLDER = re.compile(r"checkpoint_\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}(\.\d+)?")
#: Ray Train's record of the checkpoints reported to it, in the same storage folder (``ray.train.RunConfig``)
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"


class Checkpointer(Protocol):
    """Where a run resumes from and how it writes a checkpoint (the module docstring)."""

    def restore(self, ft: Finetuner) -> dict | None: ...

    def save(self, ft: Finetuner) -> str | None: ...


class Collective:
    """How the workers of one run agree: ``barrier()`` waits for all of them, ``broadcast(x)`` returns rank 0's
    ``x`` on every rank. This one is a run's only worker (both do nothing); Ray Train's workers pass
    :class:`raystudy.distributed.train.RayCollective`."""

    def barrier(self) -> None:
        pass

    def broadcast(self, value):
        return value


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


def save_checkpoint(ft: Finetuner, storage: str, keep: int | None, collective: Collective | None = None) -> str:
    """Write ``ft``'s checkpoint at its step into ``storage`` and return its folder, then delete all but the
    ``keep`` newest complete ones (all kept when None) and any incomplete folder (left by a full disk or a
    killed writer).

    Every worker of the run calls it at the same step (``collective``: the run's workers, one by default):
    worker 0 clears the folder, each worker writes its files, worker 0 marks the checkpoint complete once all
    have written, and it returns on every worker once the checkpoint is complete."""
    collective = collective or Collective()
    target = checkpoint_path(storage, ft.step)
    if ft.rank == 0:
        delete_dir(target)  # an older attempt's checkpoint of this step: never complete while being rewritten
    collective.barrier()
    local, uri = staged(target)
    try:
        ft.save(local)
        if uri is not None:
            upload_dir(local, uri)  # next to the other workers' files
    finally:
        if uri is not None:
            shutil.rmtree(local, ignore_errors=True)
    collective.barrier()  # every worker's files are there
    if ft.rank == 0:
        mark_complete(target, ft.step)
        _prune(storage, keep)
    collective.barrier()
    return target


def _prune(storage: str, keep: int | None) -> None:
    """Delete all but the ``keep`` newest complete checkpoints (none when None) and every incomplete one
    (folders moved aside, ``.foreign-1``, are kept)."""
    complete = checkpoint_steps(storage)
    stale = {checkpoint_path(storage, s) for s in (complete[:-keep] if keep else [])}
    stale |= {checkpoint_path(storage, s) for s in _steps(storage, CHECKPOINT_PREFIX)} \
        - {checkpoint_path(storage, s) for s in complete}
    for folder in sorted(stale):
        delete_dir(folder)


# ---- the upgrade of older layouts ----------------------------------------------------------------------


def _ray_folder_step(folder: str) -> int | None:
    """The step of a checkpoint in a folder Ray Train named: its ``.complete`` marker's, else its
    ``state.pt``'s (Ray's checkpoints before the marker); None when it has neither."""
    marked = read_text(join(folder, COMPLETE_MARKER))
    if marked is not None and marked.strip().isdigit():
        return int(marked)
    with tempfile.TemporaryDirectory(prefix="raystudy-upgrade-") as tmp:
        local = folder
        if is_uri(folder):
            download_dir(folder, tmp)
            local = tmp
        if checkpoint_problem(local) is not None:
            return None
        try:
            return int(load_checkpoint_file(os.path.join(local, "state.pt"))["step"])
        except (UnreadableCheckpoint, KeyError, TypeError, ValueError):  # refused, or no run state: moved aside
            return None


def _older_checkpoints(storage: str) -> list[tuple[str, int | None]]:
    """The folders of the older layouts under ``storage`` with their steps (None: no checkpoint in it)."""
    found = []
    for name in subdirs(storage):
        if name.startswith(LEGACY_PREFIX) and name[len(LEGACY_PREFIX):].isdigit():
            found.append((join(storage, name), int(name[len(LEGACY_PREFIX):])))
        elif RAY_FOLDER.fullmatch(name):
            found.append((join(storage, name), _ray_folder_step(join(storage, name))))
    return found


def upgrade_layout(storage: str) -> list[str]:
    """Rename the checkpoints of the older layouts under ``storage`` (``step_XXXXXXXX/``, Ray Train's
    ``checkpoint_<date>/``) into today's ``checkpoint_XXXXXXXX/`` with its marker; returns the new folders.

    An older folder whose step today's layout already holds complete is deleted; one without a checkpoint
    (a Ray folder with neither marker nor a whole ``state.pt``) is moved aside (``.corrupt-<n>``). Ray's
    snapshot (:data:`RAY_SNAPSHOT`), which names the old folders, is deleted: Ray would refuse a run whose
    snapshot lists folders that are gone, and no run reports checkpoints to Ray any more. Whether an
    upgraded checkpoint verifies is checked when a run resumes from it, as for any other."""
    upgraded = []
    for folder, step in _older_checkpoints(storage):
        if step is None:
            log.warning("checkpoint folder %s holds no checkpoint; moved aside to %s", folder,
                        move_aside(folder, "corrupt"))
            continue
        target = checkpoint_path(storage, step)
        if exists(join(target, COMPLETE_MARKER)):
            delete_dir(folder)
            continue
        delete_dir(target)  # an incomplete folder of this step
        move(folder, target)
        mark_complete(target, step)
        log.info("checkpoint %s upgraded to %s", folder, target)
        upgraded.append(target)
    delete_file(join(storage, RAY_SNAPSHOT))
    return upgraded


# ---- resuming ------------------------------------------------------------------------------------------


def load_checkpoint(ft: Finetuner, folder: str, *, verify: bool = False) -> dict:
    """Load the checkpoint ``folder`` (local or a URI) into ``ft``; its restore record. With ``verify``, a
    folder whose files do not verify raises :class:`UnusableCheckpoint` (tag ``corrupt``), as does one with a
    file that cannot be loaded without running code (:class:`~raystudy.core.finetune.state.UnreadableCheckpoint`:
    tag ``corrupt``) and another run's (tag ``foreign``)."""
    with tempfile.TemporaryDirectory(prefix="raystudy-resume-") as tmp:
        local = folder
        if is_uri(folder):
            download_dir(folder, tmp)
            local = tmp
        problem = checkpoint_problem(local) if verify else None
        if problem is not None:
            raise UnusableCheckpoint(problem, "corrupt")
        try:
            return ft.load(local)
        except ForeignCheckpoint as e:
            raise UnusableCheckpoint(str(e), "foreign") from e
        except UnreadableCheckpoint as e:  # e.g. a pickle weights_only refuses: never loaded any other way
            raise UnusableCheckpoint(str(e), "corrupt") from None


class UnusableCheckpoint(ValueError):
    """A checkpoint a run cannot resume from: ``tag`` says why (``corrupt`` | ``foreign``)."""

    def __init__(self, problem: str, tag: str):
        super().__init__(problem)
        self.tag = tag


def resume_latest(ft: Finetuner, storage: str) -> dict | None:
    """Load the newest complete checkpoint under ``storage`` into ``ft``; its restore record, or None.

    Older layouts there are upgraded first (:func:`upgrade_layout`). A checkpoint that cannot be resumed from,
    because its files do not verify (:func:`~raystudy.core.finetune.state.checkpoint_problem`), one of them
    cannot be loaded without running code (a pickle ``weights_only`` refuses: never loaded otherwise) or another
    run wrote it (:class:`~raystudy.core.finetune.state.ForeignCheckpoint`), is moved aside
    (``<folder>.corrupt-<n>`` or ``.foreign-<n>``: kept, never read again, so a re-run does not meet it),
    noted in ``ft.skipped_checkpoints`` (the run's summary) and the one before it is tried."""
    upgrade_layout(storage)
    for step in reversed(checkpoint_steps(storage)):
        folder = checkpoint_path(storage, step)
        try:
            return load_checkpoint(ft, folder, verify=True)
        except UnusableCheckpoint as e:
            message = f"skipping checkpoint {folder}: {e}; moved aside to {move_aside(folder, e.tag)}"
        ft.skipped_checkpoints.append(message)
        log.warning("%s", message)
    return None


class DirectoryCheckpointer:
    """Checkpoints in one storage folder (local or a URI), ``keep`` newest kept (all when None); the run's
    final event is not checkpointed (its outputs are the run's own files).

    ``collective`` joins the workers of one run: worker 0 chooses the checkpoint to resume from
    (:func:`resume_latest`: it upgrades, verifies and moves aside) and every other worker loads the same one."""

    def __init__(self, storage: str | os.PathLike, keep: int | None = None, collective: Collective | None = None):
        self.storage, self.keep = str(storage), keep
        self.collective = collective or Collective()

    def restore(self, ft: Finetuner) -> dict | None:
        info = resume_latest(ft, self.storage) if ft.rank == 0 else None
        step = self.collective.broadcast(None if info is None else info["step"])
        if ft.rank != 0 and step is not None:
            info = load_checkpoint(ft, checkpoint_path(self.storage, step))
        if info is not None:
            log.info("rank %d resumed at step %d from %s", ft.rank, info["step"], self.storage)
        return info

    def save(self, ft: Finetuner) -> str:
        return save_checkpoint(ft, self.storage, self.keep, self.collective)


class NoCheckpoints:
    """A run that neither resumes nor writes checkpoints."""

    def restore(self, ft: Finetuner) -> dict | None:
        return None

    def save(self, ft: Finetuner) -> None:
        return None
