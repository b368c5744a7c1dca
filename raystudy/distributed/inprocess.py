"""One finetuning run inside the calling process: a study trial's own, long-lived Tune actor.

A single-worker trial does not need a Ray Train worker group: :func:`run_in_process` runs the same
:class:`~raystudy.core.finetune.Finetuner` in the Tune trial actor itself. Tune reuses that actor for the
next trial with the same resources (``TuneConfig(reuse_actors=True)``), so process start, imports, CUDA
initialisation and compiled kernels are paid once per actor instead of once per trial
(``benchmarks/trial_overhead.py`` measures both ways side by side).

Checkpoints are the run's own, in its storage folder (``<out>/train/<trial_id>/``, local or a URI), in the
layout of :mod:`raystudy.core.finetune.checkpoint`::

    checkpoint_00000050/   state.pt, rng_rank0.pt (Finetuner.save), .complete (written last)

Only folders with ``.complete`` are resumed from; the ``keep`` newest are kept. The run itself is
:func:`raystudy.core.finetune.run` with a :class:`~raystudy.core.finetune.DirectoryCheckpointer` and its
reports forwarded to ``on_report``, its outputs written by :func:`~raystudy.core.finetune.driver.finish_run`.
A trial that fails (its
actor or node lost, an error) is re-run by Tune (``FailureConfig(max_failures=trial_retries)``) and resumes
from the newest checkpoint, as a re-run of the study after a killed driver does; results are exactly those
of an uninterrupted run (``tests/unit/core/test_inprocess.py``). The run's outputs are those of
:func:`raystudy.distributed.train.run_finetune` (``summary.json`` with ``execution: actor``).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

import torch

from raystudy.core.finetune.checkpoint import (
    DirectoryCheckpointer,
)
from raystudy.core.finetune.config import FinetuneConfig
from raystudy.core.finetune.data import epoch_permutation, prepare_caches
from raystudy.core.finetune.driver import ForwardReports, finish_run, finished_summary, run, run_record
from raystudy.data.cache import release_reads
from raystudy.distributed.devices import placement_record, worker_device
from raystudy.distributed.train import TrainResources, run_config_dict

log = logging.getLogger(__name__)

__all__ = ["release_trial_memory", "run_in_process"]


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
    device, warning = worker_device(resources.gpus_per_worker, int(resources.cpus_per_worker))
    if warning:
        log.warning("%s: %s", cfg.out_dir, warning)
    summary, ft = run(cfg, checkpointer=DirectoryCheckpointer(storage, keep=resources.keep_checkpoints),
                      reporter=ForwardReports(on_report), progress=False, device=device)
    summary = finished_summary(summary, wall_seconds=time.perf_counter() - t0, workers=1, execution="actor")
    summary.update(placement_record(device, warning))
    finish_run(cfg, summary, run_record(summary, ft), config=run_config_dict(cfg, resources), storage=storage,
               cleanup=resources.cleanup_checkpoints)
    del ft
    release_trial_memory()
    return summary


def release_trial_memory() -> None:
    """Return what a finished trial holds to its reused actor, so that the next trial (maybe of another
    store, sharing the GPU with others under a fractional ``gpus_per_worker``) starts from the same memory:
    the data caches of the last trial (its store shard's encoded images, its epoch orders) are forgotten,
    reference cycles of its model and optimizer collected, and CUDA's cached blocks returned to the driver
    (``torch.cuda.empty_cache``; Ray Tune users report reused actors that keep them otherwise)."""
    release_reads()
    epoch_permutation.cache_clear()
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
