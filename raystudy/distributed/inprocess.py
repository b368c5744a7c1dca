"""One finetuning run inside the calling process: a study trial's own, long-lived Tune actor.

A single-worker trial does not need a Ray Train worker group: :func:`run_in_process` runs the same
:class:`~raystudy.core.finetune.Finetuner` in the Tune trial actor itself. Tune reuses that actor for the
next trial with the same resources (``TuneConfig(reuse_actors=True)``), so process start, imports, CUDA
initialisation and compiled kernels are paid once per actor instead of once per trial
(``benchmarks/trial_overhead.py`` measures both ways side by side).

Checkpoints are the run's own, in its storage folder (``<out>/train/<trial_id>/``, local or a URI)::

    checkpoint_00000050/   state.pt, rng_rank0.pt (Finetuner.save), .complete (written last)

Only folders with ``.complete`` are resumed from; the ``keep`` newest are kept. A trial that fails (its
actor or node lost, an error) is re-run by Tune (``FailureConfig(max_failures=trial_retries)``) and resumes
from the newest checkpoint, as a re-run of the study after a killed driver does; results are exactly those
of an uninterrupted run (``tests/test_inprocess.py``). The run's outputs are those of
:func:`raystudy.distributed.train.run_finetune` (``summary.json`` with ``execution: actor``).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from raystudy.core.finetune import (
    Event,
    FinetuneConfig,
    Finetuner,
    TensorBoardLogger,
    prepare_caches,
    save_weights,
    write_outputs,
)
from raystudy.core.finetune.state import checkpoint_problem
from raystudy.distributed.train import (
    TrainResources,
    event_metrics,
    failure_due,
    inject_failure,
    run_config_dict,
)
from raystudy.faults import injected
from raystudy.storage import (
    delete_dir,
    download_dir,
    exists,
    is_uri,
    join,
    publish,
    staged,
    subdirs,
    write_text_atomic,
)

log = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint_"
#: written into a checkpoint folder after everything else: a folder without it is never resumed from
COMPLETE_MARKER = ".complete"


def checkpoint_steps(storage: str) -> list[int]:
    """The steps of the complete checkpoints under ``storage``, oldest first."""
    steps = []
    for name in subdirs(storage):
        if name.startswith(CHECKPOINT_PREFIX) and name[len(CHECKPOINT_PREFIX):].isdigit() \
                and exists(join(storage, name, COMPLETE_MARKER)):
            steps.append(int(name[len(CHECKPOINT_PREFIX):]))
    return sorted(steps)


def checkpoint_path(storage: str, step: int) -> str:
    return join(storage, f"{CHECKPOINT_PREFIX}{step:08d}")


def save_checkpoint(ft: Finetuner, storage: str, keep: int) -> None:
    """Write ``ft``'s checkpoint at its step into ``storage``, then delete all but the ``keep`` newest
    complete ones and any incomplete folder (left by a full disk or a killed actor)."""
    target = checkpoint_path(storage, ft.step)
    delete_dir(target)  # an older attempt's checkpoint of this step: never complete while being rewritten
    local, uri = staged(target)
    try:
        ft.save(local)
        publish(local, uri)
    finally:
        if uri is not None:
            shutil.rmtree(local, ignore_errors=True)
    write_text_atomic(join(target, COMPLETE_MARKER), f"{ft.step}\n")
    complete = checkpoint_steps(storage)
    stale = {checkpoint_path(storage, s) for s in complete[:-keep]}
    stale |= {join(storage, n) for n in subdirs(storage) if n.startswith(CHECKPOINT_PREFIX)} \
        - {checkpoint_path(storage, s) for s in complete}
    for folder in sorted(stale):
        delete_dir(folder)


def resume_latest(ft: Finetuner, storage: str) -> dict | None:
    """Load the newest complete checkpoint under ``storage`` into ``ft``; its restore record, or None.

    A checkpoint whose files do not verify (:func:`~raystudy.core.finetune.state.checkpoint_problem`) is
    skipped with a warning for the one before it."""
    for step in reversed(checkpoint_steps(storage)):
        folder = checkpoint_path(storage, step)
        with tempfile.TemporaryDirectory(prefix="raystudy-resume-") as tmp:
            local = folder
            if is_uri(folder):
                download_dir(folder, tmp)
                local = tmp
            problem = checkpoint_problem(local)
            if problem is None:
                return ft.load(local)
        log.warning("skipping checkpoint %s: %s", folder, problem)
    return None


def _device(resources: TrainResources) -> torch.device:
    if resources.use_gpu and torch.cuda.is_available():
        return torch.device("cuda")
    torch.set_num_threads(max(1, int(resources.cpus_per_worker)))
    return torch.device("cpu")


def run_in_process(cfg: FinetuneConfig, resources: TrainResources, *, storage: str,
                   on_report: Callable[[dict], None] | None = None) -> dict:
    """Run ``cfg`` in this process with its checkpoints under ``storage``; return its summary (also written
    to ``cfg.out_dir``, with ``best_trainable.safetensors`` and TensorBoard events).

    Resumes from the newest complete checkpoint under ``storage``. ``on_report`` receives the metrics of every
    logged, evaluated or checkpointed step (a study forwards them to Tune). A diverged run returns status
    ``diverged``; any failure raises (the caller's retry resumes from the checkpoints). With
    ``resources.cleanup_checkpoints`` the checkpoints are deleted once the run has ended.
    """
    resources = resources.validate(cfg.validate())
    if resources.workers != 1:
        raise ValueError(f"run_in_process runs one worker, not TrainResources.workers={resources.workers}")
    t0 = time.perf_counter()
    prepare_caches(cfg)
    ft = Finetuner(cfg, device=_device(resources))
    resume_latest(ft, storage)
    fail_after = injected("fail_after_step", Path(cfg.out_dir).name)
    tb = TensorBoardLogger(cfg.out_dir, purge_step=ft.step + 1 if ft.step else None)

    def callback(ev: Event) -> None:
        tb(ev)
        if ev.checkpoint and not ev.final:
            save_checkpoint(ft, storage, resources.keep_checkpoints)
        if on_report is not None:
            on_report(event_metrics(ev))
        if failure_due(ft, ev, fail_after):
            inject_failure(ft, ev)

    try:
        summary = ft.run(callback, progress=False)
    finally:
        tb.close()
    save_weights(ft)
    summary.update(wall_seconds=time.perf_counter() - t0, workers=1, execution="actor",
                   worker_failures=0, worker_failure_errors=[])
    write_outputs(cfg.out_dir, summary, ft.curves, config=run_config_dict(cfg, resources), restores=ft.restores)
    if resources.cleanup_checkpoints:
        delete_dir(storage)
    return summary
