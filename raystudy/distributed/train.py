"""Finetuning on Ray Train (V2): a thin adapter of the run driver (:mod:`raystudy.core.finetune.driver`): a
worker function with Ray Train's reporter and collective, and the driver process's fit and outputs.

``run_finetune(cfg, resources)`` builds a ``TorchTrainer`` (:func:`make_trainer`) with
``resources.workers`` workers, fits it and writes the run's outputs into ``cfg.out_dir``:

* ``summary.json``: the ``trials.parquet`` columns of the run (the caller adds trial_id, dataset, model)
  plus memory, throughput and restore figures; ``curves.parquet``: step, lr_now, train_loss, grad_norm,
  component_grad_norm, images_per_s, val_loss, val_acc (val columns null between evaluations);
* ``tb/``: TensorBoard events and the run's HParams record (written by worker 0);
  ``best_trainable.safetensors``: the trainable parameters and head of the best-validation step;
  ``config.json`` (the protocol, with the resources under ``"resources"``), ``restores.json``;
* ``ray/train/``: the Ray Train run's folder (unless a ``run_config`` says otherwise, :func:`run_storage`)
  with the run's checkpoints, deleted when the run ends ``ok`` or ``diverged`` (``cleanup_checkpoints``),
  kept when it ``failed``.

Each worker builds the same model (seeded), freezes it by configuration, wraps it in DDP through
``ray.train.torch.prepare_model`` (gloo on CPU, NCCL on GPU) and reads its own contiguous slice of every
global batch from the prepared store (see :mod:`raystudy.core.finetune.data` for why this order is exact).
Metrics are reported with ``ray.train.report`` at every log step and evaluation; every
``checkpoint_period`` steps the workers write a checkpoint in the one layout of
:mod:`raystudy.core.finetune.checkpoint` into the run's folder (worker 0: trainable parameters, optimizer,
schedule, step, data position, best-validation state, curves; every worker: its RNG states; then the
``.complete`` marker), never reported to Ray, so Ray keeps no copies of its own. A restart of the worker
group (``FailureConfig(max_failures)``: Ray Train restarts the workers whether or not a checkpoint was
reported) resumes from that folder exactly, as does a re-run of a run that failed (or whose driver died)
with the same ``out_dir`` (or the same ``RunConfig`` name and storage). Checkpoints of older versions there
(Ray's ``checkpoint_<date>/`` folders) are upgraded into the layout first
(:func:`~raystudy.core.finetune.checkpoint.upgrade_layout`).

A non-finite loss ends the run with status ``diverged`` (recorded, not raised); a run whose workers fail
more often than ``max_failures`` is recorded with status ``failed`` and the error message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ray.train import UserCallback

from raystudy.core.finetune.checkpoint import Collective, DirectoryCheckpointer, upgrade_layout
from raystudy.core.finetune.config import FinetuneConfig
from raystudy.core.finetune.data import prepare_caches
from raystudy.core.finetune.driver import (
    Reporter,
    failed_summary,
    finish_run,
    finished_summary,
    run,
    run_record,
)
from raystudy.distributed.cluster import init_ray
from raystudy.distributed.devices import no_cuda_message, placement_record
from raystudy.settings import ResourceSettings, problems
from raystudy.storage import filesystem, join, read_text, uploaded_folder, write_json_atomic

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# Resources: where and on how many workers a run executes
# --------------------------------------------------------------------------------------------------


@dataclass
class TrainResources(ResourceSettings):
    """The Ray Train settings of a run (the protocol is :class:`~raystudy.core.finetune.FinetuneConfig`);
    each setting is defined once in :class:`raystudy.settings.ResourceSettings`.

    ``workers`` DDP workers with ``cpus_per_worker`` CPUs and ``gpus_per_worker`` GPUs each share the global
    batch evenly. ``max_failures`` worker failures are recovered from the latest checkpoint. Ray Train keeps
    the ``keep_checkpoints`` latest checkpoints while a run lives and, with ``cleanup_checkpoints``, its
    directory is deleted once the run has ended ``ok`` or ``diverged`` (a ViT-B MHA checkpoint is ~340 MB:
    a thousand-run study cannot keep them); ``failed`` runs keep theirs so that a re-run resumes.
    """

    def validate(self, cfg: FinetuneConfig | None = None) -> TrainResources:
        """Raise ``ValueError`` naming the offending field (also when ``cfg``'s global batch does not split
        evenly over the workers); returns ``self``."""
        def bad(name: str, why: str):
            raise ValueError(f"TrainResources.{name}={getattr(self, name)!r}: {why}")

        for name, why in problems(self):
            bad(name, why)
        if not (isinstance(self.max_failures, int) and self.max_failures >= -1):
            bad("max_failures", "must be an integer >= 0 (or -1: retry forever)")
        if cfg is not None and cfg.batch_size % self.workers:
            bad("workers", f"the global batch FinetuneConfig.batch_size={cfg.batch_size} must split evenly "
                           "over the workers")
        return self

    @property
    def use_gpu(self) -> bool:
        return self.gpus_per_worker > 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainResources:
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown TrainResources field(s) {unknown}")
        return cls(**d)


def run_config_dict(cfg: FinetuneConfig, resources: TrainResources) -> dict:
    """A run's ``config.json``: the protocol, with the resources under ``"resources"``."""
    return {**cfg.to_dict(), "resources": resources.to_dict()}


