"""The run driver: one finetuning run, from its start or resume to its outputs, whatever executes it.

A run reads top to bottom in :func:`run`: build the :class:`Finetuner`, resume it from its checkpointer
(:mod:`.checkpoint`, the one layout), train while handling every event of the loop in one place (TensorBoard on
worker 0, a checkpoint at checkpoint steps, the event's report, the test faults of :mod:`raystudy.faults`),
then write the weights (worker 0). :func:`finish_run` writes the run's tables (the one place that does:
summary, curves, changes, config, restores) and deletes its checkpoints when asked. Each execution is a thin
adapter that picks a checkpointer, a reporter and what the summary says about the execution:

* :func:`train_local`: the plain single-process run, checkpoints in a folder of their own;
* a study trial's own actor (:func:`raystudy.distributed.inprocess.run_in_process`): checkpoints in the
  trial's storage folder, reports forwarded to Tune;
* Ray Train (:func:`raystudy.distributed.train.run_finetune`): every worker runs :func:`run` with the same
  checkpointer over the run's storage folder (its workers joined by a collective), reports go to
  ``ray.train.report``; the driver process calls :func:`finish_run` with worker 0's :func:`run_record`.

A run's summary is the loop's (:meth:`Finetuner.summary`) with :func:`finished_summary`'s execution
figures, or :func:`failed_summary` when the run produced none.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

from raystudy.core.finetune.checkpoint import Checkpointer, DirectoryCheckpointer, NoCheckpoints
from raystudy.core.finetune.config import FinetuneConfig
from raystudy.core.finetune.loop import Event, Finetuner
from raystudy.core.finetune.outputs import (
    HPARAM_METRICS,
    run_hparams,
    run_summary,
    save_safetensors,
    write_outputs,
)
from raystudy.core.finetune.selection import build_finetune_model, select_for
from raystudy.data.store import read_meta
from raystudy.faults import injected
from raystudy.storage import delete_dir, join

log = logging.getLogger(__name__)

# ---- reports -----------------------------------------------------------------------------------------


def event_metrics(ev: Event) -> dict:
    """What a report of ``ev`` carries: its plain numbers, strings and flags (None and nested values dropped),
    its step and whether it is the run's final one."""
    clean = {k: float(v) if isinstance(v, float) else v for k, v in ev.metrics.items()
             if isinstance(v, int | float | str | bool)}
    return {**clean, "step": ev.step, "final": ev.final}


class Reporter:
    """What a run does with each event besides TensorBoard: this base does nothing.

    :meth:`report` gets the event's :func:`event_metrics` and the folder of the checkpoint written at that
    event, complete (None at other events); :meth:`before_failure` runs on every worker right before an injected
    failure is raised."""

    def report(self, metrics: dict, checkpoint: str | None) -> None:
        pass

    def before_failure(self) -> None:
        pass


class ForwardReports(Reporter):
    """Hands every event's metrics to ``on_report`` (a study forwards them to Tune); nothing without it."""

    def __init__(self, on_report: Callable[[dict], None] | None):
        self.on_report = on_report

    def report(self, metrics: dict, checkpoint: str | None) -> None:
        if self.on_report is not None:
            self.on_report(metrics)


class TensorBoardLogger:
    """Writes every curve row to ``out_dir/tb`` (one directory per run) and, at the end, the run's result
    scalars and its HParams session (:func:`~raystudy.core.finetune.outputs.run_hparams` and ``hparams``,
    e.g. a study trial's dataset and phase, with :data:`~raystudy.core.finetune.outputs.HPARAM_METRICS`)
    into the same directory. ``purge_step`` drops events after a restored step, so a resumed run leaves no
    duplicates."""

    def __init__(self, out_dir: str | os.PathLike, purge_step: int | None = None, hparams: dict | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=join(out_dir, "tb"), purge_step=purge_step)
        self.hparams = dict(hparams or {})

    def __call__(self, event: Event) -> None:
        if event.final:
            for tag in HPARAM_METRICS:
                v = event.metrics.get(tag.split("/", 1)[1])
                if v is not None and math.isfinite(v):
                    self.writer.add_scalar(tag, v, event.step)
            self.write_hparams(event.metrics, event.step)
        else:
            for k, v in event.metrics.items():
                if k != "step" and v is not None:
                    tag = ("val/" if k.startswith("val_") else "train/") + k
                    self.writer.add_scalar(tag, v, event.step)
        self.writer.flush()

    def write_hparams(self, summary: dict, step: int) -> None:
        """The HParams plugin's session records (start and end) in this run's own event file
        (``SummaryWriter.add_hparams`` would open a second, timestamped run folder). No experiment record:
        TensorBoard takes the first one it finds as every run's, so a study writes one for all its trials
        (:mod:`raystudy.study.hparams`: every axis with its domain) and a lone run lets TensorBoard
        compute it from the sessions."""
        from torch.utils.tensorboard.summary import hparams

        writer = self.writer._get_file_writer()
        _, start, end = hparams({**run_hparams(summary), **self.hparams}, dict.fromkeys(HPARAM_METRICS, 0.0))
        for record in (start, end):
            writer.add_summary(record, step)

    def close(self) -> None:
        self.writer.close()