def split_legacy(d: dict) -> tuple[FinetuneConfig, TrainResources]:
    """The protocol and the resources of a run's ``config.json``, today's (:func:`run_config_dict`) or an
    older one (resources as top-level keys, ``component`` for ``configuration``, ``fail_after_step``)."""
    d = dict(d)
    resources = d.pop("resources", None)
    if resources is None:
        resources = {f.name: d[f.name] for f in fields(TrainResources) if f.name in d}
    return FinetuneConfig.from_dict(d), TrainResources.from_dict(resources)


# --------------------------------------------------------------------------------------------------
# The worker
# --------------------------------------------------------------------------------------------------


def _all_reduce_sum(t):
    import torch.distributed as dist

    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


class RayCollective(Collective):
    """The workers of one Ray Train run (:class:`~raystudy.core.finetune.checkpoint.Collective`): Ray Train's
    own barrier and broadcast from worker 0 (``ray.train.collective``), through its controller."""

    def barrier(self) -> None:
        import ray.train.collective

        ray.train.collective.barrier()

    def broadcast(self, value):
        import ray.train.collective

        return ray.train.collective.broadcast_from_rank_zero(value)


class RayTrainReporter(Reporter):
    """``ray.train.report`` of every event's metrics, never with a checkpoint (the run's checkpoints are its
    own, :mod:`raystudy.core.finetune.checkpoint`, complete on every worker before the report); before an
    injected failure a barrier, so that every worker decides to fail before worker 0 marks the failure."""

    def report(self, metrics: dict, checkpoint: str | None) -> None:
        import ray.train

        ray.train.report(metrics)

    def before_failure(self) -> None:
        import ray.train.collective

        ray.train.collective.barrier()


def _worker_placement(resources: TrainResources) -> tuple[dict, str | None]:
    """This worker's :class:`Finetuner` placement: rank, world size, device, the DDP wrapper and all-reduce
    when there are several workers (CPU workers use ``int(cpus_per_worker)`` threads); and why a worker given
    GPUs runs on the CPU (:func:`~raystudy.distributed.devices.no_cuda_message`), or ``None``."""
    import ray.train
    import ray.train.torch
    import torch

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()  # cuda:<i> from the GPU ids Ray assigned, whether CUDA sees it or not
    if device.type == "cuda" and not torch.cuda.is_available():
        device = torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(max(1, int(resources.cpus_per_worker)))
    warning = no_cuda_message(resources.gpus_per_worker, max(1, int(resources.cpus_per_worker))) \
        if resources.use_gpu and device.type == "cpu" else None
    placement = dict(rank=rank, world_size=world, device=device,
                     wrap=lambda m: ray.train.torch.prepare_model(m, move_to_device=device,
                                                                  parallel_strategy="ddp" if world > 1 else None),
                     all_reduce=_all_reduce_sum if world > 1 else None)
    return placement, warning


@contextlib.contextmanager
def _outputs_folder(run_dir: str, upload_to: str | None) -> Iterator[str]:
    """Where worker 0 writes the run's TensorBoard events and weights: the run's folder ``run_dir`` where this
    node sees it (the node of the run's driver, or a shared file system); else, for a run whose folder is the
    local staging of ``upload_to`` (a study on object storage) on another node, a temporary folder of this
    worker's, uploaded to ``upload_to`` when the run ends (also when it fails) and removed."""
    if upload_to is None or os.path.isdir(run_dir):
        yield run_dir
        return
    with uploaded_folder(upload_to, prefix="raystudy-worker-") as local:
        yield local


def train_loop_per_worker(config: dict) -> dict | None:
    """The Ray Train worker function: ``config["run"]`` is a run's :func:`run_config_dict`, ``config["storage"]``
    its checkpoint folder (the Ray Train run's own folder, :func:`run_storage`), ``config["upload_to"]`` the
    URI the run's folder is uploaded to, if any (:func:`_outputs_folder`).

    Every worker runs :func:`raystudy.core.finetune.driver.run` with one
    :class:`~raystudy.core.finetune.checkpoint.DirectoryCheckpointer` over that folder (the workers joined by
    :class:`RayCollective`): a restart after a worker failure (``FailureConfig(max_failures)``) or a re-run
    resumes from its newest complete checkpoint. Returns the run's
    :func:`~raystudy.core.finetune.driver.run_record` on worker 0, ``None`` on the others.
    """
    cfg, resources = split_legacy(config["run"])
    placement, warning = _worker_placement(resources)
    collective = RayCollective() if placement["world_size"] > 1 else None
    checkpointer = DirectoryCheckpointer(config["storage"], keep=resources.keep_checkpoints, collective=collective)
    outputs = _outputs_folder(cfg.out_dir, config.get("upload_to")) if placement["rank"] == 0 \
        else contextlib.nullcontext(cfg.out_dir)
    with outputs as outputs_dir:
        summary, ft = run(cfg, checkpointer=checkpointer, reporter=RayTrainReporter(), progress=False,
                          outputs_dir=outputs_dir, **placement)
    if ft.rank != 0:
        return None
    return run_record({**summary, **placement_record(placement["device"], warning)}, ft)


# --------------------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------------------


def _run_config(cfg: FinetuneConfig, resources: TrainResources, run_config, callbacks: list):
    """``run_config``, or the default one of :func:`make_trainer`, with the resources' failure setting where it
    leaves Ray's default, the default storage folder and name where it has none, and ``callbacks`` appended."""
    from ray.train import FailureConfig, RunConfig

    failure = FailureConfig(max_failures=resources.max_failures)
    storage_path, name = str(Path(cfg.out_dir).absolute() / "ray"), "train"
    if run_config is None:
        return RunConfig(name=name, storage_path=storage_path, failure_config=failure, callbacks=list(callbacks))
    changes = {}
    if run_config.failure_config == FailureConfig():
        changes["failure_config"] = failure
    if not run_config.storage_path:
        changes["storage_path"] = storage_path
    if not run_config.name:
        changes["name"] = name
    if callbacks:
        changes["callbacks"] = list(run_config.callbacks or []) + list(callbacks)
    return dataclasses.replace(run_config, **changes) if changes else run_config


def run_storage(run_config) -> str:
    """The folder of a Ray Train run, ``<storage_path>/<name>``: its checkpoints
    (:mod:`raystudy.core.finetune.checkpoint`) and its failure records (:class:`RecordFailures`)."""
    return join(str(run_config.storage_path), run_config.name)


def make_trainer(cfg: FinetuneConfig, resources: TrainResources | None = None, *, run_config=None,
                 callbacks: list | None = None, upload_to: str | None = None):
    """The ``TorchTrainer`` of one run.

    Without ``run_config``: ``RunConfig(name="train", storage_path=<out_dir>/ray,
    failure_config=FailureConfig(max_failures=resources.max_failures), callbacks=callbacks)``. A given
    ``run_config`` (e.g. ``RunConfig(callbacks=[TuneReportCallback()], storage_path=..., name=...)`` inside a
    Tune trial) is used as is, except that a failure config left at Ray's default, a missing storage path or
    name take the values above and ``callbacks`` are appended to its own. The run's checkpoints are the
    project's, ``resources.keep_checkpoints`` newest kept in :func:`run_storage` (Ray's ``CheckpointConfig``
    is not used: no checkpoint is reported to Ray). ``upload_to``: the URI that ``cfg.out_dir``, a local
    staging folder, is uploaded to (worker 0 uploads its own outputs there when it runs on another node).
    """
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    resources = (resources or TrainResources()).validate(cfg.validate())
    per_worker = {"CPU": resources.cpus_per_worker}
    if resources.use_gpu:
        per_worker["GPU"] = resources.gpus_per_worker
    run_config = _run_config(cfg, resources, run_config, list(callbacks or []))
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"run": run_config_dict(cfg, resources), "storage": run_storage(run_config),
                           "upload_to": upload_to},
        scaling_config=ScalingConfig(num_workers=resources.workers, use_gpu=resources.use_gpu,
                                     resources_per_worker=per_worker),
        run_config=run_config,
        torch_config=_torch_config() if resources.use_gpu else TorchConfig(backend="gloo"),
    )