def session_hparams(ft: Finetuner) -> dict:
    """What a run's HParams session adds to :func:`~raystudy.core.finetune.outputs.run_hparams`: its ``dataset``
    (the store's name, as ``dataset.json`` gives it), then ``cfg.hparams`` (a study trial's: the dataset's name
    in the study, and its phase)."""
    return {"dataset": str(ft.meta.get("name") or Path(ft.cfg.store).name), **ft.cfg.hparams}


def resumed_tensorboard(ft: Finetuner, out_dir: str | os.PathLike) -> TensorBoardLogger:
    """The run's :class:`TensorBoardLogger` in ``out_dir/tb``, for a run that may have resumed at ``ft.step``.

    Where that folder holds the events of the earlier attempt (one file system), the new events start after
    the restored step (``purge_step``). Where it holds none (the attempt before ran on a node that was lost, or
    on another node whose folder of a study on object storage is not this one), the restored curve rows are
    written again first, from the first one's step on, so that the folder holds every step once; and a copy
    of the earlier attempt's events merged into it later is purged from that step on."""
    folder, hparams = Path(out_dir) / "tb", session_hparams(ft)
    if not ft.step:
        return TensorBoardLogger(out_dir, hparams=hparams)
    if any(folder.glob("events.out.tfevents.*")) or not ft.curves:
        return TensorBoardLogger(out_dir, purge_step=ft.step + 1, hparams=hparams)
    tb = TensorBoardLogger(out_dir, purge_step=ft.curves[0]["step"], hparams=hparams)
    for row in ft.curves:
        tb(Event(step=row["step"], metrics=dict(row), checkpoint=False))
    return tb


# ---- the test fault ----------------------------------------------------------------------------------


class InjectedFailure(RuntimeError):
    """Raised by a run when a test injects ``fail_after_step`` (:mod:`raystudy.faults`)."""


#: a run's folder holds this file once its injected failure fired (the first attempt failed)
INJECTED_MARKER = ".injected_failure"


def failure_due(ft: Finetuner, ev: Event, fail_after: int | None) -> bool:
    """Whether the test fault ``fail_after_step`` (:mod:`raystudy.faults`) fires at ``ev``: that step of the
    run's first attempt (nothing restored yet, no failure fired before, also before a checkpoint)."""
    return (fail_after is not None and ev.step == fail_after and not ft.restores and not ev.final
            and not (Path(ft.cfg.out_dir) / INJECTED_MARKER).exists())


#: a held run waits at its first checkpoint until its folder holds this file (or the hold's seconds pass)
RELEASE_MARKER = ".release"


def hold_due(ft: Finetuner, ev: Event, hold: float | None) -> bool:
    """Whether the test fault ``hold_after_checkpoint`` (:mod:`raystudy.faults`) holds the run at ``ev``:
    its first checkpoint of the run's first attempt (nothing restored yet)."""
    return hold is not None and ev.checkpoint and not ev.final and not ft.restores and ft.rank == 0 \
        and not (Path(ft.cfg.out_dir) / RELEASE_MARKER).exists()


def hold_run(ft: Finetuner, seconds: float) -> None:
    """Wait until the run's folder holds :data:`RELEASE_MARKER` or ``seconds`` have passed, then mark it
    released (a run is held once)."""
    release = Path(ft.cfg.out_dir) / RELEASE_MARKER
    deadline = time.monotonic() + seconds
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    _touch(release)


def _touch(marker: Path) -> None:
    """Create the fault marker ``marker``, its folder too (a Ray Train worker 0 on another node than its run's
    staging folder of a study on object storage does not see that folder)."""
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()


def inject_failure(ft: Finetuner, ev: Event) -> None:
    """Mark the run's first attempt as failed (rank 0) and raise :class:`InjectedFailure`."""
    if ft.rank == 0:
        _touch(Path(ft.cfg.out_dir) / INJECTED_MARKER)
    raise InjectedFailure(f"injected failure after step {ev.step} (raystudy.faults fail_after_step)")


# ---- the run -----------------------------------------------------------------------------------------


def run(cfg: FinetuneConfig, *, checkpointer: Checkpointer | None = None, reporter: Reporter | None = None,
        resume: bool = True, tensorboard: bool = True, progress: bool | None = None, write_weights: bool = True,
        outputs_dir: str | None = None, **placement) -> tuple[dict, Finetuner]:
    """Run ``cfg`` to its end; returns ``(summary, finetuner)``.

    ``placement`` goes to :class:`Finetuner` (a worker's ``rank``, ``world_size``, ``device``, ``wrap``,
    ``all_reduce``). With ``resume``, the run continues from ``checkpointer.restore``. At each event of the
    loop: TensorBoard on worker 0 (with ``tensorboard``), ``checkpointer.save`` at checkpoint steps (never at
    the end: the run's outputs are its own files), ``reporter.report``, then the test fault
    ``fail_after_step`` of the run's folder name (after that step's checkpoint and report) and the test fault
    ``hold_after_checkpoint`` (the first attempt waits after its first checkpoint, see :func:`hold_run`).
    The summary's ``wall_seconds`` is the wall time of the loop; worker 0 writes the run's weights
    (:func:`save_weights`) with ``write_weights``. Worker 0's TensorBoard events and weights go to
    ``outputs_dir`` (default ``cfg.out_dir``; a Ray Train worker away from its run's folder passes its own).
    """
    ft = Finetuner(cfg, **placement)
    checkpointer = checkpointer if checkpointer is not None else NoCheckpoints()
    reporter = reporter if reporter is not None else Reporter()
    if resume:
        checkpointer.restore(ft)
    outputs_dir = outputs_dir or cfg.out_dir
    tb = resumed_tensorboard(ft, outputs_dir) if tensorboard and ft.rank == 0 else None
    fail_after = injected("fail_after_step", Path(cfg.out_dir).name)
    hold = injected("hold_after_checkpoint", Path(cfg.out_dir).name)

    def on_event(ev: Event) -> None:
        if tb is not None:
            tb(ev)
        folder = checkpointer.save(ft) if ev.checkpoint and not ev.final else None
        reporter.report(event_metrics(ev), folder)
        if hold_due(ft, ev, hold):
            hold_run(ft, hold)
        if failure_due(ft, ev, fail_after):
            reporter.before_failure()
            inject_failure(ft, ev)

    t0 = time.perf_counter()
    try:
        summary = ft.run(on_event, progress=progress)
    finally:
        if tb is not None:
            tb.close()
    summary["wall_seconds"] = time.perf_counter() - t0
    if write_weights and ft.rank == 0:
        save_weights(ft, outputs_dir)
    return summary, ft


def save_weights(ft: Finetuner, folder: str | os.PathLike | None = None) -> None:
    """``best_trainable.safetensors`` (the best-validation trainable state, when there was an evaluation)
    and, with ``save_final``, ``final_model.safetensors`` (the whole final model) in ``folder`` (default the
    run's ``out_dir``); both under a plain timm model's names (LoRA merged: :meth:`Finetuner.exported_state`)."""
    folder = folder or ft.cfg.out_dir
    if ft.best_state is not None:
        save_safetensors(ft.exported_state(ft.best_state), join(folder, "best_trainable.safetensors"))
    if ft.cfg.save_final:
        save_safetensors(ft.merged_model().state_dict(), join(folder, "final_model.safetensors"))


# ---- the summary -------------------------------------------------------------------------------------