def _cuda_seen() -> bool:
    import torch

    return torch.cuda.is_available()


def _torch_config():
    """A ``TorchConfig`` whose backend the workers decide as they start: NCCL where every worker's CUDA sees a
    device, else gloo (GPUs Ray declared but CUDA does not see: the run goes on on the CPU and its summary's
    ``device_warning`` says so, :mod:`raystudy.distributed.devices`). Ray's own choice is NCCL whenever GPUs
    were asked for, and NCCL refuses to start without one."""
    from ray.train.torch.config import TorchConfig, _TorchBackend  # Ray's backend; only its choice differs

    class CudaWhereSeenBackend(_TorchBackend):
        def on_start(self, worker_group, backend_config):
            backend = "nccl" if all(worker_group.execute(_cuda_seen)) else "gloo"
            super().on_start(worker_group, dataclasses.replace(backend_config, backend=backend))

    class CudaWhereSeenConfig(TorchConfig):
        @property
        def backend_cls(self):
            return CudaWhereSeenBackend

    return CudaWhereSeenConfig()


# --- worker-group failures: a trace in the summary also when no checkpoint was restored (issue 15) ---

#: the folder of a Ray Train run's storage where :class:`RecordFailures` writes one file per failure
FAILURES_DIR = "failures"


def _last_line(error: BaseException) -> str:
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"[:300]


class RecordFailures(UserCallback):
    """One JSON file per worker-group failure (each failed rank's error, last line) in the run's storage,
    ``<storage_path>/<name>/failures/``; runs in Ray Train's controller. A restart before the first
    checkpoint restores nothing (``num_restores`` stays 0) but is counted by :func:`worker_failures`."""

    def after_exception(self, run_context, worker_exceptions) -> None:
        rc = run_context.run_config
        if not rc.storage_path:
            return
        errors = {str(rank): _last_line(e) for rank, e in worker_exceptions.items()}
        try:
            write_json_atomic(join(rc.storage_path, rc.name, FAILURES_DIR, f"{time.time_ns()}.json"),
                              {"time": time.time(), "errors": errors})
        except OSError as e:  # a full disk must not take the controller down
            log.warning("could not record a worker failure of %s: %s", rc.name, e)


def worker_failures(run_config) -> dict:
    """``{"worker_failures": n, "worker_failure_errors": [first error of each failure]}`` of the run whose
    ``RunConfig`` is ``run_config`` (what :class:`RecordFailures` wrote, oldest first)."""
    import json

    import pyarrow.fs as pafs

    errors = []
    if run_config.storage_path:
        fs, folder = filesystem(join(run_config.storage_path, run_config.name, FAILURES_DIR))
        if fs.get_file_info(folder).type == pafs.FileType.Directory:
            for info in sorted(fs.get_file_info(pafs.FileSelector(folder)), key=lambda i: i.base_name):
                try:
                    record = json.loads(read_text(f"{folder}/{info.base_name}") or "{}")
                    errors.append(next(iter(record["errors"].values()), ""))
                except (ValueError, KeyError, TypeError, AttributeError):
                    errors.append("unreadable failure record")
    return {"worker_failures": len(errors), "worker_failure_errors": errors}


# --- end of worker-group failures ---


class _QueueReports(UserCallback):
    """Puts worker 0's reports into a Ray queue (this callback runs in Ray Train's controller process, whose
    output does not reach the terminal)."""

    def __init__(self, queue):
        self.queue = queue

    def after_report(self, run_context, metrics, checkpoint) -> None:
        if metrics:
            self.queue.put_nowait(metrics[0])  # returns once the item is in the queue


@contextlib.contextmanager
def forwarded_reports(on_report: Callable[[dict], None] | None) -> Iterator[list]:
    """Ray Train callbacks that hand worker 0's reports to ``on_report`` on the driver (in a thread, while
    the block runs; the remaining ones when it ends). Empty without ``on_report``."""
    if on_report is None:
        yield []
        return
    from ray.util.queue import Empty, Queue

    queue, done = Queue(actor_options={"num_cpus": 0}), threading.Event()

    def drain() -> None:
        while True:
            try:
                on_report(queue.get(timeout=0.5))
            except Empty:
                if done.is_set():
                    return

    thread = threading.Thread(target=drain, name="raystudy-reports", daemon=True)
    thread.start()
    try:
        yield [_QueueReports(queue)]
    finally:
        done.set()
        thread.join()
        queue.shutdown()