def finished_summary(summary: dict, *, wall_seconds: float, workers: int, execution: str,
                     failures: dict | None = None) -> dict:
    """``summary`` with how a study's execution ran it: ``wall_seconds`` (the execution's wall time),
    ``workers``, ``execution`` (``train`` | ``actor``) and the worker-group failures ``failures``
    (``worker_failures``, ``worker_failure_errors``; none by default)."""
    out = dict(summary)
    out.update(wall_seconds=wall_seconds, workers=workers, execution=execution)
    out.update(failures if failures is not None else {"worker_failures": 0, "worker_failure_errors": []})
    return out


def failed_summary(cfg: FinetuneConfig, error: BaseException | str | None) -> dict:
    """The summary of a run that produced no result: every key of a normal summary, the measured ones
    null (NaN or None), ``trainable_params`` counted when the model can be built, and ``error``."""
    trainable, num_classes = None, cfg.num_classes
    try:
        num_classes = num_classes or int(read_meta(cfg.store)["num_classes"])
        trainable = select_for(build_finetune_model(cfg, num_classes), cfg).num_trainable
    except Exception:  # the failure may be the store or the model itself
        pass
    message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return run_summary(cfg, status="failed", trainable_params=trainable, num_classes=num_classes,
                       error=message[:2000])


# ---- the outputs ---------------------------------------------------------------------------------------


def run_record(summary: dict, ft: Finetuner) -> dict:
    """What :func:`finish_run` writes of a run besides its config: its summary, curves, restores and changes
    (plain values: Ray Train hands worker 0's to the driver process)."""
    return {"summary": summary, "curves": ft.curves, "restores": ft.restores, "changes": ft.changes}


def finish_run(cfg: FinetuneConfig, summary: dict, record: dict | None, *, config: dict,
               storage: str | None = None, cleanup: bool = False) -> dict:
    """Write the run's outputs into ``cfg.out_dir`` and return ``summary``: the one writer of a run's tables
    (:func:`~raystudy.core.finetune.outputs.write_outputs`: ``summary.json``, ``curves.parquet``,
    ``changes.parquet``, ``config.json`` = ``config``, ``restores.json``), for every execution.

    ``record`` is :func:`run_record`'s (None for a run that produced none: no curves, no restores). With
    ``cleanup``, the run's checkpoint folder ``storage`` is deleted once the run ended ``ok`` or ``diverged``
    (a ``failed`` run keeps its checkpoints, so that a re-run resumes)."""
    record = record or {"curves": [], "restores": []}
    write_outputs(cfg.out_dir, summary, record["curves"], config=config, restores=record["restores"],
                  changes=record.get("changes"))
    if cleanup and storage is not None and summary["status"] in ("ok", "diverged"):
        try:
            delete_dir(storage)
        except OSError as e:
            log.warning("could not delete the checkpoints of %s: %s", storage, e)
    return summary


# ---- the local execution -----------------------------------------------------------------------------


def train_local(cfg: FinetuneConfig, *, checkpoint_dir: str | os.PathLike | None = None,
                resume: bool = False, tensorboard: bool = True, write: bool = True,
                checkpointer: Checkpointer | None = None) -> tuple[dict, Finetuner]:
    """The plain single-process run (no Ray, world size 1): run ``cfg`` and, with ``write``, write its outputs
    into ``cfg.out_dir``.

    With ``checkpoint_dir``, checkpoints are written to ``checkpoint_dir/checkpoint_XXXXXXXX``
    (:class:`~raystudy.core.finetune.checkpoint.DirectoryCheckpointer`, all kept) and ``resume=True``
    continues from the newest complete one (older layouts there upgraded first). Another ``checkpointer`` (its
    ``restore`` called at the start, its ``save`` at the checkpoint events) replaces that folder's. Returns
    ``(summary, finetuner)``.
    """
    given = checkpointer is not None  # its restore always runs: it decides what to restore
    if not given:
        checkpointer = DirectoryCheckpointer(checkpoint_dir) if checkpoint_dir else NoCheckpoints()
    summary, ft = run(cfg, checkpointer=checkpointer, resume=resume or given, tensorboard=tensorboard,
                      write_weights=write)
    if write:
        finish_run(cfg, summary, run_record(summary, ft), config=cfg.to_dict())
    return summary, ft