def run_finetune(cfg: FinetuneConfig, resources: TrainResources | None = None, *, run_config=None,
                 callbacks: list | None = None, on_report: Callable[[dict], None] | None = None,
                 upload_to: str | None = None) -> dict:
    """Run one finetuning run on Ray Train and return its summary (also written to ``cfg.out_dir``).

    Starts a quiet local Ray (:func:`~raystudy.distributed.cluster.init_ray`) when none runs.

    Never raises for a run that diverges (status ``diverged``) or whose workers fail beyond
    ``resources.max_failures`` (status ``failed``, with ``error``); invalid settings raise ``ValueError``.
    ``wall_seconds`` is the driver's wall time of ``fit()``, Ray Train start-up included. ``on_report``
    receives worker 0's metrics of every report while the run lives (``raystudy finetune`` prints them).
    ``upload_to``: the URI ``cfg.out_dir`` (a local staging folder) is uploaded to by the caller, where worker
    0 uploads its TensorBoard events and weights itself when it does not see that folder (another node).
    """
    resources = (resources or TrainResources()).validate(cfg.validate())
    init_ray()  # from Python: a quiet local Ray of its own (Ray Train's own ray.init logs, and joins any instance)
    t0 = time.perf_counter()
    record, error = None, None
    try:
        prepare_caches(cfg)  # verifies (or builds, outside a study) the uint8 caches; a study builds them first
    except Exception as e:  # a missing or unreadable store: recorded as the run's failure, as a worker's is
        error = e
        log.error("finetune run %s failed preparing its data: %s", cfg.out_dir, e)
    resolved = _run_config(cfg, resources, run_config, [])
    if error is None:
        upgrade_layout(run_storage(resolved))  # before Ray reads its snapshot of an older version's checkpoints
        record, error = _fit(cfg, resources, run_config, [*(callbacks or []), RecordFailures()], on_report,
                             upload_to)
    summary = dict(record["summary"]) if record is not None else failed_summary(cfg, error)
    summary = finished_summary(summary, wall_seconds=time.perf_counter() - t0, workers=resources.workers,
                               execution="train", failures=worker_failures(resolved))
    return finish_run(cfg, summary, record, config=run_config_dict(cfg, resources), storage=run_storage(resolved),
                      cleanup=resources.cleanup_checkpoints)


def _fit(cfg: FinetuneConfig, resources: TrainResources, run_config, callbacks, on_report, upload_to):
    """Fit the run's trainer: ``(worker 0's run record or None, error or None)``."""
    from ray.train import TrainingFailedError

    record, error = None, None
    try:
        with forwarded_reports(on_report) as forward:
            trainer = make_trainer(cfg, resources, run_config=run_config, callbacks=[*(callbacks or []), *forward],
                                   upload_to=upload_to)
            record = trainer.fit().return_value
        if record is None:
            error = RuntimeError("Ray Train returned no result from worker 0")
    except TrainingFailedError as e:
        error = e
        log.error("finetune run %s failed: %s", cfg.out_dir, e)
    return record, error


# --------------------------------------------------------------------------------------------------
# Terminal output
# --------------------------------------------------------------------------------------------------


def _fmt(v) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.6g}"
    return "-" if v is None else str(v)


def format_report(metrics: dict, steps: int) -> str:
    """One progress line of a report: step, train loss, the step's lr (``lr_now``), images/s, and the val
    metrics at evaluations."""
    line = (f"step {metrics.get('step', '?')}/{steps}  loss {_fmt(metrics.get('train_loss'))}  "
            f"lr {_fmt(metrics.get('lr_now'))}  {_fmt(metrics.get('images_per_s'))} img/s")
    if "val_acc" in metrics:
        line += f"  val_loss {_fmt(metrics.get('val_loss'))}  val_acc {_fmt(metrics['val_acc'])}"
    return line


def format_summary(summary: dict) -> str:
    """A short human-readable block of a run summary (used by ``raystudy finetune``)."""
    keys = ["configuration", "optimizer", "lr", "seed", "steps", "batch_size", "workers", "trainable_params",
            "status", "best_val_acc", "best_val_step", "test_acc", "final_val_loss", "images_per_s",
            "grad_memory_bytes", "optimizer_memory_bytes", "num_restores", "wall_seconds", "error"]
    width = max(len(k) for k in keys)
    return "\n".join(f"{k:<{width}}  {_fmt(summary[k])}" for k in keys if k in summary)
